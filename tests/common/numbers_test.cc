// Tests for the size grammar and the checked arithmetic (common/numbers.h).
#include "common/numbers.h"

#include <gtest/gtest.h>

namespace ztier {
namespace {

TEST(NumbersTest, SizesWithSuffixes) {
  EXPECT_EQ(*ParseSize("0"), 0u);
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("64K"), 64u << 10);
  EXPECT_EQ(*ParseSize("64k"), 64u << 10);
  EXPECT_EQ(*ParseSize("16Mi"), 16u << 20);
  EXPECT_EQ(*ParseSize("2GB"), uint64_t{2} << 30);
  EXPECT_EQ(*ParseSize("1TiB"), uint64_t{1} << 40);
  // A whole number as the config's JSON may write it: the same in a
  // variable as in the file.
  EXPECT_EQ(*ParseSize("1e9"), 1000000000u);
  EXPECT_EQ(*ParseSize("1.5e9"), 1500000000u);
  EXPECT_EQ(*ParseSize("1500000000.0"), 1500000000u);
  EXPECT_FALSE(ParseSize("9007199254740993.0").ok());  // past 2^53: not exact
}

TEST(NumbersTest, RejectsWhatIsNotAWholeSize) {
  for (const char* bad :
       {"", "nan", "inf", "1e30", "-1", "+5", "1.5G", "12X", "G", " 1", "1 ", "1.5", "1e-3",
        "2.5e0", "1e9K", "18446744073709551616.0", "0x10", "18446744073709551616", "16777216T",
        // an "i" with no unit before it (read as 64 bytes)
        "64i", "64iB"}) {
    Result<uint64_t> r = ParseSize(bad);
    EXPECT_FALSE(r.ok()) << "'" << bad << "' parsed as " << (r.ok() ? *r : 0);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    }
  }
}

TEST(NumbersTest, FormatIsExact) {
  EXPECT_EQ(FormatSize(0), "0");
  EXPECT_EQ(FormatSize(1000), "1000");
  EXPECT_EQ(FormatSize(3u << 20), "3M");
  EXPECT_EQ(FormatSize((uint64_t{1} << 30) + 1024), "1048577K");
  EXPECT_EQ(*ParseSize(FormatSize(uint64_t{5} << 40)), uint64_t{5} << 40);
}

TEST(NumbersTest, SecondsReadToTheMillisecond) {
  using std::chrono::milliseconds;
  EXPECT_EQ(FormatSeconds(std::chrono::minutes(10)), "600 s");
  EXPECT_EQ(FormatSeconds(milliseconds(100)), "0.1 s");
  EXPECT_EQ(FormatSeconds(milliseconds(2500)), "2.5 s");
  EXPECT_EQ(FormatSeconds(milliseconds(1)), "0.001 s");
  EXPECT_EQ(FormatSeconds(milliseconds(0)), "0 s");
}

TEST(NumbersTest, CheckedArithmetic) {
  EXPECT_EQ(CheckedMul(1u << 20, 1u << 20), uint64_t{1} << 40);
  EXPECT_FALSE(CheckedMul(uint64_t{1} << 32, uint64_t{1} << 32).has_value());
  EXPECT_EQ(CheckedAdd(1, 2), 3u);
  EXPECT_FALSE(CheckedAdd(UINT64_MAX, 1).has_value());
}

}  // namespace
// One grammar for a uid, in ztierctl and ztierd --allow-uid alike (ztierd
// took numbers only).
TEST(NumbersTest, UidsAreNumbersOrUserNames) {
  EXPECT_EQ(*ParseUid("0"), 0u);
  EXPECT_EQ(*ParseUid("4242"), 4242u);
  EXPECT_EQ(*ParseUid("root"), 0u);
  EXPECT_EQ(ParseUid("4294967295").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseUid("-1").status().message(), "'-1' is not a uid, nor a user's name here");
  EXPECT_EQ(ParseUid("no-such-user-here").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace ztier
