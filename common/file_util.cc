// ztier common: durable file writes and bounded reads (see file_util.h).
#include "common/file_util.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>

#include "common/unique_fd.h"

namespace ztier {
namespace {

std::mutex hook_mu;
std::shared_ptr<const FileFaultHook> hook;  // null: none

// 0, or the errno the hook injects for `op` on `path`.
int Injected(FileOp op, const std::string& path) {
  std::shared_ptr<const FileFaultHook> h;
  {
    std::lock_guard<std::mutex> lock(hook_mu);
    h = hook;
  }
  return h ? (*h)(op, path) : 0;
}

// open(2) through the hook; the fd or -errno.
int OpenFile(const std::string& path, int flags, mode_t mode = 0) {
  if (const int err = Injected(FileOp::kOpen, path)) return -err;
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  return fd >= 0 ? fd : -errno;
}

}  // namespace

std::string_view FileOpName(FileOp op) {
  switch (op) {
    case FileOp::kOpen:
      return "open";
    case FileOp::kWrite:
      return "write";
    case FileOp::kRead:
      return "read";
    case FileOp::kFsync:
      return "fsync";
    case FileOp::kRename:
      return "rename";
    case FileOp::kFsyncDir:
      return "fsync-dir";
    case FileOp::kRemove:
      return "remove";
  }
  return "?";
}

void SetFileFaultHook(FileFaultHook h) {
  std::lock_guard<std::mutex> lock(hook_mu);
  hook = h ? std::make_shared<const FileFaultHook>(std::move(h)) : nullptr;
}

Status FsyncPath(const std::string& path, bool directory) {
  const int fd = OpenFile(path, directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return PosixError(StrCat("open ", path, " for fsync"), fd);
  UniqueFd guard(fd);
  const FileOp op = directory ? FileOp::kFsyncDir : FileOp::kFsync;
  int err = Injected(op, path);
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (err != 0) return PosixError(StrCat("fsync ", path), err);
  return Status::Ok();
}

std::string_view MemoryFilesystemOf(const std::string& path) {
  struct statfs sfs {};
  if (::statfs(path.c_str(), &sfs) != 0) return "";
  if (sfs.f_type == TMPFS_MAGIC) return "tmpfs";
  if (sfs.f_type == RAMFS_MAGIC) return "ramfs";
  return "";
}

void OpenClosedStandardFds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    const int opened = ::open("/dev/null", O_RDWR);  // the lowest free number: fd
    if (opened >= 0 && opened != fd) ::close(opened);
  }
}

Result<std::string> ReplaceableTarget(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return path;
    return PosixError(StrCat("stat ", path), errno);
  }
  if (S_ISREG(st.st_mode)) return path;
  if (S_ISLNK(st.st_mode)) {
    std::unique_ptr<char, decltype(&std::free)> real(::realpath(path.c_str(), nullptr), &std::free);
    if (real == nullptr) {
      return PosixError(StrCat(path,
                               " is a symbolic link to nothing that can be written; "
                               "not replaced"),
                        errno);
    }
    if (::stat(real.get(), &st) == 0 && S_ISREG(st.st_mode)) return std::string(real.get());
    return Status::InvalidArgument(
        StrCat(path, " links to ", real.get(), ", which is not a regular file; not replaced"));
  }
  return Status::InvalidArgument(StrCat(path, " is not a regular file (",
                                        S_ISDIR(st.st_mode)                          ? "a directory"
                                        : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                        : S_ISFIFO(st.st_mode)                       ? "a pipe"
                                                                                     : "a socket",
                                        "); not replaced"));
}

namespace {

// "<path>.<pid>-<n>.tmp": a temp file of this writer's own. Two writers of
// one path (two threads, two processes) each rename only their own, and no
// file the caller did not name ("<path>.tmp", say) is ever removed.
std::string TempNameFor(const std::string& path) {
  static std::atomic<uint64_t> next{0};
  return StrCat(path, ".", ::getpid(), "-", next.fetch_add(1), ".tmp");
}

}  // namespace

void RemoveStaleTemps(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string prefix = p.filename().string() + ".";
  std::error_code ec;
  const std::filesystem::path dir = p.parent_path().empty() ? "." : p.parent_path();
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(prefix) || !name.ends_with(".tmp")) continue;
    const std::string_view rest =
        std::string_view(name).substr(prefix.size(), name.size() - prefix.size() - 4);
    const size_t dash = rest.find('-');
    if (dash == std::string_view::npos || dash == 0 || dash + 1 == rest.size()) continue;
    if (!std::all_of(rest.begin(), rest.end(), [](char c) {
          return c == '-' || std::isdigit(static_cast<unsigned char>(c));
        })) {
      continue;
    }
    const long pid = std::strtol(std::string(rest.substr(0, dash)).c_str(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 ||
        errno != ESRCH) {
      continue;
    }
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(e.path().c_str());
  }
}

Status WriteFileAtomically(const std::string& named, std::string_view data,
                           const AtomicWriteOptions& options) {
  if (named.empty()) return Status::InvalidArgument("an empty path names no file");
  ZT_ASSIGN_OR_RETURN(const std::string path, ReplaceableTarget(named));
  if (options.remove_stale_temps) RemoveStaleTemps(path);
  const std::string tmp = TempNameFor(path);
  // A new file of its own (O_EXCL, no link followed).
  const int fd = OpenFile(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600);
  if (fd < 0) return PosixError(StrCat("create ", tmp), fd);
  UniqueFd guard(fd);
  // Any failure from here on leaves no temp file behind.
  auto fail = [&](std::string_view what, int err) {
    if (guard.get() >= 0) (void)guard.Close();
    ::unlink(tmp.c_str());
    return PosixError(StrCat(what, " ", tmp), err);
  };
  size_t done = 0;
  while (done < data.size()) {
    if (const int err = Injected(FileOp::kWrite, tmp)) return fail("write", err);
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("write", errno);
    done += static_cast<size_t>(n);
  }
  int err = Injected(FileOp::kFsync, tmp);
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (err != 0) return fail("fsync", err);
  if (const int close_err = guard.Close(); close_err != 0) return fail("close", close_err);
  err = Injected(FileOp::kRename, path);
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    return PosixError(StrCat("rename ", tmp, " -> ", path), err);
  }
  if (!options.fsync_directory) return Status::Ok();
  std::string dir = std::filesystem::path(path).parent_path().string();
  return FsyncPath(dir.empty() ? "." : dir, /*directory=*/true);
}

Status RemoveFile(const std::string& path) {
  int err = Injected(FileOp::kRemove, path);
  if (err == 0 && ::unlink(path.c_str()) != 0 && errno != ENOENT) err = errno;
  if (err != 0) return PosixError(StrCat("remove ", path), err);
  return Status::Ok();
}

Result<std::string> ReadFileToString(const std::string& path, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer, before the
  // check below could refuse it (regular files read the same either way).
  const int fd = OpenFile(path, O_RDONLY | O_NONBLOCK);
  if (fd < 0) return PosixError(StrCat("open ", path), fd);
  UniqueFd guard(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return PosixError(StrCat("stat ", path), errno);
  if (S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(StrCat(path, " is a directory, not a file"));
  }
  if (!S_ISREG(st.st_mode)) {
    return Status::InvalidArgument(
        StrCat(path, " is not a regular file (a device, a pipe or a socket)"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    return Status::ResourceExhausted(
        StrCat(path, " is ", size, " bytes, more than the ", max_bytes, " bytes allowed here"));
  }
  std::string data;
  data.resize(size);
  uint64_t done = 0;
  for (;;) {
    if (done == data.size()) {
      // The file may have grown since the stat: read on, within the bound.
      if (done >= max_bytes) {
        char probe;
        const ssize_t n = ::read(fd, &probe, 1);
        if (n == 0) break;
        return Status::ResourceExhausted(
            StrCat(path, " grew past the ", max_bytes, " bytes allowed here while being read"));
      }
      data.resize(std::min<uint64_t>(max_bytes, std::max<uint64_t>(done * 2, 4096)));
    }
    if (const int err = Injected(FileOp::kRead, path))
      return PosixError(StrCat("read ", path), err);
    const ssize_t n = ::read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError(StrCat("read ", path), errno);
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  data.resize(done);
  return data;
}

}  // namespace ztier
