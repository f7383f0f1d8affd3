// SOCK_SEQPACKET sockets for the daemon protocol: whole datagrams with fds,
// and a peer that misbehaves (too large, too many fds, gone, silent) is an
// error with every fd it sent closed, never a signal or a hang.
#include "engine/seqpacket.h"

#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/testing/as_nobody.h"
#include "tests/testing/scratch_dir.h"

namespace ztier::engine {
namespace {

using namespace std::chrono_literals;
using ztier::testing::ScratchDir;

int OpenFds() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)e;
    ++n;
  }
  return n;
}

UniqueFd MemfdWith(const std::string& text) {
  UniqueFd fd(::memfd_create("seqpacket-test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::write(fd.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
  return fd;
}

TEST(SeqPacketTest, DatagramsArriveWholeWithTheirFds) {
  auto pair = SeqPacketSocket::Pair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  auto& [a, b] = *pair;
  UniqueFd memfd = MemfdWith("shared bytes");
  const int fds[] = {memfd.get()};
  ASSERT_TRUE(a.Send("first", fds).ok());
  ASSERT_TRUE(a.Send(std::string(60000, 'z')).ok());
  Result<SeqPacketSocket::Received> r = b.Receive(5s, 64 << 10, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->data, "first");
  ASSERT_EQ(r->fds.size(), 1u);
  EXPECT_EQ(::fcntl(r->fds[0].get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  char buf[32] = {};
  EXPECT_EQ(::pread(r->fds[0].get(), buf, sizeof(buf), 0), 12);
  EXPECT_STREQ(buf, "shared bytes");
  Result<SeqPacketSocket::Received> big = b.Receive(5s, 64 << 10, 4);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->data.size(), 60000u);
  EXPECT_TRUE(big->fds.empty());
  Result<PeerCredentials> peer = b.Peer();
  ASSERT_TRUE(peer.ok());
  EXPECT_EQ(peer->pid, ::getpid());
  EXPECT_EQ(peer->uid, ::getuid());
}

TEST(SeqPacketTest, OversizeAndTooManyFdsAreRefusedAndTheirFdsClosed) {
  auto pair = SeqPacketSocket::Pair();
  ASSERT_TRUE(pair.ok());
  auto& [a, b] = *pair;
  UniqueFd m1 = MemfdWith("1"), m2 = MemfdWith("2"), m3 = MemfdWith("3");
  const int before = OpenFds();
  const int three[] = {m1.get(), m2.get(), m3.get()};
  ASSERT_TRUE(a.Send(std::string(4097, 'x'), three).ok());
  Result<SeqPacketSocket::Received> r = b.Receive(5s, 4096, 4);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_NE(r.status().message().find("larger than the limit of 4096"), std::string::npos)
      << r.status();
  EXPECT_EQ(OpenFds(), before) << "the fds of a refused message stay open";
  ASSERT_TRUE(a.Send("ok", three).ok());
  r = b.Receive(5s, 4096, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("more than 2 file descriptors"), std::string::npos)
      << r.status();
  EXPECT_EQ(OpenFds(), before);
  // An odd limit: the control buffer rounds up and has room for one more.
  const int two[] = {m1.get(), m2.get()};
  ASSERT_TRUE(a.Send("two", two).ok());
  r = b.Receive(5s, 4096, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(OpenFds(), before);
}

TEST(SeqPacketTest, APeerThatStopsReadingFailsTheSendInTime) {
  auto pair = SeqPacketSocket::Pair();
  ASSERT_TRUE(pair.ok());
  auto& [a, b] = *pair;
  const std::string big(32 << 10, 'x');
  Status s;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10000 && s.ok(); ++i) s = a.Send(big, {}, 200ms);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_TRUE(b.valid());
}

TEST(SeqPacketTest, AGoneOrSilentPeerIsUnavailableNeverASignal) {
  // SIGPIPE at its default would kill the test: sends must not raise it.
  struct sigaction old {};
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ASSERT_EQ(::sigaction(SIGPIPE, &dfl, &old), 0);
  auto pair = SeqPacketSocket::Pair();
  ASSERT_TRUE(pair.ok());
  auto& [a, b] = *pair;
  const auto t0 = std::chrono::steady_clock::now();
  Result<SeqPacketSocket::Received> silent = b.Receive(200ms, 4096, 1);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(silent.ok());
  EXPECT_EQ(silent.status().code(), StatusCode::kUnavailable);
  EXPECT_GE(waited, 190ms);
  EXPECT_LT(waited, 5s);
  ASSERT_TRUE(b.Close().ok());
  Status s = a.Send("anyone?");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  Result<SeqPacketSocket::Received> gone = a.Receive(1s, 4096, 1);
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable) << gone.status();
  ::sigaction(SIGPIPE, &old, nullptr);
}

TEST(SeqPacketTest, ListenerBindsWithItsModeAndRefusesALiveSocket) {
  ScratchDir dir("seqpacket");
  const std::string path = dir / "ztierd.sock";
  Result<SeqPacketListener> l = SeqPacketListener::Listen(path, 0660);
  ASSERT_TRUE(l.ok()) << l.status();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  Result<SeqPacketSocket> c = SeqPacketSocket::Connect(path);
  ASSERT_TRUE(c.ok()) << c.status();
  Result<SeqPacketSocket> s = l->Accept(5s);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(c->Send("hello").ok());
  Result<SeqPacketSocket::Received> hello = s->Receive(5s, 4096, 1);
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(hello->data, "hello");
  EXPECT_EQ(l->Accept(100ms).status().code(), StatusCode::kUnavailable);

  // A second listener on a live path is refused, at the lock beside it,
  // naming the holder.
  Result<SeqPacketListener> second = SeqPacketListener::Listen(path, 0660);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find(StrCat("in use by this process (pid ", ::getpid(), ")")),
            std::string::npos)
      << second.status();
  // So is one while the file is gone (removed by hand) and the first still
  // listens: two daemons on one path, one of them unreachable.
  ASSERT_EQ(::unlink(path.c_str()), 0);
  EXPECT_EQ(SeqPacketListener::Listen(path, 0660).status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(l->Close().ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".lock"));
  // Once closed, the path is free again.
  l = SeqPacketListener::Listen(path, 0660);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_TRUE(l->Close().ok());

  Result<SeqPacketSocket> none = SeqPacketSocket::Connect(path);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(none.status().message().find(path), std::string::npos) << none.status();
}

// Who a refused user may ask to be let in depends on the socket's mode:
// on a 0600 socket it named the group, whose members were refused too.
TEST(SeqPacketTest, APermissionRefusalSaysWhomTheSocketAdmits) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  char tmpl[] = "/tmp/seqpacket-perm-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  const std::string path = dir + "/ztierd.sock";
  // What uid 65534 is told connecting: {mode of the socket, of its directory}.
  const auto told = [&](mode_t sock_mode, mode_t dir_mode, gid_t group = 0) {
    Result<SeqPacketListener> l = SeqPacketListener::Listen(path, sock_mode);
    EXPECT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(::chown(path.c_str(), static_cast<uid_t>(-1), group), 0);
    EXPECT_EQ(::chmod(dir.c_str(), dir_mode), 0);
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      std::string said = "connected";
      if (::setgid(65534) == 0 && ::setuid(65534) == 0) {
        Result<SeqPacketSocket> c = SeqPacketSocket::Connect(path);
        if (!c.ok()) said = c.status().ToString();
      } else {
        said = "setuid failed";
      }
      (void)!::write(fds[1], said.data(), said.size());
      ::_exit(0);
    }
    ::close(fds[1]);
    std::string said;
    char buf[512];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) said.append(buf, n);
    ::close(fds[0]);
    int st = 0;
    ::waitpid(pid, &st, 0);
    EXPECT_EQ(::chmod(dir.c_str(), 0755), 0);
    return said;
  };
  std::string said = told(0600, 0755);
  EXPECT_NE(said.find("the socket (mode 0600) admits its owner, uid 0, only"), std::string::npos)
      << said;
  // Root's group: not a group to add users to (said so to a user told
  // to join group root).
  said = told(0660, 0755);
  EXPECT_NE(said.find("the socket admits group root (root's) only: ask the admin to give it a "
                      "group for the users of ztier (ztierd.socket's SocketGroup="),
            std::string::npos)
      << said;
  gid_t unnamed = 40000;  // a gid no group names here
  while (::getgrgid(unnamed) != nullptr) ++unnamed;
  said = told(0660, 0755, unnamed);
  EXPECT_NE(said.find(StrCat("the socket admits gid ", unnamed,
                             " only: ask the admin to add this user to it")),
            std::string::npos)
      << said;
  said = told(0666, 0700);
  EXPECT_NE(said.find("a directory on its path is closed to this user"), std::string::npos) << said;
  std::filesystem::remove_all(dir);
}

TEST(SeqPacketTest, AStaleSocketFileIsReplacedAndOtherFilesAreNot) {
  ScratchDir dir("seqpacket");
  const std::string path = dir / "ztierd.sock";
  // A listener whose process died leaves its file behind.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Result<SeqPacketListener> l = SeqPacketListener::Listen(path, 0600);
    ::_exit(l.ok() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(std::filesystem::exists(path));
  Result<SeqPacketListener> again = SeqPacketListener::Listen(path, 0600);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(again->Close().ok());

  const std::string file = dir / "not-a-socket";
  { std::ofstream(file) << "data"; }
  Result<SeqPacketListener> refused = SeqPacketListener::Listen(file, 0600);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("not a socket"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(file));
}

// A connect to a file this user may not write (--socket /etc/passwd) is
// answered EACCES, not ECONNREFUSED: it was told that the socket "admits
// its owner only" and to ask the admin, of a file that is no socket.
TEST(SeqPacketTest, AFileThisUserMayNotWriteIsSaidToBeNoSocket) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  ScratchDir dir("not-writable");
  ::chmod(dir.path().c_str(), 0755);
  const std::string file = dir.path() + "/read-only";
  { std::ofstream(file) << "data"; }
  ::chmod(file.c_str(), 0644);
  const int rc = testing::AsNobody([&] {
    Result<SeqPacketSocket> c = SeqPacketSocket::Connect(file);
    if (c.ok()) return 10;
    if (c.status().code() != StatusCode::kInvalidArgument) return 11;
    return c.status().message().find("is not a socket") != std::string::npos ? 0 : 12;
  });
  EXPECT_EQ(rc, 0);
}

// A stream socket (another program's, or ztierd's metrics one): it was an
// io_error "Protocol wrong type for socket".
TEST(SeqPacketTest, ASocketOfAnotherKindIsSaidToBeNoZtierds) {
  // Under /tmp: a bind takes a path of 107 bytes at most (the build tree's
  // may be longer).
  std::string dir = "/tmp/ztier-stream-XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/stream.sock";
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(sa.sun_path));
  std::memcpy(sa.sun_path, path.data(), path.size());
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(fd.get(), 4), 0);
  Result<SeqPacketSocket> c = SeqPacketSocket::Connect(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("a socket of another kind than ztierd's"), std::string::npos)
      << c.status();
  std::filesystem::remove_all(dir);
}

// A listener's Close removes the file it bound, never one that replaced it
// at the path (another daemon's, once the first's was removed by hand).
TEST(SeqPacketTest, CloseLeavesASocketFileThatReplacedItsOwn) {
  ScratchDir dir("seqpacket");
  const std::string path = dir / "ztierd.sock";
  Result<SeqPacketListener> l = SeqPacketListener::Listen(path, 0600);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_EQ(::unlink(path.c_str()), 0);
  // Another socket file at the path (mknod makes one without a bind).
  ASSERT_EQ(::mknod(path.c_str(), S_IFSOCK | 0600, 0), 0) << std::strerror(errno);
  ASSERT_TRUE(l->Close().ok());
  EXPECT_TRUE(std::filesystem::exists(path));
}

TEST(SeqPacketTest, PathsLongerThanSunPathWork) {
  ScratchDir dir("seqpacket");
  const std::filesystem::path deep = dir / std::string(120, 'd');
  std::filesystem::create_directories(deep);
  const std::string path = deep / "ztierd.sock";
  ASSERT_GT(path.size(), 108u);
  Result<SeqPacketListener> l = SeqPacketListener::Listen(path, 0600);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(std::filesystem::exists(path));
  Result<SeqPacketSocket> c = SeqPacketSocket::Connect(path);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(l->Accept(5s).ok());
  ASSERT_TRUE(l->Close().ok());
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(SeqPacketTest, OnlyAListeningSeqPacketSocketIsTakenOver) {
  UniqueFd stream(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  Result<SeqPacketListener> bad = SeqPacketListener::FromFd(stream.release());
  ASSERT_FALSE(bad.ok());
  auto pair = SeqPacketSocket::Pair();  // connected, not listening
  ASSERT_TRUE(pair.ok());
  EXPECT_FALSE(SeqPacketListener::FromFd(::dup(pair->first.fd())).ok());
}

}  // namespace
}  // namespace ztier::engine
