// ztier engine: AF_UNIX SOCK_SEQPACKET sockets for the daemon protocol
// (engine/protocol.h): whole datagrams with file descriptors attached
// (SCM_RIGHTS), the peer's credentials (SO_PEERCRED), and the rules that keep
// a peer from hurting the process: sends use MSG_NOSIGNAL (a dead peer is an
// error, never SIGPIPE), received fds are close-on-exec
// (MSG_CMSG_CLOEXEC), a datagram over the size limit (MSG_TRUNC) or with
// more fds than allowed (MSG_CTRUNC) is an error and every fd that came with
// it is closed, and every wait has a deadline.
//
// Thread safety: one thread may Send while another Receives on the same
// socket; two concurrent Sends (or Receives) are not ordered with each other
// but each datagram stays whole. Failure: Unavailable when the peer is gone
// or does not answer in time (naming the path or the wait), Corruption for
// a datagram that breaks the limits, PosixError otherwise.
#ifndef ZTIER_ENGINE_SEQPACKET_H_
#define ZTIER_ENGINE_SEQPACKET_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/dir_lock.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace ztier::engine {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// Whether `path` can name a socket at all: not empty, and a path past
// sun_path's 108 bytes has a file name short enough to be reached through
// its directory (/proc/self/fd/<fd>/<name>). Nothing is opened: a check of
// the text, for arguments (InvalidArgument).
Status CheckSocketPath(const std::string& path);

class SeqPacketSocket {
 public:
  struct Received {
    std::string data;
    std::vector<UniqueFd> fds;
  };

  SeqPacketSocket() = default;
  explicit SeqPacketSocket(UniqueFd fd) : fd_(std::move(fd)) {}

  // Connects to a listening socket at `path` (any length: a path past
  // sun_path's 108 bytes is reached through its directory). Errors:
  // Unavailable (nothing listens there: names the path), FailedPrecondition
  // (permission denied: the socket's group), InvalidArgument (empty path).
  static Result<SeqPacketSocket> Connect(const std::string& path);
  // Two connected sockets (tests, and helpers in one process).
  static Result<std::pair<SeqPacketSocket, SeqPacketSocket>> Pair();

  // Sends one datagram with `fds` attached (they stay open here), waiting at
  // most `timeout` for room when the peer does not read. Errors:
  // Unavailable (the peer is gone or stuck), InvalidArgument (too large, too
  // many fds), PosixError.
  // A send waiting for room also ends (Unavailable) once `give_up` is set,
  // within 100 ms (a daemon that stops).
  Status Send(std::string_view datagram, std::span<const int> fds = {},
              std::chrono::milliseconds timeout = std::chrono::seconds(30),
              const std::atomic<bool>* give_up = nullptr);
  // The next datagram, waiting at most `timeout`. Datagrams are at most
  // `max_bytes`, with at most `max_fds` fds. Errors: Unavailable (the peer
  // closed, or nothing within the timeout: names it), Corruption (larger,
  // or more fds), PosixError.
  Result<Received> Receive(std::chrono::milliseconds timeout, size_t max_bytes, uint32_t max_fds);

  // The peer's pid, uid and gid as the kernel saw them at connect time.
  Result<PeerCredentials> Peer() const;
  // A pidfd of the peer process (SO_PEERPIDFD): readable once it exits.
  // Errors: Unimplemented (a kernel older than 6.5), PosixError.
  Result<UniqueFd> PeerPidfd() const;
  // The peer's supplementary groups when it connected (SO_PEERGROUPS).
  // Errors: PosixError.
  Result<std::vector<gid_t>> PeerGroups() const;

  int fd() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }
  // Shuts both directions down: the peer's Receive ends with Unavailable.
  void Shutdown();
  Status Close();

 private:
  UniqueFd fd_;
};

// A listening SOCK_SEQPACKET socket: bound to a path by Listen, or handed
// over by systemd socket activation (FromFd).
class SeqPacketListener {
 public:
  SeqPacketListener() = default;
  // Binds `path` (a stale socket file left by a dead process is replaced;
  // a live one is Unavailable: "in use") with `mode` permissions, and
  // listens. One listener a path: `path`.lock beside it is locked
  // (common/dir_lock.h) from before the stale check until Close, so two
  // started at once never both bind it. Sets the process umask for the
  // bind: call it before other threads create files. Errors: Unavailable,
  // InvalidArgument, PosixError, as DirLock::Acquire.
  static Result<SeqPacketListener> Listen(const std::string& path, mode_t mode, int backlog = 64);
  // Takes an fd that already listens (systemd's LISTEN_FDS) and owns it
  // from then on (a refused one is closed); checks that it is an AF_UNIX
  // SOCK_SEQPACKET listening socket. Errors: InvalidArgument.
  static Result<SeqPacketListener> FromFd(int fd);

  // The next connection, waiting at most `timeout`. Errors: Unavailable on
  // timeout or after Shutdown, PosixError.
  Result<SeqPacketSocket> Accept(std::chrono::milliseconds timeout);
  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }
  // Removes the socket file it bound (not one it was handed, nor one that
  // replaced it at the path since).
  Status Close();

 private:
  UniqueFd fd_;
  std::string path_;  // empty when handed over
  DirLock lock_;      // on path_.lock while bound
  dev_t dev_ = 0;     // the socket file bound
  ino_t ino_ = 0;
};

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_SEQPACKET_H_
