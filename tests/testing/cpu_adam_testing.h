// Test support for the optimizer kernels: a shared Executor per thread
// count, a fresh random seed, and the 8-bit moments of a reference shard
// (the buffers StepInt8 updates, next to the fp32 buffers of a Shard).
//
// Thread safety: SharedExecutor is for a test's main thread. Failure:
// aborts if an Executor cannot be made.
#ifndef ZTIER_TESTS_TESTING_CPU_ADAM_TESTING_H_
#define ZTIER_TESTS_TESTING_CPU_ADAM_TESTING_H_

#include <cstdint>
#include <cstdlib>
#include <random>
#include <span>
#include <vector>

#include "cpu_adam/adamw.h"

namespace ztier::adam_testing {

// One Executor per thread count (1..8), made on first use and kept.
inline cpu_adam::Executor& SharedExecutor(int threads = 2) {
  static cpu_adam::Executor* executors[9] = {};
  if (executors[threads] == nullptr) {
    Result<cpu_adam::Executor> e = cpu_adam::Executor::Create({.threads = threads});
    ZT_CHECK_MSG(e.ok(), e.status().ToString());
    executors[threads] = new cpu_adam::Executor(std::move(e).value());
  }
  return *executors[threads];
}

// A new seed per run (the tests print it), or ZTIER_TEST_SEED's to replay one.
inline uint64_t FreshSeed() {
  if (const char* fixed = std::getenv("ZTIER_TEST_SEED"); fixed != nullptr && *fixed != '\0') {
    return std::strtoull(fixed, nullptr, 10);
  }
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// The 8-bit m and v of `n` elements, all zero (as a new job's), their
// groups cut where the tensors at `starts` begin (cpu_adam::QuantCuts).
struct Int8Moments {
  std::vector<uint8_t> m, v;
  std::vector<size_t> cuts;
  std::vector<float> m_absmax, v_absmax;

  explicit Int8Moments(size_t n = 0, std::span<const size_t> starts = {})
      : m(n, 0),
        v(n, 0),
        cuts(cpu_adam::QuantCuts(starts, n)),
        m_absmax(cpu_adam::QuantGroups(n, cuts), 0.0f),
        v_absmax(cpu_adam::QuantGroups(n, cuts), 0.0f) {}

  // `fp32`'s grads, params and bf16 output with these moments.
  cpu_adam::Int8Shard ShardOf(const cpu_adam::Shard& fp32) {
    return {.count = fp32.count,
            .grads = fp32.grads,
            .grad_type = fp32.grad_type,
            .params = fp32.params,
            .moments = {.m = m.data(),
                        .v = v.data(),
                        .m_absmax = m_absmax.data(),
                        .v_absmax = v_absmax.data(),
                        .cuts = cuts},
            .params_out = fp32.params_out};
  }
  // The fp32 values of the moments.
  void Dequantize(float* m_out, float* v_out) const {
    cpu_adam::Dequantize(cpu_adam::QuantMap::kSigned, m.data(), m_absmax.data(), m.size(), m_out,
                         cuts);
    cpu_adam::Dequantize(cpu_adam::QuantMap::kUnsigned, v.data(), v_absmax.data(), v.size(), v_out,
                         cuts);
  }
};

}  // namespace ztier::adam_testing

#endif  // ZTIER_TESTS_TESTING_CPU_ADAM_TESTING_H_
