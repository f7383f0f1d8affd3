// ztier engine: settings, declared once, read from a JSON config file and
// ZTIER_* environment variables.
//
// Every tunable is one row of a table (settings.cc): its JSON key path, its
// environment variable, its parser and its documentation. The config file
// uses DeepSpeed's keys where they mean the same thing, so a DeepSpeed user
// can bring the offload part of a ds_config:
//
//   {"zero_optimization": {"stage": 3,
//      "offload_optimizer": {"device": "nvme", "nvme_path": ["/nvme0", "/nvme1"],
//                            "pin_memory": true, "buffer_count": 4},
//      "offload_param": {"device": "cpu"}},
//    "aio": {"block_size": 1048576, "queue_depth": 16},
//    "ztier": {"dram_budget": "64G", "nvme_capacity": "2T"}}
//
// Unknown keys are an error naming the key; so are values of the wrong type
// or out of range. A few DeepSpeed keys that have no meaning here
// (zero_optimization.stage and friends, aio.thread_count, ...) are accepted
// and ignored; DescribeSettings() lists them. Environment variables override
// the file. Sizes take a number of bytes or a string with K/M/G/T suffix
// (powers of 1024).
//
// Pure functions; thread-safe.
#ifndef ZTIER_ENGINE_SETTINGS_H_
#define ZTIER_ENGINE_SETTINGS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/dram_pool.h"

namespace ztier::engine {

enum class Tier : uint8_t { kDram, kNvme };

struct Settings {
  // Pinned DRAM pool.
  uint64_t dram_budget_bytes = uint64_t{8} << 30;
  HugePages huge_pages = HugePages::kTransparent;
  bool pin_memory = true;
  // NVMe swap space.
  std::vector<std::string> nvme_paths;
  uint64_t nvme_capacity_per_path = uint64_t{64} << 30;
  uint64_t stripe_bytes = uint64_t{1} << 20;
  uint32_t queue_depth = 16;
  bool checksums = true;
  // Placement of optimizer states and bf16 params, and the pinned ring that
  // stages NVMe-resident units.
  Tier optimizer_tier = Tier::kDram;
  Tier param_tier = Tier::kDram;
  uint32_t buffer_count = 4;
  // CPU threads of the optimizer, shared by all jobs (0: all cores).
  int optimizer_threads = 0;
  // Client side of stage 3 (each rank's Stage3Runner): the cap on params
  // live on a device and the persistence threshold, in parameters, and the
  // prefetch depth in units.
  uint64_t max_live_parameters = 0;
  uint64_t param_persistence_threshold = 32768;
  int prefetch_depth = 2;

  friend bool operator==(const Settings&, const Settings&) = default;
};

// Parses a JSON config on top of `base`. `origin` names the source in errors.
// Errors: InvalidArgument (syntax with position, unknown key, wrong type or
// value, contradicting keys), always naming the key.
Result<Settings> ParseSettings(std::string_view json, std::string_view origin,
                               const Settings& base = {});
// Reads and parses a config file. Errors: NotFound, IoError, as ParseSettings.
Result<Settings> LoadSettings(const std::string& path, const Settings& base = {});
// Applies ZTIER_* variables from `env` (a null-terminated array like
// environ). Errors: InvalidArgument naming the variable.
Result<Settings> ApplyEnvironment(const Settings& base, const char* const* env);
// Checks cross-setting constraints (NVMe placement needs paths, ...).
Status Validate(const Settings& s);
// "key = value" lines for every setting that differs from the default (the
// engine logs them at start).
std::vector<std::string> NonDefaultSettings(const Settings& s);
// Markdown table of every setting: JSON key, environment variable, default,
// meaning; and the accepted-but-ignored DeepSpeed keys.
std::string DescribeSettings();

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_SETTINGS_H_
