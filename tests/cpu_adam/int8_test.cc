// Tests of the 8-bit states (StepInt8, Quantize, Dequantize) on every
// compiled Highway target:
//  - the maps: ascending, 0 and exactly 1 in both, m's symmetric;
//  - quantization picks the nearest code (ties to the smaller; a positive v
//    never code 0) for every
//    code value, every midpoint and its neighbouring floats, random values,
//    zeros and denormals, against a brute-force search;
//  - the round trip error of a block is at most half a code step times its
//    absmax, and a quantized block quantizes again to the same codes;
//  - StepInt8 against a double-precision reference of the same algorithm
//    (dequantize, update, new absmax, nearest code), with param groups and
//    frozen segments that cut blocks anywhere, in groups of the block grid
//    or cut where each segment starts (a frozen one's then never written),
//    both grad dtypes, AdamW and Adam, several steps; bad cuts refused;
//  - a tensor beside one with 1e4 times its grads steps as in fp32;
//  - the same bits for any thread count; inf/NaN grads skip the step and
//    write nothing; argument validation;
//  - a least-squares fit on a fixed batch: the 8-bit run's loss tracks the
//    fp32 run's.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/bf16.h"
#include "cpu_adam/adamw.h"
#include "hwy/highway.h"
#include "hwy/tests/hwy_gtest.h"
#include "tests/testing/cpu_adam_testing.h"

namespace ztier::cpu_adam {
namespace {

using adam_testing::FreshSeed;
using adam_testing::SharedExecutor;

// The map's magnitudes, ascending (m: 128, v: 256).
std::vector<float> Magnitudes(QuantMap map) {
  const float* v = QuantMapValues(map);
  return std::vector<float>(v, v + (map == QuantMap::kSigned ? 128 : 256));
}

// Brute force: the magnitude code nearest to a >= 0, ties to the smaller,
// midpoints computed as the kernel's tables do (in double, rounded to fp32).
int NearestMagnitude(const std::vector<float>& mag, double a) {
  int code = 0;
  for (size_t c = 0; c + 1 < mag.size(); ++c) {
    const float mid = static_cast<float>((static_cast<double>(mag[c]) + mag[c + 1]) / 2.0);
    if (a > mid) code = static_cast<int>(c + 1);
  }
  return code;
}

// The code a value x of a block with absmax `absmax` should get: the
// nearest, but a positive v never 0.
int NearestCode(QuantMap map, double x, double absmax) {
  const double a = absmax > 0 ? std::min(1.0, std::fabs(x) / absmax) : 0.0;
  const int mag = NearestMagnitude(Magnitudes(map), a);
  if (map == QuantMap::kUnsigned) return x > 0 && mag == 0 ? 1 : mag;
  return x < 0 && mag != 0 ? mag | 0x80 : mag;
}

double CodeValue(QuantMap map, uint8_t code) { return QuantMapValues(map)[code]; }

// The magnitude step around code c (the larger of its two gaps).
double Step(QuantMap map, uint8_t code) {
  const std::vector<float> mag = Magnitudes(map);
  const size_t k = map == QuantMap::kSigned ? (code & 0x7f) : code;
  const double lo = k > 0 ? mag[k] - mag[k - 1] : 0.0;
  const double hi = k + 1 < mag.size() ? mag[k + 1] - mag[k] : 0.0;
  return std::max(lo, hi);
}

class Int8Test : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(Int8Test);

TEST(Int8MapsTest, AscendingWithZeroAndOneAndSymmetricSigns) {
  for (QuantMap map : {QuantMap::kSigned, QuantMap::kUnsigned}) {
    const std::vector<float> mag = Magnitudes(map);
    EXPECT_EQ(mag.front(), 0.0f);
    EXPECT_EQ(mag.back(), 1.0f);
    for (size_t c = 1; c < mag.size(); ++c) EXPECT_LT(mag[c - 1], mag[c]) << c;
  }
  const float* m = QuantMapValues(QuantMap::kSigned);
  for (int c = 0; c < 128; ++c) EXPECT_EQ(m[128 + c], -m[c]) << c;
  // Dynamic range: the smallest nonzero magnitudes.
  EXPECT_NEAR(Magnitudes(QuantMap::kSigned)[1], 1e-6, 1e-12);
  EXPECT_NEAR(Magnitudes(QuantMap::kUnsigned)[1], 1e-7, 1e-13);
}

TEST_P(Int8Test, DequantizeGivesTheMapsValuesBitForBit) {
  // Every code, in full vectors and in tails, with absmax 1.
  std::vector<uint8_t> codes(kQuantBlock * 2 + 5);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 7 + i / 256);
  const std::vector<float> ones(QuantBlocks(codes.size()), 1.0f);
  for (QuantMap map : {QuantMap::kSigned, QuantMap::kUnsigned}) {
    std::vector<float> x(codes.size());
    Dequantize(map, codes.data(), ones.data(), codes.size(), x.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(x[i]),
                std::bit_cast<uint32_t>(QuantMapValues(map)[codes[i]]))
          << "code " << int{codes[i]} << " at " << i << " on " << hwy::TargetName(GetParam());
    }
  }
}

TEST_P(Int8Test, QuantizePicksTheNearestCode) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("target ", hwy::TargetName(GetParam()), ", seed ", seed));
  std::mt19937_64 rng(seed);
  for (QuantMap map : {QuantMap::kSigned, QuantMap::kUnsigned}) {
    const std::vector<float> mag = Magnitudes(map);
    // Values to try, as magnitudes in [0, 1].
    std::vector<float> probe = {
        0.0f,   1.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
        1e-30f, 3e-8f};
    for (size_t c = 0; c < mag.size(); ++c) {
      probe.push_back(mag[c]);
      if (c + 1 < mag.size()) {
        const float mid = static_cast<float>((static_cast<double>(mag[c]) + mag[c + 1]) / 2.0);
        probe.push_back(mid);
        probe.push_back(std::nextafter(mid, 0.0f));
        probe.push_back(std::nextafter(mid, 2.0f));
      }
    }
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    std::uniform_real_distribution<float> exponent(-30.0f, 0.0f);
    for (int i = 0; i < 20000; ++i) probe.push_back(unit(rng));
    for (int i = 0; i < 20000; ++i) probe.push_back(std::pow(10.0f, exponent(rng)));
    // Blocks whose first element is 1: the absmax is 1, so the others are
    // quantized as they are (x * 1). m also gets them negated.
    std::vector<float> x;
    for (size_t i = 0; i < probe.size(); ++i) {
      if (x.size() % kQuantBlock == 0) x.push_back(1.0f);
      const bool negate = map == QuantMap::kSigned && i % 2 == 1;
      x.push_back(negate ? -probe[i] : probe[i]);
    }
    std::vector<uint8_t> codes(x.size());
    std::vector<float> absmax(QuantBlocks(x.size()));
    Quantize(map, x.data(), x.size(), codes.data(), absmax.data());
    for (float a : absmax) ASSERT_EQ(a, 1.0f);
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(codes[i], NearestCode(map, x[i], 1.0))
          << (map == QuantMap::kSigned ? "m" : "v") << " value " << x[i] << " (element " << i
          << ")";
    }
  }
}

TEST_P(Int8Test, RoundTripErrorIsWithinHalfAStepAndStable) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("target ", hwy::TargetName(GetParam()), ", seed ", seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (QuantMap map : {QuantMap::kSigned, QuantMap::kUnsigned}) {
    for (size_t n : {size_t{1}, size_t{5}, kQuantBlock - 1, kQuantBlock, 10 * kQuantBlock + 77}) {
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) {
        // Blocks of different scales, some all zero, some denormal.
        const size_t block = i / kQuantBlock;
        const float scale = block % 4 == 1   ? 0.0f
                            : block % 4 == 2 ? 1e-39f
                                             : std::pow(10.0f, -static_cast<float>(block % 7));
        float v = normal(rng) * scale;
        x[i] = map == QuantMap::kUnsigned ? std::fabs(v) : v;
      }
      std::vector<uint8_t> codes(n), codes2(n);
      std::vector<float> absmax(QuantBlocks(n)), absmax2(QuantBlocks(n));
      std::vector<float> y(n);
      Quantize(map, x.data(), n, codes.data(), absmax.data());
      Dequantize(map, codes.data(), absmax.data(), n, y.data());
      for (size_t i = 0; i < n; ++i) {
        const double am = absmax[i / kQuantBlock];
        const size_t first = i / kQuantBlock * kQuantBlock;
        float mx = 0;
        for (size_t j = first; j < std::min(n, first + kQuantBlock); ++j) {
          mx = std::max(mx, std::fabs(x[j]));
        }
        // Blocks below the smallest normal float are held as zeros.
        const bool flushed = mx < std::numeric_limits<float>::min();
        ASSERT_EQ(am, flushed ? 0.0f : mx);
        if (flushed) {
          ASSERT_EQ(y[i], 0.0f);
          continue;
        }
        // Half the larger gap around the code, and the smallest code
        // flushes values below half of it to zero. The code is the nearest
        // to a = |x| * (1 / absmax) and the value comes back as code value
        // * absmax, each rounded: a few ulps of |x| on top (2^-21), far below
        // the step a wrong code would be off by.
        const double bound =
            0.5 * Step(map, codes[i]) * am * (1 + 1e-6) + std::ldexp(std::fabs(x[i]), -21) + 1e-45;
        ASSERT_LE(std::fabs(y[i] - x[i]), bound)
            << "n " << n << " element " << i << ": " << x[i] << " came back as " << y[i];
      }
      Quantize(map, y.data(), n, codes2.data(), absmax2.data());
      ASSERT_EQ(codes, codes2) << "n " << n;
      ASSERT_EQ(absmax, absmax2) << "n " << n;
    }
  }
}

// The quantization groups [lo, hi) of `n` elements cut at `cuts`, in
// order: the block grid and the cuts, sorted.
std::vector<std::pair<size_t, size_t>> Groups(size_t n, const std::vector<size_t>& cuts) {
  std::vector<size_t> starts(cuts);
  for (size_t b = 0; b < n; b += kQuantBlock) starts.push_back(b);
  std::sort(starts.begin(), starts.end());
  std::vector<std::pair<size_t, size_t>> groups;
  for (size_t k = 0; k < starts.size(); ++k) {
    groups.emplace_back(starts[k], k + 1 < starts.size() ? starts[k + 1] : n);
  }
  return groups;
}

// A shard with 8-bit moments, misaligned views into padded storage, its
// groups cut at `cuts`.
struct State8 {
  size_t n;
  std::vector<size_t> cuts;
  std::vector<float> p_store, g32_store;
  std::vector<bf16> g16_store, out_store;
  std::vector<uint8_t> m, v;
  std::vector<float> m_absmax, v_absmax;
  float* p;
  float* g32;
  bf16* g16;
  bf16* out;

  State8(size_t count, size_t misalign, std::vector<size_t> group_cuts = {})
      : n(count), cuts(std::move(group_cuts)) {
    p_store.assign(n + 32, 0.0f);
    g32_store.assign(n + 32, 0.0f);
    g16_store.assign(n + 32, bf16{0});
    out_store.assign(n + 32, bf16{0xdead});
    p = p_store.data() + misalign;
    g32 = g32_store.data() + (misalign * 3) % 16;
    g16 = g16_store.data() + (misalign * 5) % 16;
    out = out_store.data() + (misalign * 7) % 16;
    m.assign(n, 0);
    v.assign(n, 0);
    m_absmax.assign(QuantGroups(n, cuts), 0.0f);
    v_absmax.assign(QuantGroups(n, cuts), 0.0f);
  }

  void Randomize(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> m0(n), v0(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = normal(rng);
      m0[i] = 0.1f * normal(rng);
      v0[i] = i % 4 == 0 ? 0.0f : 0.01f * std::fabs(normal(rng));
    }
    Quantize(QuantMap::kSigned, m0.data(), n, m.data(), m_absmax.data(), cuts);
    Quantize(QuantMap::kUnsigned, v0.data(), n, v.data(), v_absmax.data(), cuts);
  }

  void NewGrads(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      g32[i] = normal(rng);
      g16[i] = FloatToBf16(g32[i]);
    }
  }

  Int8Shard View(GradType type) {
    return {.count = n,
            .grads = type == GradType::kBFloat16 ? static_cast<const void*>(g16) : g32,
            .grad_type = type,
            .params = p,
            .moments = {.m = m.data(),
                        .v = v.data(),
                        .m_absmax = m_absmax.data(),
                        .v_absmax = v_absmax.data(),
                        .cuts = cuts},
            .params_out = out};
  }
  double RawGrad(GradType type, size_t i) const {
    return type == GradType::kBFloat16 ? Bf16ToFloat(g16[i]) : g32[i];
  }
};

// Segments that cut blocks anywhere: groups 0/1 alternate with a frozen run.
std::vector<Segment> Segments(size_t n, std::mt19937_64& rng) {
  std::vector<Segment> segs;
  std::uniform_int_distribution<size_t> len(1, 3 * kQuantBlock);
  size_t at = 0;
  for (int k = 0; at < n; ++k) {
    const size_t end = std::min(n, at + len(rng));
    segs.push_back({.begin = at,
                    .end = end,
                    .lr = k % 3 == 1 ? 3e-3f : 1e-2f,
                    .weight_decay = k % 3 == 1 ? 0.0f : 0.1f,
                    .frozen = k % 3 == 2});
    at = end;
  }
  return segs;
}

// How a shard's segments meet its quantization groups.
enum class Layout {
  kOne,       // one segment, the block grid
  kMixed,     // segments that cut blocks anywhere, the block grid (groups mix them)
  kCutAtEach  // the same segments, the groups cut where each starts (as tensors)
};

::testing::AssertionResult RunAndCheck(GradType type, Mode mode, size_t n, Layout layout, int steps,
                                       uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Hyper h{.lr = 1e-2f,
                .beta1 = 0.9f,
                .beta2 = 0.999f,
                .eps = 1e-8f,
                .weight_decay = 0.1f,
                .mode = mode};
  const bool segmented = layout != Layout::kOne;
  const std::vector<Segment> segs =
      segmented ? Segments(n, rng)
                : std::vector<Segment>{{.begin = 0, .end = n, .lr = h.lr, .weight_decay = 0.1f}};
  std::vector<size_t> starts;
  for (const Segment& sg : segs) starts.push_back(sg.begin);
  State8 s(n, seed % 5,
           layout == Layout::kCutAtEach ? QuantCuts(starts, n) : std::vector<size_t>{});
  s.Randomize(rng);
  std::vector<const Segment*> seg_of(n);
  for (const Segment& sg : segs) {
    for (size_t i = sg.begin; i < sg.end; ++i) seg_of[i] = &sg;
  }
  const std::vector<std::pair<size_t, size_t>> groups = Groups(n, s.cuts);
  std::vector<size_t> group_of(n);
  for (size_t k = 0; k < groups.size(); ++k) {
    for (size_t i = groups[k].first; i < groups[k].second; ++i) group_of[i] = k;
  }
  for (int step = 1; step <= steps; ++step) {
    s.NewGrads(rng);
    const std::vector<float> p0(s.p, s.p + n);
    const std::vector<uint8_t> m0 = s.m, v0 = s.v;
    const std::vector<float> ma0 = s.m_absmax, va0 = s.v_absmax;
    Result<StepResult> r = StepInt8(h, {.step = step}, s.View(type),
                                    segmented ? segs : std::vector<Segment>{}, SharedExecutor());
    if (!r.ok()) return ::testing::AssertionFailure() << "StepInt8: " << r.status();
    if (r->skipped) return ::testing::AssertionFailure() << "finite grads were skipped";

    const double b1 = h.beta1, b2 = h.beta2;
    const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
    // m_ref and v_ref, and the sums of the magnitudes of their terms (the
    // kernel's fp32 rounding error scales with those where terms cancel).
    std::vector<double> m_ref(n), v_ref(n), m_terms(n, 0.0), v_terms(n, 0.0);
    for (size_t i = 0; i < n; ++i) {
      const Segment& sg = *seg_of[i];
      const double m_old = CodeValue(QuantMap::kSigned, m0[i]) * ma0[group_of[i]];
      const double v_old = CodeValue(QuantMap::kUnsigned, v0[i]) * va0[group_of[i]];
      if (sg.frozen) {
        m_ref[i] = m_old;
        v_ref[i] = v_old;
        if (s.p[i] != p0[i])
          return ::testing::AssertionFailure() << "frozen param " << i << " moved";
      } else {
        const double lr = sg.lr, wd = sg.weight_decay;
        double g = s.RawGrad(type, i);
        double g_mag = std::fabs(g);
        if (mode == Mode::kAdam) {
          g += wd * p0[i];
          g_mag += std::fabs(wd * p0[i]);
        }
        m_ref[i] = b1 * m_old + (1 - b1) * g;
        v_ref[i] = b2 * v_old + (1 - b2) * g * g;
        const double denom = std::sqrt(v_ref[i]) / std::sqrt(bc2) + h.eps;
        const double decayed = mode == Mode::kAdamW ? p0[i] * (1.0 - lr * wd) : p0[i];
        const double p = decayed - (lr / bc1) * m_ref[i] / denom;
        const double m_mag = b1 * std::fabs(m_old) + (1 - b1) * g_mag;
        const double v_mag = b2 * v_old + (1 - b2) * g_mag * g_mag;
        m_terms[i] = m_mag;
        v_terms[i] = v_mag;
        const double update_mag =
            (lr / bc1) *
            (m_mag + std::fabs(m_ref[i]) * (1.0 + v_mag / std::max(v_ref[i], 1e-300))) / denom;
        if (std::fabs(s.p[i] - p) > 2e-6 * (std::fabs(decayed) + update_mag) + 1e-12) {
          return ::testing::AssertionFailure()
                 << "step " << step << " element " << i << ": p " << s.p[i] << " want " << p;
        }
      }
      if (s.out[i].bits != FloatToBf16(s.p[i]).bits) {
        return ::testing::AssertionFailure() << "element " << i << ": bf16 out is not the param";
      }
    }
    for (size_t b = 0; b < groups.size(); ++b) {
      const auto [lo, hi] = groups[b];
      bool updated = false;
      double ma = 0, va = 0, m_tol = 0, v_tol = 0;
      for (size_t i = lo; i < hi; ++i) {
        updated = updated || !seg_of[i]->frozen;
        ma = std::max(ma, std::fabs(m_ref[i]));
        va = std::max(va, v_ref[i]);
        m_tol = std::max(m_tol, 2e-6 * m_terms[i]);
        v_tol = std::max(v_tol, 2e-6 * v_terms[i]);
      }
      if (!updated) {  // untouched, to the bit
        if (s.m_absmax[b] != ma0[b] || s.v_absmax[b] != va0[b] ||
            !std::equal(s.m.begin() + lo, s.m.begin() + hi, m0.begin() + lo) ||
            !std::equal(s.v.begin() + lo, s.v.begin() + hi, v0.begin() + lo)) {
          return ::testing::AssertionFailure() << "frozen group " << b << " was written";
        }
        continue;
      }
      if (std::fabs(s.m_absmax[b] - ma) > m_tol + 1e-6 * ma ||
          std::fabs(s.v_absmax[b] - va) > v_tol + 1e-6 * va) {
        return ::testing::AssertionFailure()
               << "step " << step << " group " << b << ": absmax m " << s.m_absmax[b] << " want "
               << ma << ", v " << s.v_absmax[b] << " want " << va;
      }
      // The nearest code, or its neighbour where the fp32 value sits within
      // rounding of the midpoint between them.
      for (size_t i = lo; i < hi; ++i) {
        for (QuantMap map : {QuantMap::kSigned, QuantMap::kUnsigned}) {
          const bool is_m = map == QuantMap::kSigned;
          const double x = is_m ? m_ref[i] : v_ref[i];
          const double am = is_m ? ma : va;
          const uint8_t got = is_m ? s.m[i] : s.v[i];
          const int want = NearestCode(map, x, am);
          if (got == want) continue;
          const double mid = (CodeValue(map, got) + CodeValue(map, static_cast<uint8_t>(want))) / 2;
          const double terms = is_m ? m_terms[i] : v_terms[i];
          if (std::fabs(std::fabs(x) / am - std::fabs(mid)) >
              (2e-6 * terms + 1e-6 * std::fabs(x)) / am + 1e-5 * std::fabs(mid) + 1e-12) {
            return ::testing::AssertionFailure()
                   << "step " << step << " element " << i << ": " << (is_m ? "m" : "v") << " code "
                   << int{got} << " want " << want << " (value " << x << ", absmax " << am << ")";
          }
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

TEST_P(Int8Test, StepMatchesDoubleReference) {
  for (GradType type : {GradType::kBFloat16, GradType::kFloat32}) {
    for (Mode mode : {Mode::kAdamW, Mode::kAdam}) {
      for (Layout layout : {Layout::kOne, Layout::kMixed, Layout::kCutAtEach}) {
        for (size_t n :
             {size_t{1}, size_t{17}, kQuantBlock + 3, size_t{5000}, (size_t{1} << 16) + 9}) {
          const uint64_t seed = FreshSeed();
          SCOPED_TRACE(StrCat("target ", hwy::TargetName(GetParam()), ", n ", n, ", ",
                              type == GradType::kBFloat16 ? "bf16" : "fp32", " grads, ",
                              mode == Mode::kAdamW ? "AdamW" : "Adam",
                              layout == Layout::kOne     ? ""
                              : layout == Layout::kMixed ? ", segments"
                                                         : ", segments with groups of their own",
                              ", seed ", seed));
          ASSERT_TRUE(RunAndCheck(type, mode, n, layout, 3, seed));
        }
      }
    }
  }
}

TEST_P(Int8Test, BitwiseSameForAnyThreadCount) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("seed ", seed));
  const size_t n = 5 * kTileElements + 1234;
  std::vector<State8> states;
  for (int t = 0; t < 3; ++t) {
    std::mt19937_64 rng(seed);
    states.emplace_back(n, 0);
    states.back().Randomize(rng);
  }
  std::mt19937_64 seg_rng(seed + 1);
  const std::vector<Segment> segs = Segments(n, seg_rng);
  const Hyper h{.lr = 1e-2f, .weight_decay = 0.1f};
  for (int step = 1; step <= 3; ++step) {
    std::mt19937_64 grad_rng(seed + 100 + step);
    states[0].NewGrads(grad_rng);
    for (int t = 1; t < 3; ++t) {
      std::copy(states[0].g16, states[0].g16 + n, states[t].g16);
    }
    const int threads[] = {1, 2, 3};
    for (int t = 0; t < 3; ++t) {
      ASSERT_TRUE(StepInt8(h, {.step = step}, states[t].View(GradType::kBFloat16), segs,
                           SharedExecutor(threads[t]))
                      .ok());
    }
  }
  for (int t = 1; t < 3; ++t) {
    EXPECT_EQ(0, std::memcmp(states[0].p, states[t].p, n * sizeof(float)));
    EXPECT_EQ(states[0].m, states[t].m);
    EXPECT_EQ(states[0].v, states[t].v);
    EXPECT_EQ(states[0].m_absmax, states[t].m_absmax);
    EXPECT_EQ(states[0].v_absmax, states[t].v_absmax);
  }
}

TEST_P(Int8Test, NonFiniteGradsSkipTheStepAndWriteNothing) {
  const size_t n = 3000;
  std::mt19937_64 rng(7);
  State8 s(n, 1);
  s.Randomize(rng);
  s.NewGrads(rng);
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    s.g16[2222] = FloatToBf16(bad);
    const std::vector<float> p0(s.p, s.p + n);
    const std::vector<uint8_t> m0 = s.m, v0 = s.v;
    const std::vector<float> ma0 = s.m_absmax;
    const std::vector<bf16> out0(s.out, s.out + n);
    Result<StepResult> r =
        StepInt8({}, {.step = 1}, s.View(GradType::kBFloat16), {}, SharedExecutor());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->skipped);
    EXPECT_EQ(0, std::memcmp(p0.data(), s.p, n * 4));
    EXPECT_EQ(m0, s.m);
    EXPECT_EQ(v0, s.v);
    EXPECT_EQ(ma0, s.m_absmax);
    EXPECT_EQ(0, std::memcmp(out0.data(), s.out, n * 2));
    // Passed as prechecked, the kernel still notices.
    r = StepInt8({}, {.step = 1, .grad_check = GradCheck::kPrechecked}, s.View(GradType::kBFloat16),
                 {}, SharedExecutor());
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
    s.Randomize(rng);
  }
}

TEST(Int8ValidationTest, RejectsBadSegmentsAndBuffers) {
  State8 s(1000, 0);
  Executor& e = SharedExecutor();
  auto code = [&](const std::vector<Segment>& segs) {
    return StepInt8({}, {.step = 1}, s.View(GradType::kBFloat16), segs, e).status().code();
  };
  EXPECT_EQ(code({{.begin = 0, .end = 1000, .lr = 1e-3f}}), StatusCode::kOk);
  EXPECT_EQ(code({{.begin = 0, .end = 999, .lr = 1e-3f}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{.begin = 1, .end = 1000, .lr = 1e-3f}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{.begin = 0, .end = 500, .lr = 1e-3f}, {.begin = 400, .end = 1000, .lr = 1e-3f}}),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{.begin = 0, .end = 1000, .lr = -1.0f}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{.begin = 0, .end = 1000, .lr = 1e-3f, .weight_decay = NAN}}),
            StatusCode::kInvalidArgument);
  Int8Shard bad = s.View(GradType::kBFloat16);
  bad.moments.v_absmax = nullptr;
  EXPECT_EQ(StepInt8({}, {.step = 1}, bad, {}, e).status().code(), StatusCode::kInvalidArgument);
  bad = s.View(GradType::kBFloat16);
  bad.moments.v = bad.moments.m + 10;
  EXPECT_EQ(StepInt8({}, {.step = 1}, bad, {}, e).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(StepInt8({}, {.step = 0}, s.View(GradType::kBFloat16), {}, e).status().code(),
            StatusCode::kInvalidArgument);
  // Cuts not as QuantCuts makes them (the absmax arrays are sized by them).
  for (const std::vector<size_t>& cuts :
       std::vector<std::vector<size_t>>{{0}, {1000}, {256}, {300, 300}, {600, 300}, {2000}}) {
    bad = s.View(GradType::kBFloat16);
    bad.moments.cuts = cuts;
    Status st = StepInt8({}, {.step = 1}, bad, {}, e).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  }
  const std::vector<size_t> ok_cuts =
      QuantCuts(std::vector<size_t>{0, 600, 256, 300, 300, 1000}, 1000);
  EXPECT_EQ(ok_cuts, (std::vector<size_t>{300, 600}));
  EXPECT_EQ(QuantGroups(1000, ok_cuts), QuantBlocks(1000) + 2);
}

// One step of `g` on fp32 states (p32, m32, v32) and on 8-bit ones (p8, q).
::testing::AssertionResult StepBoth(const Hyper& h, int step, const std::vector<float>& g,
                                    std::vector<float>& p32, std::vector<float>& m32,
                                    std::vector<float>& v32, std::vector<float>& p8,
                                    adam_testing::Int8Moments& q) {
  const Shard fp32{.count = g.size(),
                   .grads = g.data(),
                   .grad_type = GradType::kFloat32,
                   .params = p32.data(),
                   .exp_avg = m32.data(),
                   .exp_avg_sq = v32.data()};
  if (Status s = Step(h, {.step = step}, fp32, SharedExecutor()).status(); !s.ok()) {
    return ::testing::AssertionFailure() << s;
  }
  Shard int8 = fp32;
  int8.params = p8.data();
  if (Status s = StepInt8(h, {.step = step}, q.ShardOf(int8), {}, SharedExecutor()).status();
      !s.ok()) {
    return ::testing::AssertionFailure() << s;
  }
  return ::testing::AssertionSuccess();
}

// A tensor whose grads are 1e4 times smaller than its neighbour's in the
// same shard: with groups cut where it starts its 8-bit steps follow fp32's.
// Sharing a block with the neighbour (its absmax), its v fell below the
// smallest code and read as 0, and its steps grew tenfold and more.
TEST(Int8TrainingTest, ASmallTensorBesideALargeOneStepsAsInFp32) {
  const size_t big = 128, small = 384, n = big + small;  // the small one starts mid-block
  const std::vector<size_t> starts = {0, big};
  adam_testing::Int8Moments q(n, starts);
  ASSERT_EQ(q.cuts, std::vector<size_t>{big});
  std::vector<float> p8(n, 0.5f), p32(n, 0.5f), m32(n, 0.0f), v32(n, 0.0f), g(n);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const Hyper h{.lr = 1e-3f, .weight_decay = 0.0f};
  double moved8 = 0, moved32 = 0;  // the small tensor's summed |step|
  for (int step = 1; step <= 300; ++step) {
    for (size_t i = 0; i < n; ++i) g[i] = normal(rng) * (i < big ? 1e-2f : 1e-6f);
    const std::vector<float> before8(p8), before32(p32);
    ASSERT_TRUE(StepBoth(h, step, g, p32, m32, v32, p8, q));
    for (size_t i = big; i < n; ++i) {
      moved8 += std::fabs(p8[i] - before8[i]);
      moved32 += std::fabs(p32[i] - before32[i]);
    }
  }
  std::printf("the small tensor moved %.4g with 8-bit states, %.4g with fp32\n", moved8, moved32);
  EXPECT_LT(moved8, 1.25 * moved32);
  EXPECT_GT(moved8, 0.8 * moved32);
}

// Within one block, an element whose grads are 1e4 (up to 1e6) times
// smaller than the others': its v fell below v's smallest code and read as
// 0 while its m (whose map reaches lower) was kept, and once its grad was 0
// it stepped by lr * m / eps: 7e4 in one step for lr 1e-3. Its steps stay
// within fp32's now.
TEST(Int8TrainingTest, AnElementWithTinyGradsInABlockOfLargeOnesStepsNoFartherThanInFp32) {
  for (const float ratio : {1e3f, 1e4f, 1e6f}) {
    SCOPED_TRACE(ratio);
    const size_t n = kQuantBlock;
    adam_testing::Int8Moments q(n);
    std::vector<float> p8(n, 0.5f), p32(n, 0.5f), m32(n, 0.0f), v32(n, 0.0f), g(n);
    const Hyper h{.lr = 1e-3f, .weight_decay = 0.0f};
    for (int step = 1; step <= 40; ++step) {
      // Half the block large grads every step; element 200 grads of 1 for
      // three steps, then none.
      for (size_t i = 0; i < n; ++i) g[i] = i < n / 2 ? ratio : 0.0f;
      g[200] = step <= 3 ? 1.0f : 0.0f;
      const float before8 = p8[200], before32 = p32[200];
      ASSERT_TRUE(StepBoth(h, step, g, p32, m32, v32, p8, q));
      // (fp32's steps are about lr; the first three are exactly as fp32's.)
      ASSERT_LE(std::fabs(p8[200] - before8), 1.01 * std::max(std::fabs(p32[200] - before32), h.lr))
          << "step " << step << ": " << before8 << " -> " << p8[200] << " (fp32 " << before32
          << " -> " << p32[200] << ")";
    }
  }
}

// Least squares on a fixed batch, y = X w*: the 8-bit moments' loss curve
// tracks fp32's.
TEST(Int8TrainingTest, LossTracksFp32OnAFixedBatch) {
  const size_t dim = 512, rows = 64;
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * dim), w_true(dim), y(rows);
  for (float& v : x) v = normal(rng);
  for (float& v : w_true) v = normal(rng) * 0.1f;
  for (size_t r = 0; r < rows; ++r) {
    double acc = 0;
    for (size_t j = 0; j < dim; ++j) acc += x[r * dim + j] * w_true[j];
    y[r] = static_cast<float>(acc);
  }
  auto loss_and_grad = [&](const std::vector<float>& w, std::vector<float>& g) {
    std::fill(g.begin(), g.end(), 0.0f);
    double loss = 0;
    for (size_t r = 0; r < rows; ++r) {
      double pred = 0;
      for (size_t j = 0; j < dim; ++j) pred += x[r * dim + j] * w[j];
      const double err = pred - y[r];
      loss += err * err / rows;
      for (size_t j = 0; j < dim; ++j) g[j] += static_cast<float>(2 * err * x[r * dim + j] / rows);
    }
    return loss;
  };
  const Hyper h{.lr = 3e-3f, .weight_decay = 0.0f};
  std::vector<float> w32(dim, 0.0f), m32(dim, 0.0f), v32(dim, 0.0f), g(dim);
  std::vector<float> w8(dim, 0.0f), ma(QuantBlocks(dim)), va(QuantBlocks(dim));
  std::vector<uint8_t> m8(dim, 0), v8(dim, 0);
  double l32 = 0, l8 = 0, first = 0;
  for (int step = 1; step <= 300; ++step) {
    l32 = loss_and_grad(w32, g);
    if (step == 1) first = l32;
    ASSERT_TRUE(Step(h, {.step = step},
                     {.count = dim,
                      .grads = g.data(),
                      .grad_type = GradType::kFloat32,
                      .params = w32.data(),
                      .exp_avg = m32.data(),
                      .exp_avg_sq = v32.data()},
                     SharedExecutor())
                    .ok());
    l8 = loss_and_grad(w8, g);
    ASSERT_TRUE(StepInt8(h, {.step = step},
                         {.count = dim,
                          .grads = g.data(),
                          .grad_type = GradType::kFloat32,
                          .params = w8.data(),
                          .moments = {.m = m8.data(),
                                      .v = v8.data(),
                                      .m_absmax = ma.data(),
                                      .v_absmax = va.data(),
                                      .cuts = {}}},
                         {}, SharedExecutor())
                    .ok());
  }
  std::printf("least squares, 300 steps: loss %.4g -> fp32 %.4g, int8 %.4g\n", first, l32, l8);
  EXPECT_LT(l32, 0.05 * first);
  EXPECT_LT(l8, 0.05 * first);
  EXPECT_NEAR(l8, l32, 0.2 * l32 + 1e-3 * first);
}

}  // namespace
}  // namespace ztier::cpu_adam
