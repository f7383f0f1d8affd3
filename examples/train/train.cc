// ztier-train: trains the GPT example on a text file through libztier.
//
//   ztier-train                       # fortunes corpus, embedded engine,
//                                     # optimizer states on NVMe swap in ./ztier-run
//   ztier-train --data book.txt --steps 500 --layers 6 --channels 256
//   ztier-train --resume              # continue from ./ztier-run/checkpoint
//
// A byte-level vocabulary (256 tokens). Each local rank is a thread with
// its own device (the host backend, or one CUDA device per rank) and its own
// Stage3Runner; the ranks' collectives are local (host) or NCCL (CUDA).
// Batches are drawn from the text by a generator seeded with (seed, step,
// micro-step, rank), so a resumed run sees exactly the batches the
// uninterrupted run would have. At the end (and every --checkpoint-every
// steps) it writes a checkpoint, and at the end a safetensors export of the
// weights. The progress line shows step, loss, tokens/s and the bytes moved
// per tier (host <-> device copies, NVMe reads and writes); every step is
// also a row of <out>/train_log.tsv.
//
// Exit codes: 0 done, 1 a runtime error (printed), 2 bad usage.
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/ztier.h"
#include "examples/gpt/gpt.h"

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
using Clock = std::chrono::steady_clock;

constexpr char kFortunes[] = "/usr/share/games/fortunes";

struct Flags {
  std::string data;  // empty: the fortunes corpus
  std::string out = "ztier-run";
  std::string swap_dir;  // empty: <out>/swap
  std::string config;    // engine settings (JSON)
  int steps = 500;
  int batch = 8;
  gpt::Config model{.vocab = 256, .context = 64, .channels = 128, .layers = 4, .heads = 4};
  float lr = 2e-3f;
  float weight_decay = 0.01f;
  float clip = 1.0f;
  int accumulation = 1;
  int ranks = 1;
  std::string device = "host";
  std::string optimizer = "nvme";
  std::string params = "dram";
  // Runner options; negative: from the engine settings (config, ZTIER_*).
  int prefetch = -1;
  int64_t max_live_bytes = -1;
  int64_t persistence_threshold = -1;
  int checkpoint_every = 0;
  bool resume = false;
  uint64_t seed = 1;
  bool progress = true;
  int exit_after = 0;  // abrupt exit right after this step's checkpoint (crash testing)
};

void Usage(std::ostream& os) {
  os << "usage: ztier-train [options]\n"
        "Trains a small GPT (byte-level) on a text file through ztier's stage-3 runner.\n"
        "data and output:\n"
        "  --data PATH              text to train on (default: the fortunes corpus in "
     << kFortunes
     << ")\n"
        "  --out DIR                checkpoint, export and swap go here (default ztier-run)\n"
        "  --swap-dir DIR           NVMe swap directory (default <out>/swap); repeat with commas\n"
        "  --resume                 continue from <out>/checkpoint\n"
        "  --checkpoint-every N     also checkpoint every N steps (default: at the end only)\n"
        "model:\n"
        "  --layers N --channels C --heads H --context T   (default 4, 128, 4, 64)\n"
        "  --untied                 a separate output head instead of the tied embedding\n"
        "  --checkpoint-activations recompute each block's activations in its backward\n"
        "training:\n"
        "  --steps N                optimizer steps (default 500)\n"
        "  --batch B                sequences per rank and micro-step (default 8)\n"
        "  --lr X --weight-decay X  AdamW (default 2e-3, 0.01)\n"
        "  --clip X                 global grad-norm clipping, 0 off (default 1.0)\n"
        "  --accumulation N         micro-steps per optimizer step (default 1)\n"
        "  --seed N                 initialisation and batch order (default 1)\n"
        "placement and devices:\n"
        "  --optimizer dram|nvme    where fp32 master and moments live (default nvme)\n"
        "  --params dram|nvme       where the published bf16 params live (default dram)\n"
        "  --device host|cuda       compute device of each rank (default host)\n"
        "  --ranks R                local ranks: threads on the host, GPUs with cuda (default 1)\n"
        "  --prefetch D             units fetched ahead (default 2, ztier.prefetch_depth)\n"
        "  --max-live-bytes N       cap on param bytes on each device (default: none)\n"
        "  --persistence-threshold N  units up to N bytes stay on the device (default 64K)\n"
        "  --config PATH            engine settings file (JSON; ZTIER_* variables apply too)\n"
        "output:\n"
        "  --no-progress            one line per step instead of a progress bar\n"
        "  --exit-after N           exit abruptly right after step N's checkpoint (crash tests)\n";
}

// Parses "64K", "1M", "2G" or a plain number.
bool ParseBytes(const std::string& s, uint64_t* out) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || v < 0) return false;
  double mult = 1;
  const std::string suffix(end);
  if (suffix == "K" || suffix == "k")
    mult = 1 << 10;
  else if (suffix == "M" || suffix == "m")
    mult = 1 << 20;
  else if (suffix == "G" || suffix == "g")
    mult = double(1 << 30);
  else if (!suffix.empty())
    return false;
  *out = static_cast<uint64_t>(v * mult);
  return true;
}

Result<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= argc) return Status::InvalidArgument(StrCat(a, " needs a value"));
      return std::string(argv[++i]);
    };
    auto integer = [&](int* out, int min) -> Status {
      ZT_ASSIGN_OR_RETURN(std::string v, value());
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || n < min || n > (1L << 30)) {
        return Status::InvalidArgument(StrCat(a, " wants an integer >= ", min, ", got '", v, "'"));
      }
      *out = static_cast<int>(n);
      return Status::Ok();
    };
    auto real = [&](float* out) -> Status {
      ZT_ASSIGN_OR_RETURN(std::string v, value());
      char* end = nullptr;
      const float x = std::strtof(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !std::isfinite(x) || x < 0) {
        return Status::InvalidArgument(StrCat(a, " wants a number >= 0, got '", v, "'"));
      }
      *out = x;
      return Status::Ok();
    };
    auto bytes = [&](uint64_t* out) -> Status {
      ZT_ASSIGN_OR_RETURN(std::string v, value());
      if (!ParseBytes(v, out)) {
        return Status::InvalidArgument(
            StrCat(a, " wants a size like 65536, 64K or 1G, got '", v, "'"));
      }
      return Status::Ok();
    };
    auto choice = [&](std::string* out, std::initializer_list<const char*> allowed) -> Status {
      ZT_ASSIGN_OR_RETURN(std::string v, value());
      for (const char* c : allowed) {
        if (v == c) {
          *out = v;
          return Status::Ok();
        }
      }
      return Status::InvalidArgument(StrCat(a, ": unknown value '", v, "'"));
    };
    Status s;
    if (a == "--data") {
      ZT_ASSIGN_OR_RETURN(f.data, value());
    } else if (a == "--out") {
      ZT_ASSIGN_OR_RETURN(f.out, value());
    } else if (a == "--swap-dir") {
      ZT_ASSIGN_OR_RETURN(f.swap_dir, value());
    } else if (a == "--config") {
      ZT_ASSIGN_OR_RETURN(f.config, value());
    } else if (a == "--steps") {
      s = integer(&f.steps, 1);
    } else if (a == "--batch") {
      s = integer(&f.batch, 1);
    } else if (a == "--layers") {
      s = integer(&f.model.layers, 1);
    } else if (a == "--channels") {
      s = integer(&f.model.channels, 1);
    } else if (a == "--heads") {
      s = integer(&f.model.heads, 1);
    } else if (a == "--context") {
      s = integer(&f.model.context, 1);
    } else if (a == "--untied") {
      f.model.tied_head = false;
    } else if (a == "--checkpoint-activations") {
      f.model.checkpoint_activations = true;
    } else if (a == "--lr") {
      s = real(&f.lr);
    } else if (a == "--weight-decay") {
      s = real(&f.weight_decay);
    } else if (a == "--clip") {
      s = real(&f.clip);
    } else if (a == "--accumulation") {
      s = integer(&f.accumulation, 1);
    } else if (a == "--ranks") {
      s = integer(&f.ranks, 1);
    } else if (a == "--device") {
      s = choice(&f.device, {"host", "cuda"});
    } else if (a == "--optimizer") {
      s = choice(&f.optimizer, {"dram", "nvme"});
    } else if (a == "--params") {
      s = choice(&f.params, {"dram", "nvme"});
    } else if (a == "--prefetch") {
      s = integer(&f.prefetch, 0);
    } else if (a == "--max-live-bytes" || a == "--persistence-threshold") {
      uint64_t n = 0;
      s = bytes(&n);
      (a == "--max-live-bytes" ? f.max_live_bytes : f.persistence_threshold) =
          static_cast<int64_t>(n);
    } else if (a == "--checkpoint-every") {
      s = integer(&f.checkpoint_every, 0);
    } else if (a == "--resume") {
      f.resume = true;
    } else if (a == "--seed") {
      int seed = 0;
      s = integer(&seed, 0);
      f.seed = static_cast<uint64_t>(seed);
    } else if (a == "--no-progress") {
      f.progress = false;
    } else if (a == "--exit-after") {
      s = integer(&f.exit_after, 1);
    } else if (a == "-h" || a == "--help") {
      Usage(std::cout);
      std::exit(0);
    } else {
      return Status::InvalidArgument(StrCat("unknown option '", a, "'"));
    }
    ZT_RETURN_IF_ERROR(s);
  }
  ZT_RETURN_IF_ERROR(gpt::ValidateConfig(f.model));
  if (f.params == "nvme" && f.optimizer != "nvme") {
    return Status::InvalidArgument("--params nvme needs --optimizer nvme");
  }
  return f;
}

// ------------------------------------------------------------------ data --

// The text, as bytes. The default corpus is every fortunes data file.
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
  std::string text;
  for (const fs::path& p : files) {
    std::ifstream in(p, std::ios::binary);
    if (!in) return Status::NotFound(StrCat("cannot read '", p.string(), "'"));
    std::ostringstream ss;
    ss << in.rdbuf();
    text += ss.str();
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
std::vector<int32_t> Batch(const std::string& text, const Flags& f, int64_t step, int micro,
                           int rank) {
  const int t = f.model.context;
  const uint64_t span = text.size() - static_cast<uint64_t>(t) - 1;
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(f.batch) * (t + 1));
  uint64_t state = Mix(f.seed ^ Mix(static_cast<uint64_t>(step) * 1000003u + micro * 7919u + rank));
  for (int b = 0; b < f.batch; ++b) {
    state = Mix(state);
    const uint64_t start = state % span;
    for (int i = 0; i <= t; ++i) tokens.push_back(static_cast<unsigned char>(text[start + i]));
  }
  return tokens;
}

// -------------------------------------------------------------- progress --

std::string Gb(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / 1e9);
  return buf;
}

// The progress line on stderr (a bar on a terminal, a line per step
// otherwise), and <out>/train_log.tsv: one row per step, appended on resume.
class Progress {
 public:
  Progress(int first, int last, bool bar, const std::string& log_path)
      : first_(first), last_(last), bar_(bar && isatty(2)) {
    const bool fresh = first == 0 || !fs::exists(log_path);
    log_ = std::fopen(log_path.c_str(), fresh ? "w" : "a");
    if (log_ != nullptr && fresh) {
      std::fprintf(log_,
                   "step\tloss\ttokens_per_s\thost_device_bytes\tnvme_read_bytes\t"
                   "nvme_write_bytes\n");
    }
  }
  ~Progress() {
    if (log_ != nullptr) std::fclose(log_);
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Update(int step, double loss, double tokens_per_s, const RunnerStats& runner,
              const engine::JobCounters& engine) {
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
    if (log_ != nullptr) {
      std::fprintf(
          log_, "%d\t%.6f\t%.1f\t%llu\t%llu\t%llu\n", step, loss, tokens_per_s,
          static_cast<unsigned long long>(runner.h2d_bytes + runner.d2h_bytes),
          static_cast<unsigned long long>(engine.nvme_read_bytes + engine.nvme_param_read_bytes),
          static_cast<unsigned long long>(engine.nvme_write_bytes));
      std::fflush(log_);
    }
    if (bar_) {
      std::fprintf(stderr, "\r%s\x1b[K", line.c_str());
      if (step == last_) std::fprintf(stderr, "\n");
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }

 private:
  int first_, last_;
  bool bar_;
  std::FILE* log_ = nullptr;
};

// ------------------------------------------------------------------- run --

Result<engine::Settings> EngineSettings(const Flags& f, uint64_t params) {
  engine::Settings s;
  if (!f.config.empty()) {
    ZT_ASSIGN_OR_RETURN(s, engine::LoadSettings(f.config));
  }
  ZT_ASSIGN_OR_RETURN(s, engine::ApplyEnvironment(s, ::environ));
  if (f.optimizer == "nvme" && s.nvme_paths.empty()) {
    std::string dirs = f.swap_dir.empty() ? (fs::path(f.out) / "swap").string() : f.swap_dir;
    std::stringstream ss(dirs);
    for (std::string d; std::getline(ss, d, ',');) {
      if (!d.empty()) s.nvme_paths.push_back(d);
    }
    // fp32 master, m, v and two bf16 param copies, with room to spare.
    const uint64_t need = params * 16 / s.nvme_paths.size();
    s.nvme_capacity_per_path = std::max<uint64_t>(uint64_t{64} << 20, 2 * need);
  }
  return s;
}

int Run(const Flags& f) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "\nztier-train: %s\n", s.ToString().c_str());
    return 1;
  };
  Result<std::string> text = LoadText(f.data);
  if (!text.ok()) return fail(text.status());
  if (text->size() < static_cast<size_t>(f.model.context) + 2) {
    return fail(Status::InvalidArgument(
        StrCat("the text has ", text->size(), " bytes, fewer than the context + 2")));
  }
  const uint64_t params = gpt::ParameterCount(f.model);
  Result<engine::Settings> settings = EngineSettings(f, params);
  if (!settings.ok()) return fail(settings.status());
  std::error_code ec;
  fs::create_directories(f.out, ec);
  for (const std::string& p : settings->nvme_paths) fs::create_directories(p, ec);

  Result<std::unique_ptr<Session>> session =
      Session::Open({.settings = *settings, .daemon_socket = "", .io_backend = nullptr});
  if (!session.ok()) return fail(session.status());
  engine::OptimizerConfig opt;
  opt.hyper.lr = f.lr;
  opt.hyper.weight_decay = f.weight_decay;
  opt.clip_norm = f.clip;
  opt.grad_accumulation = f.accumulation;
  Result<std::unique_ptr<Model>> model = (*session)->RegisterModel(
      {.name = "gpt",
       .units = gpt::UnitSpecs(f.model),
       .optimizer = opt,
       .optimizer_tier = f.optimizer == "nvme" ? engine::Tier::kNvme : engine::Tier::kDram,
       .param_tier = f.params == "nvme" ? engine::Tier::kNvme : engine::Tier::kDram,
       .world_size = f.ranks});
  if (!model.ok()) return fail(model.status());
  Model& m = **model;
  const std::string ckpt = (fs::path(f.out) / "checkpoint").string();
  int64_t first = 0;
  if (f.resume) {
    Status s = m.LoadCheckpoint(ckpt);
    if (!s.ok()) return fail(s.Annotate("--resume"));
    first = m.published_step();
  } else {
    for (int k = 0; k < m.units(); ++k) {
      std::vector<float> w(m.layout(k).numel);
      gpt::InitUnit(f.model, k, f.seed, m.layout(k), w);
      Status s = m.SetWeights(k, w.data(), w.size());
      if (!s.ok()) return fail(s);
    }
  }
  std::fprintf(stderr,
               "ztier-train: %.2fM params (%d layers, %d channels, %d heads, context %d), %zu "
               "bytes of text, %d rank(s) on %s, optimizer states in %s, params in %s, %s engine\n",
               params / 1e6, f.model.layers, f.model.channels, f.model.heads, f.model.context,
               text->size(), f.ranks, f.device.c_str(), f.optimizer.c_str(), f.params.c_str(),
               (*session)->transport_name().c_str());
  if (first >= f.steps) {
    std::fprintf(stderr, "ztier-train: the checkpoint is at step %lld already\n",
                 static_cast<long long>(first));
    return 0;
  }
  if (f.resume) std::fprintf(stderr, "ztier-train: resumed at step %lld\n", (long long)first);

  std::vector<std::unique_ptr<Collectives>> coll;
  if (f.ranks > 1) {
    Result<std::vector<std::unique_ptr<Collectives>>> c =
        f.device == "cuda" ? [&] {
          std::vector<int> ordinals;
          for (int r = 0; r < f.ranks; ++r) ordinals.push_back(r);
          return MakeNcclCollectives(ordinals);
        }()
                           : MakeLocalCollectives(f.ranks);
    if (!c.ok()) return fail(c.status());
    coll = *std::move(c);
  }

  // Per step: ranks train, then rank 0 reports (and checkpoints) while the
  // others wait at the barrier, so a checkpoint sees no grads pending.
  std::barrier sync(f.ranks);
  std::mutex mu;
  std::vector<double> step_loss(f.ranks, 0.0);
  std::vector<RunnerStats> stats(f.ranks);
  std::vector<Status> status(f.ranks);
  Progress progress(static_cast<int>(first), f.steps, f.progress,
                    (fs::path(f.out) / "train_log.tsv").string());
  const double tokens_per_step =
      static_cast<double>(f.batch) * f.model.context * f.ranks * f.accumulation;
  auto rank_main = [&](int r) -> Status {
    Result<std::unique_ptr<Device>> dev = f.device == "cuda" ? MakeCudaDevice(r) : MakeHostDevice();
    if (!dev.ok()) return dev.status();
    std::vector<engine::UnitLayout> layouts;
    for (int k = 0; k < m.units(); ++k) layouts.push_back(m.layout(k));
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<gpt::Gpt> net,
                        gpt::Gpt::Create(f.model, f.batch, **dev, layouts));
    client::RunnerOptions options = client::RunnerOptionsFrom((*session)->settings());
    if (f.prefetch >= 0) options.prefetch_depth = f.prefetch;
    if (f.max_live_bytes >= 0) options.max_live_bytes = static_cast<uint64_t>(f.max_live_bytes);
    if (f.persistence_threshold >= 0) {
      options.persistence_threshold = static_cast<uint64_t>(f.persistence_threshold);
    }
    ZT_ASSIGN_OR_RETURN(
        std::unique_ptr<Stage3Runner> runner,
        Stage3Runner::Create(m, r, **dev, f.ranks > 1 ? coll[r].get() : nullptr, options));
    gpt::SourceOf<Stage3Runner> source(*runner);
    const float scale = 1.0f / static_cast<float>(f.ranks * f.accumulation);
    Clock::time_point t0 = Clock::now();
    for (int64_t step = first; step < f.steps; ++step) {
      double loss = 0;
      for (int micro = 0; micro < f.accumulation; ++micro) {
        const std::vector<int32_t> tokens = Batch(*text, f, step, micro, r);
        ZT_ASSIGN_OR_RETURN(float l, net->TrainMicroStep(source, tokens.data(), scale));
        loss += l / f.accumulation;
        ZT_RETURN_IF_ERROR(runner->Step());
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        step_loss[r] = loss;
        stats[r] = runner->stats();
      }
      sync.arrive_and_wait();
      if (r == 0) {
        const int64_t done = step + 1;
        double mean = 0;
        RunnerStats total;
        for (int k = 0; k < f.ranks; ++k) {
          mean += step_loss[k] / f.ranks;
          total.h2d_bytes += stats[k].h2d_bytes;
          total.d2h_bytes += stats[k].d2h_bytes;
        }
        const bool checkpoint =
            done == f.steps || (f.checkpoint_every > 0 && done % f.checkpoint_every == 0);
        if (checkpoint) {
          ZT_RETURN_IF_ERROR(m.WaitPublished(done, std::chrono::hours(1)));
        }
        const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        progress.Update(static_cast<int>(done), mean, tokens_per_step / std::max(secs, 1e-9), total,
                        m.counters());
        if (checkpoint) {
          ZT_RETURN_IF_ERROR(m.SaveCheckpoint(ckpt));
          if (f.exit_after > 0 && done == f.exit_after) {
            std::fprintf(stderr, "ztier-train: exiting abruptly after step %lld (--exit-after)\n",
                         static_cast<long long>(done));
            std::_Exit(3);
          }
        }
        t0 = Clock::now();
      }
      sync.arrive_and_wait();
    }
    return Status::Ok();
  };
  const Clock::time_point run_start = Clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < f.ranks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = rank_main(r);
      if (!status[r].ok()) {
        std::fprintf(stderr, "\nztier-train: rank %d: %s\n", r, status[r].ToString().c_str());
        std::_Exit(1);  // the other ranks would wait for this one forever
      }
    });
  }
  for (auto& t : threads) t.join();

  const std::string exported = (fs::path(f.out) / "model.safetensors").string();
  Status s = m.ExportSafetensors(exported, engine::Engine::ExportType::kBFloat16);
  if (!s.ok()) return fail(s);
  const engine::JobCounters c = m.counters();
  const double run_s = std::chrono::duration<double>(Clock::now() - run_start).count();
  std::fprintf(
      stderr,
      "ztier-train: done: %lld steps (%lld skipped) in %.1f s; the engine's optimizer ran "
      "%.2f s beside the compute, rank 0 waited %.2f s for params and %.2f s for its grads "
      "to land; checkpoint %s, weights %s\n",
      static_cast<long long>(c.steps), static_cast<long long>(c.skipped_steps), run_s,
      c.optimizer_seconds, stats[0].acquire_wait_seconds, stats[0].step_wait_seconds, ckpt.c_str(),
      exported.c_str());
  return 0;
}

}  // namespace
}  // namespace ztier::train

int main(int argc, char** argv) {
  ztier::Result<ztier::train::Flags> flags = ztier::train::ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "ztier-train: %s\n\n", flags.status().ToString().c_str());
    ztier::train::Usage(std::cerr);
    return 2;
  }
  return ztier::train::Run(*flags);
}
