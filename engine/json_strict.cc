// ParseJsonStrict: nlohmann's parser with a callback that remembers each
// object's keys (see json_strict.h).
#include "engine/json_strict.h"

#include <algorithm>
#include <set>
#include <vector>

namespace ztier::engine {

Result<nlohmann::json> ParseJsonStrict(const std::string& text, std::string_view origin) {
  using Json = nlohmann::json;
  // nlohmann's parser ends the input at a NUL byte: whatever followed one
  // (a second half of the file) was dropped in silence.
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    const size_t line_start = text.rfind('\n', nul);
    const size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + nul, '\n'));
    const size_t column = nul - (line_start == std::string::npos ? 0 : line_start + 1) + 1;
    return Status::InvalidArgument(StrCat(origin, ": a NUL byte at line ", line, ", column ",
                                          column, " (JSON is text; is this the right file?)"));
  }
  std::vector<std::set<std::string>> seen;
  std::vector<std::string> path;
  std::string duplicate;
  auto cb = [&](int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        seen.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!seen.empty()) seen.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string k = parsed.get<std::string>();
        path.resize(static_cast<size_t>(std::max(depth, 1)));
        path.back() = k;
        if (!seen.empty() && !seen.back().insert(k).second && duplicate.empty()) {
          for (size_t i = 0; i < path.size(); ++i) duplicate += (i ? "." : "") + path[i];
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  Json doc = Json::parse(text, cb, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    // Parse again with exceptions, caught here, only to get nlohmann's
    // message with the position of the error.
    std::string why = "invalid JSON";
    try {
      const Json probe = Json::parse(text);
      (void)probe;
    } catch (const Json::exception& e) {  // parse_error, or out_of_range for huge numbers
      why = e.what();
    }
    // "[json.exception.parse_error.101] parse error at line L, column C:
    // ...; last read: '<everything since the last token>'": without the tag,
    // and only the end of what was read (it quoted whole lines of a file
    // that is not JSON, control characters spelled <U+000A>).
    if (why.starts_with("[json.exception")) {
      if (const size_t tag = why.find("] "); tag != std::string::npos) why = why.substr(tag + 2);
    }
    if (const size_t read = why.find("; last read: '"); read != std::string::npos) {
      std::string near = why.substr(read + 14);
      if (!near.empty() && near.back() == '\'') near.pop_back();
      // Its last line, trimmed (the error's line and column say where).
      if (const size_t nl = near.rfind("<U+000A>"); nl != std::string::npos) {
        near = near.substr(nl + 8);
      }
      near.erase(0, std::min(near.size(), near.find_first_not_of(" \t")));
      if (near.size() > 40) near = near.substr(0, 40) + "...";
      why = near.empty() ? why.substr(0, read) : StrCat(why.substr(0, read), "; at '", near, "'");
    }
    return Status::InvalidArgument(StrCat(origin, ": ", why));
  }
  if (!duplicate.empty()) {
    return Status::InvalidArgument(StrCat(origin, ": key '", duplicate, "' is given twice"));
  }
  return doc;
}

}  // namespace ztier::engine
