// ztier engine: safetensors header parsing and writing (see safetensors.h).
#include "engine/safetensors.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/json_strict.h"

namespace ztier::engine {
namespace {

using Json = nlohmann::json;

// Header JSON larger than this is refused (the reference implementation
// refuses 100 MB; a model's header is a few MB at most).
constexpr uint64_t kMaxHeader = uint64_t{100} << 20;

uint64_t DtypeBytes(StDtype d) {
  switch (d) {
    case StDtype::kF32:
      return 4;
    case StDtype::kBF16:
      return 2;
    case StDtype::kF16:
      return 2;
    case StDtype::kOther:
      return 0;
  }
  return 0;
}

StDtype ParseDtype(const std::string& s) {
  if (s == "F32") return StDtype::kF32;
  if (s == "BF16") return StDtype::kBF16;
  if (s == "F16") return StDtype::kF16;
  return StDtype::kOther;
}

// Sizes in bits of the other dtypes the format defines, so that files
// carrying them are still validated (ztier only imports F32/BF16/F16 into
// its units); the 4- and 6-bit ones pack their elements.
uint64_t OtherDtypeBits(const std::string& s) {
  if (s == "F64" || s == "I64" || s == "U64" || s == "C64") return 64;
  if (s == "I32" || s == "U32") return 32;
  if (s == "I16" || s == "U16") return 16;
  if (s == "I8" || s == "U8" || s == "BOOL" || s == "F8_E4M3" || s == "F8_E5M2" || s == "F8_E8M0" ||
      s == "F8_E4M3FNUZ" || s == "F8_E5M2FNUZ") {
    return 8;
  }
  if (s == "F6_E2M3" || s == "F6_E3M2") return 6;
  if (s == "F4") return 4;
  return 0;
}

}  // namespace

Result<StHeader> ParseSafetensorsHeader(std::string_view prefix, uint64_t file_size) {
  auto bad = [](std::string_view why) { return Status::Corruption(StrCat("safetensors: ", why)); };
  if (file_size < 8 || prefix.size() < 8) return bad("file shorter than the 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, prefix.data(), 8);
  if (n > kMaxHeader) return bad(StrCat("header length ", n, " is implausible (> 100 MiB)"));
  if (n > file_size - 8) {
    return bad(StrCat("header length ", n, " runs past the end of the ", file_size, "-byte file"));
  }
  if (prefix.size() < 8 + n) return bad("header not fully read");
  // Strictly, as the reference reader: a key given twice at any depth (a
  // tensor named twice, or an entry's "dtype" given twice, whose last one
  // read fp16 bytes as bf16) is refused, and so is anything after a NUL
  // byte. In time linear in the header's size.
  Result<Json> parsed = ParseJsonStrict(std::string(prefix.substr(8, n)), "header");
  if (!parsed.ok()) return bad(parsed.status().message());
  const Json& h = *parsed;
  if (!h.is_object()) return bad("header is not a JSON object");
  StHeader out;
  out.data_start = 8 + n;
  const uint64_t data_size = file_size - out.data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == kSafetensorsMetadataKey) {
      if (!v.is_object()) return bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return bad("__metadata__ values must be strings");
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return bad(StrCat("tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    const Json& dt = v["dtype"];
    const Json& shape = v["shape"];
    const Json& offs = v["data_offsets"];
    if (!dt.is_string() || !shape.is_array() || !offs.is_array() || offs.size() != 2 ||
        !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned()) {
      return bad(StrCat("tensor '", name, "' has fields of the wrong type"));
    }
    StTensor t;
    t.dtype_name = dt.get<std::string>();
    t.dtype = ParseDtype(t.dtype_name);
    const uint64_t bits =
        t.dtype != StDtype::kOther ? 8 * DtypeBytes(t.dtype) : OtherDtypeBits(t.dtype_name);
    if (bits == 0) return bad(StrCat("tensor '", name, "' has unknown dtype '", t.dtype_name, "'"));
    uint64_t count = 1;
    for (const Json& d : shape) {
      if (!d.is_number_unsigned()) return bad(StrCat("tensor '", name, "' has a bad dimension"));
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(INT64_MAX)) {
        return bad(StrCat("tensor '", name, "' has a dimension past 2^63 - 1"));
      }
      if (dim != 0 && count > UINT64_MAX / dim) {
        return bad(StrCat("tensor '", name, "' shape overflows"));
      }
      count *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    t.begin = offs[0].get<uint64_t>();
    t.end = offs[1].get<uint64_t>();
    if (t.begin > t.end || t.end > data_size) {
      return bad(StrCat("tensor '", name, "' data_offsets [", t.begin, ", ", t.end,
                        ") fall outside the ", data_size, "-byte data region"));
    }
    if (count > UINT64_MAX / bits) {
      return bad(
          StrCat("tensor '", name, "' of ", count, " ", t.dtype_name, " elements: past 2^64 bits"));
    }
    if (count * bits % 8 != 0) {
      return bad(StrCat("tensor '", name, "' of ", count, " ", t.dtype_name,
                        " elements is no whole number of bytes"));
    }
    if (t.end - t.begin != count * bits / 8) {
      return bad(StrCat("tensor '", name, "' has ", t.end - t.begin,
                        " bytes of data but its shape and dtype need ", count * bits / 8));
    }
    ranges.emplace_back(t.begin, t.end);
    out.tensors.emplace(name, std::move(t));
  }
  // The tensors' data tile the data region: no overlap, no hole, nothing
  // before the first or after the last (bytes no tensor names are a damaged
  // or forged file, as the reference reader holds).
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin < at) return bad("two tensors' data overlap");
    if (begin > at)
      return bad(StrCat("bytes [", at, ", ", begin, ") of the data belong to no tensor"));
    at = end;
  }
  if (at != data_size) {
    return bad(
        StrCat("bytes [", at, ", ", data_size, ") after the last tensor's data belong to none"));
  }
  return out;
}

std::string MakeSafetensorsHeader(const std::vector<StEntry>& entries) {
  Json h = Json::object();
  uint64_t off = 0;
  for (const StEntry& e : entries) {
    h[e.name] = {
        {"dtype", e.dtype_name}, {"shape", e.shape}, {"data_offsets", {off, off + e.bytes}}};
    off += e.bytes;
  }
  h[std::string(kSafetensorsMetadataKey)] = {{"format", "pt"}, {"producer", "ztier"}};
  std::string json = h.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // align the data region to 8
  const uint64_t n = json.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + json;
}

}  // namespace ztier::engine
