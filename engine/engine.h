// ztier engine (public header of the component): jobs, units and the
// overlapped optimizer step, over the pinned DRAM pool.
//
// A job registers its units in forward order. Each unit's tensors are
// flattened into one buffer, padded to a multiple of ranks x kAlignElements,
// and cut into R equal shards. Per unit the engine holds fp32 master, m and v,
// the bf16 publish buffer clients fetch, and the bf16 grad inbox clients land
// their grad shards in (plus an fp32 accumulator when gradient accumulation
// is > 1), all from the DRAM pool under the job's and the engine's budgets.
//
// The step. A client writes its grad shard into GradInbox(unit, rank) and
// rings GradsReady(unit, rank). The engine accumulates the squared norm as
// shards arrive. At an accumulation boundary:
//   - exact mode (default): once the last unit's grads are in, it computes
//     the global norm, skips the whole step if any grad is inf/NaN, clips,
//     and runs AdamW on the units in forward order, publishing each unit as
//     soon as it is done (so the next forward can start on unit 0);
//   - eager mode (opt-in, no clipping): each unit is updated the moment its
//     last shard arrives, overlapping the rest of the backward pass. A
//     non-finite grad in eager mode cannot be undone: it fails the step.
// Every unit's publish buffer carries the step it holds; WaitPublished(unit,
// step) waits for that unit only.
//
// Param groups and frozen tensors. Each tensor belongs to an optimizer param
// group (TensorSpec::group) with a weight decay of its own (OptimizerConfig::
// group_weight_decay) and a learning rate the client sets per step
// (SetLearningRates); a frozen tensor is never updated. A unit is updated
// as runs of adjacent tensors of one group (frozen or not), each run one
// AdamW pass with its group's rates (the padding goes with the last run); a
// job with one group and no frozen tensor is one pass over the unit.
//
// Optimizer states on NVMe (ZeRO-Infinity placement, optimizer_tier kNvme).
// Each unit's fp32 master, m and v live in one swap object of the engine's
// swap space (Settings::nvme_paths, striped across them). A step streams the
// units through a pinned ring of Settings::buffer_count slots: while unit k
// is updated, units k+1 .. k+buffer_count-2 are read and unit k-1 is written
// back, so DRAM holds buffer_count unit states whatever the model size (plus
// the bf16 publish buffer and grad inbox of every unit, 4 bytes a param).
// A step completes (its last unit is published) only after every unit's
// write-back is done. An I/O error during a step fails the job with the
// error (naming the step, the unit, the drive and the errno); the state on
// the drives may then be partly of the new step, so recover by loading the
// last checkpoint into a new job.
// bf16 params on NVMe too (param_tier kNvme, with states on NVMe): each unit
// has two param objects written alternately (a write-back never overwrites
// the copy clients read), and clients read them through AcquireParams into a
// pinned cache of buffer_count slots; DRAM then holds the grad inbox only
// (2 bytes a param) besides the two rings.
//
// Thread safety: every method may be called from any thread; GradsReady of
// different (unit, rank) pairs may race freely. The optimizer runs on one
// engine thread per engine, using the shared Executor for its cores.
#ifndef ZTIER_ENGINE_ENGINE_H_
#define ZTIER_ENGINE_ENGINE_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "cpu_adam/adamw.h"
#include "engine/settings.h"
#include "engine/wire_types.h"

namespace ztier::nvme {
class IoBackend;
}

namespace ztier::engine {

// What Engine::RegisterJob checks of a spec on its own, before anything
// of the engine's: names (non-empty where they must be, valid UTF-8
// without control characters, at most kMaxNameBytes), the counts and
// figures of engine/wire_types.h's limits (a scalar tensor has no dims),
// ranks 1..1024, the optimizer's settings and tiers. A client of ztierd
// checks its spec with it before sending it, so both ways say the same.
// `name_prefix_bytes`: of the job's name, a prefix its sender put there
// (ztierd's scope, "uid<N>/"), not counted against the limit. Errors:
// InvalidArgument, naming the job, unit and tensor.
Status ValidateJobSpec(const JobSpec& spec, size_t name_prefix_bytes = 0);

// Unit `unit`'s layout in a job of `spec` (one ValidateJobSpec passed): its
// tensors one after the other, padded to ranks x kAlignElements. The
// engine lays its units out so; a client of ztierd checks what it is told.
UnitLayout UnitLayoutOf(const JobSpec& spec, size_t unit);

// A name or a text that goes into JSON, logs and onto operators' terminals
// (a job's name, ztierctl evict's reason): valid UTF-8 of at most
// kMaxNameBytes (+ `prefix_bytes`), with no control character (C0, DEL or
// C1: a terminal's escape sequences). Errors: InvalidArgument naming `what`
// and the first bad byte.
Status CheckName(std::string_view what, std::string_view name, size_t prefix_bytes = 0);

// The longest wait: a century, forever to anyone waiting. Longer timeouts
// (INT64_MAX ms, say) are cut to it, since the clock's nanoseconds would
// overflow and time the wait out at once.
inline constexpr std::chrono::hours kForeverWait{24 * 365 * 100};
// A timeout as the engine's waits take it: cut to [0, kForeverWait] (a
// negative one, milliseconds::min() say, is no wait at all).
inline std::chrono::milliseconds ClampWait(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout, std::chrono::milliseconds{0}, kForeverWait);
}

class Engine {
 public:
  // Creates the DRAM pool, the optimizer's thread arena and, when NVMe paths
  // are set, the swap space (through `io_backend`, io_uring when null; tests
  // pass a fault-injecting one). Errors: InvalidArgument (settings), as
  // DramPool / cpu_adam::Executor / nvme::SwapSpace::Create.
  static Result<std::unique_ptr<Engine>> Create(
      const Settings& settings, std::shared_ptr<nvme::IoBackend> io_backend = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Errors: InvalidArgument (empty units, bad shapes, sizes past the limits
  // below, ranks < 1, accumulation < 1, eager mode with clipping; a
  // tensor's param group not below group_weight_decay's size, or 0 when it
  // is empty, or a group's weight decay not finite and >= 0, naming the
  // unit and the tensor),
  // AlreadyExists (name), ResourceExhausted (the pinned DRAM the job needs,
  // computed up front, exceeds what the budget has left, naming both
  // figures; or the swap space, naming the path), FailedPrecondition (states
  // on NVMe without swap paths); InvalidArgument also for params on NVMe
  // with states in DRAM. Limits: 2^40 elements a unit, 2^48 a job.
  // `admit`, when given, is called with the pinned DRAM bytes and the swap
  // bytes (whole stripe units) the job needs once they are known and before
  // any is allocated; its error is RegisterJob's (ztierd's per-uid quotas:
  // a job over one never holds the budget others need, nor grows the swap
  // files, not even for a moment).
  Result<int> RegisterJob(
      const JobSpec& spec,
      const std::function<Status(uint64_t dram_bytes, uint64_t nvme_bytes)>& admit = {});
  // Frees everything the job holds. Errors: NotFound.
  Status UnregisterJob(int job);

  Result<UnitLayout> Layout(int job, int unit) const;

  // Initial weights of a unit, flat fp32 (layout.numel elements): sets the
  // master copy and publishes it as step 0. Errors: InvalidArgument (null,
  // the count, a value not finite), NotFound, OutOfRange.
  Status WriteWeights(int job, int unit, const float* flat, uint64_t numel);
  // Reads the fp32 master / m / v of a unit (padded elements), for tests and
  // checkpoints, between the unit's steps; a null array is not read.
  // Errors: FailedPrecondition (grads of a step pending on the unit, a step
  // begun or the state replaced while it was read), NotFound, OutOfRange.
  Status ReadState(int job, int unit, float* master, float* exp_avg, float* exp_avg_sq) const;

  // Overwrites a unit's fp32 master, m and v (layout.padded elements each)
  // and sets its bf16 params from the master, without publishing them:
  // loading a checkpoint whose files another process read (ztierd's
  // clients) is WriteState per unit, then CommitState. Call between steps.
  // `generation` (>= 0): the WeightsGeneration the writer expects, the
  // job's as its pass began plus one for each of its writes since (each
  // write and commit bumps it): another writer's write or commit in
  // between (a second client's load) refuses this one, which would mix
  // the two states. Errors: InvalidArgument (a null array),
  // FailedPrecondition (grads pending, another writer), NotFound,
  // OutOfRange, IoError (NVMe tier).
  Status WriteState(int job, int unit, const float* master, const float* exp_avg,
                    const float* exp_avg_sq, int64_t generation = -1);
  // The job holds `step` (and `adam_step`, the steps that updated the
  // weights; both kKeepSteps: the steps it is at, as an import keeps
  // them): every unit is published as `step`. `generation` as
  // WriteState's. Errors: InvalidArgument (negative, or adam_step > step),
  // FailedPrecondition (another writer), NotFound.
  Status CommitState(int job, int64_t step, int64_t adam_step, int64_t generation = -1);
  // The job's completed steps and the steps that updated its weights (as a
  // checkpoint records them). Errors: NotFound.
  Result<std::pair<int64_t, int64_t>> Steps(int job) const;
  // The job's completed steps as they stand, without waiting for the
  // write-backs of a step under way (as Steps does: on a stalled drive, a
  // listing of jobs waited as long). Errors: NotFound.
  Result<int64_t> StepNow(int job) const;

  // The learning rate of each optimizer param group (one per group: 1 when
  // the job's group_weight_decay is empty, else its size), for every step
  // whose grads complete after this call, until the next call; before any
  // call each group's is hyper.lr. An exact step takes them as its last
  // unit's grads arrive (call before delivering a step's last grads); an
  // eager step takes them as each unit's grads are complete (call before
  // the step's first unit is). When the step's task runs does not matter.
  // Errors: NotFound (job),
  // InvalidArgument (the count, or a rate not finite and >= 0, naming the
  // group).
  Status SetLearningRates(int job, const std::vector<float>& lrs);

  // Where rank `rank` writes its bf16 grad shard of `unit` (layout.shard
  // elements). A unit's inbox is its R shards in rank order (rank r's at
  // rank 0's + r * shard), and a job's inboxes lie in unit order in one
  // region, each starting on a page: clients copy runs of them at once.
  // Valid until the job is unregistered. With gradient
  // accumulation 1 the optimizer reads the inbox after the last unit's grads
  // are in: write a unit's next grads only after WaitPublished(unit, step)
  // returned for the step they belong after (the forward pass does that).
  Result<bf16*> GradInbox(int job, int unit, int rank);
  // Rank's shard of unit is in; during a checkpoint save, export, load or
  // import of the job (called from another thread), once that is done.
  // Errors: FailedPrecondition (rang twice in one micro-step), Aborted (the
  // job failed or was unregistered), NotFound, OutOfRange.
  Status GradsReady(int job, int unit, int rank);
  // Drops every grad delivered since the job's last step (every rank's, of
  // every micro-step toward the next step): the job is as it was after that
  // step, and the next grads start the step afresh. For a training loop
  // whose backward pass failed after some of its grads went out. Returns
  // the micro-steps that were complete on every unit (discarded with the
  // partial one). `step` is the step the caller's grads are for (its
  // version + 1). Call with no GradsReady of the job in flight. Errors:
  // FailedPrecondition (the step's update has begun: in exact mode every
  // unit's grads are in, in eager mode a unit's; the job is at `step` or
  // past it, the grads applied; or a GradsReady is in flight, or a
  // checkpoint is), InvalidArgument (`step` < 1), Aborted (the job failed), NotFound.
  Result<int> AbortStep(int job, int64_t step);

  // The unit's published bf16 params (layout.padded elements) and the step
  // they hold. Params in DRAM only (FailedPrecondition otherwise).
  Result<const bf16*> Published(int job, int unit) const;
  // The unit's bf16 params at step >= `step` (layout.padded elements), valid
  // until ReleaseParams(job, unit); works for either param tier. Params on
  // NVMe are read into a pinned cache of buffer_count slots, and the next
  // units in the direction of the walk (forward, or backward in a backward
  // pass) are prefetched into free slots. Every acquire needs one release.
  // Errors: as WaitPublished; Unavailable when every slot stays held past
  // the timeout; IoError / Corruption reading the drives.
  Result<const bf16*> AcquireParams(int job, int unit, int64_t step,
                                    std::chrono::milliseconds timeout = std::chrono::minutes(10));
  // Errors: FailedPrecondition (not acquired: params on NVMe; with params
  // in DRAM an acquire holds nothing, and a release without one is not
  // told apart), NotFound, OutOfRange.
  Status ReleaseParams(int job, int unit);
  int64_t PublishedStep(int job, int unit) const;
  // How many times the job's weights were replaced in place, at the step
  // they were at (SetWeights, LoadCheckpoint, ImportSafetensors, each
  // WriteState and CommitState): a client whose copy of a unit is of the step published
  // fetches it again when this changed. -1 for an unknown job.
  int64_t WeightsGeneration(int job) const;
  // The step every unit will hold once the optimizer has applied the grads
  // delivered so far: the highest published step, plus one for a unit whose
  // grads for the next step are all in (it is queued or being updated). A
  // client that starts reading while a step runs reads this step. -1 for an
  // unknown job or a job without weights.
  int64_t TargetStep(int job) const;
  // Blocks until the unit holds step >= `step`, at most `timeout` (cut by
  // ClampWait). Errors: Unavailable on timeout (naming the unit, the step
  // and what it holds), Aborted if the job failed or was unregistered,
  // FailedPrecondition at once for a step more than one past the job's (no
  // grads could ever make it).
  Status WaitPublished(int job, int unit, int64_t step,
                       std::chrono::milliseconds timeout = std::chrono::minutes(10));

  // Claims `dir` (created if missing) for the job's checkpoints now: an
  // exclusive lock on it (common/dir_lock.h) held until the job is
  // unregistered, so no other job, in this process or another, can save
  // there meanwhile (a dead process's lock never blocks). A save claims its
  // directory itself, for as long as it is among the job's eight most
  // recently saved to (ClaimedCheckpointDirs); claim first to be refused
  // before any work is done. `until_closed` false: a claim as a save's.
  // Errors: Unavailable (in use: names the directory and the holder's pid),
  // as creating the directory (FailedPrecondition, IoError naming the errno,
  // e.g. a read-only filesystem), NotFound (job).
  Status ClaimCheckpointDir(int job, const std::string& dir, bool until_closed = true);
  // Saves the job's full state into `dir` (created if missing; claimed as
  // above): one file per unit shard (fp32 master, m, v, with a header) and
  // manifest.json (step, optimizer config, unit layout, every file's
  // CRC-32C, its own checksum), written atomically: files first (under
  // names no committed checkpoint uses), then the manifest through a temp
  // file, fsync, rename and directory fsync; then the previous checkpoint's
  // files are removed. A crash mid-save leaves the last committed checkpoint
  // loadable; a failed save (a full disk, a failed fsync) removes what it
  // wrote and reports the error. Call between steps: a step whose grads
  // are all in (queued or running) is waited for first; one that waits for
  // more grads is refused. Errors: IoError, ResourceExhausted (disk full),
  // Unavailable (directory in use), FailedPrecondition (grads of a step
  // pending), NotFound.
  Status SaveCheckpoint(int job, const std::string& dir);
  // Whether the job's units hold one state, as a save or an export made
  // from ReadState (ztierd's clients write those themselves) needs: what
  // SaveCheckpoint checks before it writes. ReadState reads a failed job's
  // units too (to look at them), which may then be at different steps. A
  // step whose grads are all in is waited for first, as by SaveCheckpoint.
  // Errors: Aborted (the job failed), FailedPrecondition (a load or import
  // failed midway; a checkpoint in progress; grads of a step pending),
  // NotFound.
  Status CheckConsistent(int job) const;
  // Loads a checkpoint into a registered job whose units have the same names
  // and shapes; its rank count may differ (the state is resharded). Takes no
  // lock: a checkpoint another run is still writing loads as its last
  // committed state (a save that commits mid-load makes the load start over
  // from the new manifest). Publishes every unit as the checkpoint's step.
  // Errors: NotFound (no checkpoint there), Corruption (a checksum, a
  // truncated, forged or malformed manifest or file, naming it),
  // InvalidArgument (layout differs, naming the unit, the tensor and both
  // shapes), FailedPrecondition (step pending). A load that fails once it
  // began to write the job's state (an I/O error on its second pass) leaves
  // the job fenced: GradsReady, WaitPublished, saves and exports are
  // FailedPrecondition until a load or import commits (WriteState without
  // CommitState likewise).
  Status LoadCheckpoint(int job, const std::string& dir);

  // Writes the job's consolidated weights as a safetensors file: every
  // tensor under its registered name and shape, unpadded, in bf16 or fp32
  // (the fp32 master), loadable by safetensors / PyTorch / Hugging Face.
  // Written atomically (temp file, fsync, rename). Errors: IoError, NotFound.
  using ExportType = engine::ExportType;
  Status ExportSafetensors(int job, const std::string& path, ExportType type);
  // Sets initial weights from a safetensors file: each registered tensor is
  // looked up by name, its shape must match; F32, BF16 and F16 data are
  // accepted. Publishes every unit as step 0. The header is parsed
  // defensively (sizes, offsets, overlaps, dtypes). Errors: NotFound (file
  // or tensor), Corruption (malformed file, naming what is wrong),
  // InvalidArgument (shape mismatch), FailedPrecondition (step pending).
  Status ImportSafetensors(int job, const std::string& path);

  // Reads every unit's NVMe-resident state through the ring and writes it
  // back unchanged, as a step does but without computing: the I/O floor of a
  // step (ztier-bench step measures it) and a scrub of the checksums. No-op
  // for DRAM-resident states. Call between steps. Errors: IoError,
  // Corruption, FailedPrecondition (grads pending), NotFound.
  Status RoundTripStates(int job);

  JobCounters counters(int job) const;
  // How the job keeps m and v (its spec's, else the engine's when it
  // registered). Errors: NotFound.
  Result<StateDtype> state_dtype(int job) const;
  // Every job's counters added up since the engine started, the jobs
  // unregistered since included.
  EngineTotals totals() const;
  // Why the engine failed the job (an I/O error during a step, inf/NaN
  // grads in eager mode); OK while it is healthy. Errors: NotFound.
  Status failure(int job) const;
  // Each swap path's usage (engine/wire_types.h); empty without NVMe paths.
  std::vector<SwapPathUsage> swap_usage() const;
  // The optimizer's threads (ztier.optimizer_threads, 0 resolved).
  int optimizer_threads() const;
  // Rank `rank`'s words of the job's client page (kClientCounterWords u64,
  // wire_types.h ClientCounter): its runner adds the bytes it copies
  // between its device and the engine's memory there (std::atomic_ref,
  // relaxed), and counters() reports their sums. Valid until the job is
  // unregistered. Errors: NotFound, InvalidArgument (rank).
  Result<uint64_t*> ClientCounters(int job, int rank) const;
  // Where the client page lies in the job's grad-inbox region (which
  // clients map read-write), for a client in another process. Errors:
  // NotFound.
  Result<SharedBuffer> ClientPage(int job) const;
  // The pinned DRAM pool: budget, bytes reserved and in use, regions locked,
  // and the page size it really got (engine/dram_pool.h).
  DramPoolStats pool_stats() const;
  // Gives the pool's empty regions back to the system (they are kept, pinned,
  // for the next job otherwise): for a daemon that has no jobs. Returns the
  // bytes released.
  uint64_t ReleaseIdleDram();
  // DramPool::HoldOutside / ReleaseOutside: pinned memory of freed jobs that
  // live clients still map (ztierd's lingering connections).
  void HoldDram(uint64_t bytes);
  void ReleaseDram(uint64_t bytes);

  // The job's own pinned regions, {base, bytes}: every pointer the engine
  // hands its clients (grad inboxes, publish buffers, the param cache) lies
  // in one. Made at RegisterJob, never shared with another job, unmapped at
  // UnregisterJob: a client registers them with its device for DMA and
  // unregisters them before the job goes. Empty for an unknown job.
  std::vector<std::pair<void*, uint64_t>> PinnedRegions(int job) const;

  // The job's regions as another process sees them: each one's index,
  // size and access (offset 0, the whole region), in the order of
  // PinnedRegions. Errors: NotFound (job).
  Result<std::vector<SharedBuffer>> SharedRegions(int job) const;
  // Where `bytes` at `ptr`, a buffer this engine handed out for `job` (a
  // grad inbox, publish buffer or param cache slot), lie in the job's
  // regions, and what another process may do there: the daemon sends this
  // instead of a pointer. Errors: NotFound (job), InvalidArgument (not in
  // one of the job's regions).
  Result<SharedBuffer> Locate(int job, const void* ptr, uint64_t bytes) const;
  // Where the job's step page lies: one int64 per unit, the step its params
  // hold (-1: none), kept by every publish (and lowered by a loaded
  // checkpoint), then one int64, WeightsGeneration, in the read-only
  // params region. A client of the daemon
  // reads published steps there instead of asking. Errors: NotFound.
  Result<SharedBuffer> PublishedSteps(int job) const;
  // A new fd for one of the job's regions (the caller owns it), to pass to
  // a client; the params' region's is a read-only open (DramPool::ShareFd).
  // Errors: NotFound (job, or a region not the job's), PosixError.
  Result<UniqueFd> DupRegionFd(int job, uint32_t region) const;

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_ENGINE_H_
