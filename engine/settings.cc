// ztier engine: the settings table and its JSON / environment / flag readers.
#include "engine/settings.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "common/log.h"
#include "common/numbers.h"
#include "engine/json_strict.h"

namespace ztier::engine {
namespace {

using Json = nlohmann::json;

// ---- value parsers (from the text of a JSON leaf, an env var or a flag)

Result<uint64_t> ParseSizeKey(std::string_view text, std::string_view key) {
  Result<uint64_t> v = ParseSize(text);
  if (!v.ok()) return Status::InvalidArgument(StrCat(key, ": ", v.status().message()));
  return v;
}

// A count of elements: a size (suffixes allowed), or a number such as
// DeepSpeed configs write (1e9), which must be a whole number.
Result<uint64_t> ParseCount(std::string_view text, std::string_view key) {
  Result<uint64_t> size = ParseSize(text);
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

// A count of parameters whose bytes (2 a bf16 param) are counted in a
// uint64_t: at most 2^60 (far past any device), so the bytes cannot wrap.
Result<uint64_t> ParseParamCount(std::string_view text, std::string_view key) {
  ZT_ASSIGN_OR_RETURN(uint64_t n, ParseCount(text, key));
  constexpr uint64_t kMax = uint64_t{1} << 60;
  if (n > kMax) {
    return Status::InvalidArgument(
        StrCat(key, ": ", n, " parameters is more than ", kMax, " (0 means no limit)"));
  }
  return n;
}

// An integer; a whole number written as 5e2 is accepted, as DeepSpeed does.
Result<int64_t> ParseInt(std::string_view text, std::string_view key, int64_t lo, int64_t hi) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size()) {
    double d = 0;
    auto [dptr, dec] = std::from_chars(text.data(), text.data() + text.size(), d);
    if (dec != std::errc() || dptr != text.data() + text.size() || !std::isfinite(d) ||
        d != std::trunc(d) || std::fabs(d) > 9.0e18) {
      return Status::InvalidArgument(StrCat(key, ": '", text, "' is not an integer"));
    }
    v = static_cast<int64_t>(d);
  }
  if (v < lo || v > hi) {
    return Status::InvalidArgument(StrCat(key, ": ", v, " is outside ", lo, "..", hi));
  }
  return v;
}

// A finite number in [lo, hi].
Result<double> ParseDouble(std::string_view text, std::string_view key, double lo, double hi) {
  double d = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
  if (ec != std::errc() || ptr != text.data() + text.size() || !std::isfinite(d)) {
    return Status::InvalidArgument(StrCat(key, ": '", text, "' is not a finite number"));
  }
  if (d < lo || d > hi) {
    return Status::InvalidArgument(StrCat(key, ": ", text, " is outside ", lo, "..", hi));
  }
  return d;
}

Result<float> ParseReal(std::string_view text, std::string_view key, double lo, double hi) {
  ZT_ASSIGN_OR_RETURN(double d, ParseDouble(text, key, lo, hi));
  // Kept in fp32: a value it cannot hold would become inf or 0 (an lr of
  // 1e-50 trained at lr 0) without a word.
  const float f = static_cast<float>(d);
  if (!std::isfinite(f) || (d != 0 && f == 0)) {
    return Status::InvalidArgument(StrCat(key, ": ", text,
                                          " is outside what fp32 holds (magnitudes from about "
                                          "1e-45 to 3.4e38, or 0)"));
  }
  return f;
}

Result<bool> ParseBool(std::string_view text, std::string_view key) {
  // In any case, as sizes' suffixes are ("TRUE" was refused, "1gb" taken).
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "true" || lower == "1" || lower == "on" || lower == "yes") return true;
  if (lower == "false" || lower == "0" || lower == "off" || lower == "no") return false;
  return Status::InvalidArgument(
      StrCat(key, ": '", text, "' is not a boolean (true, false, 1, 0, on, off, yes or no)"));
}

Result<Tier> ParseTier(std::string_view text, std::string_view key) {
  // DeepSpeed's "cpu" is ztier's pinned DRAM tier; its "none" (states on the
  // GPU) is the nearest ztier has: DRAM.
  if (text == "cpu" || text == "dram" || text == "none") return Tier::kDram;
  if (text == "nvme") return Tier::kNvme;
  return Status::InvalidArgument(StrCat(key, ": device '", text, "' is not cpu, nvme or none"));
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

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

template <class T>
std::string OptText(const std::optional<T>& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? std::string(*v ? "true" : "false") : std::string();
  } else {
    return v ? StrCat(*v) : std::string();
  }
}

// ---- the table

// The JSON value a row takes; every other JSON type is an error naming it.
enum class JsonType {
  kString,         // a string
  kBool,           // true / false
  kInteger,        // an integer (or a whole 5e2)
  kNumber,         // any finite number
  kSize,           // an integer or a string with a suffix ("64G")
  kPaths,          // a string (comma-separated) or a list of strings
  kPair,           // a list of two numbers
  kFlagOrSection,  // true / false, or an object whose presence means true
};

struct Tunable {
  std::vector<const char*> json_keys;  // dotted paths; all set the same field
  const char* env;                     // "" for hidden rows
  JsonType type;
  const char* default_text;
  const char* doc;  // "" for hidden rows (legacy spellings of another row)
  std::function<Status(Settings&, std::string_view text, std::string_view key)> set;
  std::function<std::string(const Settings&)> get;
  const char* source_key = nullptr;  // hidden rows: the row whose field they set
  bool hidden() const { return doc[0] == '\0'; }
  const char* key() const { return source_key != nullptr ? source_key : json_keys[0]; }
};

const char* HugeText(HugePages h) {
  return h == HugePages::kNone ? "none" : h == HugePages::kHugetlb ? "hugetlb" : "transparent";
}
const char* BackendText(nvme::BackendChoice b) {
  return b == nvme::BackendChoice::kUring     ? "io_uring"
         : b == nvme::BackendChoice::kThreads ? "threads"
                                              : "auto";
}

// A row setting one optional field of the training settings: a bool, an
// integer in [lo, hi] or a finite number in [lo, hi].
template <class T>
Tunable TrainingRow(std::vector<const char*> keys, const char* env, const char* doc,
                    std::optional<T> TrainingSettings::*field, double lo = 0, double hi = 0) {
  constexpr JsonType type = std::is_same_v<T, bool>       ? JsonType::kBool
                            : std::is_floating_point_v<T> ? JsonType::kNumber
                                                          : JsonType::kInteger;
  return {std::move(keys),
          env,
          type,
          "(program's)",
          doc,
          [=](Settings& s, std::string_view t, std::string_view k) -> Status {
            if constexpr (std::is_same_v<T, bool>) {
              ZT_ASSIGN_OR_RETURN(s.training.*field, ParseBool(t, k));
            } else if constexpr (std::is_floating_point_v<T>) {
              ZT_ASSIGN_OR_RETURN(s.training.*field, ParseReal(t, k, lo, hi));
            } else {
              ZT_ASSIGN_OR_RETURN(
                  int64_t v, ParseInt(t, k, static_cast<int64_t>(lo), static_cast<int64_t>(hi)));
              s.training.*field = static_cast<T>(v);
            }
            return Status::Ok();
          },
          [=](const Settings& s) { return OptText(s.training.*field); }};
}

const std::vector<Tunable>& Table() {
  static const std::vector<Tunable> table = {
      {{"ztier.dram_budget"},
       "ZTIER_DRAM_BUDGET",
       JsonType::kSize,
       "8G",
       "Hard cap on pinned host DRAM held by the engine (all jobs).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.dram_budget_bytes, ParseSizeKey(t, k));
         if (s.dram_budget_bytes == 0) return Status::InvalidArgument(StrCat(k, ": must be > 0"));
         // `64` meant as GiB is 64 bytes (and `1K` a slip for `1G`): every
         // job refused, the cause far away.
         if (s.dram_budget_bytes < (uint64_t{1} << 20)) {
           const bool bare = t.find_first_not_of("0123456789") == std::string_view::npos;
           return Status::InvalidArgument(StrCat(
               k, ": ", t, bare ? " bytes" : "", " is less than 1 MiB, too little for any job",
               bare ? StrCat(" (a number is bytes: give a unit, as in \"", t, "G\" for GiB)")
                    : std::string()));
         }
         return Status::Ok();
       },
       [](const Settings& s) { return FormatSize(s.dram_budget_bytes); }},
      {{"ztier.huge_pages"},
       "ZTIER_HUGE_PAGES",
       JsonType::kString,
       "transparent",
       "none, transparent (madvise; effective only where the kernel's shmem_enabled allows) or "
       "hugetlb (reserved 2 MiB pages; falls back with a warning). The pool reports the page "
       "size it got.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         if (t == "none") {
           s.huge_pages = HugePages::kNone;
         } else if (t == "transparent") {
           s.huge_pages = HugePages::kTransparent;
         } else if (t == "hugetlb") {
           s.huge_pages = HugePages::kHugetlb;
         } else {
           return Status::InvalidArgument(
               StrCat(k, ": '", t, "' is not none, transparent or hugetlb"));
         }
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(HugeText(s.huge_pages)); }},
      {{"zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_param.pin_memory"},
       "ZTIER_PIN_MEMORY",
       JsonType::kBool,
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
       JsonType::kPaths,
       "(none)",
       "Swap directories, one per drive; they must exist (a list, or a string that is "
       "comma-separated as the variable is: a path with a comma cannot be named). Each is locked "
       "while in use.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         std::vector<std::string> paths = SplitList(t);
         if (paths.empty()) return Status::InvalidArgument(StrCat(k, ": empty path list"));
         if (paths.size() != static_cast<size_t>(std::count(t.begin(), t.end(), ',')) + 1) {
           // ("/a,,/b" became /a,/b: a typo, as a path left out, is said.)
           return Status::InvalidArgument(StrCat(k, ": '", t, "' names an empty path"));
         }
         // "/a/" is "/a": kept without the slash, so two spellings of one
         // list compare equal.
         for (std::string& p : paths) {
           while (p.size() > 1 && p.back() == '/') p.pop_back();
         }
         // One directory twice, as written (the swap space also refuses
         // two spellings of one directory, as it opens them).
         for (size_t i = 0; i < paths.size(); ++i) {
           if (std::find(paths.begin() + i + 1, paths.end(), paths[i]) != paths.end()) {
             return Status::InvalidArgument(
                 StrCat(k, ": '", t, "' names ", paths[i], " twice (one directory per drive)"));
           }
         }
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
       JsonType::kSize,
       "0",
       "Cap on each path's swap file; 0: none. Swap files start empty, grow with their jobs "
       "(fallocate, in steps), give a finished job's blocks back to the drive (holes; the files "
       "keep their size) and are emptied when their last job goes; deleted when the engine "
       "closes.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.nvme_capacity_per_path, ParseSizeKey(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return FormatSize(s.nvme_capacity_per_path); }},
      {{"aio.block_size"},
       "ZTIER_STRIPE_BYTES",
       JsonType::kSize,
       "1M",
       "Stripe unit and I/O size (a multiple of 4 KiB).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.stripe_bytes, ParseSizeKey(t, k));
         if (s.stripe_bytes < 4096 || s.stripe_bytes % 4096 != 0 || s.stripe_bytes > (1u << 30)) {
           return Status::InvalidArgument(
               StrCat(k, ": ", s.stripe_bytes, " is not a multiple of 4096 in 4K..1G"));
         }
         return Status::Ok();
       },
       [](const Settings& s) { return FormatSize(s.stripe_bytes); }},
      {{"aio.queue_depth"},
       "ZTIER_QUEUE_DEPTH",
       JsonType::kInteger,
       "16",
       "I/Os in flight per path.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 1, 4096));
         s.queue_depth = static_cast<uint32_t>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.queue_depth); }},
      {{"ztier.io_backend"},
       "ZTIER_IO_BACKEND",
       JsonType::kString,
       "auto",
       "NVMe I/O: auto (io_uring, or a thread pool with a warning where the kernel refuses "
       "io_uring), io_uring, or threads.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         if (t == "auto") {
           s.io_backend = nvme::BackendChoice::kAuto;
         } else if (t == "io_uring" || t == "uring") {
           s.io_backend = nvme::BackendChoice::kUring;
         } else if (t == "threads") {
           s.io_backend = nvme::BackendChoice::kThreads;
         } else {
           return Status::InvalidArgument(
               StrCat(k, ": '", t, "' is not auto, io_uring or threads"));
         }
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(BackendText(s.io_backend)); }},
      {{"ztier.checksums"},
       "ZTIER_CHECKSUMS",
       JsonType::kBool,
       "true",
       "CRC-32C per stripe unit, checked on every read.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.checksums, ParseBool(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(s.checksums ? "true" : "false"); }},
      {{"zero_optimization.offload_optimizer.device"},
       "ZTIER_OPTIMIZER_DEVICE",
       JsonType::kString,
       "cpu",
       "Client: where a job's fp32 master/m/v live: cpu (pinned DRAM) or nvme (none: as cpu).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.optimizer_tier, ParseTier(t, k));
         return Status::Ok();
       },
       [](const Settings& s) {
         return std::string(s.optimizer_tier == Tier::kNvme ? "nvme" : "cpu");
       }},
      {{"zero_optimization.cpu_offload"},  // DeepSpeed's old spelling of the above
       "",
       JsonType::kBool,
       "",
       "",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(bool on, ParseBool(t, k));
         if (on) s.optimizer_tier = Tier::kDram;
         return Status::Ok();
       },
       nullptr,
       "zero_optimization.offload_optimizer.device"},
      {{"zero_optimization.offload_param.device"},
       "ZTIER_PARAM_DEVICE",
       JsonType::kString,
       "cpu",
       "Client: where a job's bf16 params live between fetches: cpu (pinned DRAM) or nvme (needs "
       "the optimizer "
       "on nvme; clients read through a pinned cache of buffer_count units).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.param_tier, ParseTier(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(s.param_tier == Tier::kNvme ? "nvme" : "cpu"); }},
      {{"zero_optimization.cpu_offload_param", "zero_optimization.cpu_offload_params"},
       "",
       JsonType::kBool,
       "",
       "",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(bool on, ParseBool(t, k));
         if (on) s.param_tier = Tier::kDram;
         return Status::Ok();
       },
       nullptr,
       "zero_optimization.offload_param.device"},
      {{"zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_param.buffer_count"},
       "ZTIER_BUFFER_COUNT",
       JsonType::kInteger,
       "4",
       "Slots of the pinned ring that stages NVMe-resident units (>= 3: read, update, write back).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 3, 1024));
         s.buffer_count = static_cast<uint32_t>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.buffer_count); }},
      {{"ztier.state_dtype"},
       "ZTIER_STATE_DTYPE",
       JsonType::kString,
       "fp32",
       "How AdamW's m and v are kept: fp32, or int8 (block-wise 8-bit dynamic quantization, "
       "256-element blocks: 6 bytes a parameter with the fp32 master instead of 12, so half the "
       "NVMe traffic of a step). Checkpoints load across the two.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         if (t == "fp32") {
           s.state_dtype = StateDtype::kFp32;
         } else if (t == "int8") {
           s.state_dtype = StateDtype::kInt8;
         } else {
           return Status::InvalidArgument(StrCat(k, ": '", t, "' is not fp32 or int8"));
         }
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(StateDtypeName(s.state_dtype)); }},
      {{"zero_optimization.stage3_max_live_parameters", "zero_optimization.max_live_parameters"},
       "ZTIER_MAX_LIVE_PARAMETERS",
       JsonType::kSize,
       "0",
       "Client: cap on the bf16 params each rank keeps on its device (held, prefetched, in "
       "flight), in parameters; 0: no cap.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.max_live_parameters, ParseParamCount(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.max_live_parameters); }},
      {{"zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.param_persistence_threshold"},
       "ZTIER_PARAM_PERSISTENCE_THRESHOLD",
       JsonType::kSize,
       "32768",
       "Client: units of at most this many parameters stay on the device once fetched "
       "(refreshed once per step).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.param_persistence_threshold, ParseParamCount(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.param_persistence_threshold); }},
      {{"ztier.prefetch_depth"},
       "ZTIER_PREFETCH_DEPTH",
       JsonType::kInteger,
       "2",
       "Client: units each rank fetches ahead of the one it computes, in the learned order.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 0, 1024));
         s.prefetch_depth = static_cast<int>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.prefetch_depth); }},
      {{"ztier.coalesce_bytes"},
       "ZTIER_COALESCE_BYTES",
       JsonType::kSize,
       "4M",
       "Client: copies between host and device smaller than this are coalesced: small units "
       "next to each other in the fetch order go in one copy each way (0: off; at most 1G).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.coalesce_bytes, ParseSizeKey(t, k));
         if (s.coalesce_bytes > (uint64_t{1} << 30)) {
           return Status::InvalidArgument(StrCat(k, ": ", s.coalesce_bytes, " is over 1G"));
         }
         return Status::Ok();
       },
       [](const Settings& s) { return FormatSize(s.coalesce_bytes); }},
      {{"ztier.wait_timeout"},
       "ZTIER_WAIT_TIMEOUT",
       JsonType::kInteger,
       "600",
       "Client: seconds a rank waits on the engine (a unit's publish, a param cache slot) before "
       "it fails with a message naming the unit and the step, and ztier.torch's ranks wait for "
       "each other at a collective (a rank that gave up ends its peers' waits too). Through ztierd "
       "every call also has 120 s to be answered: a stopped or hung ztierd fails a call after "
       "120 s (a wait after this plus 120 s; a session's first call, its hello, after 15 s), "
       "and the calls after it at once until it answers again.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 1, 7 * 24 * 3600));
         s.wait_timeout_seconds = static_cast<uint32_t>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.wait_timeout_seconds); }},
      {{"ztier.daemon_socket"},
       "ZTIER_DAEMON_SOCKET",
       JsonType::kString,
       "",
       "Client: the ztierd socket to train through (empty: the engine runs in this process). "
       "With a daemon, the engine's settings (budget, swap paths, threads) are the daemon's.",
       [](Settings& s, std::string_view t, std::string_view) -> Status {
         s.daemon_socket = std::string(t);
         return Status::Ok();
       },
       [](const Settings& s) { return s.daemon_socket; }},
      {{"ztier.poison_released_params"},
       "ZTIER_POISON_RELEASED_PARAMS",
       JsonType::kBool,
       "false",
       "Test mode: fill a param cache slot (params on nvme) with NaNs when its last lease is "
       "released, so a client that still reads it fails loudly instead of by chance.",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.poison_released_params, ParseBool(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return std::string(s.poison_released_params ? "true" : "false"); }},
      {{"ztier.optimizer_threads"},
       "ZTIER_OPTIMIZER_THREADS",
       JsonType::kInteger,
       "0",
       "CPU threads of the optimizer shared by all jobs (0: all cores).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(int64_t v, ParseInt(t, k, 0, 4096));
         s.optimizer_threads = static_cast<int>(v);
         return Status::Ok();
       },
       [](const Settings& s) { return StrCat(s.optimizer_threads); }},
      // ---- training (read by the program that trains: ztier-train, bindings)
      {{"optimizer.type"},
       "ZTIER_OPTIMIZER",
       JsonType::kString,
       "(program's)",
       "Training: AdamW or Adam (case-insensitive; Adam is decoupled AdamW unless "
       "optimizer.params.adam_w_mode is false, as in DeepSpeed).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         const std::string type = Lower(t);
         if (type != "adam" && type != "adamw") {
           return Status::InvalidArgument(
               StrCat(k, ": '", t,
                      "' is not an optimizer ztier runs (its CPU optimizer is AdamW / Adam)"));
         }
         s.training.optimizer_type = type;
         return Status::Ok();
       },
       [](const Settings& s) { return s.training.optimizer_type.value_or(""); }},
      TrainingRow(
          {"optimizer.params.adam_w_mode"}, "ZTIER_ADAM_W_MODE",
          "Training: with optimizer type Adam (or no type given), decoupled weight decay "
          "(true, DeepSpeed's default) or L2 (false); beside type AdamW it is ignored, as in "
          "DeepSpeed (AdamW is decoupled).",
          &TrainingSettings::adam_w_mode),
      TrainingRow({"optimizer.params.lr"}, "ZTIER_LR", "Training: learning rate.",
                  &TrainingSettings::lr, 0, 1e6),
      {{"optimizer.params.betas"},
       "ZTIER_BETAS",
       JsonType::kPair,
       "(program's)",
       "Training: AdamW's beta1, beta2 (a list of two; the variable is \"0.9,0.95\").",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         // Exactly two items: "0.9,,0.95" is a typo, not two betas.
         const std::vector<std::string> parts = SplitList(t);
         if (parts.size() != 2 || std::count(t.begin(), t.end(), ',') != 1) {
           return Status::InvalidArgument(StrCat(k, ": '", t, "' is not two numbers"));
         }
         ZT_ASSIGN_OR_RETURN(double b1, ParseDouble(parts[0], k, 0, 1));
         ZT_ASSIGN_OR_RETURN(double b2, ParseDouble(parts[1], k, 0, 1));
         if (b1 >= 1.0 || b2 >= 1.0) {
           return Status::InvalidArgument(StrCat(k, ": betas must be below 1 (got ", t, ")"));
         }
         s.training.beta1 = b1;
         s.training.beta2 = b2;
         return Status::Ok();
       },
       [](const Settings& s) {
         return s.training.beta1 ? StrCat(*s.training.beta1, ",", *s.training.beta2)
                                 : std::string();
       }},
      TrainingRow({"optimizer.params.eps"}, "ZTIER_EPS", "Training: AdamW's epsilon.",
                  &TrainingSettings::eps, 1e-30, 1),
      TrainingRow({"optimizer.params.weight_decay"}, "ZTIER_WEIGHT_DECAY",
                  "Training: weight decay (decoupled for AdamW, L2 for Adam).",
                  &TrainingSettings::weight_decay, 0, 1e6),
      TrainingRow({"optimizer.params.bias_correction"}, "ZTIER_BIAS_CORRECTION",
                  "Training: Adam's bias correction.", &TrainingSettings::bias_correction),
      {{"optimizer.params.amsgrad"},  // accepted only when it changes nothing
       "",
       JsonType::kBool,
       "",
       "",
       [](Settings&, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(bool on, ParseBool(t, k));
         if (on) return Status::InvalidArgument(StrCat(k, ": ztier's AdamW has no AMSGrad"));
         return Status::Ok();
       },
       nullptr,
       "optimizer.type"},
      TrainingRow({"gradient_clipping"}, "ZTIER_GRADIENT_CLIPPING",
                  "Training: global grad-norm clipping threshold; 0: off.",
                  &TrainingSettings::clip_norm, 0, 1e30),
      TrainingRow({"gradient_accumulation_steps"}, "ZTIER_GRADIENT_ACCUMULATION_STEPS",
                  "Training: micro-steps per optimizer step.", &TrainingSettings::grad_accumulation,
                  1, 1 << 20),
      TrainingRow({"train_micro_batch_size_per_gpu"}, "ZTIER_MICRO_BATCH_SIZE",
                  "Training: sequences per rank and micro-step.", &TrainingSettings::micro_batch, 1,
                  1 << 20),
      TrainingRow({"train_batch_size"}, "ZTIER_TRAIN_BATCH_SIZE",
                  "Training: sequences per optimizer step over all ranks (= micro batch x "
                  "accumulation x ranks; any two of the three give the third).",
                  &TrainingSettings::train_batch, 1, static_cast<double>(int64_t{1} << 40)),
      {{"ztier.activation_checkpointing", "activation_checkpointing"},
       "ZTIER_ACTIVATION_CHECKPOINTING",
       JsonType::kFlagOrSection,
       "(program's)",
       "Training: recompute each block's activations in its backward (a DeepSpeed "
       "activation_checkpointing section turns it on).",
       [](Settings& s, std::string_view t, std::string_view k) -> Status {
         ZT_ASSIGN_OR_RETURN(s.training.activation_checkpointing, ParseBool(t, k));
         return Status::Ok();
       },
       [](const Settings& s) { return OptText(s.training.activation_checkpointing); }},
  };
  return table;
}

// DeepSpeed's known keys that configure DeepSpeed itself and mean nothing
// to ztier: accepted, and listed once as ignored. "x.*" takes any key under
// x (free-form sections, or ones DeepSpeed itself reads loosely).
const std::vector<const char*>& IgnoredKeys() {
  static const std::vector<const char*> keys = {
      // top level
      "steps_per_print",
      "wall_clock_breakdown",
      "memory_breakdown",
      "dump_state",
      "disable_python_gc",
      "disable_allgather",
      "prescale_gradients",
      "gradient_predivide_factor",
      "gradient_allreduce_op",
      "communication_data_type",
      "seq_parallel_communication_data_type",
      "seq_parallel_comm_data_type",
      "sparse_gradients",
      "zero_allow_untested_optimizer",
      "zero_force_ds_cpu_optimizer",
      "graph_harvesting",
      "vocabulary_size",
      "dataloader_drop_last",
      "use_data_before_expert_parallelism",
      "log_level",
      "sequence_parallel_size",
      "allgather_size",
      "managed_gradient_accumulation",
      // zero_optimization
      "zero_optimization.stage",
      "zero_optimization.contiguous_gradients",
      "zero_optimization.reduce_scatter",
      "zero_optimization.reduce_bucket_size",
      "zero_optimization.use_multi_rank_bucket_allreduce",
      "zero_optimization.allgather_partitions",
      "zero_optimization.allgather_bucket_size",
      "zero_optimization.overlap_comm",
      "zero_optimization.load_from_fp32_weights",
      "zero_optimization.elastic_checkpoint",
      "zero_optimization.sub_group_size",
      "zero_optimization.cpu_offload_use_pin_memory",
      "zero_optimization.stage3_prefetch_bucket_size",
      "zero_optimization.prefetch_bucket_size",
      "zero_optimization.stage3_model_persistence_threshold",
      "zero_optimization.model_persistence_threshold",
      "zero_optimization.stage3_max_reuse_distance",
      "zero_optimization.max_reuse_distance",
      "zero_optimization.stage3_gather_16bit_weights_on_model_save",
      "zero_optimization.gather_16bit_weights_on_model_save",
      "zero_optimization.stage3_gather_fp16_weights_on_model_save",
      "zero_optimization.stage3_module_granularity_threshold",
      "zero_optimization.module_granularity_threshold",
      "zero_optimization.stage3_use_all_reduce_for_fetch_params",
      "zero_optimization.use_all_reduce_for_fetch_params",
      "zero_optimization.stage3_allgather_sequential",
      "zero_optimization.allgather_sequential",
      "zero_optimization.stage3_partition_stream_chunk_size",
      "zero_optimization.partition_stream_chunk_size",
      "zero_optimization.ignore_unused_parameters",
      "zero_optimization.legacy_stage1",
      "zero_optimization.round_robin_gradients",
      "zero_optimization.zero_hpz_partition_size",
      "zero_optimization.zero_quantized_weights",
      "zero_optimization.zero_quantized_nontrainable_weights",
      "zero_optimization.zero_quantized_gradients",
      "zero_optimization.mics_shard_size",
      "zero_optimization.mics_hierarchical_params_gather",
      "zero_optimization.memory_efficient_linear",
      "zero_optimization.pipeline_loading_checkpoint",
      "zero_optimization.override_module_apply",
      "zero_optimization.log_trace_cache_warnings",
      "zero_optimization.enable_sanity_checks",
      "zero_optimization.save_muon_momentum_buffer_in_memory",
      "zero_optimization.zenflow.*",
      "zero_optimization.reflow.*",
      "zero_optimization.leaf_module.*",
      "zero_optimization.zeropp_loco_param.*",
      "zero_optimization.offload_param.buffer_size",
      "zero_optimization.offload_param.max_in_cpu",
      "zero_optimization.offload_optimizer.pipeline_read",
      "zero_optimization.offload_optimizer.pipeline_write",
      "zero_optimization.offload_optimizer.fast_init",
      "zero_optimization.offload_optimizer.ratio",
      "zero_optimization.offload_optimizer.super_offload",
      "zero_optimization.offload_optimizer.convert_grad_on_cpu",
      "zero_optimization.offload_optimizer.cpuadam_cores_perc",
      // aio
      "aio.thread_count",
      "aio.intra_op_parallelism",
      "aio.single_submit",
      "aio.overlap_events",
      "aio.use_gds",
      "aio.io_backend",
      // optimizer and scheduler
      "optimizer.legacy_fusion",
      "optimizer.params.torch_adam",
      "optimizer.params.foreach",
      "optimizer.params.capturable",
      "optimizer.params.differentiable",
      "optimizer.params.fused",
      "optimizer.params.set_grad_none",
      "optimizer.params.fp32_optimizer_states",
      "scheduler.type",
      "scheduler.params.*",
      // activation checkpointing (the section itself turns recomputation on)
      "activation_checkpointing.partition_activations",
      "activation_checkpointing.contiguous_memory_optimization",
      "activation_checkpointing.cpu_checkpointing",
      "activation_checkpointing.number_checkpoints",
      "activation_checkpointing.synchronize_checkpoint_boundary",
      "activation_checkpointing.profile",
      // precision (ztier computes in bf16 and keeps fp32 masters)
      "fp16.enabled",
      "fp16.auto_cast",
      "fp16.loss_scale",
      "fp16.initial_scale_power",
      "fp16.loss_scale_window",
      "fp16.hysteresis",
      "fp16.consecutive_hysteresis",
      "fp16.min_loss_scale",
      "fp16.fp16_master_weights_and_grads",
      "fp16.fused_mode",
      "bf16.enabled",
      "bf16.immediate_grad_update",
      "bf16.check_grad_overflow",
      "bf16.check_overflow",
      "bf16.bf16_master_weights_and_grads",
      "bf16.bf16_optimizer_states",
      "bfloat16.enabled",
      "bfloat16.immediate_grad_update",
      "bfloat16.check_grad_overflow",
      "bfloat16.check_overflow",
      "bfloat16.bf16_master_weights_and_grads",
      "bfloat16.bf16_optimizer_states",
      "amp.*",
      "torch_autocast.*",
      "data_types.grad_accum_dtype",
      "data_types.param_dtype",
      "data_types.buffer_dtype",
      // monitoring and profiling
      "tensorboard.enabled",
      "tensorboard.output_path",
      "tensorboard.job_name",
      "csv_monitor.enabled",
      "csv_monitor.output_path",
      "csv_monitor.job_name",
      "wandb.enabled",
      "wandb.group",
      "wandb.team",
      "wandb.project",
      "comet.enabled",
      "comet.samples_log_interval",
      "comet.project",
      "comet.workspace",
      "comet.api_key",
      "comet.experiment_name",
      "comet.experiment_key",
      "comet.online",
      "comet.mode",
      "trackio.enabled",
      "trackio.project",
      "comms_logger.enabled",
      "comms_logger.verbose",
      "comms_logger.prof_all",
      "comms_logger.debug",
      "comms_logger.prof_ops",
      "flops_profiler.enabled",
      "flops_profiler.recompute_fwd_factor",
      "flops_profiler.profile_step",
      "flops_profiler.module_depth",
      "flops_profiler.top_modules",
      "flops_profiler.detailed",
      "flops_profiler.output_file",
      "timers.throughput.enabled",
      "timers.throughput.synchronized",
      // checkpointing (ztier writes its own checkpoints)
      "checkpoint.tag_validation",
      "checkpoint.load_universal",
      "checkpoint.use_node_local_storage",
      "checkpoint.parallel_write.pipeline_stage",
      "checkpoint.checkpoint_serialization",
      "checkpoint.writer.*",
      "nebula.*",
      "datastates_ckpt.*",
      // features of DeepSpeed's engine outside ZeRO offload
      "autotuning.*",
      "elasticity.*",
      "data_efficiency.*",
      "curriculum_learning.*",
      "compression_training.*",
      "quantize_training.*",
      "eigenvalue.*",
      "sparse_attention.*",
      "progressive_layer_drop.*",
      "pipeline.*",
      "hybrid_engine.*",
      "compile.*",
      "tensor_parallel.*",
      "expert_parallel.*",
      "weight_quantization.*",
  };
  return keys;
}

bool IsIgnored(const std::string& key) {
  for (std::string_view k : IgnoredKeys()) {
    if (k.ends_with(".*")) {
      const std::string_view prefix = k.substr(0, k.size() - 1);  // "x."
      if (key.starts_with(prefix) || key == k.substr(0, k.size() - 2)) return true;
    } else if (key == k) {
      return true;
    }
  }
  return false;
}

// The text a JSON leaf gives the row's parser; nullopt for "auto" (leave
// the setting alone). Errors: InvalidArgument naming the key and the types.
Result<std::optional<std::string>> LeafText(const Json& v, JsonType type, std::string_view key) {
  if (v.is_string() && v.get<std::string>() == "auto") return std::optional<std::string>();
  auto wrong = [&](std::string_view want) {
    return Status::InvalidArgument(StrCat(
        key, ": expected ", want, ", got ",
        v.is_null() ? std::string("null") : StrCat(v.type_name(), " ", v.dump().substr(0, 40))));
  };
  auto number_text = [](const Json& n) -> std::string {
    if (n.is_number_float()) {
      const double d = n.get<double>();
      if (std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9.0e18) {
        return StrCat(static_cast<int64_t>(d));  // DeepSpeed writes counts as 1e9
      }
    }
    return n.dump();
  };
  switch (type) {
    case JsonType::kString:
      if (!v.is_string()) return wrong("a string");
      return std::optional<std::string>(v.get<std::string>());
    case JsonType::kBool:
      if (!v.is_boolean()) return wrong("true or false");
      return std::optional<std::string>(v.get<bool>() ? "true" : "false");
    case JsonType::kFlagOrSection:
      if (v.is_object()) return std::optional<std::string>("true");
      if (!v.is_boolean()) return wrong("true, false or an object");
      return std::optional<std::string>(v.get<bool>() ? "true" : "false");
    case JsonType::kInteger:
    case JsonType::kNumber:
      if (!v.is_number()) return wrong("a number");
      return std::optional<std::string>(number_text(v));
    case JsonType::kSize:
      if (v.is_string()) return std::optional<std::string>(v.get<std::string>());
      if (!v.is_number()) return wrong("a size (a number of bytes, or a string like \"64G\")");
      return std::optional<std::string>(number_text(v));
    case JsonType::kPaths: {
      if (v.is_string()) return std::optional<std::string>(v.get<std::string>());
      if (!v.is_array()) return wrong("a string or a list of strings");
      std::string out;
      for (const Json& e : v) {
        if (!e.is_string()) {
          return Status::InvalidArgument(StrCat(key, ": list items must be strings"));
        }
        const std::string s = e.get<std::string>();
        if (s.empty() || s.find(',') != std::string::npos) {
          return Status::InvalidArgument(StrCat(key, ": path '", s, "' is empty or has a comma"));
        }
        out += (out.empty() ? "" : ",") + s;
      }
      return std::optional<std::string>(out);
    }
    case JsonType::kPair:
      if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number()) {
        return wrong("a list of two numbers");
      }
      return std::optional<std::string>(StrCat(v[0].dump(), ",", v[1].dump()));
  }
  return wrong("?");
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
  if (IsIgnored(key)) return Match::kIgnored;
  for (const char* k : IgnoredKeys())
    section = section || std::string_view(k).starts_with(as_prefix);
  return section ? Match::kSection : Match::kNone;
}

// ---- suggestions for a misspelled key or variable

// The ZTIER_ variables that are not settings: logging (common/log.h) and
// the project's scripts and tests (ZTIER_TEST_* too).
constexpr std::string_view kOtherVariables[] = {
    "ZTIER_LOG",
    "ZTIER_LOG_SUBSYS",
    "ZTIER_SOAK_SECONDS",
    "ZTIER_REQUIRE_TORCH",
    "ZTIER_REQUIRE_PROMTOOL",
    "ZTIER_TORCH_PYTHON",
    "ZTIER_VENV",
    "ZTIER_PYTHON",
    "ZTIER_PYTHON_PACKAGE",
    "ZTIER_SANITIZE",
    "ZTIER_GPU_CHECK_SECONDS",
    "ZTIER_GPU_PYTHON",
    "ZTIER_GPU_RUN_PYTHON",
    "ZTIER_KEEP_INSTALL_TEST",
    "ZTIER_LOG_TEST_OUT",
    "ZTIER_RECORD_LOSS_CURVE",
    "ZTIER_COMPARE_ADAM_REEXEC",
    "ZTIER_PLOT_REEXEC",
};

// Levenshtein distance, case-insensitive (keys and variables are short).
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
      const size_t next = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = row[j];
      row[j] = next;
    }
  }
  return row[b.size()];
}

// "; did you mean 'X'?" for the setting's name closest to `name` (config
// keys and ignored DeepSpeed keys, or with `variables` the environment
// variables), when one is a plausible misspelling of it; else "".
std::string DidYouMean(std::string_view name, bool variables) {
  std::string_view best;
  size_t best_distance = std::max<size_t>(2, name.size() / 5) + 1;
  auto consider = [&](std::string_view candidate) {
    // A name cut short (gradient_clip) is as close as one typo.
    const bool cut = candidate.starts_with(name) && name.size() * 2 >= candidate.size();
    // The distance is at least the lengths' difference: a name far longer
    // than any setting's (an 80 KB key took 15 s) is compared with none.
    const size_t longer = std::max(name.size(), candidate.size());
    if (!cut && longer - std::min(name.size(), candidate.size()) >= best_distance) return;
    const size_t d = cut ? 1 : EditDistance(name, candidate);
    if (d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  };
  for (const Tunable& t : Table()) {
    if (variables) {
      if (t.env[0] != '\0') consider(t.env);
    } else {
      for (const char* k : t.json_keys) consider(k);
    }
  }
  if (variables) {
    for (std::string_view v : kOtherVariables) consider(v);
  } else {
    for (const char* k : IgnoredKeys()) consider(k);
  }
  return best.empty() ? "" : StrCat("; did you mean '", best, "'?");
}

// Records `origin` as the source of row t's setting, set to `text`. A
// hidden row's false (DeepSpeed's cpu_offload: false, amsgrad: false) sets
// nothing: the setting it stands for is not that origin's, and a default
// that depends on that (ztier-train's DRAM through ztierd) still applies.
void Record(Settings& s, const Tunable& t, std::string_view origin, std::string_view text) {
  if (t.hidden() && t.type == JsonType::kBool) {
    Result<bool> on = ParseBool(text, t.key());
    if (on.ok() && !*on) return;
  }
  s.sources[t.key()] = std::string(origin);
}

struct WalkState {
  std::string_view origin;
  std::vector<std::string> ignored;
  // The settings this file set: {key, value}, by row (two keys of one row,
  // offload_param's and offload_optimizer's, must agree).
  std::map<const Tunable*, std::pair<std::string, std::string>> set;
};

Status Walk(const Json& node, const std::string& prefix, Settings& s, WalkState& w);

// A section's known children that are DeepSpeed's and ignored.
Status WalkIgnoredChildren(const Json& node, const std::string& prefix, WalkState& w) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string key = prefix + "." + it.key();
    if (IsIgnored(key)) {
      w.ignored.push_back(key);
    } else {
      return Status::InvalidArgument(StrCat(w.origin, ": unknown key '", key, "'",
                                            DidYouMean(key, false),
                                            " (docs/configuration.md lists every setting)"));
    }
  }
  return Status::Ok();
}

// Two keys of one row given {key, text} each mean one value: the same
// text, or texts read as the same ("1M" and 1048576).
bool SameValue(const Tunable& t, const std::pair<std::string, std::string>& a,
               const std::pair<std::string, std::string>& b) {
  if (a.second == b.second) return true;
  if (t.get == nullptr) return false;
  Settings sa, sb;
  return t.set(sa, a.second, a.first).ok() && t.set(sb, b.second, b.first).ok() &&
         t.get(sa) == t.get(sb);
}

Status Walk(const Json& node, const std::string& prefix, Settings& s, WalkState& w) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    const Tunable* t = nullptr;
    switch (Classify(key, &t)) {
      case Match::kTunable: {
        Result<std::optional<std::string>> text = LeafText(it.value(), t->type, key);
        if (!text.ok()) return text.status().Annotate(w.origin);
        if (!text->has_value()) break;  // "auto"
        Status st = t->set(s, **text, key);
        if (!st.ok()) return st.Annotate(w.origin);
        const auto [earlier, first] = w.set.try_emplace(t, key, **text);
        if (!first && !SameValue(*t, earlier->second, {key, **text})) {
          return Status::InvalidArgument(StrCat(w.origin, ": '", key, "' is ", **text, " but '",
                                                earlier->second.first, "', the same setting, is ",
                                                earlier->second.second,
                                                "; give one value (or the same in both)"));
        }
        Record(s, *t, w.origin, **text);
        if (t->type == JsonType::kFlagOrSection && it.value().is_object()) {
          ZT_RETURN_IF_ERROR(WalkIgnoredChildren(it.value(), key, w));
        }
        break;
      }
      case Match::kIgnored:
        w.ignored.push_back(key);
        break;
      case Match::kSection:
        if (key == "zero_optimization" && it.value().is_boolean()) {  // DeepSpeed's old form
          w.ignored.push_back(key);
          break;
        }
        if (!it.value().is_object()) {
          return Status::InvalidArgument(StrCat(w.origin, ": '", key, "' must be an object"));
        }
        ZT_RETURN_IF_ERROR(Walk(it.value(), key, s, w));
        break;
      case Match::kNone:
        return Status::InvalidArgument(StrCat(w.origin, ": unknown key '", key, "'",
                                              DidYouMean(key, false),
                                              " (docs/configuration.md lists every setting)"));
    }
  }
  return Status::Ok();
}

// DeepSpeed reads its config with hjson, and its own documented configs
// rely on that: comments, trailing commas, members separated only by a line
// break. This turns such text into JSON: comments become spaces (line
// breaks kept, so error positions stay right), a trailing comma becomes a
// space, and a comma is inserted where a line break separates two values.
std::string RelaxedToJson(std::string_view in) {
  enum class Last { kNone, kOpen, kComma, kColon, kValue };
  std::string out;
  out.reserve(in.size() + 16);
  Last last = Last::kNone;
  size_t last_comma = std::string::npos;  // in `out`
  bool newline_since_value = false;
  int depth = 0;  // of objects and arrays: between two top-level values no comma goes
  auto value_start = [&] {
    if (last == Last::kValue && newline_since_value && depth > 0) out += ',';
  };
  for (size_t i = 0; i < in.size(); ++i) {
    const char c = in[i];
    if (c == '"') {
      value_start();
      size_t j = i + 1;
      while (j < in.size() && in[j] != '"') j += in[j] == '\\' ? 2 : 1;
      if (j >= in.size()) {  // unterminated: the parser reports it
        out.append(in.substr(i));
        break;
      }
      out.append(in.substr(i, j - i + 1));
      i = j;
      last = Last::kValue;
      newline_since_value = false;
    } else if (c == '#' || (c == '/' && i + 1 < in.size() && in[i + 1] == '/')) {
      while (i < in.size() && in[i] != '\n') {
        out += ' ';
        ++i;
      }
      if (i < in.size()) {
        out += '\n';
        newline_since_value = true;
      }
    } else if (c == '/' && i + 1 < in.size() && in[i + 1] == '*') {
      const size_t end = in.find("*/", i + 2);
      if (end == std::string_view::npos) {  // unterminated: the parser reports it
        out.append(in.substr(i));
        break;
      }
      const size_t stop = end + 2;
      for (; i < stop; ++i) {
        const bool nl = in[i] == '\n';
        out += nl ? '\n' : ' ';
        newline_since_value = newline_since_value || nl;
      }
      --i;
    } else if (c == ',') {
      // Trailing only after a value: "{,}" and "[1,,]" stay for the parser
      // to refuse.
      last_comma = last == Last::kValue ? out.size() : std::string::npos;
      out += c;
      last = Last::kComma;
    } else if (c == '}' || c == ']') {
      --depth;
      if (last == Last::kComma && last_comma != std::string::npos) out[last_comma] = ' ';
      out += c;
      last = Last::kValue;
      newline_since_value = false;
    } else if (c == '{' || c == '[') {
      value_start();
      ++depth;
      out += c;
      last = Last::kOpen;
    } else if (c == ':') {
      out += c;
      last = Last::kColon;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      out += c;
      if (c == '\n') newline_since_value = true;
    } else {
      // A literal (number, true, false, null, or junk the parser rejects).
      value_start();
      auto literal = [](char ch) {
        return std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '+' || ch == '-';
      };
      size_t j = i;
      while (j < in.size() && literal(in[j])) ++j;
      if (j == i) {
        out += c;  // a character no rule takes: the parser names it
      } else {
        out.append(in.substr(i, j - i));
        i = j - 1;
      }
      last = Last::kValue;
      newline_since_value = false;
    }
  }
  return out;
}

const Tunable* FindRow(std::string_view key) {
  for (const Tunable& t : Table()) {
    if (t.env[0] != '\0' && key == t.env) return &t;
    for (const char* k : t.json_keys) {
      if (key == k) return &t;
    }
  }
  return nullptr;
}

bool KnownVariable(std::string_view name) {
  if (name.starts_with("ZTIER_TEST_")) return true;
  for (std::string_view v : kOtherVariables) {
    if (name == v) return true;
  }
  return FindRow(name) != nullptr;
}

// A misspelled variable would otherwise be dropped in silence and its
// setting keep its default; once per name and process (a Python process
// opens many sessions).
void WarnUnknownVariable(std::string_view name) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> warned;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!warned.emplace(name).second) return;
  }
  ZT_LOG(kWarn, "engine") << name << " is set but names no setting and is ignored"
                          << DidYouMean(name, true)
                          << " (docs/configuration.md lists every variable)";
}

// DeepSpeed's old spellings (zero_optimization.cpu_offload: true) beside the
// setting they stand for, set otherwise (offload_optimizer.device nvme): the
// file's order of keys decided which won, in silence. False means only that
// the old spelling offloads nothing, so it never contradicts.
Status CheckOldSpellings(const WalkState& w) {
  for (const auto& [row, set] : w.set) {
    if (row->source_key == nullptr || set.second != "true") continue;
    const Tunable* main = FindRow(row->source_key);
    const auto other = w.set.find(main);
    if (main == nullptr || other == w.set.end()) continue;
    Settings old_alone, main_alone;
    ZT_RETURN_IF_ERROR(row->set(old_alone, set.second, set.first));
    ZT_RETURN_IF_ERROR(main->set(main_alone, other->second.second, other->second.first));
    if (main->get(old_alone) != main->get(main_alone)) {
      return Status::InvalidArgument(
          StrCat(w.origin, ": '", set.first, "' (DeepSpeed's old spelling) is true, which means ",
                 main->key(), " ", main->get(old_alone), ", but '", other->second.first, "' is ",
                 other->second.second, "; give one of the two"));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Settings> ParseSettings(std::string_view json, std::string_view origin,
                               const Settings& base) {
  Settings s = base;
  WalkState w{origin, {}, {}};
  // A byte-order mark, as Windows editors write one, is not the config's
  // (taken as a value, a comment or line break after it made a comma appear).
  if (json.starts_with("\xEF\xBB\xBF")) json.remove_prefix(3);
  try {
    ZT_ASSIGN_OR_RETURN(Json doc, ParseJsonStrict(RelaxedToJson(json), origin));
    if (!doc.is_object()) {
      return Status::InvalidArgument(StrCat(origin, ": the config must be a JSON object"));
    }
    ZT_RETURN_IF_ERROR(Walk(doc, "", s, w));
    ZT_RETURN_IF_ERROR(CheckOldSpellings(w));
  } catch (const Json::exception& e) {  // nothing escapes this component
    return Status::InvalidArgument(StrCat(origin, ": ", e.what()));
  }
  if (!w.ignored.empty()) {
    std::string list;
    for (const std::string& k : w.ignored) list += (list.empty() ? "" : ", ") + k;
    ZT_LOG(kWarn, "engine") << origin << ": " << w.ignored.size()
                            << " DeepSpeed setting(s) mean nothing to ztier and are ignored: "
                            << list;
  }
  return s;
}

Result<Settings> LoadSettings(const std::string& path, const Settings& base) {
  Result<std::string> text = ReadFileToString(path, uint64_t{16} << 20);
  if (!text.ok()) return text.status().Annotate("config");
  return ParseSettings(*text, path, base);
}

Result<Settings> ApplyEnvironment(const Settings& base, const char* const* env) {
  Settings s = base;
  if (env == nullptr) return s;
  for (const Tunable& t : Table()) {
    if (t.env[0] == '\0') continue;
    const std::string prefix = std::string(t.env) + "=";
    for (const char* const* e = env; *e != nullptr; ++e) {
      if (std::strncmp(*e, prefix.c_str(), prefix.size()) != 0) continue;
      // A variable replaces (not merges) the list from the file.
      if (t.type == JsonType::kPaths) s.nvme_paths.clear();
      ZT_RETURN_IF_ERROR(t.set(s, *e + prefix.size(), t.env));
      Record(s, t, t.env, *e + prefix.size());
    }
  }
  for (const char* const* e = env; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (name.starts_with("ZTIER_") && !KnownVariable(name)) WarnUnknownVariable(name);
  }
  return s;
}

Result<Settings> ApplySetting(const Settings& base, std::string_view key, std::string_view text,
                              std::string_view origin) {
  const Tunable* t = FindRow(key);
  if (t == nullptr) {
    const bool variable = key.starts_with("ZTIER_");
    return Status::InvalidArgument(
        StrCat(origin, ": no setting '", key, "'", DidYouMean(key, variable)));
  }
  Settings s = base;
  if (t->type == JsonType::kPaths) s.nvme_paths.clear();  // replaces, as a variable does
  Status st = t->set(s, text, origin);
  if (!st.ok()) return st;
  Record(s, *t, origin, text);
  return s;
}

Status Validate(const Settings& s) {
  // Through a daemon the swap directories are the daemon's.
  if ((s.optimizer_tier == Tier::kNvme || s.param_tier == Tier::kNvme) && s.nvme_paths.empty() &&
      s.daemon_socket.empty()) {
    return Status::InvalidArgument(
        "device nvme needs swap directories: set zero_optimization.offload_optimizer.nvme_path "
        "or ZTIER_NVME_PATHS");
  }
  if (s.nvme_capacity_per_path != 0 && s.nvme_capacity_per_path < s.stripe_bytes) {
    return Status::InvalidArgument(StrCat("ztier.nvme_capacity (", s.nvme_capacity_per_path,
                                          ") is smaller than one stripe (", s.stripe_bytes, ")"));
  }
  // What the parser range-checks, for Settings made in code: a ring of
  // fewer than 3 slots read every unit into one slot (2 read nothing ahead).
  if (s.buffer_count < 3 || s.buffer_count > 1024) {
    return Status::InvalidArgument(
        StrCat("buffer_count ", s.buffer_count, ": the ring takes 3 to 1024 slots"));
  }
  if (s.queue_depth < 1 || s.queue_depth > 4096) {
    return Status::InvalidArgument(StrCat("aio.queue_depth ", s.queue_depth, ": 1 to 4096"));
  }
  if (s.stripe_bytes < 4096 || s.stripe_bytes % 4096 != 0 || s.stripe_bytes > (1u << 30)) {
    return Status::InvalidArgument(
        StrCat("aio.block_size ", s.stripe_bytes, ": a multiple of 4096 in 4K..1G"));
  }
  if (s.optimizer_threads < 0 || s.optimizer_threads > 4096) {
    return Status::InvalidArgument(
        StrCat("ztier.optimizer_threads ", s.optimizer_threads, ": 0 (all cores) to 4096"));
  }
  return Status::Ok();
}

std::vector<std::string> NonDefaultSettings(const Settings& s) {
  const Settings defaults;
  std::vector<std::string> out;
  for (const Tunable& t : Table()) {
    if (t.hidden()) continue;
    const std::string now = t.get(s);
    auto src = s.sources.find(t.key());
    // A value someone set is listed with its source even when it equals the
    // default: it may override a program's own default.
    if (now == t.get(defaults) && src == s.sources.end()) continue;
    out.push_back(StrCat(t.key(), " = ", now,
                         src != s.sources.end() ? StrCat(" (from ", src->second, ")") : ""));
  }
  return out;
}

std::vector<std::string> ClientOnlySettingsSet(const Settings& s) {
  std::vector<std::string> out;
  for (const Tunable& t : Table()) {
    if (t.hidden()) continue;
    const std::string_view doc = t.doc;
    if (!doc.starts_with("Client:") && !doc.starts_with("Training:")) continue;
    auto src = s.sources.find(t.key());
    if (src != s.sources.end()) out.push_back(StrCat(t.key(), " (from ", src->second, ")"));
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> EngineOnlySettingsSet(const Settings& s) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Tunable& t : Table()) {
    if (t.hidden()) continue;
    const std::string_view doc = t.doc;
    if (doc.starts_with("Client:") || doc.starts_with("Training:")) continue;
    if (std::string_view(t.key()) == "ztier.state_dtype") continue;  // the job's own
    auto src = s.sources.find(t.key());
    if (src != s.sources.end()) out.emplace_back(t.key(), src->second);
  }
  return out;
}

cpu_adam::Hyper TrainingHyper(const Settings& s, cpu_adam::Hyper h) {
  const TrainingSettings& t = s.training;
  if (t.optimizer_type) {
    const bool decoupled = *t.optimizer_type == "adamw" || t.adam_w_mode.value_or(true);
    h.mode = decoupled ? cpu_adam::Mode::kAdamW : cpu_adam::Mode::kAdam;
  } else if (t.adam_w_mode) {
    h.mode = *t.adam_w_mode ? cpu_adam::Mode::kAdamW : cpu_adam::Mode::kAdam;
  }
  if (t.lr) h.lr = *t.lr;
  if (t.beta1) h.beta1 = *t.beta1;
  if (t.beta2) h.beta2 = *t.beta2;
  if (t.eps) h.eps = *t.eps;
  if (t.weight_decay) h.weight_decay = *t.weight_decay;
  if (t.bias_correction) {
    h.bias_correction =
        *t.bias_correction ? cpu_adam::BiasCorrection::kOn : cpu_adam::BiasCorrection::kOff;
  }
  return h;
}

std::string DescribeSettings() {
  std::string out = "| config key | environment | default | meaning |\n| --- | --- | --- | --- |\n";
  for (const Tunable& t : Table()) {
    if (t.hidden()) continue;
    std::string keys;
    for (const char* k : t.json_keys) keys += (keys.empty() ? "" : ", ") + StrCat("`", k, "`");
    out += StrCat("| ", keys, " | `", t.env, "` | ", t.default_text, " | ", t.doc, " |\n");
  }
  out +=
      "\nAlso read: `zero_optimization.cpu_offload` and `cpu_offload_param(s)` (DeepSpeed's old "
      "spellings of the devices), `optimizer.params.amsgrad` (false only).\n"
      "\nAccepted and ignored (DeepSpeed settings with no meaning in ztier; `x.*` is everything "
      "under x): ";
  std::string ignored;
  for (const char* k : IgnoredKeys()) {
    ignored += (ignored.empty() ? "" : ", ") + StrCat("`", k, "`");
  }
  return out + ignored + ".\n";
}

}  // namespace ztier::engine
