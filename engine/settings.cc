// ztier engine: the settings table and its JSON / environment readers.
#include "engine/settings.h"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

namespace ztier::engine {
namespace {

using Json = nlohmann::json;

// ---- value parsers (from the canonical text of a JSON scalar or an env var)

Result<uint64_t> ParseSize(std::string_view text, std::string_view key) {
  uint64_t v = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  auto [ptr, ec] = std::from_chars(first, last, v);
  if (ec != std::errc() || ptr == first) {
    return Status::InvalidArgument(StrCat(key, ": '", text, "' is not a size (e.g. 1048576, 64G)"));
  }
  std::string_view suffix(ptr, static_cast<size_t>(last - ptr));
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b')) suffix.remove_suffix(1);
  if (!suffix.empty() && suffix.back() == 'i') suffix.remove_suffix(1);
  int shift = 0;
  if (suffix == "K" || suffix == "k")
    shift = 10;
  else if (suffix == "M" || suffix == "m")
    shift = 20;
  else if (suffix == "G" || suffix == "g")
    shift = 30;
  else if (suffix == "T" || suffix == "t")
    shift = 40;
  else if (!suffix.empty()) {
    return Status::InvalidArgument(
        StrCat(key, ": unknown size suffix in '", text, "' (K, M, G, T)"));
  }
  if (shift > 0 && v > (UINT64_MAX >> shift)) {
    return Status::InvalidArgument(StrCat(key, ": size '", text, "' is too large"));
  }
  return v << shift;
}

// A count of elements: a size (suffixes allowed), or a JSON number such as
// DeepSpeed configs write (1e9), which must be a whole number.
Result<uint64_t> ParseCount(std::string_view text, std::string_view key) {
  Result<uint64_t> size = ParseSize(text, key);
  if (size.ok()) return size;
  double d = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
  if (ec != std::errc() || ptr != text.data() + text.size() || !(d >= 0) || d > 9.0e18 ||
      d != static_cast<double>(static_cast<uint64_t>(d))) {
    return Status::InvalidArgument(
        StrCat(key, ": '", text, "' is not a whole number of parameters (e.g. 100000, 1e9, 64M)"));
  }
  return static_cast<uint64_t>(d);
}

Result<int64_t> ParseInt(std::string_view text, std::string_view key, int64_t lo, int64_t hi) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size()) {
    return Status::InvalidArgument(StrCat(key, ": '", text, "' is not an integer"));
  }
  if (v < lo || v > hi) {
    return Status::InvalidArgument(StrCat(key, ": ", v, " is outside ", lo, "..", hi));
  }
  return v;
}

Result<bool> ParseBool(std::string_view text, std::string_view key) {
  if (text == "true" || text == "1" || text == "on" || text == "yes") return true;
  if (text == "false" || text == "0" || text == "off" || text == "no") return false;
  return Status::InvalidArgument(StrCat(key, ": '", text, "' is not a boolean (true/false)"));
}

Result<Tier> ParseTier(std::string_view text, std::string_view key) {
  // DeepSpeed's "cpu" is ztier's pinned DRAM tier.
  if (text == "cpu" || text == "dram") return Tier::kDram;
  if (text == "nvme") return Tier::kNvme;
  return Status::InvalidArgument(StrCat(key, ": device '", text, "' is not cpu or nvme"));
}

std::vector<std::string> SplitList(std::string_view text) {
  std::vector<std::string> out;
  while (!text.empty()) {
    const size_t comma = text.find(',');
    if (comma != 0) out.emplace_back(text.substr(0, comma));
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return out;
}

// ---- the table

enum class Kind { kScalar, kList };

struct Tunable {
  std::vector<const char*> json_keys;  // dotted paths; all set the same field
  const char* env;
  Kind kind;
  const char* default_text;
  const char* doc;
  std::function<Status(Settings&, std::string_view text, std::string_view key)> set;
  std::function<std::string(const Settings&)> get;
};

std::string SizeText(uint64_t v) {
  for (auto [shift, suffix] : {std::pair{40, "T"}, {30, "G"}, {20, "M"}, {10, "K"}}) {
    if (v != 0 && v % (uint64_t{1} << shift) == 0) return StrCat(v >> shift, suffix);
  }
  return StrCat(v);
}

const char* HugeText(HugePages h) {
  return h == HugePages::kNone ? "none" : h == HugePages::kHugetlb ? "hugetlb" : "transparent";
}

const std::vector<Tunable>& Table() {
  static const std::vector<Tunable> table = {
      {{"ztier.dram_budget"},
       "ZTIER_DRAM_BUDGET",
       Kind::kScalar,
       "8G",
       "Hard cap on pinned host DRAM held by the engine (all jobs).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.dram_budget_bytes, ParseSize(t, k));
         if (s.dram_budget_bytes == 0) return Status::InvalidArgument(StrCat(k, ": must be > 0"));
         return Status::Ok();
       },
       [](const Settings& s) { return SizeText(s.dram_budget_bytes); }},
      {{"ztier.huge_pages"},
       "ZTIER_HUGE_PAGES",
       Kind::kScalar,
       "transparent",
       "none, transparent (madvise) or hugetlb (reserved 2 MiB pages; falls back with a warning).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         if (t == "none")
           s.huge_pages = HugePages::kNone;
         else if (t == "transparent")
           s.huge_pages = HugePages::kTransparent;
         else if (t == "hugetlb")
           s.huge_pages = HugePages::kHugetlb;
         else
           return Status::InvalidArgument(
               StrCat(k, ": '", t, "' is not none, transparent or hugetlb"));
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(HugeText(s.huge_pages)); }},
      {{"zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_param.pin_memory"},
       "ZTIER_PIN_MEMORY",
       Kind::kScalar,
       "true",
       "mlock the DRAM pool (needs LimitMEMLOCK=infinity or CAP_IPC_LOCK; warns when refused).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.pin_memory, ParseBool(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(s.pin_memory ? "true" : "false"); }},
      {{"zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_param.nvme_path"},
       "ZTIER_NVME_PATHS",
       Kind::kList,
       "(none)",
       "Swap directories, one per drive (a string or a list; the env variable is comma-separated).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         std::vector<std::string> paths = SplitList(t);
         if (paths.empty()) return Status::InvalidArgument(StrCat(k, ": empty path list"));
         if (!s.nvme_paths.empty() && s.nvme_paths != paths) {
           return Status::InvalidArgument(
               StrCat(k,
                      ": names other directories than an earlier nvme_path; ztier keeps optimizer "
                      "states and params in one swap space, so both must name the same list"));
         }
         s.nvme_paths = std::move(paths);
         return Status::Ok();
       },
       [](const Settings& s) {
         std::string out;
         for (const std::string& p : s.nvme_paths) out += (out.empty() ? "" : ",") + p;
         return out;
       }},
      {{"ztier.nvme_capacity"},
       "ZTIER_NVME_CAPACITY",
       Kind::kScalar,
       "64G",
       "Swap file size preallocated on each path.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.nvme_capacity_per_path, ParseSize(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return SizeText(s.nvme_capacity_per_path); }},
      {{"aio.block_size"},
       "ZTIER_STRIPE_BYTES",
       Kind::kScalar,
       "1M",
       "Stripe unit and I/O size (a multiple of 4 KiB).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.stripe_bytes, ParseSize(t, k));
         if (s.stripe_bytes < 4096 || s.stripe_bytes % 4096 != 0 || s.stripe_bytes > (1u << 30)) {
           return Status::InvalidArgument(
               StrCat(k, ": ", s.stripe_bytes, " is not a multiple of 4096 in 4K..1G"));
         }
         return Status::Ok();
       },
       [](const Settings& s) { return SizeText(s.stripe_bytes); }},
      {{"aio.queue_depth"},
       "ZTIER_QUEUE_DEPTH",
       Kind::kScalar,
       "16",
       "I/Os in flight per path.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 1, 4096));
         s.queue_depth = static_cast<uint32_t>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.queue_depth); }},
      {{"ztier.checksums"},
       "ZTIER_CHECKSUMS",
       Kind::kScalar,
       "true",
       "CRC-32C per stripe unit, checked on every read.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.checksums, ParseBool(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(s.checksums ? "true" : "false"); }},
      {{"zero_optimization.offload_optimizer.device"},
       "ZTIER_OPTIMIZER_DEVICE",
       Kind::kScalar,
       "cpu",
       "Where fp32 master/m/v live: cpu (pinned DRAM) or nvme.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.optimizer_tier, ParseTier(t, k));
         return Status::Ok();
       },
       [](const Settings& s) {
         return std::string(s.optimizer_tier == Tier::kNvme ? "nvme" : "cpu");
       }},
      {{"zero_optimization.offload_param.device"},
       "ZTIER_PARAM_DEVICE",
       Kind::kScalar,
       "cpu",
       "Where bf16 params live between fetches: cpu (pinned DRAM) or nvme (needs the optimizer "
       "on nvme; clients read through a pinned cache of buffer_count units).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.param_tier, ParseTier(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(s.param_tier == Tier::kNvme ? "nvme" : "cpu"); }},
      {{"zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_param.buffer_count"},
       "ZTIER_BUFFER_COUNT",
       Kind::kScalar,
       "4",
       "Slots of the pinned ring that stages NVMe-resident units (>= 3: read, update, write back).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 3, 1024));
         s.buffer_count = static_cast<uint32_t>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.buffer_count); }},
      {{"zero_optimization.stage3_max_live_parameters"},
       "ZTIER_MAX_LIVE_PARAMETERS",
       Kind::kScalar,
       "0",
       "Client: cap on the bf16 params each rank keeps on its device (held, prefetched, in "
       "flight), in parameters; 0: no cap.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.max_live_parameters, ParseCount(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.max_live_parameters); }},
      {{"zero_optimization.stage3_param_persistence_threshold"},
       "ZTIER_PARAM_PERSISTENCE_THRESHOLD",
       Kind::kScalar,
       "32768",
       "Client: units of at most this many parameters stay on the device once fetched "
       "(refreshed once per step).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.param_persistence_threshold, ParseCount(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.param_persistence_threshold); }},
      {{"ztier.prefetch_depth"},
       "ZTIER_PREFETCH_DEPTH",
       Kind::kScalar,
       "2",
       "Client: units each rank fetches ahead of the one it computes, in the learned order.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 0, 1024));
         s.prefetch_depth = static_cast<int>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.prefetch_depth); }},
      {{"ztier.optimizer_threads"},
       "ZTIER_OPTIMIZER_THREADS",
       Kind::kScalar,
       "0",
       "CPU threads of the optimizer shared by all jobs (0: all cores).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 0, 4096));
         s.optimizer_threads = static_cast<int>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.optimizer_threads); }},
  };
  return table;
}

// DeepSpeed keys a ds_config commonly carries in the sections ztier reads,
// accepted and ignored (they configure DeepSpeed itself).
const std::vector<const char*>& IgnoredKeys() {
  static const std::vector<const char*> keys = {
      "zero_optimization.stage",
      "zero_optimization.contiguous_gradients",
      "zero_optimization.overlap_comm",
      "zero_optimization.reduce_bucket_size",
      "zero_optimization.sub_group_size",
      "zero_optimization.stage3_prefetch_bucket_size",
      "zero_optimization.stage3_max_reuse_distance",
      "zero_optimization.stage3_gather_16bit_weights_on_model_save",
      "zero_optimization.offload_optimizer.fast_init",
      "zero_optimization.offload_optimizer.pipeline_read",
      "zero_optimization.offload_optimizer.pipeline_write",
      "zero_optimization.offload_optimizer.ratio",
      "zero_optimization.offload_param.buffer_size",
      "zero_optimization.offload_param.max_in_cpu",
      "aio.thread_count",
      "aio.single_submit",
      "aio.overlap_events",
      "aio.use_gds",
  };
  return keys;
}

// The canonical text of a JSON leaf for the tunable's parser.
Result<std::string> LeafText(const Json& v, Kind kind, std::string_view key) {
  if (kind == Kind::kList && v.is_array()) {
    std::string out;
    for (const Json& e : v) {
      if (!e.is_string())
        return Status::InvalidArgument(StrCat(key, ": list items must be strings"));
      const std::string s = e.get<std::string>();
      if (s.empty() || s.find(',') != std::string::npos) {
        return Status::InvalidArgument(StrCat(key, ": path '", s, "' is empty or has a comma"));
      }
      out += (out.empty() ? "" : ",") + s;
    }
    return out;
  }
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return std::string(v.get<bool>() ? "true" : "false");
  if (v.is_number_integer() || v.is_number_unsigned()) return v.dump();
  if (v.is_number_float()) {
    // DeepSpeed configs write large counts as 1e9: whole numbers pass.
    const double d = v.get<double>();
    if (d >= 0 && d < 9.0e18 && d == static_cast<double>(static_cast<uint64_t>(d))) {
      return StrCat(static_cast<uint64_t>(d));
    }
    return Status::InvalidArgument(StrCat(key, ": ", v.dump(), " is not an integer"));
  }
  return Status::InvalidArgument(StrCat(key, ": expected a ",
                                        kind == Kind::kList ? "string or list" : "scalar", ", got ",
                                        v.type_name()));
}

enum class Match { kNone, kTunable, kIgnored, kSection };

// What a dotted key is: a tunable, an ignored DeepSpeed key, a section that
// holds known keys, or nothing ztier knows.
Match Classify(const std::string& key, const Tunable** tunable) {
  bool section = false;
  const std::string as_prefix = key + ".";
  for (const Tunable& t : Table()) {
    for (const char* k : t.json_keys) {
      if (key == k) {
        *tunable = &t;
        return Match::kTunable;
      }
      section = section || std::string_view(k).starts_with(as_prefix);
    }
  }
  for (const char* k : IgnoredKeys()) {
    if (key == k) return Match::kIgnored;
    section = section || std::string_view(k).starts_with(as_prefix);
  }
  return section ? Match::kSection : Match::kNone;
}

Status Walk(const Json& node, const std::string& prefix, Settings& s, std::string_view origin) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    const Tunable* t = nullptr;
    switch (Classify(key, &t)) {
      case Match::kTunable: {
        Result<std::string> text = LeafText(it.value(), t->kind, key);
        Status st = text.ok() ? t->set(s, *text, key) : text.status();
        if (!st.ok()) return st.Annotate(origin);
        break;
      }
      case Match::kIgnored:
        break;
      case Match::kSection:
        if (!it.value().is_object()) {
          return Status::InvalidArgument(StrCat(origin, ": '", key, "' must be an object"));
        }
        ZT_RETURN_IF_ERROR(Walk(it.value(), key, s, origin));
        break;
      case Match::kNone:
        return Status::InvalidArgument(
            StrCat(origin, ": unknown key '", key, "' (the README lists every setting)"));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Settings> ParseSettings(std::string_view json, std::string_view origin,
                               const Settings& base) {
  Json doc = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    // Parse again with exceptions, caught here, only to get nlohmann's
    // message with the byte position of the error.
    std::string why = "invalid JSON";
    try {
      const Json probe = Json::parse(json.begin(), json.end());
      (void)probe;
    } catch (const Json::exception& e) {  // parse_error, or out_of_range for huge numbers
      why = e.what();
    }
    return Status::InvalidArgument(StrCat(origin, ": ", why));
  }
  if (!doc.is_object()) {
    return Status::InvalidArgument(StrCat(origin, ": the config must be a JSON object"));
  }
  Settings s = base;
  try {
    ZT_RETURN_IF_ERROR(Walk(doc, "", s, origin));
  } catch (const Json::exception& e) {  // nothing escapes this component
    return Status::InvalidArgument(StrCat(origin, ": ", e.what()));
  }
  return s;
}

Result<Settings> LoadSettings(const std::string& path, const Settings& base) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return PosixError(StrCat("open config ", path), errno);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::IoError(StrCat("reading config ", path));
  return ParseSettings(text.str(), path, base);
}

Result<Settings> ApplyEnvironment(const Settings& base, const char* const* env) {
  Settings s = base;
  if (env == nullptr) return s;
  for (const Tunable& t : Table()) {
    const std::string prefix = std::string(t.env) + "=";
    for (const char* const* e = env; *e != nullptr; ++e) {
      if (std::strncmp(*e, prefix.c_str(), prefix.size()) != 0) continue;
      // An env variable replaces (not merges) the list from the file.
      if (t.kind == Kind::kList) s.nvme_paths.clear();
      ZT_RETURN_IF_ERROR(t.set(s, *e + prefix.size(), t.env));
    }
  }
  return s;
}

Status Validate(const Settings& s) {
  if ((s.optimizer_tier == Tier::kNvme || s.param_tier == Tier::kNvme) && s.nvme_paths.empty()) {
    return Status::InvalidArgument(
        "device nvme needs swap directories: set zero_optimization.offload_optimizer.nvme_path "
        "or ZTIER_NVME_PATHS");
  }
  if (s.nvme_capacity_per_path < s.stripe_bytes && !s.nvme_paths.empty()) {
    return Status::InvalidArgument(StrCat("ztier.nvme_capacity (", s.nvme_capacity_per_path,
                                          ") is smaller than one stripe (", s.stripe_bytes, ")"));
  }
  return Status::Ok();
}

std::vector<std::string> NonDefaultSettings(const Settings& s) {
  const Settings defaults;
  std::vector<std::string> out;
  for (const Tunable& t : Table()) {
    const std::string now = t.get(s);
    if (now != t.get(defaults)) out.push_back(StrCat(t.json_keys[0], " = ", now));
  }
  return out;
}

std::string DescribeSettings() {
  std::string out = "| config key | environment | default | meaning |\n| --- | --- | --- | --- |\n";
  for (const Tunable& t : Table()) {
    std::string keys;
    for (const char* k : t.json_keys) keys += (keys.empty() ? "" : ", ") + StrCat("`", k, "`");
    out += StrCat("| ", keys, " | `", t.env, "` | ", t.default_text, " | ", t.doc, " |\n");
  }
  out += "\nAccepted and ignored (DeepSpeed settings with no meaning in ztier): ";
  std::string ignored;
  for (const char* k : IgnoredKeys())
    ignored += (ignored.empty() ? "" : ", ") + StrCat("`", k, "`");
  return out + ignored + ".\n";
}

}  // namespace ztier::engine
