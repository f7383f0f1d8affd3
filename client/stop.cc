// libztier: a clean stop on SIGINT / SIGTERM (see InstallStopHandlers in
// client/ztier.h). The first signal is recorded in a lock-free atomic and
// both handlers go back to the default action, so a second signal ends the
// process at once; the training loop polls StopRequested() at its step
// boundaries. Everything the handler calls is async-signal-safe.
#include <signal.h>

#include <atomic>
#include <cerrno>

#include "client/ztier.h"

namespace ztier::client {
namespace {

std::atomic<int> requested{0};
static_assert(std::atomic<int>::is_always_lock_free);

void OnSignal(int sig) {
  int none = 0;
  requested.compare_exchange_strong(none, sig);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGINT, &dfl, nullptr);
  ::sigaction(SIGTERM, &dfl, nullptr);
}

}  // namespace

Status InstallStopHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking calls go on; the loop checks between steps
  for (int sig : {SIGINT, SIGTERM}) {
    if (::sigaction(sig, &sa, nullptr) != 0) {
      return PosixError(StrCat("sigaction(", sig, ") for a clean stop"), errno);
    }
  }
  return Status::Ok();
}

int StopRequested() { return requested.load(std::memory_order_relaxed); }

}  // namespace ztier::client
