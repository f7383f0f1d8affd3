// ztier nvme: io_uring backend and the fault-injecting backend (io_backend.h).
#include "nvme/io_backend.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "common/log.h"

namespace ztier::nvme {

int IoBackend::OpenFile(const std::string& path, int flags, int mode) {
  const int fd = ::open(path.c_str(), flags, mode);
  return fd >= 0 ? fd : -errno;
}

int IoBackend::Preallocate(int fd, uint64_t offset, uint64_t bytes) {
  return ::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes)) == 0 ? 0
                                                                                        : -errno;
}

namespace {

// A ring owned by one swap file. The file is registered as fixed file 0 and
// the staging buffers as fixed buffers, so the kernel skips the per-I/O file
// lookup and page pinning. Completions are read from the shared CQ ring
// without a syscall (io_uring_peek_batch_cqe); one io_uring_enter submits a
// whole batch and, when asked, waits in the same call.
class UringQueue final : public IoQueue {
 public:
  ~UringQueue() override {
    if (initialized_) io_uring_queue_exit(&ring_);
  }

  static Result<std::unique_ptr<IoQueue>> Open(int fd, const std::string& path, uint32_t depth,
                                               std::span<const iovec> fixed) {
    auto q = std::unique_ptr<UringQueue>(new UringQueue());
    io_uring_params params{};
    int rc = io_uring_queue_init_params(depth, &q->ring_, &params);
    if (rc < 0) {
      if (rc == -ENOSYS) return Status::Unimplemented("io_uring is not available in this kernel");
      if (rc == -EPERM) {
        return Status(StatusCode::kFailedPrecondition,
                      StrCat("io_uring is switched off for this process (io_uring_queue_init for ",
                             path, ": EPERM; see sysctl kernel.io_uring_disabled)"),
                      EPERM);
      }
      return PosixError(StrCat("io_uring_queue_init(", depth, ") for ", path), rc);
    }
    q->initialized_ = true;
    rc = io_uring_register_files(&q->ring_, &fd, 1);
    if (rc < 0) return PosixError(StrCat("io_uring_register_files for ", path), rc);
    if (!fixed.empty()) {
      rc = io_uring_register_buffers(&q->ring_, fixed.data(), static_cast<unsigned>(fixed.size()));
      if (rc < 0) {
        return PosixError(StrCat("io_uring_register_buffers (", fixed.size(), " buffers) for ",
                                 path, "; raise RLIMIT_MEMLOCK if this is ENOMEM"),
                          rc);
      }
    }
    q->path_ = path;
    return std::unique_ptr<IoQueue>(std::move(q));
  }

  bool Prepare(const IoOp& op) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return false;
    switch (op.kind) {
      case IoKind::kRead:
        if (op.buf_index >= 0) {
          io_uring_prep_read_fixed(sqe, 0, op.buf, op.len, op.offset, op.buf_index);
        } else {
          io_uring_prep_read(sqe, 0, op.buf, op.len, op.offset);
        }
        break;
      case IoKind::kWrite:
        if (op.buf_index >= 0) {
          io_uring_prep_write_fixed(sqe, 0, op.buf, op.len, op.offset, op.buf_index);
        } else {
          io_uring_prep_write(sqe, 0, op.buf, op.len, op.offset);
        }
        break;
      case IoKind::kFsync:
        io_uring_prep_fsync(sqe, 0, IORING_FSYNC_DATASYNC);
        // Starts only after every earlier op on this ring has completed.
        sqe->flags |= IOSQE_IO_DRAIN;
        break;
    }
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, op.user_data);
    return true;
  }

  Status Submit(unsigned wait_for) override {
    for (;;) {
      const int rc =
          wait_for > 0 ? io_uring_submit_and_wait(&ring_, wait_for) : io_uring_submit(&ring_);
      if (rc >= 0) return Status::Ok();
      if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) {
        if (wait_for == 0) return Status::Ok();
        continue;
      }
      return PosixError(StrCat("io_uring_enter for ", path_), rc);
    }
  }

  size_t Unsubmitted() const override { return io_uring_sq_ready(&ring_); }

  size_t Reap(IoCompletion* out, size_t max) override {
    io_uring_cqe* cqes[64];
    size_t got = 0;
    while (got < max) {
      const unsigned want = static_cast<unsigned>(std::min<size_t>(64, max - got));
      const unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, want);
      if (n == 0) break;
      for (unsigned i = 0; i < n; ++i) {
        out[got++] = IoCompletion{io_uring_cqe_get_data64(cqes[i]), cqes[i]->res};
      }
      io_uring_cq_advance(&ring_, n);
    }
    return got;
  }

 private:
  UringQueue() = default;
  io_uring ring_{};
  bool initialized_ = false;
  std::string path_;
};

class UringBackend final : public IoBackend {
 public:
  std::string_view name() const override { return "io_uring"; }
  Result<std::unique_ptr<IoQueue>> OpenQueue(int fd, const std::string& path, uint32_t depth,
                                             std::span<const iovec> fixed) override {
    return UringQueue::Open(fd, path, depth, fixed);
  }
};

}  // namespace

std::unique_ptr<IoBackend> MakeUringBackend() { return std::make_unique<UringBackend>(); }

Status ProbeUring() {
  io_uring_probe* probe = io_uring_get_probe();
  if (probe == nullptr) return Status::Unimplemented("io_uring is not available (probe failed)");
  struct Need {
    int op;
    const char* name;
  };
  const Need needs[] = {{IORING_OP_READ, "READ"},
                        {IORING_OP_WRITE, "WRITE"},
                        {IORING_OP_READ_FIXED, "READ_FIXED"},
                        {IORING_OP_WRITE_FIXED, "WRITE_FIXED"},
                        {IORING_OP_FSYNC, "FSYNC"}};
  Status s;
  for (const Need& n : needs) {
    if (!io_uring_opcode_supported(probe, n.op)) {
      s = Status::Unimplemented(StrCat("io_uring lacks IORING_OP_", n.name));
      break;
    }
  }
  io_uring_free_probe(probe);
  return s;
}

// ---------------------------------------------------------------------------
// Thread-pool backend

namespace {

// Ops run on a few threads with pread / pwrite / fdatasync; completions wait
// in a queue for Reap. An fsync is a barrier, as IOSQE_IO_DRAIN makes it on
// a ring: it starts when every earlier op is done, and later ops start when
// it is done.
class ThreadQueue final : public IoQueue {
 public:
  explicit ThreadQueue(int fd) : fd_(fd) {}
  // Starts up to `depth` workers (8 at most); fewer if the process cannot
  // make more threads, an error if it can make none (a thread that failed
  // to start in the constructor ended the process: the exception left
  // joinable threads behind).
  Status Start(uint32_t depth) {
    const uint32_t n = std::min<uint32_t>(std::max<uint32_t>(depth, 1), 8);
    for (uint32_t i = 0; i < n; ++i) {
      try {
        workers_.emplace_back([this] { Work(); });
      } catch (const std::system_error& e) {
        if (!workers_.empty()) break;
        return Status(StatusCode::kResourceExhausted,
                      StrCat("no thread for the I/O thread pool (", e.what(), ")"),
                      e.code().value());
      }
    }
    return Status::Ok();
  }
  ~ThreadQueue() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  bool Prepare(const IoOp& op) override {
    prepared_.push_back(op);
    return true;
  }

  size_t Unsubmitted() const override { return prepared_.size(); }

  Status Submit(unsigned wait_for) override {
    std::unique_lock<std::mutex> lock(mu_);
    for (const IoOp& op : prepared_) queued_.push_back(op);
    prepared_.clear();
    work_cv_.notify_all();
    done_cv_.wait(lock, [&] { return done_.size() >= wait_for; });
    return Status::Ok();
  }

  size_t Reap(IoCompletion* out, size_t max) override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    while (n < max && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    return n;
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || (!queued_.empty() && !barrier_); });
      if (stop_ && queued_.empty()) return;
      const IoOp op = queued_.front();
      queued_.pop_front();
      if (op.kind == IoKind::kFsync) {
        barrier_ = true;  // nothing after it starts until it is done
        idle_cv_.wait(lock, [&] { return running_ == 0; });
      }
      ++running_;
      lock.unlock();
      const int32_t res = Run(op);
      lock.lock();
      --running_;
      if (op.kind == IoKind::kFsync) {
        barrier_ = false;
        work_cv_.notify_all();
      }
      if (running_ == 0) idle_cv_.notify_all();
      done_.push_back(IoCompletion{op.user_data, res});
      done_cv_.notify_all();
    }
  }

  int32_t Run(const IoOp& op) const {
    ssize_t n = 0;
    do {
      switch (op.kind) {
        case IoKind::kRead:
          n = ::pread(fd_, op.buf, op.len, static_cast<off_t>(op.offset));
          break;
        case IoKind::kWrite:
          n = ::pwrite(fd_, op.buf, op.len, static_cast<off_t>(op.offset));
          break;
        case IoKind::kFsync:
          n = ::fdatasync(fd_);
          break;
      }
    } while (n < 0 && errno == EINTR);
    return n < 0 ? -errno : static_cast<int32_t>(n);
  }

  const int fd_;
  std::vector<IoOp> prepared_;  // the driving thread's
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_, idle_cv_;
  std::deque<IoOp> queued_;
  std::deque<IoCompletion> done_;
  uint32_t running_ = 0;
  bool barrier_ = false;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

class ThreadBackend final : public IoBackend {
 public:
  std::string_view name() const override { return "threads"; }
  Result<std::unique_ptr<IoQueue>> OpenQueue(int fd, const std::string&, uint32_t depth,
                                             std::span<const iovec>) override {
    auto q = std::make_unique<ThreadQueue>(fd);
    ZT_RETURN_IF_ERROR(q->Start(depth));
    return std::unique_ptr<IoQueue>(std::move(q));
  }
};

}  // namespace

std::unique_ptr<IoBackend> MakeThreadBackend() { return std::make_unique<ThreadBackend>(); }

Status ProbeUringSetup() {
  static const Status probe = [] {
    io_uring ring{};
    const int rc = io_uring_queue_init(1, &ring, 0);
    if (rc == 0) {
      io_uring_queue_exit(&ring);
      return ProbeUring();
    }
    std::string sysctl = "unreadable";
    if (std::FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "r")) {
      int v = -1;
      if (std::fscanf(f, "%d", &v) == 1) sysctl = StrCat(v);
      std::fclose(f);
    }
    return Status(rc == -ENOSYS ? StatusCode::kUnimplemented : StatusCode::kFailedPrecondition,
                  StrCat("io_uring is refused (", std::strerror(-rc),
                         "; sysctl kernel.io_uring_disabled = ", sysctl,
                         ", or a seccomp filter of the container)"),
                  -rc);
  }();
  return probe;
}

std::shared_ptr<IoBackend> SelectBackend(const Status& uring_probe) {
  if (uring_probe.ok()) return MakeUringBackend();
  ZT_LOG(kWarn, "nvme") << uring_probe
                        << ": the swap space uses the portable thread-pool I/O backend (slower "
                           "at high queue depths); allow io_uring with sysctl "
                           "kernel.io_uring_disabled=0, or set ztier.io_backend to silence this";
  return MakeThreadBackend();
}

Result<std::shared_ptr<IoBackend>> MakeBackend(BackendChoice choice) {
  switch (choice) {
    case BackendChoice::kThreads:
      return std::shared_ptr<IoBackend>(MakeThreadBackend());
    case BackendChoice::kUring: {
      Status probe = ProbeUringSetup();
      if (!probe.ok()) {
        return probe.Annotate("ztier.io_backend is io_uring; choose auto or threads");
      }
      return std::shared_ptr<IoBackend>(MakeUringBackend());
    }
    case BackendChoice::kAuto:
      break;
  }
  Status probe = ProbeUringSetup();
  if (probe.ok()) return std::shared_ptr<IoBackend>(MakeUringBackend());
  static std::atomic<bool> warned{false};  // once per process
  if (!warned.exchange(true)) return SelectBackend(probe);
  return std::shared_ptr<IoBackend>(MakeThreadBackend());
}

// ---------------------------------------------------------------------------
// FaultBackend

class FaultBackend::Queue final : public IoQueue {
 public:
  Queue(FaultBackend* owner, std::unique_ptr<IoQueue> inner)
      : owner_(owner), inner_(std::move(inner)) {}

  bool Prepare(const IoOp& op) override {
    const int64_t delay = owner_->delay_ms_[static_cast<int>(op.kind)].load();
    if (delay > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    int err = 0;
    const Fate fate = owner_->Decide(op.kind, &err);
    if (fate == Fate::kFail) {
      synthetic_.push_back(IoCompletion{op.user_data, -err});
      return true;
    }
    IoOp real = op;
    if (fate == Fate::kShort && op.kind != IoKind::kFsync && op.len > 4096) {
      real.len = std::max<uint32_t>(4096, (op.len / 2) & ~uint32_t{4095});
    }
    if (fate == Fate::kFlip) flip_[op.user_data] = op.buf;
    return inner_->Prepare(real);
  }

  size_t Unsubmitted() const override { return inner_->Unsubmitted(); }

  Status Submit(unsigned wait_for) override {
    if (const int err = owner_->fail_submit_.load(); err != 0) {
      return PosixError("io_uring_enter (injected)", err);
    }
    // Synthetic completions are ready at once; do not block waiting for them.
    const unsigned ready = static_cast<unsigned>(synthetic_.size());
    return inner_->Submit(wait_for > ready ? wait_for - ready : 0);
  }

  size_t Reap(IoCompletion* out, size_t max) override {
    size_t got = 0;
    while (got < max && !synthetic_.empty()) {
      out[got++] = synthetic_.front();
      synthetic_.pop_front();
    }
    const size_t n = inner_->Reap(out + got, max - got);
    for (size_t i = got; i < got + n; ++i) {
      auto it = flip_.find(out[i].user_data);
      if (it == flip_.end()) continue;
      if (out[i].res > 0) {
        // Flip a bit in the middle of what was read: a media error the drive
        // did not report.
        static_cast<uint8_t*>(it->second)[out[i].res / 2] ^= 0x10;
      }
      flip_.erase(it);
    }
    return got + n;
  }

 private:
  FaultBackend* owner_;
  std::unique_ptr<IoQueue> inner_;
  std::deque<IoCompletion> synthetic_;
  std::unordered_map<uint64_t, void*> flip_;
};

FaultBackend::FaultBackend(std::unique_ptr<IoBackend> inner) : inner_(std::move(inner)) {}
FaultBackend::~FaultBackend() = default;

int FaultBackend::OpenFile(const std::string& path, int flags, int mode) {
  if (refuse_direct_ && (flags & O_DIRECT) != 0) {
    // As the kernel on ramfs: O_CREAT makes the file before O_DIRECT is refused.
    if ((flags & O_CREAT) != 0) {
      const int fd = ::open(path.c_str(), flags & ~O_DIRECT, mode);
      if (fd >= 0) ::close(fd);
    }
    return -EINVAL;
  }
  return inner_->OpenFile(path, flags, mode);
}

int FaultBackend::Preallocate(int fd, uint64_t offset, uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_prealloc_ != 0 && ++prealloc_calls_ >= fail_prealloc_at_) {
      if (fail_prealloc_partial_ && bytes / 2 >= 4096) {
        (void)inner_->Preallocate(fd, offset, bytes / 2 / 4096 * 4096);
      }
      return -fail_prealloc_;
    }
    if (fail_prealloc_ == 0) ++prealloc_calls_;
  }
  return inner_->Preallocate(fd, offset, bytes);
}

Result<std::unique_ptr<IoQueue>> FaultBackend::OpenQueue(int fd, const std::string& path,
                                                         uint32_t depth,
                                                         std::span<const iovec> fixed) {
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<IoQueue> inner, inner_->OpenQueue(fd, path, depth, fixed));
  return std::unique_ptr<IoQueue>(std::make_unique<Queue>(this, std::move(inner)));
}

void FaultBackend::FailNth(IoKind kind, uint64_t n, int err) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.push_back(Rule{kind, counts_[static_cast<int>(kind)] + n, false, err, false, false});
}

void FaultBackend::FailFrom(IoKind kind, uint64_t n, int err) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.push_back(Rule{kind, counts_[static_cast<int>(kind)] + n, true, err, false, false});
}

void FaultBackend::ShortNth(IoKind kind, uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.push_back(Rule{kind, counts_[static_cast<int>(kind)] + n, false, 0, true, false});
}

void FaultBackend::FlipBitOnNthRead(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.push_back(
      Rule{IoKind::kRead, counts_[static_cast<int>(IoKind::kRead)] + n, false, 0, false, true});
}

uint64_t FaultBackend::count(IoKind kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_[static_cast<int>(kind)];
}

void FaultBackend::Reset() {
  for (std::atomic<int64_t>& d : delay_ms_) d.store(0);
  std::lock_guard<std::mutex> lock(mu_);
  rules_.clear();
  refuse_direct_ = false;
  fail_prealloc_ = 0;
}

FaultBackend::Fate FaultBackend::Decide(IoKind kind, int* err) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t n = ++counts_[static_cast<int>(kind)];
  for (const Rule& r : rules_) {
    if (r.kind != kind) continue;
    if (r.from ? n >= r.at : n == r.at) {
      if (r.err > 0) {
        *err = r.err;
        return Fate::kFail;
      }
      if (r.short_io) return Fate::kShort;
      if (r.flip) return Fate::kFlip;
    }
  }
  return Fate::kPass;
}

}  // namespace ztier::nvme
