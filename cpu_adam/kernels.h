// ztier cpu_adam internal: per-tile SIMD kernels behind Highway dynamic
// dispatch. Only cpu_adam/*.cc include this; the public API is adamw.h.
//
// The functions here work on one element range of one shard, run on the
// calling thread, allocate nothing and cannot fail; validation happens in
// adamw.cc. They are pure functions of their arguments: safe to call
// concurrently on disjoint ranges.
#ifndef ZTIER_CPU_ADAM_KERNELS_H_
#define ZTIER_CPU_ADAM_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "cpu_adam/adamw.h"

namespace ztier::cpu_adam::internal {

// Per-step scalars, precomputed once (in double, then rounded to fp32).
struct KernelConsts {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;     // lr / bc1
  float inv_sqrt_bc2;  // 1 / sqrt(bc2)
  float eps;
  float decay;  // 1 - lr * wd (kAdamW), unused in kAdam
  float l2;     // wd (kAdam), unused in kAdamW
};

enum class OutKind : uint8_t { kNone, kRegular, kStreaming };

struct UpdateArgs {
  KernelConsts c;
  Mode mode;
  const void* grads;
  GradType grad_type;
  float* params;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* out;  // bf16 bits, or null
  OutKind out_kind;
  bool sum_sq;
};

struct RangeResult {
  double sq_sum;    // sum of squares of raw grads (only when args.sum_sq)
  bool non_finite;  // some raw grad in the range was inf/NaN
};

// A quantization map's lookup tables (quant_maps.cc), built once:
//   value[code]   the code's value (256; for the signed map, codes >= 128
//                 are the negated magnitudes);
//   upper[k]      the midpoint between magnitude k and k + 1 (2 for the
//                 last), so magnitude k is the answer for a in
//                 (upper[k - 1], upper[k]];
//   bucket[i]     for bucket i = (bits(a) >> kShift) - base of a
//                 normalized magnitude a in [0, 1] (clamped to [0, buckets -
//                 1]): the magnitude c nearest to the bucket's low end in
//                 bits 0-7, and above them the low kShift bits of the one
//                 midpoint the bucket may hold (all ones: none), so the
//                 magnitude of a is c + (low bits of a > those bits): one
//                 lookup per value.
//   decade_base, decade_step  16 floats each (8 used): magnitude c >= 1
//                 with top set bit at pos is fma(decade_step[pos], c - 2^pos
//                 + 1, decade_base[pos]) (== value[c]).
struct QuantTables {
  bool is_signed;
  int32_t base;
  int32_t buckets;
  const float* value;
  const float* upper;
  const int32_t* bucket;
  const float* decade_base;
  const float* decade_step;
};
// Bucket widths: 2^-kSignedBucketBits (m) and 2^-kUnsignedBucketBits (v)
// of a binade; the tables check at build time that they are fine enough.
inline constexpr int kSignedBucketBits = 6;
inline constexpr int kUnsignedBucketBits = 7;
const QuantTables& Tables(QuantMap map);

// A segment of an 8-bit step with its constants.
struct SegmentConsts {
  size_t begin, end;
  KernelConsts c;
  bool frozen;
};

struct Int8Args {
  Mode mode;
  const void* grads;
  GradType grad_type;
  float* params;
  Int8Moments moments;
  uint16_t* out;  // bf16 bits, or null
  const SegmentConsts* segments;
  size_t segment_count;
};

// Updates the blocks of [begin, end) (begin a multiple of kQuantBlock, end
// one or the shard's end). Never reports a sum of squares.
RangeResult UpdateInt8Range(const Int8Args& args, size_t begin, size_t end);
// Block-wise quantization of [begin, end) (same bounds as above).
void QuantizeRange(QuantMap map, const float* x, size_t begin, size_t end, uint8_t* codes,
                   float* absmax);
void DequantizeRange(QuantMap map, const uint8_t* codes, const float* absmax, size_t begin,
                     size_t end, float* x);

// Updates elements [begin, end). Writes even when grads are non-finite: the
// caller decides whether that is allowed (it is not, unless prechecked).
RangeResult UpdateRange(const UpdateArgs& args, size_t begin, size_t end);

// fp64 sum of squares of raw grads [begin, end); inf/NaN propagate.
double SquareSumRange(const void* grads, GradType type, size_t begin, size_t end);

}  // namespace ztier::cpu_adam::internal

#endif  // ZTIER_CPU_ADAM_KERNELS_H_
