// libztier (public header of the client component): a training process's
// view of ztier. A Session opens the engine (embedded in this process, or
// ztierd through its socket, behind the same calls), a Model registers the
// units, and each local rank drives a Stage3Runner, which streams a unit's
// bf16 params to the rank's device just ahead of the compute and streams the
// unit's grads back to the engine as each unit's backward ends.
//
// Devices and collectives sit behind interfaces (Device, Collectives): the
// host backend (device memory is host memory, copies run on a copy thread
// with events, so overlap is real) and the CUDA backend; local collectives
// (ranks as threads of one process) and NCCL.
//
// Thread safety: Session and Model methods may be called from any thread.
// A Stage3Runner belongs to one rank and is driven from one thread (the
// rank's training loop); its transfers run on a thread of its own. A Device
// may be shared by the runner's threads (its methods are thread-safe); a
// Collectives object belongs to one rank. Sessions, models, runners and
// host devices belong to the process that made them: in a forked child (a
// data loader's worker) their calls fail with FailedPrecondition, and
// destroying them there frees nothing of the parent's. Nor does the child
// hold the parent's connection to ztierd: killed, the parent's jobs go with
// it, whatever children it forked live on.
//
// Errors: every call returns Status / Result with a message naming the unit,
// the limit or the file at fault; bad use (an unknown unit, a second Step
// with no grads, a buffer of the wrong size) is an error, never a crash.
#ifndef ZTIER_CLIENT_ZTIER_H_
#define ZTIER_CLIENT_ZTIER_H_

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/status.h"
#include "engine/engine.h"
#include "engine/settings.h"

namespace ztier::client {

// ---------------------------------------------------------------- devices --

enum class DeviceKind : uint8_t { kHost, kCuda };
// The in-order queues of a device: kernels run on kCompute, transfers to
// the device (and the collectives of a fetch) on kCopy, transfers to the
// host on kCopyOut. A unit's copy overlaps another unit's compute, and grads
// going to the host overlap params coming in (both directions of the link).
enum class Stream : uint8_t { kCompute, kCopy, kCopyOut };
// What an allocation is for; the device keeps a byte count and a high-water
// mark per purpose (the runner's cap on live params is checked against it).
enum class MemoryPurpose : uint8_t { kParams, kGrads, kOther };
inline constexpr int kMemoryPurposes = 3;

struct MemoryStats {
  uint64_t bytes = 0;       // allocated now
  uint64_t high_water = 0;  // most ever allocated at once (since ResetHighWater)
};

// A point in a stream's work. Complete once everything queued on the stream
// before it is done.
class Event {
 public:
  virtual ~Event() = default;
  virtual bool Done() const = 0;
  // Blocks the caller until the event completes. Errors: the device's.
  virtual Status Synchronize() = 0;
};

// One span of work recorded by the host backend's timeline (and by the
// runner for compute it brackets): which stream, what, when.
struct TimelineSpan {
  Stream stream = Stream::kCompute;
  std::string label;
  std::chrono::steady_clock::time_point start, end;
};

// What the process may do to a host range it registers for DMA: a mapping
// made PROT_READ (ztierd's publish buffers and param cache, sealed against
// writes) is kReadOnly, and must be registered so (CUDA refuses to pin a
// read-only mapping without cudaHostRegisterReadOnly).
enum class HostAccess : uint8_t { kReadWrite, kReadOnly };

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  virtual std::string name() const = 0;
  // The device's index among those of its kind (the CUDA ordinal; 0 for
  // the host).
  virtual int ordinal() const = 0;

  // Device memory, 256 B aligned, uninitialised; accounted at the bytes asked
  // for. Errors: ResourceExhausted.
  virtual Result<void*> Allocate(size_t bytes, MemoryPurpose purpose) = 0;
  // Frees after all work queued so far on both streams. Null is a no-op,
  // and so is any pointer in a forked child (the memory is the parent's). A
  // pointer this device did not allocate, or freed already, stops the
  // process naming it (a programming error, as a double free() is).
  virtual void Free(void* ptr) = 0;
  virtual MemoryStats memory(MemoryPurpose purpose) const = 0;
  virtual void ResetHighWater() = 0;

  // Asynchronous copies and fills, ordered on `stream`. Host pointers passed
  // to the copies should be registered (RegisterHost) for true DMA.
  virtual Status CopyToDevice(void* dst, const void* host_src, size_t bytes, Stream stream) = 0;
  virtual Status CopyToHost(void* host_dst, const void* src, size_t bytes, Stream stream) = 0;
  virtual Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream stream) = 0;
  virtual Status Memset(void* dst, int value, size_t bytes, Stream stream) = 0;

  // Records an event on `stream`; Wait makes `stream` wait for it.
  virtual Result<std::unique_ptr<Event>> Record(Stream stream) = 0;
  virtual Status Wait(Stream stream, Event& event) = 0;
  virtual Status Synchronize(Stream stream) = 0;
  // The backend's native stream handle (cudaStream_t for CUDA; null for host),
  // for kernels launched by the caller.
  virtual void* native_stream(Stream stream) const = 0;

  // Page-locks a host range for DMA (cudaHostRegister; with kReadOnly,
  // cudaHostRegisterReadOnly: the device only reads it). Counted per range:
  // registering a range again is cheap, and each registration is undone by
  // one UnregisterHost; the last one unregisters it (cudaHostUnregister),
  // which must happen before the range is unmapped. The host backend pins
  // nothing, but checks `access` as CUDA does. RegisterHost errors:
  // InvalidArgument (null, or kReadWrite for a range not mapped writable),
  // the device's. UnregisterHost errors: InvalidArgument (not registered).
  virtual Status RegisterHost(void* ptr, size_t bytes, HostAccess access) = 0;
  virtual Status UnregisterHost(void* ptr, size_t bytes) = 0;

  // Timeline of spans (host backend: every copy-stream operation; both
  // backends: spans added with AddSpan). Off until enabled.
  virtual void EnableTimeline(bool on) = 0;
  virtual void AddSpan(TimelineSpan span) = 0;
  virtual std::vector<TimelineSpan> timeline() const = 0;
};

// Test modes of the host backend, which copies far faster than a GPU's DMA
// and so hides ordering bugs between copies and the buffers they read.
struct HostDeviceOptions {
  // Each kCopy copy waits this long before it runs.
  std::chrono::microseconds copy_delay{0};
  // Each kCopy copy checks that its source is unchanged between the call
  // that queued it and its run (a buffer released or reused before its copy
  // finished), unless work queued before it on its stream writes that
  // source (stream order makes that change expected); the first change fails every later
  // Synchronize of the copy stream (and of its events' waiters) with a message naming the copy.
  bool check_copy_sources = false;
  // The device's memory, as a GPU's: an allocation that would take what is
  // allocated past it is ResourceExhausted (0: the machine's memory only).
  uint64_t memory_bytes = 0;
};

// Host backend: device memory is host memory; kCompute work runs on the
// caller's thread, kCopy work on the device's copy thread, in order.
Result<std::unique_ptr<Device>> MakeHostDevice(const HostDeviceOptions& options = {});
// CUDA backend on device `ordinal`: cudaMalloc, a copy and a compute stream,
// events, cudaHostRegister. Errors: Unavailable when the build has no CUDA
// or the machine no device ("no CUDA device: ..."), the CUDA error otherwise.
Result<std::unique_ptr<Device>> MakeCudaDevice(int ordinal);
// Number of CUDA devices (0 when the build has no CUDA or there is no driver).
int CudaDeviceCount();

// ------------------------------------------------------------ collectives --

class Model;

// Collectives among the R ranks of one job, one object per rank. Calls are
// made in the same order by every rank; each is queued on `stream` of the
// rank's device after the work already there (the local backend runs it on
// the calling thread after synchronizing that stream).
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // `buffer` holds world_size shards of `shard_elems`; this rank's shard is
  // filled in; afterwards every shard is.
  virtual Status AllGather(bf16* buffer, size_t shard_elems, Device& device, Stream stream) = 0;
  // `input` holds world_size shards; `output` gets the sum over ranks of
  // shard rank() (summed in fp32 in rank order, rounded to bf16 once, by the
  // local backend; NCCL's bf16 sum rounds per hop).
  virtual Status ReduceScatter(const bf16* input, bf16* output, size_t shard_elems, Device& device,
                               Stream stream) = 0;
  // Ends the group's collectives for every rank: their calls in progress
  // and later ones fail with Aborted. A rank whose runner failed calls it,
  // so that its peers stop at once instead of waiting for it (their
  // timeout). Any thread of the rank may call it.
  virtual void Abort(std::string_view reason) { (void)reason; }
  // Waits for `done`, an event recorded on a stream after this rank's
  // collectives there. The host backends finish a collective before it
  // returns, so this is done.Synchronize(). NCCL's run on the device, where
  // a peer that failed would leave them waiting for good: its wait polls,
  // and ends this rank's communicator (ncclCommAbort) once a rank of the
  // group called Abort or left the job (Aborted), NCCL reports an error, or
  // nothing completes within 10 minutes (Unavailable).
  virtual Status Wait(Event& done) { return done.Synchronize(); }
};

// R ranks as threads of this process (host devices). A rank that does not
// arrive at a collective within `timeout` fails it for the ranks waiting
// (Unavailable), and every later collective of the group fails (Aborted):
// no rank goes on with a peer that gave up. Errors: InvalidArgument.
Result<std::vector<std::unique_ptr<Collectives>>> MakeLocalCollectives(
    int world_size, std::chrono::milliseconds timeout = std::chrono::minutes(10));
// Rank `rank`'s collectives among the ranks of `model`'s job, wherever they
// run (threads of this process, or processes attached through ztierd), met
// in the job's collective region: on host devices the collectives run in
// that shared memory, bit-identical to MakeLocalCollectives (the sum in
// fp32 in rank order, rounded once); on CUDA devices they are NCCL, rank 0
// making the unique id and handing it to the others through the region.
// When a rank's process dies, ztierd tells the others' collectives, which
// fail with Aborted naming the rank instead of waiting; when ztierd ends
// the job (an eviction, a stop) they fail with its reason, and when ztierd
// is gone, with Unavailable saying so (seen within half a second); a rank that waits
// for its peers longer than `timeout` gives up, and its peers stop too.
// Every rank calls this, with the same kind of device. The collectives keep
// the region mapped (they may outlive the model, of no use then). Errors:
// InvalidArgument (rank, a timeout not positive), Aborted (a rank left),
// Unavailable (a peer not there within the timeout), as
// MakeNcclRankCollectives.
Result<std::unique_ptr<Collectives>> MakeJobCollectives(
    Model& model, int rank, Device& device,
    std::chrono::milliseconds timeout = std::chrono::minutes(10));

// NCCL's unique id (ncclUniqueId: 128 bytes), made by one rank
// (MakeNcclId) and handed to the others, each of which makes its
// communicator with it (ncclCommInitRank) on CUDA device `ordinal`.
// Errors: Unavailable without NCCL or the device, NCCL's error naming the
// call.
// `peers` tells a rank of several processes that another one left (then
// its init and waits end, ncclCommAbort, instead of waiting for good) and
// tells the others when this one gives up; either may be empty. A wait
// with nothing done for `peers.timeout` gives up.
using NcclId = std::array<uint8_t, 128>;
struct NcclPeers {
  std::function<Status()> left;  // Aborted naming the rank that left, or OK
  std::function<void()> leave;   // marks this rank as left for the others
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};
Result<NcclId> MakeNcclId();
Result<std::unique_ptr<Collectives>> MakeNcclRankCollectives(int ordinal, int rank, int world_size,
                                                             const NcclId& id,
                                                             NcclPeers peers = {});
// One NCCL communicator per CUDA device in `ordinals` (ranks 0..n-1 of one
// process, ncclCommInitAll). Errors: Unavailable without NCCL or devices.
Result<std::vector<std::unique_ptr<Collectives>>> MakeNcclCollectives(
    const std::vector<int>& ordinals);

// --------------------------------------------------------------- sessions --

struct SessionOptions {
  engine::Settings settings;  // the embedded engine's settings
  // Where ztierd listens. Empty: settings.daemon_socket (ztier.daemon_socket,
  // ZTIER_DAEMON_SOCKET); both empty: the embedded engine in this process.
  // Through a daemon the engine's settings are the daemon's, and this
  // process reads and writes checkpoints and safetensors files itself.
  std::string daemon_socket;
  // The embedded engine's NVMe I/O backend; null: io_uring. Tests pass a
  // fault-injecting one (nvme/io_backend.h).
  std::shared_ptr<nvme::IoBackend> io_backend;
  // The ztierd at daemon_socket was made with these settings (one that a
  // process hosts for its ranks): no warning that the daemon's apply.
  bool daemon_has_these_settings = false;
};

class Transport;  // the seam between the client and an engine (client/transport.h)

class Session {
 public:
  // Errors: as engine::Engine::Create (embedded); as MakeDaemonTransport
  // (client/transport.h): Unavailable when no ztierd answers at the socket,
  // FailedPrecondition when it refuses this uid or speaks another version.
  static Result<std::unique_ptr<Session>> Open(const SessionOptions& options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  std::string transport_name() const;  // "embedded" or "daemon"
  // Whether the session can still serve: Ok, or why not (its ztierd is gone
  // or stopping: every later call fails so; open a new session). In a forked
  // child: FailedPrecondition. An embedded session is always Ok in its process.
  Status Health() const;
  // The engine's pinned DRAM pool: budget, use, and the page size it got.
  engine::DramPoolStats pool_stats() const;
  // The settings the session was opened with (runner defaults among them).
  const engine::Settings& settings() const { return settings_; }

  struct ModelSpec {
    std::string name;
    std::vector<engine::UnitSpec> units;  // in forward order
    engine::OptimizerConfig optimizer;
    engine::Tier optimizer_tier = engine::Tier::kDram;
    engine::Tier param_tier = engine::Tier::kDram;
    int world_size = 1;  // local ranks
    // How the engine keeps the model's m and v. Unset: the session's
    // ztier.state_dtype when a config, variable or flag set it (so it
    // reaches a ztierd too), else the engine's own.
    std::optional<engine::StateDtype> state_dtype = std::nullopt;
    // Ranks in processes of their own (AttachModel): a nonzero value rank 0
    // draws, registers with and hands its other ranks, so that a rank never
    // joins another launch's job of the same name (engine::JobSpec::launch).
    // 0: not checked.
    uint64_t launch = 0;
  };
  // Registers the model's units with the engine. Its ranks run in this
  // process (threads), or rank 0 here and the others in processes of their
  // own that attach (AttachModel). Errors: as engine::Engine::RegisterJob
  // (ResourceExhausted when the model does not fit the configured tiers,
  // naming the job, the unit and the budget).
  Result<std::unique_ptr<Model>> RegisterModel(const ModelSpec& spec);
  // Joins, as `rank` (1..world_size-1, or a rank whose process restarted),
  // the model that rank 0 registers under spec.name through the same ztierd
  // (one process per GPU, as torchrun starts them), waiting up to `timeout`
  // for rank 0's registration. `spec` must be the model rank 0 registered
  // (world size included). The job lives while any rank's Model does; this
  // rank acts for itself only (its grads). Errors: FailedPrecondition (the
  // embedded engine: ranks in other processes need ztierd; a spec that
  // differs, naming the difference), NotFound (no registration in time),
  // AlreadyExists (another process attached that rank), InvalidArgument.
  Result<std::unique_ptr<Model>> AttachModel(
      const ModelSpec& spec, int rank,
      std::chrono::milliseconds timeout = std::chrono::minutes(10));

 private:
  Session(std::shared_ptr<Transport> transport, engine::Settings settings);
  Result<std::unique_ptr<Model>> OpenModel(const ModelSpec& spec, int rank,
                                           std::chrono::milliseconds timeout);
  std::shared_ptr<Transport> transport_;
  engine::Settings settings_;
};

// ztierd's operator interface (what ztierctl speaks): the daemon's status,
// the jobs, quotas per uid, drain and evict. Anyone the socket lets in may
// read the status, their own jobs and their own quota; the rest is for
// operators (root, ztierd's uid, members of its admin group, by default
// ztier-admin) and refused for others with PermissionDenied, naming who
// may. Thread safety: as Session.
class ControlTransport;  // client/transport.h
class DaemonControl {
 public:
  // Errors: Unavailable (no ztierd listens at `socket`: not running),
  // FailedPrecondition (it refused this uid, or speaks another protocol
  // version), PermissionDenied is not returned here (the socket's own
  // permissions: FailedPrecondition naming the path), InvalidArgument
  // (`socket` is no socket); Unavailable also when ztierd does not answer
  // within `call_timeout`, which bounds every call of this object.
  static Result<std::unique_ptr<DaemonControl>> Connect(
      const std::string& socket,
      std::chrono::milliseconds call_timeout = std::chrono::seconds(120));
  ~DaemonControl();
  DaemonControl(const DaemonControl&) = delete;
  DaemonControl& operator=(const DaemonControl&) = delete;

  Result<engine::DaemonStatus> GetStatus();
  // Every job an operator may see (all of them), or the caller's own.
  Result<std::vector<engine::JobInfo>> Jobs();
  // One uid's quota and use (another uid's: operators only).
  Result<engine::QuotaInfo> GetQuota(uint32_t uid);
  // Every uid's the daemon knows of (holding something, or with a quota
  // of its own), and the defaults (operators only).
  Result<std::vector<engine::QuotaInfo>> AllQuotas(engine::Quota* defaults);
  // Errors: PermissionDenied, InvalidArgument (a count below 1),
  // IoError (the quota file could not be written: nothing changed).
  Result<engine::QuotaInfo> SetQuota(const engine::QuotaUpdate& update);
  // New jobs refused (on) or accepted again (off); running jobs go on.
  Status Drain(bool on);
  // Frees job `id` (JobInfo::id): its clients' calls fail with Aborted
  // naming `reason`. Errors: PermissionDenied, NotFound.
  Status Evict(int32_t id, const std::string& reason);

 private:
  explicit DaemonControl(std::shared_ptr<ControlTransport> t) : t_(std::move(t)) {}
  std::shared_ptr<ControlTransport> t_;
};

// A registered or attached model (an engine job). Unregistered when
// destroyed (an attached rank only lets go of the job).
class Model {
 public:
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const Session::ModelSpec& spec() const { return spec_; }
  int units() const { return static_cast<int>(spec_.units.size()); }
  // The unit's flat layout (tensor offsets, padded size, shard size); an
  // unknown unit's is empty (numel 0), and every call with it an error.
  const engine::UnitLayout& layout(int unit) const {
    static const engine::UnitLayout kNone{};
    return unit >= 0 && unit < units() ? layouts_[unit] : kNone;
  }
  // The index of the unit named `name`. Errors: NotFound.
  Result<int> FindUnit(const std::string& name) const;

  // Initial weights, flat fp32 (layout(unit).numel elements), published as
  // step 0. Errors: InvalidArgument (null, the size, a value not finite),
  // OutOfRange (unit).
  // Weights replaced here, by ImportSafetensors or by LoadCheckpoint while
  // a runner lives: a runner of world size 1 fetches again the units it
  // kept on its device (and takes a checkpoint's step as its version);
  // with several ranks, make every rank's runner again after the
  // replacement (their copies are the old weights).
  Status SetWeights(int unit, const float* flat, uint64_t numel);
  Status ImportSafetensors(const std::string& path);
  Status ExportSafetensors(const std::string& path, engine::Engine::ExportType type);
  // Locks `dir` for this model's checkpoints until the model is closed, so
  // that a second run (in this process or another) on the same directory is
  // refused at once, naming the holder's pid (engine::Engine::
  // ClaimCheckpointDir). A save locks it itself, while it is among the
  // model's eight most recently saved to (a load takes no lock: it reads
  // one committed manifest); claim first to fail before training.
  // `until_closed` false: a claim as a save's. Errors: Unavailable (in
  // use), IoError (cannot create it: a read-only filesystem, ...).
  Status ClaimCheckpointDir(const std::string& dir, bool until_closed = true);
  // Between steps (a step whose grads are all in, queued or running in the
  // engine, is waited for, and saved). From another thread while a runner trains: refused
  // (FailedPrecondition, "in flight") while grads of a step are pending;
  // embedded, the runner's next grads wait while it reads the state;
  // through ztierd, a step taken meanwhile fails it (FailedPrecondition,
  // "went from step") and training goes on. Either way, retry at a step
  // boundary. A load or import of the same job meanwhile (another client
  // or thread) refuses it too, embedded ("in progress") and through ztierd
  // (the state "replaced", or a load "under way").
  Status SaveCheckpoint(const std::string& dir);
  // Through ztierd a load (or import) writes unit by unit: a second one of
  // the same job meanwhile (another client or thread) refuses the rest of
  // the first (FailedPrecondition, "another load, import or state write"),
  // which leaves the job the second's state whole; embedded the second is
  // refused ("in progress").
  Status LoadCheckpoint(const std::string& dir);
  // Claims `dir` and removes the files of older checkpoints that its
  // manifest no longer names (a save killed between writing its manifest
  // and removing them leaves them; the next save would). For a run that
  // resumes and may save no more. Errors: as ClaimCheckpointDir; a file
  // that cannot be removed.
  Status TidyCheckpointDir(const std::string& dir);
  // Claims `dir` and removes the checkpoint there: its manifest first, then
  // the shard files of every save (files of other names stay: a user's
  // unit-test-results.txt went too). For a run that starts over where an
  // earlier one saved. Errors: as ClaimCheckpointDir; a file that cannot be
  // removed.
  Status RemoveCheckpoint(const std::string& dir);
  // The learning rate of each optimizer param group (one per group of
  // spec().optimizer: 1 when group_weight_decay is empty, else its size)
  // for the steps that start from now on; until set, every group's is
  // optimizer.hyper.lr. A learning rate scheduler calls it once per step,
  // before the step's last grads are pushed (the engine takes the rates
  // when the step starts; in eager mode, before the step's first grads).
  // Any rank may set them, for the whole job. Errors: InvalidArgument (the
  // count, or a rate not finite and >= 0, naming the group), NotFound.
  Status SetLearningRates(const std::vector<float>& lrs);
  // The fp32 master weights of a unit (layout(unit).padded elements), for
  // tests and inspection, between steps.
  Status ReadMaster(int unit, std::vector<float>* master) const;
  // Optimizer steps the engine has published for every unit (the version a
  // new forward pass reads); -1 while some unit has no weights, or when the
  // engine cannot be asked (ztierd gone, or not answering).
  int64_t published_step() const;
  // The same, with why there is none: FailedPrecondition (a unit without
  // weights, naming it), the transport's error.
  Result<int64_t> PublishedStep() const;
  // Waits until every unit holds step >= `step` (the optimizer has finished
  // it). Errors: Unavailable on timeout, Aborted if the job failed,
  // FailedPrecondition at once for a step past the one whose grads the job
  // takes next (it would wait on grads not yet pushed).
  Status WaitPublished(int64_t step, std::chrono::milliseconds timeout) const;
  // The job's traffic and time so far. Errors: Unavailable when ztierd is
  // gone or does not answer.
  Result<engine::JobCounters> counters() const;
  // How the engine keeps the model's m and v: the spec's, else the
  // session's setting, else the engine's own (ztierd's through one).
  Result<engine::StateDtype> state_dtype() const;

  Transport& transport() const { return *transport_; }
  int job() const { return job_; }
  // The rank this process attached as (Session::AttachModel); -1 when it
  // registered the model (its ranks are this process's threads, or it is
  // rank 0 of ranks in other processes).
  int attached_rank() const { return attached_rank_; }

 private:
  friend class Session;
  friend class Stage3Runner;
  // (Its collectives keep the transport, to hear of ztierd's end.)
  friend Result<std::unique_ptr<Collectives>> MakeJobCollectives(Model&, int, Device&,
                                                                 std::chrono::milliseconds);
  Model(std::shared_ptr<Transport> transport, int job, Session::ModelSpec spec,
        std::vector<engine::UnitLayout> layouts, int attached_rank);
  std::shared_ptr<Transport> transport_;
  int job_;
  Session::ModelSpec spec_;
  std::vector<engine::UnitLayout> layouts_;
  int attached_rank_;
  // The ranks a Stage3Runner of this process serves (one runner a rank:
  // a second one's pushes would add to the first's in the same step).
  std::mutex runners_mu_;
  std::set<int> runner_ranks_;
};

// --------------------------------------------------------- stage-3 runner --

struct RunnerOptions {
  // Units fetched ahead of the one being acquired, in the learned order.
  int prefetch_depth = 2;
  // Cap on param bytes live on the device (held, prefetched or in flight);
  // 0: no cap. A unit that cannot fit beside the held ones is an error.
  uint64_t max_live_bytes = 0;
  // Units whose bf16 params take at most this many bytes stay on the device
  // once fetched (refreshed once per step), instead of being freed on release.
  uint64_t persistence_threshold = 0;
  // Copies over the link smaller than this many bytes are coalesced: small
  // units consecutive in the learned order are fetched in one copy (each
  // whole on every rank, without an all-gather) as far as the engine has
  // published them when the first is copied, through a staging buffer of
  // this size on the device; nothing waits for a later unit to fill a
  // copy. With world size 1 small pushes queued and ready together go in
  // one copy, through a second such buffer. With world size R > 1 the
  // pushes of units whose shard is small are grouped as the calls come
  // (consecutive pushes of units side by side, up to R times this many
  // bytes, sent when the next push cannot join or at Step()): one
  // reduce-scatter and one copy of about this size per rank for the group,
  // through device buffers of R + 1 times this size; the fetches of units
  // over this size whose shard is under it are grouped so too once fetched
  // at the step's version before (the backward's; units side by side in
  // the engine's memory, params in DRAM): one copy per rank of its R-th of
  // the group's span, and one all-gather. Every rank must use
  // the same value. 0: every unit is copied alone. At most 1 GiB.
  uint64_t coalesce_bytes = uint64_t{4} << 20;
  // How long a transfer may wait on the engine (a published version, a slot).
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Adds each unit's compute span (acquire to release) to the device timeline.
  bool record_compute_spans = false;
};

// Runner options from the engine settings (config file keys
// zero_optimization.stage3_max_live_parameters, .stage3_param_persistence_threshold,
// ztier.prefetch_depth, ztier.coalesce_bytes and ztier.wait_timeout, or their
// ZTIER_* variables);
// bf16 params are 2 bytes.
RunnerOptions RunnerOptionsFrom(const engine::Settings& settings);

struct RunnerStats {
  int64_t micro_steps = 0;
  int64_t fetches = 0;        // unit fetches (host -> device)
  int64_t prefetch_hits = 0;  // acquires whose unit was already fetched or in flight
  int64_t order_changes = 0;  // times the acquire order left the learned one
  // Times a prefetch stopped at a unit it could not queue (the device out
  // of memory): that unit was fetched when acquired instead.
  int64_t prefetches_refused = 0;
  uint64_t h2d_bytes = 0;  // params copied to this rank's device
  uint64_t d2h_bytes = 0;  // grads copied to the engine
  int64_t h2d_copies = 0;  // copies over the link, each way (coalesced ones count once)
  int64_t d2h_copies = 0;
  double acquire_wait_seconds = 0;  // the compute thread blocked in Acquire
  double step_wait_seconds = 0;     // Step() waiting for grads to land
  // The same waits (Acquire's and Step's) by what the transfers were doing
  // meanwhile, each second counted once: waiting for the engine (its
  // optimizer to publish a unit, or to take the step before's grads: the
  // optimizer's critical path), copying to the device, copying to the host,
  // in collectives (R > 1). What is left of the waits (the device finishing
  // the kernels that write the grads) is compute.
  double wait_optimizer_seconds = 0;
  double wait_h2d_seconds = 0;
  double wait_d2h_seconds = 0;
  double wait_collective_seconds = 0;
};

// One rank's stage-3 driver. Per micro-step the training loop calls, for
// each unit it computes: Acquire (the unit's full bf16 params on the device,
// at the version this step reads), Release, and in backward GradBuffer +
// PushGrads; then Step(). The runner learns the acquire order in the first
// micro-step and prefetches by it afterwards (it logs when the order
// changes, and relearns). Step() ends the micro-step: it waits until every
// grad of the micro-step has reached the engine (the engine's optimizer
// needs them), and at an accumulation boundary moves to the next version,
// which the next forward pass's acquires wait for, unit by unit.
class Stage3Runner {
 public:
  // `collectives` is required when world_size > 1 (else may be null); when
  // given, its world size and rank must be the model's and `rank`. The
  // model, device and collectives must outlive the runner. The model's
  // weights must be set; on a rank attached from another process, Create
  // waits (up to options.timeout) for rank 0 to set them. Errors:
  // InvalidArgument (rank, collectives, options), as Device::RegisterHost.
  static Result<std::unique_ptr<Stage3Runner>> Create(Model& model, int rank, Device& device,
                                                      Collectives* collectives,
                                                      const RunnerOptions& options);
  // Finishes the transfers queued. With world size 1, a step begun and not
  // finished (grads pushed, no Step(): an exception's unwind) is dropped as
  // by AbortStep, so the next runner on the model starts it afresh.
  ~Stage3Runner();
  Stage3Runner(const Stage3Runner&) = delete;
  Stage3Runner& operator=(const Stage3Runner&) = delete;

  // The unit's full bf16 params (layout.padded elements) on the device, ready
  // for kernels on the compute stream; valid until Release. Acquiring a unit
  // already held is allowed (one Release each). Errors: OutOfRange (unit),
  // ResourceExhausted (the live-bytes cap cannot hold it beside the held
  // units), the engine's or device's error (naming the unit).
  Result<const bf16*> Acquire(int unit);
  // Errors: OutOfRange, FailedPrecondition (not held).
  Status Release(int unit);
  // Releases every unit held, as often as it was acquired: the cleanup of
  // a pass interrupted between an acquire and its release (an exception,
  // Ctrl-C). Returns the releases made. Errors: as Release.
  Result<int> ReleaseAll();
  // A zeroed device buffer for the unit's grads (layout.padded elements), to
  // be filled by the compute stream and passed to PushGrads. Errors:
  // OutOfRange, FailedPrecondition (grads already pushed this micro-step).
  Result<bf16*> GradBuffer(int unit);
  // Sends the unit's grads (the buffer from GradBuffer, after the compute
  // stream work queued so far): reduce-scatter when world_size > 1, copy of
  // this rank's shard into the engine's inbox, then the doorbell. With
  // world_size > 1 the push of a unit whose shard is under coalesce_bytes
  // may wait for the pushes after it, to go with them (at the latest at
  // Step()). The buffer belongs to the runner again. Errors: OutOfRange,
  // FailedPrecondition (no GradBuffer, or pushed twice in a micro-step).
  Status PushGrads(int unit);
  // Pushes grads from the caller's own device buffer: `count` bf16 values,
  // the unit's numel or its padded size (the rest is zero), copied on the
  // compute stream into a grad buffer, then pushed as above; the caller's
  // buffer is free again once the compute stream passes this point. Errors:
  // InvalidArgument (count, naming the unit and the sizes it takes), as
  // GradBuffer and PushGrads.
  Status PushGrads(int unit, const bf16* grads, uint64_t count);
  // Ends the micro-step, and prefetches the next one's first units (as
  // SetOrder). Errors: FailedPrecondition (a unit without grads, naming it,
  // e.g. Step called twice), the first transfer error of its grads.
  Status Step();
  // Undoes the step in progress after a backward pass that failed (an
  // exception, an interrupt) once some of its grads were pushed: waits for
  // the pushes queued, then the engine drops every grad delivered since the
  // last optimizer step (with gradient accumulation, the earlier
  // micro-steps' too), and the next micro-step starts that step afresh at
  // the same version; grad buffers handed out and not pushed are zeroed.
  // The pass's acquire order is not learned. Returns the micro-steps that
  // were discarded whole. World size 1 only (with more ranks, a rank whose
  // backward failed has left its peers' collectives waiting: the job must
  // restart from a checkpoint). Errors: FailedPrecondition (world size >
  // 1; a unit still acquired; the engine has begun the step: eager mode, or
  // every unit's grads were in; or has run it: the grads are applied, and
  // Step() goes on from there), the first transfer error.
  Result<int> AbortStep();

  // The version (optimizer steps) the current micro-step reads.
  int64_t version() const;
  RunnerStats stats() const;
  // The learned acquire order (unit indices) of the active kind of pass,
  // empty before its first pass ended.
  std::vector<int> learned_order() const;

  // Selects the kind of pass the next acquires belong to, each with a
  // learned order of its own, so that passes of different kinds (training,
  // evaluation, generation, a gather of every unit) do not make each other
  // relearn. Key 0 is training: its pass is the micro-step, ended by Step()
  // (which switches back to key 0). Any other key starts a new pass of that
  // kind, ending the previous pass of the key that was active. Starting a
  // pass whose order is known prefetches its first units (as far as the
  // device has room: a unit it cannot take now is fetched when acquired).
  // Errors: InvalidArgument (key < 0).
  Status SetOrder(int key);
  int order_key() const;

  struct Impl;

 private:
  explicit Stage3Runner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// --------------------------------------------------------------- stopping --

// A clean stop on SIGINT / SIGTERM for a training loop (what ztier-train
// does): InstallStopHandlers() makes the first such signal only record its
// number, which StopRequested() returns; the loop checks it at a step
// boundary, saves a checkpoint (and whatever else it owes) and exits with
// 128 + the signal. A second SIGINT or SIGTERM ends the process at once.
// Process-wide; the handler is async-signal-safe. Errors: IoError (a
// sigaction failed).
Status InstallStopHandlers();
// 0 until a stop was requested; then SIGINT or SIGTERM.
int StopRequested();

}  // namespace ztier::client

#endif  // ZTIER_CLIENT_ZTIER_H_
