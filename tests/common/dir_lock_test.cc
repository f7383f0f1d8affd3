// Tests for directory locks (common/dir_lock.h): exclusion within a process
// and across processes, the holder named in the error, release on death.
#include "common/dir_lock.h"

#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tests/testing/as_nobody.h"
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
  // Named with its command and user, so an operator sees whose it is.
  EXPECT_NE(refused.status().message().find(StrCat("process ", child, " (dir_lock_test, ")),
            std::string::npos)
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

// flock needs no write access: a lock file that others can read, they can
// hold, keeping its owner out of their own directory. Lock files are the
// owner's alone, whatever the umask, and one left readable is made so.
TEST(DirLockTest, LockFilesAreTheOwnersAlone) {
  ScratchDir dir("dir-lock");
  const fs::path file = dir / kFile;
  const mode_t umask_was = ::umask(0);
  Result<DirLock> a = Lock(dir.path());
  ::umask(umask_was);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(fs::status(file).permissions(), fs::perms::owner_read | fs::perms::owner_write);
  a->Release();
  std::ofstream(file) << "1\n";  // left readable, as by an older version killed holding it
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                            fs::perms::others_read);
  a = Lock(dir.path());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(fs::status(file).permissions(), fs::perms::owner_read | fs::perms::owner_write);
}

// Another user who opened a lock file of ours while it was readable, and
// holds its lock: the refusal names them and says to remove the file (not
// replaced by the library: a process of ours could take the old one in
// that moment). Once removed, the new file is ours alone, and they cannot
// hold it again. Another user's own lock file is a refusal naming them.
TEST(DirLockTest, AnotherUserHoldingOurLeftoverLockFileIsNamedAndRemovedByHand) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to act as another user";
  ScratchDir dir("dir-lock");
  fs::permissions(dir.path(), fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                  fs::perms::others_read | fs::perms::others_exec);
  const fs::path file = dir / kFile;
  std::ofstream(file) << "1\n";
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                            fs::perms::others_read);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // nobody, holding our file's lock through a read-only open
    char c = 'y';
    if (::setgroups(0, nullptr) != 0 || ::setresgid(65534, 65534, 65534) != 0 ||
        ::setresuid(65534, 65534, 65534) != 0) {
      c = 'u';
    } else {
      const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || ::flock(fd, LOCK_EX | LOCK_NB) != 0) c = 'n';
    }
    [[maybe_unused]] ssize_t n = ::write(ready[1], &c, 1);
    ::pause();  // killed below
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  const auto end_child = [&] {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  };
  if (c != 'y') {
    end_child();
    GTEST_SKIP() << (c == 'u' ? "cannot become nobody" : "nobody cannot reach the scratch dir");
  }
  Result<DirLock> refused = Lock(dir.path());
  ASSERT_FALSE(refused.ok());
  const std::string said(refused.status().message());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << said;
  EXPECT_NE(said.find(StrCat("process ", child, " (dir_lock_test, user nobody)")),
            std::string::npos)
      << said;
  EXPECT_NE(said.find(StrCat("rm ", file.string())), std::string::npos) << said;
  EXPECT_EQ(fs::status(file).permissions(), fs::perms::owner_read | fs::perms::owner_write);
  ASSERT_TRUE(fs::remove(file));
  Result<DirLock> mine = Lock(dir.path());
  EXPECT_TRUE(mine.ok()) << mine.status();
  // Nobody cannot open the new one; our own lock is one to wait for.
  EXPECT_EQ(testing::AsNobody([&] { return ::open(file.c_str(), O_RDONLY) < 0 ? 0 : 1; }), 0);
  EXPECT_EQ(Lock(dir.path()).status().code(), StatusCode::kUnavailable);
  end_child();
  // Another user's try of the directory (our lock file, theirs to open
  // not): refused naming us, not "permission denied".
  EXPECT_EQ(testing::AsNobody([&] {
              Result<DirLock> r = Lock(dir.path());
              if (r.ok() || r.status().code() != StatusCode::kUnavailable) return 1;
              const std::string m(r.status().message());
              const bool named = m.find("(dir_lock_test, user root)") != std::string::npos &&
                                 m.find("user root's)") != std::string::npos;
              return named ? 0 : 2;
            }),
            0);
}

// Another user's lock file left writable to all: a writer took their
// directory over and removed their file as it let go. Refused naming them;
// the file stays. One of theirs that is theirs alone, root may take (as a
// file a writer made is another owner's on a squashing NFS mount).
TEST(DirLockTest, AnotherUsersLockFileLeftWritableIsRefusedToAWriter) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to make another user's file";
  ScratchDir dir("dir-lock");
  const fs::path file = dir / kFile;
  std::ofstream(file) << "1\n";
  ASSERT_EQ(::chown(file.c_str(), 65534, 65534), 0);
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                            fs::perms::group_write | fs::perms::others_read |
                            fs::perms::others_write);
  Result<DirLock> refused = Lock(dir.path());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find("was used by user nobody, whose lock file"),
            std::string::npos)
      << refused.status();
  EXPECT_TRUE(fs::exists(file));
  Result<DirLock> reader = Lock(dir.path(), DirLock::Mode::kShared);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->MakeExclusive().code(), StatusCode::kUnavailable);
  reader = Status::Internal("released");
  EXPECT_TRUE(fs::exists(file)) << "a reader removed another user's lock file";
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write);
  Result<DirLock> root = Lock(dir.path());
  EXPECT_TRUE(root.ok()) << root.status();
}

// A holder whose directory was removed and made again, and locked by
// another, removed that one's lock file as it let go: a third then took
// the directory beside the second.
TEST(DirLockTest, ALockWhoseDirectoryWasMadeAgainLeavesTheNewHoldersFile) {
  ScratchDir dir("dir-lock");
  const std::string d = dir / "d";
  fs::create_directory(d);
  Result<DirLock> first = Lock(d);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->AtItsPath());
  fs::remove_all(d);
  EXPECT_FALSE(first->AtItsPath());
  fs::create_directory(d);
  Result<DirLock> second = Lock(d);
  ASSERT_TRUE(second.ok()) << second.status();
  first->Release();
  EXPECT_TRUE(fs::exists(fs::path(d) / kFile));
  EXPECT_FALSE(Lock(d).ok());
  EXPECT_TRUE(second->AtItsPath());
}

// A lock taken by a relative path named another file after a chdir: it
// looked let go of (and its release would remove a file there).
TEST(DirLockTest, ALockByARelativePathIsTheSameFileAfterAChdir) {
  ScratchDir dir("dir-lock");
  fs::create_directory(dir / "d");
  fs::create_directory(dir / "elsewhere");
  fs::create_directory(dir / "elsewhere/d");
  const fs::path cwd = fs::current_path();
  fs::current_path(dir.path());
  Result<DirLock> lock = Lock("d");
  fs::current_path(dir / "elsewhere");
  ASSERT_TRUE(lock.ok()) << lock.status();
  EXPECT_TRUE(lock->AtItsPath());
  std::ofstream(fs::path("d") / kFile) << "another's";
  lock->Release();
  EXPECT_TRUE(fs::exists(fs::path("d") / kFile));
  EXPECT_FALSE(fs::exists(fs::path(dir / "d") / kFile));
  fs::current_path(cwd);
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
