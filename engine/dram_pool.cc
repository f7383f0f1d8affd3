// ztier engine: pinned DRAM pool implementation (see dram_pool.h).
#include "engine/dram_pool.h"

#include <fcntl.h>
#include <hwloc.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>

#include "common/extent_allocator.h"
#include "common/log.h"

namespace ztier::engine {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kHugePage = uint64_t{2} << 20;

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// One memfd mapping. Move-only; unmaps and closes on destruction.
class Region {
 public:
  Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  Region(Region&& o) noexcept { *this = std::move(o); }
  Region& operator=(Region&& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    std::swap(locked_, o.locked_);
    std::swap(lock_error_, o.lock_error_);
    std::swap(name_, o.name_);
    std::swap(hugetlb_, o.hugetlb_);
    std::swap(huge_bytes_, o.huge_bytes_);
    std::swap(hugetlb_refused_, o.hugetlb_refused_);
    return *this;
  }
  ~Region() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }

  // `final_seal`: no seal may be added later (shared regions); a dedicated
  // region gets its final seals from SealRegion.
  static Result<Region> Make(const DramPoolOptions& o, uint64_t bytes, uint32_t index,
                             bool final_seal = true) {
    const std::string name = StrCat(o.name, "-", index);
    if (o.huge_pages == HugePages::kHugetlb && bytes % kHugePage == 0) {
      // memfd_create(MFD_HUGETLB) succeeds even with no pages reserved; the
      // mmap is what fails. Fall back to transparent huge pages then.
      Result<Region> huge = MakeWith(o, bytes, name, MFD_HUGETLB, final_seal);
      if (huge.ok()) return huge;
      Result<Region> r = MakeWith(o, bytes, name, 0, final_seal);
      if (!r.ok()) return r.status().Annotate(StrCat("after hugetlb pages: ", huge.status()));
      r->hugetlb_refused_ = huge.status().ToString();  // the pool warns (once)
      return r;
    }
    return MakeWith(o, bytes, name, 0, final_seal);
  }

 private:
  static Result<Region> MakeWith(const DramPoolOptions& o, uint64_t bytes, const std::string& name,
                                 unsigned extra_flags, bool final_seal) {
    Region r;
    r.fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING | extra_flags);
    if (r.fd_ < 0) return PosixError(StrCat("memfd_create ", name), errno);
    r.hugetlb_ = (extra_flags & MFD_HUGETLB) != 0;
    if (::ftruncate(r.fd_, static_cast<off_t>(bytes)) != 0) {
      return PosixError(StrCat("ftruncate memfd ", name, " to ", bytes, " bytes"), errno);
    }
    // Some kernels refuse F_SEAL_GROW on hugetlb memfds; the size is still
    // fixed by this process, so a refused seal is only worth a warning.
    if (::fcntl(r.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | (final_seal ? F_SEAL_SEAL : 0)) !=
        0) {
      ZT_LOG(kWarn, "engine") << "cannot seal " << name << ": " << std::strerror(errno);
    }
    // hugetlb pages are all reserved at mmap (which fails without them);
    // every region's pages are faulted in after, a chunk at a time (see
    // LockInChunks), others' advised first so the advice takes effect.
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd_, 0);
    if (p == MAP_FAILED) {
      return PosixError(StrCat("mmap ", bytes, " bytes of memfd ", name), errno);
    }
    r.base_ = p;
    r.bytes_ = bytes;
    if (!r.hugetlb_ && o.huge_pages != HugePages::kNone) {
      // Advice only: THP may be off ("never"); the pool works either way.
      (void)::madvise(p, bytes, MADV_HUGEPAGE);
    }
    int lock_err = 0;
    if (o.lock) {
      lock_err = LockInChunks(p, bytes);
      r.locked_ = lock_err == 0;
    }
    if (!r.locked_) {
      // A page the kernel cannot give now (a cgroup's limit on memory or
      // on hugetlb pages) fails the region here, not a write to it later
      // (SIGBUS in ztierd or a client); a hugetlb one falls back to
      // transparent huge pages (Make).
      if (const int err = Prefault(p, bytes); err != 0) {
        return PosixError(StrCat("fault in the ", bytes, " bytes of memfd ", name), err);
      }
    }
    r.lock_error_ = lock_err;
    r.name_ = name;
    r.huge_bytes_ = r.hugetlb_ ? bytes : HugeBytesOf(p);
    return r;
  }

  // mlock faults every page in, and holds the kernel's lock on the address
  // space while it does: one call for a region of tens of GiB held up every
  // other thread of the process that mapped or unmapped memory (ztierd's
  // other jobs, its clients' connections) for seconds. Chunk by chunk, the
  // lock is let go between them. Returns 0, or mlock's errno with nothing
  // left locked.
  static constexpr uint64_t kFaultChunk = uint64_t{16} << 20;
  static int LockInChunks(void* p, uint64_t bytes) {
    auto* c = static_cast<char*>(p);
    for (uint64_t off = 0; off < bytes; off += kFaultChunk) {
      if (::mlock(c + off, std::min(kFaultChunk, bytes - off)) != 0) {
        const int err = errno;
        // (mlock marks its range locked before it faults the pages in: the
        // chunk that failed may be locked in part.)
        (void)::munlock(c, off + std::min(kFaultChunk, bytes - off));
        return err;
      }
    }
    return 0;
  }

  // Faults every page of a mapping in (writes keep them: a region is fresh).
  // In chunks: a hugetlb region's faults hold the address space's lock
  // for as long as one call takes.
  // Returns 0, or the errno of pages the advice could not fault in for
  // another reason than its absence (a kernel before 5.14: the pages are
  // written to instead).
  static int Prefault(void* p, uint64_t bytes) {
    constexpr int kMadvPopulateWrite = 23;  // Linux 5.14
    auto* c = static_cast<char*>(p);
    uint64_t off = 0;
    for (; off < bytes; off += kFaultChunk) {
      if (::madvise(c + off, std::min(kFaultChunk, bytes - off), kMadvPopulateWrite) == 0) {
        continue;
      }
      if (errno != EINVAL) return errno;
      break;
    }
    for (auto* v = static_cast<volatile char*>(p); off < bytes; off += kPage) v[off] = 0;
    return 0;
  }

  // Bytes of the mapping at `base` on PMD (2 MiB) pages, from smaps.
  static uint64_t HugeBytesOf(void* base) {
    std::FILE* f = std::fopen("/proc/self/smaps", "r");
    if (f == nullptr) return 0;
    char line[512];
    bool in = false;
    uint64_t kb = 0;
    const auto want = reinterpret_cast<uintptr_t>(base);
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      unsigned long start = 0, end = 0;
      if (std::sscanf(line, "%lx-%lx ", &start, &end) == 2 && std::strchr(line, ':') != nullptr &&
          std::strchr(line, '-') < std::strchr(line, ' ')) {
        if (in) break;
        in = start == want;
        continue;
      }
      unsigned long v = 0;
      if (in && (std::sscanf(line, "ShmemPmdMapped: %lu kB", &v) == 1 ||
                 std::sscanf(line, "FilePmdMapped: %lu kB", &v) == 1)) {
        kb += v;
      }
    }
    std::fclose(f);
    return kb * 1024;
  }

 public:
  void* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  int fd() const { return fd_; }
  bool locked() const { return locked_; }
  int lock_error() const { return lock_error_; }  // mlock's errno, 0 if locked or not asked
  const std::string& name() const { return name_; }
  bool hugetlb() const { return hugetlb_; }
  uint64_t huge_bytes() const { return huge_bytes_; }
  // Why hugetlb pages were asked for and not had ("": not asked, or had).
  const std::string& hugetlb_refused() const { return hugetlb_refused_; }

 private:
  int fd_ = -1;
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  bool locked_ = false;
  int lock_error_ = 0;
  std::string name_;
  bool hugetlb_ = false;
  uint64_t huge_bytes_ = 0;
  std::string hugetlb_refused_;
};

}  // namespace

struct DramPool::Impl {
  DramPoolOptions options;
  mutable std::mutex mu;
  // The live regions by index. An index is never reused (a client may
  // still map a dropped region under it), and a dropped region leaves no
  // entry: a service that runs job after job keeps and walks only its
  // live regions.
  struct Slot {
    Region region;
    ExtentAllocator pages;   // in 4 KiB pages
    bool dedicated;          // one owner's, never carved for others
    bool read_only = false;  // shared read-only (SealRegion)
  };
  std::map<uint32_t, Slot> slots;
  // The regions' figures for stats(), kept as regions come and go: a walk
  // of every region per call made ztierd's per-job counters (a listing, a
  // scrape) quadratic in its jobs, under the engine's lock.
  DramPoolStats tally;
  // Counts `region` into the tally (sign +1) or out of it (-1).
  void Tally(const Region& region, int sign) {
    tally.regions += sign;
    tally.locked_regions += region.locked() ? sign : 0;
    tally.hugetlb_regions += region.hugetlb() ? sign : 0;
    tally.huge_page_bytes += sign * static_cast<int64_t>(region.huge_bytes());
  }
  void Add(uint32_t r, Slot slot) {
    Tally(slot.region, +1);
    slots.emplace(r, std::move(slot));
  }
  uint32_t next_region = 0;
  uint64_t reserved = 0;
  uint64_t used = 0;
  uint64_t outside = 0;  // HoldOutside: in use, in no region of this pool

  // What the budget has left to reserve (0 when outside holds pass it).
  uint64_t Left() const {
    return options.budget_bytes - std::min(options.budget_bytes, reserved + outside);
  }

  bool live(uint32_t r) const { return slots.count(r) != 0; }

  // ResourceExhausted, naming the figures, when `size` more bytes would pass
  // the budget.
  Status CheckBudget(uint64_t size, std::string_view owner) const {
    if (used + outside + size <= options.budget_bytes) return Status::Ok();
    return Status::ResourceExhausted(StrCat(owner, ": DRAM pool budget of ", options.budget_bytes,
                                            " bytes exceeded (", used + outside, " in use",
                                            outside == 0
                                                ? ""
                                                : StrCat(", ", outside,
                                                         " of them freed jobs' memory that "
                                                         "live clients still map"),
                                            ", ", size, " more requested)"));
  }

  // Makes a region of `bytes`, binds it to the NUMA node and records it
  // under the next index. A dedicated region keeps room for more seals.
  Result<uint32_t> AddRegion(const DramPoolOptions& o, uint64_t bytes, bool dedicated_region) {
    const uint32_t r = next_region;
    ZT_ASSIGN_OR_RETURN(Region region, Region::Make(o, bytes, r, /*final_seal=*/!dedicated_region));
    if (region.lock_error() != 0) WarnUnlocked(region);
    if (!region.hugetlb_refused().empty()) WarnHugetlbRefused(region);
    ZT_RETURN_IF_ERROR(BindToNode(region));
    ++next_region;
    reserved += region.bytes();
    const uint64_t units = region.bytes() / kPage;
    Add(r, Slot{std::move(region), ExtentAllocator(units), dedicated_region});
    return r;
  }

  // A region mlock refused: warned of once a pool (every job's regions
  // said it again, seven lines for one job), the later ones at info.
  bool unlocked_warned = false;
  void WarnUnlocked(const Region& region) {
    if (unlocked_warned) {
      ZT_LOG(kInfo, "engine") << "DRAM pool region " << region.name() << " (" << region.bytes()
                              << " bytes) is not locked either";
      return;
    }
    unlocked_warned = true;
    rlimit lim{};
    ::getrlimit(RLIMIT_MEMLOCK, &lim);
    const std::string limit =
        lim.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : StrCat(lim.rlim_cur, " bytes");
    ZT_LOG(kWarn, "engine") << "DRAM pool region " << region.name() << " (" << region.bytes()
                            << " bytes) is not locked: mlock failed with "
                            << std::strerror(region.lock_error()) << "; RLIMIT_MEMLOCK is " << limit
                            << " (set LimitMEMLOCK=infinity or ulimit -l unlimited; the pool's "
                               "later regions that are not locked are logged at info)";
  }

  // hugetlb pages asked for and not had: one warning a pool (it said so
  // of each region it made, a line per job and more), the later ones at info.
  bool hugetlb_warned = false;
  void WarnHugetlbRefused(const Region& region) {
    if (hugetlb_warned) {
      ZT_LOG(kInfo, "engine") << "DRAM pool region " << region.name()
                              << " has no hugetlb pages either";
      return;
    }
    hugetlb_warned = true;
    ZT_LOG(kWarn, "engine") << "hugetlb pages unavailable for the DRAM pool ("
                            << region.hugetlb_refused()
                            << "; reserve them in /proc/sys/vm/nr_hugepages): using transparent "
                               "huge pages (the pool's later regions without them are logged at "
                               "info)";
  }

  // Unmaps region r (its memfd closed once every other mapping is gone);
  // its index is never reused.
  void Drop(uint32_t r) {
    auto it = slots.find(r);
    reserved -= it->second.region.bytes();
    Tally(it->second.region, -1);
    slots.erase(it);
  }

  // Makes room for `size` more reserved bytes by dropping empty shared
  // regions (kept only to save their making again).
  void DropEmptySharedRegions(uint64_t size) {
    for (auto it = slots.begin(); it != slots.end() && Left() < size;) {
      const Slot& s = it->second;
      const bool empty = !s.dedicated && s.pages.free_units() == s.pages.total_units();
      auto next = std::next(it);
      if (empty) Drop(it->first);
      it = next;
    }
  }

  Status BindToNode(Region& r) {
    if (options.numa_node < 0) return Status::Ok();
    hwloc_topology_t topo = nullptr;
    if (hwloc_topology_init(&topo) != 0) return PosixError("hwloc_topology_init", errno);
    Status s;
    if (hwloc_topology_load(topo) != 0) {
      s = PosixError("hwloc_topology_load", errno);
    } else if (hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE) > 1) {
      hwloc_obj_t node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, options.numa_node);
      if (node == nullptr) {
        s = Status::InvalidArgument(StrCat("NUMA node ", options.numa_node, " does not exist"));
      } else if (hwloc_set_area_membind(topo, r.base(), r.bytes(), node->nodeset,
                                        HWLOC_MEMBIND_BIND,
                                        HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_MIGRATE) != 0) {
        ZT_LOG(kWarn, "engine") << "cannot bind DRAM pool memory to NUMA node " << options.numa_node
                                << ": " << std::strerror(errno);
      }
    }
    hwloc_topology_destroy(topo);
    return s;
  }
};

DramPool::DramPool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DramPool::~DramPool() = default;

Result<std::unique_ptr<DramPool>> DramPool::Create(const DramPoolOptions& options) {
  if (options.budget_bytes == 0) {
    return Status::InvalidArgument("DRAM pool budget must be > 0 bytes");
  }
  if (options.region_bytes == 0 || options.region_bytes % kHugePage != 0) {
    return Status::InvalidArgument(StrCat("DRAM pool region size ", options.region_bytes,
                                          " must be a positive multiple of 2 MiB"));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  // A shared region reserves more than it holds at first; keep that slack to
  // a sixteenth of the budget, so the room dedicated regions need is there.
  impl->options.region_bytes = std::min(
      options.region_bytes, std::max(kHugePage, options.budget_bytes / 16 / kHugePage * kHugePage));
  return std::unique_ptr<DramPool>(new DramPool(std::move(impl)));
}

Result<DramBlock> DramPool::Allocate(uint64_t bytes, std::string_view owner) {
  Impl& p = *impl_;
  if (bytes == 0) return Status::InvalidArgument(StrCat(owner, ": DRAM block of 0 bytes"));
  const uint64_t size = RoundUp(bytes, kPage);
  std::lock_guard<std::mutex> lock(p.mu);
  ZT_RETURN_IF_ERROR(p.CheckBudget(size, owner));
  // First fit in an existing shared region.
  for (auto& [r, slot] : p.slots) {
    if (slot.dedicated) continue;
    uint64_t first = 0;
    if (!slot.pages.AllocateContiguous(size / kPage, &first)) continue;
    p.used += size;
    const uint64_t off = first * kPage;
    return DramBlock{static_cast<uint8_t*>(slot.region.base()) + off, size, r, off};
  }
  // A new region: the standard size, or one just for this block, never
  // reserving past the budget (pinned memory is what the budget protects).
  // Cut to a whole number of such blocks: a job's blocks are mostly of one
  // size (its layers'), and blocks past half a region left the rest of each
  // region unused (a fifth of the budget, and a job the budget's check let
  // in failed as it allocated). Hugetlb pages need whole huge pages.
  p.DropEmptySharedRegions(size);
  const uint64_t room = p.Left() / kPage * kPage;
  const uint64_t standard = std::max(p.options.region_bytes, RoundUp(size, kHugePage));
  // (Small blocks keep the standard size: what is left past the last of
  // them is small, and other blocks use it.)
  uint64_t fit = size * 8 > standard ? standard / size * size : standard;
  if (p.options.huge_pages == HugePages::kHugetlb) {
    fit = std::min(standard, RoundUp(fit, kHugePage));
  }
  const uint64_t make = std::min(fit, room);
  if (make < size) {
    return Status::ResourceExhausted(StrCat(owner, ": DRAM pool budget of ", p.options.budget_bytes,
                                            " bytes exceeded: no region has a free run of ", size,
                                            " bytes and only ", room,
                                            " bytes are left to reserve"));
  }
  ZT_ASSIGN_OR_RETURN(const uint32_t r, p.AddRegion(p.options, make, /*dedicated=*/false));
  uint64_t first = 0;
  ZT_CHECK(p.slots.at(r).pages.AllocateContiguous(size / kPage, &first) && first == 0);
  p.used += size;
  return DramBlock{p.slots.at(r).region.base(), size, r, 0};
}

uint64_t DramPool::ReleaseEmpty() {
  Impl& p = *impl_;
  std::lock_guard<std::mutex> lock(p.mu);
  const uint64_t before = p.reserved;
  p.DropEmptySharedRegions(UINT64_MAX);
  return before - p.reserved;
}

Result<uint32_t> DramPool::CreateRegion(uint64_t bytes, std::string_view owner) {
  Impl& p = *impl_;
  if (bytes == 0) return Status::InvalidArgument(StrCat(owner, ": a region of 0 bytes"));
  const uint64_t size = RoundUp(bytes, kPage);
  // The budget and an index are taken under the lock; the region is made
  // (its pages faulted in and locked: a minute for a large model's) without
  // it, so every other user of the pool (ztierd's other jobs, its stats
  // and its accept loop) goes on meanwhile.
  uint32_t r = 0;
  DramPoolOptions o;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    ZT_RETURN_IF_ERROR(p.CheckBudget(size, owner));
    p.DropEmptySharedRegions(size);
    if (p.Left() < size) {
      return Status::ResourceExhausted(StrCat(owner, ": DRAM pool budget of ",
                                              p.options.budget_bytes, " bytes exceeded: ", p.Left(),
                                              " bytes are left to reserve, ", size, " requested"));
    }
    r = p.next_region++;
    p.reserved += size;
    p.used += size;  // all of it is the owner's
    o = p.options;
  }
  // Never hugetlb: a client could punch holes in it and release the
  // reservation the engine's mapping faults on.
  if (o.huge_pages == HugePages::kHugetlb) o.huge_pages = HugePages::kTransparent;
  Result<Region> region = Region::Make(o, size, r, /*final_seal=*/false);
  Status bound = region.ok() ? p.BindToNode(*region) : region.status();
  std::lock_guard<std::mutex> lock(p.mu);
  if (!bound.ok()) {
    p.reserved -= size;
    p.used -= size;
    return bound;
  }
  if (region->lock_error() != 0) p.WarnUnlocked(*region);
  p.Add(r, Impl::Slot{std::move(*region), ExtentAllocator(size / kPage), true});
  return r;
}

Result<DramBlock> DramPool::AllocateIn(uint32_t region, uint64_t bytes, std::string_view owner) {
  Impl& p = *impl_;
  if (bytes == 0) return Status::InvalidArgument(StrCat(owner, ": DRAM block of 0 bytes"));
  const uint64_t size = RoundUp(bytes, kPage);
  std::lock_guard<std::mutex> lock(p.mu);
  ZT_CHECK_MSG(p.live(region) && p.slots.at(region).dedicated, "AllocateIn: region ", region,
               " is not a live dedicated region");
  uint64_t first = 0;
  if (!p.slots.at(region).pages.AllocateContiguous(size / kPage, &first)) {
    return Status::ResourceExhausted(StrCat(owner, ": region ", region, " of ",
                                            p.slots.at(region).region.bytes(),
                                            " bytes has no free run of ", size, " bytes"));
  }
  const uint64_t off = first * kPage;
  return DramBlock{static_cast<uint8_t*>(p.slots.at(region).region.base()) + off, size, region,
                   off};
}

Status DramPool::SealRegion(uint32_t region, RegionAccess others) {
  Impl& p = *impl_;
  std::lock_guard<std::mutex> lock(p.mu);
  ZT_CHECK_MSG(p.live(region) && p.slots.at(region).dedicated, "SealRegion: region ", region,
               " is not a live dedicated region");
  // All at once, and checked: a client must never be able to shrink the
  // memfd under the engine's mapping (SIGBUS). A read-only region is
  // shared through a read-only open of it (ShareFd) and made 0444: no
  // writable mapping, write or reopen for write by another user; not
  // F_SEAL_FUTURE_WRITE, which would keep its pages from being punched
  // (DestroyRegion) while a client holds it, memory no quota then counts.
  const int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  const int fd = p.slots.at(region).region.fd();
  if (others == RegionAccess::kReadOnly) {
    if (::fchmod(fd, 0444) != 0) {
      return PosixError(StrCat("making DRAM region ", region, " read-only for other users"), errno);
    }
    p.slots.at(region).read_only = true;
  }
  if (::fcntl(fd, F_ADD_SEALS, want) != 0) {
    const int err = errno;
    return PosixError(StrCat("sealing DRAM region ", region,
                             others == RegionAccess::kReadOnly ? " read-only for other processes"
                                                               : " against resizing"),
                      err);
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & want) != want) {
    return Status::Unimplemented(StrCat("DRAM region ", region, ": the kernel kept seals 0x",
                                        std::hex, seals, " of 0x", want,
                                        "; sharing it with other processes would not be safe"));
  }
  return Status::Ok();
}

void DramPool::DestroyRegion(uint32_t region) {
  Impl& p = *impl_;
  std::lock_guard<std::mutex> lock(p.mu);
  ZT_CHECK_MSG(p.live(region) && p.slots.at(region).dedicated, "DestroyRegion: region ", region,
               " is not a live dedicated region");
  // Its pages go now, whoever else still holds the memfd (a client, or a
  // child it forked that kept the fds: their memory was in no one's quota
  // nor in the budget); what they read of it after is new zeroed pages,
  // theirs.
  const Region& r = p.slots.at(region).region;
  (void)::fallocate(r.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                    static_cast<off_t>(r.bytes()));
  p.used -= r.bytes();
  p.Drop(region);
}

void DramPool::Free(const DramBlock& block) {
  Impl& p = *impl_;
  // Validate under the lock, zero outside it (the block is still owned by
  // the caller), then return its pages.
  auto check = [&] {
    ZT_CHECK_MSG(p.live(block.region), "DRAM block of a region that is gone: ", block.region);
    const Region& r = p.slots.at(block.region).region;
    ZT_CHECK_MSG(static_cast<uint8_t*>(r.base()) + block.offset == block.ptr &&
                     block.offset + block.bytes <= r.bytes() && block.bytes % kPage == 0,
                 "DRAM block does not belong to region ", block.region);
  };
  {
    std::lock_guard<std::mutex> lock(p.mu);
    check();
  }
  std::memset(block.ptr, 0, block.bytes);
  std::lock_guard<std::mutex> lock(p.mu);
  check();
  const bool freed = p.slots.at(block.region).pages.Free(block.offset / kPage, block.bytes / kPage);
  ZT_CHECK_MSG(freed, "DRAM block at offset ", block.offset, " of region ", block.region,
               " freed twice");
  if (!p.slots.at(block.region).dedicated)
    p.used -= block.bytes;  // a dedicated region counts whole
}

Result<UniqueFd> DramPool::ShareFd(uint32_t region) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->live(region)) return Status::NotFound(StrCat("DRAM region ", region, " is gone"));
  const Impl::Slot& slot = impl_->slots.at(region);
  const int fd = slot.region.fd();
  UniqueFd copy(slot.read_only ? ::open(StrCat("/proc/self/fd/", fd).c_str(), O_RDONLY | O_CLOEXEC)
                               : ::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) {
    const int err = errno;
    return PosixError(StrCat(slot.read_only ? "open of /proc/self/fd/" : "dup of fd ", fd,
                             " to share DRAM region ", region),
                      err);
  }
  return copy;
}

int DramPool::region_fd(uint32_t region) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->live(region) ? impl_->slots.at(region).region.fd() : -1;
}

std::pair<void*, uint64_t> DramPool::region(uint32_t region) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->live(region)) return {nullptr, 0};
  return {impl_->slots.at(region).region.base(), impl_->slots.at(region).region.bytes()};
}

std::vector<std::pair<void*, uint64_t>> DramPool::regions() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::pair<void*, uint64_t>> out;
  for (const auto& [r, slot] : impl_->slots)
    out.emplace_back(slot.region.base(), slot.region.bytes());
  return out;
}

DramPoolStats DramPool::stats() const {
  const Impl& p = *impl_;
  std::lock_guard<std::mutex> lock(p.mu);
  DramPoolStats s = p.tally;
  s.budget_bytes = p.options.budget_bytes;
  s.reserved_bytes = p.reserved + p.outside;
  s.used_bytes = p.used + p.outside;
  if (p.reserved > 0) s.page_bytes = 2 * s.huge_page_bytes >= p.reserved ? kHugePage : kPage;
  return s;
}

void DramPool::HoldOutside(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->outside += bytes;
}

void DramPool::ReleaseOutside(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ZT_CHECK_MSG(bytes <= impl_->outside, "ReleaseOutside of ", bytes, " B, more than held (",
               impl_->outside, ")");
  impl_->outside -= bytes;
}

std::string ShmemHugePagePolicy() {
  std::FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
  if (f == nullptr) return "";
  char buf[256] = {};
  const bool read = std::fgets(buf, sizeof(buf), f) != nullptr;
  std::fclose(f);
  if (!read) return "";
  // "always within_size advise [never] deny force": the bracketed one is in effect.
  const char* open = std::strchr(buf, '[');
  const char* close = open != nullptr ? std::strchr(open, ']') : nullptr;
  if (open == nullptr || close == nullptr) return "";
  return std::string(open + 1, close);
}

}  // namespace ztier::engine
