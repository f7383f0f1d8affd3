// ztier engine internal: the pinned host DRAM pool.
//
// Memory comes in regions, each a memfd (MFD_CLOEXEC | MFD_ALLOW_SEALING;
// MFD_HUGETLB when hugetlb pages are asked for and the kernel has them, else
// transparent huge pages advised before the first touch) sized with
// ftruncate, sealed against shrink and grow, mapped shared, prefaulted and
// mlock'ed when the process may lock that much (otherwise a warning that
// says why; DMA still works, the kernel pins pages on registration), and
// bound to a NUMA node through hwloc when the machine has more than one. A
// region's fd and a block's offset in it let another process (a client) map
// the same bytes. The pages a region really got are read back from
// /proc/self/smaps: transparent huge pages on shared memory need the
// kernel's shmem_enabled to allow them ("never" is a common default), so
// stats() reports what was given, not what was asked.
//
// Blocks are carved from regions by a first-fit allocator in 4 KiB pages;
// a request larger than the region size gets a region of its own. The pool
// has a hard byte budget over all regions; a request past it is
// ResourceExhausted naming the budget. Freed blocks are zeroed before they can
// be handed to anyone else. Empty regions are kept (they are pinned and
// prefaulted: making them again is the expensive part) until a dedicated
// region needs their room, or ReleaseEmpty (a daemon with no jobs).
//
// Shared regions hold what never leaves this process (optimizer states,
// rings); dedicated regions (CreateRegion) hold what a job shares with its
// clients, one owner each, sealed by access (SealRegion) and destroyed with
// the job.
//
// Thread safety: every method may be called concurrently.
#ifndef ZTIER_ENGINE_DRAM_POOL_H_
#define ZTIER_ENGINE_DRAM_POOL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "engine/wire_types.h"

namespace ztier::engine {

enum class HugePages : uint8_t {
  kNone,         // 4 KiB pages
  kTransparent,  // madvise(MADV_HUGEPAGE) (default)
  kHugetlb,      // MFD_HUGETLB 2 MiB pages; falls back to kTransparent with a warning
};

struct DramPoolOptions {
  uint64_t budget_bytes = 0;  // hard cap over all regions (> 0)
  // Size of a shared region, at most a sixteenth of the budget (2 MiB at
  // least): the room a region reserves before it is full stays small.
  uint64_t region_bytes = uint64_t{256} << 20;
  HugePages huge_pages = HugePages::kTransparent;
  bool lock = true;            // mlock regions when allowed
  int numa_node = -1;          // -1: no binding
  std::string name = "ztier";  // memfd name prefix (shows in /proc/<pid>/fd)
};

struct DramBlock {
  void* ptr = nullptr;
  uint64_t bytes = 0;   // rounded up to 4 KiB
  uint32_t region = 0;  // region index: region_fd(region) maps it
  uint64_t offset = 0;  // offset of the block in its region
};

// Why transparent huge pages may be missing: the kernel's
// /sys/kernel/mm/transparent_hugepage/shmem_enabled choice ("never",
// "advise", ...), or "" where the file is not there.
std::string ShmemHugePagePolicy();

class DramPool {
 public:
  // Errors: InvalidArgument (budget 0, region size not a multiple of 2 MiB).
  static Result<std::unique_ptr<DramPool>> Create(const DramPoolOptions& options);
  ~DramPool();
  DramPool(const DramPool&) = delete;
  DramPool& operator=(const DramPool&) = delete;

  // A zeroed block of at least `bytes` (> 0), 4 KiB aligned. `owner` names
  // the requester in errors. Errors: ResourceExhausted (over budget, naming
  // it and the bytes in use), IoError/ResourceExhausted from memfd/mmap.
  Result<DramBlock> Allocate(uint64_t bytes, std::string_view owner);
  // Zeroes the block and returns it to its region. A block not from this pool
  // (or freed twice) is a programmer error and aborts.
  void Free(const DramBlock& block);

  // Dedicated regions: memory one owner (a job) shares with other processes.
  // A dedicated region is never carved for anyone else; its whole size
  // counts as used from creation (empty shared regions are dropped to make
  // room under the budget); its index is never reused, even after
  // DestroyRegion, so a client that mapped it can never be handed another
  // job's memory under the same index. Errors: InvalidArgument (0 bytes),
  // ResourceExhausted (the budget, naming the figures), PosixError.
  Result<uint32_t> CreateRegion(uint64_t bytes, std::string_view owner);
  // A zeroed block of a dedicated region. Errors: ResourceExhausted (no free
  // run that long). A region that is not live and dedicated aborts.
  Result<DramBlock> AllocateIn(uint32_t region, uint64_t bytes, std::string_view owner);
  // Adds the final seals (no shrinking or growing, no more seals); with
  // kReadOnly the memfd is made 0444 and ShareFd hands out read-only opens
  // of it: another user can neither map it writable, write it nor reopen
  // it for writing (through /proc), while this pool's own mapping stays
  // writable and its pages can still be punched (DestroyRegion). (A
  // process of this pool's own user, or root, could reopen it for writing;
  // it could write this process's memory anyway.) Errors: PosixError.
  Status SealRegion(uint32_t region, RegionAccess others);
  // A live region's memfd to pass to another process: a read-only open of
  // it for a region sealed kReadOnly, else a duplicate. Errors: NotFound
  // (no such live region), PosixError.
  Result<UniqueFd> ShareFd(uint32_t region) const;
  // Frees a dedicated region's pages (whoever else holds its memfd), unmaps
  // it and returns its bytes to the budget.
  void DestroyRegion(uint32_t region);
  // Memory in use that is in no live region: a destroyed region that a
  // live client still maps (its pages stay allocated). Counted against the
  // budget, as reserved and used, until released; may take the pool past
  // its budget (it is in use already), which then refuses new blocks.
  // Releasing more than is held is a programmer error.
  void HoldOutside(uint64_t bytes);
  void ReleaseOutside(uint64_t bytes);
  // Unmaps every shared region that holds no block, giving its pinned
  // memory back to the system; returns the bytes released.
  uint64_t ReleaseEmpty();

  // The memfd of a live region, for passing to another process; -1 if none.
  int region_fd(uint32_t region) const;
  // A live region's {base, bytes}; {nullptr, 0} if none.
  std::pair<void*, uint64_t> region(uint32_t region) const;
  // Every live region, {base, bytes}, in region order (for registering them
  // with a device for DMA).
  std::vector<std::pair<void*, uint64_t>> regions() const;
  DramPoolStats stats() const;

  struct Impl;

 private:
  explicit DramPool(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_DRAM_POOL_H_
