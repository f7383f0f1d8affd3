// cpu_adam::Step against golden vectors recorded from PyTorch's own
// torch.optim.AdamW / Adam (tests/cpu_adam/testdata/torch_golden.bin, see
// make_torch_golden.py): an oracle independent of this code base that needs
// no Python at test time. Every case without clipping is run from the same
// inputs, step after step without resetting, and compared after each step
// (tolerances in tests/testing/torch_golden.h). The engine's own step,
// clipping included, is checked against the same file in
// tests/engine/torch_golden_engine_test.cc.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/bf16.h"
#include "cpu_adam/adamw.h"
#include "tests/testing/torch_golden.h"

namespace ztier::cpu_adam {
namespace {

using ztier::testing::CompareWithTorch;
using ztier::testing::GoldenCase;
using ztier::testing::LoadTorchGolden;

const std::vector<GoldenCase>& Cases() {
  static const std::vector<GoldenCase> cases = [] {
    Result<std::vector<GoldenCase>> r = LoadTorchGolden(
        std::string(ZTIER_SOURCE_DIR) + "/tests/cpu_adam/testdata/torch_golden.bin");
    ZT_CHECK_MSG(r.ok(), r.status().ToString());
    return std::move(r).value();
  }();
  return cases;
}

TEST(TorchGoldenTest, TheFileHasEveryKindOfCase) {
  int adam = 0, adamw = 0, bf16 = 0, fp32 = 0, clipped = 0;
  for (const GoldenCase& c : Cases()) {
    (c.adamw ? adamw : adam)++;
    (c.bf16_grads ? bf16 : fp32)++;
    clipped += c.clip_norm > 0;
    EXPECT_GE(c.steps.size(), 4u) << c.name;
  }
  EXPECT_GT(adam, 0);
  EXPECT_GT(adamw, 0);
  EXPECT_GT(bf16, 0);
  EXPECT_GT(fp32, 0);
  EXPECT_GT(clipped, 0);
}

class TorchGoldenStepTest : public ::testing::TestWithParam<int> {};

TEST_P(TorchGoldenStepTest, EveryUnclippedCaseMatchesTorch) {
  Result<Executor> exec = Executor::Create({.threads = GetParam()});
  ASSERT_TRUE(exec.ok()) << exec.status();
  int checked = 0;
  for (const GoldenCase& c : Cases()) {
    if (c.clip_norm > 0) continue;  // clipping is the engine's: see the engine test
    SCOPED_TRACE(c.name);
    const size_t n = c.total();
    const std::vector<float> p0 = c.InitialParams();
    std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f);
    const Hyper h{.lr = static_cast<float>(c.lr),
                  .beta1 = static_cast<float>(c.beta1),
                  .beta2 = static_cast<float>(c.beta2),
                  .eps = static_cast<float>(c.eps),
                  .weight_decay = static_cast<float>(c.weight_decay),
                  .mode = c.adamw ? Mode::kAdamW : Mode::kAdam};
    for (int s = 0; s < static_cast<int>(c.steps.size()); ++s) {
      const std::vector<float> g32 = c.Grads(s);
      std::vector<bf16> g16(n);
      for (size_t i = 0; i < n; ++i) g16[i] = FloatToBf16(g32[i]);  // exact: already rounded
      Result<StepResult> r =
          Step(h, {.step = s + 1},
               Shard{.count = n,
                     .grads = c.bf16_grads ? static_cast<const void*>(g16.data()) : g32.data(),
                     .grad_type = c.bf16_grads ? GradType::kBFloat16 : GradType::kFloat32,
                     .params = p.data(),
                     .exp_avg = m.data(),
                     .exp_avg_sq = v.data()},
               *exec);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_FALSE(r->skipped);
      ASSERT_EQ(CompareWithTorch(c, s, p0, p.data(), m.data(), v.data()), "");
    }
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

INSTANTIATE_TEST_SUITE_P(Threads, TorchGoldenStepTest, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return std::to_string(param_info.param) + "_threads";
                         });

}  // namespace
}  // namespace ztier::cpu_adam
