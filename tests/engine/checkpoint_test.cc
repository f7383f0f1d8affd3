// Checkpoints under faults and hostile input:
//  - a save that fails at any of its system calls (a full disk, a failed
//    fsync or rename, injected through the file fault hook) reports it,
//    removes what it wrote, and leaves a checkpoint that loads: the last
//    committed one, or the new one when only the last directory fsync failed;
//  - forged manifests whose checksum is valid (sizes near 2^63, a negative
//    step, zero ranks, file names that leave the directory) are refused, and
//    a directory where a file should be is an error, never a crash;
//  - a checkpoint directory has one saving user at a time, across processes
//    and across jobs of one engine, and a dead holder never blocks;
//  - loads take no lock and see one committed checkpoint while another run
//    keeps saving into the directory;
//  - jobs are sized up front against the limits and the DRAM budget;
//  - a query of the job's step while a load commits sees one step or the
//    other (the commit sets it under the engine lock: a TSan build checks).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/file_util.h"
#include "engine/engine.h"
#include "engine/state_files.h"
#include "tests/engine/engine_testing.h"
#include "tests/testing/scratch_dir.h"

namespace ztier::engine {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using namespace testing;

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::set<std::string> Files(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

class CheckpointFaultTest : public ::testing::Test {
 protected:
  void TearDown() override { SetFileFaultHook({}); }

  // A job trained `steps` steps and saved into dir_, plus its snapshot.
  void TrainAndSave(int steps) {
    Train(*engine_, job_, 1, step_, steps, 17 + step_);
    step_ += steps;
    ASSERT_TRUE(engine_->SaveCheckpoint(job_, dir_.path()).ok());
    saved_[step_] = Snapshot(*engine_, job_);
  }

  // Loads `dir` (default dir_) into a fresh engine: the step it holds, with
  // its state checked against the snapshot taken at that step.
  int64_t LoadFresh(const std::string& dir = "") {
    auto e = MakeEngine();
    Result<int> j = e->RegisterJob(SmallModel("reader", 2, 1.0f, 1, StepMode::kExact));
    EXPECT_TRUE(j.ok());
    Status s = e->LoadCheckpoint(*j, dir.empty() ? dir_.path() : dir);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return -1;
    const int64_t step = e->PublishedStep(*j, 0);
    auto it = saved_.find(step);
    EXPECT_NE(it, saved_.end()) << "loaded step " << step << " was never committed";
    if (it != saved_.end()) {
      EXPECT_TRUE(Same(Snapshot(*e, *j), it->second)) << "step " << step;
    }
    return step;
  }

  ScratchDir dir_{"ckpt-fault"};
  std::unique_ptr<Engine> engine_ = MakeEngine();
  int job_ = *engine_->RegisterJob(SmallModel("saver", 1, 1.0f, 1, StepMode::kExact));
  int step_ = 0;
  std::map<int64_t, State> saved_;
};

TEST_F(CheckpointFaultTest, AFullDiskDuringASaveRemovesWhatItWroteAndKeepsTheLastCheckpoint) {
  TrainAndSave(2);
  const std::set<std::string> committed = Files(dir_.path());
  Train(*engine_, job_, 1, step_, 1, 99);
  // The third shard file finds the disk full.
  SetFileFaultHook([](FileOp op, const std::string& path) {
    return op == FileOp::kWrite && path.find("/unit-2-") != std::string::npos ? ENOSPC : 0;
  });
  Status s = engine_->SaveCheckpoint(job_, dir_.path());
  SetFileFaultHook({});
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("unit-2-"), std::string::npos) << s;
  EXPECT_EQ(Files(dir_.path()), committed) << "a failed save left files behind";
  EXPECT_EQ(LoadFresh(), 2);
  // With room again the next save works.
  ASSERT_TRUE(engine_->SaveCheckpoint(job_, dir_.path()).ok());
  saved_[3] = Snapshot(*engine_, job_);
  EXPECT_EQ(LoadFresh(), 3);
}

// A save removes the files of older checkpoints (shard files, with or
// without a tag, and their temp files), and nothing else: a user's files
// named unit-* went too.
TEST_F(CheckpointFaultTest, ASaveRemovesOlderShardFilesAndNoOtherFile) {
  TrainAndSave(1);
  const std::set<std::string> first = Files(dir_.path());
  const std::vector<std::string> users = {"unit-test-results.txt", "unit-conversions.json",
                                          "unit-0-rank-0-step-1.bin.bak", "notes.txt"};
  const std::vector<std::string> stale = {"unit-0-rank-0-step-0.bin",
                                          "unit-1-rank-0-step-0-0badcafe.bin",
                                          "unit-1-rank-0-step-0-0badcafe.bin.123-4.tmp"};
  for (const std::string& name : users)
    ASSERT_TRUE(WriteFileAtomically((fs::path(dir_.path()) / name).string(), name).ok());
  for (const std::string& name : stale)
    ASSERT_TRUE(WriteFileAtomically((fs::path(dir_.path()) / name).string(), name).ok());
  TrainAndSave(1);
  const std::set<std::string> now = Files(dir_.path());
  for (const std::string& name : users) {
    EXPECT_EQ(now.count(name), 1u) << name << " was removed";
    EXPECT_EQ(Slurp(fs::path(dir_.path()) / name), name);
  }
  for (const std::string& name : stale) EXPECT_EQ(now.count(name), 0u) << name << " stayed";
  for (const std::string& name : first) {  // the first save's shards
    if (name.starts_with("unit-")) {
      EXPECT_EQ(now.count(name), 0u) << name << " stayed";
    }
  }
  EXPECT_EQ(LoadFresh(), 2);
}

// A first save killed before its manifest leaves shard files (and temp
// files) that no manifest names. The next save removes them before it
// writes: on a disk with room for one checkpoint it failed on them
// (ENOSPC) and kept them, as did every save after. A user's files stay.
TEST_F(CheckpointFaultTest, ASaveKilledBeforeItsFirstManifestLeavesNoFilesInTheNextOnesWay) {
  const std::vector<std::string> killed = {"unit-0-rank-0-step-3-77490b9f.bin",
                                           "unit-1-rank-0-step-3-77490b9f.bin",
                                           "unit-2-rank-0-step-3-77490b9f.bin.123-4.tmp"};
  const std::vector<std::string> users = {"unit-test-results.txt", "notes.txt"};
  for (const std::string& name : killed) {
    ASSERT_TRUE(WriteFileAtomically((fs::path(dir_.path()) / name).string(), name).ok());
  }
  for (const std::string& name : users) {
    ASSERT_TRUE(WriteFileAtomically((fs::path(dir_.path()) / name).string(), name).ok());
  }
  ASSERT_FALSE(fs::exists(fs::path(dir_.path()) / "manifest.json"));
  // Room for one checkpoint: a shard write finds the disk full while the
  // killed save's files are there.
  const std::string first = (fs::path(dir_.path()) / killed[0]).string();
  SetFileFaultHook([&](FileOp op, const std::string& path) {
    return op == FileOp::kWrite && path.find("/unit-") != std::string::npos && fs::exists(first)
               ? ENOSPC
               : 0;
  });
  Status s = engine_->SaveCheckpoint(job_, dir_.path());
  SetFileFaultHook({});
  ASSERT_TRUE(s.ok()) << s;
  saved_[0] = Snapshot(*engine_, job_);
  const std::set<std::string> now = Files(dir_.path());
  for (const std::string& name : killed) EXPECT_EQ(now.count(name), 0u) << name << " stayed";
  for (const std::string& name : users) EXPECT_EQ(now.count(name), 1u) << name << " was removed";
  EXPECT_EQ(LoadFresh(), 0);

  // Tidying (a resume's) removes them too where there is no manifest, and
  // nothing where the manifest is a link it cannot follow (to a filesystem
  // not mounted, say): that one may name them.
  ScratchDir other("ckpt-tidy");
  for (const std::string& name : killed) {
    ASSERT_TRUE(WriteFileAtomically((fs::path(other.path()) / name).string(), name).ok());
  }
  fs::create_symlink(fs::path(other.path()) / "nowhere" / "manifest.json",
                     fs::path(other.path()) / "manifest.json");
  ASSERT_TRUE(RemoveUnnamedCheckpointFiles(other.path()).ok());
  for (const std::string& name : killed) {
    EXPECT_TRUE(fs::exists(other / name)) << name << " went beside a manifest link";
  }
  fs::remove(other / "manifest.json");
  ASSERT_TRUE(RemoveUnnamedCheckpointFiles(other.path()).ok());
  for (const std::string& name : killed) EXPECT_FALSE(fs::exists(other / name)) << name;
}

// A load whose apply pass failed midway (a shard file unreadable the
// second time) returned its error, but the job trained on a mix of the
// file's units and its own, and could save that mix. It now refuses grads,
// waits, saves and exports until a load commits; then it trains as usual.
TEST_F(CheckpointFaultTest, ALoadThatFailsMidwayFencesTheJobUntilALoadCommits) {
  TrainAndSave(2);
  Train(*engine_, job_, 1, step_, 1, 31);  // the job holds step 3, the file step 2
  std::atomic<int> opens{0};
  SetFileFaultHook([&](FileOp op, const std::string& path) {
    const bool apply = op == FileOp::kOpen && path.find("/unit-2-") != std::string::npos &&
                       opens.fetch_add(1) == 1;  // the first open checks, the second applies
    return apply ? EIO : 0;
  });
  Status s = engine_->LoadCheckpoint(job_, dir_.path());
  SetFileFaultHook({});
  ASSERT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_NE(s.message().find("partly loaded"), std::string::npos) << s;
  const auto fenced = [&](const Status& st) {
    return st.code() == StatusCode::kFailedPrecondition &&
           st.message().find("failed midway") != std::string::npos;
  };
  const UnitLayout l = *engine_->Layout(job_, 3);
  std::fill_n(*engine_->GradInbox(job_, 3, 0), l.shard, FloatToBf16(0.1f));
  EXPECT_TRUE(fenced(engine_->GradsReady(job_, 3, 0))) << engine_->GradsReady(job_, 3, 0);
  EXPECT_TRUE(fenced(engine_->WaitPublished(job_, 0, 3, 1s)));
  EXPECT_TRUE(fenced(engine_->SaveCheckpoint(job_, dir_.path())));
  ScratchDir out("partly");
  EXPECT_TRUE(
      fenced(engine_->ExportSafetensors(job_, out / "m.safetensors", ExportType::kFloat32)));
  // A load that commits lifts it: the file's state, trained on as usual.
  ASSERT_TRUE(engine_->LoadCheckpoint(job_, dir_.path()).ok());
  EXPECT_TRUE(Same(Snapshot(*engine_, job_), saved_[2]));
  Train(*engine_, job_, 1, 2, 1, 31);
  EXPECT_EQ(engine_->Steps(job_)->first, 3);
}

TEST_F(CheckpointFaultTest, AStepQueryDuringALoadSeesOneStepOrTheOther) {
  TrainAndSave(2);
  Train(*engine_, job_, 1, step_, 1, 41);  // the job holds step 3, the file step 2
  std::atomic<bool> done{false};
  std::set<int64_t> seen;
  std::thread reader([&] {
    while (!done.load()) {
      Result<std::pair<int64_t, int64_t>> steps = engine_->Steps(job_);
      if (steps.ok()) seen.insert(steps->first);
    }
  });
  Status s = engine_->LoadCheckpoint(job_, dir_.path());
  done = true;
  reader.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(engine_->Steps(job_)->first, 2);
  for (int64_t step : seen) EXPECT_TRUE(step == 2 || step == 3) << step;
}

TEST_F(CheckpointFaultTest, EveryFailingCallOfASaveIsReportedAndACheckpointStillLoads) {
  TrainAndSave(2);
  Train(*engine_, job_, 1, step_, 1, 7);
  saved_[3] = Snapshot(*engine_, job_);
  // Count the calls a save makes, by kind.
  std::map<FileOp, int> calls;
  std::mutex mu;
  auto count = [&](FileOp op, const std::string&) {
    std::lock_guard<std::mutex> lock(mu);
    ++calls[op];
    return 0;
  };
  {
    ScratchDir probe("ckpt-probe");
    auto e = MakeEngine();
    Result<int> j = e->RegisterJob(SmallModel("probe", 1, 1.0f, 1, StepMode::kExact));
    ASSERT_TRUE(j.ok());
    Train(*e, *j, 1, 0, 1, 5);
    ASSERT_TRUE(e->SaveCheckpoint(*j, probe.path()).ok());  // a first save: nothing to remove
    SetFileFaultHook(count);
    ASSERT_TRUE(e->SaveCheckpoint(*j, probe.path()).ok());
    SetFileFaultHook({});
  }
  ASSERT_GT(calls[FileOp::kFsync], 0);
  ASSERT_GT(calls[FileOp::kRename], 0);
  ASSERT_GT(calls[FileOp::kFsyncDir], 0);
  // Each case saves into a copy of the step-2 checkpoint.
  int cases = 0;
  for (const auto& [op, n] : calls) {
    if (op == FileOp::kRead || op == FileOp::kRemove) continue;  // a save's cleanup, not its work
    for (int nth = 1; nth <= n; ++nth) {
      SCOPED_TRACE(StrCat(FileOpName(op), " #", nth, " of ", n));
      const std::string d = dir_ / StrCat("case-", cases++);
      fs::create_directories(d);
      for (const std::string& f : Files(dir_.path())) {
        if (f.starts_with("unit-") || f == "manifest.json") fs::copy(dir_ / f, d);
      }
      std::atomic<int> seen{0};
      SetFileFaultHook([&, op = op, nth](FileOp o, const std::string&) {
        return o == op && ++seen == nth ? EIO : 0;
      });
      Status s = engine_->SaveCheckpoint(job_, d);
      SetFileFaultHook({});
      EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
      EXPECT_EQ(s.sys_errno(), EIO) << s;
      // The last committed checkpoint, or the new one if the failure came
      // after its manifest was renamed in (opening or syncing the directory
      // for the last time): then the old files stay until a save is known
      // durable, and the next one removes them.
      const int64_t loaded = LoadFresh(d);
      const bool after_rename = (op == FileOp::kFsyncDir || op == FileOp::kOpen) && nth == n;
      EXPECT_TRUE(loaded == 2 || (loaded == 3 && after_rename)) << loaded;
      std::set<std::string> names;
      for (const std::string& f : Files(d)) {
        EXPECT_FALSE(f.ends_with(".tmp")) << f << " left behind";
        if (f.starts_with("unit-")) names.insert(f);
      }
      EXPECT_EQ(names.size(), loaded == 2 ? 4u : 8u) << "files of a failed save are left";
      if (loaded == 3) {
        ASSERT_TRUE(engine_->SaveCheckpoint(job_, d).ok());
        names.clear();
        for (const std::string& f : Files(d)) {
          if (f.starts_with("unit-")) names.insert(f);
        }
        EXPECT_EQ(names.size(), 4u) << "the next save did not clean up";
      }
    }
  }
  EXPECT_GT(cases, 8);
}

TEST_F(CheckpointFaultTest, ASaveWhoseManifestCannotBeReadBackKeepsTheFilesItMayName) {
  TrainAndSave(2);
  Train(*engine_, job_, 1, step_, 1, 7);
  saved_[3] = Snapshot(*engine_, job_);
  int fsync_dirs = 0;  // a save's directory syncs; the last one follows the manifest's rename
  SetFileFaultHook([&](FileOp op, const std::string&) {
    if (op == FileOp::kFsyncDir) ++fsync_dirs;
    return 0;
  });
  {
    ScratchDir probe("ckpt-probe");
    auto e = MakeEngine();
    const int j = *e->RegisterJob(SmallModel("probe", 1, 1.0f, 1, StepMode::kExact));
    ASSERT_TRUE(e->SaveCheckpoint(j, probe.path()).ok());
    fsync_dirs = 0;
    ASSERT_TRUE(e->SaveCheckpoint(j, probe.path()).ok());
  }
  SetFileFaultHook({});
  ASSERT_GT(fsync_dirs, 0);
  // The manifest is renamed in, the directory's sync fails, and the
  // manifest cannot be read back to tell which files it names: the new
  // files must stay, for that manifest may name them.
  std::atomic<int> seen{0};
  std::atomic<bool> renamed{false};
  SetFileFaultHook([&, last = fsync_dirs](FileOp op, const std::string&) {
    if (op == FileOp::kFsyncDir && ++seen == last) {
      renamed = true;
      return EIO;
    }
    return op == FileOp::kRead && renamed ? EIO : 0;
  });
  Status s = engine_->SaveCheckpoint(job_, dir_.path());
  SetFileFaultHook({});
  EXPECT_EQ(s.sys_errno(), EIO) << s;
  EXPECT_EQ(LoadFresh(), 3) << "the manifest on disk names files a failed save removed";
}

// A save synced the directory after each shard file it wrote (and scanned
// it for leftover temps of each): 8,000 files (1,000 units, 8 ranks) took
// minutes. The shard files' names are synced once, before the manifest.
TEST(CheckpointSaveTest, TheDirectoryIsSyncedOnceForAllShardFiles) {
  std::map<int, int> fsync_dirs;  // by ranks
  for (const int ranks : {1, 4}) {
    ScratchDir dir("ckpt-syncs");
    auto e = MakeEngine();
    const int j = *e->RegisterJob(SmallModel("syncs", ranks, 1.0f, 1, StepMode::kExact));
    ASSERT_TRUE(e->SaveCheckpoint(j, dir.path()).ok());
    std::atomic<int> n{0};
    SetFileFaultHook([&](FileOp op, const std::string&) {
      if (op == FileOp::kFsyncDir) ++n;
      return 0;
    });
    const Status s = e->SaveCheckpoint(j, dir.path());  // over the first: the usual case
    SetFileFaultHook({});
    ASSERT_TRUE(s.ok()) << s;
    fsync_dirs[ranks] = n;
  }
  // 4 shard files against 16: the same syncs (the shard files' names, the
  // manifest's, the removal of the old files).
  EXPECT_EQ(fsync_dirs[1], fsync_dirs[4]);
  EXPECT_LE(fsync_dirs[4], 3);
}

// Rewrites the manifest with `edit` applied and a valid checksum.
void Forge(const fs::path& dir, const std::function<void(Json&)>& edit) {
  const fs::path path = dir / "manifest.json";
  Json m = Json::parse(Slurp(path));
  edit(m);
  if (m.is_object()) {
    m.erase("checksum");
    const std::string canonical = m.dump();
    m["checksum"] = Crc32c(canonical.data(), canonical.size());
  }
  std::ofstream(path, std::ios::trunc) << m.dump(1);
}

TEST_F(CheckpointFaultTest, ForgedManifestsWithValidChecksumsAreRefusedAndTouchNothing) {
  TrainAndSave(1);
  const std::string good = Slurp(dir_ / "manifest.json");
  auto other = MakeEngine();
  const int job = *other->RegisterJob(SmallModel("victim", 1, 1.0f, 1, StepMode::kExact));
  Train(*other, job, 1, 0, 1, 3);
  const State before = Snapshot(*other, job);
  struct Case {
    const char* what;
    std::function<void(Json&)> edit;
    const char* message;
  };
  const Case cases[] = {
      {"padded near 2^63", [](Json& m) { m["units"][1]["padded"] = uint64_t{1} << 63; }, "padded"},
      {"numel near 2^62", [](Json& m) { m["units"][1]["numel"] = uint64_t{1} << 62; }, "numel"},
      {"negative step", [](Json& m) { m["step"] = -1; }, "'step'"},
      // The step after it overflowed: the job wedged ("only the grads of
      // step -9223372036854775808 can come next").
      {"a step past 2^62",
       [](Json& m) {
         m["step"] = INT64_MAX;
         m["adam_step"] = INT64_MAX;
       },
       "'step'"},
      {"adam step past step", [](Json& m) { m["adam_step"] = 5; }, "'adam_step'"},
      {"zero ranks", [](Json& m) { m["ranks"] = 0; }, "'ranks'"},
      {"a file named ..", [](Json& m) { m["units"][0]["shards"][0]["file"] = ".."; }, "plain"},
      {"a path that leaves", [](Json& m) { m["units"][0]["shards"][0]["file"] = "../x.bin"; },
       "plain"},
      {"an absolute path", [](Json& m) { m["units"][0]["shards"][0]["file"] = "/etc/passwd"; },
       "plain"},
      {"one file twice",
       [](Json& m) { m["units"][1]["shards"][0]["file"] = m["units"][0]["shards"][0]["file"]; },
       "twice"},
      {"a huge shape",
       [](Json& m) {
         m["units"][0]["tensors"][0]["shape"] = {1u << 31, 1u << 31};
       },
       "shape"},
      {"a negative dimension",
       [](Json& m) {
         m["units"][0]["tensors"][0]["shape"] = {-97, 24};
       },
       "shape"},
      {"no units", [](Json& m) { m["units"] = Json::array(); }, "'units'"},
      {"a string step", [](Json& m) { m["step"] = "1"; }, "'step'"},
      {"bytes off by one", [](Json& m) { m["units"][2]["shards"][0]["bytes"] = 1; }, "'bytes'"},
      {"not an object",
       [](Json& m) {
         m = Json::array({1, 2});
       },
       "not a JSON object"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::ofstream(dir_ / "manifest.json", std::ios::trunc) << good;
    Forge(dir_.path(), c.edit);
    Status s = other->LoadCheckpoint(job, dir_.path());
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
    EXPECT_TRUE(Same(Snapshot(*other, job), before));
  }
  std::ofstream(dir_ / "manifest.json", std::ios::trunc) << good;
  EXPECT_TRUE(other->LoadCheckpoint(job, dir_.path()).ok());
}

// Shards listed out of rank order are named as such (it said "'rank' 1 is
// outside 0..0").
TEST_F(CheckpointFaultTest, ShardsOutOfRankOrderAreNamedAsSuch) {
  auto e = MakeEngine();
  const int job = *e->RegisterJob(SmallModel("two", 2, 1.0f, 1, StepMode::kExact));
  Train(*e, job, 2, 0, 1, 3);
  ASSERT_TRUE(e->SaveCheckpoint(job, dir_.path()).ok());
  Forge(dir_.path(),
        [](Json& m) { std::swap(m["units"][1]["shards"][0], m["units"][1]["shards"][1]); });
  Status s = e->LoadCheckpoint(job, dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find("'rank' is 1, in rank 0's place"), std::string::npos) << s;
}

// A manifest of 200 KB nesting arrays 10^5 deep overflowed the stack (the
// checksum copies and dumps the tree, a call a level) before any check.
TEST_F(CheckpointFaultTest, ADeeplyNestedManifestIsRefusedNotACrash) {
  TrainAndSave(1);
  auto other = MakeEngine();
  const int job = *other->RegisterJob(SmallModel("victim", 1, 1.0f, 1, StepMode::kExact));
  const int depth = 100000;
  std::ofstream(dir_ / "manifest.json", std::ios::trunc)
      << R"({"format": "ztier-checkpoint", "version": 1, "checksum": 1, "x": )"
      << std::string(depth, '[') << std::string(depth, ']') << "}";
  Status s = other->LoadCheckpoint(job, dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find("nest more than"), std::string::npos) << s;
  // Brackets inside strings are text, not nesting.
  std::ofstream(dir_ / "manifest.json", std::ios::trunc)
      << R"({"format": "ztier-checkpoint", "x": ")" << std::string(1000, '[') << R"(\"["})";
  s = other->LoadCheckpoint(job, dir_.path());
  EXPECT_EQ(s.message().find("nest more than"), std::string::npos) << s;
}

// A manifest crafted of empty objects cost sixty times its size in memory
// before it was refused (4 GB for 64 MiB); a document is refused once its
// values would take 16 times the text, and a manifest ztier wrote (a few
// times its size) loads.
TEST_F(CheckpointFaultTest, AManifestCraftedToTakeMemoryIsRefused) {
  TrainAndSave(1);
  auto other = MakeEngine();
  const int job = *other->RegisterJob(SmallModel("victim", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(other->LoadCheckpoint(job, dir_.path()).ok());
  std::string empties(4 << 20, ',');
  for (size_t i = 0; i + 2 < empties.size(); i += 3) empties.replace(i, 2, "{}");
  empties.resize(empties.size() - empties.size() % 3 - 1);
  std::ofstream(dir_ / "manifest.json", std::ios::trunc)
      << R"({"format": "ztier-checkpoint", "version": 1, "x": [)" << empties << "]}";
  Status s = other->LoadCheckpoint(job, dir_.path());
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find("would take more than 65 MiB of memory"), std::string::npos) << s;
}

TEST_F(CheckpointFaultTest, ADirectoryWhereAFileShouldBeIsAnErrorNotACrash) {
  TrainAndSave(1);
  auto other = MakeEngine();
  const int job = *other->RegisterJob(SmallModel("victim", 1, 1.0f, 1, StepMode::kExact));
  // A shard file replaced by a directory.
  const Json m = Json::parse(Slurp(dir_ / "manifest.json"));
  const fs::path shard = dir_ / m["units"][1]["shards"][0]["file"].get<std::string>();
  fs::remove(shard);
  fs::create_directory(shard);
  Status s = other->LoadCheckpoint(job, dir_.path());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("is a directory"), std::string::npos) << s;
  EXPECT_NE(s.message().find(shard.filename().string()), std::string::npos) << s;
  // The manifest replaced by a directory.
  fs::remove(dir_ / "manifest.json");
  fs::create_directory(dir_ / "manifest.json");
  s = other->LoadCheckpoint(job, dir_.path());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("is a directory"), std::string::npos) << s;
}

TEST_F(CheckpointFaultTest, RandomManifestMutationsNeverCrashAndWhatLoadsIsACommittedState) {
  TrainAndSave(1);
  const std::string good = Slurp(dir_ / "manifest.json");
  auto other = MakeEngine();
  const int job = *other->RegisterJob(SmallModel("victim", 2, 1.0f, 1, StepMode::kExact));
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  // Every leaf of the manifest, as a JSON pointer.
  std::vector<Json::json_pointer> leaves;
  const Json flat = Json::parse(good).flatten();
  for (const auto& item : flat.items()) {
    if (item.key() != "/checksum") leaves.emplace_back(item.key());
  }
  const Json replacements =
      Json::array({0, 1, -1, 3, 64, 4096, uint64_t{1} << 40, uint64_t{1} << 63, UINT64_MAX, 1.5, "",
                   "..", "x", true, nullptr, Json::array(), Json::object(), Json::array({1, 2})});
  int loaded = 0;
  for (int iter = 0; iter < 400; ++iter) {
    Json m = Json::parse(good);
    for (int k = 0; k < 1 + static_cast<int>(rng() % 3); ++k) {
      m[leaves[rng() % leaves.size()]] = replacements[rng() % replacements.size()];
    }
    std::ofstream(dir_ / "manifest.json", std::ios::trunc) << m.dump();
    Forge(dir_.path(), [](Json&) {});
    Status s = other->LoadCheckpoint(job, dir_.path());
    if (s.ok()) {
      ++loaded;  // a harmless mutation: the state is the committed one
      EXPECT_TRUE(Same(Snapshot(*other, job), saved_[1])) << m.dump();
    }
  }
  RecordProperty("harmless_mutations", loaded);
}

// A job unregistered while its save ran let go of the directory at once:
// another job could claim it and save there, each save removing the other's
// files (the manifest then named a file gone). The claim now lasts until
// the save is done; the unregister waits for it.
TEST(CheckpointDirTest, AnUnregisterDuringASaveKeepsTheDirectoryUntilTheSaveIsDone) {
  ScratchDir dir("ckpt-unregister");
  const std::string d = dir / "ck";
  auto e = MakeEngine();
  const int a = *e->RegisterJob(SmallModel("a", 1, 0.0f, 1, StepMode::kExact));
  const int b = *e->RegisterJob(SmallModel("b", 1, 0.0f, 1, StepMode::kExact));
  Train(*e, a, 1, 0, 1, 1);
  std::mutex mu;
  std::condition_variable cv;
  bool writing = false, go_on = false;
  SetFileFaultHook([&](FileOp op, const std::string&) {
    if (op != FileOp::kWrite) return 0;
    std::unique_lock<std::mutex> lock(mu);
    writing = true;
    cv.notify_all();
    cv.wait(lock, [&] { return go_on; });  // the save holds here
    return 0;
  });
  Status saved;
  std::thread saver([&] { saved = e->SaveCheckpoint(a, d); });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return writing; });
  }
  std::atomic<bool> unregistered{false};
  std::thread unregister([&] {
    EXPECT_TRUE(e->UnregisterJob(a).ok());
    unregistered = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(unregistered) << "the unregister did not wait for the save";
  const Status claimed = e->ClaimCheckpointDir(b, d);
  EXPECT_EQ(claimed.code(), StatusCode::kUnavailable) << claimed;
  {
    std::lock_guard<std::mutex> lock(mu);
    go_on = true;
  }
  cv.notify_all();
  saver.join();
  unregister.join();
  SetFileFaultHook({});
  EXPECT_TRUE(saved.ok()) << saved;
  // The save done and the job gone, the directory is free; what it saved loads.
  ASSERT_TRUE(e->ClaimCheckpointDir(b, d).ok());
  EXPECT_TRUE(e->LoadCheckpoint(b, d).ok());
}

// A directory's key keeps its "..", as the kernel walks it: folded,
// "link/../ckpt" and "ckpt" were one key for two directories.
TEST(CheckpointDirTest, AKeyIsThePathAsTheKernelWalksIt) {
  EXPECT_EQ(CheckpointDirKey("/a/./b//c/"), "/a/b/c");
  EXPECT_EQ(CheckpointDirKey("/a/link/../c"), "/a/link/../c");
  EXPECT_EQ(CheckpointDirKey("/"), "/");
  EXPECT_EQ(CheckpointDirKey("x"), (std::filesystem::current_path() / "x").string());
}

// A claim whose lock file is gone from its path (the directory removed and
// made again) holds nothing, and goes; one made after a look at the path
// (another thread's, whose file the look may have missed) is no such
// claim: dropped, its lock went with it and two jobs saved into one
// directory. A look that could not stat the path drops nothing.
TEST(CheckpointDirTest, OnlyAClaimMadeBeforeALookThatMissedItsFileGoes) {
  ScratchDir dir("ckpt-claims");
  const std::string d = dir / "ck";
  std::filesystem::create_directories(d);
  const std::string key = CheckpointDirKey(d);
  const auto acquire = [&] {
    return DirLock::Acquire(d, kCheckpointLockFile, "checkpoint directory",
                            DirLock::Mode::kExclusive);
  };
  ClaimedCheckpointDirs mine;
  std::vector<DirLock> gone;
  // Looked at before the claim was made: no file then.
  const ClaimedCheckpointDirs::LockFileNow before = ClaimedCheckpointDirs::Look(d);
  ASSERT_TRUE(before.known && !before.exists);
  Result<DirLock> lock = acquire();
  ASSERT_TRUE(lock.ok()) << lock.status();
  mine.Add(key, *std::move(lock), /*pin=*/true, &gone);
  EXPECT_TRUE(mine.Holds(key, before, true, false, &gone));
  EXPECT_TRUE(gone.empty());
  EXPECT_EQ(acquire().status().code(), StatusCode::kUnavailable);
  // The directory removed and made again: the claim holds nothing.
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  EXPECT_FALSE(mine.Holds(key, ClaimedCheckpointDirs::Look(d), true, false, &gone));
  EXPECT_EQ(gone.size(), 1u);
  gone.clear();
  // A look that could not stat the path (a permission, an I/O error) tells
  // nothing of the file: the claim stays.
  lock = acquire();
  ASSERT_TRUE(lock.ok()) << lock.status();
  mine.Add(key, *std::move(lock), /*pin=*/true, &gone);
  ClaimedCheckpointDirs::LockFileNow unknown;
  unknown.claims_before = UINT64_MAX;
  EXPECT_TRUE(mine.Holds(key, unknown, true, false, &gone));
  EXPECT_TRUE(gone.empty());
}

TEST(CheckpointDirTest, OneSavingUserAtATimeAcrossJobsAndProcesses) {
  ScratchDir dir("ckpt-dir");
  const std::string d = dir / "ck";
  auto a = MakeEngine();
  const int ja = *a->RegisterJob(SmallModel("first", 1, 0.0f, 1, StepMode::kExact));
  const int ja2 = *a->RegisterJob(SmallModel("second", 1, 0.0f, 1, StepMode::kExact));
  Train(*a, ja, 1, 0, 1, 1);
  Train(*a, ja2, 1, 0, 1, 2);
  ASSERT_TRUE(a->ClaimCheckpointDir(ja, d).ok());
  // Another job of the same engine.
  Status same = a->SaveCheckpoint(ja2, d);
  EXPECT_EQ(same.code(), StatusCode::kUnavailable) << same;
  EXPECT_NE(same.message().find("job 'first'"), std::string::npos) << same;
  // Another engine, as another process would be.
  auto b = MakeEngine();
  const int jb = *b->RegisterJob(SmallModel("other", 1, 0.0f, 1, StepMode::kExact));
  Status cross = b->ClaimCheckpointDir(jb, d);
  EXPECT_EQ(cross.code(), StatusCode::kUnavailable) << cross;
  EXPECT_NE(cross.message().find(StrCat("pid ", ::getpid())), std::string::npos) << cross;
  // Loading never needs the lock.
  ASSERT_TRUE(a->SaveCheckpoint(ja, d).ok());
  EXPECT_TRUE(b->LoadCheckpoint(jb, d).ok());
  // The owner gone, the directory is free.
  ASSERT_TRUE(a->UnregisterJob(ja).ok());
  EXPECT_TRUE(b->ClaimCheckpointDir(jb, d).ok());
  ASSERT_TRUE(b->UnregisterJob(jb).ok());

  // A process that holds it and dies by SIGKILL never blocks anyone.
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto e = MakeEngine();
    const int j = *e->RegisterJob(SmallModel("child", 1, 0.0f, 1, StepMode::kExact));
    const char c = e->ClaimCheckpointDir(j, d).ok() ? 'y' : 'n';
    [[maybe_unused]] ssize_t n = ::write(ready[1], &c, 1);
    ::pause();
    ::_exit(0);
  }
  ::close(ready[1]);  // a child that died says nothing, and the read ends
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1) << "the child died before it claimed the directory";
  ASSERT_EQ(c, 'y');
  const int jc = *a->RegisterJob(SmallModel("after", 1, 0.0f, 1, StepMode::kExact));
  Status held = a->ClaimCheckpointDir(jc, d);
  EXPECT_EQ(held.code(), StatusCode::kUnavailable);
  EXPECT_NE(held.message().find(StrCat("process ", child)), std::string::npos) << held;
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_TRUE(a->ClaimCheckpointDir(jc, d).ok());
  ::close(ready[0]);
}

TEST(CheckpointDirTest, ALoadSeesOneCommittedCheckpointWhileAnotherRunKeepsSaving) {
  ScratchDir dir("ckpt-live");
  auto writer = MakeEngine();
  const int jw = *writer->RegisterJob(SmallModel("writer", 1, 1.0f, 1, StepMode::kExact));
  Train(*writer, jw, 1, 0, 1, 1);
  ASSERT_TRUE(writer->SaveCheckpoint(jw, dir.path()).ok());
  std::mutex mu;
  std::map<int64_t, State> committed = {{1, Snapshot(*writer, jw)}};
  std::atomic<bool> done{false};
  std::thread saver([&] {
    for (int step = 1; step < 12; ++step) {
      Train(*writer, jw, 1, step, 1, 100 + step);
      State s = Snapshot(*writer, jw);
      {
        std::lock_guard<std::mutex> lock(mu);
        committed[step + 1] = std::move(s);
      }
      ASSERT_TRUE(writer->SaveCheckpoint(jw, dir.path()).ok());
    }
    done = true;
  });
  auto reader = MakeEngine();
  const int jr = *reader->RegisterJob(SmallModel("reader", 1, 1.0f, 1, StepMode::kExact));
  int loads = 0;
  while (!done || loads == 0) {
    Status s = reader->LoadCheckpoint(jr, dir.path());
    ASSERT_TRUE(s.ok()) << s;
    const int64_t step = reader->PublishedStep(jr, 0);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_TRUE(committed.count(step)) << step;
    EXPECT_TRUE(Same(Snapshot(*reader, jr), committed[step])) << "step " << step;
    ++loads;
  }
  saver.join();
  EXPECT_GT(loads, 0);
}

TEST(EngineLimitsTest, JobsAreSizedUpFront) {
  auto e = MakeEngine(uint64_t{64} << 20);
  JobSpec huge;
  huge.name = "huge";
  huge.units = {{"u", {{"w", {int64_t{1} << 31, int64_t{1} << 31}}}}};
  Result<int> h = e->RegisterJob(huge);
  EXPECT_EQ(h.status().code(), StatusCode::kInvalidArgument) << h.status();
  EXPECT_NE(h.status().message().find("elements"), std::string::npos) << h.status();
  JobSpec wide;
  wide.name = "wide";
  for (int k = 0; k < 300; ++k) {
    wide.units.push_back({StrCat("u", k), {{"w", {int64_t{1} << 20, int64_t{1} << 20}}}});
  }
  EXPECT_EQ(e->RegisterJob(wide).status().code(), StatusCode::kInvalidArgument);
  // 8M parameters with states in DRAM: 128 MiB (and the 4 KiB step page
  // and client page) against a 64 MiB budget, refused before anything is allocated, with
  // both figures.
  JobSpec big;
  big.name = "big";
  big.units = {{"w", {{"w", {2048, 4096}}}}};
  Result<int> b = e->RegisterJob(big);
  ASSERT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status();
  EXPECT_NE(b.status().message().find("needs 134225920 bytes"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("67108864"), std::string::npos) << b.status();
  EXPECT_EQ(e->pool_stats().used_bytes, 0u);
}

// Names go into JSON files and onto terminals: a name that is not UTF-8, or
// holds a control character, is refused when the job registers (a non-UTF-8
// tensor name once aborted the process at its first checkpoint).
TEST(EngineLimitsTest, NamesAreUtf8WithoutControlCharacters) {
  auto e = MakeEngine();
  const auto job = [](std::string name, std::string unit, std::string tensor) {
    JobSpec j;
    j.name = std::move(name);
    j.units = {{std::move(unit), {{std::move(tensor), {8}}}}};
    return j;
  };
  for (const auto& [spec, says] : std::vector<std::pair<JobSpec, std::string>>{
           {job("j", "u", "\xff\xfe"), "tensor 0's name is not valid UTF-8 (byte 0: 0xff)"},
           {job("j", "u", "w\xc3"), "is not valid UTF-8 (byte 1: 0xc3)"},
           {job("j", "u", "\xc0\xaf"), "not valid UTF-8"},      // overlong '/'
           {job("j", "u", "\xed\xa0\x80"), "not valid UTF-8"},  // a surrogate
           {job("j", "u\nv", "w"), "unit 0's name holds a control character"},
           {job("a\tb", "u", "w"), "the job name holds a control character"},
           // U+202E (right-to-left override), U+2066 (isolate), U+2028 (line separator)
           {job("gpt\xe2\x80\xae", "u", "w"), "the job name holds a text-direction"},
           {job("j", "\xe2\x81\xa6u", "w"), "unit 0's name holds a text-direction"},
           {job("j\xe2\x80\xa8k", "u", "w"), "line-separator character (byte 1"}}) {
    Result<int> r = e->RegisterJob(spec);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
  }
  // Any other UTF-8 is fine, and saves and exports.
  ScratchDir dir("names");
  Result<int> ok = e->RegisterJob(job("näme ✓ \"q\"", "ünit", "τ.weight"));
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE(e->WriteWeights(*ok, 0, std::vector<float>(8, 1.0f).data(), 8).ok());
  EXPECT_TRUE(e->SaveCheckpoint(*ok, dir / "ck").ok());
  EXPECT_TRUE(e->ExportSafetensors(*ok, dir / "m.safetensors", Engine::ExportType::kFloat32).ok());
}

// A safetensors file names each tensor once: a job whose units repeat a name
// (fine for its checkpoints, which go by index) is refused an export or an
// import, naming both units.
TEST(EngineLimitsTest, AnExportOfRepeatedTensorNamesIsRefused) {
  auto e = MakeEngine();
  JobSpec j;
  j.name = "dup";
  j.units = {{"a", {{"w", {4}}}}, {"b", {{"w", {6}}}}};
  Result<int> id = e->RegisterJob(j);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(e->WriteWeights(*id, 0, std::vector<float>(4, 1.0f).data(), 4).ok());
  ASSERT_TRUE(e->WriteWeights(*id, 1, std::vector<float>(6, 2.0f).data(), 6).ok());
  ScratchDir dir("dup");
  const std::string path = dir / "m.safetensors";
  const Status s = e->ExportSafetensors(*id, path, Engine::ExportType::kFloat32);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("tensor name 'w' is in unit 'a' and in unit 'b'"), std::string::npos)
      << s;
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(e->SaveCheckpoint(*id, dir / "ck").ok());
}

TEST(EnginePoolTest, ThePoolReportsThePageSizeItGot) {
  auto e = MakeEngine();
  const int j = *e->RegisterJob(SmallModel("pages", 1, 0.0f, 1, StepMode::kExact));
  const DramPoolStats s = e->pool_stats();
  EXPECT_TRUE(s.page_bytes == 4096 || s.page_bytes == (2u << 20)) << s.page_bytes;
  EXPECT_EQ(e->counters(j).dram_page_bytes, s.page_bytes);
  if (ShmemHugePagePolicy() == "never" || ShmemHugePagePolicy() == "deny") {
    EXPECT_EQ(s.page_bytes, 4096u) << "huge pages reported where the kernel gives none";
    EXPECT_EQ(s.huge_page_bytes, 0u);
  }
}

}  // namespace
}  // namespace ztier::engine
