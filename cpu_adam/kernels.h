// ztier cpu_adam internal: per-tile SIMD kernels behind Highway dynamic
// dispatch. Only cpu_adam/*.cc include this; the public API is adamw.h.
//
// The functions here work on one element range of one shard, run on the
// calling thread, allocate nothing and cannot fail; validation happens in
// adamw.cc. They are pure functions of their arguments: safe to call
// concurrently on disjoint ranges.
#ifndef ZTIER_CPU_ADAM_KERNELS_H_
#define ZTIER_CPU_ADAM_KERNELS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

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

// A quantization map's tables (quant_maps.cc), built once. The map's
// magnitudes 1 .. k - 1 come in decades: magnitude c with its top set bit at
// pos (c in [2^pos, 2^(pos+1))) is fma(step[pos], c - 2^pos + 1, base[pos])
// in fp32 (== value[c]); the decade's top, its last code's value, is
// top[pos]. Per-decade arrays hold 16 floats (`decades` used, the rest
// copies of the last), so one in-register table lookup reads them.
//   value[code]   the code's value (256; for the signed map, codes >= 128
//                 are the negated magnitudes);
//   upper[c]      the midpoint between magnitude c and c + 1 (2 for the
//                 last): magnitude c is the nearest for a in
//                 (upper[c - 1], upper[c]].
// Quantizing a normalized magnitude a in [0, 1] (DecadeLanes, CodeLanes):
//  1. the decade pos is the number of tops below a: an estimate of
//     log10(a), ceil(fma(bits(a) as a float, log_scale, log_offset)), or on
//     16-lane targets the decade of a's binary octave's lowest value
//     (octave_decade[max(exponent, kOctaveFloor) - kOctaveFloor]: an octave
//     spans less than a decade), is pos or pos - 1, and one comparison with
//     a top settles it;
//  2. place = fma(a, inv_step[pos], place_offset[pos]) puts the codes
//     below_code[pos] + j (j = 0 .. 2^pos; below_code = 2^pos - 1, the code
//     just under the decade, held as 2^23 + 2^pos - 1 so that the sum's low
//     mantissa bits are the code) at place j and the midpoints between them
//     within kMidpointSlack / 4 of j + 1/2 (checked for every midpoint when
//     the tables are built; the lowest decade measures from 0, the value of
//     code 0), so rounding place gives the nearest code, except
//  3. where place is within kMidpointSlack of a midpoint: there the
//     comparison a > upper[c] with c = below_code + trunc(place) decides.
struct QuantTables {
  bool is_signed;
  int32_t decades;
  const float* value;
  const float* upper;
  const float* base;  // dequantization: base and step per decade
  const float* step;
  const float* top;
  const float* inv_step;
  const float* place_offset;
  const float* below_code;
  float log_scale;
  float log_offset;
  const int32_t* octave_decade;  // kOctaves entries
};
// The octaves of octave_decade: biased exponents kOctaveFloor (values below
// 2^-31, far under every map's smallest code, fall in its lowest octave)
// to 127 (1.0).
inline constexpr int32_t kOctaveFloor = 96;
inline constexpr int32_t kOctaves = 128 - kOctaveFloor;
// How near (in steps) to a midpoint the rounded place is not trusted; far
// above the rounding error of place (< 3e-5 steps).
inline constexpr float kMidpointSlack = 1.0f / 4096;
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

// Walks the quantization groups (adamw.h) of [begin, end), begin a
// multiple of kQuantBlock: the group at hand is [begin(), end()), its
// absmax at index().
class GroupCursor {
 public:
  GroupCursor(std::span<const size_t> cuts, size_t begin, size_t end)
      : cuts_(cuts),
        limit_(end),
        next_(
            static_cast<size_t>(std::lower_bound(cuts.begin(), cuts.end(), begin) - cuts.begin())),
        index_(begin / kQuantBlock + next_),
        begin_(begin),
        end_(GroupEnd()) {}
  bool done() const { return begin_ >= limit_; }
  size_t begin() const { return begin_; }
  size_t end() const { return end_; }
  size_t index() const { return index_; }
  void Next() {
    if (next_ < cuts_.size() && cuts_[next_] == end_) ++next_;
    ++index_;
    begin_ = end_;
    end_ = GroupEnd();
  }

 private:
  // The next cut or block bound after begin_, at most limit_.
  size_t GroupEnd() const {
    const size_t block_end = std::min(limit_, (begin_ / kQuantBlock + 1) * kQuantBlock);
    return next_ < cuts_.size() && cuts_[next_] < block_end ? cuts_[next_] : block_end;
  }

  std::span<const size_t> cuts_;
  size_t limit_;
  size_t next_;  // the first cut not passed
  size_t index_;
  size_t begin_, end_;
};

// Updates the groups of [begin, end) (begin a multiple of kQuantBlock, end
// one or the shard's end). Never reports a sum of squares.
RangeResult UpdateInt8Range(const Int8Args& args, size_t begin, size_t end);
// Group-wise quantization of [begin, end) (same bounds as above).
void QuantizeRange(QuantMap map, const float* x, size_t begin, size_t end, uint8_t* codes,
                   float* absmax, std::span<const size_t> cuts);
void DequantizeRange(QuantMap map, const uint8_t* codes, const float* absmax, size_t begin,
                     size_t end, float* x, std::span<const size_t> cuts);

// Updates elements [begin, end). Writes even when grads are non-finite: the
// caller decides whether that is allowed (it is not, unless prechecked).
RangeResult UpdateRange(const UpdateArgs& args, size_t begin, size_t end);

// fp64 sum of squares of raw grads [begin, end); inf/NaN propagate.
double SquareSumRange(const void* grads, GradType type, size_t begin, size_t end);

}  // namespace ztier::cpu_adam::internal

#endif  // ZTIER_CPU_ADAM_KERNELS_H_
