// ztier-bench: same-pattern memory kernels, the "limit" each benchmark is
// measured against in the same run.
//
// The AdamW limit kernel touches memory exactly like cpu_adam::Step():
// reads grads (bf16 or fp32), params, exp_avg, exp_avg_sq; writes params,
// exp_avg, exp_avg_sq in place; writes a bf16 copy of params (regular or
// streaming stores) — with trivial arithmetic (v gains g*g, so it stays a
// valid second moment for the AdamW runs that share the buffers), so its
// time is the machine's memory time for that pattern. Highway dynamic dispatch, so it runs at the
// same SIMD width as the kernel it bounds.
//
// Thread safety: pure function of its arguments over [begin, end).
#ifndef ZTIER_BENCHMARKS_MEMORY_PATTERN_H_
#define ZTIER_BENCHMARKS_MEMORY_PATTERN_H_

#include <cstddef>
#include <cstdint>

namespace ztier::bench {

struct AdamPatternArgs {
  const void* grads;
  bool grads_bf16;
  float* params;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* out;  // bf16 bits or null
  bool stream_out;
};

void AdamPatternRange(const AdamPatternArgs& args, size_t begin, size_t end);

// The 8-bit states' pattern (cpu_adam::StepInt8): grads read, params read
// and written, m and v codes read and written, each 256-element block's two
// absmax read and written, the bf16 copy written (regular stores). `begin`
// is a multiple of cpu_adam::kQuantBlock.
struct Int8PatternArgs {
  const void* grads;
  bool grads_bf16;
  float* params;
  uint8_t* m;
  uint8_t* v;
  float* m_absmax;
  float* v_absmax;
  uint16_t* out;  // bf16 bits or null
};

void Int8PatternRange(const Int8PatternArgs& args, size_t begin, size_t end);

}  // namespace ztier::bench

#endif  // ZTIER_BENCHMARKS_MEMORY_PATTERN_H_
