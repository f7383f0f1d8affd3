// ztier engine: the wire types, the values that cross the boundary between
// a client and the engine, in one process or across the daemon's socket:
// what a job registers (JobSpec), how a unit is laid out (UnitLayout), what
// the engine reports (JobCounters, DramPoolStats). Plain structs with no
// behaviour; this header depends on nothing but the standard library and
// cpu_adam/hyper.h, so a client of the daemon does not link the engine.
// Their encoding for the socket is engine/protocol.h's; kWireVersion names
// the layout of these structs there and changes with any field.
#ifndef ZTIER_ENGINE_WIRE_TYPES_H_
#define ZTIER_ENGINE_WIRE_TYPES_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cpu_adam/hyper.h"

namespace ztier::engine {

// 2: a tensor's param group and frozen flag, the groups' weight decays.
// 3: the step-time histogram, the last step's time and the clients' device
// traffic in JobCounters; the operator's types (DaemonStatus, JobInfo,
// quotas); a job's own state dtype in its JobSpec.
// 4: no struct changed; the protocol's version moves with this one
// (protocol.h), and it gained abort_step.
// 5: the job's state dtype in its JobHandle.
// 6: cpu_adam::Hyper's betas are double.
// 7: no struct changed; the protocol gained check_consistent.
// 8: a JobSpec's launch.
// 9: a QuotaInfo's lingering bytes and the processes holding them.
// 10: abort_step names the step whose grads it drops; the step page ends
// with the weights' generation.
// 11: no struct changed; a state write and commit through ztierd name the
// weights generation they expect, and an import's commit keeps the job's
// steps (protocol.h).
// 12: a SwapPathUsage's waiting operations, quiet time and problem.
inline constexpr uint16_t kWireVersion = 12;

// The steps of a state committed unit by unit (Engine::CommitState) that
// are the job's own as it commits (an import's).
inline constexpr int64_t kKeepSteps = -1;
// The largest step (and AdamW step) a job may be set to, by a load or a
// commit: far past any training's, and far enough below INT64_MAX that the
// step after it never overflows.
inline constexpr int64_t kMaxStep = int64_t{1} << 62;

// A job's step page (Engine::PublishedSteps): each unit's published step,
// then the weights' generation, one int64 each.
inline constexpr uint64_t StepPageBytes(uint64_t units) { return (units + 1) * sizeof(int64_t); }

enum class Tier : uint8_t { kDram, kNvme };
// How the engine keeps the AdamW moments m and v (ztier.state_dtype): fp32,
// or 8-bit block-wise quantized (cpu_adam/adamw.h, StepInt8). The fp32
// master is kept either way.
enum class StateDtype : uint8_t { kFp32, kInt8 };
// "fp32" or "int8", as settings, manifests and ztierctl spell it.
inline std::string_view StateDtypeName(StateDtype d) {
  return d == StateDtype::kInt8 ? "int8" : "fp32";
}

inline constexpr uint64_t kAlignElements = 64;  // 256 B of fp32, 128 B of bf16
// Limits on what a job may register (far above any real model; they keep
// every size computation inside 64 bits).
inline constexpr uint64_t kMaxUnitElements = uint64_t{1} << 40;
inline constexpr uint64_t kMaxJobElements = uint64_t{1} << 48;
inline constexpr uint32_t kMaxNameBytes = 1024;  // a job's, a unit's, a tensor's
inline constexpr uint32_t kMaxUnits = 1 << 17;
inline constexpr uint64_t kMaxUnitRanks = uint64_t{1} << 22;  // units x ranks
inline constexpr uint32_t kMaxTensorsPerUnit = 1 << 16;
inline constexpr uint32_t kMaxDims = 8;  // 0 dims: a scalar
// Optimizer param groups of a job (group_weight_decay, learning rates).
inline constexpr uint32_t kMaxParamGroups = 1 << 16;
inline constexpr int kMaxGradAccumulation = 1 << 20;

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  // The tensor's optimizer param group (OptimizerConfig::group_weight_decay;
  // its learning rate is the group's, Engine::SetLearningRates).
  uint32_t group = 0;
  // Never updated (requires_grad false): its master, m and v stay as they
  // are and its params stay the bf16 rounding of its master. Its grads are
  // not applied, yet count in the global norm as delivered: clients push
  // zeros for them.
  bool frozen = false;
};

// A shape as messages spell it: "[768, 3072]", "[]" for a scalar.
inline std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

struct UnitSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
};

enum class StepMode : uint8_t { kExact, kEager };

struct OptimizerConfig {
  cpu_adam::Hyper hyper;
  float clip_norm = 0.0f;  // global-norm clipping threshold; 0: off
  int grad_accumulation = 1;
  StepMode mode = StepMode::kExact;
  // The weight decay of each optimizer param group, by group index. Empty:
  // one group (0) whose weight decay is hyper.weight_decay. Otherwise
  // hyper.weight_decay is unused and every tensor's group is below its
  // size. Every group starts at hyper.lr (Engine::SetLearningRates changes
  // it).
  std::vector<float> group_weight_decay;
};

struct JobSpec {
  std::string name;
  std::vector<UnitSpec> units;  // in forward order
  int ranks = 1;
  OptimizerConfig optimizer;
  Tier optimizer_tier = Tier::kDram;
  Tier param_tier = Tier::kDram;
  // How the job's m and v are kept; unset: the engine's ztier.state_dtype.
  std::optional<StateDtype> state_dtype = std::nullopt;
  // Which start of the job this is, for ranks in processes of their own:
  // rank 0 draws a nonzero value, registers with it and hands it to its
  // other ranks, and ztierd refuses an attach that names another (a rank of
  // another launch that uses the same job name). 0 on either side: not
  // checked.
  uint64_t launch = 0;
};

struct UnitLayout {
  uint64_t numel = 0;             // sum of the tensors' elements
  uint64_t padded = 0;            // multiple of ranks x kAlignElements
  uint64_t shard = 0;             // padded / ranks
  std::vector<uint64_t> offsets;  // of each tensor in the flat buffer
};

// Upper bounds (seconds) of the buckets of a job's step-time histogram
// (JobCounters::step_seconds_buckets); the last bucket is everything above.
inline constexpr std::array<double, 14> kStepSecondsBounds = {
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120};

struct JobCounters {
  // Steps count once done: with states on NVMe and params in DRAM, a step's
  // units are visible (WaitPublished) before its write-backs end.
  int64_t steps = 0;          // optimizer steps taken
  int64_t skipped_steps = 0;  // skipped for inf/NaN grads
  double optimizer_seconds = 0;
  // Of the last step done: from its start (the last grads in, exact mode;
  // its first unit's update, eager mode) to its end.
  double last_step_seconds = 0;
  // How many steps took at most kStepSecondsBounds[i] (and more than the
  // bound before); the last entry counts those above every bound.
  std::array<uint64_t, kStepSecondsBounds.size() + 1> step_seconds_buckets{};
  double stall_seconds = 0;  // clients blocked in WaitPublished
  // Before clipping, of the last step whose grads are all in (exact mode):
  // set before any of its units is published.
  double last_grad_norm = 0;
  double compute_seconds = 0;          // in the AdamW kernel
  double io_wait_seconds = 0;          // the optimizer blocked on the drives (NVMe tier)
  uint64_t dram_bytes = 0;             // pinned DRAM held (state, buffers, ring)
  uint64_t dram_page_bytes = 0;        // the page size the pinned pool got (4 KiB or 2 MiB)
  uint64_t nvme_bytes = 0;             // swap space held
  uint64_t grad_bytes_in = 0;          // bf16 grads delivered by clients into DRAM
  uint64_t nvme_read_bytes = 0;        // optimizer state read from the drives
  uint64_t nvme_write_bytes = 0;       // optimizer state (and params) written to the drives
  uint64_t nvme_param_read_bytes = 0;  // params read into the param cache
  // What the job's ranks copied between their devices and the engine's
  // memory (params in, grads out), as their runners report it in the job's
  // client page (Engine::ClientCounters).
  uint64_t host_to_device_bytes = 0;
  uint64_t device_to_host_bytes = 0;
};

// A job's client page: per rank, kClientCounterWords u64 that the rank's
// runner adds its device traffic to (relaxed atomic adds), in the job's
// grad-inbox region (clients write it); the engine sums them.
inline constexpr uint64_t kClientCounterWords = 8;
enum ClientCounter : uint32_t { kHostToDeviceBytes = 0, kDeviceToHostBytes = 1 };

// Bytes moved per tier: engine-wide since start (retired jobs included), or
// over a window.
struct TierBytes {
  uint64_t nvme_read = 0;   // optimizer state and params read from the drives
  uint64_t nvme_write = 0;  // written to them
  uint64_t host_to_device = 0;
  uint64_t device_to_host = 0;
};

// The engine's totals since it started: every job it ever held.
struct EngineTotals {
  TierBytes bytes;
  uint64_t grad_bytes_in = 0;
  int64_t steps = 0;
  int64_t skipped_steps = 0;
  double optimizer_seconds = 0;
  double stall_seconds = 0;
  int64_t jobs_registered = 0;
};

// One swap path of the engine: its file's size now, the bytes its objects
// take in it, and what it may grow to (the cap, else the file plus the
// free space of its filesystem); its disk operations waiting and, while
// some do, the seconds since one last finished (a stalled drive); what is
// wrong with it ("": nothing known).
struct SwapPathUsage {
  std::string path;
  uint64_t used_bytes = 0;
  uint64_t file_bytes = 0;
  uint64_t capacity_bytes = 0;
  uint64_t waiting_ops = 0;
  double quiet_seconds = 0;
  std::string problem;
};

// ---- the operator's view of ztierd (ztierctl, the metrics endpoint)

enum class JobState : uint8_t {
  kTraining,  // held by a client's connection
  kParked,    // its last client left; kept for the grace period
  kFailed,    // the engine failed it (an I/O error, eager inf/NaN): see `failure`
};

// A job as the operator sees it. `id` names it to `ztierctl evict`.
struct JobInfo {
  int32_t id = 0;
  uint32_t uid = 0;
  std::string name;
  JobState state = JobState::kTraining;
  std::string failure;  // why it failed, when it did
  int32_t world_size = 1;
  int32_t attached = 0;  // connections holding it
  int64_t step = 0;      // completed steps
  StateDtype state_dtype = StateDtype::kFp32;
  Tier optimizer_tier = Tier::kDram;
  Tier param_tier = Tier::kDram;
  JobCounters counters;
};

// Per-uid limits; 0 bytes: none (only the engine's budget).
struct Quota {
  int32_t max_jobs = 0;
  int32_t max_connections = 0;
  uint64_t max_dram_bytes = 0;
  uint64_t max_nvme_bytes = 0;
};

// A uid's quota and what it holds now.
struct QuotaInfo {
  uint32_t uid = 0;
  Quota quota;
  bool custom = false;  // set for this uid (else the daemon's defaults)
  int32_t jobs = 0;
  int32_t connections = 0;
  uint64_t dram_bytes = 0;
  uint64_t nvme_bytes = 0;
  // Of dram_bytes: freed jobs' memory (an evicted job's) that live
  // processes still map (a stopped client), charged until they exit; the
  // first kMaxLingeringPids of those processes.
  uint64_t lingering_bytes = 0;
  std::vector<int32_t> lingering_pids = {};
};
inline constexpr size_t kMaxLingeringPids = 16;

// A change of one uid's quota: the fields whose bit is set in `set`
// (kQuota* below), or `reset` to the daemon's defaults.
inline constexpr uint32_t kQuotaMaxJobs = 1u << 0;
inline constexpr uint32_t kQuotaMaxConnections = 1u << 1;
inline constexpr uint32_t kQuotaMaxDram = 1u << 2;
inline constexpr uint32_t kQuotaMaxNvme = 1u << 3;
struct QuotaUpdate {
  uint32_t uid = 0;
  uint32_t set = 0;
  bool reset = false;
  Quota quota;
};

// ztierd as a whole (ztierctl status).
struct DaemonStatus {
  std::string version;  // "0.1.0"
  uint16_t protocol = 0;
  double uptime_seconds = 0;
  bool draining = false;  // new jobs refused (ztierctl drain)
  bool caller_is_admin = false;
  uint32_t optimizer_threads = 0;
  int32_t connections = 0;
  int32_t jobs = 0;
  uint64_t requests = 0;
  uint64_t refused = 0;
  // Pinned DRAM: the pool (budget, reserved, used), filled below.
  uint64_t dram_budget_bytes = 0;
  uint64_t dram_reserved_bytes = 0;
  uint64_t dram_used_bytes = 0;
  uint64_t dram_page_bytes = 0;
  std::vector<SwapPathUsage> swap;
  EngineTotals totals;
  // Over the last `window_seconds` (about a minute once ztierd has run that
  // long).
  TierBytes window;
  double window_seconds = 0;
};

// What another process (a client of the daemon) may do with a region of
// the engine's pinned memory it maps.
enum class RegionAccess : uint8_t { kReadWrite = 1, kReadOnly = 2 };

// A buffer in one of a job's shared regions: region index (never reused),
// the region's size, the buffer's offset and size in it, and what a client
// may do with it.
struct SharedBuffer {
  uint32_t region = 0;
  uint64_t region_bytes = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  RegionAccess access = RegionAccess::kReadOnly;
};

// A job's collective region: memory every rank of the job maps read-write,
// where ranks in different processes meet for collectives (client/
// job_collectives.cc lays it out). The daemon writes one word of it: when a
// rank's connection closes while the job lives, the abort word becomes 1 +
// that rank and its waiters are woken (FUTEX_WAKE on the futex word), so
// the others fail at once instead of at their timeout.
// An abort word of kCollectiveEndedByDaemon: ztierd ended the job itself
// (an operator evicted it, or ztierd is stopping); the next request on the
// job says why.
inline constexpr uint64_t kCollectiveAbortOffset = 0;  // u32
inline constexpr uint32_t kCollectiveEndedByDaemon = 0xffffffffu;
inline constexpr uint64_t kCollectiveFutexOffset = 4;  // u32
inline constexpr uint64_t kCollectiveHeaderBytes = 4096;
// After the header, a slot of this many bytes per rank: a job's region is
// CollectiveRegionBytes(its ranks), no other size (charged to its uid's
// DRAM quota while it exists).
inline constexpr uint64_t kCollectiveSlotBytes = uint64_t{4} << 20;
inline constexpr uint64_t kMaxCollectiveRegionBytes = uint64_t{1} << 30;
constexpr uint64_t CollectiveRegionBytes(int ranks) {
  return kCollectiveHeaderBytes + static_cast<uint64_t>(ranks) * kCollectiveSlotBytes;
}

// A safetensors export's element type.
enum class ExportType : uint8_t { kBFloat16, kFloat32 };

struct DramPoolStats {
  uint64_t budget_bytes = 0;
  uint64_t reserved_bytes = 0;  // regions made
  uint64_t used_bytes = 0;      // blocks handed out
  uint32_t regions = 0;
  uint32_t locked_regions = 0;
  uint32_t hugetlb_regions = 0;
  uint64_t huge_page_bytes = 0;  // reserved bytes backed by 2 MiB pages (hugetlb or THP)
  // The page size most of the pool sits on: 4096, or 2 MiB when at least
  // half of the reserved bytes are on huge pages; 0 before any region.
  uint64_t page_bytes = 0;
};

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_WIRE_TYPES_H_
