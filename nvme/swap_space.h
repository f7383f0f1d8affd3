// ztier nvme: swap space on NVMe drives (public header of the component).
//
// A SwapSpace stores and returns byte ranges of named *swap objects* in swap
// files, one per configured path (one directory per drive). It knows nothing
// of jobs or optimizers.
//
// Ownership. Each path is locked (common/dir_lock.h, lock file
// "ztier-swap.lock") for the swap space's life, so a second swap space on a
// path, in this process or another, is refused at once with the holder's
// pid; a dead owner's lock never blocks. A new swap space truncates what a
// dead owner left in its file. Close() deletes the swap files unless
// SwapOptions::keep_files (a space reopened from a manifest keeps them).
//
// Layout and size. An object's bytes are cut in stripe units (default 1 MiB,
// a multiple of 4 KiB) laid round-robin across the paths, so reading one
// object keeps every drive busy. Each file has a free-extent allocator (first
// fit, coalescing on free). Files start empty and grow as objects need room:
// every file by the same step (growth_bytes, or an eighth of its size, but
// at most half of what its filesystem has free beyond the need; with
// fallocate so that space is reserved up front), up to max_file_bytes when it
// is set. Out of space (the cap, or a full disk) is ResourceExhausted naming
// the path and changes nothing; files do not shrink until closed.
//
// I/O. One io_uring per path, owned by one I/O thread per path: the thread
// batches submissions up to the path's queue depth and reaps completions from
// the shared ring without a syscall per I/O. One owner per ring means no lock
// on the submission path, drives work in parallel, and checksums of one
// drive's data are computed on that drive's thread. Staging buffers (queue
// depth x stripe unit per path, 4 KiB aligned) are registered as fixed
// buffers; user buffers that are 4 KiB aligned with 4 KiB multiple lengths
// go to the disk directly, others bounce through a staging buffer.
// Short transfers are resubmitted for the rest, -EAGAIN/-EINTR retried,
// anything else fails the request with the path, offset and errno.
//
// Writes must cover whole stripe units: start at a unit boundary of the
// object and end at a unit boundary or at the object's end (the engine writes
// whole buffers). Reads may cover any byte range.
//
// Integrity. With checksums on (default), every stripe unit carries a CRC-32C
// of its bytes, kept in the extent map and checked on every read: a mismatch
// is a Corruption status naming the object, offset and path. A unit whose
// last write failed reads back as an IoError, never as stale bytes.
//
// Durability. Sync() fdatasyncs every swap file through io_uring. An fsync
// failure is fatal for the swap space: every later call returns
// FailedPrecondition (retrying an fsync can report success while data is
// lost). SaveManifest() syncs, then writes the extent map to a temp file,
// fsyncs it, renames it over the old manifest and fsyncs the directory.
// Open() restores a swap space from its manifest; a truncated or corrupt
// manifest is a Corruption error.
//
// Thread safety: every method may be called from any thread concurrently.
// Overlapping writes to the same range in flight at once, or a read racing a
// write of the same range, give one of the two contents (not torn checksums:
// such a read may fail with Corruption). Buffers must stay valid until the
// request completes.
#ifndef ZTIER_NVME_SWAP_SPACE_H_
#define ZTIER_NVME_SWAP_SPACE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ztier::nvme {

class IoBackend;

struct SwapOptions {
  std::vector<std::string> paths;              // one directory per drive (must exist)
  uint64_t max_file_bytes = 0;                 // cap on each swap file; 0: the disk's free space
  uint64_t growth_bytes = uint64_t{64} << 20;  // smallest growth step of the files
  uint64_t stripe_bytes = 1 << 20;             // stripe unit, multiple of 4 KiB
  uint32_t queue_depth = 16;                   // in-flight I/Os per path
  bool checksums = true;                       // CRC-32C per stripe unit
  bool keep_files = false;                     // leave the swap files on Close()
  std::string file_name = "ztier.swap";        // swap file name inside each path
};

struct ObjectInfo {
  uint64_t id = 0;
  std::string name;
  uint64_t size = 0;
};

enum class IoDirection : uint8_t { kRead, kWrite };

// One byte range of one object and the buffer it goes to or comes from.
struct IoRange {
  uint64_t object = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  void* buffer = nullptr;
};

// Completion of one Submit(): wait on it, poll it, or get a callback.
class IoTicket {
 public:
  IoTicket() = default;
  // Blocks until every range of the request is done; the first error, if any.
  Status Wait() const;
  bool Done() const;
  bool valid() const { return state_ != nullptr; }

  struct State;

 private:
  friend class SwapSpace;
  explicit IoTicket(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};

struct SwapStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t reads = 0;    // disk ops
  uint64_t writes = 0;   // disk ops
  uint64_t retries = 0;  // short transfers resubmitted, EAGAIN/EINTR
  uint64_t bounced_bytes = 0;
};

class SwapSpace {
 public:
  // Locks the paths and creates empty swap files (truncating stale ones).
  // A null backend is MakeBackend(kAuto): io_uring, or threads where the
  // kernel refuses io_uring. Errors: InvalidArgument (options), NotFound (a
  // path is missing), Unavailable (a path is locked by another swap space,
  // naming its holder), FailedPrecondition (a filesystem cannot do
  // O_DIRECT), IoError.
  static Result<std::unique_ptr<SwapSpace>> Create(const SwapOptions& options,
                                                   std::shared_ptr<IoBackend> backend = nullptr);
  // Reopens a swap space from a manifest written by SaveManifest(). Options
  // other than queue_depth are taken from the manifest; the files are kept
  // on Close(). Errors: as Create, plus Corruption (manifest damaged,
  // truncated, inconsistent, of another version, or files of the wrong size).
  static Result<std::unique_ptr<SwapSpace>> Open(const std::string& manifest_path,
                                                 uint32_t queue_depth = 16,
                                                 std::shared_ptr<IoBackend> backend = nullptr);

  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // A new object of `bytes` bytes (> 0), growing the files if needed; units
  // an earlier object freed have their blocks reserved again first.
  // Errors: AlreadyExists (name taken), ResourceExhausted (the cap or a full
  // disk, naming the path, free and needed bytes), InvalidArgument, IoError.
  Result<uint64_t> Allocate(std::string_view name, uint64_t bytes);
  // Frees the object's space: its blocks go back to the drives (a hole in
  // the file, where the filesystem can punch one; the files keep their
  // size), and the last object freed empties the files. Errors: NotFound,
  // FailedPrecondition (I/O in flight).
  Status Free(uint64_t id);
  Result<ObjectInfo> Find(std::string_view name) const;
  std::vector<ObjectInfo> Objects() const;

  // Starts reads or writes of several ranges as one request. Range errors
  // (unknown object, out of bounds, unaligned write) are reported through the
  // ticket, which is then already done. `on_done` (optional) runs on an I/O
  // thread when the request completes; it must not block.
  IoTicket Submit(IoDirection dir, std::span<const IoRange> ranges,
                  std::function<void(const Status&)> on_done = {});
  // An eventfd (non-blocking, close-on-exec) that counts completed requests:
  // poll it beside other sources, read it to reset, then check tickets with
  // Done(). Owned by the swap space; valid until it is destroyed.
  int completion_fd() const;

  // Synchronous helpers.
  Status Write(uint64_t object, uint64_t offset, const void* data, uint64_t length);
  Status Read(uint64_t object, uint64_t offset, void* data, uint64_t length);

  // Makes every completed write durable. Errors: IoError (then the swap space
  // is failed for good), FailedPrecondition (already failed).
  Status Sync();
  // Sync(), then writes the extent map atomically to `path`.
  Status SaveManifest(const std::string& path);
  // Stops the I/O threads and closes the files (deleting them unless
  // keep_files); waits for requests in flight; releases the path locks.
  Status Close();

  const SwapOptions& options() const;
  // Bytes the swap files take on the drives now (all paths).
  uint64_t file_bytes() const;
  // Bytes free inside the files now (more come by growing them).
  uint64_t free_bytes() const;
  SwapStats stats() const;
  // Per path, in the order of options().paths: the bytes the swap file
  // holds on the drive (its size less the holes of freed units), the
  // bytes its objects take in it, and what it may grow to (the cap,
  // ztier.nvme_capacity, else what it holds plus the room the files can
  // grow by: they grow in lockstep, so the least free space of any path's
  // filesystem, shared among the paths on it); the disk operations waiting
  // there and, while some do, the seconds since one last finished; and
  // what is wrong with it, if anything: the swap space failed (an fsync
  // refused), its filesystem is read-only, its last write (else read)
  // failed, or a read since the space opened gave back bytes that did not
  // match their checksum (kept until it closes).
  struct PathUsage {
    std::string path;
    uint64_t used_bytes = 0;
    uint64_t file_bytes = 0;
    uint64_t capacity_bytes = 0;
    uint64_t waiting = 0;
    double quiet_seconds = 0;
    std::string problem;
  };
  std::vector<PathUsage> path_usage() const;
  // The swap files whose drive has not finished a disk operation for at
  // least `quiet` while some wait there (a stalled or dead drive, for the
  // messages of waits that time out): the file, the operations waiting, and
  // the seconds since the last one finished (or since the first went in).
  struct Stall {
    std::string file;
    uint64_t waiting = 0;
    double seconds = 0;
  };
  std::vector<Stall> stalls(std::chrono::milliseconds quiet) const;
  // The same, said in one sentence for an error message ("" when none is).
  std::string StallNote(std::chrono::milliseconds quiet) const;

  struct Impl;

 private:
  explicit SwapSpace(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ztier::nvme

#endif  // ZTIER_NVME_SWAP_SPACE_H_
