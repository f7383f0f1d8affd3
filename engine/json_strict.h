// JSON as people write it into ztier's files (configs, the quota file,
// checkpoint manifests, safetensors headers), read strictly: a key given
// twice in one object is an error, not the last one silently winning, and
// so are a NUL byte, nesting past 256 levels, and values that would take
// more than 16 times the text in memory (and 1 MiB: the files ztier writes
// take a few times their size, one crafted of empty objects sixty times); a
// parse error says where, briefly. Time and memory linear in the text.
//
// Thread safety: a pure function. Failure: InvalidArgument naming `origin`.
// Engine-internal (nlohmann::json is no public type of ztier).
#ifndef ZTIER_ENGINE_JSON_STRICT_H_
#define ZTIER_ENGINE_JSON_STRICT_H_

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace ztier::engine {

// Parses `text`; errors name `origin`, and the dotted key given twice or
// the line and column of a syntax error.
Result<nlohmann::json> ParseJsonStrict(const std::string& text, std::string_view origin);

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_JSON_STRICT_H_
