// NCCL collectives. MakeNcclCollectives: the R ranks of one job are R CUDA
// devices of this process, one communicator each, created together with
// ncclCommInitAll. MakeNcclRankCollectives: one rank of a job whose ranks
// are processes, a non-blocking communicator (ncclCommInitRankConfig) made
// from a unique id one rank handed out. Each rank's Collectives object owns
// its communicator: destroyed with the object (finalized first where it is
// non-blocking), or ended (ncclCommAbort) where the group ended.
//
// AllGather and ReduceScatter are queued on the rank's device stream
// (Device::native_stream), after the work already there, on bf16 buffers;
// NCCL's bf16 sum rounds at every hop of the ring (the local backend sums in
// fp32 and rounds once), so sums of more than two ranks may differ from the
// local backend's in the last bit.
//
// Thread safety: one Collectives object belongs to one rank, driven by that
// rank's thread; the ranks' threads call concurrently, every rank making the
// same calls in the same order (NCCL matches them by order). No ncclGroup is
// needed since each communicator has its own thread. Abort may come from
// any thread: it only marks the group, and the rank's thread ends its
// communicator at its next call or poll.
//
// Failure contract: every NCCL call is checked; its Status names the call,
// the rank and NCCL's error string (plus ncclGetLastError's detail), and the
// NCCL result code is the Status' sys_errno. A wait for NCCL's work (Wait,
// an init, a call a non-blocking communicator answers in progress) polls
// and ends the communicator once the group ended (a rank's Abort), a peer
// left (NcclPeers::left), NCCL reports an error, or NcclPeers::timeout
// (10 minutes unless told) passes with nothing done: Aborted, NCCL's error, Unavailable; every
// later call of the rank fails at once. Too few devices, or a build or machine without them, is
// Unavailable; a device that is not the rank's CUDA device is InvalidArgument.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "client/ztier.h"
#include "common/log.h"
#include "common/numbers.h"
#include "common/status.h"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "ztier needs NCCL 2.14 or newer (ncclCommInitRankConfig, non-blocking communicators)"
#endif

namespace ztier::client {
namespace {

constexpr std::string_view kLog = "client";

StatusCode CodeFor(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return StatusCode::kInvalidArgument;
    case ncclInternalError:
      return StatusCode::kInternal;
    default:  // ncclUnhandledCudaError, ncclSystemError, ncclRemoteError, ...
      return StatusCode::kIoError;
  }
}

// The one place an ncclResult_t becomes a Status. `comm` (may be null) adds
// NCCL's last error message, which names what was wrong.
Status NcclError(ncclResult_t r, std::string_view call, const char* file, int line,
                 std::string_view who, ncclComm_t comm) {
  const char* detail = ncclGetLastError(comm);
  return Status(CodeFor(r),
                StrCat(who, ": ", call, " failed at ", ShortSourcePath(file), ":", line, ": ",
                       ncclGetErrorString(r),
                       detail != nullptr && detail[0] != '\0' ? StrCat(" (", detail, ")") : ""),
                static_cast<int>(r));
}

Status CudaError(cudaError_t err, std::string_view call, const char* file, int line,
                 std::string_view who) {
  cudaGetLastError();
  return Status(err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver
                    ? StatusCode::kUnavailable
                    : StatusCode::kIoError,
                StrCat(who, ": ", call, " failed at ", ShortSourcePath(file), ":", line, ": ",
                       cudaGetErrorString(err), " (", cudaGetErrorName(err), ")"),
                static_cast<int>(err));
}

#define ZT_NCCL_RETURN_IF_ERROR(call, who, comm)                             \
  do {                                                                       \
    const ncclResult_t zt_nccl_r = (call);                                   \
    if (zt_nccl_r != ncclSuccess) [[unlikely]] {                             \
      return NcclError(zt_nccl_r, #call, __FILE__, __LINE__, (who), (comm)); \
    }                                                                        \
  } while (0)

#define ZT_CUDA_RETURN_IF_ERROR(call, who)                             \
  do {                                                                 \
    const cudaError_t zt_cuda_err = (call);                            \
    if (zt_cuda_err != cudaSuccess) [[unlikely]] {                     \
      return CudaError(zt_cuda_err, #call, __FILE__, __LINE__, (who)); \
    }                                                                  \
  } while (0)

using Clock = std::chrono::steady_clock;

// How long a wait that ended its communicator still waits for the copies
// queued beside the collectives (their host memory is let go after it).
constexpr std::chrono::seconds kCopyGrace{30};

// What ends a group's collectives: the first reason a rank gave (Abort).
// The ranks of MakeNcclCollectives, threads of one process, share one.
class GroupEnd {
 public:
  void Set(std::string_view reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_.load()) return;
    reason_ = std::string(reason);
    ended_.store(true);
  }
  bool ended() const { return ended_.load(); }
  std::string reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }

 private:
  std::atomic<bool> ended_{false};
  mutable std::mutex mu_;
  std::string reason_;
};

// Sleeps between polls: a few yields first (a collective that is about to
// complete costs no more than a spin), then 50 us, then 1 ms.
void Backoff(int polls) {
  if (polls < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(polls < 2048 ? std::chrono::microseconds(50)
                                             : std::chrono::microseconds(1000));
  }
}

// One rank's communicator. NCCL's work runs on the device: a peer that
// failed or left would leave this rank's kernels (and the thread waiting
// for them) waiting for good. A wait for a collective polls instead, and
// ends the communicator (ncclCommAbort, which stops its kernels) once the
// group ended, a peer left, NCCL reports an error, or the timeout passed;
// later calls then fail at once. The communicator is used only by the
// rank's one thread that queues and waits for collectives (Abort only
// marks the group).
class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(ncclComm_t comm, bool blocking, int rank, int world_size, int ordinal,
                  std::shared_ptr<GroupEnd> group, NcclPeers peers)
      : comm_(comm),
        blocking_(blocking),
        rank_(rank),
        world_size_(world_size),
        ordinal_(ordinal),
        group_(std::move(group)),
        peers_(std::move(peers)),
        who_(StrCat("NCCL rank ", rank, "/", world_size, " (cuda:", ordinal, ")")) {}
  NcclCollectives(const NcclCollectives&) = delete;
  NcclCollectives& operator=(const NcclCollectives&) = delete;

  ~NcclCollectives() override {
    if (comm_ == nullptr) return;
    // A peer that failed, or a collective queued and never waited for (a
    // failure between them), may never finish: stop, do not wait for it.
    if (pending_ || !Ended().ok()) {
      EndComm();
      return;
    }
    cudaSetDevice(ordinal_);
    ncclResult_t r = ncclSuccess;
    const char* call = "ncclCommDestroy";
    if (!blocking_) {
      // A non-blocking communicator finalizes (waiting for its peers) before
      // it is destroyed; one that does not within the timeout is ended.
      call = "ncclCommFinalize";
      r = ncclCommFinalize(comm_);
      if (r == ncclInProgress) r = Settle(call).ok() ? ncclSuccess : ncclSystemError;
      if (comm_ == nullptr) return;  // ended while finalizing
      if (r == ncclSuccess) call = "ncclCommDestroy";
    }
    if (r == ncclSuccess) r = ncclCommDestroy(comm_);
    if (r != ncclSuccess) {
      ZT_LOG(kError, kLog) << who_ << ": " << call << ": " << ncclGetErrorString(r);
      EndComm();
    }
    comm_ = nullptr;
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  void Abort(std::string_view reason) override {
    group_->Set(StrCat(who_, " ended the group's collectives: ", reason));
    if (peers_.leave) peers_.leave();
  }

  // Polls only where a collective was queued since the last wait (a copy
  // alone cannot wait for a peer): cudaEventSynchronize otherwise.
  Status Wait(Event& done) override {
    if (!pending_) return done.Synchronize();
    const Clock::time_point deadline = Clock::now() + peers_.timeout;
    Status s = Status::Ok();
    for (int polls = 0; !done.Done(); ++polls) {
      s = Ended();
      if (s.ok()) s = AsyncError("waiting for its collectives");
      if (s.ok() && Clock::now() >= deadline) s = TimedOut("its collectives");
      if (!s.ok()) break;
      Backoff(polls);
    }
    pending_ = false;
    if (s.ok()) return done.Synchronize();
    // The communicator is ended (its kernels stopped); the copies queued
    // beside them still run, and the caller lets go of their host memory
    // once this returns: they finish first, within a bound.
    const Clock::time_point grace = Clock::now() + kCopyGrace;
    while (!done.Done() && Clock::now() < grace) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!done.Done()) {
      ZT_LOG(kError, kLog) << who_ << ": copies queued with its ended collectives still run after "
                           << kCopyGrace.count() << " s";
    }
    return s;
  }

  Status AllGather(bf16* buffer, size_t shard_elems, Device& device, Stream stream) override {
    if (shard_elems == 0) return Status::Ok();
    ZT_RETURN_IF_ERROR(Ended());
    ZT_RETURN_IF_ERROR(CheckCall("AllGather", buffer, device));
    // In place: this rank's shard already sits at its offset of the output.
    pending_ = true;
    return Enqueued(ncclAllGather(buffer + static_cast<size_t>(rank_) * shard_elems, buffer,
                                  shard_elems, ncclBfloat16, comm_, StreamOf(device, stream)),
                    "ncclAllGather");
  }

  Status ReduceScatter(const bf16* input, bf16* output, size_t shard_elems, Device& device,
                       Stream stream) override {
    if (shard_elems == 0) return Status::Ok();
    ZT_RETURN_IF_ERROR(Ended());
    ZT_RETURN_IF_ERROR(CheckCall("ReduceScatter", input, device));
    ZT_RETURN_IF_ERROR(CheckCall("ReduceScatter", output, device));
    pending_ = true;
    return Enqueued(ncclReduceScatter(input, output, shard_elems, ncclBfloat16, ncclSum, comm_,
                                      StreamOf(device, stream)),
                    "ncclReduceScatter");
  }

  // Waits for a non-blocking init to complete (the peers all arrive).
  Status Ready() {
    ncclResult_t state = ncclSuccess;
    ZT_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_, &state), who_, comm_);
    if (state == ncclInProgress) return Settle("ncclCommInitRankConfig");
    if (state != ncclSuccess) return Fail(state, "ncclCommInitRankConfig");
    return Status::Ok();
  }

 private:
  static cudaStream_t StreamOf(Device& device, Stream stream) {
    return static_cast<cudaStream_t>(device.native_stream(stream));
  }

  // Aborted once the communicator or the group ended or a peer left (the
  // communicator is then ended too), else OK.
  Status Ended() {
    if (comm_ == nullptr) return Status::Aborted(StrCat(who_, ": ", ended_));
    std::string why;
    if (group_->ended()) {
      why = group_->reason();
    } else if (peers_.left) {
      if (Status s = peers_.left(); !s.ok()) why = std::string(s.message());
    }
    if (why.empty()) return Status::Ok();
    ended_ = why;
    EndComm();
    return Status::Aborted(StrCat(who_, ": ", why));
  }

  // An error NCCL found while its work ran (a peer's connection lost):
  // the communicator is ended and the group with it.
  Status AsyncError(std::string_view what) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return Fail(r, StrCat("ncclCommGetAsyncError ", what));
    if (state != ncclSuccess && state != ncclInProgress) return Fail(state, what);
    return Status::Ok();
  }

  // A call's result: a non-blocking communicator may answer ncclInProgress
  // (queued once its state settles).
  Status Enqueued(ncclResult_t r, std::string_view call) {
    if (r == ncclSuccess) return Status::Ok();
    if (r == ncclInProgress) return Settle(call);
    return Fail(r, call);
  }

  // Polls the communicator's state until it is no longer in progress.
  Status Settle(std::string_view call) {
    const Clock::time_point deadline = Clock::now() + peers_.timeout;
    for (int polls = 0;; ++polls) {
      ZT_RETURN_IF_ERROR(Ended());
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return Fail(r, StrCat("ncclCommGetAsyncError after ", call));
      if (state == ncclSuccess) return Status::Ok();
      if (state != ncclInProgress) return Fail(state, call);
      if (Clock::now() >= deadline) return TimedOut(call);
      Backoff(polls);
    }
  }

  // NCCL's error for `call`: the communicator and the group end (the peers
  // are told), and this and every later call fail with it.
  Status Fail(ncclResult_t r, std::string_view call) {
    const char* detail = ncclGetLastError(comm_);
    Status s(CodeFor(r),
             StrCat(who_, ": ", call, " failed: ", ncclGetErrorString(r),
                    detail != nullptr && detail[0] != '\0' ? StrCat(" (", detail, ")") : ""),
             static_cast<int>(r));
    Abort(s.message());
    ended_ = std::string(s.message());
    EndComm();
    return s;
  }

  Status TimedOut(std::string_view what) {
    Status s = Status::Unavailable(StrCat(who_, ": ", what, " did not complete within ",
                                          FormatSeconds(peers_.timeout),
                                          " (a peer rank is not there or stopped)"));
    Abort(s.message());
    ended_ = std::string(s.message());
    EndComm();
    return s;
  }

  // ncclCommAbort: stops the communicator's kernels still running and frees
  // it. Work queued on its streams after them then runs on (on data that
  // is not the collective's; the caller has failed by then).
  void EndComm() {
    if (comm_ == nullptr) return;
    cudaSetDevice(ordinal_);
    const ncclResult_t r = ncclCommAbort(comm_);
    if (r != ncclSuccess && r != ncclInProgress) {
      ZT_LOG(kError, kLog) << who_ << ": ncclCommAbort: " << ncclGetErrorString(r);
    }
    comm_ = nullptr;
    if (ended_.empty()) ended_ = "its communicator was ended";
  }

  // The device must be a CUDA device and `ptr` memory of this rank's GPU
  // (a wrong device would otherwise surface as a hang or a crash in NCCL).
  // Also makes the rank's GPU current on the calling thread.
  Status CheckCall(const char* op, const void* ptr, Device& device) {
    if (device.kind() != DeviceKind::kCuda) {
      return Status::InvalidArgument(
          StrCat(who_, ": ", op, " on device '", device.name(), "', which is not a CUDA device"));
    }
    if (ptr == nullptr) {
      return Status::InvalidArgument(StrCat(who_, ": ", op, " of a null buffer"));
    }
    ZT_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_), who_);
    cudaPointerAttributes attr = {};
    ZT_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptr), who_);
    if (attr.type != cudaMemoryTypeDevice || attr.device != ordinal_) {
      return Status::InvalidArgument(
          StrCat(who_, ": ", op, " buffer ", ptr, " is not memory of cuda:", ordinal_,
                 attr.type == cudaMemoryTypeDevice ? StrCat(" (it is on cuda:", attr.device, ")")
                                                   : std::string(" (it is host memory)")));
    }
    return Status::Ok();
  }

  ncclComm_t comm_;      // null once ended or destroyed
  const bool blocking_;  // made with ncclCommInitAll (blocking), or non-blocking
  const int rank_;
  const int world_size_;
  const int ordinal_;
  const std::shared_ptr<GroupEnd> group_;
  const NcclPeers peers_;
  const std::string who_;
  std::string ended_;     // why the communicator ended
  bool pending_ = false;  // a collective queued since the last Wait
};

}  // namespace

Result<std::vector<std::unique_ptr<Collectives>>> MakeNcclCollectives(
    const std::vector<int>& ordinals) {
  const int n = static_cast<int>(ordinals.size());
  if (n == 0) return Status::InvalidArgument("NCCL collectives: no devices given (ordinals empty)");
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cudaGetLastError();
    return Status(StatusCode::kUnavailable,
                  StrCat("NCCL collectives for ", n, " ranks: no CUDA device: ",
                         cudaGetErrorString(err), " (", cudaGetErrorName(err), ")"),
                  static_cast<int>(err));
  }
  if (count < n) {
    return Status::Unavailable(StrCat("NCCL collectives for ", n, " ranks need ", n,
                                      " CUDA devices; this machine has ", count));
  }
  std::set<int> seen;
  for (int ordinal : ordinals) {
    if (ordinal < 0 || ordinal >= count) {
      return Status::Unavailable(StrCat("NCCL collectives: no CUDA device ", ordinal,
                                        " (this machine has ", count, ", 0..", count - 1, ")"));
    }
    if (!seen.insert(ordinal).second) {
      return Status::InvalidArgument(
          StrCat("NCCL collectives: device ", ordinal,
                 " is listed twice; each rank needs a device of its own"));
    }
  }
  std::vector<ncclComm_t> comms(n, nullptr);
  ZT_NCCL_RETURN_IF_ERROR(ncclCommInitAll(comms.data(), n, ordinals.data()),
                          StrCat("NCCL collectives for ", n, " ranks"), nullptr);
  auto group = std::make_shared<GroupEnd>();
  std::vector<std::unique_ptr<Collectives>> out;
  out.reserve(n);
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<NcclCollectives>(comms[r], /*blocking=*/true, r, n, ordinals[r],
                                                    group, NcclPeers{}));
  }
  return out;
}

Result<NcclId> MakeNcclId() {
  static_assert(sizeof(ncclUniqueId) == sizeof(NcclId));
  ncclUniqueId id;
  ZT_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id), "NCCL unique id", nullptr);
  NcclId out;
  std::memcpy(out.data(), &id, out.size());
  return out;
}

Result<std::unique_ptr<Collectives>> MakeNcclRankCollectives(int ordinal, int rank, int world_size,
                                                             const NcclId& id, NcclPeers peers) {
  const std::string who = StrCat("NCCL rank ", rank, "/", world_size, " (cuda:", ordinal, ")");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument(StrCat(who, ": rank out of range"));
  }
  if (peers.timeout.count() <= 0) {
    return Status::InvalidArgument(StrCat(who, ": the timeout must be positive"));
  }
  peers.timeout = engine::ClampWait(peers.timeout);  // the clock's nanoseconds hold it
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cudaGetLastError();
    return Status(StatusCode::kUnavailable,
                  StrCat(who, ": no CUDA device: ", cudaGetErrorString(err), " (",
                         cudaGetErrorName(err), ")"),
                  static_cast<int>(err));
  }
  if (ordinal < 0 || ordinal >= count) {
    return Status::Unavailable(
        StrCat(who, ": no CUDA device ", ordinal, " (this machine has ", count, ")"));
  }
  ZT_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal), who);
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), id.size());
  // Non-blocking: the init waits for every peer, and one that never comes
  // (its process died) ends it rather than leaving this rank waiting.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world_size, nid, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    return NcclError(r, "ncclCommInitRankConfig", __FILE__, __LINE__, who, nullptr);
  }
  auto out = std::make_unique<NcclCollectives>(comm, /*blocking=*/false, rank, world_size, ordinal,
                                               std::make_shared<GroupEnd>(), std::move(peers));
  ZT_RETURN_IF_ERROR(out->Ready());
  return std::unique_ptr<Collectives>(std::move(out));
}

}  // namespace ztier::client
