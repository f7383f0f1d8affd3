// ztier common: starting a thread as a Result. std::thread throws
// std::system_error when the system has none to give (the task limit of
// `ulimit -u` or a cgroup's pids.max, or no address space for its stack);
// an exception escaping a library call or a thread ends the process, so
// ztier starts its threads through StartThread and returns the error.
//
// A thread started with the default attributes gets a stack of RLIMIT_STACK
// (`ulimit -s`); under a small one (128 KiB) the compute threads overflow
// it. StartThread first raises the process's default thread stack to
// kMinThreadStack when it is below that (never lowers it; threads started
// by others after that get it too).
//
// Thread safety: a function of its arguments. Failure: ResourceExhausted
// naming `what` and the limits that cause it.
#ifndef ZTIER_COMMON_THREAD_H_
#define ZTIER_COMMON_THREAD_H_

#include <pthread.h>

#include <cstddef>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "common/status.h"

namespace ztier {

inline constexpr size_t kMinThreadStack = size_t{8} << 20;

// Raises the default stack of threads started from now on to
// kMinThreadStack, once per process; a failure leaves it as it was.
inline void RaiseDefaultThreadStack() {
  [[maybe_unused]] static const bool raised = [] {
    pthread_attr_t attr;
    if (pthread_getattr_default_np(&attr) != 0) return false;
    size_t size = 0;
    bool ok = pthread_attr_getstacksize(&attr, &size) == 0;
    if (ok && size < kMinThreadStack) {
      ok = pthread_attr_setstacksize(&attr, kMinThreadStack) == 0 &&
           pthread_setattr_default_np(&attr) == 0;
    }
    pthread_attr_destroy(&attr);
    return ok;
  }();
}

template <class F>
Result<std::thread> StartThread(std::string_view what, F&& fn) {
  RaiseDefaultThreadStack();
  try {
    return std::thread(std::forward<F>(fn));
  } catch (const std::system_error& e) {
    return Status::ResourceExhausted(
        StrCat("cannot start ", what, ": ", e.what(),
               " (the task limit of ulimit -u or the cgroup's pids.max, or the address space of "
               "ulimit -v, is reached)"));
  }
}

}  // namespace ztier

#endif  // ZTIER_COMMON_THREAD_H_
