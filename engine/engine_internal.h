// ztier engine internal: the job and unit records shared by engine.cc and
// checkpoint.cc. Only engine/*.cc include this.
#ifndef ZTIER_ENGINE_ENGINE_INTERNAL_H_
#define ZTIER_ENGINE_ENGINE_INTERNAL_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/dir_lock.h"
#include "common/log.h"
#include "cpu_adam/adamw.h"
#include "engine/dram_pool.h"
#include "engine/engine.h"
#include "engine/state_files.h"
#include "nvme/swap_space.h"

namespace ztier::engine {

// A unit's fp32 state where it can be read and written now: its DRAM blocks,
// or a ring slot holding it while it is staged from NVMe.
// `publish` is where the unit's new bf16 params go: the DRAM publish buffer,
// or the slot's bf16 area when params live on NVMe too.
// With 8-bit states (StateDtype::kInt8) exp_avg and exp_avg_sq are null and
// `q` holds m and v (codes, then absmax per block; StateLayout).
struct StateView {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  bf16* publish = nullptr;
  cpu_adam::Int8Moments q;
};

// Adjacent tensors of a unit in one param group, frozen or not: [begin,
// end) of the flat padded buffer (the last run ends at `padded`).
struct TensorRun {
  uint64_t begin = 0, end = 0;
  uint32_t group = 0;
  bool frozen = false;
};

struct Unit {
  UnitLayout layout;
  // Where its 8-bit moments' quantization groups start besides the block
  // grid: its tensors' offsets (cpu_adam::QuantCuts), so no group holds
  // parts of two tensors.
  std::vector<size_t> quant_cuts;
  // The unit's runs of tensors; empty when the job has one group and no
  // frozen tensor (the unit is then one AdamW pass).
  std::vector<TensorRun> runs;
  // fp32 state in DRAM (optimizer tier dram); empty blocks on the NVMe tier,
  // where the state is swap object `swap_object`: master, m, v back to back.
  // With 8-bit states `exp_avg` holds the compact m and v (MomentBytes) and
  // `exp_avg_sq` is empty.
  DramBlock master, exp_avg, exp_avg_sq, publish, inbox, accum;
  // Every tensor frozen, states in DRAM: no m and v are kept (they are never
  // used); they read as zeros (`zero_state`, a read-only mapping of the
  // job's) and what is written to them (a loaded checkpoint's) is dropped.
  bool stateless = false;
  const float* zero_state = nullptr;
  uint64_t swap_object = 0;
  // Params on NVMe: two swap objects of bf16 params, written alternately so
  // that a write-back never overwrites the copy clients read;
  // `param_current` is the one that holds the published params.
  uint64_t param_objects[2] = {0, 0};
  std::atomic<uint8_t> param_current{0};
  std::vector<uint8_t> arrived;  // by rank, this micro-step
  int arrived_count = 0;
  int micro = 0;                 // micro-steps completed toward the next step
  std::vector<double> shard_sq;  // by rank, at the accumulation boundary
  bool ready = false;            // grads complete for the pending step
  int64_t published = -1;        // step held by the publish buffer
  // Published (its params visible) while its state's write-back to the
  // drives is still in flight (NVMe states, params in DRAM): the step
  // completes, and checkpoints may start, once it is done.
  bool writing_back = false;
  float* f(const DramBlock& b) const { return static_cast<float*>(b.ptr); }
  // Grads of a step have reached the unit and its update is not published.
  bool StepInFlight() const { return ready || arrived_count > 0 || micro > 0; }
};

// The pinned ring that stages NVMe-resident units: buffer_count slots, each
// as large as the job's largest unit state. `mu` is held by whoever uses the
// slots (a step on the engine thread, or a synchronous access between
// steps), so accesses never interleave; every I/O is complete when it is
// released.
struct StateRing {
  nvme::SwapSpace* swap = nullptr;
  std::mutex mu;
  std::vector<DramBlock> slots;
  // Reads of the next pass's first units submitted ahead of it
  // (PreloadUnitStates): slot i receives unit preload_units[i]. The next
  // ForEachUnitState adopts them if its order starts with those units and
  // it reads; otherwise it waits for them and drops their data. Guarded by
  // `mu`.
  std::vector<nvme::IoTicket> preload_reads;
  std::vector<size_t> preload_units;
  // Traffic and time, read by counters() without `mu`.
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0};
  std::atomic<uint64_t> io_wait_ns{0};  // the engine blocked on the drives
};

// Params on NVMe: the pinned cache clients read units' bf16 params from.
// Guarded by the engine lock. A slot is leased by AcquireParams and freed by
// ReleaseParams; unleased slots are reused least recently used first, never
// while a read into them is in flight. A publish of a unit marks its cached
// copies stale.
struct ParamSlot {
  DramBlock block;
  int unit = -1;  // -1: empty
  int leases = 0;
  bool stale = false;
  uint64_t last_use = 0;
  nvme::IoTicket read;
};
struct ParamCache {
  std::vector<ParamSlot> slots;
  uint64_t clock = 0;
  int last_unit = -1;  // of the previous acquire: gives the direction to prefetch in
  std::atomic<uint64_t> bytes_read{0};
};

struct Job {
  int id = 0;
  JobSpec spec;
  StateDtype state_dtype = StateDtype::kFp32;  // the engine's, when registered
  std::vector<Unit> units;
  int64_t step = 0;       // completed steps (what clients wait for)
  int64_t adam_step = 0;  // steps that updated the weights (bias correction)
  // The learning rate of each param group for the steps whose grads complete
  // from now (Engine::SetLearningRates): a step takes a copy when its last
  // grads are in (exact), or each unit's are (eager), never later, so the
  // rates it runs at follow the calls alone, not when its task runs.
  std::vector<float> lrs;
  // Exact mode: units whose grads for the next step not yet queued are all
  // in; the step is queued when every unit's are (and the count starts over:
  // a unit published by the running step may take its next grads meanwhile).
  int ready_units = 0;
  // Exact mode: steps queued or running, not complete. Two can be: with
  // states on NVMe a unit is visible before its write-back, so the next
  // step's grads can all be in while this one writes back (a bool here was
  // cleared by the first's completion, and AbortStep then zeroed the grads
  // of the second, which ran anyway).
  int steps_queued = 0;
  // Optimizer updates posted so far (exact steps, eager units' updates):
  // a state read outside the job's checkpointing (Engine::ReadState) that
  // saw this change while it copied may have read a unit mid-update.
  uint64_t updates_posted = 0;
  int eager_done = 0;
  // GradsReady calls between their two holds of the engine lock (the
  // accumulation and norm of a shard run outside it): AbortStep is
  // refused while there are any.
  int delivering = 0;
  double eager_seconds = 0;  // of the eager step in progress (its units' updates)
  Status failure;
  bool removed = false;
  bool checkpointing = false;  // a save or load owns the buffers
  // The checkpointing call is one that replaces the state (a load, an
  // import, a state write or commit): a state read meanwhile is refused.
  bool replacing = false;
  // Counts the checkpointing calls that may have replaced the state (a
  // load, an import, a state write or commit), at their end: grads that
  // waited through one are of the state before it.
  uint64_t state_replacements = 0;
  // A load or import wrote some units' state and did not commit it (it
  // failed midway): the job holds a mix of two states until one commits.
  // Written while the job is marked checkpointing.
  std::atomic<bool> partly_written{false};
  JobCounters counters;
  DramPool* pool = nullptr;
  // The job's own regions (DramPool::CreateRegion): grad inboxes (clients
  // write) and publish buffers or the param cache (clients read).
  uint32_t inbox_region = 0, publish_region = 0;
  std::vector<uint32_t> shared_regions;  // made so far; destroyed with the job
  // Each unit's published step (int64, -1: none), then the weights'
  // generation (int64, Engine::WeightsGeneration), in the publish region:
  // another process reads them there without asking (Engine::
  // PublishedSteps).
  DramBlock step_page;
  // The client page (wire_types.h kClientCounterWords per rank), in the
  // inbox region: each rank's runner adds its device traffic there. The
  // client may write anything there; what the engine counts is `seen`
  // (under the engine's mu): per rank and word, the largest value read so
  // far, never less, and never more than a link could have moved since
  // the job was registered (`registered`), so a client's bad words cannot
  // make the totals of the engine (every user's) go back or jump.
  DramBlock client_page;
  std::vector<uint64_t> seen;
  std::chrono::steady_clock::time_point registered = std::chrono::steady_clock::now();
  std::unique_ptr<StateRing> ring;      // optimizer tier nvme only
  std::unique_ptr<ParamCache> params;   // param tier nvme only
  std::atomic<uint64_t> compute_ns{0};  // in cpu_adam::Step

  // Zeros for the m and v of stateless units (read-only anonymous memory:
  // the kernel's zero page, no memory of its own).
  std::shared_ptr<void> zero_state;
  // Called once the job's memory and swap objects are back (the end of
  // ~Job): the engine counts unregistered jobs not yet gone (a step under
  // way, a call, still holds them). It takes no lock the holders may hold.
  std::function<void()> on_gone;

  ~Job() {
    // Reads in flight first: none may land in freed memory, and the swap
    // space refuses to free an object with I/O in flight (its space would
    // stay taken for the daemon's life).
    if (ring != nullptr) {
      for (nvme::IoTicket& t : ring->preload_reads) {
        if (t.valid()) (void)t.Wait();
      }
    }
    if (params != nullptr) {
      for (ParamSlot& s : params->slots) {
        if (s.read.valid()) (void)s.read.Wait();  // no read may land in freed memory
        pool->Free(s.block);
      }
    }
    if (step_page.ptr != nullptr) pool->Free(step_page);
    if (client_page.ptr != nullptr) pool->Free(client_page);
    for (Unit& u : units) {
      for (DramBlock* b : {&u.master, &u.exp_avg, &u.exp_avg_sq, &u.publish, &u.inbox, &u.accum}) {
        if (b->ptr != nullptr) pool->Free(*b);
      }
      if (ring == nullptr) continue;
      for (uint64_t id : {u.swap_object, u.param_objects[0], u.param_objects[1]}) {
        if (id == 0) continue;
        if (Status s = ring->swap->Free(id); !s.ok()) {
          ZT_LOG(kWarn, "engine") << "job teardown: " << s;
        }
      }
    }
    if (ring != nullptr) {
      for (const DramBlock& b : ring->slots) pool->Free(b);
    }
    for (uint32_t r : shared_regions) pool->DestroyRegion(r);
    if (on_gone) on_gone();
  }
};

// Adds the nanoseconds since `t0` to a time counter.
inline void AddElapsed(std::atomic<uint64_t>& ns, std::chrono::steady_clock::time_point t0) {
  ns.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now() - t0)
                                         .count()),
               std::memory_order_relaxed);
}

// Bytes of a unit's m and v: 2 x padded fp32, or (int8) padded codes of
// each, then QuantGroups(padded, quant_cuts) fp32 absmax of each.
uint64_t MomentBytes(const Unit& u, StateDtype dtype);
// The compact m and v laid out at `base` (MomentBytes(u, kInt8)); they view
// u.quant_cuts.
cpu_adam::Int8Moments Int8View(void* base, const Unit& u);
// Bytes of a unit's state as one swap object and one ring slot: the fp32
// master then m and v (MomentBytes), rounded up to 4 KiB so transfers go
// straight to the drive.
uint64_t StateBytes(const Unit& u, StateDtype dtype);
// A unit's m and v as fp32 (`padded` each; dequantized when 8-bit), and
// back (quantized when 8-bit).
void MomentsToFloat(const Job& job, const Unit& u, const StateView& view, float* m, float* v);
void MomentsFromFloat(const Job& job, const Unit& u, const StateView& view, const float* m,
                      const float* v);
// Bytes of a unit's bf16 params as one swap object (4 KiB multiple).
uint64_t ParamBytes(const UnitLayout& layout);

// What a pass over units' state does with it (NVMe tier):
//   kRead       read each unit; nothing written back;
//   kUpdate     read each unit, write it back after fn;
//   kOverwrite  fn fills the whole state (and params) without reading it:
//               no read, written back after fn.
enum class Access : uint8_t { kRead, kUpdate, kOverwrite };

// Runs `fn(k, view)` for each unit index in `order`, with the unit's fp32
// state in reach. DRAM tier: views of the unit's blocks, in order. NVMe tier:
// a pipeline over the ring (holding ring->mu throughout): while fn works on
// one unit the ring reads ahead the next buffer_count - 2 units and writes
// back the previous ones (as `access` says; with params on NVMe, the bf16
// params go to the unit's other param object, which then becomes current).
// `computed(k)`, if given, runs once fn has updated unit k, before its
// write-back starts; `stored(k)`, if given, runs once unit k's write-back is
// done (at once without one), in any order. Returns after every I/O is done. The first
// error (fn's, or an I/O error naming the unit) stops it.
using UnitFn = std::function<Status(size_t unit, const StateView& state)>;
using StoredFn = std::function<void(size_t unit)>;
Status ForEachUnitState(Job& job, const std::vector<size_t>& order, Access access, const UnitFn& fn,
                        const StoredFn& stored = {}, const StoredFn& computed = {});
// NVMe tier: submits the reads of the first units of `order` (as many as
// the pass reads ahead at its start, buffer_count - 1) into the ring's
// slots and returns at once, so that the next ForEachUnitState over that
// order (the next step, while backward still runs) starts with them in
// DRAM. A no-op on the DRAM tier or when reads are already preloaded. The
// states on the drives must not change before that pass, except through
// ForEachUnitState (which then drops the preloaded data).
void PreloadUnitStates(Job& job, const std::vector<size_t>& order);
// The same for one unit.
Status WithUnitState(Job& job, size_t unit, Access access, const UnitFn& fn,
                     const StoredFn& stored = {});
// 0, 1, ..., units - 1.
std::vector<size_t> ForwardOrder(const Job& job);

// The job holds `step` and `adam_step`: sets them and publishes every unit
// as holding `step` (engine.cc: under the engine lock, which readers of the
// job's step hold).
using CommitFn = std::function<void(int64_t step, int64_t adam_step)>;

// The checkpoint directories the engine's jobs save to. Each is locked
// (common/dir_lock.h, exclusive) from a job's first claim or save until the
// job is unregistered (a save's claim: while it is among the
// kMaxClaimedCheckpointDirs the job used last, ClaimedCheckpointDirs): no
// other process,
// and no other job of this engine, can save there meanwhile. Loads take no
// lock (reading another run's
// checkpoint, even one being written, is safe: see LoadCheckpointImpl).
// Thread-safe.
class CheckpointDirs {
 public:
  // `job` saves to `dir` from now on (`pin`: until it is unregistered).
  // Errors: Unavailable (another process or another job saves there,
  // naming it), as DirLock::Acquire.
  Status Claim(const Job& job, const std::string& dir, bool pin);
  // The job is gone: the directories it claimed are unlocked.
  void Release(int job);

 private:
  struct JobDirs {
    std::string job_name;
    ClaimedCheckpointDirs dirs;
  };
  std::mutex mu_;
  std::map<int, JobDirs> jobs_;
};

// Called with the job idle (no grads pending) and marked checkpointing.
Status SaveCheckpointImpl(Job& job, const std::string& dir, CheckpointDirs& dirs);
Status LoadCheckpointImpl(Job& job, const std::string& dir, const CommitFn& commit);
Status ExportSafetensorsImpl(Job& job, const std::string& path, bool bf16_out);
Status ImportSafetensorsImpl(Job& job, const std::string& path, const CommitFn& commit);
// One unit's master, m and v (padded each) set from `from`, its params from
// the master; not published (CommitStateImpl does).
Status WriteUnitStateImpl(Job& job, size_t unit, const UnitState& from);
// The job holds `step`: every unit published as it.
Status CommitStateImpl(Job& job, int64_t step, int64_t adam_step, const CommitFn& commit);
// What the state files (engine/state_files.h) record of the job.
JobDescription Describe(const Job& job);

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_ENGINE_INTERNAL_H_
