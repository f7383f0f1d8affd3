// ztier engine: settings, declared once, read from a JSON config file,
// ZTIER_* environment variables and a program's flags.
//
// Every tunable is one row of a table (settings.cc): its config keys, its
// environment variable, its parser and its documentation. The config file is
// a DeepSpeed ds_config: keys that mean something to ztier are honoured
// (offload devices and NVMe paths, aio, the stage-3 live-parameter and
// persistence settings, the optimizer's type and params, gradient_clipping,
// gradient_accumulation_steps, the batch sizes, activation_checkpointing),
// the rest of DeepSpeed's known keys are accepted and listed once, in one
// warning, as ignored, and a key that is neither DeepSpeed's nor ztier's is
// an error naming it (typo protection); so is a value of the wrong JSON type
// or out of range, and a key given twice. ztier's own keys live under
// "ztier". Like DeepSpeed's own reader (hjson), the parser accepts comments
// (#, //, /* */), trailing commas and members separated by a line break;
// the string "auto" (Hugging Face templates) leaves a setting at its default.
//
//   {"zero_optimization": {"stage": 3,
//      "offload_optimizer": {"device": "nvme", "nvme_path": ["/nvme0", "/nvme1"],
//                            "pin_memory": true, "buffer_count": 4},
//      "offload_param": {"device": "cpu"}},
//    "aio": {"block_size": 1048576, "queue_depth": 16},
//    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95]}},
//    "gradient_clipping": 1.0,
//    "ztier": {"dram_budget": "64G"}}
//
// Precedence: defaults < config file < environment < a program's flags
// (ApplySetting). Settings::sources records where each value that was set
// came from; NonDefaultSettings lists them with it. Sizes take a number of
// bytes or a string with K/M/G/T suffix (powers of 1024, common/numbers.h).
//
// Pure functions; thread-safe.
#ifndef ZTIER_ENGINE_SETTINGS_H_
#define ZTIER_ENGINE_SETTINGS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "cpu_adam/adamw.h"
#include "engine/dram_pool.h"
#include "engine/wire_types.h"
#include "nvme/io_backend.h"

namespace ztier::engine {

// What a training program takes from the config (DeepSpeed's optimizer,
// gradient_clipping, gradient_accumulation_steps, batch sizes and
// activation_checkpointing). Unset unless a config, a variable or a flag
// sets it: the program has its own defaults.
struct TrainingSettings {
  std::optional<std::string> optimizer_type;  // "adam" or "adamw"
  std::optional<bool> adam_w_mode;            // DeepSpeed's; default true for "adam"
  std::optional<float> lr, eps, weight_decay;
  std::optional<double> beta1, beta2;  // double, as cpu_adam::Hyper's
  std::optional<bool> bias_correction;
  std::optional<float> clip_norm;
  std::optional<int> grad_accumulation;
  std::optional<int> micro_batch;      // sequences per rank and micro-step
  std::optional<int64_t> train_batch;  // micro x accumulation x ranks
  std::optional<bool> activation_checkpointing;

  friend bool operator==(const TrainingSettings&, const TrainingSettings&) = default;
};

struct Settings {
  // Pinned DRAM pool.
  uint64_t dram_budget_bytes = uint64_t{8} << 30;
  HugePages huge_pages = HugePages::kTransparent;
  bool pin_memory = true;
  // NVMe swap space. Swap files grow with their jobs; the capacity caps
  // each file (0: none, the disk's free space).
  std::vector<std::string> nvme_paths;
  uint64_t nvme_capacity_per_path = 0;
  uint64_t stripe_bytes = uint64_t{1} << 20;
  uint32_t queue_depth = 16;
  bool checksums = true;
  nvme::BackendChoice io_backend = nvme::BackendChoice::kAuto;
  // Placement of optimizer states and bf16 params, and the pinned ring that
  // stages NVMe-resident units.
  Tier optimizer_tier = Tier::kDram;
  Tier param_tier = Tier::kDram;
  uint32_t buffer_count = 4;
  // How m and v are kept (fp32, or int8: 6 bytes a parameter instead of 12).
  StateDtype state_dtype = StateDtype::kFp32;
  // CPU threads of the optimizer, shared by all jobs (0: all cores).
  int optimizer_threads = 0;
  // Client side of stage 3 (each rank's Stage3Runner): the cap on params
  // live on a device and the persistence threshold, in parameters, and the
  // prefetch depth in units.
  uint64_t max_live_parameters = 0;
  uint64_t param_persistence_threshold = 32768;
  int prefetch_depth = 2;
  // Copies between host and device smaller than this are coalesced (bytes;
  // 0: off).
  uint64_t coalesce_bytes = uint64_t{4} << 20;
  // How long a client waits on the engine (a unit's publish, a cache slot)
  // before it fails with a message instead of hanging.
  uint32_t wait_timeout_seconds = 600;
  // The ztierd socket a client trains through; empty: the embedded engine.
  std::string daemon_socket;
  // Test mode: a param cache slot (params on NVMe) is filled with NaNs as
  // its last lease is released, so a client still reading it shows.
  bool poison_released_params = false;
  TrainingSettings training;
  // Where each setting that was set came from, by its first config key:
  // the config file's path, the environment variable, a program's flag.
  std::map<std::string, std::string> sources;

  friend bool operator==(const Settings&, const Settings&) = default;
};

// Parses a JSON config on top of `base`. `origin` names the source in errors
// and in `sources`. Logs one warning listing the DeepSpeed keys it ignores.
// Errors: InvalidArgument (syntax with position, unknown key, duplicate key,
// wrong type or value, contradicting keys), always naming the key.
Result<Settings> ParseSettings(std::string_view json, std::string_view origin,
                               const Settings& base = {});
// Reads and parses a config file (a regular file of at most 16 MiB).
// Errors: NotFound, IoError, as ParseSettings.
Result<Settings> LoadSettings(const std::string& path, const Settings& base = {});
// Applies ZTIER_* variables from `env` (a null-terminated array like
// environ). Errors: InvalidArgument naming the variable.
Result<Settings> ApplyEnvironment(const Settings& base, const char* const* env);
// Sets one setting as a program's flag does: `key` is any of its config keys
// or its environment variable, `text` is written as in that variable, and
// `origin` names the flag in `sources`. Errors: InvalidArgument (unknown key,
// bad value, naming `origin`).
Result<Settings> ApplySetting(const Settings& base, std::string_view key, std::string_view text,
                              std::string_view origin);
// Checks cross-setting constraints (NVMe placement needs paths, ...).
Status Validate(const Settings& s);
// "key = value (from origin)" for every setting that differs from the
// default or was set by a config, a variable or a flag (the engine logs them
// at start; ztier-train prints them).
std::vector<std::string> NonDefaultSettings(const Settings& s);
// The settings set (by a config, a variable or a flag) that only a client
// reads (a runner's, the training's: the rows whose description starts
// "Client:" or "Training:"), "key (from origin)" each: through ztierd each
// job brings its own, so ztierd's own config or environment setting them
// changes nothing, which it says.
std::vector<std::string> ClientOnlySettingsSet(const Settings& s);
// The settings set that only the engine reads (the rest: not a client's,
// nor ztier.state_dtype, which travels with each job), as {key, origin}:
// through ztierd the daemon's own apply, which a client says.
std::vector<std::pair<std::string, std::string>> EngineOnlySettingsSet(const Settings& s);
// The AdamW hyper-parameters: `defaults` with the training settings that
// are set applied (the optimizer type, Adam's adam_w_mode, lr, betas, eps,
// weight decay, bias correction).
cpu_adam::Hyper TrainingHyper(const Settings& s, cpu_adam::Hyper defaults);
// Markdown table of every setting: config keys, environment variable,
// default, meaning; and the DeepSpeed keys that are accepted and ignored.
std::string DescribeSettings();

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_SETTINGS_H_
