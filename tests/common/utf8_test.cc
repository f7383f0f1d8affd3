// Tests of common/utf8: decoding, what names are checked by; the printable
// form of text from outside (errors, names on a terminal); display widths
// that align tables of names.
#include "common/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace ztier {
namespace {

TEST(Utf8Test, DecodesWellFormedAndRefusesTheRest) {
  EXPECT_EQ(DecodeUtf8("a", 0).code_point, 'a');
  const std::string cjk = "\u6570";  // 3 bytes
  EXPECT_EQ(DecodeUtf8(cjk, 0).length, 3u);
  EXPECT_EQ(DecodeUtf8(cjk, 0).code_point, 0x6570u);
  EXPECT_EQ(DecodeUtf8(cjk.substr(0, 2), 0).length, 0u) << "truncated";
  EXPECT_EQ(DecodeUtf8("\xc0\xaf", 0).length, 0u) << "overlong";
  EXPECT_EQ(DecodeUtf8("\xed\xa0\x80", 0).length, 0u) << "surrogate";
  EXPECT_EQ(DecodeUtf8("\x80", 0).length, 0u) << "a continuation byte first";
}

TEST(Utf8Test, PrintableTextHidesControlsAndBadBytes) {
  EXPECT_EQ(PrintableUtf8(std::string("a\0b", 3)), "a?b");  // a NUL no longer cuts the text
  EXPECT_EQ(PrintableUtf8("x\x1b[31my\n"), "x?[31my?");
  EXPECT_EQ(PrintableUtf8("\xc2\x9b"), "?") << "C1 CSI";
  EXPECT_EQ(PrintableUtf8("\xff"
                          "ok"),
            "?ok");
  EXPECT_EQ(PrintableUtf8("caf\u00e9 \u6570"), "caf\u00e9 \u6570");
}

TEST(Utf8Test, DisplayWidthCountsTerminalColumns) {
  EXPECT_EQ(DisplayWidth("job-1"), 5u);
  EXPECT_EQ(DisplayWidth("\u00fcn\u00ef"), 3u);
  EXPECT_EQ(DisplayWidth("\u540d\u524d"), 4u) << "two wide characters";
  EXPECT_EQ(DisplayWidth("e\u0301"), 1u) << "a combining accent takes no column";
  EXPECT_EQ(DisplayWidth("\xff"), 1u);
}

}  // namespace
}  // namespace ztier
