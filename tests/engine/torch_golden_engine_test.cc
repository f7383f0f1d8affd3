// The engine's whole step (global-norm clipping over every unit and rank,
// the bf16 grad inbox, the sharded update, the NVMe tier) against golden
// vectors recorded from PyTorch: torch.nn.utils.clip_grad_norm_ followed by
// torch.optim.AdamW / Adam (tests/cpu_adam/testdata/torch_golden.bin). The
// engine's other tests compare it with cpu_adam::Step, which it calls; this
// one does not trust cpu_adam or the engine's clipping formula. Each case
// with bf16 grads runs with one and two ranks, states in DRAM and on NVMe;
// the states are read back and compared after every step.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "engine/engine.h"
#include "tests/engine/engine_testing.h"
#include "tests/testing/torch_golden.h"

namespace ztier::engine {
namespace {

using testing::MakeEngine;
using ztier::testing::CompareWithTorch;
using ztier::testing::GoldenCase;
using ztier::testing::LoadTorchGolden;
using ztier::testing::ScratchDir;

class TorchGoldenEngineTest : public ::testing::TestWithParam<std::tuple<int, Tier>> {};

TEST_P(TorchGoldenEngineTest, EveryBf16CaseMatchesTorchStepByStep) {
  const auto [ranks, tier] = GetParam();
  Result<std::vector<GoldenCase>> cases =
      LoadTorchGolden(std::string(ZTIER_SOURCE_DIR) + "/tests/cpu_adam/testdata/torch_golden.bin");
  ASSERT_TRUE(cases.ok()) << cases.status();
  int checked = 0, clipped = 0;
  for (const GoldenCase& c : *cases) {
    if (!c.bf16_grads) continue;  // the engine's grads are bf16
    SCOPED_TRACE(c.name);
    ScratchDir swap("golden");
    auto engine = MakeEngine(uint64_t{1} << 30, tier == Tier::kNvme ? &swap : nullptr);
    JobSpec spec;
    spec.name = c.name;
    spec.ranks = ranks;
    spec.optimizer_tier = tier;
    spec.optimizer.hyper = {.lr = static_cast<float>(c.lr),
                            .beta1 = static_cast<float>(c.beta1),
                            .beta2 = static_cast<float>(c.beta2),
                            .eps = static_cast<float>(c.eps),
                            .weight_decay = static_cast<float>(c.weight_decay),
                            .mode = c.adamw ? cpu_adam::Mode::kAdamW : cpu_adam::Mode::kAdam};
    spec.optimizer.clip_norm = static_cast<float>(c.clip_norm);
    for (size_t t = 0; t < c.sizes.size(); ++t) {  // one unit per tensor
      spec.units.push_back(
          {"unit" + std::to_string(t), {{"w", {static_cast<int64_t>(c.sizes[t])}}}});
    }
    Result<int> job = engine->RegisterJob(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    const int nunits = static_cast<int>(spec.units.size());
    std::vector<UnitLayout> layouts;
    const std::vector<float> p0 = c.InitialParams();
    for (int k = 0, at = 0; k < nunits; at += static_cast<int>(c.sizes[k]), ++k) {
      layouts.push_back(*engine->Layout(*job, k));
      ASSERT_TRUE(engine->WriteWeights(*job, k, p0.data() + at, c.sizes[k]).ok());
    }
    for (int s = 0; s < static_cast<int>(c.steps.size()); ++s) {
      const std::vector<float> g = c.Grads(s);
      for (int k = nunits - 1, end = static_cast<int>(c.total()); k >= 0; --k) {
        const int at = end - static_cast<int>(c.sizes[k]);
        std::vector<bf16> padded(layouts[k].padded, bf16{0});
        for (uint64_t i = 0; i < c.sizes[k]; ++i) padded[i] = FloatToBf16(g[at + i]);
        for (int r = 0; r < ranks; ++r) {
          Result<bf16*> inbox = engine->GradInbox(*job, k, r);
          ASSERT_TRUE(inbox.ok()) << inbox.status();
          std::memcpy(*inbox, padded.data() + r * layouts[k].shard,
                      layouts[k].shard * sizeof(bf16));
          ASSERT_TRUE(engine->GradsReady(*job, k, r).ok());
        }
        end = at;
      }
      std::vector<float> p, m, v;
      for (int k = 0; k < nunits; ++k) {
        ASSERT_TRUE(engine->WaitPublished(*job, k, s + 1, std::chrono::seconds(30)).ok());
        const uint64_t n = layouts[k].padded;
        std::vector<float> up(n), um(n), uv(n);
        ASSERT_TRUE(engine->ReadState(*job, k, up.data(), um.data(), uv.data()).ok());
        p.insert(p.end(), up.begin(), up.begin() + c.sizes[k]);
        m.insert(m.end(), um.begin(), um.begin() + c.sizes[k]);
        v.insert(v.end(), uv.begin(), uv.begin() + c.sizes[k]);
      }
      ASSERT_EQ(CompareWithTorch(c, s, p0, p.data(), m.data(), v.data()), "");
    }
    ++checked;
    clipped += c.clip_norm > 0;
  }
  EXPECT_GE(checked, 3);
  EXPECT_GE(clipped, 2);
}

INSTANTIATE_TEST_SUITE_P(RanksAndTiers, TorchGoldenEngineTest,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values(Tier::kDram, Tier::kNvme)),
                         [](const ::testing::TestParamInfo<std::tuple<int, Tier>>& param_info) {
                           return std::to_string(std::get<0>(param_info.param)) + "_ranks_" +
                                  (std::get<1>(param_info.param) == Tier::kDram ? "dram" : "nvme");
                         });

}  // namespace
}  // namespace ztier::engine
