// ztier nvme: the I/O backend seam under the swap space.
//
// The swap space never calls the OS directly for data I/O: it opens its files
// and drives one IoQueue per swap file through an IoBackend. Backends:
//   - MakeUringBackend(): io_uring (liburing) with the swap file registered as
//     a fixed file and the staging buffers as fixed buffers;
//   - MakeThreadBackend(): a small pool of threads per queue doing pread /
//     pwrite / fdatasync, for kernels where io_uring is missing or switched
//     off (kernel.io_uring_disabled, seccomp filters in containers);
//   - MakeDefaultBackend(): io_uring when this process may use it, else the
//     thread backend with one warning that names the cause;
//   - FaultBackend: wraps another backend and injects faults for tests (fail
//     the Nth read/write/fsync with an errno, short transfers, a full disk,
//     bit flips in data read back, an open that refuses O_DIRECT).
//
// Errors come back as negative errno values in IoCompletion::res, as io_uring
// delivers them; the swap space turns them into Status with path and offset.
//
// Thread safety: an IoBackend may be shared by several swap files and used
// from several threads. An IoQueue is driven by one thread at a time.
#ifndef ZTIER_NVME_IO_BACKEND_H_
#define ZTIER_NVME_IO_BACKEND_H_

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "common/status.h"

namespace ztier::nvme {

enum class IoKind : uint8_t { kRead, kWrite, kFsync };

struct IoOp {
  IoKind kind = IoKind::kRead;
  uint64_t offset = 0;  // file offset (multiple of 4 KiB for O_DIRECT)
  void* buf = nullptr;
  uint32_t len = 0;
  int buf_index = -1;  // registered fixed buffer holding buf, or -1
  uint64_t user_data = 0;
};

struct IoCompletion {
  uint64_t user_data;
  int32_t res;  // bytes transferred, or -errno
};

// One submission/completion queue bound to one open file.
class IoQueue {
 public:
  virtual ~IoQueue() = default;
  // Queues op for the next Submit(); false when the submission queue is full.
  virtual bool Prepare(const IoOp& op) = 0;
  // Submits all prepared ops and waits until at least `wait_for` completions
  // are ready (0: do not wait). Errors: IoError when the ring itself fails.
  virtual Status Submit(unsigned wait_for) = 0;
  // Moves up to `max` ready completions into `out` without a syscall.
  virtual size_t Reap(IoCompletion* out, size_t max) = 0;
  // Prepared ops not yet taken by a Submit (after one that failed, those
  // that never reach the disk unless a later Submit succeeds).
  virtual size_t Unsubmitted() const = 0;
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual std::string_view name() const = 0;
  // open(2) with the given flags and mode; returns the fd or -errno.
  virtual int OpenFile(const std::string& path, int flags, int mode);
  // fallocate(2) of [offset, offset + bytes), growing the file; returns 0 or
  // -errno (-EOPNOTSUPP where the filesystem cannot preallocate).
  virtual int Preallocate(int fd, uint64_t offset, uint64_t bytes);
  // A queue of `depth` entries for fd, with `fixed` registered as buffers.
  virtual Result<std::unique_ptr<IoQueue>> OpenQueue(int fd, const std::string& path,
                                                     uint32_t depth,
                                                     std::span<const iovec> fixed) = 0;
};

// io_uring backend. Errors from OpenQueue: Unimplemented when the kernel has
// no io_uring (or lacks an opcode ztier needs), FailedPrecondition when it is
// switched off for this process (EPERM), IoError otherwise.
std::unique_ptr<IoBackend> MakeUringBackend();

// Thread-pool backend: min(depth, 8) threads per queue, O_DIRECT pread /
// pwrite on the caller's buffers; an fsync waits for every op before it and
// holds back the ops after it (io_uring's IOSQE_IO_DRAIN).
std::unique_ptr<IoBackend> MakeThreadBackend();

enum class BackendChoice : uint8_t { kAuto, kUring, kThreads };
// The backend for `choice`: kAuto tries io_uring (a one-entry ring, once per
// process) and falls back to threads with a warning naming the sysctl; kUring
// fails when io_uring cannot be used. Errors: FailedPrecondition /
// Unimplemented (kUring refused, with the reason and the fix).
Result<std::shared_ptr<IoBackend>> MakeBackend(BackendChoice choice);
// The same decision from a given probe result (tests).
std::shared_ptr<IoBackend> SelectBackend(const Status& uring_probe);
// Whether this process may create an io_uring: Ok, or why not.
Status ProbeUringSetup();

// Checks that this kernel's io_uring has what the swap space needs (rings,
// read/write/fsync opcodes, fixed files and buffers). Used by tests to skip.
Status ProbeUring();

// Fault injection for tests. Counting is per kind over every queue opened
// through this backend, starting at 1 from the moment the fault is armed.
class FaultBackend final : public IoBackend {
 public:
  explicit FaultBackend(std::unique_ptr<IoBackend> inner);
  ~FaultBackend() override;

  std::string_view name() const override { return "fault"; }
  int OpenFile(const std::string& path, int flags, int mode) override;
  int Preallocate(int fd, uint64_t offset, uint64_t bytes) override;
  Result<std::unique_ptr<IoQueue>> OpenQueue(int fd, const std::string& path, uint32_t depth,
                                             std::span<const iovec> fixed) override;

  // The nth op of `kind` from now completes with -err without reaching the disk.
  void FailNth(IoKind kind, uint64_t n, int err);
  // Every op of `kind` from the nth on fails with -err (a full disk: ENOSPC).
  void FailFrom(IoKind kind, uint64_t n, int err);
  // The nth read or write from now transfers only its first half (rounded
  // down to 4 KiB, at least 4 KiB); the caller must resubmit the rest.
  void ShortNth(IoKind kind, uint64_t n);
  // The nth read from now returns its data with one bit flipped.
  void FlipBitOnNthRead(uint64_t n);
  // Every op of `kind` is held `per_op` before it is queued (a slow or
  // stalled drive, on the submitting thread); 0: no delay.
  void SlowDown(IoKind kind, std::chrono::milliseconds per_op) {
    delay_ms_[static_cast<int>(kind)].store(per_op.count());
  }
  // open() with O_DIRECT fails with EINVAL, as on a filesystem without it
  // (ramfs: a file O_CREAT asked for is made all the same).
  void RefuseDirectIo() { refuse_direct_ = true; }
  // Every Submit fails with -err, its ops left unsubmitted (io_uring_enter
  // refused for good, by a seccomp filter say); 0: off.
  void FailSubmits(int err) { fail_submit_.store(err); }
  // fallocate() fails with -err (from the nth call on; 1: the next one),
  // where `partial` having reserved the first half of its range first, as
  // ext4's does (it keeps the blocks it got before running out).
  void FailPreallocate(int err, uint64_t from = 1, bool partial = false) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_prealloc_ = err;
    fail_prealloc_at_ = prealloc_calls_ + from;
    fail_prealloc_partial_ = partial;
  }
  // Ops seen so far, by kind.
  uint64_t count(IoKind kind) const;
  void Reset();

 private:
  class Queue;
  struct Rule {
    IoKind kind;
    uint64_t at;    // absolute op number (1-based) of that kind
    bool from;      // applies to every op from `at` on
    int err;        // >0: fail with -err
    bool short_io;  // transfer half
    bool flip;      // flip a bit of the data read
  };
  enum class Fate { kPass, kFail, kShort, kFlip };
  Fate Decide(IoKind kind, int* err);

  std::unique_ptr<IoBackend> inner_;
  mutable std::mutex mu_;
  uint64_t counts_[3] = {0, 0, 0};
  std::vector<Rule> rules_;
  std::atomic<bool> refuse_direct_{false};
  std::atomic<int> fail_submit_{0};
  std::atomic<int64_t> delay_ms_[3] = {0, 0, 0};
  int fail_prealloc_ = 0;  // under mu_
  bool fail_prealloc_partial_ = false;
  uint64_t fail_prealloc_at_ = 0, prealloc_calls_ = 0;
};

}  // namespace ztier::nvme

#endif  // ZTIER_NVME_IO_BACKEND_H_
