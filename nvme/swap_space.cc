// ztier nvme: SwapSpace implementation (see swap_space.h for the contract).
//
// Structure: Impl holds the object map (under map_mu_) and one PathIo per
// swap file. Submit() cuts each range into per-stripe-unit Pieces and queues
// them on their path; each PathIo thread moves pieces through its IoQueue,
// resubmits short transfers, checks or records checksums and completes the
// request's ticket when its last piece is done.
#include "nvme/swap_space.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/crc32c.h"
#include "common/dir_lock.h"
#include "common/extent_allocator.h"
#include "common/file_util.h"
#include "common/log.h"
#include "common/thread.h"
#include "nvme/io_backend.h"
#include "nvme/swap_manifest.h"

namespace ztier::nvme {

namespace {

constexpr uint64_t kBlock = 4096;
constexpr int kMaxRetries = 64;
// In each swap directory: the lock that keeps a second swap space out.
constexpr char kLockFile[] = "ztier-swap.lock";

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kBlock == 0; }

enum class UnitState : uint8_t { kUnwritten = 0, kValid = 1, kFailed = 2 };

struct Unit {
  uint64_t file_offset;
  uint32_t crc;
  UnitState state;
};

struct Object {
  uint64_t id;
  std::string name;
  uint64_t size;
  uint32_t start_path;
  std::vector<Unit> units;
  uint32_t inflight = 0;  // pieces queued or on disk
};

// Owns a 4 KiB aligned allocation.
struct AlignedBuffer {
  void* ptr = nullptr;
  explicit AlignedBuffer(size_t bytes) : ptr(std::aligned_alloc(kBlock, RoundUp(bytes, kBlock))) {}
  AlignedBuffer(AlignedBuffer&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)) {}
  AlignedBuffer& operator=(AlignedBuffer&&) = delete;
  ~AlignedBuffer() { std::free(ptr); }
};

}  // namespace

struct IoTicket::State {
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  bool done = false;
  Status status;
  std::function<void(const Status&)> on_done;
  int event_fd = -1;  // the swap space's completion eventfd

  void Finish(const Status& s) {
    std::function<void(const Status&)> cb;
    Status final_status;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!s.ok() && status.ok()) status = s;
      if (--pending > 0) return;
      cb = std::move(on_done);
      final_status = status;
    }
    // The callback runs before waiters are released: Wait() returning means
    // the callback is done too.
    if (cb) cb(final_status);
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
    }
    cv.notify_all();
    if (event_fd >= 0) {
      const uint64_t one = 1;
      // Cannot fail short of a counter overflow (2^64 - 2 completions unread).
      [[maybe_unused]] ssize_t n = ::write(event_fd, &one, sizeof(one));
    }
  }
};

Status IoTicket::Wait() const {
  if (!state_) return Status::FailedPrecondition("Wait() on an empty IoTicket");
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

bool IoTicket::Done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One disk operation: a stripe unit (or what remains of it after a short
// transfer), or an fsync.
struct Piece {
  std::shared_ptr<IoTicket::State> ticket;
  IoKind kind = IoKind::kRead;
  uint64_t object = 0;
  size_t unit = 0;
  uint64_t file_offset = 0;  // of the unit
  uint32_t disk_len = 0;     // bytes moved to/from disk (multiple of 4 KiB)
  uint32_t unit_bytes = 0;   // object bytes in the unit
  uint8_t* user = nullptr;   // caller's buffer for this piece
  uint32_t user_off = 0;     // reads: where the caller's range starts in the unit
  uint32_t user_len = 0;
  bool direct = false;  // disk I/O uses `user` itself
  int staging = -1;
  uint32_t done = 0;  // bytes transferred so far
  int retries = 0;
  uint32_t expected_crc = 0;  // reads: the unit's crc at submit
  UnitState expected_state = UnitState::kUnwritten;
  uint64_t object_offset = 0;  // of the unit, for messages
};

}  // namespace

struct SwapSpace::Impl {
  SwapOptions options;
  std::shared_ptr<IoBackend> backend;

  // ---- one per swap file ----
  struct PathIo {
    Impl* owner = nullptr;
    uint32_t index = 0;
    std::string file;
    int fd = -1;
    bool sparse_warned = false;  // told once that this path cannot preallocate
    // By stripe unit of the file: freed, and its blocks given back to the
    // drive (a hole), to be reserved again before it is handed out. Under
    // map_mu, as is `holes`, the count of units marked so.
    std::vector<bool> punched;
    uint64_t holes = 0;
    void MarkHoles(uint64_t start, uint64_t count, bool hole) {
      for (uint64_t k = start; k < start + count; ++k) {
        if (punched[k] != hole) {
          punched[k] = hole;
          holes += hole ? 1 : uint64_t(-1);
        }
      }
    }
    // The file passed the ownership check (a plain file of ours with one
    // name): only then is it removed with the space. One that was refused
    // stays where it is, as the message says.
    bool owned = false;
    std::unique_ptr<IoQueue> queue;
    std::vector<AlignedBuffer> staging;
    bool fixed = false;
    std::vector<int> free_staging;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Piece*> pending;
    std::vector<Piece*> retry, starting;  // owned by the thread
    std::unordered_set<Piece*> in_ring;   // queued on the ring or on disk; the thread's
    Status broken;  // the ring's submits failed for good: every piece fails so; the thread's
    bool stop = false;
    std::thread thread;

    // Pieces given to this path and not finished, and when the path last
    // moved: a piece finished, or the first went in while none waited
    // (steady clock, ns). Read through Quiet() from any thread.
    std::atomic<uint64_t> waiting{0};
    std::atomic<int64_t> moved_ns{0};
    // The pieces waiting and, while some do, the seconds since the path
    // last moved (0, not less, when one finished as the clock was read).
    std::pair<uint64_t, double> Quiet() const {
      const uint64_t n = waiting.load(std::memory_order_seq_cst);
      if (n == 0) return {0, 0.0};
      const int64_t since = moved_ns.load(std::memory_order_relaxed);
      return {n, static_cast<double>(std::max<int64_t>(NowNs() - since, 0)) * 1e-9};
    }
    // By kind (read, write): the errno of the last one here that the
    // drive refused, 0 once one succeeds again (a path gone read-only
    // fails its writes and still reads; a dying drive).
    std::atomic<int> last_errno[2] = {0, 0};
    // Reads whose bytes did not match their checksum, and the file offset
    // of the last (kept: a drive that gave back other bytes once is not
    // trusted again because the next read matched).
    std::atomic<uint64_t> bad_checksums{0};
    std::atomic<uint64_t> last_bad_offset{0};
    void Moved() { moved_ns.store(NowNs(), std::memory_order_relaxed); }

    void Enqueue(Piece* p) {
      {
        std::lock_guard<std::mutex> lock(mu);
        pending.push_back(p);
        // The clock first: a reader never sees this piece waiting since
        // the last one finished long ago.
        if (waiting.load(std::memory_order_relaxed) == 0) Moved();
        waiting.fetch_add(1, std::memory_order_seq_cst);
      }
      cv.notify_one();
    }
    void Run();
    Status Pump();
    void Start(Piece* p);
    void Complete(Piece* p, int32_t res, std::vector<Piece*>* retry);
    void Finish(Piece* p, const Status& s);
    void* StagingPtr(const Piece* p) const { return staging[p->staging].ptr; }
  };

  std::vector<DirLock> locks;  // one per path, held until the files are closed
  std::vector<std::unique_ptr<PathIo>> paths;
  std::vector<ExtentAllocator> allocators;  // by path, in stripe units
  uint64_t file_bytes = 0;                  // every swap file's size (under map_mu)

  mutable std::mutex map_mu;
  std::map<uint64_t, Object> objects;
  std::unordered_map<std::string, uint64_t> by_name;
  uint64_t next_id = 1;
  uint32_t next_start_path = 0;
  std::condition_variable idle_cv;  // inflight, `syncing` or `releasing` reached 0
  int syncing = 0;                  // Sync calls with fsyncs queued (under map_mu)
  // Free calls punching holes outside map_mu, their units not yet back in
  // the allocators (under map_mu; idle_cv when it reaches 0).
  int releasing = 0;

  std::atomic<bool> failed{false};
  Status failure;     // under map_mu
  int event_fd = -1;  // completion eventfd, closed in ~Impl

  ~Impl() {
    if (event_fd >= 0) ::close(event_fd);
  }
  // Set by Close under map_mu: a call that finds it clear there (and
  // counts its I/O there) is waited for before the threads stop.
  std::atomic<bool> closed{false};

  std::atomic<uint64_t> bytes_read{0}, bytes_written{0}, reads{0}, writes{0}, retries{0},
      bounced{0};

  Status CheckUsable() const {
    if (closed.load()) return Status::FailedPrecondition("swap space is closed");
    if (failed.load()) {
      std::lock_guard<std::mutex> lock(map_mu);
      return Status::FailedPrecondition(
          StrCat("swap space failed earlier and must be recreated: ", failure.message()));
    }
    return Status::Ok();
  }

  void Fail(const Status& s) {
    std::lock_guard<std::mutex> lock(map_mu);
    if (!failed.exchange(true)) failure = s;
  }

  Status LockPaths();
  Status OpenFiles(bool create);
  // Reserves the blocks of the units in `extents` of path `p` that are
  // holes, adding each range reserved to `reserved`. Errors:
  // ResourceExhausted (the drive is full, naming it and its free bytes),
  // the fallocate's.
  Status ReserveHoles(uint32_t p, const std::vector<Extent>& extents,
                      std::vector<Extent>* reserved);
  // Gives the blocks of the units in `extents` of path `p` back to the
  // drive (where the filesystem can). Needs no lock: the caller holds the
  // units (not in the allocator), and Close waits for it (`releasing`) or
  // came before it (Free then touches no file).
  void Punch(uint32_t p, const std::vector<Extent>& extents) const;
  // Under map_mu: frees the units in `extents` of path `p`, marked as holes
  // when `punched` (Punch came first).
  void Release(uint32_t p, const std::vector<Extent>& extents, bool punched);
  // An errno (negated) that says the drive or the user's quota is full.
  static bool OutOfSpace(int rc);
  // ResourceExhausted for `what` on path `p`, naming the path's free bytes.
  Status OutOfSpaceError(uint32_t p, const std::string& what, int rc) const;
  // Grows every swap file so that each path has `units` more free stripe
  // units than now, and a step more when `ahead`. Under map_mu. Errors:
  // ResourceExhausted (the cap, or the disk full, naming the path and its
  // free bytes), IoError.
  Status Grow(uint64_t units, bool ahead);
  // Under map_mu: cuts every swap file back to `bytes` (no more than now;
  // every unit past it free). False, and the files as they were, if the
  // filesystem refuses.
  bool CutFiles(uint64_t bytes);
  // Units freed and given back to the drive, on any path (under map_mu).
  bool AnyHoles() const {
    for (const auto& p : paths) {
      if (p->holes > 0) return true;
    }
    return false;
  }
  Status StartThreads();
  // After setup `s`: starts the I/O threads, or on any error stops what was
  // started and leaves the space closed.
  Status Launch(Status s) {
    if (s.ok()) s = StartThreads();
    if (!s.ok()) {
      StopThreads();
      closed = true;
    }
    return s;
  }
  void StopThreads();
  void PieceSettled(uint64_t object_id) {
    std::lock_guard<std::mutex> lock(map_mu);
    auto it = objects.find(object_id);
    if (it != objects.end() && --it->second.inflight == 0) idle_cv.notify_all();
  }
};

// ---------------------------------------------------------------------------
// Path I/O thread

void SwapSpace::Impl::PathIo::Start(Piece* p) {
  IoOp op;
  op.kind = p->kind;
  op.user_data = reinterpret_cast<uint64_t>(p);
  if (p->kind != IoKind::kFsync) {
    uint8_t* base;
    if (p->direct) {
      base = p->user;
    } else {
      base = static_cast<uint8_t*>(StagingPtr(p));
      op.buf_index = fixed ? p->staging : -1;
    }
    op.offset = p->file_offset + p->done;
    op.buf = base + p->done;
    op.len = p->disk_len - p->done;
  }
  // The queue has room: in_ring.size() < depth is checked by the caller.
  const bool ok = queue->Prepare(op);
  ZT_CHECK_MSG(ok, "submission queue full with ", in_ring.size(), " in flight");
  in_ring.insert(p);
}

void SwapSpace::Impl::PathIo::Finish(Piece* p, const Status& s) {
  Moved();
  waiting.fetch_sub(1, std::memory_order_relaxed);
  if (p->staging >= 0) free_staging.push_back(p->staging);
  std::shared_ptr<IoTicket::State> ticket = std::move(p->ticket);
  const uint64_t object = p->object;
  const bool is_data = p->kind != IoKind::kFsync;
  delete p;
  if (is_data) owner->PieceSettled(object);
  ticket->Finish(s);
}

void SwapSpace::Impl::PathIo::Complete(Piece* p, int32_t res, std::vector<Piece*>* retry) {
  in_ring.erase(p);
  Moved();  // a short transfer resubmitted is progress too
  Impl& sp = *owner;
  if (p->kind == IoKind::kFsync) {
    if (res < 0) {
      const Status s = PosixError(StrCat("fdatasync of swap file ", file), res);
      sp.Fail(s);
      Finish(p, s);
    } else {
      Finish(p, Status::Ok());
    }
    return;
  }
  const char* what = p->kind == IoKind::kRead ? "read" : "write";
  if (res == -EAGAIN || res == -EINTR) {
    if (++p->retries <= kMaxRetries) {
      sp.retries.fetch_add(1, std::memory_order_relaxed);
      retry->push_back(p);
      return;
    }
  }
  Status error;
  last_errno[p->kind == IoKind::kWrite].store(res < 0    ? -res
                                              : res == 0 ? EIO
                                                         : 0,
                                              std::memory_order_relaxed);
  if (res < 0) {
    // EINVAL on aligned O_DIRECT I/O is a filesystem that took O_DIRECT at
    // open and refuses it at I/O (the probe at the start could not tell on
    // a full disk).
    error = PosixError(StrCat(what, " of swap file ", file, " at offset ", p->file_offset + p->done,
                              " (object ", p->object, ", byte ", p->object_offset + p->done, ")",
                              res == -EINVAL ? "; its filesystem refuses O_DIRECT I/O: put swap "
                                               "on a local disk filesystem such as ext4 or xfs"
                                             : ""),
                       res);
  } else if (res == 0) {
    error =
        Status::IoError(StrCat(what, " of swap file ", file, " at offset ",
                               p->file_offset + p->done, " made no progress (file truncated?)"));
  } else {
    p->done += static_cast<uint32_t>(res);
    if (p->done < p->disk_len) {  // short transfer: go on with the rest
      sp.retries.fetch_add(1, std::memory_order_relaxed);
      retry->push_back(p);
      return;
    }
  }

  if (p->kind == IoKind::kWrite) {
    sp.writes.fetch_add(1, std::memory_order_relaxed);
    if (error.ok()) sp.bytes_written.fetch_add(p->unit_bytes, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sp.map_mu);
      auto it = sp.objects.find(p->object);
      if (it != sp.objects.end()) {
        Unit& u = it->second.units[p->unit];
        u.state = error.ok() ? UnitState::kValid : UnitState::kFailed;
        u.crc = p->expected_crc;  // computed when the write was started
      }
    }
    Finish(p, error);
    return;
  }

  // Read: verify, then hand the caller its bytes.
  sp.reads.fetch_add(1, std::memory_order_relaxed);
  if (error.ok()) {
    const uint8_t* unit_data = p->direct ? p->user : static_cast<uint8_t*>(StagingPtr(p));
    if (sp.options.checksums) {
      const uint32_t crc = Crc32c(unit_data, p->unit_bytes);
      if (crc != p->expected_crc) {
        last_bad_offset.store(p->file_offset, std::memory_order_relaxed);
        bad_checksums.fetch_add(1, std::memory_order_relaxed);
        error = Status::Corruption(StrCat(
            "checksum mismatch in object ", p->object, " at byte ", p->object_offset,
            " (stripe unit ", p->unit, ", ", p->unit_bytes, " bytes) read from ", file, " offset ",
            p->file_offset, ": stored crc32c ", p->expected_crc, ", data ", crc));
      }
    }
    if (error.ok() && !p->direct) {
      std::memcpy(p->user, unit_data + p->user_off, p->user_len);
      sp.bounced.fetch_add(p->user_len, std::memory_order_relaxed);
    }
    if (error.ok()) sp.bytes_read.fetch_add(p->user_len, std::memory_order_relaxed);
  }
  Finish(p, error);
}

// Moves retries and pending pieces into the ring, up to the queue depth and
// the free staging buffers, and submits them. A write's checksum and bounce
// copy are done piece by piece with a submit after each, so the drive starts
// on the first piece while the next one is being checksummed.
Status SwapSpace::Impl::PathIo::Pump() {
  const uint32_t depth = owner->options.queue_depth;
  unsigned prepared = 0;
  for (Piece* p : retry) {
    Start(p);
    ++prepared;
  }
  retry.clear();
  starting.clear();
  {
    std::lock_guard<std::mutex> lock(mu);
    while (!pending.empty() && in_ring.size() + starting.size() < depth) {
      Piece* p = pending.front();
      const bool needs_staging = p->kind != IoKind::kFsync && !p->direct;
      if (needs_staging && free_staging.empty()) break;
      pending.pop_front();
      if (needs_staging) {
        p->staging = free_staging.back();
        free_staging.pop_back();
      }
      starting.push_back(p);
    }
  }
  for (size_t i = 0; i < starting.size(); ++i) {
    Piece* p = starting[i];
    bool work = false;
    if (p->kind == IoKind::kWrite) {
      // Checksum the caller's bytes, then stage them if they cannot go to
      // the disk directly (unaligned, or a partial last block).
      if (owner->options.checksums) {
        p->expected_crc = Crc32c(p->user, p->unit_bytes);
        work = true;
      }
      if (!p->direct) {
        auto* s = static_cast<uint8_t*>(StagingPtr(p));
        std::memcpy(s, p->user, p->unit_bytes);
        std::memset(s + p->unit_bytes, 0, p->disk_len - p->unit_bytes);
        owner->bounced.fetch_add(p->unit_bytes, std::memory_order_relaxed);
        work = true;
      }
    }
    Start(p);
    ++prepared;
    if (work) {
      if (Status s = queue->Submit(0); !s.ok()) {
        // The pieces not yet in the ring end here with the error (they
        // would be forgotten otherwise, and their waiters hang); those in
        // it go in with a later submit, or fail with the ring.
        for (size_t j = i + 1; j < starting.size(); ++j) Finish(starting[j], s);
        starting.clear();
        return s;
      }
      prepared = 0;
    }
  }
  if (prepared > 0) return queue->Submit(0);
  return Status::Ok();
}

void SwapSpace::Impl::PathIo::Run() {
  // Turns in a row whose submit failed and that completed nothing, before
  // the pieces no submit took are given up (a transient failure passes).
  constexpr int kBrokenTurns = 100;
  std::vector<IoCompletion> done(owner->options.queue_depth + 8);
  int stuck = 0;
  std::string said;  // the error logged last
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || !pending.empty() || !in_ring.empty() || !retry.empty(); });
      if (stop && pending.empty() && in_ring.empty() && retry.empty()) return;
    }
    Status s = broken.ok() ? Pump() : broken;
    if (s.ok() && !in_ring.empty()) s = queue->Submit(1);  // wait for a completion
    const size_t n = queue->Reap(done.data(), done.size());
    for (size_t i = 0; i < n; ++i) {
      Complete(reinterpret_cast<Piece*>(done[i].user_data), done[i].res, &retry);
      // Refill the slot at once: checksums of the other completions run
      // while the drive works on the new piece.
      if (s.ok() && i + 1 < n) s = Pump();
    }
    if (s.ok()) {
      stuck = 0;
      continue;
    }
    // A write the ring did not take leaves its unit's old bytes: the space
    // fails (reads say so). The same error again is not logged again.
    if (s.message() != said) {
      said = std::string(s.message());
      ZT_LOG(kError, "nvme") << s;
    }
    owner->Fail(s);
    if (n > 0) {
      stuck = 0;
      continue;
    }
    // The ring is broken: fail what is waiting rather than spin.
    std::deque<Piece*> orphans;
    {
      std::lock_guard<std::mutex> lock(mu);
      orphans.swap(pending);
    }
    for (Piece* p : orphans) Finish(p, s);
    for (Piece* p : retry) Finish(p, s);
    retry.clear();
    if (in_ring.empty()) continue;
    if (++stuck >= kBrokenTurns && queue->Unsubmitted() >= in_ring.size()) {
      // Every piece left in the ring is one that no submit took, and none
      // goes in: the ring is broken for good. They fail (the kernel never
      // saw them, so no I/O reaches their buffers), as does every piece
      // from now on; the ring is never entered again.
      broken = s;
      for (Piece* p : in_ring) Finish(p, s);
      in_ring.clear();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---------------------------------------------------------------------------
// Files and threads

Status SwapSpace::Impl::LockPaths() {
  for (const std::string& dir : options.paths) {
    ZT_ASSIGN_OR_RETURN(DirLock lock, DirLock::Acquire(dir, kLockFile, "swap directory",
                                                       DirLock::Mode::kExclusive));
    locks.push_back(std::move(lock));
  }
  return Status::Ok();
}

// Opens every swap file: a new space truncates what a dead owner left (the
// lock is ours) and starts empty; a reopened one checks the files' sizes.
Status SwapSpace::Impl::OpenFiles(bool create) {
  for (uint32_t i = 0; i < options.paths.size(); ++i) {
    auto pio = std::make_unique<PathIo>();
    pio->owner = this;
    pio->index = i;
    const std::string& dir = options.paths[i];
    pio->file = (std::filesystem::path(dir) / options.file_name).string();
    // Memory, not a drive: what is swapped there takes RAM that no DRAM
    // budget counts (and is lost with the machine, as RAM is).
    if (const std::string_view memory = MemoryFilesystemOf(dir); !memory.empty()) {
      ZT_LOG(kWarn, "nvme") << "swap path " << dir << " is on " << memory
                            << ", which is memory: what goes there takes RAM that the DRAM budget "
                               "(ztier.dram_budget) does not count; give a directory on a drive";
    }
    struct stat fst {};
    const bool exists = ::stat(pio->file.c_str(), &fst) == 0;
    if (!create && !exists) {
      return Status::NotFound(StrCat("swap file ", pio->file, " named by the manifest is missing"));
    }
    if (!create && static_cast<uint64_t>(fst.st_size) != file_bytes) {
      return Status::Corruption(StrCat("swap file ", pio->file, " is ", fst.st_size,
                                       " bytes; the manifest says ", file_bytes));
    }
    // Never through a link, and emptied only once it is known to be a file
    // of this process's user that nothing else names: a user who may write
    // into a swap directory must not make a daemon running as root truncate
    // (or keep everyone's optimizer states in) a file of their choosing.
    const int flags = O_RDWR | O_DIRECT | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0);
    const int fd = backend->OpenFile(pio->file, flags, 0600);
    if (fd < 0 && create && !exists) {
      // The kernel may have made the file before refusing the open (ramfs
      // does, for O_DIRECT): an empty plain file of ours there now goes.
      struct stat made {};
      if (::lstat(pio->file.c_str(), &made) == 0 && S_ISREG(made.st_mode) &&
          made.st_uid == ::geteuid() && made.st_size == 0) {
        ::unlink(pio->file.c_str());
      }
    }
    if (fd == -EINVAL) {
      return Status::FailedPrecondition(StrCat(
          "swap path ", dir, ": its filesystem does not support O_DIRECT (open of ", pio->file,
          " failed with EINVAL); put swap on a local disk filesystem such "
          "as ext4 or xfs"));
    }
    if (fd == -ELOOP) {
      return Status::FailedPrecondition(
          StrCat("swap file ", pio->file, " is a symbolic link; refused (remove it)"));
    }
    if (fd < 0) return PosixError(StrCat("open swap file ", pio->file), fd);
    pio->fd = fd;
    paths.push_back(std::move(pio));
    PathIo& p = *paths.back();
    struct stat own {};
    if (::fstat(fd, &own) != 0) return PosixError(StrCat("stat ", p.file), errno);
    if (!S_ISREG(own.st_mode) || own.st_uid != ::geteuid() || own.st_nlink != 1) {
      return Status::FailedPrecondition(
          StrCat("swap file ", p.file, " is not a plain file of uid ", ::geteuid(),
                 " with one name (", S_ISREG(own.st_mode) ? "" : "not a regular file, ",
                 "owner uid ", own.st_uid, ", ", own.st_nlink, " links); refused (remove it)"));
    }
    p.owned = true;
    if (create && ::ftruncate(fd, 0) != 0) return PosixError(StrCat("truncate ", p.file), errno);
    if (::fchmod(fd, 0600) != 0) return PosixError(StrCat("chmod 0600 ", p.file), errno);
    // Some filesystems accept O_DIRECT at open and refuse it at the first
    // I/O: probe one aligned block (written and read back on a new file,
    // which is then emptied again).
    AlignedBuffer probe(kBlock);
    std::memset(probe.ptr, 0, kBlock);
    ssize_t rc = create ? ::pwrite(fd, probe.ptr, kBlock, 0) : 0;
    if (rc >= 0) rc = ::pread(fd, probe.ptr, kBlock, 0);
    if (rc < 0 && (errno == ENOSPC || errno == EDQUOT)) {
      // A full filesystem now is no reason to refuse the swap space (and
      // ztierd with it, DRAM jobs too): objects are refused there until it
      // has room, and the first write they make tries O_DIRECT.
      ZT_LOG(kWarn, "nvme") << "swap path " << dir << ": its filesystem has no room now ("
                            << std::strerror(errno)
                            << "): objects on NVMe are refused until it has";
      rc = 0;
    }
    if (rc < 0) {
      const int err = errno;
      if (err == EINVAL) {
        return Status::FailedPrecondition(StrCat("swap path ", dir,
                                                 ": its filesystem does not support O_DIRECT "
                                                 "I/O (probe of ",
                                                 p.file, " failed with EINVAL)"));
      }
      return PosixError(StrCat("probe I/O on ", p.file), err);
    }
    if (create && ::ftruncate(fd, 0) != 0) return PosixError(StrCat("truncate ", p.file), errno);
    allocators.emplace_back(file_bytes / options.stripe_bytes);
    // A file opened again may have holes anywhere its objects are not:
    // every unit is reserved before it is handed out (cheap where it is not
    // a hole).
    p.punched.assign(file_bytes / options.stripe_bytes, !create);
    p.holes = create ? 0 : file_bytes / options.stripe_bytes;
  }
  return Status::Ok();
}

Status SwapSpace::Impl::Grow(uint64_t units, bool ahead) {
  const uint64_t stripe = options.stripe_bytes;
  const uint64_t cap = options.max_file_bytes;
  const uint64_t need = file_bytes + units * stripe;
  if (cap != 0 && need > cap) {
    return Status::ResourceExhausted(StrCat("swap files are at their cap of ", cap,
                                            " bytes per path (ztier.nvme_capacity); ",
                                            units * stripe, " more bytes per path are needed"));
  }
  // Grow in steps (the configured step, or an eighth of the file), so a
  // model's units do not cost an fallocate each; the exact need if the
  // disk cannot give the step.
  uint64_t step = ahead ? std::max(options.growth_bytes, file_bytes / 8) : 0;
  // Growth ahead of the need takes at most half of what a path's
  // filesystem has free: on a small one the rest is left for what else
  // goes there (a checkpoint beside the default <out>/swap).
  // Paths on one filesystem share its half.
  std::map<unsigned long, uint64_t> sharing;                // by f_fsid: the paths there
  std::vector<std::pair<unsigned long, uint64_t>> free_of;  // per path: fsid, bytes free
  for (const std::string& dir : options.paths) {
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) != 0) continue;
    ++sharing[vfs.f_fsid];
    free_of.emplace_back(vfs.f_fsid, uint64_t{vfs.f_bavail} * vfs.f_frsize);
  }
  for (const auto& [fsid, bytes] : free_of) step = std::min(step, bytes / 2 / sharing[fsid]);
  step = (step + stripe - 1) / stripe * stripe;
  uint64_t target = std::max(need, file_bytes + step);
  if (cap != 0) target = std::min(target, cap);
  // A failed attempt gives back what it took: fallocate keeps the blocks it
  // got before running out, and the paths before the failing one grew in
  // full. Several paths may share one filesystem, so the free bytes are
  // told once all of it is back.
  const auto shrink_back = [&] {
    for (auto& p : paths) (void)::ftruncate(p->fd, static_cast<off_t>(file_bytes));
  };
  for (const uint64_t size : {target, need}) {
    Status s;
    for (auto& p : paths) {
      int rc = backend->Preallocate(p->fd, file_bytes, size - file_bytes);
      if (rc == -EOPNOTSUPP) {  // no fallocate here: a sparse file
        if (!p->sparse_warned) {
          p->sparse_warned = true;
          ZT_LOG(kWarn, "nvme")
              << "the filesystem of swap path " << options.paths[p->index]
              << " cannot preallocate (no fallocate): its space is not reserved, and a full "
                 "disk shows up as a write error during a step";
        }
        rc = ::ftruncate(p->fd, static_cast<off_t>(size)) == 0 ? 0 : -errno;
      }
      if (OutOfSpace(rc)) {
        shrink_back();
        s = OutOfSpaceError(
            p->index, StrCat("growing ", p->file, " from ", file_bytes, " to ", size, " bytes"),
            rc);
        break;
      }
      if (rc < 0) {
        shrink_back();
        return PosixError(
            StrCat("fallocate ", size - file_bytes, " bytes at ", file_bytes, " of ", p->file), rc);
      }
    }
    if (!s.ok()) {
      if (size == need) return s;
      continue;  // try the exact need
    }
    file_bytes = size;
    for (ExtentAllocator& a : allocators) a.Grow(size / stripe);
    for (auto& p : paths) p->punched.resize(size / stripe, false);
    ZT_LOG(kDebug, "nvme") << "swap files grown to " << size << " bytes per path";
    return Status::Ok();
  }
  return Status::Internal("unreachable");
}

bool SwapSpace::Impl::OutOfSpace(int rc) { return rc == -ENOSPC || rc == -EDQUOT || rc == -EFBIG; }

Status SwapSpace::Impl::OutOfSpaceError(uint32_t p, const std::string& what, int rc) const {
  struct statvfs vfs {};
  const std::string& dir = options.paths[p];
  const uint64_t avail =
      ::statvfs(dir.c_str(), &vfs) == 0 ? uint64_t{vfs.f_bavail} * vfs.f_frsize : 0;
  return Status(StatusCode::kResourceExhausted,
                StrCat("swap path ", dir, " is out of space: ", what, " failed (",
                       std::strerror(-rc), "; ", avail, " bytes free)"),
                -rc);
}

Status SwapSpace::Impl::ReserveHoles(uint32_t p, const std::vector<Extent>& extents,
                                     std::vector<Extent>* reserved) {
  PathIo& path = *paths[p];
  const uint64_t stripe = options.stripe_bytes;
  for (const Extent& e : extents) {
    uint64_t u = e.start;
    const uint64_t end = e.start + e.count;
    while (u < end) {
      if (!path.punched[u]) {
        ++u;
        continue;
      }
      uint64_t run = u;
      while (run < end && path.punched[run]) ++run;
      const int rc = backend->Preallocate(path.fd, u * stripe, (run - u) * stripe);
      if (rc < 0 && rc != -EOPNOTSUPP) {
        // fallocate keeps the blocks it got before it failed: given back
        // (the run stays holes), so a refusal leaves the drive as it was.
        Punch(p, {{u, run - u}});
        const std::string what =
            StrCat("reserving ", (run - u) * stripe, " bytes at ", u * stripe, " of ", path.file);
        return OutOfSpace(rc) ? OutOfSpaceError(p, what, rc) : PosixError(what, rc);
      }
      path.MarkHoles(u, run - u, false);
      reserved->push_back({u, run - u});
      u = run;
    }
  }
  return Status::Ok();
}

void SwapSpace::Impl::Punch(uint32_t p, const std::vector<Extent>& extents) const {
  const PathIo& path = *paths[p];
  const uint64_t stripe = options.stripe_bytes;
  // Before the allocator has the units back: another object may get them
  // as soon as it does, and a hole punched then would take its data.
  for (const Extent& e : extents) {
    (void)::fallocate(path.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(e.start * stripe), static_cast<off_t>(e.count * stripe));
  }
}

void SwapSpace::Impl::Release(uint32_t p, const std::vector<Extent>& extents, bool punched) {
  PathIo& path = *paths[p];
  for (const Extent& e : extents) {
    // Marked even when the punch failed (it may have freed part of the
    // range): reserving a range that holds its blocks is cheap.
    if (punched) path.MarkHoles(e.start, e.count, true);
    const bool freed = allocators[p].Free(e.start, e.count);
    ZT_CHECK_MSG(freed, "swap unit freed twice");
  }
}

bool SwapSpace::Impl::CutFiles(uint64_t bytes) {
  bool cut = true;
  for (auto& path : paths) cut = ::ftruncate(path->fd, static_cast<off_t>(bytes)) == 0 && cut;
  const uint64_t units = bytes / options.stripe_bytes;
  if (!cut) {  // the files keep their size: the allocators still hold
    for (auto& path : paths) {
      (void)::ftruncate(path->fd, static_cast<off_t>(file_bytes));
      // Their blocks past `bytes` may be gone: reserved again before use.
      path->MarkHoles(units, path->punched.size() - units, true);
    }
    return false;
  }
  for (ExtentAllocator& a : allocators) {
    const bool shrunk = a.Shrink(units);
    ZT_CHECK_MSG(shrunk, "swap files cut over units in use");
  }
  for (auto& path : paths) {
    path->MarkHoles(units, path->punched.size() - units, false);
    path->punched.resize(units);
  }
  file_bytes = bytes;
  return true;
}

Status SwapSpace::Impl::StartThreads() {
  event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (event_fd < 0) return PosixError("eventfd for swap-space completions", errno);
  for (auto& pp : paths) {
    PathIo& p = *pp;
    std::vector<iovec> iov;
    for (uint32_t b = 0; b < options.queue_depth; ++b) {
      p.staging.emplace_back(options.stripe_bytes);
      if (p.staging.back().ptr == nullptr) {
        return Status::ResourceExhausted(StrCat("cannot allocate ", options.queue_depth, " x ",
                                                options.stripe_bytes, " bytes of staging buffers"));
      }
      iov.push_back(iovec{p.staging.back().ptr, options.stripe_bytes});
      p.free_staging.push_back(static_cast<int>(b));
    }
    Result<std::unique_ptr<IoQueue>> q = backend->OpenQueue(p.fd, p.file, options.queue_depth, iov);
    if (!q.ok() && q.status().code() != StatusCode::kUnimplemented) {
      // Registering buffers pins memory; without the rlimit for it, run
      // with plain buffers (slower) rather than not at all.
      ZT_LOG(kWarn, "nvme") << q.status() << "; continuing without fixed buffers";
      q = backend->OpenQueue(p.fd, p.file, options.queue_depth, {});
    } else if (q.ok()) {
      p.fixed = true;
    }
    if (!q.ok()) return q.status();
    p.queue = std::move(q).value();
    ZT_ASSIGN_OR_RETURN(
        p.thread, StartThread(StrCat("the I/O thread of swap path ", p.file), [&p] { p.Run(); }));
  }
  return Status::Ok();
}

void SwapSpace::Impl::StopThreads() {
  for (auto& p : paths) {
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->stop = true;
    }
    p->cv.notify_one();
  }
  for (auto& p : paths) {
    if (p->thread.joinable()) p->thread.join();
  }
  for (auto& p : paths) {
    p->queue.reset();
    const bool remove = !options.keep_files && p->owned;
    // Emptied first: an io_uring ring lets go of its registered files some
    // time after it is torn down, and an unlinked file's blocks came back
    // only then (a space made at once after, on the same filesystem, was
    // refused for space its own check had found free).
    if (remove && p->fd >= 0 && ::ftruncate(p->fd, 0) != 0) {
      ZT_LOG(kWarn, "nvme") << PosixError(StrCat("emptying swap file ", p->file), errno);
    }
    if (p->fd >= 0) ::close(p->fd);
    p->fd = -1;
    // Scratch files go with their owner; a new space starts from nothing.
    if (remove) {
      Status s = RemoveFile(p->file);
      if (!s.ok()) {
        ZT_LOG(kWarn, "nvme") << s;
      }
    }
  }
  locks.clear();
}

// ---------------------------------------------------------------------------
// Public API

namespace {

// Whether two swap paths name one directory: spelled alike once normal
// ("d", "d/" and "./d"), or the same inode (a link to it).
bool SameDirectory(const std::string& a, const std::string& b) {
  const auto normal = [](const std::string& p) {
    std::filesystem::path n = std::filesystem::path(p).lexically_normal();
    if (!n.has_filename() && n.has_parent_path() && n != n.root_path()) n = n.parent_path();
    return n;
  };
  if (normal(a) == normal(b)) return true;
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

Status ValidateOptions(const SwapOptions& o) {
  if (o.paths.empty()) return Status::InvalidArgument("swap space needs at least one path");
  for (size_t i = 0; i < o.paths.size(); ++i) {
    for (size_t j = i + 1; j < o.paths.size(); ++j) {
      if (SameDirectory(o.paths[i], o.paths[j])) {
        return Status::InvalidArgument(
            o.paths[i] == o.paths[j]
                ? StrCat("swap path ", o.paths[i], " is listed twice")
                : StrCat("swap path ", o.paths[i], " is listed twice (also as ", o.paths[j], ")"));
      }
    }
  }
  if (o.stripe_bytes < kBlock || o.stripe_bytes % kBlock != 0 || o.stripe_bytes > (1u << 30)) {
    return Status::InvalidArgument(StrCat("stripe size ", o.stripe_bytes,
                                          " must be a multiple of 4096 between 4 KiB and 1 GiB"));
  }
  if (o.max_file_bytes != 0 && o.max_file_bytes < o.stripe_bytes) {
    return Status::InvalidArgument(StrCat("swap file cap ", o.max_file_bytes,
                                          " is smaller than one stripe unit (", o.stripe_bytes,
                                          " bytes)"));
  }
  if (o.queue_depth < 1 || o.queue_depth > 4096) {
    return Status::InvalidArgument(StrCat("queue depth ", o.queue_depth, " must be 1..4096"));
  }
  if (o.file_name.empty() || o.file_name == "." || o.file_name == ".." ||
      o.file_name.find('/') != std::string::npos || o.file_name == kLockFile) {
    return Status::InvalidArgument(
        StrCat("swap file name '", o.file_name, "' is not a plain name"));
  }
  return Status::Ok();
}

}  // namespace

SwapSpace::SwapSpace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SwapSpace::~SwapSpace() {
  if (impl_ && !impl_->closed.load()) {
    Status s = Close();
    if (!s.ok()) {
      ZT_LOG(kError, "nvme") << "closing swap space: " << s;
    }
  }
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::Create(const SwapOptions& options,
                                                     std::shared_ptr<IoBackend> backend) {
  ZT_RETURN_IF_ERROR(ValidateOptions(options));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->options.max_file_bytes =
      options.max_file_bytes / options.stripe_bytes * options.stripe_bytes;
  if (backend == nullptr) {
    ZT_ASSIGN_OR_RETURN(backend, MakeBackend(BackendChoice::kAuto));
  }
  impl->backend = std::move(backend);
  std::unique_ptr<SwapSpace> space(new SwapSpace(std::move(impl)));
  Impl& sp = *space->impl_;
  Status s = sp.LockPaths();
  if (s.ok()) s = sp.OpenFiles(/*create=*/true);
  ZT_RETURN_IF_ERROR(sp.Launch(s));
  return space;
}

Result<uint64_t> SwapSpace::Allocate(std::string_view name, uint64_t bytes) {
  Impl& sp = *impl_;
  ZT_RETURN_IF_ERROR(sp.CheckUsable());
  if (bytes == 0) return Status::InvalidArgument(StrCat("swap object '", name, "' of 0 bytes"));
  if (name.empty()) return Status::InvalidArgument("swap object needs a name");
  // Far beyond any disk, and the file offsets below cannot overflow.
  constexpr uint64_t kMaxObjectBytes = uint64_t{1} << 56;
  if (bytes > kMaxObjectBytes) {
    return Status::InvalidArgument(StrCat("swap object '", name, "' of ", bytes,
                                          " bytes: more than the most one object can be (",
                                          kMaxObjectBytes, ")"));
  }
  const uint64_t stripe = sp.options.stripe_bytes;
  const uint64_t units = (bytes + stripe - 1) / stripe;
  const uint32_t npaths = static_cast<uint32_t>(sp.paths.size());

  std::lock_guard<std::mutex> lock(sp.map_mu);
  // Growing the files needs them open: Close may have come since the check.
  if (sp.closed.load()) return Status::FailedPrecondition("swap space is closed");
  if (sp.by_name.count(std::string(name)) != 0) {
    return Status::AlreadyExists(StrCat("swap object '", name, "' already exists"));
  }
  // Units per path for round-robin placement from `start`, and by how
  // much the files must grow for them.
  std::vector<uint64_t> need(npaths);
  const auto place = [&](uint32_t start) {
    std::fill(need.begin(), need.end(), units / npaths);
    for (uint64_t r = 0; r < units % npaths; ++r) ++need[(start + r) % npaths];
    uint64_t deficit = 0;
    for (uint32_t p = 0; p < npaths; ++p) {
      if (need[p] > sp.allocators[p].free_units()) {
        deficit = std::max(deficit, need[p] - sp.allocators[p].free_units());
      }
    }
    return deficit;
  };
  // Objects start on the paths in turn, so the files fill alike; after
  // frees the paths' free units differ, and the start that needs the least
  // growth is taken (the turn's first): a capped or full drive refused an
  // object that the free units of another start held.
  uint32_t start = sp.next_start_path;
  uint64_t deficit = place(start);
  for (uint32_t k = 1; k < npaths && deficit > 0; ++k) {
    const uint32_t other = (sp.next_start_path + k) % npaths;
    const uint64_t d = place(other);
    if (d < deficit) {
      start = other;
      deficit = d;
    }
  }
  place(start);
  // A refusal for want of room says how full each path is; one for another
  // cause (a failing drive: EIO) says that, not "full".
  const auto full = [&](const Status& why) {
    const int err = why.sys_errno();
    const bool no_room = err == 0 ? why.code() == StatusCode::kResourceExhausted  // the cap
                                  : err == ENOSPC || err == EDQUOT || err == EFBIG;
    if (!no_room) {
      return Status(why.code(),
                    StrCat("swap space could not place object '", name, "' (", units * stripe,
                           " bytes): ", why.message()),
                    err);
    }
    std::string detail;
    for (uint32_t q = 0; q < npaths; ++q) {
      detail += StrCat(q ? ", " : "", sp.options.paths[q], ": ",
                       sp.allocators[q].free_units() * stripe, " bytes free in its file");
    }
    return Status(why.code(),
                  StrCat("swap space full: object '", name, "' needs ", units * stripe, " bytes; ",
                         why.message(), " (", detail, ")"),
                  err);
  };
  // Where freed units gave their blocks back, they are reused before the
  // files' new tail is: the files grow by what this object needs and no
  // step more, so the growth leaves the drive the room those holes need.
  const uint64_t file_bytes_before = sp.file_bytes;
  if (deficit > 0) {
    Status grown = sp.Grow(deficit, /*ahead=*/!sp.AnyHoles());
    if (!grown.ok()) return full(grown);
  }
  Object obj;
  obj.id = sp.next_id++;
  obj.name = std::string(name);
  obj.size = bytes;
  obj.start_path = start;
  obj.units.resize(units);
  std::vector<std::vector<Extent>> extents(npaths);
  for (uint32_t p = 0; p < npaths; ++p) {
    if (need[p] > 0) extents[p] = sp.allocators[p].Allocate(need[p]);
  }
  // Units an earlier object freed may be holes: their blocks are reserved
  // again now, so a full drive refuses the object here rather than failing
  // a write in the middle of a step.
  std::vector<std::vector<Extent>> reserved(npaths);
  for (uint32_t p = 0; p < npaths; ++p) {
    Status s = sp.ReserveHoles(p, extents[p], &reserved[p]);
    if (!s.ok()) {
      // Nothing of the refused object stays: the holes it reserved are
      // holes again, the files their size before.
      for (uint32_t q = 0; q < npaths; ++q) {
        sp.Release(q, extents[q], /*punched=*/false);
        sp.Punch(q, reserved[q]);
        for (const Extent& e : reserved[q]) sp.paths[q]->MarkHoles(e.start, e.count, true);
      }
      if (sp.file_bytes != file_bytes_before) (void)sp.CutFiles(file_bytes_before);
      return full(s);
    }
  }
  for (uint32_t p = 0; p < npaths; ++p) {
    if (need[p] == 0) continue;
    const std::vector<Extent>& ext = extents[p];
    // Hand this path's units out in order.
    size_t e = 0;
    uint64_t k = 0;
    for (uint64_t u = (p + npaths - start) % npaths; u < units; u += npaths) {
      while (k == ext[e].count) {
        ++e;
        k = 0;
      }
      obj.units[u] = Unit{(ext[e].start + k) * stripe, 0, UnitState::kUnwritten};
      ++k;
    }
  }
  sp.next_start_path = (start + 1) % npaths;
  sp.by_name[obj.name] = obj.id;
  const uint64_t id = obj.id;
  sp.objects.emplace(id, std::move(obj));
  return id;
}

Status SwapSpace::Free(uint64_t id) {
  Impl& sp = *impl_;
  std::unique_lock<std::mutex> lock(sp.map_mu);
  auto it = sp.objects.find(id);
  if (it == sp.objects.end())
    return Status::NotFound(StrCat("swap object ", id, " does not exist"));
  if (it->second.inflight > 0) {
    return Status::FailedPrecondition(StrCat("swap object '", it->second.name, "' has ",
                                             it->second.inflight, " I/O(s) in flight"));
  }
  if (sp.closed.load()) {
    // The files are closed (and gone, unless kept): nothing to give back,
    // and their descriptors may be another file's by now (a job freed as
    // its engine closes).
    sp.by_name.erase(it->second.name);
    sp.objects.erase(it);
    return Status::Ok();
  }
  const uint64_t stripe = sp.options.stripe_bytes;
  const uint32_t npaths = static_cast<uint32_t>(sp.paths.size());
  std::vector<std::vector<Extent>> units(npaths);
  for (size_t u = 0; u < it->second.units.size(); ++u) {
    const uint32_t p = (it->second.start_path + u) % npaths;
    const uint64_t unit = it->second.units[u].file_offset / stripe;
    if (!units[p].empty() && units[p].back().start + units[p].back().count == unit) {
      ++units[p].back().count;  // one call for a run of units
    } else {
      units[p].push_back({unit, 1});
    }
  }
  sp.by_name.erase(it->second.name);
  sp.objects.erase(it);
  // The last object gone, the files give their room back to the drives
  // (they grew in steps for jobs that are gone, or for one that was
  // refused halfway, and held the space from everything else there).
  // Before that, each object's units do, a hole punched in them (a job
  // that leaves gives its space back while others run on). Files kept for
  // a manifest (keep_files) keep the data of what they held: a manifest
  // saved before this Free still names the object.
  const auto cut_if_unused = [&] {
    if (sp.objects.empty() && sp.releasing == 0 && sp.file_bytes > 0 && !sp.options.keep_files) {
      (void)sp.CutFiles(0);
    }
  };
  if (sp.options.keep_files || (sp.objects.empty() && sp.releasing == 0)) {
    for (uint32_t p = 0; p < npaths; ++p) sp.Release(p, units[p], /*punched=*/false);
    cut_if_unused();
    return Status::Ok();
  }
  // A multi-GB punch takes a while: other objects' I/O and allocations go
  // on meanwhile (Close waits for it). The units come back to the
  // allocator after it, so nothing can be placed in them before.
  ++sp.releasing;
  lock.unlock();
  for (uint32_t p = 0; p < npaths; ++p) sp.Punch(p, units[p]);
  lock.lock();
  for (uint32_t p = 0; p < npaths; ++p) sp.Release(p, units[p], /*punched=*/true);
  if (--sp.releasing == 0) sp.idle_cv.notify_all();
  cut_if_unused();
  return Status::Ok();
}

Result<ObjectInfo> SwapSpace::Find(std::string_view name) const {
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  auto it = impl_->by_name.find(std::string(name));
  if (it == impl_->by_name.end()) {
    return Status::NotFound(StrCat("swap object '", name, "' does not exist"));
  }
  const Object& o = impl_->objects.at(it->second);
  return ObjectInfo{o.id, o.name, o.size};
}

std::vector<ObjectInfo> SwapSpace::Objects() const {
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  std::vector<ObjectInfo> out;
  for (const auto& [id, o] : impl_->objects) out.push_back(ObjectInfo{id, o.name, o.size});
  return out;
}

IoTicket SwapSpace::Submit(IoDirection dir, std::span<const IoRange> ranges,
                           std::function<void(const Status&)> on_done) {
  Impl& sp = *impl_;
  auto state = std::make_shared<IoTicket::State>();
  state->on_done = std::move(on_done);
  state->event_fd = sp.event_fd;
  state->pending = 1;  // held until every piece is queued
  IoTicket ticket(state);
  Status usable = sp.CheckUsable();
  if (!usable.ok()) {
    state->Finish(usable);
    return ticket;
  }
  const uint64_t stripe = sp.options.stripe_bytes;
  const uint32_t npaths = static_cast<uint32_t>(sp.paths.size());
  std::vector<std::pair<uint32_t, Piece*>> pieces;
  Status error;
  {
    std::lock_guard<std::mutex> lock(sp.map_mu);
    // Pieces are counted under the lock Close sets `closed` under: either
    // Close waits for them or they are refused here, never queued to
    // threads that stopped.
    if (sp.closed.load()) error = Status::FailedPrecondition("swap space is closed");
    for (const IoRange& r : ranges) {
      if (!error.ok()) break;
      auto it = sp.objects.find(r.object);
      if (it == sp.objects.end()) {
        error = Status::NotFound(StrCat("swap object ", r.object, " does not exist"));
        break;
      }
      Object& o = it->second;
      if (r.offset > o.size || r.length > o.size - r.offset) {
        error = Status::OutOfRange(StrCat("range [", r.offset, ", ", r.offset + r.length,
                                          ") is outside swap object '", o.name, "' of ", o.size,
                                          " bytes"));
        break;
      }
      if (r.length > 0 && r.buffer == nullptr) {
        error = Status::InvalidArgument("I/O range with a null buffer");
        break;
      }
      if (dir == IoDirection::kWrite && r.length > 0 &&
          (r.offset % stripe != 0 ||
           ((r.offset + r.length) % stripe != 0 && r.offset + r.length != o.size))) {
        error = Status::InvalidArgument(
            StrCat("write of [", r.offset, ", ", r.offset + r.length, ") to swap object '", o.name,
                   "' does not cover whole stripe units of ", stripe,
                   " bytes (start on a unit boundary, end on one or at the object's end)"));
        break;
      }
      uint64_t pos = r.offset;
      const uint64_t end = r.offset + r.length;
      while (pos < end) {
        const size_t u = pos / stripe;
        const uint64_t unit_start = u * stripe;
        const uint32_t unit_bytes = static_cast<uint32_t>(std::min(stripe, o.size - unit_start));
        const uint32_t in_off = static_cast<uint32_t>(pos - unit_start);
        const uint32_t len =
            static_cast<uint32_t>(std::min<uint64_t>(end - pos, unit_bytes - in_off));
        uint8_t* user = static_cast<uint8_t*>(r.buffer) + (pos - r.offset);
        const Unit& unit = o.units[u];
        if (dir == IoDirection::kRead && unit.state != UnitState::kValid) {
          if (unit.state == UnitState::kFailed) {
            error = Status::IoError(StrCat("swap object '", o.name, "' bytes [", unit_start, ", ",
                                           unit_start + unit_bytes,
                                           ") are lost: their last write failed"));
            break;
          }
          std::memset(user, 0, len);  // never written: reads as zeros
          pos += len;
          continue;
        }
        auto* p = new Piece();
        p->ticket = state;
        p->kind = dir == IoDirection::kRead ? IoKind::kRead : IoKind::kWrite;
        p->object = o.id;
        p->unit = u;
        p->file_offset = unit.file_offset;
        p->unit_bytes = unit_bytes;
        p->disk_len = static_cast<uint32_t>(RoundUp(unit_bytes, kBlock));
        p->user = user;
        p->user_off = in_off;
        p->user_len = len;
        p->direct = in_off == 0 && len == unit_bytes && unit_bytes % kBlock == 0 && Aligned(user);
        p->expected_crc = unit.crc;
        p->expected_state = unit.state;
        p->object_offset = unit_start;
        ++o.inflight;
        pieces.emplace_back((o.start_path + u) % npaths, p);
        pos += len;
      }
      if (!error.ok()) break;
    }
  }
  if (!error.ok()) {
    // Nothing was queued yet: undo the inflight counts and fail the request.
    for (auto& [path, p] : pieces) {
      const uint64_t obj = p->object;
      delete p;
      sp.PieceSettled(obj);
    }
    state->Finish(error);
    return ticket;
  }
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->pending += static_cast<int>(pieces.size());
  }
  for (auto& [path, p] : pieces) sp.paths[path]->Enqueue(p);
  state->Finish(Status::Ok());  // drop the submit hold
  return ticket;
}

Status SwapSpace::Write(uint64_t object, uint64_t offset, const void* data, uint64_t length) {
  const IoRange r{object, offset, length, const_cast<void*>(data)};
  return Submit(IoDirection::kWrite, {&r, 1}).Wait();
}

Status SwapSpace::Read(uint64_t object, uint64_t offset, void* data, uint64_t length) {
  const IoRange r{object, offset, length, data};
  return Submit(IoDirection::kRead, {&r, 1}).Wait();
}

Status SwapSpace::Sync() {
  Impl& sp = *impl_;
  ZT_RETURN_IF_ERROR(sp.CheckUsable());
  {
    std::lock_guard<std::mutex> lock(sp.map_mu);  // as Submit's pieces
    if (sp.closed.load()) return Status::FailedPrecondition("swap space is closed");
    ++sp.syncing;
  }
  auto state = std::make_shared<IoTicket::State>();
  state->pending = static_cast<int>(sp.paths.size());
  for (auto& path : sp.paths) {
    auto* p = new Piece();
    p->ticket = state;
    p->kind = IoKind::kFsync;
    path->Enqueue(p);
  }
  IoTicket ticket(state);
  Status s = ticket.Wait();
  {
    std::lock_guard<std::mutex> lock(sp.map_mu);
    if (--sp.syncing == 0) sp.idle_cv.notify_all();
  }
  if (!s.ok()) return s.Annotate("swap space is now failed");
  return Status::Ok();
}

int SwapSpace::completion_fd() const { return impl_->event_fd; }

const SwapOptions& SwapSpace::options() const { return impl_->options; }

uint64_t SwapSpace::file_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  return impl_->file_bytes * impl_->paths.size();
}

uint64_t SwapSpace::free_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  uint64_t units = 0;
  for (const ExtentAllocator& a : impl_->allocators) units += a.free_units();
  return units * impl_->options.stripe_bytes;
}

std::vector<SwapSpace::Stall> SwapSpace::stalls(std::chrono::milliseconds quiet) const {
  const Impl& sp = *impl_;
  std::vector<Stall> out;
  const double at_least = std::chrono::duration<double>(quiet).count();
  for (const auto& path : sp.paths) {
    const auto [waiting, seconds] = path->Quiet();
    if (waiting == 0 || seconds < at_least) continue;
    out.push_back(Stall{.file = path->file, .waiting = waiting, .seconds = seconds});
  }
  return out;
}

std::string SwapSpace::StallNote(std::chrono::milliseconds quiet) const {
  std::string note;
  for (const Stall& s : stalls(quiet)) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), s.seconds < 10 ? "%.1f" : "%.0f", s.seconds);
    note += StrCat(note.empty() ? "" : "; ", "swap file ", s.file, ": ", s.waiting,
                   " disk operation(s) waiting, none finished for ", secs, " s");
  }
  if (!note.empty()) note += " (a stalled or failing drive?)";
  return note;
}

std::vector<SwapSpace::PathUsage> SwapSpace::path_usage() const {
  const Impl& sp = *impl_;
  std::vector<PathUsage> out;
  std::lock_guard<std::mutex> lock(sp.map_mu);
  // The files grow in lockstep, each by the same bytes: what they can grow
  // by is the least room of any path's filesystem, shared by the paths on
  // it (a large drive beside a small one was said to take its whole free
  // space; two paths on one filesystem each claimed all of it).
  uint64_t room = UINT64_MAX;
  if (sp.options.max_file_bytes == 0) {
    std::map<uint64_t, std::pair<uint64_t, uint64_t>> filesystems;  // fsid: free, paths
    for (const auto& path : sp.paths) {
      struct statvfs fs;
      if (path->fd < 0 || ::fstatvfs(path->fd, &fs) != 0) continue;
      auto& [bytes, paths] = filesystems[fs.f_fsid];
      bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
      ++paths;
    }
    for (const auto& [fsid, fs] : filesystems) room = std::min(room, fs.first / fs.second);
    // (No filesystem answered: no room can be promised.)
    if (filesystems.empty()) room = 0;
  }
  for (size_t i = 0; i < sp.paths.size(); ++i) {
    PathUsage u;
    u.path = i < sp.options.paths.size() ? sp.options.paths[i] : sp.paths[i]->file;
    const uint64_t free_units = i < sp.allocators.size() ? sp.allocators[i].free_units() : 0;
    u.used_bytes = sp.file_bytes - std::min(sp.file_bytes, free_units * sp.options.stripe_bytes);
    // The blocks the file holds: the holes of freed units are the
    // filesystem's free blocks, and counted there.
    const int fd = sp.paths[i]->fd;
    struct stat st;
    u.file_bytes = sp.file_bytes;
    if (fd >= 0 && ::fstat(fd, &st) == 0) {
      u.file_bytes = std::min(u.file_bytes, static_cast<uint64_t>(st.st_blocks) * 512);
    }
    u.capacity_bytes = sp.options.max_file_bytes;
    if (u.capacity_bytes == 0) u.capacity_bytes = u.file_bytes + room;
    const Impl::PathIo& io = *sp.paths[i];
    std::tie(u.waiting, u.quiet_seconds) = io.Quiet();
    struct statvfs vfs;
    if (sp.failed.load()) {
      u.problem = StrCat("the swap space failed: ", sp.failure.message());
    } else if (fd >= 0 && ::fstatvfs(fd, &vfs) == 0 && (vfs.f_flag & ST_RDONLY) != 0) {
      u.problem = "its filesystem is read-only";
    } else if (const int err = io.last_errno[1].load(std::memory_order_relaxed); err != 0) {
      u.problem = StrCat("its last write failed: ", std::strerror(err));
    } else if (const int read_err = io.last_errno[0].load(std::memory_order_relaxed);
               read_err != 0) {
      u.problem = StrCat("its last read failed: ", std::strerror(read_err));
    } else if (const uint64_t bad = io.bad_checksums.load(std::memory_order_relaxed); bad != 0) {
      u.problem = StrCat(bad,
                         " read(s) gave back bytes that did not match their checksum (the last at "
                         "offset ",
                         io.last_bad_offset.load(std::memory_order_relaxed), ")");
    }
    out.push_back(std::move(u));
  }
  return out;
}

SwapStats SwapSpace::stats() const {
  const Impl& sp = *impl_;
  return SwapStats{sp.bytes_read.load(), sp.bytes_written.load(), sp.reads.load(),
                   sp.writes.load(),     sp.retries.load(),       sp.bounced.load()};
}

Status SwapSpace::Close() {
  Impl& sp = *impl_;
  {
    // Wait for requests in flight (their pieces hold inflight counts, a
    // Sync the syncing count).
    std::unique_lock<std::mutex> lock(sp.map_mu);
    if (sp.closed.exchange(true)) return Status::Ok();
    sp.idle_cv.wait(lock, [&] {
      if (sp.syncing > 0 || sp.releasing > 0) return false;
      for (const auto& [id, o] : sp.objects) {
        if (o.inflight > 0) return false;
      }
      return true;
    });
  }
  sp.StopThreads();
  if (sp.failed.load()) {
    std::lock_guard<std::mutex> lock(sp.map_mu);
    return sp.failure;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Manifest (format and checks: swap_manifest.h)

Status SwapSpace::SaveManifest(const std::string& path) {
  Impl& sp = *impl_;
  ZT_RETURN_IF_ERROR(Sync());
  SwapManifest m;
  {
    std::lock_guard<std::mutex> lock(sp.map_mu);
    const SwapOptions& o = sp.options;
    m.stripe_bytes = o.stripe_bytes;
    m.file_bytes = sp.file_bytes;
    m.cap_bytes = o.max_file_bytes;
    m.checksums = o.checksums;
    m.file_name = o.file_name;
    m.paths = o.paths;
    m.next_id = sp.next_id;
    m.next_start_path = sp.next_start_path;
    for (const auto& [id, obj] : sp.objects) {
      ManifestObject& mo = m.objects.emplace_back();
      mo.id = id;
      mo.name = obj.name;
      mo.size = obj.size;
      mo.start_path = obj.start_path;
      for (const Unit& u : obj.units) {
        mo.units.push_back({u.file_offset, u.crc, static_cast<uint8_t>(u.state)});
      }
    }
  }
  return WriteFileAtomically(path, EncodeSwapManifest(m));
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::Open(const std::string& manifest_path,
                                                   uint32_t queue_depth,
                                                   std::shared_ptr<IoBackend> backend) {
  // A manifest holds 13 bytes per stripe unit: 1 GiB describes 80 TiB of
  // 1 MiB units.
  ZT_ASSIGN_OR_RETURN(std::string data, ReadFileToString(manifest_path, uint64_t{1} << 30));
  ZT_ASSIGN_OR_RETURN(SwapManifest m, DecodeSwapManifest(data, manifest_path));
  SwapOptions o;
  o.paths = m.paths;
  o.max_file_bytes = m.cap_bytes;
  o.stripe_bytes = m.stripe_bytes;
  o.queue_depth = queue_depth;
  o.checksums = m.checksums;
  o.file_name = m.file_name;
  o.keep_files = true;  // reopened data outlives this space, as it did the last one
  if (Status s = ValidateOptions(o); !s.ok()) {
    return Status::Corruption(StrCat("swap manifest ", manifest_path, ": ", s.message()));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  impl->file_bytes = m.file_bytes;
  if (backend == nullptr) {
    ZT_ASSIGN_OR_RETURN(backend, MakeBackend(BackendChoice::kAuto));
  }
  impl->backend = std::move(backend);
  std::unique_ptr<SwapSpace> space(new SwapSpace(std::move(impl)));
  Impl& sp = *space->impl_;
  Status s = sp.LockPaths();
  if (s.ok()) s = sp.OpenFiles(/*create=*/false);
  if (s.ok()) {
    sp.next_id = m.next_id;
    sp.next_start_path = m.next_start_path;
    const uint64_t stripe = o.stripe_bytes;
    const uint32_t npaths = static_cast<uint32_t>(o.paths.size());
    for (ManifestObject& mo : m.objects) {
      Object obj;
      obj.id = mo.id;
      obj.name = std::move(mo.name);
      obj.size = mo.size;
      obj.start_path = mo.start_path;
      obj.units.reserve(mo.units.size());
      for (size_t u = 0; u < mo.units.size(); ++u) {
        const ManifestUnit& mu = mo.units[u];
        // The decoder checked that no two units overlap.
        const uint32_t p = (obj.start_path + u) % npaths;
        const bool reserved = sp.allocators[p].Reserve(mu.file_offset / stripe, 1);
        ZT_CHECK(reserved);
        sp.paths[p]->MarkHoles(mu.file_offset / stripe, 1, false);  // it holds data
        obj.units.push_back(Unit{mu.file_offset, mu.crc, static_cast<UnitState>(mu.state)});
      }
      sp.by_name[obj.name] = obj.id;
      sp.objects.emplace(obj.id, std::move(obj));
    }
  }
  ZT_RETURN_IF_ERROR(sp.Launch(s));
  return space;
}

}  // namespace ztier::nvme
