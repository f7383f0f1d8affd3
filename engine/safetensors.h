// ztier engine internal: the safetensors file format.
//
// Layout: u64 little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32"|"BF16"|"F16"|..., "shape": [..],
//             "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}
// then the data region; offsets are relative to its start.
//
// ParseSafetensorsHeader trusts nothing: the header length against the file
// size, JSON syntax, every field's type, dtype names, shape x dtype size ==
// the offset range, ranges inside the data region, and no two tensors
// overlapping. Pure functions; thread-safe.
#ifndef ZTIER_ENGINE_SAFETENSORS_H_
#define ZTIER_ENGINE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ztier::engine {

enum class StDtype : uint8_t { kF32, kBF16, kF16, kOther };

struct StTensor {
  StDtype dtype = StDtype::kOther;
  std::string dtype_name;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data region
  uint64_t end = 0;
};

struct StHeader {
  uint64_t data_start = 0;  // 8 + header length
  std::map<std::string, StTensor> tensors;
};

// The header's key for the file's metadata: no tensor may have this name.
inline constexpr std::string_view kSafetensorsMetadataKey = "__metadata__";

// Parses the header of a safetensors file whose first bytes are `prefix` and
// whose total size is `file_size`. `prefix` must hold at least the 8-byte
// length and the whole header when it is complete (callers read
// min(file_size, 8 + N)). Errors: Corruption naming the problem.
Result<StHeader> ParseSafetensorsHeader(std::string_view prefix, uint64_t file_size);

// The header bytes (length prefix included, padded with spaces to a
// multiple of 8) for tensors laid out in the given order; no entry may be
// named kSafetensorsMetadataKey.
struct StEntry {
  std::string name;
  std::string dtype_name;  // "BF16" or "F32"
  std::vector<int64_t> shape;
  uint64_t bytes;
};
std::string MakeSafetensorsHeader(const std::vector<StEntry>& entries);

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_SAFETENSORS_H_
