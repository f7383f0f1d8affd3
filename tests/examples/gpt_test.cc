// Tests of the GPT example model (examples/gpt) on the host device: its
// grads against finite differences, the training path (bf16 units through a
// WeightSource) against the fp32 check path, bf16 matmuls against fp32 ones
// of rounded operands, activation checkpointing,
// determinism across runs and thread counts, the acquire/release/push
// protocol (also under injected failures), a short training run, and the
// errors of bad configs and inputs.
#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "client/ztier.h"
#include "common/bf16.h"
#include "engine/engine.h"
#include "examples/gpt/gpt.h"
#include "examples/gpt/kernels.h"
#include "tests/testing/gpt_testing.h"

namespace ztier::gpt {
namespace {

using client::Device;
using client::DeviceKind;
using client::MemoryPurpose;
using client::Stream;

using testing::GptInitWeights;
using testing::GptLayouts;

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1), from a counter.
float Uniform(uint64_t seed, uint64_t i) {
  return static_cast<float>(
      static_cast<double>(Mix(seed * 0x100000001b3ull + i) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// Weights far from the GPT-2 init (which keeps the model nearly linear), so
// the finite-difference check exercises every nonlinearity: matrices
// U(-0.5, 0.5), biases U(-0.1, 0.1), layernorm weights 1 + U(-0.2, 0.2).
std::vector<std::vector<float>> RandomWeights(const Config& config,
                                              const std::vector<engine::UnitLayout>& layouts,
                                              uint64_t seed) {
  const std::vector<engine::UnitSpec> specs = UnitSpecs(config);
  std::vector<std::vector<float>> weights(specs.size());
  for (size_t u = 0; u < specs.size(); ++u) {
    weights[u].resize(layouts[u].numel);
    for (size_t k = 0; k < specs[u].tensors.size(); ++k) {
      const engine::TensorSpec& tensor = specs[u].tensors[k];
      const uint64_t begin = layouts[u].offsets[k];
      const uint64_t end =
          k + 1 < specs[u].tensors.size() ? layouts[u].offsets[k + 1] : layouts[u].numel;
      const bool is_bias = tensor.name.ends_with(".bias");
      const bool is_ln = tensor.shape.size() == 1 && !is_bias;
      for (uint64_t i = begin; i < end; ++i) {
        const float r = Uniform(seed + u, i);
        weights[u][i] = is_ln ? 1.0f + 0.2f * r : (is_bias ? 0.1f * r : 0.5f * r);
      }
    }
  }
  return weights;
}

std::vector<std::vector<float>> RoundedThroughBf16(std::vector<std::vector<float>> weights) {
  for (auto& unit : weights) {
    for (float& w : unit) w = Bf16ToFloat(FloatToBf16(w));
  }
  return weights;
}

// batch rows of context + 1 tokens.
std::vector<int32_t> RandomTokens(const Config& config, int batch, uint64_t seed) {
  std::vector<int32_t> tokens(static_cast<size_t>(batch) * (config.context + 1));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(Mix(seed * 7919 + i) % static_cast<uint64_t>(config.vocab));
  }
  return tokens;
}

std::unique_ptr<Device> HostDevice() {
  Result<std::unique_ptr<Device>> device = client::MakeHostDevice();
  ZT_CHECK_MSG(device.ok(), device.status().ToString());
  return std::move(device).value();
}

std::unique_ptr<Gpt> MakeGpt(const Config& config, int batch, Device& device) {
  Result<std::unique_ptr<Gpt>> gpt = Gpt::Create(config, batch, device, GptLayouts(config));
  ZT_CHECK_MSG(gpt.ok(), gpt.status().ToString());
  return std::move(gpt).value();
}

using testing::GptMemorySource;

// Expected acquire order of a training micro-step.
std::vector<int> TrainOrder(const Config& config) {
  const int head = config.layers + 1;
  std::vector<int> order;
  for (int u = 0; u <= head; ++u) order.push_back(u);
  if (config.tied_head) order.push_back(0);
  for (int u = head - 1; u >= 0; --u) order.push_back(u);
  return order;
}

Config TinyConfig(bool tied) {
  return {.vocab = 16, .context = 6, .channels = 8, .layers = 2, .heads = 2, .tied_head = tied};
}

// Over the weights [begin, end) of unit u, with fd the central difference of
// the fp32 loss: the sums of (grad_scale x analytic grad - fd)^2 and of fd^2.
struct FdSums {
  double diff2 = 0;
  double fd2 = 0;
};

FdSums CentralDifferences(Gpt& gpt, std::vector<std::vector<float>>& weights,
                          const std::vector<int32_t>& tokens,
                          const std::vector<std::vector<float>>& grads, size_t u, uint64_t begin,
                          uint64_t end, float eps, double grad_scale = 1.0) {
  FdSums sums;
  std::vector<std::vector<float>> scratch;
  for (uint64_t i = begin; i < end; ++i) {
    const float saved = weights[u][i];
    weights[u][i] = saved + eps;
    const float plus = *gpt.LossAndGrads(weights, tokens.data(), &scratch);
    weights[u][i] = saved - eps;
    const float minus = *gpt.LossAndGrads(weights, tokens.data(), &scratch);
    weights[u][i] = saved;
    const double fd = (static_cast<double>(plus) - minus) / (2.0 * eps);
    const double d = grad_scale * grads[u][i] - fd;
    sums.diff2 += d * d;
    sums.fd2 += fd * fd;
  }
  return sums;
}

// Per tensor, ||analytic - fd|| / ||fd|| over every coordinate, with central
// differences of the fp32 loss.
struct FdResult {
  std::string tensor;
  double rel_error = 0;
  double fd_norm = 0;
};

std::vector<FdResult> FiniteDifferenceErrors(const Config& config, float eps) {
  constexpr int kBatch = 2;
  std::unique_ptr<Device> device = HostDevice();
  std::unique_ptr<Gpt> gpt = MakeGpt(config, kBatch, *device);
  const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
  const std::vector<engine::UnitSpec> specs = UnitSpecs(config);
  std::vector<std::vector<float>> weights = RandomWeights(config, layouts, 11);
  const std::vector<int32_t> tokens = RandomTokens(config, kBatch, 5);
  std::vector<std::vector<float>> grads;
  Result<float> loss = gpt->LossAndGrads(weights, tokens.data(), &grads);
  ZT_CHECK_MSG(loss.ok(), loss.status().ToString());

  std::vector<FdResult> results;
  for (size_t u = 0; u < specs.size(); ++u) {
    for (size_t k = 0; k < specs[u].tensors.size(); ++k) {
      const uint64_t begin = layouts[u].offsets[k];
      const uint64_t end =
          k + 1 < specs[u].tensors.size() ? layouts[u].offsets[k + 1] : layouts[u].numel;
      const FdSums sums = CentralDifferences(*gpt, weights, tokens, grads, u, begin, end, eps);
      FdResult r;
      r.tensor = specs[u].tensors[k].name;
      r.fd_norm = std::sqrt(sums.fd2);
      r.rel_error = sums.fd2 > 0 ? std::sqrt(sums.diff2 / sums.fd2) : std::sqrt(sums.diff2);
      results.push_back(r);
    }
  }
  return results;
}

// Central differences of an fp32 loss have two error terms: truncation,
// eps^2 / 6 x the third derivative, and rounding, about ulp(loss) / eps, on
// top of the fp32 rounding of the analytic grads themselves. Measured worst
// per-tensor errors with eps = 1e-2: 1.3e-3 (tied head), 2.4e-3 (untied);
// with eps = 1e-3 about the same, so what is left is rounding, not
// truncation. A wrong grad shows up far above that: a 5% error in the
// attention's score grads gives up to 5e-2, the GELU derivative's cubic term
// at 2/3 of its value 1.4e-2, a missing term or a transposed matmul O(1). A
// tolerance of 1e-2 keeps 4x margin over the noise.
constexpr float kFdEps = 1e-2f;
constexpr double kFdTolerance = 1e-2;

void CheckFiniteDifferences(bool tied) {
  const std::vector<FdResult> results = FiniteDifferenceErrors(TinyConfig(tied), kFdEps);
  double worst = 0;
  for (const FdResult& r : results) {
    EXPECT_LT(r.rel_error, kFdTolerance) << r.tensor << " (||fd|| " << r.fd_norm << ")";
    // Every tensor has a grad worth checking (all embedding rows are used,
    // by the inputs or by the tied head).
    if (tied) {
      EXPECT_GT(r.fd_norm, 1e-4) << r.tensor;
    }
    worst = std::max(worst, r.rel_error);
  }
  std::printf("finite differences (%s head): worst per-tensor relative error %.3g\n",
              tied ? "tied" : "untied", worst);
}

TEST(GptTest, GradsMatchFiniteDifferencesTiedHead) { CheckFiniteDifferences(true); }
TEST(GptTest, GradsMatchFiniteDifferencesUntiedHead) { CheckFiniteDifferences(false); }

// The check itself detects a wrong grad: a grad scaled by 1.1 fails it.
TEST(GptTest, FiniteDifferenceCheckDetectsAWrongGrad) {
  const Config config = TinyConfig(true);
  std::unique_ptr<Device> device = HostDevice();
  std::unique_ptr<Gpt> gpt = MakeGpt(config, 2, *device);
  const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
  std::vector<std::vector<float>> weights = RandomWeights(config, layouts, 11);
  const std::vector<int32_t> tokens = RandomTokens(config, 2, 5);
  std::vector<std::vector<float>> grads;
  ASSERT_TRUE(gpt->LossAndGrads(weights, tokens.data(), &grads).ok());
  // The last block's mlp.proj.weight.
  const size_t u = config.layers;
  const FdSums sums = CentralDifferences(*gpt, weights, tokens, grads, u, layouts[u].offsets[10],
                                         layouts[u].offsets[11], kFdEps, 1.1);
  EXPECT_GT(std::sqrt(sums.diff2 / sums.fd2), kFdTolerance);
}

struct StepResult {
  float loss = 0;
  std::vector<std::vector<bf16>> grads;  // per unit, padded
};

StepResult TrainStep(Gpt& gpt, Device& device, const std::vector<engine::UnitLayout>& layouts,
                     const std::vector<std::vector<float>>& weights,
                     const std::vector<int32_t>& tokens, float grad_scale = 1.0f) {
  GptMemorySource source(device, layouts, weights);
  Result<float> loss = gpt.TrainMicroStep(source, tokens.data(), grad_scale);
  ZT_CHECK_MSG(loss.ok(), loss.status().ToString());
  ZT_CHECK(source.AllReleased());
  StepResult r;
  r.loss = *loss;
  for (size_t u = 0; u < layouts.size(); ++u) {
    ZT_CHECK_MSG(source.pushed()[u] == 1, "unit ", u, " pushed ", source.pushed()[u], " times");
    r.grads.push_back(source.grads(static_cast<int>(u)));
  }
  return r;
}

void ExpectSameBits(const StepResult& a, const StepResult& b) {
  EXPECT_EQ(std::bit_cast<uint32_t>(a.loss), std::bit_cast<uint32_t>(b.loss));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t u = 0; u < a.grads.size(); ++u) {
    ASSERT_EQ(a.grads[u].size(), b.grads[u].size());
    EXPECT_EQ(0, std::memcmp(a.grads[u].data(), b.grads[u].data(), a.grads[u].size() * 2))
        << "unit " << u;
  }
}

void ExpectSameBits(const std::vector<std::vector<float>>& a,
                    const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t u = 0; u < a.size(); ++u) {
    ASSERT_EQ(a[u].size(), b[u].size());
    EXPECT_EQ(0, std::memcmp(a[u].data(), b[u].data(), a[u].size() * sizeof(float)))
        << "unit " << u;
  }
}

// A config big enough that every kernel splits its work into many tasks,
// with row and channel counts that are not multiples of the kernels' tiles.
Config MediumConfig(bool tied) {
  return {.vocab = 96, .context = 33, .channels = 72, .layers = 2, .heads = 4, .tied_head = tied};
}

TEST(GptTest, ProtocolOrderAndSinglePushPerUnit) {
  for (bool tied : {true, false}) {
    const Config config = TinyConfig(tied);
    std::unique_ptr<Device> device = HostDevice();
    std::unique_ptr<Gpt> gpt = MakeGpt(config, 2, *device);
    const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
    const auto weights = GptInitWeights(config, layouts, 1);
    const std::vector<int32_t> tokens = RandomTokens(config, 2, 3);

    GptMemorySource train(*device, layouts, weights);
    Result<float> loss = gpt->TrainMicroStep(train, tokens.data(), 1.0f);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_EQ(train.order(), TrainOrder(config)) << "tied " << tied;
    EXPECT_TRUE(train.AllReleased());
    EXPECT_EQ(train.pushed(), std::vector<int>(layouts.size(), 1));
    // The padding of every grad buffer stays zero.
    for (size_t u = 0; u < layouts.size(); ++u) {
      for (uint64_t i = layouts[u].numel; i < layouts[u].padded; ++i) {
        ASSERT_EQ(train.grads(static_cast<int>(u))[i].bits, 0) << "unit " << u << " elem " << i;
      }
    }

    // Forward only: every unit once (the embedding again beside a tied
    // head), nothing pushed, the same loss.
    GptMemorySource eval(*device, layouts, weights);
    Result<float> eval_loss = gpt->Loss(eval, tokens.data());
    ASSERT_TRUE(eval_loss.ok()) << eval_loss.status();
    EXPECT_EQ(*eval_loss, *loss);
    std::vector<int> forward;
    for (int u = 0; u <= config.layers + 1; ++u) forward.push_back(u);
    if (tied) forward.push_back(0);
    EXPECT_EQ(eval.order(), forward);
    EXPECT_TRUE(eval.AllReleased());
    EXPECT_EQ(eval.pushed(), std::vector<int>(layouts.size(), 0));
  }
}

TEST(GptTest, CheckpointingGivesTheSameBits) {
  for (bool tied : {true, false}) {
    Config plain = MediumConfig(tied);
    Config checkpointed = plain;
    checkpointed.checkpoint_activations = true;
    constexpr int kBatch = 3;
    std::unique_ptr<Device> device = HostDevice();
    std::unique_ptr<Gpt> a = MakeGpt(plain, kBatch, *device);
    std::unique_ptr<Gpt> b = MakeGpt(checkpointed, kBatch, *device);
    const std::vector<engine::UnitLayout> layouts = GptLayouts(plain);
    const auto weights = RandomWeights(plain, layouts, 21);
    const std::vector<int32_t> tokens = RandomTokens(plain, kBatch, 8);

    SCOPED_TRACE(tied ? "tied head" : "untied head");
    ExpectSameBits(TrainStep(*a, *device, layouts, weights, tokens),
                   TrainStep(*b, *device, layouts, weights, tokens));
    std::vector<std::vector<float>> ga, gb;
    const float la = *a->LossAndGrads(weights, tokens.data(), &ga);
    const float lb = *b->LossAndGrads(weights, tokens.data(), &gb);
    EXPECT_EQ(std::bit_cast<uint32_t>(la), std::bit_cast<uint32_t>(lb));
    ExpectSameBits(ga, gb);
  }
}

TEST(GptTest, DeterministicAcrossRunsAndThreadCounts) {
  const Config config = MediumConfig(true);
  constexpr int kBatch = 4;
  std::unique_ptr<Device> device = HostDevice();
  std::unique_ptr<Gpt> gpt = MakeGpt(config, kBatch, *device);
  const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
  const auto weights = RandomWeights(config, layouts, 31);
  const std::vector<int32_t> tokens = RandomTokens(config, kBatch, 9);

  const StepResult first = TrainStep(*gpt, *device, layouts, weights, tokens);
  const StepResult second = TrainStep(*gpt, *device, layouts, weights, tokens);
  ExpectSameBits(first, second);
  std::vector<std::vector<float>> g_default, g_one, g_many;
  const float l_default = *gpt->LossAndGrads(weights, tokens.data(), &g_default);
  StepResult one_thread;
  float l_one = 0;
  {
    tbb::global_control one(tbb::global_control::max_allowed_parallelism, 1);
    one_thread = TrainStep(*gpt, *device, layouts, weights, tokens);
    l_one = *gpt->LossAndGrads(weights, tokens.data(), &g_one);
  }
  ExpectSameBits(first, one_thread);
  EXPECT_EQ(std::bit_cast<uint32_t>(l_default), std::bit_cast<uint32_t>(l_one));
  ExpectSameBits(g_default, g_one);
  {
    // More workers than cores: other splits of the same ranges.
    tbb::global_control many(tbb::global_control::max_allowed_parallelism, 7);
    const float l_many = *gpt->LossAndGrads(weights, tokens.data(), &g_many);
    EXPECT_EQ(std::bit_cast<uint32_t>(l_default), std::bit_cast<uint32_t>(l_many));
  }
  ExpectSameBits(g_default, g_many);
}

// The training path converts the bf16 units to fp32 and rounds the fp32
// grads once: with weights already on the bf16 grid its grads are exactly
// the check path's fp32 grads rounded to bf16, and grad_scale (a power of
// two here, so exact) scales them.
TEST(GptTest, TrainMicroStepMatchesFp32GradsRoundedToBf16) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied head" : "untied head");
    const Config config = MediumConfig(tied);
    constexpr int kBatch = 2;
    std::unique_ptr<Device> device = HostDevice();
    std::unique_ptr<Gpt> gpt = MakeGpt(config, kBatch, *device);
    const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
    const auto weights = RoundedThroughBf16(RandomWeights(config, layouts, 41));
    const std::vector<int32_t> tokens = RandomTokens(config, kBatch, 10);
    std::vector<std::vector<float>> fp32;
    const float fp32_loss = *gpt->LossAndGrads(weights, tokens.data(), &fp32);

    for (float scale : {1.0f, 0.25f}) {
      const StepResult step = TrainStep(*gpt, *device, layouts, weights, tokens, scale);
      EXPECT_EQ(step.loss, fp32_loss);
      for (size_t u = 0; u < layouts.size(); ++u) {
        int mismatches = 0;
        double diff2 = 0, ref2 = 0;
        for (uint64_t i = 0; i < layouts[u].numel; ++i) {
          const float ref = fp32[u][i] * scale;
          const float got = Bf16ToFloat(step.grads[u][i]);
          mismatches += FloatToBf16(ref).bits != step.grads[u][i].bits;
          diff2 += (got - ref) * static_cast<double>(got - ref);
          ref2 += static_cast<double>(ref) * ref;
        }
        EXPECT_EQ(mismatches, 0) << "unit " << u << " scale " << scale;
        // bf16 keeps 8 significant bits: relative rounding error <= 2^-9.
        EXPECT_LE(std::sqrt(diff2 / ref2), 1.0 / 512) << "unit " << u;
      }
    }
  }
}

// bf16 matmuls on the CPU backend are its fp32 matmuls on operands rounded
// to bf16, bit for bit, with the bias grads summed from dout as it is.
TEST(GptTest, Bf16MatmulsAreFp32MatmulsOfRoundedOperands) {
  constexpr int N = 37, C = 24, OC = 40;
  const auto random = [](size_t n, uint64_t seed) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = Uniform(seed, i);
    return v;
  };
  const auto rounded = [](std::vector<float> v) {
    for (float& x : v) x = Bf16ToFloat(FloatToBf16(x));
    return v;
  };
  const std::vector<float> inp = random(N * C, 1), w = random(OC * C, 2), bias = random(OC, 3);
  const std::vector<float> dout = random(N * OC, 4);
  std::unique_ptr<Kernels> bf16 = MakeCpuKernels();
  std::unique_ptr<Kernels> fp32 = MakeCpuKernels();
  ASSERT_TRUE(bf16->SetMatmul(MatmulMath::kBf16, N * OC).ok());

  std::vector<float> out(N * OC), want(N * OC);
  bf16->Matmul(out.data(), inp.data(), w.data(), bias.data(), N, C, OC);
  fp32->Matmul(want.data(), rounded(inp).data(), rounded(w).data(), bias.data(), N, C, OC);
  EXPECT_EQ(std::memcmp(out.data(), want.data(), out.size() * sizeof(float)), 0);
  std::vector<float> exact(N * OC);
  fp32->Matmul(exact.data(), inp.data(), w.data(), bias.data(), N, C, OC);
  EXPECT_NE(std::memcmp(out.data(), exact.data(), out.size() * sizeof(float)), 0)
      << "the bf16 matmul gave fp32's bits: nothing was rounded";

  std::vector<float> dinp = random(N * C, 5), dw = random(OC * C, 6), db = random(OC, 7);
  std::vector<float> want_dinp = dinp, want_dw = dw, want_db = db;
  bf16->MatmulBackward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, C,
                       OC);
  fp32->MatmulBackward(want_dinp.data(), want_dw.data(), nullptr, rounded(dout).data(),
                       rounded(inp).data(), rounded(w).data(), N, C, OC);
  for (int o = 0; o < OC; ++o) {
    for (int n = 0; n < N; ++n) want_db[o] += dout[static_cast<size_t>(n) * OC + o];
  }
  EXPECT_EQ(std::memcmp(dinp.data(), want_dinp.data(), dinp.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(dw.data(), want_dw.data(), dw.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(db.data(), want_db.data(), db.size() * sizeof(float)), 0);
}

// A GPT with bf16 matmuls: every operand fits what Create reserved (shapes
// where the largest is the head's weight, the logits, or the MLP's
// activations), the loss and grads stay near fp32's (bf16 keeps 8
// significant bits; through the model that stays within a few percent) and
// the runs are deterministic.
TEST(GptTest, Bf16MatmulsTrackFp32) {
  for (const auto& [config, batch] : {std::pair{Config{.vocab = 256,
                                     .context = 8,
                                     .channels = 16,
                                     .layers = 1,
                                     .heads = 2,
                                     .tied_head = false},
                                                1},
                                      std::pair{MediumConfig(true), 3}}) {
    SCOPED_TRACE(::testing::Message() << "vocab " << config.vocab << " channels " << config.channels
                                      << " batch " << batch);
    Config with_bf16 = config;
    with_bf16.matmul = MatmulMath::kBf16;
    EXPECT_GT(ActivationBytes(with_bf16, batch), ActivationBytes(config, batch));
    std::unique_ptr<Device> device = HostDevice();
    std::unique_ptr<Gpt> exact = MakeGpt(config, batch, *device);
    std::unique_ptr<Gpt> rounded = MakeGpt(with_bf16, batch, *device);
    const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
    const auto weights = RandomWeights(config, layouts, 51);
    const std::vector<int32_t> tokens = RandomTokens(config, batch, 12);
    std::vector<std::vector<float>> g_exact, g_rounded, g_again;
    const float l_exact = *exact->LossAndGrads(weights, tokens.data(), &g_exact);
    const float l_rounded = *rounded->LossAndGrads(weights, tokens.data(), &g_rounded);
    const float l_again = *rounded->LossAndGrads(weights, tokens.data(), &g_again);
    EXPECT_EQ(std::bit_cast<uint32_t>(l_rounded), std::bit_cast<uint32_t>(l_again));
    ExpectSameBits(g_rounded, g_again);
    EXPECT_NE(l_rounded, l_exact);
    EXPECT_NEAR(l_rounded, l_exact, 2e-2 * std::fabs(l_exact));
    for (size_t u = 0; u < layouts.size(); ++u) {
      double diff2 = 0, ref2 = 0;
      for (size_t i = 0; i < g_exact[u].size(); ++i) {
        const double d = static_cast<double>(g_rounded[u][i]) - g_exact[u][i];
        diff2 += d * d;
        ref2 += static_cast<double>(g_exact[u][i]) * g_exact[u][i];
      }
      EXPECT_LE(std::sqrt(diff2), 5e-2 * std::sqrt(ref2) + 1e-7) << "unit " << u;
    }
  }
}

// A failing Acquire or PushGrads anywhere in the micro-step is returned with
// the unit named, and every unit acquired before it is released.
TEST(GptTest, FailuresReleaseEveryHeldUnit) {
  const Config config = TinyConfig(true);
  std::unique_ptr<Device> device = HostDevice();
  std::unique_ptr<Gpt> gpt = MakeGpt(config, 2, *device);
  const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
  const auto weights = GptInitWeights(config, layouts, 1);
  const std::vector<int32_t> tokens = RandomTokens(config, 2, 3);
  const int acquires = static_cast<int>(TrainOrder(config).size());
  for (int n = 0; n < acquires; ++n) {
    GptMemorySource source(*device, layouts, weights);
    source.FailAcquireAt(n);
    Result<float> loss = gpt->TrainMicroStep(source, tokens.data(), 1.0f);
    ASSERT_FALSE(loss.ok()) << "acquire " << n;
    EXPECT_EQ(loss.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(loss.status().message().find("acquiring unit"), std::string::npos) << loss.status();
    EXPECT_TRUE(source.AllReleased()) << "acquire " << n;
  }
  for (int n = 0; n < static_cast<int>(layouts.size()); ++n) {
    GptMemorySource source(*device, layouts, weights);
    source.FailPushAt(n);
    Result<float> loss = gpt->TrainMicroStep(source, tokens.data(), 1.0f);
    ASSERT_FALSE(loss.ok()) << "push " << n;
    EXPECT_EQ(loss.status().code(), StatusCode::kIoError);
    EXPECT_NE(loss.status().message().find("pushing grads of unit"), std::string::npos)
        << loss.status();
    EXPECT_TRUE(source.AllReleased()) << "push " << n;
  }
  // After all that the model still trains.
  GptMemorySource source(*device, layouts, weights);
  EXPECT_TRUE(gpt->TrainMicroStep(source, tokens.data(), 1.0f).ok());
  EXPECT_TRUE(source.AllReleased());
}

// AdamW (bias-corrected, decoupled weight decay) on fp32 masters, the
// micro-step reading bf16 copies of them: the loss on a fixed batch of a
// repeated phrase falls by well over 30% in 30 steps.
TEST(GptTest, AdamWLowersTheLoss) {
  const Config config = {.vocab = 256, .context = 16, .channels = 32, .layers = 2, .heads = 4};
  constexpr int kBatch = 4;
  std::unique_ptr<Device> device = HostDevice();
  std::unique_ptr<Gpt> gpt = MakeGpt(config, kBatch, *device);
  const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
  auto weights = GptInitWeights(config, layouts, 7);

  const std::string text = "the cat sat on the mat. ";
  std::vector<int32_t> tokens;
  for (int b = 0; b < kBatch; ++b) {
    for (int t = 0; t <= config.context; ++t) {
      tokens.push_back(static_cast<unsigned char>(text[(b * 5 + t) % text.size()]));
    }
  }

  constexpr float kLr = 1e-2f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kDecay = 0.0f;
  std::vector<std::vector<float>> m(layouts.size()), v(layouts.size());
  for (size_t u = 0; u < layouts.size(); ++u) {
    m[u].assign(layouts[u].numel, 0.0f);
    v[u].assign(layouts[u].numel, 0.0f);
  }
  float first = 0, last = 0;
  for (int step = 1; step <= 30; ++step) {
    const StepResult r = TrainStep(*gpt, *device, layouts, weights, tokens);
    ASSERT_TRUE(std::isfinite(r.loss));
    if (step == 1) first = r.loss;
    last = r.loss;
    const float bc1 = 1.0f - std::pow(kBeta1, static_cast<float>(step));
    const float bc2 = 1.0f - std::pow(kBeta2, static_cast<float>(step));
    for (size_t u = 0; u < layouts.size(); ++u) {
      for (uint64_t i = 0; i < layouts[u].numel; ++i) {
        const float g = Bf16ToFloat(r.grads[u][i]);
        m[u][i] = kBeta1 * m[u][i] + (1 - kBeta1) * g;
        v[u][i] = kBeta2 * v[u][i] + (1 - kBeta2) * g * g;
        weights[u][i] *= 1 - kLr * kDecay;
        weights[u][i] -= kLr * (m[u][i] / bc1) / (std::sqrt(v[u][i] / bc2) + kEps);
      }
    }
  }
  std::printf("AdamW: loss %.4f -> %.4f in 30 steps\n", first, last);
  EXPECT_NEAR(first, std::log(256.0f), 0.1f);  // GPT-2 init: near uniform
  EXPECT_LT(last, 0.7f * first);
}

TEST(GptTest, UnitSpecsAndParameterCount) {
  for (bool tied : {true, false}) {
    Config config;  // defaults: V 256, T 64, C 64, L 2
    config.tied_head = tied;
    const std::vector<engine::UnitSpec> specs = UnitSpecs(config);
    ASSERT_EQ(specs.size(), 4u);
    EXPECT_EQ(specs[0].name, "embed");
    EXPECT_EQ(specs[1].name, "h.0");
    EXPECT_EQ(specs[2].name, "h.1");
    EXPECT_EQ(specs[3].name, "head");
    EXPECT_EQ(specs[1].tensors[2].name, "h.0.attn.qkv.weight");
    EXPECT_EQ(specs[2].tensors[10].name, "h.1.mlp.proj.weight");
    EXPECT_EQ(specs[2].tensors[10].shape, (std::vector<int64_t>{64, 256}));
    std::set<std::string> names;
    size_t tensors = 0;
    for (const auto& unit : specs) {
      for (const auto& tensor : unit.tensors) names.insert(tensor.name), ++tensors;
    }
    EXPECT_EQ(names.size(), tensors) << "tensor names must be unique";
    const uint64_t C = 64, V = 256, T = 64;
    const uint64_t block = 12 * C * C + 13 * C;
    EXPECT_EQ(ParameterCount(config), V * C + T * C + 2 * block + 2 * C + (tied ? 0 : V * C));
  }
}

TEST(GptTest, InitUnitIsGpt2InitAndDeterministic) {
  Config config;
  config.layers = 4;
  const std::vector<engine::UnitLayout> layouts = GptLayouts(config);
  const auto a = GptInitWeights(config, layouts, 99);
  const auto b = GptInitWeights(config, layouts, 99);
  const auto c = GptInitWeights(config, layouts, 100);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a[1], a[2]) << "blocks draw from different streams";

  auto std_of = [](const float* p, uint64_t n) {
    double s = 0, s2 = 0;
    for (uint64_t i = 0; i < n; ++i) s += p[i], s2 += static_cast<double>(p[i]) * p[i];
    const double mean = s / n;
    return std::sqrt(s2 / n - mean * mean);
  };
  const engine::UnitLayout& block = layouts[1];
  const float* w = a[1].data();
  const uint64_t C = config.channels;
  EXPECT_NEAR(std_of(w + block.offsets[2], 3 * C * C), 0.02, 0.002);  // attn.qkv
  EXPECT_NEAR(std_of(w + block.offsets[10], 4 * C * C), 0.02 / std::sqrt(8.0), 0.0007);
  EXPECT_NEAR(std_of(w + block.offsets[4], C * C), 0.02 / std::sqrt(8.0), 0.0007);
  for (uint64_t i = 0; i < C; ++i) {
    EXPECT_EQ(w[block.offsets[0] + i], 1.0f);  // ln_1.weight
    EXPECT_EQ(w[block.offsets[1] + i], 0.0f);  // ln_1.bias
  }
  EXPECT_NEAR(std_of(a[0].data(), 256 * C), 0.02, 0.002);  // wte
}

TEST(GptTest, ValidateConfigNamesTheBadField) {
  struct Case {
    void (*mutate)(Config&);
    const char* field;
  };
  const Case cases[] = {
      {[](Config& c) { c.vocab = 0; }, "vocab"},
      {[](Config& c) { c.context = -1; }, "context"},
      {[](Config& c) { c.channels = 0; }, "channels"},
      {[](Config& c) { c.layers = 0; }, "layers"},
      {[](Config& c) { c.heads = 0; }, "heads"},
      {[](Config& c) { c.heads = 5; }, "heads"},  // does not divide 64
  };
  EXPECT_TRUE(ValidateConfig(Config{}).ok());
  for (const Case& test : cases) {
    Config config;
    test.mutate(config);
    const Status s = ValidateConfig(config);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << test.field;
    EXPECT_NE(s.message().find(test.field), std::string::npos) << s;
  }
}

// The CUDA kernels' limits are said for the device before a run trains:
// past them the first attention stopped the process.
TEST(GptTest, ShapesPastTheCudaKernelsAreRefusedForCudaOnly) {
  Config config;
  config.channels = 2 * kCudaMaxHeadSize;
  config.heads = 1;
  EXPECT_TRUE(ValidateConfigFor(config, DeviceKind::kHost).ok());
  Status s = ValidateConfigFor(config, DeviceKind::kCuda);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("a head's size, 2048"), std::string::npos) << s;
  config.heads = 2;
  EXPECT_TRUE(ValidateConfigFor(config, DeviceKind::kCuda).ok());
  config.context = kCudaMaxContext + 1;
  EXPECT_TRUE(ValidateConfigFor(config, DeviceKind::kHost).ok());
  s = ValidateConfigFor(config, DeviceKind::kCuda);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("config.context 8193"), std::string::npos) << s;
}

TEST(GptTest, CreateAndStepRejectBadInput) {
  const Config config = TinyConfig(true);
  std::unique_ptr<Device> device = HostDevice();
  std::vector<engine::UnitLayout> layouts = GptLayouts(config);

  std::vector<engine::UnitLayout> short_layouts(layouts.begin(), layouts.end() - 1);
  Result<std::unique_ptr<Gpt>> r = Gpt::Create(config, 2, *device, short_layouts);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layouts"), std::string::npos) << r.status();

  std::vector<engine::UnitLayout> untied = GptLayouts(TinyConfig(false));
  r = Gpt::Create(config, 2, *device, untied);  // the head has one tensor too many
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();

  Config bad = config;
  bad.heads = 3;
  EXPECT_EQ(Gpt::Create(bad, 2, *device, layouts).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Gpt::Create(config, 0, *device, layouts).status().code(), StatusCode::kInvalidArgument);
  // The largest dimensions there are: the attention scores' count passes
  // 2^63, and the int64 product that checked it wrapped (and passed).
  Config huge = config;
  huge.channels = huge.context = huge.heads = 1 << 16;
  r = Gpt::Create(huge, INT_MAX, *device, {});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("exceed the kernels' int range"), std::string::npos)
      << r.status();

  std::unique_ptr<Gpt> gpt = MakeGpt(config, 2, *device);
  EXPECT_EQ(gpt->config().vocab, 16);
  EXPECT_EQ(gpt->batch(), 2);
  const auto weights = GptInitWeights(config, layouts, 1);
  std::vector<int32_t> tokens = RandomTokens(config, 2, 3);
  tokens[9] = config.vocab;  // row 1, position 2
  GptMemorySource source(*device, layouts, weights);
  Result<float> loss = gpt->TrainMicroStep(source, tokens.data(), 1.0f);
  EXPECT_EQ(loss.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loss.status().message().find("row 1, position 2"), std::string::npos) << loss.status();
  EXPECT_EQ(source.acquires(), 0);

  std::vector<std::vector<float>> grads;
  tokens[9] = 0;
  auto wrong = weights;
  wrong[1].pop_back();
  EXPECT_EQ(gpt->LossAndGrads(wrong, tokens.data(), &grads).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gpt->LossAndGrads(weights, tokens.data(), nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gpt->LossAndGrads(weights, nullptr, &grads).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ztier::gpt
