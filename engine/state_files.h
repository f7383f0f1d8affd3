// ztier engine: a job's state in files, wherever the job runs: checkpoints
// (the format of checkpoint_manifest.h) and safetensors exports and
// imports, written and read through a StateAccess, so the same code serves
// the engine in this process (engine/checkpoint.cc) and a client of ztierd,
// which does the file I/O itself and moves the bytes through the daemon
// (the daemon never opens a path a client names).
//
// SaveCheckpointFiles writes every shard file under a name no committed
// checkpoint uses (the step and a random tag), fsyncs them and the
// directory, then the manifest atomically; only then are the previous
// checkpoint's files removed. A failed save removes the files it wrote that
// the manifest on disk does not name, so a full disk keeps no half-written
// checkpoint and the last committed one stays whole. The caller holds the
// directory's lock. LoadCheckpointFiles reads every file once and checks it
// (sizes, checksums, headers, the layout against the job's) before it
// touches the job, then again to apply; a save that commits meanwhile makes
// it start over from the new manifest. Imports check every tensor first.
//
// Thread safety: one call per job at a time. Failure: IoError /
// ResourceExhausted (disk full) writing, NotFound / Corruption /
// InvalidArgument reading, naming the file, the unit and the tensor; the
// StateAccess's own errors.
#ifndef ZTIER_ENGINE_STATE_FILES_H_
#define ZTIER_ENGINE_STATE_FILES_H_

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/dir_lock.h"
#include "common/status.h"
#include "engine/wire_types.h"

namespace ztier::engine {

// What the files record of a job besides its state.
struct JobDescription {
  std::string name;
  int ranks = 1;
  OptimizerConfig optimizer;
  std::vector<UnitSpec> units;
  std::vector<UnitLayout> layouts;  // one per unit
  int64_t step = 0;                 // completed steps
  int64_t adam_step = 0;            // steps that updated the weights
  // How the job keeps m and v ("fp32", "int8"); "" where not known (a
  // client of ztierd). Recorded in checkpoints.
  std::string state_dtype;
};

// A unit's fp32 state, `padded` elements each.
struct UnitState {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

// Where a job's state lives. Each pass visits the units in forward order.
class StateAccess {
 public:
  using Visit = std::function<Status(size_t unit, const UnitState& state)>;
  virtual ~StateAccess() = default;
  // Each unit's state to read.
  virtual Status Read(const Visit& fn) = 0;
  // Each unit's state to fill whole; stored (params from the master) after
  // fn. Publishing waits for Commit.
  virtual Status Overwrite(const Visit& fn) = 0;
  // Each unit's state, read, to change the master of; stored after fn.
  virtual Status UpdateMaster(const Visit& fn) = 0;
  // The new state is complete: the job holds `step` (and `adam_step`), and
  // every unit is published as `step`; both kKeepSteps: the steps the job
  // is at then (an import).
  virtual Status Commit(int64_t step, int64_t adam_step) = 0;
  // Units this access has written (Overwrite, UpdateMaster) so far: a
  // load or import that failed after one left the job partly written.
  int units_written() const { return units_written_; }

 protected:
  int units_written_ = 0;
};

// The words of the refusal of a state written unit by unit (through ztierd)
// after another writer's write or commit (Engine::WriteState): the job's
// state is then that writer's, not partly this one's.
inline constexpr std::string_view kAnotherWriter = "another load, import or state write";
// Annotates the failure of a load or import that wrote some units (the job
// holds part of its state) with what to do.
Status PartlyWrittenNote(const StateAccess& state, Status st, std::string_view what);

// Where a unit's state holds a value no optimizer leaves: a master not
// finite in bf16 (it is published as bf16), m or v past what a step's grads
// bound them to (every step taken has grads whose squares sum to at most
// cpu_adam::kMaxGradSqSum after their scale: m is a running mean of those
// grads, v of their squares; twice that, for rounding), or a negative v.
// `count` elements of each array from element `first` of the unit; a null
// exp_avg or exp_avg_sq is not checked (a unit that keeps no moments). ""
// when every value is possible, else where and what: "tensor 'w' element 5
// has m (exp_avg) nan" ("its padding ..." past the tensors).
std::string ImpossibleStateValue(const UnitSpec& unit, const UnitLayout& layout, uint64_t first,
                                 uint64_t count, const float* master, const float* exp_avg,
                                 const float* exp_avg_sq);

Status SaveCheckpointFiles(const JobDescription& job, StateAccess& state, const std::string& dir);
// Removes the unit files in `dir` that its manifest does not name: a save
// killed after its manifest and before its cleanup leaves the older
// checkpoint's files; one killed before its manifest, its own (every shard
// file, when there is no manifest: a save removes those first). Call holding the
// directory's claim (no other save writing there). A manifest that cannot
// be read removes nothing. Errors: a file that cannot be removed.
Status RemoveUnnamedCheckpointFiles(const std::string& dir);
// Removes the checkpoint in `dir`: its manifest first (made durable, so no
// load takes a part of it), then the shard files of every save; other files
// stay. Call holding the directory's claim. Errors: a file that cannot be
// removed.
Status RemoveCheckpointFiles(const std::string& dir);
Status LoadCheckpointFiles(const JobDescription& job, StateAccess& state, const std::string& dir);
Status ExportSafetensorsFile(const JobDescription& job, StateAccess& state, const std::string& path,
                             ExportType type);
// Sets the master weights (and params) from the file; m and v stay; the job
// keeps its step.
Status ImportSafetensorsFile(const JobDescription& job, StateAccess& state,
                             const std::string& path);

// Creates `dir` (and its parents) if missing, each level made durable, and
// checks that a save may commit there (CheckManifestIsNoLink). Errors:
// FailedPrecondition (not a directory; the manifest a link), IoError naming
// the errno.
Status CreateCheckpointDir(const std::string& dir);
// FailedPrecondition when the manifest in `dir` is a symbolic link: a save
// wrote through it into the checkpoint the link named, whose shard files it
// did not write, and a dangling one read as no checkpoint. OK otherwise.
Status CheckManifestIsNoLink(const std::string& dir);
// A checkpoint directory as one key, as the kernel walks it (absolute,
// without "." parts, repeated or trailing '/'; ".." kept): which
// directories a process holds.
std::string CheckpointDirKey(const std::string& dir);
// The name of the lock file (common/dir_lock.h) a checkpoint directory's
// writer holds.
inline constexpr char kCheckpointLockFile[] = "ztier-checkpoint.lock";

// The checkpoint directories one job has claimed, each held by its lock
// (kCheckpointLockFile, one fd each). A claim made for a save lasts while
// it is among the job's kMaxClaimedCheckpointDirs most recently used
// unpinned ones: a run saving to a new directory each time held one fd per
// save until the job ended, and failed with EMFILE after about a thousand.
// A pinned claim (ClaimCheckpointDir's, "until the model is closed") stays.
// A claim let go may be claimed again, or by another saver. A claim whose
// lock file is no longer the one at its path (the directory removed, and
// made again by the next save) keeps no one out: it is let go of, and the
// directory claimed anew (two runs saved into one directory so).
//
// Not thread-safe: the owner's lock guards it. The locks let go of are
// handed back, to be destroyed (their files removed) outside that lock.
class ClaimedCheckpointDirs {
 public:
  static constexpr size_t kMaxClaimedCheckpointDirs = 8;
  // The lock file at a checkpoint directory's path now (looked at before
  // the owner's lock is taken: no file I/O under it), and the claims made
  // before the look (`claims_before`: a claim made after it, by another
  // thread, has a lock file the look may not have seen).
  struct LockFileNow {
    bool known = false;  // the stat answered (or said there is no file)
    bool exists = false;
    struct stat st {};
    uint64_t claims_before = 0;
  };
  static LockFileNow Look(const std::string& dir);
  // Whether `key` (CheckpointDirKey) is held. A claim of it made before
  // `now` whose lock file is not the one `now` found (none, or another)
  // holds nothing any more: it goes to *gone. `touch` marks it used now;
  // `pin` pins it.
  bool Holds(const std::string& key, const LockFileNow& now, bool touch, bool pin,
             std::vector<DirLock>* gone);
  // Holds `key` by `lock` from now on; for an unpinned claim, the unpinned
  // ones past the cap, least recently used first, go to *gone.
  void Add(std::string key, DirLock lock, bool pin, std::vector<DirLock>* gone);

 private:
  struct Claim {
    std::string key;
    DirLock lock;
    bool pinned = false;
    uint64_t made = 0;  // its number among every claim of this process
  };
  std::vector<Claim> claims_;  // least recently used first
};

// What a weight must be, in the errors that refuse one (set, imported or
// loaded): the forward pass reads it as bf16.
inline constexpr char kWeightsInBf16Range[] =
    "weights must be finite and within bf16's range (|x| < 3.39e38: the forward pass reads them "
    "as bf16)";

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_STATE_FILES_H_
