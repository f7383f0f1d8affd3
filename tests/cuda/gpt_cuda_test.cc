// The whole GPT example (examples/gpt) on the CUDA backend against the CPU
// backend (the reference), from identical fp32 weights, at ztier-train's
// default shape (4 layers, 128 channels, 4 heads, context 64, batch 8, the
// head tied to the embedding):
//  - one forward and backward on batches that hold every byte value 0-255
//    as inputs and as targets: the loss and every parameter's grad, and each
//    embedding row on its own (a wrong row of wte is a small part of the
//    tensor's norm);
//  - one training micro-step through a WeightSource (bf16 params in, the
//    bf16 grads each unit pushes out, the tied embedding's pushed once with
//    the head's part), the path ztier-train takes, on the same batches;
//  - teacher forcing over 40 AdamW steps: at every step both backends are
//    evaluated on the CPU trajectory's weights and batch (text-like bytes
//    with 2% >= 128), so rounding cannot make them drift apart, and they
//    must agree at every step;
//  - the forward and backward again with bf16 matmuls on both backends.
//
// Tolerance, from fp32 summation order: cuBLAS and the CPU kernels sum the
// same products in different orders, so each output differs by a few ulps
// of the sum of its terms' magnitudes (cuda_kernels_test holds single
// kernels to 1e-4). Through 4 blocks and the backward pass that stays far
// below 1e-3 of a tensor's norm; the loss is held to 1e-4 relative. A wrong
// value in the model (a bad row, a race) moves a tensor by O(1) of its norm.
// Pushed bf16 grads may also differ by one bf16 rounding (2^-8 relative) where
// the two fp32 sums fall on either side of a rounding point: 4e-3 there.
// Skips without a CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "client/ztier.h"
#include "common/bf16.h"
#include "common/status.h"
#include "examples/gpt/gpt.h"
#include "tests/testing/gpt_testing.h"

namespace ztier::gpt {
namespace {

constexpr int kBatch = 8;
constexpr double kLossRtol = 1e-4;
constexpr double kGradRtol = 1e-3;  // of the tensor's (or the row's) L2 norm
constexpr double kGradAtol = 1e-7;  // for tensors and rows whose grad is ~0
constexpr double kBf16GradRtol = 4e-3;

Config DefaultShape() {
  Config c;
  c.layers = 4;
  c.channels = 128;
  c.heads = 4;
  c.context = 64;
  c.vocab = 256;
  c.tied_head = true;
  return c;
}

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// kBatch rows of context + 1 tokens holding every byte value: a shuffled
// 0..255, twice, then random bytes.
std::vector<int32_t> EveryByte(const Config& c, uint64_t seed) {
  std::vector<int32_t> tokens(static_cast<size_t>(kBatch) * (c.context + 1));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = i < 512 ? static_cast<int32_t>(i % 256) : static_cast<int32_t>(Mix(seed + i) % 256);
  }
  for (size_t i = 511; i > 0; --i) std::swap(tokens[i], tokens[Mix(seed * 31 + i) % (i + 1)]);
  return tokens;
}

// Text-like bytes (letters, spaces, newlines) with `high` of them >= 128.
std::vector<int32_t> TextLike(const Config& c, uint64_t seed, double high) {
  static constexpr char kCommon[] = "etaoin shrdlu\ncmfwypvbgkqjxz.,ETAOINSHRDLU";
  std::vector<int32_t> tokens(static_cast<size_t>(kBatch) * (c.context + 1));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint64_t r = Mix(seed * 1000003 + i);
    if (static_cast<double>(r % 10000) < high * 10000) {
      tokens[i] = 128 + static_cast<int32_t>((r >> 20) % 128);
    } else {
      tokens[i] = static_cast<unsigned char>(kCommon[(r >> 20) % (sizeof(kCommon) - 1)]);
    }
  }
  return tokens;
}

double Norm(const float* x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}

double DiffNorm(const float* a, const float* b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return std::sqrt(s);
}

class GptCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<client::Device>> d = client::MakeCudaDevice(0);
    if (!d.ok() && d.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << d.status().message();
    }
    ASSERT_TRUE(d.ok()) << d.status();
    cuda_device_ = std::move(*d);
    Result<std::unique_ptr<client::Device>> host = client::MakeHostDevice();
    ASSERT_TRUE(host.ok()) << host.status();
    host_device_ = std::move(*host);
    layouts_ = testing::GptLayouts(config_);
    specs_ = UnitSpecs(config_);
    Result<std::unique_ptr<Gpt>> g = Gpt::Create(config_, kBatch, *cuda_device_, layouts_);
    if (!g.ok() && g.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << g.status().message();
    }
    ASSERT_TRUE(g.ok()) << g.status();
    cuda_ = std::move(*g);
    Result<std::unique_ptr<Gpt>> h = Gpt::Create(config_, kBatch, *host_device_, layouts_);
    ASSERT_TRUE(h.ok()) << h.status();
    host_ = std::move(*h);
  }

  // Per tensor, and per embedding row, ||cuda - cpu|| <= atol + rtol ||cpu||;
  // true when all hold. Failures name the unit, tensor (or row) and errors.
  bool CompareGrads(const std::vector<std::vector<float>>& gc,
                    const std::vector<std::vector<float>>& gh, double rtol,
                    const std::string& what) {
    bool same = true;
    int past = 0;
    const auto check = [&](const float* c, const float* h, size_t n, const std::string& name) {
      const double err = DiffNorm(c, h, n), ref = Norm(h, n);
      if (err <= kGradAtol + rtol * ref) return;
      if (++past <= 8) {
        ADD_FAILURE() << what << ": " << name << ": ||cuda - cpu|| " << err << " > " << rtol
                      << " x ||cpu|| " << ref;
      }
      same = false;
    };
    for (size_t u = 0; u < specs_.size(); ++u) {
      for (size_t k = 0; k < specs_[u].tensors.size(); ++k) {
        const engine::TensorSpec& tensor = specs_[u].tensors[k];
        const uint64_t begin = layouts_[u].offsets[k];
        const uint64_t end =
            k + 1 < specs_[u].tensors.size() ? layouts_[u].offsets[k + 1] : layouts_[u].numel;
        const std::string name = specs_[u].name + "/" + tensor.name;
        check(gc[u].data() + begin, gh[u].data() + begin, end - begin, name);
        // The embeddings row by row: rows of rare tokens are a small part
        // of the tensor's norm.
        if (u == 0 && tensor.shape.size() == 2) {
          const size_t cols = static_cast<size_t>(tensor.shape[1]);
          for (uint64_t row = begin; row < end; row += cols) {
            check(gc[u].data() + row, gh[u].data() + row, cols,
                  StrCat(name, " row ", (row - begin) / cols));
          }
        }
      }
    }
    if (past > 8) ADD_FAILURE() << what << ": " << past << " tensors and rows past tolerance in all";
    return same;
  }

  // Both backends on the same weights and tokens; true when they agree.
  // Failures name the unit, tensor (or embedding row) and the errors.
  bool Compare(const std::vector<std::vector<float>>& weights, const std::vector<int32_t>& tokens,
               const std::string& what, std::vector<std::vector<float>>* host_grads = nullptr) {
    std::vector<std::vector<float>> gh, gc;
    Result<float> lh = host_->LossAndGrads(weights, tokens.data(), &gh);
    Result<float> lc = cuda_->LossAndGrads(weights, tokens.data(), &gc);
    EXPECT_TRUE(lh.ok()) << lh.status();
    EXPECT_TRUE(lc.ok()) << lc.status();
    if (!lh.ok() || !lc.ok()) return false;
    bool same = true;
    if (!(std::fabs(*lc - *lh) <= loss_rtol_ * std::max(1.0f, std::fabs(*lh)))) {
      ADD_FAILURE() << what << ": loss cuda " << *lc << ", cpu " << *lh;
      same = false;
    }
    same = CompareGrads(gc, gh, grad_rtol_, what) && same;
    if (host_grads != nullptr) *host_grads = std::move(gh);
    return same;
  }

  Config config_ = DefaultShape();
  double loss_rtol_ = kLossRtol, grad_rtol_ = kGradRtol;  // of Compare
  std::unique_ptr<client::Device> cuda_device_, host_device_;
  std::vector<engine::UnitLayout> layouts_;
  std::vector<engine::UnitSpec> specs_;
  std::unique_ptr<Gpt> cuda_, host_;
};

TEST_F(GptCudaTest, ForwardAndBackwardMatchTheCpuOnEveryByteValue) {
  const std::vector<std::vector<float>> weights = testing::GptInitWeights(config_, layouts_, 1);
  for (uint64_t seed : {1, 2, 3}) {
    EXPECT_TRUE(Compare(weights, EveryByte(config_, seed), StrCat("every byte, seed ", seed)));
  }
  // Only bytes < 128, then only >= 128: a difference in one half names it.
  std::vector<int32_t> low = EveryByte(config_, 4), high = low;
  for (int32_t& t : low) t %= 128;
  for (int32_t& t : high) t = 128 + t % 128;
  EXPECT_TRUE(Compare(weights, low, "bytes < 128 only"));
  EXPECT_TRUE(Compare(weights, high, "bytes >= 128 only"));
}

// bf16 matmuls (tensor cores on CUDA, the same rounding ahead of fp32 loops
// on the CPU). Where the backends' fp32 inputs of a matmul differ by an ulp
// the operand's bf16 rounding may differ by one bf16 step (2^-8) on that
// element: tolerances 10x the fp32 ones.
TEST_F(GptCudaTest, Bf16MatmulsMatchTheCpusOnEveryByteValue) {
  Config bf16 = config_;
  bf16.matmul = MatmulMath::kBf16;
  Result<std::unique_ptr<Gpt>> c = Gpt::Create(bf16, kBatch, *cuda_device_, layouts_);
  ASSERT_TRUE(c.ok()) << c.status();
  Result<std::unique_ptr<Gpt>> h = Gpt::Create(bf16, kBatch, *host_device_, layouts_);
  ASSERT_TRUE(h.ok()) << h.status();
  cuda_ = std::move(*c);
  host_ = std::move(*h);
  loss_rtol_ = 10 * kLossRtol;
  grad_rtol_ = 10 * kGradRtol;
  const std::vector<std::vector<float>> weights = testing::GptInitWeights(config_, layouts_, 1);
  for (uint64_t seed : {1, 2}) {
    EXPECT_TRUE(Compare(weights, EveryByte(config_, seed), StrCat("bf16 matmuls, seed ", seed)));
  }
}

TEST_F(GptCudaTest, TrainMicroStepPushesTheCpusBf16Grads) {
  // The path ztier-train takes: bf16 params acquired from a WeightSource,
  // converted on the device, bf16 grads pushed back unit by unit.
  const std::vector<std::vector<float>> weights = testing::GptInitWeights(config_, layouts_, 1);
  for (uint64_t seed : {5, 6}) {
    const std::vector<int32_t> tokens = EveryByte(config_, seed);
    testing::GptMemorySource on_cuda(*cuda_device_, layouts_, weights);
    testing::GptMemorySource on_host(*host_device_, layouts_, weights);
    Result<float> lc = cuda_->TrainMicroStep(on_cuda, tokens.data(), 1.0f);
    Result<float> lh = host_->TrainMicroStep(on_host, tokens.data(), 1.0f);
    ASSERT_TRUE(lc.ok()) << lc.status();
    ASSERT_TRUE(lh.ok()) << lh.status();
    EXPECT_LE(std::fabs(*lc - *lh), kLossRtol * std::max(1.0f, std::fabs(*lh)))
        << "loss cuda " << *lc << ", cpu " << *lh;
    std::vector<std::vector<float>> gc(layouts_.size()), gh(layouts_.size());
    for (size_t u = 0; u < layouts_.size(); ++u) {
      ASSERT_EQ(on_cuda.pushed()[u], 1) << "unit " << u;
      ASSERT_EQ(on_host.pushed()[u], 1) << "unit " << u;
      for (uint64_t i = 0; i < layouts_[u].numel; ++i) {
        gc[u].push_back(Bf16ToFloat(on_cuda.grads(u)[i]));
        gh[u].push_back(Bf16ToFloat(on_host.grads(u)[i]));
      }
    }
    EXPECT_TRUE(CompareGrads(gc, gh, kBf16GradRtol, StrCat("pushed bf16 grads, seed ", seed)));
  }
}

TEST_F(GptCudaTest, TeacherForcedFortyStepsAgreeAtEveryStep) {
  // AdamW as ztier-train's defaults (lr 2e-3, weight decay 0.01), in double
  // on the host, driven by the CPU's grads.
  std::vector<std::vector<float>> weights = testing::GptInitWeights(config_, layouts_, 1);
  std::vector<std::vector<double>> m(weights.size()), v(weights.size());
  for (size_t u = 0; u < weights.size(); ++u) {
    m[u].assign(weights[u].size(), 0.0);
    v[u].assign(weights[u].size(), 0.0);
  }
  const double lr = 2e-3, wd = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  int disagreeing = 0;
  for (int step = 1; step <= 40; ++step) {
    std::vector<std::vector<float>> grads;
    const std::vector<int32_t> tokens =
        step % 10 == 0 ? EveryByte(config_, 100 + step) : TextLike(config_, step, 0.02);
    if (!Compare(weights, tokens, StrCat("step ", step), &grads)) ++disagreeing;
    if (grads.empty()) break;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (size_t u = 0; u < weights.size(); ++u) {
      for (size_t i = 0; i < weights[u].size(); ++i) {
        const double g = grads[u][i];
        m[u][i] = b1 * m[u][i] + (1 - b1) * g;
        v[u][i] = b2 * v[u][i] + (1 - b2) * g * g;
        double w = weights[u][i] * (1 - lr * wd);
        w -= lr * (m[u][i] / bc1) / (std::sqrt(v[u][i] / bc2) + eps);
        weights[u][i] = static_cast<float>(w);
      }
    }
  }
  EXPECT_EQ(disagreeing, 0) << "of 40 teacher-forced steps";
}

}  // namespace
}  // namespace ztier::gpt
