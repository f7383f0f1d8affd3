// ztier cpu_adam: the dynamic quantization maps of the 8-bit states and
// their lookup tables (see QuantTables in kernels.h), built once on first
// use from double arithmetic rounded to fp32, so every SIMD target and the
// tests' reference see the same values. Thread-safe (function-local
// statics); a table that breaks its own invariant aborts at build time.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_adam/kernels.h"

namespace ztier::cpu_adam {
namespace internal {
namespace {

// Magnitudes of a map with `bits` bits: 0, then for each decade 10^-e (e
// from bits - 2 down to 0, ascending values) 2^(bits - 2 - e) values at the
// upper ends of equal steps of [0.1, 1] x 10^-e. Magnitude code c >= 1 has
// its top set bit at `pos` = bits - 2 - e and f = c - 2^pos; its value is
// fma(step[pos], f + 1, base[pos]) in fp32 (base = 0.1 x 10^-e, step =
// 0.9 x 10^-e / 2^pos), which the kernels evaluate the same way with a fused
// multiply-add where the target has one. The largest is exactly 1.
std::vector<float> Magnitudes(int bits, float* base, float* step) {
  std::vector<float> v = {0.0f};
  const int decades = bits - 1;
  for (int pos = 0; pos < decades; ++pos) {
    const int e = decades - 1 - pos;
    const int n = 1 << pos;
    const double scale = std::pow(10.0, -e);
    base[pos] = static_cast<float>(0.1 * scale);
    step[pos] = static_cast<float>(0.9 * scale / n);
    for (int f = 0; f < n; ++f) {
      v.push_back(std::fma(step[pos], static_cast<float>(f + 1), base[pos]));
    }
  }
  return v;
}

// The decade estimate of QuantLanes for a in [0, 1]: ceil(fma(bits(a), scale,
// offset)) clamped to [0, decades - 1]. bits(a) / 2^23 - 127 is below
// log2(a) by at most 0.0861, so the estimate is ceil(log10(a)) + decades - 1
// or one less; the offset's 1e-4 margin covers the rounding of the
// conversion and of the tops (fp32 powers of ten) and keeps the same bounds.
constexpr double kLog10Of2 = 0.30102999566398120;

int EstimateDecade(float a, float scale, float offset, int decades) {
  const float bits = static_cast<float>(std::bit_cast<int32_t>(a));
  const float est = std::ceil(std::fma(bits, scale, offset));
  return static_cast<int>(std::clamp(est, 0.0f, static_cast<float>(decades - 1)));
}

struct Built {
  QuantTables tables;
  std::vector<float> value, upper;
  alignas(64) float base[16] = {};
  alignas(64) float step[16] = {};
  alignas(64) float top[16] = {};
  alignas(64) float inv_step[16] = {};
  alignas(64) float place_offset[16] = {};
  alignas(64) float below_code[16] = {};
  alignas(64) int32_t octave_decade[kOctaves] = {};

  explicit Built(bool is_signed) {
    const int bits = is_signed ? 8 : 9;
    const int decades = bits - 1;
    const std::vector<float> mag = Magnitudes(bits, base, step);
    const size_t k = mag.size();
    ZT_CHECK(k == (is_signed ? 128u : 256u));
    ZT_CHECK_MSG(mag.back() == 1.0f, "the largest code of a quantization map is not 1");
    for (size_t c = 1; c < k; ++c) ZT_CHECK_MSG(mag[c - 1] < mag[c], "map not ascending");
    value.resize(256);
    for (size_t c = 0; c < 256; ++c) {
      value[c] = is_signed ? (c < 128 ? mag[c] : -mag[c - 128]) : mag[c];
    }
    upper.resize(k);
    for (size_t c = 0; c + 1 < k; ++c) {
      upper[c] = static_cast<float>((static_cast<double>(mag[c]) + mag[c + 1]) / 2.0);
    }
    upper[k - 1] = 2.0f;
    double place_scale[16], place_origin[16];  // place = (a - origin) * scale
    for (int pos = 0; pos < 16; ++pos) {
      const int p = std::min(pos, decades - 1);
      base[pos] = base[p];
      step[pos] = step[p];
      top[pos] = mag[(size_t{2} << p) - 1];
      below_code[pos] = static_cast<float>((1 << p) - 1 + (1 << 23));
      // The lowest decade's code below is 0, of value 0: its places count
      // from 0 in steps of its one code's value.
      place_origin[pos] = p == 0 ? 0.0 : static_cast<double>(base[p]);
      place_scale[pos] = p == 0 ? 1.0 / mag[1] : 1.0 / static_cast<double>(step[p]);
      inv_step[pos] = static_cast<float>(place_scale[pos]);
      place_offset[pos] = static_cast<float>(-place_origin[pos] * place_scale[pos]);
    }
    // Every code sits at its integer place and every midpoint at j + 1/2, to
    // well within the slack QuantLanes allows.
    for (size_t c = 0; c + 1 < k; ++c) {
      const int p = c + 1 < 2 ? 0 : std::bit_width(c + 1) - 1;  // decade of c + 1
      const double j = static_cast<double>(c) - (below_code[p] - (1 << 23));
      const double place_c = (mag[c] - place_origin[p]) * place_scale[p];
      const double place_mid = (upper[c] - place_origin[p]) * place_scale[p];
      ZT_CHECK_MSG(std::fabs(place_c - j) < kMidpointSlack / 4, "a code is off its place");
      ZT_CHECK_MSG(std::fabs(place_mid - (j + 0.5)) < kMidpointSlack / 4,
                   "a midpoint is off its place");
    }
    const float log_scale = static_cast<float>(kLog10Of2 / (1 << 23));
    const float log_offset = static_cast<float>(decades - 1 - 127 * kLog10Of2 - 1e-4);
    // The estimate is the decade or the one below it at both ends of every
    // decade, so everywhere (it does not decrease with a).
    for (int pos = 0; pos < decades; ++pos) {
      const float lo = pos == 0 ? 0.0f : std::nextafter(top[pos - 1], 2.0f);
      const int at_lo = EstimateDecade(lo, log_scale, log_offset, decades);
      const int at_hi = EstimateDecade(top[pos], log_scale, log_offset, decades);
      ZT_CHECK_MSG(at_lo >= pos - 1 && at_hi <= pos, "decade estimate out of bounds");
    }
    // Each octave's lowest value's decade; the decade of any value in the
    // octave is that one or the next (checked at the octave's top).
    const auto decade_of = [&](float a) {
      int pos = 0;
      while (pos + 1 < decades && a > top[pos]) ++pos;
      return pos;
    };
    for (int32_t o = 0; o < kOctaves; ++o) {
      const float lo = std::bit_cast<float>((o + kOctaveFloor) << 23);
      const float hi = std::min(std::nextafter(2.0f * lo, 0.0f), 1.0f);
      octave_decade[o] = decade_of(lo);
      const int at_hi = decade_of(hi);
      ZT_CHECK_MSG(at_hi == octave_decade[o] || at_hi == octave_decade[o] + 1,
                   "an octave spans more than two decades");
    }
    ZT_CHECK_MSG(decade_of(std::bit_cast<float>(kOctaveFloor << 23)) == 0,
                 "the lowest octave is above the lowest decade");
    tables = {.is_signed = is_signed,
              .decades = decades,
              .value = value.data(),
              .upper = upper.data(),
              .base = base,
              .step = step,
              .top = top,
              .inv_step = inv_step,
              .place_offset = place_offset,
              .below_code = below_code,
              .log_scale = log_scale,
              .log_offset = log_offset,
              .octave_decade = octave_decade};
  }
};

}  // namespace

const QuantTables& Tables(QuantMap map) {
  static const Built kSigned(true);
  static const Built kUnsigned(false);
  return map == QuantMap::kSigned ? kSigned.tables : kUnsigned.tables;
}

}  // namespace internal

const float* QuantMapValues(QuantMap map) { return internal::Tables(map).value; }

}  // namespace ztier::cpu_adam
