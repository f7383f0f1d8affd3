// ztier-bench train: what offloading costs a training run. The GPT example
// (ztier-train) on the chosen device, its params streamed to the device a
// unit ahead of compute (offloaded: ztier-train's default persistence
// threshold) against every unit kept on the device (resident), with the
// optimizer states in DRAM and on NVMe, each pair run back to back in the
// same invocation. Per run: tokens/s over the steps after the skipped ones,
// and rank 0's step time split into compute and its waits by what the
// runner's transfers were doing meanwhile (optimizer: the engine's critical
// path; H2D; D2H; collectives), each second counted once, so the parts add
// up to the step (RunnerStats). The ratio offloaded / resident is the cost
// of streaming the params.
//
// Each run is a ztier-train process (--train, else next to this program or
// in the build tree's examples/) writing --summary JSON into a scratch
// directory removed afterwards; its output goes to a log there, shown when
// it fails. Single-threaded driver.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/subcommands.h"

extern char** environ;

namespace ztier::bench {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage = R"(usage: ztier-bench train [options]

The GPT example trained by ztier-train with its params streamed to the device
(offloaded) and with every unit resident on it, for each optimizer placement:
tokens/s, the ratio offloaded / resident, and each run's step split into
compute and waits (optimizer critical path, H2D, D2H, collectives).

options:
  --device host|cuda       compute device (default host)
  --matmul fp32|bf16       ztier-train's matmuls (default fp32; bf16: bf16
                           operands, fp32 sums, tensor cores on cuda)
  --optimizer LIST         dram, nvme or dram,nvme (default dram,nvme)
  --layers N --channels C --heads H --context T --batch B
                           model and micro-batch (default ztier-train's:
                           4, 128, 4, 64, 8)
  --ranks R                local ranks (default 1)
  --steps N                steps per run (default 24)
  --skip N                 first steps left out of the figures (default 5)
  --data PATH              text to train on (default ztier-train's)
  --dir DIR                scratch directory for the runs, swap included
                           (default: a new one under $TMPDIR); what the runs
                           put there goes, and the directory if this made it
                           (a failed run's log stays, named in the error);
                           with nvme it must be on a drive, not tmpfs
  --train PATH             the ztier-train program, a path or a name in PATH
                           (default: beside ztier-bench, or the build
                           tree's examples/)
  --repeat N               run each pair N times, alternating, and report each
                           mode's median run (of an even N the slower middle
                           one; default 1; a noisy machine wants 3);
                           the JSON has every repeat's tokens/s too
  --json                   also print one JSON object with every figure
)";

struct Options {
  std::string device = "host";
  std::string matmul = "fp32";
  std::vector<std::string> placements = {"dram", "nvme"};
  int layers = 4, channels = 128, heads = 4, context = 64, batch = 8, ranks = 1;
  int steps = 24, skip = 5, repeat = 1;
  std::string data, dir, train;
  bool json = false;
};

Result<Options> Parse(int argc, char** argv) {
  Options o;
  ArgReader args(argc, argv);
  while (args.Next()) {
    if (args.Is("--device")) {
      ZT_ASSIGN_OR_RETURN(o.device, args.Choice<std::string>({{"host", "host"}, {"cuda", "cuda"}}));
    } else if (args.Is("--matmul")) {
      ZT_ASSIGN_OR_RETURN(o.matmul, args.Choice<std::string>({{"fp32", "fp32"}, {"bf16", "bf16"}}));
    } else if (args.Is("--optimizer")) {
      ZT_ASSIGN_OR_RETURN(o.placements,
                          args.Choice<std::vector<std::string>>({{"dram", {"dram"}},
                                                                 {"nvme", {"nvme"}},
                                                                 {"dram,nvme", {"dram", "nvme"}},
                                                                 {"nvme,dram", {"nvme", "dram"}}}));
    } else if (args.Is("--layers")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.layers, 1, 1024));
    } else if (args.Is("--channels")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.channels, 1, 65536));
    } else if (args.Is("--heads")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.heads, 1, 1024));
    } else if (args.Is("--context")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.context, 1, 65536));
    } else if (args.Is("--batch")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.batch, 1, 65536));
    } else if (args.Is("--ranks")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.ranks, 1, 64));
    } else if (args.Is("--steps")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.steps, 2, 1 << 20));
    } else if (args.Is("--skip")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.skip, 0, 1 << 20));
    } else if (args.Is("--data")) {
      ZT_ASSIGN_OR_RETURN(const std::string_view v, args.Value());
      o.data = v;
    } else if (args.Is("--dir")) {
      ZT_ASSIGN_OR_RETURN(const std::string_view v, args.Value());
      o.dir = v;
    } else if (args.Is("--train")) {
      ZT_ASSIGN_OR_RETURN(const std::string_view v, args.Value());
      o.train = v;
    } else if (args.Is("--repeat")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.repeat, 1, 100));
    } else if (args.Is("--json")) {
      o.json = true;
    } else {
      return args.Unrecognized();
    }
  }
  if (o.skip >= o.steps) {
    return Status::InvalidArgument(
        StrCat("--skip ", o.skip, " leaves none of --steps ", o.steps, " to measure"));
  }
  // The GPT's own rule (ztier-train would say it, after the bench began).
  if (o.channels % o.heads != 0) {
    return Status::InvalidArgument(
        StrCat("--heads ", o.heads, " must divide --channels ", o.channels));
  }
  return o;
}

bool IsExecutableFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0;
}

// ztier-train: --train (a path, or as a shell finds a command, a name
// without a slash looked up in PATH), else beside this program, else the
// build tree's. The run starts the file found, never another of that name.
Result<std::string> FindTrain(const Options& o) {
  if (!o.train.empty()) {
    if (o.train.find('/') != std::string::npos) {
      if (!IsExecutableFile(o.train)) {
        return Status::NotFound(StrCat("--train ", o.train, ": not an executable file"));
      }
      return o.train;
    }
    const char* path = std::getenv("PATH");
    std::string_view dirs = path != nullptr ? path : "";
    while (true) {
      const size_t colon = dirs.find(':');
      const std::string_view dir = dirs.substr(0, colon);
      const fs::path candidate = fs::path(dir.empty() ? "." : std::string(dir)) / o.train;
      if (IsExecutableFile(candidate)) return fs::absolute(candidate).string();
      if (colon == std::string_view::npos) break;
      dirs.remove_prefix(colon + 1);
    }
    return Status::NotFound(StrCat("--train ", o.train,
                                   ": no executable of that name in PATH (give a path, e.g. ./",
                                   o.train, ")"));
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (const fs::path& p : {self.parent_path() / "ztier-train",
                              self.parent_path().parent_path() / "examples" / "ztier-train"}) {
      if (IsExecutableFile(p)) return p.string();
    }
  }
  return Status::NotFound(
      "no ztier-train beside ztier-bench or in the build tree's examples/; name it with --train");
}

// Runs argv[0] with its output to `log`; an error names the log's tail. A
// stop signal goes on to the run (ztier-train stops at its next step), which
// is waited for, never left running.
Status RunLogged(StopSignals& stops, const std::vector<std::string>& argv, const fs::path& log) {
  ZT_ASSIGN_OR_RETURN(const int st, stops.Run(argv, log.string(), log.string()));
  // Stopped, the scratch directory a run made goes (its logs too): the
  // message names no log.
  if (stops.Stopped() != 0) return stops.Error(StrCat(argv[0], " too"));
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return Status::Ok();
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
  // ztier-train's own words say what was wrong (a --data file, no GPU): a
  // run that failed, not a fault of this program's.
  return Status::FailedPrecondition(StrCat(argv[0],
                                           WIFEXITED(st) ? StrCat(" exited with ", WEXITSTATUS(st))
                                                         : StrCat(" died of signal ", WTERMSIG(st)),
                                           "; its output (", log.string(), "):\n", text));
}

// One number of ztier-train's --summary object.
Result<double> Number(const std::string& json, const std::string& key) {
  const std::string tag = "\"" + key + "\": ";
  const size_t at = json.find(tag);
  if (at == std::string::npos) return Status::Internal(StrCat("summary has no '", key, "'"));
  const char* begin = json.c_str() + at + tag.size();
  char* end = nullptr;
  const double v = std::strtod(begin, &end);
  if (end == begin) return Status::Internal(StrCat("summary's '", key, "' is not a number"));
  return v;
}

struct Figures {
  std::string placement, mode;
  double tokens_per_s = 0, step = 0, compute = 0, optimizer = 0, h2d = 0, d2h = 0, coll = 0;
  double h2d_bytes = 0, d2h_bytes = 0;
  double h2d_copies = 0, d2h_copies = 0;  // over the link, per step
};

Result<Figures> RunOne(StopSignals& stops, const Options& o, const std::string& train,
                       const fs::path& dir, const std::string& placement, bool resident) {
  const std::string name = placement + (resident ? "-resident" : "-offloaded");
  const fs::path out = dir / name;
  std::vector<std::string> argv = {train,
                                   "--out",
                                   out.string(),
                                   "--overwrite",
                                   "--no-progress",
                                   "--device",
                                   o.device,
                                   "--matmul",
                                   o.matmul,
                                   "--optimizer",
                                   placement,
                                   "--layers",
                                   StrCat(o.layers),
                                   "--channels",
                                   StrCat(o.channels),
                                   "--heads",
                                   StrCat(o.heads),
                                   "--context",
                                   StrCat(o.context),
                                   "--batch",
                                   StrCat(o.batch),
                                   "--ranks",
                                   StrCat(o.ranks),
                                   "--steps",
                                   StrCat(o.steps),
                                   "--summary",
                                   (dir / (name + ".json")).string(),
                                   "--summary-skip",
                                   StrCat(o.skip)};
  // Resident: no unit is too large to stay (the threshold is in bytes).
  if (resident) argv.insert(argv.end(), {"--persistence-threshold", "1T"});
  if (!o.data.empty()) argv.insert(argv.end(), {"--data", o.data});
  ZT_RETURN_IF_ERROR(RunLogged(stops, argv, dir / (name + ".log")));
  std::ifstream in(dir / (name + ".json"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string json = ss.str();
  Figures f{.placement = placement, .mode = resident ? "resident" : "offloaded"};
  ZT_ASSIGN_OR_RETURN(f.tokens_per_s, Number(json, "tokens_per_s"));
  ZT_ASSIGN_OR_RETURN(f.step, Number(json, "step_seconds"));
  ZT_ASSIGN_OR_RETURN(f.compute, Number(json, "compute_seconds"));
  ZT_ASSIGN_OR_RETURN(f.optimizer, Number(json, "optimizer_wait_seconds"));
  ZT_ASSIGN_OR_RETURN(f.h2d, Number(json, "h2d_wait_seconds"));
  ZT_ASSIGN_OR_RETURN(f.d2h, Number(json, "d2h_wait_seconds"));
  ZT_ASSIGN_OR_RETURN(f.coll, Number(json, "collective_wait_seconds"));
  ZT_ASSIGN_OR_RETURN(f.h2d_bytes, Number(json, "h2d_bytes_per_step"));
  ZT_ASSIGN_OR_RETURN(f.d2h_bytes, Number(json, "d2h_bytes_per_step"));
  ZT_ASSIGN_OR_RETURN(f.h2d_copies, Number(json, "h2d_copies_per_step"));
  ZT_ASSIGN_OR_RETURN(f.d2h_copies, Number(json, "d2h_copies_per_step"));
  std::error_code ec;
  fs::remove_all(out, ec);  // checkpoint, export and swap of the run
  // Its summary and log too, once read (a failed run's stay, named in the
  // error): a --dir of the user's was left holding them.
  fs::remove(dir / (name + ".json"), ec);
  fs::remove(dir / (name + ".log"), ec);
  return f;
}

void PrintRow(const Figures& f, double ratio) {
  const double ms = 1e3;
  char r[32] = "";
  if (ratio > 0) std::snprintf(r, sizeof(r), "%.3f", ratio);
  std::printf(
      "  %-9s %-10s %10.0f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.2f %9.2f %6.1f %6.1f   %s\n",
      f.placement.c_str(), f.mode.c_str(), f.tokens_per_s, f.step * ms, f.compute * ms,
      f.optimizer * ms, f.h2d * ms, f.d2h * ms, f.coll * ms, f.h2d_bytes / 1e6, f.d2h_bytes / 1e6,
      f.h2d_copies, f.d2h_copies, r);
}

}  // namespace

int RunTrain(int argc, char** argv) {
  Result<Options> parsed = Parse(argc, argv);
  if (!parsed.ok()) return UsageExit(parsed.status(), "train", kUsage);
  const Options& o = *parsed;
  Result<std::string> train = FindTrain(o);
  if (!train.ok()) return FailExit(train.status(), "train");
  StopSignals stops;  // a stop ends the run going and then this one
  fs::path dir = o.dir;
  bool made_dir = false;
  // States "on NVMe" in a directory in memory are the RAM's figures, said
  // as the drive's (the swap space's warning went into a log the bench
  // removes): refused, as nvme and step refuse such a --path.
  const bool nvme =
      std::find(o.placements.begin(), o.placements.end(), "nvme") != o.placements.end();
  const auto on_a_drive = [&](const std::string& where, std::string_view what) {
    Status s = CheckOnADrive(where, what);
    if (s.ok()) return s;
    return Status(s.code(), StrCat(s.message(), "; or --optimizer dram"));
  };
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    const std::string base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    if (nvme) {
      if (Status s = on_a_drive(base, "the default --dir's parent (TMPDIR, or /tmp)"); !s.ok()) {
        return FailExit(s, "train");
      }
    }
    std::string pattern = base + "/ztier-bench-train.XXXXXX";  // mkdtemp's template
    if (::mkdtemp(pattern.data()) == nullptr) {
      return FailExit(Status::IoError(StrCat("mkdtemp ", pattern, ": ", std::strerror(errno))),
                      "train");
    }
    dir = pattern;
    made_dir = true;
  } else {
    // Made if its parent exists; a typo further up is an error, as for the
    // other benchmarks' paths (it made directories from the root down).
    std::error_code ec;
    fs::path whole = fs::absolute(dir, ec).lexically_normal();
    if (!whole.has_filename()) whole = whole.parent_path();  // a trailing '/'
    const fs::path parent = whole.parent_path();
    if (fs::exists(fs::symlink_status(dir, ec)) && !fs::is_directory(dir, ec)) {
      return FailExit(Status::FailedPrecondition(
                          StrCat("--dir ", dir.string(), " is not a directory (give a directory)")),
                      "train");
    }
    if (!fs::is_directory(dir, ec) && !fs::is_directory(parent, ec)) {
      return FailExit(Status::NotFound(StrCat("--dir ", dir.string(), ": its parent ",
                                              parent.string(), " is not an existing directory")),
                      "train");
    }
    made_dir = fs::create_directory(dir, ec);  // (false: it was there)
    if (ec) {
      return FailExit(Status::IoError(StrCat("--dir ", dir.string(), ": ", ec.message())), "train");
    }
    // Said now, not once the first run cannot write its log.
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      return FailExit(PosixError(StrCat("--dir ", dir.string(), " cannot be written"), errno),
                      "train");
    }
    if (nvme) {
      if (Status s = on_a_drive(dir.string(), "--dir"); !s.ok()) {
        if (made_dir) fs::remove(dir, ec);
        return FailExit(s, "train");
      }
    }
  }
  std::printf(
      "ztier-bench train: %s, %s matmuls, %d layers x %d channels, %d heads, context %d, batch %d, "
      "%d "
      "rank(s); %d steps, figures over the last %d (median of %d); offloaded = params streamed "
      "(ztier-train's "
      "persistence threshold), resident = every unit kept on the device\n",
      o.device.c_str(), o.matmul.c_str(), o.layers, o.channels, o.heads, o.context, o.batch,
      o.ranks, o.steps, o.steps - o.skip, o.repeat);
  // ztier-train reads its settings from ZTIER_ variables too (under the
  // flags the bench gives): the figures are of those settings, so say them.
  std::vector<std::pair<std::string, std::string>> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const size_t eq = entry.find('=');
    if (entry.starts_with("ZTIER_") && eq != std::string_view::npos) {
      inherited.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
    }
  }
  std::sort(inherited.begin(), inherited.end());
  if (!inherited.empty()) {
    std::string list;
    for (const auto& [name, value] : inherited) list += StrCat(" ", name, "=", value);
    std::printf("  the runs inherit from the environment:%s\n", list.c_str());
  }
  std::printf("  %-9s %-10s %10s %9s %9s %9s %9s %9s %9s %9s %9s %6s %6s   %s\n", "optimizer",
              "params", "tokens/s", "step ms", "compute", "opt wait", "h2d wait", "d2h wait",
              "coll", "h2d MB", "d2h MB", "h2d #", "d2h #", "offloaded/resident");
  std::vector<std::string> rows;
  int status = 0;
  // The run of median tokens/s among a mode's repeats: of an even count,
  // the slower of the middle two (a run's figures are not averaged; the
  // faster one was taken, flattering both modes).
  const auto median = [](std::vector<Figures> runs) {
    std::sort(runs.begin(), runs.end(),
              [](const Figures& a, const Figures& b) { return a.tokens_per_s < b.tokens_per_s; });
    return runs[(runs.size() - 1) / 2];
  };
  for (const std::string& placement : o.placements) {
    std::vector<Figures> offs, ress;
    Status failed;
    for (int i = 0; i < o.repeat && failed.ok(); ++i) {
      Result<Figures> a = RunOne(stops, o, *train, dir, placement, false);
      Result<Figures> b = a.ok() ? RunOne(stops, o, *train, dir, placement, true) : a.status();
      if (!a.ok() || !b.ok()) {
        failed = a.ok() ? b.status() : a.status();
      } else {
        offs.push_back(*a);
        ress.push_back(*b);
      }
    }
    if (!failed.ok()) {
      status = FailExit(failed, "train");
      if (stops.Stopped() != 0) status = stops.ExitCode();
      break;
    }
    const Figures off_run = median(offs), res_run = median(ress);
    const Figures* off = &off_run;
    const Figures* res = &res_run;
    const double ratio = off->tokens_per_s / res->tokens_per_s;
    PrintRow(*off, ratio);
    PrintRow(*res, 0);
    // Every repeat's tokens/s beside the median run's figures.
    const auto each = [](const std::vector<Figures>& runs) {
      std::vector<std::string> v;
      for (const Figures& r : runs) v.push_back(JsonNumber(r.tokens_per_s));
      return JsonArray(v);
    };
    for (const Figures* f : {off, res}) {
      rows.push_back(JsonObject()
                         .AddRaw("tokens_per_s_of_each_repeat", each(f == off ? offs : ress))
                         .Add("optimizer", f->placement)
                         .Add("params", f->mode)
                         .Add("tokens_per_s", f->tokens_per_s)
                         .Add("step_seconds", f->step)
                         .Add("compute_seconds", f->compute)
                         .Add("optimizer_wait_seconds", f->optimizer)
                         .Add("h2d_wait_seconds", f->h2d)
                         .Add("d2h_wait_seconds", f->d2h)
                         .Add("collective_wait_seconds", f->coll)
                         .Add("h2d_bytes_per_step", f->h2d_bytes)
                         .Add("d2h_bytes_per_step", f->d2h_bytes)
                         .Add("h2d_copies_per_step", f->h2d_copies)
                         .Add("d2h_copies_per_step", f->d2h_copies)
                         .Add("offloaded_over_resident", f == off ? ratio : 1.0)
                         .str());
    }
  }
  if (status == 0 && o.json) {
    std::printf("%s\n", JsonObject()
                            .Add("bench", "train")
                            .Add("device", o.device)
                            .Add("matmul", o.matmul)
                            .Add("layers", o.layers)
                            .Add("channels", o.channels)
                            .Add("heads", o.heads)
                            .Add("context", o.context)
                            .Add("batch", o.batch)
                            .Add("ranks", o.ranks)
                            .Add("steps", o.steps)
                            .Add("skip", o.skip)
                            .Add("repeat", o.repeat)
                            .AddRaw("environment",
                                    [&] {
                                      JsonObject env;
                                      for (const auto& [name, value] : inherited) {
                                        env.Add(name, value);
                                      }
                                      return env.str();
                                    }())
                            .AddRaw("runs", JsonArray(rows))
                            .str()
                            .c_str());
  }
  if (made_dir && (status == 0 || stops.Stopped() != 0)) {  // a failed run's logs stay
    std::error_code ec;
    if (o.dir.empty()) {
      fs::remove_all(dir, ec);
    } else {
      fs::remove(dir, ec);  // a --dir the bench made, left empty by its runs
    }
  }
  return status;
}

}  // namespace ztier::bench
