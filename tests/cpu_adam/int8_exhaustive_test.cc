// Quantization against a brute-force nearest code for every float in
// [0, 1] (and, for m's signed map, its negation), on every compiled Highway
// target: about 10^9 values per map, so label slow. The kernels round a
// place computed in fp32 and fall back to a midpoint comparison only near a
// midpoint; this proves the two agree with the exact answer everywhere, not
// just at the probes of int8_test.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "cpu_adam/adamw.h"
#include "hwy/highway.h"
#include "hwy/tests/hwy_gtest.h"

namespace ztier::cpu_adam {
namespace {

class Int8ExhaustiveTest : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(Int8ExhaustiveTest);

TEST_P(Int8ExhaustiveTest, EveryFloatInZeroOneGetsTheNearestCode) {
  constexpr uint32_t kOne = 0x3f800000u;  // bits of 1.0f
  constexpr size_t kChunk = size_t{1} << 20;
  for (QuantMap map : {QuantMap::kSigned, QuantMap::kUnsigned}) {
    const bool is_signed = map == QuantMap::kSigned;
    const float* values = QuantMapValues(map);
    const size_t k = is_signed ? 128 : 256;
    // Midpoints as the tables define them (in double, rounded to fp32):
    // the nearest magnitude of a is the number of midpoints below a.
    std::vector<float> mids;
    for (size_t c = 0; c + 1 < k; ++c) {
      mids.push_back(static_cast<float>((static_cast<double>(values[c]) + values[c + 1]) / 2.0));
    }
    std::vector<float> x(kChunk);
    std::vector<uint8_t> codes(kChunk);
    std::vector<float> absmax(QuantBlocks(kChunk));
    size_t mismatches = 0;
    for (uint64_t first = 0; first <= kOne; first += kChunk) {
      for (size_t i = 0; i < kChunk; ++i) {
        // Each block starts with 1, so its absmax is 1 and the others are
        // quantized as they are.
        const uint32_t bits = i % kQuantBlock == 0
                                  ? kOne
                                  : static_cast<uint32_t>(std::min<uint64_t>(first + i, kOne));
        const float a = std::bit_cast<float>(bits);
        x[i] = is_signed && i % 2 == 1 ? -a : a;
      }
      Quantize(map, x.data(), kChunk, codes.data(), absmax.data());
      for (size_t i = 0; i < kChunk; ++i) {
        const float a = x[i] < 0 ? -x[i] : x[i];
        const int mag =
            static_cast<int>(std::lower_bound(mids.begin(), mids.end(), a) - mids.begin());
        const int want = is_signed ? (x[i] < 0 && mag != 0 ? mag | 0x80 : mag)
                                   : (x[i] > 0 && mag == 0 ? 1 : mag);  // a positive v never 0
        if (codes[i] != want && ++mismatches <= 10) {
          ADD_FAILURE() << (is_signed ? "m" : "v") << " value " << x[i] << " (bits 0x" << std::hex
                        << std::bit_cast<uint32_t>(x[i]) << std::dec << ") got code "
                        << int{codes[i]} << ", nearest is " << want << " on "
                        << hwy::TargetName(GetParam());
        }
      }
    }
    EXPECT_EQ(mismatches, 0u) << (is_signed ? "m" : "v");
  }
}

}  // namespace
}  // namespace ztier::cpu_adam
