// ztier cpu_adam: the dynamic quantization maps of the 8-bit states and
// their lookup tables (see QuantTables in kernels.h), built once on first
// use from double arithmetic rounded to fp32, so every SIMD target and the
// tests' reference see the same values. Thread-safe (function-local
// statics); a table that breaks its own invariant aborts at build time.
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

int32_t Bits(float x) { return std::bit_cast<int32_t>(x); }

struct Built {
  QuantTables tables;
  std::vector<float> value, upper;
  std::vector<int32_t> bucket;
  alignas(64) float decade_base[16] = {};
  alignas(64) float decade_step[16] = {};

  Built(bool is_signed, int bucket_bits) {
    const std::vector<float> mag = Magnitudes(is_signed ? 8 : 9, decade_base, decade_step);
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
    // Buckets from two binades below the smallest midpoint up to 1.0: the
    // lowest binade holds no midpoint, so a value below it, clamped into
    // bucket 0, gets magnitude 0 whatever its low bits.
    const int shift = 23 - bucket_bits;
    const int32_t low_mask = (1 << shift) - 1;
    const int32_t lowest =
        std::bit_cast<int32_t>(std::bit_cast<uint32_t>(upper[0] / 2) & 0xff800000u);
    const int32_t base = lowest >> shift;
    const int32_t buckets = (Bits(1.0f) >> shift) - base + 1;
    bucket.resize(static_cast<size_t>(buckets));
    size_t c = 0;  // magnitudes whose upper midpoint is below the bucket's low end
    for (int32_t i = 0; i < buckets; ++i) {
      const float lo = std::bit_cast<float>((base + i) << shift);
      while (c + 1 < k && upper[c] < lo) ++c;
      // At most one midpoint in [lo, next lo): the one-step correction finds
      // the nearest magnitude. Its low bits go in the entry (all ones: none).
      const float hi = std::bit_cast<float>((base + i + 1) << shift);
      size_t mids = 0;
      for (size_t j = c; j + 1 < k && upper[j] < hi; ++j) ++mids;
      ZT_CHECK_MSG(mids <= 1, "quantization bucket too coarse");
      ZT_CHECK_MSG(i > 0 || mids == 0, "quantization bucket 0 holds a midpoint");
      const int32_t mid_low = mids == 1 ? (Bits(upper[c]) & low_mask) : low_mask;
      bucket[static_cast<size_t>(i)] = (mid_low << 8) | static_cast<int32_t>(c);
    }
    tables = {.is_signed = is_signed,
              .base = base,
              .buckets = buckets,
              .value = value.data(),
              .upper = upper.data(),
              .bucket = bucket.data(),
              .decade_base = decade_base,
              .decade_step = decade_step};
  }
};

}  // namespace

const QuantTables& Tables(QuantMap map) {
  static const Built kSigned(true, kSignedBucketBits);
  static const Built kUnsigned(false, kUnsignedBucketBits);
  return map == QuantMap::kSigned ? kSigned.tables : kUnsigned.tables;
}

}  // namespace internal

const float* QuantMapValues(QuantMap map) { return internal::Tables(map).value; }

}  // namespace ztier::cpu_adam
