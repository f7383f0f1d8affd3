// Test support: AsNobody runs a check in a child process as uid/gid 65534
// (nobody), for tests of what ztierd lets another user do. Needs root (the
// caller skips otherwise). The child has every supplementary group dropped.
// Not thread-safe with other forks of the test (one at a time).
#ifndef ZTIER_TESTS_TESTING_AS_NOBODY_H_
#define ZTIER_TESTS_TESTING_AS_NOBODY_H_

#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

namespace ztier::testing {

// Runs `body` in a child process as nobody; returns its exit code (0: every
// check in it passed; 90: the uid could not be changed; 128 + signal when
// it died of one).
template <class Body>
int AsNobody(Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setresgid(65534, 65534, 65534) != 0 ||
        ::setresuid(65534, 65534, 65534) != 0) {
      _exit(90);
    }
    _exit(body());
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_AS_NOBODY_H_
