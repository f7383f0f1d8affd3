// The CUDA device backend (client/cuda_device.cc): allocation accounting and
// high-water marks per purpose, copies on both streams ordered by events,
// stream waits, frees queued behind work, idempotent host registration, the
// timeline; and, on a machine without a GPU or driver, that opening a device
// fails with Unavailable and says why. Tests that need a device skip with
// the reason when there is none.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client/ztier.h"

namespace ztier::client {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (text) << "'"

TEST(CudaDeviceNoGpuTest, MakeCudaDeviceIsUnavailableWithoutDevice) {
  if (CudaDeviceCount() > 0) {
    GTEST_SKIP() << "this machine has " << CudaDeviceCount()
                 << " CUDA device(s); the no-device path is not reachable";
  }
  Result<std::unique_ptr<Device>> d = MakeCudaDevice(0);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status();
  EXPECT_CONTAINS(d.status().message(), "no CUDA device");
}

TEST(CudaDeviceNoGpuTest, OrdinalOutOfRangeIsUnavailable) {
  for (int ordinal : {-1, CudaDeviceCount(), CudaDeviceCount() + 7}) {
    Result<std::unique_ptr<Device>> d = MakeCudaDevice(ordinal);
    ASSERT_FALSE(d.ok()) << "ordinal " << ordinal;
    EXPECT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status();
    EXPECT_CONTAINS(d.status().message(), "no CUDA device");
  }
}

// Registered host memory must outlive its registration (the device keeps a
// range pinned until the device is destroyed; there is no unregister call),
// so the fixture owns the host buffers and destroys them after the device.
class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<Device>> d = MakeCudaDevice(0);
    if (!d.ok() && d.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << d.status().message();
    }
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(*d);
  }

  // Device memory freed at scope exit.
  struct Buffer {
    Device* device = nullptr;
    void* ptr = nullptr;
    Buffer() = default;
    Buffer(Device* d, void* p) : device(d), ptr(p) {}
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() {
      if (device != nullptr) device->Free(ptr);
    }
  };

  void* Alloc(size_t bytes, MemoryPurpose purpose = MemoryPurpose::kOther) {
    Result<void*> p = device_->Allocate(bytes, purpose);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }

  // A host buffer that lives until after the device is destroyed.
  std::vector<uint8_t>& Host(size_t n, uint8_t fill) {
    host_.push_back(std::make_unique<std::vector<uint8_t>>(n, fill));
    return *host_.back();
  }
  std::vector<uint8_t>& RandomHost(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t>& v = Host(n, 0);
    for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
    return v;
  }

  std::vector<std::unique_ptr<std::vector<uint8_t>>> host_;  // destroyed after device_
  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceTest, NameKindAndStreams) {
  EXPECT_EQ(device_->kind(), DeviceKind::kCuda);
  EXPECT_CONTAINS(device_->name(), "cuda:0 (");
  EXPECT_NE(device_->native_stream(Stream::kCompute), nullptr);
  EXPECT_NE(device_->native_stream(Stream::kCopy), nullptr);
  EXPECT_NE(device_->native_stream(Stream::kCompute), device_->native_stream(Stream::kCopy));
}

// A size within 255 B of SIZE_MAX rounded up to 256 wrapped to 0: the
// allocation "succeeded" with a null pointer, accounted at the bytes asked.
TEST_F(CudaDeviceTest, AnImpossibleSizeIsResourceExhausted) {
  for (const size_t bytes : {SIZE_MAX, SIZE_MAX - 100, SIZE_MAX - 255}) {
    Result<void*> p = device_->Allocate(bytes, MemoryPurpose::kOther);
    EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted) << bytes;
  }
  EXPECT_EQ(device_->memory(MemoryPurpose::kOther).bytes, 0u);
}

TEST_F(CudaDeviceTest, AllocationAccountingAndHighWater) {
  Result<void*> zero = device_->Allocate(0, MemoryPurpose::kParams);
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(*zero, nullptr);
  device_->Free(nullptr);

  void* a = Alloc(1000, MemoryPurpose::kParams);
  void* b = Alloc(3000, MemoryPurpose::kParams);
  void* g = Alloc(512, MemoryPurpose::kGrads);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(g, nullptr);
  for (void* p : {a, b, g}) EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u) << p;

  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).bytes, 4000u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).high_water, 4000u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kGrads).bytes, 512u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kOther).bytes, 0u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kOther).high_water, 0u);

  device_->Free(a);
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).bytes, 3000u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).high_water, 4000u);
  device_->ResetHighWater();
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).high_water, 3000u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kGrads).high_water, 512u);

  void* c = Alloc(10000, MemoryPurpose::kParams);
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).high_water, 13000u);
  device_->Free(b);
  device_->Free(c);
  device_->Free(g);
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).bytes, 0u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kGrads).bytes, 0u);
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).high_water, 13000u);
}

TEST_F(CudaDeviceTest, OutOfMemoryIsResourceExhaustedAndCountsNothing) {
  const uint64_t before = device_->memory(MemoryPurpose::kGrads).bytes;
  Result<void*> huge = device_->Allocate(size_t{1} << 50, MemoryPurpose::kGrads);  // 1 PiB
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status();
  EXPECT_CONTAINS(huge.status().message(), "cuda:0");
  EXPECT_EQ(device_->memory(MemoryPurpose::kGrads).bytes, before);
  // The device still works afterwards.
  Buffer ok(device_.get(), Alloc(4096));
  EXPECT_NE(ok.ptr, nullptr);
  EXPECT_TRUE(device_->Synchronize(Stream::kCompute).ok());
}

// H2D on one stream, D2H on the other after an event: both directions, both
// stream assignments.
TEST_F(CudaDeviceTest, RoundTripOnBothStreamsWithEvents) {
  const size_t n = (size_t{8} << 20) + 123;
  for (Stream up : {Stream::kCopy, Stream::kCompute}) {
    const Stream down = up == Stream::kCopy ? Stream::kCompute : Stream::kCopy;
    std::vector<uint8_t>& src = RandomHost(n, up == Stream::kCopy ? 1 : 2);
    std::vector<uint8_t>& dst = Host(n, 0);
    ASSERT_TRUE(device_->RegisterHost(src.data(), n, HostAccess::kReadWrite).ok());
    ASSERT_TRUE(device_->RegisterHost(dst.data(), n, HostAccess::kReadWrite).ok());
    Buffer buf(device_.get(), Alloc(n));
    ASSERT_NE(buf.ptr, nullptr);

    ASSERT_TRUE(device_->CopyToDevice(buf.ptr, src.data(), n, up).ok());
    Result<std::unique_ptr<Event>> uploaded = device_->Record(up);
    ASSERT_TRUE(uploaded.ok()) << uploaded.status();
    ASSERT_TRUE(device_->Wait(down, **uploaded).ok());
    ASSERT_TRUE(device_->CopyToHost(dst.data(), buf.ptr, n, down).ok());
    Result<std::unique_ptr<Event>> downloaded = device_->Record(down);
    ASSERT_TRUE(downloaded.ok()) << downloaded.status();
    Status s = (*downloaded)->Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE((*downloaded)->Done());
    EXPECT_TRUE((*uploaded)->Done());
    EXPECT_TRUE(src == dst) << "round trip via " << (up == Stream::kCopy ? "copy" : "compute")
                            << " stream differs";
  }
}

// The copy stream reads a buffer only after the compute stream's fills,
// because it waits on the compute stream's event.
TEST_F(CudaDeviceTest, StreamWaitOrdersWorkAcrossStreams) {
  const size_t n = size_t{64} << 20;
  std::vector<uint8_t>& src = Host(n, 0x22);
  std::vector<uint8_t>& dst = Host(n, 0);
  ASSERT_TRUE(device_->RegisterHost(src.data(), n, HostAccess::kReadWrite).ok());
  ASSERT_TRUE(device_->RegisterHost(dst.data(), n, HostAccess::kReadWrite).ok());
  Buffer buf(device_.get(), Alloc(n));
  ASSERT_NE(buf.ptr, nullptr);
  for (int round = 0; round < 3; ++round) {
    const int value = 0x30 + round;
    ASSERT_TRUE(device_->CopyToDevice(buf.ptr, src.data(), n, Stream::kCompute).ok());
    ASSERT_TRUE(device_->Memset(buf.ptr, value, n, Stream::kCompute).ok());
    Result<std::unique_ptr<Event>> filled = device_->Record(Stream::kCompute);
    ASSERT_TRUE(filled.ok()) << filled.status();
    ASSERT_TRUE(device_->Wait(Stream::kCopy, **filled).ok());
    ASSERT_TRUE(device_->CopyToHost(dst.data(), buf.ptr, n, Stream::kCopy).ok());
    Status s = device_->Synchronize(Stream::kCopy);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE((*filled)->Done());
    const size_t bad = static_cast<size_t>(
        std::count_if(dst.begin(), dst.end(), [&](uint8_t b) { return b != value; }));
    EXPECT_EQ(bad, 0u) << "round " << round;
  }
}

// Free while copies and fills are still queued: the memory is released only
// after them, and a new allocation of the same size works at once.
TEST_F(CudaDeviceTest, FreeIsOrderedAfterQueuedWork) {
  const size_t n = size_t{32} << 20;
  std::vector<uint8_t>& host = Host(n, 0x5a);
  std::vector<uint8_t>& back = Host(n, 0);
  ASSERT_TRUE(device_->RegisterHost(host.data(), n, HostAccess::kReadWrite).ok());
  ASSERT_TRUE(device_->RegisterHost(back.data(), n, HostAccess::kReadWrite).ok());
  for (int i = 0; i < 8; ++i) {
    void* p = Alloc(n, MemoryPurpose::kParams);
    ASSERT_NE(p, nullptr);
    ASSERT_TRUE(device_->CopyToDevice(p, host.data(), n, Stream::kCopy).ok());
    ASSERT_TRUE(device_->Memset(p, 0x11, n / 2, Stream::kCompute).ok());
    device_->Free(p);
  }
  Buffer last(device_.get(), Alloc(n, MemoryPurpose::kParams));
  ASSERT_TRUE(device_->CopyToDevice(last.ptr, host.data(), n, Stream::kCopy).ok());
  ASSERT_TRUE(device_->CopyToHost(back.data(), last.ptr, n, Stream::kCopy).ok());
  ASSERT_TRUE(device_->Synchronize(Stream::kCopy).ok());
  ASSERT_TRUE(device_->Synchronize(Stream::kCompute).ok());
  EXPECT_TRUE(host == back);
  EXPECT_EQ(device_->memory(MemoryPurpose::kParams).bytes, n);
}

TEST_F(CudaDeviceTest, RegisterHostIsIdempotent) {
  const size_t n = size_t{4} << 20;
  std::vector<uint8_t>& host = RandomHost(n, 7);
  std::vector<uint8_t>& back = Host(n, 0);
  Status s = device_->RegisterHost(host.data(), n, HostAccess::kReadWrite);
  ASSERT_TRUE(s.ok()) << s;
  s = device_->RegisterHost(host.data(), n, HostAccess::kReadWrite);
  EXPECT_TRUE(s.ok()) << s;
  // A range inside one already registered is pinned already: tolerated.
  s = device_->RegisterHost(host.data() + 4096, n / 2, HostAccess::kReadWrite);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(device_->RegisterHost(host.data(), 0, HostAccess::kReadWrite).ok());
  EXPECT_EQ(device_->RegisterHost(nullptr, 64, HostAccess::kReadWrite).code(),
            StatusCode::kInvalidArgument);

  Buffer buf(device_.get(), Alloc(n));
  ASSERT_TRUE(device_->CopyToDevice(buf.ptr, host.data(), n, Stream::kCopy).ok());
  ASSERT_TRUE(device_->CopyToHost(back.data(), buf.ptr, n, Stream::kCopy).ok());
  ASSERT_TRUE(device_->Synchronize(Stream::kCopy).ok());
  EXPECT_TRUE(host == back);
}

// ztierd's publish buffers are a sealed memfd the client maps PROT_READ:
// pinned without cudaHostRegisterReadOnly, every runner through ztierd
// failed to start on a GPU.
TEST_F(CudaDeviceTest, AReadOnlyMappingIsPinnedAndCopiedFrom) {
  const size_t n = size_t{2} << 20;
  const int fd = ::memfd_create("ztier-ro-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(n)), 0);
  void* w = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* r = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(w, MAP_FAILED);
  ASSERT_NE(r, MAP_FAILED);
  std::vector<uint8_t>& want = RandomHost(n, 11);
  std::memcpy(w, want.data(), n);
  std::vector<uint8_t>& back = Host(n, 0);
  Status s = device_->RegisterHost(r, n, HostAccess::kReadOnly);
  ASSERT_TRUE(s.ok()) << s;
  Buffer buf(device_.get(), Alloc(n));
  ASSERT_TRUE(device_->CopyToDevice(buf.ptr, r, n, Stream::kCopy).ok());
  ASSERT_TRUE(device_->CopyToHost(back.data(), buf.ptr, n, Stream::kCopy).ok());
  ASSERT_TRUE(device_->Synchronize(Stream::kCopy).ok());
  EXPECT_TRUE(want == back);
  EXPECT_TRUE(device_->UnregisterHost(r, n).ok());
  ::munmap(r, n);
  ::munmap(w, n);
}

// Registrations are counted: the last UnregisterHost unpins the range (a
// region must be unregistered before it is unmapped), and unregistering a
// range never registered is an error that names it.
TEST_F(CudaDeviceTest, UnregisterHostUndoesOneRegistrationAtATime) {
  const size_t n = size_t{1} << 20;
  std::vector<uint8_t>& host = Host(n, 3);
  unsigned flags = 0;
  ASSERT_TRUE(device_->RegisterHost(host.data(), n, HostAccess::kReadWrite).ok());
  ASSERT_TRUE(device_->RegisterHost(host.data(), n, HostAccess::kReadWrite).ok());
  ASSERT_TRUE(device_->UnregisterHost(host.data(), n).ok());
  EXPECT_EQ(cudaHostGetFlags(&flags, host.data()), cudaSuccess) << "unpinned while still held";
  ASSERT_TRUE(device_->UnregisterHost(host.data(), n).ok());
  EXPECT_NE(cudaHostGetFlags(&flags, host.data()), cudaSuccess) << "still pinned after the last";
  cudaGetLastError();
  Status s = device_->UnregisterHost(host.data(), n);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
}

// Two devices of the process on the same host range (ranks as threads):
// the pin is the process's, so neither device's unregistering or going
// unpins it while the other still holds it.
TEST_F(CudaDeviceTest, RegisterHostSharedBetweenDeviceObjects) {
  const size_t n = size_t{1} << 20;
  std::vector<uint8_t>& host = Host(n, 1);
  unsigned flags = 0;
  Result<std::unique_ptr<Device>> other = MakeCudaDevice(0);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE(device_->RegisterHost(host.data(), n, HostAccess::kReadWrite).ok());
  Status s = (*other)->RegisterHost(host.data(), n, HostAccess::kReadWrite);
  EXPECT_TRUE(s.ok()) << s;
  ASSERT_TRUE(device_->UnregisterHost(host.data(), n).ok());
  EXPECT_EQ(cudaHostGetFlags(&flags, host.data()), cudaSuccess) << "unpinned under the other";
  ASSERT_TRUE(device_->RegisterHost(host.data(), n, HostAccess::kReadWrite).ok());
  other->reset();
  EXPECT_EQ(cudaHostGetFlags(&flags, host.data()), cudaSuccess) << "unpinned under this one";
  ASSERT_TRUE(device_->UnregisterHost(host.data(), n).ok());
  EXPECT_NE(cudaHostGetFlags(&flags, host.data()), cudaSuccess);
  cudaGetLastError();
}

class ForeignEvent final : public Event {
 public:
  bool Done() const override { return true; }
  Status Synchronize() override { return Status::Ok(); }
};

TEST_F(CudaDeviceTest, WaitOnForeignEventIsInvalidArgument) {
  ForeignEvent e;
  Status s = device_->Wait(Stream::kCompute, e);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
}

TEST_F(CudaDeviceTest, TimelineKeepsSpansOnlyWhenEnabled) {
  const auto now = std::chrono::steady_clock::now();
  device_->AddSpan({Stream::kCompute, "before", now, now});
  EXPECT_TRUE(device_->timeline().empty());
  device_->EnableTimeline(true);
  device_->AddSpan({Stream::kCompute, "unit0", now, now + std::chrono::milliseconds(1)});
  device_->AddSpan({Stream::kCopy, "fetch1", now, now + std::chrono::milliseconds(2)});
  std::vector<TimelineSpan> spans = device_->timeline();
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].label, "unit0");
  EXPECT_EQ(spans[1].stream, Stream::kCopy);
  device_->EnableTimeline(false);
  device_->AddSpan({Stream::kCompute, "after", now, now});
  EXPECT_EQ(device_->timeline().size(), 2u);
}

// Memory still allocated when the device goes away is released with it.
TEST_F(CudaDeviceTest, DestroyWithLiveAllocations) {
  Result<std::unique_ptr<Device>> other = MakeCudaDevice(0);
  ASSERT_TRUE(other.ok()) << other.status();
  Result<void*> p = (*other)->Allocate(1 << 20, MemoryPurpose::kOther);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE((*other)->Memset(*p, 0, 1 << 20, Stream::kCompute).ok());
  other->reset();
  SUCCEED();
}

}  // namespace
}  // namespace ztier::client
