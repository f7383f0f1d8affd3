// The daemon transport: libztier's calls sent to ztierd over its socket
// (engine/protocol.h), with the job's regions mapped into this process. It
// links the wire code only, never the engine.
//
// One receiver thread reads every reply and hands it to the caller waiting
// on its request id, so a call that blocks in the daemon (an acquire, a
// publish wait) never holds up the others. The regions of a job are mapped
// when it registers (grad inboxes read-write, params read-only) and
// unmapped when it unregisters; the engine hands out {region, offset},
// turned into pointers here after a bounds check.
//
// Thread safety: every method from any thread. Failure: the daemon's errors
// as it sent them; Unavailable naming the socket when the daemon is gone
// (closed connection, no answer in time: every waiting call fails at once),
// with the daemon's reason when it said one (a stop); InvalidArgument for a
// region or buffer the daemon described wrongly.
//
// Checkpoints and safetensors files are read and written here, by the
// client, with the format code the engine uses (engine/state_files.h); the
// state moves through staging memfds, so the daemon never opens a path a
// client names (it cannot be made to read or write another user's files).
// The client holds the lock on a checkpoint directory it saves to.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/transport.h"
#include "common/dir_lock.h"
#include "common/log.h"
#include "engine/engine.h"
#include "engine/protocol.h"
#include "engine/seqpacket.h"
#include "engine/shared_memory.h"
#include "engine/state_files.h"

namespace ztier::client {
namespace {

namespace p = engine::protocol;
using engine::Mapping;
using engine::RegionAccess;
using engine::SeqPacketSocket;
using engine::SharedBuffer;

// How long a call that does not wait on training progress may take; calls
// that do (acquire, publish wait) get their own timeout plus this margin.
constexpr std::chrono::seconds kCallTimeout{120};
// The most a hello may take: ztierd answers it at once. A socket where
// nothing answers (a stopped or stuck ztierd, a listener of another
// program) held the session's open for the whole call timeout.
constexpr std::chrono::seconds kHelloTimeout{15};
// A drive far slower than any NVMe drive (or one shared with other jobs'
// steps): a call that moves a unit's state gets that long for its bytes on
// top of the call timeout.
constexpr uint64_t kSlowDriveBytesPerSecond = uint64_t{8} << 20;

struct Reply {
  std::string payload;  // after the status
  std::vector<UniqueFd> fds;
};

// A memfd this process made to move bulk data through, mapped here.
struct Staging {
  static Result<Staging> Make(uint64_t bytes) {
    Staging s;
    ZT_ASSIGN_OR_RETURN(s.fd, engine::MakeStagingMemfd("ztier-staging", bytes));
    ZT_ASSIGN_OR_RETURN(s.map, Mapping::Map(s.fd.get(), bytes, true, "the staging memfd"));
    return s;
  }
  float* floats() const { return static_cast<float*>(map.data()); }
  UniqueFd fd;
  Mapping map;
};

// The sockets of the live connections to ztierd. A child forked from this
// process (a data loader's worker) lets go of them: its copy of a
// connection kept it open, and the jobs on it registered, their names
// taken and their memory charged, after the client itself died. Each is
// made /dev/null in the child, under the same fd, which the child's copy of
// the transport never uses (ForkSafe) nor closes. The registry's lock is
// held across fork (pthread_atfork), so a connection closing meanwhile is
// either still listed and open, or closed and gone.
class ForkedChildLetsGo {
 public:
  static ForkedChildLetsGo& Get() {
    static ForkedChildLetsGo* const registry = new ForkedChildLetsGo();  // never destroyed
    return *registry;
  }
  void Add(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    fds_.push_back(fd);
  }
  // Closes the connection `close` closes, its fd no longer listed.
  template <class Close>
  void Remove(int fd, Close close) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase(fds_, fd);
    close();
  }

 private:
  ForkedChildLetsGo() {
    ::pthread_atfork([] { Get().mu_.lock(); }, [] { Get().mu_.unlock(); },
                     [] {
                       ForkedChildLetsGo& r = Get();
                       const int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
                       if (null_fd >= 0) {
                         for (int fd : r.fds_) (void)::dup3(null_fd, fd, O_CLOEXEC);
                         ::close(null_fd);
                       }
                       r.mu_.unlock();
                     });
  }
  std::mutex mu_;
  std::vector<int> fds_;
};

class DaemonTransport final : public Transport, public ControlTransport {
 public:
  // `name`: the hello's ("libztier", or the operator's tool's).
  // `call_timeout`: how long a call that does not wait on training may take.
  static Result<std::shared_ptr<DaemonTransport>> Connect(
      const std::string& path, std::string_view name = "libztier",
      std::chrono::milliseconds call_timeout = kCallTimeout) {
    ZT_ASSIGN_OR_RETURN(SeqPacketSocket sock, SeqPacketSocket::Connect(path));
    auto t = std::shared_ptr<DaemonTransport>(new DaemonTransport(path, std::move(sock)));
    t->call_timeout_ = call_timeout;
    t->operator_ = name == p::kOperatorClientName;
    t->receiver_ = std::thread([raw = t.get()] { raw->ReceiveLoop(); });
    Result<Reply> r =
        t->Call(p::MessageType::kHello, p::Encode(p::Hello{.name = std::string(name)}), {},
                std::min<std::chrono::milliseconds>(t->call_timeout_, kHelloTimeout));
    if (!r.ok()) {
      const Status& s = r.status();
      if (s.code() == StatusCode::kUnavailable &&
          s.message().find("did not answer a request (hello)") != std::string::npos) {
        return Status::Unavailable(StrCat(s.message(), " (or what listens there is no ztierd)"));
      }
      if (s.message().starts_with("ztierd at ")) return s;
      return Status(s.code(), StrCat("ztierd at ", path, ": ", s.message()), s.sys_errno());
    }
    ZT_ASSIGN_OR_RETURN(p::Hello h, p::DecodeHello(r->payload));
    ZT_LOG(kInfo, "client") << "connected to " << h.name << " at " << path;
    return t;
  }

  ~DaemonTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    sock_.Shutdown();
    if (receiver_.joinable()) receiver_.join();
    ForkedChildLetsGo::Get().Remove(sock_.fd(), [this] { sock_ = SeqPacketSocket(); });
  }

  std::string name() const override { return "daemon"; }

  Result<int> RegisterJob(const engine::JobSpec& spec) override {
    ZT_RETURN_IF_ERROR(engine::ValidateJobSpec(spec));  // as the embedded engine says it
    return OpenJob(p::MessageType::kRegisterJob, p::Encode(spec), spec, call_timeout_);
  }

  Result<int> AttachJob(const engine::JobSpec& spec, int rank,
                        std::chrono::milliseconds timeout) override {
    ZT_RETURN_IF_ERROR(engine::ValidateJobSpec(spec));
    // The daemon waits a day at most (a longer wait is one day's).
    timeout = std::min(timeout, p::kMaxWait);
    return OpenJob(p::MessageType::kAttachJob,
                   p::Encode(p::AttachRequest{.rank = rank, .timeout = timeout, .spec = spec}),
                   spec, timeout + call_timeout_);
  }

  Result<std::shared_ptr<void>> CollectiveRegion(int job, uint64_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto j = jobs_.find(job);
      if (j == jobs_.end()) return Status::NotFound(StrCat("job ", job, " is not mapped"));
      if (const auto& c = j->second.collectives; c != nullptr) {
        if (c->bytes() != bytes) {
          return Status::InvalidArgument(StrCat("job '", j->second.spec.name,
                                                "': its collective region has ", c->bytes(),
                                                " bytes, asked for ", bytes));
        }
        return std::shared_ptr<void>(c, c->data());
      }
    }
    ZT_ASSIGN_OR_RETURN(
        Reply r,
        Call(p::MessageType::kCollectiveRegion,
             p::Encode(p::CollectiveRegionRequest{.job = job, .bytes = bytes}), {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::RegionList list, p::DecodeRegionList(r.payload));
    if (list.regions.size() != 1 || r.fds.size() != 1 || list.regions[0].bytes != bytes ||
        list.regions[0].access != RegionAccess::kReadWrite) {
      return Status::Corruption(StrCat("ztierd answered a collective region request with ",
                                       list.regions.size(), " regions and ", r.fds.size(),
                                       " memfds"));
    }
    ZT_RETURN_IF_ERROR(engine::CheckPeerMemfd(r.fds[0].get(), bytes, bytes,
                                              RegionAccess::kReadWrite, "the collective region")
                           .status());
    ZT_ASSIGN_OR_RETURN(Mapping m,
                        Mapping::Map(r.fds[0].get(), bytes, true, "the collective region"));
    std::lock_guard<std::mutex> lock(mu_);
    auto j = jobs_.find(job);
    if (j == jobs_.end()) return Status::NotFound(StrCat("job ", job, " is not mapped"));
    auto& c = j->second.collectives;
    if (c == nullptr) c = std::make_shared<Mapping>(std::move(m));
    return std::shared_ptr<void>(c, c->data());
  }

  Status UnregisterJob(int job) override {
    Result<Reply> r =
        Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = job}), {}, call_timeout_);
    // The mappings go either way: the job is gone or the daemon is.
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.erase(job);
    deferred_.erase(job);
    return r.status();
  }

  Result<engine::UnitLayout> Layout(int job, int unit) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(job);
      if (it != jobs_.end() && unit >= 0 && unit < static_cast<int>(it->second.layouts.size()) &&
          it->second.layouts[unit].numel > 0) {
        return it->second.layouts[unit];
      }
    }
    ZT_ASSIGN_OR_RETURN(
        Reply r, Call(p::MessageType::kLayout, p::Encode(p::UnitRef{.job = job, .unit = unit}), {},
                      kCallTimeout));
    ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, p::DecodeUnitLayout(r.payload));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job);
    if (it != jobs_.end() && unit >= 0 && unit < static_cast<int>(it->second.layouts.size())) {
      // The runner's copies are sized by it: it must be the spec's unit's.
      const engine::JobSpec& spec = it->second.spec;
      const engine::UnitLayout want = engine::UnitLayoutOf(spec, unit);
      if (l.numel != want.numel || l.padded != want.padded || l.shard != want.shard ||
          l.offsets != want.offsets) {
        return Status::Corruption(
            StrCat("ztierd described unit ", unit, " of job '", spec.name, "' as ", l.numel,
                   " elements in ", l.padded, " (", l.shard, " per rank, ", l.offsets.size(),
                   " tensors); its spec makes ", want.numel, " in ", want.padded, " (", want.shard,
                   " per rank, ", want.offsets.size(), " tensors)"));
      }
      it->second.layouts[unit] = l;
    }
    return l;
  }

  Status WriteWeights(int job, int unit, const float* flat, uint64_t numel) override {
    ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, Layout(job, unit));
    if (numel != l.numel) {
      return Status::InvalidArgument(
          StrCat("unit ", unit, ": ", numel, " weights given, the unit has ", l.numel));
    }
    const uint64_t bytes = numel * sizeof(float);
    ZT_ASSIGN_OR_RETURN(Staging staging, Staging::Make(bytes));
    std::memcpy(staging.floats(), flat, bytes);
    const int fds[] = {staging.fd.get()};
    return Call(p::MessageType::kWriteWeights,
                p::Encode(p::StagedData{.job = job, .unit = unit, .bytes = bytes}), fds,
                kCallTimeout)
        .status();
  }

  Status ReadState(int job, int unit, float* master, float* m, float* v) override {
    ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, Layout(job, unit));
    const uint64_t n = l.padded;
    ZT_ASSIGN_OR_RETURN(Staging staging, Staging::Make(3 * n * sizeof(float)));
    ZT_RETURN_IF_ERROR(StagedCall(p::MessageType::kReadState, job, unit, staging));
    std::memcpy(master, staging.floats(), n * sizeof(float));
    std::memcpy(m, staging.floats() + n, n * sizeof(float));
    std::memcpy(v, staging.floats() + 2 * n, n * sizeof(float));
    return Status::Ok();
  }

  Status SetLearningRates(int job, const std::vector<float>& lrs) override {
    return Call(p::MessageType::kSetLearningRates,
                p::Encode(p::LearningRates{.job = job, .lrs = lrs}), {}, call_timeout_, 0, job)
        .status();
  }

  Result<bf16*> GradInbox(int job, int unit, int rank) override {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kGradInbox,
                                      p::Encode(p::UnitRef{.job = job, .unit = unit, .rank = rank}),
                                      {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(SharedBuffer b, p::DecodeSharedBuffer(r.payload));
    ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, Layout(job, unit));
    ZT_ASSIGN_OR_RETURN(void* ptr,
                        Resolve(job, b, RegionAccess::kReadWrite, l.shard * sizeof(bf16)));
    return static_cast<bf16*>(ptr);
  }

  Result<uint64_t*> ClientCounters(int job, int rank) override {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kClientPage, p::Encode(p::JobRef{.job = job}),
                                      {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(SharedBuffer b, p::DecodeSharedBuffer(r.payload));
    const uint64_t words = static_cast<uint64_t>(rank + 1) * engine::kClientCounterWords;
    if (rank < 0 || b.bytes < words * sizeof(uint64_t) || b.offset % alignof(uint64_t) != 0) {
      return Status::Corruption(StrCat("ztierd's client page of job ", job, " has ", b.bytes,
                                       " bytes at offset ", b.offset, ", no room for rank ", rank));
    }
    ZT_ASSIGN_OR_RETURN(void* page, Resolve(job, b, RegionAccess::kReadWrite, 0));  // checked
    return static_cast<uint64_t*>(page) + static_cast<uint64_t>(rank) * engine::kClientCounterWords;
  }

  // ---- the operator's calls

  Result<engine::DaemonStatus> DaemonStatus() override {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kDaemonStatus, "", {}, call_timeout_));
    return p::DecodeDaemonStatus(r.payload);
  }

  Result<std::vector<engine::JobInfo>> ListJobs(int64_t after, bool* more) override {
    ZT_ASSIGN_OR_RETURN(
        Reply r, Call(p::MessageType::kListJobs, p::Encode(p::ListRequest{.after = after}), {},
                      call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::JobList list, p::DecodeJobList(r.payload));
    *more = list.more;
    return std::move(list.jobs);
  }

  Result<std::vector<engine::QuotaInfo>> GetQuotas(uint32_t uid, bool all, int64_t after,
                                                   engine::Quota* defaults, bool* more) override {
    ZT_ASSIGN_OR_RETURN(
        Reply r,
        Call(p::MessageType::kGetQuota,
             p::Encode(p::QuotaQuery{.uid = uid, .all = all, .after = after}), {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::QuotaList list, p::DecodeQuotaList(r.payload));
    *defaults = list.defaults;
    *more = list.more;
    return std::move(list.quotas);
  }

  Result<engine::QuotaInfo> SetQuota(const engine::QuotaUpdate& update) override {
    ZT_ASSIGN_OR_RETURN(Reply r,
                        Call(p::MessageType::kSetQuota, p::Encode(update), {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::QuotaList list, p::DecodeQuotaList(r.payload));
    if (list.quotas.size() != 1 || list.quotas[0].uid != update.uid) {
      return Status::Corruption(StrCat("ztierd answered a quota set of uid ", update.uid, " with ",
                                       list.quotas.size(), " quotas"));
    }
    return list.quotas[0];
  }

  Status Drain(bool on) override {
    return Call(p::MessageType::kDrain, p::Encode(p::DrainRequest{.on = on}), {}, call_timeout_)
        .status();
  }

  Status EvictJob(int32_t job, const std::string& reason) override {
    return Call(p::MessageType::kEvictJob, p::Encode(p::EvictRequest{.job = job, .reason = reason}),
                {}, call_timeout_)
        .status();
  }

  Status GradsReady(int job, int unit, int rank) override {
    return Call(p::MessageType::kGradsReady,
                p::Encode(p::UnitRef{.job = job, .unit = unit, .rank = rank}), {}, call_timeout_, 0,
                job)
        .status();
  }

  Result<int> AbortStep(int job, int64_t step) override {
    ZT_ASSIGN_OR_RETURN(
        Reply r, Call(p::MessageType::kAbortStep,
                      p::Encode(p::AbortStepRequest{.job = job, .step = step}), {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::StepValue v, p::DecodeStepValue(r.payload));
    return static_cast<int>(v.step);
  }

  // Params in DRAM stay where they are from step to step: once their place
  // is known, an acquire of a step the step page shows published takes no
  // round trip (nor does its release).
  Result<const bf16*> AcquireParams(int job, int unit, int64_t step,
                                    std::chrono::milliseconds timeout) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto j = jobs_.find(job);
      if (j != jobs_.end() && unit >= 0 && unit < static_cast<int>(j->second.params.size()) &&
          j->second.params[unit] != nullptr && j->second.Step(unit) >= step && dead_.ok()) {
        ++j->second.local_leases[unit];
        return j->second.params[unit];
      }
    }
    timeout = std::min(timeout, p::kMaxStepWait);  // "for ever": as long as ztierd waits
    ZT_ASSIGN_OR_RETURN(
        Reply r,
        Call(p::MessageType::kAcquireParams,
             p::Encode(p::StepWait{.job = job, .unit = unit, .step = step, .timeout = timeout}), {},
             timeout + call_timeout_, 0, job));
    ZT_ASSIGN_OR_RETURN(SharedBuffer b, p::DecodeSharedBuffer(r.payload));
    Result<engine::UnitLayout> l = Layout(job, unit);
    Result<void*> ptr =
        l.ok() ? Resolve(job, b, RegionAccess::kReadOnly, l->padded * sizeof(bf16)) : l.status();
    if (!ptr.ok()) {
      (void)ReleaseParams(job, unit);
      return ptr.status();
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto j = jobs_.find(job);
    if (j != jobs_.end() && j->second.spec.param_tier == engine::Tier::kDram && unit >= 0 &&
        unit < static_cast<int>(j->second.params.size())) {
      j->second.params[unit] = static_cast<const bf16*>(*ptr);
    }
    return static_cast<const bf16*>(*ptr);
  }

  // Sent without waiting for the reply (the daemon handles a connection's
  // requests in order, so a later acquire sees the release); an error comes
  // back from the next call.
  Status ReleaseParams(int job, int unit) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto j = jobs_.find(job);
      if (j != jobs_.end() && unit >= 0 && unit < static_cast<int>(j->second.local_leases.size()) &&
          j->second.local_leases[unit] > 0) {
        --j->second.local_leases[unit];
        return Status::Ok();
      }
    }
    return Post(p::MessageType::kReleaseParams, p::Encode(p::UnitRef{.job = job, .unit = unit}),
                job, StrCat("release of job ", job, " unit ", unit));
  }

  // A step the step page shows published returns at once.
  Status WaitPublished(int job, int unit, int64_t step,
                       std::chrono::milliseconds timeout) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto j = jobs_.find(job);
      if (j != jobs_.end() && unit >= 0 && unit < j->second.units() &&
          j->second.Step(unit) >= step && dead_.ok()) {
        return Status::Ok();
      }
    }
    timeout = std::min(timeout, p::kMaxStepWait);
    ZT_RETURN_IF_ERROR(
        Call(p::MessageType::kWaitPublished,
             p::Encode(p::StepWait{.job = job, .unit = unit, .step = step, .timeout = timeout}), {},
             timeout + call_timeout_, 0, job)
            .status());
    return Status::Ok();
  }

  Result<int64_t> PublishedStep(int job, int unit) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto j = jobs_.find(job);
      if (j != jobs_.end() && unit >= 0 && unit < j->second.units() && dead_.ok()) {
        return j->second.Step(unit);
      }
    }
    return StepQuery(p::MessageType::kPublishedStep,
                     p::Encode(p::UnitRef{.job = job, .unit = unit}));
  }
  Result<int64_t> WeightsGeneration(int job) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto j = jobs_.find(job);
    if (j == jobs_.end() || j->second.steps == nullptr) {
      return Status::NotFound(StrCat("job ", job, " is not mapped by this client"));
    }
    ZT_RETURN_IF_ERROR(dead_);
    return __atomic_load_n(j->second.steps + j->second.units(), __ATOMIC_ACQUIRE);
  }
  Result<int64_t> TargetStep(int job) override {
    return StepQuery(p::MessageType::kTargetStep, p::Encode(p::JobRef{.job = job}));
  }

  Status ClaimCheckpointDir(int job, const std::string& dir, bool until_closed) override {
    ZT_RETURN_IF_ERROR(engine::CreateCheckpointDir(dir));
    const std::string key = engine::CheckpointDirKey(dir);
    engine::ClaimedCheckpointDirs::LockFileNow now = engine::ClaimedCheckpointDirs::Look(dir);
    // The file I/O without mu_ (on a slow or hung filesystem it would
    // stall the reply thread, and with it every job's transfers): the locks
    // let go of go after it.
    std::vector<DirLock> gone;
    // Whether the job (or another of this process) has it: Ok when the
    // job has, `claimed` set; under mu_.
    const auto held = [&](bool* claimed) -> Status {
      *claimed = false;
      if (jobs_.count(job) == 0)
        return Status::NotFound(StrCat("no job ", job, " in this session"));
      for (auto& [id, other] : jobs_) {
        if (other.dirs.Holds(key, now, /*touch=*/id == job, until_closed && id == job, &gone)) {
          if (id == job) {
            *claimed = true;
            return Status::Ok();
          }
          return Status::Unavailable(StrCat("checkpoint directory ", dir, " is used by job '",
                                            other.spec.name,
                                            "' of this process for its checkpoints; choose "
                                            "another directory"));
        }
      }
      return Status::Ok();
    };
    bool claimed = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ZT_RETURN_IF_ERROR(held(&claimed));
      if (claimed) return Status::Ok();
    }
    ZT_ASSIGN_OR_RETURN(DirLock l,
                        DirLock::Acquire(dir, engine::kCheckpointLockFile, "checkpoint directory",
                                         DirLock::Mode::kExclusive));
    now = engine::ClaimedCheckpointDirs::Look(dir);  // its file as this lock made it
    std::lock_guard<std::mutex> lock(mu_);
    ZT_RETURN_IF_ERROR(held(&claimed));  // a claim may have come meanwhile
    if (!claimed) jobs_[job].dirs.Add(key, std::move(l), until_closed, &gone);
    return Status::Ok();
  }

  Status Health() override {
    std::lock_guard<std::mutex> lock(mu_);
    return dead_;
  }

  // The job as a save or an export reads it: after a step whose grads are
  // all in (ztierd's check waits for it), so that the step the files say
  // is the step their state is of (a save right after a step's last grads
  // described the step before, and failed: "went from step").
  // `generation`: the job's weights generation before (a load by another
  // client between this and the read is one while it was read).
  Result<engine::JobDescription> DescribeBetweenSteps(int job, int64_t* generation) {
    ZT_ASSIGN_OR_RETURN(*generation, WeightsGeneration(job));
    // The step may take a while (states on NVMe): the call waits up to
    // ten minutes for it (ztier.wait_timeout's default), and for ztierd's
    // answer after.
    ZT_RETURN_IF_ERROR(Call(p::MessageType::kCheckConsistent, p::Encode(p::JobRef{.job = job}), {},
                            std::chrono::minutes(10) + call_timeout_)
                           .status());
    return Describe(job);
  }

  Status SaveCheckpoint(int job, const std::string& dir) override {
    ZT_RETURN_IF_ERROR(Health());  // before the directory is made
    ZT_RETURN_IF_ERROR(ClaimCheckpointDir(job, dir, /*until_closed=*/false));
    int64_t generation = -1;
    ZT_ASSIGN_OR_RETURN(engine::JobDescription d, DescribeBetweenSteps(job, &generation));
    DaemonStateAccess state(*this, job, d, generation);
    return engine::SaveCheckpointFiles(d, state, dir)
        .Annotate(StrCat("save checkpoint of job '", d.name, "'"))
        .Annotate(dir);
  }
  Status LoadCheckpoint(int job, const std::string& dir) override {
    ZT_ASSIGN_OR_RETURN(engine::JobDescription d, Describe(job));
    DaemonStateAccess state(*this, job, d);
    Status st = engine::LoadCheckpointFiles(d, state, dir);
    if (!st.ok()) {
      // ztierd gone midway took the job with it: there is no partly loaded
      // state to load again, only the job to register anew.
      Status gone = Health();
      if (!gone.ok()) st = std::move(gone);
    }
    return st.Annotate(StrCat("load checkpoint of job '", d.name, "'")).Annotate(dir);
  }
  Status ExportSafetensors(int job, const std::string& path, engine::ExportType type) override {
    int64_t generation = -1;
    ZT_ASSIGN_OR_RETURN(engine::JobDescription d, DescribeBetweenSteps(job, &generation));
    DaemonStateAccess state(*this, job, d, generation);
    return engine::ExportSafetensorsFile(d, state, path, type)
        .Annotate(StrCat("export safetensors of job '", d.name, "'"));
  }
  Status ImportSafetensors(int job, const std::string& path) override {
    ZT_ASSIGN_OR_RETURN(engine::JobDescription d, Describe(job));
    DaemonStateAccess state(*this, job, d);
    return engine::ImportSafetensorsFile(d, state, path)
        .Annotate(StrCat("import safetensors of job '", d.name, "'"));
  }

  Result<engine::StateDtype> StateDtype(int job) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return Status::NotFound(StrCat("no job ", job, " in this session"));
    return it->second.state_dtype;  // as ztierd said at registration
  }

  Result<engine::JobCounters> Counters(int job) override {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kCounters, p::Encode(p::JobRef{.job = job}),
                                      {}, call_timeout_));
    return p::DecodeJobCounters(r.payload);
  }

  engine::DramPoolStats PoolStats() override {
    Result<Reply> r = Call(p::MessageType::kPoolStats, "", {}, call_timeout_);
    if (r.ok()) {
      Result<engine::DramPoolStats> s = p::DecodeDramPoolStats(r->payload);
      if (s.ok()) return *s;
      r = s.status();
    }
    ZT_LOG(kWarn, "client") << "pool stats: " << r.status();
    return {};
  }

  std::vector<HostRegion> PinnedRegions(int job) override {
    std::vector<HostRegion> out;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return out;
    for (const auto& [index, region] : it->second.regions) {
      // Mapped as ztierd shares it: publish buffers and the param cache
      // PROT_READ (sealed), the grad inbox read-write.
      out.push_back({.base = region.mapping.data(),
                     .bytes = region.mapping.bytes(),
                     .access = region.access == RegionAccess::kReadWrite ? HostAccess::kReadWrite
                                                                         : HostAccess::kReadOnly});
    }
    return out;
  }

 private:
  struct Region {
    Mapping mapping;
    RegionAccess access = RegionAccess::kReadOnly;
  };
  struct Job {
    engine::JobSpec spec;
    engine::StateDtype state_dtype = engine::StateDtype::kFp32;  // as ztierd keeps m and v
    // The job's step page (the daemon keeps it), in the params' mapping.
    const int64_t* steps = nullptr;
    std::vector<const bf16*> params;  // DRAM params by unit, once an acquire named them
    std::vector<int> local_leases;    // acquires answered here, by unit
    int units() const { return static_cast<int>(spec.units.size()); }
    int64_t Step(int unit) const {
      return steps == nullptr ? -1 : __atomic_load_n(steps + unit, __ATOMIC_ACQUIRE);
    }
    std::map<uint32_t, Region> regions;
    std::vector<engine::UnitLayout> layouts;  // numel 0: not fetched yet
    engine::ClaimedCheckpointDirs dirs;       // checkpoint directories claimed
    std::shared_ptr<Mapping> collectives;     // the collective region, once asked for
  };

  // The job's state as the file code sees it: each unit through a staging
  // memfd, read from or written to the daemon.
  class DaemonStateAccess final : public engine::StateAccess {
   public:
    // `generation`: the job's weights generation before `d` was taken
    // (-1: as each pass begins).
    DaemonStateAccess(DaemonTransport& t, int job, const engine::JobDescription& d,
                      int64_t generation = -1)
        : t_(t), job_(job), d_(d), generation_(generation) {}
    Status Read(const Visit& fn) override { return Pass(fn, true, false); }
    Status Overwrite(const Visit& fn) override { return Pass(fn, false, true); }
    Status UpdateMaster(const Visit& fn) override { return Pass(fn, true, true); }
    // Through the generation the writes left (another writer's write or
    // commit meanwhile refuses it).
    Status Commit(int64_t step, int64_t adam_step) override {
      return t_
          .Call(p::MessageType::kCommitState,
                p::Encode(p::StateCommit{
                    .job = job_, .step = step, .adam_step = adam_step, .generation = generation_}),
                {}, kCallTimeout)
          .status();
    }

   private:
    // The job's units hold one state (ztierd's engine says): not a failed
    // job's, some units of which stepped, nor a mix a failed load left.
    Status CheckConsistent() {
      return t_
          .Call(p::MessageType::kCheckConsistent, p::Encode(p::JobRef{.job = job_}), {},
                kCallTimeout)
          .status();
    }

    // What is read whole (a save, an export) is one state: checked before
    // the first unit by the caller (DescribeBetweenSteps), after the last
    // here. What is written unit by unit (a load, an import) names the
    // weights generation it expects at each write and at the commit: each
    // of its writes bumps it by one, and another writer's write or commit
    // in between (a second client's load) refuses the rest of this one, so
    // the job holds one state whole, the other's.
    Status Pass(const Visit& fn, bool read, bool write) {
      uint64_t most = 0;
      for (const engine::UnitLayout& l : d_.layouts) most = std::max(most, l.padded);
      ZT_ASSIGN_OR_RETURN(Staging staging, Staging::Make(3 * most * sizeof(float)));
      if (generation_ < 0) {
        ZT_ASSIGN_OR_RETURN(generation_, t_.WeightsGeneration(job_));
      }
      const int64_t generation = generation_;
      for (size_t k = 0; k < d_.layouts.size(); ++k) {
        const int unit = static_cast<int>(k);
        const uint64_t n = d_.layouts[k].padded;
        float* f = staging.floats();
        if (read) {
          ZT_RETURN_IF_ERROR(t_.StagedCall(p::MessageType::kReadState, job_, unit, staging,
                                           3 * n * sizeof(float)));
        } else {
          std::memset(f, 0, 3 * n * sizeof(float));
        }
        ZT_RETURN_IF_ERROR(
            fn(k, engine::UnitState{.master = f, .exp_avg = f + n, .exp_avg_sq = f + 2 * n}));
        if (write) {
          Status written = t_.StagedCall(p::MessageType::kWriteState, job_, unit, staging,
                                         3 * n * sizeof(float), generation_);
          if (!written.ok()) {
            // A write refused before it began (another writer, grads
            // pending) changed nothing; one that failed in the engine's
            // write (the drive under NVMe states: EIO, ENOSPC) left the
            // job partly written. The job tells which.
            const Status now = CheckConsistent();
            if (now.code() == StatusCode::kFailedPrecondition &&
                now.message().find("failed midway") != std::string::npos) {
              ++units_written_;
            }
            return written;
          }
          ++generation_;
          ++units_written_;
        }
      }
      if (read && !write) {
        // Each unit was read between steps (the daemon checks); the job
        // must also not have stepped between the first unit and the last
        // (a rank in another process that went on training). The check
        // waits for a step under way first: one that had updated some
        // units but not completed was not yet the job's step, and a mix of
        // two steps passed as the first. Nor may another client have
        // replaced the state meanwhile (a load, an import: each unit read
        // whole, but some of the old state and some of the new), which
        // leaves the step as it was: the weights generation tells.
        ZT_RETURN_IF_ERROR(CheckConsistent());
        ZT_ASSIGN_OR_RETURN(engine::JobDescription now, t_.Describe(job_));
        ZT_ASSIGN_OR_RETURN(const int64_t generation_now, t_.WeightsGeneration(job_));
        if (generation_now != generation) {
          return Status::FailedPrecondition(
              StrCat("job '", d_.name, "': its state was replaced (a checkpoint load, an ",
                     "import or weights set, by another client or thread) while it was read; ",
                     "read it again once that is done"));
        }
        if (now.step != d_.step || now.adam_step != d_.adam_step) {
          return Status::FailedPrecondition(
              StrCat("job '", d_.name, "' went from step ", d_.step, " to ", now.step,
                     " while its state was read; read it between steps, with every rank "
                     "waiting"));
        }
      }
      return Status::Ok();
    }

    DaemonTransport& t_;
    const int job_;
    const engine::JobDescription& d_;
    int64_t generation_;  // as the pass began; plus this one's writes since
  };
  struct Pending {
    bool done = false;
    Result<Reply> reply = Status::Internal("no reply");
    std::string posted;  // not empty: nobody waits; names the request in errors
    int job = -1;        // a posted request's job
    // An acquire whose caller gave up (a timeout): a lease its late answer
    // brings is given back, not left held in ztierd (job, unit).
    std::optional<std::pair<int, int>> release_if_late;
  };

  DaemonTransport(std::string path, SeqPacketSocket sock)
      : path_(std::move(path)), sock_(std::move(sock)) {
    ForkedChildLetsGo::Get().Add(sock_.fd());
  }

  // The unit holds `step` or later.

  // A unit's state (3 x padded fp32, or `bytes` of it) in or out.
  // `generation`: the one a state write expects (-1: none).
  Status StagedCall(p::MessageType type, int job, int unit, const Staging& staging,
                    uint64_t bytes = 0, int64_t generation = -1) {
    if (bytes == 0) bytes = staging.map.bytes();
    const int fds[] = {staging.fd.get()};
    // ztierd reads or writes the unit's state on its drive meanwhile (states
    // on NVMe), behind the other jobs' I/O: a unit of gigabytes on a busy or
    // slow drive took past the fixed call timeout, and a save failed as if
    // ztierd were stuck. The bytes at kSlowDriveBytesPerSecond come on top.
    const auto moving = std::chrono::milliseconds(bytes / (kSlowDriveBytesPerSecond / 1000));
    return Call(type,
                p::Encode(p::StagedData{
                    .job = job, .unit = unit, .bytes = bytes, .generation = generation}),
                fds, call_timeout_ + moving)
        .status();
  }

  // What the state files record of the job: its spec, layouts and steps.
  Result<engine::JobDescription> Describe(int job) {
    engine::JobDescription d;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(job);
      if (it == jobs_.end()) return Status::NotFound(StrCat("no job ", job, " in this session"));
      d.name = it->second.spec.name;
      d.ranks = it->second.spec.ranks;
      d.optimizer = it->second.spec.optimizer;
      d.units = it->second.spec.units;
      d.state_dtype = engine::StateDtypeName(it->second.state_dtype);
    }
    for (int k = 0; k < static_cast<int>(d.units.size()); ++k) {
      ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, Layout(job, k));
      d.layouts.push_back(std::move(l));
    }
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kJobSteps, p::Encode(p::JobRef{.job = job}),
                                      {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::JobSteps steps, p::DecodeJobSteps(r.payload));
    d.step = steps.step;
    d.adam_step = steps.adam_step;
    return d;
  }

  Result<int64_t> StepQuery(p::MessageType type, std::string payload) {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(type, std::move(payload), {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::StepValue v, p::DecodeStepValue(r.payload));
    return v.step;
  }

  // Registers or attaches `spec` (the request `bytes`) and maps the job.
  Result<int> OpenJob(p::MessageType type, std::string bytes, const engine::JobSpec& spec,
                      std::chrono::milliseconds timeout) {
    ZT_ASSIGN_OR_RETURN(p::JobHandle h, SendSpec(type, std::move(bytes), timeout));
    if (h.units != static_cast<int32_t>(spec.units.size()) || h.ranks != spec.ranks) {
      return Status::Internal(StrCat("ztierd answered ", p::MessageTypeName(type), " of job '",
                                     spec.name, "' with ", h.units, " units and ", h.ranks,
                                     " ranks"));
    }
    Status mapped = MapRegions(h.job, spec, h.state_dtype);
    if (!mapped.ok()) {
      (void)Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = h.job}), {},
                 kCallTimeout);
      return mapped;
    }
    return h.job;
  }

  // A request that carries a job spec: in the datagram, or in a sealed
  // memfd when it is too large for one.
  Result<p::JobHandle> SendSpec(p::MessageType type, std::string bytes,
                                std::chrono::milliseconds timeout) {
    Result<Reply> r = Status::Internal("unsent");
    if (bytes.size() <= p::kMaxMessageBytes - p::kHeaderBytes) {
      r = Call(type, std::move(bytes), {}, timeout);
    } else if (bytes.size() > p::kMaxMemfdPayloadBytes) {
      return Status::InvalidArgument(
          StrCat("the job's spec takes ", bytes.size(), " bytes, more than ztierd takes (",
                 p::kMaxMemfdPayloadBytes, "): fewer, larger tensors take less"));
    } else {
      ZT_ASSIGN_OR_RETURN(UniqueFd fd, engine::MemfdWithPayload("ztier-job-spec", bytes));
      const int fds[] = {fd.get()};
      r = Call(type, "", fds, timeout, p::kFlagMemfd);
    }
    if (!r.ok()) return r.status();
    return p::DecodeJobHandle(r->payload);
  }

  // Maps the job's regions, checking each memfd's size and seals first.
  Status MapRegions(int32_t job, const engine::JobSpec& spec, engine::StateDtype state_dtype) {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = job}),
                                      {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(p::RegionList list, p::DecodeRegionList(r.payload));
    if (list.regions.size() != r.fds.size()) {
      return Status::Corruption(StrCat("ztierd described ", list.regions.size(),
                                       " regions and sent ", r.fds.size(), " memfds"));
    }
    Job j;
    j.spec = spec;
    j.state_dtype = state_dtype;
    j.params.assign(spec.units.size(), nullptr);
    j.local_leases.assign(spec.units.size(), 0);
    j.layouts.resize(spec.units.size());
    for (size_t k = 0; k < list.regions.size(); ++k) {
      const p::RegionInfo& info = list.regions[k];
      const std::string what = StrCat("region ", info.region, " from ztierd");
      // Sealed against shrinking (a mapping past its end would fault); a
      // read-only region comes as a read-only open of it and is mapped so.
      ZT_RETURN_IF_ERROR(engine::CheckPeerMemfd(r.fds[k].get(), info.bytes, info.bytes,
                                                RegionAccess::kReadWrite, what)
                             .status());
      ZT_ASSIGN_OR_RETURN(Mapping m, Mapping::Map(r.fds[k].get(), info.bytes,
                                                  info.access == RegionAccess::kReadWrite, what));
      j.regions[info.region] = Region{.mapping = std::move(m), .access = info.access};
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_[job] = std::move(j);
    }
    Result<const int64_t*> steps = StepPage(job, spec);
    std::lock_guard<std::mutex> lock(mu_);
    if (!steps.ok()) {
      jobs_.erase(job);  // unmaps what was mapped
      return steps.status();
    }
    jobs_[job].steps = *steps;
    return Status::Ok();
  }

  // Where the job's step page lies in its mapped params region.
  Result<const int64_t*> StepPage(int32_t job, const engine::JobSpec& spec) {
    ZT_ASSIGN_OR_RETURN(Reply page, Call(p::MessageType::kStepPage,
                                         p::Encode(p::JobRef{.job = job}), {}, call_timeout_));
    ZT_ASSIGN_OR_RETURN(SharedBuffer b, p::DecodeSharedBuffer(page.payload));
    // Each unit's step, then the weights' generation.
    if (b.bytes != engine::StepPageBytes(spec.units.size()) || b.offset % alignof(int64_t) != 0) {
      return Status::Corruption(StrCat("ztierd's step page of job '", spec.name, "' has ", b.bytes,
                                       " bytes at offset ", b.offset, " for ", spec.units.size(),
                                       " units"));
    }
    ZT_ASSIGN_OR_RETURN(void* steps, Resolve(job, b, RegionAccess::kReadOnly, 0));  // checked
    return static_cast<const int64_t*>(steps);
  }

  // A buffer the daemon named, as a pointer into the job's mapping: of at
  // least `need` bytes (what the caller reads or writes there), aligned for
  // bf16.
  Result<void*> Resolve(int job, const SharedBuffer& b, RegionAccess want, uint64_t need) {
    if (b.bytes < need || b.offset % alignof(bf16) != 0) {
      return Status::Corruption(StrCat("ztierd named a buffer of ", b.bytes, " bytes at offset ",
                                       b.offset, " for ", need, " bytes"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto j = jobs_.find(job);
    if (j == jobs_.end()) return Status::NotFound(StrCat("job ", job, " is not mapped"));
    auto r = j->second.regions.find(b.region);
    if (r == j->second.regions.end() || r->second.mapping.bytes() != b.region_bytes ||
        r->second.access != want || b.access != want) {
      return Status::InvalidArgument(StrCat("ztierd named region ", b.region,
                                            ", which is not one of the job's mapped regions with "
                                            "that size and access"));
    }
    return static_cast<char*>(r->second.mapping.data()) + b.offset;  // bounds: DecodeSharedBuffer
  }

  // A new request id, its reply to go to `pending`; or why no request can
  // go now (the daemon is gone, or a posted request of `job` failed).
  // `posted`: a request nobody waits for goes even while ztierd has left a
  // call unanswered (a runner's release refused then left its lease held in
  // ztierd for the connection's life).
  Result<uint64_t> Expect(std::shared_ptr<Pending> pending, int job, bool posted = false) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!dead_.ok()) return dead_;
    if (auto d = deferred_.find(job); job >= 0 && d != deferred_.end()) {
      Status s = std::move(d->second);
      deferred_.erase(d);
      return s;
    }
    if (!unanswered_.empty() && !posted) {
      return Status::Unavailable(StrCat("ztierd at ", path_, " did not answer ", unanswered_,
                                        " and has said nothing since (", StuckHint(),
                                        "): calls are refused until it answers again"));
    }
    const uint64_t id = next_id_++;
    pending_[id] = std::move(pending);
    return id;
  }

  // Releases the leases late acquires brought (ReceiveLoop), from the
  // thread of the call about to be made.
  void SendLateReleases() {
    std::vector<std::pair<int, int>> late;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (late_releases_.empty()) return;
      late.swap(late_releases_);
    }
    for (const auto& [job, unit] : late) {
      (void)Post(p::MessageType::kReleaseParams, p::Encode(p::UnitRef{.job = job, .unit = unit}),
                 job, StrCat("release of job ", job, " unit ", unit, " (a late acquire's)"));
    }
  }

  // Sends a request whose reply nobody waits for; an error it brings is
  // returned by the next Call.
  Status Post(p::MessageType type, std::string payload, int job, std::string what) {
    SendLateReleases();
    auto pending = std::make_shared<Pending>();
    pending->posted = std::move(what);
    pending->job = job;
    ZT_ASSIGN_OR_RETURN(const uint64_t id, Expect(pending, -1, /*posted=*/true));  // always sent
    Result<std::string> msg =
        p::EncodeMessage({.type = type, .flags = 0, .request_id = id, .fds = 0}, payload);
    Status sent = msg.ok() ? sock_.Send(*msg, {}, std::chrono::seconds(30)) : msg.status();
    if (!sent.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.erase(id);
      return msg.ok() ? Status::Unavailable(StrCat("ztierd at ", path_, ": ", sent.message()))
                      : sent;
    }
    return Status::Ok();
  }

  // Sends a request and waits for its reply (or the connection's end).
  // `job`: the job a call of the runner's is for, to get an error of that
  // job's posted requests instead of going (-1: always goes).
  Result<Reply> Call(p::MessageType type, std::string payload, std::span<const int> fds,
                     std::chrono::milliseconds timeout, uint32_t flags = 0, int job = -1) {
    SendLateReleases();
    auto pending = std::make_shared<Pending>();
    ZT_ASSIGN_OR_RETURN(const uint64_t id, Expect(pending, job));
    auto forget = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.erase(id);
    };
    Result<std::string> msg = p::EncodeMessage(
        {.type = type, .flags = flags, .request_id = id, .fds = static_cast<uint32_t>(fds.size())},
        payload);
    if (!msg.ok()) {
      forget();
      return msg.status();
    }
    Status sent = sock_.Send(*msg, fds, std::chrono::seconds(30));
    if (!sent.ok()) {
      forget();
      // A daemon that refused or stopped said why before it closed: give
      // the receiver a moment to read that.
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::seconds(2), [&] { return !dead_.ok(); });
      }
      return Gone(sent);
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return pending->done; })) {
      Result<p::StepWait> w = type == p::MessageType::kAcquireParams
                                  ? p::DecodeStepWait(payload)
                                  : Result<p::StepWait>(Status::NotFound("not an acquire"));
      if (w.ok()) {
        pending->release_if_late = std::make_pair(w->job, w->unit);  // kept for its answer
      } else {
        pending_.erase(id);
      }
      unanswered_ = StrCat("a request (", p::MessageTypeName(type), ") within ",
                           std::chrono::duration_cast<std::chrono::seconds>(timeout).count(), " s");
      return Status::Unavailable(
          StrCat("ztierd at ", path_, " did not answer ", unanswered_, " (", StuckHint(), ")"));
    }
    return std::move(pending->reply);
  }

  Status Gone(const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_.ok()) {
      // A session with jobs lost their DRAM state; the operator's tool had none.
      dead_ = Status::Unavailable(StrCat(
          "ztierd at ", path_, " is gone (", why.message(), ")",
          operator_ ? ""
                    : "; the DRAM state of this session's jobs went with it: resume from the "
                      "last checkpoint, if one was saved"));
    }
    return dead_;
  }

  void ReceiveLoop() {
    for (;;) {
      pollfd pfd{.fd = sock_.fd(), .events = POLLIN, .revents = 0};
      const int n = ::poll(&pfd, 1, 500);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closing_) break;
      }
      if (n == 0 || (n < 0 && errno == EINTR)) continue;
      Result<SeqPacketSocket::Received> got =
          sock_.Receive(std::chrono::milliseconds(0), p::kMaxMessageBytes, p::kMaxFdsPerMessage);
      if (!got.ok()) {
        FailAll(got.status());
        return;
      }
      Result<p::Header> h = p::DecodeHeader(got->data, static_cast<uint32_t>(got->fds.size()));
      if (!h.ok() && h.status().code() == StatusCode::kFailedPrecondition) {
        // Another protocol version (an upgrade left the old ztierd running):
        // ztierd is there and lost nothing, it speaks another language.
        std::lock_guard<std::mutex> lock(mu_);
        if (dead_.ok()) {
          dead_ = Status::FailedPrecondition(
              StrCat("ztierd at ", path_, " speaks another protocol: ", h.status().message(),
                     " (after an upgrade, restart ztierd once its jobs are done)"));
        }
      }
      if (!h.ok() || (h->flags & p::kFlagReply) == 0) {
        FailAll(h.ok() ? Status::Corruption("ztierd sent a request") : h.status());
        return;
      }
      Result<std::string_view> body =
          p::DecodeReplyStatus(std::string_view(got->data).substr(p::kHeaderBytes));
      if (h->request_id == 0) {
        // The daemon's last word: why it closes the connection (a stop, a
        // refusal), passed on as it said it.
        const Status why =
            body.ok() ? Status::Corruption("ztierd sent an empty notice") : body.status();
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (dead_.ok()) {
            dead_ = Status(why.code(), StrCat("ztierd at ", path_, ": ", why.message()),
                           why.sys_errno());
          }
        }
        FailAll(why);
        return;
      }
      std::unique_lock<std::mutex> lock(mu_);
      unanswered_.clear();  // it answers again
      auto it = pending_.find(h->request_id);
      if (it == pending_.end()) continue;  // its caller gave up
      if (it->second->release_if_late) {
        // Given back by the next call's thread: this one must not block in
        // a send while ztierd waits for it to read.
        if (body.ok()) late_releases_.push_back(*it->second->release_if_late);
        pending_.erase(it);
        continue;
      }
      if (!it->second->posted.empty()) {
        // For that job's next call (a job unregistered meanwhile is gone).
        if (!body.ok() && jobs_.count(it->second->job) != 0 &&
            deferred_.count(it->second->job) == 0) {
          deferred_[it->second->job] =
              body.status().Annotate(StrCat("an earlier ", it->second->posted));
        }
        pending_.erase(it);
        continue;
      }
      if (body.ok()) {
        it->second->reply = Reply{.payload = std::string(*body), .fds = std::move(got->fds)};
      } else {
        it->second->reply = body.status();
      }
      it->second->done = true;
      pending_.erase(it);
      cv_.notify_all();
    }
    FailAll(Status::Unavailable("the session closed"));
  }

  void FailAll(const Status& why) {
    (void)Gone(why);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : pending_) {
      p->reply = dead_;
      p->done = true;
    }
    pending_.clear();
    cv_.notify_all();
  }

  const std::string path_;
  SeqPacketSocket sock_;
  std::thread receiver_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closing_ = false;
  Status dead_;
  // The error of a posted request, by job: the job's next call of those
  // that pass `job` to Call returns it instead of being sent (never
  // another job's, an unregister or a release, which always go).
  std::map<int, Status> deferred_;
  // A call ztierd left unanswered past its timeout ("kind within N s"):
  // until ztierd sends anything again, calls are refused at once instead
  // of each waiting out its own timeout on a stopped or stuck daemon.
  std::string unanswered_;
  // Leases late acquires brought (job, unit), to be released (under mu_).
  std::vector<std::pair<int, int>> late_releases_;
  bool operator_ = false;  // the operator's tool's connection (no jobs)
  // Where to look when ztierd does not answer: ztierctl, for a job's
  // client; for ztierctl itself, the process.
  std::string StuckHint() const {
    return operator_ ? "stopped or stuck? systemctl status ztierd, or ps -o stat= -p its pid, tells"
                     : "stopped or stuck? ztierctl status tells";
  }
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Pending>> pending_;
  std::map<int, Job> jobs_;
  std::chrono::milliseconds call_timeout_ = kCallTimeout;  // set once, before the hello
};

}  // namespace

Result<std::shared_ptr<Transport>> MakeDaemonTransport(const std::string& socket_path,
                                                       std::chrono::milliseconds call_timeout) {
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<DaemonTransport> t,
                      DaemonTransport::Connect(socket_path, "libztier", call_timeout));
  return std::shared_ptr<Transport>(std::move(t));
}

Result<std::shared_ptr<ControlTransport>> MakeDaemonControl(
    const std::string& socket_path, std::chrono::milliseconds call_timeout) {
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<DaemonTransport> t,
                      DaemonTransport::Connect(socket_path, p::kOperatorClientName, call_timeout));
  return std::shared_ptr<ControlTransport>(std::move(t));
}

}  // namespace ztier::client
