// ztier common: directory locks (see dir_lock.h).
#include "common/dir_lock.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

namespace ztier {
namespace {

// Pids holding a flock on the file `st` describes, from /proc/locks.
std::vector<long> LockHolders(const struct stat& st) {
  std::vector<long> pids;
  std::ifstream in("/proc/locks");
  std::string line;
  while (std::getline(in, line)) {
    // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks waiters).
    std::istringstream fields(line);
    std::string id, type, kind, access, dev;
    long pid = 0;
    fields >> id >> type;
    if (type == "->") continue;  // waiting, not holding
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

// A lock holder as /proc tells it: its command and effective uid, where
// readable (another user's process under hidepid is not).
struct Holder {
  long pid = 0;
  std::string command;
  std::optional<uid_t> uid;
};

Holder DescribePid(long pid) {
  Holder h;
  h.pid = pid;
  std::ifstream in(StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Name:", 0) == 0) {
      const size_t begin = line.find_first_not_of(" \t", 5);  // none: a blank name
      if (begin != std::string::npos) h.command = line.substr(begin);
    } else if (line.rfind("Uid:", 0) == 0) {
      std::istringstream ids(line.substr(4));
      unsigned long real = 0, effective = 0;
      if (ids >> real >> effective) h.uid = static_cast<uid_t>(effective);
    }
  }
  return h;
}

std::string UserName(uid_t uid) {
  struct passwd pw {};
  struct passwd* found = nullptr;
  std::vector<char> buf(4096);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    return StrCat("user ", found->pw_name);
  }
  return StrCat("uid ", uid);
}

// The holders of the lock on the file `st` describes (open as `fd`, or -1):
// from /proc/locks, else the pid an exclusive holder wrote into the file.
std::vector<Holder> Holders(const struct stat& st, int fd) {
  std::vector<long> pids = LockHolders(st);
  if (pids.empty() && fd >= 0) {
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    if (n > 0) {
      const long pid = std::strtol(buf, nullptr, 10);
      if (pid > 0) pids.push_back(pid);
    }
  }
  std::vector<Holder> out;
  for (long pid : pids) out.push_back(DescribePid(pid));
  return out;
}

std::vector<Holder> Holders(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return {};
  return Holders(st, fd);
}

// "process 1234 (ztierd, user ztier)", "this process (pid 1234)", or
// "another process".
std::string HoldersText(const std::vector<Holder>& holders) {
  if (holders.empty()) return "another process";
  const long self = static_cast<long>(::getpid());
  std::string out;
  for (const Holder& h : holders) {
    if (!out.empty()) out += ", ";
    if (h.pid == self) {
      out += StrCat("this process (pid ", h.pid, ")");
      continue;
    }
    out += StrCat("process ", h.pid);
    if (!h.command.empty() || h.uid) {
      out += StrCat(" (", h.command, !h.command.empty() && h.uid ? ", " : "",
                    h.uid ? UserName(*h.uid) : "", ")");
    }
  }
  return out;
}

Status Busy(std::string_view what, const std::string& dir, const std::string& path,
            const std::vector<Holder>& holders, std::string_view advice = {},
            std::string_view note = {}) {
  return Status(
      StatusCode::kUnavailable,
      StrCat(what, " ", dir, " is in use by ", HoldersText(holders), " (lock file ", path, "); ",
             advice.empty() ? "two users must not share it: wait for the other one to "
                              "finish, or choose another directory"
                            : advice,
             note),
      EWOULDBLOCK);
}

// Where our lock file is held only by other users' processes (not root's,
// as /proc/locks tells it): they opened it while it was readable to them
// (an older version made lock files 0644, and a killed holder left one),
// and hold it to keep us out. Not replaced here: one of our own processes
// may take the old file in the moment it is replaced, and two would hold
// it. The owner removes it, once no process of theirs uses the directory.
std::string IntrudersNote(const struct stat& file, const std::string& path,
                          const std::vector<Holder>& holders) {
  if (holders.empty() || file.st_uid != ::geteuid()) return "";
  for (const Holder& h : holders) {
    if (!h.uid || *h.uid == ::geteuid() || *h.uid == 0) return "";
  }
  return StrCat("; no user but its owner may hold it: it was left readable by an older version, ",
                "and is now the owner's alone, so remove it (rm ", path,
                ") once no process of yours uses the directory, and try again");
}

// Whether the lock file `st` is another user's that they left writable to
// group or others: a writer would take their directory over, and remove
// the file as it lets go. (Not any file of another owner: on NFS with
// root_squash, or a vfat or CIFS mount with a fixed uid, the file a writer
// just made belongs to someone else, 0600 as made.)
bool OthersLeftItWritable(const struct stat& st) {
  return st.st_uid != ::geteuid() && (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
}

// The refusal of a directory whose lock file `st` (at `path`) is another
// user's: they use the directory, or did.
Status AnotherUsersLockFile(std::string_view what, const std::string& dir, const std::string& path,
                            const struct stat& st) {
  const std::vector<Holder> holders = Holders(st, -1);
  const std::string user = UserName(st.st_uid);
  return Status(
      StatusCode::kUnavailable,
      holders.empty()
          ? StrCat(what, " ", dir, " was used by ", user, ", whose lock file ", path,
                   " is there; two users must not share it: choose another directory, "
                   "or they remove the file")
          : StrCat(what, " ", dir, " is in use by ", HoldersText(holders), " (lock file ", path,
                   ", ", user, "'s); two users must not share it: choose another directory"),
      EACCES);
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
    // Only its owner may open the file: flock needs no write access, so
    // anyone who can read a lock file can hold it and keep its owner out.
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    int err = fd < 0 ? errno : 0;
    if (fd < 0 && mode == Mode::kShared && (err == EACCES || err == EROFS)) {
      fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);  // readers need no write
      if (fd < 0 && errno != ENOENT) err = errno;  // else: the write refusal says why
    }
    if (fd < 0 && err == EACCES) {
      // Another user's lock file (not ours to open): they use the
      // directory, or did.
      struct stat theirs {};
      if (::lstat(path.c_str(), &theirs) == 0 && theirs.st_uid != ::geteuid()) {
        return AnotherUsersLockFile(what, dir, path, theirs);
      }
    }
    if (fd < 0) return PosixError(StrCat("lock file ", path, " of ", what, " ", dir), err);
    struct stat mine {};
    if (::fstat(fd, &mine) != 0) {
      err = errno;
      ::close(fd);
      return PosixError(StrCat("stat lock file ", path, " of ", what, " ", dir), err);
    }
    if (mode == Mode::kExclusive && OthersLeftItWritable(mine)) {
      ::close(fd);
      return AnotherUsersLockFile(what, dir, path, mine);
    }
    if (mine.st_uid == ::geteuid() && (mine.st_mode & 077) != 0) {
      (void)::fchmod(fd, 0600);  // left readable by an older version
    }
    if (::flock(fd, op) != 0) {
      err = errno;
      if (err == EWOULDBLOCK) {
        const std::vector<Holder> holders = Holders(mine, fd);
        Status busy = Busy(what, dir, path, holders, advice, IntrudersNote(mine, path, holders));
        ::close(fd);
        return busy;
      }
      ::close(fd);
      return PosixError(StrCat("flock ", path, " of ", what, " ", dir), err);
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
    // Absolute (a relative one named another file after a chdir:
    // AtItsPath, Release), its ".." left to the kernel, as the open was.
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(path, ec);
    lock.path_ = ec ? path : absolute.string();
    lock.what_ = std::string(what);
    lock.mode_ = mode;
    lock.fd_ = fd;
    lock.dev_ = held.st_dev;
    lock.ino_ = held.st_ino;
    return lock;
  }
  return Status::Unavailable(
      StrCat("lock file ", path, " of ", what, " ", dir, " keeps being replaced; try again"));
}

std::string DirLock::DescribeHolders(const std::string& lock_file) {
  struct stat st {};
  if (::lstat(lock_file.c_str(), &st) != 0) return "another process";
  return HoldersText(Holders(st, -1));
}

bool DirLock::IsHeld(const std::string& lock_file) {
  struct stat st {};
  return ::lstat(lock_file.c_str(), &st) == 0 && S_ISREG(st.st_mode) && !LockHolders(st).empty();
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
    dev_ = other.dev_;
    ino_ = other.ino_;
  }
  return *this;
}

Status DirLock::MakeExclusive() {
  if (fd_ < 0) return Status::FailedPrecondition(StrCat(what_, " ", dir_, " is not locked"));
  if (mode_ == Mode::kExclusive) return Status::Ok();
  if (struct stat st{}; ::fstat(fd_, &st) == 0 && OthersLeftItWritable(st)) {
    return AnotherUsersLockFile(what_, dir_, path_, st);  // as Acquire's writer
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    Status s = err == EWOULDBLOCK ? Busy(what_, dir_, path_, Holders(fd_))
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

bool DirLock::AtItsPath() const {
  if (fd_ < 0) return false;
  struct stat held {
  }, now{};
  return ::fstat(fd_, &held) == 0 && held.st_nlink > 0 && ::stat(path_.c_str(), &now) == 0 &&
         held.st_ino == now.st_ino && held.st_dev == now.st_dev;
}

void DirLock::Release() {
  if (fd_ < 0) return;
  // Remove the file while still holding it: a waiter that opened it sees
  // the lock held, then finds the path gone and starts again. Not when the
  // path names another file now (ours removed, the directory made again):
  // that is another holder's lock.
  if (mode_ == Mode::kExclusive && AtItsPath()) ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
}

}  // namespace ztier
