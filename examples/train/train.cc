// ztier-train: trains the GPT example on a text file through libztier.
//
//   ztier-train                       # fortunes corpus, embedded engine,
//                                     # optimizer states on NVMe swap in ./ztier-run
//   ztier-train --data book.txt --steps 500 --layers 6 --channels 256
//   ztier-train --resume              # continue from ./ztier-run/checkpoint
//   ztier-train --config ds_config.json  # a DeepSpeed config: offload, optimizer, batch
//
// A byte-level vocabulary (256 tokens). Each local rank is a thread with
// its own device (the host backend, or one CUDA device per rank) and its own
// Stage3Runner; the ranks' collectives are local (host) or NCCL (CUDA).
// Batches are drawn from the text by a generator seeded with (seed, step,
// micro-step, rank), so a resumed run sees exactly the batches the
// uninterrupted run would have. At the end (and every --checkpoint-every
// steps) it writes a checkpoint, and at the end a safetensors export of the
// weights. The progress line shows step, loss, tokens/s and the bytes moved
// per tier (host <-> device copies, NVMe reads and writes): a live bar on a
// terminal; otherwise (a log file, CI) a line at most every
// --progress-every seconds (5), plus the first and the last step. Every step
// is a row of <out>/train_log.tsv.
//
// Settings come, in rising precedence, from ztier-train's defaults, the
// --config file (a DeepSpeed ds_config), ZTIER_* variables and the flags;
// the startup lines name where each one that is not a default came from.
//
// An --out directory belongs to one run at a time: its checkpoint directory
// and swap directory are locked while the run lives (a second run is refused
// at once, naming the first one's pid). A run never overwrites a checkpoint
// it did not resume from: without --resume or --overwrite it refuses. An
// --out of another user's, or one every user may write into, is refused:
// its writers could plant links or a checkpoint there.
// --resume finishes whatever the run had left (steps, the export), with the
// loss log cut back to the checkpoint's step. SIGINT / SIGTERM stop at the
// next step boundary with a checkpoint and the export (exit 130 / 143); a
// second signal ends the run at once.
//
// Exit codes: 0 done, 1 a runtime error (printed), 2 bad usage (flags,
// config, environment), 3 --exit-after, 128 + signal when stopped.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/ztier.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/numbers.h"
#include "common/thread.h"
#include "common/unique_fd.h"
#include "common/utf8.h"
#include "engine/checkpoint_manifest.h"
#include "engine/state_files.h"
#include "examples/gpt/gpt.h"
#include "nvme/swap_space.h"

extern char** environ;

namespace ztier::train {
namespace {

using client::Collectives;
using client::Device;
using client::MakeCudaDevice;
using client::MakeHostDevice;
using client::MakeLocalCollectives;
using client::MakeNcclCollectives;
using client::Model;
using client::RunnerStats;
using client::Session;
using client::Stage3Runner;

namespace fs = std::filesystem;

// `p` absolute (an empty path is the working directory) and lexically
// normal; where the working directory cannot be read (removed under the
// run) a relative path stays relative instead of throwing.
fs::path AbsoluteNormal(const fs::path& p) {
  std::error_code ec;
  const fs::path a = fs::absolute(p.empty() ? fs::path(".") : p, ec);
  return (ec ? p : a).lexically_normal();
}

using Clock = std::chrono::steady_clock;

constexpr char kFortunes[] = "/usr/share/games/fortunes";
constexpr uint64_t kMaxTextBytes = uint64_t{2} << 30;
constexpr char kDefault[] = "ztier-train's default";
constexpr size_t kMaxJobName = 256;

struct Flags {
  std::string data;  // empty: the fortunes corpus
  std::string out = "ztier-run";
  std::string config;  // a DeepSpeed ds_config / ztier settings file
  int steps = 500;
  gpt::Config model{.vocab = 256, .context = 64, .channels = 128, .layers = 4, .heads = 4};
  int ranks = 1;
  std::string device = "host";
  int checkpoint_every = 0;
  bool resume = false;
  bool overwrite = false;
  uint64_t seed = 1;
  bool progress = true;          // a bar when stderr is a terminal
  double progress_every = 5.0;   // seconds between progress lines without a bar
  int exit_after = 0;            // abrupt exit right after this step's checkpoint (crash testing)
  std::string summary;           // a JSON summary of the run's speed goes here (benchmarks)
  std::string job_name;          // the engine's name of the job (default: from --out)
  bool job_name_of_out = false;  // job_name is the default, made from --out
  int summary_skip = -1;         // steps left out of it (-1: min(5, steps / 4))
  // Flags that set a setting, applied over the config and the environment:
  // {setting key, value, flag}.
  struct Override {
    std::string key, text, flag;
  };
  std::vector<Override> overrides;
};

// What the run does, from the flags and the settings.
struct Plan {
  engine::Settings settings;
  int batch = 8;
  int accumulation = 1;
  float clip = 1.0f;
  cpu_adam::Hyper hyper;
  gpt::Config model;
  uint64_t params = 0;
};

void Usage(std::ostream& os) {
  os << "usage: ztier-train [options]\n"
        "Trains a small GPT (byte-level) on a text file through ztier's stage-3 runner.\n"
        "data and output:\n"
        "  --data PATH              text to train on (default: the fortunes corpus in "
     << kFortunes
     << ")\n"
        "  --out DIR                checkpoint, log, export and swap go here (default ztier-run);\n"
        "                           made with its parents if missing; one run at a time\n"
        "  --swap-dir DIR[,DIR..]   NVMe swap directories, which must exist (default <out>/swap;\n"
        "                           with --daemon, ztierd's)\n"
        "  --daemon SOCKET          train through the ztierd at SOCKET (its DRAM and swap;\n"
        "                           optimizer states default to dram there)\n"
        "  --resume                 continue from <out>/checkpoint (and finish its export)\n"
        "  --overwrite              start over in an --out that holds a checkpoint, removing it\n"
        "  --checkpoint-every N     also checkpoint every N steps (default: at the end only)\n"
        "  --job-name NAME          the job's name in the engine and ztierd (default: gpt:<the\n"
        "                           absolute --out>, so runs on other --out never collide)\n"
        "model:\n"
        "  --layers N --channels C --heads H --context T   (default 4, 128, 4, 64)\n"
        "  --untied                 a separate output head instead of the tied embedding\n"
        "  --checkpoint-activations recompute each block's activations in its backward\n"
        "  --matmul fp32|bf16       matmul operands in fp32 (default) or rounded to bf16, the\n"
        "                           products summed in fp32 (bf16 tensor cores on cuda)\n"
        "training (each but --steps and --seed also a setting of the --config file):\n"
        "  --steps N                optimizer steps (default 500)\n"
        "  --batch B                sequences per rank and micro-step (default 8)\n"
        "  --lr X --weight-decay X  AdamW (default 2e-3, 0.01)\n"
        "  --clip X                 global grad-norm clipping, 0 off (default 1.0)\n"
        "  --accumulation N         micro-steps per optimizer step (default 1)\n"
        "  --seed N                 initialisation and batch order (default 1)\n"
        "placement and devices:\n"
        "  --optimizer dram|nvme    where fp32 master and moments live (default nvme)\n"
        "  --params dram|nvme       where the published bf16 params live (default dram)\n"
        "  --state-dtype fp32|int8  how AdamW's m and v are kept (default fp32, "
        "ztier.state_dtype)\n"
        "  --device host|cuda       compute device of each rank (default host)\n"
        "  --ranks R                local ranks: threads on the host, GPUs with cuda (default 1)\n"
        "  --prefetch D             units fetched ahead (default 2, ztier.prefetch_depth)\n"
        "  --max-live-bytes N       cap on param bytes on each device (default: none)\n"
        "  --persistence-threshold N  units up to N bytes stay on the device (default 64K)\n"
        "  --coalesce N               copies to and from the device under N bytes are\n"
        "                             coalesced (default 4M; 0: off)\n"
        "  --config PATH            settings file: a DeepSpeed ds_config.json (offload, aio,\n"
        "                           optimizer, batch sizes, clipping, accumulation) with ztier.*\n"
        "                           keys; ZTIER_* variables override it, flags override both\n"
        "output:\n"
        "  --no-progress            progress lines instead of a bar (as without a terminal)\n"
        "  --progress-every S       without a bar, a line at most every S seconds, plus the\n"
        "                           first and the last step (default 5; 0: every step)\n"
        "  --exit-after N           exit abruptly right after step N's checkpoint (crash tests)\n"
        "  --summary PATH           write the run's speed as JSON: tokens/s and rank 0's step\n"
        "                           time split into compute and its waits (optimizer, H2D,\n"
        "                           D2H, collectives), over the steps after --summary-skip N\n"
        "                           (default: 5, or a quarter of the steps if fewer)\n"
        "SIGINT / SIGTERM stop at the next step with a checkpoint and the export; a second\n"
        "signal stops at once. Exit codes: 0 done, 1 error, 2 bad usage, 3 --exit-after,\n"
        "128+signal stopped.\n";
}

// The paths of one run in its --out directory.
struct OutPaths {
  std::string checkpoint, manifest, log, exported;
  explicit OutPaths(const std::string& out)
      : checkpoint((fs::path(out) / "checkpoint").string()),
        manifest((fs::path(checkpoint) / engine::kCheckpointManifestName).string()),
        log((fs::path(out) / "train_log.tsv").string()),
        exported((fs::path(out) / "model.safetensors").string()) {}
};

Result<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= argc) return Status::InvalidArgument(StrCat(a, " needs a value"));
      std::string v = argv[++i];
      if (v.empty()) return Status::InvalidArgument(StrCat(a, " needs a non-empty value"));
      return v;
    };
    auto integer = [&](int* out, int min, int max) -> Status {
      ZT_ASSIGN_OR_RETURN(std::string v, value());
      char* end = nullptr;
      errno = 0;
      const long n = std::strtol(v.c_str(), &end, 10);
      // (strtol skips leading blanks and takes a sign: " 5" and "+5" are not
      // how the other flags, read as settings, take a count.)
      const bool digits_first = !v.empty() && (std::isdigit(static_cast<unsigned char>(v[0])) ||
                                               (v[0] == '-' && v.size() > 1));
      if (!digits_first || end == v.c_str() || *end != '\0' || errno != 0 || n < min || n > max) {
        return Status::InvalidArgument(
            StrCat(a, " wants an integer in ", min, "..", max, ", got '", v, "'"));
      }
      *out = static_cast<int>(n);
      return Status::Ok();
    };
    // A flag that sets a setting: checked when the settings are resolved.
    auto setting = [&](std::string key, auto convert) -> Status {
      ZT_ASSIGN_OR_RETURN(std::string v, value());
      ZT_ASSIGN_OR_RETURN(std::string text, convert(v));
      f.overrides.push_back({std::move(key), std::move(text), a});
      return Status::Ok();
    };
    auto as_is = [](const std::string& v) -> Result<std::string> { return v; };
    auto device = [&](const std::string& v) -> Result<std::string> {
      if (v == "dram") return std::string("cpu");
      if (v == "nvme") return v;
      return Status::InvalidArgument(StrCat(a, ": '", v, "' is not dram or nvme"));
    };
    // Bytes of bf16 params -> a count of parameters, as the settings keep it.
    auto bf16_bytes = [&](const std::string& v) -> Result<std::string> {
      Result<uint64_t> n = ParseSize(v);
      if (!n.ok()) return Status::InvalidArgument(StrCat(a, ": ", n.status().message()));
      if (a == "--max-live-bytes" && *n > 0 && *n < sizeof(bf16)) {
        return Status::InvalidArgument(
            StrCat(a, " ", v, " is less than one bf16 param (2 bytes); 0 means no cap"));
      }
      return StrCat(*n / sizeof(bf16));
    };
    Status s;
    if (a == "--data") {
      ZT_ASSIGN_OR_RETURN(f.data, value());
    } else if (a == "--out") {
      ZT_ASSIGN_OR_RETURN(f.out, value());
    } else if (a == "--config") {
      ZT_ASSIGN_OR_RETURN(f.config, value());
    } else if (a == "--swap-dir") {
      s = setting("ZTIER_NVME_PATHS", as_is);
    } else if (a == "--daemon") {
      s = setting("ztier.daemon_socket", as_is);
    } else if (a == "--steps") {
      s = integer(&f.steps, 1, 1 << 30);
    } else if (a == "--layers") {
      s = integer(&f.model.layers, 1, 1 << 30);
    } else if (a == "--channels") {
      s = integer(&f.model.channels, 1, 1 << 30);
    } else if (a == "--heads") {
      s = integer(&f.model.heads, 1, 1 << 30);
    } else if (a == "--context") {
      s = integer(&f.model.context, 1, 1 << 30);
    } else if (a == "--untied") {
      f.model.tied_head = false;
    } else if (a == "--matmul") {
      ZT_ASSIGN_OR_RETURN(const std::string math, value());
      if (math == "fp32") {
        f.model.matmul = gpt::MatmulMath::kFp32;
      } else if (math == "bf16") {
        f.model.matmul = gpt::MatmulMath::kBf16;
      } else {
        s = Status::InvalidArgument(StrCat("--matmul: '", math, "' is not fp32 or bf16"));
      }
    } else if (a == "--checkpoint-activations") {
      f.overrides.push_back({"ztier.activation_checkpointing", "true", a});
    } else if (a == "--batch") {
      s = setting("train_micro_batch_size_per_gpu", as_is);
    } else if (a == "--lr") {
      s = setting("optimizer.params.lr", as_is);
    } else if (a == "--weight-decay") {
      s = setting("optimizer.params.weight_decay", as_is);
    } else if (a == "--clip") {
      s = setting("gradient_clipping", as_is);
    } else if (a == "--accumulation") {
      s = setting("gradient_accumulation_steps", as_is);
    } else if (a == "--optimizer") {
      s = setting("zero_optimization.offload_optimizer.device", device);
    } else if (a == "--params") {
      s = setting("zero_optimization.offload_param.device", device);
    } else if (a == "--state-dtype") {
      s = setting("ztier.state_dtype", as_is);
    } else if (a == "--prefetch") {
      s = setting("ztier.prefetch_depth", as_is);
    } else if (a == "--max-live-bytes") {
      s = setting("zero_optimization.stage3_max_live_parameters", bf16_bytes);
    } else if (a == "--persistence-threshold") {
      s = setting("zero_optimization.stage3_param_persistence_threshold", bf16_bytes);
    } else if (a == "--coalesce") {
      s = setting("ztier.coalesce_bytes", as_is);
    } else if (a == "--ranks") {
      s = integer(&f.ranks, 1, 1024);
    } else if (a == "--device") {
      ZT_ASSIGN_OR_RETURN(f.device, value());
      if (f.device != "host" && f.device != "cuda") {
        s = Status::InvalidArgument(StrCat("--device: '", f.device, "' is not host or cuda"));
      }
    } else if (a == "--checkpoint-every") {
      s = integer(&f.checkpoint_every, 0, 1 << 30);
    } else if (a == "--resume") {
      f.resume = true;
    } else if (a == "--overwrite") {
      f.overwrite = true;
    } else if (a == "--seed") {
      int seed = 0;
      s = integer(&seed, 0, INT32_MAX);
      f.seed = static_cast<uint64_t>(seed);
    } else if (a == "--no-progress") {
      f.progress = false;
    } else if (a == "--progress-every") {
      ZT_ASSIGN_OR_RETURN(std::string v, value());
      // from_chars: no leading blanks or sign, no hex (strtod took " 5", 0x10).
      double x = -1;
      const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
      if (ec != std::errc() || end != v.data() + v.size() || !(x >= 0 && x <= 86400)) {
        s = Status::InvalidArgument(
            StrCat(a, " wants seconds from 0 to 86400 (0: every step), got '", v, "'"));
      }
      f.progress_every = x;
    } else if (a == "--exit-after") {
      s = integer(&f.exit_after, 1, 1 << 30);
    } else if (a == "--summary") {
      ZT_ASSIGN_OR_RETURN(f.summary, value());
    } else if (a == "--job-name") {
      ZT_ASSIGN_OR_RETURN(f.job_name, value());
      if (PrintableUtf8(f.job_name) != f.job_name) {
        return Status::InvalidArgument(
            "--job-name: a control character, or bytes that are not UTF-8");
      }
      if (f.job_name.empty() || f.job_name.size() > kMaxJobName) {
        s = Status::InvalidArgument(
            StrCat("--job-name wants 1 to ", kMaxJobName, " bytes, got ", f.job_name.size()));
      }
    } else if (a == "--summary-skip") {
      s = integer(&f.summary_skip, 0, 1 << 30);
    } else if (a == "-h" || a == "--help") {
      Usage(std::cout);
      std::exit(0);
    } else {
      return Status::InvalidArgument(StrCat("unknown option '", a, "'"));
    }
    ZT_RETURN_IF_ERROR(s);
  }
  if (f.resume && f.overwrite) {
    return Status::InvalidArgument("--resume and --overwrite contradict each other");
  }
  // What would only fail at the end of the run fails now.
  if (f.exit_after > 0) {
    const bool checkpointed = f.exit_after == f.steps ||
                              (f.checkpoint_every > 0 && f.exit_after % f.checkpoint_every == 0);
    if (f.exit_after > f.steps || !checkpointed) {
      return Status::InvalidArgument(StrCat("--exit-after ", f.exit_after, ": step ", f.exit_after,
                                            " has no checkpoint (the last step, ", f.steps,
                                            ", has one, and every multiple of "
                                            "--checkpoint-every)"));
    }
  }
  if (f.summary.empty() && f.summary_skip >= 0) {
    return Status::InvalidArgument(
        "--summary-skip without --summary: it says which steps the summary leaves out");
  }
  if (!f.summary.empty()) {
    std::error_code ec;
    const fs::path summary(f.summary);
    const fs::path parent = summary.parent_path();
    if (fs::is_directory(summary, ec)) {
      return Status::InvalidArgument(StrCat("--summary ", f.summary, " is a directory"));
    }
    // A directory in --out is made with it; any other must exist.
    const fs::path out_dir = AbsoluteNormal(f.out);
    const fs::path rel = AbsoluteNormal(parent).lexically_relative(out_dir);
    const bool in_out = !rel.empty() && *rel.begin() != "..";
    if (!parent.empty() && !in_out && !fs::is_directory(parent, ec)) {
      return Status::InvalidArgument(
          StrCat("--summary ", f.summary, ": no directory ", parent.string()));
    }
    // Never over what the run writes (its checkpoint, log or export).
    const fs::path summary_abs = AbsoluteNormal(summary);
    const OutPaths run(out_dir.string());
    const fs::path in_checkpoint = summary_abs.lexically_relative(run.checkpoint);
    if (summary_abs == fs::path(run.log) || summary_abs == fs::path(run.exported) ||
        (!in_checkpoint.empty() && *in_checkpoint.begin() != "..")) {
      return Status::InvalidArgument(StrCat("--summary ", f.summary,
                                            " is one of the run's own files (checkpoint, ",
                                            "train_log.tsv or model.safetensors)"));
    }

    // Only a new or a regular file is replaced (a rename over /dev/full made
    // the device a file), and never the text or the config the run reads.
    Result<std::string> target = ReplaceableTarget(f.summary);
    if (!target.ok()) {
      return Status::InvalidArgument(StrCat("--summary: ", target.status().message()));
    }
    for (const auto& [flag, input] :
         {std::pair<const char*, std::string>{"--data", f.data}, {"--config", f.config}}) {
      if (!input.empty() && fs::equivalent(*target, input, ec)) {
        return Status::InvalidArgument(
            StrCat("--summary ", f.summary, " is the ", flag, " file the run reads"));
      }
    }
    if (f.summary_skip >= f.steps) {
      return Status::InvalidArgument(StrCat("--summary-skip ", f.summary_skip,
                                            " leaves none of --steps ", f.steps, " to measure"));
    }
  }
  if (f.job_name.empty()) {
    // One job per --out (which one run at a time owns): runs of one user
    // on one ztierd do not collide, and a resumed run is its own job again.
    // One spelling of the directory: symlinks resolved, no trailing '/'.
    std::error_code ec;
    fs::path out = fs::weakly_canonical(AbsoluteNormal(f.out), ec);
    if (ec) out = AbsoluteNormal(f.out);
    if (!out.has_filename() && out.has_parent_path()) out = out.parent_path();
    // A name shows in ztierctl's table and in checkpoints' JSON: the
    // directory's control characters and bytes that are not UTF-8 as '?'.
    f.job_name = StrCat("gpt:", PrintableUtf8(out.string()));
    f.job_name_of_out = true;
    if (f.job_name.size() > kMaxJobName) {
      // Too long: the path's end, whole characters only, after a hash of
      // all of it (two long paths with one end stay two names).
      const std::string& path = out.string();
      char tag[24];
      std::snprintf(tag, sizeof(tag), "%08x%08x", Crc32c(path.data(), path.size()),
                    Crc32c(path.data(), path.size(), 0x9e3779b9u));
      const std::string head = StrCat("gpt:", tag, ":...");
      size_t from = f.job_name.size() - (kMaxJobName - head.size());
      while (from < f.job_name.size() && (static_cast<uint8_t>(f.job_name[from]) & 0xC0) == 0x80) {
        ++from;  // not inside a character
      }
      f.job_name = head + f.job_name.substr(from);
    }
  }
  if (Status v = gpt::ValidateConfigFor(
          f.model, f.device == "cuda" ? client::DeviceKind::kCuda : client::DeviceKind::kHost);
      !v.ok()) {
    // The model's settings by their flags' names (config.heads: --heads).
    std::string message(v.message());
    for (size_t at = message.find("config."); at != std::string::npos;
         at = message.find("config.", at)) {
      message.replace(at, 7, "--");
    }
    return Status(v.code(), message);
  }
  return f;
}

// The settings in rising precedence: ztier-train's defaults, the config
// file, the environment, the flags; then what the run does with them.
Result<Plan> ResolvePlan(const Flags& f) {
  engine::Settings s;
  ZT_ASSIGN_OR_RETURN(
      s, engine::ApplySetting(s, "zero_optimization.offload_optimizer.device", "nvme", kDefault));
  if (!f.config.empty()) {
    ZT_ASSIGN_OR_RETURN(s, engine::LoadSettings(f.config, s));
  }
  ZT_ASSIGN_OR_RETURN(s, engine::ApplyEnvironment(s, ::environ));
  for (const Flags::Override& o : f.overrides) {
    ZT_ASSIGN_OR_RETURN(s, engine::ApplySetting(s, o.key, o.text, o.flag));
  }
  // Through a daemon the tiers are the daemon's: states go to its DRAM
  // unless asked for (nvme then needs swap paths in the daemon's config).
  const bool daemon = !s.daemon_socket.empty();
  auto source = s.sources.find("zero_optimization.offload_optimizer.device");
  if (daemon && source != s.sources.end() && source->second == kDefault) {
    ZT_ASSIGN_OR_RETURN(s, engine::ApplySetting(s, "zero_optimization.offload_optimizer.device",
                                                "cpu", "ztier-train's default through ztierd"));
  }
  // The swap directories are the engine's, so ztierd's through a daemon:
  // --swap-dir beside --daemon asks for what cannot be, and a config's or
  // the environment's paths are not this run's (nor checked as if they were).
  const auto paths = s.sources.find("zero_optimization.offload_optimizer.nvme_path");
  const bool swap_dir_given = paths != s.sources.end() && paths->second == "--swap-dir";
  if (daemon && paths != s.sources.end()) {
    if (swap_dir_given) {
      return Status::InvalidArgument(
          "--swap-dir: through --daemon the swap directories are ztierd's (nvme_path in its "
          "config); leave --swap-dir out");
    }
    std::fprintf(stderr,
                 "ztier-train: warning: zero_optimization.offload_optimizer.nvme_path (from %s) is "
                 "an engine setting: through --daemon the swap directories are ztierd's\n",
                 PrintableUtf8(paths->second).c_str());
    s.nvme_paths.clear();
    s.sources.erase(paths);  // (`paths` is not used after this)
  }
  // Swap directories given on the command line for states in DRAM were
  // taken and never used: a run the user believed on NVMe held it all in
  // DRAM. (A config's or the environment's may serve other runs.)
  if (swap_dir_given && s.optimizer_tier != engine::Tier::kNvme) {
    const auto device = s.sources.find("zero_optimization.offload_optimizer.device");
    return Status::InvalidArgument(StrCat(
        "--swap-dir: the optimizer states are in dram (",
        device == s.sources.end() ? std::string("the default") : device->second,
        "), which uses no swap directory: --optimizer nvme puts them there, or leave --swap-dir "
        "out"));
  }
  if (s.param_tier == engine::Tier::kNvme && s.optimizer_tier != engine::Tier::kNvme) {
    const auto from = [&](const char* key) {
      auto it = s.sources.find(key);
      return it == s.sources.end() ? std::string("the default") : it->second;
    };
    return Status::InvalidArgument(
        StrCat("params on nvme (", from("zero_optimization.offload_param.device"),
               ") need the optimizer states on nvme, which are in dram (",
               from("zero_optimization.offload_optimizer.device"), "): --optimizer nvme"));
  }
  if (!daemon && s.optimizer_tier == engine::Tier::kNvme && s.nvme_paths.empty()) {
    // The swap paths' text is a comma-separated list: a comma in --out
    // made two paths of <out>/swap, and the error named --swap-dir.
    if (f.out.find(',') != std::string::npos) {
      return Status::InvalidArgument(
          StrCat("--out '", f.out, "' holds a comma, so its swap directory (<out>/swap, where ",
                 "states on nvme go by default) cannot be named: give --swap-dir, or an --out ",
                 "without one"));
    }
    ZT_ASSIGN_OR_RETURN(s, engine::ApplySetting(s, "ZTIER_NVME_PATHS",
                                                (fs::path(f.out) / "swap").string(), kDefault));
  }
  ZT_RETURN_IF_ERROR(engine::Validate(s));
  // Settings of the swap space for a run that keeps everything in DRAM
  // were taken and changed nothing, without a word.
  if (!daemon && s.optimizer_tier != engine::Tier::kNvme && s.param_tier != engine::Tier::kNvme) {
    for (const char* key :
         {"zero_optimization.offload_optimizer.nvme_path", "ztier.nvme_capacity", "aio.block_size",
          "aio.queue_depth", "ztier.io_backend", "ztier.checksums",
          "zero_optimization.offload_optimizer.buffer_count", "ztier.poison_released_params"}) {
      // (A config's may serve other runs: a DeepSpeed config keeps its aio
      // section whatever the device.)
      auto it = s.sources.find(key);
      if (it == s.sources.end() || !it->second.starts_with("ZTIER_")) continue;
      std::fprintf(stderr,
                   "ztier-train: warning: %s (from %s) is a setting of the NVMe swap space, and "
                   "this run keeps its states and params in DRAM: it changes nothing "
                   "(--optimizer nvme puts the states there)\n",
                   key, PrintableUtf8(it->second).c_str());
    }
  }

  Plan p;
  const engine::TrainingSettings& t = s.training;
  p.model = f.model;
  p.model.checkpoint_activations = t.activation_checkpointing.value_or(false);
  p.clip = t.clip_norm.value_or(1.0f);
  p.hyper = engine::TrainingHyper(s, {.lr = 2e-3f, .weight_decay = 0.01f});
  ZT_RETURN_IF_ERROR(cpu_adam::ValidateHyper(p.hyper));
  // DeepSpeed's batch rule: train batch = micro batch x accumulation x
  // ranks; any two give the third.
  p.batch = t.micro_batch.value_or(8);
  p.accumulation = t.grad_accumulation.value_or(1);
  if (t.train_batch) {
    const int64_t tb = *t.train_batch;
    if (t.micro_batch && t.grad_accumulation) {
      // both given: they must agree
    } else if (t.micro_batch) {
      p.accumulation = static_cast<int>(tb / (int64_t{p.batch} * f.ranks));
    } else if (t.grad_accumulation) {
      p.batch = static_cast<int>(tb / (int64_t{p.accumulation} * f.ranks));
    } else {
      p.accumulation = 1;
      p.batch = static_cast<int>(tb / f.ranks);
    }
    if (p.batch < 1 || p.accumulation < 1 || int64_t{p.batch} * p.accumulation * f.ranks != tb) {
      // Named by what was given: a derived figure rounded down (0) says nothing.
      std::string given;
      if (t.micro_batch) given += StrCat(" x micro batch ", *t.micro_batch);
      if (t.grad_accumulation) given += StrCat(" x accumulation ", *t.grad_accumulation);
      const bool both = t.micro_batch && t.grad_accumulation;
      return Status::InvalidArgument(StrCat("train_batch_size ", tb,
                                            both ? " is not " : " is not a whole multiple of ",
                                            f.ranks, " rank(s)", given,
                                            " (DeepSpeed's rule: train batch = micro batch x "
                                            "accumulation x ranks)"));
    }
    // What it gives holds to the bounds of the settings it stands for.
    constexpr int kMaxDerived = 1 << 20;
    if (p.batch > kMaxDerived || p.accumulation > kMaxDerived) {
      return Status::InvalidArgument(
          StrCat("train_batch_size ", tb, " makes ",
                 p.batch > kMaxDerived ? StrCat("the micro batch ", p.batch)
                                       : StrCat("the gradient accumulation ", p.accumulation),
                 ", outside 1..", kMaxDerived));
    }
  }
  p.params = gpt::ParameterCount(p.model);
  p.settings = std::move(s);
  return p;
}

// ------------------------------------------------------------------ data --

// The text, as bytes: a regular file of at most kMaxTextBytes, or every
// fortunes data file.
Result<std::string> LoadText(const std::string& path) {
  std::vector<fs::path> files;
  if (!path.empty()) {
    files.push_back(path);
  } else {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(kFortunes, ec)) {
      const fs::path& p = e.path();
      if (e.is_regular_file() && !e.is_symlink() && p.extension() != ".dat") files.push_back(p);
    }
    if (files.empty()) {
      return Status::NotFound(StrCat("no text to train on: ", kFortunes,
                                     " is empty or missing (install the Debian package "
                                     "'fortunes', or pass --data FILE)"));
    }
    std::sort(files.begin(), files.end());
  }
  // One copy of the text in memory: a file read in place, several appended.
  std::string text;
  for (const fs::path& p : files) {
    Result<std::string> part = ReadFileToString(p.string(), kMaxTextBytes - text.size());
    if (!part.ok()) return part.status().Annotate("--data");
    if (text.empty()) {
      text = *std::move(part);
    } else {
      text += *part;
    }
  }
  return text;
}

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rows of context + 1 tokens for (step, micro, rank), from random offsets.
std::vector<int32_t> Batch(const std::string& text, const Flags& f, int batch, int64_t step,
                           int micro, int rank) {
  // A row's start: every offset whose context + 1 bytes fit, the last
  // (whose final byte is the text's last, a target) included.
  const int t = f.model.context;
  const uint64_t span = text.size() - static_cast<uint64_t>(t);
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(batch) * (t + 1));
  uint64_t state = Mix(f.seed ^ Mix(static_cast<uint64_t>(step) * 1000003u + micro * 7919u + rank));
  for (int b = 0; b < batch; ++b) {
    state = Mix(state);
    const uint64_t start = state % span;
    for (int i = 0; i <= t; ++i) tokens.push_back(static_cast<unsigned char>(text[start + i]));
  }
  return tokens;
}

// ---------------------------------------------------------------- memory --

uint64_t MemTotalBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

std::string GiB(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

// What the run needs in host memory, refused up front when the machine
// does not have it: the engine's pinned buffers (fp32 states in DRAM or the
// bf16 buffers beside NVMe states), each rank's activations (on the host
// backend, device memory is host memory) and the text.
Status CheckHostMemory(const Flags& f, const Plan& p, uint64_t text_bytes) {
  const double params = static_cast<double>(p.params);
  const bool nvme_states = p.settings.optimizer_tier == engine::Tier::kNvme;
  const bool nvme_params = p.settings.param_tier == engine::Tier::kNvme;
  double engine =
      params * ((nvme_states ? 0 : 12) + (nvme_params ? 0 : 2) + 2 + (p.accumulation > 1 ? 4 : 0));
  double ranks = 0;
  if (f.device == "host") {
    // Activations, plus the params and grads a runner holds on its device.
    ranks = f.ranks * (static_cast<double>(gpt::ActivationBytes(p.model, p.batch)) + 4 * params);
  }
  const double need = engine + ranks + static_cast<double>(text_bytes);
  const uint64_t total = MemTotalBytes();
  if (total != 0 && need > static_cast<double>(total)) {
    const auto b = [](double x) {
      return GiB(x >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(x));
    };
    char millions[32];
    std::snprintf(millions, sizeof(millions), "%.1fM", params / 1e6);
    return Status::ResourceExhausted(
        StrCat("this model (", millions, " params, ", f.model.layers, " layers, ", f.model.channels,
               " channels, batch ", p.batch, ") needs about ", b(need), " of host memory (engine ",
               b(engine), ", ranks ", b(ranks), "); this machine has ", GiB(total),
               ": make it smaller", nvme_states ? "" : ", or put the optimizer on nvme"));
  }
  return Status::Ok();
}

// -------------------------------------------------------------- progress --

std::string Gb(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / 1e9);
  return buf;
}

constexpr char kLogHeader[] =
    "step\tloss\ttokens_per_s\thost_device_bytes\tnvme_read_bytes\tnvme_write_bytes\n";

// The loss log for a run that starts after step `first`: a fresh header, or
// the rows of steps 1..first of the existing log (rows past the checkpoint
// the run resumes from were logged by a run that died before committing
// them; they are logged again).
Status PrepareLog(const std::string& path, int64_t first) {
  std::string kept = kLogHeader;
  if (first > 0) {
    Result<std::string> old = ReadFileToString(path, uint64_t{1} << 30);
    if (old.ok()) {
      // Whole rows only (a row cut short by a crash has no newline), of
      // the log's six fields, each step once, in order.
      const std::string_view text = *old;
      size_t at = text.find('\n');  // past the header
      long long last = 0, rows = 0;
      while (at != std::string_view::npos && at + 1 < text.size()) {
        const size_t end = text.find('\n', at + 1);
        if (end == std::string_view::npos) break;  // torn
        const std::string row(text.substr(at + 1, end - at - 1));
        at = end;
        char* stop = nullptr;
        const long long step = std::strtoll(row.c_str(), &stop, 10);
        if (stop == row.c_str() || *stop != '\t' || step <= last || step > first) continue;
        if (row.find('\0') != std::string::npos || std::count(row.begin(), row.end(), '\t') != 5) {
          continue;
        }
        kept += row + "\n";
        last = step;
        ++rows;
      }
      if (rows < first) {
        std::fprintf(stderr,
                     "ztier-train: the loss log %s holds %lld of the %lld steps before the "
                     "checkpoint (rows lost or damaged); the run logs from step %lld on\n",
                     path.c_str(), rows, static_cast<long long>(first),
                     static_cast<long long>(first) + 1);
      }
    } else if (old.status().code() == StatusCode::kNotFound) {
      std::fprintf(stderr,
                   "ztier-train: the loss log %s is gone (the %lld steps before the checkpoint "
                   "are not in it); the run logs from step %lld on\n",
                   path.c_str(), static_cast<long long>(first), static_cast<long long>(first) + 1);
    } else {
      return old.status();
    }
  }
  Status written = WriteFileAtomically(path, kept);
  if (first == 0) return written;
  return written.Annotate(StrCat("resuming, the loss log cut back to the checkpoint's step ", first,
                                 " could not be written (the checkpoint is intact: --resume "
                                 "again once this is fixed)"));
}

// The progress line on stderr and the loss log (one row per step,
// appended, each in one write: a row the disk refuses, whole or in part, is
// taken back and said; the run goes on). On a terminal the line is a bar redrawn every step;
// otherwise (or without `bar`) lines: the run's first and last step, one the caller asks for
// (Line::kAlways), and in between at most one every `every_seconds` (0: every step), so that a log
// stays readable.
class Progress {
 public:
  enum class Line { kIfDue, kAlways };

  Progress(int first, int last, bool bar, double every_seconds, const std::string& log_path)
      : first_(first),
        last_(last),
        bar_(bar && isatty(2)),
        every_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(every_seconds))),
        log_path_(log_path) {
    log_ = UniqueFd(::open(log_path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644));
    struct stat st {};
    if (!log_.valid() || ::fstat(log_.get(), &st) != 0) {
      std::fprintf(stderr, "ztier-train: warning: cannot open %s (%s): the run keeps no loss log\n",
                   PrintableUtf8(log_path).c_str(), std::strerror(errno));
      log_.reset();
    } else {
      log_bytes_ = st.st_size;
    }
  }
  ~Progress() {
    if (missing_ > 0) {
      std::fprintf(
          stderr, "ztier-train: warning: %s misses the rows of %lld steps (from step %d)\n",
          PrintableUtf8(log_path_).c_str(), static_cast<long long>(missing_), first_missing_);
    }
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Update(int step, double loss, double tokens_per_s, const RunnerStats& runner,
              const engine::JobCounters& engine, Line show) {
    const int width = 24;
    const double done = static_cast<double>(step - first_) / std::max(1, last_ - first_);
    std::string line;
    if (bar_) {
      const int fill = static_cast<int>(done * width);
      line = "[" + std::string(fill, '=') + (fill < width ? ">" : "") +
             std::string(std::max(0, width - fill - 1), ' ') + "] ";
    }
    char buf[256];
    std::snprintf(buf, sizeof(buf),
                  "step %d/%d | loss %.4f | %.0f tok/s | gpu<->host %s GB | nvme r %s w %s GB | "
                  "pinned %s GB",
                  step, last_, loss, tokens_per_s, Gb(runner.h2d_bytes + runner.d2h_bytes).c_str(),
                  Gb(engine.nvme_read_bytes + engine.nvme_param_read_bytes).c_str(),
                  Gb(engine.nvme_write_bytes).c_str(), Gb(engine.dram_bytes).c_str());
    line += buf;
    if (log_.valid()) {
      char row[160];
      const int n = std::snprintf(
          row, sizeof(row), "%d\t%.6f\t%.1f\t%llu\t%llu\t%llu\n", step, loss, tokens_per_s,
          static_cast<unsigned long long>(runner.h2d_bytes + runner.d2h_bytes),
          static_cast<unsigned long long>(engine.nvme_read_bytes + engine.nvme_param_read_bytes),
          static_cast<unsigned long long>(engine.nvme_write_bytes));
      AppendRow(step, row, static_cast<size_t>(n));
    }
    if (bar_) {
      std::fprintf(stderr, "\r%s\x1b[K", line.c_str());
      if (step == last_) std::fprintf(stderr, "\n");
    } else {
      const Clock::time_point now = Clock::now();
      if (show == Line::kAlways || step == first_ + 1 || step == last_ ||
          now - last_line_ >= every_) {
        std::fprintf(stderr, "%s\n", line.c_str());
        last_line_ = now;
      }
    }
    std::fflush(stderr);
  }

  // One write; a part the disk took of a row it refused is cut off again
  // (the next row would merge with it). The first refusal is said at once.
  void AppendRow(int step, const char* row, size_t n) {
    ssize_t w;
    do {
      w = ::write(log_.get(), row, n);
    } while (w < 0 && errno == EINTR);
    if (w == static_cast<ssize_t>(n)) {
      log_bytes_ += static_cast<off_t>(n);
      return;
    }
    const int err = w < 0 ? errno : ENOSPC;
    if (w > 0) (void)::ftruncate(log_.get(), log_bytes_);
    if (missing_++ == 0) {
      first_missing_ = step;
      if (bar_) std::fprintf(stderr, "\n");
      std::fprintf(stderr,
                   "ztier-train: warning: cannot append step %d's row to %s (%s): the loss log "
                   "misses the steps it cannot take (the run goes on)\n",
                   step, PrintableUtf8(log_path_).c_str(), std::strerror(err));
    }
  }

  // The rows so far to the disk, before a checkpoint commits their steps
  // (a power cut after the commit then finds them: a resume keeps rows up
  // to its checkpoint's step). A refusal is said; the run goes on.
  void Sync() {
    if (!log_.valid() || ::fdatasync(log_.get()) == 0) return;
    std::fprintf(stderr,
                 "ztier-train: warning: cannot sync %s (%s): a power cut may lose its rows\n",
                 PrintableUtf8(log_path_).c_str(), std::strerror(errno));
  }

  // Ends a bar line early (a stop between steps).
  void Break() {
    if (bar_) std::fprintf(stderr, "\n");
  }

 private:
  int first_, last_;
  bool bar_;
  Clock::duration every_;
  Clock::time_point last_line_{};
  std::string log_path_;
  UniqueFd log_;
  off_t log_bytes_ = 0;    // the log's size after the last whole row
  int64_t missing_ = 0;    // rows the disk refused
  int first_missing_ = 0;  // the step of the first
};

// ------------------------------------------------------------------- run --

Status CreateDir(const std::string& dir, std::string_view what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!ec) return Status::Ok();
  // A symbolic link to nothing "exists" as a name, but not as a directory.
  std::error_code link_ec;
  if (fs::is_symlink(dir, link_ec) && !fs::exists(dir, link_ec)) {
    return Status::NotFound(StrCat("cannot create ", what, " ", dir, ": it is a symbolic link to ",
                                   fs::read_symlink(dir, link_ec).string(),
                                   ", which does not exist"));
  }
  return PosixError(StrCat("cannot create ", what, " ", dir), ec.value());
}

// An --out that another user owns, or that every user may write into, is
// refused: whoever can write there could put a
// symbolic link where the run writes and removes (--overwrite removed the
// checkpoint another directory's link named, and saved there) or a
// checkpoint for --resume to load. One not there yet is made ours.
std::string OctalMode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

Status CheckOutIsOurs(const std::string& out) {
  struct stat st {};
  if (::stat(out.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return Status::Ok();
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    return Status::FailedPrecondition(StrCat(
        "--out ", out, " belongs to uid ", st.st_uid, ", not to this user (uid ", ::geteuid(),
        "): its owner could put links there where the run writes or a "
        "checkpoint it resumes; give a directory of your own, in one no other user can write (root "
        "in a container given a host user's volume: run as that user, docker run --user "
        "$(id -u):$(id -g))"));
  }
  // (Sticky or not: the sticky bit keeps others from removing what the run
  // made there, not from making a name first.)
  if ((st.st_mode & S_IWOTH) != 0) {
    return Status::FailedPrecondition(
        StrCat("--out ", out, " may be written by every user (mode ", OctalMode(st.st_mode),
               "): anyone could put links there where the run writes or a checkpoint it "
               "resumes; chmod o-w it, or give a directory of your own"));
  }
  return Status::Ok();
}

void PrintSetup(const Flags& f, const Plan& p, const Session& session, size_t text_bytes) {
  const engine::Settings& s = p.settings;
  std::fprintf(
      stderr,
      "ztier-train: %.2fM params (%d layers, %d channels, %d heads, context %d), %zu "
      "bytes of text, %d rank(s) on %s%s, batch %d x %d micro-step(s), optimizer states "
      "in %s, params in %s, %s engine\n",
      p.params / 1e6, p.model.layers, p.model.channels, p.model.heads, p.model.context, text_bytes,
      f.ranks, f.device.c_str(), p.model.matmul == gpt::MatmulMath::kBf16 ? " (bf16 matmuls)" : "",
      p.batch, p.accumulation, s.optimizer_tier == engine::Tier::kNvme ? "nvme" : "dram",
      s.param_tier == engine::Tier::kNvme ? "nvme" : "dram", session.transport_name().c_str());
  const engine::DramPoolStats pool = session.pool_stats();
  std::string pages = "pinned DRAM pool: budget " + GiB(pool.budget_bytes);
  if (pool.page_bytes != 0) {
    pages += StrCat(", ", pool.page_bytes == 4096 ? "4 KiB pages" : "2 MiB pages");
    const std::string policy = engine::ShmemHugePagePolicy();
    // (Through ztierd the pool and its ztier.huge_pages are ztierd's.)
    if (pool.page_bytes == 4096 && s.huge_pages == engine::HugePages::kTransparent &&
        !policy.empty() && session.transport_name() == "embedded") {
      pages += StrCat(" (the kernel's shmem_enabled is '", policy,
                      "'; ztier.huge_pages hugetlb uses reserved huge pages)");
    }
  }
  std::fprintf(stderr, "ztier-train: %s\n", pages.c_str());
  // Through ztierd the engine's settings are ztierd's: one set here (the
  // session warned of it) is not listed as this run's.
  std::set<std::string> not_applied;
  if (session.transport_name() != "embedded") {
    for (const auto& [key, from] : engine::EngineOnlySettingsSet(s)) not_applied.insert(key);
  }
  for (const std::string& line : engine::NonDefaultSettings(s)) {
    if (not_applied.contains(line.substr(0, line.find(" = ")))) continue;
    std::fprintf(stderr, "ztier-train: setting %s\n", line.c_str());
  }
}

// The checkpoint's step when the run resumes, 0 when it starts afresh: a
// fresh start in an --out that holds a checkpoint needs --overwrite, which
// removes it (and the export) first.
// What of the run its tensors' shapes do not tell, beside the checkpoint, a
// "key value" line each: the head count (a checkpoint of 4 heads has the
// shapes of one of 2), which a resume must match, and what sets the batches
// and the update (seed, batch, ranks, text, lr, matmul), which a resume may
// change but is told of.
std::vector<std::pair<std::string, std::string>> RunNote(const Flags& f, const Plan& p,
                                                         std::string_view text) {
  char lr[32];
  const auto lr_end = std::to_chars(lr, lr + sizeof(lr), p.hyper.lr).ptr;
  char crc[16];
  std::snprintf(crc, sizeof(crc), "%08x", Crc32c(text.data(), text.size()));
  return {{"heads", StrCat(f.model.heads)},
          {"seed", StrCat(f.seed)},
          {"batch", StrCat(p.batch)},
          {"ranks", StrCat(f.ranks)},
          {"data", StrCat(text.size(), " bytes, crc32c ", crc)},
          {"lr", std::string(lr, lr_end)},
          {"matmul", p.model.matmul == gpt::MatmulMath::kBf16 ? "bf16" : "fp32"}};
}
// With the step of the checkpoint it was written beside (after its save
// committed), when there is one; else (a run's start) "saves none": shard
// files found beside such a note are a first save that a kill cut short
// (older versions wrote neither line).
std::string RunNoteText(const std::vector<std::pair<std::string, std::string>>& note,
                        int64_t step = -1) {
  std::string out;
  for (const auto& [key, value] : note) out += StrCat(key, " ", value, "\n");
  out += step >= 0 ? StrCat("step ", step, "\n") : std::string("saves none\n");
  return out;
}
std::string ModelNotePath(const OutPaths& paths) {
  return (fs::path(paths.checkpoint) / "ztier-train-model.txt").string();
}

// `text` without its trailing blanks and newlines.
std::string TrimmedEnd(std::string text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return text;
}

// The "key value" lines of a model note, up to the first line that is not one.
std::map<std::string, std::string> ParseRunNote(const std::string& note) {
  std::map<std::string, std::string> saved;
  std::istringstream lines(note);
  for (std::string line; std::getline(lines, line);) {
    line = TrimmedEnd(std::move(line));  // (an editor's CRLF or a space)
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos) break;
    saved[line.substr(0, space)] = line.substr(space + 1);
  }
  return saved;
}

// Whether a parsed model note says its run has saved nothing yet ("saves
// none", written at its start; a "step" line follows each save that
// committed). An older version's note (neither line) says nothing of the
// kind.
bool SaysNothingWasSaved(const std::map<std::string, std::string>& note) {
  const auto saves = note.find("saves");
  return !note.contains("step") && saves != note.end() && saves->second == "none";
}

// The same of --out's note; false when there is none or it cannot be read.
// Shard files beside such a note are those of a first save that a kill cut
// short: nothing was ever resumable.
bool NoteSaysNothingWasSaved(const OutPaths& paths) {
  Result<std::string> note = ReadFileToString(ModelNotePath(paths), 4096);
  return note.ok() && SaysNothingWasSaved(ParseRunNote(*note));
}

// Whether --out holds a checkpoint (its manifest); an error when that cannot
// be told (a loop of links, a directory that cannot be searched).
Result<bool> HasCheckpoint(const OutPaths& paths) {
  // (A dangling link read as no checkpoint: the run trained, then its
  // first save was refused.)
  ZT_RETURN_IF_ERROR(engine::CheckManifestIsNoLink(paths.checkpoint));
  std::error_code ec;
  const bool exists = fs::exists(paths.manifest, ec);
  if (ec) return PosixError(StrCat("cannot look for ", paths.manifest), ec.value());
  return exists;
}
// The step of the checkpoint --out holds (its manifest's), or -1 when
// there is none or it cannot be read.
int64_t CommittedStep(const OutPaths& paths) {
  Result<std::string> text = ReadFileToString(paths.manifest, size_t{64} << 20);
  if (!text.ok()) return -1;
  Result<engine::CheckpointManifest> decoded =
      engine::DecodeCheckpointManifest(*text, paths.manifest);
  return decoded.ok() ? decoded->step : -1;
}

// What goes before an error: a line break that ends the progress bar's
// line on a terminal; nothing in a log (a blank line there).
const char* BarEnd() { return isatty(STDERR_FILENO) ? "\n" : ""; }

// A --resume's refusal when --out holds no checkpoint: that another run
// holds the directory, where one does (a run before its first save; said
// as a fresh start into the same --out would say it), else that there is
// none. Call before this run claims the directory.
Status NoCheckpointToResume(const OutPaths& paths) {
  const std::string none = StrCat("--resume: there is no checkpoint in ", paths.checkpoint);
  // Looked at, not opened: a lock this takes, even for a moment, another
  // run's start would be refused for.
  const std::string file = (fs::path(paths.checkpoint) / engine::kCheckpointLockFile).string();
  if (DirLock::IsHeld(file)) {
    return Status::Unavailable(StrCat(none, " yet: it is in use by ",
                                      DirLock::DescribeHolders(file),
                                      ", a run that has not saved yet"));
  }
  return Status::NotFound(none);
}

// Without a checkpoint (no manifest), what an earlier run left that a
// fresh start would replace or remove: its export, or shard files of a
// checkpoint whose manifest is gone. "" when none. (The model note alone is
// what a run killed before its first save leaves; the note saying nothing
// was saved and shard files, a run killed in its first save: no earlier
// output, the fresh start removes them. A note that cannot be read, an
// older version's, or none: the shards are kept.)
Result<std::string> EarlierOutput(const OutPaths& paths) {
  std::error_code ec;
  // (Anything else there is refused as no place for the export.)
  if (fs::is_regular_file(fs::symlink_status(paths.exported, ec))) {
    return StrCat("an export (", paths.exported, ")");
  }
  if (!fs::is_directory(paths.checkpoint, ec)) return std::string();
  fs::directory_iterator it(paths.checkpoint, ec);
  if (ec) return PosixError(StrCat("cannot list ", paths.checkpoint), ec.value());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return PosixError(StrCat("cannot list ", paths.checkpoint), ec.value());
    const std::string name = it->path().filename().string();
    if (name.starts_with("unit-") && name.ends_with(".bin")) {
      if (NoteSaysNothingWasSaved(paths)) return std::string();
      return StrCat("checkpoint shard files without their manifest (", it->path().string(),
                    ": a checkpoint damaged or partly removed?)");
    }
  }
  return std::string();
}

// Compares the checkpoint's note with this run's: another head count is
// refused; other batches or updates are said once, in one warning. A note
// of another step than the checkpoint's (`step`: a run stopped between its
// save and the note) is said to be.
Status CheckRunNote(const Flags& f, const OutPaths& paths,
                    const std::vector<std::pair<std::string, std::string>>& now, int64_t step) {
  const std::string path = ModelNotePath(paths);
  Result<std::string> note = ReadFileToString(path, 4096);
  if (!note.ok() && note.status().code() == StatusCode::kNotFound) {
    std::fprintf(stderr,
                 "ztier-train: warning: the checkpoint has no %s: its head count cannot be checked "
                 "(the tensors' shapes match; this run's --heads %d is taken)\n",
                 path.c_str(), f.model.heads);
    return Status::Ok();
  }
  if (!note.ok()) return note.status().Annotate("--resume: the checkpoint's model note");
  const std::map<std::string, std::string> saved = ParseRunNote(*note);
  const auto heads = saved.find("heads");
  if (heads == saved.end()) {
    return Status::Corruption(StrCat("--resume: the checkpoint's model note ", path, " holds '",
                                     PrintableUtf8(TrimmedEnd(note->substr(0, 64))),
                                     "', not 'heads N' (damaged? write 'heads ", f.model.heads,
                                     "' there if this run's --heads is the checkpoint's)"));
  }
  if (heads->second != StrCat(f.model.heads)) {
    return Status::InvalidArgument(StrCat("--resume: the checkpoint in ", paths.checkpoint,
                                          " is of a model with heads ", heads->second,
                                          "; this run has ", f.model.heads, " (--heads)"));
  }
  const auto noted_step = saved.find("step");
  if (noted_step != saved.end() && noted_step->second != StrCat(step)) {
    std::fprintf(stderr,
                 "ztier-train: warning: the checkpoint is of step %lld, its note %s of step %s "
                 "(the run that saved it stopped before its note): what this run is compared "
                 "with below are the settings at step %s\n",
                 static_cast<long long>(step), path.c_str(),
                 PrintableUtf8(noted_step->second).c_str(),
                 PrintableUtf8(noted_step->second).c_str());
  }
  // The note of a run's start beside its checkpoint (a kill between its
  // first save and the note): that run made the checkpoint, with these
  // settings (its start removed what was there), so the note takes the
  // checkpoint's step. Left saying "saves none" (by a resume that only
  // exports), the checkpoint's shards, its manifest lost, would be taken
  // for a cut-short first save's and removed by a fresh run.
  if (SaysNothingWasSaved(saved)) {
    std::string mended;
    std::istringstream lines(*note);
    for (std::string line; std::getline(lines, line);) {
      mended += TrimmedEnd(line) == "saves none" ? StrCat("step ", step) : line;
      mended += "\n";
    }
    if (Status written = WriteFileAtomically(path, mended); !written.ok()) {
      std::fprintf(stderr,
                   "ztier-train: warning: the checkpoint's note %s says nothing was saved, and "
                   "could not be given the checkpoint's step: %s\n",
                   path.c_str(), PrintableUtf8(written.ToString()).c_str());
    }
  }
  std::string changed;
  for (const auto& [key, value] : now) {
    const auto it = saved.find(key);
    if (key == "heads" || it == saved.end() || it->second == value) continue;
    if (!changed.empty()) changed += ", ";
    changed += key == "data" ? StrCat("other text (--data: ", value, "; before: ", it->second, ")")
                             : StrCat("--", key, " ", value, " (before: ", it->second, ")");
  }
  if (!changed.empty()) {
    std::fprintf(stderr,
                 "ztier-train: warning: resuming with %s; the steps from here differ from those "
                 "an uninterrupted run would take\n",
                 PrintableUtf8(changed).c_str());
  }
  return Status::Ok();
}

Result<int64_t> StartingPoint(const Flags& f, const Plan& p, std::string_view text,
                              const OutPaths& paths, Model& m) {
  const std::vector<std::pair<std::string, std::string>> note = RunNote(f, p, text);
  ZT_ASSIGN_OR_RETURN(const bool has_checkpoint, HasCheckpoint(paths));
  if (f.resume) {
    if (!has_checkpoint) {
      return Status::NotFound(StrCat("--resume: there is no checkpoint in ", paths.checkpoint));
    }
    // The shapes first (the engine names a tensor that differs), then the
    // note. It describes the checkpoint beside it: this run's settings go in
    // once its first save has committed (a resume that fails, is refused or
    // is killed before leaves it as it was).
    ZT_RETURN_IF_ERROR(m.LoadCheckpoint(paths.checkpoint).Annotate("--resume"));
    // An older checkpoint's files a kill left (after the last save's
    // manifest): the run may save no more, which would remove them.
    ZT_RETURN_IF_ERROR(m.TidyCheckpointDir(paths.checkpoint).Annotate("--resume"));
    // And the note's temp file a kill between a save and its note's rename
    // left (a resume that saves no more writes no note, which removes it).
    RemoveStaleTemps(ModelNotePath(paths));
    ZT_RETURN_IF_ERROR(CheckRunNote(f, paths, note, m.published_step()));
    return m.published_step();
  }
  if (has_checkpoint && !f.overwrite) {
    return Status::AlreadyExists(
        StrCat(f.out, " holds a checkpoint of an earlier run (", paths.checkpoint,
               "): pass --resume to continue it, or --overwrite to start over and replace it"));
  }
  if (!f.overwrite) {
    ZT_ASSIGN_OR_RETURN(const std::string earlier, EarlierOutput(paths));
    if (!earlier.empty()) {
      return Status::AlreadyExists(StrCat(f.out, " holds ", earlier,
                                          " of an earlier run, and no checkpoint to resume: pass "
                                          "--overwrite to start over and replace it"));
    }
  }
  // The checkpoint's files there go: with --overwrite an earlier run's;
  // without, those of a first save a kill cut short, if any (EarlierOutput).
  if (fs::is_directory(paths.checkpoint)) {
    ZT_RETURN_IF_ERROR(m.RemoveCheckpoint(paths.checkpoint)
                           .Annotate(f.overwrite ? "--overwrite"
                                                 : "removing the files of a cut-short first save"));
  }
  if (f.overwrite) ZT_RETURN_IF_ERROR(RemoveFile(paths.exported));
  for (int k = 0; k < m.units(); ++k) {
    std::vector<float> w(m.layout(k).numel);
    gpt::InitUnit(f.model, k, f.seed, m.layout(k), w);
    ZT_RETURN_IF_ERROR(m.SetWeights(k, w.data(), w.size()));
  }
  ZT_RETURN_IF_ERROR(CreateDir(paths.checkpoint, "checkpoint directory"));
  ZT_RETURN_IF_ERROR(WriteFileAtomically(ModelNotePath(paths), RunNoteText(note)));
  return int64_t{0};
}

// Trains steps first+1 .. f.steps on every rank; returns the signal that
// stopped it early (0 when it ran to the end).
// Rank 0's figures over the steps a --summary measures.
struct Measured {
  int steps = 0;
  double train_seconds = 0;  // rank 0 training (its steps' micro-steps), not reporting
  RunnerStats at_start, at_end;
  double engine_optimizer_at_start = 0;  // the job's optimizer seconds so far
};

// The steps a --summary leaves out of a run that trains steps first+1 ..
// f.steps (a resumed run counts from where it resumed).
int SummarySkip(const Flags& f, int64_t first) {
  return f.summary_skip >= 0 ? f.summary_skip
                             : static_cast<int>(std::min<int64_t>(5, (f.steps - first) / 4));
}

Result<int> TrainSteps(const Flags& f, const Plan& p, const std::string& text, Session& session,
                       Model& m, const OutPaths& paths, int64_t first,
                       std::vector<RunnerStats>* stats, Measured* measured) {
  std::vector<std::unique_ptr<Collectives>> coll;
  if (f.ranks > 1) {
    Result<std::vector<std::unique_ptr<Collectives>>> c =
        f.device == "cuda" ? [&] {
          std::vector<int> ordinals;
          for (int r = 0; r < f.ranks; ++r) ordinals.push_back(r);
          return MakeNcclCollectives(ordinals);
        }()
                           : MakeLocalCollectives(f.ranks);
    if (!c.ok()) return c.status();
    coll = *std::move(c);
  }
  // Per step: ranks train, then rank 0 reports (and checkpoints) while the
  // others wait at the barrier, so a checkpoint sees no grads pending; a
  // stop decided there is seen by every rank after the second barrier.
  std::barrier sync(f.ranks);
  std::mutex mu;
  std::vector<double> step_loss(f.ranks, 0.0);
  stats->assign(f.ranks, RunnerStats{});
  std::vector<Status> status(f.ranks);
  int stop_signal = 0;  // written by rank 0 between the barriers
  // The step of the last checkpoint committed (the one resumed from, 0:
  // none), for a failure's message.
  std::atomic<int64_t> saved{first};
  Progress progress(static_cast<int>(first), f.steps, f.progress, f.progress_every, paths.log);
  const double tokens_per_step =
      static_cast<double>(p.batch) * f.model.context * f.ranks * p.accumulation;
  auto rank_main = [&](int r) -> Status {
    Result<std::unique_ptr<Device>> dev = f.device == "cuda" ? MakeCudaDevice(r) : MakeHostDevice();
    if (!dev.ok()) return dev.status();
    std::vector<engine::UnitLayout> layouts;
    for (int k = 0; k < m.units(); ++k) layouts.push_back(m.layout(k));
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<gpt::Gpt> net,
                        gpt::Gpt::Create(p.model, p.batch, **dev, layouts));
    const client::RunnerOptions options = client::RunnerOptionsFrom(session.settings());
    ZT_ASSIGN_OR_RETURN(
        std::unique_ptr<Stage3Runner> runner,
        Stage3Runner::Create(m, r, **dev, f.ranks > 1 ? coll[r].get() : nullptr, options));
    gpt::SourceOf<Stage3Runner> source(*runner);
    const float scale = 1.0f / static_cast<float>(f.ranks * p.accumulation);
    Clock::time_point t0 = Clock::now();
    for (int64_t step = first; step < f.steps; ++step) {
      const bool measure = r == 0 && step - first >= SummarySkip(f, first);
      if (measure && measured->steps == 0) {
        measured->at_start = runner->stats();
        ZT_ASSIGN_OR_RETURN(const engine::JobCounters at_start, m.counters());
        measured->engine_optimizer_at_start = at_start.optimizer_seconds;
      }
      const Clock::time_point step_start = Clock::now();
      double loss = 0;
      for (int micro = 0; micro < p.accumulation; ++micro) {
        const std::vector<int32_t> tokens = Batch(text, f, p.batch, step, micro, r);
        ZT_ASSIGN_OR_RETURN(float l, net->TrainMicroStep(source, tokens.data(), scale));
        loss += l / p.accumulation;
        ZT_RETURN_IF_ERROR(runner->Step());
      }
      if (measure) {
        measured->train_seconds += std::chrono::duration<double>(Clock::now() - step_start).count();
        ++measured->steps;
        measured->at_end = runner->stats();
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        step_loss[r] = loss;
        (*stats)[r] = runner->stats();
      }
      sync.arrive_and_wait();
      if (r == 0) {
        const int64_t done = step + 1;
        double mean = 0;
        RunnerStats total;
        for (int k = 0; k < f.ranks; ++k) {
          mean += step_loss[k] / f.ranks;
          total.h2d_bytes += (*stats)[k].h2d_bytes;
          total.d2h_bytes += (*stats)[k].d2h_bytes;
        }
        const int sig = done < f.steps ? client::StopRequested() : 0;
        const bool checkpoint = done == f.steps || sig != 0 ||
                                (f.checkpoint_every > 0 && done % f.checkpoint_every == 0);
        if (checkpoint) {
          ZT_RETURN_IF_ERROR(
              m.WaitPublished(done, std::chrono::seconds(p.settings.wait_timeout_seconds)));
        }
        const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        // A stop's step is the run's last: its line is always shown.
        ZT_ASSIGN_OR_RETURN(const engine::JobCounters counters, m.counters());
        progress.Update(static_cast<int>(done), mean, tokens_per_step / std::max(secs, 1e-9), total,
                        counters, sig != 0 ? Progress::Line::kAlways : Progress::Line::kIfDue);
        if (checkpoint) {
          progress.Sync();
          const auto write_note = [&] {
            return WriteFileAtomically(ModelNotePath(paths),
                                       RunNoteText(RunNote(f, p, text), done));
          };
          if (Status s = m.SaveCheckpoint(paths.checkpoint); !s.ok()) {
            // A save can fail once it committed (the directory's fsync
            // after its manifest's rename): the checkpoint there is then
            // this step's, which --resume goes on from. It gets its note,
            // and the failure says its step.
            if (CommittedStep(paths) == done) {
              saved.store(done);
              (void)write_note();
            }
            return s;
          }
          saved.store(done);
          // The note follows the save that committed: one that failed or was
          // cut short leaves the checkpoint before it, and that one's note.
          // A note that cannot be written ends no run: the checkpoint is
          // committed; a resume then says the note is of another step.
          if (Status noted = write_note(); !noted.ok()) {
            std::fprintf(stderr,
                         "ztier-train: warning: the checkpoint of step %lld is saved, its note "
                         "is not: %s\n",
                         static_cast<long long>(done), PrintableUtf8(noted.ToString()).c_str());
          }
          if (f.exit_after > 0 && done == f.exit_after) {
            std::fprintf(stderr, "ztier-train: exiting abruptly after step %lld (--exit-after)\n",
                         static_cast<long long>(done));
            std::_Exit(3);
          }
        }
        if (sig != 0) {
          progress.Break();
          stop_signal = sig;
        }
        t0 = Clock::now();
      }
      sync.arrive_and_wait();
      if (stop_signal != 0) break;
    }
    return Status::Ok();
  };
  // A rank that fails ends the process (the other ranks would wait for it
  // forever), without closing the embedded engine: its swap files go now,
  // as a clean close removes them (on a full disk they held the room the
  // checkpoint needed). The checkpoint stays. Only this run's own files,
  // known by their inodes from the start: an --out removed under the run
  // and taken by another one holds that run's swap file at the same path.
  std::vector<std::pair<std::string, std::pair<dev_t, ino_t>>> own_swap_files;
  if (p.settings.daemon_socket.empty()) {
    for (const std::string& dir : p.settings.nvme_paths) {
      const std::string file =
          (std::filesystem::path(dir) / nvme::SwapOptions().file_name).string();
      struct stat st {};
      if (::lstat(file.c_str(), &st) == 0) own_swap_files.push_back({file, {st.st_dev, st.st_ino}});
    }
  }
  const auto abandon = [&](int r, const Status& s) {
    std::fprintf(stderr, "%sztier-train: rank %d: %s\n", BarEnd(), r, s.ToString().c_str());
    // What is left to go on from, as the other failures say it.
    if (const int64_t step = saved.load(); step > 0) {
      std::fprintf(stderr,
                   "ztier-train: the last checkpoint saved, of step %lld, is in %s: --resume "
                   "continues from it once this is fixed\n",
                   static_cast<long long>(step), paths.checkpoint.c_str());
    } else {
      std::fprintf(stderr,
                   "ztier-train: this run saved no checkpoint: run it again (--overwrite) once "
                   "this is fixed\n");
    }
    for (const auto& [file, id] : own_swap_files) {
      struct stat st {};
      if (::lstat(file.c_str(), &st) == 0 && st.st_dev == id.first && st.st_ino == id.second) {
        ::unlink(file.c_str());
      }
    }
    std::_Exit(1);
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < f.ranks; ++r) {
    Result<std::thread> t = StartThread(StrCat("the thread of rank ", r), [&, r] {
      try {
        status[r] = rank_main(r);
      } catch (const std::exception& e) {  // oneTBB's, when it cannot start a worker
        status[r] = Status::ResourceExhausted(StrCat("the kernels failed: ", e.what()));
      }
      if (!status[r].ok()) abandon(r, status[r]);
    });
    if (!t.ok()) abandon(r, t.status());
    threads.push_back(std::move(*t));
  }
  for (auto& t : threads) t.join();
  return stop_signal;
}

// --summary: rank 0's speed over the measured steps, its step time split
// into compute and the runner's waits by what the transfers were doing
// (RunnerStats), each second counted once, so the parts add up to the step.
Status WriteSummary(const Flags& f, const Plan& p, const Measured& m, const engine::JobCounters& c,
                    engine::StateDtype dtype, int64_t first) {
  if (m.steps == 0) {  // (checked before training: a run stopped by a signal)
    return Status::InvalidArgument(StrCat("--summary: no step was measured (steps ", first + 1,
                                          "..", f.steps, ", --summary-skip ", SummarySkip(f, first),
                                          ")"));
  }
  const double n = m.steps;
  const auto per_step = [&](double RunnerStats::*field) {
    return (m.at_end.*field - m.at_start.*field) / n;
  };
  const double step_s = m.train_seconds / n;
  const double opt = per_step(&RunnerStats::wait_optimizer_seconds);
  const double h2d = per_step(&RunnerStats::wait_h2d_seconds);
  const double d2h = per_step(&RunnerStats::wait_d2h_seconds);
  const double coll = per_step(&RunnerStats::wait_collective_seconds);
  const double tokens_per_step =
      static_cast<double>(p.batch) * f.model.context * f.ranks * p.accumulation;
  const auto tier = [](engine::Tier t) { return t == engine::Tier::kNvme ? "nvme" : "dram"; };
  char buf[2048];
  std::snprintf(
      buf, sizeof(buf),
      "{\"device\": \"%s\", \"ranks\": %d, \"layers\": %d, \"channels\": %d, \"heads\": %d, "
      "\"context\": %d, \"batch\": %d, \"accumulation\": %d, \"optimizer\": \"%s\", "
      "\"params\": \"%s\", \"state_dtype\": \"%s\", \"persistence_threshold_params\": %llu, "
      "\"prefetch_depth\": %d, \"steps_measured\": %d, \"steps_skipped\": %d, "
      "\"tokens_per_s\": %.1f, \"step_seconds\": %.6f, \"compute_seconds\": %.6f, "
      "\"optimizer_wait_seconds\": %.6f, \"h2d_wait_seconds\": %.6f, \"d2h_wait_seconds\": %.6f, "
      "\"collective_wait_seconds\": %.6f, \"h2d_bytes_per_step\": %.0f, "
      "\"d2h_bytes_per_step\": %.0f, \"coalesce_bytes\": %llu, \"h2d_copies_per_step\": %.1f, "
      "\"d2h_copies_per_step\": %.1f, \"engine_optimizer_seconds\": %.6f}\n",
      f.device.c_str(), f.ranks, f.model.layers, f.model.channels, f.model.heads, f.model.context,
      p.batch, p.accumulation, tier(p.settings.optimizer_tier), tier(p.settings.param_tier),
      std::string(engine::StateDtypeName(dtype)).c_str(),
      static_cast<unsigned long long>(p.settings.param_persistence_threshold),
      p.settings.prefetch_depth, m.steps, SummarySkip(f, first), tokens_per_step / step_s, step_s,
      step_s - opt - h2d - d2h - coll, opt, h2d, d2h, coll,
      static_cast<double>(m.at_end.h2d_bytes - m.at_start.h2d_bytes) / n,
      static_cast<double>(m.at_end.d2h_bytes - m.at_start.d2h_bytes) / n,
      static_cast<unsigned long long>(p.settings.coalesce_bytes),
      static_cast<double>(m.at_end.h2d_copies - m.at_start.h2d_copies) / n,
      static_cast<double>(m.at_end.d2h_copies - m.at_start.d2h_copies) / n,
      (c.optimizer_seconds - m.engine_optimizer_at_start) / n);
  return WriteFileAtomically(f.summary, buf).Annotate("--summary");
}

int Run(const Flags& f, const Plan& p) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "%sztier-train: %s\n", BarEnd(), PrintableUtf8(s.ToString()).c_str());
    return 1;
  };
  Result<std::string> text = LoadText(f.data);
  if (!text.ok()) return fail(text.status());
  if (text->size() < static_cast<size_t>(f.model.context) + 1) {
    return fail(Status::InvalidArgument(
        StrCat("the text has ", text->size(), " bytes, fewer than the context + 1 (one row)")));
  }
  if (Status s = CheckHostMemory(f, p, text->size()); !s.ok()) return fail(s);
  if (f.device == "cuda") {
    // Rank r trains on GPU r: without the last one the run ends here, before
    // the engine pins the states (seconds for a large model).
    Result<std::unique_ptr<Device>> last = MakeCudaDevice(f.ranks - 1);
    if (!last.ok()) return fail(last.status().Annotate(StrCat("--device cuda --ranks ", f.ranks)));
  }
  if (Status s = CheckOutIsOurs(f.out); !s.ok()) return fail(s);
  // Nothing is made for a --resume with nothing to resume (it left an
  // empty checkpoint and swap directory behind).
  if (f.resume) {
    Result<bool> has = HasCheckpoint(OutPaths(f.out));
    if (!has.ok()) return fail(has.status().Annotate("--resume"));
    if (!*has) return fail(NoCheckpointToResume(OutPaths(f.out)));
  }
  if (Status s = CreateDir(f.out, "--out directory"); !s.ok()) return fail(s);
  if (!f.summary.empty()) {
    // Its directory (one in --out is made now) must take the file: said
    // before training, not once the run is over.
    const fs::path dir = fs::path(f.summary).parent_path().empty()
                             ? fs::path(".")
                             : fs::path(f.summary).parent_path();
    std::error_code ec;
    // Not in a swap directory, whose files the engine removes as it closes.
    for (const std::string& swap : p.settings.nvme_paths) {
      if (AbsoluteNormal(dir) == AbsoluteNormal(swap) || fs::equivalent(dir, swap, ec)) {
        return fail(
            Status::InvalidArgument(StrCat("--summary ", f.summary, " is in swap directory ", swap,
                                           ", whose files the engine removes")));
      }
    }
    fs::create_directories(dir, ec);
    if (ec) return fail(PosixError(StrCat("--summary: create ", dir.string()), ec.value()));
    if (::access(dir.c_str(), W_OK) != 0) {
      return fail(PosixError(StrCat("--summary: ", dir.string(), " cannot be written"), errno));
    }
  }
  // Swap directories must exist, the default <out>/swap aside (made here):
  // one made under a drive's mount point that is not mounted would put the
  // swap space on the root filesystem, silently.
  const std::string default_swap = (fs::path(f.out) / "swap").string();
  for (const std::string& dir : p.settings.nvme_paths) {
    std::error_code ec;
    if (fs::is_directory(dir, ec)) continue;
    if (dir != default_swap) {
      return fail(
          fs::exists(dir, ec)
              ? Status::FailedPrecondition(StrCat(
                    "swap directory ", dir, " is not a directory (give a directory on the drive)"))
              : Status::NotFound(
                    StrCat("swap directory ", dir,
                           " does not exist (swap directories must: create it on the drive, "
                           "mounted, or leave --swap-dir out for <out>/swap)")));
    }
    if (Status s = CreateDir(dir, "swap directory"); !s.ok()) return fail(s);
  }

  // The swap directories are locked as the session opens, the checkpoint
  // directory as soon as the model exists: a second run on this --out stops
  // here, before it touches anything of the first one's.
  Result<std::unique_ptr<Session>> session =
      Session::Open({.settings = p.settings, .daemon_socket = "", .io_backend = nullptr});
  if (!session.ok()) return fail(session.status());
  engine::OptimizerConfig opt;
  opt.hyper = p.hyper;
  opt.clip_norm = p.clip;
  opt.grad_accumulation = p.accumulation;
  Result<std::unique_ptr<Model>> model =
      (*session)->RegisterModel({.name = f.job_name,
                                 .units = gpt::UnitSpecs(p.model),
                                 .optimizer = opt,
                                 .optimizer_tier = p.settings.optimizer_tier,
                                 .param_tier = p.settings.param_tier,
                                 .world_size = f.ranks});
  if (!model.ok()) {
    if (model.status().code() == StatusCode::kAlreadyExists && f.job_name_of_out) {
      // (Another --job-name ran into the other run's checkpoint lock.)
      return fail(model.status().Annotate(
          StrCat("another run on --out ", f.out,
                 " is training through this ztierd: one --out "
                 "takes one run at a time (give this one another --out, or stop that one)")));
    }
    if (model.status().code() == StatusCode::kAlreadyExists) {
      return fail(model.status().Annotate(
          "another job has this name (--job-name NAME gives this run another)"));
    }
    return fail(model.status());
  }
  Model& m = **model;
  const OutPaths paths(f.out);
  if (Status s = m.ClaimCheckpointDir(paths.checkpoint); !s.ok()) return fail(s);
  // A checkpoint whose longest file path (a shard of the last step's, the
  // note, while written to a temp file beside it) is past the system's
  // fails now, before the run writes anything.
  const size_t longest =
      std::max((fs::path(paths.checkpoint) / StrCat("unit-", m.units() - 1, "-rank-", f.ranks - 1,
                                                    "-step-", f.steps, "-00000000.bin"))
                   .string()
                   .size(),
               std::max(ModelNotePath(paths).size(), paths.exported.size())) +
      kAtomicTempSuffixBytes;
  if (longest >= PATH_MAX) {
    return fail(Status::InvalidArgument(
        StrCat("--out ", f.out, ": the checkpoint's files would have paths of ", longest,
               " bytes, past the system's ", PATH_MAX - 1, " (choose a shorter --out)")));
  }
  Result<int64_t> first = StartingPoint(f, p, *text, paths, m);
  if (!first.ok()) {
    if (first.status().code() == StatusCode::kAlreadyExists) {
      std::fprintf(stderr, "ztier-train: %s\n", PrintableUtf8(first.status().message()).c_str());
      return 2;
    }
    return fail(first.status());
  }
  PrintSetup(f, p, **session, text->size());
  if (*first > f.steps) {
    return fail(
        Status::InvalidArgument(StrCat("the checkpoint is at step ", *first, ", past --steps ",
                                       f.steps, "; raise --steps to train on")));
  }
  if (f.exit_after > 0 && f.exit_after <= *first) {
    return fail(Status::InvalidArgument(StrCat("--exit-after ", f.exit_after,
                                               ": the run resumes after step ", *first,
                                               " and would never reach it")));
  }
  if (!f.summary.empty() && SummarySkip(f, *first) >= f.steps - *first) {
    // Said before training, not after it (a resumed run trains fewer steps).
    return fail(Status::InvalidArgument(
        *first == f.steps ? StrCat("--summary: the checkpoint is at step ", f.steps,
                                   " (--steps): this run trains no step to measure (raise --steps)")
                          : StrCat("--summary: this run trains steps ", *first + 1, "..", f.steps,
                                   " (", f.steps - *first, "), and --summary-skip ",
                                   SummarySkip(f, *first), " leaves none of them to measure")));
  }
  if (Status s = PrepareLog(paths.log, *first); !s.ok()) return fail(s);
  // What would fail only once every step has run fails now: an export that
  // could not replace what is there.
  if (Result<std::string> t = ReplaceableTarget(paths.exported); !t.ok()) return fail(t.status());
  if (f.resume) {
    std::fprintf(stderr, "ztier-train: resumed at step %lld of %d\n",
                 static_cast<long long>(*first), f.steps);
  }

  const Clock::time_point run_start = Clock::now();
  std::vector<RunnerStats> stats;
  Measured measured;
  int stopped = 0;
  if (*first < f.steps) {
    Result<int> trained = TrainSteps(f, p, *text, **session, m, paths, *first, &stats, &measured);
    if (!trained.ok()) return fail(trained.status());
    stopped = *trained;
  }
  if (Status s = m.ExportSafetensors(paths.exported, engine::Engine::ExportType::kBFloat16);
      !s.ok()) {
    fail(s);
    // The steps are saved: a run started again with --overwrite would
    // throw them away.
    if (const int64_t step = CommittedStep(paths); step > 0) {
      std::fprintf(stderr,
                   "ztier-train: the checkpoint of step %lld is saved in %s: --resume writes the "
                   "export from it once this is fixed\n",
                   static_cast<long long>(step), paths.checkpoint.c_str());
    }
    return 1;
  }
  Result<engine::JobCounters> counters = m.counters();
  if (!counters.ok()) return fail(counters.status());
  const engine::JobCounters& c = *counters;
  const double run_s = std::chrono::duration<double>(Clock::now() - run_start).count();
  if (stopped != 0) {
    std::fprintf(stderr,
                 "ztier-train: stopped by %s after step %lld of %d; checkpoint %s (--resume "
                 "continues it), weights %s\n",
                 stopped == SIGINT ? "SIGINT" : "SIGTERM",
                 static_cast<long long>(m.published_step()), f.steps, paths.checkpoint.c_str(),
                 paths.exported.c_str());
    return 128 + stopped;
  }
  if (stats.empty()) {
    std::fprintf(stderr,
                 "ztier-train: the checkpoint is at step %lld, the last one: wrote the weights "
                 "%s\n",
                 static_cast<long long>(*first), paths.exported.c_str());
    return 0;
  }
  std::fprintf(
      stderr,
      "ztier-train: done: %lld steps (%lld skipped) in %.1f s; the engine's optimizer ran "
      "%.2f s beside the compute, rank 0 waited %.2f s for params and %.2f s for its grads "
      "to land; checkpoint %s, weights %s\n",
      static_cast<long long>(c.steps), static_cast<long long>(c.skipped_steps), run_s,
      c.optimizer_seconds, stats[0].acquire_wait_seconds, stats[0].step_wait_seconds,
      paths.checkpoint.c_str(), paths.exported.c_str());
  if (!f.summary.empty()) {
    // The job's, as the engine keeps it (ztierd's own setting where the
    // run set none: the run's said fp32 beside an int8 checkpoint).
    Result<engine::StateDtype> dtype = m.state_dtype();
    if (!dtype.ok()) return fail(dtype.status());
    if (Status w = WriteSummary(f, p, measured, c, *dtype, *first); !w.ok()) return fail(w);
  }
  return 0;
}

}  // namespace
}  // namespace ztier::train

int main(int argc, char** argv) {
  using ztier::train::Usage;
  // A file size limit (ulimit -f) past which a write or an ftruncate of the
  // pool's memory files would kill the process without a word: EFBIG, said.
  ::signal(SIGXFSZ, SIG_IGN);
  // A reader of stderr gone (`| tee log` with the terminal's Ctrl-C, which
  // reaches tee too) killed the run as it said it was stopping, before the
  // stop's checkpoint: the lines go nowhere instead.
  ::signal(SIGPIPE, SIG_IGN);
  ztier::OpenClosedStandardFds();
  // First: a SIGTERM while the run sets up killed it without a word (the
  // stop is seen at the first step's end, as any other).
  if (ztier::Status s = ztier::client::InstallStopHandlers(); !s.ok()) {
    std::fprintf(stderr, "ztier-train: %s\n", s.ToString().c_str());
    return 1;
  }
  ztier::Result<ztier::train::Flags> flags = ztier::train::ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "ztier-train: %s\n\n",
                 ztier::PrintableUtf8(flags.status().ToString()).c_str());
    Usage(std::cerr);
    return 2;
  }
  ztier::Result<ztier::train::Plan> plan = ztier::train::ResolvePlan(*flags);
  if (!plan.ok()) {
    std::fprintf(stderr, "ztier-train: %s\n",
                 ztier::PrintableUtf8(plan.status().ToString()).c_str());
    return 2;
  }
  // What the up-front checks cannot see (a ulimit, memory taken by others
  // meanwhile) ends in a message, not an abort.
  try {
    return ztier::train::Run(*flags, *plan);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "%sztier-train: resource_exhausted: out of host memory (a ulimit -v, or other "
                 "processes took what the checks counted on); make the model, the batch or "
                 "--data smaller\n",
                 ztier::train::BarEnd());
    return 1;
  }
}
