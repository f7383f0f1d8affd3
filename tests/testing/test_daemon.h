// Test support: a ztierd (engine::Daemon) served from a thread of the test
// process on a socket in a fresh private directory, and OpenTestSession,
// which opens a client Session through such a daemon when the test runs
// with ZTIER_TEST_TRANSPORT=daemon (ctest runs the Session, Model and
// runner suites both ways) and embedded otherwise.
//
// Thread safety: a TestDaemon has one owner; OpenTestSession may be called
// from any thread. Failure: Result/Status from the daemon and the session.
#ifndef ZTIER_TESTS_TESTING_TEST_DAEMON_H_
#define ZTIER_TESTS_TESTING_TEST_DAEMON_H_

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "client/ztier.h"
#include "common/log.h"
#include "common/status.h"
#include "engine/daemon.h"
#include "engine/seqpacket.h"

namespace ztier::testing {

// A small engine for daemon tests: a 128 MiB pinned budget on 4 KiB pages.
inline engine::Settings SmallEngine() {
  engine::Settings s;
  s.dram_budget_bytes = uint64_t{128} << 20;
  s.huge_pages = engine::HugePages::kNone;
  return s;
}

class TestDaemon {
 public:
  static Result<std::unique_ptr<TestDaemon>> Start(
      const engine::Settings& settings, const engine::DaemonOptions& options = {},
      std::shared_ptr<nvme::IoBackend> io_backend = nullptr) {
    std::string dir = "/tmp/ztierd-test-XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr) return PosixError("mkdtemp", errno);
    auto t = std::unique_ptr<TestDaemon>(new TestDaemon(dir));
    ZT_ASSIGN_OR_RETURN(t->daemon_,
                        engine::Daemon::Create(settings, options, std::move(io_backend)));
    Result<engine::SeqPacketListener> listener =
        engine::SeqPacketListener::Listen(t->socket(), 0600);
    if (!listener.ok()) return listener.status();
    t->listener_ = *std::move(listener);
    t->thread_ = std::thread([raw = t.get()] {
      Status s = raw->daemon_->Serve(raw->listener_);
      if (!s.ok()) {
        ZT_LOG(kError, "test") << "ztierd: " << s;
      }
    });
    return t;
  }
  ~TestDaemon() { Stop("the test's ztierd is stopping"); }
  TestDaemon(const TestDaemon&) = delete;
  TestDaemon& operator=(const TestDaemon&) = delete;

  // Stops serving (clients get `reason`) and joins the serving thread.
  void Stop(std::string_view reason) {
    if (daemon_ != nullptr) daemon_->Stop(reason);
    if (thread_.joinable()) thread_.join();
    (void)listener_.Close();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string socket() const { return dir_ + "/ztierd.sock"; }
  engine::Daemon& daemon() { return *daemon_; }

 private:
  explicit TestDaemon(std::string dir) : dir_(std::move(dir)) {}

  std::string dir_;
  std::unique_ptr<engine::Daemon> daemon_;
  engine::SeqPacketListener listener_;
  std::thread thread_;
};

// Whether this run's sessions go through a daemon (ZTIER_TEST_TRANSPORT).
inline bool DaemonUnderTest() {
  const char* t = std::getenv("ZTIER_TEST_TRANSPORT");
  return t != nullptr && std::string_view(t) == "daemon";
}

// Session::Open, or (under ZTIER_TEST_TRANSPORT=daemon) a daemon made with
// `options`' engine settings and backend and a session through it. Each
// daemon lives until its session has closed (reaped at the next call) or
// the process ends.
inline Result<std::unique_ptr<client::Session>> OpenTestSession(
    const client::SessionOptions& options) {
  if (!DaemonUnderTest()) return client::Session::Open(options);
  static std::mutex mu;
  static auto* daemons = new std::vector<std::unique_ptr<TestDaemon>>();
  std::lock_guard<std::mutex> lock(mu);
  std::erase_if(*daemons, [](const std::unique_ptr<TestDaemon>& d) {
    return d->daemon().stats().connections == 0;
  });
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<TestDaemon> d,
                      TestDaemon::Start(options.settings, {}, options.io_backend));
  client::SessionOptions through = options;
  through.daemon_socket = d->socket();
  through.io_backend = nullptr;
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<client::Session> s, client::Session::Open(through));
  daemons->push_back(std::move(d));
  return s;
}

// Skips a test whose feature does not go through the daemon yet.
#define ZTIER_SKIP_UNDER_DAEMON(why)                                            \
  do {                                                                          \
    if (::ztier::testing::DaemonUnderTest()) GTEST_SKIP() << "ztierd: " << why; \
  } while (0)

// Whether this kernel gives a socket's peer as a pidfd (SO_PEERPIDFD, Linux
// 6.5), which ztierd needs to keep a process charged while it lives.
inline bool HavePeerPidfd() {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) return false;
  int pidfd = -1;
  socklen_t len = sizeof(pidfd);
  const int rc = ::getsockopt(pair[0], SOL_SOCKET, 77 /* SO_PEERPIDFD */, &pidfd, &len);
  ::close(pair[0]);
  ::close(pair[1]);
  if (rc == 0) ::close(pidfd);
  return rc == 0;
}

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_TEST_DAEMON_H_
