// The library's clean stop (client::InstallStopHandlers): the first SIGINT
// or SIGTERM is only recorded, a second one ends the process as the default
// action does. Run in a child process, since the handlers are process-wide.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/ztier.h"

namespace ztier::client {
namespace {

// In a child: installs the handlers, raises `first` (which must only be
// recorded), reports StopRequested() through the pipe, raises `second`.
int ChildStatus(int first, int second, int* recorded) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    if (!InstallStopHandlers().ok()) ::_exit(10);
    if (StopRequested() != 0) ::_exit(11);
    ::raise(first);
    const int seen = StopRequested();
    [[maybe_unused]] ssize_t n = ::write(fds[1], &seen, sizeof(seen));
    ::raise(second);
    ::_exit(0);  // not reached: the second signal ends the process
  }
  ::close(fds[1]);
  *recorded = -1;
  EXPECT_EQ(::read(fds[0], recorded, sizeof(*recorded)), static_cast<ssize_t>(sizeof(*recorded)));
  ::close(fds[0]);
  int st = 0;
  ::waitpid(child, &st, 0);
  return st;
}

TEST(StopTest, FirstSignalIsRecordedSecondEndsTheProcess) {
  for (auto [first, second] :
       {std::pair{SIGINT, SIGINT}, std::pair{SIGTERM, SIGINT}, std::pair{SIGINT, SIGTERM}}) {
    int recorded = 0;
    const int st = ChildStatus(first, second, &recorded);
    EXPECT_EQ(recorded, first);
    ASSERT_TRUE(WIFSIGNALED(st)) << "the second signal did not end the process";
    EXPECT_EQ(WTERMSIG(st), second);
  }
}

}  // namespace
}  // namespace ztier::client
