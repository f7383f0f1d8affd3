// Tests of the pinned DRAM pool: allocation and alignment, zeroing before
// reuse, the hard budget, own regions for large blocks, sealed memfds that
// another mapping (a client) can share, dedicated regions (one owner,
// read-only seals, indices never reused), concurrency, hugetlb fallback and
// double-free detection.
#include "engine/dram_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/as_nobody.h"

namespace ztier::engine {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::unique_ptr<DramPool> MakePool(uint64_t budget, uint64_t region = 4 * kMiB,
                                   HugePages huge = HugePages::kTransparent) {
  Result<std::unique_ptr<DramPool>> p =
      DramPool::Create({.budget_bytes = budget, .region_bytes = region, .huge_pages = huge});
  ZT_CHECK_MSG(p.ok(), p.status().ToString());
  return std::move(p).value();
}

bool AllBytes(const void* p, size_t n, uint8_t v) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) {
    if (b[i] != v) return false;
  }
  return true;
}

TEST(DramPoolTest, AllocatesAlignedZeroedWritableBlocks) {
  auto pool = MakePool(64 * kMiB);  // regions of 4 MiB (at most a 16th of the budget)
  Result<DramBlock> a = pool->Allocate(10000, "test");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes, 12288u);  // rounded up to 4 KiB pages
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->ptr) % 4096, 0u);
  EXPECT_TRUE(AllBytes(a->ptr, a->bytes, 0));
  std::memset(a->ptr, 0x5a, a->bytes);
  const DramPoolStats st = pool->stats();
  EXPECT_EQ(st.used_bytes, 12288u);
  EXPECT_EQ(st.regions, 1u);
  EXPECT_EQ(st.reserved_bytes, 4 * kMiB);
  pool->Free(*a);
  EXPECT_EQ(pool->stats().used_bytes, 0u);
}

TEST(DramPoolTest, FreedMemoryIsZeroedBeforeReuse) {
  auto pool = MakePool(8 * kMiB);
  Result<DramBlock> a = pool->Allocate(kMiB, "job-a");
  ASSERT_TRUE(a.ok());
  std::memset(a->ptr, 0xab, a->bytes);
  pool->Free(*a);
  Result<DramBlock> b = pool->Allocate(kMiB, "job-b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ptr, a->ptr) << "first fit should hand the same pages out again";
  EXPECT_TRUE(AllBytes(b->ptr, b->bytes, 0)) << "job-b sees job-a's bytes";
}

TEST(DramPoolTest, BudgetIsHardAndNamed) {
  auto pool = MakePool(8 * kMiB, 4 * kMiB);
  Result<DramBlock> a = pool->Allocate(6 * kMiB, "job-a");
  ASSERT_TRUE(a.ok()) << a.status();
  std::memset(a->ptr, 1, a->bytes);
  Result<DramBlock> b = pool->Allocate(3 * kMiB, "job-b");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("job-b"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("budget of 8388608 bytes"), std::string::npos) << b.status();
  EXPECT_TRUE(AllBytes(a->ptr, a->bytes, 1)) << "a failed request touched another block";
  Result<DramBlock> c = pool->Allocate(2 * kMiB, "job-c");  // exactly fits
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_LE(pool->stats().reserved_bytes, 8 * kMiB);
  EXPECT_EQ(pool->Allocate(1, "job-d").status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Allocate(0, "job-e").status().code(), StatusCode::kInvalidArgument);
}

TEST(DramPoolTest, LargeBlockGetsItsOwnRegion) {
  auto pool = MakePool(64 * kMiB, 4 * kMiB);
  Result<DramBlock> small = pool->Allocate(kMiB, "s");
  Result<DramBlock> big = pool->Allocate(20 * kMiB + 5, "b");
  ASSERT_TRUE(small.ok() && big.ok());
  EXPECT_NE(small->region, big->region);
  EXPECT_EQ(big->offset, 0u);
  std::memset(big->ptr, 7, big->bytes);
  EXPECT_EQ(pool->stats().regions, 2u);
}

TEST(DramPoolTest, RegionsAreSealedMemfdsAnotherMappingCanShare) {
  auto pool = MakePool(16 * kMiB, 4 * kMiB);
  Result<DramBlock> a = pool->Allocate(3 * kMiB, "a");
  Result<DramBlock> b = pool->Allocate(64 * 1024, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  std::memset(b->ptr, 0x42, b->bytes);
  const int fd = pool->region_fd(b->region);
  ASSERT_GE(fd, 0);
  // What a client does with the fd it receives: map it and see the bytes.
  void* view = ::mmap(nullptr, b->bytes, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(b->offset));
  ASSERT_NE(view, MAP_FAILED) << std::strerror(errno);
  EXPECT_TRUE(AllBytes(view, b->bytes, 0x42));
  ::munmap(view, b->bytes);
  // Sealed against shrink and grow.
  EXPECT_NE(::ftruncate(fd, 1), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(fd, 64 * kMiB), 0);
  const int seals = ::fcntl(fd, F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_EQ(pool->region_fd(99), -1);
}

TEST(DramPoolTest, DedicatedRegionsAreOneOwnersAndTheirIndicesNeverReturn) {
  auto pool = MakePool(16 * kMiB, 4 * kMiB);
  Result<uint32_t> r = pool->CreateRegion(3 * kMiB + 100, "job 'a' shared");
  ASSERT_TRUE(r.ok()) << r.status();
  // The whole region is the owner's: counted as used, carved only by it.
  EXPECT_EQ(pool->stats().used_bytes, 3 * kMiB + 4096);
  Result<DramBlock> in = pool->AllocateIn(*r, 1 * kMiB, "inbox");
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->region, *r);
  EXPECT_TRUE(AllBytes(in->ptr, in->bytes, 0));
  Result<DramBlock> shared = pool->Allocate(64 * 1024, "state");
  ASSERT_TRUE(shared.ok());
  EXPECT_NE(shared->region, *r) << "a shared block was carved from a dedicated region";
  Result<DramBlock> too_big = pool->AllocateIn(*r, 3 * kMiB, "more");
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted);
  pool->Free(*in);
  EXPECT_EQ(pool->stats().used_bytes, 3 * kMiB + 4096 + 64 * 1024);

  const int fd = pool->region_fd(*r);
  ASSERT_GE(fd, 0);
  const int keep = ::dup(fd);  // a client's copy of the fd (or a child's it forked)
  struct stat st {};
  ASSERT_EQ(::fstat(keep, &st), 0);
  EXPECT_GT(st.st_blocks, 0);
  pool->DestroyRegion(*r);
  EXPECT_EQ(pool->region_fd(*r), -1);
  EXPECT_EQ(pool->stats().used_bytes, 64 * 1024u);
  // Its pages went with it, whoever holds the fd (they stayed, in no
  // budget); the fd still maps, and the pool's index does not come back
  // for anyone else.
  ASSERT_EQ(::fstat(keep, &st), 0);
  EXPECT_EQ(st.st_blocks, 0) << "the destroyed region's pages live on in the fd's holder";
  void* view = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, keep, 0);
  EXPECT_NE(view, MAP_FAILED);
  ::munmap(view, 4096);
  ::close(keep);
  Result<uint32_t> next = pool->CreateRegion(1 * kMiB, "job 'b' shared");
  ASSERT_TRUE(next.ok());
  EXPECT_GT(*next, *r);
  Result<DramBlock> later = pool->Allocate(2 * kMiB, "state");
  ASSERT_TRUE(later.ok());
  EXPECT_NE(later->region, *r);
}

// A dedicated region was made (its pages faulted in and locked) under the
// pool's lock: a large model's registration in ztierd held up every other
// job's allocations, the stats and ztierd's accept loop for as long.
TEST(DramPoolTest, MakingALargeRegionHoldsUpNoOtherUserOfThePool) {
  auto pool = MakePool(uint64_t{2} << 30);
  // A shared region to allocate from without mapping anything (a new
  // mapping would wait for the kernel's lock on the address space, which
  // faulting the large region in holds).
  Result<DramBlock> warm = pool->Allocate(64 * 1024, "warm");
  ASSERT_TRUE(warm.ok()) << warm.status();
  pool->Free(*warm);
  std::atomic<bool> made{false};
  std::thread big([&] {
    Result<uint32_t> r = pool->CreateRegion(uint64_t{1} << 30, "a large job's params");
    made = true;
    ASSERT_TRUE(r.ok()) << r.status();
    pool->DestroyRegion(*r);
  });
  // While it is being made: another owner's block, the stats.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const bool before = made.load();
  Result<DramBlock> other = pool->Allocate(64 * 1024, "another job's state");
  (void)pool->stats();
  const bool after = made.load();
  big.join();
  ASSERT_TRUE(other.ok()) << other.status();
  pool->Free(*other);
  if (before) GTEST_SKIP() << "the region was made within 20 ms: too fast to tell";
  EXPECT_FALSE(after) << "the allocation waited until the large region was made";
}

// The region's pages were locked (faulted in) by one mlock, which holds
// the kernel's lock on the address space throughout: every other thread
// that mapped memory meanwhile (ztierd's other jobs and connections) waited
// as long as the whole region took, seconds for tens of GiB.
TEST(DramPoolTest, MakingALargeRegionHoldsUpNoNewMapping) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's mlock does nothing and says it succeeded";
#endif
  // hugetlb regions were faulted in by one mmap(MAP_POPULATE) as well:
  // where 2 MiB pages are reserved (/proc/sys/vm/nr_hugepages).
  for (const HugePages huge : {HugePages::kTransparent, HugePages::kHugetlb}) {
    const bool hugetlb = huge == HugePages::kHugetlb;
    SCOPED_TRACE(hugetlb ? "hugetlb" : "transparent");
    auto pool = MakePool(uint64_t{2} << 30, 4 * kMiB, huge);
    std::atomic<bool> made{false};
    std::chrono::duration<double, std::milli> took{};
    DramPoolStats stats;
    std::thread big([&] {
      const auto t0 = std::chrono::steady_clock::now();
      // (Dedicated regions are never hugetlb; a large block's own region is.)
      if (hugetlb) {
        Result<DramBlock> b = pool->Allocate(uint64_t{1} << 30, "a large job's states");
        took = std::chrono::steady_clock::now() - t0;
        made = true;
        ASSERT_TRUE(b.ok()) << b.status();
        stats = pool->stats();
        pool->Free(*b);
        return;
      }
      Result<uint32_t> r = pool->CreateRegion(uint64_t{1} << 30, "a large job's params");
      took = std::chrono::steady_clock::now() - t0;
      made = true;
      ASSERT_TRUE(r.ok()) << r.status();
      stats = pool->stats();
      pool->DestroyRegion(*r);
    });
    // Meanwhile: new mappings, each touched, as a new client's buffers are.
    std::chrono::duration<double, std::milli> worst{};
    int maps = 0;
    while (!made.load()) {
      const auto t0 = std::chrono::steady_clock::now();
      void* q = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      ASSERT_NE(q, MAP_FAILED);
      *static_cast<volatile char*>(q) = 1;
      ::munmap(q, 4096);
      worst = std::max<std::chrono::duration<double, std::milli>>(
          worst, std::chrono::steady_clock::now() - t0);
      ++maps;
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    big.join();
    std::printf("%s region made in %.0f ms (%s); %d mappings meanwhile, the slowest %.1f ms\n",
                stats.hugetlb_regions > 0 ? "a hugetlb" : "a", took.count(),
                stats.locked_regions > 0 ? "locked" : "not locked", maps, worst.count());
    if (hugetlb && stats.hugetlb_regions == 0) continue;  // none reserved: as above
    if (!hugetlb && stats.locked_regions == 0) continue;  // no CAP_IPC_LOCK: faulted in by chunks
    if (took < std::chrono::milliseconds(50)) continue;   // too fast to tell
    EXPECT_LT(worst, took / 2) << "a new mapping waited for most of the region's making";
  }
}

// The process's resident set, from /proc/self/status (0 where unreadable).
uint64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// A service runs job after job: each made regions whose table entries (the
// region, its page allocator) stayed after the region went, about 150
// bytes a region for good, and every allocation and stats() walked them.
TEST(DramPoolTest, RegionsThatWentLeaveNothingBehind) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer keeps freed memory in quarantine: the resident set grows";
#endif
  auto pool = MakePool(16 * kMiB, 4 * kMiB);
  Result<DramBlock> kept = pool->Allocate(4096, "state");  // a shared region throughout
  ASSERT_TRUE(kept.ok());
  auto cycle = [&](int n) {
    for (int i = 0; i < n; ++i) {
      Result<uint32_t> r = pool->CreateRegion(4096, "job");
      ASSERT_TRUE(r.ok()) << r.status();
      pool->DestroyRegion(*r);
    }
  };
  cycle(1000);  // the allocator's and the table's first growth
  const uint64_t before = ResidentBytes();
  cycle(10000);
  const uint64_t after = ResidentBytes();
  EXPECT_LT(after, before + kMiB / 2)
      << "the pool grew by " << (after - before) / 1024 << " KiB over 10000 regions that went";
  EXPECT_EQ(pool->stats().regions, 1);
  EXPECT_EQ(pool->regions().size(), 1u);
}

// A region shared read-only goes out as a read-only open of a memfd of
// mode 0444: another user can neither map it writable, write it, punch it
// nor reopen it for writing, while the pool writes it through its own
// mapping and frees its pages when it goes, whoever holds the fd. (It was
// sealed F_SEAL_FUTURE_WRITE, which the kernel lets no one punch: a client
// that kept the fd of every job it registered and unregistered kept their
// pages, ztierd's memory, in no quota.)
TEST(DramPoolTest, AReadOnlyRegionIsReadOnlyForOthersAndItsPagesGoWithIt) {
  auto pool = MakePool(16 * kMiB, 4 * kMiB);
  Result<uint32_t> r = pool->CreateRegion(1 * kMiB, "publish");
  ASSERT_TRUE(r.ok());
  Result<DramBlock> b = pool->AllocateIn(*r, 4096, "unit");
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(pool->SealRegion(*r, RegionAccess::kReadOnly).ok());
  // The pool's own mapping stays writable.
  std::memset(b->ptr, 0x5a, 4096);
  Result<UniqueFd> shared = pool->ShareFd(*r);
  ASSERT_TRUE(shared.ok()) << shared.status();
  const int fd = shared->get();
  EXPECT_EQ(::fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  EXPECT_LT(::pwrite(fd, "x", 1, 0), 0);
  EXPECT_NE(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  EXPECT_NE(::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);  // F_SEAL_SEAL
  if (::geteuid() == 0) {
    // Another user cannot reopen it for writing through /proc, nor change
    // its mode; reading works.
    const int code = testing::AsNobody([fd] {
      const std::string path = "/proc/self/fd/" + std::to_string(fd);
      if (::open(path.c_str(), O_RDWR) >= 0 || errno != EACCES) return 1;
      if (::fchmod(fd, 0666) == 0) return 2;
      void* view = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
      if (view == MAP_FAILED || !AllBytes(view, 4096, 0x5a)) return 3;
      return 0;
    });
    EXPECT_EQ(code, 0);
  }
  void* view = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(view, MAP_FAILED);
  EXPECT_TRUE(AllBytes(view, 4096, 0x5a));
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_GT(st.st_blocks, 0);
  // Destroyed while another holder maps it and holds its fd: the pages go.
  pool->DestroyRegion(*r);
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_EQ(st.st_blocks, 0) << "the region's pages outlived it in its holder";
  ::munmap(view, 4096);
  // A read-write region's is a duplicate, as before.
  Result<uint32_t> rw = pool->CreateRegion(1 * kMiB, "inbox");
  ASSERT_TRUE(rw.ok());
  ASSERT_TRUE(pool->SealRegion(*rw, RegionAccess::kReadWrite).ok());
  Result<UniqueFd> dup = pool->ShareFd(*rw);
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(::fcntl(dup->get(), F_GETFL) & O_ACCMODE, O_RDWR);
  EXPECT_EQ(pool->ShareFd(12345).status().code(), StatusCode::kNotFound);
  pool->DestroyRegion(*rw);
}

TEST(DramPoolTest, DedicatedRegionsDropEmptySharedOnesForRoomAndRespectTheBudget) {
  auto pool = MakePool(8 * kMiB, 4 * kMiB);
  Result<DramBlock> a = pool->Allocate(4096, "a");  // reserves a 2 MiB shared region
  ASSERT_TRUE(a.ok());
  pool->Free(*a);
  Result<uint32_t> r = pool->CreateRegion(7 * kMiB, "needs the empty region's room");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(pool->stats().regions, 1u);
  Result<uint32_t> over = pool->CreateRegion(4 * kMiB, "over");
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("8388608"), std::string::npos) << over.status();
}

// Where no 2 MiB pages are reserved, the pool said so of every region it
// made (a line per job, and one per large block): one warning a pool.
TEST(DramPoolTest, HugetlbFallsBackWhenNoneReservedAndSaysSoOnce) {
  auto pool = MakePool(64 * kMiB, 4 * kMiB, HugePages::kHugetlb);
  ::testing::internal::CaptureStderr();
  std::vector<DramBlock> blocks;
  for (uint64_t size : {kMiB, 4 * kMiB, 4 * kMiB, 8 * kMiB}) {  // a region each
    Result<DramBlock> a = pool->Allocate(size, "h");
    ASSERT_TRUE(a.ok()) << a.status();
    std::memset(a->ptr, 3, a->bytes);
    blocks.push_back(*a);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  const DramPoolStats st = pool->stats();
  std::printf("hugetlb regions: %u of %u, locked: %u\n", st.hugetlb_regions, st.regions,
              st.locked_regions);
  EXPECT_GE(st.regions, 3u);
  const size_t fell_back = st.regions - st.hugetlb_regions;
  size_t warnings = 0;
  for (size_t at = log.find("hugetlb pages unavailable"); at != std::string::npos;
       at = log.find("hugetlb pages unavailable", at + 1)) {
    ++warnings;
  }
  EXPECT_EQ(warnings, fell_back == 0 ? 0u : 1u) << log;
  for (const DramBlock& b : blocks) pool->Free(b);
}

TEST(DramPoolTest, ConcurrentAllocationsDoNotOverlap) {
  auto pool = MakePool(128 * kMiB, 8 * kMiB);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<DramBlock> mine;
      for (int i = 0; i < 40; ++i) {
        Result<DramBlock> b = pool->Allocate((i % 7 + 1) * 12288, "t");
        if (!b.ok()) {
          ++bad;
          continue;
        }
        std::memset(b->ptr, t + 1, b->bytes);
        mine.push_back(*b);
        if (i % 3 == 0) {
          pool->Free(mine.front());
          mine.erase(mine.begin());
        }
      }
      for (const DramBlock& b : mine) {
        if (!AllBytes(b.ptr, b.bytes, static_cast<uint8_t>(t + 1))) ++bad;
        pool->Free(b);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(pool->stats().used_bytes, 0u);
}

// Blocks past half a region took a standard region each, the rest of it
// unused: 16 blocks of 2.5 MiB in a budget of 64 MiB (40 MiB), and a job
// the budget's check let in failed as it allocated.
TEST(DramPoolTest, BlocksOfOneSizeFillTheBudget) {
  auto pool = MakePool(64 * kMiB, 4 * kMiB);
  uint64_t blocks = 0;
  while (pool->Allocate(5 * kMiB / 2, "layer").ok()) ++blocks;
  EXPECT_EQ(blocks, 25u) << pool->stats().regions << " regions";
  // Small blocks still share the standard regions.
  auto other = MakePool(64 * kMiB, 4 * kMiB);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(other->Allocate(kMiB, "small").ok());
  EXPECT_EQ(other->stats().regions, 1u);
  EXPECT_EQ(other->stats().reserved_bytes, 4 * kMiB);
}

TEST(DramPoolTest, ALargeBlockTakesTheRoomOfEmptySharedRegions) {
  auto pool = MakePool(8 * kMiB, 4 * kMiB);
  Result<DramBlock> small = pool->Allocate(4096, "small");  // a 2 MiB shared region
  ASSERT_TRUE(small.ok());
  pool->Free(*small);
  Result<DramBlock> large = pool->Allocate(7 * kMiB, "large");
  ASSERT_TRUE(large.ok()) << large.status();
  EXPECT_EQ(pool->stats().regions, 1u);
}

TEST(DramPoolTest, SharedRegionsReserveAtMostASixteenthOfTheBudget) {
  auto pool = MakePool(64 * kMiB, 256 * kMiB);
  ASSERT_TRUE(pool->Allocate(4096, "a").ok());
  EXPECT_EQ(pool->stats().reserved_bytes, 4 * kMiB);
  auto tiny = MakePool(8 * kMiB, 256 * kMiB);
  ASSERT_TRUE(tiny->Allocate(4096, "a").ok());
  EXPECT_EQ(tiny->stats().reserved_bytes, 2 * kMiB);  // never below one huge page
}

// stats() walked every region (ztierd asks once per job: quadratic in the
// jobs); the figures are now kept as regions come and go, and go back to
// nothing with the regions.
TEST(DramPoolTest, StatsFollowRegionsMadeAndDropped) {
  auto pool = MakePool(64 * kMiB, 4 * kMiB);
  std::vector<uint32_t> regions;
  for (int i = 0; i < 5; ++i) {
    Result<uint32_t> r = pool->CreateRegion(2 * kMiB, "job region");
    ASSERT_TRUE(r.ok()) << r.status();
    regions.push_back(*r);
  }
  Result<DramBlock> shared = pool->Allocate(kMiB, "shared");
  ASSERT_TRUE(shared.ok()) << shared.status();
  DramPoolStats st = pool->stats();
  EXPECT_EQ(st.regions, 6u);
  EXPECT_LE(st.locked_regions, st.regions);
  EXPECT_LE(st.huge_page_bytes, st.reserved_bytes);
  for (uint32_t r : regions) pool->DestroyRegion(r);
  st = pool->stats();
  EXPECT_EQ(st.regions, 1u);
  EXPECT_EQ(st.reserved_bytes, 4 * kMiB);
  EXPECT_LE(st.huge_page_bytes, 4 * kMiB);
  pool->Free(*shared);
  Result<uint32_t> big = pool->CreateRegion(62 * kMiB, "needs the shared region's room");
  ASSERT_TRUE(big.ok()) << big.status();  // the empty shared region dropped for it
  st = pool->stats();
  EXPECT_EQ(st.regions, 1u) << "the dropped region is still counted";
  EXPECT_EQ(st.reserved_bytes, 62 * kMiB);
  pool->DestroyRegion(*big);
  st = pool->stats();
  EXPECT_EQ(st.regions, 0u);
  EXPECT_EQ(st.huge_page_bytes, 0u);
  EXPECT_EQ(st.page_bytes, 0u);
}

TEST(DramPoolTest, RejectsBadOptions) {
  EXPECT_EQ(DramPool::Create({.budget_bytes = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DramPool::Create({.budget_bytes = kMiB, .region_bytes = 3 * kMiB}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(DramPoolDeathTest, DoubleFreeAborts) {
  auto pool = MakePool(8 * kMiB);
  Result<DramBlock> a = pool->Allocate(kMiB, "d");
  ASSERT_TRUE(a.ok());
  pool->Free(*a);
  EXPECT_DEATH(pool->Free(*a), "freed twice");
}

// Without the right to lock, the pool warned of each region it made: seven
// lines for one job. One warning a pool; the later regions at info.
TEST(DramPoolTest, RegionsThatCannotBeLockedAreWarnedOfOnce) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to drop to nobody (who lacks CAP_IPC_LOCK)";
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer's mlock does nothing and says it succeeded";
#endif
  const int rc = testing::AsNobody([] {
    const rlimit small{.rlim_cur = 64 << 10, .rlim_max = 64 << 10};
    if (::setrlimit(RLIMIT_MEMLOCK, &small) != 0) return 2;
    ::testing::internal::CaptureStderr();
    int made = 0;
    {
      Result<std::unique_ptr<DramPool>> pool = DramPool::Create(
          {.budget_bytes = 64 * kMiB, .region_bytes = 4 * kMiB, .huge_pages = HugePages::kNone});
      if (!pool.ok()) return 3;
      for (int i = 0; i < 3; ++i) made += (*pool)->CreateRegion(kMiB, "job region").ok() ? 1 : 0;
      made += (*pool)->Allocate(kMiB, "shared").ok() ? 1 : 0;
    }
    const std::string log = ::testing::internal::GetCapturedStderr();
    if (made != 4) return 4;
    size_t warnings = 0;
    for (size_t at = log.find("is not locked: mlock failed"); at != std::string::npos;
         at = log.find("is not locked: mlock failed", at + 1)) {
      ++warnings;
    }
    if (warnings != 1) {
      std::fprintf(stdout, "%zu warnings:\n%s", warnings, log.c_str());
      std::fflush(stdout);
      return 5;
    }
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace ztier::engine
