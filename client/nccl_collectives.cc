// NCCL collectives (client::MakeNcclCollectives): the R ranks of one job are
// R CUDA devices of this process, one NCCL communicator each, created
// together with ncclCommInitAll. Each rank's Collectives object owns its
// communicator and destroys it (ncclCommDestroy) with the object.
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
// needed since each communicator has its own thread.
//
// Failure contract: every NCCL call is checked through
// ZT_NCCL_RETURN_IF_ERROR, which returns a Status naming the call, file:line,
// the rank and NCCL's error string (plus ncclGetLastError's detail); the NCCL
// result code is the Status' sys_errno. Too few devices, or a build or
// machine without them, is Unavailable; a device that is not the rank's CUDA
// device is InvalidArgument.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "client/ztier.h"
#include "common/log.h"
#include "common/status.h"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 13, 0)
#error "ztier needs NCCL 2.13 or newer (ncclBfloat16, ncclGetLastError)"
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

// An NCCL communicator, destroyed with the object.
class OwnedComm {
 public:
  explicit OwnedComm(ncclComm_t comm) : comm_(comm) {}
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;
  ~OwnedComm() {
    if (comm_ == nullptr) return;
    const ncclResult_t r = ncclCommDestroy(comm_);
    if (r != ncclSuccess) {
      ZT_LOG(kError, kLog) << "ncclCommDestroy: " << ncclGetErrorString(r);
    }
  }
  ncclComm_t get() const { return comm_; }

 private:
  ncclComm_t comm_;
};

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(ncclComm_t comm, int rank, int world_size, int ordinal)
      : comm_(comm),
        rank_(rank),
        world_size_(world_size),
        ordinal_(ordinal),
        who_(StrCat("NCCL rank ", rank, "/", world_size, " (cuda:", ordinal, ")")) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Status AllGather(bf16* buffer, size_t shard_elems, Device& device, Stream stream) override {
    if (shard_elems == 0) return Status::Ok();
    ZT_RETURN_IF_ERROR(CheckCall("AllGather", buffer, device));
    // In place: this rank's shard already sits at its offset of the output.
    ZT_NCCL_RETURN_IF_ERROR(
        ncclAllGather(buffer + static_cast<size_t>(rank_) * shard_elems, buffer, shard_elems,
                      ncclBfloat16, comm_.get(), StreamOf(device, stream)),
        who_, comm_.get());
    return Status::Ok();
  }

  Status ReduceScatter(const bf16* input, bf16* output, size_t shard_elems, Device& device,
                       Stream stream) override {
    if (shard_elems == 0) return Status::Ok();
    ZT_RETURN_IF_ERROR(CheckCall("ReduceScatter", input, device));
    ZT_RETURN_IF_ERROR(CheckCall("ReduceScatter", output, device));
    ZT_NCCL_RETURN_IF_ERROR(ncclReduceScatter(input, output, shard_elems, ncclBfloat16, ncclSum,
                                              comm_.get(), StreamOf(device, stream)),
                            who_, comm_.get());
    return Status::Ok();
  }

 private:
  static cudaStream_t StreamOf(Device& device, Stream stream) {
    return static_cast<cudaStream_t>(device.native_stream(stream));
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

  OwnedComm comm_;
  const int rank_;
  const int world_size_;
  const int ordinal_;
  const std::string who_;
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
  std::vector<std::unique_ptr<Collectives>> out;
  out.reserve(n);
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<NcclCollectives>(comms[r], r, n, ordinals[r]));
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
                                                             const NcclId& id) {
  const std::string who = StrCat("NCCL rank ", rank, "/", world_size, " (cuda:", ordinal, ")");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument(StrCat(who, ": rank out of range"));
  }
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
  ncclComm_t comm = nullptr;
  ZT_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm, world_size, nid, rank), who, nullptr);
  return std::unique_ptr<Collectives>(
      std::make_unique<NcclCollectives>(comm, rank, world_size, ordinal));
}

}  // namespace ztier::client
