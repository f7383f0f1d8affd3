// ztier common: size grammar (see numbers.h).
#include "common/numbers.h"

#include <pwd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace ztier {

Result<uint64_t> ParseSize(std::string_view text) {
  uint64_t v = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  auto [ptr, ec] = std::from_chars(first, last, v);
  if (ec == std::errc::result_out_of_range) {
    return Status::InvalidArgument(StrCat("size '", text, "' is too large"));
  }
  if (ec != std::errc() || ptr == first) {
    return Status::InvalidArgument(StrCat("'", text, "' is not a size (e.g. 65536, 64K, 1G)"));
  }
  if (ptr != last && (*ptr == '.' || *ptr == 'e' || *ptr == 'E')) {
    // A whole number written as the config file's JSON may write it (1e9,
    // 1.5e9, 1500000000.0): the same size in a variable as in the file.
    double d = 0;
    auto [dptr, dec] = std::from_chars(first, last, d);
    // Below 2^53, where every whole number is a double exactly.
    if (dec == std::errc() && dptr == last && d >= 0 && d < 9007199254740992.0 &&
        d == static_cast<double>(static_cast<uint64_t>(d))) {
      return static_cast<uint64_t>(d);
    }
    return Status::InvalidArgument(
        StrCat("'", text,
               "' is not a size (a whole number of bytes, or one with K, M, G or T; "
               "e.g. 64K, 1G)"));
  }
  std::string_view suffix(ptr, static_cast<size_t>(last - ptr));
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b')) suffix.remove_suffix(1);
  // "i" marks a binary unit ("64Ki"): after a unit's letter only ("64i" is
  // no size).
  if (suffix.size() >= 2 && suffix.back() == 'i') suffix.remove_suffix(1);
  int shift = 0;
  if (suffix == "K" || suffix == "k") {
    shift = 10;
  } else if (suffix == "M" || suffix == "m") {
    shift = 20;
  } else if (suffix == "G" || suffix == "g") {
    shift = 30;
  } else if (suffix == "T" || suffix == "t") {
    shift = 40;
  } else if (!suffix.empty()) {
    return Status::InvalidArgument(
        StrCat("'", text, "' is not a size (a whole number with K, M, G or T; e.g. 64K, 1G)"));
  }
  if (shift > 0 && v > (UINT64_MAX >> shift)) {
    return Status::InvalidArgument(StrCat("size '", text, "' is too large"));
  }
  return v << shift;
}

Result<uint32_t> ParseUid(std::string_view text) {
  const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) != 0;
  });
  if (digits) {
    uint64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || ptr != text.data() + text.size() || v >= UINT32_MAX) {
      return Status::InvalidArgument(StrCat("'", text, "' is not a uid"));
    }
    return static_cast<uint32_t>(v);
  }
  const std::string name(text);
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  const int err = ::getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found);
  if (err != 0) {
    return Status::Unavailable(
        StrCat("cannot look up the user '", text, "': ", std::strerror(err)));
  }
  if (found == nullptr) {
    return Status::InvalidArgument(StrCat("'", text, "' is not a uid, nor a user's name here"));
  }
  return static_cast<uint32_t>(found->pw_uid);
}

std::string FormatSize(uint64_t bytes) {
  for (auto [shift, suffix] : {std::pair{40, "T"}, {30, "G"}, {20, "M"}, {10, "K"}}) {
    if (bytes != 0 && bytes % (uint64_t{1} << shift) == 0) return StrCat(bytes >> shift, suffix);
  }
  return StrCat(bytes);
}

std::string FormatSeconds(std::chrono::milliseconds duration) {
  const int64_t ms = duration.count();
  std::string out = StrCat(ms / 1000);
  if (int64_t frac = std::abs(ms % 1000); frac != 0) {
    std::string digits = StrCat(1000 + frac).substr(1);  // three digits
    while (digits.back() == '0') digits.pop_back();
    out = StrCat(ms < 0 && ms > -1000 ? "-" : "", out, ".", digits);
  }
  return StrCat(out, " s");
}

}  // namespace ztier
