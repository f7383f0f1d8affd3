// UTF-8 decoding, one code point at a time: what names (jobs, units,
// tensors) are checked or shown by, wherever they come from.
//
// Thread safety: pure functions. Failure: none; bytes that are not UTF-8
// decode to a length of 0.
#ifndef ZTIER_COMMON_UTF8_H_
#define ZTIER_COMMON_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ztier {

struct Utf8Char {
  size_t length = 0;  // bytes; 0: not UTF-8 at this position
  uint32_t code_point = 0;
};

// The code point at text[i] (i < text.size()). Length 0 for a truncated or
// malformed sequence, an overlong form, a surrogate or a code point past
// U+10FFFF.
Utf8Char DecodeUtf8(std::string_view text, size_t i);

// `text` with control characters (C0, DEL, C1: a terminal's escape
// sequences, a NUL that cuts a C string) and bytes that are not UTF-8 as
// '?': for what goes onto a terminal or into a name from outside.
std::string PrintableUtf8(std::string_view text);

// The columns `text` takes on a terminal: East Asian wide characters (CJK,
// Hangul, fullwidth forms, emoji) 2, combining marks 0, others 1 (a byte
// that is not UTF-8: 1). For aligning tables of names.
size_t DisplayWidth(std::string_view text);

}  // namespace ztier

#endif  // ZTIER_COMMON_UTF8_H_
