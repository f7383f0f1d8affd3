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
// prefaulted: making them again is the expensive part).
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
#include "engine/wire_types.h"

namespace ztier::engine {

enum class HugePages : uint8_t {
  kNone,         // 4 KiB pages
  kTransparent,  // madvise(MADV_HUGEPAGE) (default)
  kHugetlb,      // MFD_HUGETLB 2 MiB pages; falls back to kTransparent with a warning
};

struct DramPoolOptions {
  uint64_t budget_bytes = 0;                    // hard cap over all regions (> 0)
  uint64_t region_bytes = uint64_t{256} << 20;  // size of a shared region
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

  // The memfd of a region, for passing to another process.
  int region_fd(uint32_t region) const;
  // Every region made so far, {base, bytes}, in region order (for
  // registering them with a device for DMA).
  std::vector<std::pair<void*, uint64_t>> regions() const;
  DramPoolStats stats() const;

  struct Impl;

 private:
  explicit DramPool(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_DRAM_POOL_H_
