// ztier-bench step: the engine's optimizer step on a synthetic job, states
// on NVMe (default) or in DRAM, against the two limits a step cannot beat,
// both measured in the same run:
//   io alone       the same reads and write-backs through the same ring with
//                  no compute (Engine::RoundTripStates);
//   compute alone  the grads' squared norm, then cpu_adam::Step, on every
//                  unit's size from DRAM buffers, with the engine's thread
//                  count.
// Overlap efficiency = max(io alone, compute alone) / step: 1.0 means the
// pipeline hides the smaller of the two entirely. --state-dtype int8 keeps
// m and v 8-bit (the compute alone is then cpu_adam::StepInt8); both runs
// fp32 then int8 on the same drives and reports the ratio of their steps
// and the NVMe bytes each step moved.
//
// The step is timed from the moment the first unit's grads are handed over
// (backward order, as a backward pass hands them) until its last write-back
// is done (the job's step count moves): io alone reads and writes every
// state, so a step must too to be held to it (timed to the last unit's
// publish, its write-backs would fall into the next round's io alone). The
// time to the last publish, when training's next forward could have every
// unit, is reported beside it. Peak RSS is reported against the pinned pool
// and the compute-alone scratch, to show that states larger than RAM stream
// through a bounded ring.
//
// With --json, one more step after the timed ones is traced (not counted in
// the figures above): each unit's read, compute and write-back as spans from
// that step's start, for benchmarks/plot.py's timeline. The reads and writes
// come from an I/O backend that wraps the swap space's and records each op
// (queued, reaped, buffer); an op's buffer is a ring slot, which tells the
// unit (see AttributeIo). The compute spans come from the job's compute
// counter, polled by a thread: each rise is one unit's AdamW call ending.
//
// Single-threaded driver (plus the poller of the traced step); the engine
// runs its own threads.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/subcommands.h"
#include "cpu_adam/adamw.h"
#include "engine/engine.h"
#include "nvme/io_backend.h"

namespace ztier::bench {
namespace {

constexpr char kDefaultSwapDir[] = "ztier-bench-swap";

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
  bool timeline = true;  // with --json: one more step, traced per unit
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
  --path DIR        an existing swap directory, one per drive; repeat for
                    several (default: ./ztier-bench-swap, created)
  --steps N         timed steps, after one untimed warm-up step (default 3)
  --threads N       optimizer threads (default 0: all cores)
  --buffer-count N  slots of the staging ring (default 4)
  --stripe N        stripe unit (default 1M)
  --qd N            queue depth per path (default 16)
  --no-checksums    turn off per-stripe CRC-32C
  --state-dtype D   fp32, int8 (8-bit m and v) or both (fp32 then int8, and
                    the ratio of their step times) (default fp32)
  --json            print one JSON object as the last line; it holds the
                    per-unit spans of one more, traced, step ("timeline")
  --no-timeline     with --json: no traced step
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
      ZT_RETURN_IF_ERROR(args.SizeInto(&o->stripe, 4096, uint64_t{1} << 30));
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
    } else if (args.Is("--no-timeline")) {
      o->timeline = false;
    } else {
      return args.Unrecognized();
    }
  }
  if (o->param_tier == Tier::kNvme && o->tier != Tier::kNvme) {
    return Status::InvalidArgument("--param-tier nvme needs --tier nvme");
  }
  if (o->params == 0) o->params = o->tier == Tier::kNvme ? uint64_t{1} << 30 : uint64_t{256} << 20;
  if (o->paths.empty()) o->paths.push_back(kDefaultSwapDir);
  return Status::Ok();
}

// Peak and current resident set of this process, from /proc/self/status.
struct Rss {
  uint64_t peak = 0, now = 0;
};
// Starts the peak over (the kernel's VmHWM, reset through clear_refs), so
// that each run's peak is its own, not the process's so far. False where
// the kernel does not allow it.
bool ResetPeakRss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

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
// "96", "48.3": MiB, one decimal where it is not whole.
std::string Mib(uint64_t b) {
  char buf[32];
  const double m = static_cast<double>(b) / (1u << 20);
  std::snprintf(buf, sizeof(buf), b % (1u << 20) == 0 ? "%.0f" : "%.1f", m);
  return buf;
}

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
  double step = 0, published = 0, io = 0, compute = 0;
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

// ---------------------------------------------------- the traced step --

// Passes every call to another backend and, while on, records each read and
// write op: when the swap space queued it (Prepare) and when its completion
// was reaped, with its buffer and length. A queue is driven by one thread at
// a time (IoQueue's contract); the record is shared under a mutex.
class TracingBackend final : public nvme::IoBackend {
 public:
  struct Op {
    nvme::IoKind kind;
    uintptr_t buf;
    uint64_t len;
    double queued, done;  // NowSeconds(); done 0 until reaped
  };

  explicit TracingBackend(std::shared_ptr<nvme::IoBackend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  int OpenFile(const std::string& path, int flags, int mode) override {
    return inner_->OpenFile(path, flags, mode);
  }
  int Preallocate(int fd, uint64_t offset, uint64_t bytes) override {
    return inner_->Preallocate(fd, offset, bytes);
  }
  Result<std::unique_ptr<nvme::IoQueue>> OpenQueue(int fd, const std::string& path, uint32_t depth,
                                                   std::span<const iovec> fixed) override {
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoQueue> q,
                        inner_->OpenQueue(fd, path, depth, fixed));
    return std::unique_ptr<nvme::IoQueue>(new Queue(this, std::move(q)));
  }

  void Start() {
    std::lock_guard<std::mutex> lock(mu_);
    ops_.clear();
    ++generation_;
    on_.store(true, std::memory_order_release);
  }
  std::vector<Op> Stop() {
    on_.store(false, std::memory_order_release);
    std::lock_guard<std::mutex> lock(mu_);
    ++generation_;  // completions of ops still in flight are dropped
    std::vector<Op> ops = std::move(ops_);
    ops_.clear();
    return ops;
  }

 private:
  class Queue final : public nvme::IoQueue {
   public:
    Queue(TracingBackend* owner, std::unique_ptr<nvme::IoQueue> inner)
        : owner_(owner), inner_(std::move(inner)) {}
    bool Prepare(const nvme::IoOp& op) override {
      if (!inner_->Prepare(op)) return false;
      if (op.kind != nvme::IoKind::kFsync && owner_->on_.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(owner_->mu_);
        if (!owner_->on_.load(std::memory_order_relaxed)) return true;  // Stop() came between
        pending_[op.user_data] = {owner_->generation_, owner_->ops_.size()};
        owner_->ops_.push_back(
            {op.kind, reinterpret_cast<uintptr_t>(op.buf), op.len, NowSeconds(), 0.0});
      }
      return true;
    }
    Status Submit(unsigned wait_for) override { return inner_->Submit(wait_for); }
    size_t Unsubmitted() const override { return inner_->Unsubmitted(); }
    size_t Reap(nvme::IoCompletion* out, size_t max) override {
      const size_t n = inner_->Reap(out, max);
      if (n == 0 || pending_.empty()) return n;
      const double now = NowSeconds();
      std::lock_guard<std::mutex> lock(owner_->mu_);
      for (size_t i = 0; i < n; ++i) {
        const auto it = pending_.find(out[i].user_data);
        if (it == pending_.end()) continue;
        if (it->second.generation == owner_->generation_) owner_->ops_[it->second.index].done = now;
        pending_.erase(it);
      }
      return n;
    }

   private:
    struct Pending {
      uint64_t generation;
      size_t index;
    };
    TracingBackend* owner_;
    std::unique_ptr<nvme::IoQueue> inner_;
    std::unordered_map<uint64_t, Pending> pending_;  // by user_data
  };

  std::shared_ptr<nvme::IoBackend> inner_;
  std::atomic<bool> on_{false};
  std::mutex mu_;
  uint64_t generation_ = 0;  // under mu_
  std::vector<Op> ops_;      // under mu_
};

// One unit's spans in the traced step, seconds from its start.
struct UnitSpans {
  std::optional<double> read_start, read_end, compute_start, compute_end, write_start, write_end;
  uint64_t read_bytes = 0, write_bytes = 0;
};

// Attributes the traced ops to units. Unit i of the step goes to ring slot
// i % slots, a slot is read into only after its last write-back is done,
// and its unit is written back from it after the update
// (engine/state_store.cc); a unit's state is read from and written to its
// slot from the slot's start. So the ops whose buffers lie in
// [base, base + slot_bytes) form one slot; the slots ranked by their first
// read are slots 0, 1, ...; and slot r's ops in time order are read, write,
// read, write ... of units r, r + slots, ... An empty string when every unit
// got one read and one write, else what did not fit.
std::string AttributeIo(std::vector<TracingBackend::Op> ops, uint64_t slot_bytes, double t0,
                        std::vector<UnitSpans>* units) {
  if (ops.empty()) return "no I/O was traced";
  std::sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.buf < b.buf; });
  std::vector<std::vector<TracingBackend::Op>> slots;
  uintptr_t base = 0;
  for (const TracingBackend::Op& op : ops) {
    if (slots.empty() || op.buf >= base + slot_bytes) {
      slots.emplace_back();
      base = op.buf;
    }
    slots.back().push_back(op);
  }
  struct Burst {
    nvme::IoKind kind;
    double start, end;
    uint64_t bytes;
  };
  std::vector<std::vector<Burst>> bursts(slots.size());
  for (size_t s = 0; s < slots.size(); ++s) {
    std::sort(slots[s].begin(), slots[s].end(),
              [](const auto& a, const auto& b) { return a.queued < b.queued; });
    for (const TracingBackend::Op& op : slots[s]) {
      const double done = op.done > 0 ? op.done : op.queued;
      if (bursts[s].empty() || bursts[s].back().kind != op.kind) {
        bursts[s].push_back({op.kind, op.queued, done, 0});
      }
      Burst& b = bursts[s].back();
      b.end = std::max(b.end, done);
      b.bytes += op.len;
    }
  }
  std::vector<size_t> rank(slots.size());
  for (size_t s = 0; s < rank.size(); ++s) rank[s] = s;
  std::sort(rank.begin(), rank.end(),
            [&](size_t a, size_t b) { return bursts[a].front().start < bursts[b].front().start; });
  const size_t count = slots.size();
  for (size_t r = 0; r < count; ++r) {
    const std::vector<Burst>& seq = bursts[rank[r]];
    for (size_t n = 0; n < seq.size(); ++n) {
      const bool read = n % 2 == 0;
      if (seq[n].kind != (read ? nvme::IoKind::kRead : nvme::IoKind::kWrite)) {
        return StrCat("ring slot ", r, ": its I/O does not alternate read, write-back");
      }
      const size_t unit = r + (n / 2) * count;
      if (unit >= units->size()) return StrCat("ring slot ", r, ": more I/O than units");
      UnitSpans& u = (*units)[unit];
      (read ? u.read_start : u.write_start) = seq[n].start - t0;
      (read ? u.read_end : u.write_end) = seq[n].end - t0;
      (read ? u.read_bytes : u.write_bytes) = seq[n].bytes;
    }
  }
  for (size_t k = 0; k < units->size(); ++k) {
    if (!(*units)[k].read_start || !(*units)[k].write_start) {
      return StrCat("unit ", k, " has no read or no write-back");
    }
  }
  return "";
}

// The bytes of unit state (and bf16 params with them) a ring slot holds, as
// the engine lays a slot out: master, m and v (8-bit codes and absmax with
// int8, a group's per block and per tensor off the block grid), rounded up
// to 4 KiB; the params after them, rounded likewise.
uint64_t SlotBytes(const engine::UnitLayout& l, bool int8, bool nvme_params) {
  const auto round_up = [](uint64_t x) { return (x + 4095) / 4096 * 4096; };
  const uint64_t padded = l.padded;
  const uint64_t moments =
      int8 ? 2 * padded + 8 * cpu_adam::QuantGroups(padded, cpu_adam::QuantCuts(l.offsets, padded))
           : 8 * padded;
  return round_up(4 * padded + moments) + (nvme_params ? round_up(2 * padded) : 0);
}

// Waits until `job` has taken `steps` steps, its write-backs done, or 10
// minutes (Unavailable).
Status WaitSteps(engine::Engine& e, int job, int64_t steps) {
  const double t0 = NowSeconds();
  while (e.counters(job).steps < steps) {
    if (NowSeconds() - t0 > 600) return Status::Unavailable("a step's write-backs hang");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return Status::Ok();
}

// The traced step's "timeline" JSON. `run_step` runs one step and reports
// its start (the first grads handed over), the time to the last unit's
// publish and the time to its last write-back. `tracer` is null with
// states in DRAM.
Result<std::string> TraceStep(engine::Engine& e, int job,
                              const std::vector<engine::UnitLayout>& layouts, int64_t step,
                              TracingBackend* tracer, uint64_t slot_bytes,
                              const std::function<Status(double*, double*, double*)>& run_step) {
  constexpr auto kPoll = std::chrono::microseconds(100);
  // The step before may have units still being written back: not this step's.
  ZT_RETURN_IF_ERROR(WaitSteps(e, job, step - 1));
  std::vector<std::pair<double, double>> rises;  // (when seen, compute seconds added)
  std::atomic<bool> stop{false};
  const double compute_before = e.counters(job).compute_seconds;
  std::thread poller([&] {
    double last = compute_before;
    while (!stop.load(std::memory_order_acquire)) {
      const double c = e.counters(job).compute_seconds;
      if (c != last) {
        rises.emplace_back(NowSeconds(), c - last);
        last = c;
      }
      std::this_thread::sleep_for(kPoll);
    }
  });
  if (tracer != nullptr) tracer->Start();
  double t0 = 0, seconds = 0, done = 0;
  Status s = run_step(&t0, &seconds, &done);
  std::vector<TracingBackend::Op> ops;
  if (tracer != nullptr) ops = tracer->Stop();
  std::this_thread::sleep_for(4 * kPoll);  // the poller sees the last rise
  stop.store(true, std::memory_order_release);
  poller.join();
  ZT_RETURN_IF_ERROR(s);

  std::vector<UnitSpans> units(layouts.size());
  std::vector<std::string> notes;
  if (tracer != nullptr) {
    const std::string io = AttributeIo(std::move(ops), slot_bytes, t0, &units);
    if (!io.empty()) {
      notes.push_back(StrCat("I/O not attributed to units: ", io));
      units.assign(layouts.size(), UnitSpans{});
    }
  }
  // One rise per unit, in forward order; a poll that saw several units end
  // cannot tell them apart.
  if (rises.size() == units.size()) {
    for (size_t k = 0; k < units.size(); ++k) {
      units[k].compute_end = rises[k].first - t0;
      units[k].compute_start = rises[k].first - t0 - rises[k].second;
    }
  } else {
    notes.push_back(StrCat("compute: ", rises.size(), " rises of the compute counter seen for ",
                           units.size(), " units (units too small for a ", kPoll.count(),
                           " us poll)"));
  }
  std::vector<std::string> per_unit;
  for (size_t k = 0; k < units.size(); ++k) {
    const UnitSpans& u = units[k];
    JsonObject j;
    j.Add("unit", static_cast<int64_t>(k)).Add("params", layouts[k].padded);
    const auto span = [&](const char* name, const std::optional<double>& v) {
      if (v) j.Add(name, *v);
    };
    span("read_start", u.read_start);
    span("read_end", u.read_end);
    span("compute_start", u.compute_start);
    span("compute_end", u.compute_end);
    span("write_start", u.write_start);
    span("write_end", u.write_end);
    if (u.read_start) j.Add("read_bytes", u.read_bytes).Add("write_bytes", u.write_bytes);
    per_unit.push_back(j.str());
  }
  std::string note;
  for (const std::string& n : notes) note += (note.empty() ? "" : "; ") + n;
  JsonObject j;
  j.Add("step", step)
      .Add("published_seconds", seconds)  // the last unit published
      .Add("write_backs_done_seconds", done)
      .Add("times", "seconds from the step's start (its first grads handed over)")
      .Add("note", note)
      .AddRaw("units", JsonArray(per_unit));
  std::printf("traced step %lld: every unit published at %.3f s, write-backs done at %.3f s%s%s\n",
              static_cast<long long>(step), seconds, done, note.empty() ? "" : ": ", note.c_str());
  return j.str();
}

// What one run reports to the next (--state-dtype both).
struct RunSummary {
  double step_seconds = 0;
  uint64_t read_bytes_per_step = 0, write_bytes_per_step = 0;
  std::string json;
};

// The compute alone's scratch: a ring of slots of the largest unit's
// params (`unit_params`), as many as the units or as make 256 MiB (the step
// touches memory of its own for each unit: one reused slot stayed in the
// cache for small units, and the limit came out faster than memory allows).
constexpr uint64_t kSlotBytesPerParam = 4 + 4 + 4 + 2 + 2;  // p, m, v, g, out
uint64_t ScratchSlots(uint64_t unit_params, uint64_t units) {
  return std::clamp<uint64_t>((uint64_t{256} << 20) / (unit_params * kSlotBytesPerParam), 1, units);
}

// One job of `dtype` states, timed; 0, FailExit's code, or 128 + the
// signal after a stop (asked between steps; the swap files go with the
// engine).
int RunOnce(StopSignals& stops, const StepBenchOptions& o, engine::StateDtype dtype,
            RunSummary* summary) {
  const auto fail = [&stops](const Status& s) {
    const int code = FailExit(s, "step");
    return stops.Stopped() != 0 ? stops.ExitCode() : code;
  };
  const auto stopped = [&stops] {
    return stops.Stopped() != 0 ? stops.Error("the swap files are removed") : Status::Ok();
  };
  // A stop during the run before (--state-dtype both) ends it here.
  if (Status s = stopped(); !s.ok()) return fail(s);
  const bool nvme = o.tier == Tier::kNvme;
  const bool int8 = dtype == engine::StateDtype::kInt8;
  const uint64_t units = (o.params + o.unit_params - 1) / o.unit_params;
  const uint64_t largest_unit = std::min(o.unit_params, o.params);  // the ring's slots hold it
  // This run's peak RSS, not the process's so far (a run before it, of the
  // other state dtype, set it).
  const bool own_peak = ResetPeakRss();
  // master + m + v: 12 B a param, or 6 B and two fp32 absmax per 256.
  const double state_per_param = int8 ? 6.0 + 8.0 / cpu_adam::kQuantBlock : 12.0;
  const uint64_t state_bytes =
      static_cast<uint64_t>(static_cast<double>(o.params) * state_per_param);
  const uint64_t slot_params =
      static_cast<uint64_t>(static_cast<double>(largest_unit) * state_per_param);

  engine::Settings settings;
  settings.optimizer_threads = o.threads;
  settings.buffer_count = o.buffer_count;
  settings.state_dtype = dtype;
  // The pool holds the grad inbox and publish buffer (4 B a param), the fp32
  // state too in DRAM (12 B), and the ring (NVMe); plus slack for padding.
  const bool nvme_params = o.param_tier == Tier::kNvme;
  const uint64_t ring_bytes =
      nvme ? uint64_t{o.buffer_count} * (slot_params + (nvme_params ? 4 * largest_unit : 0)) : 0;
  // The pool reserves 256 MiB regions: allow one region of fragmentation.
  settings.dram_budget_bytes = (nvme_params ? 2 * o.params
                                : nvme      ? 4 * o.params
                                            : 4 * o.params + state_bytes) +
                               ring_bytes + units * (uint64_t{64} << 10) + (uint64_t{320} << 20);
  // The pool and the compute alone's scratch, refused before the engine
  // pins any of it (the engine only warned of a budget past the machine's
  // memory, one this bench had set itself, and the scratch was in no check).
  if (Status s = CheckFitsInMemory(
          static_cast<double>(settings.dram_budget_bytes + ScratchSlots(largest_unit, units) *
                                                               largest_unit * kSlotBytesPerParam),
          StrCat("--params ", o.params, nvme ? " (states on nvme)" : ""));
      !s.ok()) {
    return fail(s);
  }
  if (nvme) {
    // A --path must exist (the default was made by RunStep).
    for (const std::string& p : o.paths) {
      if (Status dir = CheckBenchDirectory(p, "--path", p == kDefaultSwapDir, ""); !dir.ok()) {
        return FailExit(dir, "step");
      }
      // (It ran, and said RAM's figures as the drive's.)
      if (Status drive = CheckOnADrive(p, p == kDefaultSwapDir ? "the default --path" : "--path");
          !drive.ok())
        return FailExit(drive, "step");
    }
    settings.nvme_paths = o.paths;
    settings.stripe_bytes = o.stripe;
    settings.queue_depth = o.qd;
    settings.checksums = o.checksums;
    const uint64_t per_path =
        (state_bytes + (nvme_params ? o.params * 4 : 0)) / o.paths.size() + units * 4 * o.stripe;
    settings.nvme_capacity_per_path = (per_path + o.stripe - 1) / o.stripe * o.stripe;
    if (Status s = CheckFitsOnDisk(o.paths, settings.nvme_capacity_per_path,
                                   StrCat("--params ", o.params, " (states on nvme)"));
        !s.ok()) {
      return fail(s);
    }
    settings.optimizer_tier = Tier::kNvme;
  }
  // With states on NVMe the swap space's I/O goes through a tracer (idle
  // but for the traced step).
  std::shared_ptr<TracingBackend> tracer;
  if (nvme) {
    Result<std::shared_ptr<nvme::IoBackend>> backend = nvme::MakeBackend(settings.io_backend);
    if (!backend.ok()) return fail(backend.status());
    tracer = std::make_shared<TracingBackend>(*std::move(backend));
  }
  Result<std::unique_ptr<engine::Engine>> created = engine::Engine::Create(settings, tracer);
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
  // (The compute alone's: the engine's thread count, as it clamps it.)
  Result<cpu_adam::Executor> exec = cpu_adam::Executor::Create({.threads = o.threads});
  if (!exec.ok()) return fail(exec.status());
  std::printf(
      "ztier-bench step: %s params in %llu units, states %s (%.2f GiB: fp32 master, %s m+v), "
      "params %s%s, %d optimizer threads\n",
      FormatCount(o.params).c_str(), static_cast<unsigned long long>(units),
      nvme ? "on NVMe" : "in DRAM", Gib(state_bytes), int8 ? "int8" : "fp32",
      nvme_params ? "on NVMe" : "in DRAM",
      nvme ? StrCat(", ", o.paths.size(), " path(s), ring ", o.buffer_count, " x ",
                    Mib(ring_bytes / o.buffer_count), " MiB")
                 .c_str()
           : "",
      exec->threads());

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
  // One step: units' grads handed over backward; timed from the first one
  // (`start`: the engine reads states as grads come, and each hand-over
  // sums its grads' squares; timed from the last, the step's I/O had begun
  // and efficiencies came out past 1) to the last unit's publish
  // (`published`) and to the step's last write-back (`seconds`).
  auto run_step = [&](double* start, double* published, double* seconds) -> Status {
    ++step;
    const double t0 = NowSeconds();
    for (uint64_t k = units; k-- > 1;)
      ZT_RETURN_IF_ERROR(e.GradsReady(*job, static_cast<int>(k), 0));
    ZT_RETURN_IF_ERROR(e.GradsReady(*job, 0, 0));
    ZT_RETURN_IF_ERROR(e.WaitPublished(*job, static_cast<int>(units - 1), step));
    *published = NowSeconds() - t0;
    ZT_RETURN_IF_ERROR(WaitSteps(e, *job, step));
    *seconds = NowSeconds() - t0;
    *start = t0;
    return Status::Ok();
  };
  double started = 0, published = 0;  // only the traced step needs these

  // Compute alone: the same kernel calls on DRAM buffers, each unit in
  // turn on the next of the scratch's slots (ScratchSlots).
  uint64_t max_padded = 0;
  for (const engine::UnitLayout& l : layouts) max_padded = std::max(max_padded, l.padded);
  const uint64_t slots = ScratchSlots(max_padded, layouts.size());
  const uint64_t span = max_padded * slots;
  Buffer p(span * 4), m(span * 4), v(span * 4), g(span * 2), out(span * 2);
  if (!p.p || !m.p || !v.p || !g.p || !out.p) return fail(Status::ResourceExhausted("scratch"));
  FillGrads(static_cast<bf16*>(g.p), span, 99);
  auto compute_alone = [&](double* seconds) -> Status {
    const double t0 = NowSeconds();
    // The step's hand-overs sum each unit's grads' squares (clipping needs
    // the norm before any update): so does its limit (without it the ratio
    // of a DRAM step came out near 0.85, never 1).
    for (size_t k = layouts.size(); k-- > 0;) {
      const auto* const grads = static_cast<const bf16*>(g.p) + k % slots * max_padded;
      ZT_RETURN_IF_ERROR(
          cpu_adam::SquaredNorm(grads, cpu_adam::GradType::kBFloat16, layouts[k].shard, *exec)
              .status());
    }
    for (size_t k = 0; k < layouts.size(); ++k) {
      const engine::UnitLayout& l = layouts[k];
      const uint64_t at = k % slots * max_padded;  // this unit's slot, in elements
      const cpu_adam::StepOptions options{
          .step = step + 1, .grad_scale = 0.5f, .grad_check = cpu_adam::GradCheck::kPrechecked};
      auto* const grads = static_cast<bf16*>(g.p) + at;
      auto* const params = static_cast<float*>(p.p) + at;
      auto* const params_out = static_cast<bf16*>(out.p) + at;
      if (int8) {  // codes in m's slot, absmax in v's
        auto* codes = static_cast<uint8_t*>(m.p) + at * 4;
        auto* absmax = static_cast<float*>(v.p) + at;
        const cpu_adam::Int8Shard shard8{
            .count = l.padded,
            .grads = grads,
            .grad_type = cpu_adam::GradType::kBFloat16,
            .params = params,
            .moments = {.m = codes,
                        .v = codes + l.padded,
                        .m_absmax = absmax,
                        .v_absmax = absmax + cpu_adam::QuantBlocks(l.padded),
                        .cuts = {}},
            .params_out = params_out};
        ZT_RETURN_IF_ERROR(
            cpu_adam::StepInt8(spec.optimizer.hyper, options, shard8, {}, *exec).status());
        continue;
      }
      const cpu_adam::Shard shard{.count = l.padded,
                                  .grads = grads,
                                  .grad_type = cpu_adam::GradType::kBFloat16,
                                  .params = params,
                                  .exp_avg = static_cast<float*>(m.p) + at,
                                  .exp_avg_sq = static_cast<float*>(v.p) + at,
                                  .params_out = params_out};
      ZT_RETURN_IF_ERROR(cpu_adam::Step(spec.optimizer.hyper, options, shard, *exec).status());
    }
    *seconds = NowSeconds() - t0;
    return Status::Ok();
  };

  // Warm-up: the first step writes every state (reads of never-written
  // states cost no I/O) and faults in the scratch buffers.
  double warm = 0, warm_compute = 0;
  if (Status s = stopped(); !s.ok()) return fail(s);
  if (Status s = run_step(&started, &published, &warm); !s.ok()) return fail(s);
  if (Status s = compute_alone(&warm_compute); !s.ok()) return fail(s);
  std::printf("warm-up step %.2f s\n", warm);
  std::printf("%5s %9s %9s %9s %11s %11s %10s\n", "step", "step s", "io s", "compute s",
              "compute in", "io wait in", "efficiency");

  std::vector<Round> rounds;
  uint64_t step_read = 0, step_written = 0;  // NVMe bytes in the timed steps
  // Every step's row on a terminal; in a log, one every few seconds (all of
  // them are in --json).
  LinePacer pacer(stdout);
  for (int r = 0; r < o.steps; ++r) {
    if (Status s = stopped(); !s.ok()) return fail(s);
    Round round;
    if (nvme) {
      const double t0 = NowSeconds();
      if (Status s = e.RoundTripStates(*job); !s.ok()) return fail(s);
      round.io = NowSeconds() - t0;
    }
    if (Status s = compute_alone(&round.compute); !s.ok()) return fail(s);
    const engine::JobCounters before = e.counters(*job);
    if (Status s = run_step(&started, &round.published, &round.step); !s.ok()) return fail(s);
    const engine::JobCounters after = e.counters(*job);
    round.compute_in_step = after.compute_seconds - before.compute_seconds;
    round.io_wait_in_step = after.io_wait_seconds - before.io_wait_seconds;
    step_read += after.nvme_read_bytes - before.nvme_read_bytes;
    step_written += after.nvme_write_bytes - before.nvme_write_bytes;
    if (pacer.Due(r, o.steps)) {
      std::printf("%5lld %9.3f %9.3f %9.3f %11.3f %11.3f %10.3f\n", static_cast<long long>(step),
                  round.step, round.io, round.compute, round.compute_in_step, round.io_wait_in_step,
                  round.efficiency());
      std::fflush(stdout);
    }
    rounds.push_back(round);
  }
  if (pacer.held_back() > 0) {
    std::printf("(%lld of %d step rows not shown: stdout is not a terminal; --json has all)\n",
                static_cast<long long>(pacer.held_back()), o.steps);
  }
  double mean_step = 0, mean_published = 0, mean_io = 0, mean_compute = 0;
  for (const Round& r : rounds) {
    mean_step += r.step / rounds.size();
    mean_published += r.published / rounds.size();
    mean_io += r.io / rounds.size();
    mean_compute += r.compute / rounds.size();
  }
  // Of the means printed beside it (a mean of the steps' ratios did not
  // follow from them).
  const double mean_eff = std::max(mean_io, mean_compute) / mean_step;
  const engine::JobCounters c = e.counters(*job);
  const Rss rss = ReadRss();
  const uint64_t scratch = span * kSlotBytesPerParam;
  // In DRAM there is no I/O to overlap: the figure is the step against its
  // compute alone (noise moves it a few percent either side of 1).
  std::printf(
      "mean: step %.3f s (every unit published at %.3f s), io alone %.3f s, compute alone %.3f s, "
      "%s %.3f\n",
      mean_step, mean_published, mean_io, mean_compute,
      nvme ? "overlap efficiency" : "compute alone / step (states in DRAM: no I/O to overlap)",
      mean_eff);
  if (nvme && mean_eff > 1.05) {
    // (A step cannot beat its own I/O: the limits, measured in rounds of
    // their own, saw a slower drive than the steps did.)
    std::printf(
        "note: an efficiency past 1 means the drive was faster during the steps than during io "
        "alone (others' I/O on it, a short run): more --steps, or larger --params, settle it\n");
  }
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
      "%.1f Mparams/s; peak RSS%s %.2f GiB = pinned pool %.2f GiB (ring %.2f GiB) + "
      "compute-alone scratch %.2f GiB + %.2f GiB other; state %.2f GiB\n",
      o.params / mean_step / 1e6, own_peak ? "" : " (of the process: not reset)", Gib(rss.peak),
      Gib(c.dram_bytes), Gib(ring_bytes), Gib(scratch),
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
          .Add("published_seconds", r.published)
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
        .Add("threads", exec->threads())  // as run (--threads 0 is all cores)
        .Add("checksums", o.checksums)
        .Add("overlap_efficiency", mean_eff)
        .Add("step_seconds", mean_step)
        .Add("published_seconds", mean_published)
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
    // Last: the traced step comes after every figure above was taken.
    if (o.json && o.timeline) {
      uint64_t slot_bytes = 0;
      for (const engine::UnitLayout& l : layouts) {
        slot_bytes = std::max(slot_bytes, SlotBytes(l, int8, nvme_params));
      }
      Result<std::string> timeline =
          TraceStep(e, *job, layouts, step + 1, tracer.get(), slot_bytes, run_step);
      if (!timeline.ok()) return fail(timeline.status());
      j.AddRaw("timeline", *timeline);
    }
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
  // The default swap directory is made (a --path must exist: a typo would
  // measure another filesystem), and goes with the run if empty.
  std::optional<DefaultDir> default_dir;
  if (o.tier == Tier::kNvme &&
      std::find(o.paths.begin(), o.paths.end(), kDefaultSwapDir) != o.paths.end()) {
    default_dir.emplace(kDefaultSwapDir);
  }
  // Before any thread starts: a stop ends the run at its next step.
  StopSignals stops;
  std::vector<RunSummary> runs(o.dtypes.size());
  for (size_t i = 0; i < o.dtypes.size(); ++i) {
    if (i > 0) std::printf("\n");
    if (int rc = RunOnce(stops, o, o.dtypes[i], &runs[i]); rc != 0) return rc;
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
