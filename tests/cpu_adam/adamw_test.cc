// Tests of the fused AdamW kernel on every compiled Highway target:
//  - against a double-precision reference of the same formulas (random data,
//    a fresh seed per case printed on failure, many sizes, misaligned
//    pointers, both grad dtypes, AdamW and Adam, bias correction on/off,
//    weight decay zero and not, grad scale != 1, several steps in a row);
//  - bf16 publish copy: bit-exact round to nearest even through the kernel;
//  - bitwise identical results for 1, 2 and more threads;
//  - inf/NaN grads: detected, nothing written;
//  - argument validation.
//
// Tolerance: the kernel computes in fp32, each operation correctly rounded
// (relative error <= 2^-24 ~ 6e-8). An element's update is a chain of about
// a dozen such operations plus fp32-rounded per-step constants, so its error
// is below ~1e-6 of the magnitude of the terms that were added. We allow
// kRelTol = 2e-6 relative to the sum of the absolute values of the terms
// (|beta1*m| + |(1-beta1)*g| for m, and so on): well under the 1e-5 per
// element that a step may cost, and far tighter than any formula slip (a
// wrong bias correction or a missing term is off by >1e-3).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <oneapi/tbb/info.h>

#include "common/bf16.h"
#include "cpu_adam/adamw.h"
#include "hwy/highway.h"
#include "hwy/tests/hwy_gtest.h"
#include "tests/testing/cpu_adam_testing.h"

namespace ztier::cpu_adam {
namespace {

constexpr double kRelTol = 2e-6;
// Absolute floor for values that are zero up to rounding (m and p terms can
// cancel); far below the size of any element in these tests.
constexpr double kAbsTol = 1e-12;

using adam_testing::FreshSeed;
using adam_testing::SharedExecutor;

// Owns over-allocated storage and exposes views shifted by `misalign`
// elements, so the kernel sees pointers that are not vector-aligned (and not
// aligned alike: each buffer gets its own shift).
struct State {
  size_t n = 0;
  std::vector<float> p_store, m_store, v_store, g32_store;
  std::vector<bf16> g16_store, out_store;
  float* p = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  float* g32 = nullptr;
  bf16* g16 = nullptr;
  bf16* out = nullptr;

  State(size_t count, size_t misalign) : n(count) {
    const size_t pad = 64;
    p_store.assign(n + pad, 0.0f);
    m_store.assign(n + pad, 0.0f);
    v_store.assign(n + pad, 0.0f);
    g32_store.assign(n + pad, 0.0f);
    g16_store.assign(n + pad, bf16{0});
    out_store.assign(n + pad, bf16{0xdead});
    p = p_store.data() + misalign;
    m = m_store.data() + (misalign * 3) % 16;
    v = v_store.data() + (misalign * 5) % 16;
    g32 = g32_store.data() + (misalign * 7) % 16;
    g16 = g16_store.data() + (misalign * 9) % 32;
    out = out_store.data() + (misalign * 11) % 32;
  }

  void Randomize(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      p[i] = normal(rng);
      m[i] = 0.1f * normal(rng);
      // Every fourth element starts with v = 0 so that, with a tiny grad
      // scale, eps is comparable to sqrt(v) and its handling is checked too.
      v[i] = i % 4 == 0 ? 0.0f : 0.01f * std::fabs(normal(rng));
    }
  }

  void NewGrads(std::mt19937_64& rng, float scale) {
    std::normal_distribution<float> normal(0.0f, scale);
    for (size_t i = 0; i < n; ++i) {
      g32[i] = normal(rng);
      g16[i] = FloatToBf16(g32[i]);
    }
  }

  Shard View(GradType type, bool with_out) const {
    Shard s;
    s.count = n;
    s.grad_type = type;
    s.grads = type == GradType::kBFloat16 ? static_cast<const void*>(g16) : g32;
    s.params = p;
    s.exp_avg = m;
    s.exp_avg_sq = v;
    s.params_out = with_out ? out : nullptr;
    return s;
  }

  double RawGrad(GradType type, size_t i) const {
    return type == GradType::kBFloat16 ? Bf16ToFloat(g16[i]) : g32[i];
  }
};

struct Case {
  GradType grad_type;
  Mode mode;
  BiasCorrection bias;
  float weight_decay;
  float grad_scale;
  bool with_out;
  // 0.99999 is far from its float (1 - beta2 would be 0.14% off in float).
  double beta2;
};

std::string Describe(const Case& c) {
  return StrCat(c.grad_type == GradType::kBFloat16 ? "bf16" : "fp32", " grads, ",
                c.mode == Mode::kAdamW ? "AdamW" : "Adam", ", bias correction ",
                c.bias == BiasCorrection::kOn ? "on" : "off", ", beta2 ", c.beta2, ", wd ",
                c.weight_decay, ", grad_scale ", c.grad_scale, c.with_out ? ", bf16 out" : "");
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (GradType gt : {GradType::kBFloat16, GradType::kFloat32}) {
    for (Mode mode : {Mode::kAdamW, Mode::kAdam}) {
      for (BiasCorrection bias : {BiasCorrection::kOn, BiasCorrection::kOff}) {
        for (float wd : {0.0f, 0.1f}) {
          for (float gs : {1.0f, 0.37f, 1e-7f}) {
            cases.push_back({gt, mode, bias, wd, gs, /*with_out=*/(cases.size() % 3) != 2,
                             /*beta2=*/cases.size() % 4 < 2 ? 0.999 : 0.99999});
          }
        }
      }
    }
  }
  return cases;
}

// Runs `steps` steps and checks each element of each step against the double
// reference computed from the kernel's own inputs of that step.
::testing::AssertionResult RunAndCheck(const Case& c, size_t n, size_t misalign, int steps,
                                       uint64_t seed) {
  std::mt19937_64 rng(seed);
  State s(n, misalign);
  s.Randomize(rng);
  const Hyper h{.lr = 1e-2f,
                .beta1 = 0.9,
                .beta2 = c.beta2,
                .eps = 1e-8f,
                .weight_decay = c.weight_decay,
                .mode = c.mode,
                .bias_correction = c.bias};
  std::vector<float> p0(n), m0(n), v0(n);
  for (int step = 1; step <= steps; ++step) {
    s.NewGrads(rng, 1.0f);
    std::copy(s.p, s.p + n, p0.begin());
    std::copy(s.m, s.m + n, m0.begin());
    std::copy(s.v, s.v + n, v0.begin());
    const StepOptions opt{.step = step, .grad_scale = c.grad_scale, .want_grad_sq_sum = true};
    Result<StepResult> r = Step(h, opt, s.View(c.grad_type, c.with_out), SharedExecutor());
    if (!r.ok()) return ::testing::AssertionFailure() << "Step failed: " << r.status();
    if (r->skipped) return ::testing::AssertionFailure() << "finite grads were skipped";

    const double b1 = 0.9, b2 = c.beta2, lr = h.lr, wd = h.weight_decay;
    const bool bias = c.bias == BiasCorrection::kOn;
    const double bc1 = bias ? 1.0 - std::pow(b1, step) : 1.0;
    const double bc2 = bias ? 1.0 - std::pow(b2, step) : 1.0;
    double sq = 0.0;
    for (size_t i = 0; i < n; ++i) {
      const double g_raw = s.RawGrad(c.grad_type, i);
      sq += g_raw * g_raw;
      // Each tolerance scales with the magnitudes that went into the value
      // (terms can cancel: with L2 the grad and weight_decay * p often do).
      double g = g_raw * static_cast<double>(c.grad_scale);
      double g_mag = std::fabs(g);
      if (c.mode == Mode::kAdam) {
        g += wd * p0[i];
        g_mag += std::fabs(wd * p0[i]);
      }
      const double m = b1 * m0[i] + (1.0 - b1) * g;
      const double v = b2 * v0[i] + (1.0 - b2) * g * g;
      const double m_mag = b1 * std::fabs(m0[i]) + (1.0 - b1) * g_mag;
      const double v_mag = b2 * v0[i] + (1.0 - b2) * g_mag * g_mag;
      const double denom = std::sqrt(v) / std::sqrt(bc2) + h.eps;
      const double decayed = c.mode == Mode::kAdamW ? p0[i] * (1.0 - lr * wd) : p0[i];
      const double update = (lr / bc1) * m / denom;
      const double p = decayed - update;
      // The update inherits m's error and half of v's (through the sqrt).
      const double update_mag =
          (lr / bc1) * (m_mag + std::fabs(m) * (1.0 + v_mag / std::max(v, 1e-300))) / denom;
      const double m_tol = kRelTol * m_mag + kAbsTol;
      const double v_tol = kRelTol * v_mag + kAbsTol;
      const double p_tol = kRelTol * (std::fabs(decayed) + update_mag) + kAbsTol;
      if (std::fabs(s.m[i] - m) > m_tol || std::fabs(s.v[i] - v) > v_tol ||
          std::fabs(s.p[i] - p) > p_tol) {
        return ::testing::AssertionFailure()
               << "step " << step << " element " << i << " of " << n << ": p " << s.p[i] << " want "
               << p << ", m " << s.m[i] << " want " << m << ", v " << s.v[i] << " want " << v;
      }
      if (c.with_out && s.out[i].bits != FloatToBf16(s.p[i]).bits) {
        return ::testing::AssertionFailure()
               << "step " << step << " element " << i << ": bf16 out 0x" << std::hex
               << s.out[i].bits << " want 0x" << FloatToBf16(s.p[i]).bits;
      }
    }
    if (std::fabs(r->grad_sq_sum - sq) > 1e-12 * sq) {
      return ::testing::AssertionFailure()
             << "step " << step << ": grad_sq_sum " << r->grad_sq_sum << " want " << sq;
    }
  }
  return ::testing::AssertionSuccess();
}

class AdamWTest : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(AdamWTest);

TEST_P(AdamWTest, MatchesDoubleReference) {
  // Small sizes run every case; the large ones a rotating subset, so that
  // every case meets a multi-tile shard on some size without an hour of
  // reference arithmetic.
  const std::vector<Case> cases = AllCases();
  const size_t sizes[] = {0, 1, 7, 15, 16, 17, 31, 1023, 4099, 1 << 20, (1 << 20) + 3};
  size_t rotate = 0;
  for (size_t n : sizes) {
    const bool large = n > 100000;
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      if (large && (ci % 12) != (rotate % 12)) continue;
      for (size_t misalign : {size_t{0}, size_t{1}, size_t{3}}) {
        if (large && misalign != (ci % 2 == 0 ? 0 : 3)) continue;
        const uint64_t seed = FreshSeed();
        SCOPED_TRACE(StrCat("target ", hwy::TargetName(GetParam()), ", n ", n, ", misalign ",
                            misalign, ", ", Describe(cases[ci]), ", seed ", seed));
        ASSERT_TRUE(RunAndCheck(cases[ci], n, misalign, large ? 2 : 3, seed));
      }
    }
    if (large) ++rotate;
  }
  EXPECT_EQ(ActiveTarget(), hwy::TargetName(GetParam()));
}

TEST_P(AdamWTest, PublishCopyRoundsToNearestEvenBitExact) {
  // lr = 0 and no weight decay leave every param exactly as it was, so the
  // bf16 copy shows the kernel's fp32 -> bf16 rounding of chosen values.
  const uint32_t specials[] = {
      0x3f800000, 0x3f808000, 0x3f818000, 0xbf818000, 0x3f808001, 0x3f807fff,  // ties
      0x3fffffff, 0x3fff8000, 0x7f7fffff, 0xff7fffff, 0x7f7f7fff,              // carries
      0x7f800000, 0xff800000, 0x00000000, 0x80000000,                          // inf, zeros
      0x00010000, 0x00008000, 0x00018000, 0x00008001, 0x807fffff, 0x00000001,  // subnormals
      0x7fc00000, 0xffc00000, 0x7f800001, 0x7fffffff};                         // NaNs
  const size_t nspecial = sizeof(specials) / sizeof(specials[0]);
  for (OutputStore store : {OutputStore::kStreaming, OutputStore::kRegular}) {
    for (size_t misalign : {size_t{0}, size_t{1}, size_t{5}}) {
      const size_t n = 7 * nspecial + 3;  // vector body plus one-lane head/tail
      State s(n, misalign);
      for (size_t i = 0; i < n; ++i) s.p[i] = std::bit_cast<float>(specials[i % nspecial]);
      const Hyper h{.lr = 0.0f, .weight_decay = 0.0f};
      const StepOptions opt{.step = 1, .output_store = store};
      Result<StepResult> r = Step(h, opt, s.View(GradType::kFloat32, true), SharedExecutor());
      ASSERT_TRUE(r.ok()) << r.status();
      for (size_t i = 0; i < n; ++i) {
        const uint32_t in = specials[i % nspecial];
        SCOPED_TRACE(StrCat("input bits 0x", std::hex, in, ", index ", std::dec, i));
        const float f = std::bit_cast<float>(in);
        if (std::isnan(f)) {
          EXPECT_TRUE(std::isnan(Bf16ToFloat(s.out[i])));
          EXPECT_EQ(s.out[i].bits & 0x8000, (in >> 16) & 0x8000) << "NaN sign";
        } else {
          EXPECT_EQ(std::bit_cast<uint32_t>(s.p[i]), in) << "param changed with lr 0";
          EXPECT_EQ(s.out[i].bits, FloatToBf16(f).bits);
        }
      }
    }
  }
}

TEST_P(AdamWTest, StreamingAndRegularStoresAgree) {
  const size_t n = 3 * kTileElements + 77;
  std::mt19937_64 rng(FreshSeed());
  State a(n, 1), b(n, 1);
  a.Randomize(rng);
  a.NewGrads(rng, 1.0f);
  b.p_store = a.p_store;
  b.m_store = a.m_store;
  b.v_store = a.v_store;
  b.g16_store = a.g16_store;
  const Hyper h{.weight_decay = 0.01f};
  ASSERT_TRUE(Step(h, {.output_store = OutputStore::kStreaming}, a.View(GradType::kBFloat16, true),
                   SharedExecutor())
                  .ok());
  ASSERT_TRUE(Step(h, {.output_store = OutputStore::kRegular}, b.View(GradType::kBFloat16, true),
                   SharedExecutor())
                  .ok());
  EXPECT_EQ(std::memcmp(a.out, b.out, n * sizeof(bf16)), 0);
  EXPECT_EQ(std::memcmp(a.p, b.p, n * sizeof(float)), 0);
}

// Everything a step writes, as raw bytes.
std::vector<uint8_t> Snapshot(const State& s) {
  std::vector<uint8_t> bytes;
  auto append = [&](const void* ptr, size_t len) {
    const auto* b = static_cast<const uint8_t*>(ptr);
    bytes.insert(bytes.end(), b, b + len);
  };
  append(s.p, s.n * sizeof(float));
  append(s.m, s.n * sizeof(float));
  append(s.v, s.n * sizeof(float));
  append(s.out, s.n * sizeof(bf16));
  return bytes;
}

TEST_P(AdamWTest, BitwiseSameForAnyThreadCount) {
  const size_t n = (1 << 20) + 3;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("seed ", seed));
  for (GradCheck check : {GradCheck::kScanFirst, GradCheck::kPrechecked}) {
    std::vector<uint8_t> want;
    uint64_t want_sq = 0, want_norm = 0;
    for (int threads : {1, 2, 3, 8}) {
      std::mt19937_64 rng(seed);
      State s(n, 1);
      s.Randomize(rng);
      const Hyper h{.weight_decay = 0.05f};
      double sq = 0.0;
      for (int step = 1; step <= 2; ++step) {
        s.NewGrads(rng, 1.0f);
        const StepOptions opt{
            .step = step, .grad_scale = 0.5f, .grad_check = check, .want_grad_sq_sum = true};
        Result<StepResult> r =
            Step(h, opt, s.View(GradType::kBFloat16, true), SharedExecutor(threads));
        ASSERT_TRUE(r.ok()) << r.status();
        sq = r->grad_sq_sum;
      }
      Result<double> norm = SquaredNorm(s.g32, GradType::kFloat32, n, SharedExecutor(threads));
      ASSERT_TRUE(norm.ok());
      if (threads == 1) {
        want = Snapshot(s);
        want_sq = std::bit_cast<uint64_t>(sq);
        want_norm = std::bit_cast<uint64_t>(*norm);
      } else {
        EXPECT_TRUE(Snapshot(s) == want) << threads << " threads differ from 1 thread";
        EXPECT_EQ(std::bit_cast<uint64_t>(sq), want_sq) << threads << " threads";
        EXPECT_EQ(std::bit_cast<uint64_t>(*norm), want_norm) << threads << " threads";
      }
    }
  }
}

// Finite grads whose squares overflow fp32 (bf16 reaches 3e38) made v
// infinite: every later update of the element was 0, and a checkpoint of
// the state could not be loaded. Such a step is skipped like an inf/NaN one,
// also when grad_scale is what takes the grads past the limit.
TEST_P(AdamWTest, GradsWhoseSquaresOverflowSkipTheStep) {
  std::mt19937_64 rng(5);
  for (GradType gt : {GradType::kBFloat16, GradType::kFloat32}) {
    for (const auto& [value, scale] :
         {std::pair{1e30f, 1.0f}, std::pair{1e20f, 1e20f}, std::pair{2e19f, 1.0f}}) {
      SCOPED_TRACE(StrCat("grad ", value, " scale ", scale));
      State s(33, 1);
      s.Randomize(rng);
      s.NewGrads(rng, 1.0f);
      s.g32[7] = value;
      s.g16[7] = FloatToBf16(value);
      const std::vector<uint8_t> before = Snapshot(s);
      Result<StepResult> r =
          Step({}, {.step = 2, .grad_scale = scale}, s.View(gt, true), SharedExecutor());
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->skipped);
      EXPECT_TRUE(Snapshot(s) == before) << "a skipped step wrote to the shard";
    }
    // Large, but within what fp32 moments hold: a normal step, v finite.
    State s(33, 1);
    s.Randomize(rng);
    s.NewGrads(rng, 1.0f);
    s.g32[7] = 1e18f;
    s.g16[7] = FloatToBf16(1e18f);
    Result<StepResult> r = Step({}, {.step = 2}, s.View(gt, true), SharedExecutor());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->skipped);
    for (size_t i = 0; i < 33; ++i) {
      ASSERT_TRUE(std::isfinite(s.v[i]) && std::isfinite(s.m[i]) && std::isfinite(s.p[i])) << i;
    }
  }
}

TEST_P(AdamWTest, NonFiniteGradsSkipTheStepAndWriteNothing) {
  const float bad_values[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (size_t n : {size_t{1}, size_t{17}, size_t{4099}, (size_t{1} << 18) + 3}) {
    for (GradType gt : {GradType::kBFloat16, GradType::kFloat32}) {
      for (float bad : bad_values) {
        State s(n, 1);
        s.Randomize(rng);
        s.NewGrads(rng, 1.0f);
        for (size_t i = 0; i < n; ++i) s.out[i] = FloatToBf16(s.p[i]);
        // First, last, and a random element in between.
        const size_t at = std::uniform_int_distribution<size_t>(0, 2)(rng) == 0 ? 0
                          : std::uniform_int_distribution<size_t>(0, 1)(rng) == 0
                              ? n - 1
                              : std::uniform_int_distribution<size_t>(0, n - 1)(rng);
        s.g32[at] = bad;
        s.g16[at] = FloatToBf16(bad);
        SCOPED_TRACE(StrCat("n ", n, ", bad ", bad, " at ", at));
        const std::vector<uint8_t> before = Snapshot(s);
        Result<StepResult> r =
            Step({}, {.step = 3, .want_grad_sq_sum = true}, s.View(gt, true), SharedExecutor());
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_TRUE(r->skipped);
        EXPECT_FALSE(std::isfinite(r->grad_sq_sum));
        EXPECT_TRUE(Snapshot(s) == before) << "a skipped step wrote to the shard";

        Result<double> norm = SquaredNorm(s.View(gt, false).grads, gt, n, SharedExecutor());
        ASSERT_TRUE(norm.ok());
        EXPECT_FALSE(std::isfinite(*norm));

        // A caller that claims the grads were checked gets a loud error.
        Result<StepResult> pre = Step({}, {.step = 3, .grad_check = GradCheck::kPrechecked},
                                      s.View(gt, true), SharedExecutor());
        ASSERT_FALSE(pre.ok());
        EXPECT_EQ(pre.status().code(), StatusCode::kFailedPrecondition);
      }
    }
  }
}

TEST_P(AdamWTest, SquaredNormMatchesDouble) {
  std::mt19937_64 rng(FreshSeed());
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{1023}, size_t{(1 << 20) + 3}}) {
    State s(n, 3);
    s.NewGrads(rng, 3.0f);
    for (GradType gt : {GradType::kBFloat16, GradType::kFloat32}) {
      double want = 0.0;
      for (size_t i = 0; i < n; ++i) want += s.RawGrad(gt, i) * s.RawGrad(gt, i);
      Result<double> got = SquaredNorm(s.View(gt, false).grads, gt, n, SharedExecutor());
      ASSERT_TRUE(got.ok());
      EXPECT_NEAR(*got, want, 1e-12 * want) << "n " << n;
    }
  }
}

TEST(AdamWValidationTest, RejectsBadHyperParametersAndBuffers) {
  std::vector<float> p(8), m(8), v(8), g(8);
  Shard s{.count = 8,
          .grads = g.data(),
          .grad_type = GradType::kFloat32,
          .params = p.data(),
          .exp_avg = m.data(),
          .exp_avg_sq = v.data()};
  Executor& e = SharedExecutor();
  auto code = [&](const Hyper& h, const StepOptions& o, const Shard& sh) {
    Result<StepResult> r = Step(h, o, sh, e);
    return r.ok() ? StatusCode::kOk : r.status().code();
  };
  EXPECT_EQ(code({}, {}, s), StatusCode::kOk);
  EXPECT_EQ(code({.lr = -1.0f}, {}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.beta1 = 1.0f}, {}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.beta2 = std::nanf("")}, {}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.eps = 0.0f}, {}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.weight_decay = -0.1f}, {}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({}, {.step = 0}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({}, {.grad_scale = 0.0f}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({}, {.grad_scale = INFINITY}, s), StatusCode::kInvalidArgument);
  Shard null_params = s;
  null_params.params = nullptr;
  EXPECT_EQ(code({}, {}, null_params), StatusCode::kInvalidArgument);
  Shard overlap = s;
  overlap.exp_avg = p.data() + 4;
  Result<StepResult> r = Step({}, {}, overlap, e);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("params and exp_avg"), std::string::npos) << r.status();
  Shard out_over_grads = s;
  out_over_grads.params_out = reinterpret_cast<bf16*>(g.data());
  EXPECT_EQ(code({}, {}, out_over_grads), StatusCode::kInvalidArgument);
  Shard empty{};
  EXPECT_EQ(code({}, {}, empty), StatusCode::kOk);
  EXPECT_EQ(SquaredNorm(nullptr, GradType::kFloat32, 4, e).status().code(),
            StatusCode::kInvalidArgument);
  // Enum values out of range were taken as some mode (kGradCheck(9): no scan).
  EXPECT_EQ(code({.mode = static_cast<Mode>(9)}, {}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({.bias_correction = static_cast<BiasCorrection>(9)}, {}, s),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code({}, {.grad_check = static_cast<GradCheck>(9)}, s), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({}, {.output_store = static_cast<OutputStore>(9)}, s),
            StatusCode::kInvalidArgument);
  Shard bad_type = s;
  bad_type.grad_type = static_cast<GradType>(9);
  EXPECT_EQ(code({}, {}, bad_type), StatusCode::kInvalidArgument);
  EXPECT_EQ(SquaredNorm(g.data(), static_cast<GradType>(9), 4, e).status().code(),
            StatusCode::kInvalidArgument);
  // fp32 grads at an odd address are no floats (a misaligned load, UB).
  std::vector<char> bytes(8 * 4 + 1);
  Shard odd = s;
  odd.grads = bytes.data() + 1;
  r = Step({}, {}, odd, e);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("grads at"), std::string::npos) << r.status();
  EXPECT_EQ(SquaredNorm(bytes.data() + 1, GradType::kFloat32, 8, e).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ExecutorTest, ValidatesOptionsAndReportsTopology) {
  EXPECT_EQ(Executor::Create({.threads = -1}).status().code(), StatusCode::kInvalidArgument);
  Result<Executor> far = Executor::Create({.numa_node = 4096});
  ASSERT_FALSE(far.ok());
  EXPECT_NE(far.status().message().find("NUMA node 4096"), std::string::npos);
  Result<Topology> t = DetectTopology();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_GE(t->cores, 1);
  EXPECT_GE(t->numa_nodes, 1);
  EXPECT_EQ(t->cores_per_node.size(), static_cast<size_t>(t->numa_nodes));
  Result<Executor> all = Executor::Create({});
  ASSERT_TRUE(all.ok());
  EXPECT_GE(all->threads(), 1);
  // More than the process runs at once is what it runs (oneTBB ran fewer,
  // while threads() named the count asked for: ztier-bench labelled its
  // rows with it).
  Result<Executor> many = Executor::Create({.threads = 100000});
  ASSERT_TRUE(many.ok()) << many.status();
  EXPECT_EQ(many->threads(), oneapi::tbb::info::default_concurrency());
}

TEST(ExecutorTest, ParallelForCoversTheRangeOnce) {
  for (int threads : {1, 2, 4}) {
    std::vector<int> hits(1000, 0);
    SharedExecutor(threads).ParallelFor(hits.size(), [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) ++hits[i];
    });
    for (int h : hits) ASSERT_EQ(h, 1);
  }
}

}  // namespace
}  // namespace ztier::cpu_adam
