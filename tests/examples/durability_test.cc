// Durability seen from the kernel's side: ztier-train runs under strace and
// the system calls that write its checkpoint and export are checked in
// order, independently of ztier's own fault hooks. Every file is written to
// a temp name, fsynced, then renamed into place; the shard files' names are
// made durable (a directory fsync) before the manifest is renamed in, and
// the manifest's rename is followed by a directory fsync. Skips, with the
// reason, where strace cannot trace (no strace, or ptrace refused).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "tests/testing/scratch_dir.h"

namespace {

namespace fs = std::filesystem;
using ztier::testing::ScratchDir;

struct Call {
  std::string name;  // openat, fsync, fdatasync, rename, renameat2, close
  std::string a, b;  // paths (open: the path; rename: from, to)
  int fd = -1;       // open's result, or fsync/close's argument
};

// A small cursor over one strace line; std::regex is avoided on purpose
// (GCC 12 warns inside <regex> under the sanitizer build's -Werror).
struct Cursor {
  std::string_view s;
  bool Eat(std::string_view prefix) {
    if (!s.starts_with(prefix)) return false;
    s.remove_prefix(prefix.size());
    return true;
  }
  // A quoted string: "...", without escapes (the paths here have none).
  bool Quoted(std::string* out) {
    if (!Eat("\"")) return false;
    const size_t end = s.find('"');
    if (end == std::string_view::npos) return false;
    *out = std::string(s.substr(0, end));
    s.remove_prefix(end + 1);
    return true;
  }
  bool Number(long* out) {
    size_t n = s.starts_with('-') ? 1 : 0;
    while (n < s.size() && s[n] >= '0' && s[n] <= '9') ++n;
    if (n == 0 || (n == 1 && s[0] == '-')) return false;
    *out = std::stol(std::string(s.substr(0, n)));
    s.remove_prefix(n);
    return true;
  }
  // The call's result: the number after the ")  = " that closes the call
  // (strace pads short calls with spaces before the '=').
  bool Result(long* out) {
    for (size_t at = s.find(')'); at != std::string_view::npos; at = s.find(')', at + 1)) {
      size_t i = at + 1;
      while (i < s.size() && s[i] == ' ') ++i;
      if (i + 1 >= s.size() || s[i] != '=' || s[i + 1] != ' ') continue;
      s.remove_prefix(i + 2);
      return Number(out);
    }
    return false;
  }
};

// Parses one call of interest; false for anything else or a failed call.
bool ParseCall(std::string_view text, Call* c) {
  Cursor cur{text};
  long result = 0;
  if (cur.Eat("openat(AT_FDCWD, ")) {
    c->name = "openat";
    if (!cur.Quoted(&c->a) || !cur.Result(&result) || result < 0) return false;
    c->fd = static_cast<int>(result);
    return true;
  }
  for (const char* name : {"fsync", "fdatasync", "close"}) {
    if (!cur.Eat(std::string(name) + "(")) continue;
    long fd = 0;
    if (!cur.Number(&fd) || !cur.Result(&result) || result != 0) return false;
    c->name = name;
    c->fd = static_cast<int>(fd);
    return true;
  }
  if (cur.Eat("renameat2(") || cur.Eat("renameat(") || cur.Eat("rename(")) {
    c->name = "rename";
    cur.Eat("AT_FDCWD, ");
    if (!cur.Quoted(&c->a) || !cur.Eat(", ")) return false;
    cur.Eat("AT_FDCWD, ");
    if (!cur.Quoted(&c->b) || !cur.Result(&result) || result != 0) return false;
    return true;
  }
  return false;
}

// One thread's calls in order, then all of them by time of completion:
// strace -f writes a call that another thread interrupts as "<unfinished
// ...>" and its end as "<... name resumed>"; the two halves are joined.
std::vector<std::pair<long, Call>> ParseStrace(const std::string& path) {
  std::ifstream in(path);
  std::map<long, std::string> pending;
  std::vector<std::pair<long, Call>> calls;
  std::string raw;
  while (std::getline(in, raw)) {
    Cursor line{raw};
    long pid = 0;
    if (!line.Number(&pid) || line.s.empty() || line.s[0] != ' ') continue;
    while (line.Eat(" ")) {
    }
    std::string text(line.s);
    const size_t unfinished = text.find(" <unfinished ...>");
    if (unfinished != std::string::npos) {
      pending[pid] = text.substr(0, unfinished);
      continue;
    }
    if (text.starts_with("<... ")) {
      const size_t resumed = text.find("resumed>");
      if (resumed == std::string::npos || !pending.count(pid)) continue;
      text = pending[pid] + text.substr(resumed + 8);
      pending.erase(pid);
    }
    Call c;
    if (ParseCall(text, &c)) calls.emplace_back(pid, std::move(c));
  }
  return calls;
}

// What happened to the files of `dir`, in order: "fsync <path>" (a file or
// the directory itself) and "rename <to>".
std::vector<std::string> Events(const std::vector<std::pair<long, Call>>& calls,
                                const std::string& dir) {
  std::map<std::pair<long, int>, std::string> open;  // (pid, fd) -> path
  std::vector<std::string> out;
  for (const auto& [pid, c] : calls) {
    if (c.name == "openat" && c.fd >= 0) {
      open[{pid, c.fd}] = c.a;
    } else if (c.name == "close") {
      open.erase({pid, c.fd});
    } else if (c.name == "fsync" || c.name == "fdatasync") {
      auto it = open.find({pid, c.fd});
      if (it == open.end()) continue;
      const std::string& p = it->second;
      if (p == dir || fs::path(p).parent_path() == dir) out.push_back("fsync " + p);
    } else if (c.name == "rename" && fs::path(c.b).parent_path() == dir) {
      out.push_back("rename " + c.a + " " + c.b);
    }
  }
  return out;
}

// Checks the durable-write protocol for the files of `dir` that were
// renamed into place: fsync of the temp file before its rename, and a
// directory fsync after the last rename. Returns what is wrong, or "".
std::string CheckAtomicWrites(const std::vector<std::string>& ev, const std::string& dir,
                              const std::string& commit_name) {
  std::string problems;
  size_t last_rename = std::string::npos, commit = std::string::npos;
  for (size_t i = 0; i < ev.size(); ++i) {
    if (!ev[i].starts_with("rename ")) continue;
    std::istringstream words(ev[i].substr(7));
    std::string from, to;
    words >> from >> to;
    bool synced = false;
    for (size_t j = 0; j < i; ++j) synced = synced || ev[j] == "fsync " + from;
    if (!synced) problems += "no fsync of " + from + " before its rename; ";
    last_rename = i;
    if (fs::path(to).filename() == commit_name) commit = i;
  }
  if (last_rename == std::string::npos) return "nothing was renamed into " + dir;
  bool dir_synced_after = false;
  for (size_t j = last_rename + 1; j < ev.size(); ++j) {
    dir_synced_after = dir_synced_after || ev[j] == "fsync " + dir;
  }
  if (!dir_synced_after) problems += "no fsync of " + dir + " after its last rename; ";
  if (commit != std::string::npos) {
    // The files the commit names were made durable (a directory fsync after
    // the last rename before it) before it was renamed in.
    size_t prev_rename = std::string::npos;
    for (size_t j = 0; j < commit; ++j) {
      if (ev[j].starts_with("rename ")) prev_rename = j;
    }
    bool names_durable = prev_rename == std::string::npos;
    for (size_t j = prev_rename == std::string::npos ? 0 : prev_rename + 1; j < commit; ++j) {
      names_durable = names_durable || ev[j] == "fsync " + dir;
    }
    if (!names_durable) problems += "the files were not durable before " + commit_name + "; ";
  }
  return problems;
}

// Whether strace can trace a program here.
bool StraceCanTrace() {
  return std::system("timeout -k 5 30 strace -f -qq -o /dev/null true >/dev/null 2>&1") == 0;
}

// The text the runs train on, as dir/text.txt.
void WriteText(const ScratchDir& dir) {
  std::ofstream text(dir / "text.txt");
  for (int i = 0; i < 200; ++i) text << "How vexingly quick daft zebras jump, " << i << ". ";
}

TEST(DurabilityTest, CheckpointAndExportReachTheDiskInOrder) {
  if (!StraceCanTrace()) {
    GTEST_SKIP() << "strace cannot trace here (not installed, or ptrace is refused)";
  }
  ScratchDir dir("durability");
  WriteText(dir);
  const std::string out = dir / "run";
  const std::string trace = dir / "strace.txt";
  // LeakSanitizer cannot run under ptrace (a sanitizer build): leaks are
  // checked by every other test.
  const std::string cmd =
      "ASAN_OPTIONS=\"$ASAN_OPTIONS:detect_leaks=0\" timeout -k 10 300 strace -f -qq -e "
      "trace=openat,fsync,fdatasync,close,rename,renameat,"
      "renameat2 -o " +
      trace + " " + ZTIER_TRAIN_BINARY +
      " --no-progress --layers 2 --channels 32 --heads 2 --context 16 --batch 4 --steps 3 "
      "--checkpoint-every 2 --data " +
      (dir / "text.txt") + " --out " + out + " >" + (dir / "out.txt") + " 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    std::ifstream log(dir / "out.txt");
    std::stringstream text;
    text << log.rdbuf();
    FAIL() << cmd << "\nfailed; its output:\n" << text.str();
  }
  const auto calls = ParseStrace(trace);
  ASSERT_GT(calls.size(), 10u) << "strace recorded nothing";
  const std::string ckpt = out + "/checkpoint";
  const std::vector<std::string> ev = Events(calls, ckpt);
  std::string all;
  for (const std::string& e : ev) all += e + "\n";
  EXPECT_EQ(CheckAtomicWrites(ev, ckpt, "manifest.json"), "") << all;
  // Two checkpoints (steps 2 and 3): two manifests committed.
  int manifests = 0;
  for (const std::string& e : ev) {
    manifests += e.starts_with("rename ") && e.ends_with("/manifest.json") ? 1 : 0;
  }
  EXPECT_EQ(manifests, 2) << all;
  const std::vector<std::string> export_ev = Events(calls, out);
  std::string export_all;
  for (const std::string& e : export_ev) export_all += e + "\n";
  EXPECT_EQ(CheckAtomicWrites(export_ev, out, "model.safetensors"), "") << export_all;
}

// A save that failed once it had committed (the directory fsync after its
// manifest's rename, EIO injected by strace): the run said the checkpoint
// before it was the last one saved, and the resume, which went on from the
// committed one, warned that its note was of the step before. The failure
// says the step on disk, which has its note.
TEST(DurabilityTest, ASaveThatFailsAfterItCommittedSaysTheStepItCommitted) {
  if (!StraceCanTrace()) {
    GTEST_SKIP() << "strace cannot trace here (not installed, or ptrace is refused)";
  }
  ScratchDir dir("durability-late");
  WriteText(dir);
  const std::string out = dir / "run";
  const std::string args =
      " --no-progress --layers 2 --channels 32 --heads 2 --context 16 "
      "--batch 4 --steps 12 --checkpoint-every 4 --data " +
      (dir / "text.txt") + " --out " + out;
  // The checkpoint directory's fsyncs by the saving thread, three a save
  // (its shard files' names, the manifest's rename, the old files' removal):
  // the fifth is the second save's after its manifest's rename.
  const std::string cmd =
      "ASAN_OPTIONS=\"$ASAN_OPTIONS:detect_leaks=0\" timeout -k 10 300 strace "
      "-f -qq -o /dev/null -P " +
      out + "/checkpoint -e trace=fsync -e inject=fsync:error=EIO:when=5 " + ZTIER_TRAIN_BINARY +
      args + " >" + (dir / "out.txt") + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir / "out.txt");
  std::stringstream text;
  text << log.rdbuf();
  ASSERT_NE(rc, 0) << "no save failed: " << text.str();
  std::ifstream manifest(out + "/checkpoint/manifest.json");
  std::stringstream m;
  m << manifest.rdbuf();
  ASSERT_NE(m.str().find("\"step\": 8,"), std::string::npos)
      << "the injected EIO did not fail the fsync after the second manifest's rename (did the "
         "order of the checkpoint directory's fsyncs change?); the manifest:\n"
      << m.str() << "\nthe run:\n"
      << text.str();
  EXPECT_NE(text.str().find("the last checkpoint saved, of step 8,"), std::string::npos)
      << text.str();
  const std::string resume =
      ZTIER_TRAIN_BINARY + args + " --resume >" + (dir / "resume.txt") + " 2>&1";
  EXPECT_EQ(std::system(resume.c_str()), 0);
  std::ifstream rlog(dir / "resume.txt");
  std::stringstream rtext;
  rtext << rlog.rdbuf();
  EXPECT_NE(rtext.str().find("resumed at step 8"), std::string::npos) << rtext.str();
  EXPECT_EQ(rtext.str().find("warning"), std::string::npos) << rtext.str();
}

}  // namespace
