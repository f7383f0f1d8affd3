// Test support for the GPT example (examples/gpt): the engine's one-rank
// layout of a config's units (tensors back to back, padded to
// kAlignElements), the GPT-2 initial weights in that layout, and a
// WeightSource over bf16 weights in a device's memory (GptMemorySource, one
// thread; it aborts if the device cannot hold them). The functions are
// pure.
#ifndef ZTIER_TESTS_TESTING_GPT_TESTING_H_
#define ZTIER_TESTS_TESTING_GPT_TESTING_H_

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "client/ztier.h"
#include "common/bf16.h"
#include "common/status.h"
#include "engine/engine.h"
#include "examples/gpt/gpt.h"

namespace ztier::testing {

inline std::vector<engine::UnitLayout> GptLayouts(const gpt::Config& config) {
  std::vector<engine::UnitLayout> layouts;
  for (const engine::UnitSpec& unit : gpt::UnitSpecs(config)) {
    engine::UnitLayout layout;
    for (const engine::TensorSpec& tensor : unit.tensors) {
      layout.offsets.push_back(layout.numel);
      uint64_t n = 1;
      for (int64_t d : tensor.shape) n *= static_cast<uint64_t>(d);
      layout.numel += n;
    }
    layout.padded = (layout.numel + engine::kAlignElements - 1) / engine::kAlignElements *
                    engine::kAlignElements;
    layout.shard = layout.padded;
    layouts.push_back(std::move(layout));
  }
  return layouts;
}

inline std::vector<std::vector<float>> GptInitWeights(const gpt::Config& config,
                                                      const std::vector<engine::UnitLayout>& layouts,
                                                      uint64_t seed) {
  std::vector<std::vector<float>> weights(layouts.size());
  for (size_t u = 0; u < layouts.size(); ++u) {
    weights[u].resize(layouts[u].numel);
    gpt::InitUnit(config, static_cast<int>(u), seed, layouts[u], weights[u]);
  }
  return weights;
}

// A WeightSource over bf16 copies of fp32 weights in a device's memory. It
// records the protocol (acquire order, holds, pushes), captures the pushed
// grads and can fail the n-th Acquire or PushGrads.
class GptMemorySource final : public gpt::WeightSource {
 public:
  GptMemorySource(client::Device& device, const std::vector<engine::UnitLayout>& layouts,
                  const std::vector<std::vector<float>>& weights)
      : device_(device), layouts_(layouts) {
    const size_t units = layouts.size();
    held_.assign(units, 0);
    pushed_.assign(units, 0);
    grads_.assign(units, {});
    for (size_t u = 0; u < units; ++u) {
      std::vector<bf16> host(layouts[u].padded, bf16{0});
      for (uint64_t i = 0; i < layouts[u].numel; ++i) host[i] = FloatToBf16(weights[u][i]);
      params_.push_back(Alloc(host.size(), client::MemoryPurpose::kParams));
      grad_buffers_.push_back(Alloc(host.size(), client::MemoryPurpose::kGrads));
      ZT_CHECK(device_
                   .CopyToDevice(params_.back(), host.data(), host.size() * sizeof(bf16),
                                 client::Stream::kCompute)
                   .ok());
    }
  }
  ~GptMemorySource() override {
    for (bf16* p : params_) device_.Free(p);
    for (bf16* p : grad_buffers_) device_.Free(p);
  }

  Result<const bf16*> Acquire(int unit) override {
    if (acquires_++ == fail_acquire_at_) return Status::Unavailable("injected acquire failure");
    ++held_[unit];
    order_.push_back(unit);
    return static_cast<const bf16*>(params_[unit]);
  }
  Status Release(int unit) override {
    if (held_[unit] == 0) return Status::FailedPrecondition(StrCat("unit ", unit, " not held"));
    --held_[unit];
    return Status::Ok();
  }
  Result<bf16*> GradBuffer(int unit) override {
    if (held_[unit] == 0) {
      return Status::FailedPrecondition(StrCat("grad buffer of unit ", unit, " not held"));
    }
    if (pushed_[unit] != 0) return Status::FailedPrecondition(StrCat("unit ", unit, " pushed"));
    ZT_RETURN_IF_ERROR(device_.Memset(grad_buffers_[unit], 0, layouts_[unit].padded * sizeof(bf16),
                                      client::Stream::kCompute));
    return grad_buffers_[unit];
  }
  Status PushGrads(int unit) override {
    if (pushes_++ == fail_push_at_) return Status::IoError("injected push failure");
    if (held_[unit] == 0) return Status::FailedPrecondition(StrCat("push of unit ", unit));
    ++pushed_[unit];
    grads_[unit].resize(layouts_[unit].padded);
    ZT_RETURN_IF_ERROR(device_.CopyToHost(grads_[unit].data(), grad_buffers_[unit],
                                          grads_[unit].size() * sizeof(bf16), client::Stream::kCompute));
    return device_.Synchronize(client::Stream::kCompute);
  }

  void FailAcquireAt(int n) { fail_acquire_at_ = n; }
  void FailPushAt(int n) { fail_push_at_ = n; }
  int acquires() const { return acquires_; }
  const std::vector<int>& order() const { return order_; }
  const std::vector<int>& pushed() const { return pushed_; }
  bool AllReleased() const {
    return std::all_of(held_.begin(), held_.end(), [](int h) { return h == 0; });
  }
  // The unit's pushed bf16 grads (padded).
  const std::vector<bf16>& grads(int unit) const { return grads_[unit]; }

 private:
  bf16* Alloc(size_t elems, client::MemoryPurpose purpose) {
    Result<void*> p = device_.Allocate(elems * sizeof(bf16), purpose);
    ZT_CHECK_MSG(p.ok(), p.status().ToString());
    return static_cast<bf16*>(*p);
  }

  client::Device& device_;
  const std::vector<engine::UnitLayout>& layouts_;
  std::vector<bf16*> params_;
  std::vector<bf16*> grad_buffers_;
  std::vector<int> held_;
  std::vector<int> pushed_;
  std::vector<std::vector<bf16>> grads_;
  std::vector<int> order_;
  int acquires_ = 0;
  int pushes_ = 0;
  int fail_acquire_at_ = -1;
  int fail_push_at_ = -1;
};

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_GPT_TESTING_H_
