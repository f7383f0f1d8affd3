// client internal: the seam between libztier and an engine. The embedded
// transport calls an engine in this process; the daemon transport (ztierd)
// implements the same calls over its socket and shared memory, so Session,
// Model and Stage3Runner never know which one they talk to (DCGM's
// embedded/standalone split). Pointers it returns (grad inboxes, params)
// point into pinned memory the client can read and write directly: the
// engine's own in-process, mapped shared memory for a daemon.
//
// Thread safety: every method may be called from any thread. Errors: the
// engine's (see engine/engine.h), plus the transport's own for a daemon.
#ifndef ZTIER_CLIENT_TRANSPORT_H_
#define ZTIER_CLIENT_TRANSPORT_H_

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "client/ztier.h"
#include "common/bf16.h"
#include "common/status.h"
#include "engine/wire_types.h"

namespace ztier::engine {
struct Settings;
}
namespace ztier::nvme {
class IoBackend;
}

namespace ztier::client {

// One of a job's host regions as this process maps it.
struct HostRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
  HostAccess access = HostAccess::kReadWrite;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // Ok while the engine behind it is reachable; once the transport knows it
  // is gone (ztierd died or stopped: seen within half a second, without a
  // round trip), the error every later call gets. Cheap.
  virtual Status Health() { return Status::Ok(); }

  virtual Result<int> RegisterJob(const engine::JobSpec& spec) = 0;
  // Joins the job `spec.name`, which rank 0 registers in another process,
  // as `rank`, waiting up to `timeout` for the registration (ztierd only).
  // Errors: FailedPrecondition (the embedded engine; a model that differs
  // from the job's, naming the difference), NotFound (not registered in
  // time), AlreadyExists (the rank is attached already).
  virtual Result<int> AttachJob(const engine::JobSpec& spec, int rank,
                                std::chrono::milliseconds timeout) = 0;
  // The job's collective region (engine/wire_types.h): `bytes` of memory
  // that every rank of the job maps read-write, zeroed when made. The first
  // call makes it; every later one (from any rank) must ask for the same
  // size. Mapped while the job is registered here or a returned pointer
  // lives (its owner). Errors: InvalidArgument (a size other than the
  // region's).
  virtual Result<std::shared_ptr<void>> CollectiveRegion(int job, uint64_t bytes) = 0;
  virtual Status UnregisterJob(int job) = 0;
  virtual Result<engine::UnitLayout> Layout(int job, int unit) = 0;
  virtual Status WriteWeights(int job, int unit, const float* flat, uint64_t numel) = 0;
  virtual Status ReadState(int job, int unit, float* master, float* m, float* v) = 0;

  // Each param group's learning rate from the job's next step on
  // (engine::Engine::SetLearningRates); any rank's connection may set them.
  virtual Status SetLearningRates(int job, const std::vector<float>& lrs) = 0;

  virtual Result<bf16*> GradInbox(int job, int unit, int rank) = 0;
  virtual Status GradsReady(int job, int unit, int rank) = 0;
  // Drops the grads delivered since the job's last step, those of `step`
  // (the caller's version + 1); the micro-steps that were complete
  // (engine::Engine::AbortStep).
  virtual Result<int> AbortStep(int job, int64_t step) = 0;
  virtual Result<const bf16*> AcquireParams(int job, int unit, int64_t step,
                                            std::chrono::milliseconds timeout) = 0;
  virtual Status ReleaseParams(int job, int unit) = 0;
  virtual Status WaitPublished(int job, int unit, int64_t step,
                               std::chrono::milliseconds timeout) = 0;
  // The step unit `unit` holds (-1: no weights yet) and the step the job is
  // heading to (engine::Engine::PublishedStep, TargetStep); an error where
  // the engine cannot be asked (ztierd gone or silent, a forked child).
  virtual Result<int64_t> PublishedStep(int job, int unit) = 0;
  virtual Result<int64_t> TargetStep(int job) = 0;
  // How many times the job's weights were replaced at the step they were
  // at (engine::Engine::WeightsGeneration): copies fetched before a change
  // are out of date. Read without asking where the step page is mapped.
  virtual Result<int64_t> WeightsGeneration(int job) = 0;

  // `until_closed`: held while the job lives (else as a save's claim:
  // engine::ClaimedCheckpointDirs).
  virtual Status ClaimCheckpointDir(int job, const std::string& dir, bool until_closed) = 0;
  virtual Status SaveCheckpoint(int job, const std::string& dir) = 0;
  virtual Status LoadCheckpoint(int job, const std::string& dir) = 0;
  virtual Status ExportSafetensors(int job, const std::string& path, engine::ExportType type) = 0;
  virtual Status ImportSafetensors(int job, const std::string& path) = 0;
  // Errors: as the call (ztierd gone or silent: Unavailable).
  virtual Result<engine::JobCounters> Counters(int job) = 0;
  // How the engine (ztierd's, through one) keeps the job's m and v.
  virtual Result<engine::StateDtype> StateDtype(int job) = 0;
  virtual engine::DramPoolStats PoolStats() = 0;
  // The job's host memory regions as this process maps them, for the
  // client's device to register for DMA (and unregister before the job
  // goes): engine::Engine::PinnedRegions, each with its access here.
  virtual std::vector<HostRegion> PinnedRegions(int job) = 0;
  // Rank `rank`'s words of the job's client page (engine::Engine::
  // ClientCounters): where its runner counts the bytes it copies between
  // its device and the engine (relaxed atomic adds). Valid while the job is
  // registered here.
  virtual Result<uint64_t*> ClientCounters(int job, int rank) = 0;
};

// ztierd's operator calls (ztierctl; engine/protocol.h says which need an
// operator: they are refused with PermissionDenied for others).
class ControlTransport {
 public:
  virtual ~ControlTransport() = default;
  virtual Result<engine::DaemonStatus> DaemonStatus() = 0;
  // A page of jobs after job id `after` (-1: the first); `*more` says
  // whether another page follows.
  virtual Result<std::vector<engine::JobInfo>> ListJobs(int64_t after, bool* more) = 0;
  // One uid's quota, or (all) a page of every uid's after `after`; the
  // daemon's defaults in `*defaults`.
  virtual Result<std::vector<engine::QuotaInfo>> GetQuotas(uint32_t uid, bool all, int64_t after,
                                                           engine::Quota* defaults, bool* more) = 0;
  virtual Result<engine::QuotaInfo> SetQuota(const engine::QuotaUpdate& update) = 0;
  virtual Status Drain(bool on) = 0;
  virtual Status EvictJob(int32_t job, const std::string& reason) = 0;
};

// The process that made an object. A forked child holds copies of its
// parent's objects (the daemon connection, shared mappings, the engine's
// state and io_uring rings) but none of their threads: it must neither use
// them (ztierd would take its requests for the parent's, a unit's grads
// would land in the parent's inbox) nor tear them down (joining threads it
// does not have, shutting the parent's connection down).
class ProcessOwner {
 public:
  ProcessOwner();
  bool forked() const;
  // FailedPrecondition in a forked child, naming `what`.
  Status Check(std::string_view what) const;

 private:
  int pid_;
};

// `inner` for the process that made it only: in a forked child every call
// fails with FailedPrecondition (the ones with no status return what a gone
// engine would), and destroying it leaves `inner` alone (leaked in the
// child, whose exit frees it).
std::shared_ptr<Transport> ForkSafe(std::shared_ptr<Transport> inner);

// The engine in this process, on `io_backend` (null: io_uring). Errors: as
// engine::Engine::Create.
Result<std::shared_ptr<Transport>> MakeEmbeddedTransport(
    const engine::Settings& settings, std::shared_ptr<nvme::IoBackend> io_backend);

// ztierd at `socket_path`: connects and says hello (protocol versions).
// Errors: Unavailable (nothing listens there, or the daemon refused: names
// why), FailedPrecondition (permission denied on the socket, a protocol
// version mismatch, a uid not allowed), as SeqPacketSocket::Connect.
// `call_timeout`: how long ztierd may take to answer a call (beyond what a
// wait asks for).
Result<std::shared_ptr<Transport>> MakeDaemonTransport(
    const std::string& socket_path,
    std::chrono::milliseconds call_timeout = std::chrono::seconds(120));
// The same connection, for the operator's calls. Errors: as
// MakeDaemonTransport.
// `call_timeout`: how long ztierd may take to answer each call.
Result<std::shared_ptr<ControlTransport>> MakeDaemonControl(const std::string& socket_path,
                                                            std::chrono::milliseconds call_timeout);

}  // namespace ztier::client

#endif  // ZTIER_CLIENT_TRANSPORT_H_
