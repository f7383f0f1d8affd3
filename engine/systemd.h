// ztier engine: what ztierd needs from systemd, spoken directly (both are
// stable, documented protocols; no libsystemd):
//   - sd_notify: datagrams to $NOTIFY_SOCKET ("READY=1", "STATUS=...",
//     "WATCHDOG=1", "STOPPING=1", "EXTEND_TIMEOUT_USEC=..."), a path or an
//     abstract ("@...") AF_UNIX address; nothing is sent when the variable
//     is unset (not run by systemd);
//   - the watchdog interval ($WATCHDOG_USEC, for this pid per $WATCHDOG_PID);
//   - socket activation: the fds systemd passes from 3 on ($LISTEN_PID,
//     $LISTEN_FDS, $LISTEN_FDNAMES), taken once, close-on-exec, with the
//     variables removed so children do not inherit them.
//
// Thread safety: Notifier may be used from any thread (one datagram per
// call). TakeListenFds and the environment readers must run before other
// threads touch the environment. Failure: Status naming the variable or the
// socket; a notifier whose socket is gone reports it and the caller goes on.
#ifndef ZTIER_ENGINE_SYSTEMD_H_
#define ZTIER_ENGINE_SYSTEMD_H_

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ztier::engine::systemd {

class Notifier {
 public:
  // From $NOTIFY_SOCKET; a notifier that sends nothing when it is unset.
  // Errors: InvalidArgument (a malformed address), PosixError (socket).
  static Result<Notifier> FromEnvironment();
  // To an explicit address (tests): a path, or "@name" for the abstract
  // namespace.
  static Result<Notifier> ForAddress(const std::string& address);

  bool enabled() const { return fd_.valid(); }
  // One datagram of newline-separated assignments. Errors: Unavailable (the
  // manager's socket is gone), PosixError.
  Status Notify(std::string_view state);
  Status Ready() { return Notify("READY=1"); }
  Status SetStatus(std::string_view text);
  Status Watchdog() { return Notify("WATCHDOG=1"); }
  Status Stopping() { return Notify("STOPPING=1"); }
  // Asks for `more` time before the stop (or start) timeout fires.
  Status ExtendTimeout(std::chrono::microseconds more);

 private:
  UniqueFd fd_;
  std::string address_;  // as given; '@' for abstract
};

// The watchdog interval systemd expects pings within, if it asked for them
// for this process ($WATCHDOG_PID absent or equal to getpid()). Ping at half
// of it. Errors: InvalidArgument (a malformed value).
Result<std::optional<std::chrono::microseconds>> WatchdogInterval();

struct ListenFd {
  int fd = -1;       // owned by the caller from now on
  std::string name;  // from $LISTEN_FDNAMES ("unknown" when not named)
};
// The fds systemd passed to this process (empty when not socket-activated,
// or activated for another pid). The variables are removed. Errors:
// InvalidArgument naming the malformed variable (the fds are then closed).
Result<std::vector<ListenFd>> TakeListenFds();

}  // namespace ztier::engine::systemd

#endif  // ZTIER_ENGINE_SYSTEMD_H_
