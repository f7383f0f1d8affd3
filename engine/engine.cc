// ztier engine: jobs, units and the step pipeline (see engine.h).
//
// Locking: `mu` guards the job map and every job's bookkeeping (arrivals,
// micro-steps, norms, counters, step numbers). Grad accumulation and norms
// run on the calling client thread outside the lock, on the caller's own
// shard. Optimizer work runs on the engine's stepping threads, outside the
// lock, on units whose grads are complete (no client writes them until the
// next step). Each job's steps run one at a time and in order (a strand), and
// different jobs' steps run side by side on the stepping threads of their
// lane: jobs with states or params on NVMe, whose steps wait on the drives,
// have threads of their own, so however many of them wait (one uid may have
// 16), a job in DRAM never waits behind them; their compute shares the one
// Executor.
#include "engine/engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common/bf16.h"
#include "common/log.h"
#include "common/numbers.h"
#include "common/thread.h"
#include "common/utf8.h"
#include "engine/dram_pool.h"
#include "engine/engine_internal.h"
#include "engine/state_files.h"

namespace ztier::engine {
namespace {

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// How long a registration short of DRAM waits for unregistered jobs (a
// step under way stops at its next unit) to let their memory go.
constexpr std::chrono::seconds kRetiringWait{60};

// The client page of a job (wire_types.h): kClientCounterWords u64 a rank.
uint64_t ClientPageBytes(const JobSpec& spec) {
  return static_cast<uint64_t>(spec.ranks) * kClientCounterWords * sizeof(uint64_t);
}

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

// A job that a failed load or import left holding a mix of two states
// trains, saves and exports nothing until a load or import commits.
Status PartlyWritten(const Job& j) {
  if (!j.partly_written) return Status::Ok();
  return Status::FailedPrecondition(
      StrCat("job '", j.spec.name,
             "': a checkpoint load or safetensors import is under way (through ztierd, by ",
             "another client or thread: wait for it) or failed midway, leaving some units' state ",
             "from the file and the rest as it was (then load a checkpoint, or import, again)"));
}

}  // namespace

struct Engine::Impl {
  Settings settings;
  std::unique_ptr<DramPool> pool;
  std::unique_ptr<nvme::SwapSpace> swap;  // when NVMe paths are configured
  // For a wait that timed out: "; swap file F: N disk operations waiting,
  // none finished for T s ..." where a drive has been quiet for half the
  // wait's time, at least 2 s (ztierd waits in slices of 500 ms: a busy
  // drive is no stalled one) and at most 10 s; else "".
  std::string StallNote(std::chrono::milliseconds waited) const {
    if (swap == nullptr) return "";
    const std::string note = swap->StallNote(std::clamp<std::chrono::milliseconds>(
        waited / 2, std::chrono::seconds(2), std::chrono::seconds(10)));
    return note.empty() ? note : "; " + note;
  }
  cpu_adam::Executor executor;
  // Jobs unregistered and not yet gone (a step under way or a call still
  // holds them, and their memory and swap): a registration short of either
  // waits for them (WaitForRetiring). A leaf mutex: the last holder of a job
  // may hold any other lock. Declared before the jobs and tasks, which may
  // hold such a job as they are destroyed.
  std::mutex retiring_mu;
  std::condition_variable retiring_cv;
  int retiring = 0;   // guarded by retiring_mu
  uint64_t gone = 0;  // unregistered jobs gone so far, guarded by retiring_mu
  // Until `deadline`, for one more unregistered job to be gone since
  // `*seen` (then true, *seen updated: check again); false once none is
  // left to wait for, or at the deadline (said).
  bool WaitForRetiring(uint64_t* seen, std::chrono::steady_clock::time_point deadline,
                       std::string_view who) {
    std::unique_lock<std::mutex> lock(retiring_mu);
    if (gone == *seen && retiring == 0) return false;
    if (!retiring_cv.wait_until(lock, deadline, [&] { return gone != *seen; })) {
      ZT_LOG(kWarn, "engine") << who << ": waited " << kRetiringWait.count() << " s for "
                              << retiring
                              << " unregistered job(s) to let their memory go (a step stuck on a "
                                 "drive that does not answer?)";
      return false;
    }
    *seen = gone;
    return true;
  }

  CheckpointDirs dirs;  // before `jobs`: jobs go first on destruction

  mutable std::mutex mu;
  std::condition_variable published_cv;
  std::map<int, std::shared_ptr<Job>> jobs;
  // Names of jobs being registered (guarded by mu): a second registration
  // of one is refused as if it were registered (two threads at once each
  // found the name free and both registered it).
  std::set<std::string> registering;
  int next_job = 1;
  // What the jobs unregistered so far counted (guarded by mu): totals()
  // adds the live jobs' counters to it.
  EngineTotals retired;

  // Stepping: each job's tasks in order (its strand), jobs of a lane taking
  // turns on its threads. Lane 0: jobs all in DRAM; lane 1: jobs whose
  // steps read and write the drives.
  static constexpr int kLanes = 2;
  static constexpr int kSteppingThreadsPerLane = 4;
  static int LaneOf(const Job& j) { return j.ring != nullptr || j.params != nullptr ? 1 : 0; }
  std::mutex task_mu;
  std::condition_variable task_cv[kLanes];
  std::map<int, std::deque<std::function<void()>>> tasks;  // by job
  std::deque<int> runnable[kLanes];  // jobs with tasks and no thread running one
  std::set<int> running;             // jobs a thread runs a task of
  bool stop = false;
  std::vector<std::thread> workers;

  explicit Impl(cpu_adam::Executor e) : executor(std::move(e)) {}

  void Post(const Job& j, std::function<void()> task) {
    const int lane = LaneOf(j);
    {
      std::lock_guard<std::mutex> lock(task_mu);
      std::deque<std::function<void()>>& q = tasks[j.id];
      q.push_back(std::move(task));
      if (q.size() == 1 && running.count(j.id) == 0) runnable[lane].push_back(j.id);
    }
    task_cv[lane].notify_one();
  }

  // A stepping thread of `lane`: the next job's next task, until stopped
  // with nothing left to run.
  void Run(int lane) {
    for (;;) {
      std::function<void()> task;
      int job;
      {
        std::unique_lock<std::mutex> lock(task_mu);
        task_cv[lane].wait(lock, [&] { return stop || !runnable[lane].empty(); });
        if (runnable[lane].empty()) return;
        job = runnable[lane].front();
        runnable[lane].pop_front();
        std::deque<std::function<void()>>& q = tasks[job];
        task = std::move(q.front());
        q.pop_front();
        running.insert(job);
      }
      try {
        task();
      } catch (const std::exception& e) {
        // oneTBB's, when it cannot start a worker thread: the job fails (its
        // waiters are told), the engine and its other jobs go on.
        std::shared_ptr<Job> j;
        {
          std::lock_guard<std::mutex> lock(mu);
          auto it = jobs.find(job);
          if (it != jobs.end()) j = it->second;
        }
        if (j != nullptr) {
          Fail(*j, Status::ResourceExhausted(StrCat("the optimizer's task failed: ", e.what())));
        }
      }
      {
        std::lock_guard<std::mutex> lock(task_mu);
        running.erase(job);
        auto it = tasks.find(job);
        if (it->second.empty()) {
          tasks.erase(it);
        } else {
          runnable[lane].push_back(job);  // behind the other jobs waiting
          task_cv[lane].notify_one();
        }
      }
    }
  }

  // The pinned DRAM a job's layout needs with its states (and params) on
  // NVMe or in DRAM: the ring, the param cache and the per-unit buffers, as
  // RegisterJob allocates them.
  uint64_t DramNeed(const Job& job, bool nvme_states, bool nvme_params) const {
    auto page = [](uint64_t b) { return RoundUp(b, 4096); };
    uint64_t need = 0, slot = 0, param_slot = 0;
    for (const Unit& u : job.units) {
      const uint64_t n = u.layout.padded;
      if (!nvme_states) {
        need += page(n * 4);
        if (!u.stateless && job.state_dtype == StateDtype::kInt8) {
          need += page(MomentBytes(u, StateDtype::kInt8));
        } else if (!u.stateless) {
          need += 2 * page(n * 4);
        }
      }
      if (!nvme_params) need += page(n * 2);
      need += page(n * 2);  // grad inbox
      if (job.spec.optimizer.grad_accumulation > 1) need += page(n * 4);
      slot =
          std::max(slot, StateBytes(u, job.state_dtype) + (nvme_params ? ParamBytes(u.layout) : 0));
      param_slot = std::max(param_slot, ParamBytes(u.layout));
    }
    if (nvme_states) need += settings.buffer_count * page(slot);
    if (nvme_params) need += settings.buffer_count * page(param_slot);
    need += page(StepPageBytes(job.units.size()));
    need += page(ClientPageBytes(job.spec));
    return need;
  }

  // A job's pinned DRAM need (DramNeed) against what the budget has left
  // and what the machine has: refused up front, with the figures.
  Result<uint64_t> CheckDramNeed(const Job& job) const {
    const JobSpec& spec = job.spec;
    const bool nvme_states = spec.optimizer_tier == Tier::kNvme;
    const bool nvme_params = spec.param_tier == Tier::kNvme;
    const uint64_t need = DramNeed(job, nvme_states, nvme_params);
    const DramPoolStats pool_stats = pool->stats();
    const uint64_t left =
        pool_stats.budget_bytes - std::min(pool_stats.used_bytes, pool_stats.budget_bytes);
    if (need > left) {
      // States on NVMe need less only where the units outweigh the
      // staging ring (buffer_count of the largest unit's states).
      const uint64_t on_nvme = nvme_states ? need : DramNeed(job, true, nvme_params);
      return Status::ResourceExhausted(StrCat(
          "job '", spec.name, "' needs ", need, " bytes of pinned DRAM (",
          nvme_states ? "grad inboxes, publish buffers and the staging ring"
                      : "fp32 master, m, v, the bf16 publish buffer and grad inbox of each unit",
          "); the DRAM budget (ztier.dram_budget) has ", left, " of ", pool_stats.budget_bytes,
          " bytes left: raise the budget",
          on_nvme >= need ? std::string()
          : on_nvme <= left
              ? StrCat(" or put the optimizer states on nvme (", on_nvme,
                       " bytes of pinned DRAM then)")
              : StrCat(" (with the optimizer states on nvme the job needs ", on_nvme, " bytes)")));
    }
    const uint64_t physical = PhysicalMemoryBytes();
    if (physical != 0 && need > physical) {
      return Status::ResourceExhausted(StrCat("job '", spec.name, "' needs ", need,
                                              " bytes of pinned DRAM; this machine has ", physical,
                                              " bytes of memory in all"));
    }
    return need;
  }

  // One step of `seconds` done: the job's step-time counters (under mu).
  static void CountStepTime(JobCounters& c, double seconds) {
    c.optimizer_seconds += seconds;
    c.last_step_seconds = seconds;
    size_t b = 0;
    while (b < kStepSecondsBounds.size() && seconds > kStepSecondsBounds[b]) ++b;
    ++c.step_seconds_buckets[b];
  }

  // The job's counters, with the figures kept outside them (under mu).
  JobCounters CountersLocked(Job& j) const {
    JobCounters c = j.counters;
    c.dram_page_bytes = pool->stats().page_bytes;
    c.compute_seconds = static_cast<double>(j.compute_ns.load(std::memory_order_relaxed)) * 1e-9;
    if (j.ring != nullptr) {
      c.nvme_read_bytes = j.ring->bytes_read.load(std::memory_order_relaxed);
      c.nvme_write_bytes = j.ring->bytes_written.load(std::memory_order_relaxed);
      if (j.params != nullptr) c.nvme_param_read_bytes = j.params->bytes_read.load();
      c.io_wait_seconds =
          static_cast<double>(j.ring->io_wait_ns.load(std::memory_order_relaxed)) * 1e-9;
    }
    auto* page = static_cast<uint64_t*>(j.client_page.ptr);
    if (page == nullptr) return c;
    // Past what links of 1 TiB/s could have moved since registration, a
    // word is the client's garbage, not traffic.
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - j.registered).count();
    // (After 2^23 s, 97 days, the bound would pass 2^63: it stops there.)
    const uint64_t most = seconds < 0x1p23
                              ? (uint64_t{1} << 30) + static_cast<uint64_t>(seconds * 0x1p40)
                              : uint64_t{1} << 63;
    j.seen.resize(static_cast<size_t>(j.spec.ranks) * kClientCounterWords, 0);
    const auto word = [&](int rank, int w) {
      uint64_t& seen = j.seen[static_cast<size_t>(rank) * kClientCounterWords + w];
      const uint64_t v = std::atomic_ref<uint64_t>(page[rank * kClientCounterWords + w])
                             .load(std::memory_order_relaxed);
      if (v > seen && v <= most) seen = v;
      return seen;
    };
    for (int r = 0; r < j.spec.ranks; ++r) {
      c.host_to_device_bytes += word(r, kHostToDeviceBytes);
      c.device_to_host_bytes += word(r, kDeviceToHostBytes);
    }
    return c;
  }

  static void AddTotals(EngineTotals& t, const JobCounters& c) {
    t.bytes.nvme_read += c.nvme_read_bytes + c.nvme_param_read_bytes;
    t.bytes.nvme_write += c.nvme_write_bytes;
    t.bytes.host_to_device += c.host_to_device_bytes;
    t.bytes.device_to_host += c.device_to_host_bytes;
    t.grad_bytes_in += c.grad_bytes_in;
    t.steps += c.steps;
    t.skipped_steps += c.skipped_steps;
    t.optimizer_seconds += c.optimizer_seconds;
    t.stall_seconds += c.stall_seconds;
  }

  Result<std::shared_ptr<Job>> Find(int job) const {
    auto it = jobs.find(job);
    if (it == jobs.end()) return Status::NotFound(StrCat("job ", job, " is not registered"));
    return it->second;
  }

  // Runs AdamW on one unit (all ranks' shards) whose state is in `state`,
  // with the param groups' learning rates `lrs`; the bf16 copy lands in the
  // publish buffer, which the caller publishes. A unit of one group without
  // frozen tensors is one pass; otherwise one pass per run of tensors
  // (Unit::runs), a frozen run only rounding its master into the publish
  // buffer (which may be a staging slot that must be filled whole).
  Status RunAdam(Job& job, Unit& u, const StateView& state, int64_t adam_step, float scale,
                 const std::vector<float>& lrs) {
    const auto t0 = std::chrono::steady_clock::now();
    const OptimizerConfig& o = job.spec.optimizer;
    const cpu_adam::StepOptions opt{
        .step = adam_step, .grad_scale = scale, .grad_check = cpu_adam::GradCheck::kPrechecked};
    const bool accum = o.grad_accumulation > 1;
    // Elements [begin, end) of the unit, with `group`'s rates.
    auto update = [&](uint64_t begin, uint64_t end, uint32_t group) {
      cpu_adam::Hyper hyper = o.hyper;
      hyper.lr = lrs[group];
      if (!o.group_weight_decay.empty()) hyper.weight_decay = o.group_weight_decay[group];
      const cpu_adam::Shard shard{
          .count = end - begin,
          .grads = accum ? static_cast<const void*>(u.f(u.accum) + begin)
                         : static_cast<const void*>(static_cast<const bf16*>(u.inbox.ptr) + begin),
          .grad_type = accum ? cpu_adam::GradType::kFloat32 : cpu_adam::GradType::kBFloat16,
          .params = state.master + begin,
          .exp_avg = state.exp_avg + begin,
          .exp_avg_sq = state.exp_avg_sq + begin,
          .params_out = state.publish + begin};
      return cpu_adam::Step(hyper, opt, shard, executor).status();
    };
    Status s;
    if (job.state_dtype == StateDtype::kInt8) {
      // One pass over the unit: its runs become the kernel's segments
      // (each starts at a tensor's offset, one of the unit's quantization
      // cuts or on the block grid: no group mixes two).
      std::vector<cpu_adam::Segment> segments;
      const auto group_decay = [&](uint32_t group) {
        return o.group_weight_decay.empty() ? o.hyper.weight_decay : o.group_weight_decay[group];
      };
      if (u.runs.empty()) {
        segments.push_back(
            {.begin = 0, .end = u.layout.padded, .lr = lrs[0], .weight_decay = group_decay(0)});
      }
      for (const TensorRun& run : u.runs) {
        segments.push_back({.begin = run.begin,
                            .end = run.end,
                            .lr = lrs[run.group],
                            .weight_decay = group_decay(run.group),
                            .frozen = run.frozen});
      }
      const cpu_adam::Int8Shard shard{
          .count = u.layout.padded,
          .grads = accum ? static_cast<const void*>(u.f(u.accum)) : u.inbox.ptr,
          .grad_type = accum ? cpu_adam::GradType::kFloat32 : cpu_adam::GradType::kBFloat16,
          .params = state.master,
          .moments = state.q,
          .params_out = state.publish};
      s = cpu_adam::StepInt8(o.hyper, opt, shard, segments, executor).status();
    } else if (u.runs.empty()) {
      s = update(0, u.layout.padded, 0);
    } else {
      for (const TensorRun& run : u.runs) {
        if (run.frozen) {
          executor.ParallelFor(run.end - run.begin, [&](size_t b, size_t e) {
            for (size_t i = run.begin + b; i < run.begin + e; ++i) {
              state.publish[i] = FloatToBf16(state.master[i]);
            }
          });
          continue;
        }
        s = update(run.begin, run.end, run.group);
        if (!s.ok()) break;
      }
    }
    AddElapsed(job.compute_ns, t0);
    return s;
  }

  // The unit holds `step` now and its inbox may take the next step's grads.
  // `also` runs under the same lock, so bookkeeping it does (step counters)
  // is visible to every waiter this publish wakes.
  template <class F>
  void Publish(Job& job, Unit& u, int64_t step, F&& also) {
    {
      std::lock_guard<std::mutex> lock(mu);
      // A unit made visible before its write-back is published again when
      // the write is done; by then its grads for the next step may be in.
      const bool first = u.published < step;
      u.published = step;
      const size_t unit = static_cast<size_t>(&u - job.units.data());
      std::atomic_ref<int64_t>(static_cast<int64_t*>(job.step_page.ptr)[unit])
          .store(step, std::memory_order_release);
      if (job.params != nullptr) {  // cached copies of the unit are out of date
        const int k = static_cast<int>(&u - job.units.data());
        for (ParamSlot& slot : job.params->slots) {
          if (slot.unit != k) continue;
          if (slot.leases > 0) {
            slot.stale = true;
          } else {
            slot.unit = -1;
          }
        }
      }
      if (u.ready && (first || !u.writing_back)) u.ready = false;
      also();
    }
    published_cv.notify_all();
  }

  // The CommitFn of a load, import or commit of `job` (engine_internal.h).
  CommitFn Committer(Job& job) {
    return [this, &job](int64_t step, int64_t adam_step) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (step == kKeepSteps) {  // an import: the steps the job is at
          step = job.step;
          adam_step = job.adam_step;
        }
        job.step = step;
        job.adam_step = adam_step;
      }
      for (Unit& u : job.units) Publish(job, u, step, [] {});
    };
  }

  // After weights replaced in place (set, loaded, imported; WithIdleJob's
  // calls that replace the state, even one that failed midway) are published:
  // a client's copies of a step it fetched before are out of date, though
  // the step is the same (Engine::WeightsGeneration).
  static void WeightsReplaced(Job& job) {
    WeightsGenerationOf(job).fetch_add(1, std::memory_order_release);
  }
  // The step page's word after the units' steps.
  static std::atomic_ref<int64_t> WeightsGenerationOf(const Job& job) {
    return std::atomic_ref<int64_t>(static_cast<int64_t*>(job.step_page.ptr)[job.units.size()]);
  }

  // Under `lock` (on mu): until no unit of the job is published with its
  // write-back in flight (the step it belongs to is then complete), or the
  // job failed or went.
  void WaitWriteBacksLocked(std::unique_lock<std::mutex>& lock, const Job& job) {
    published_cv.wait(lock, [&] {
      if (!job.failure.ok() || job.removed) return true;
      return std::none_of(job.units.begin(), job.units.end(),
                          [](const Unit& u) { return u.writing_back; });
    });
  }

  // Waits for what the engine does on its own: steps whose grads are all
  // in (queued or running; eager units' updates) and write-backs. Steps
  // that still wait for grads are the caller's to refuse (CheckIdle): a
  // save right after the step's last grads went read the state while the
  // step ran, and was refused ("in flight"), or failed through ztierd
  // ("went from step").
  void WaitQueuedStepsLocked(std::unique_lock<std::mutex>& lock, const Job& job) {
    const bool exact = job.spec.optimizer.mode == StepMode::kExact;
    published_cv.wait(lock, [&] {
      if (!job.failure.ok() || job.removed) return true;
      if (exact && job.steps_queued > 0) return false;
      return std::none_of(job.units.begin(), job.units.end(),
                          [&](const Unit& u) { return u.writing_back || (!exact && u.ready); });
    });
  }

  bool Removed(const Job& job) {
    std::lock_guard<std::mutex> lock(mu);
    return job.removed;
  }

  void Fail(Job& job, const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (job.failure.ok()) job.failure = s;
    }
    ZT_LOG(kError, "engine") << "job '" << job.spec.name << "': " << s;
    published_cv.notify_all();
  }

  static double Since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Exact mode: every unit's grads are in, their squared norm `sq` and the
  // learning rates `lrs` taken as the last arrived. Skip or clip, then units
  // in forward order, each published when done.
  void StepExact(const std::shared_ptr<Job>& jp, double sq, const std::vector<float>& lrs) {
    Job& job = *jp;
    const auto t0 = std::chrono::steady_clock::now();
    int64_t step, adam_step;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (job.removed || !job.failure.ok()) return;  // a failed job steps no more
      step = job.step + 1;
      adam_step = job.adam_step + 1;
    }
    const double norm = std::sqrt(sq);
    {
      // Readable once the step's grads are in: a client that sees a unit of
      // this step sees its norm, whether or not the write-backs are done.
      std::lock_guard<std::mutex> lock(mu);
      job.counters.last_grad_norm = norm;
    }
    const float scale = cpu_adam::ClipScale(norm, job.spec.optimizer.clip_norm);
    // Skipped: inf/NaN grads, or grads so large that v would overflow.
    const bool finite = !cpu_adam::GradsOverflow(sq, scale);
    if (!finite) {
      ZT_LOG(kWarn, "engine") << "job '" << job.spec.name << "': step " << step << " skipped: "
                              << (std::isfinite(norm)
                                      ? StrCat("grad norm ", norm,
                                               " (unclipped) is past the most the engine steps "
                                               "with (a sum of squared grads of ",
                                               cpu_adam::kMaxGradSqSum,
                                               ", so that no squared grad can pass fp32's "
                                               "range): clip the grads (gradient_clipping) or "
                                               "scale the loss down")
                                      : std::string("inf/NaN in the gradients"));
    }
    // Units are published as their write-backs finish (in any order); the
    // step completes with the last of them. With states on NVMe and params
    // in DRAM a unit's params are visible as soon as it is updated (the next
    // forward need not wait for the drives); it stays `writing_back` until
    // its write-back is done, and the step completes after every one.
    size_t published = 0;
    auto publish = [&](size_t k) {
      Publish(job, job.units[k], step, [&] {
        job.units[k].writing_back = false;
        if (++published < job.units.size()) return;
        job.step = step;
        --job.steps_queued;
        if (finite) {
          job.adam_step = adam_step;
        } else {
          ++job.counters.skipped_steps;
        }
        ++job.counters.steps;
        CountStepTime(job.counters, Since(t0));
      });
    };
    if (!finite) {  // a skipped step publishes the same weights as the new step
      for (size_t k = 0; k < job.units.size(); ++k) publish(k);
      return;
    }
    // A unit is published once its write-back is done: a published unit is
    // on the drives, and an I/O error fails the step it belongs to.
    StoredFn visible;
    if (job.ring != nullptr && job.params == nullptr) {
      visible = [&](size_t k) {
        Publish(job, job.units[k], step, [&] { job.units[k].writing_back = true; });
      };
    }
    Status s = ForEachUnitState(
        job, ForwardOrder(job), Access::kUpdate,
        [&](size_t k, const StateView& state) {
          // A job unregistered meanwhile stops here, and its memory goes
          // back (a run started again at once waits for it to register as
          // much again: WaitForRetiring).
          if (Removed(job)) return Status::Aborted("the job was unregistered");
          return RunAdam(job, job.units[k], state, adam_step, scale, lrs);
        },
        publish, visible);
    if (!s.ok() && !Removed(job)) Fail(job, s.Annotate(StrCat("step ", step)));
  }

  // Eager mode: one unit's grads are in; update it now.
  // Eager mode: `unit`'s grads are in, the learning rates `lrs` taken as
  // they arrived.
  void StepEager(const std::shared_ptr<Job>& jp, size_t unit, const std::vector<float>& lrs) {
    Job& job = *jp;
    const auto t0 = std::chrono::steady_clock::now();
    int64_t step, adam_step;
    double sq = 0.0;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (job.removed || !job.failure.ok()) return;  // a failed job steps no more
      step = job.step + 1;
      adam_step = job.adam_step + 1;
      for (double s : job.units[unit].shard_sq) sq += s;
    }
    if (cpu_adam::GradsOverflow(sq, 1.0f)) {
      return Fail(job, Status::Aborted(
                           StrCat("step ", step, ": ",
                                  std::isfinite(sq) ? StrCat("grads of norm ", std::sqrt(sq),
                                                             " (past what fp32 moments hold)")
                                                    : std::string("inf/NaN gradients"),
                                  " in unit '", job.spec.units[unit].name,
                                  "' with eager updates, which cannot skip a step; use exact mode "
                                  "(the default) for loss scaling")));
    }
    // Published once the state is written back (NVMe tier).
    Status s = WithUnitState(job, unit, Access::kUpdate, [&](size_t k, const StateView& state) {
      return RunAdam(job, job.units[k], state, adam_step, 1.0f, lrs);
    });
    if (!s.ok()) return Fail(job, s.Annotate(StrCat("step ", step)));
    Publish(job, job.units[unit], step, [&] {
      job.eager_seconds += Since(t0);
      if (++job.eager_done == static_cast<int>(job.units.size())) {
        job.eager_done = 0;
        job.step = step;
        job.adam_step = adam_step;
        ++job.counters.steps;
        CountStepTime(job.counters, job.eager_seconds);
        job.eager_seconds = 0;
      }
    });
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(impl_->task_mu);
    impl_->stop = true;
  }
  for (std::condition_variable& cv : impl_->task_cv) cv.notify_all();
  for (std::thread& t : impl_->workers) t.join();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->jobs.clear();
  }
  if (impl_->swap != nullptr) {
    Status s = impl_->swap->Close();
    if (!s.ok()) {
      ZT_LOG(kError, "engine") << "closing the swap space: " << s;
    }
  }
}

Result<std::unique_ptr<Engine>> Engine::Create(const Settings& settings,
                                               std::shared_ptr<nvme::IoBackend> io_backend) {
  ZT_RETURN_IF_ERROR(Validate(settings));
  ZT_ASSIGN_OR_RETURN(cpu_adam::Executor exec,
                      cpu_adam::Executor::Create({.threads = settings.optimizer_threads}));
  auto impl = std::make_unique<Impl>(std::move(exec));
  impl->settings = settings;
  ZT_ASSIGN_OR_RETURN(impl->pool, DramPool::Create({.budget_bytes = settings.dram_budget_bytes,
                                                    .huge_pages = settings.huge_pages,
                                                    .lock = settings.pin_memory}));
  if (!settings.nvme_paths.empty()) {
    // The swap space's staging buffers (queue_depth x stripe_bytes a path,
    // pinned as io_uring fixed buffers) come beside the pool: bounded by the
    // budget and the machine (1G stripes made 17 GB of them for a 0.02M
    // parameter model).
    const double staging = static_cast<double>(settings.nvme_paths.size()) * settings.queue_depth *
                           static_cast<double>(settings.stripe_bytes);
    const uint64_t physical = PhysicalMemoryBytes();
    if (staging > static_cast<double>(settings.dram_budget_bytes) ||
        (physical != 0 && staging > 0.5 * static_cast<double>(physical))) {
      return Status::InvalidArgument(StrCat(
          "the swap space's staging buffers, aio.queue_depth ", settings.queue_depth,
          " x aio.block_size ", settings.stripe_bytes, " x ", settings.nvme_paths.size(),
          " path(s) = ", static_cast<uint64_t>(staging), " bytes, would pass ",
          staging > static_cast<double>(settings.dram_budget_bytes)
              ? StrCat("the DRAM budget (ztier.dram_budget ", settings.dram_budget_bytes, ")")
              : StrCat("half of this machine's ", physical, " bytes of memory"),
          ": lower the stripe or the queue depth"));
    }
    if (io_backend == nullptr) {
      ZT_ASSIGN_OR_RETURN(io_backend, nvme::MakeBackend(settings.io_backend));
    }
    ZT_ASSIGN_OR_RETURN(impl->swap,
                        nvme::SwapSpace::Create({.paths = settings.nvme_paths,
                                                 .max_file_bytes = settings.nvme_capacity_per_path,
                                                 .stripe_bytes = settings.stripe_bytes,
                                                 .queue_depth = settings.queue_depth,
                                                 .checksums = settings.checksums},
                                                std::move(io_backend)));
  }
  for (const std::string& line : NonDefaultSettings(settings)) {
    ZT_LOG(kInfo, "engine") << "setting " << line;
  }
  // A cap, not an allocation: allowed, but the jobs it admits could pin
  // more than the machine has.
  if (const uint64_t physical = PhysicalMemoryBytes();
      physical != 0 && settings.dram_budget_bytes > physical) {
    ZT_LOG(kWarn, "engine") << "the DRAM budget (ztier.dram_budget " << settings.dram_budget_bytes
                            << " bytes) is more than this machine's " << physical
                            << " bytes of memory: jobs it admits may pin more than there is";
  }
  std::unique_ptr<Engine> engine(new Engine(std::move(impl)));
  // Stepping threads (those started stop with the engine on an error).
  for (int k = 0; k < Impl::kLanes * Impl::kSteppingThreadsPerLane; ++k) {
    Impl* i = engine->impl_.get();
    const int lane = k % Impl::kLanes;
    ZT_ASSIGN_OR_RETURN(std::thread t,
                        StartThread("the engine's stepping thread", [i, lane] { i->Run(lane); }));
    i->workers.push_back(std::move(t));
  }
  return engine;
}

UnitLayout UnitLayoutOf(const JobSpec& spec, size_t unit) {
  UnitLayout l;
  for (const TensorSpec& t : spec.units[unit].tensors) {
    uint64_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    l.offsets.push_back(l.numel);
    l.numel += n;
  }
  l.padded = RoundUp(l.numel, static_cast<uint64_t>(spec.ranks) * kAlignElements);
  l.shard = l.padded / spec.ranks;
  return l;
}

Status CheckName(std::string_view what, std::string_view name, size_t prefix_bytes) {
  if (name.size() > kMaxNameBytes + prefix_bytes) {
    return Status::InvalidArgument(
        StrCat(what, " is ", name.size(), " bytes, more than ", kMaxNameBytes + prefix_bytes));
  }
  for (size_t i = 0; i < name.size();) {
    const Utf8Char ch = DecodeUtf8(name, i);
    if (ch.length == 0) {
      const auto c = static_cast<unsigned char>(name[i]);
      return Status::InvalidArgument(StrCat(what, " is not valid UTF-8 (byte ", i, ": 0x",
                                            "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15],
                                            ")"));
    }
    if (ch.code_point < 0x20 || (ch.code_point >= 0x7f && ch.code_point < 0xa0)) {
      return Status::InvalidArgument(
          StrCat(what, " holds a control character (byte ", i, ": ", ch.code_point, ")"));
    }
    // Text-direction marks and overrides reorder what follows them on an
    // operator's screen (a job's uid or state column), and line separators
    // start a line of their own in a log.
    const uint32_t c = ch.code_point;
    if (c == 0x061c || c == 0x200e || c == 0x200f || (c >= 0x2028 && c <= 0x202e) ||
        (c >= 0x2066 && c <= 0x2069)) {
      return Status::InvalidArgument(StrCat(what, " holds a text-direction or line-separator ",
                                            "character (byte ", i, ": code point ", c, ")"));
    }
    i += ch.length;
  }
  return Status::Ok();
}

Status ValidateJobSpec(const JobSpec& spec, size_t name_prefix_bytes) {
  if (spec.name.empty()) return Status::InvalidArgument("a job needs a name");
  ZT_RETURN_IF_ERROR(CheckName("the job name", spec.name, name_prefix_bytes));
  if (spec.units.empty())
    return Status::InvalidArgument(StrCat("job '", spec.name, "' has no units"));
  if (spec.units.size() > kMaxUnits) {
    return Status::InvalidArgument(
        StrCat("job '", spec.name, "' has ", spec.units.size(), " units, more than ", kMaxUnits));
  }
  if (spec.ranks < 1 || spec.ranks > 1024) {
    return Status::InvalidArgument(
        StrCat("job '", spec.name, "': ranks ", spec.ranks, " not in 1..1024"));
  }
  // Each unit keeps a little of each rank's (its grads' arrivals and
  // shards' norms), made before the job's memory is weighed against the
  // budget: bounded, so a spec cannot make the engine (ztierd) take
  // gigabytes only to refuse it.
  if (spec.units.size() * static_cast<uint64_t>(spec.ranks) > kMaxUnitRanks) {
    return Status::InvalidArgument(StrCat("job '", spec.name, "': ", spec.units.size(), " units x ",
                                          spec.ranks, " ranks is more than ", kMaxUnitRanks));
  }
  if (spec.optimizer.grad_accumulation < 1 ||
      spec.optimizer.grad_accumulation > kMaxGradAccumulation) {
    return Status::InvalidArgument(StrCat("job '", spec.name, "': gradient accumulation ",
                                          spec.optimizer.grad_accumulation, " not in 1..",
                                          kMaxGradAccumulation));
  }
  if (spec.optimizer.mode != StepMode::kExact && spec.optimizer.mode != StepMode::kEager) {
    return Status::InvalidArgument(StrCat("job '", spec.name, "': step mode ",
                                          static_cast<int>(spec.optimizer.mode), " is unknown"));
  }
  for (const auto& [what, tier] :
       {std::pair{"optimizer", spec.optimizer_tier}, std::pair{"param", spec.param_tier}}) {
    if (tier != Tier::kDram && tier != Tier::kNvme) {
      return Status::InvalidArgument(
          StrCat("job '", spec.name, "': ", what, " tier ", static_cast<int>(tier), " is unknown"));
    }
  }
  if (spec.state_dtype.has_value() && *spec.state_dtype != StateDtype::kFp32 &&
      *spec.state_dtype != StateDtype::kInt8) {
    return Status::InvalidArgument(StrCat("job '", spec.name, "': state dtype ",
                                          static_cast<int>(*spec.state_dtype), " is unknown"));
  }
  if (spec.optimizer.mode == StepMode::kEager && spec.optimizer.clip_norm > 0.0f) {
    return Status::InvalidArgument(
        StrCat("job '", spec.name,
               "': eager updates cannot apply global-norm clipping (the norm is "
               "known only after the last grad); use exact mode or clip_norm 0"));
  }
  if (!(spec.optimizer.clip_norm >= 0.0f) || !std::isfinite(spec.optimizer.clip_norm)) {
    return Status::InvalidArgument(
        StrCat("job '", spec.name, "': clip_norm must be finite and >= 0"));
  }
  ZT_RETURN_IF_ERROR(
      cpu_adam::ValidateHyper(spec.optimizer.hyper).Annotate(StrCat("job '", spec.name, "'")));
  const std::vector<float>& group_decay = spec.optimizer.group_weight_decay;
  if (group_decay.size() > kMaxParamGroups) {
    return Status::InvalidArgument(StrCat("job '", spec.name, "' has ", group_decay.size(),
                                          " param groups, more than ", kMaxParamGroups));
  }
  for (size_t g = 0; g < group_decay.size(); ++g) {
    if (!std::isfinite(group_decay[g]) || group_decay[g] < 0.0f) {
      return Status::InvalidArgument(StrCat("job '", spec.name, "': param group ", g,
                                            " has weight decay ", group_decay[g],
                                            "; it must be finite and >= 0"));
    }
  }
  const uint64_t groups = group_decay.empty() ? 1 : group_decay.size();
  if (spec.param_tier == Tier::kNvme && spec.optimizer_tier != Tier::kNvme) {
    return Status::InvalidArgument(
        StrCat("job '", spec.name,
               "': bf16 params on nvme need the optimizer states on nvme too (params take 2 of "
               "the 16 bytes a parameter needs; move the other 12 first)"));
  }
  uint64_t job_elements = 0;
  for (size_t k = 0; k < spec.units.size(); ++k) {
    const UnitSpec& us = spec.units[k];
    if (us.name.empty()) {
      return Status::InvalidArgument(StrCat("job '", spec.name, "' unit ", k, " has no name"));
    }
    ZT_RETURN_IF_ERROR(CheckName(StrCat("job '", spec.name, "' unit ", k, "'s name"), us.name));
    const std::string where = StrCat("job '", spec.name, "' unit '", us.name, "'");
    if (us.tensors.empty()) return Status::InvalidArgument(StrCat(where, " is empty"));
    if (us.tensors.size() > kMaxTensorsPerUnit) {
      return Status::InvalidArgument(
          StrCat(where, " has ", us.tensors.size(), " tensors, more than ", kMaxTensorsPerUnit));
    }
    uint64_t unit_elements = 0;
    for (size_t t = 0; t < us.tensors.size(); ++t) {
      const TensorSpec& ts = us.tensors[t];
      if (ts.name.empty()) {
        return Status::InvalidArgument(StrCat(where, " tensor ", t, " has no name"));
      }
      ZT_RETURN_IF_ERROR(CheckName(StrCat(where, " tensor ", t, "'s name"), ts.name));
      if (ts.group >= groups) {
        return Status::InvalidArgument(StrCat(
            where, " tensor '", ts.name, "' is in param group ", ts.group, "; the job has ", groups,
            group_decay.empty() ? " (no group_weight_decay)" : " (group_weight_decay)"));
      }
      if (ts.shape.size() > kMaxDims) {
        return Status::InvalidArgument(StrCat(where, " tensor '", ts.name, "' has ",
                                              ts.shape.size(), " dimensions, more than ",
                                              kMaxDims));
      }
      uint64_t n = 1;
      for (int64_t d : ts.shape) {
        if (d <= 0) {
          return Status::InvalidArgument(
              StrCat(where, " tensor '", ts.name, "' has a dimension <= 0"));
        }
        const std::optional<uint64_t> p = CheckedMul(n, static_cast<uint64_t>(d));
        if (!p || *p > kMaxUnitElements) {
          return Status::InvalidArgument(StrCat(where, " tensor '", ts.name, "' has more than ",
                                                kMaxUnitElements, " elements"));
        }
        n = *p;
      }
      unit_elements += n;
      if (unit_elements > kMaxUnitElements) {
        return Status::InvalidArgument(
            StrCat(where, " has more than ", kMaxUnitElements, " elements; split it"));
      }
    }
    job_elements += unit_elements;
    if (job_elements > kMaxJobElements) {
      return Status::InvalidArgument(
          StrCat("job '", spec.name, "' has more than ", kMaxJobElements, " elements"));
    }
  }
  return Status::Ok();
}

Result<int> Engine::RegisterJob(
    const JobSpec& spec,
    const std::function<Status(uint64_t dram_bytes, uint64_t nvme_bytes)>& admit) {
  Impl& e = *impl_;
  // Room for ztierd's scope before the name ("uid4294967295/"); its client
  // checked the name without it.
  ZT_RETURN_IF_ERROR(ValidateJobSpec(spec, /*name_prefix_bytes=*/16));
  const std::vector<float>& group_decay = spec.optimizer.group_weight_decay;
  const uint64_t groups = group_decay.empty() ? 1 : group_decay.size();
  if (spec.optimizer_tier == Tier::kNvme && e.swap == nullptr) {
    return Status::FailedPrecondition(
        StrCat("job '", spec.name,
               "': optimizer states on nvme need swap directories, one per drive: the "
               "setting zero_optimization.offload_optimizer.nvme_path (a config file's key; "
               "in Python, settings={\"zero_optimization.offload_optimizer.nvme_path\": "
               "\"/path\"}) or the variable ZTIER_NVME_PATHS"));
  }
  {
    std::lock_guard<std::mutex> lock(e.mu);
    bool taken = e.registering.count(spec.name) != 0;
    for (const auto& [id, j] : e.jobs) taken = taken || j->spec.name == spec.name;
    if (taken) {
      return Status::AlreadyExists(StrCat("job '", spec.name, "' is already registered"));
    }
    e.registering.insert(spec.name);
  }
  // The name is this registration's until it returns (registered or not).
  struct NameHeld {
    Impl& e;
    const std::string& name;
    ~NameHeld() {
      std::lock_guard<std::mutex> lock(e.mu);
      e.registering.erase(name);
    }
  } name_held{e, spec.name};

  auto job = std::make_shared<Job>();
  job->spec = spec;
  job->state_dtype = spec.state_dtype.value_or(e.settings.state_dtype);
  job->pool = e.pool.get();
  {
    // Ids are never reused, so swap objects of a job that is still being
    // torn down (a task may hold it a moment longer) never clash by name.
    std::lock_guard<std::mutex> lock(e.mu);
    job->id = e.next_job++;
  }
  job->units = std::vector<Unit>(spec.units.size());
  const bool nvme_params = spec.param_tier == Tier::kNvme;
  // What a swap object of `bytes` takes on the drives: whole stripe units
  // (the quotas and ztierctl count this, the space the files give up).
  const auto SwapFootprint = [&](uint64_t bytes) {
    return RoundUp(bytes, e.settings.stripe_bytes);
  };
  if (spec.optimizer_tier == Tier::kNvme) {
    job->ring = std::make_unique<StateRing>();
    job->ring->swap = e.swap.get();
  }
  job->lrs.assign(groups, spec.optimizer.hyper.lr);
  // Units are updated in runs of tensors when the job has groups or frozen
  // tensors, in one pass otherwise (as they always were).
  bool split = !group_decay.empty();
  for (const UnitSpec& us : spec.units) {
    for (const TensorSpec& t : us.tensors) split = split || t.frozen;
  }
  uint64_t job_elements = 0;
  uint64_t zero_elements = 0;  // the largest stateless unit
  for (size_t k = 0; k < spec.units.size(); ++k) {
    const UnitSpec& us = spec.units[k];
    Unit& u = job->units[k];
    u.layout = UnitLayoutOf(spec, k);  // ValidateJobSpec bounded every figure
    u.quant_cuts = cpu_adam::QuantCuts(u.layout.offsets, u.layout.padded);
    for (size_t t = 0; split && t < us.tensors.size(); ++t) {
      const TensorSpec& ts = us.tensors[t];
      if (!u.runs.empty() && u.runs.back().group == ts.group && u.runs.back().frozen == ts.frozen) {
        continue;
      }
      if (!u.runs.empty()) u.runs.back().end = u.layout.offsets[t];
      u.runs.push_back({.begin = u.layout.offsets[t], .group = ts.group, .frozen = ts.frozen});
    }
    if (!u.runs.empty()) u.runs.back().end = u.layout.padded;  // the padding too
    u.stateless = spec.optimizer_tier == Tier::kDram &&
                  std::all_of(us.tensors.begin(), us.tensors.end(),
                              [](const TensorSpec& t) { return t.frozen; });
    if (u.stateless) {  // its zeros read as fp32 or as 8-bit m and v
      zero_elements =
          std::max({zero_elements, u.layout.padded, (MomentBytes(u, StateDtype::kInt8) + 3) / 4});
    }
    u.arrived.assign(spec.ranks, 0);
    u.shard_sq.assign(spec.ranks, 0.0);
    job_elements += u.layout.padded;
    if (job_elements > kMaxJobElements) {
      return Status::InvalidArgument(
          StrCat("job '", spec.name, "' has more than ", kMaxJobElements, " elements"));
    }
  }
  // The swap objects the loop below allocates, in whole stripe units.
  uint64_t nvme_need = 0;
  uint64_t path_need = 0;  // the most one path may need: objects' stripes are dealt round robin
  const uint64_t swap_paths = std::max<uint64_t>(e.settings.nvme_paths.size(), 1);
  const auto on_one_path = [&](uint64_t footprint) {
    return (footprint / e.settings.stripe_bytes + swap_paths - 1) / swap_paths *
           e.settings.stripe_bytes;
  };
  const auto need = [&](uint64_t bytes, uint64_t copies) {
    nvme_need += copies * SwapFootprint(bytes);
    path_need += copies * on_one_path(SwapFootprint(bytes));
  };
  for (const Unit& u : job->units) {
    if (job->ring != nullptr) need(StateBytes(u, job->state_dtype), 1);
    if (nvme_params) need(ParamBytes(u.layout), 2);
  }
  // The swap files' cap, for the whole job up front (as its DRAM): a unit at
  // a time, each refusal named the next unit's shortfall only, and the cap
  // was raised unit by unit.
  const auto check_swap_cap = [&]() -> Status {
    if (nvme_need == 0 || e.swap == nullptr || e.settings.nvme_capacity_per_path == 0) {
      return Status::Ok();
    }
    const std::vector<nvme::SwapSpace::PathUsage> usage = e.swap->path_usage();
    const uint64_t cap = e.settings.nvme_capacity_per_path;
    uint64_t used = 0, most_used = 0;
    for (const auto& u : usage) {
      used += u.used_bytes;
      most_used = std::max(most_used, u.used_bytes);
    }
    const uint64_t paths = swap_paths;  // usage.size(): the settings' paths
    // used + need > cap x paths, without the product (a cap near 2^64).
    if ((used + nvme_need + paths - 1) / paths > cap) {
      const uint64_t per_path = most_used + path_need;  // enough however the stripes fall
      return Status::ResourceExhausted(
          StrCat("job '", spec.name, "' needs ", nvme_need, " bytes of swap space, and ", used,
                 " are in use of the swap files' cap of ", cap, " bytes per path x ", paths,
                 " path(s) (ztier.nvme_capacity): raise it to at least ", per_path,
                 " bytes per path, or keep states in DRAM"));
    }
    return Status::Ok();
  };
  // Short of DRAM or swap while unregistered jobs still hold theirs (a run
  // killed mid-step and started again at once): their steps stop at their
  // next unit, and the checks are made again as each goes.
  const auto check_room = [&]() -> Result<uint64_t> {
    ZT_ASSIGN_OR_RETURN(const uint64_t dram, e.CheckDramNeed(*job));
    ZT_RETURN_IF_ERROR(check_swap_cap());
    return dram;
  };
  uint64_t seen = 0;
  {
    std::lock_guard<std::mutex> lock(e.retiring_mu);
    seen = e.gone;
  }
  const auto deadline = std::chrono::steady_clock::now() + kRetiringWait;
  Result<uint64_t> room = check_room();
  while (room.status().code() == StatusCode::kResourceExhausted &&
         e.WaitForRetiring(&seen, deadline, StrCat("job '", spec.name, "'"))) {
    room = check_room();
  }
  ZT_ASSIGN_OR_RETURN(const uint64_t dram_need, std::move(room));
  if (admit) ZT_RETURN_IF_ERROR(admit(dram_need, nvme_need));
  job->counters.nvme_bytes = nvme_need;  // what the job holds once registered
  if (zero_elements > 0) {
    const size_t bytes = zero_elements * sizeof(float);
    void* zeros =
        mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (zeros == MAP_FAILED) {
      return PosixError(StrCat("job '", spec.name, "': zeros for the frozen units' moments"),
                        errno);
    }
    job->zero_state = std::shared_ptr<void>(zeros, [bytes](void* p) { munmap(p, bytes); });
    for (Unit& u : job->units) {
      if (u.stateless) u.zero_state = static_cast<const float*>(zeros);
    }
  }
  uint64_t slot = 0, param_slot = 0;
  for (const Unit& u : job->units) {
    slot =
        std::max(slot, StateBytes(u, job->state_dtype) + (nvme_params ? ParamBytes(u.layout) : 0));
    param_slot = std::max(param_slot, ParamBytes(u.layout));
  }
  // What clients touch lives in regions of the job's own, never shared with
  // another job (DramPool::CreateRegion): the grad inboxes, which clients
  // write, and the publish buffers or the param cache, which they only read
  // (sealed so no other process can map them writable). States, the
  // accumulators and the staging ring stay in the engine's shared regions.
  const auto page = [](uint64_t b) { return RoundUp(b, 4096); };
  uint64_t inbox_bytes = 0, publish_bytes = 0;
  for (const Unit& u : job->units) {
    inbox_bytes += page(u.layout.padded * 2);
    if (!nvme_params) publish_bytes += page(u.layout.padded * 2);
  }
  inbox_bytes += page(ClientPageBytes(spec));
  if (nvme_params) publish_bytes = e.settings.buffer_count * page(param_slot);
  publish_bytes += page(StepPageBytes(job->units.size()));
  ZT_ASSIGN_OR_RETURN(
      job->inbox_region,
      e.pool->CreateRegion(inbox_bytes, StrCat("job '", spec.name, "' grad inboxes")));
  job->shared_regions.push_back(job->inbox_region);
  ZT_ASSIGN_OR_RETURN(job->publish_region,
                      e.pool->CreateRegion(publish_bytes, StrCat("job '", spec.name, "' params")));
  job->shared_regions.push_back(job->publish_region);
  job->counters.dram_bytes += inbox_bytes + publish_bytes;
  // The staging ring first (its slots are the largest blocks), then each
  // unit's buffers and swap object.
  if (job->ring != nullptr) {
    for (uint32_t i = 0; i < e.settings.buffer_count; ++i) {
      ZT_ASSIGN_OR_RETURN(DramBlock b,
                          e.pool->Allocate(slot, StrCat("job '", spec.name, "' staging ring")));
      job->ring->slots.push_back(b);
      job->counters.dram_bytes += b.bytes;
    }
    if (nvme_params) {
      job->params = std::make_unique<ParamCache>();
      for (uint32_t i = 0; i < e.settings.buffer_count; ++i) {
        ZT_ASSIGN_OR_RETURN(DramBlock b,
                            e.pool->AllocateIn(job->publish_region, param_slot,
                                               StrCat("job '", spec.name, "' param cache")));
        job->params->slots.emplace_back().block = b;
      }
    }
  }
  ZT_ASSIGN_OR_RETURN(job->step_page,
                      e.pool->AllocateIn(job->publish_region, StepPageBytes(spec.units.size()),
                                         StrCat("job '", spec.name, "' step page")));
  std::fill_n(static_cast<int64_t*>(job->step_page.ptr), spec.units.size(), int64_t{-1});
  Impl::WeightsGenerationOf(*job).store(0);
  ZT_ASSIGN_OR_RETURN(job->client_page,
                      e.pool->AllocateIn(job->inbox_region, ClientPageBytes(spec),
                                         StrCat("job '", spec.name, "' client page")));
  std::memset(job->client_page.ptr, 0, ClientPageBytes(spec));
  for (size_t k = 0; k < spec.units.size(); ++k) {
    const UnitSpec& us = spec.units[k];
    Unit& u = job->units[k];
    const std::string owner = StrCat("job '", spec.name, "' unit '", us.name, "'");
    const uint64_t n = u.layout.padded;
    const bool dram_states = job->ring == nullptr;
    const bool moments = dram_states && !u.stateless;
    const bool int8 = job->state_dtype == StateDtype::kInt8;  // m and v in one block
    for (auto [block, bytes] :
         {std::pair{&u.master, dram_states ? n * 4 : 0},
          {&u.exp_avg, moments ? (int8 ? MomentBytes(u, StateDtype::kInt8) : n * 4) : 0},
          {&u.exp_avg_sq, moments && !int8 ? n * 4 : 0},
          {&u.accum, spec.optimizer.grad_accumulation > 1 ? n * 4 : 0}}) {
      if (bytes == 0) continue;
      ZT_ASSIGN_OR_RETURN(*block, e.pool->Allocate(bytes, owner));
      job->counters.dram_bytes += block->bytes;
    }
    ZT_ASSIGN_OR_RETURN(u.inbox, e.pool->AllocateIn(job->inbox_region, n * 2, owner));
    if (!nvme_params) {
      ZT_ASSIGN_OR_RETURN(u.publish, e.pool->AllocateIn(job->publish_region, n * 2, owner));
    }
    if (!dram_states) {
      Result<uint64_t> object =
          e.swap->Allocate(StrCat("job", job->id, "/unit", k), StateBytes(u, job->state_dtype));
      if (!object.ok()) return object.status().Annotate(owner);
      u.swap_object = *object;
    }
    for (int copy = 0; nvme_params && copy < 2; ++copy) {
      Result<uint64_t> object = e.swap->Allocate(
          StrCat("job", job->id, "/unit", k, "/params", copy), ParamBytes(u.layout));
      if (!object.ok()) return object.status().Annotate(owner);
      u.param_objects[copy] = *object;
    }
  }
  ZT_RETURN_IF_ERROR(e.pool->SealRegion(job->inbox_region, RegionAccess::kReadWrite));
  ZT_RETURN_IF_ERROR(e.pool->SealRegion(job->publish_region, RegionAccess::kReadOnly));
  std::lock_guard<std::mutex> lock(e.mu);
  e.jobs[job->id] = job;
  return job->id;
}

Status Engine::UnregisterJob(int job) {
  Impl& e = *impl_;
  std::shared_ptr<Job> j;
  {
    std::unique_lock<std::mutex> lock(e.mu);
    ZT_ASSIGN_OR_RETURN(j, e.Find(job));
    j->removed = true;
    e.jobs.erase(job);
    {
      std::lock_guard<std::mutex> retiring(e.retiring_mu);
      ++e.retiring;
    }
    j->on_gone = [&e] {
      {
        std::lock_guard<std::mutex> retiring(e.retiring_mu);
        --e.retiring;
        ++e.gone;
      }
      e.retiring_cv.notify_all();
    };
    Impl::AddTotals(e.retired, e.CountersLocked(*j));
    // A save under way keeps its directory's claim until it is done: let go
    // sooner, another job could claim the directory and each save remove
    // the other's files.
    e.published_cv.wait(lock, [&] { return !j->checkpointing; });
  }
  e.dirs.Release(job);
  e.published_cv.notify_all();
  // Its memory goes back to the pool when the last holder drops `j`: a
  // step under way stops at its next unit (StepExact), a queued one at
  // once. Until then a registration short of DRAM waits for it.
  return Status::Ok();
}

Result<UnitLayout> Engine::Layout(int job, int unit) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  if (unit < 0 || unit >= static_cast<int>(j->units.size())) {
    return Status::OutOfRange(StrCat("job ", job, " has no unit ", unit));
  }
  return j->units[unit].layout;
}

// What a call under WithIdleJob does to the job's state.
enum class StateUse { kReads, kReplaces };
// How a call under WithIdleJob enters.
struct IdleEntry {
  // Waits for a call under way (a unit's write of another client's load,
  // another unit's weights) rather than be refused "in progress": for the
  // short calls of a state written unit by unit, whose order the weights
  // generation checks.
  bool wait_turn = false;
  // Checked under the engine lock before the job is marked: a refusal
  // changes nothing (a call that ran and failed counts as a replacement).
  std::function<Status(const Job&)> check;
};
template <class Fn>
Status WithIdleJob(Engine::Impl& e, int job, std::string_view what, StateUse use, const Fn& fn,
                   const IdleEntry& entry = {});

constexpr std::string_view kInitialWeightsOnly =
    "initial weights go in before the first step (load a checkpoint or import safetensors to "
    "replace them later)";

Status Engine::WriteWeights(int job, int unit, const float* flat, uint64_t numel) {
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
  }
  if (unit < 0 || unit >= static_cast<int>(j->units.size())) {
    return Status::OutOfRange(StrCat("job ", job, " has no unit ", unit));
  }
  Unit& u = j->units[unit];
  if (flat == nullptr) return Status::InvalidArgument("WriteWeights: null weights");
  if (numel != u.layout.numel) {
    return Status::InvalidArgument(StrCat("unit '", j->spec.units[unit].name, "' has ",
                                          u.layout.numel, " elements, got ", numel));
  }
  // A NaN or infinite master would make every step's grads non-finite, and
  // every step skipped; one past bf16's range is published as Inf:
  // refused, naming where.
  for (uint64_t i = 0; i < numel; ++i) {
    if (FiniteInBf16(flat[i])) continue;
    const std::vector<uint64_t>& off = u.layout.offsets;
    const size_t t = std::upper_bound(off.begin(), off.end(), i) - off.begin() - 1;
    return Status::InvalidArgument(StrCat("set weights: unit '", j->spec.units[unit].name,
                                          "' tensor '", j->spec.units[unit].tensors[t].name,
                                          "' element ", i - off[t], " is ", flat[i], "; ",
                                          kWeightsInBf16Range));
  }
  {
    // Weights published as step 0 after a step would leave clients waiting
    // for a step that never comes: initial weights only.
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (j->step > 0 || u.StepInFlight()) {
      return Status::FailedPrecondition(
          StrCat("set weights: job '", j->spec.name, "' is at step ", j->step,
                 u.StepInFlight() ? " with a step in flight" : "", "; ", kInitialWeightsOnly));
    }
  }
  // The job to itself meanwhile, as a load's: it waits for a call under
  // way (another unit's weights from another thread, a unit's write of a
  // load through ztierd, a load) rather than go in between its units, and
  // a state read or the rest of a load through ztierd begun before it is
  // refused (the weights generation moves).
  const IdleEntry entry{.wait_turn = true, .check = [&](const Job& idle) -> Status {
                          if (idle.step == 0) return Status::Ok();
                          return Status::FailedPrecondition(  // a step completed meanwhile
                              StrCat("set weights: job '", idle.spec.name, "' is at step ",
                                     idle.step, "; ", kInitialWeightsOnly));
                        }};
  return WithIdleJob(
      *impl_, job, "set weights", StateUse::kReplaces,
      [&](Job& idle) -> Status {
        return WithUnitState(
            idle, unit, Access::kUpdate,
            [&](size_t, const StateView& state) {
              std::memcpy(state.master, flat, numel * sizeof(float));
              std::memset(state.master + numel, 0, (u.layout.padded - numel) * sizeof(float));
              for (uint64_t i = 0; i < u.layout.padded; ++i)
                state.publish[i] = FloatToBf16(state.master[i]);
              return Status::Ok();
            },
            [&](size_t) { impl_->Publish(idle, u, 0, [] {}); });
      },
      entry);
}

namespace {
Status StateReplacedWhileRead(const Job& j, int unit) {
  return Status::FailedPrecondition(
      StrCat("read state: the state of job '", j.spec.name,
             "' was being replaced (a checkpoint load, an import or a state write) while unit ",
             unit, " was read; read it again once that is done"));
}
}  // namespace

Status Engine::ReadState(int job, int unit, float* master, float* exp_avg,
                         float* exp_avg_sq) const {
  std::shared_ptr<Job> j;
  uint64_t posted = 0;
  uint64_t replacements = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
    if (unit < 0 || unit >= static_cast<int>(j->units.size())) {
      return Status::OutOfRange(StrCat("job ", job, " has no unit ", unit));
    }
    const Unit& u = j->units[unit];
    // (A failed job steps no more: what its units hold may be read.)
    if (j->failure.ok() && u.StepInFlight()) {
      return Status::FailedPrecondition(
          StrCat("read state: unit ", unit, " of job '", j->spec.name,
                 "' has gradients of a step in flight; read it between steps"));
    }
    if (j->failure.ok() && j->replacing) return StateReplacedWhileRead(*j, unit);
    posted = j->updates_posted;
    replacements = j->state_replacements;
  }
  const size_t bytes = j->units[unit].layout.padded * sizeof(float);
  ZT_RETURN_IF_ERROR(WithUnitState(*j, unit, Access::kRead, [&](size_t k, const StateView& state) {
    if (master) std::memcpy(master, state.master, bytes);
    MomentsToFloat(*j, j->units[k], state, exp_avg, exp_avg_sq);
    return Status::Ok();
  }));
  // The copy holds no lock a step waits for (DRAM states): one that began
  // meanwhile may have updated the unit under it.
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!j->failure.ok()) return Status::Ok();
  if (j->updates_posted != posted) {
    return Status::FailedPrecondition(
        StrCat("read state: a step of job '", j->spec.name, "' began while unit ", unit,
               " was read; read it between steps, with every rank waiting"));
  }
  if (j->replacing || j->state_replacements != replacements) {
    return StateReplacedWhileRead(*j, unit);
  }
  return Status::Ok();
}

Status Engine::SetLearningRates(int job, const std::vector<float>& lrs) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  if (lrs.size() != j->lrs.size()) {
    return Status::InvalidArgument(StrCat("job '", j->spec.name, "': ", lrs.size(),
                                          " learning rates for its ", j->lrs.size(),
                                          " param groups (one each)"));
  }
  for (size_t g = 0; g < lrs.size(); ++g) {
    if (!std::isfinite(lrs[g]) || lrs[g] < 0.0f) {
      return Status::InvalidArgument(StrCat("job '", j->spec.name,
                                            "': the learning rate of param group ", g, " is ",
                                            lrs[g], "; it must be finite and >= 0"));
    }
  }
  j->lrs = lrs;
  return Status::Ok();
}

Result<bf16*> Engine::GradInbox(int job, int unit, int rank) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  if (unit < 0 || unit >= static_cast<int>(j->units.size()) || rank < 0 || rank >= j->spec.ranks) {
    return Status::OutOfRange(StrCat("job ", job, ": no unit ", unit, " rank ", rank));
  }
  Unit& u = j->units[unit];
  return static_cast<bf16*>(u.inbox.ptr) + static_cast<uint64_t>(rank) * u.layout.shard;
}

Status Engine::GradsReady(int job, int unit, int rank) {
  Impl& e = *impl_;
  std::shared_ptr<Job> j;
  int micro;
  {
    std::unique_lock<std::mutex> lock(e.mu);
    ZT_ASSIGN_OR_RETURN(j, e.Find(job));
    if (unit < 0 || unit >= static_cast<int>(j->units.size()) || rank < 0 ||
        rank >= j->spec.ranks) {
      return Status::OutOfRange(StrCat("job ", job, ": no unit ", unit, " rank ", rank));
    }
    // A save or export began between steps (from another thread while
    // training goes on): the grads of the next step wait for it, as its
    // copy must be of one step. (Refused, they had failed the runner that
    // pushed them for good.) Grads that waited through a load, an import
    // or a state write are of the state before it: refused.
    const uint64_t replacements = j->state_replacements;
    e.published_cv.wait(lock, [&] { return !j->checkpointing || j->removed; });
    if (j->removed) return Status::Aborted(StrCat("job ", job, " was unregistered"));
    if (!j->failure.ok()) return Status::Aborted(StrCat("job failed: ", j->failure.ToString()));
    if (j->state_replacements != replacements) {
      return Status::FailedPrecondition(
          StrCat("job '", j->spec.name, "': its state was replaced (a checkpoint load, an import ",
                 "or a state write) while these grads waited: they are of the state before"));
    }
    Unit& u = j->units[unit];
    ZT_RETURN_IF_ERROR(PartlyWritten(*j));
    if (u.ready) {
      return Status::FailedPrecondition(StrCat("unit '", j->spec.units[unit].name,
                                               "': grads for the next step arrived before the "
                                               "optimizer finished this one; wait for the unit's "
                                               "publish first"));
    }
    if (u.arrived[rank]) {
      return Status::FailedPrecondition(StrCat("unit '", j->spec.units[unit].name, "' rank ", rank,
                                               ": grads already delivered for this micro-step"));
    }
    u.arrived[rank] = 1;
    micro = u.micro;
    ++j->delivering;
  }
  // Outside the lock: this rank's shard only.
  Unit& u = j->units[unit];
  const int accum_steps = j->spec.optimizer.grad_accumulation;
  const uint64_t off = static_cast<uint64_t>(rank) * u.layout.shard;
  const bf16* g = static_cast<const bf16*>(u.inbox.ptr) + off;
  const bool last_micro = micro == accum_steps - 1;
  Result<double> norm = 0.0;
  if (accum_steps > 1) {
    float* acc = u.f(u.accum) + off;
    if (micro == 0) {
      for (uint64_t i = 0; i < u.layout.shard; ++i) acc[i] = Bf16ToFloat(g[i]);
    } else {
      for (uint64_t i = 0; i < u.layout.shard; ++i) acc[i] += Bf16ToFloat(g[i]);
    }
    if (last_micro) {
      norm = cpu_adam::SquaredNorm(acc, cpu_adam::GradType::kFloat32, u.layout.shard, e.executor);
    }
  } else {
    norm = cpu_adam::SquaredNorm(g, cpu_adam::GradType::kBFloat16, u.layout.shard, e.executor);
  }
  std::lock_guard<std::mutex> lock(e.mu);
  --j->delivering;
  if (j->removed) return Status::Aborted(StrCat("job ", job, " was unregistered"));
  if (!norm.ok()) {  // null data only: never for a registered unit
    u.arrived[rank] = 0;
    return norm.status();
  }
  const double sq = *norm;
  j->counters.grad_bytes_in += u.layout.shard * sizeof(bf16);
  if (last_micro) u.shard_sq[rank] = sq;
  if (++u.arrived_count < j->spec.ranks) return Status::Ok();
  // Every rank's shard of this micro-step is in.
  u.arrived_count = 0;
  std::fill(u.arrived.begin(), u.arrived.end(), 0);
  if (!last_micro) {
    ++u.micro;
    return Status::Ok();
  }
  u.micro = 0;
  u.ready = true;
  if (j->spec.optimizer.mode == StepMode::kEager) {
    ++j->updates_posted;
    e.Post(*j, [&e, j, unit, lrs = j->lrs] { e.StepEager(j, static_cast<size_t>(unit), lrs); });
  } else if (++j->ready_units == static_cast<int>(j->units.size())) {
    // Each unit took these grads after its publish of the step before, so
    // that step has published every unit (its write-backs may still run: the
    // job's tasks run one at a time). The norm and the rates are the step's
    // from here, whatever a later call does before its task runs.
    j->ready_units = 0;
    ++j->steps_queued;
    ++j->updates_posted;
    double step_sq = 0.0;
    for (const Unit& each : j->units) {
      for (double s : each.shard_sq) step_sq += s;  // unit, then rank order: deterministic
    }
    e.Post(*j, [&e, j, step_sq, lrs = j->lrs] { e.StepExact(j, step_sq, lrs); });
  } else if (j->ready_units == 1 && j->ring != nullptr) {
    // The step's first unit is ready, backward goes on: the step's first
    // units' states are read from the drives meanwhile (after the previous
    // step, on the job's strand), so the step starts with them in DRAM.
    e.Post(*j, [j] { PreloadUnitStates(*j, ForwardOrder(*j)); });
  }
  return Status::Ok();
}

Result<int> Engine::AbortStep(int job, int64_t for_step) {
  Impl& e = *impl_;
  std::unique_lock<std::mutex> lock(e.mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, e.Find(job));
  // A step queued or running whose units took grads of the next one
  // meanwhile (published already, or only made visible before their
  // write-backs with states on NVMe), or one before `for_step` (an abort
  // right after Step(), nothing of its own pushed yet): what is discarded
  // comes after it, once it completes. A queued step without such grads
  // is the one asked about.
  if (j->spec.optimizer.mode == StepMode::kExact && j->steps_queued > 0) {
    const bool next = for_step > j->step + j->steps_queued || j->ready_units > 0 ||
                      std::any_of(j->units.begin(), j->units.end(),
                                  [](const Unit& u) { return u.micro > 0 || u.arrived_count > 0; });
    if (next) {
      e.published_cv.wait(lock,
                          [&] { return j->steps_queued == 0 || !j->failure.ok() || j->removed; });
    }
  } else {
    if (j->spec.optimizer.mode == StepMode::kEager) {
      // Every unit's grads of the step before `for_step` are in (an abort
      // right after Step()): its eager updates still queued are that
      // step's, and it completes without more grads.
      const auto before_is_in = [&] {
        return std::all_of(j->units.begin(), j->units.end(),
                           [&](const Unit& u) { return u.ready || u.published > j->step; });
      };
      if (for_step > j->step + 1 && before_is_in()) {
        // That one step, however far ahead `for_step` is (nothing more
        // comes without grads).
        const int64_t running = j->step + 1;
        e.published_cv.wait(lock,
                            [&] { return j->step >= running || !j->failure.ok() || j->removed; });
      }
    }
    e.WaitWriteBacksLocked(lock, *j);
  }
  if (j->removed) return Status::Aborted(StrCat("job ", job, " was unregistered"));
  if (!j->failure.ok()) return Status::Aborted(StrCat("job failed: ", j->failure.ToString()));
  if (for_step < 1) {
    return Status::InvalidArgument(
        StrCat("job '", j->spec.name, "': abort of step ", for_step, ": steps count from 1"));
  }
  if (j->step >= for_step) {
    // The grads went in and their step completed before the call (a
    // backward that failed after its last push): nothing pending is that
    // step's, and dropping nothing left the caller a step behind the job.
    return Status::FailedPrecondition(
        StrCat("job '", j->spec.name, "': cannot discard the grads of step ", for_step,
               ": the optimizer has applied them (the job is at step ", j->step,
               "); finish the step (Step) and go on from there"));
  }
  const std::string what =
      StrCat("job '", j->spec.name, "': cannot discard the grads of step ", for_step);
  if (j->checkpointing) {
    return Status::FailedPrecondition(StrCat(what, ": a checkpoint save or load is in progress"));
  }
  if (j->delivering > 0) {
    return Status::FailedPrecondition(
        StrCat(what, ": grads are being delivered (", j->delivering,
               " GradsReady in flight); every rank's pushes must have returned"));
  }
  const bool exact = j->spec.optimizer.mode == StepMode::kExact;
  // Begun: an exact step is queued (every unit's grads in) or has published
  // some units; an eager one has a unit queued or published.
  const int64_t step = j->step;
  const bool begun = (exact && j->steps_queued > 0) ||
                     std::any_of(j->units.begin(), j->units.end(), [&](const Unit& u) {
                       return (!exact && u.ready) || u.published > step;
                     });
  if (begun) {
    return Status::FailedPrecondition(
        StrCat(what, ": the optimizer has begun to apply them (",
               exact ? "every unit's grads are in" : "eager mode: a unit's grads are in",
               "); wait for the step"));
  }
  // Micro-steps complete on a unit: a ready unit's are all of the step's.
  const int accum = j->spec.optimizer.grad_accumulation;
  auto done = [&](const Unit& u) { return u.ready ? accum : u.micro; };
  int complete = accum;
  for (const Unit& u : j->units) complete = std::min(complete, done(u));
  bool partial = false;
  for (Unit& u : j->units) {
    partial = partial || done(u) > complete || u.arrived_count > 0;
    std::fill(u.arrived.begin(), u.arrived.end(), 0);
    std::fill(u.shard_sq.begin(), u.shard_sq.end(), 0.0);
    u.arrived_count = 0;
    u.micro = 0;
    u.ready = false;
  }
  j->ready_units = 0;
  if (complete > 0 || partial) {
    std::string which = "some units'";
    if (accum > 1) {
      which = complete == 0 ? std::string("part of its first micro-step")
                            : StrCat(complete, " of its ", accum, " micro-steps",
                                     partial ? ", and part of the next" : "");
    }
    ZT_LOG(kWarn, "engine") << "job '" << j->spec.name
                            << "': discarded the grads delivered toward step " << j->step + 1
                            << " (" << which << "); the job holds step " << j->step;
  }
  return complete;
}

Result<const bf16*> Engine::Published(int job, int unit) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  if (unit < 0 || unit >= static_cast<int>(j->units.size())) {
    return Status::OutOfRange(StrCat("job ", job, " has no unit ", unit));
  }
  if (j->params != nullptr) {
    return Status::FailedPrecondition(
        StrCat("job '", j->spec.name, "' keeps its params on nvme: use AcquireParams"));
  }
  return static_cast<const bf16*>(j->units[unit].publish.ptr);
}

Result<const bf16*> Engine::AcquireParams(int job, int unit, int64_t step,
                                          std::chrono::milliseconds timeout) {
  Impl& e = *impl_;
  timeout = ClampWait(timeout);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ZT_RETURN_IF_ERROR(WaitPublished(job, unit, step, timeout));
  std::unique_lock<std::mutex> lock(e.mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, e.Find(job));
  if (j->params == nullptr) return static_cast<const bf16*>(j->units[unit].publish.ptr);
  ParamCache& pc = *j->params;
  const int units = static_cast<int>(j->units.size());
  // Starts reading unit k's current params into slot i.
  auto start_read = [&](size_t i, int k, int leases) {
    ParamSlot& slot = pc.slots[i];
    const Unit& u = j->units[k];
    slot.unit = k;
    slot.leases = leases;
    slot.stale = false;
    slot.last_use = ++pc.clock;
    const nvme::IoRange range{.object = u.param_objects[u.param_current.load()],
                              .offset = 0,
                              .length = ParamBytes(u.layout),
                              .buffer = slot.block.ptr};
    slot.read = e.swap->Submit(nvme::IoDirection::kRead, {&range, 1});
    pc.bytes_read.fetch_add(ParamBytes(u.layout), std::memory_order_relaxed);
  };
  // The least recently used slot nobody holds and no read is filling.
  auto free_slot = [&]() -> int {
    int best = -1;
    for (size_t i = 0; i < pc.slots.size(); ++i) {
      const ParamSlot& slot = pc.slots[i];
      if (slot.leases > 0 || (slot.read.valid() && !slot.read.Done())) continue;
      if (best < 0 || slot.last_use < pc.slots[best].last_use) best = static_cast<int>(i);
    }
    return best;
  };
  auto cached = [&](int k) -> int {
    for (size_t i = 0; i < pc.slots.size(); ++i) {
      if (pc.slots[i].unit == k && !pc.slots[i].stale) return static_cast<int>(i);
    }
    return -1;
  };
  int index = -1;
  for (;;) {
    if (j->removed) return Status::Aborted(StrCat("job ", job, " was unregistered"));
    if (!j->failure.ok()) return Status::Aborted(StrCat("job failed: ", j->failure.ToString()));
    index = cached(unit);
    if (index >= 0) {
      ++pc.slots[index].leases;
      pc.slots[index].last_use = ++pc.clock;
      break;
    }
    index = free_slot();
    if (index >= 0) {
      start_read(index, unit, 1);
      break;
    }
    if (e.published_cv.wait_until(lock, deadline) == std::cv_status::timeout) {
      return Status::Unavailable(
          StrCat("job '", j->spec.name, "': all ", pc.slots.size(),
                 " param cache slots are held; release units (ReleaseParams) or raise "
                 "buffer_count",
                 e.StallNote(timeout)));
    }
  }
  // Prefetch the next units in the direction the client walks (forward, or
  // backward in the backward pass) into slots nobody holds.
  const int dir = pc.last_unit > unit ? -1 : 1;
  pc.last_unit = unit;
  const int depth = std::max<int>(1, static_cast<int>(pc.slots.size()) - 2);
  for (int d = 1, k = unit + dir; d <= depth && k >= 0 && k < units; ++d, k += dir) {
    if (cached(k) >= 0 || j->units[k].published < 0) continue;
    const int i = free_slot();
    if (i < 0) break;
    start_read(i, k, 0);
  }
  const nvme::IoTicket ticket = pc.slots[index].read;
  lock.unlock();
  Status s = ticket.valid() ? ticket.Wait() : Status::Ok();
  if (!s.ok()) {
    lock.lock();
    ParamSlot& slot = pc.slots[index];
    --slot.leases;
    if (slot.unit == unit) slot.stale = true;  // read again on the next acquire
    if (slot.leases == 0 && slot.stale) slot.unit = -1;
    e.published_cv.notify_all();
    return s.Annotate(StrCat("read params of unit '", j->spec.units[unit].name, "'"));
  }
  return static_cast<const bf16*>(pc.slots[index].block.ptr);
}

Status Engine::ReleaseParams(int job, int unit) {
  Impl& e = *impl_;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, e.Find(job));
    if (unit < 0 || unit >= static_cast<int>(j->units.size())) {
      return Status::OutOfRange(StrCat("job ", job, " has no unit ", unit));
    }
    if (j->params == nullptr) return Status::Ok();
    ParamSlot* held = nullptr;
    for (ParamSlot& slot : j->params->slots) {
      if (slot.unit == unit && slot.leases > 0 && (held == nullptr || slot.stale)) held = &slot;
    }
    if (held == nullptr) {
      return Status::FailedPrecondition(
          StrCat("unit ", unit, " of job '", j->spec.name, "' is not acquired"));
    }
    if (--held->leases == 0 && held->stale) held->unit = -1;
    if (held->leases == 0 && e.settings.poison_released_params) {
      // Test mode: whatever still reads this slot after its last release
      // reads NaNs (0xffff bf16), and the slot is read again next time.
      std::memset(held->block.ptr, 0xff, held->block.bytes);
      held->unit = -1;
    }
  }
  e.published_cv.notify_all();
  return Status::Ok();
}

int64_t Engine::PublishedStep(int job, int unit) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Result<std::shared_ptr<Job>> j = impl_->Find(job);
  if (!j.ok() || unit < 0 || unit >= static_cast<int>((*j)->units.size())) return -1;
  return (*j)->units[unit].published;
}

int64_t Engine::WeightsGeneration(int job) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Result<std::shared_ptr<Job>> j = impl_->Find(job);
  if (!j.ok()) return -1;
  return Impl::WeightsGenerationOf(**j).load(std::memory_order_acquire);
}

int64_t Engine::TargetStep(int job) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Result<std::shared_ptr<Job>> found = impl_->Find(job);
  if (!found.ok()) return -1;
  const Job& j = **found;
  int64_t low = INT64_MAX, high = -1;
  bool all_ready = true, any_ready = false;
  for (const Unit& u : j.units) {
    if (u.published < 0) return -1;
    low = std::min(low, u.published);
    high = std::max(high, u.published);
    all_ready = all_ready && u.ready;
    any_ready = any_ready || u.ready;
  }
  if (high > low) return high;  // a step is being published unit by unit
  if (j.spec.optimizer.mode == StepMode::kExact) {
    // Exact mode steps once every unit's grads are in; some of them only
    // (a client that died mid-backward) make no step.
    return all_ready ? low + 1 : low;
  }
  return any_ready ? low + 1 : low;  // eager: a ready unit is being updated
}

namespace {
// What a client may do in one of the job's regions: write its grad inboxes,
// only read the rest.
RegionAccess OthersAccess(const Job& j, uint32_t region) {
  return region == j.inbox_region ? RegionAccess::kReadWrite : RegionAccess::kReadOnly;
}
}  // namespace

Result<SharedBuffer> Engine::Locate(int job, const void* ptr, uint64_t bytes) const {
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
  }
  const auto* p = static_cast<const char*>(ptr);
  for (uint32_t r : j->shared_regions) {
    const auto [base, size] = impl_->pool->region(r);
    const auto* b = static_cast<const char*>(base);
    if (b == nullptr || p < b || p >= b + size) continue;
    const uint64_t offset = static_cast<uint64_t>(p - b);
    if (bytes > size - offset) break;
    return SharedBuffer{.region = r,
                        .region_bytes = size,
                        .offset = offset,
                        .bytes = bytes,
                        .access = OthersAccess(*j, r)};
  }
  return Status::InvalidArgument(
      StrCat("job '", j->spec.name, "': ", bytes, " bytes at ", ptr, " are not in its regions"));
}

Result<SharedBuffer> Engine::PublishedSteps(int job) const {
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
  }
  return Locate(job, j->step_page.ptr, StepPageBytes(j->units.size()));
}

Result<std::vector<SharedBuffer>> Engine::SharedRegions(int job) const {
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
  }
  std::vector<SharedBuffer> out;
  for (uint32_t r : j->shared_regions) {
    const uint64_t size = impl_->pool->region(r).second;
    if (size == 0) continue;
    out.push_back(SharedBuffer{.region = r,
                               .region_bytes = size,
                               .offset = 0,
                               .bytes = size,
                               .access = OthersAccess(*j, r)});
  }
  return out;
}

Result<UniqueFd> Engine::DupRegionFd(int job, uint32_t region) const {
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
  }
  if (std::find(j->shared_regions.begin(), j->shared_regions.end(), region) ==
      j->shared_regions.end()) {
    return Status::NotFound(StrCat("job '", j->spec.name, "' has no region ", region));
  }
  return impl_->pool->ShareFd(region);
}

Status Engine::WaitPublished(int job, int unit, int64_t step, std::chrono::milliseconds timeout) {
  Impl& e = *impl_;
  std::unique_lock<std::mutex> lock(e.mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, e.Find(job));
  if (unit < 0 || unit >= static_cast<int>(j->units.size())) {
    return Status::OutOfRange(StrCat("job ", job, " has no unit ", unit));
  }
  // A client reaches step s + 1 by sending the grads of step s: a wait for
  // more than one step past the job's can never end (a client that resumed
  // at the wrong step, say). Say so now rather than at the timeout.
  // (A unit made visible before its write-back is done is a step ahead of
  // the job.)
  if (!j->checkpointing) ZT_RETURN_IF_ERROR(PartlyWritten(*j));
  const int64_t done = std::max(j->step, j->units[unit].published);
  if (step > done + 1) {
    return Status::FailedPrecondition(
        StrCat("job '", j->spec.name, "': unit ", unit, " cannot reach step ", step,
               ": the job has done ", done, " steps and only the grads of step ", done + 1,
               " can come next (a client at the wrong step, e.g. after a resume?)"));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const bool ok = e.published_cv.wait_for(lock, ClampWait(timeout), [&] {
    return j->units[unit].published >= step || j->removed || !j->failure.ok();
  });
  j->counters.stall_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (j->removed) return Status::Aborted(StrCat("job ", job, " was unregistered"));
  if (!j->failure.ok()) return Status::Aborted(StrCat("job failed: ", j->failure.ToString()));
  if (!ok) {
    return Status::Unavailable(StrCat("job '", j->spec.name, "' unit '", j->spec.units[unit].name,
                                      "' did not reach step ", step, " within ", timeout.count(),
                                      " ms (holds step ", j->units[unit].published, ")",
                                      e.StallNote(timeout)));
  }
  return Status::Ok();
}

namespace {
// Under the engine lock: the job has no grads of a step pending.
Status CheckIdle(const Job& j, std::string_view what) {
  if (!j.failure.ok()) return Status::Aborted(StrCat("job failed: ", j.failure.ToString()));
  if (j.checkpointing) {
    return Status::FailedPrecondition(StrCat(what, ": another checkpoint is in progress"));
  }
  // An eager step updates each unit as its grads come: some units updated
  // (none in flight) and others waiting for theirs is a step in flight too.
  const bool eager_midway = j.spec.optimizer.mode == StepMode::kEager && j.eager_done > 0;
  for (const Unit& u : j.units) {
    if (u.StepInFlight() || eager_midway) {
      return Status::FailedPrecondition(
          StrCat(what, ": job '", j.spec.name,
                 "' has gradients of a step in flight; checkpoint between steps"));
    }
  }
  return Status::Ok();
}
}  // namespace

// Runs fn(job) with the job idle and marked checkpointing (grads wait
// meanwhile, and are refused after a call that replaces the state), then
// clears the mark.
template <class Fn>
Status WithIdleJob(Engine::Impl& e, int job, std::string_view what, StateUse use, const Fn& fn,
                   const IdleEntry& entry) {
  std::shared_ptr<Job> j;
  {
    std::unique_lock<std::mutex> lock(e.mu);
    ZT_ASSIGN_OR_RETURN(j, e.Find(job));
    for (;;) {
      e.WaitQueuedStepsLocked(lock, *j);
      if (!entry.wait_turn || !j->checkpointing || j->removed || !j->failure.ok()) break;
      e.published_cv.wait(lock, [&] { return !j->checkpointing || j->removed; });
    }
    if (j->removed) return Status::Aborted(StrCat("job ", job, " was unregistered"));
    ZT_RETURN_IF_ERROR(CheckIdle(*j, what));
    if (entry.check) ZT_RETURN_IF_ERROR(entry.check(*j));
    j->checkpointing = true;
    j->replacing = use == StateUse::kReplaces;
  }
  // Steps publish every unit before the job looks idle, so the buffers are
  // stable while the mark keeps new grads out.
  Status s = fn(*j);
  {
    std::lock_guard<std::mutex> lock(e.mu);
    j->checkpointing = false;
    j->replacing = false;
    if (use == StateUse::kReplaces) {
      ++j->state_replacements;  // even when it failed midway
      // The published weights may be others now, at the step they were at
      // (a load or import, even one that failed midway): clients fetch
      // again. Bumped with the mark cleared, under the lock: a reader that
      // finds the job idle (CheckConsistent) finds the new generation too.
      Engine::Impl::WeightsReplaced(*j);
    }
  }
  e.published_cv.notify_all();  // an unregister and GradsReady wait for it
  return s.Annotate(StrCat(what, " of job '", j->spec.name, "'"));
}

Status Engine::ClaimCheckpointDir(int job, const std::string& dir, bool until_closed) {
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
  }
  ZT_RETURN_IF_ERROR(CreateCheckpointDir(dir));
  ZT_RETURN_IF_ERROR(impl_->dirs.Claim(*j, dir, until_closed));
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (j->removed) {  // unregistered meanwhile, its claims let go before this one
    impl_->dirs.Release(job);
    return Status::Aborted(StrCat("job ", job, " was unregistered"));
  }
  return Status::Ok();
}

Status Engine::CheckConsistent(int job) const {
  std::unique_lock<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  impl_->WaitQueuedStepsLocked(lock, *j);
  if (j->removed) return Status::Aborted(StrCat("job ", job, " was unregistered"));
  ZT_RETURN_IF_ERROR(CheckIdle(*j, "read the state"));
  return PartlyWritten(*j);
}

Status Engine::SaveCheckpoint(int job, const std::string& dir) {
  return WithIdleJob(*impl_, job, "save checkpoint", StateUse::kReads, [&](Job& j) -> Status {
    ZT_RETURN_IF_ERROR(PartlyWritten(j));  // a mix of two states is no checkpoint
    return SaveCheckpointImpl(j, dir, impl_->dirs).Annotate(dir);
  });
}

Status Engine::LoadCheckpoint(int job, const std::string& dir) {
  Impl& e = *impl_;
  return WithIdleJob(e, job, "load checkpoint", StateUse::kReplaces, [&](Job& j) {
    return LoadCheckpointImpl(j, dir, e.Committer(j)).Annotate(dir);
  });
}

Status Engine::ExportSafetensors(int job, const std::string& path, ExportType type) {
  if (type != ExportType::kFloat32 && type != ExportType::kBFloat16) {
    return Status::InvalidArgument(
        StrCat("export ", path, ": export type ", static_cast<int>(type), " is unknown"));
  }
  return WithIdleJob(*impl_, job, "export safetensors", StateUse::kReads, [&](Job& j) -> Status {
    ZT_RETURN_IF_ERROR(PartlyWritten(j));
    return ExportSafetensorsImpl(j, path, type == ExportType::kBFloat16);
  });
}

Status Engine::ImportSafetensors(int job, const std::string& path) {
  Impl& e = *impl_;
  return WithIdleJob(e, job, "import safetensors", StateUse::kReplaces,
                     [&](Job& j) { return ImportSafetensorsImpl(j, path, e.Committer(j)); });
}

namespace {
// A state written unit by unit (a load or import through ztierd) that
// expected the job at `generation` (-1: not checked), under WithIdleJob.
Status CheckWriter(const Job& j, int64_t generation) {
  if (generation < 0) return Status::Ok();
  const int64_t now = Engine::Impl::WeightsGenerationOf(j).load(std::memory_order_acquire);
  if (now == generation) return Status::Ok();
  return Status::FailedPrecondition(
      StrCat("job '", j.spec.name, "': ", kAnotherWriter, " (of another client, ",
             "or another thread; or weights set) changed the state while this one was under way ",
             "(weights generation ", now, ", this one expected ", generation, "); the two would ",
             "mix, so this one stopped: a load or import that completes leaves the job its state ",
             "whole; else it is partly written, refused by a save until a load or import ",
             "commits. Run this one again once the other is done if its state is the one "
             "wanted"));
}
}  // namespace

Status Engine::WriteState(int job, int unit, const float* master, const float* exp_avg,
                          const float* exp_avg_sq, int64_t generation) {
  {
    // A NaN master or moment trained on as NaN (every step skipped), a
    // negative v as NaN updates: refused, naming where, as a checkpoint
    // holding one is. Units and layouts do not change after registration.
    std::shared_ptr<Job> j;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
    }
    if (unit >= 0 && unit < static_cast<int>(j->units.size()) && master != nullptr &&
        exp_avg != nullptr && exp_avg_sq != nullptr) {
      const Unit& u = j->units[unit];
      const bool moments = !u.stateless;  // a stateless unit's m and v are not kept
      const std::string bad =
          ImpossibleStateValue(j->spec.units[unit], u.layout, 0, u.layout.padded, master,
                               moments ? exp_avg : nullptr, moments ? exp_avg_sq : nullptr);
      if (!bad.empty()) {
        return Status::InvalidArgument(StrCat("write state: unit '", j->spec.units[unit].name, "' ",
                                              bad,
                                              ", which no training leaves; nothing was written"));
      }
    }
  }
  // A refused write changes nothing (nor the generation another writer
  // expects); one with a generation waits for the write under way.
  const IdleEntry entry{
      .wait_turn = generation >= 0, .check = [&](const Job& j) -> Status {
        if (unit < 0 || unit >= static_cast<int>(j.units.size())) {
          return Status::OutOfRange(StrCat("unit ", unit, " of ", j.units.size()));
        }
        if (master == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) {
          return Status::InvalidArgument("WriteState: null master, m or v");
        }
        return CheckWriter(j, generation);
      }};
  return WithIdleJob(
      *impl_, job, "write state", StateUse::kReplaces,
      [&](Job& j) -> Status {
        return WriteUnitStateImpl(j, static_cast<size_t>(unit),
                                  UnitState{.master = const_cast<float*>(master),
                                            .exp_avg = const_cast<float*>(exp_avg),
                                            .exp_avg_sq = const_cast<float*>(exp_avg_sq)});
      },
      entry);
}

Status Engine::CommitState(int job, int64_t step, int64_t adam_step, int64_t generation) {
  const bool keep = step == kKeepSteps && adam_step == kKeepSteps;
  if (!keep && (step < 0 || step > kMaxStep || adam_step < 0 || adam_step > step)) {
    return Status::InvalidArgument(
        StrCat("step ", step, ", adam step ", adam_step,
               " (steps are 0 to 2^62, the AdamW step at most the step)"));
  }
  Impl& e = *impl_;
  return WithIdleJob(
      e, job, "commit state", StateUse::kReplaces,
      [&](Job& j) { return CommitStateImpl(j, step, adam_step, e.Committer(j)); },
      IdleEntry{.wait_turn = generation >= 0,
                .check = [&](const Job& j) { return CheckWriter(j, generation); }});
}

Result<std::pair<int64_t, int64_t>> Engine::Steps(int job) const {
  std::unique_lock<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  impl_->WaitWriteBacksLocked(lock, *j);  // a step whose units are all visible completes
  return std::pair<int64_t, int64_t>{j->step, j->adam_step};
}

Result<int64_t> Engine::StepNow(int job) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  return j->step;
}

Status Engine::RoundTripStates(int job) {
  return WithIdleJob(*impl_, job, "round-trip states", StateUse::kReads, [&](Job& j) {
    return ForEachUnitState(
        j, ForwardOrder(j), Access::kUpdate, [&](size_t k, const StateView& state) {
          if (j.params != nullptr) {  // the params written back are bf16(master)
            for (uint64_t i = 0; i < j.units[k].layout.padded; ++i) {
              state.publish[i] = FloatToBf16(state.master[i]);
            }
          }
          return Status::Ok();
        });
  });
}

DramPoolStats Engine::pool_stats() const { return impl_->pool->stats(); }
uint64_t Engine::ReleaseIdleDram() { return impl_->pool->ReleaseEmpty(); }
void Engine::HoldDram(uint64_t bytes) { impl_->pool->HoldOutside(bytes); }
void Engine::ReleaseDram(uint64_t bytes) { impl_->pool->ReleaseOutside(bytes); }

std::vector<std::pair<void*, uint64_t>> Engine::PinnedRegions(int job) const {
  std::vector<std::pair<void*, uint64_t>> out;
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    Result<std::shared_ptr<Job>> found = impl_->Find(job);
    if (!found.ok()) return out;
    j = *found;
  }
  for (uint32_t r : j->shared_regions) {
    const std::pair<void*, uint64_t> region = impl_->pool->region(r);
    if (region.first != nullptr) out.push_back(region);
  }
  return out;
}

Result<StateDtype> Engine::state_dtype(int job) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  return j->state_dtype;
}

JobCounters Engine::counters(int job) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Result<std::shared_ptr<Job>> r = impl_->Find(job);
  if (!r.ok()) return JobCounters{};
  return impl_->CountersLocked(**r);
}

EngineTotals Engine::totals() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  EngineTotals t = impl_->retired;
  for (const auto& [id, j] : impl_->jobs) Impl::AddTotals(t, impl_->CountersLocked(*j));
  t.jobs_registered = impl_->next_job - 1;
  return t;
}

Status Engine::failure(int job) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  return j->failure;
}

std::vector<SwapPathUsage> Engine::swap_usage() const {
  std::vector<SwapPathUsage> out;
  if (impl_->swap == nullptr) return out;
  for (nvme::SwapSpace::PathUsage& u : impl_->swap->path_usage()) {
    out.push_back({.path = std::move(u.path),
                   .used_bytes = u.used_bytes,
                   .file_bytes = u.file_bytes,
                   .capacity_bytes = u.capacity_bytes,
                   .waiting_ops = u.waiting,
                   .quiet_seconds = u.quiet_seconds,
                   .problem = std::move(u.problem)});
  }
  return out;
}

int Engine::optimizer_threads() const { return impl_->executor.threads(); }

Result<uint64_t*> Engine::ClientCounters(int job, int rank) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<Job> j, impl_->Find(job));
  if (rank < 0 || rank >= j->spec.ranks) {
    return Status::InvalidArgument(StrCat("job ", job, " has no rank ", rank));
  }
  return static_cast<uint64_t*>(j->client_page.ptr) + rank * kClientCounterWords;
}

Result<SharedBuffer> Engine::ClientPage(int job) const {
  std::shared_ptr<Job> j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ZT_ASSIGN_OR_RETURN(j, impl_->Find(job));
  }
  return Locate(job, j->client_page.ptr, ClientPageBytes(j->spec));
}

}  // namespace ztier::engine
