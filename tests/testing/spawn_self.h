// Test support: this test binary started again as a helper process of its
// own (a fresh process, not a fork of a threaded test), running the one test
// `filter` names with extra environment variables, and waiting for it (or
// for a file it creates when ready).
//
// Thread safety: thread-safe. Failure: PosixError from posix_spawn /
// waitpid.
#ifndef ZTIER_TESTS_TESTING_SPAWN_SELF_H_
#define ZTIER_TESTS_TESTING_SPAWN_SELF_H_

#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

extern char** environ;

namespace ztier::testing {

// Starts /proc/self/exe --gtest_filter=`filter` with `env` ("NAME=value")
// added to this process's environment. Returns the child's pid.
inline Result<pid_t> SpawnSelf(const std::string& filter, std::vector<std::string> env) {
  std::string self = "/proc/self/exe", flag = "--gtest_filter=" + filter;
  char* argv[] = {self.data(), flag.data(), nullptr};
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int err = ::posix_spawn(&pid, argv[0], nullptr, nullptr, argv, envp.data());
  if (err != 0) return PosixError("posix_spawn " + flag, err);
  return pid;
}

// Waits for `pid`; returns its exit status (128 + the signal that ended it).
inline Result<int> WaitChild(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) < 0) return PosixError("waitpid", errno);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

// Waits up to `timeout` for a helper to create `path` (it is ready).
inline bool WaitForFile(const std::string& path,
                        std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_SPAWN_SELF_H_
