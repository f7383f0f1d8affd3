// ztierd (engine/daemon.h) and libztier's daemon transport, end to end:
// what a client may and may not do over the socket (a hostile client's
// framing, fds and memfds; other connections' jobs; writable mappings of
// read-only regions), quotas and the allow-list, a client that dies, a
// daemon that stops or dies, and two users (a client forked with uid
// 65534 against the ztierd program run as root).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "client/transport.h"
#include "client/ztier.h"
#include "common/dir_lock.h"
#include "common/file_util.h"
#include "engine/protocol.h"
#include "engine/seqpacket.h"
#include "engine/shared_memory.h"
#include "engine/state_files.h"
#include "tests/testing/as_nobody.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/spawn_self.h"
#include "tests/testing/test_daemon.h"
#include "tests/testing/ztierd_process.h"

namespace ztier::client {
namespace {

namespace p = engine::protocol;
using engine::RegionAccess;
using engine::SeqPacketListener;
using engine::SeqPacketSocket;
using engine::SharedBuffer;
using engine::Tier;
using testing::AsNobody;
using testing::ScratchDir;
using testing::SmallEngine;
using testing::TestDaemon;
using testing::ZtierdProcess;
using namespace std::chrono_literals;

engine::JobSpec TwoUnits(const std::string& name) {
  engine::JobSpec spec;
  spec.name = name;
  for (int u = 0; u < 2; ++u) {
    spec.units.push_back(
        {.name = StrCat("u", u), .tensors = {{.name = StrCat("u", u, ".w"), .shape = {1000}}}});
  }
  return spec;
}

Session::ModelSpec ModelOf(const engine::JobSpec& job) {
  Session::ModelSpec m;
  m.name = job.name;
  m.units = job.units;
  m.world_size = job.ranks;
  return m;
}

// A client that speaks the protocol by hand, to send what libztier never
// would.
// Threads of this process now (the in-process daemon's included).
int ProcessThreads() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

class RawClient {
 public:
  struct Reply {
    p::Header header;
    Status status;        // the reply's status
    std::string payload;  // the fields after it
    std::vector<UniqueFd> fds;
  };

  static RawClient Connect(const std::string& path, bool hello = true,
                           const std::string& name = "raw") {
    RawClient c;
    Result<SeqPacketSocket> s = SeqPacketSocket::Connect(path);
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) c.sock_ = *std::move(s);
    if (hello) {
      Result<Reply> r = c.Call(p::MessageType::kHello, p::Encode(p::Hello{.name = name}));
      EXPECT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
    }
    return c;
  }

  Status SendRaw(std::string_view datagram, std::span<const int> fds = {},
                 std::chrono::milliseconds timeout = 5s) {
    return sock_.Send(datagram, fds, timeout);
  }
  Status Send(p::MessageType type, std::string_view payload, std::span<const int> fds = {},
              uint32_t flags = 0, std::chrono::milliseconds timeout = 5s) {
    Result<std::string> msg = p::EncodeMessage({.type = type,
                                                .flags = flags,
                                                .request_id = next_id_++,
                                                .fds = static_cast<uint32_t>(fds.size())},
                                               payload);
    if (!msg.ok()) return msg.status();
    return SendRaw(*msg, fds, timeout);
  }
  Result<Reply> Receive(std::chrono::milliseconds timeout = 10s) {
    ZT_ASSIGN_OR_RETURN(SeqPacketSocket::Received got,
                        sock_.Receive(timeout, p::kMaxMessageBytes, p::kMaxFdsPerMessage));
    ZT_ASSIGN_OR_RETURN(p::Header h,
                        p::DecodeHeader(got.data, static_cast<uint32_t>(got.fds.size())));
    Reply r;
    r.header = h;
    r.fds = std::move(got.fds);
    Result<std::string_view> body =
        p::DecodeReplyStatus(std::string_view(got.data).substr(p::kHeaderBytes));
    if (body.ok()) {
      r.payload = std::string(*body);
    } else {
      r.status = body.status();
    }
    return r;
  }
  Result<Reply> Call(p::MessageType type, std::string_view payload, std::span<const int> fds = {},
                     uint32_t flags = 0) {
    ZT_RETURN_IF_ERROR(Send(type, payload, fds, flags));
    return Receive();
  }
  // The connection was closed by the daemon (after an optional notice).
  bool Closed() {
    for (int k = 0; k < 3; ++k) {
      Result<SeqPacketSocket::Received> got =
          sock_.Receive(5s, p::kMaxMessageBytes, p::kMaxFdsPerMessage);
      if (!got.ok()) return got.status().message().find("closed") != std::string_view::npos;
    }
    return false;
  }
  SeqPacketSocket& socket() { return sock_; }

 private:
  SeqPacketSocket sock_;
  uint64_t next_id_ = 1;
};

// The fds this process has open.
long OpenFdCount() {
  return std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                       std::filesystem::directory_iterator());
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }
  void Start(const engine::DaemonOptions& options) {
    daemon_.reset();
    Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine(), options);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
  }
  std::string socket() const { return daemon_->socket(); }

  // Registers through the raw client; returns the handle.
  int32_t Register(RawClient& c, const std::string& name) {
    Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits(name)));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return -1;
    EXPECT_TRUE(r->status.ok()) << r->status;
    Result<p::JobHandle> h = p::DecodeJobHandle(r->payload);
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? h->job : -1;
  }

  // Waits (bounded) for the daemon's figures to settle.
  void WaitForStats(int connections, int jobs) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    engine::DaemonStats s;
    while (std::chrono::steady_clock::now() < deadline) {
      s = daemon_->daemon().stats();
      if (s.connections == connections && s.jobs == jobs) return;
      std::this_thread::sleep_for(10ms);
    }
    ADD_FAILURE() << "ztierd has " << s.connections << " connections and " << s.jobs
                  << " jobs, expected " << connections << " and " << jobs;
  }

  std::unique_ptr<TestDaemon> daemon_;
};

// ------------------------------------------------------- a hostile client

TEST_F(DaemonTest, TheFirstMessageMustBeTheHello) {
  RawClient c = RawClient::Connect(socket(), /*hello=*/false);
  Result<RawClient::Reply> r = c.Call(p::MessageType::kPoolStats, "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kFailedPrecondition) << r->status;
  EXPECT_NE(r->status.ToString().find("hello"), std::string::npos) << r->status;
  EXPECT_TRUE(c.Closed());
}

TEST_F(DaemonTest, AnotherProtocolVersionIsRefusedNamingBoth) {
  RawClient c = RawClient::Connect(socket(), /*hello=*/false);
  Result<RawClient::Reply> r =
      c.Call(p::MessageType::kHello,
             p::Encode(p::Hello{
                 .min_version = p::kVersion + 1, .max_version = p::kVersion + 3, .name = "x"}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kFailedPrecondition) << r->status;
  EXPECT_NE(r->status.ToString().find(StrCat(p::kVersion + 1, "..", p::kVersion + 3)),
            std::string::npos)
      << r->status;
  EXPECT_TRUE(c.Closed());
  // Counted with the other refused connections (the metrics, status).
  EXPECT_EQ(daemon_->daemon().stats().refused, 1u);
  // A first message in another release's framing (its header's version) is
  // refused before any hello is read: counted too.
  RawClient old = RawClient::Connect(socket(), /*hello=*/false);
  Result<std::string> msg = p::EncodeMessage(
      {.version = p::kVersion - 1, .type = p::MessageType::kHello}, p::Encode(p::Hello{}));
  ASSERT_TRUE(msg.ok()) << msg.status();
  ASSERT_TRUE(old.SendRaw(*msg).ok());
  r = old.Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->status.ToString().find(StrCat("protocol version ", p::kVersion - 1)),
            std::string::npos)
      << r->status;
  EXPECT_TRUE(old.Closed());
  EXPECT_EQ(daemon_->daemon().stats().refused, 2u);
}

// The hello's name is logged ("... : <name> connected"): a newline in it
// wrote a line of the client's own into ztierd's log, an escape sequence
// reached the operator's terminal.
TEST_F(DaemonTest, AHelloWhoseNameCouldForgeLogLinesIsRefused) {
  for (const std::string name : {"x\nztier warn ztierd: fake", "\x1b[31mred", "a\u2028b"}) {
    RawClient c = RawClient::Connect(socket(), /*hello=*/false);
    Result<RawClient::Reply> r = c.Call(p::MessageType::kHello, p::Encode(p::Hello{.name = name}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
    EXPECT_NE(r->status.ToString().find("the client's name"), std::string::npos) << r->status;
    EXPECT_TRUE(c.Closed());
  }
  EXPECT_EQ(daemon_->daemon().stats().refused, 3u);
  RawClient ok = RawClient::Connect(socket(), /*hello=*/true, "libztier");
}

TEST_F(DaemonTest, BrokenFramingGetsANoticeAndTheConnectionCloses) {
  Result<std::string> good = p::EncodeMessage({.type = p::MessageType::kPoolStats}, "");
  ASSERT_TRUE(good.ok());
  std::string bad_magic = *good;
  bad_magic[0] ^= 0x55;
  std::string truncated = *p::EncodeMessage({.type = p::MessageType::kLayout},
                                            p::Encode(p::UnitRef{.job = 1, .unit = 0}));
  truncated.resize(truncated.size() - 3);
  std::string oversize = *good + std::string(p::kMaxMessageBytes, 'x');
  for (const std::string& msg : {bad_magic, truncated, oversize}) {
    RawClient c = RawClient::Connect(socket());
    ASSERT_TRUE(c.SendRaw(msg).ok());
    Result<RawClient::Reply> r = c.Receive();
    if (msg.size() <= p::kMaxMessageBytes) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->header.request_id, 0u);
      EXPECT_EQ(r->status.code(), StatusCode::kCorruption) << r->status;
    }
    EXPECT_TRUE(c.Closed());
  }
  // The daemon serves the next client.
  RawClient ok = RawClient::Connect(socket());
  Result<RawClient::Reply> r = ok.Call(p::MessageType::kPoolStats, "");
  ASSERT_TRUE(r.ok() && r->status.ok());
  WaitForStats(1, 0);
}

TEST_F(DaemonTest, UnexpectedFdsAreRefusedAndClosedAndTheConnectionGoesOn) {
  RawClient c = RawClient::Connect(socket());
  Result<UniqueFd> fd = engine::MakeSealedMemfd("extra", 4096);
  ASSERT_TRUE(fd.ok());
  const int fds[] = {fd->get()};
  Result<RawClient::Reply> r = c.Call(p::MessageType::kPoolStats, "", fds);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
  r = c.Call(p::MessageType::kPoolStats, "");
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  EXPECT_TRUE(p::DecodeDramPoolStats(r->payload).ok());
}

TEST_F(DaemonTest, StagingMemfdsMustBeSealedAndOfTheRightSize) {
  RawClient c = RawClient::Connect(socket());
  const int32_t job = Register(c, "weights");
  const uint64_t bytes = 1000 * sizeof(float);
  // Unsealed: a client could shrink it under the daemon's mapping.
  UniqueFd unsealed(::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::ftruncate(unsealed.get(), bytes), 0);
  const int fds[] = {unsealed.get()};
  Result<RawClient::Reply> r =
      c.Call(p::MessageType::kWriteWeights,
             p::Encode(p::StagedData{.job = job, .unit = 0, .bytes = bytes}), fds);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
  EXPECT_NE(r->status.ToString().find("F_SEAL_SHRINK"), std::string::npos) << r->status;
  // Sealed but smaller than it says.
  Result<UniqueFd> small = engine::MakeSealedMemfd("small", bytes - 4);
  ASSERT_TRUE(small.ok());
  const int small_fds[] = {small->get()};
  r = c.Call(p::MessageType::kWriteWeights,
             p::Encode(p::StagedData{.job = job, .unit = 0, .bytes = bytes}), small_fds);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
  // Sealed, of the right size, and sparse: its pages would be ztierd's to
  // fault in (ztierd's memory, in no quota of the sender's). A read_state
  // into it too; one whose pages are there is taken.
  Result<RawClient::Reply> layout =
      c.Call(p::MessageType::kLayout, p::Encode(p::UnitRef{.job = job, .unit = 0}));
  ASSERT_TRUE(layout.ok() && layout->status.ok());
  const uint64_t padded = p::DecodeUnitLayout(layout->payload)->padded;
  for (const p::MessageType type : {p::MessageType::kWriteWeights, p::MessageType::kReadState}) {
    const uint64_t want = type == p::MessageType::kReadState ? 3 * padded * 4 : bytes;
    Result<UniqueFd> sparse = engine::MakeSealedMemfd("sparse", want);
    ASSERT_TRUE(sparse.ok());
    const int sparse_fds[] = {sparse->get()};
    r = c.Call(type, p::Encode(p::StagedData{.job = job, .unit = 0, .bytes = want}), sparse_fds);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
    EXPECT_NE(r->status.ToString().find("have pages; ztierd takes only memory its sender"),
              std::string::npos)
        << r->status;
    // Pages past what it carries do not stand in for those of its range.
    const uint64_t past = (want + 4095) / 4096 * 4096;  // the first page past its range
    Result<UniqueFd> tail = engine::MakeSealedMemfd("tail", past + want);
    ASSERT_TRUE(tail.ok());
    const std::vector<char> ones(want, 1);
    ASSERT_EQ(::pwrite(tail->get(), ones.data(), want, static_cast<off_t>(past)),
              static_cast<ssize_t>(want));
    const int tail_fds[] = {tail->get()};
    r = c.Call(type, p::Encode(p::StagedData{.job = job, .unit = 0, .bytes = want}), tail_fds);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
    Result<UniqueFd> allocated = engine::MakeStagingMemfd("allocated", want);
    ASSERT_TRUE(allocated.ok());
    const int allocated_fds[] = {allocated->get()};
    r = c.Call(type, p::Encode(p::StagedData{.job = job, .unit = 0, .bytes = want}), allocated_fds);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->status.ok()) << r->status;
  }
  // A regular file is not a memfd.
  UniqueFd file(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  const int file_fds[] = {file.get()};
  r = c.Call(p::MessageType::kWriteWeights,
             p::Encode(p::StagedData{.job = job, .unit = 0, .bytes = bytes}), file_fds);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
  // No fd at all.
  r = c.Call(p::MessageType::kWriteWeights,
             p::Encode(p::StagedData{.job = job, .unit = 0, .bytes = bytes}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << r->status;
}

// A request id is the client's to choose. The fds of a reply were kept in
// a map by request id: with an abort (pooled) and a regions request (inline)
// of one id in flight, the abort's reply took the regions' fds, and the
// first reply's erase closed them while the other was still sending their
// numbers, which by then named whatever another connection had opened (a
// second user got the first one's job memory, sockets and pidfds that way).
TEST_F(DaemonTest, AReplyCarriesItsOwnRequestsFdsWhateverTheIds) {
  RawClient c = RawClient::Connect(socket());
  const int32_t job = Register(c, "ids");
  Result<RawClient::Reply> first =
      c.Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = job}));
  ASSERT_TRUE(first.ok() && first->status.ok()) << (first.ok() ? first->status : first.status());
  const auto inode = [](int fd) {
    struct stat st {};
    return ::fstat(fd, &st) == 0 ? st.st_ino : ino_t{0};
  };
  std::vector<ino_t> own;
  for (const UniqueFd& fd : first->fds) own.push_back(inode(fd.get()));
  // Another connection opens and closes fds in ztierd meanwhile.
  std::atomic<bool> done{false};
  std::thread churn([&] {
    RawClient other = RawClient::Connect(socket(), true, "churn");
    const int32_t j = Register(other, "churn");
    while (!done.load()) {
      (void)other.Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = j}));
    }
  });
  struct Stop {  // also when an assertion below returns early
    std::atomic<bool>& done;
    std::thread& churn;
    ~Stop() {
      done = true;
      churn.join();
    }
  } stop{done, churn};
  int abort_fds = 0, regions_short = 0, foreign = 0, errors = 0;
  for (uint64_t i = 0; i < 300; ++i) {
    const uint64_t id = 1000000 + i;
    for (p::MessageType type : {p::MessageType::kAbortStep, p::MessageType::kRegions}) {
      Result<std::string> msg = p::EncodeMessage(
          {.type = type, .request_id = id},
          type == p::MessageType::kAbortStep ? p::Encode(p::AbortStepRequest{.job = job, .step = 1})
                                             : p::Encode(p::JobRef{.job = job}));
      ASSERT_TRUE(msg.ok());
      ASSERT_TRUE(c.SendRaw(*msg).ok());
    }
    for (int k = 0; k < 2; ++k) {
      Result<RawClient::Reply> r = c.Receive();
      ASSERT_TRUE(r.ok()) << r.status();
      if (!r->status.ok()) {
        ++errors;
        continue;
      }
      if (r->header.type == p::MessageType::kAbortStep) {
        abort_fds += !r->fds.empty();
        continue;
      }
      regions_short += r->fds.size() != own.size();
      for (const UniqueFd& fd : r->fds) {
        foreign += std::find(own.begin(), own.end(), inode(fd.get())) == own.end();
      }
    }
  }
  EXPECT_EQ(errors, 0);
  EXPECT_EQ(abort_fds, 0) << "abort replies carried the regions' fds";
  EXPECT_EQ(regions_short, 0) << "regions replies lost their fds";
  EXPECT_EQ(foreign, 0) << "fds that are not the job's regions";
}

TEST_F(DaemonTest, ReadOnlyRegionsCannotBeMappedWritableNotEvenThroughProc) {
  RawClient c = RawClient::Connect(socket());
  const int32_t job = Register(c, "ro");
  Result<RawClient::Reply> r = c.Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = job}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  Result<p::RegionList> list = p::DecodeRegionList(r->payload);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->regions.size(), r->fds.size());
  int read_only = 0, read_write = 0;
  for (size_t k = 0; k < r->fds.size(); ++k) {
    const p::RegionInfo& info = list->regions[k];
    const int fd = r->fds[k].get();
    void* w = ::mmap(nullptr, info.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (info.access == engine::RegionAccess::kReadOnly) {
      ++read_only;
      EXPECT_EQ(w, MAP_FAILED) << "region " << info.region << " mapped writable";
      // No write or hole punching through the fd.
      const char byte = 1;
      EXPECT_EQ(::pwrite(fd, &byte, 1, 0), -1);
      EXPECT_NE(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
      // Another user cannot reopen it for writing through /proc (ztierd's
      // own user, here root, could: it could write ztierd's memory anyway).
      if (::geteuid() == 0) {
        EXPECT_EQ(AsNobody([fd] {
                    const std::string path = StrCat("/proc/self/fd/", fd);
                    return ::open(path.c_str(), O_RDWR | O_CLOEXEC) < 0 && errno == EACCES ? 0 : 1;
                  }),
                  0);
      }
      EXPECT_NE(::ftruncate(fd, 0), 0);  // sealed against shrinking
    } else {
      ++read_write;
      EXPECT_NE(w, MAP_FAILED) << std::strerror(errno);
      EXPECT_NE(::ftruncate(fd, 0), 0);
    }
    if (w != MAP_FAILED) ::munmap(w, info.bytes);
  }
  EXPECT_EQ(read_only, 1);
  EXPECT_EQ(read_write, 1);
}

// A client that kept a job's region fds and unregistered it, again and
// again, kept the read-only region's pages of every job (F_SEAL_FUTURE_WRITE
// let no one punch them): ztierd's memory, in no quota and not in the
// budget (1.2 GB over 100 jobs of 12 MiB). Its pages go with the job.
TEST_F(DaemonTest, RegionFdsKeptPastAnUnregisterHoldNoMemory) {
  RawClient c = RawClient::Connect(socket());
  const int32_t job = Register(c, "kept");
  Result<RawClient::Reply> r = c.Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = job}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  std::vector<UniqueFd> kept = std::move(r->fds);
  std::vector<void*> views;
  for (const UniqueFd& fd : kept) {
    struct stat st {};
    ASSERT_EQ(::fstat(fd.get(), &st), 0);
    EXPECT_GT(st.st_blocks, 0);  // ztierd's pinned, faulted-in pages
    views.push_back(::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd.get(), 0));
    ASSERT_NE(views.back(), MAP_FAILED);
  }
  r = c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = job}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  for (size_t k = 0; k < kept.size(); ++k) {
    struct stat st {};
    ASSERT_EQ(::fstat(kept[k].get(), &st), 0);
    EXPECT_EQ(st.st_blocks, 0) << "region " << k << " kept " << st.st_blocks * 512
                               << " bytes past its job";
    ::munmap(views[k], 4096);
  }
  WaitForStats(1, 0);
}

TEST_F(DaemonTest, AJobIsVisibleOnlyOnItsConnection) {
  RawClient a = RawClient::Connect(socket());
  RawClient b = RawClient::Connect(socket());
  const int32_t job = Register(a, "mine");
  for (p::MessageType t :
       {p::MessageType::kLayout, p::MessageType::kGradInbox, p::MessageType::kGradsReady,
        p::MessageType::kReleaseParams, p::MessageType::kPublishedStep}) {
    Result<RawClient::Reply> r = b.Call(t, p::Encode(p::UnitRef{.job = job, .unit = 0}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << p::MessageTypeName(t) << r->status;
  }
  for (p::MessageType t :
       {p::MessageType::kRegions, p::MessageType::kUnregisterJob, p::MessageType::kCounters,
        p::MessageType::kTargetStep, p::MessageType::kAbortStep}) {
    Result<RawClient::Reply> r = b.Call(
        t, t == p::MessageType::kAbortStep ? p::Encode(p::AbortStepRequest{.job = job, .step = 1})
                                           : p::Encode(p::JobRef{.job = job}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << p::MessageTypeName(t) << r->status;
    EXPECT_TRUE(r->fds.empty());
  }
  // Its owner still has it.
  Result<RawClient::Reply> r =
      a.Call(p::MessageType::kLayout, p::Encode(p::UnitRef{.job = job, .unit = 0}));
  ASSERT_TRUE(r.ok() && r->status.ok());
}

TEST_F(DaemonTest, NamesAreScopedByUidAndErrorsDoNotShowTheScope) {
  RawClient a = RawClient::Connect(socket());
  RawClient b = RawClient::Connect(socket());
  Register(a, "gpt");
  Result<RawClient::Reply> r = b.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("gpt")));
  ASSERT_TRUE(r.ok()) << r.status();
  // The same uid: its own name is taken; the message names it as given.
  EXPECT_EQ(r->status.code(), StatusCode::kAlreadyExists) << r->status;
  EXPECT_NE(r->status.ToString().find("'gpt'"), std::string::npos) << r->status;
  EXPECT_EQ(r->status.ToString().find("uid"), std::string::npos) << r->status;
}

TEST_F(DaemonTest, QuotasRefuseNamingTheQuotaAndTheFigures) {
  engine::DaemonOptions quotas;
  quotas.max_connections_per_uid = 2;
  quotas.max_jobs_per_uid = 1;
  Start(quotas);
  RawClient a = RawClient::Connect(socket());
  Register(a, "one");
  Result<RawClient::Reply> r = a.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("two")));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kResourceExhausted) << r->status;
  EXPECT_NE(r->status.ToString().find("max_jobs_per_uid"), std::string::npos) << r->status;
  RawClient b = RawClient::Connect(socket());
  // Past the quota an operator (this test's uid is the daemon's own) has a
  // reserve of connections for its tool's messages, so that a uid whose
  // jobs filled its quota can still be looked at and helped. A training
  // session is refused there at its hello (one took the reserve, locking
  // ztierctl out).
  SessionOptions session;
  session.daemon_socket = socket();
  for (int i = 0; i < 6; ++i) {
    Result<std::unique_ptr<Session>> refused = Session::Open(session);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
    // (At its hello on the reserve; at once, while the reserve is held by
    // the ones refused just before, their connections not closed yet.)
    const std::string why = refused.status().ToString();
    EXPECT_TRUE(why.find("only the operator's tool") != std::string::npos ||
                why.find("max_connections_per_uid") != std::string::npos)
        << why;
  }
  WaitForStats(2, 1);
  std::vector<std::unique_ptr<RawClient>> reserve;
  for (int i = 0; i < 4; ++i) {
    reserve.push_back(std::make_unique<RawClient>(RawClient::Connect(socket(), true, "ztierctl")));
    r = reserve.back()->Call(p::MessageType::kDaemonStatus, "");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->status.ok()) << r->status;
  }
  r = reserve[0]->Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("three")));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kResourceExhausted) << r->status;
  EXPECT_NE(r->status.ToString().find("operator's messages only"), std::string::npos) << r->status;
  EXPECT_NE(r->status.ToString().find("max_connections_per_uid: 2 held of 2"), std::string::npos)
      << r->status;
  // Past the reserve too, a connection is refused at its hello.
  SessionOptions o;
  o.daemon_socket = socket();
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().ToString().find("max_connections_per_uid"), std::string::npos) << s.status();
  EXPECT_NE(s.status().ToString().find("(and 4 on the operators' reserve)"), std::string::npos)
      << s.status();
}

// A connection that never says its hello is closed (silent ones held their
// uid's connection quota for good, locking its jobs and operators out).
TEST_F(DaemonTest, AConnectionWithoutAHelloIsClosed) {
  engine::DaemonOptions quick;
  quick.hello_timeout = 300ms;
  Start(quick);
  Result<SeqPacketSocket> silent = SeqPacketSocket::Connect(socket());
  ASSERT_TRUE(silent.ok()) << silent.status();
  WaitForStats(1, 0);
  Result<SeqPacketSocket::Received> notice = silent->Receive(5s, p::kMaxMessageBytes, 4);
  ASSERT_TRUE(notice.ok()) << notice.status();
  Result<std::string_view> body =
      p::DecodeReplyStatus(std::string_view(notice->data).substr(p::kHeaderBytes));
  ASSERT_FALSE(body.ok());
  EXPECT_NE(body.status().ToString().find("no hello within 300 ms"), std::string::npos)
      << body.status();
  WaitForStats(0, 0);
  // One that says it in time stays.
  RawClient talker = RawClient::Connect(socket());
  std::this_thread::sleep_for(600ms);
  EXPECT_TRUE(talker.Call(p::MessageType::kPoolStats, "").ok());
  WaitForStats(1, 0);
}

// Connections that never say their hello, any user's to open: each was
// logged as it closed, without the bound the other lines any user can make
// ztierd repeat have (a few a second, without end, from one user's
// connection quota).
TEST_F(DaemonTest, SilentConnectionsDoNotFloodTheLog) {
  engine::DaemonOptions quick;
  quick.hello_timeout = 100ms;
  Start(quick);
  testing::ScratchDir dir("silent");
  const std::string captured = dir.path() + "/stderr";
  std::fflush(stderr);
  UniqueFd saved(::dup(2));
  {
    UniqueFd file(::open(captured.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    ASSERT_TRUE(file.valid() && saved.valid());
    ::dup2(file.get(), 2);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<SeqPacketSocket> silent;
  for (int k = 0; k < 50; ++k) {
    Result<SeqPacketSocket> c = SeqPacketSocket::Connect(socket());
    if (c.ok()) silent.push_back(*std::move(c));
  }
  for (SeqPacketSocket& c : silent) {  // each told why, then closed
    (void)c.Receive(5s, p::kMaxMessageBytes, 4);
  }
  WaitForStats(0, 0);
  std::fflush(stderr);
  ::dup2(saved.get(), 2);
  std::ifstream in(captured);
  const std::string log(std::istreambuf_iterator<char>(in), {});
  size_t lines = 0;
  for (size_t at = log.find("no hello within"); at != std::string::npos;
       at = log.find("no hello within", at + 1)) {
    ++lines;
  }
  // 20 at once, then 20 every 10 s (2 a second, as a loaded machine
  // spreads the closes out).
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(silent.size(), 40u);
  EXPECT_GT(lines, 0u) << log;
  EXPECT_LE(lines, 21u + static_cast<size_t>(2 * seconds)) << log;
  EXPECT_LT(lines, silent.size()) << log;
}

// With no job for --idle-release-seconds, the pinned DRAM the pool kept
// for the next job goes back to the system (one large job left it locked
// until a restart); while a job is there, none of it goes.
TEST_F(DaemonTest, AnIdleDaemonGivesItsPinnedDramBack) {
  engine::DaemonOptions options;
  options.idle_dram_release = 2s;
  Start(options);
  const auto reserved = [&] { return daemon_->daemon().engine().pool_stats().reserved_bytes; };
  RawClient c = RawClient::Connect(socket());
  const int32_t job = Register(c, "a");
  ASSERT_GE(job, 0);
  std::this_thread::sleep_for(800ms);
  const uint64_t with_job = reserved();
  EXPECT_GT(with_job, 0u);
  Result<RawClient::Reply> r =
      c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = job}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  WaitForStats(1, 0);
  EXPECT_GT(reserved(), 0u) << "released before the idle time";
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (reserved() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(reserved(), 0u) << "an idle ztierd kept its pinned DRAM";
  // The next job makes its regions again.
  const int32_t b = Register(c, "b");
  ASSERT_GE(b, 0);
  r = c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = b}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  // Short jobs one after another, each gone before ztierd's next check
  // (every 200 ms): the pool stays for them (it was given back and pinned
  // again every 2 s, though jobs kept coming).
  for (int i = 0; i < 20; ++i) {
    EXPECT_GT(reserved(), 0u) << "given back between short jobs, before job " << i;
    const int32_t j = Register(c, StrCat("short-", i));
    ASSERT_GE(j, 0);
    r = c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = j}));
    ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
    std::this_thread::sleep_for(200ms);
  }
}

// A uid that holds nothing any more (its connections closed, its jobs
// gone) is forgotten: every uid that ever connected, refused ones too,
// kept a record and six metric series for as long as ztierd ran.
TEST_F(DaemonTest, AUidThatHoldsNothingLeavesTheMetrics) {
  const std::string me = StrCat("ztier_quota_connections{uid=\"", ::geteuid(), "\"}");
  {
    RawClient c = RawClient::Connect(socket());
    ASSERT_GE(Register(c, "a"), 0);
    EXPECT_NE(daemon_->daemon().MetricsText().find(me), std::string::npos);
  }
  WaitForStats(0, 0);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (daemon_->daemon().MetricsText().find(me) != std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(daemon_->daemon().MetricsText().find(me), std::string::npos)
      << daemon_->daemon().MetricsText();
  // It comes back as it connects again.
  RawClient again = RawClient::Connect(socket());
  ASSERT_GE(Register(again, "b"), 0);
  EXPECT_NE(daemon_->daemon().MetricsText().find(me), std::string::npos);
}

TEST_F(DaemonTest, TheDramQuotaOfAUidRefusesNamingItAndHoldsNothing) {
  engine::DaemonOptions quota;
  quota.max_dram_bytes_per_uid = 16 << 10;  // two units of 1000 params need more
  Start(quota);
  const uint64_t before = daemon_->daemon().engine().pool_stats().used_bytes;
  RawClient c = RawClient::Connect(socket());
  Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("big")));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kResourceExhausted) << r->status;
  EXPECT_NE(r->status.ToString().find("max_dram_bytes_per_uid"), std::string::npos) << r->status;
  EXPECT_NE(r->status.ToString().find("16384"), std::string::npos) << r->status;
  WaitForStats(1, 0);
  EXPECT_EQ(daemon_->daemon().engine().pool_stats().used_bytes, before);
}

// The swap quota too is checked before anything is allocated: a job over it
// grew the shared swap files (to 729 MiB for a quota of 4 MiB) and left them
// grown, the drive's room gone for everyone.
TEST_F(DaemonTest, TheSwapQuotaOfAUidRefusesBeforeTheSwapFilesGrow) {
  ScratchDir dir("nvme-quota");
  engine::Settings settings = SmallEngine();
  settings.nvme_paths = {dir.path()};
  settings.stripe_bytes = 64 << 10;
  engine::DaemonOptions quota;
  quota.max_nvme_bytes_per_uid = 64 << 10;  // one stripe; two units take one each
  daemon_.reset();
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(settings, quota);
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = *std::move(d);
  RawClient c = RawClient::Connect(socket());
  engine::JobSpec spec = TwoUnits("big");
  spec.optimizer_tier = engine::Tier::kNvme;
  Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(spec));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kResourceExhausted) << r->status;
  EXPECT_NE(r->status.ToString().find("131072 bytes of swap"), std::string::npos) << r->status;
  EXPECT_NE(r->status.ToString().find("max_nvme_bytes_per_uid"), std::string::npos) << r->status;
  WaitForStats(1, 0);
  for (const engine::SwapPathUsage& u : daemon_->daemon().engine().swap_usage()) {
    EXPECT_EQ(u.file_bytes, 0u) << u.path << ": the swap file grew for a refused job";
  }
  // One unit fits, and is charged.
  spec.units.resize(1);
  spec.name = "small";
  r = c.Call(p::MessageType::kRegisterJob, p::Encode(spec));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->status.ok()) << r->status;
}

// --------------------------------------------------------- lifecycle

TEST_F(DaemonTest, AClientThatDiesHasItsLeasesWaitsAndJobsFreed) {
  const engine::DramPoolStats before = daemon_->daemon().engine().pool_stats();
  {
    RawClient c = RawClient::Connect(socket());
    const int32_t job = Register(c, "dies");
    std::vector<float> w(1000, 0.5f);
    Result<UniqueFd> fd = engine::MakeSealedMemfd("w", w.size() * 4);
    ASSERT_TRUE(fd.ok());
    ASSERT_EQ(::pwrite(fd->get(), w.data(), w.size() * 4, 0), 4000);
    for (int unit = 0; unit < 2; ++unit) {
      const int fds[] = {fd->get()};
      Result<RawClient::Reply> r =
          c.Call(p::MessageType::kWriteWeights,
                 p::Encode(p::StagedData{.job = job, .unit = unit, .bytes = 4000}), fds);
      ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
    }
    // A lease held, and a wait that cannot end (step 1 needs grads).
    Result<RawClient::Reply> r =
        c.Call(p::MessageType::kAcquireParams,
               p::Encode(p::StepWait{.job = job, .unit = 0, .step = 0, .timeout = 1s}));
    ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
    ASSERT_TRUE(c.Send(p::MessageType::kWaitPublished,
                       p::Encode(p::StepWait{.job = job, .unit = 1, .step = 1, .timeout = 600s}))
                    .ok());
    WaitForStats(1, 1);
  }  // the socket closes: the client is gone
  WaitForStats(0, 0);
  const engine::DramPoolStats after = daemon_->daemon().engine().pool_stats();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
}

// A connection's pool kept as many threads as it ever had requests blocked
// at once, for its whole life: one burst of waits on a uid's idle
// connections held thousands of threads, and others' connections then got
// none.
TEST_F(DaemonTest, PoolThreadsOfABurstOfWaitsEndOnceIdle) {
  engine::DaemonOptions options;
  options.pool_thread_idle = 200ms;
  Start(options);
  const auto threads = ProcessThreads;
  RawClient c = RawClient::Connect(socket());
  const int before = threads();
  constexpr int kWaits = 40;
  for (int k = 0; k < kWaits; ++k) {
    ASSERT_TRUE(c.Send(p::MessageType::kAttachJob,
                       p::Encode(p::AttachRequest{
                           .rank = 0, .timeout = 300ms, .spec = TwoUnits("nobody-registers")}))
                    .ok());
  }
  for (int k = 0; k < kWaits; ++k) {
    Result<RawClient::Reply> r = c.Receive();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << r->status.ToString();
  }
  EXPECT_GE(threads(), before + kWaits / 2) << "the waits did not run at once";
  int now = threads();
  for (int k = 0; k < 100 && now > before + 2; ++k) {
    std::this_thread::sleep_for(20ms);
    now = threads();
  }
  EXPECT_LE(now, before + 2) << "threads " << before << " before the waits";
  // The pool still serves: a new burst gets threads again.
  ASSERT_TRUE(c.Send(p::MessageType::kAttachJob,
                     p::Encode(p::AttachRequest{
                         .rank = 0, .timeout = 50ms, .spec = TwoUnits("nobody-registers")}))
                  .ok());
  Result<RawClient::Reply> r = c.Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << r->status;
}

// A registered job's spec stays in ztierd's heap (twice, with the engine's
// layout) for the job's life: one uid's jobs of millions of scalar tensors
// took gigabytes that only the specs in flight were counted for.
TEST_F(DaemonTest, RegisteredJobsSpecsCountTowardTheSpecQuota) {
  engine::DaemonOptions options;
  options.max_spec_bytes_per_uid = 256 << 10;
  Start(options);
  engine::JobSpec many;
  many.name = "scalars";
  many.units.push_back({.name = "u0", .tensors = {}});
  for (int t = 0; t < 1500; ++t) {
    many.units[0].tensors.push_back({.name = StrCat("t", t), .shape = {1}});
  }
  RawClient c = RawClient::Connect(socket());
  const int32_t first = [&] {
    Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(many));
    EXPECT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
    Result<p::JobHandle> h = p::DecodeJobHandle(r.ok() ? r->payload : "");
    return h.ok() ? h->job : -1;
  }();
  ASSERT_GE(first, 0);
  many.name = "more-scalars";
  Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(many));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kResourceExhausted) << r->status;
  EXPECT_NE(r->status.message().find("max_spec_bytes_per_uid"), std::string::npos) << r->status;
  EXPECT_EQ(daemon_->daemon().stats().jobs, 1);
  // Unregistered, its spec's bytes come back.
  r = c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = first}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  r = c.Call(p::MessageType::kRegisterJob, p::Encode(many));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->status.ok()) << r->status;
}

// A job's collective region was the size its first rank asked for, up to
// a GiB whatever the job, and in no quota: one uid with a quota of 256 MiB
// made ztierd hold 4 GiB with four one-rank jobs. Its size is the job's
// ranks', and it is in the uid's DRAM use while it exists.
TEST_F(DaemonTest, ACollectiveRegionIsTheJobsRanksSizeAndInItsUidsQuota) {
  engine::DaemonOptions options;
  options.job_grace_period = 60s;
  Start(options);
  std::optional<RawClient> c(RawClient::Connect(socket()));
  const int32_t job = Register(*c, "coll");
  Result<std::unique_ptr<DaemonControl>> control = DaemonControl::Connect(socket(), 10s);
  ASSERT_TRUE(control.ok()) << control.status();
  const uint64_t job_bytes = (*control)->GetQuota(::geteuid())->dram_bytes;
  const auto ask = [&](uint64_t bytes) {
    Result<RawClient::Reply> r =
        c->Call(p::MessageType::kCollectiveRegion,
                p::Encode(p::CollectiveRegionRequest{.job = job, .bytes = bytes}));
    return r.ok() ? r->status : r.status();
  };
  Status big = ask(engine::kMaxCollectiveRegionBytes);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument) << big;
  EXPECT_NE(big.message().find("of 1 rank(s) has a collective region of 4198400 bytes"),
            std::string::npos)
      << big;
  // A quota with no room for it.
  ASSERT_TRUE((*control)
                  ->SetQuota({.uid = ::geteuid(),
                              .set = engine::kQuotaMaxDram,
                              .quota = {.max_dram_bytes = job_bytes + 4096}})
                  .ok());
  Status over = ask(engine::CollectiveRegionBytes(1));
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over;
  EXPECT_NE(over.message().find("max_dram_bytes_per_uid"), std::string::npos) << over;
  ASSERT_TRUE((*control)
                  ->SetQuota({.uid = ::geteuid(),
                              .set = engine::kQuotaMaxDram,
                              .quota = {.max_dram_bytes = uint64_t{1} << 30}})
                  .ok());
  ASSERT_TRUE(ask(engine::CollectiveRegionBytes(1)).ok());
  EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes,
            job_bytes + engine::CollectiveRegionBytes(1));
  ASSERT_TRUE(ask(engine::CollectiveRegionBytes(1)).ok());  // the same region, charged once
  EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes,
            job_bytes + engine::CollectiveRegionBytes(1));
  // Parked (its client gone), its ranks meet in a fresh region: the old
  // one's charge goes; freed, the job's.
  c.reset();
  WaitForStats(1, 1);  // (the control's connection)
  EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, job_bytes);
  Result<std::vector<engine::JobInfo>> jobs = (*control)->Jobs();
  ASSERT_TRUE(jobs.ok() && jobs->size() == 1);
  ASSERT_TRUE((*control)->Evict((*jobs)[0].id, "done").ok());
  EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, 0u);
}

// A job of several ranks was charged for its collective region only when
// its first rank asked for it: admitted at its uid's quota edge, it was
// refused at its first collective. The region's place is held from the
// registration on (parked too), and a registration with no room for it is
// refused, naming it.
TEST_F(DaemonTest, AJobOfSeveralRanksHoldsItsCollectiveRegionsPlaceFromItsRegistration) {
  engine::DaemonOptions options;
  options.job_grace_period = 60s;
  Start(options);
  Result<std::unique_ptr<DaemonControl>> control = DaemonControl::Connect(socket(), 10s);
  ASSERT_TRUE(control.ok()) << control.status();
  engine::JobSpec spec = TwoUnits("pair");
  spec.ranks = 2;
  const uint64_t region = engine::CollectiveRegionBytes(2);
  const auto register_pair = [&](RawClient& c) -> Result<int32_t> {
    Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(spec));
    if (!r.ok()) return r.status();
    if (!r->status.ok()) return r->status;
    ZT_ASSIGN_OR_RETURN(p::JobHandle h, p::DecodeJobHandle(r->payload));
    return h.job;
  };
  uint64_t states = 0;
  {
    std::optional<RawClient> c(RawClient::Connect(socket()));
    Result<int32_t> job = register_pair(*c);
    ASSERT_TRUE(job.ok()) << job.status();
    Result<std::vector<engine::JobInfo>> jobs = (*control)->Jobs();
    ASSERT_TRUE(jobs.ok() && jobs->size() == 1);
    states = (*jobs)[0].counters.dram_bytes;
    ASSERT_GT(states, 0u);
    EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, states + region);
    // Made, it is charged once; parked, its place stays.
    Result<RawClient::Reply> r =
        c->Call(p::MessageType::kCollectiveRegion,
                p::Encode(p::CollectiveRegionRequest{.job = *job, .bytes = region}));
    ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
    EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, states + region);
    c.reset();
    WaitForStats(1, 1);
    EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, states + region);
    ASSERT_TRUE((*control)->Evict((*jobs)[0].id, "done").ok());
    EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, 0u);
  }
  // A quota with room for the states only: refused at the registration.
  ASSERT_TRUE((*control)
                  ->SetQuota({.uid = ::geteuid(),
                              .set = engine::kQuotaMaxDram,
                              .quota = {.max_dram_bytes = states + region - 1}})
                  .ok());
  RawClient c = RawClient::Connect(socket());
  Result<int32_t> refused = register_pair(c);
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find(
                StrCat(region, " of them the collective region of its 2 ranks")),
            std::string::npos)
      << refused.status();
  EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, 0u);
  // With room for both, its ranks meet.
  ASSERT_TRUE((*control)
                  ->SetQuota({.uid = ::geteuid(),
                              .set = engine::kQuotaMaxDram,
                              .quota = {.max_dram_bytes = states + region}})
                  .ok());
  Result<int32_t> job = register_pair(c);
  ASSERT_TRUE(job.ok()) << job.status();
  Result<RawClient::Reply> r =
      c.Call(p::MessageType::kCollectiveRegion,
             p::Encode(p::CollectiveRegionRequest{.job = *job, .bytes = region}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  r = c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = *job}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, 0u);
  // Ranks past what a region may serve (256: 1 GiB and more) make none:
  // nothing is charged for one (it was up to 256 GiB, refused by any quota).
  ASSERT_TRUE((*control)
                  ->SetQuota({.uid = ::geteuid(),
                              .set = engine::kQuotaMaxDram,
                              .quota = {.max_dram_bytes = uint64_t{1} << 30}})
                  .ok());
  spec.ranks = 256;
  ASSERT_GT(engine::CollectiveRegionBytes(spec.ranks), engine::kMaxCollectiveRegionBytes);
  job = register_pair(c);
  ASSERT_TRUE(job.ok()) << job.status();
  Result<std::vector<engine::JobInfo>> jobs = (*control)->Jobs();
  ASSERT_TRUE(jobs.ok() && jobs->size() == 1);
  EXPECT_EQ((*control)->GetQuota(::geteuid())->dram_bytes, (*jobs)[0].counters.dram_bytes);
}

TEST_F(DaemonTest, AJobWhoseClientDiedIsParkedForTheGracePeriodThenFreed) {
  engine::DaemonOptions options;
  // Long enough that a loaded machine's scheduling leaves the reattach
  // below inside it (at 1 s it missed it once under a -j2 suite).
  options.job_grace_period = 3s;
  Start(options);
  const engine::DramPoolStats before = daemon_->daemon().engine().pool_stats();
  {
    RawClient c = RawClient::Connect(socket());
    const int32_t job = Register(c, "parked");
    Result<RawClient::Reply> region =
        c.Call(p::MessageType::kCollectiveRegion,
               p::Encode(p::CollectiveRegionRequest{.job = job,
                                                    .bytes = engine::CollectiveRegionBytes(1)}));
    ASSERT_TRUE(region.ok() && region->status.ok() && region->fds.size() == 1);
    // A wait that cannot end: the connection still closes at once (its
    // threads do not wait for a job that outlives it).
    ASSERT_TRUE(c.Send(p::MessageType::kWaitPublished,
                       p::Encode(p::StepWait{.job = job, .unit = 1, .step = 1, .timeout = 600s}))
                    .ok());
    WaitForStats(1, 1);
  }
  WaitForStats(0, 1);  // parked, not freed
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(daemon_->daemon().stats().jobs, 1);
  {
    // Within the grace period a rank attaches to it again.
    RawClient c = RawClient::Connect(socket());
    Result<RawClient::Reply> r =
        c.Call(p::MessageType::kAttachJob,
               p::Encode(p::AttachRequest{.rank = 0, .timeout = 1s, .spec = TwoUnits("parked")}));
    ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
    // Its collectives start afresh: the region of the ranks that left is
    // not this one's (whose abort word would say a rank left).
    Result<p::JobHandle> h = p::DecodeJobHandle(r->payload);
    ASSERT_TRUE(h.ok());
    r = c.Call(p::MessageType::kCollectiveRegion,
               p::Encode(p::CollectiveRegionRequest{.job = h->job,
                                                    .bytes = engine::CollectiveRegionBytes(1)}));
    ASSERT_TRUE(r.ok() && r->status.ok() && r->fds.size() == 1);
    Result<engine::Mapping> m = engine::Mapping::Map(r->fds[0].get(), 4096, false, "region");
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(*static_cast<const uint32_t*>(m->data()), 0u) << "the abort word is set";
    WaitForStats(1, 1);
  }
  WaitForStats(0, 1);  // parked again; then the grace period ends
  WaitForStats(0, 0);
  EXPECT_EQ(daemon_->daemon().engine().pool_stats().used_bytes, before.used_bytes);
  // A registration of the name replaces a parked job at once.
  {
    RawClient c = RawClient::Connect(socket());
    Register(c, "again");
  }
  WaitForStats(0, 1);
  RawClient c = RawClient::Connect(socket());
  EXPECT_GE(Register(c, "again"), 0);
  WaitForStats(1, 1);
}

// A run killed and started again at once registers its job's name while
// ztierd may not have seen the old connection close: the name was refused
// as registered already (or, while the old job was being freed, by the
// engine), about 1,600 times in 2,500 tight rounds. A name held only by
// connections whose peers hung up is waited for; one a live connection
// holds is refused at once.
TEST_F(DaemonTest, ANameIsFreeAsSoonAsTheConnectionsHoldingItHungUp) {
  for (const auto grace : {0s, 60s}) {
    SCOPED_TRACE("grace period " + std::to_string(grace.count()) + " s");
    engine::DaemonOptions options;
    options.job_grace_period = grace;
    Start(options);
    int registered = 0;
    for (int round = 0; round < 300; ++round) {
      RawClient c = RawClient::Connect(socket());
      Result<RawClient::Reply> r =
          c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("again")));
      ASSERT_TRUE(r.ok()) << r.status();
      if (!r->status.ok()) {
        ADD_FAILURE() << "round " << round << ": " << r->status;
        break;
      }
      ++registered;
    }  // each round's connection closes as the next one registers
    EXPECT_EQ(registered, 300);
    RawClient holder = RawClient::Connect(socket());
    ASSERT_GE(Register(holder, "held"), 0);
    RawClient other = RawClient::Connect(socket());
    const auto t0 = std::chrono::steady_clock::now();
    Result<RawClient::Reply> r =
        other.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("held")));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status.code(), StatusCode::kAlreadyExists) << r->status;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "a live holder's name waited for";
  }
}

// A registration refused while ztierd drains took the parked job of its
// name with it (freed as "registered again" before the refusal): a drain
// lets jobs live, and a refusal changes nothing.
TEST_F(DaemonTest, ARefusedRegistrationLeavesTheParkedJobOfItsNameParked) {
  engine::DaemonOptions options;
  options.job_grace_period = 60s;
  Start(options);
  {
    RawClient c = RawClient::Connect(socket());
    Register(c, "left");
  }
  WaitForStats(0, 1);  // parked
  RawClient c = RawClient::Connect(socket());
  Result<RawClient::Reply> r =
      c.Call(p::MessageType::kDrain, p::Encode(p::DrainRequest{.on = true}));
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  r = c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("left")));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kUnavailable) << r->status;
  EXPECT_EQ(daemon_->daemon().stats().jobs, 1) << "the parked job was freed";
  r = c.Call(p::MessageType::kDrain, p::Encode(p::DrainRequest{.on = false}));
  ASSERT_TRUE(r.ok() && r->status.ok());
  EXPECT_GE(Register(c, "left"), 0);
  WaitForStats(1, 1);
}

// A quota refusal says how much of the use is parked jobs and when they go
// (it said only "uid N has 1 jobs": the user saw no job of theirs running).
TEST_F(DaemonTest, AQuotaRefusalNamesTheParkedJobs) {
  engine::DaemonOptions options;
  options.job_grace_period = 60s;
  options.max_jobs_per_uid = 1;
  Start(options);
  {
    RawClient c = RawClient::Connect(socket());
    Register(c, "left");
  }
  WaitForStats(0, 1);  // parked
  RawClient c = RawClient::Connect(socket());
  Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("other")));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kResourceExhausted) << r->status;
  EXPECT_NE(r->status.message().find("1 of its jobs ("), std::string::npos) << r->status;
  EXPECT_NE(r->status.message().find("are parked"), std::string::npos) << r->status;
  // Its own name takes the parked job over.
  EXPECT_GE(Register(c, "left"), 0);
}

// One live process that registered a job, asked for its regions and
// closed its connection, again and again (a grace period set, so each
// registration took the parked job over): each freed job kept a pidfd of
// the process for as long as it lived, and ztierd's fd table filled (2,044
// fds after 6,000 rounds; other users' registrations then failed). Freed
// jobs that live processes map count as the uid's jobs.
TEST_F(DaemonTest, FreedJobsThatALiveProcessMapsCountAsItsJobs) {
  engine::DaemonOptions options;
  options.job_grace_period = 60s;
  options.max_jobs_per_uid = 4;
  Start(options);
  const auto fds = OpenFdCount;
  const auto before = fds();
  Status refused;
  int registered = 0;
  for (int round = 0; round < 40 && refused.ok(); ++round) {
    WaitForStats(0, round == 0 ? 0 : 1);  // the last round's job parked
    RawClient c = RawClient::Connect(socket());
    Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("L")));
    ASSERT_TRUE(r.ok()) << r.status();
    if (!r->status.ok()) {
      refused = r->status;
      break;
    }
    ++registered;
    Result<p::JobHandle> h = p::DecodeJobHandle(r->payload);
    ASSERT_TRUE(h.ok()) << h.status();
    r = c.Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = h->job}));
    ASSERT_TRUE(r.ok() && r->status.ok());
  }  // the connection closes; the process (this one) lives
  EXPECT_EQ(registered, 4);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find(
                "and 3 freed ones (evicted, or left by their connections) whose memory "
                "processes that live on still map"),
            std::string::npos)
      << refused;
  EXPECT_LT(fds() - before, 24) << "ztierd keeps fds for the rounds";
  EXPECT_EQ(daemon_->daemon().stats().jobs, 1) << "a refusal changes nothing: the parked job stays";
}

TEST_F(DaemonTest, AStoppingDaemonTellsEveryClientWhyAndNothingHangs) {
  SessionOptions o;
  o.daemon_socket = socket();
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  ASSERT_TRUE(s.ok()) << s.status();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("stop")));
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<float> w(1000, 1.0f);
  ASSERT_TRUE((*m)->SetWeights(0, w.data(), w.size()).ok());
  ASSERT_TRUE((*m)->SetWeights(1, w.data(), w.size()).ok());
  // A wait blocked in the daemon ends with the daemon's reason.
  Status waited;
  std::thread waiter([&] { waited = (*m)->WaitPublished(1, 600s); });
  std::this_thread::sleep_for(100ms);
  const auto t0 = std::chrono::steady_clock::now();
  daemon_->Stop("maintenance at noon");
  waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_FALSE(waited.ok());
  EXPECT_TRUE(waited.code() == StatusCode::kUnavailable || waited.code() == StatusCode::kAborted)
      << waited;
  // Every later call fails at once, with the reason.
  EXPECT_EQ((*m)->published_step(), -1);
  Status again = (*m)->SetWeights(0, w.data(), w.size());
  EXPECT_EQ(again.code(), StatusCode::kUnavailable) << again;
  EXPECT_NE(again.ToString().find("maintenance at noon"), std::string::npos) << again;
}

TEST_F(DaemonTest, ALargeJobSpecTravelsInAMemfd) {
  engine::JobSpec spec;
  spec.name = "many-units";
  for (int u = 0; u < 600; ++u) {
    spec.units.push_back({.name = StrCat("layer.", u, std::string(100, 'x')),
                          .tensors = {{.name = StrCat("w", u), .shape = {64}}}});
  }
  spec.ranks = 2;
  ASSERT_GT(p::Encode(spec).size(), p::kMaxMessageBytes);
  SessionOptions o;
  o.daemon_socket = socket();
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  ASSERT_TRUE(s.ok()) << s.status();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(spec));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->units(), 600);
  // Rank 1 attaches from another connection with the same large spec.
  Result<std::unique_ptr<Session>> s1 = Session::Open(o);
  ASSERT_TRUE(s1.ok()) << s1.status();
  Result<std::unique_ptr<Model>> m1 = (*s1)->AttachModel(ModelOf(spec), 1, 5s);
  ASSERT_TRUE(m1.ok()) << m1.status();
  EXPECT_EQ((*m1)->units(), 600);
  EXPECT_EQ((*m1)->layout(599).shard, (*m)->layout(599).shard);
  // Weights in, the master out, through staging memfds.
  std::vector<float> w(64);
  for (int k = 0; k < 64; ++k) w[k] = 0.25f * k;
  ASSERT_TRUE((*m)->SetWeights(599, w.data(), w.size()).ok());
  std::vector<float> master;
  ASSERT_TRUE((*m)->ReadMaster(599, &master).ok());
  ASSERT_GE(master.size(), 64u);
  for (int k = 0; k < 64; ++k) EXPECT_EQ(master[k], w[k]);
}

// One uid cannot take every thread of the daemon: its requests in flight
// across all its connections are bounded (each blocked one holds a thread;
// a user's flood of waits made ztierd start threads until it aborted). The
// refusal names the quota, and the uid's requests go through again once
// the others end.
TEST_F(DaemonTest, OneUidsRequestsInFlightOnAllItsConnectionsAreBounded) {
  engine::DaemonOptions o;
  o.max_requests_in_flight = 2;
  o.max_requests_in_flight_per_uid = 4;
  Start(o);
  const auto attach = [](std::chrono::milliseconds timeout) {
    return p::Encode(p::AttachRequest{.rank = 0, .timeout = timeout, .spec = TwoUnits("nobody")});
  };
  // Two connections, two waits each, for a job nobody registers.
  std::vector<RawClient> waiting;
  for (int c = 0; c < 2; ++c) waiting.push_back(RawClient::Connect(socket()));
  const int before = ProcessThreads();
  for (RawClient& c : waiting) {
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(c.Send(p::MessageType::kAttachJob, attach(8s)).ok());
    }
  }
  // In once each has its pool thread (sent is not in: a loaded machine's
  // reader threads may not have read them when the third's call arrives).
  for (int k = 0; k < 500 && ProcessThreads() < before + 4; ++k) {
    std::this_thread::sleep_for(10ms);
  }
  // Once the four are in, a fifth on a third connection is refused at once
  // (the four wait 8 s: in until then on a loaded machine too).
  RawClient third = RawClient::Connect(socket());
  Status refused;
  const auto deadline = std::chrono::steady_clock::now() + 6s;
  while (refused.ok() && std::chrono::steady_clock::now() < deadline) {
    Result<RawClient::Reply> r = third.Call(p::MessageType::kAttachJob, attach(10ms));
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->status.code() == StatusCode::kResourceExhausted) {
      refused = r->status;
    } else {
      EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << r->status;
    }
  }
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("max_requests_in_flight_per_uid"), std::string::npos) << refused;
  for (RawClient& c : waiting) {
    for (int k = 0; k < 2; ++k) {
      Result<RawClient::Reply> r = c.Receive(10s);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << r->status;
    }
  }
  Result<RawClient::Reply> again = third.Call(p::MessageType::kAttachJob, attach(10ms));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->status.code(), StatusCode::kNotFound) << again->status;
}

// A client that sends requests and reads no reply: once its socket holds
// no more refusals, the daemon's send to it waits (up to 30 s) for room.
// That wait was made with the daemon's lock held, so every other client's
// hello, ztierctl and the watchdog's ping stalled for as long (past
// WatchdogSec: systemd would have killed ztierd). Others are served at
// once.
TEST_F(DaemonTest, AClientThatReadsNoRepliesHoldsUpNobodyElse) {
  engine::DaemonOptions o;
  o.max_requests_in_flight = 2;
  o.max_requests_in_flight_per_uid = 2;
  Start(o);
  RawClient flood = RawClient::Connect(socket());
  const std::string wait =
      p::Encode(p::AttachRequest{.rank = 0, .timeout = 20s, .spec = TwoUnits("nobody")});
  // Two waits in flight, then refusals, until the daemon stops reading
  // (blocked sending to us) and our sends find no room.
  int sent = 0;
  while (sent < 100000 && flood.Send(p::MessageType::kAttachJob, wait, {}, 0, 300ms).ok()) ++sent;
  ASSERT_LT(sent, 100000) << "the daemon never stopped reading";
  const auto t0 = std::chrono::steady_clock::now();
  RawClient other = RawClient::Connect(socket());
  Result<RawClient::Reply> status = other.Call(p::MessageType::kDaemonStatus, "");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->status.ok()) << status->status;
  (void)daemon_->daemon().stats();  // what the watchdog's ping reads
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "after " << sent << " requests";
  // Nor does it hold up a stop (it did, until its send gave up at 30 s).
  const auto t1 = std::chrono::steady_clock::now();
  daemon_->Stop("stopping beside a client that reads nothing");
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 5s);
}

// A spec in a memfd was charged twice its bytes while ztierd decoded it and
// made its copies, some eight times more: one uid's requests took
// gigabytes past its quota. It is charged for those before it is read.
TEST_F(DaemonTest, ASpecInAMemfdIsChargedForWhatItsDecodingTakes) {
  engine::JobSpec spec;
  spec.name = "scalars-in-a-memfd";
  spec.units.push_back({.name = "u0", .tensors = {}});
  for (int t = 0; t < 6000; ++t) {
    spec.units[0].tensors.push_back({.name = StrCat("t", t), .shape = {1}});
  }
  const uint64_t bytes = p::Encode(spec).size();
  ASSERT_GT(bytes, p::kMaxMessageBytes);  // it travels in a memfd
  engine::DaemonOptions o;
  o.max_spec_bytes_per_uid = 10 * bytes;
  Start(o);
  SessionOptions so;
  so.daemon_socket = socket();
  Result<std::unique_ptr<Session>> s = Session::Open(so);
  ASSERT_TRUE(s.ok()) << s.status();
  Status refused = (*s)->RegisterModel(ModelOf(spec)).status();
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find(StrCat("this one needs ", 16 * bytes)), std::string::npos)
      << refused;
  EXPECT_EQ(daemon_->daemon().stats().jobs, 0);
}

// A waiting attach stayed charged 16 times its spec's bytes for its whole
// wait: a job's ranks attaching together were refused under a quota that
// holds their decoded specs. The wait is charged for what it keeps.
TEST_F(DaemonTest, RanksWaitingToAttachAreChargedForTheSpecTheyKeep) {
  engine::JobSpec spec;
  spec.name = "three-ranks";
  for (int u = 0; u < 600; ++u) {
    spec.units.push_back({.name = StrCat("layer.", u, std::string(100, 'x')),
                          .tensors = {{.name = StrCat("w", u), .shape = {64}}}});
  }
  spec.ranks = 3;
  const uint64_t bytes = p::Encode(spec).size();
  ASSERT_GT(bytes, p::kMaxMessageBytes);  // it travels in a memfd
  engine::DaemonOptions o;
  // Room for one request reading its spec (16x) beside two waits (their
  // decoded specs, about 4x each), not for two reading.
  o.max_spec_bytes_per_uid = (p::kMemfdPayloadHeapFactor + 10) * bytes;
  Start(o);
  SessionOptions so;
  so.daemon_socket = socket();
  std::vector<std::unique_ptr<Session>> s;
  for (int r = 0; r < 3; ++r) {
    Result<std::unique_ptr<Session>> one = Session::Open(so);
    ASSERT_TRUE(one.ok()) << one.status();
    s.push_back(std::move(*one));
  }
  Status attached[3];
  std::vector<std::thread> waiters;
  for (int r = 1; r < 3; ++r) {
    waiters.emplace_back(
        [&, r] { attached[r] = s[r]->AttachModel(ModelOf(spec), r, 20s).status(); });
    std::this_thread::sleep_for(300ms);  // one waits before the other reads
  }
  Result<std::unique_ptr<Model>> m = s[0]->RegisterModel(ModelOf(spec));
  for (std::thread& t : waiters) t.join();
  EXPECT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(attached[1].ok()) << attached[1];
  EXPECT_TRUE(attached[2].ok()) << attached[2];
}

// Nor all its memory: the job specs one uid's requests hold (an attach
// keeps its spec while it waits, up to a day; a user's large specs took
// ztierd's memory without bound) are bounded, and given back as each ends.
TEST_F(DaemonTest, TheJobSpecsOneUidsRequestsHoldAreBounded) {
  engine::JobSpec spec;
  spec.name = "large-spec";
  for (int u = 0; u < 600; ++u) {
    spec.units.push_back({.name = StrCat("layer.", u, std::string(100, 'x')),
                          .tensors = {{.name = StrCat("w", u), .shape = {64}}}});
  }
  spec.ranks = 2;
  const uint64_t bytes = p::Encode(spec).size();
  ASSERT_GT(bytes, p::kMaxMessageBytes);  // it travels in a memfd
  engine::DaemonOptions o;
  // A request is charged kMemfdPayloadHeapFactor (16) times its spec's
  // bytes as it reads it, a waiting attach its decoded spec after: a second
  // one coming while the first waits is more than the quota.
  o.max_spec_bytes_per_uid = (p::kMemfdPayloadHeapFactor + 1) * bytes;
  Start(o);
  SessionOptions so;
  so.daemon_socket = socket();
  Result<std::unique_ptr<Session>> s1 = Session::Open(so);
  Result<std::unique_ptr<Session>> s2 = Session::Open(so);
  ASSERT_TRUE(s1.ok() && s2.ok());
  Status first;
  std::thread waiter([&] { first = (*s1)->AttachModel(ModelOf(spec), 1, 3s).status(); });
  std::this_thread::sleep_for(300ms);  // its request in first, as a rule
  Status refused;
  const auto deadline = std::chrono::steady_clock::now() + 2500ms;
  while (refused.ok() && std::chrono::steady_clock::now() < deadline) {
    Status st = (*s2)->AttachModel(ModelOf(spec), 1, 10ms).status();
    if (st.code() == StatusCode::kResourceExhausted) {
      refused = st;
    } else {
      EXPECT_EQ(st.code(), StatusCode::kNotFound) << st;
    }
  }
  waiter.join();
  // Whichever came second while the other waited was refused (on a loaded
  // machine a probe may be the one waiting when the long wait arrives).
  if (first.code() == StatusCode::kResourceExhausted) refused = first;
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("max_spec_bytes_per_uid"), std::string::npos) << refused;
  EXPECT_TRUE(first.code() == StatusCode::kNotFound ||
              first.code() == StatusCode::kResourceExhausted)
      << first;
  // Every charge was given back: the same spec is in flight again, and
  // registers.
  Status again = (*s2)->AttachModel(ModelOf(spec), 1, 10ms).status();
  EXPECT_EQ(again.code(), StatusCode::kNotFound) << again;
  Result<std::unique_ptr<Model>> m = (*s2)->RegisterModel(ModelOf(spec));
  EXPECT_TRUE(m.ok()) << m.status();
}

// Two launches of a user with one job name on one ztierd (two torchrun
// runs started together): a rank joins its own launch's registration only.
// Before, a rank of the second launch could attach to the first's job (its
// spec matched), training with it while its own rank 0 was refused.
TEST_F(DaemonTest, ARankJoinsOnlyItsOwnLaunchOfAJobName) {
  engine::JobSpec spec = TwoUnits("same");
  spec.ranks = 3;
  Session::ModelSpec first = ModelOf(spec);
  first.launch = 0x1234;
  Session::ModelSpec second = first;
  second.launch = 0x5678;
  SessionOptions o;
  o.daemon_socket = socket();
  Result<std::unique_ptr<Session>> s0 = Session::Open(o);
  Result<std::unique_ptr<Session>> s1 = Session::Open(o);
  ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status() << s1.status();
  Result<std::unique_ptr<Model>> m0 = (*s0)->RegisterModel(first);
  ASSERT_TRUE(m0.ok()) << m0.status();
  Result<std::unique_ptr<Model>> other0 = (*s1)->RegisterModel(second);
  EXPECT_EQ(other0.status().code(), StatusCode::kAlreadyExists) << other0.status();
  Result<std::unique_ptr<Model>> other1 = (*s1)->AttachModel(second, 1, 2s);
  ASSERT_FALSE(other1.ok());
  EXPECT_EQ(other1.status().code(), StatusCode::kFailedPrecondition) << other1.status();
  EXPECT_NE(other1.status().message().find("registered by another launch's rank 0"),
            std::string::npos)
      << other1.status();
  // The rank stays free for its own launch; launch 0 (a C++ caller that
  // draws none) is not checked.
  Result<std::unique_ptr<Model>> m1 = (*s1)->AttachModel(first, 1, 2s);
  ASSERT_TRUE(m1.ok()) << m1.status();
  Session::ModelSpec unchecked = first;
  unchecked.launch = 0;
  Result<std::unique_ptr<Model>> m2 = (*s1)->AttachModel(unchecked, 2, 2s);
  ASSERT_TRUE(m2.ok()) << m2.status();
}

// A launch killed and started again: a rank of the new launch that asks
// to attach before its rank 0 registered again met the old launch's job
// (parked, or held by connections that hung up) and was refused as a rank
// of another launch. It waits for its own launch's registration, which
// replaces the old job.
TEST_F(DaemonTest, ARankOfALaunchStartedAgainWaitsForItsRankZero) {
  engine::DaemonOptions options;
  options.job_grace_period = 60s;
  Start(options);
  engine::JobSpec spec = TwoUnits("again");
  spec.ranks = 2;
  spec.launch = 0x1234;
  {
    RawClient c0 = RawClient::Connect(socket());
    Result<RawClient::Reply> r = c0.Call(p::MessageType::kRegisterJob, p::Encode(spec));
    ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  }  // killed: its job is parked
  Session::ModelSpec new_launch = ModelOf(spec);
  new_launch.launch = 0x5678;
  SessionOptions o;
  o.daemon_socket = socket();
  WaitForStats(0, 1);  // parked
  Result<std::unique_ptr<Session>> s1 = Session::Open(o);
  ASSERT_TRUE(s1.ok()) << s1.status();
  // No rank 0 comes: the wait ends saying whose job is there.
  Result<std::unique_ptr<Model>> lone = (*s1)->AttachModel(new_launch, 1, 300ms);
  EXPECT_EQ(lone.status().code(), StatusCode::kNotFound) << lone.status();
  EXPECT_NE(lone.status().message().find("another launch's"), std::string::npos) << lone.status();
  // Rank 1 first, then rank 0.
  Result<std::unique_ptr<Model>> m1 = Status::Internal("not attached");
  std::thread rank1([&] { m1 = (*s1)->AttachModel(new_launch, 1, 10s); });
  std::this_thread::sleep_for(300ms);
  Result<std::unique_ptr<Session>> s0 = Session::Open(o);
  ASSERT_TRUE(s0.ok()) << s0.status();
  Result<std::unique_ptr<Model>> m0 = (*s0)->RegisterModel(new_launch);
  rank1.join();
  ASSERT_TRUE(m0.ok()) << m0.status();
  ASSERT_TRUE(m1.ok()) << m1.status();
  WaitForStats(2, 1);  // the new launch's job alone
}

// Learning rates through ztierd: the rank that registered the job and an
// attached one may both set them (for the whole job); a connection without
// the job may not; a rank whose model puts a tensor in another param group,
// freezes another tensor or decays a group otherwise is refused, naming it.
TEST_F(DaemonTest, AnyRankSetsTheLearningRatesAndAttachCompareParamGroups) {
  engine::JobSpec spec = TwoUnits("groups");
  spec.ranks = 2;
  spec.units[0].tensors.push_back({.name = "u0.b", .shape = {10}, .group = 1});
  spec.units[1].tensors[0].frozen = true;
  Session::ModelSpec model = ModelOf(spec);
  model.optimizer.group_weight_decay = {0.1f, 0.0f};
  SessionOptions o;
  o.daemon_socket = socket();
  Result<std::unique_ptr<Session>> s0 = Session::Open(o);
  Result<std::unique_ptr<Session>> s1 = Session::Open(o);
  ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status() << s1.status();
  Result<std::unique_ptr<Model>> m0 = (*s0)->RegisterModel(model);
  ASSERT_TRUE(m0.ok()) << m0.status();

  auto refused = [&](const Session::ModelSpec& other, const std::string& says) {
    Result<std::unique_ptr<Model>> m = (*s1)->AttachModel(other, 1, 2s);
    ASSERT_FALSE(m.ok()) << says;
    EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition) << m.status();
    EXPECT_NE(m.status().ToString().find("does not match job 'groups'"), std::string::npos)
        << m.status();
    EXPECT_NE(m.status().ToString().find(says), std::string::npos) << m.status();
  };
  Session::ModelSpec other = model;
  other.units[0].tensors[1].group = 0;
  refused(other, "unit 'u0' tensor 'u0.b' in param group 0, the job's in 1");
  other = model;
  other.units[1].tensors[0].frozen = false;
  refused(other, "unit 'u1' tensor 'u1.w' not frozen, the job's frozen");
  other = model;
  other.optimizer.group_weight_decay[1] = 0.01f;
  refused(other, "weight decay 0.01 for param group 1, the job's is 0");
  other = model;
  other.optimizer.group_weight_decay.push_back(0.0f);
  refused(other, "3 param group weight decays");
  // Named (they were all "other optimizer settings").
  other = model;
  other.optimizer.clip_norm = 1.0f;
  refused(other, "clipping norm 1, the job's 0");
  other = model;
  other.optimizer.grad_accumulation = 2;
  refused(other, "gradient accumulation 2, the job's 1");
  other = model;
  other.optimizer.hyper.beta2 = 0.95;
  refused(other, "beta2 0.95, the job's 0.999");
  // A shape or a name that differs, said with both (the message named the
  // tensor twice and no shape).
  other = model;
  other.units[0].tensors[1].shape = {12};
  refused(other, "unit 'u0' tensor 'u0.b' of shape [12], the job's [10]");
  other = model;
  other.units[0].tensors[1].name = "u0.c";
  refused(other, "unit 'u0' tensor 1 named 'u0.c', the job's 'u0.b'");

  Result<std::unique_ptr<Model>> m1 = (*s1)->AttachModel(model, 1, 2s);
  ASSERT_TRUE(m1.ok()) << m1.status();
  EXPECT_TRUE((*m0)->SetLearningRates({1e-3f, 2e-3f}).ok());
  EXPECT_TRUE((*m1)->SetLearningRates({3e-3f, 0.0f}).ok());
  Status bad = (*m1)->SetLearningRates({1e-3f});
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.ToString().find("job 'groups': 1 learning rates for its 2 param groups"),
            std::string::npos)
      << bad;  // the daemon's scope taken out of the name
  bad = (*m0)->SetLearningRates({1e-3f, std::nanf("")});
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.ToString().find("param group 1"), std::string::npos) << bad;

  // A connection without the job, by hand: not found; a malformed list is
  // refused and the connection goes on.
  RawClient c = RawClient::Connect(socket());
  Result<RawClient::Reply> r =
      c.Call(p::MessageType::kSetLearningRates,
             p::Encode(p::LearningRates{.job = (*m0)->job(), .lrs = {1e-3f, 1e-3f}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << r->status;
  std::string cut = p::Encode(p::LearningRates{.job = 0, .lrs = {1e-3f, 1e-3f}});
  cut.resize(cut.size() - 1);
  r = c.Call(p::MessageType::kSetLearningRates, cut);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status.code(), StatusCode::kCorruption) << r->status;
  r = c.Call(p::MessageType::kPoolStats, "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->status.ok()) << r->status;
}

// A session as `o` says, the model TwoUnits(name) with its weights, a host
// device and rank 0's runner: what a one-rank training loop holds.
struct Trainer {
  std::unique_ptr<Session> session;
  std::unique_ptr<Model> model;
  std::unique_ptr<Device> device;
  std::unique_ptr<Stage3Runner> runner;
};
Result<Trainer> OpenTrainer(const SessionOptions& o, const std::string& name) {
  Trainer t;
  ZT_ASSIGN_OR_RETURN(t.session, Session::Open(o));
  ZT_ASSIGN_OR_RETURN(t.model, t.session->RegisterModel(ModelOf(TwoUnits(name))));
  std::vector<float> w(1000, 1.0f);
  for (int k : {0, 1}) ZT_RETURN_IF_ERROR(t.model->SetWeights(k, w.data(), w.size()));
  ZT_ASSIGN_OR_RETURN(t.device, MakeHostDevice());
  ZT_ASSIGN_OR_RETURN(t.runner, Stage3Runner::Create(*t.model, 0, *t.device, nullptr, {}));
  return t;
}

// Both units' (zero) grads, backward, then Step().
Status PushBothAndStep(Stage3Runner& runner) {
  for (int k : {1, 0}) {
    ZT_RETURN_IF_ERROR(runner.GradBuffer(k).status());
    ZT_RETURN_IF_ERROR(runner.PushGrads(k));
  }
  return runner.Step();
}

// A step's grads dropped through the daemon (the runner's AbortStep after
// a failed backward): the same grads may go again, and the step is taken.
TEST_F(DaemonTest, AStepIsAbortedThroughTheDaemon) {
  SessionOptions o;
  o.daemon_socket = socket();
  Result<Trainer> t = OpenTrainer(o, "abort");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(t->runner->GradBuffer(1).ok());
  ASSERT_TRUE(t->runner->PushGrads(1).ok());
  Result<int> discarded = t->runner->AbortStep();
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(*discarded, 0);
  ASSERT_TRUE(PushBothAndStep(*t->runner).ok());
  EXPECT_TRUE(t->model->WaitPublished(1, 30s).ok());
}

// A save or an export through ztierd is written by the client from the
// units it reads; ztierd let it read a job that held no one state, and the
// file passed every check on load: a job a load failed midway in (units
// from the file beside units of its own, saved under the file's step), or
// a failed eager job (units a step apart). Each is refused now, as the
// embedded engine refuses it.
TEST_F(DaemonTest, ASaveOrExportThroughZtierdRefusesUnitsThatHoldNoOneState) {
  SessionOptions o;
  o.daemon_socket = socket();
  Result<Trainer> t = OpenTrainer(o, "mixed");
  ASSERT_TRUE(t.ok()) << t.status();
  ScratchDir dir("daemon-mixed");
  const std::string ck = dir / "ck";
  ASSERT_TRUE(PushBothAndStep(*t->runner).ok());
  const Status saved = t->model->SaveCheckpoint(ck);
  ASSERT_TRUE(saved.ok()) << saved;
  ASSERT_TRUE(PushBothAndStep(*t->runner).ok());
  ASSERT_TRUE(t->model->WaitPublished(2, 30s).ok());
  std::atomic<int> opens{0};
  SetFileFaultHook([&](FileOp op, const std::string& path) {
    const bool apply = op == FileOp::kOpen && path.find("/unit-1-") != std::string::npos &&
                       opens.fetch_add(1) == 1;  // the first open checks, the second applies
    return apply ? EIO : 0;
  });
  const Status load = t->model->LoadCheckpoint(ck);
  SetFileFaultHook({});
  ASSERT_FALSE(load.ok());
  EXPECT_NE(load.message().find("partly loaded"), std::string::npos) << load;
  const auto refused = [](const Status& st, std::string_view why) {
    return !st.ok() && st.message().find(why) != std::string_view::npos;
  };
  Status save = t->model->SaveCheckpoint(dir / "mix");
  EXPECT_TRUE(refused(save, "failed midway")) << save;
  Status out =
      t->model->ExportSafetensors(dir / "mix.safetensors", engine::Engine::ExportType::kFloat32);
  EXPECT_TRUE(refused(out, "failed midway")) << out;
  EXPECT_FALSE(std::filesystem::exists(dir / "mix.safetensors"));
  // A load that commits lifts it.
  ASSERT_TRUE(t->model->LoadCheckpoint(ck).ok());
  save = t->model->SaveCheckpoint(dir / "mix");
  EXPECT_TRUE(save.ok()) << save;

  // An eager job whose step failed after one unit had stepped.
  Session::ModelSpec spec = ModelOf(TwoUnits("eager"));
  spec.optimizer.mode = engine::StepMode::kEager;
  Result<std::unique_ptr<Model>> m = t->session->RegisterModel(spec);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<float> w(1000, 1.0f);
  for (int k : {0, 1}) ASSERT_TRUE((*m)->SetWeights(k, w.data(), w.size()).ok());
  Result<std::unique_ptr<Device>> dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok());
  Result<std::unique_ptr<Stage3Runner>> r = Stage3Runner::Create(**m, 0, **dev, nullptr, {});
  ASSERT_TRUE(r.ok()) << r.status();
  for (int k : {1, 0}) {
    Result<bf16*> g = (*r)->GradBuffer(k);
    ASSERT_TRUE(g.ok()) << g.status();
    std::fill_n(*g, 1000, FloatToBf16(k == 0 ? std::nanf("") : 0.5f));
    ASSERT_TRUE((*r)->PushGrads(k).ok());
  }
  (void)(*r)->Step();
  // Unit 1 stepped, unit 0's NaN failed the job.
  const Status waited = (*m)->WaitPublished(1, 30s);
  ASSERT_TRUE(refused(waited, "job failed")) << waited;
  save = (*m)->SaveCheckpoint(dir / "eager");
  EXPECT_TRUE(refused(save, "job failed")) << save;
  out = (*m)->ExportSafetensors(dir / "eager.safetensors", engine::Engine::ExportType::kFloat32);
  EXPECT_TRUE(refused(out, "job failed")) << out;
}

// A run saving to a new directory each time (checkpoint-500,
// checkpoint-1000, ...) held a lock fd on each until its job ended, in the
// client through ztierd and in the embedded engine alike: a long run
// failed with EMFILE (save #122 under ulimit -n 128). A job holds its most
// recently saved to directories now, and those it claimed itself ("until
// the model is closed").
TEST_F(DaemonTest, SavesToEverNewDirectoriesHoldFewLocks) {
  for (const bool through_ztierd : {false, true}) {
    SCOPED_TRACE(through_ztierd ? "through ztierd" : "embedded");
    SessionOptions o;
    if (through_ztierd) o.daemon_socket = socket();
    Result<Trainer> t = OpenTrainer(o, "rotating");
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE(PushBothAndStep(*t->runner).ok());
    ASSERT_TRUE(t->model->WaitPublished(1, 30s).ok());
    ScratchDir dir("daemon-rotating");
    const auto ck = [&](std::string_view kind, int i) { return dir / StrCat(kind, "-", i); };
    const std::string final_dir = dir / "final";
    ASSERT_TRUE(t->model->ClaimCheckpointDir(final_dir).ok());
    const long before = OpenFdCount();
    // A rotation that keeps the last two (the older ones' files removed
    // through the model, which claims them as a save does, then the rest).
    for (int i = 0; i < 40; ++i) {
      const Status saved = t->model->SaveCheckpoint(ck("checkpoint", i));
      ASSERT_TRUE(saved.ok()) << i << ": " << saved;
      if (i < 2) continue;
      ASSERT_TRUE(t->model->RemoveCheckpoint(ck("checkpoint", i - 2)).ok()) << i;
      std::filesystem::remove_all(ck("checkpoint", i - 2));
    }
    const long most = engine::ClaimedCheckpointDirs::kMaxClaimedCheckpointDirs;
    EXPECT_LE(OpenFdCount() - before, most);
    // Every directory kept: the most recent ones stay held.
    for (int i = 0; i < 40; ++i) {
      ASSERT_TRUE(t->model->SaveCheckpoint(ck("kept", i)).ok()) << i;
    }
    EXPECT_LE(OpenFdCount() - before, most);
    const auto lock = [&](const std::string& d) {
      return DirLock::Acquire(d, engine::kCheckpointLockFile, "checkpoint directory",
                              DirLock::Mode::kExclusive)
          .status();
    };
    // A claim of its own takes no save's place.
    ASSERT_TRUE(t->model->ClaimCheckpointDir(dir / "own").ok());
    for (int i = 32; i < 40; ++i) {
      const Status newest = lock(ck("kept", i));
      EXPECT_EQ(newest.code(), StatusCode::kUnavailable) << i << ": " << newest;
    }
    EXPECT_TRUE(lock(ck("kept", 0)).ok());
    // One used again is held again, by a save.
    ASSERT_TRUE(t->model->SaveCheckpoint(ck("kept", 1)).ok());
    EXPECT_EQ(lock(ck("kept", 1)).code(), StatusCode::kUnavailable);
    // The directory it claimed itself is still its own after all that.
    EXPECT_EQ(lock(final_dir).code(), StatusCode::kUnavailable);
    ASSERT_TRUE(t->model->SaveCheckpoint(final_dir).ok());
    // A directory named through a link and "..": every save of it is one
    // claim (the lock's path and the kernel's disagreed: every second save
    // was refused as this process's own).
    std::filesystem::create_directories(dir / "runs/7");
    std::filesystem::create_symlink(dir / "runs/7", dir / "latest");
    for (int i = 0; i < 4; ++i) {
      const Status saved = t->model->SaveCheckpoint(dir / "latest/../ckpt");
      EXPECT_TRUE(saved.ok()) << i << ": " << saved;
    }
    // "ckpt" beside the link is another directory: its save takes its lock
    // (one key for both, it took none).
    ASSERT_TRUE(t->model->SaveCheckpoint(dir / "ckpt").ok());
    EXPECT_EQ(lock(dir / "ckpt").code(), StatusCode::kUnavailable);
    // A directory removed while held (rm -rf of a run's --out), then made
    // again by the next save: that save holds the new directory (its claim
    // stayed on the removed lock file, and a second run saved there too),
    // a claim of its own too.
    for (const std::string& gone : {ck("kept", 39), final_dir}) {
      std::filesystem::remove_all(gone);
      ASSERT_TRUE(t->model->SaveCheckpoint(gone).ok()) << gone;
      EXPECT_EQ(lock(gone).code(), StatusCode::kUnavailable) << gone;
    }
  }
}

// A bad model is refused with the same code and words through ztierd as
// by the embedded engine (the daemon's decoder said "corruption" for a
// negative dimension or a NaN learning rate; it refused a scalar tensor
// the engine takes, and the engine a name the decoder would not).
TEST_F(DaemonTest, ABadModelIsRefusedAsTheEmbeddedEngineRefusesIt) {
  struct Case {
    const char* what;
    std::function<void(Session::ModelSpec&)> spoil;
  };
  const std::vector<Case> cases = {
      {"a negative dimension", [](Session::ModelSpec& m) { m.units[0].tensors[0].shape = {-5}; }},
      {"a zero dimension",
       [](Session::ModelSpec& m) {
         m.units[1].tensors[0].shape = {4, 0};
       }},
      {"no name", [](Session::ModelSpec& m) { m.name.clear(); }},
      {"a name of 2000 bytes", [](Session::ModelSpec& m) { m.name.assign(2000, 'n'); }},
      {"a control character", [](Session::ModelSpec& m) { m.name = "quo\"te\nnew"; }},
      {"accumulation 0", [](Session::ModelSpec& m) { m.optimizer.grad_accumulation = 0; }},
      {"a NaN learning rate", [](Session::ModelSpec& m) { m.optimizer.hyper.lr = std::nanf(""); }},
      {"a tensor without a name", [](Session::ModelSpec& m) { m.units[0].tensors[0].name = ""; }},
      {"nine dimensions", [](Session::ModelSpec& m) { m.units[0].tensors[0].shape.assign(9, 1); }},
  };
  SessionOptions through;
  through.daemon_socket = socket();
  SessionOptions embedded;
  embedded.settings.dram_budget_bytes = uint64_t{64} << 20;
  embedded.settings.pin_memory = false;
  Result<std::unique_ptr<Session>> d = Session::Open(through);
  Result<std::unique_ptr<Session>> e = Session::Open(embedded);
  ASSERT_TRUE(d.ok() && e.ok()) << d.status() << e.status();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Session::ModelSpec m = ModelOf(TwoUnits("bad"));
    c.spoil(m);
    Result<std::unique_ptr<Model>> via_daemon = (*d)->RegisterModel(m);
    Result<std::unique_ptr<Model>> in_process = (*e)->RegisterModel(m);
    ASSERT_FALSE(via_daemon.ok());
    ASSERT_FALSE(in_process.ok());
    EXPECT_EQ(via_daemon.status().code(), StatusCode::kInvalidArgument) << via_daemon.status();
    EXPECT_EQ(via_daemon.status().ToString(), in_process.status().ToString());
  }
  // A scalar (a learned temperature, say) is a tensor like any other.
  Session::ModelSpec scalar = ModelOf(TwoUnits("scalar"));
  scalar.units[1].tensors.push_back({.name = "u1.temperature", .shape = {}});
  Result<std::unique_ptr<Model>> via_daemon = (*d)->RegisterModel(scalar);
  Result<std::unique_ptr<Model>> in_process = (*e)->RegisterModel(scalar);
  ASSERT_TRUE(via_daemon.ok()) << via_daemon.status();
  ASSERT_TRUE(in_process.ok()) << in_process.status();
  EXPECT_EQ((*via_daemon)->layout(1).numel, 1001u);
}

// A forked child (a data loader's worker) holds copies of its parent's
// session, model and runner: using them is refused, and dropping them
// leaves the parent's job alone (the child's close unregistered the
// parent's job through the shared connection, and its destructors
// shut that connection down and joined threads it does not have).
TEST_F(DaemonTest, AForkedChildNeitherUsesNorClosesItsParentsModel) {
  for (bool through_daemon : {true, false}) {
    SCOPED_TRACE(through_daemon ? "ztierd" : "embedded");
    SessionOptions o;
    if (through_daemon) o.daemon_socket = socket();
    o.settings.dram_budget_bytes = uint64_t{64} << 20;
    o.settings.pin_memory = false;
    Result<Trainer> t = OpenTrainer(o, "forked");
    ASSERT_TRUE(t.ok()) << t.status();
    std::vector<float> w(1000, 1.0f);
    ASSERT_TRUE(t->runner->Acquire(0).ok());
    ASSERT_TRUE(t->runner->Release(0).ok());

    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      auto refused = [](const Status& st) {
        return st.code() == StatusCode::kFailedPrecondition &&
               st.ToString().find("forked from process") != std::string::npos;
      };
      bool ok = refused(t->model->SetWeights(0, w.data(), w.size())) &&
                refused(t->runner->Acquire(1).status()) &&
                refused(t->model->WaitPublished(0, 1s)) && t->model->published_step() == -1;
      t->runner.reset();
      t->device.reset();
      t->model.reset();
      t->session.reset();
      ::_exit(ok ? 0 : 1);
    }
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (::waitpid(child, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(child, SIGKILL);
        ::waitpid(child, &status, 0);
        FAIL() << "the child hung dropping its copies";
      }
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    // The parent trains on.
    ASSERT_TRUE(PushBothAndStep(*t->runner).ok());
    EXPECT_TRUE(t->model->WaitPublished(1, 30s).ok());
  }
}

// A ztierd of another release (left running by an upgrade) is named as
// such: it was said to be gone, with the DRAM state of its jobs.
TEST(DaemonClientTest, ADaemonOfAnotherProtocolVersionIsNamedAsSuch) {
  ScratchDir dir("old-ztierd");
  const std::string path = dir.path() + "/z.sock";
  Result<SeqPacketListener> listener = SeqPacketListener::Listen(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::thread old_daemon([&] {
    Result<SeqPacketSocket> c = listener->Accept(10s);
    if (!c.ok()) return;
    Result<SeqPacketSocket::Received> hello = c->Receive(10s, p::kMaxMessageBytes, 4);
    if (!hello.ok()) return;
    Result<p::Header> h = p::DecodeHeader(hello->data, 0);
    if (!h.ok()) return;
    Result<std::string> reply = p::EncodeMessage({.version = p::kVersion - 1,
                                                  .type = p::MessageType::kHello,
                                                  .flags = p::kFlagReply,
                                                  .request_id = h->request_id},
                                                 "");
    if (reply.ok()) (void)c->Send(*reply);
    std::this_thread::sleep_for(500ms);
  });
  SessionOptions o;
  o.daemon_socket = path;
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  old_daemon.join();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status();
  EXPECT_NE(s.status().ToString().find(StrCat("protocol version ", p::kVersion - 1)),
            std::string::npos)
      << s.status();
  EXPECT_EQ(s.status().ToString().find("resume from the last checkpoint"), std::string::npos)
      << s.status();
}

// ------------------------------------------- the ztierd program, as root

// ztierd with `args` to its end (at most 30 s): {exit code, its output}.
// `env`: VAR=value words before it.
std::pair<int, std::string> RunZtierd(const std::string& args, const std::string& env = "") {
  ScratchDir dir("ztierd-cli");
  const std::string out = dir.path() + "/out.txt";
  const int st = std::system(
      StrCat(env, " timeout -s KILL 30 ", ZTIERD_BINARY, " ", args, " >", out, " 2>&1").c_str());
  std::string text;
  if (FILE* f = std::fopen(out.c_str(), "r")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) text.append(buf, n);
    std::fclose(f);
  }
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, text};
}

TEST(ZtierdProgramTest, BadUsageAndASocketInUseAreClearErrors) {
  auto [rc, out] = RunZtierd("--frobnicate 1");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("unknown flag '--frobnicate'"), std::string::npos) << out;
  std::tie(rc, out) = RunZtierd("--max-jobs-per-uid 0 --socket /tmp/x.sock");
  EXPECT_EQ(rc, 2) << out;
  std::tie(rc, out) = RunZtierd("--max-dram-per-uid lots --socket /tmp/x.sock");
  EXPECT_EQ(rc, 2) << out;
  // "none" is no limit, as ztierctl quota set takes it (parsing goes on).
  std::tie(rc, out) = RunZtierd("--max-nvme-per-uid none --frobnicate 1");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("unknown flag '--frobnicate'"), std::string::npos) << out;
  std::tie(rc, out) = RunZtierd("");  // no socket, not socket-activated
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--socket"), std::string::npos) << out;
  // An empty value (a unit's unset ${VARIABLE}): --socket said none was
  // given; --quota-file, --config and --metrics were dropped in silence.
  for (const char* flag : {"--socket", "--quota-file", "--config", "--metrics"}) {
    std::tie(rc, out) = RunZtierd(StrCat("--socket /tmp/x.sock ", flag, " ''"));
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find(StrCat(flag, ": an empty value")), std::string::npos) << out;
  }
  // A ZTIER_LOG that is no level keeps the service's info, said (it fell
  // to warn, hiding the lines a service logs at info).
  std::tie(rc, out) = RunZtierd("--frobnicate 1", "ZTIER_LOG=verbose");
  EXPECT_NE(out.find("ZTIER_LOG='verbose' is not error, warn, info or debug; logging at info"),
            std::string::npos)
      << out;
  std::tie(rc, out) = RunZtierd("--socket /tmp/x.sock --metrics-job-names 1");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("is not yes or no"), std::string::npos) << out;
  // A sign before an octal mode (strtoul took it).
  std::tie(rc, out) = RunZtierd("--socket /tmp/x.sock --socket-mode +660");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--socket-mode: '+660' is not an octal mode"), std::string::npos) << out;
  // Digits past 0777 are octal too: the bound is what is wrong.
  std::tie(rc, out) = RunZtierd("--socket /tmp/x.sock --socket-mode 7777");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("is not an octal mode of at most 0777"), std::string::npos) << out;
  // Fewer requests in flight than a training process keeps on its
  // connection: its jobs failed ("1 of the quota of 1") rather than wait.
  for (const char* n : {"1", "31"}) {
    std::tie(rc, out) = RunZtierd(StrCat("--socket /tmp/x.sock --max-requests-in-flight ", n));
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find(StrCat("--max-requests-in-flight: ", n, " is below 32")), std::string::npos)
        << out;
  }
  ScratchDir metrics("ztierd-metrics");
  std::tie(rc, out) = RunZtierd("--socket " + metrics.path() + "/d.sock --metrics :9464");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("no host before the port"), std::string::npos) << out;
  // A socket path only a change of settings mends: 2, not 1 (a runtime
  // error, which systemd restarts every 2 s for ever).
  std::tie(rc, out) = RunZtierd("--socket /nonexistent-dir/ztierd.sock");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("/nonexistent-dir"), std::string::npos) << out;
  ScratchDir cfg("ztierd-cfg");
  std::tie(rc, out) = RunZtierd("--socket " + cfg.path());  // a directory
  EXPECT_EQ(rc, 2) << out;
  std::tie(rc, out) =
      RunZtierd("--socket " + cfg.path() + "/m.sock --metrics unix:/nonexistent-dir/m.sock");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_FALSE(std::filesystem::exists(cfg.path() + "/m.sock")) << "its socket was left behind";
  {
    std::FILE* f = std::fopen((cfg.path() + "/bad.json").c_str(), "w");
    std::fputs("{\"ztier\": {\"dram_budjet\": \"1G\"}}", f);
    std::fclose(f);
  }
  std::tie(rc, out) = RunZtierd("--socket /tmp/x.sock --config " + cfg.path() + "/bad.json");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("dram_budjet"), std::string::npos) << out;
  // A quota file it could never write (found at the first quota set).
  std::tie(rc, out) =
      RunZtierd("--socket " + cfg.path() + "/q.sock --quota-file /nonexistent-dir/quotas.json");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("/nonexistent-dir does not exist"), std::string::npos) << out;
  std::tie(rc, out) =
      RunZtierd("--socket " + cfg.path() + "/q.sock --quota-file " + cfg.path() + "/bad.json/q");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("/bad.json is not a directory ztierd can write"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(cfg.path() + "/q.sock")) << "its socket was left behind";
  // A directory given as the file: said of the flag (the message named
  // neither the flag nor a quota file).
  std::tie(rc, out) = RunZtierd("--socket " + cfg.path() + "/q.sock --quota-file " + cfg.path());
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("quota file (--quota-file): " + cfg.path() + " is a directory"),
            std::string::npos)
      << out;
  // A swap directory that is not there: a settings error (2), which
  // systemd does not restart in a loop (it was 1, a runtime error).
  std::tie(rc, out) =
      RunZtierd("--socket " + cfg.path() + "/s.sock", "ZTIER_NVME_PATHS=" + cfg.path() + "/none");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find(cfg.path() + "/none"), std::string::npos) << out;
  // A swap directory ztierd's user cannot write (EACCES) is said as such;
  // under systemd it was said to be missing from ReadWritePaths=, which
  // gives EROFS instead.
  if (::geteuid() == 0 && std::system("command -v setpriv >/dev/null 2>&1") == 0) {
    const std::string open_dir = cfg.path() + "/open", theirs = cfg.path() + "/roots";
    std::filesystem::create_directories(open_dir);
    std::filesystem::create_directories(theirs);
    ::chmod(cfg.path().c_str(), 0755);
    ::chmod(open_dir.c_str(), 0777);
    ::chmod(theirs.c_str(), 0755);
    std::tie(rc, out) = RunZtierd("--socket " + open_dir + "/n.sock",
                                  "INVOCATION_ID=test ZTIER_NVME_PATHS=" + theirs +
                                      " setpriv --reuid 65534 --regid 65534 --clear-groups");
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find("must be usable by the user ztierd runs as (uid 65534"), std::string::npos)
        << out;
    EXPECT_EQ(out.find("ReadWritePaths="), std::string::npos) << out;
  }
  // A second ztierd on a live socket: refused, naming it; the first one
  // serves on.
  const std::string quotas = cfg.path() + "/quotas.json";
  ZtierdProcess d(ZTIERD_BINARY, {"--quota-file", quotas});
  // Nor on the first one's quota file: each rewrites it whole at a quota
  // set, undoing the other's changes.
  std::tie(rc, out) = RunZtierd("--socket " + cfg.path() + "/q2.sock --quota-file " + quotas);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("another ztierd keeps this quota file"), std::string::npos) << out;
  // Not also told to choose another directory: another file in it is fine.
  EXPECT_EQ(out.find("choose another directory"), std::string::npos) << out;
  std::tie(rc, out) = RunZtierd("--socket " + d.socket());
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("in use"), std::string::npos) << out;
  SessionOptions o;
  o.daemon_socket = d.socket();
  EXPECT_TRUE(Session::Open(o).ok()) << d.log();
}

// A loop of short jobs wrote three info lines a job (registered, handle
// dropped, freed): 250 a second from one user, past what journald keeps,
// and the lines that mattered went with the rest. They are bounded now,
// the rest counted.
TEST(ZtierdProgramTest, ALoopOfShortJobsDoesNotFloodTheLog) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  RawClient c = RawClient::Connect(d.socket());
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int kJobs = 200;
  for (int i = 0; i < kJobs; ++i) {
    Result<RawClient::Reply> r =
        c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits(StrCat("short-", i))));
    ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status()) << d.log();
    Result<p::JobHandle> h = p::DecodeJobHandle(r->payload);
    ASSERT_TRUE(h.ok()) << h.status();
    r = c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = h->job}));
    ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = d.log();
  const auto count = [&](std::string_view what) {
    size_t n = 0;
    for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
    return n;
  };
  const size_t lines = count("' registered (") + count("' dropped") + count("' freed (");
  EXPECT_GT(lines, 0u) << log;
  EXPECT_LE(lines, 40u + static_cast<size_t>(4 * seconds) + 1) << log;
  EXPECT_LT(lines, 3u * kJobs) << log;
  EXPECT_NE(log.find("more like it not logged"), std::string::npos) << log;
}

TEST(ZtierdProgramTest, TwoUsersEachSeeOnlyTheirOwnJobs) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  ZtierdProcess d(ZTIERD_BINARY, {});
  SessionOptions o;
  o.daemon_socket = d.socket();
  Result<std::unique_ptr<Session>> root = Session::Open(o);
  ASSERT_TRUE(root.ok()) << root.status() << d.log();
  Result<std::unique_ptr<Model>> mine = (*root)->RegisterModel(ModelOf(TwoUnits("gpt")));
  ASSERT_TRUE(mine.ok()) << mine.status();
  const int rc = AsNobody([&] {
    RawClient c = RawClient::Connect(d.socket());
    // Root's job is handle 1 on root's connection: on this one it does not exist.
    Result<RawClient::Reply> r = c.Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = 1}));
    if (!r.ok() || r->status.code() != StatusCode::kNotFound || !r->fds.empty()) return 1;
    // Nor can it attach to root's job: the name is not in its namespace.
    r = c.Call(p::MessageType::kAttachJob,
               p::Encode(p::AttachRequest{.rank = 0, .timeout = 100ms, .spec = TwoUnits("gpt")}));
    if (!r.ok() || r->status.code() != StatusCode::kNotFound) return 4;
    r = c.Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = 1}));
    if (!r.ok() || r->status.code() != StatusCode::kNotFound) return 2;
    // The same name in this uid's own namespace is free.
    r = c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("gpt")));
    if (!r.ok() || !r->status.ok()) return 3;
    return 0;
  });
  EXPECT_EQ(rc, 0) << d.log();
  // Root's job is untouched.
  EXPECT_EQ((*mine)->published_step(), -1);
  EXPECT_GT((*mine)->counters()->dram_bytes, 0u);
}

// Requests in flight hold a thread each, and were bounded per uid only:
// five uids, each within its quota, took every thread the service's task
// limit allowed, and another user's running job failed ("cannot start a
// thread"). Past half of ztierd's total, a uid with its fair share or more
// is refused, and another uid is still served.
TEST(ZtierdProgramTest, OneUidCannotTakeEveryRequestThreadFromTheOthers) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  ZtierdProcess d(ZTIERD_BINARY, {"--max-requests-in-flight-total", "256"});
  const auto attach = [](std::chrono::milliseconds timeout) {
    return p::Encode(p::AttachRequest{.rank = 0, .timeout = timeout, .spec = TwoUnits("never")});
  };
  // Root's waits for a job nobody registers, until refused: its share is
  // half of the total while it is the only uid with requests.
  RawClient hog = RawClient::Connect(d.socket());
  int sent = 0;
  for (; sent < 200; ++sent) ASSERT_TRUE(hog.Send(p::MessageType::kAttachJob, attach(20s)).ok());
  Status refused;
  for (int k = 0; k < sent && refused.ok(); ++k) {
    Result<RawClient::Reply> r = hog.Receive(10s);
    ASSERT_TRUE(r.ok()) << r.status() << d.log();
    refused = r->status;
  }
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  // (256, unless a task limit under 512 lowered it, which ztierd logs.)
  const bool lowered = d.log().find("lowered to") != std::string::npos;
  EXPECT_NE(refused.message().find(lowered ? " (ztierd's --max-requests-in-flight-total"
                                           : "128 of 256 (ztierd's --max-requests-in-flight-total"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find("at least its share of 128 among 1 uids"), std::string::npos)
      << refused;
  // Another uid is served meanwhile: its calls get the job's absence, never
  // a refusal for want of threads.
  const int rc = AsNobody([&] {
    RawClient c = RawClient::Connect(d.socket());
    for (int k = 0; k < 40; ++k) {
      Result<RawClient::Reply> r = c.Call(p::MessageType::kAttachJob, attach(10ms));
      if (!r.ok()) return 1;
      if (r->status.code() != StatusCode::kNotFound) {
        std::fprintf(stderr, "%s\n", r->status.ToString().c_str());
        return 2;
      }
    }
    return 0;
  });
  EXPECT_EQ(rc, 0) << d.log();
}

// The cap on all requests in flight is lowered to half of the task limit
// where that is less (here RLIMIT_NPROC of a user other than root).
TEST(ZtierdProgramTest, TheTotalOfRequestsInFlightFitsTheTaskLimit) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run ztierd as another uid";
  testing::ScratchDir dir("task-limit");
  ::chmod(dir.path().c_str(), 0777);
  const std::string log = dir / "ztierd.log";
  const std::string socket = dir / "z.sock";
  const int rc = AsNobody([&] {
    const rlimit nproc{.rlim_cur = 600, .rlim_max = 600};
    if (::setrlimit(RLIMIT_NPROC, &nproc) != 0) return 1;
    const pid_t child = ::fork();
    if (child == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0 || ::dup2(fd, 2) < 0) _exit(3);
      ::setenv("ZTIER_LOG", "info", 1);
      ::execl(ZTIERD_BINARY, ZTIERD_BINARY, "--socket", socket.c_str(), nullptr);
      _exit(4);
    }
    bool ready = false;
    for (int k = 0; k < 1000 && !ready; ++k) {
      std::this_thread::sleep_for(10ms);
      Result<std::string> text = ReadFileToString(log, 1 << 20);
      ready = text.ok() && text->find("ready") != std::string::npos;
    }
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    return ready ? 0 : 2;
  });
  Result<std::string> text = ReadFileToString(log, 1 << 20);
  ASSERT_EQ(rc, 0) << (text.ok() ? *text : text.status().ToString());
  // (A cgroup's pids.max under 600 is the limit named instead.)
  const bool cgroup = text->find("pids.max (TasksMax)") != std::string::npos;
  EXPECT_NE(text->find(cgroup ? "requests in flight on all connections: 4096 lowered to "
                              : "requests in flight on all connections: 4096 lowered to 300 for "
                                "the task limit of 600 (RLIMIT_NPROC)"),
            std::string::npos)
      << *text;
}

TEST(ZtierdProgramTest, AUidOffTheAllowListIsRefusedAtItsHello) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid";
  ZtierdProcess d(ZTIERD_BINARY, {"--allow-uid", "4242", "--allow-uid", "root"});  // (a name too)
  const int rc = AsNobody([&] {
    SessionOptions o;
    o.daemon_socket = d.socket();
    Result<std::unique_ptr<Session>> s = Session::Open(o);
    if (s.ok()) return 1;
    if (s.status().ToString().find("uid 65534 is not on") == std::string::npos) return 2;
    return 0;
  });
  EXPECT_EQ(rc, 0) << d.log();
}

// Trains `job` through `session` for `steps` steps on a host device with
// grads that depend only on (step, unit, element); returns every unit's
// master.
Result<std::vector<std::vector<float>>> TrainSteps(Session& session, const std::string& job,
                                                   int steps) {
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Model> m, session.RegisterModel(ModelOf(TwoUnits(job))));
  std::vector<float> w(1000);
  for (int u = 0; u < 2; ++u) {
    for (int k = 0; k < 1000; ++k) w[k] = 0.001f * static_cast<float>((k * 7 + u) % 100);
    ZT_RETURN_IF_ERROR(m->SetWeights(u, w.data(), w.size()));
  }
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, MakeHostDevice());
  {
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                        Stage3Runner::Create(*m, 0, *device, nullptr, {}));
    std::vector<bf16> grads(1000);
    for (int step = 0; step < steps; ++step) {
      for (int u = 0; u < 2; ++u) {
        ZT_RETURN_IF_ERROR(runner->Acquire(u).status());
        ZT_RETURN_IF_ERROR(runner->Release(u));
      }
      for (int u = 1; u >= 0; --u) {
        for (int k = 0; k < 1000; ++k) {
          grads[k] = FloatToBf16(0.01f * static_cast<float>((k + 31 * step + 7 * u) % 13 - 6));
        }
        ZT_ASSIGN_OR_RETURN(bf16 * buf, runner->GradBuffer(u));
        std::copy(grads.begin(), grads.end(), buf);
        ZT_RETURN_IF_ERROR(runner->PushGrads(u));
      }
      ZT_RETURN_IF_ERROR(runner->Step());
    }
  }
  ZT_RETURN_IF_ERROR(m->WaitPublished(steps, 60s));
  std::vector<std::vector<float>> out(2);
  for (int u = 0; u < 2; ++u) ZT_RETURN_IF_ERROR(m->ReadMaster(u, &out[u]));
  return out;
}

// A client process for the test below: this test binary started again
// with ZTIER_TEST_VICTIM=SOCKET,NAME, training until it is killed (a fresh
// process, not a fork of the threaded test).
// A client process for the test below (ZTIER_TEST_LINGER=SOCKET,READY):
// registers a job, maps its regions, closes its connection (so the daemon
// frees the job) and lives on with the mappings.
// Kills a helper process on the way out of a test (a failed check leaves
// none sleeping on), and reaps it if it is this process's child; pid 0: let
// go (the test ended it itself).
struct KillOnExit {
  pid_t pid;
  ~KillOnExit() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    (void)testing::WaitChild(pid);  // ECHILD for another's child: nothing to reap
  }
};

// A helper process's environment variable `name`: "SOCKET,REST" (REST a
// ready file or a job name); nullopt when unset (the test run on its own).
struct HelperArgs {
  std::string socket, rest;
};
std::optional<HelperArgs> HelperEnv(const char* name) {
  const char* env = std::getenv(name);
  if (env == nullptr) return std::nullopt;
  const std::string spec = env;
  const size_t comma = spec.find(',');
  return HelperArgs{spec.substr(0, comma),
                    comma == std::string::npos ? std::string() : spec.substr(comma + 1)};
}
// A session through the ztierd at `socket`.
Result<std::unique_ptr<Session>> SessionAt(const std::string& socket) {
  SessionOptions o;
  o.daemon_socket = socket;
  return Session::Open(o);
}

// Starts the helper test `helper` of this binary, its `var` naming `d`'s
// socket and a ready file in `dir`, and waits for that file.
Result<pid_t> StartHelper(const ZtierdProcess& d, const testing::ScratchDir& dir,
                          const std::string& helper, const std::string& var) {
  const std::string ready = dir.path() + "/ready";
  ZT_ASSIGN_OR_RETURN(pid_t pid, testing::SpawnSelf(StrCat("ZtierdProgramTest.", helper),
                                                    {StrCat(var, "=", d.socket(), ",", ready)}));
  if (!testing::WaitForFile(ready)) {
    ::kill(pid, SIGKILL);
    (void)testing::WaitChild(pid);
    return Status::Unavailable(StrCat(helper, " did not get ready:\n", d.log()));
  }
  return pid;
}

TEST(ZtierdProgramTest, LingeringClient) {
  const std::optional<HelperArgs> args = HelperEnv("ZTIER_TEST_LINGER");
  if (!args) GTEST_SKIP() << "a helper process of AProcessThatClosedItsConnection...";
  // ZTIER_TEST_LINGER_OPEN: the connection stays open too (an evicted job).
  const bool stay_connected = std::getenv("ZTIER_TEST_LINGER_OPEN") != nullptr;
  std::vector<engine::Mapping> mappings;
  std::optional<RawClient> kept;
  {
    RawClient c = RawClient::Connect(args->socket);
    Result<RawClient::Reply> r = c.Call(p::MessageType::kRegisterJob, p::Encode(TwoUnits("gone")));
    ASSERT_TRUE(r.ok() && r->status.ok());
    Result<p::JobHandle> h = p::DecodeJobHandle(r->payload);
    ASSERT_TRUE(h.ok());
    r = c.Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = h->job}));
    ASSERT_TRUE(r.ok() && r->status.ok());
    Result<p::RegionList> list = p::DecodeRegionList(r->payload);
    ASSERT_TRUE(list.ok());
    for (size_t k = 0; k < list->regions.size(); ++k) {
      Result<engine::Mapping> m =
          engine::Mapping::Map(r->fds[k].get(), list->regions[k].bytes, false, "region");
      ASSERT_TRUE(m.ok()) << m.status();
      mappings.push_back(*std::move(m));
    }
    if (stay_connected) kept.emplace(std::move(c));
  }  // the connection closes (unless kept); the mappings stay
  std::FILE* ready = std::fopen(args->rest.c_str(), "w");
  ASSERT_NE(ready, nullptr);
  std::fclose(ready);
  std::this_thread::sleep_for(std::chrono::minutes(10));
}

// A listing longer than one reply comes in pages; each page gathered the
// figures of every job after it (3,000 jobs: 7 s, quadratic). Every job
// comes once, in id order, across the pages.
TEST(ZtierdProgramTest, AListingOfManyJobsComesWholeAcrossPages) {
  constexpr int kJobs = 500;
  ZtierdProcess d(ZTIERD_BINARY, {"--max-jobs-per-uid", std::to_string(kJobs)});
  SessionOptions o;
  o.daemon_socket = d.socket();
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  std::vector<std::unique_ptr<Model>> models;
  for (int i = 0; i < kJobs; ++i) {
    Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits(StrCat("job-", i))));
    ASSERT_TRUE(m.ok()) << m.status() << d.log();
    models.push_back(std::move(*m));
  }
  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect(d.socket(), 10s);
  ASSERT_TRUE(c.ok()) << c.status();
  Result<std::vector<engine::JobInfo>> jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), static_cast<size_t>(kJobs));
  size_t bytes = 0;
  std::set<std::string> names;
  for (size_t i = 0; i < jobs->size(); ++i) {
    bytes += p::EncodedBytes((*jobs)[i]);
    names.insert((*jobs)[i].name);
    if (i > 0) {
      EXPECT_LT((*jobs)[i - 1].id, (*jobs)[i].id);
    }
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kJobs));
  EXPECT_GT(bytes, 2 * p::kMaxMessageBytes) << "the listing fits one page: no paging tried";
}

// A job freed while a live process maps its regions keeps that process's
// uid charged for them until it exits, however the job went: freed as its
// client closed the connection, evicted under its open connection, or
// parked when its client closed and freed when the grace period ended (the
// last two uncharged it while the memory lived on).
enum class Freed { kAtClose, kEvicted, kAfterGrace };
void ExpectChargedUntilTheMapperExits(Freed how) {
  const bool evict = how == Freed::kEvicted;
  uint64_t job_bytes = 0;
  {
    ZtierdProcess probe(ZTIERD_BINARY, {});
    SessionOptions o;
    o.daemon_socket = probe.socket();
    Result<std::unique_ptr<Session>> s = Session::Open(o);
    ASSERT_TRUE(s.ok()) << s.status() << probe.log();
    Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("probe")));
    ASSERT_TRUE(m.ok()) << m.status();
    job_bytes = (*m)->counters()->dram_bytes;
  }
  std::vector<std::string> flags = {"--max-dram-per-uid", std::to_string(job_bytes + 4096)};
  if (how == Freed::kAfterGrace) flags.insert(flags.end(), {"--job-grace-seconds", "1"});
  ZtierdProcess d(ZTIERD_BINARY, flags);
  testing::ScratchDir dir("lingering");
  const std::string ready = dir.path() + "/ready";
  std::vector<std::string> env = {StrCat("ZTIER_TEST_LINGER=", d.socket(), ",", ready)};
  if (evict) env.push_back("ZTIER_TEST_LINGER_OPEN=1");
  Result<pid_t> pid = testing::SpawnSelf("ZtierdProgramTest.LingeringClient", env);
  ASSERT_TRUE(pid.ok()) << pid.status();
  KillOnExit helper{*pid};
  ASSERT_TRUE(testing::WaitForFile(ready)) << d.log();
  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect(d.socket(), 10s);
  ASSERT_TRUE(c.ok()) << c.status();
  if (evict) {
    Result<std::vector<engine::JobInfo>> jobs = (*c)->Jobs();
    ASSERT_TRUE(jobs.ok() && jobs->size() == 1) << d.log();
    ASSERT_TRUE((*c)->Evict((*jobs)[0].id, "room for another").ok()) << d.log();
  }
  // Freed (at once, evicted, or reaped once the grace period ended).
  for (int k = 0; k < 500; ++k) {
    Result<std::vector<engine::JobInfo>> jobs = (*c)->Jobs();
    if (jobs.ok() && jobs->empty()) break;
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE((*c)->Jobs()->empty()) << d.log();
  SessionOptions o;
  o.daemon_socket = d.socket();
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("after")));
  ASSERT_FALSE(m.ok()) << "registered beside the regions a live process maps";
  EXPECT_EQ(m.status().code(), StatusCode::kResourceExhausted) << m.status();
  EXPECT_NE(m.status().ToString().find("live on"), std::string::npos) << m.status();
  Result<engine::DaemonStatus> st = (*c)->GetStatus();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_GT(st->dram_used_bytes, 0u) << "the mapped regions left the budget";
  // The freed job counts as the quota counts it (quota get said 0 jobs
  // while a registration was refused for the job quota).
  Result<engine::QuotaInfo> q = (*c)->GetQuota(::geteuid());
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->jobs, 1);
  ::kill(*pid, SIGKILL);
  (void)testing::WaitChild(*pid);
  helper.pid = 0;
  for (int k = 0; k < 300; ++k) {
    m = (*s)->RegisterModel(ModelOf(TwoUnits("after")));
    if (m.ok()) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(m.ok()) << m.status() << d.log();
  m->reset();
  st = (*c)->GetStatus();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->dram_used_bytes, 0u) << "still counted after the process exited";
}

TEST(ZtierdProgramTest, AProcessThatClosedItsConnectionStaysChargedUntilItExits) {
  if (!testing::HavePeerPidfd()) GTEST_SKIP() << "this kernel has no SO_PEERPIDFD";
  ExpectChargedUntilTheMapperExits(Freed::kAtClose);
}

TEST(ZtierdProgramTest, AnEvictedJobsLiveClientStaysChargedForItsMappingUntilItExits) {
  if (!testing::HavePeerPidfd()) GTEST_SKIP() << "this kernel has no SO_PEERPIDFD";
  ExpectChargedUntilTheMapperExits(Freed::kEvicted);
}

TEST(ZtierdProgramTest, AParkedJobFreedLaterKeepsItsLiveMapperCharged) {
  if (!testing::HavePeerPidfd()) GTEST_SKIP() << "this kernel has no SO_PEERPIDFD";
  ExpectChargedUntilTheMapperExits(Freed::kAfterGrace);
}

TEST(ZtierdProgramTest, ForkingClient) {
  const std::optional<HelperArgs> args = HelperEnv("ZTIER_TEST_FORKER");
  if (!args) GTEST_SKIP() << "a helper process of AJobGoesWithItsClient...";
  Result<std::unique_ptr<Session>> s = SessionAt(args->socket);
  ASSERT_TRUE(s.ok()) << s.status();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("forker")));
  ASSERT_TRUE(m.ok()) << m.status();
  const pid_t worker = ::fork();  // a data loader's worker: never touches ztier
  if (worker == 0) {
    ::pause();
    ::_exit(0);
  }
  std::FILE* ready = std::fopen(args->rest.c_str(), "w");
  ASSERT_NE(ready, nullptr);
  std::fprintf(ready, "%d\n", static_cast<int>(worker));
  std::fclose(ready);
  std::this_thread::sleep_for(std::chrono::minutes(10));
}

// A client killed while a child it forked (a data loader's worker) lives:
// the child's copy of the connection kept the job registered, its name
// taken and its memory charged, until the child exited. A forked child lets
// go of its parent's connections, so the job goes with its client.
TEST(ZtierdProgramTest, AJobGoesWithItsClientNotWithTheChildrenItForked) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  testing::ScratchDir dir("forker");
  Result<pid_t> pid = StartHelper(d, dir, "ForkingClient", "ZTIER_TEST_FORKER");
  ASSERT_TRUE(pid.ok()) << pid.status();
  KillOnExit helper{*pid}, worker{0};  // the worker is the helper's child: killed, not reaped
  const std::string ready = dir.path() + "/ready";
  for (int k = 0; k < 500 && worker.pid == 0; ++k) {  // written after the file is made
    std::ifstream(ready) >> worker.pid;
    if (worker.pid == 0) std::this_thread::sleep_for(10ms);
  }
  ASSERT_GT(worker.pid, 0);
  ::kill(*pid, SIGKILL);
  (void)testing::WaitChild(*pid);
  helper.pid = 0;
  Result<std::unique_ptr<Session>> s = SessionAt(d.socket());
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  Result<std::unique_ptr<Model>> m = Status::Internal("not tried");
  for (int k = 0; k < 500; ++k) {  // 5 s: the connection's end is seen at once
    m = (*s)->RegisterModel(ModelOf(TwoUnits("forker")));
    if (m.ok()) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(m.ok()) << m.status() << " while the client's forked child lives\n" << d.log();
}

TEST(ZtierdProgramTest, LargeClient) {
  const std::optional<HelperArgs> args = HelperEnv("ZTIER_TEST_LARGE_CLIENT");
  if (!args) GTEST_SKIP() << "a helper process of ARunKilledAndStartedAgainAtOnce...";
  // Memory of its own, written: a killed process lets go of it before it
  // closes its sockets (about 0.1 s a GiB here).
  std::vector<char> memory(size_t{1} << 30, 1);
  Result<std::unique_ptr<Session>> s = SessionAt(args->socket);
  ASSERT_TRUE(s.ok()) << s.status();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("large")));
  ASSERT_TRUE(m.ok()) << m.status();
  std::ofstream(args->rest) << memory[4096] << "\n";
  std::this_thread::sleep_for(std::chrono::minutes(10));
}

// A run of some GiB killed and started again at once: the registration
// came while the killed process still let go of its memory, its connection
// not yet closed, and was refused as a name that a live connection holds
// ("already registered"; restarts within 0.15 s of a kill -9 of a torch
// process). A holder whose process is dying is waited for, as one whose
// connection hung up.
TEST(ZtierdProgramTest, ARunKilledAndStartedAgainAtOnceIsNotRefusedWhileTheOldOneDies) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  testing::ScratchDir dir("large");
  Result<pid_t> pid = StartHelper(d, dir, "LargeClient", "ZTIER_TEST_LARGE_CLIENT");
  ASSERT_TRUE(pid.ok()) << pid.status();
  KillOnExit helper{*pid};
  Result<std::unique_ptr<Session>> s = SessionAt(d.socket());
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  ::kill(*pid, SIGKILL);
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("large")));
  (void)testing::WaitChild(*pid);
  helper.pid = 0;
  EXPECT_TRUE(m.ok()) << m.status() << "\n" << d.log();
}

TEST(ZtierdProgramTest, MainThreadEndsClient) {
  const std::optional<HelperArgs> args = HelperEnv("ZTIER_TEST_MAIN_ENDS");
  if (!args) GTEST_SKIP() << "a helper process of ALiveClientWhoseMainThread...";
  static Result<std::unique_ptr<Session>> s = SessionAt(args->socket);
  ASSERT_TRUE(s.ok()) << s.status();
  static Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("main-ends")));
  ASSERT_TRUE(m.ok()) << m.status();
  std::thread([] { std::this_thread::sleep_for(std::chrono::minutes(10)); }).detach();
  std::ofstream(args->rest) << "ready\n";
  // This thread alone ends (no unwinding, which the test body would catch):
  // the process lives on in the other.
  ::syscall(SYS_exit, 0);
}

// A process whose main thread ended while another runs on shows that
// thread's exit in /proc/<pid>/stat: taken for a dying one, its job's name
// was waited for (30 s, then refused; an attach, its whole timeout). A
// process is dying when every thread of it is.
TEST(ZtierdProgramTest, ALiveClientWhoseMainThreadEndedHoldsItsName) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  testing::ScratchDir dir("main-ends");
  Result<pid_t> pid = StartHelper(d, dir, "MainThreadEndsClient", "ZTIER_TEST_MAIN_ENDS");
  ASSERT_TRUE(pid.ok()) << pid.status();
  KillOnExit helper{*pid};
  bool zombie = false;  // the main thread
  for (int k = 0; k < 500 && !zombie; ++k) {
    std::ifstream stat(StrCat("/proc/", *pid, "/stat"));
    const std::string text(std::istreambuf_iterator<char>(stat), {});
    zombie = text.find(") Z ") != std::string::npos;
    if (!zombie) std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(zombie) << "the helper's main thread did not end";
  Result<std::unique_ptr<Session>> s = SessionAt(d.socket());
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(TwoUnits("main-ends")));
  EXPECT_EQ(m.status().code(), StatusCode::kAlreadyExists) << m.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "a live holder's name waited for";
}

TEST(ZtierdProgramTest, VictimClient) {
  const std::optional<HelperArgs> args = HelperEnv("ZTIER_TEST_VICTIM");
  if (!args) GTEST_SKIP() << "a helper process of ClientsKilledAtRandom...";
  Result<std::unique_ptr<Session>> s = SessionAt(args->socket);
  ASSERT_TRUE(s.ok()) << s.status();
  (void)TrainSteps(**s, args->rest, 1 << 20);
}

TEST(ZtierdProgramTest, ClientsKilledAtRandomLeaveNoTraceAndABystanderTrainsOn) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  SessionOptions o;
  o.daemon_socket = d.socket();
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  const int steps = 40;
  Result<std::vector<std::vector<float>>> solo = TrainSteps(**s, "solo", steps);
  ASSERT_TRUE(solo.ok()) << solo.status();
  const uint64_t baseline = (*s)->pool_stats().used_bytes;

  // The bystander trains while clients (processes of their own) are killed
  // at random moments.
  Result<std::vector<std::vector<float>>> beside = Status::Internal("not run");
  std::thread bystander([&] { beside = TrainSteps(**s, "beside", steps); });
  std::mt19937 rng(11);
  for (int k = 0; k < 6; ++k) {
    Result<pid_t> pid = testing::SpawnSelf(
        "ZtierdProgramTest.VictimClient", {StrCat("ZTIER_TEST_VICTIM=", d.socket(), ",victim", k)});
    ASSERT_TRUE(pid.ok()) << pid.status();
    // Killed mid-training: once its job is registered, at a random moment.
    const std::string registered = StrCat("job 'victim", k, "' registered");
    for (int t = 0; t < 3000 && d.log().find(registered) == std::string::npos; ++t) {
      std::this_thread::sleep_for(5ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 200));
    ::kill(*pid, SIGKILL);
    (void)testing::WaitChild(*pid);
  }
  bystander.join();
  ASSERT_TRUE(beside.ok()) << beside.status() << d.log();
  EXPECT_EQ(*beside, *solo);
  // Every victim's job is gone: the pool holds what it held before (the
  // bystander's job is unregistered by now too).
  uint64_t used = 0;
  for (int k = 0; k < 500; ++k) {
    used = (*s)->pool_stats().used_bytes;
    if (used == baseline) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(used, baseline) << d.log();
  for (int k = 0; k < 6; ++k) {
    EXPECT_NE(d.log().find(StrCat("job 'victim", k, "' registered")), std::string::npos) << d.log();
  }
}

// A session through `d` and a model of two units named `name` registered
// through it.
struct DaemonClient {
  std::unique_ptr<Session> session;
  std::unique_ptr<Model> model;
};
// A session through `d`.
Result<std::unique_ptr<Session>> SessionThrough(const ZtierdProcess& d) {
  return SessionAt(d.socket());
}

Result<DaemonClient> RegisterThrough(const ZtierdProcess& d, const std::string& name) {
  DaemonClient c;
  ZT_ASSIGN_OR_RETURN(c.session, SessionThrough(d));
  ZT_ASSIGN_OR_RETURN(c.model, c.session->RegisterModel(ModelOf(TwoUnits(name))));
  return c;
}

// An operator's habitual `kill -HUP` (reload) and a stray SIGUSR1/2 killed
// ztierd silently, and every user's job with it.
TEST(ZtierdProgramTest, HangupAndUserSignalsAreSaidAndIgnored) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<DaemonClient> c = RegisterThrough(d, "h");
  ASSERT_TRUE(c.ok()) << c.status() << d.log();
  for (int sig : {SIGHUP, SIGUSR1, SIGUSR2}) ASSERT_EQ(::kill(d.pid(), sig), 0);
  for (int i = 0; i < 200 && d.log().find("SIGUSR2: ignored") == std::string::npos; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_NE(d.log().find("received SIGHUP: ignored (ztierd reads its configuration only at "
                         "start"),
            std::string::npos)
      << d.log();
  EXPECT_NE(d.log().find("received SIGUSR1: ignored"), std::string::npos) << d.log();
  // It serves on, the first client's job still registered.
  Result<DaemonClient> again = RegisterThrough(d, "h");
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists) << again.status() << d.log();
  EXPECT_TRUE(RegisterThrough(d, "h2").ok()) << d.log();
  EXPECT_EQ(d.SignalAndWait(SIGTERM), 0) << d.log();
}

// ztierd logged a client's settings in its config (the learning rate, the
// socket to train through) as set, and then used each job's own: it now
// says they change nothing there.
TEST(ZtierdProgramTest, SettingsOnlyAClientReadsAreSaidToChangeNothing) {
  ScratchDir dir("ztierd-client-settings");
  const std::string config = dir / "ztierd.json";
  std::ofstream(config) << R"({"ztier": {"daemon_socket": "/tmp/other.sock"},
                               "optimizer": {"params": {"lr": 5}}})";
  ZtierdProcess d(ZTIERD_BINARY, {"--config", config});
  ASSERT_TRUE(RegisterThrough(d, "c").ok()) << d.log();
  const std::string log = d.log();
  const size_t at = log.find("settings that only a client reads change nothing here");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string line = log.substr(at, log.find('\n', at) - at);
  EXPECT_NE(line.find("ztier.daemon_socket"), std::string::npos) << line;
  EXPECT_NE(line.find("optimizer.params.lr"), std::string::npos) << line;
}

// Any local user could make ztierd log a line per connection, thousands a
// second (connect, close), past journald's rate limit, which then drops the
// lines that matter. The lines a connection makes are bounded now, and
// those left out are counted in the next.
TEST(ZtierdProgramTest, AFloodOfConnectionsDoesNotFloodTheLog) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  const auto lines = [&](std::string_view what) {
    const std::string log = d.log();
    size_t n = 0;
    for (size_t p = log.find(what); p != std::string::npos; p = log.find(what, p + 1)) ++n;
    return n;
  };
  for (int k = 0; k < 300; ++k) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un su{};
    su.sun_family = AF_UNIX;
    std::memcpy(su.sun_path, d.socket().data(), d.socket().size());
    ASSERT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&su), sizeof(su)), 0);
    if (k % 2 == 1) (void)::send(fd.get(), "garbage", 7, MSG_NOSIGNAL);
  }
  for (int i = 0; i < 500 && lines("connection closed") < 20; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  std::this_thread::sleep_for(500ms);
  EXPECT_LE(lines("connection closed"), 40u) << d.log();
  EXPECT_LE(lines("refused client"), 40u) << d.log();
  // After a while a client's lines are logged again, with the count.
  std::this_thread::sleep_for(1s);
  Result<DaemonClient> c = RegisterThrough(d, "after");
  ASSERT_TRUE(c.ok()) << c.status() << d.log();
  for (int i = 0; i < 200 && d.log().find("more like it not logged") == std::string::npos; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_NE(d.log().find("more like it not logged"), std::string::npos) << d.log();
}

// A session opened on a ztierd that answers nothing (stopped, here) waited
// the whole call timeout of 120 s for its hello; it fails after 15 s,
// saying what to look at.
TEST(ZtierdProgramTest, AHelloNobodyAnswersFailsWithinFifteenSeconds) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  d.Pause();
  SessionOptions o;
  o.daemon_socket = d.socket();
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::unique_ptr<Session>> s = Session::Open(o);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status();
  EXPECT_NE(s.status().message().find("did not answer a request (hello) within 15 s"),
            std::string::npos)
      << s.status();
  EXPECT_NE(s.status().message().find("ztierctl status"), std::string::npos) << s.status();
  EXPECT_LT(took, 30s);
  // Continued, it serves.
  Result<std::unique_ptr<Session>> again = Session::Open(o);
  EXPECT_TRUE(again.ok()) << again.status() << d.log();
}

// A rank waiting in a collective for a peer that is slow (alive) while
// ztierd is killed: no one wrote the region's abort word, and it waited for
// its whole timeout (ten minutes by default). Its transport knows ztierd is
// gone within half a second, and the collective asks it as it waits.
TEST(ZtierdProgramTest, ARankWaitingInACollectiveHearsOfAKilledZtierd) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  SessionOptions o;
  o.daemon_socket = d.socket();
  Result<std::unique_ptr<Session>> a = Session::Open(o);
  Result<std::unique_ptr<Session>> b = Session::Open(o);
  ASSERT_TRUE(a.ok() && b.ok()) << d.log();
  engine::JobSpec spec = TwoUnits("killed-under");
  spec.ranks = 2;
  Result<std::unique_ptr<Model>> m0 = (*a)->RegisterModel(ModelOf(spec));
  ASSERT_TRUE(m0.ok()) << m0.status();
  Result<std::unique_ptr<Model>> m1 = (*b)->AttachModel(ModelOf(spec), 1);
  ASSERT_TRUE(m1.ok()) << m1.status();
  Result<std::unique_ptr<Device>> dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok()) << dev.status();
  Result<std::unique_ptr<Collectives>> coll = MakeJobCollectives(**m0, 0, **dev, 600s);
  ASSERT_TRUE(coll.ok()) << coll.status();
  std::vector<bf16> buffer(2 * 64);
  Status gathered;
  std::thread rank0(
      [&] { gathered = (*coll)->AllGather(buffer.data(), 64, **dev, Stream::kCompute); });
  std::this_thread::sleep_for(200ms);  // rank 1 never comes
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(d.SignalAndWait(SIGKILL), 128 + SIGKILL);
  rank0.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_EQ(gathered.code(), StatusCode::kUnavailable) << gathered;
  EXPECT_NE(gathered.ToString().find("ztierd at " + d.socket()), std::string::npos) << gathered;
}

TEST(ZtierdProgramTest, SigtermStopsCleanlyAndKillNineFailsClientsFast) {
  {
    ZtierdProcess d(ZTIERD_BINARY, {});
    Result<DaemonClient> c = RegisterThrough(d, "t");
    ASSERT_TRUE(c.ok()) << c.status() << d.log();
    std::unique_ptr<Model>& m = c->model;
    EXPECT_EQ(d.SignalAndWait(SIGTERM), 0) << d.log();
    Status after = m->WaitPublished(0, 5s);
    EXPECT_EQ(after.code(), StatusCode::kUnavailable) << after;
    EXPECT_NE(after.ToString().find("SIGTERM"), std::string::npos) << after;
    EXPECT_NE(d.log().find("stopped"), std::string::npos) << d.log();
  }
  {
    ZtierdProcess d(ZTIERD_BINARY, {});
    Result<DaemonClient> c = RegisterThrough(d, "k");
    ASSERT_TRUE(c.ok()) << c.status() << d.log();
    std::unique_ptr<Model>& m = c->model;
    Status waited;
    std::thread waiter([&] { waited = m->WaitPublished(1, 600s); });
    std::this_thread::sleep_for(100ms);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(d.SignalAndWait(SIGKILL), 128 + SIGKILL);
    waiter.join();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
    EXPECT_EQ(waited.code(), StatusCode::kUnavailable) << waited;
    EXPECT_NE(waited.ToString().find("resume from the last checkpoint"), std::string::npos)
        << waited;
  }
  // A runner whose units stay on its device needs no transfer to acquire
  // them or to queue a push: after a kill -9 those calls returned OK (the
  // params stale), and once Step failed the next push was refused as
  // "already pushed". Every call now says the daemon is gone, and a save
  // makes no directory.
  {
    ZtierdProcess d(ZTIERD_BINARY, {});
    Result<DaemonClient> c = RegisterThrough(d, "r");
    ASSERT_TRUE(c.ok()) << c.status() << d.log();
    std::unique_ptr<Model>& m = c->model;
    std::vector<float> w(1000, 1.0f);
    ASSERT_TRUE(m->SetWeights(0, w.data(), w.size()).ok());
    ASSERT_TRUE(m->SetWeights(1, w.data(), w.size()).ok());
    Result<std::unique_ptr<Device>> dev = MakeHostDevice();
    ASSERT_TRUE(dev.ok()) << dev.status();
    Result<std::unique_ptr<Stage3Runner>> r =
        Stage3Runner::Create(*m, 0, **dev, nullptr, {.persistence_threshold = uint64_t{1} << 30});
    ASSERT_TRUE(r.ok()) << r.status();
    const auto micro_step = [&]() -> Status {
      for (int k = 0; k < 2; ++k) {
        ZT_RETURN_IF_ERROR((*r)->Acquire(k).status());
        ZT_RETURN_IF_ERROR((*r)->Release(k));
      }
      for (int k = 1; k >= 0; --k) {
        ZT_RETURN_IF_ERROR((*r)->GradBuffer(k).status());
        ZT_RETURN_IF_ERROR((*r)->PushGrads(k));
      }
      return (*r)->Step();
    };
    ASSERT_TRUE(micro_step().ok());
    EXPECT_EQ(d.SignalAndWait(SIGKILL), 128 + SIGKILL);
    std::this_thread::sleep_for(1s);  // the transport sees the hang-up within 0.5 s
    const auto gone = [](const Status& st) {
      return st.code() == StatusCode::kUnavailable &&
             st.ToString().find("resume from the last checkpoint") != std::string::npos;
    };
    Status acquired = (*r)->Acquire(0).status();
    EXPECT_TRUE(gone(acquired)) << acquired;
    EXPECT_TRUE(gone(micro_step())) << micro_step();
    EXPECT_TRUE(gone((*r)->PushGrads(1))) << (*r)->PushGrads(1);
    ScratchDir dir("killed-daemon");
    const std::string ck = dir / "ck";
    EXPECT_TRUE(gone(m->SaveCheckpoint(ck)));
    EXPECT_FALSE(std::filesystem::exists(ck)) << "a save to a gone daemon made its directory";
  }
}

// A checkpoint saved through ztierd did not record how its m and v were
// kept (the manifest's state_dtype): a resume into the other dtype was not
// told of the conversion, as one of an embedded engine's checkpoint is.
TEST(ZtierdProgramTest, ACheckpointSavedThroughZtierdRecordsItsStateDtype) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::unique_ptr<Session>> s = SessionThrough(d);
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  ScratchDir dir("daemon-state-dtype");
  for (const auto& [dtype, said] : {std::pair<std::optional<engine::StateDtype>, std::string>{
                                        engine::StateDtype::kInt8, "int8"},
                                    {std::nullopt, "fp32"}}) {  // ztierd's own
    Session::ModelSpec spec = ModelOf(TwoUnits(said));
    spec.state_dtype = dtype;
    Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(spec);
    ASSERT_TRUE(m.ok()) << m.status() << d.log();
    const std::string ck = dir / said;
    ASSERT_TRUE((*m)->SaveCheckpoint(ck).ok()) << d.log();
    std::ifstream in(ck + "/manifest.json");
    const std::string manifest((std::istreambuf_iterator<char>(in)),
                               std::istreambuf_iterator<char>());
    EXPECT_NE(manifest.find(StrCat("\"state_dtype\": \"", said, "\"")), std::string::npos)
        << manifest;
  }
}

// ztierd killed while a load applied a checkpoint: the error said the job
// was gone with ztierd and, after it, that its state was partly loaded and
// to load again, which no job left could do. It now says only the first.
TEST(ZtierdProgramTest, ALoadThatZtierdDiesDuringSaysTheJobIsGone) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::unique_ptr<Session>> s = SessionThrough(d);
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  engine::JobSpec spec;
  spec.name = "load";
  constexpr int kUnits = 4;
  constexpr int64_t kElements = int64_t{1} << 20;  // the files take a while to check
  for (int u = 0; u < kUnits; ++u) {
    spec.units.push_back({.name = StrCat("u", u),
                          .tensors = {{.name = StrCat("u", u, ".w"), .shape = {kElements}}}});
  }
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(ModelOf(spec));
  ASSERT_TRUE(m.ok()) << m.status() << d.log();
  std::vector<float> w(kElements, 0.5f);
  for (int u = 0; u < kUnits; ++u) ASSERT_TRUE((*m)->SetWeights(u, w.data(), w.size()).ok());
  ScratchDir dir("load-killed-daemon");
  const std::string ck = dir / "ck";
  ASSERT_TRUE((*m)->SaveCheckpoint(ck).ok()) << d.log();
  Status loaded;
  std::thread loader([&] { loaded = (*m)->LoadCheckpoint(ck); });
  // Stopped after the load described the job (its first call) and while it
  // checks the files, it hangs on its first write of state; then killed.
  std::this_thread::sleep_for(2ms);
  ASSERT_EQ(::kill(d.pid(), SIGSTOP), 0);
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(d.SignalAndWait(SIGKILL), 128 + SIGKILL);
  loader.join();
  if (loaded.ok()) GTEST_SKIP() << "the load finished before ztierd stopped";
  EXPECT_EQ(loaded.code(), StatusCode::kUnavailable) << loaded;
  EXPECT_NE(loaded.ToString().find("resume from the last checkpoint"), std::string::npos) << loaded;
  EXPECT_EQ(loaded.ToString().find("partly loaded"), std::string::npos) << loaded;
}

// A daemon that names a buffer smaller than the unit's (a bug, or not
// ztierd at all): the transport took it, and the runner's copy of a
// shard there ran past the mapping (SIGSEGV, or another mapping overwritten).
TEST(DaemonTransportTest, ABufferSmallerThanTheUnitsIsRefused) {
  ScratchDir dir("fake-daemon");
  const std::string path = dir / "fake.sock";
  Result<engine::SeqPacketListener> l = engine::SeqPacketListener::Listen(path, 0600);
  ASSERT_TRUE(l.ok()) << l.status();
  constexpr uint64_t kRegion = 1 << 20;
  constexpr int64_t kElements = 100000;  // a shard of 200000 bytes
  std::jthread server([&] {              // ends when the client's connection closes
    Result<engine::SeqPacketSocket> c = l->Accept(10s);
    if (!c.ok()) return;
    Result<UniqueFd> inbox = engine::MakeSealedMemfd("inbox", kRegion);
    // Read-only for the client: sealed against its writes too.
    UniqueFd params(::memfd_create("params", MFD_ALLOW_SEALING | MFD_CLOEXEC));
    if (!inbox.ok() || ::ftruncate(params.get(), kRegion) != 0 ||
        ::fcntl(params.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE) !=
            0) {
      return;
    }
    for (;;) {
      Result<engine::SeqPacketSocket::Received> got =
          c->Receive(10s, p::kMaxMessageBytes, p::kMaxFdsPerMessage);
      if (!got.ok()) return;
      Result<p::Header> h = p::DecodeHeader(got->data, static_cast<uint32_t>(got->fds.size()));
      if (!h.ok()) return;
      std::string body;
      std::vector<int> fds;
      Status status;
      switch (h->type) {
        case p::MessageType::kHello:
          body = p::Encode(p::Hello{.name = "fake"});
          break;
        case p::MessageType::kRegisterJob:
          body = p::Encode(p::JobHandle{.job = 1, .units = 1, .ranks = 1});
          break;
        case p::MessageType::kRegions:
          body = p::Encode(p::RegionList{
              .regions = {{.region = 0, .bytes = kRegion, .access = RegionAccess::kReadWrite},
                          {.region = 1, .bytes = kRegion, .access = RegionAccess::kReadOnly}}});
          fds = {inbox->get(), params.get()};
          break;
        case p::MessageType::kStepPage:
          body = p::Encode(SharedBuffer{.region = 1,
                                        .region_bytes = kRegion,
                                        .offset = 0,
                                        .bytes = 16,  // one unit's step, the weights' generation
                                        .access = RegionAccess::kReadOnly});
          break;
        case p::MessageType::kLayout:
          body = p::Encode(engine::UnitLayout{
              .numel = kElements, .padded = 100032, .shard = 100032, .offsets = {0}});
          break;
        case p::MessageType::kGradInbox:  // 2 bytes at the very end of the region
          body = p::Encode(SharedBuffer{.region = 0,
                                        .region_bytes = kRegion,
                                        .offset = kRegion - 2,
                                        .bytes = 2,
                                        .access = RegionAccess::kReadWrite});
          break;
        default:
          status = Status::Unimplemented("fake");
      }
      Result<std::string> msg =
          p::EncodeMessage({.type = h->type,
                            .flags = p::kFlagReply,
                            .request_id = h->request_id,
                            .fds = static_cast<uint32_t>(fds.size())},
                           p::EncodeStatus(status) + (status.ok() ? body : ""));
      if (!msg.ok() || !c->Send(*msg, fds, 5s).ok()) return;
    }
  });
  Result<std::shared_ptr<Transport>> t = MakeDaemonTransport(path);
  ASSERT_TRUE(t.ok()) << t.status();
  engine::JobSpec spec;
  spec.name = "fake";
  spec.units.push_back({.name = "u0", .tensors = {{.name = "u0.w", .shape = {kElements}}}});
  Result<int> job = (*t)->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  Result<bf16*> grads = (*t)->GradInbox(*job, 0, 0);
  EXPECT_EQ(grads.status().code(), StatusCode::kCorruption) << grads.status();
  EXPECT_NE(grads.status().message().find("a buffer of 2 bytes"), std::string::npos)
      << grads.status();
}

}  // namespace
}  // namespace ztier::client
