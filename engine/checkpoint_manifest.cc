// ztier engine: checkpoint manifest codec (see checkpoint_manifest.h).
#include "engine/checkpoint_manifest.h"

#include <set>

#include <nlohmann/json.hpp>

#include "engine/json_strict.h"

#include "common/crc32c.h"
#include "common/numbers.h"
#include "engine/wire_types.h"

namespace ztier::engine {
namespace {

using Json = nlohmann::json;

constexpr const char* kFormat = "ztier-checkpoint";
constexpr size_t kMaxTensorsPerUnit = size_t{1} << 20;
constexpr size_t kMaxDims = 16;

uint32_t ManifestChecksum(Json manifest) {
  manifest.erase("checksum");
  const std::string canonical = manifest.dump();
  return Crc32c(canonical.data(), canonical.size());
}

// Typed field readers: Corruption naming `where` and the field.
class Fields {
 public:
  explicit Fields(std::string_view origin) : origin_(origin) {}

  Status Bad(std::string_view why) const {
    return Status::Corruption(StrCat("checkpoint manifest ", origin_, ": ", why));
  }
  Result<const Json*> Get(const Json& o, const char* key, std::string_view where) const {
    auto it = o.find(key);
    if (it == o.end()) return Bad(StrCat(where, "has no '", key, "'"));
    return &*it;
  }
  Result<std::string> String(const Json& o, const char* key, std::string_view where) const {
    ZT_ASSIGN_OR_RETURN(const Json* v, Get(o, key, where));
    if (!v->is_string()) return Bad(StrCat(where, "'", key, "' is not a string"));
    return v->get<std::string>();
  }
  // An integer in [lo, hi].
  // "'key' n is outside lo..hi", or where only one value will do (a size
  // the layout fixes) "'key' is n, where the layout has lo".
  template <class T>
  static std::string OutOf(std::string_view where, const char* key, T n, T lo, T hi) {
    if (lo == hi) return StrCat(where, "'", key, "' is ", n, ", where the layout has ", lo);
    return StrCat(where, "'", key, "' ", n, " is outside ", lo, "..", hi);
  }
  Result<int64_t> Int(const Json& o, const char* key, std::string_view where, int64_t lo,
                      int64_t hi) const {
    ZT_ASSIGN_OR_RETURN(const Json* v, Get(o, key, where));
    if (!v->is_number_integer()) return Bad(StrCat(where, "'", key, "' is not an integer"));
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Bad(StrCat(where, "'", key, "' ", v->dump(), " is outside ", lo, "..", hi));
    }
    const int64_t n = v->get<int64_t>();
    if (n < lo || n > hi) return Bad(OutOf(where, key, n, lo, hi));
    return n;
  }
  Result<uint64_t> Uint(const Json& o, const char* key, std::string_view where, uint64_t lo,
                        uint64_t hi) const {
    ZT_ASSIGN_OR_RETURN(const Json* v, Get(o, key, where));
    if (!v->is_number_unsigned()) {
      return Bad(StrCat(where, "'", key, "' is not a non-negative integer"));
    }
    const uint64_t n = v->get<uint64_t>();
    if (n < lo || n > hi) return Bad(OutOf(where, key, n, lo, hi));
    return n;
  }
  Result<const Json*> Array(const Json& o, const char* key, std::string_view where, size_t lo,
                            size_t hi) const {
    ZT_ASSIGN_OR_RETURN(const Json* v, Get(o, key, where));
    if (!v->is_array()) return Bad(StrCat(where, "'", key, "' is not a list"));
    if (v->size() < lo || v->size() > hi) {
      return Bad(StrCat(where, "'", key, "' has ", v->size(), " entries, not ", lo, "..", hi));
    }
    return v;
  }

 private:
  std::string_view origin_;
};

Result<CheckpointManifest> Decode(const Json& m, const Fields& f) {
  if (!m.is_object()) return f.Bad("not a JSON object");
  CheckpointManifest out;
  {
    auto format = m.find("format");
    if (format == m.end() || !format->is_string() || format->get<std::string>() != kFormat) {
      return f.Bad("not a ztier checkpoint (no \"format\": \"ztier-checkpoint\")");
    }
  }
  ZT_ASSIGN_OR_RETURN(int64_t version, f.Int(m, "version", "", 0, INT64_MAX));
  if (version != kCheckpointVersion) {
    return f.Bad(StrCat("version ", version, " is not the supported version ", kCheckpointVersion));
  }
  ZT_ASSIGN_OR_RETURN(uint64_t checksum, f.Uint(m, "checksum", "", 0, UINT32_MAX));
  if (checksum != ManifestChecksum(m)) {
    return f.Bad("checksum mismatch (the manifest was altered or damaged)");
  }
  ZT_ASSIGN_OR_RETURN(out.job, f.String(m, "job", ""));
  ZT_ASSIGN_OR_RETURN(out.step, f.Int(m, "step", "", 0, kMaxStep));
  ZT_ASSIGN_OR_RETURN(out.adam_step, f.Int(m, "adam_step", "", 0, out.step));
  ZT_ASSIGN_OR_RETURN(int64_t ranks, f.Int(m, "ranks", "", 1, kMaxCheckpointRanks));
  out.ranks = static_cast<int>(ranks);
  ZT_ASSIGN_OR_RETURN(const Json* opt, f.Get(m, "optimizer", ""));
  if (!opt->is_object()) return f.Bad("'optimizer' is not an object");
  out.optimizer_json = opt->dump();
  if (m.contains("state_dtype")) {
    ZT_ASSIGN_OR_RETURN(out.state_dtype, f.String(m, "state_dtype", ""));
    if (out.state_dtype != "fp32" && out.state_dtype != "int8") {
      return f.Bad(StrCat("'state_dtype' is '", out.state_dtype, "', not fp32 or int8"));
    }
  }
  ZT_ASSIGN_OR_RETURN(const Json* units, f.Array(m, "units", "", 1, kMaxCheckpointUnits));
  std::set<std::string> files;
  out.units.reserve(units->size());
  for (size_t k = 0; k < units->size(); ++k) {
    const Json& cu = (*units)[k];
    const std::string where = StrCat("unit ", k, ": ");
    if (!cu.is_object()) return f.Bad(StrCat(where, "not an object"));
    CheckpointUnit u;
    ZT_ASSIGN_OR_RETURN(u.name, f.String(cu, "name", where));
    if (u.name.empty()) return f.Bad(StrCat(where, "empty name"));
    ZT_ASSIGN_OR_RETURN(u.numel, f.Uint(cu, "numel", where, 1, kMaxUnitElements));
    ZT_ASSIGN_OR_RETURN(u.padded, f.Uint(cu, "padded", where, u.numel, kMaxUnitElements));
    // The engine pads every unit to a multiple of ranks x kAlignElements.
    const uint64_t granule = static_cast<uint64_t>(out.ranks) * kAlignElements;
    if (u.padded != (u.numel + granule - 1) / granule * granule) {
      return f.Bad(StrCat(where, "padded size ", u.padded, " is not ", u.numel,
                          " rounded up to a multiple of ", granule, " (", out.ranks, " ranks)"));
    }
    ZT_ASSIGN_OR_RETURN(const Json* tensors, f.Array(cu, "tensors", where, 1, kMaxTensorsPerUnit));
    uint64_t sum = 0;
    for (size_t t = 0; t < tensors->size(); ++t) {
      const Json& ct = (*tensors)[t];
      const std::string tw = StrCat(where, "tensor ", t, ": ");
      if (!ct.is_object()) return f.Bad(StrCat(tw, "not an object"));
      CheckpointTensor tensor;
      ZT_ASSIGN_OR_RETURN(tensor.name, f.String(ct, "name", tw));
      if (auto frozen = ct.find("frozen"); frozen != ct.end()) {
        if (!frozen->is_boolean()) return f.Bad(StrCat(tw, "'frozen' is not true or false"));
        tensor.frozen = frozen->get<bool>();
      }
      ZT_ASSIGN_OR_RETURN(const Json* shape, f.Array(ct, "shape", tw, 0, kMaxDims));
      uint64_t n = 1;
      for (const Json& d : *shape) {
        if (!d.is_number_unsigned() || d.get<uint64_t>() == 0) {
          return f.Bad(StrCat(tw, "shape ", shape->dump(), " has a dimension that is not >= 1"));
        }
        const std::optional<uint64_t> prod = CheckedMul(n, d.get<uint64_t>());
        if (!prod || *prod > kMaxUnitElements) {
          return f.Bad(StrCat(tw, "shape ", shape->dump(), " has too many elements"));
        }
        n = *prod;
        tensor.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
      }
      const std::optional<uint64_t> total = CheckedAdd(sum, n);
      if (!total || *total > u.numel) {
        return f.Bad(StrCat(where, "its tensors hold more than its ", u.numel, " elements"));
      }
      sum = *total;
      u.tensors.push_back(std::move(tensor));
    }
    if (sum != u.numel) {
      return f.Bad(StrCat(where, "its tensors hold ", sum, " elements, numel says ", u.numel));
    }
    const uint64_t shard = u.padded / out.ranks;
    ZT_ASSIGN_OR_RETURN(const Json* shards, f.Array(cu, "shards", where, out.ranks, out.ranks));
    for (int r = 0; r < out.ranks; ++r) {
      const Json& cs = (*shards)[r];
      const std::string sw = StrCat(where, "shard ", r, ": ");
      if (!cs.is_object()) return f.Bad(StrCat(sw, "not an object"));
      CheckpointShard s;
      ZT_ASSIGN_OR_RETURN(s.file, f.String(cs, "file", sw));
      if (!PlainFileName(s.file)) {
        return f.Bad(StrCat(sw, "file name '", s.file, "' is not a plain name in the directory"));
      }
      if (!files.insert(s.file).second) return f.Bad(StrCat(sw, "file '", s.file, "' used twice"));
      ZT_ASSIGN_OR_RETURN(int64_t rank, f.Int(cs, "rank", sw, 0, out.ranks - 1));
      if (rank != r) {
        return f.Bad(StrCat(sw, "'rank' is ", rank, ", in rank ", r,
                            "'s place: a unit's shards are listed in rank order"));
      }
      s.rank = static_cast<int>(rank);
      ZT_ASSIGN_OR_RETURN(s.elements, f.Uint(cs, "elements", sw, shard, shard));
      ZT_ASSIGN_OR_RETURN(s.bytes,
                          f.Uint(cs, "bytes", sw, ShardFileBytes(shard), ShardFileBytes(shard)));
      ZT_ASSIGN_OR_RETURN(uint64_t crc, f.Uint(cs, "crc32c", sw, 0, UINT32_MAX));
      s.crc32c = static_cast<uint32_t>(crc);
      u.shards.push_back(std::move(s));
    }
    out.units.push_back(std::move(u));
  }
  return out;
}

}  // namespace

bool PlainFileName(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos &&
         name != kCheckpointManifestName;
}

std::string EncodeCheckpointManifest(const CheckpointManifest& m) {
  Json units = Json::array();
  for (const CheckpointUnit& u : m.units) {
    Json tensors = Json::array();
    for (const CheckpointTensor& t : u.tensors) {
      Json tensor{{"name", t.name}, {"shape", t.shape}};
      if (t.frozen) tensor["frozen"] = true;
      tensors.push_back(std::move(tensor));
    }
    Json shards = Json::array();
    for (const CheckpointShard& s : u.shards) {
      shards.push_back({{"file", s.file},
                        {"rank", s.rank},
                        {"elements", s.elements},
                        {"bytes", s.bytes},
                        {"crc32c", s.crc32c}});
    }
    units.push_back({{"name", u.name},
                     {"numel", u.numel},
                     {"padded", u.padded},
                     {"tensors", tensors},
                     {"shards", shards}});
  }
  Json manifest = {{"format", kFormat},
                   {"version", kCheckpointVersion},
                   {"job", m.job},
                   {"step", m.step},
                   {"adam_step", m.adam_step},
                   {"ranks", m.ranks},
                   {"optimizer", Json::parse(m.optimizer_json, nullptr, false)},
                   {"units", units}};
  if (!m.state_dtype.empty()) manifest["state_dtype"] = m.state_dtype;
  manifest["checksum"] = ManifestChecksum(manifest);
  return manifest.dump(1);
}

namespace {

// How deep arrays and objects nest in JSON `text` (outside strings), up to
// `limit` + 1: a manifest nests 5 deep, and nlohmann's copy and dump (the
// checksum) recurse once a level, so 10^5 levels overflowed the stack.
int NestingDepth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

constexpr int kMaxManifestDepth = 32;

}  // namespace

Result<CheckpointManifest> DecodeCheckpointManifest(std::string_view text,
                                                    std::string_view origin) {
  const Fields f(origin);
  if (text.size() > kMaxManifestBytes) return f.Bad(StrCat(text.size(), " bytes is too large"));
  if (NestingDepth(text, kMaxManifestDepth) > kMaxManifestDepth) {
    return f.Bad(StrCat("arrays and objects nest more than ", kMaxManifestDepth, " deep"));
  }
  // Strictly: a key given twice is refused, and nothing after a NUL byte
  // is dropped in silence (a manifest with garbage past one resumed).
  Result<Json> parsed = ParseJsonStrict(std::string(text), "its JSON");
  if (!parsed.ok()) return f.Bad(parsed.status().message());
  const Json& m = *parsed;
  try {
    return Decode(m, f);
  } catch (const Json::exception& e) {  // nothing escapes: a type the checks above missed
    return f.Bad(e.what());
  }
}

}  // namespace ztier::engine
