// ztier common: the one grammar for sizes ("64G", "1M", "4096"),
// overflow-checked arithmetic for sizes read from files, flags and configs,
// how a duration reads in a message, and a uid as an operator types it.
//
// ParseSize takes a decimal integer with an optional K/M/G/T suffix (powers
// of 1024; "Ki", "KB", "KiB" spellings accepted). No sign, no fraction, no
// exponent, no "nan" / "inf": a size a user typed is a whole number of bytes
// or it is an error. Callers add the option or key name to the message.
//
// Pure functions; thread-safe.
#ifndef ZTIER_COMMON_NUMBERS_H_
#define ZTIER_COMMON_NUMBERS_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace ztier {

// "4096", "64K", "16Mi", "2GB", "1TiB" -> bytes. Errors: InvalidArgument
// ("'x' is not a size (e.g. 65536, 64K, 1G)", "... is too large").
Result<uint64_t> ParseSize(std::string_view text);

// A uid as a user types it: a decimal below 2^32 - 1, or a user's name in
// the passwd database. Errors: InvalidArgument ("'x' is not a uid", "'x'
// is not a uid, nor a user's name here"), Unavailable (the lookup failed).
Result<uint32_t> ParseUid(std::string_view text);

// The shortest exact rendering with a suffix: 1048576 -> "1M", 1000 -> "1000".
std::string FormatSize(uint64_t bytes);

// A duration in seconds for a message: 600000ms -> "600 s", 100ms -> "0.1 s",
// 2500ms -> "2.5 s" (to the millisecond, no trailing zeros).
std::string FormatSeconds(std::chrono::milliseconds duration);

// a * b and a + b, or nullopt on overflow of uint64_t.
inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

}  // namespace ztier

#endif  // ZTIER_COMMON_NUMBERS_H_
