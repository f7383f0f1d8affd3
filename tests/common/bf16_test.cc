// Exact tests of the scalar fp32 <-> bf16 conversions (the reference the SIMD
// kernels are held to): ties to even, NaN, infinities, rounding into the
// exponent, subnormals, signed zero.
#include "common/bf16.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include <gtest/gtest.h>

namespace ztier {
namespace {

uint16_t Bits(float f) { return FloatToBf16(f).bits; }
float F(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST(Bf16Test, ExactValuesRoundTrip) {
  for (float f : {0.0f, 1.0f, -2.0f, 0.5f, 3.0f, 1.0f / 128}) {
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(f)), f) << f;
  }
  EXPECT_EQ(Bits(1.0f), 0x3f80);
  EXPECT_EQ(Bits(-0.0f), 0x8000);
}

TEST(Bf16Test, TiesRoundToEven) {
  EXPECT_EQ(Bits(F(0x3f808000)), 0x3f80);  // tie, low bit 0: stays
  EXPECT_EQ(Bits(F(0x3f818000)), 0x3f82);  // tie, low bit 1: up to even
  EXPECT_EQ(Bits(F(0xbf818000)), 0xbf82);  // negative tie
  EXPECT_EQ(Bits(F(0x3f808001)), 0x3f81);  // just above the tie: up
  EXPECT_EQ(Bits(F(0x3f807fff)), 0x3f80);  // just below the tie: down
}

TEST(Bf16Test, RoundingCarriesIntoTheExponent) {
  EXPECT_EQ(Bits(F(0x3fffffff)), 0x4000);  // 1.99999988 -> 2.0
  EXPECT_EQ(Bits(F(0x3fff8000)), 0x4000);  // tie with odd mantissa -> next binade
  EXPECT_EQ(Bits(F(0x7f7fffff)), 0x7f80);  // FLT_MAX rounds to +Inf
  EXPECT_EQ(Bits(F(0xff7fffff)), 0xff80);  // -FLT_MAX rounds to -Inf
  EXPECT_EQ(Bits(F(0x7f7f7fff)), 0x7f7f);  // largest that stays finite
}

TEST(Bf16Test, Infinities) {
  EXPECT_EQ(Bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(Bits(-std::numeric_limits<float>::infinity()), 0xff80);
}

// Finite in bf16: up to the largest bf16 and what rounds to it; the fp32
// values from the halfway point up round to Inf.
TEST(Bf16Test, FiniteInBf16StopsWhereRoundingReachesInf) {
  EXPECT_TRUE(FiniteInBf16(0.0f));
  EXPECT_TRUE(FiniteInBf16(-1e-45f));
  EXPECT_TRUE(FiniteInBf16(F(0x7f7f0000)));    // the largest bf16
  EXPECT_TRUE(FiniteInBf16(F(0x7f7f7fff)));    // just under halfway: rounds down
  EXPECT_FALSE(FiniteInBf16(F(0x7f7f8000)));   // halfway: to even, Inf
  EXPECT_FALSE(FiniteInBf16(-F(0x7f7fffff)));  // the largest fp32
  EXPECT_FALSE(FiniteInBf16(std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(FiniteInBf16(std::numeric_limits<float>::quiet_NaN()));
}

TEST(Bf16Test, NaNStaysQuietNaNWithSign) {
  EXPECT_EQ(Bits(std::numeric_limits<float>::quiet_NaN()), 0x7fc0);
  EXPECT_EQ(Bits(-std::numeric_limits<float>::quiet_NaN()), 0xffc0);
  // A signalling NaN whose payload lives only in the low 16 bits would round
  // to Inf with a plain add; it must stay a NaN.
  EXPECT_EQ(Bits(F(0x7f800001)), 0x7fc0);
  EXPECT_EQ(Bits(F(0x7fffffff)), 0x7fff);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(F(0xff800001)))));
}

TEST(Bf16Test, SubnormalsAreRoundedNotFlushed) {
  EXPECT_EQ(Bits(F(0x00010000)), 0x0001);  // smallest bf16 subnormal, exact
  EXPECT_EQ(Bits(F(0x00008000)), 0x0000);  // half of it: tie to even (0)
  EXPECT_EQ(Bits(F(0x00018000)), 0x0002);  // 1.5: tie to even (2)
  EXPECT_EQ(Bits(F(0x00008001)), 0x0001);  // just above half: up
  EXPECT_EQ(Bits(F(0x807fffff)), 0x8080);  // largest subnormal rounds to -FLT_MIN
  EXPECT_EQ(Bits(F(0x00000001)), 0x0000);  // tiny: to zero
}

TEST(Bf16Test, MatchesLongHandRoundingOnAGrid) {
  // Compare with rounding done in double arithmetic on a sweep of bit patterns.
  for (uint32_t hi = 0; hi < 0x7f80; hi += 0x13) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const uint32_t u = (hi << 16) | lo;
      const double x = F(u);
      const double down = Bf16ToFloat(bf16{static_cast<uint16_t>(hi)});
      const double up = Bf16ToFloat(bf16{static_cast<uint16_t>(hi + 1)});
      uint16_t want;
      if (x - down < up - x)
        want = static_cast<uint16_t>(hi);
      else if (x - down > up - x)
        want = static_cast<uint16_t>(hi + 1);
      else
        want = static_cast<uint16_t>((hi & 1) ? hi + 1 : hi);
      ASSERT_EQ(Bits(F(u)), want) << std::hex << u;
    }
  }
}

}  // namespace
}  // namespace ztier
