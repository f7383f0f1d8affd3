// Tests of the NVMe swap space: round trips over 1, 2 and 4 paths (separate
// directories of one disk here), concurrent submitters, every fault of the
// fault backend, free and reuse, growth of the files and their cap, locks on
// the paths, out of space, manifests (round trip, corruption, truncation),
// and rejected paths. Every test runs on both I/O backends (io_uring and the
// thread pool); the io_uring runs skip, with the reason, only when the
// kernel lacks an io_uring feature they need.
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/crc32c.h"
#include "common/extent_allocator.h"
#include "nvme/io_backend.h"
#include "nvme/swap_space.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/small_tmpfs.h"

namespace ztier::nvme {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kKiB = 1024, kMiB = 1024 * 1024;

uint64_t FreshSeed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

// A byte buffer placed at a chosen misalignment from a 4 KiB boundary.
class Buffer {
 public:
  Buffer(size_t n, size_t misalign) : store_(n + 8192), n_(n) {
    auto base = reinterpret_cast<uintptr_t>(store_.data());
    data_ = store_.data() + ((4096 - base % 4096) % 4096) + misalign;
  }
  uint8_t* data() { return data_; }
  size_t size() const { return n_; }

 private:
  std::vector<uint8_t> store_;
  uint8_t* data_;
  size_t n_;
};

enum class BackendKind { kUring, kThreads };

std::string BackendName(const ::testing::TestParamInfo<BackendKind>& info) {
  return info.param == BackendKind::kUring ? "io_uring" : "threads";
}

class SwapSpaceTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    if (GetParam() == BackendKind::kUring) {
      Status probe = ProbeUring();
      if (probe.ok()) probe = ProbeUringSetup();
      if (!probe.ok()) GTEST_SKIP() << "kernel lacks io_uring support needed: " << probe;
    }
    scratch_.emplace("swap");
    root_ = scratch_->path();
  }
  void TearDown() override { scratch_.reset(); }

  // `cap`: the files' size limit per path (0: none).
  SwapOptions Options(int npaths, uint64_t cap, uint64_t stripe = kMiB) {
    SwapOptions o;
    for (int i = 0; i < npaths; ++i) {
      const fs::path p = root_ / ("drive" + std::to_string(i));
      fs::create_directories(p);
      o.paths.push_back(p.string());
    }
    o.max_file_bytes = cap;
    o.stripe_bytes = stripe;
    o.queue_depth = 8;
    return o;
  }

  // The backend under test, fresh.
  std::shared_ptr<IoBackend> Backend() const {
    if (GetParam() == BackendKind::kUring) return MakeUringBackend();
    return MakeThreadBackend();
  }
  std::shared_ptr<FaultBackend> Faulty() const {
    return std::make_shared<FaultBackend>(GetParam() == BackendKind::kUring ? MakeUringBackend()
                                                                            : MakeThreadBackend());
  }

  std::unique_ptr<SwapSpace> MustCreate(const SwapOptions& o,
                                        std::shared_ptr<IoBackend> backend = nullptr) {
    Result<std::unique_ptr<SwapSpace>> s =
        SwapSpace::Create(o, backend != nullptr ? std::move(backend) : Backend());
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  std::optional<ztier::testing::ScratchDir> scratch_;
  fs::path root_;
};

TEST(Crc32cTest, KnownValueAndHardwareMatchesPortable) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::mt19937_64 rng(FreshSeed());
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{4095}, size_t{12288}, size_t{12289},
                   size_t{40000}, size_t{1 << 20}}) {
    const std::vector<uint8_t> v = RandomBytes(rng, n);
    EXPECT_EQ(Crc32c(v.data(), n), Crc32cPortable(v.data(), n)) << n;
    // Incremental: crc(A|B) from crc(A).
    const size_t cut = n / 3;
    EXPECT_EQ(Crc32c(v.data() + cut, n - cut, Crc32c(v.data(), cut)), Crc32c(v.data(), n)) << n;
  }
}

TEST(ExtentAllocatorTest, FirstFitCoalescesAndReserves) {
  ExtentAllocator a(10);
  auto e1 = a.Allocate(4);
  ASSERT_EQ(e1.size(), 1u);
  EXPECT_EQ(e1[0].start, 0u);
  auto e2 = a.Allocate(4);
  EXPECT_EQ(e2[0].start, 4u);
  EXPECT_TRUE(a.Allocate(3).empty());  // only 2 left
  EXPECT_TRUE(a.Free(0, 4));
  EXPECT_FALSE(a.Free(1, 2)) << "double free must be refused";
  auto e3 = a.Allocate(5);  // 4 free at 0 and 2 at 8: two extents
  ASSERT_EQ(e3.size(), 2u);
  EXPECT_EQ(a.free_units(), 1u);
  EXPECT_TRUE(a.Free(e3[0].start, e3[0].count));
  EXPECT_TRUE(a.Free(e3[1].start, e3[1].count));
  EXPECT_TRUE(a.Free(4, 4));
  EXPECT_FALSE(a.Free(9, 2)) << "out of range";
  EXPECT_EQ(a.free_units(), 10u);
  EXPECT_EQ(a.Allocate(10).size(), 1u);  // coalesced back into one run
  ExtentAllocator b(8);
  EXPECT_TRUE(b.Reserve(2, 3));
  EXPECT_FALSE(b.Reserve(4, 1));  // already used
  EXPECT_EQ(b.free_units(), 5u);
}

TEST(ExtentAllocatorTest, ShrinksOnlyOverAFreeTail) {
  ExtentAllocator a(10);
  auto e = a.Allocate(4);
  a.Grow(16);
  EXPECT_FALSE(a.Shrink(3)) << "units 0-3 are in use";
  EXPECT_FALSE(a.Shrink(17)) << "past the end";
  EXPECT_TRUE(a.Shrink(16));
  EXPECT_TRUE(a.Shrink(6));
  EXPECT_EQ(a.total_units(), 6u);
  EXPECT_EQ(a.free_units(), 2u);
  EXPECT_TRUE(a.Shrink(4)) << "the free run ends where the range starts";
  EXPECT_EQ(a.free_units(), 0u);
  EXPECT_TRUE(a.Allocate(1).empty());
  a.Grow(5);
  EXPECT_EQ(a.Allocate(1)[0].start, 4u);
  EXPECT_FALSE(a.Shrink(4));
}

TEST_P(SwapSpaceTest, RoundTripsRandomSizesAcrossPaths) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (int npaths : {1, 2, 4}) {
    SCOPED_TRACE(StrCat(npaths, " path(s)"));
    std::unique_ptr<SwapSpace> space = MustCreate(Options(npaths, 96 * kMiB / npaths + 8 * kMiB));
    ASSERT_NE(space, nullptr);
    std::vector<uint64_t> sizes = {
        1,        4095,         4096,
        4097,     kMiB - 1,     kMiB,
        kMiB + 1, 3 * kMiB + 5, std::uniform_int_distribution<uint64_t>(1, 8 * kMiB)(rng)};
    if (npaths == 4) sizes.push_back(64 * kMiB);
    int k = 0;
    for (uint64_t size : sizes) {
      SCOPED_TRACE(StrCat("size ", size));
      Result<uint64_t> id = space->Allocate(StrCat("obj", k++), size);
      ASSERT_TRUE(id.ok()) << id.status();
      const std::vector<uint8_t> data = RandomBytes(rng, size);
      for (size_t misalign : {size_t{0}, size_t{3}}) {
        Buffer in(size, misalign);
        std::memcpy(in.data(), data.data(), size);
        ASSERT_TRUE(space->Write(*id, 0, in.data(), size).ok());
        Buffer out(size, misalign == 0 ? 0 : 5);
        Status s = space->Read(*id, 0, out.data(), size);
        ASSERT_TRUE(s.ok()) << s;
        ASSERT_EQ(std::memcmp(out.data(), data.data(), size), 0) << "misalign " << misalign;
      }
      // A few sub-ranges, unaligned.
      for (int r = 0; r < 4; ++r) {
        const uint64_t off = std::uniform_int_distribution<uint64_t>(0, size - 1)(rng);
        const uint64_t len = std::uniform_int_distribution<uint64_t>(1, size - off)(rng);
        std::vector<uint8_t> part(len);
        ASSERT_TRUE(space->Read(*id, off, part.data(), len).ok());
        ASSERT_EQ(std::memcmp(part.data(), data.data() + off, len), 0) << off << "+" << len;
      }
    }
    const SwapStats st = space->stats();
    EXPECT_GT(st.bytes_written, 0u);
    EXPECT_GT(st.bytes_read, 0u);
    ASSERT_TRUE(space->Close().ok());
  }
}

// A space closed gives its disk back at once: an io_uring ring lets go of
// its registered files a while after it is torn down, and the blocks of the
// unlinked file came back only then. A space made at once after, on a
// filesystem with room for one, was refused for lack of space
// (ztier-bench nvme's second round, on a drive its check had let through).
TEST_P(SwapSpaceTest, AClosedSpaceGivesItsDiskBackAtOnce) {
  const fs::path small = root_ / "small";
  ztier::testing::SmallTmpfs tmpfs(small.string(), "24m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a tmpfs: " << tmpfs.error();
  SwapOptions o;
  o.paths = {small.string()};
  o.queue_depth = 8;
  std::vector<uint8_t> data(16 * kMiB, 0x5a);
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(StrCat("round ", round));
    Result<std::unique_ptr<SwapSpace>> space = SwapSpace::Create(o, Backend());
    if (!space.ok() && space.status().message().find("O_DIRECT") != std::string::npos) {
      GTEST_SKIP() << "this kernel's tmpfs takes no O_DIRECT: " << space.status();
    }
    ASSERT_TRUE(space.ok()) << space.status();
    Result<uint64_t> id = (*space)->Allocate("obj", data.size());
    ASSERT_TRUE(id.ok()) << id.status();
    Buffer in(data.size(), 0);
    std::memcpy(in.data(), data.data(), data.size());
    ASSERT_TRUE((*space)->Write(*id, 0, in.data(), data.size()).ok());
    ASSERT_TRUE((*space)->Close().ok());
  }
}

TEST_P(SwapSpaceTest, StripesRoundRobinAcrossPaths) {
  // A 4-unit object on 4 paths puts one unit on each drive: each file sees
  // exactly one unit's worth of data.
  std::unique_ptr<SwapSpace> space = MustCreate(Options(4, 4 * kMiB, kMiB));
  ASSERT_NE(space, nullptr);
  Result<uint64_t> id = space->Allocate("x", 4 * kMiB);
  ASSERT_TRUE(id.ok());
  std::vector<uint8_t> data(4 * kMiB);
  for (size_t u = 0; u < 4; ++u)
    std::memset(data.data() + u * kMiB, static_cast<int>(0xa0 + u), kMiB);
  ASSERT_TRUE(space->Write(*id, 0, data.data(), data.size()).ok());
  ASSERT_TRUE(space->Sync().ok());
  int seen = 0;
  for (const std::string& p : space->options().paths) {
    std::ifstream f(fs::path(p) / "ztier.swap", std::ios::binary);
    std::vector<char> file((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    int units_here = 0;
    for (size_t u = 0; u < 4; ++u) {
      for (size_t off = 0; off + kMiB <= file.size(); off += kMiB) {
        if (static_cast<uint8_t>(file[off]) == 0xa0 + u &&
            static_cast<uint8_t>(file[off + kMiB - 1]) == 0xa0 + u) {
          ++units_here;
        }
      }
    }
    EXPECT_EQ(units_here, 1) << p;
    seen += units_here;
    struct stat st {};
    ASSERT_EQ(::stat((fs::path(p) / "ztier.swap").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << "swap file mode";
  }
  EXPECT_EQ(seen, 4);
}

TEST_P(SwapSpaceTest, ConcurrentSubmitters) {
  std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 64 * kMiB, 256 * kKiB));
  ASSERT_NE(space, nullptr);
  const uint64_t seed = FreshSeed();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      for (int i = 0; i < 12; ++i) {
        const uint64_t size = std::uniform_int_distribution<uint64_t>(1, 3 * kMiB)(rng);
        Result<uint64_t> id = space->Allocate(StrCat("t", t, "_", i), size);
        if (!id.ok()) {
          ++failures;
          continue;
        }
        const std::vector<uint8_t> data = RandomBytes(rng, size);
        std::vector<uint8_t> back(size);
        // Asynchronous submission; several requests of this thread in flight.
        IoTicket w =
            space->Submit(IoDirection::kWrite,
                          std::vector<IoRange>{{*id, 0, size, const_cast<uint8_t*>(data.data())}});
        if (!w.Wait().ok()) {
          ++failures;
          continue;
        }
        IoTicket r =
            space->Submit(IoDirection::kRead, std::vector<IoRange>{{*id, 0, size, back.data()}});
        if (!r.Wait().ok() || back != data) ++failures;
        if (i % 3 == 0 && !space->Free(*id).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << "seed " << seed;
}

TEST_P(SwapSpaceTest, CallbackRunsOnCompletion) {
  std::unique_ptr<SwapSpace> space = MustCreate(Options(1, 8 * kMiB));
  ASSERT_NE(space, nullptr);
  Result<uint64_t> id = space->Allocate("cb", 2 * kMiB);
  ASSERT_TRUE(id.ok());
  std::vector<uint8_t> data(2 * kMiB, 7);
  std::atomic<int> calls{0};
  Status seen = Status::Internal("not called");
  std::mutex mu;
  IoTicket t =
      space->Submit(IoDirection::kWrite, std::vector<IoRange>{{*id, 0, data.size(), data.data()}},
                    [&](const Status& s) {
                      std::lock_guard<std::mutex> lock(mu);
                      seen = s;
                      ++calls;
                    });
  ASSERT_TRUE(t.Wait().ok());
  EXPECT_TRUE(t.Done());
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(seen.ok());
}

TEST_P(SwapSpaceTest, CompletionEventfdCountsRequests) {
  std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 8 * kMiB));
  ASSERT_NE(space, nullptr);
  const int efd = space->completion_fd();
  ASSERT_GE(efd, 0);
  Result<uint64_t> id = space->Allocate("ev", 3 * kMiB);
  ASSERT_TRUE(id.ok());
  std::vector<uint8_t> data(3 * kMiB, 9), back(3 * kMiB), front(kMiB);
  std::vector<IoTicket> tickets;
  tickets.push_back(
      space->Submit(IoDirection::kWrite, std::vector<IoRange>{{*id, 0, data.size(), data.data()}}));
  ASSERT_TRUE(tickets.back().Wait().ok());
  tickets.push_back(
      space->Submit(IoDirection::kRead, std::vector<IoRange>{{*id, 0, back.size(), back.data()}}));
  tickets.push_back(
      space->Submit(IoDirection::kRead, std::vector<IoRange>{{*id, 0, kMiB, front.data()}}));
  uint64_t seen = 0;
  bool silent = false;  // (the reads are waited for before the buffers go, either way)
  while (seen < 3 && !silent) {
    pollfd p{efd, POLLIN, 0};
    silent = ::poll(&p, 1, 10000) != 1;
    uint64_t n = 0;
    if (!silent) silent = ::read(efd, &n, sizeof(n)) != static_cast<ssize_t>(sizeof(n));
    seen += n;
  }
  EXPECT_FALSE(silent) << "no completion event within 10 s";
  for (IoTicket& t : tickets) (void)t.Wait();
  EXPECT_EQ(seen, 3u);
  for (const IoTicket& t : tickets) EXPECT_TRUE(t.Done());
}

TEST_P(SwapSpaceTest, RejectsBadRangesAndUnalignedWrites) {
  std::unique_ptr<SwapSpace> space = MustCreate(Options(1, 8 * kMiB));
  ASSERT_NE(space, nullptr);
  Result<uint64_t> id = space->Allocate("r", 3 * kMiB + 10);
  ASSERT_TRUE(id.ok());
  std::vector<uint8_t> buf(4 * kMiB);
  EXPECT_EQ(space->Read(*id, 3 * kMiB, buf.data(), 11).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(space->Read(999, 0, buf.data(), 1).code(), StatusCode::kNotFound);
  Status unaligned = space->Write(*id, 100, buf.data(), kMiB);
  EXPECT_EQ(unaligned.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unaligned.message().find("whole stripe units"), std::string::npos) << unaligned;
  // Whole units and the tail are fine; never-written bytes read as zeros.
  EXPECT_TRUE(space->Write(*id, 3 * kMiB, buf.data(), 10).ok());
  std::vector<uint8_t> z(kMiB, 0xff);
  ASSERT_TRUE(space->Read(*id, kMiB, z.data(), kMiB).ok());
  EXPECT_EQ(z, std::vector<uint8_t>(kMiB, 0));
  EXPECT_EQ(space->Allocate("r", 1).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(space->Allocate("zero", 0).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(SwapSpaceTest, FreeAndReuseAndOutOfSpaceKeepsObjects) {
  std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 8 * kMiB));
  ASSERT_NE(space, nullptr);
  std::mt19937_64 rng(FreshSeed());
  std::vector<uint64_t> ids;
  std::vector<std::vector<uint8_t>> datas;
  for (int i = 0; i < 4; ++i) {
    Result<uint64_t> id = space->Allocate(StrCat("o", i), 4 * kMiB);
    ASSERT_TRUE(id.ok()) << id.status();
    datas.push_back(RandomBytes(rng, 4 * kMiB));
    ASSERT_TRUE(space->Write(*id, 0, datas.back().data(), 4 * kMiB).ok());
    ids.push_back(*id);
  }
  EXPECT_EQ(space->free_bytes(), 0u);
  Result<uint64_t> full = space->Allocate("too-much", 1);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find(space->options().paths[0]), std::string::npos)
      << full.status();
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<uint8_t> back(4 * kMiB);
    ASSERT_TRUE(space->Read(ids[i], 0, back.data(), back.size()).ok());
    EXPECT_EQ(back, datas[i]) << "object " << i << " changed after out-of-space";
  }
  ASSERT_TRUE(space->Free(ids[1]).ok());
  EXPECT_EQ(space->Free(ids[1]).code(), StatusCode::kNotFound);
  EXPECT_EQ(space->free_bytes(), 4 * kMiB);
  Result<uint64_t> again = space->Allocate("again", 4 * kMiB);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<uint8_t> d = RandomBytes(rng, 4 * kMiB);
  ASSERT_TRUE(space->Write(*again, 0, d.data(), d.size()).ok());
  for (size_t i : {size_t{0}, size_t{2}, size_t{3}}) {
    std::vector<uint8_t> back(4 * kMiB);
    ASSERT_TRUE(space->Read(ids[i], 0, back.data(), back.size()).ok());
    EXPECT_EQ(back, datas[i]);
  }
}

// ---- faults ----

class SwapFaultTest : public SwapSpaceTest {
 protected:
  void SetUp() override {
    SwapSpaceTest::SetUp();
    if (IsSkipped()) return;
    fault_ = Faulty();
    space_ = MustCreate(Options(2, 16 * kMiB, 256 * kKiB), fault_);
    ASSERT_NE(space_, nullptr);
    std::mt19937_64 rng(FreshSeed());
    // An object written before any fault, to show it is never touched.
    Result<uint64_t> keep = space_->Allocate("keep", 2 * kMiB + 123);
    ASSERT_TRUE(keep.ok());
    keep_ = *keep;
    keep_data_ = RandomBytes(rng, 2 * kMiB + 123);
    ASSERT_TRUE(space_->Write(keep_, 0, keep_data_.data(), keep_data_.size()).ok());
    Result<uint64_t> id = space_->Allocate("victim", kMiB);
    ASSERT_TRUE(id.ok());
    victim_ = *id;
    data_ = RandomBytes(rng, kMiB);
  }

  void ExpectKeepIntact() {
    fault_->Reset();
    std::vector<uint8_t> back(keep_data_.size());
    ASSERT_TRUE(space_->Read(keep_, 0, back.data(), back.size()).ok());
    EXPECT_EQ(back, keep_data_) << "an unrelated object changed";
  }

  std::shared_ptr<FaultBackend> fault_;
  std::unique_ptr<SwapSpace> space_;
  uint64_t keep_ = 0, victim_ = 0;
  std::vector<uint8_t> keep_data_, data_;
};

TEST_P(SwapFaultTest, WriteEioFailsNamesPathAndLosesNothingSilently) {
  fault_->FailNth(IoKind::kWrite, 2, EIO);
  Status s = space_->Write(victim_, 0, data_.data(), data_.size());
  ASSERT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_NE(s.message().find("ztier.swap at offset"), std::string::npos) << s;
  // The failed unit reads back as an error, never as stale bytes.
  std::vector<uint8_t> back(kMiB);
  Status r = space_->Read(victim_, 0, back.data(), back.size());
  EXPECT_EQ(r.code(), StatusCode::kIoError) << r;
  EXPECT_NE(r.message().find("last write failed"), std::string::npos) << r;
  // Rewriting heals it.
  ASSERT_TRUE(space_->Write(victim_, 0, data_.data(), data_.size()).ok());
  ASSERT_TRUE(space_->Read(victim_, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data_);
  ExpectKeepIntact();
}

// A path whose writes fail (gone read-only) says so in the operator's view
// (ztierd's status, ztierctl status) while its reads still work; the
// first write it takes again clears it.
TEST_P(SwapFaultTest, APathWhoseWritesFailSaysSoUntilOneSucceeds) {
  for (const SwapSpace::PathUsage& u : space_->path_usage()) EXPECT_EQ(u.problem, "") << u.path;
  fault_->FailFrom(IoKind::kWrite, 1, EROFS);
  ASSERT_FALSE(space_->Write(victim_, 0, data_.data(), data_.size()).ok());
  ExpectKeepIntact();  // reads work, and do not clear it
  for (const SwapSpace::PathUsage& u : space_->path_usage()) {
    EXPECT_EQ(u.problem, StrCat("its last write failed: ", std::strerror(EROFS))) << u.path;
    EXPECT_EQ(u.waiting, 0u) << u.path;
  }
  fault_->Reset();
  ASSERT_TRUE(space_->Write(victim_, 0, data_.data(), data_.size()).ok());
  for (const SwapSpace::PathUsage& u : space_->path_usage()) EXPECT_EQ(u.problem, "") << u.path;
}

TEST_P(SwapFaultTest, DirectIoRefusedAtTheFirstWriteSaysSo) {
  // A filesystem that takes O_DIRECT at open and refuses it at I/O, found
  // only at a write when the probe at the start met a full disk.
  fault_->FailNth(IoKind::kWrite, 1, EINVAL);
  Status s = space_->Write(victim_, 0, data_.data(), data_.size());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.sys_errno(), EINVAL) << s;
  EXPECT_NE(s.message().find("refuses O_DIRECT I/O"), std::string::npos) << s;
  EXPECT_NE(s.message().find("ztier.swap at offset"), std::string::npos) << s;
  ExpectKeepIntact();
}

TEST_P(SwapFaultTest, ReadEioFailsThenRecovers) {
  ASSERT_TRUE(space_->Write(victim_, 0, data_.data(), data_.size()).ok());
  fault_->FailNth(IoKind::kRead, 1, EIO);
  std::vector<uint8_t> back(kMiB);
  Status s = space_->Read(victim_, 0, back.data(), back.size());
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  ASSERT_TRUE(space_->Read(victim_, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data_);
  ExpectKeepIntact();
}

TEST_P(SwapFaultTest, ShortTransfersAndEagainAreResubmitted) {
  fault_->ShortNth(IoKind::kWrite, 1);
  fault_->ShortNth(IoKind::kWrite, 3);
  fault_->FailNth(IoKind::kWrite, 2, EAGAIN);
  ASSERT_TRUE(space_->Write(victim_, 0, data_.data(), data_.size()).ok());
  fault_->ShortNth(IoKind::kRead, 1);
  fault_->FailNth(IoKind::kRead, 2, EINTR);
  std::vector<uint8_t> back(kMiB);
  Status s = space_->Read(victim_, 0, back.data(), back.size());
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(back, data_);
  EXPECT_GE(space_->stats().retries, 5u);
  ExpectKeepIntact();
}

TEST_P(SwapFaultTest, FullDiskIsResourceExhausted) {
  fault_->FailFrom(IoKind::kWrite, 1, ENOSPC);
  Status s = space_->Write(victim_, 0, data_.data(), data_.size());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  ExpectKeepIntact();
}

// Units freed and given back to the drive, which then fills: an object
// that would reuse them is refused up front, naming the path, rather
// than failing a write mid-step; nothing leaks, and the space takes the
// object once the drive has room.
// The refusal gives back what the failed fallocate took (ext4's keeps the
// blocks it got before running out): it left the drive fuller, at worst
// full, for whatever else is there.
TEST_P(SwapFaultTest, ReusingFreedUnitsOnAFullDriveIsRefusedUpFront) {
  ASSERT_TRUE(space_->Free(victim_).ok());
  const uint64_t size = space_->file_bytes();
  auto held = [&] {
    uint64_t bytes = 0;
    for (const SwapSpace::PathUsage& u : space_->path_usage()) bytes += u.file_bytes;
    return bytes;
  };
  const uint64_t before = held();
  fault_->FailPreallocate(ENOSPC, 1, /*partial=*/true);
  Result<uint64_t> id = space_->Allocate("again", kMiB);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kResourceExhausted) << id.status();
  EXPECT_NE(id.status().message().find("out of space: reserving"), std::string::npos)
      << id.status();
  EXPECT_FALSE(space_->Find("again").ok());
  EXPECT_EQ(held(), before) << "the refusal kept blocks of the drive";
  fault_->Reset();
  id = space_->Allocate("again", kMiB);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(space_->file_bytes(), size) << "the units were not given back";
  ASSERT_TRUE(space_->Write(*id, 0, data_.data(), data_.size()).ok());
  std::vector<uint8_t> back(data_.size());
  ASSERT_TRUE(space_->Read(*id, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data_);
  ExpectKeepIntact();
}

TEST_P(SwapFaultTest, BitFlipIsCorruption) {
  ASSERT_TRUE(space_->Write(victim_, 0, data_.data(), data_.size()).ok());
  fault_->FlipBitOnNthRead(1);
  std::vector<uint8_t> back(kMiB);
  Status s = space_->Read(victim_, 0, back.data(), back.size());
  ASSERT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find("object " + std::to_string(victim_)), std::string::npos) << s;
  EXPECT_NE(s.message().find("ztier.swap"), std::string::npos) << s;
  ASSERT_TRUE(space_->Read(victim_, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data_);
  // The path says so, after the good read too: a drive that gave back
  // other bytes once is not trusted again.
  int bad_paths = 0;
  for (const SwapSpace::PathUsage& u : space_->path_usage()) {
    if (u.problem.empty()) continue;
    ++bad_paths;
    EXPECT_NE(u.problem.find("1 read(s) gave back bytes that did not match their checksum"),
              std::string::npos)
        << u.problem;
  }
  EXPECT_EQ(bad_paths, 1);
  ExpectKeepIntact();
}

TEST_P(SwapFaultTest, FsyncFailureIsFatal) {
  fault_->FailNth(IoKind::kFsync, 1, EIO);
  Status s = space_->Sync();
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_NE(s.message().find("fdatasync"), std::string::npos) << s;
  fault_->Reset();
  EXPECT_EQ(space_->Sync().code(), StatusCode::kFailedPrecondition);
  Status w = space_->Write(victim_, 0, data_.data(), data_.size());
  EXPECT_EQ(w.code(), StatusCode::kFailedPrecondition) << w;
  EXPECT_EQ(space_->Allocate("new", 1).status().code(), StatusCode::kFailedPrecondition);
}

// A submit that fails for good (io_uring_enter refused by a seccomp filter
// after the ring was set up) left the pieces already in the ring waiting
// for ever: the write hung, and the I/O thread logged the error a thousand
// times a second. Those pieces now fail with it, once the failure has
// lasted; the space is failed, and closes.
TEST_P(SwapFaultTest, ASubmitThatFailsForGoodFailsTheRequestInsteadOfHanging) {
  fault_->FailSubmits(EPERM);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = space_->Write(victim_, 0, data_.data(), data_.size());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("io_uring_enter"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  fault_->FailSubmits(0);
  // The ring is not entered again: the space is failed, and says why.
  Status again = space_->Write(victim_, 0, data_.data(), data_.size());
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("io_uring_enter"), std::string::npos) << again;
  (void)space_->Close();  // returns: nothing is left in flight (a hang times the test out)
}

// ---- manifests ----

TEST_P(SwapSpaceTest, ManifestRoundTripRestoresEveryObject) {
  SwapOptions o = Options(3, 16 * kMiB, 512 * kKiB);
  o.keep_files = true;
  std::mt19937_64 rng(FreshSeed());
  std::vector<std::pair<std::string, std::vector<uint8_t>>> objects;
  const std::string manifest = (root_ / "swap.manifest").string();
  uint64_t free_before = 0;
  {
    std::unique_ptr<SwapSpace> space = MustCreate(o);
    ASSERT_NE(space, nullptr);
    for (int i = 0; i < 6; ++i) {
      const uint64_t size = std::uniform_int_distribution<uint64_t>(1, 5 * kMiB)(rng);
      Result<uint64_t> id = space->Allocate(StrCat("unit", i), size);
      ASSERT_TRUE(id.ok());
      objects.emplace_back(StrCat("unit", i), RandomBytes(rng, size));
      ASSERT_TRUE(space->Write(*id, 0, objects.back().second.data(), size).ok());
    }
    ASSERT_TRUE(space->Free(space->Find("unit2")->id).ok());
    objects.erase(objects.begin() + 2);
    free_before = space->free_bytes();
    ASSERT_TRUE(space->SaveManifest(manifest).ok());
    ASSERT_TRUE(space->Close().ok());
  }
  Result<std::unique_ptr<SwapSpace>> reopened = SwapSpace::Open(manifest, 8, Backend());
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  SwapSpace& space = **reopened;
  EXPECT_EQ(space.Objects().size(), objects.size());
  EXPECT_EQ(space.free_bytes(), free_before);
  for (const auto& [name, data] : objects) {
    Result<ObjectInfo> info = space.Find(name);
    ASSERT_TRUE(info.ok()) << name;
    ASSERT_EQ(info->size, data.size());
    std::vector<uint8_t> back(data.size());
    ASSERT_TRUE(space.Read(info->id, 0, back.data(), back.size()).ok()) << name;
    EXPECT_EQ(back, data) << name;
  }
  // New allocations do not overlap restored objects.
  Result<uint64_t> extra = space.Allocate("extra", 2 * kMiB);
  ASSERT_TRUE(extra.ok());
  std::vector<uint8_t> junk(2 * kMiB, 0x5a);
  ASSERT_TRUE(space.Write(*extra, 0, junk.data(), junk.size()).ok());
  for (const auto& [name, data] : objects) {
    std::vector<uint8_t> back(data.size());
    ASSERT_TRUE(space.Read(space.Find(name)->id, 0, back.data(), back.size()).ok());
    EXPECT_EQ(back, data) << name;
  }
}

TEST_P(SwapSpaceTest, DamagedManifestsAreRejectedClearly) {
  const std::string manifest = (root_ / "swap.manifest").string();
  {
    std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 8 * kMiB));
    ASSERT_NE(space, nullptr);
    Result<uint64_t> id = space->Allocate("a", 3 * kMiB);
    ASSERT_TRUE(id.ok());
    std::vector<uint8_t> d(3 * kMiB, 1);
    ASSERT_TRUE(space->Write(*id, 0, d.data(), d.size()).ok());
    ASSERT_TRUE(space->SaveManifest(manifest).ok());
  }
  std::string good;
  {
    std::ifstream in(manifest, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto try_open = [&](const std::string& bytes) {
    const std::string path = (root_ / "bad.manifest").string();
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return SwapSpace::Open(path, 8, Backend()).status();
  };
  struct Case {
    const char* what;
    std::string bytes;
    const char* message;
  };
  std::string flipped_payload = good;
  flipped_payload[good.size() - 3] ^= 0x01;
  std::string flipped_header = good;
  flipped_header[17] ^= 0x40;
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  const Case cases[] = {
      {"empty", "", "truncated"},
      {"half a header", good.substr(0, 30), "truncated"},
      {"truncated payload", good.substr(0, good.size() - 10), "payload is"},
      {"flipped payload bit", flipped_payload, "payload checksum mismatch"},
      {"flipped header bit", flipped_header, "header checksum mismatch"},
      {"bad magic", bad_magic, "bad magic"},
  };
  for (const Case& c : cases) {
    Status s = try_open(c.bytes);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << c.what << ": " << s;
  }
  // Random garbage of every length never crashes and never opens.
  std::mt19937_64 rng(FreshSeed());
  for (size_t cut = 0; cut < good.size(); cut += 7) {
    std::string mangled = good.substr(0, cut);
    EXPECT_FALSE(try_open(mangled).ok()) << "cut " << cut;
  }
  EXPECT_EQ(SwapSpace::Open((root_ / "missing").string(), 8, Backend()).status().code(),
            StatusCode::kNotFound);

  // Mutations behind valid checksums reach the parser itself: it must reject
  // them (or accept a still-consistent table) without crashing or reading
  // out of bounds (ASan runs this in CI).
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("seed ", seed));
  std::mt19937_64 mut(seed);
  int rejected = 0;
  for (int iter = 0; iter < 300; ++iter) {
    std::string m = good;
    const int flips = 1 + static_cast<int>(mut() % 6);
    for (int f = 0; f < flips; ++f) {
      const size_t at = 64 + mut() % (good.size() - 64);
      m[at] = static_cast<char>(mut() % 4 == 0 ? 0xff : m[at] ^ (1 << (mut() % 8)));
    }
    const uint64_t size = m.size() - 64;
    const uint32_t payload_crc = Crc32c(m.data() + 64, size);
    std::memcpy(m.data() + 24, &payload_crc, 4);
    const uint32_t header_crc = Crc32c(m.data(), 60);
    std::memcpy(m.data() + 60, &header_crc, 4);
    if (!try_open(m).ok()) ++rejected;
  }
  EXPECT_GT(rejected, 0);
}

// ---- rejected paths ----

TEST_P(SwapSpaceTest, RejectsMissingFullAndNonDirectPaths) {
  SwapOptions o = Options(1, 8 * kMiB);
  o.paths.push_back((root_ / "does-not-exist").string());
  Status missing = SwapSpace::Create(o, Backend()).status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find("does-not-exist"), std::string::npos) << missing;

  {  // No cap: a petabyte object finds the disk full, and says how full.
    std::unique_ptr<SwapSpace> space = MustCreate(Options(1, 0));
    ASSERT_NE(space, nullptr);
    Result<uint64_t> huge = space->Allocate("petabyte", uint64_t{1} << 50);
    ASSERT_FALSE(huge.ok());
    EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status();
    EXPECT_NE(huge.status().message().find("bytes free"), std::string::npos) << huge.status();
    EXPECT_NE(huge.status().message().find(space->options().paths[0]), std::string::npos)
        << huge.status();
    EXPECT_TRUE(space->Allocate("small", kMiB).ok());
  }

  std::shared_ptr<FaultBackend> fault = Faulty();
  fault->RefuseDirectIo();
  const SwapOptions refused = Options(1, 8 * kMiB);
  Status direct = SwapSpace::Create(refused, fault).status();
  EXPECT_EQ(direct.code(), StatusCode::kFailedPrecondition) << direct;
  EXPECT_NE(direct.message().find("does not support O_DIRECT"), std::string::npos) << direct;
  // The refused open made the file (as ramfs does); it is not left behind.
  EXPECT_FALSE(fs::exists(fs::path(refused.paths[0]) / refused.file_name));

  SwapOptions bad_stripe = Options(1, 8 * kMiB, 1000);
  EXPECT_EQ(SwapSpace::Create(bad_stripe, Backend()).status().code(), StatusCode::kInvalidArgument);
  SwapOptions bad_name = Options(1, 0);
  bad_name.file_name = "..";
  EXPECT_EQ(SwapSpace::Create(bad_name, Backend()).status().code(), StatusCode::kInvalidArgument);
}

// A swap path on tmpfs: refused where the kernel gives tmpfs no O_DIRECT;
// where it does, the space works and says that its swap is memory the DRAM
// budget does not count (it said nothing).
TEST_P(SwapSpaceTest, TmpfsIsRefusedWithoutDirectIoAndSaidToBeMemory) {
  const fs::path shm = "/dev/shm";
  if (!fs::is_directory(shm)) GTEST_SKIP() << "no /dev/shm on this machine";
  const fs::path dir = shm / ("ztier-test-" + std::to_string(getpid()));
  fs::create_directories(dir);
  SwapOptions o;
  o.paths = {dir.string()};
  o.max_file_bytes = 4 * kMiB;
  ::testing::internal::CaptureStderr();
  Result<std::unique_ptr<SwapSpace>> s = SwapSpace::Create(o, Backend());
  const std::string said = ::testing::internal::GetCapturedStderr();
  if (!s.ok()) {
    EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status();
    EXPECT_NE(s.status().message().find("O_DIRECT"), std::string::npos) << s.status();
  } else {
    EXPECT_NE(said.find("is on tmpfs, which is memory"), std::string::npos) << said;
  }
  s = Status::Aborted("drop");
  fs::remove_all(dir);
}

// Close racing the I/O calls: a Submit or Sync that passed its check as
// Close began queued its pieces to threads that had stopped, and waited
// for ever. Every call now ends, done or refused as closed.
TEST_P(SwapSpaceTest, CloseRacingSubmitAndSyncLeavesNoCallWaiting) {
  // The window is narrow: a stress over rounds that close at staggered times.
  for (int round = 0; round < 60; ++round) {
    std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 0));
    ASSERT_NE(space, nullptr);
    std::vector<uint64_t> ids;  // one object per thread: each writes it, reads it, syncs
    for (int t = 0; t < 4; ++t) {
      Result<uint64_t> id = space->Allocate(StrCat("obj", t), 2 * kMiB);
      ASSERT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    }
    std::atomic<int> finished{0};
    std::mutex mu;
    std::string bad;  // the first failure that is not "closed"
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t) {
      callers.emplace_back([&, t] {
        std::vector<uint8_t> buf(2 * kMiB, static_cast<uint8_t>(t));
        for (int i = 0; i < 300; ++i) {
          const Status s = i % 3 == 0   ? space->Write(ids[t], 0, buf.data(), buf.size())
                           : i % 3 == 1 ? space->Read(ids[t], 0, buf.data(), buf.size())
                                        : space->Sync();
          if (!s.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            if (s.code() != StatusCode::kFailedPrecondition && bad.empty()) bad = s.ToString();
            break;
          }
        }
        ++finished;
      });
    }
    std::this_thread::sleep_for(std::chrono::microseconds(97 * round));
    EXPECT_TRUE(space->Close().ok());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (finished.load() < 4 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (finished.load() < 4) {
      ADD_FAILURE() << "round " << round << ": " << 4 - finished.load()
                    << " call(s) still wait after Close";
      std::_Exit(1);  // their threads cannot be joined
    }
    for (std::thread& c : callers) c.join();
    EXPECT_EQ(bad, "") << "round " << round;
  }
}

// ---- ownership and size ----

TEST_P(SwapSpaceTest, ASecondSwapSpaceOnAPathIsRefusedAndTheFirstKeepsItsData) {
  SwapOptions o = Options(2, 0);
  std::unique_ptr<SwapSpace> first = MustCreate(o);
  ASSERT_NE(first, nullptr);
  Result<uint64_t> id = first->Allocate("mine", 3 * kMiB);
  ASSERT_TRUE(id.ok());
  std::vector<uint8_t> data(3 * kMiB, 0x3c), back(3 * kMiB);
  ASSERT_TRUE(first->Write(*id, 0, data.data(), data.size()).ok());
  // Another space naming one of the same paths (the other path is new).
  SwapOptions other = Options(1, 0);
  other.paths = {(root_ / "elsewhere").string(), o.paths[1]};
  fs::create_directories(other.paths[0]);
  Result<std::unique_ptr<SwapSpace>> second = SwapSpace::Create(other, Backend());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find(o.paths[1]), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find(StrCat("pid ", ::getpid())), std::string::npos)
      << second.status();
  ASSERT_TRUE(first->Read(*id, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data) << "the refused space touched the first one's file";
  ASSERT_TRUE(first->Close().ok());
  EXPECT_TRUE(SwapSpace::Create(other, Backend()).ok()) << "the lock outlived Close()";
}

// One directory named twice, spelled otherwise ("d/", "./d", a link to
// it), is said to be listed twice (it was taken for another process's
// swap space holding it).
TEST_P(SwapSpaceTest, ADirectoryListedTwiceInOtherSpellingsIsNamed) {
  const std::string d = (root_ / "d").string();
  fs::create_directories(d);
  fs::create_directory_symlink(d, root_ / "link");
  for (const std::string& again :
       {d + "/", (root_ / "." / "d").string(), (root_ / "link").string()}) {
    SwapOptions o = Options(1, 0);
    o.paths = {d, again};
    Result<std::unique_ptr<SwapSpace>> s = SwapSpace::Create(o, Backend());
    ASSERT_FALSE(s.ok()) << again;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("listed twice (also as " + again), std::string::npos)
        << s.status();
  }
}

TEST_P(SwapSpaceTest, APlantedLinkOrForeignFileIsRefusedAndLeftAlone) {
  // Whoever may write into a swap directory could plant the swap file's
  // name as a link to a file of someone else's: it is refused, never
  // emptied or written through.
  SwapOptions o = Options(1, 0);
  const fs::path victim = root_ / "victim";
  const std::string precious = "precious data of someone else's";
  std::ofstream(victim) << precious;
  const fs::path swap_file = fs::path(o.paths[0]) / o.file_name;
  const auto victim_intact = [&] {
    std::ifstream in(victim);
    return std::string(std::istreambuf_iterator<char>(in), {}) == precious;
  };

  fs::create_symlink(victim, swap_file);
  Status linked = SwapSpace::Create(o, Backend()).status();
  EXPECT_EQ(linked.code(), StatusCode::kFailedPrecondition) << linked;
  EXPECT_NE(linked.message().find("symbolic link"), std::string::npos) << linked;
  EXPECT_TRUE(victim_intact());
  fs::remove(swap_file);

  fs::create_hard_link(victim, swap_file);
  Status hard = SwapSpace::Create(o, Backend()).status();
  EXPECT_EQ(hard.code(), StatusCode::kFailedPrecondition) << hard;
  EXPECT_NE(hard.message().find("2 links"), std::string::npos) << hard;
  EXPECT_TRUE(victim_intact());
  // The message says "remove it": the refused name is left for its owner.
  EXPECT_TRUE(fs::exists(swap_file)) << "a refused swap file was removed";
  fs::remove(swap_file);

  // A stale swap file of this user's (a killed run's) is taken over.
  std::ofstream(swap_file) << "stale";
  std::unique_ptr<SwapSpace> space = MustCreate(o);
  ASSERT_NE(space, nullptr);
  EXPECT_TRUE(space->Allocate("fresh", kMiB).ok());
}

TEST_P(SwapSpaceTest, FilesGrowWithTheirObjectsAndGoAwayOnClose) {
  SwapOptions o = Options(2, 0, 256 * kKiB);
  o.growth_bytes = kMiB;
  const std::string file0 = (fs::path(o.paths[0]) / o.file_name).string();
  // What a dead owner left behind is discarded, not counted.
  std::ofstream(file0, std::ios::binary) << std::string(3 * kMiB, 'x');
  std::unique_ptr<SwapSpace> space = MustCreate(o);
  ASSERT_NE(space, nullptr);
  EXPECT_EQ(space->file_bytes(), 0u);
  EXPECT_EQ(fs::file_size(file0), 0u);
  std::mt19937_64 rng(FreshSeed());
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> objects;
  uint64_t total = 0;
  for (int i = 0; i < 12; ++i) {
    const uint64_t size = std::uniform_int_distribution<uint64_t>(1, 3 * kMiB)(rng);
    Result<uint64_t> id = space->Allocate(StrCat("o", i), size);
    ASSERT_TRUE(id.ok()) << id.status();
    objects.emplace_back(*id, RandomBytes(rng, size));
    ASSERT_TRUE(space->Write(*id, 0, objects.back().second.data(), size).ok());
    total += size;
    // Every file is as large as the space says, and holds what was stored.
    for (const std::string& p : o.paths) {
      EXPECT_EQ(fs::file_size(fs::path(p) / o.file_name), space->file_bytes() / 2);
    }
  }
  EXPECT_GE(space->file_bytes(), total);
  EXPECT_LE(space->file_bytes(), 2 * (total + 3 * kMiB)) << "files grew far past their objects";
  for (const auto& [id, data] : objects) {
    std::vector<uint8_t> back(data.size());
    ASSERT_TRUE(space->Read(id, 0, back.data(), back.size()).ok());
    EXPECT_EQ(back, data);
  }
  // The last object freed, the files give their room back (they kept it
  // until the space closed: a job refused halfway left them grown).
  for (size_t i = 0; i < objects.size(); ++i) {
    ASSERT_TRUE(space->Free(objects[i].first).ok());
    if (i + 1 < objects.size()) {
      EXPECT_GT(space->file_bytes(), 0u);
    }
  }
  EXPECT_EQ(space->file_bytes(), 0u);
  for (const std::string& p : o.paths) {
    EXPECT_EQ(fs::file_size(fs::path(p) / o.file_name), 0u);
  }
  Result<uint64_t> again = space->Allocate("again", 2 * kMiB);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<uint8_t> data = RandomBytes(rng, 2 * kMiB);
  std::vector<uint8_t> back(data.size());
  ASSERT_TRUE(space->Write(*again, 0, data.data(), data.size()).ok());
  ASSERT_TRUE(space->Read(*again, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  ASSERT_TRUE(space->Close().ok());
  for (const std::string& p : o.paths) {
    EXPECT_FALSE(fs::exists(fs::path(p) / o.file_name)) << "swap file left after Close";
    EXPECT_FALSE(fs::exists(fs::path(p) / "ztier-swap.lock")) << "lock file left after Close";
    EXPECT_TRUE(fs::is_directory(p)) << "the user's directory must stay";
  }
}

// The blocks the swap files hold on their drives (what `du` counts).
uint64_t BlocksHeld(const SwapOptions& o) {
  uint64_t bytes = 0;
  for (const std::string& p : o.paths) {
    struct stat st {};
    if (::stat((fs::path(p) / o.file_name).c_str(), &st) == 0)
      bytes += uint64_t(st.st_blocks) * 512;
  }
  return bytes;
}

// A freed object gives its blocks back to the drives while other objects
// stay (a job that leaves a shared ztierd), the files keeping their size;
// an object that gets those units again has them reserved before any
// write, and every object reads back what was written.
TEST_P(SwapSpaceTest, AFreedObjectGivesItsBlocksBackWhileOthersStay) {
  SwapOptions o = Options(2, 0, 256 * kKiB);
  o.growth_bytes = kMiB;
  std::unique_ptr<SwapSpace> space = MustCreate(o);
  ASSERT_NE(space, nullptr);
  std::mt19937_64 rng(FreshSeed());
  Result<uint64_t> big = space->Allocate("big", 16 * kMiB);
  Result<uint64_t> stays = space->Allocate("stays", 2 * kMiB + 5);
  ASSERT_TRUE(big.ok() && stays.ok());
  const std::vector<uint8_t> big_data = RandomBytes(rng, 16 * kMiB);
  const std::vector<uint8_t> stays_data = RandomBytes(rng, 2 * kMiB + 5);
  ASSERT_TRUE(space->Write(*big, 0, big_data.data(), big_data.size()).ok());
  ASSERT_TRUE(space->Write(*stays, 0, stays_data.data(), stays_data.size()).ok());
  const uint64_t size = space->file_bytes();
  const uint64_t held = BlocksHeld(o);
  ASSERT_GE(held, 18 * kMiB);
  ASSERT_TRUE(space->Free(*big).ok());
  EXPECT_EQ(space->file_bytes(), size);
  EXPECT_LE(BlocksHeld(o), held - 16 * kMiB) << "the freed object's blocks are still held";
  std::vector<uint8_t> back(stays_data.size());
  ASSERT_TRUE(space->Read(*stays, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, stays_data);
  // The same units again: reserved at once, then written and read.
  Result<uint64_t> again = space->Allocate("again", 16 * kMiB);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(space->file_bytes(), size) << "the freed units were not reused";
  EXPECT_GE(BlocksHeld(o), held) << "the reused units are not reserved";
  const std::vector<uint8_t> again_data = RandomBytes(rng, 16 * kMiB);
  ASSERT_TRUE(space->Write(*again, 0, again_data.data(), again_data.size()).ok());
  back.resize(again_data.size());
  ASSERT_TRUE(space->Read(*again, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, again_data);
  back.resize(stays_data.size());
  ASSERT_TRUE(space->Read(*stays, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, stays_data);
  ASSERT_TRUE(space->Close().ok());
}

// Swap options of one path on the small tmpfs at `small`: 1 MiB stripes.
SwapOptions OnSmallTmpfs(const fs::path& small, uint64_t growth_bytes) {
  SwapOptions o;
  o.paths = {(small / "swap").string()};
  fs::create_directories(o.paths[0]);
  o.stripe_bytes = kMiB;
  o.queue_depth = 8;
  o.growth_bytes = growth_bytes;
  return o;
}

// Leaves `room` bytes free on the filesystem at `small`: the file `filler`
// there takes the rest.
void LeaveFree(const fs::path& small, uint64_t room) {
  const std::string filler = (small / "filler").string();
  fs::remove(filler);
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(small.c_str(), &vfs), 0);
  const uint64_t avail = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  ASSERT_GT(avail, room);
  const int fd = ::open(filler.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fallocate(fd, 0, 0, static_cast<off_t>(avail - room)), 0) << std::strerror(errno);
  ::close(fd);
}

// A swap path whose filesystem is full when the space is made: its O_DIRECT
// probe write failed, and with it the swap space (ztierd did not start,
// DRAM jobs refused too). Objects are refused until there is room.
TEST_P(SwapSpaceTest, AFullFilesystemAtTheStartRefusesObjectsUntilItHasRoom) {
  const fs::path small = root_ / "full";
  ztier::testing::SmallTmpfs tmpfs(small.string(), "8m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a small tmpfs here: " << tmpfs.error();
  const SwapOptions o = OnSmallTmpfs(small, kMiB);
  ASSERT_NO_FATAL_FAILURE(LeaveFree(small, 0));
  Result<std::unique_ptr<SwapSpace>> created = SwapSpace::Create(o, Backend());
  if (!created.ok() && created.status().message().find("O_DIRECT") != std::string::npos) {
    GTEST_SKIP() << "tmpfs takes no O_DIRECT on this kernel: " << created.status();
  }
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<SwapSpace> space = std::move(created).value();
  Result<uint64_t> a = space->Allocate("a", 2 * kMiB);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status();
  fs::remove(small / "filler");
  a = space->Allocate("a", 2 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::vector<uint8_t> out(2 * kMiB, 0x5a);
  std::vector<uint8_t> in(2 * kMiB);
  ASSERT_TRUE(space->Write(*a, 0, out.data(), out.size()).ok());
  ASSERT_TRUE(space->Read(*a, 0, in.data(), in.size()).ok());
  EXPECT_EQ(in, out);
}

// On a drive nearly full, an object that reuses freed units (holes) and
// needs the files to grow: the growth took a step ahead of the need and
// with it the room the holes needed, so an object that fit was refused,
// and the files stayed grown by the refused object. The files now grow
// by the need alone while holes are there, and a refusal leaves them as
// they were. (On a small tmpfs, which punches and preallocates.)
TEST_P(SwapSpaceTest, GrowingTheFilesLeavesTheRoomTheHolesNeed) {
  const fs::path small = root_ / "small";
  ztier::testing::SmallTmpfs tmpfs(small.string(), "32m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a small tmpfs here: " << tmpfs.error();
  const SwapOptions o = OnSmallTmpfs(small, 4 * kMiB);
  Result<std::unique_ptr<SwapSpace>> created = SwapSpace::Create(o, Backend());
  if (!created.ok() && created.status().message().find("O_DIRECT") != std::string::npos) {
    GTEST_SKIP() << "tmpfs takes no O_DIRECT on this kernel: " << created.status();
  }
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<SwapSpace> space = std::move(created).value();
  Result<uint64_t> a = space->Allocate("a", 6 * kMiB);
  Result<uint64_t> b = space->Allocate("b", 2 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  const uint64_t size = space->file_bytes();
  const uint64_t tail = space->free_bytes();  // free in the files, not holes
  const SwapSpace::PathUsage before = space->path_usage().at(0);
  ASSERT_TRUE(space->Free(*a).ok());
  const uint64_t held = BlocksHeld(o);
  ASSERT_LE(held, size - 6 * kMiB) << "no hole was punched";
  // What the path holds and may grow to: the holes are the drive's free
  // space, not counted in the file as well.
  const SwapSpace::PathUsage after = space->path_usage().at(0);
  EXPECT_EQ(after.file_bytes, held);
  EXPECT_EQ(after.used_bytes, before.used_bytes - 6 * kMiB);
  EXPECT_EQ(after.capacity_bytes, before.capacity_bytes);
  // An object of the holes, the free tail and two units more: the files
  // grow by 2 MiB and the holes take 6 MiB again, 8 MiB of room.
  const uint64_t object = 6 * kMiB + tail + 2 * kMiB;

  // 7 MiB free: refused, and nothing of it stays.
  ASSERT_NO_FATAL_FAILURE(LeaveFree(small, 7 * kMiB));
  Result<uint64_t> c = space->Allocate("c", object);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted) << c.status();
  EXPECT_EQ(space->file_bytes(), size) << "the refused object left the files grown";
  EXPECT_LE(BlocksHeld(o), held) << "the refused object left blocks held";
  EXPECT_EQ(space->free_bytes(), tail + 6 * kMiB);
  // 9 MiB free: room for the object, though not for a growth of a step
  // (4 MiB) and the holes.
  ASSERT_NO_FATAL_FAILURE(LeaveFree(small, 9 * kMiB));
  c = space->Allocate("c", object);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(space->file_bytes(), size + 2 * kMiB);
  std::mt19937_64 rng(FreshSeed());
  const std::vector<uint8_t> data = RandomBytes(rng, object);
  ASSERT_TRUE(space->Write(*c, 0, data.data(), data.size()).ok());
  std::vector<uint8_t> back(data.size());
  ASSERT_TRUE(space->Read(*c, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  ASSERT_TRUE(space->Close().ok());
}

// Objects allocated, written, read and freed from several threads at
// once: a Free punches its holes outside the map lock while the others'
// I/O and allocations go on, and the last one out cuts the files. Every
// object reads back what was written to it; at the end the files are
// gone to nothing.
TEST_P(SwapSpaceTest, ObjectsComingAndGoingFromSeveralThreadsKeepTheirData) {
  SwapOptions o = Options(2, 0, 256 * kKiB);
  o.growth_bytes = kMiB;
  std::unique_ptr<SwapSpace> space = MustCreate(o);
  ASSERT_NE(space, nullptr);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(StrCat("seed ", seed));
  std::atomic<int> failures{0};
  std::mutex report_mu;
  std::string report;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      for (int round = 0; round < 25 && failures.load() == 0; ++round) {
        const uint64_t size = std::uniform_int_distribution<uint64_t>(1, 3 * kMiB)(rng);
        const std::vector<uint8_t> data = RandomBytes(rng, size);
        Status s;
        Result<uint64_t> id = space->Allocate(StrCat("t", t, "-", round), size);
        s = id.status();
        if (s.ok()) s = space->Write(*id, 0, data.data(), size);
        std::vector<uint8_t> back(size);
        if (s.ok()) s = space->Read(*id, 0, back.data(), size);
        if (s.ok() && back != data) s = Status::Corruption("read back other bytes");
        if (id.ok()) {
          Status freed = space->Free(*id);
          if (s.ok()) s = freed;
        }
        if (!s.ok()) {
          ++failures;
          std::lock_guard<std::mutex> lock(report_mu);
          report += StrCat("thread ", t, " round ", round, ": ", s.ToString(), "\n");
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << report;
  EXPECT_EQ(space->file_bytes(), 0u) << "the last object out left the files grown";
  ASSERT_TRUE(space->Close().ok());
}

// Files kept for a manifest keep a freed object's data: a manifest saved
// before the Free still names it (a hole read back as zeros, or as a
// checksum mismatch).
TEST_P(SwapSpaceTest, KeptFilesAreNotPunched) {
  SwapOptions o = Options(1, 0, 256 * kKiB);
  o.keep_files = true;
  std::unique_ptr<SwapSpace> space = MustCreate(o);
  ASSERT_NE(space, nullptr);
  std::mt19937_64 rng(FreshSeed());
  Result<uint64_t> a = space->Allocate("a", 4 * kMiB);
  Result<uint64_t> b = space->Allocate("b", kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<uint8_t> data = RandomBytes(rng, 4 * kMiB);
  ASSERT_TRUE(space->Write(*a, 0, data.data(), data.size()).ok());
  ASSERT_TRUE(space->Write(*b, 0, data.data(), kMiB).ok());
  const uint64_t held = BlocksHeld(o);
  ASSERT_TRUE(space->Free(*a).ok());
  EXPECT_EQ(BlocksHeld(o), held);
  ASSERT_TRUE(space->Close().ok());
}

TEST_P(SwapSpaceTest, KeepFilesLeavesThemForAManifest) {
  SwapOptions o = Options(1, 0);
  o.keep_files = true;
  {
    std::unique_ptr<SwapSpace> space = MustCreate(o);
    ASSERT_NE(space, nullptr);
    ASSERT_TRUE(space->Allocate("a", kMiB).ok());
  }
  EXPECT_TRUE(fs::exists(fs::path(o.paths[0]) / o.file_name));
}

TEST_P(SwapSpaceTest, TheCapAndAFullDiskRefuseGrowthAndKeepEveryObject) {
  SwapOptions o = Options(2, 4 * kMiB);
  std::shared_ptr<FaultBackend> fault = Faulty();
  std::unique_ptr<SwapSpace> space = MustCreate(o, fault);
  ASSERT_NE(space, nullptr);
  Result<uint64_t> a = space->Allocate("a", 6 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<uint8_t> data(6 * kMiB, 0x11), back(6 * kMiB);
  ASSERT_TRUE(space->Write(*a, 0, data.data(), data.size()).ok());
  Result<uint64_t> over = space->Allocate("over", 4 * kMiB);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("cap"), std::string::npos) << over.status();
  EXPECT_TRUE(space->Allocate("fits", 2 * kMiB).ok());
  ASSERT_TRUE(space->Close().ok());

  // No cap, but the disk fills during growth.
  space = MustCreate(Options(2, 0), fault);
  ASSERT_NE(space, nullptr);
  a = space->Allocate("a", 6 * kMiB);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(space->Write(*a, 0, data.data(), data.size()).ok());
  const uint64_t before = space->file_bytes();
  // The first path grows, the second finds the disk full: the first gives
  // its growth back (the paths may share a filesystem, which it would
  // otherwise keep full).
  fault->FailPreallocate(ENOSPC, 2);
  Result<uint64_t> big = space->Allocate("big", 1024 * kMiB);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(big.status().message().find("out of space"), std::string::npos) << big.status();
  EXPECT_EQ(space->file_bytes(), before);
  for (const std::string& p : Options(2, 0).paths) {
    EXPECT_EQ(fs::file_size(fs::path(p) / o.file_name), before / 2)
        << p << ": a failed growth kept what it took";
  }
  EXPECT_FALSE(space->Find("big").ok()) << "a failed allocation left an object";
  ASSERT_TRUE(space->Read(*a, 0, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  fault->Reset();
  EXPECT_TRUE(space->Allocate("big", 1024 * kMiB).ok()) << "space came back";
}

// A drive that fails (EIO) while the files grow, or while freed units are
// reserved again, is an I/O error that says so: not "swap space full" with
// the bytes free beside it, which sent the reader looking for room.
TEST_P(SwapSpaceTest, AGrowthThatFailsWithAnIoErrorIsNotCalledFull) {
  std::shared_ptr<FaultBackend> fault = Faulty();
  std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 0), fault);
  ASSERT_NE(space, nullptr);
  fault->FailPreallocate(EIO);
  Result<uint64_t> a = space->Allocate("a", 6 * kMiB);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kIoError) << a.status();
  EXPECT_EQ(a.status().message().find("full"), std::string::npos) << a.status();
  EXPECT_EQ(a.status().message().find("bytes free"), std::string::npos) << a.status();
  EXPECT_NE(a.status().message().find("object 'a'"), std::string::npos) << a.status();
  EXPECT_NE(a.status().message().find(std::strerror(EIO)), std::string::npos) << a.status();
  fault->Reset();
  EXPECT_TRUE(space->Allocate("a", 6 * kMiB).ok()) << "the drive came back";
}

// Objects start on the paths in turn. After frees on one path only, the
// turn's path may be full (capped) while the other holds free units: the
// object starts on the other. Before, it was refused ("swap space full")
// with room for it on the drives.
TEST_P(SwapSpaceTest, AnObjectStartsWhereFreedUnitsHoldIt) {
  std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 4 * kMiB));
  ASSERT_NE(space, nullptr);
  std::vector<uint64_t> ids;
  std::vector<uint8_t> data(kMiB), back(kMiB);
  for (int i = 0; i < 8; ++i) {  // one unit each, on paths 0, 1, 0, 1, ...
    Result<uint64_t> id = space->Allocate(StrCat("o", i), kMiB);
    ASSERT_TRUE(id.ok()) << id.status();
    std::fill(data.begin(), data.end(), static_cast<uint8_t>(i + 1));
    ASSERT_TRUE(space->Write(*id, 0, data.data(), data.size()).ok());
    ids.push_back(*id);
  }
  ASSERT_TRUE(space->Free(ids[1]).ok());  // both on path 1
  ASSERT_TRUE(space->Free(ids[3]).ok());
  for (const char* name : {"x", "y"}) {  // the turn is path 0's, which is full
    Result<uint64_t> id = space->Allocate(name, kMiB);
    ASSERT_TRUE(id.ok()) << name << ": " << id.status();
    std::fill(data.begin(), data.end(), static_cast<uint8_t>(name[0]));
    ASSERT_TRUE(space->Write(*id, 0, data.data(), data.size()).ok());
    ASSERT_TRUE(space->Read(*id, 0, back.data(), back.size()).ok());
    EXPECT_EQ(back, data) << name;
  }
  Result<uint64_t> full = space->Allocate("z", kMiB);
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted) << full.status();
  for (int i : {0, 2, 4, 5, 6, 7}) {
    ASSERT_TRUE(space->Read(ids[i], 0, back.data(), back.size()).ok());
    EXPECT_EQ(back, std::vector<uint8_t>(kMiB, static_cast<uint8_t>(i + 1))) << "o" << i;
  }
  ASSERT_TRUE(space->Close().ok());
}

// The files grow in lockstep, so two paths on one filesystem share its
// free space: each was said to have all of it to grow into.
TEST_P(SwapSpaceTest, CapacityIsTheRoomTheFilesGrowByTogether) {
  std::unique_ptr<SwapSpace> space = MustCreate(Options(2, 0));
  ASSERT_NE(space, nullptr);
  ASSERT_TRUE(space->Allocate("a", 4 * kMiB).ok());
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(root_.c_str(), &vfs), 0);
  const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (avail < (uint64_t{1} << 30)) GTEST_SKIP() << "less than 1 GiB free: " << avail;
  const uint64_t slack = avail / 100 + 64 * kMiB;  // others write to the disk meanwhile
  for (const SwapSpace::PathUsage& u : space->path_usage()) {
    const uint64_t room = u.capacity_bytes - u.file_bytes;
    EXPECT_LE(room, avail / 2 + slack) << u.path;
    EXPECT_GE(room + slack, avail / 2) << u.path;
  }
  ASSERT_TRUE(space->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapSpaceTest,
                         ::testing::Values(BackendKind::kUring, BackendKind::kThreads),
                         BackendName);
INSTANTIATE_TEST_SUITE_P(Backends, SwapFaultTest,
                         ::testing::Values(BackendKind::kUring, BackendKind::kThreads),
                         BackendName);

TEST(IoBackendTest, ARefusedRingFallsBackToThreads) {
  const Status refused(StatusCode::kFailedPrecondition, "io_uring is refused (EPERM)", EPERM);
  EXPECT_EQ(SelectBackend(refused)->name(), "threads");
  if (ProbeUringSetup().ok()) {
    EXPECT_EQ(SelectBackend(Status::Ok())->name(), "io_uring");
    EXPECT_EQ((*MakeBackend(BackendChoice::kAuto))->name(), "io_uring");
  }
  EXPECT_EQ((*MakeBackend(BackendChoice::kThreads))->name(), "threads");
}

// A queue of the thread backend in a process that may make no thread more
// is an error: its constructor threw with threads started, which ended the
// process (std::terminate), ztierd with every user's jobs.
TEST(IoBackendTest, AThreadQueueWithoutThreadsIsAnError) {
  const int fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      // Root makes threads past RLIMIT_NPROC: a user with none left, then
      // with one.
      // A uid no other process has (RLIMIT_NPROC counts every task of
      // the uid: nobody's, under ctest -j2, are other tests').
      constexpr uid_t kLoneUid = 0x7ffffff0;
      const rlimit none{0, 2};
      if (::setgid(kLoneUid) != 0 || ::setuid(kLoneUid) != 0 ||
          ::setrlimit(RLIMIT_NPROC, &none) != 0) {
        ::_exit(3);
      }
      Result<std::unique_ptr<IoQueue>> q = MakeThreadBackend()->OpenQueue(fd, "/dev/null", 4, {});
      if (q.ok()) ::_exit(4);  // (threads after all: nothing to test)
      if (q.status().code() != StatusCode::kResourceExhausted ||
          q.status().message().find("I/O thread pool") == std::string::npos) {
        ::_exit(5);
      }
      const rlimit one{2, 2};  // this process and one thread
      if (::setrlimit(RLIMIT_NPROC, &one) != 0) ::_exit(3);
      q = MakeThreadBackend()->OpenQueue(fd, "/dev/null", 4, {});
      ::_exit(q.ok() ? 0 : 6);  // with the one worker it could start
    } catch (...) {
      ::_exit(7);
    }
  }
  int st = 0;
  ASSERT_EQ(::waitpid(child, &st, 0), child);
  ::close(fd);
  if (WIFEXITED(st) && (WEXITSTATUS(st) == 3 || WEXITSTATUS(st) == 4)) {
    GTEST_SKIP() << "this process cannot be made to run out of threads here";
  }
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0)
      << (WIFSIGNALED(st) ? StrCat("ended by signal ", WTERMSIG(st))
                          : StrCat("exit ", WEXITSTATUS(st)));
}

}  // namespace
}  // namespace ztier::nvme
