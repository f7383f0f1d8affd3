// ztier-bench step: the engine's optimizer step on a synthetic job, states
// on NVMe (default) or in DRAM, against the two limits a step cannot beat,
// both measured in the same run:
//   io alone       the same reads and write-backs through the same ring with
//                  no compute (Engine::RoundTripStates);
//   compute alone  cpu_adam::Step on every unit's size from DRAM buffers,
//                  with the engine's thread count.
// Overlap efficiency = max(io alone, compute alone) / step: 1.0 means the
// pipeline hides the smaller of the two entirely. --state-dtype int8 keeps
// m and v 8-bit (the compute alone is then cpu_adam::StepInt8); both runs
// fp32 then int8 on the same drives and reports the ratio of their steps
// and the NVMe bytes each step moved.
//
// The step is timed from the moment the last unit's grads are handed over
// (the other units' grads are in, as at the end of a backward pass) until
// the last unit is published. Peak RSS is reported against the pinned pool
// the job holds, to show that states larger than RAM stream through a
// bounded ring.
//
// Single-threaded driver; the engine runs its own threads.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/subcommands.h"
#include "cpu_adam/adamw.h"
#include "engine/engine.h"

namespace ztier::bench {
namespace {

namespace fs = std::filesystem;
using engine::Tier;

struct StepBenchOptions {
  uint64_t params = 0;  // 0: 1G on NVMe, 256M in DRAM
  uint64_t unit_params = uint64_t{32} << 20;
  Tier tier = Tier::kNvme;
  Tier param_tier = Tier::kDram;
  std::vector<std::string> paths;
  int steps = 3;
  int threads = 0;
  uint32_t buffer_count = 4;
  uint64_t stripe = uint64_t{1} << 20;
  uint32_t qd = 16;
  bool checksums = true;
  bool json = false;
  std::vector<engine::StateDtype> dtypes = {engine::StateDtype::kFp32};
};

constexpr const char* kUsage = R"(usage: ztier-bench step [options]

The engine's optimizer step on a synthetic job (one fp32 tensor per unit,
bf16 grads, AdamW, clipping on), with states on NVMe or in DRAM. Reports per
step the step time, I/O alone and compute alone (measured in the same run)
and the overlap efficiency max(io alone, compute alone) / step; and the peak
RSS against the pinned pool.

  --params N        parameters (default 1G with --tier nvme, 256M with dram)
  --unit-params N   parameters per unit (default 32M)
  --tier T          nvme or dram: where the optimizer states live (default nvme)
  --param-tier T    nvme or dram: where the bf16 params live (default dram;
                    nvme needs --tier nvme)
  --path DIR        a swap directory, one per drive; repeat for several
                    (default: ./ztier-bench-swap)
  --steps N         timed steps, after one untimed warm-up step (default 3)
  --threads N       optimizer threads (default 0: all cores)
  --buffer-count N  slots of the staging ring (default 4)
  --stripe N        stripe unit (default 1M)
  --qd N            queue depth per path (default 16)
  --no-checksums    turn off per-stripe CRC-32C
  --state-dtype D   fp32, int8 (8-bit m and v) or both (fp32 then int8, and
                    the ratio of their step times) (default fp32)
  --json            print one JSON object as the last line
)";

// The value of --tier or --param-tier.
Result<Tier> TierValue(ArgReader& args) {
  return args.Choice<Tier>({{"nvme", Tier::kNvme}, {"dram", Tier::kDram}});
}

Status ParseArgs(int argc, char** argv, StepBenchOptions* o) {
  ArgReader args(argc, argv);
  while (args.Next()) {
    if (args.Is("--params")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->params, 1, uint64_t{1} << 40));
    } else if (args.Is("--unit-params")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->unit_params, 1024, uint64_t{1} << 32));
    } else if (args.Is("--tier")) {
      ZT_ASSIGN_OR_RETURN(o->tier, TierValue(args));
    } else if (args.Is("--param-tier")) {
      ZT_ASSIGN_OR_RETURN(o->param_tier, TierValue(args));
    } else if (args.Is("--path")) {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      o->paths.emplace_back(v);
    } else if (args.Is("--steps")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->steps, 1, 1000));
    } else if (args.Is("--threads")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->threads, 0, 4096));
    } else if (args.Is("--buffer-count")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->buffer_count, 3, 1024));
    } else if (args.Is("--stripe")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->stripe, 4096, uint64_t{1} << 30));
      if (o->stripe % 4096 != 0) return Status::InvalidArgument("--stripe: not a multiple of 4K");
    } else if (args.Is("--qd")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->qd, 1, 4096));
    } else if (args.Is("--no-checksums")) {
      o->checksums = false;
    } else if (args.Is("--state-dtype")) {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      if (v == "fp32") {
        o->dtypes = {engine::StateDtype::kFp32};
      } else if (v == "int8") {
        o->dtypes = {engine::StateDtype::kInt8};
      } else if (v == "both") {
        o->dtypes = {engine::StateDtype::kFp32, engine::StateDtype::kInt8};
      } else {
        return Status::InvalidArgument(StrCat("--state-dtype ", v, ": want fp32, int8 or both"));
      }
    } else if (args.Is("--json")) {
      o->json = true;
    } else {
      return args.Unrecognized();
    }
  }
  if (o->param_tier == Tier::kNvme && o->tier != Tier::kNvme) {
    return Status::InvalidArgument("--param-tier nvme needs --tier nvme");
  }
  if (o->params == 0) o->params = o->tier == Tier::kNvme ? uint64_t{1} << 30 : uint64_t{256} << 20;
  if (o->paths.empty()) o->paths.push_back("ztier-bench-swap");
  return Status::Ok();
}

// Peak and current resident set of this process, from /proc/self/status.
struct Rss {
  uint64_t peak = 0, now = 0;
};
Rss ReadRss() {
  Rss r;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.starts_with("VmHWM:")) r.peak = std::strtoull(line.c_str() + 6, nullptr, 10) << 10;
    if (line.starts_with("VmRSS:")) r.now = std::strtoull(line.c_str() + 6, nullptr, 10) << 10;
  }
  return r;
}

double Gib(uint64_t b) { return static_cast<double>(b) / (1u << 30); }

// Pseudo-random bf16 grads in about [-1, 1) (xorshift; the values only need
// to be finite and varied).
void FillGrads(bf16* g, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    g[i] = FloatToBf16(static_cast<float>(static_cast<int32_t>(x >> 32)) * (1.0f / 2147483648.0f));
  }
}

struct Round {
  double step = 0, io = 0, compute = 0;
  double compute_in_step = 0, io_wait_in_step = 0;
  double efficiency() const { return std::max(io, compute) / step; }
};

// A 64-byte aligned buffer.
struct Buffer {
  void* p;
  explicit Buffer(size_t n) : p(std::aligned_alloc(64, (n + 63) / 64 * 64)) {
    if (p != nullptr) std::memset(p, 0, n);
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// What one run reports to the next (--state-dtype both).
struct RunSummary {
  double step_seconds = 0;
  uint64_t read_bytes_per_step = 0, write_bytes_per_step = 0;
  std::string json;
};

// One job of `dtype` states, timed; 0 or FailExit's code.
int RunOnce(const StepBenchOptions& o, engine::StateDtype dtype, RunSummary* summary) {
  const auto fail = [](const Status& s) { return FailExit(s, "step"); };
  const bool nvme = o.tier == Tier::kNvme;
  const bool int8 = dtype == engine::StateDtype::kInt8;
  const uint64_t units = (o.params + o.unit_params - 1) / o.unit_params;
  // master + m + v: 12 B a param, or 6 B and two fp32 absmax per 256.
  const double state_per_param = int8 ? 6.0 + 8.0 / cpu_adam::kQuantBlock : 12.0;
  const uint64_t state_bytes =
      static_cast<uint64_t>(static_cast<double>(o.params) * state_per_param);
  const uint64_t slot_params =
      static_cast<uint64_t>(static_cast<double>(o.unit_params) * state_per_param);

  engine::Settings settings;
  settings.optimizer_threads = o.threads;
  settings.buffer_count = o.buffer_count;
  settings.state_dtype = dtype;
  // The pool holds the grad inbox and publish buffer (4 B a param), the fp32
  // state too in DRAM (12 B), and the ring (NVMe); plus slack for padding.
  const bool nvme_params = o.param_tier == Tier::kNvme;
  const uint64_t ring_bytes =
      nvme ? uint64_t{o.buffer_count} * (slot_params + (nvme_params ? 4 * o.unit_params : 0)) : 0;
  // The pool reserves 256 MiB regions: allow one region of fragmentation.
  settings.dram_budget_bytes = (nvme_params ? 2 * o.params
                                : nvme      ? 4 * o.params
                                            : 4 * o.params + state_bytes) +
                               ring_bytes + units * (uint64_t{64} << 10) + (uint64_t{320} << 20);
  if (nvme) {
    for (const std::string& p : o.paths) {
      std::error_code ec;
      fs::create_directories(p, ec);
    }
    settings.nvme_paths = o.paths;
    settings.stripe_bytes = o.stripe;
    settings.queue_depth = o.qd;
    settings.checksums = o.checksums;
    const uint64_t per_path =
        (state_bytes + (nvme_params ? o.params * 4 : 0)) / o.paths.size() + units * 4 * o.stripe;
    settings.nvme_capacity_per_path = (per_path + o.stripe - 1) / o.stripe * o.stripe;
    settings.optimizer_tier = Tier::kNvme;
  }
  Result<std::unique_ptr<engine::Engine>> created = engine::Engine::Create(settings);
  if (!created.ok()) return fail(created.status());
  engine::Engine& e = **created;

  engine::JobSpec spec;
  spec.name = "bench";
  spec.optimizer.hyper = {.lr = 1e-4f, .weight_decay = 0.01f};
  spec.optimizer.clip_norm = 1.0f;
  spec.optimizer_tier = o.tier;
  spec.param_tier = o.param_tier;
  for (uint64_t k = 0, left = o.params; k < units; ++k) {
    const uint64_t n = std::min(left, o.unit_params);
    left -= n;
    spec.units.push_back({StrCat("unit", k), {{StrCat("w", k), {static_cast<int64_t>(n)}}}});
  }
  Result<int> job = e.RegisterJob(spec);
  if (!job.ok()) return fail(job.status());
  std::printf(
      "ztier-bench step: %s params in %llu units, states %s (%.1f GiB: fp32 master, %s m+v), "
      "params %s%s, %s optimizer threads\n",
      FormatCount(o.params).c_str(), static_cast<unsigned long long>(units),
      nvme ? "on NVMe" : "in DRAM", Gib(state_bytes), int8 ? "int8" : "fp32",
      nvme_params ? "on NVMe" : "in DRAM",
      nvme ? StrCat(", ", o.paths.size(), " path(s), ring ", o.buffer_count, " x ",
                    FormatCount(slot_params), "B")
                 .c_str()
           : "",
      o.threads == 0 ? "all" : StrCat(o.threads).c_str());

  // Grads once; every step hands the same inboxes over again.
  std::vector<engine::UnitLayout> layouts;
  for (uint64_t k = 0; k < units; ++k) {
    Result<engine::UnitLayout> l = e.Layout(*job, static_cast<int>(k));
    Result<bf16*> inbox = e.GradInbox(*job, static_cast<int>(k), 0);
    if (!l.ok() || !inbox.ok()) return fail(l.ok() ? inbox.status() : l.status());
    FillGrads(*inbox, l->padded, k + 1);
    layouts.push_back(*l);
  }
  int64_t step = 0;
  // One step: units' grads handed over backward; timed from the last one.
  auto run_step = [&](double* seconds) -> Status {
    ++step;
    for (uint64_t k = units; k-- > 1;)
      ZT_RETURN_IF_ERROR(e.GradsReady(*job, static_cast<int>(k), 0));
    const double t0 = NowSeconds();
    ZT_RETURN_IF_ERROR(e.GradsReady(*job, 0, 0));
    ZT_RETURN_IF_ERROR(e.WaitPublished(*job, static_cast<int>(units - 1), step));
    *seconds = NowSeconds() - t0;
    return Status::Ok();
  };

  // Compute alone: the same kernel calls on DRAM buffers of the largest unit.
  Result<cpu_adam::Executor> exec = cpu_adam::Executor::Create({.threads = o.threads});
  if (!exec.ok()) return fail(exec.status());
  const uint64_t max_padded = layouts.front().padded;
  Buffer p(max_padded * 4), m(max_padded * 4), v(max_padded * 4), g(max_padded * 2),
      out(max_padded * 2);
  if (!p.p || !m.p || !v.p || !g.p || !out.p) return fail(Status::ResourceExhausted("scratch"));
  FillGrads(static_cast<bf16*>(g.p), max_padded, 99);
  auto compute_alone = [&](double* seconds) -> Status {
    const double t0 = NowSeconds();
    for (const engine::UnitLayout& l : layouts) {
      const cpu_adam::StepOptions options{
          .step = step + 1, .grad_scale = 0.5f, .grad_check = cpu_adam::GradCheck::kPrechecked};
      if (int8) {  // codes in m's buffer, absmax in v's
        auto* codes = static_cast<uint8_t*>(m.p);
        auto* absmax = static_cast<float*>(v.p);
        const cpu_adam::Int8Shard shard8{
            .count = l.padded,
            .grads = g.p,
            .grad_type = cpu_adam::GradType::kBFloat16,
            .params = static_cast<float*>(p.p),
            .moments = {.m = codes,
                        .v = codes + l.padded,
                        .m_absmax = absmax,
                        .v_absmax = absmax + cpu_adam::QuantBlocks(l.padded)},
            .params_out = static_cast<bf16*>(out.p)};
        ZT_RETURN_IF_ERROR(
            cpu_adam::StepInt8(spec.optimizer.hyper, options, shard8, {}, *exec).status());
        continue;
      }
      const cpu_adam::Shard shard{.count = l.padded,
                                  .grads = g.p,
                                  .grad_type = cpu_adam::GradType::kBFloat16,
                                  .params = static_cast<float*>(p.p),
                                  .exp_avg = static_cast<float*>(m.p),
                                  .exp_avg_sq = static_cast<float*>(v.p),
                                  .params_out = static_cast<bf16*>(out.p)};
      ZT_RETURN_IF_ERROR(cpu_adam::Step(spec.optimizer.hyper, options, shard, *exec).status());
    }
    *seconds = NowSeconds() - t0;
    return Status::Ok();
  };

  // Warm-up: the first step writes every state (reads of never-written
  // states cost no I/O) and faults in the scratch buffers.
  double warm = 0, warm_compute = 0;
  if (Status s = run_step(&warm); !s.ok()) return fail(s);
  if (Status s = compute_alone(&warm_compute); !s.ok()) return fail(s);
  std::printf("warm-up step %.2f s\n", warm);
  std::printf("%5s %9s %9s %9s %11s %11s %10s\n", "step", "step s", "io s", "compute s",
              "compute in", "io wait in", "efficiency");

  std::vector<Round> rounds;
  uint64_t step_read = 0, step_written = 0;  // NVMe bytes in the timed steps
  for (int r = 0; r < o.steps; ++r) {
    Round round;
    if (nvme) {
      const double t0 = NowSeconds();
      if (Status s = e.RoundTripStates(*job); !s.ok()) return fail(s);
      round.io = NowSeconds() - t0;
    }
    if (Status s = compute_alone(&round.compute); !s.ok()) return fail(s);
    const engine::JobCounters before = e.counters(*job);
    if (Status s = run_step(&round.step); !s.ok()) return fail(s);
    const engine::JobCounters after = e.counters(*job);
    round.compute_in_step = after.compute_seconds - before.compute_seconds;
    round.io_wait_in_step = after.io_wait_seconds - before.io_wait_seconds;
    step_read += after.nvme_read_bytes - before.nvme_read_bytes;
    step_written += after.nvme_write_bytes - before.nvme_write_bytes;
    std::printf("%5lld %9.3f %9.3f %9.3f %11.3f %11.3f %10.3f\n", static_cast<long long>(step),
                round.step, round.io, round.compute, round.compute_in_step, round.io_wait_in_step,
                round.efficiency());
    rounds.push_back(round);
  }
  double mean_eff = 0, mean_step = 0, mean_io = 0, mean_compute = 0;
  for (const Round& r : rounds) {
    mean_eff += r.efficiency() / rounds.size();
    mean_step += r.step / rounds.size();
    mean_io += r.io / rounds.size();
    mean_compute += r.compute / rounds.size();
  }
  const engine::JobCounters c = e.counters(*job);
  const Rss rss = ReadRss();
  const uint64_t scratch = max_padded * 16;
  std::printf("mean: step %.3f s, io alone %.3f s, compute alone %.3f s, overlap efficiency %.3f\n",
              mean_step, mean_io, mean_compute, mean_eff);
  const uint64_t read_per_step = step_read / rounds.size();
  const uint64_t written_per_step = step_written / rounds.size();
  if (nvme) {
    const double moved = static_cast<double>(read_per_step + written_per_step);
    std::printf(
        "traffic per step: %.2f GiB read + %.2f GiB written; %.2f GB/s in the step, "
        "%.2f GB/s alone\n",
        Gib(read_per_step), Gib(written_per_step), moved / mean_step / 1e9, moved / mean_io / 1e9);
  }
  std::printf(
      "%.1f Mparams/s; peak RSS %.2f GiB = pinned pool %.2f GiB (ring %.2f GiB) + "
      "compute-alone scratch %.2f GiB + %.2f GiB other; state %.2f GiB\n",
      o.params / mean_step / 1e6, Gib(rss.peak), Gib(c.dram_bytes), Gib(ring_bytes), Gib(scratch),
      Gib(rss.peak > c.dram_bytes + scratch ? rss.peak - c.dram_bytes - scratch : 0),
      Gib(state_bytes));

  summary->step_seconds = mean_step;
  summary->read_bytes_per_step = read_per_step;
  summary->write_bytes_per_step = written_per_step;
  {
    std::vector<std::string> per_step, paths;
    for (const Round& r : rounds) {
      JsonObject j;
      j.Add("step_seconds", r.step)
          .Add("io_alone_seconds", r.io)
          .Add("compute_alone_seconds", r.compute)
          .Add("compute_in_step_seconds", r.compute_in_step)
          .Add("io_wait_in_step_seconds", r.io_wait_in_step)
          .Add("overlap_efficiency", r.efficiency());
      per_step.push_back(j.str());
    }
    for (const std::string& dir : o.paths) paths.push_back(JsonQuote(dir));
    JsonObject j;
    j.Add("bench", "step")
        .Add("tier", nvme ? "nvme" : "dram")
        .Add("param_tier", nvme_params ? "nvme" : "dram")
        .Add("state_dtype", int8 ? "int8" : "fp32")
        .Add("params", o.params)
        .Add("units", units)
        .Add("state_bytes", state_bytes)
        .Add("buffer_count", static_cast<int>(o.buffer_count))
        .AddRaw("paths", nvme ? JsonArray(paths) : "[]")
        .Add("threads", o.threads)
        .Add("checksums", o.checksums)
        .Add("overlap_efficiency", mean_eff)
        .Add("step_seconds", mean_step)
        .Add("io_alone_seconds", mean_io)
        .Add("compute_alone_seconds", mean_compute)
        .Add("params_per_second", o.params / mean_step)
        .Add("peak_rss_bytes", rss.peak)
        .Add("pinned_pool_bytes", c.dram_bytes)
        .Add("ring_bytes", ring_bytes)
        .Add("scratch_bytes", scratch)
        .Add("nvme_read_bytes", c.nvme_read_bytes)
        .Add("nvme_write_bytes", c.nvme_write_bytes)
        .Add("nvme_read_bytes_per_step", read_per_step)
        .Add("nvme_write_bytes_per_step", written_per_step)
        .AddRaw("steps", JsonArray(per_step));
    summary->json = j.str();
  }
  Status s = e.UnregisterJob(*job);
  created->reset();
  if (nvme) {
    for (const std::string& path : o.paths) fs::remove(fs::path(path) / "ztier.swap");
  }
  return s.ok() ? 0 : fail(s);
}

}  // namespace

int RunStep(int argc, char** argv) {
  StepBenchOptions o;
  if (Status s = ParseArgs(argc, argv, &o); !s.ok()) return UsageExit(s, "step", kUsage);
  std::vector<RunSummary> runs(o.dtypes.size());
  for (size_t i = 0; i < o.dtypes.size(); ++i) {
    if (i > 0) std::printf("\n");
    if (int rc = RunOnce(o, o.dtypes[i], &runs[i]); rc != 0) return rc;
  }
  double ratio = 0;
  if (runs.size() == 2) {
    ratio = runs[1].step_seconds / runs[0].step_seconds;
    std::printf(
        "\nint8 / fp32: step %.3f / %.3f s = %.3f; NVMe bytes a step %.2f / %.2f GiB = %.3f\n",
        runs[1].step_seconds, runs[0].step_seconds, ratio,
        Gib(runs[1].read_bytes_per_step + runs[1].write_bytes_per_step),
        Gib(runs[0].read_bytes_per_step + runs[0].write_bytes_per_step),
        static_cast<double>(runs[1].read_bytes_per_step + runs[1].write_bytes_per_step) /
            std::max<double>(1, runs[0].read_bytes_per_step + runs[0].write_bytes_per_step));
  }
  if (o.json) {
    if (runs.size() == 1) {
      std::printf("%s\n", runs[0].json.c_str());
    } else {
      std::vector<std::string> each;
      for (const RunSummary& r : runs) each.push_back(r.json);
      JsonObject j;
      j.Add("bench", "step").Add("int8_over_fp32_step", ratio).AddRaw("runs", JsonArray(each));
      std::printf("%s\n", j.str().c_str());
    }
  }
  return 0;
}

}  // namespace ztier::bench
