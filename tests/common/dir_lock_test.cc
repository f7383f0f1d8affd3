// Tests for directory locks (common/dir_lock.h): exclusion within a process
// and across processes, the holder named in the error, release on death.
#include "common/dir_lock.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tests/testing/scratch_dir.h"

namespace ztier {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;
constexpr char kFile[] = "test.lock";

Result<DirLock> Lock(const std::string& dir, DirLock::Mode mode = DirLock::Mode::kExclusive) {
  return DirLock::Acquire(dir, kFile, "test directory", mode);
}

TEST(DirLockTest, SecondExclusiveUserInTheSameProcessIsRefused) {
  ScratchDir dir("dir-lock");
  Result<DirLock> a = Lock(dir.path());
  ASSERT_TRUE(a.ok()) << a.status();
  Result<DirLock> b = Lock(dir.path());
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kUnavailable);
  const std::string msg(b.status().message());
  EXPECT_NE(msg.find(dir.path()), std::string::npos) << msg;
  EXPECT_NE(msg.find(StrCat("pid ", ::getpid())), std::string::npos) << msg;
  a->Release();
  EXPECT_FALSE(fs::exists(dir / kFile));  // an exclusive holder cleans up
  EXPECT_TRUE(Lock(dir.path()).ok());
}

TEST(DirLockTest, AnotherProcessIsNamedAndItsDeathReleasesTheLock) {
  ScratchDir dir("dir-lock");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Result<DirLock> held = Lock(dir.path());
    const char c = held.ok() ? 'y' : 'n';
    [[maybe_unused]] ssize_t n = ::write(ready[1], &c, 1);
    ::pause();  // killed below
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  Result<DirLock> refused = Lock(dir.path());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(StrCat("process ", child)), std::string::npos)
      << refused.status();
  ::kill(child, SIGKILL);  // no cleanup runs: the kernel drops the lock
  ::waitpid(child, nullptr, 0);
  Result<DirLock> after = Lock(dir.path());
  EXPECT_TRUE(after.ok()) << after.status();
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(DirLockTest, SharedHoldersCoexistAndExcludeWriters) {
  ScratchDir dir("dir-lock");
  Result<DirLock> r1 = Lock(dir.path(), DirLock::Mode::kShared);
  Result<DirLock> r2 = Lock(dir.path(), DirLock::Mode::kShared);
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_EQ(Lock(dir.path()).status().code(), StatusCode::kUnavailable);
  // r1 cannot become the writer while r2 reads; it stays a reader.
  EXPECT_EQ(r1->MakeExclusive().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(r1->held());
  r2->Release();
  EXPECT_TRUE(r1->MakeExclusive().ok());
  EXPECT_EQ(r1->mode(), DirLock::Mode::kExclusive);
  EXPECT_EQ(Lock(dir.path(), DirLock::Mode::kShared).status().code(), StatusCode::kUnavailable);
}

TEST(DirLockTest, MissingDirectoryAndFileAreErrors) {
  ScratchDir dir("dir-lock");
  EXPECT_EQ(Lock(dir / "missing").status().code(), StatusCode::kNotFound);
  std::ofstream(dir / "plain") << "x";
  EXPECT_EQ(Lock(dir / "plain").status().code(), StatusCode::kInvalidArgument);
}

TEST(DirLockTest, MovedLockStaysHeld) {
  ScratchDir dir("dir-lock");
  DirLock a;
  {
    Result<DirLock> r = Lock(dir.path());
    ASSERT_TRUE(r.ok());
    a = std::move(r).value();
  }
  EXPECT_TRUE(a.held());
  EXPECT_FALSE(Lock(dir.path()).ok());
}

}  // namespace
}  // namespace ztier
