// ztier common: starting a thread as a Result. std::thread throws
// std::system_error when the system has none to give (the task limit of
// `ulimit -u` or a cgroup's pids.max, or no address space for its stack);
// an exception escaping a library call or a thread ends the process, so
// ztier starts its threads through StartThread and returns the error.
//
// Thread safety: a function of its arguments. Failure: ResourceExhausted
// naming `what` and the limits that cause it.
#ifndef ZTIER_COMMON_THREAD_H_
#define ZTIER_COMMON_THREAD_H_

#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "common/status.h"

namespace ztier {

template <class F>
Result<std::thread> StartThread(std::string_view what, F&& fn) {
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
