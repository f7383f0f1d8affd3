// sd_notify, the watchdog interval and socket activation as systemd speaks
// them: datagrams a socket owned by the test receives (path and abstract
// addresses), the environment variables systemd sets, and fds passed from 3
// on (in a forked child, so the test's own fds are untouched).
#include "engine/systemd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

namespace ztier::engine::systemd {
namespace {

// A datagram socket bound to `address` (a path or "@abstract").
UniqueFd Bound(const std::string& address) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (address.size() >= sizeof(addr.sun_path)) {
    ADD_FAILURE() << "socket address too long for sun_path: " << address;
    return UniqueFd();
  }
  std::memcpy(addr.sun_path, address.data(), address.size());
  if (address[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size() +
                                               (address[0] == '@' ? 0 : 1));
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

std::string Next(const UniqueFd& fd) {
  char buf[2048];
  const ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
  return n < 0 ? std::string("<nothing: ") + std::strerror(errno) + ">" : std::string(buf, n);
}

TEST(SystemdTest, NotifierSpeaksTheProtocolToAPathSocket) {
  // sun_path holds 108 bytes: a short path under /tmp, as /run/systemd/notify is.
  const std::string path = "/tmp/ztier-notify-" + std::to_string(::getpid()) + ".sock";
  ::unlink(path.c_str());
  UniqueFd manager = Bound(path);
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  Result<Notifier> n = Notifier::FromEnvironment();
  ::unsetenv("NOTIFY_SOCKET");
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_TRUE(n->enabled());
  ASSERT_TRUE(n->Ready().ok());
  EXPECT_EQ(Next(manager), "READY=1");
  ASSERT_TRUE(n->SetStatus("serving 2 jobs\nof 1 user").ok());
  EXPECT_EQ(Next(manager), "STATUS=serving 2 jobs of 1 user");
  ASSERT_TRUE(n->Watchdog().ok());
  EXPECT_EQ(Next(manager), "WATCHDOG=1");
  ASSERT_TRUE(n->ExtendTimeout(std::chrono::seconds(30)).ok());
  EXPECT_EQ(Next(manager), "EXTEND_TIMEOUT_USEC=30000000");
  ASSERT_TRUE(n->Stopping().ok());
  EXPECT_EQ(Next(manager), "STOPPING=1");
  // The manager went away: an error the daemon logs, never a signal.
  manager.reset();
  ::unlink(path.c_str());
  Status gone = n->Watchdog();
  EXPECT_EQ(gone.code(), StatusCode::kUnavailable) << gone;
}

TEST(SystemdTest, AbstractAddressesWork) {
  const std::string address = "@ztier-systemd-test-" + std::to_string(::getpid());
  UniqueFd manager = Bound(address);
  Result<Notifier> n = Notifier::ForAddress(address);
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_TRUE(n->Ready().ok());
  EXPECT_EQ(Next(manager), "READY=1");
}

TEST(SystemdTest, WithoutNotifySocketNothingIsSentAndBadAddressesAreRefused) {
  ::unsetenv("NOTIFY_SOCKET");
  Result<Notifier> n = Notifier::FromEnvironment();
  ASSERT_TRUE(n.ok());
  EXPECT_FALSE(n->enabled());
  EXPECT_TRUE(n->Ready().ok());
  EXPECT_EQ(Notifier::ForAddress("relative/path").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Notifier::ForAddress("/" + std::string(200, 'x')).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Notifier::ForAddress("/nonexistent/ztier/notify").status().code(),
            StatusCode::kUnavailable);
}

TEST(SystemdTest, WatchdogIntervalIsForThisProcessOnly) {
  ::unsetenv("WATCHDOG_USEC");
  ::unsetenv("WATCHDOG_PID");
  EXPECT_FALSE(WatchdogInterval()->has_value());
  ::setenv("WATCHDOG_USEC", "2000000", 1);
  ASSERT_TRUE(WatchdogInterval()->has_value());
  EXPECT_EQ(**WatchdogInterval(), std::chrono::seconds(2));
  ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
  EXPECT_EQ(**WatchdogInterval(), std::chrono::seconds(2));
  ::setenv("WATCHDOG_PID", std::to_string(::getpid() + 1).c_str(), 1);
  EXPECT_FALSE(WatchdogInterval()->has_value());
  ::unsetenv("WATCHDOG_PID");
  ::setenv("WATCHDOG_USEC", "2s", 1);
  EXPECT_EQ(WatchdogInterval().status().code(), StatusCode::kInvalidArgument);
  ::unsetenv("WATCHDOG_USEC");
}

// Runs `body` in a child whose fds 3 and 4 are two fresh sockets; its exit
// code (0: every check held, else the number of the first that failed).
int InChildWithPassedFds(const std::function<int()>& body) {
  const pid_t child = ::fork();
  if (child == 0) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) != 0) ::_exit(100);
    if (::dup2(sv[0], 3) != 3 || ::dup2(sv[1], 4) != 4) ::_exit(101);
    ::_exit(body());
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 200;
}

TEST(SystemdTest, ListenFdsAreTakenOnceWithTheirNames) {
  EXPECT_EQ(InChildWithPassedFds([] {
              ::setenv("LISTEN_PID", std::to_string(::getpid()).c_str(), 1);
              ::setenv("LISTEN_FDS", "2", 1);
              ::setenv("LISTEN_FDNAMES", "control:metrics", 1);
              Result<std::vector<ListenFd>> fds = TakeListenFds();
              if (!fds.ok() || fds->size() != 2) return 1;
              if ((*fds)[0].fd != 3 || (*fds)[0].name != "control") return 2;
              if ((*fds)[1].fd != 4 || (*fds)[1].name != "metrics") return 3;
              if ((::fcntl(3, F_GETFD) & FD_CLOEXEC) == 0) return 4;
              if (std::getenv("LISTEN_FDS") != nullptr || std::getenv("LISTEN_PID") != nullptr) {
                return 5;
              }
              Result<std::vector<ListenFd>> again = TakeListenFds();  // taken already
              return again.ok() && again->empty() ? 0 : 6;
            }),
            0);
}

TEST(SystemdTest, ListenFdsForAnotherProcessOrMalformedAreNotTaken) {
  EXPECT_EQ(InChildWithPassedFds([] {
              ::setenv("LISTEN_PID", std::to_string(::getpid() + 1).c_str(), 1);
              ::setenv("LISTEN_FDS", "2", 1);
              Result<std::vector<ListenFd>> fds = TakeListenFds();
              if (!fds.ok() || !fds->empty()) return 1;
              return ::fcntl(3, F_GETFD) >= 0 ? 0 : 2;  // not closed: not ours to take
            }),
            0);
  EXPECT_EQ(InChildWithPassedFds([] {
              ::setenv("LISTEN_PID", std::to_string(::getpid()).c_str(), 1);
              ::setenv("LISTEN_FDS", "2", 1);
              ::setenv("LISTEN_FDNAMES", "control", 1);  // one name for two fds
              Result<std::vector<ListenFd>> fds = TakeListenFds();
              if (fds.ok() || fds.status().code() != StatusCode::kInvalidArgument) return 1;
              return ::fcntl(3, F_GETFD) < 0 && ::fcntl(4, F_GETFD) < 0 ? 0 : 2;  // closed
            }),
            0);
  EXPECT_EQ(InChildWithPassedFds([] {
              ::setenv("LISTEN_PID", "self", 1);
              ::setenv("LISTEN_FDS", "1", 1);
              return TakeListenFds().status().code() == StatusCode::kInvalidArgument ? 0 : 1;
            }),
            0);
}

}  // namespace
}  // namespace ztier::engine::systemd
