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

// Updates elements [begin, end). Writes even when grads are non-finite: the
// caller decides whether that is allowed (it is not, unless prechecked).
RangeResult UpdateRange(const UpdateArgs& args, size_t begin, size_t end);

// fp64 sum of squares of raw grads [begin, end); inf/NaN propagate.
double SquareSumRange(const void* grads, GradType type, size_t begin, size_t end);

}  // namespace ztier::cpu_adam::internal

#endif  // ZTIER_CPU_ADAM_KERNELS_H_
