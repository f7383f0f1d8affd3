// Tests for durable writes and bounded reads (common/file_util.h), with
// faults injected through the file fault hook.
#include "common/file_util.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/testing/scratch_dir.h"

namespace ztier {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

// Removes any hook a test installed.
class FileUtilTest : public ::testing::Test {
 protected:
  void TearDown() override { SetFileFaultHook({}); }
};

TEST_F(FileUtilTest, AtomicWriteReplacesAndReadsBack) {
  ScratchDir dir("file-util");
  const std::string path = dir / "f";
  ASSERT_TRUE(WriteFileAtomically(path, "old").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "new content").ok());
  EXPECT_EQ(*ReadFileToString(path), "new content");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// The temp file was "<path>.tmp", unlinked first: a file of the caller's
// by that name was lost, an empty path removed "./.tmp", and of two writers
// of one path the one told OK could find the other's content in place.
TEST_F(FileUtilTest, TwoWritersOfOnePathEachWriteTheirOwnAndNoOtherFileGoes) {
  ScratchDir dir("file-util");
  const std::string path = dir / "w.st";
  std::ofstream(path + ".tmp") << "my notes";
  EXPECT_EQ(WriteFileAtomically("", "x").code(), StatusCode::kInvalidArgument);
  for (int round = 0; round < 20; ++round) {
    const std::string a(1 << 20, 'a'), b(1 << 18, 'b');
    Status sa, sb;
    std::thread ta([&] { sa = WriteFileAtomically(path, a); });
    std::thread tb([&] { sb = WriteFileAtomically(path, b); });
    ta.join();
    tb.join();
    ASSERT_TRUE(sa.ok() && sb.ok()) << sa << " " << sb;
    const std::string now = *ReadFileToString(path, 2 << 20);
    EXPECT_TRUE(now == a || now == b) << "a mix of " << now.size() << " bytes";
  }
  EXPECT_EQ(*ReadFileToString(path + ".tmp"), "my notes");
  // A killed writer's temp file goes with the next write; a live one's stays.
  std::ofstream(path + ".999999999-0.tmp") << "stale";
  const std::string live = StrCat(path, ".", ::getppid(), "-7.tmp");
  std::ofstream(live) << "live";
  ASSERT_TRUE(WriteFileAtomically(path, "z").ok());
  EXPECT_FALSE(fs::exists(path + ".999999999-0.tmp"));
  EXPECT_TRUE(fs::exists(live));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 3u);  // w.st, w.st.tmp, the live one's
}

TEST_F(FileUtilTest, ALinkPlantedAsTheTempFileIsNeverWrittenThrough) {
  ScratchDir dir("file-util");
  const std::string path = dir / "f";
  const std::string victim = dir / "victim";
  std::ofstream(victim) << "someone else's";
  fs::create_symlink(victim, path + ".tmp");
  ASSERT_TRUE(WriteFileAtomically(path, "mine").ok());
  EXPECT_EQ(*ReadFileToString(path), "mine");
  EXPECT_EQ(*ReadFileToString(victim), "someone else's");
  EXPECT_FALSE(fs::is_symlink(path)) << "the link was renamed into place";
}

// Only a regular file is replaced: a FIFO, a socket-like special file, a
// directory or a link to one is refused and left as it was (a rename over
// /dev/full made it a file); a link to a regular file is written through
// and stays a link.
TEST_F(FileUtilTest, OnlyARegularFileIsReplacedAndALinkIsFollowed) {
  ScratchDir dir("file-util");
  const std::string fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Status s = WriteFileAtomically(fifo, "x");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("a pipe"), std::string::npos) << s;
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_FALSE(fs::exists(fifo + ".tmp"));

  fs::create_directories(dir / "d");
  s = WriteFileAtomically(dir / "d", "x");
  EXPECT_NE(s.message().find("a directory"), std::string::npos) << s;
  EXPECT_TRUE(fs::is_directory(dir / "d"));

  const std::string link = dir / "to-fifo";
  fs::create_symlink(fifo, link);
  s = WriteFileAtomically(link, "x");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(fs::is_symlink(link));

  const std::string dangling = dir / "dangling";
  fs::create_symlink(dir / "none/f", dangling);
  EXPECT_FALSE(WriteFileAtomically(dangling, "x").ok());
  EXPECT_TRUE(fs::is_symlink(dangling));

  const std::string target = dir / "target";
  std::ofstream(target) << "old";
  const std::string to_target = dir / "to-target";
  fs::create_symlink(target, to_target);
  ASSERT_TRUE(WriteFileAtomically(to_target, "new").ok());
  EXPECT_TRUE(fs::is_symlink(to_target));
  EXPECT_EQ(*ReadFileToString(target), "new");
  EXPECT_EQ(*ReplaceableTarget(to_target), fs::canonical(target).string());
  EXPECT_EQ(*ReplaceableTarget(dir / "absent"), dir / "absent");
}

TEST_F(FileUtilTest, EveryFailingCallLeavesTheOldContentAndNoTempFile) {
  ScratchDir dir("file-util");
  const std::string path = dir / "f";
  for (FileOp op : {FileOp::kOpen, FileOp::kWrite, FileOp::kFsync, FileOp::kRename}) {
    ASSERT_TRUE(WriteFileAtomically(path, "committed").ok());
    SetFileFaultHook([op](FileOp o, const std::string&) { return o == op ? ENOSPC : 0; });
    Status s = WriteFileAtomically(path, "lost");
    SetFileFaultHook({});
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << FileOpName(op) << ": " << s;
    const std::string verb = op == FileOp::kOpen ? "create" : std::string(FileOpName(op));
    EXPECT_NE(s.message().find(verb), std::string::npos) << s;
    EXPECT_EQ(*ReadFileToString(path), "committed") << FileOpName(op);
    EXPECT_FALSE(fs::exists(path + ".tmp")) << FileOpName(op);
  }
}

TEST_F(FileUtilTest, AFailedDirectoryFsyncIsReported) {
  ScratchDir dir("file-util");
  SetFileFaultHook([](FileOp o, const std::string&) { return o == FileOp::kFsyncDir ? EIO : 0; });
  Status s = WriteFileAtomically(dir / "f", "x");
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_EQ(s.sys_errno(), EIO);
}

TEST_F(FileUtilTest, ReadsOnlyRegularFiles) {
  ScratchDir dir("file-util");
  Result<std::string> d = ReadFileToString(dir.path());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("is a directory"), std::string::npos) << d.status();
  Result<std::string> z = ReadFileToString("/dev/zero");
  ASSERT_FALSE(z.ok());
  EXPECT_NE(z.status().message().find("not a regular file"), std::string::npos) << z.status();
  EXPECT_EQ(ReadFileToString(dir / "missing").status().code(), StatusCode::kNotFound);
  // A FIFO with no writer: refused at once, not a read that waits for one.
  const std::string fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Result<std::string> p = ReadFileToString(fifo);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("not a regular file"), std::string::npos) << p.status();
}

TEST_F(FileUtilTest, ReadIsBounded) {
  ScratchDir dir("file-util");
  const std::string path = dir / "big";
  std::ofstream(path) << std::string(10000, 'x');
  EXPECT_EQ(ReadFileToString(path, 10000)->size(), 10000u);
  Result<std::string> r = ReadFileToString(path, 9999);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("10000 bytes"), std::string::npos) << r.status();
}

TEST_F(FileUtilTest, RemoveIgnoresMissingAndReportsFaults) {
  ScratchDir dir("file-util");
  EXPECT_TRUE(RemoveFile(dir / "none").ok());
  std::ofstream(dir / "f") << "x";
  SetFileFaultHook([](FileOp o, const std::string&) { return o == FileOp::kRemove ? EIO : 0; });
  EXPECT_FALSE(RemoveFile(dir / "f").ok());
  SetFileFaultHook({});
  EXPECT_TRUE(RemoveFile(dir / "f").ok());
  EXPECT_FALSE(fs::exists(dir / "f"));
}

}  // namespace
}  // namespace ztier
