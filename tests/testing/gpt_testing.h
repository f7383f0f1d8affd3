// Test support for the GPT example (examples/gpt): the engine's one-rank
// layout of a config's units (tensors back to back, padded to
// kAlignElements) and the GPT-2 initial weights in that layout. Pure
// functions; no failure modes beyond the config's own validation.
#ifndef ZTIER_TESTS_TESTING_GPT_TESTING_H_
#define ZTIER_TESTS_TESTING_GPT_TESTING_H_

#include <cstdint>
#include <utility>
#include <vector>

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

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_GPT_TESTING_H_
