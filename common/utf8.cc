// UTF-8 decoding (see utf8.h).
#include "common/utf8.h"

namespace ztier {

Utf8Char DecodeUtf8(std::string_view text, size_t i) {
  const auto c = static_cast<unsigned char>(text[i]);
  const size_t len = c < 0x80           ? 1
                     : (c >> 5) == 0x6  ? 2
                     : (c >> 4) == 0xe  ? 3
                     : (c >> 3) == 0x1e ? 4
                                        : 0;
  if (len == 0 || i + len > text.size()) return {};
  uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
  for (size_t k = 1; k < len; ++k) {
    const auto cc = static_cast<unsigned char>(text[i + k]);
    if ((cc >> 6) != 0x2) return {};
    cp = (cp << 6) | (cc & 0x3f);
  }
  constexpr uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};  // shorter forms are overlong
  if (cp < kLeast[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return {};
  return {.length = len, .code_point = cp};
}

std::string PrintableUtf8(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const Utf8Char ch = DecodeUtf8(text, i);
    const uint32_t cp = ch.code_point;
    if (ch.length == 0 || cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0x9f)) {
      out += '?';  // one for a control character, one for each byte that is not UTF-8
      i += ch.length == 0 ? 1 : ch.length;
    } else {
      out.append(text.substr(i, ch.length));
      i += ch.length;
    }
  }
  return out;
}

size_t DisplayWidth(std::string_view text) {
  size_t width = 0;
  for (size_t i = 0; i < text.size();) {
    const Utf8Char ch = DecodeUtf8(text, i);
    if (ch.length == 0) {
      width += 1;
      i += 1;
      continue;
    }
    const uint32_t cp = ch.code_point;
    i += ch.length;
    if ((cp >= 0x0300 && cp <= 0x036f) || (cp >= 0x200b && cp <= 0x200f) ||
        (cp >= 0xfe00 && cp <= 0xfe0f)) {
      continue;  // combining marks, zero-width spaces, variation selectors
    }
    const bool wide = (cp >= 0x1100 && cp <= 0x115f) || (cp >= 0x2e80 && cp <= 0xa4cf) ||
                      (cp >= 0xac00 && cp <= 0xd7a3) || (cp >= 0xf900 && cp <= 0xfaff) ||
                      (cp >= 0xfe30 && cp <= 0xfe4f) || (cp >= 0xff00 && cp <= 0xff60) ||
                      (cp >= 0xffe0 && cp <= 0xffe6) || (cp >= 0x1f300 && cp <= 0x1faff) ||
                      (cp >= 0x20000 && cp <= 0x3fffd);
    width += wide ? 2 : 1;
  }
  return width;
}

}  // namespace ztier
