// The CUDA device backend (client::MakeCudaDevice): a Device on one CUDA GPU.
//
// What it holds, all owned and released by the object:
//   - three non-blocking streams, kCompute, kCopy and kCopyOut, the Device's
//     queues;
//   - two private helper streams: allocations are made on one that never
//     waits on anything (so an allocation is usable at once from either
//     queue), and frees are queued on another that first waits on both
//     queues (so Free is ordered after all work queued so far, and neither
//     queue stalls behind the other because of a free);
//   - a stream-ordered memory pool of its own (cudaMemPoolCreate) that keeps
//     freed memory cached for reuse (an allocation that finds the GPU full
//     waits for the frees still queued, then retries once); devices without
//     memory pools fall back to cudaMalloc and a Free that synchronizes both
//     queues first;
//   - the host ranges it page-locked (cudaHostRegister, portable so every
//     device of the process treats them as pinned), unregistered on
//     destruction.
//
// Thread safety: every method may be called from any thread (the runner's
// compute thread and its transfer thread share a device). Each method makes
// the device current on the calling thread first (cudaSetDevice), so callers
// never need to. Byte counts, the registered ranges and the timeline sit
// under mutexes; the CUDA calls themselves are thread-safe.
//
// Failure contract: every CUDA call is checked through ZT_CUDA_RETURN_IF_ERROR,
// which turns a failure into a Status naming the call, file:line, the device
// and the CUDA error string and name (the error number is the Status'
// sys_errno). Out of device memory is ResourceExhausted with the bytes held
// per purpose; no device or driver is Unavailable ("no CUDA device: ...");
// a bad pointer or size is InvalidArgument; other device errors are IoError.
// Free and the destructor cannot report errors: they log them (subsystem
// "client") and carry on.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "client/transport.h"
#include "client/ztier.h"
#include "common/log.h"
#include "common/status.h"

namespace ztier::client {
namespace {

constexpr std::string_view kLog = "client";
constexpr size_t kAlignment = 256;

// Host ranges pinned through the CudaDevices of this process, counted
// across devices: a cudaHostRegisterPortable registration belongs to the
// process, so only the last holder, whichever device, unpins it. `ours` is
// false for a range someone outside ztier had pinned already (never
// unpinned here). Lock order: a device's mu_, then this mutex.
struct HostPin {
  int refs = 0;
  bool ours = true;
};
std::mutex& HostPinsMutex() {
  static std::mutex m;
  return m;
}
std::map<std::pair<uintptr_t, size_t>, HostPin>& HostPins() {
  static auto* pins = new std::map<std::pair<uintptr_t, size_t>, HostPin>;
  return *pins;
}

// "client/cuda_device.cc" from a compiler's (often absolute) __FILE__.
StatusCode CodeFor(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation:
      return StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorInitializationError:
      return StatusCode::kUnavailable;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
      return StatusCode::kInvalidArgument;
    default:
      return StatusCode::kIoError;
  }
}

// The one place a cudaError_t becomes a Status in this file. Clears the
// thread's last-error slot, so a non-sticky error (an allocation failure, an
// invalid argument) is not reported again by a later, unrelated check.
Status CudaError(cudaError_t err, std::string_view call, const char* file, int line,
                 std::string_view device) {
  cudaGetLastError();
  return Status(CodeFor(err),
                StrCat(device, ": ", call, " failed at ", ShortSourcePath(file), ":", line, ": ",
                       cudaGetErrorString(err), " (", cudaGetErrorName(err), ")"),
                static_cast<int>(err));
}

// Checks a CUDA runtime call inside a CudaDevice method (uses name_).
#define ZT_CUDA_RETURN_IF_ERROR(call)                                        \
  do {                                                                       \
    const cudaError_t zt_cuda_err = (call);                                  \
    if (zt_cuda_err != cudaSuccess) [[unlikely]] {                           \
      return CudaError(zt_cuda_err, #call, __FILE__, __LINE__, this->name_); \
    }                                                                        \
  } while (0)

// Logs a failed CUDA call where no Status can be returned (Free, destructors).
#define ZT_CUDA_LOG_IF_ERROR(call, device)                                                         \
  do {                                                                                             \
    const cudaError_t zt_cuda_err = (call);                                                        \
    if (zt_cuda_err != cudaSuccess) [[unlikely]] {                                                 \
      ZT_LOG(kError, kLog) << CudaError(zt_cuda_err, #call, __FILE__, __LINE__, device).message(); \
    }                                                                                              \
  } while (0)

const char* PurposeName(MemoryPurpose p) {
  switch (p) {
    case MemoryPurpose::kParams:
      return "params";
    case MemoryPurpose::kGrads:
      return "grads";
    case MemoryPurpose::kOther:
      return "other";
  }
  return "?";
}

// A cudaStream_t, destroyed with the object.
class OwnedStream {
 public:
  OwnedStream() = default;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaError_t Create() { return cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A cudaEvent_t without timing, destroyed with the object.
class OwnedEvent {
 public:
  OwnedEvent() = default;
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  ~OwnedEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  cudaError_t Create() { return cudaEventCreateWithFlags(&event_, cudaEventDisableTiming); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// An Event of this backend: a point recorded on one of a CudaDevice's
// streams. May outlive the device (a CUDA event is a context object).
class CudaEvent final : public Event {
 public:
  CudaEvent(std::string device_name, int ordinal)
      : device_name_(std::move(device_name)), ordinal_(ordinal) {}

  cudaError_t Create() { return event_.Create(); }
  cudaEvent_t get() const { return event_.get(); }
  int ordinal() const { return ordinal_; }

  // An event whose query fails (a device error) reads as done, so a caller
  // polling Done() moves on to Synchronize(), which reports the error.
  bool Done() const override {
    const cudaError_t err = cudaEventQuery(event_.get());
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) cudaGetLastError();
    return true;
  }

  Status Synchronize() override {
    const cudaError_t err = cudaEventSynchronize(event_.get());
    if (err != cudaSuccess) {
      return CudaError(err, "cudaEventSynchronize(event)", __FILE__, __LINE__, device_name_);
    }
    return Status::Ok();
  }

 private:
  std::string device_name_;
  int ordinal_;
  OwnedEvent event_;
};

class CudaDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> Create(int ordinal, const std::string& device_name);

  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  int ordinal() const override { return ordinal_; }

  Result<void*> Allocate(size_t bytes, MemoryPurpose purpose) override;
  void Free(void* ptr) override;
  MemoryStats memory(MemoryPurpose purpose) const override;
  void ResetHighWater() override;

  Status CopyToDevice(void* dst, const void* host_src, size_t bytes, Stream stream) override;
  Status CopyToHost(void* host_dst, const void* src, size_t bytes, Stream stream) override;
  Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream stream) override;
  Status Memset(void* dst, int value, size_t bytes, Stream stream) override;

  Result<std::unique_ptr<Event>> Record(Stream stream) override;
  Status Wait(Stream stream, Event& event) override;
  Status Synchronize(Stream stream) override;
  void* native_stream(Stream stream) const override { return StreamOf(stream); }

  Status RegisterHost(void* ptr, size_t bytes, HostAccess access) override;
  Status UnregisterHost(void* ptr, size_t bytes) override;

  void EnableTimeline(bool on) override;
  void AddSpan(TimelineSpan span) override;
  std::vector<TimelineSpan> timeline() const override;

 private:
  CudaDevice(int ordinal, std::string name) : ordinal_(ordinal), name_(std::move(name)) {}

  Status Init();
  // Makes this device current on the calling thread.
  Status Enter() const {
    ZT_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return Status::Ok();
  }
  cudaStream_t StreamOf(Stream s) const {
    switch (s) {
      case Stream::kCompute:
        return compute_.get();
      case Stream::kCopy:
        return copy_.get();
      case Stream::kCopyOut:
        return copy_out_.get();
    }
    return compute_.get();
  }
  // Queues the release of `ptr` after everything queued so far on every
  // stream. Caller holds no lock (CUDA calls only).
  Status QueueFree(void* ptr);
  std::string HeldBytes() const;  // requires mu_

  const int ordinal_;
  const std::string name_;
  OwnedStream compute_, copy_, copy_out_;
  OwnedStream alloc_stream_, free_stream_;  // only with a memory pool
  cudaMemPool_t pool_ = nullptr;            // null: cudaMalloc / cudaFree

  // Orders frees after every queue; reused under free_mu_ (a wait captures
  // the event's state when it is queued, so reuse is safe).
  std::mutex free_mu_;
  OwnedEvent free_after_compute_, free_after_copy_, free_after_copy_out_;

  struct Allocation {
    size_t bytes;
    MemoryPurpose purpose;
  };
  ProcessOwner owner_;  // a forked child allocates and frees nothing
  mutable std::mutex mu_;
  std::unordered_map<void*, Allocation> allocations_;
  MemoryStats stats_[kMemoryPurposes];
  // Host ranges this device holds registrations of ({start, bytes} -> how
  // many RegisterHost calls), given back by UnregisterHost or the
  // destructor. The pins themselves are the process's (see HostPins).
  std::map<std::pair<uintptr_t, size_t>, int> held_;

  mutable std::mutex timeline_mu_;
  bool timeline_on_ = false;
  std::vector<TimelineSpan> spans_;
};

Result<std::unique_ptr<Device>> CudaDevice::Create(int ordinal, const std::string& device_name) {
  std::unique_ptr<CudaDevice> device(new CudaDevice(ordinal, device_name));
  ZT_RETURN_IF_ERROR(device->Init());
  return std::unique_ptr<Device>(std::move(device));
}

Status CudaDevice::Init() {
  ZT_RETURN_IF_ERROR(Enter());
  ZT_CUDA_RETURN_IF_ERROR(compute_.Create());
  ZT_CUDA_RETURN_IF_ERROR(copy_.Create());
  ZT_CUDA_RETURN_IF_ERROR(copy_out_.Create());
  ZT_CUDA_RETURN_IF_ERROR(free_after_compute_.Create());
  ZT_CUDA_RETURN_IF_ERROR(free_after_copy_.Create());
  ZT_CUDA_RETURN_IF_ERROR(free_after_copy_out_.Create());

  int pools_supported = 0;
  ZT_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&pools_supported, cudaDevAttrMemoryPoolsSupported, ordinal_));
  if (pools_supported == 0) {
    ZT_LOG(kInfo, kLog) << name_
                        << ": no stream-ordered memory pools; using cudaMalloc, and Free "
                           "synchronizes every stream";
    return Status::Ok();
  }
  ZT_CUDA_RETURN_IF_ERROR(alloc_stream_.Create());
  ZT_CUDA_RETURN_IF_ERROR(free_stream_.Create());
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = ordinal_;
  ZT_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool_, &props));
  // Keep freed memory in the pool (the runner frees and reallocates units all
  // the time), and never let an allocation wait on a pending free of another
  // stream: the allocation stream must stay free of dependencies.
  uint64_t keep_all = UINT64_MAX;
  ZT_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all));
  int no = 0;
  ZT_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &no));
  return Status::Ok();
}

CudaDevice::~CudaDevice() {
  ZT_CUDA_LOG_IF_ERROR(cudaSetDevice(ordinal_), name_);
  // Let queued work finish before its memory and host ranges go away.
  if (compute_.get() != nullptr) ZT_CUDA_LOG_IF_ERROR(cudaStreamSynchronize(compute_.get()), name_);
  if (copy_.get() != nullptr) ZT_CUDA_LOG_IF_ERROR(cudaStreamSynchronize(copy_.get()), name_);
  if (copy_out_.get() != nullptr) {
    ZT_CUDA_LOG_IF_ERROR(cudaStreamSynchronize(copy_out_.get()), name_);
  }
  std::unordered_map<void*, Allocation> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    leftover.swap(allocations_);
  }
  if (!leftover.empty()) {
    ZT_LOG(kDebug, kLog) << name_ << ": freeing " << leftover.size()
                         << " allocation(s) still held at destruction";
  }
  for (const auto& [ptr, alloc] : leftover) {
    if (pool_ != nullptr) {
      ZT_CUDA_LOG_IF_ERROR(cudaFreeAsync(ptr, free_stream_.get()), name_);
    } else {
      ZT_CUDA_LOG_IF_ERROR(cudaFree(ptr), name_);
    }
  }
  if (free_stream_.get() != nullptr) {
    ZT_CUDA_LOG_IF_ERROR(cudaStreamSynchronize(free_stream_.get()), name_);
  }
  if (pool_ != nullptr) ZT_CUDA_LOG_IF_ERROR(cudaMemPoolDestroy(pool_), name_);
  {
    std::lock_guard<std::mutex> pins_lock(HostPinsMutex());
    for (const auto& [key, refs] : held_) {
      auto it = HostPins().find(key);
      if (it == HostPins().end()) continue;
      it->second.refs -= refs;
      if (it->second.refs > 0) continue;
      if (it->second.ours) {
        ZT_CUDA_LOG_IF_ERROR(cudaHostUnregister(reinterpret_cast<void*>(key.first)), name_);
      }
      HostPins().erase(it);
    }
  }
  // The streams and events are destroyed by their owners after this body.
}

std::string CudaDevice::HeldBytes() const {
  return StrCat("this device holds ", stats_[0].bytes, " B of params, ", stats_[1].bytes,
                " B of grads, ", stats_[2].bytes, " B of other buffers");
}

Result<void*> CudaDevice::Allocate(size_t bytes, MemoryPurpose purpose) {
  if (static_cast<int>(purpose) >= kMemoryPurposes) {
    return Status::InvalidArgument(StrCat(name_, ": Allocate with an unknown memory purpose"));
  }
  if (bytes == 0) return static_cast<void*>(nullptr);
  ZT_RETURN_IF_ERROR(owner_.Check("a CUDA device allocation"));
  if (bytes > SIZE_MAX - kAlignment) {  // the rounding below would wrap to a tiny size
    return Status::ResourceExhausted(
        StrCat(name_, ": cannot allocate ", bytes, " B of ", PurposeName(purpose)));
  }
  ZT_RETURN_IF_ERROR(Enter());
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* ptr = nullptr;
  cudaError_t err;
  if (pool_ != nullptr) {
    err = cudaMallocFromPoolAsync(&ptr, rounded, pool_, alloc_stream_.get());
    if (err == cudaErrorMemoryAllocation) {
      // The pool reuses only memory whose free has already run; frees still
      // queued behind the compute and copy streams may be what is missing.
      // Wait for them, then try once more.
      cudaGetLastError();
      err = cudaStreamSynchronize(free_stream_.get());
      if (err == cudaSuccess) {
        err = cudaMallocFromPoolAsync(&ptr, rounded, pool_, alloc_stream_.get());
      }
    }
    // Nothing else is ever queued on the allocation stream, so this returns
    // at once; afterwards the memory is usable from any stream.
    if (err == cudaSuccess) err = cudaStreamSynchronize(alloc_stream_.get());
  } else {
    err = cudaMalloc(&ptr, rounded);
  }
  if (err != cudaSuccess) {
    Status s = CudaError(err, pool_ != nullptr ? "cudaMallocFromPoolAsync" : "cudaMalloc", __FILE__,
                         __LINE__, name_);
    std::lock_guard<std::mutex> lock(mu_);
    return Status(s.code(),
                  StrCat(s.message(), "; asked for ", bytes, " B of ", PurposeName(purpose), ", ",
                         HeldBytes(),
                         " (lower the runner's prefetch depth or live-bytes cap, "
                         "or the batch size)"),
                  s.sys_errno());
  }
  if (reinterpret_cast<uintptr_t>(ptr) % kAlignment != 0) {
    Status s = QueueFree(ptr);
    return Status::Internal(StrCat(name_, ": the CUDA allocator returned ", ptr,
                                   ", not aligned to ", kAlignment, " B",
                                   s.ok() ? "" : StrCat("; freeing it failed: ", s.message())));
  }
  std::lock_guard<std::mutex> lock(mu_);
  allocations_[ptr] = {bytes, purpose};
  MemoryStats& st = stats_[static_cast<int>(purpose)];
  st.bytes += bytes;
  st.high_water = std::max(st.high_water, st.bytes);
  return ptr;
}

Status CudaDevice::QueueFree(void* ptr) {
  if (pool_ == nullptr) {
    ZT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()));
    ZT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_.get()));
    ZT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_out_.get()));
    ZT_CUDA_RETURN_IF_ERROR(cudaFree(ptr));
    return Status::Ok();
  }
  std::lock_guard<std::mutex> lock(free_mu_);
  ZT_CUDA_RETURN_IF_ERROR(cudaEventRecord(free_after_compute_.get(), compute_.get()));
  ZT_CUDA_RETURN_IF_ERROR(cudaEventRecord(free_after_copy_.get(), copy_.get()));
  ZT_CUDA_RETURN_IF_ERROR(cudaEventRecord(free_after_copy_out_.get(), copy_out_.get()));
  ZT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(free_stream_.get(), free_after_compute_.get(), 0));
  ZT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(free_stream_.get(), free_after_copy_.get(), 0));
  ZT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(free_stream_.get(), free_after_copy_out_.get(), 0));
  ZT_CUDA_RETURN_IF_ERROR(cudaFreeAsync(ptr, free_stream_.get()));
  return Status::Ok();
}

void CudaDevice::Free(void* ptr) {
  if (ptr == nullptr || owner_.forked()) return;  // (the memory is the parent's)
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.find(ptr);
    ZT_CHECK_MSG(it != allocations_.end(), name_, ": Free of ", ptr,
                 ", which this device did not allocate (or freed already)");
    MemoryStats& st = stats_[static_cast<int>(it->second.purpose)];
    st.bytes -= it->second.bytes;
    allocations_.erase(it);
  }
  Status s = Enter();
  if (s.ok()) s = QueueFree(ptr);
  if (!s.ok()) {
    ZT_LOG(kError, kLog) << "Free(" << ptr << "): " << s.message();
  }
}

MemoryStats CudaDevice::memory(MemoryPurpose purpose) const {
  std::lock_guard<std::mutex> lock(mu_);
  const int i = static_cast<int>(purpose);
  return i < kMemoryPurposes ? stats_[i] : MemoryStats{};
}

void CudaDevice::ResetHighWater() {
  std::lock_guard<std::mutex> lock(mu_);
  for (MemoryStats& st : stats_) st.high_water = st.bytes;
}

Status CudaDevice::CopyToDevice(void* dst, const void* host_src, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  ZT_RETURN_IF_ERROR(Enter());
  ZT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, StreamOf(stream)));
  return Status::Ok();
}

Status CudaDevice::CopyToHost(void* host_dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  ZT_RETURN_IF_ERROR(Enter());
  ZT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, StreamOf(stream)));
  return Status::Ok();
}

Status CudaDevice::CopyOnDevice(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  ZT_RETURN_IF_ERROR(Enter());
  ZT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, StreamOf(stream)));
  return Status::Ok();
}

Status CudaDevice::Memset(void* dst, int value, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  ZT_RETURN_IF_ERROR(Enter());
  ZT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, StreamOf(stream)));
  return Status::Ok();
}

Result<std::unique_ptr<Event>> CudaDevice::Record(Stream stream) {
  ZT_RETURN_IF_ERROR(Enter());
  auto event = std::make_unique<CudaEvent>(name_, ordinal_);
  ZT_CUDA_RETURN_IF_ERROR(event->Create());
  ZT_CUDA_RETURN_IF_ERROR(cudaEventRecord(event->get(), StreamOf(stream)));
  return std::unique_ptr<Event>(std::move(event));
}

Status CudaDevice::Wait(Stream stream, Event& event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
  if (cuda_event == nullptr) {
    return Status::InvalidArgument(
        StrCat(name_, ": Wait on an event that was not recorded by a CUDA device"));
  }
  ZT_RETURN_IF_ERROR(Enter());
  ZT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(StreamOf(stream), cuda_event->get(), 0));
  return Status::Ok();
}

Status CudaDevice::Synchronize(Stream stream) {
  ZT_RETURN_IF_ERROR(Enter());
  ZT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(StreamOf(stream)));
  return Status::Ok();
}

Status CudaDevice::RegisterHost(void* ptr, size_t bytes, HostAccess access) {
  if (bytes == 0) return Status::Ok();
  if (ptr == nullptr) {
    return Status::InvalidArgument(
        StrCat(name_, ": RegisterHost of a null pointer (", bytes, " B)"));
  }
  const auto key = std::make_pair(reinterpret_cast<uintptr_t>(ptr), bytes);
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> pins_lock(HostPinsMutex());
  auto it = HostPins().find(key);
  if (it == HostPins().end()) {
    ZT_RETURN_IF_ERROR(Enter());
    unsigned flags = cudaHostRegisterPortable;
    if (access == HostAccess::kReadOnly) {
      // A PROT_READ mapping (ztierd's sealed publish buffers) is pinned only
      // with the read-only flag, unless the device reads host memory through
      // the host's page tables (then it is not needed, and maybe refused).
      int read_only = 0, host_tables = 0;
      ZT_CUDA_RETURN_IF_ERROR(
          cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, ordinal_));
      ZT_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
          &host_tables, cudaDevAttrPageableMemoryAccessUsesHostPageTables, ordinal_));
      if (read_only != 0) {
        flags |= cudaHostRegisterReadOnly;
      } else if (host_tables == 0) {
        return Status::FailedPrecondition(
            StrCat(name_, ": cannot pin ", bytes, " B of read-only host memory at ", ptr,
                   ": this device supports neither cudaHostRegisterReadOnly nor host page tables "
                   "(a driver too old for the daemon's sealed buffers; run the engine embedded)"));
      }
    }
    const cudaError_t err = cudaHostRegister(ptr, bytes, flags);
    bool ours = true;
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
      // Pinned already by someone else (the caller, or a range that
      // contains this one): DMA works; its owner undoes it.
      cudaGetLastError();
      ours = false;
    } else if (err != cudaSuccess) {
      Status s = CudaError(err, "cudaHostRegister", __FILE__, __LINE__, name_);
      return Status(s.code(),
                    StrCat(s.message(), "; registering ", bytes, " B at ", ptr,
                           " (page-locked memory is limited by RLIMIT_MEMLOCK and free RAM)"),
                    s.sys_errno());
    }
    it = HostPins().emplace(key, HostPin{.refs = 0, .ours = ours}).first;
  }
  ++it->second.refs;
  ++held_[key];
  return Status::Ok();
}

Status CudaDevice::UnregisterHost(void* ptr, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  const auto key = std::make_pair(reinterpret_cast<uintptr_t>(ptr), bytes);
  std::lock_guard<std::mutex> lock(mu_);
  auto held = held_.find(key);
  if (held == held_.end()) {
    return Status::InvalidArgument(StrCat(name_, ": UnregisterHost of ", bytes, " B at ", ptr,
                                          ", a range this device never registered"));
  }
  std::lock_guard<std::mutex> pins_lock(HostPinsMutex());
  auto it = HostPins().find(key);
  ZT_CHECK_MSG(it != HostPins().end() && it->second.refs > 0, "host pin count lost for ", ptr);
  if (it->second.refs == 1 && it->second.ours) {
    // Unpin first; the counts change only once it is done.
    ZT_RETURN_IF_ERROR(Enter());
    ZT_CUDA_RETURN_IF_ERROR(cudaHostUnregister(ptr));
  }
  if (--it->second.refs == 0) HostPins().erase(it);
  if (--held->second == 0) held_.erase(held);
  return Status::Ok();
}

void CudaDevice::EnableTimeline(bool on) {
  std::lock_guard<std::mutex> lock(timeline_mu_);
  timeline_on_ = on;
}

void CudaDevice::AddSpan(TimelineSpan span) {
  std::lock_guard<std::mutex> lock(timeline_mu_);
  if (timeline_on_) spans_.push_back(std::move(span));
}

std::vector<TimelineSpan> CudaDevice::timeline() const {
  std::lock_guard<std::mutex> lock(timeline_mu_);
  return spans_;
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

Result<std::unique_ptr<Device>> MakeCudaDevice(int ordinal) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(StatusCode::kUnavailable,
                  StrCat("no CUDA device: cudaGetDeviceCount: ", cudaGetErrorString(err), " (",
                         cudaGetErrorName(err), "); asked for device ", ordinal),
                  static_cast<int>(err));
  }
  if (count == 0) {
    return Status::Unavailable(
        StrCat("no CUDA device: the CUDA runtime sees 0 devices; asked for device ", ordinal,
               " (check CUDA_VISIBLE_DEVICES)"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return Status::Unavailable(StrCat("no CUDA device: device ", ordinal,
                                      " is out of range, this machine has ", count,
                                      " CUDA device(s) (0..", count - 1, ")"));
  }
  cudaDeviceProp prop = {};
  const cudaError_t perr = cudaGetDeviceProperties(&prop, ordinal);
  if (perr != cudaSuccess) {
    return CudaError(perr, "cudaGetDeviceProperties", __FILE__, __LINE__, StrCat("cuda:", ordinal));
  }
  return CudaDevice::Create(ordinal, StrCat("cuda:", ordinal, " (", prop.name, ")"));
}

}  // namespace ztier::client
