// ztier engine: AF_UNIX SOCK_SEQPACKET sockets (see seqpacket.h).
#include "engine/seqpacket.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

namespace ztier::engine {
namespace {

// A socket address for `path`. A path longer than sun_path (108 bytes) is
// reached through its directory: /proc/self/fd/<dir fd>/<name>, the fd held
// open by the address for as long as it is used.
struct Address {
  sockaddr_un addr{};
  UniqueFd dir;
};

// The longest file name a long path may have: what /proc/self/fd/<fd>/
// leaves of sun_path (an fd of up to 5 digits).
constexpr size_t kMaxLongPathName = sizeof(sockaddr_un{}.sun_path) - 1 - 20;

Result<Address> AddressOf(const std::string& path) {
  ZT_RETURN_IF_ERROR(CheckSocketPath(path));
  Address a;
  a.addr.sun_family = AF_UNIX;
  std::string name = path;
  if (path.size() >= sizeof(a.addr.sun_path)) {
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    a.dir.reset(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!a.dir.valid()) {
      const int err = errno;
      return PosixError(StrCat("opening the directory of ", path), err);
    }
    name = StrCat("/proc/self/fd/", a.dir.get(), "/",
                  slash == std::string::npos ? path : path.substr(slash + 1));
  }
  if (name.size() >= sizeof(a.addr.sun_path)) {  // an fd of more digits than allowed for
    return Status::InvalidArgument(
        StrCat("socket path '", path, "': a file name longer than ", kMaxLongPathName, " bytes"));
  }
  std::memcpy(a.addr.sun_path, name.data(), name.size());
  return a;
}

using Deadline = std::chrono::steady_clock::time_point;

Deadline After(std::chrono::milliseconds timeout) {
  return std::chrono::steady_clock::now() + timeout;
}

// Waits until `fd` has `events` (POLLIN, POLLOUT); false once `deadline`
// has passed. Retries EINTR with the time left.
Result<bool> WaitFor(int fd, short events, Deadline deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{.fd = fd, .events = events, .revents = 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT32_MAX)));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return PosixError("poll on a ztier socket", errno);
  }
}

Status Gone(std::string_view what, int err) {
  return Status(StatusCode::kUnavailable,
                StrCat(what, ": the peer closed the connection (", std::strerror(err), ")"), err);
}

}  // namespace

Status CheckSocketPath(const std::string& path) {
  const size_t slash = path.rfind('/');
  const size_t name = slash == std::string::npos ? path.size() : path.size() - slash - 1;
  if (path.empty() || (path.size() >= sizeof(sockaddr_un{}.sun_path) && name > kMaxLongPathName)) {
    return Status::InvalidArgument(StrCat("socket path '", path,
                                          "': empty, or a file name longer than ", kMaxLongPathName,
                                          " bytes"));
  }
  return Status::Ok();
}

// ------------------------------------------------------------ socket

Result<SeqPacketSocket> SeqPacketSocket::Connect(const std::string& path) {
  ZT_ASSIGN_OR_RETURN(Address a, AddressOf(path));
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return PosixError("socket(AF_UNIX, SOCK_SEQPACKET)", errno);
  for (;;) {
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), sizeof(a.addr)) == 0) {
      break;
    }
    const int err = errno;
    if (err == EINTR) continue;
    // Not a socket: connect answers ECONNREFUSED, or EACCES where the file
    // is not writable to this user (/etc/passwd), which is no permission
    // the admin can give.
    struct stat there {};
    if ((err == ECONNREFUSED || err == EACCES || err == EPERM) &&
        ::stat(path.c_str(), &there) == 0 && !S_ISSOCK(there.st_mode)) {
      return Status(StatusCode::kInvalidArgument,
                    StrCat(path, " is ", S_ISDIR(there.st_mode) ? "a directory" : "not a socket",
                           ": name ztierd's socket (its --socket; ztierd.socket's is "
                           "/run/ztier/ztierd.sock)"),
                    err);
    }
    if (err == EPROTOTYPE) {  // a stream socket, say: another program's
      return Status(StatusCode::kInvalidArgument,
                    StrCat(path, " is a socket of another kind than ztierd's (", std::strerror(err),
                           "): name ztierd's socket (its --socket; ztierd.socket's is "
                           "/run/ztier/ztierd.sock)"),
                    err);
    }
    if (err == ENOENT || err == ECONNREFUSED) {
      return Status(StatusCode::kUnavailable,
                    StrCat("no ztierd listens on ", path, " (", std::strerror(err),
                           "): start it (systemctl start ztierd.socket); a training program "
                           "can instead leave the daemon socket unset and run the engine in "
                           "its own process"),
                    err);
    }
    if (err == EACCES || err == EPERM) {
      // Who the socket admits, as its mode and group say (ztierd.socket's
      // is group ztier, 0660); a directory on the way may be closed too.
      const std::string denied = StrCat("connecting to ", path, ": permission denied; ");
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0) {
        return Status(StatusCode::kFailedPrecondition,
                      StrCat(denied, "a directory on its path is closed to this user (",
                             std::strerror(errno), ")"),
                      err);
      }
      if ((st.st_mode & S_IWGRP) == 0) {
        return Status(StatusCode::kFailedPrecondition,
                      StrCat(denied, "the socket (mode 0", std::oct, (st.st_mode & 07777), std::dec,
                             ") admits its owner, uid ", st.st_uid,
                             ", only: ask the admin to open it to a group of this user's "
                             "(ztierd --socket-mode 0660)"),
                      err);
      }
      std::string group = StrCat("gid ", st.st_gid);
      std::vector<char> buf(16384);
      struct group g {};
      struct group* found = nullptr;
      if (::getgrgid_r(st.st_gid, &g, buf.data(), buf.size(), &found) == 0 && found) {
        group = StrCat("group ", found->gr_name);
      }
      // Root's group (a ztierd started by hand as root) is no group to add
      // users to: the socket wants one of its own.
      if (st.st_gid == 0) {
        return Status(StatusCode::kFailedPrecondition,
                      StrCat(denied, "the socket admits ", group,
                             " (root's) only: ask the admin to give it a group for the users "
                             "of ztier (ztierd.socket's SocketGroup=, as installed; a ztierd "
                             "started by hand makes it with its own group: sg ztier, or chgrp ",
                             path, " after each start)"),
                      err);
      }
      return Status(StatusCode::kFailedPrecondition,
                    StrCat(denied, "the socket admits ", group,
                           " only: ask the admin to add this user to it"),
                    err);
    }
    return PosixError(StrCat("connect to ", path), err);
  }
  return SeqPacketSocket(std::move(fd));
}

Result<std::pair<SeqPacketSocket, SeqPacketSocket>> SeqPacketSocket::Pair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return PosixError("socketpair(AF_UNIX, SOCK_SEQPACKET)", errno);
  }
  return std::pair<SeqPacketSocket, SeqPacketSocket>(SeqPacketSocket(UniqueFd(sv[0])),
                                                     SeqPacketSocket(UniqueFd(sv[1])));
}

Status SeqPacketSocket::Send(std::string_view datagram, std::span<const int> fds,
                             std::chrono::milliseconds timeout, const std::atomic<bool>* give_up) {
  constexpr size_t kMaxFds = 16;
  if (fds.size() > kMaxFds) {
    return Status::InvalidArgument(StrCat(fds.size(), " fds in one message; at most ", kMaxFds));
  }
  iovec iov{.iov_base = const_cast<char*>(datagram.data()), .iov_len = datagram.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  if (!fds.empty()) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  const Deadline deadline = After(timeout);
  for (;;) {
    const ssize_t n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(datagram.size())) return Status::Ok();
    if (n >= 0) return Status::Internal("a SOCK_SEQPACKET send was cut short");
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      // The peer does not read: wait for room, but not forever (nor past
      // `give_up`, looked at every 100 ms).
      const Deadline slice =
          give_up == nullptr ? deadline : std::min(deadline, After(std::chrono::milliseconds(100)));
      ZT_ASSIGN_OR_RETURN(bool room, WaitFor(fd_.get(), POLLOUT, slice));
      if (room) continue;
      if (give_up != nullptr && give_up->load()) {
        return Status::Unavailable("the peer has not read its messages; given up on (stopping)");
      }
      if (std::chrono::steady_clock::now() < deadline) continue;
      return Status::Unavailable(StrCat("the peer has not read its messages for ", timeout.count(),
                                        " ms; giving up on it"));
    }
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) return Gone("send", err);
    if (err == EMSGSIZE) {
      return Status(StatusCode::kInvalidArgument,
                    StrCat("a message of ", datagram.size(), " bytes is too large to send"), err);
    }
    return PosixError("sendmsg on a ztier socket", err);
  }
}

Result<SeqPacketSocket::Received> SeqPacketSocket::Receive(std::chrono::milliseconds timeout,
                                                           size_t max_bytes, uint32_t max_fds) {
  Received out;
  // One byte more than allowed (a larger datagram shows as MSG_TRUNC
  // anyway); not zeroed: only what arrives is copied out.
  std::unique_ptr<char[]> buf(new char[max_bytes + 1]);
  iovec iov{.iov_base = buf.get(), .iov_len = max_bytes + 1};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<uint32_t>(max_fds, 1)));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  // Non-blocking, waiting in poll only when nothing is there: another
  // receiver may take a datagram this one was woken for, and then this one
  // waits again, never past the deadline.
  ssize_t n;
  const Deadline deadline = After(timeout);
  for (;;) {
    n = ::recvmsg(fd_.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n >= 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    if (err == ECONNRESET) return Gone("receive", err);
    if (err != EAGAIN && err != EWOULDBLOCK) return PosixError("recvmsg on a ztier socket", err);
    ZT_ASSIGN_OR_RETURN(bool readable, WaitFor(fd_.get(), POLLIN, deadline));
    if (!readable) {
      return Status::Unavailable(
          StrCat("no message from the peer within ", timeout.count(), " ms"));
    }
  }
  // Take ownership of every fd that came, whatever happens next.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out.fds.emplace_back(fd);
    }
  }
  // The control buffer is rounded up, so it may hold an fd past max_fds.
  if ((msg.msg_flags & MSG_CTRUNC) != 0 || out.fds.size() > max_fds) {
    return Status::Corruption(
        StrCat("a message came with more than ", max_fds, " file descriptors; refused"));
  }
  if ((msg.msg_flags & MSG_TRUNC) != 0 || static_cast<size_t>(n) > max_bytes) {
    return Status::Corruption(
        StrCat("a message larger than the limit of ", max_bytes, " bytes; refused"));
  }
  if (n == 0 && out.fds.empty()) {
    return Status::Unavailable("receive: the peer closed the connection");
  }
  out.data.assign(buf.get(), static_cast<size_t>(n));
  return out;
}

Result<PeerCredentials> SeqPacketSocket::Peer() const {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return PosixError("getsockopt(SO_PEERCRED)", errno);
  }
  return PeerCredentials{.pid = cred.pid, .uid = cred.uid, .gid = cred.gid};
}

Result<std::vector<gid_t>> SeqPacketSocket::PeerGroups() const {
  std::vector<gid_t> groups(64);
  for (;;) {
    socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd_.get(), SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      return groups;
    }
    // ERANGE: `len` now says how many bytes it needs.
    if (errno != ERANGE || len <= groups.size() * sizeof(gid_t)) {
      return PosixError("getsockopt(SO_PEERGROUPS)", errno);
    }
    groups.resize(len / sizeof(gid_t));
  }
}

Result<UniqueFd> SeqPacketSocket::PeerPidfd() const {
  constexpr int kSoPeerPidfd = 77;  // SO_PEERPIDFD, Linux 6.5; older headers lack it
  int pidfd = -1;
  socklen_t len = sizeof(pidfd);
  if (::getsockopt(fd_.get(), SOL_SOCKET, kSoPeerPidfd, &pidfd, &len) != 0) {
    if (errno == ENOPROTOOPT) {
      return Status::Unimplemented("SO_PEERPIDFD: this kernel has no peer pidfds (before 6.5)");
    }
    return PosixError("getsockopt(SO_PEERPIDFD)", errno);
  }
  return UniqueFd(pidfd);
}

void SeqPacketSocket::Shutdown() {
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

Status SeqPacketSocket::Close() {
  if (const int err = fd_.Close()) return PosixError("close of a ztier socket", err);
  return Status::Ok();
}

// ------------------------------------------------------------ listener

Result<SeqPacketListener> SeqPacketListener::Listen(const std::string& path, mode_t mode,
                                                    int backlog) {
  ZT_ASSIGN_OR_RETURN(Address a, AddressOf(path));
  // One listener a path: two started at once both found a stale file
  // stale (a socket bound but not yet listening refuses connections too),
  // and both bound the path, one of them then unreachable.
  const std::filesystem::path where(path);
  const std::string dir = where.has_parent_path() ? where.parent_path().string() : ".";
  Result<DirLock> lock = DirLock::Acquire(dir, StrCat(where.filename().string(), ".lock"),
                                          "the directory of the socket", DirLock::Mode::kExclusive);
  if (!lock.ok()) {
    // (Another user's lock file is said as such: none may hold it.)
    if (lock.status().code() != StatusCode::kUnavailable || lock.status().sys_errno() == EACCES) {
      return lock.status();
    }
    const std::string lock_file = where.string() + ".lock";
    return Status::Unavailable(StrCat(path, " is in use by ", DirLock::DescribeHolders(lock_file),
                                      ", which holds its lock file ", lock_file,
                                      ": another ztierd listens there or is starting"));
  }
  // A socket file already there: live (someone accepts) is an error; stale
  // (its process died) is replaced.
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return Status::FailedPrecondition(
          StrCat(path, " exists and is not a socket; refusing to replace it"));
    }
    Result<SeqPacketSocket> probe = SeqPacketSocket::Connect(path);
    if (probe.ok()) {
      return Status::Unavailable(StrCat(path, " is in use: another ztierd listens there"));
    }
    // Only a socket nobody listens on is stale; any other answer (permission
    // denied, ...) may be a live daemon's, which must not be removed.
    if (probe.status().sys_errno() != ECONNREFUSED) {
      return probe.status().Annotate(StrCat("checking whether ", path, " is stale"));
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      const int err = errno;
      return PosixError(StrCat("removing the stale socket ", path), err);
    }
  }
  // Non-blocking: Accept polls, and a connection aborted between the poll
  // and accept(2) must not block it.
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return PosixError("socket(AF_UNIX, SOCK_SEQPACKET)", errno);
  // Bind under a umask that leaves nothing open, then set the mode asked.
  const mode_t old_umask = ::umask(0177);
  const int bound = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), sizeof(a.addr));
  const int bind_err = errno;
  ::umask(old_umask);
  if (bound != 0) return PosixError(StrCat("bind ", path), bind_err);
  SeqPacketListener l;
  l.path_ = path;
  l.lock_ = *std::move(lock);
  if (struct stat bound_st{}; ::lstat(path.c_str(), &bound_st) == 0) {
    l.dev_ = bound_st.st_dev;
    l.ino_ = bound_st.st_ino;
  }
  if (::chmod(path.c_str(), mode) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return PosixError(StrCat("chmod ", path), err);
  }
  if (::listen(fd.get(), backlog) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return PosixError(StrCat("listen on ", path), err);
  }
  l.fd_ = std::move(fd);
  return l;
}

Result<SeqPacketListener> SeqPacketListener::FromFd(int raw_fd) {
  UniqueFd owned(raw_fd);  // closed on every refusal
  const int fd = owned.get();
  int type = 0, listening = 0;
  socklen_t len = sizeof(type);
  sockaddr_un addr{};
  socklen_t alen = sizeof(addr);
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) {
    const int err = errno;
    return PosixError(StrCat("fd ", fd, " handed over is not a socket"), err);
  }
  len = sizeof(listening);
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0) {
    const int err = errno;
    return PosixError(StrCat("getsockopt(SO_ACCEPTCONN) on fd ", fd), err);
  }
  if (addr.sun_family != AF_UNIX || type != SOCK_SEQPACKET || !listening) {
    return Status::InvalidArgument(
        StrCat("fd ", fd,
               " handed over is not a listening AF_UNIX SOCK_SEQPACKET socket "
               "(use ListenSequentialPacket= in the socket unit)"));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    const int err = errno;
    return PosixError(StrCat("making fd ", fd, " non-blocking"), err);
  }
  SeqPacketListener l;
  l.fd_ = std::move(owned);
  return l;
}

Result<SeqPacketSocket> SeqPacketListener::Accept(std::chrono::milliseconds timeout) {
  ZT_ASSIGN_OR_RETURN(bool readable, WaitFor(fd_.get(), POLLIN, After(timeout)));
  if (!readable) return Status::Unavailable("no connection within the timeout");
  for (;;) {
    const int fd = ::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) return SeqPacketSocket(UniqueFd(fd));
    if (errno == EINTR || errno == ECONNABORTED) continue;
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      return Status::Unavailable("no connection within the timeout");
    }
    return PosixError("accept on the ztierd socket", err);
  }
}

Status SeqPacketListener::Close() {
  Status s;
  // Only the file it bound: one that replaced it there is another's.
  struct stat st {};
  if (!path_.empty() && ::lstat(path_.c_str(), &st) == 0 && st.st_dev == dev_ &&
      st.st_ino == ino_ && ::unlink(path_.c_str()) != 0 && errno != ENOENT) {
    const int err = errno;
    s = PosixError(StrCat("removing ", path_), err);
  }
  path_.clear();
  lock_.Release();
  if (const int err = fd_.Close(); err != 0 && s.ok()) {
    s = PosixError("close of the ztierd socket", err);
  }
  return s;
}

}  // namespace ztier::engine
