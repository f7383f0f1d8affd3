// ztier common: directory locks (see dir_lock.h).
#include "common/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

namespace ztier {
namespace {

// Pids holding a flock on the file open as `fd`, from /proc/locks.
std::vector<long> LockHolders(int fd) {
  std::vector<long> pids;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return pids;
  std::ifstream in("/proc/locks");
  std::string line;
  while (std::getline(in, line)) {
    // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks waiters).
    std::istringstream fields(line);
    std::string id, type, kind, access, dev;
    long pid = 0;
    fields >> id >> type;
    if (type == "->") fields >> type;
    fields >> kind >> access >> pid >> dev;
    if (type != "FLOCK" || !fields) continue;
    unsigned major_no = 0, minor_no = 0;
    unsigned long long ino = 0;
    if (std::sscanf(dev.c_str(), "%x:%x:%llu", &major_no, &minor_no, &ino) != 3) continue;
    if (ino == st.st_ino && major_no == major(st.st_dev) && minor_no == minor(st.st_dev)) {
      pids.push_back(pid);
    }
  }
  return pids;
}

// "process 1234", "this process (pid 1234)", or "another process".
std::string DescribeHolder(int fd) {
  std::vector<long> pids = LockHolders(fd);
  if (pids.empty()) {
    // An exclusive holder wrote its pid into the file.
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    if (n > 0) {
      const long pid = std::strtol(buf, nullptr, 10);
      if (pid > 0) pids.push_back(pid);
    }
  }
  if (pids.empty()) return "another process";
  const long self = static_cast<long>(::getpid());
  std::string out;
  for (long pid : pids) {
    if (!out.empty()) out += ", ";
    out += pid == self ? StrCat("this process (pid ", pid, ")") : StrCat("process ", pid);
  }
  return out;
}

Status Busy(std::string_view what, const std::string& dir, const std::string& path, int fd,
            std::string_view advice = {}) {
  return Status(
      StatusCode::kUnavailable,
      StrCat(what, " ", dir, " is in use by ", DescribeHolder(fd), " (lock file ", path, "); ",
             advice.empty() ? "two users must not share it: wait for the other one to "
                              "finish, or choose another directory"
                            : advice),
      EWOULDBLOCK);
}

void WritePid(int fd) {
  const std::string pid = StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) == 0) {
    [[maybe_unused]] ssize_t n = ::pwrite(fd, pid.data(), pid.size(), 0);
  }
}

}  // namespace

Result<DirLock> DirLock::Acquire(const std::string& dir, std::string_view file_name,
                                 std::string_view what, Mode mode, std::string_view advice) {
  struct stat dst {};
  if (::stat(dir.c_str(), &dst) != 0) return PosixError(StrCat(what, " ", dir), errno);
  if (!S_ISDIR(dst.st_mode)) {
    return Status::InvalidArgument(StrCat(what, " ", dir, " is not a directory"));
  }
  const std::string path = (std::filesystem::path(dir) / file_name).string();
  const int op = (mode == Mode::kExclusive ? LOCK_EX : LOCK_SH) | LOCK_NB;
  // The path may be removed by a releasing holder between our open and our
  // flock: then the lock we got is on a dead file, so try again.
  for (int attempt = 0; attempt < 16; ++attempt) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    int err = fd < 0 ? errno : 0;
    if (fd < 0 && mode == Mode::kShared && (err == EACCES || err == EROFS)) {
      fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);  // readers need no write
      if (fd < 0 && errno != ENOENT) err = errno;  // else: the write refusal says why
    }
    if (fd < 0) return PosixError(StrCat("lock file ", path, " of ", what, " ", dir), err);
    if (::flock(fd, op) != 0) {
      err = errno;
      Status s = err == EWOULDBLOCK
                     ? Busy(what, dir, path, fd, advice)
                     : PosixError(StrCat("flock ", path, " of ", what, " ", dir), err);
      ::close(fd);
      return s;
    }
    struct stat held {
    }, now{};
    if (::fstat(fd, &held) != 0 || ::stat(path.c_str(), &now) != 0 || held.st_ino != now.st_ino ||
        held.st_dev != now.st_dev) {
      ::close(fd);
      continue;
    }
    if (mode == Mode::kExclusive) WritePid(fd);
    DirLock lock;
    lock.dir_ = dir;
    lock.path_ = path;
    lock.what_ = std::string(what);
    lock.mode_ = mode;
    lock.fd_ = fd;
    return lock;
  }
  return Status::Unavailable(
      StrCat("lock file ", path, " of ", what, " ", dir, " keeps being replaced; try again"));
}

DirLock::~DirLock() { Release(); }

DirLock::DirLock(DirLock&& other) noexcept { *this = std::move(other); }

DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    Release();
    dir_ = std::move(other.dir_);
    path_ = std::move(other.path_);
    what_ = std::move(other.what_);
    mode_ = other.mode_;
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

Status DirLock::MakeExclusive() {
  if (fd_ < 0) return Status::FailedPrecondition(StrCat(what_, " ", dir_, " is not locked"));
  if (mode_ == Mode::kExclusive) return Status::Ok();
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    Status s = err == EWOULDBLOCK ? Busy(what_, dir_, path_, fd_)
                                  : PosixError(StrCat("flock ", path_), err);
    if (::flock(fd_, LOCK_SH | LOCK_NB) != 0) {  // lost in the conversion's gap
      ::close(fd_);
      fd_ = -1;
    }
    return s;
  }
  mode_ = Mode::kExclusive;
  WritePid(fd_);
  return Status::Ok();
}

void DirLock::Release() {
  if (fd_ < 0) return;
  // Remove the file while still holding it: a waiter that opened it sees
  // the lock held, then finds the path gone and starts again.
  if (mode_ == Mode::kExclusive) ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
}

}  // namespace ztier
