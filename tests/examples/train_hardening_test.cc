// ztier-train tried the way a hostile or clumsy user tries it: two runs on
// one --out, re-runs that would replace committed work, resumes after kills
// at awkward points, signals, bad flags and files, configs that must mean
// what they say. Each case names the behaviour it pins down; none may end in
// a crash (an exit code >= 128 other than a requested stop).
// Runs the built binary (ZTIER_TRAIN_BINARY) in a scratch directory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/examples/train_testing.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/small_tmpfs.h"

namespace {

namespace fs = std::filesystem;
using ztier::testing::ScratchDir;
using ztier::testing::SmallTmpfs;

using ztier::testing::Slurp;
using Process = ztier::testing::TrainProcess;

// Runs ztier-train to the end: {exit code, output}.
std::pair<int, std::string> Train(const std::string& args, const ScratchDir& dir) {
  return ztier::testing::RunTrain(args, dir / "out.txt");
}

// Loss-log rows by step.
std::vector<std::string> LogSteps(const std::string& log) {
  return ztier::testing::LogColumn(log, 0);
}

std::vector<std::string> Counting(int from, int to) {
  std::vector<std::string> out;
  for (int i = from; i <= to; ++i) out.push_back(std::to_string(i));
  return out;
}

// Waits until the log has `rows` rows (or the process is gone).
void WaitForRows(const std::string& log, size_t rows, pid_t pid) {
  for (int i = 0; i < 6000; ++i) {
    if (LogSteps(log).size() >= rows) return;
    if (::kill(pid, 0) != 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

class TrainHardeningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A rank that waits on the engine for a minute fails with its message.
    ::setenv("ZTIER_WAIT_TIMEOUT", "60", 1);
    std::ofstream text(dir_ / "text.txt");
    for (int i = 0; i < 300; ++i) text << "Pack my box with five dozen liquor jugs, " << i << ". ";
  }
  std::string Common() const {
    return " --layers 2 --channels 32 --heads 2 --context 16 --batch 4 --data " +
           (dir_ / "text.txt");
  }
  ScratchDir dir_{"train-hard"};
};

TEST_F(TrainHardeningTest, ASecondRunOnOneOutIsRefusedAtOnceAndTheFirstIsUntouched) {
  const std::string out = dir_ / "shared";
  // Long enough that it is still running when the second run (started as
  // it logs its second step, on a loaded machine perhaps seconds later)
  // reaches the locks.
  const std::string a_args = Common() + " --steps 240 --checkpoint-every 1 --ranks 2 --out " + out;
  Process a(a_args, dir_ / "a.txt");
  WaitForRows(out + "/train_log.tsv", 2, a.pid());
  // The same --out; then the same --out with the swap elsewhere, which only
  // the checkpoint directory's lock can catch.
  for (const std::string& extra : {std::string(), " --swap-dir " + dir_.sub("other-swap")}) {
    const auto start = std::chrono::steady_clock::now();
    auto [rc, text] = Train(Common() + " --steps 5 --seed 2 --out " + out + extra, dir_);
    EXPECT_EQ(rc, 1) << text;
    EXPECT_NE(text.find(ztier::StrCat("in use by process ", a.pid())), std::string::npos) << text;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
        << "refused only after work was done";
  }
  ASSERT_EQ(a.Wait(), 0) << a.output();
  // The first run's results are exactly those of a run nobody disturbed.
  auto [rc, text] = Train(Common() + " --steps 240 --ranks 2 --out " + (dir_ / "alone"), dir_);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_EQ(Slurp(out + "/model.safetensors"), Slurp(dir_ / "alone/model.safetensors"));
  EXPECT_EQ(LogSteps(out + "/train_log.tsv"), Counting(1, 240));
  EXPECT_EQ(Slurp(out + "/train_log.tsv").find('\0'), std::string::npos);
}

// A --resume into the --out of a run that has not saved yet said only
// that there is no checkpoint, not that another run trains there.
TEST_F(TrainHardeningTest, AResumeIntoARunThatHasNotSavedYetNamesThatRun) {
  const std::string out = dir_ / "busy";
  Process a(Common() + " --steps 100000 --out " + out, dir_ / "a.txt");
  WaitForRows(out + "/train_log.tsv", 2, a.pid());
  auto [rc, text] = Train(Common() + " --steps 5 --resume --out " + out, dir_);
  ::kill(a.pid(), SIGKILL);
  (void)a.Wait();
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("there is no checkpoint in"), std::string::npos) << text;
  EXPECT_NE(text.find(ztier::StrCat("in use by process ", a.pid())), std::string::npos) << text;
  // The lock file is looked at, not opened: a FIFO there (not ours to
  // read) is no run, and no wait.
  const std::string fifo = dir_ / "fifo";
  std::filesystem::create_directories(fifo + "/checkpoint");
  ASSERT_EQ(::mkfifo((fifo + "/checkpoint/ztier-checkpoint.lock").c_str(), 0600), 0);
  std::tie(rc, text) = Train(Common() + " --steps 5 --resume --out " + fifo, dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("there is no checkpoint in"), std::string::npos) << text;
}

TEST_F(TrainHardeningTest, ARunNeverReplacesACheckpointItDidNotResume) {
  const std::string out = dir_ / "run";
  ASSERT_EQ(Train(Common() + " --steps 3 --out " + out, dir_).first, 0);
  const std::string manifest = Slurp(out + "/checkpoint/manifest.json");
  auto [rc, text] = Train(Common() + " --steps 3 --out " + out, dir_);
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("--resume"), std::string::npos) << text;
  EXPECT_NE(text.find("--overwrite"), std::string::npos) << text;
  EXPECT_EQ(Slurp(out + "/checkpoint/manifest.json"), manifest) << "the checkpoint changed";
  EXPECT_EQ(LogSteps(out + "/train_log.tsv"), Counting(1, 3)) << "the log changed";
  // --overwrite starts over, on purpose, and removes the checkpoint's files
  // only (a user's file whose name began with "unit-" went too).
  { std::ofstream(out + "/checkpoint/unit-test-results.txt") << "mine"; }
  auto [orc, otext] = Train(Common() + " --steps 2 --seed 5 --overwrite --out " + out, dir_);
  ASSERT_EQ(orc, 0) << otext;
  EXPECT_EQ(LogSteps(out + "/train_log.tsv"), Counting(1, 2));
  EXPECT_NE(Slurp(out + "/checkpoint/manifest.json"), manifest);
  EXPECT_EQ(Slurp(out + "/checkpoint/unit-test-results.txt"), "mine");
  const std::string now = Slurp(out + "/checkpoint/manifest.json");
  for (const auto& e : fs::directory_iterator(out + "/checkpoint")) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() == ".bin") {
      EXPECT_NE(now.find(name), std::string::npos) << name << ": the earlier run's, left";
    }
  }
  // --resume of a run that has no checkpoint is an error, not a fresh start.
  auto [nrc, ntext] = Train(Common() + " --steps 2 --resume --out " + (dir_ / "none"), dir_);
  EXPECT_EQ(nrc, 1) << ntext;
  EXPECT_NE(ntext.find("no checkpoint"), std::string::npos) << ntext;
  EXPECT_FALSE(fs::exists(dir_ / "none")) << "the refused --resume made its --out";
}

// Without a manifest a fresh run took --out as empty: an export there was
// replaced, and shard files of a checkpoint whose manifest was lost were
// removed, without a word. Refused as a checkpoint is; a run killed before
// its first save (its note alone) is no earlier output.
TEST_F(TrainHardeningTest, AFreshRunReplacesNoExportOrShardsWithoutOverwrite) {
  const std::string done = dir_ / "done";
  ASSERT_EQ(Train(Common() + " --steps 3 --out " + done, dir_).first, 0);
  const std::string weights = Slurp(done + "/model.safetensors");
  // An export alone.
  const std::string exported = dir_ / "exported";
  fs::create_directories(exported);
  fs::copy_file(done + "/model.safetensors", exported + "/model.safetensors");
  auto [rc, text] = Train(Common() + " --steps 2 --seed 3 --out " + exported, dir_);
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("holds an export"), std::string::npos) << text;
  EXPECT_NE(text.find("--overwrite"), std::string::npos) << text;
  EXPECT_TRUE(Slurp(exported + "/model.safetensors") == weights) << "the export was replaced";
  // Shard files whose manifest is gone.
  fs::remove(done + "/checkpoint/manifest.json");
  fs::remove(done + "/model.safetensors");
  size_t shards = 0;
  for (const auto& e : fs::directory_iterator(done + "/checkpoint")) {
    shards += e.path().extension() == ".bin";
  }
  ASSERT_GT(shards, 0u);
  std::tie(rc, text) = Train(Common() + " --steps 2 --seed 3 --out " + done, dir_);
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("shard files without their manifest"), std::string::npos) << text;
  size_t left = 0;
  for (const auto& e : fs::directory_iterator(done + "/checkpoint")) {
    left += e.path().extension() == ".bin";
  }
  EXPECT_EQ(left, shards) << "shard files removed";
  EXPECT_EQ(LogSteps(done + "/train_log.tsv"), Counting(1, 3)) << "the log changed";
  // --overwrite replaces both.
  for (const std::string& out : {exported, done}) {
    std::tie(rc, text) = Train(Common() + " --steps 2 --seed 3 --overwrite --out " + out, dir_);
    EXPECT_EQ(rc, 0) << text;
  }
  // The note alone (a run killed before its first save): a fresh start.
  const std::string early = dir_ / "early";
  fs::create_directories(early + "/checkpoint");
  { std::ofstream(early + "/checkpoint/ztier-train-model.txt") << "heads 2\n"; }
  std::tie(rc, text) = Train(Common() + " --steps 2 --out " + early, dir_);
  EXPECT_EQ(rc, 0) << text;
}

// A run killed in its first save leaves shard files, no manifest and its
// note without a saved step; run again as it was (no checkpoint: a fresh
// start), it was refused as a checkpoint whose manifest was lost, and the
// kill soak stalled there. It starts afresh, removes those files and ends
// with the model of a run that was never killed.
TEST_F(TrainHardeningTest, ARunKilledInItsFirstSaveStartsAfreshWhenRunAgain) {
  const std::string whole = dir_ / "whole", cut = dir_ / "cut";
  ASSERT_EQ(Train(Common() + " --steps 3 --out " + whole, dir_).first, 0);
  // The cut-short save: step 1's shard files, the note of the run's start.
  ASSERT_EQ(Train(Common() + " --steps 1 --checkpoint-every 1 --out " + cut, dir_).first, 0);
  fs::remove(cut + "/checkpoint/manifest.json");
  fs::remove(cut + "/model.safetensors");
  fs::remove(cut + "/train_log.tsv");
  std::string note = Slurp(cut + "/checkpoint/ztier-train-model.txt");
  const size_t step = note.find("step 1\n");
  ASSERT_NE(step, std::string::npos) << note;
  note.replace(step, 7, "saves none\n");  // the note of the run's start
  // An older version's note says neither: its shards are refused, as the
  // files of a checkpoint whose manifest was lost.
  { std::ofstream(cut + "/checkpoint/ztier-train-model.txt") << note.substr(0, step); }
  auto [older_rc, older_text] = Train(Common() + " --steps 3 --out " + cut, dir_);
  EXPECT_EQ(older_rc, 2) << older_text;
  EXPECT_NE(older_text.find("shard files without their manifest"), std::string::npos) << older_text;
  { std::ofstream(cut + "/checkpoint/ztier-train-model.txt") << note; }
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(cut + "/checkpoint")) {
    if (e.path().extension() == ".bin") left.push_back(e.path().string());
  }
  ASSERT_FALSE(left.empty());
  auto [rc, text] = Train(Common() + " --steps 3 --out " + cut, dir_);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_TRUE(Slurp(whole + "/model.safetensors") == Slurp(cut + "/model.safetensors"))
      << "the model differs from the uninterrupted run's";
  for (const std::string& file : left) EXPECT_FALSE(fs::exists(file)) << file << " was left";
}

// A run killed between its first save and the note left the note of its
// start ("saves none") beside a committed checkpoint; a resume that only
// exported kept it so, and once the manifest was lost, a fresh run took
// the checkpoint's shards for a cut-short first save's and removed them.
// The resume gives that note the checkpoint's step.
TEST_F(TrainHardeningTest, AResumeGivesTheNoteOfARunsStartItsCheckpointsStep) {
  const std::string out = dir_ / "first";
  ASSERT_EQ(Train(Common() + " --steps 3 --checkpoint-every 3 --out " + out, dir_).first, 0);
  const std::string note = out + "/checkpoint/ztier-train-model.txt";
  std::string text = Slurp(note);
  const size_t step = text.find("step 3\n");
  ASSERT_NE(step, std::string::npos) << text;
  text.replace(step, 7, "saves none\n");
  { std::ofstream(note, std::ios::trunc) << text; }
  auto [rc, said] = Train(Common() + " --steps 3 --checkpoint-every 3 --resume --out " + out, dir_);
  ASSERT_EQ(rc, 0) << said;
  EXPECT_NE(Slurp(note).find("step 3\n"), std::string::npos) << Slurp(note);
  EXPECT_EQ(Slurp(note).find("saves none"), std::string::npos) << Slurp(note);
  // Its manifest lost, the checkpoint is refused to a fresh run, not removed.
  fs::remove(out + "/checkpoint/manifest.json");
  fs::remove(out + "/model.safetensors");
  std::tie(rc, said) = Train(Common() + " --steps 3 --checkpoint-every 3 --out " + out, dir_);
  EXPECT_EQ(rc, 2) << said;
  EXPECT_NE(said.find("shard files without their manifest"), std::string::npos) << said;
}

// A manifest that is a symbolic link: a save wrote through it into the
// checkpoint it named (whose shard files it did not write: that one could
// be loaded no more), and a dangling one read as no checkpoint, so the run
// trained and only its first save was refused. Refused at the start.
TEST_F(TrainHardeningTest, AManifestThatIsALinkIsRefusedAtTheStart) {
  const std::string other = dir_ / "other", linked = dir_ / "linked";
  ASSERT_EQ(Train(Common() + " --steps 2 --out " + other, dir_).first, 0);
  ASSERT_EQ(Train(Common() + " --steps 2 --out " + linked, dir_).first, 0);
  const std::string manifest = Slurp(other + "/checkpoint/manifest.json");
  for (const std::string& target : {other + "/checkpoint/manifest.json", dir_ / "nothing"}) {
    fs::remove(linked + "/checkpoint/manifest.json");
    fs::create_symlink(target, linked + "/checkpoint/manifest.json");
    for (const char* mode : {" --resume", " --overwrite", ""}) {
      const auto start = std::chrono::steady_clock::now();
      auto [rc, text] = Train(Common() + " --steps 4 --out " + linked + mode, dir_);
      EXPECT_EQ(rc, 1) << mode << text;
      EXPECT_NE(text.find("is a symbolic link"), std::string::npos) << mode << text;
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
          << "refused only after work was done";
    }
  }
  EXPECT_EQ(Slurp(other + "/checkpoint/manifest.json"), manifest) << "written through the link";
  auto [rc, text] = Train(Common() + " --steps 3 --resume --out " + other, dir_);
  EXPECT_EQ(rc, 0) << text;
}

// Another user's --out (or one every user may write into) is refused
// before anything is read or removed there: its owner had put a link to
// another run's checkpoint where this run's goes, and --overwrite removed
// that checkpoint and saved into it.
TEST_F(TrainHardeningTest, AnOutThatAnotherUserCanWriteIntoIsRefused) {
  const std::string mine = dir_ / "mine", planted = dir_ / "planted";
  ASSERT_EQ(Train(Common() + " --steps 2 --out " + mine, dir_).first, 0);
  const std::string manifest = Slurp(mine + "/checkpoint/manifest.json");
  fs::create_directory(planted);
  fs::create_symlink(mine + "/checkpoint", planted + "/checkpoint");
  ASSERT_EQ(::chmod(planted.c_str(), 0777), 0);
  for (const char* mode : {" --overwrite", " --resume"}) {
    auto [rc, text] = Train(Common() + " --steps 3 --out " + planted + mode, dir_);
    EXPECT_EQ(rc, 1) << mode << text;
    EXPECT_NE(text.find("may be written by every user (mode 0777)"), std::string::npos) << text;
  }
  ASSERT_EQ(::chmod(planted.c_str(), 01777), 0);  // sticky, as /tmp: others still make names
  {
    auto [rc, text] = Train(Common() + " --steps 3 --overwrite --out " + planted, dir_);
    EXPECT_EQ(rc, 1) << text;
    EXPECT_NE(text.find("may be written by every user (mode 1777)"), std::string::npos) << text;
  }
  ASSERT_EQ(::chmod(planted.c_str(), 0755), 0);
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(planted.c_str(), 65534, 65534), 0);
    auto [rc, text] = Train(Common() + " --steps 3 --overwrite --out " + planted, dir_);
    EXPECT_EQ(rc, 1) << text;
    EXPECT_NE(text.find("belongs to uid 65534, not to this user"), std::string::npos) << text;
    // (Root in a container, given a volume of the host user's, is told the
    // way on; not a new directory inside it, whose owner could swap it for
    // a link to one of root's.)
    EXPECT_NE(text.find("in one no other user can write (root in a container given a host user's "
                        "volume: run as that user, docker run --user $(id -u):$(id -g))"),
              std::string::npos)
        << text;
  }
  EXPECT_EQ(Slurp(mine + "/checkpoint/manifest.json"), manifest) << "written through the link";
}

TEST_F(TrainHardeningTest, ResumeFinishesWhatTheRunHadLeftAndCutsTheLogBack) {
  const std::string whole = dir_ / "whole", cut = dir_ / "cut", last = dir_ / "last";
  ASSERT_EQ(Train(Common() + " --steps 6 --out " + whole, dir_).first, 0);
  // Killed right after its final checkpoint, before the export: --resume
  // writes the export and nothing else.
  EXPECT_EQ(Train(Common() + " --steps 6 --exit-after 6 --out " + last, dir_).first, 3);
  ASSERT_FALSE(fs::exists(last + "/model.safetensors"));
  auto [rc, text] = Train(Common() + " --steps 6 --resume --out " + last, dir_);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_EQ(Slurp(last + "/model.safetensors"), Slurp(whole + "/model.safetensors"));
  EXPECT_EQ(LogSteps(last + "/train_log.tsv"), Counting(1, 6));

  // Killed during a later checkpoint: rows past the committed one are in the
  // log (here written by hand, as a dying run leaves them, with a torn one).
  EXPECT_EQ(
      Train(Common() + " --steps 6 --checkpoint-every 3 --exit-after 3 --out " + cut, dir_).first,
      3);
  {
    std::ofstream log(cut + "/train_log.tsv", std::ios::app);
    log << "4\t9.999\t1\t0\t0\t0\n5\t9.999\t1\t0\t0\t0\n6\t9.9";
  }
  auto [rrc, rtext] = Train(Common() + " --steps 6 --resume --out " + cut, dir_);
  ASSERT_EQ(rrc, 0) << rtext;
  EXPECT_EQ(LogSteps(cut + "/train_log.tsv"), Counting(1, 6));
  EXPECT_EQ(Slurp(cut + "/model.safetensors"), Slurp(whole + "/model.safetensors"));
  EXPECT_EQ(Slurp(cut + "/train_log.tsv").find("9.999"), std::string::npos);

  // A log cut short before the checkpoint, its last row torn: the torn row
  // is dropped (it was kept, and the next run's rows appended to it), and
  // the rows lost are said.
  const std::string short_log = dir_ / "short";
  ASSERT_EQ(
      Train(Common() + " --steps 6 --checkpoint-every 3 --exit-after 3 --out " + short_log, dir_)
          .first,
      3);
  {
    const std::string log = Slurp(short_log + "/train_log.tsv");
    const size_t second = log.find("\n2\t");
    ASSERT_NE(second, std::string::npos) << log;
    std::ofstream(short_log + "/train_log.tsv") << log.substr(0, second + 5);  // "...\n2\t1."
  }
  auto [src, stext] = Train(Common() + " --steps 6 --resume --out " + short_log, dir_);
  ASSERT_EQ(src, 0) << stext;
  EXPECT_NE(stext.find("holds 1 of the 3 steps before the checkpoint"), std::string::npos) << stext;
  EXPECT_EQ(LogSteps(short_log + "/train_log.tsv"), (std::vector<std::string>{"1", "4", "5", "6"}));
  // A checkpoint past --steps is named, not silently "done".
  auto [prc, ptext] = Train(Common() + " --steps 4 --resume --out " + cut, dir_);
  EXPECT_EQ(prc, 1) << ptext;
  EXPECT_NE(ptext.find("past --steps 4"), std::string::npos) << ptext;
  // So is an --exit-after the resumed run would never reach.
  auto [erc, etext] = Train(
      Common() + " --steps 6 --checkpoint-every 3 --exit-after 3 --resume --out " + cut, dir_);
  EXPECT_NE(erc, 0) << etext;
  EXPECT_NE(etext.find("would never reach it"), std::string::npos) << etext;
}

TEST_F(TrainHardeningTest, ResumingAnotherShapeNamesTheTensorAndBothShapes) {
  const std::string out = dir_ / "shape";
  ASSERT_EQ(Train(Common() + " --steps 1 --out " + out, dir_).first, 0);
  auto [rc, text] = Train(Common() + " --channels 48 --steps 2 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(
      text.find("tensor 'wte' has shape [256, 32] in the checkpoint and [256, 48] in the job"),
      std::string::npos)
      << text;
  // Another head count has the same shapes: the checkpoint's note says.
  std::tie(rc, text) = Train(Common() + " --heads 4 --steps 2 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("is of a model with heads 2; this run has 4 (--heads)"), std::string::npos)
      << text;
  EXPECT_EQ(Train(Common() + " --steps 2 --resume --out " + out, dir_).first, 0);
}

// What the shapes do not tell is in the checkpoint's note: a resume that
// changes the batches or the update is told so, naming each change; one
// whose note is gone is told the head count cannot be checked.
TEST_F(TrainHardeningTest, ResumingWithOtherBatchesOrUpdatesSaysWhatChanged) {
  const std::string out = dir_ / "changed";
  ASSERT_EQ(Train(Common() + " --steps 1 --out " + out, dir_).first, 0);
  {
    std::ofstream other(dir_ / "other.txt");
    for (int i = 0; i < 300; ++i) other << "The quick brown fox jumps over the lazy dog " << i;
  }
  auto [rc, text] = Train(
      " --layers 2 --channels 32 --heads 2 --context 16 --batch 2 --seed 7 "
      "--lr 0.01 --matmul bf16 --steps 2 --resume --data " +
          (dir_ / "other.txt") + " --out " + out,
      dir_);
  EXPECT_EQ(rc, 0) << text;
  for (const char* said :
       {"warning: resuming with", "--seed 7 (before: 1)", "--batch 2 (before: 4)",
        "--lr 0.01 (before: 0.002)", "--matmul bf16 (before: fp32)", "other text (--data: "}) {
    EXPECT_NE(text.find(said), std::string::npos) << said << "\n" << text;
  }
  // The resumes below: the changed flags, with this --heads, up to --steps.
  const auto resume = [&](int heads, int steps) {
    return Train(
        " --layers 2 --channels 32 --context 16 --batch 2 --seed 7 --lr 0.01 "
        "--matmul bf16 --resume --heads " +
            std::to_string(heads) + " --steps " + std::to_string(steps) + " --data " +
            (dir_ / "other.txt") + " --out " + out,
        dir_);
  };
  // A resume that saves nothing (refused here: the checkpoint is past its
  // --steps) leaves the note alone: it rewrote it at the start, and the
  // next resume was warned of changes against flags no checkpoint had.
  std::tie(rc, text) = Train(
      " --layers 2 --channels 32 --heads 2 --context 16 --batch 3 --seed 9 --lr 0.01 "
      "--matmul bf16 --steps 1 --resume --data " +
          (dir_ / "other.txt") + " --out " + out,
      dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("past --steps 1"), std::string::npos) << text;
  // The note describes the run that saved last: the same flags again are a
  // plain resume.
  std::tie(rc, text) = resume(2, 3);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_EQ(text.find("warning"), std::string::npos) << text;
  // Without its note the head count is taken on trust, and said to be.
  fs::remove(fs::path(out) / "checkpoint/ztier-train-model.txt");
  std::tie(rc, text) = resume(4, 4);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("its head count cannot be checked"), std::string::npos) << text;
  // A loss log that is gone is said to be, not restarted in silence.
  fs::remove(fs::path(out) / "train_log.tsv");
  std::tie(rc, text) = resume(4, 5);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("train_log.tsv is gone"), std::string::npos) << text;
}

// A kill after the last save's manifest and before its cleanup left the
// older checkpoint's files; the resume (which saves no more: the run was
// done) kept them for good. It removes the files the manifest does not name.
TEST_F(TrainHardeningTest, AResumeRemovesAnOlderCheckpointsLeftoverFiles) {
  const std::string out = dir_ / "tidy";
  ASSERT_EQ(Train(Common() + " --steps 2 --out " + out, dir_).first, 0);
  const fs::path ckpt = fs::path(out) / "checkpoint";
  std::ofstream(ckpt / "unit-0-rank-0-step-1-0badc0de.bin") << "an older checkpoint's";
  std::ofstream(ckpt / "notes.txt") << "the user's";
  auto [rc, text] = Train(Common() + " --steps 2 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_FALSE(fs::exists(ckpt / "unit-0-rank-0-step-1-0badc0de.bin"));
  EXPECT_TRUE(fs::exists(ckpt / "notes.txt"));
  EXPECT_TRUE(fs::exists(ckpt / "manifest.json"));
  // What the manifest names stays: the checkpoint still resumes.
  std::tie(rc, text) = Train(Common() + " --steps 3 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 0) << text;
}

// A checkpoint manifest or directory that is a loop of symbolic links was an
// uncaught std::filesystem exception (abort): now an error naming it.
TEST_F(TrainHardeningTest, ALoopOfLinksOverTheCheckpointIsAnError) {
  for (const char* mode : {"", " --resume", " --overwrite"}) {
    const fs::path out = dir_ / "loop";
    fs::remove_all(out);
    fs::create_directories(out / "checkpoint");
    fs::create_symlink("manifest.json", out / "checkpoint/manifest.json");
    auto [rc, text] = Train(Common() + " --steps 1" + mode + " --out " + out.string(), dir_);
    EXPECT_EQ(rc, 1) << mode << "\n" << text;
    EXPECT_NE(text.find("checkpoint manifest " + (out / "checkpoint/manifest.json").string() +
                        " is a symbolic link"),
              std::string::npos)
        << text;
  }
  // A loop above the manifest: the directory cannot be searched.
  const fs::path out = dir_ / "looped";
  fs::create_directories(out);
  fs::create_symlink("checkpoint", out / "checkpoint");
  auto [rc, text] = Train(Common() + " --steps 1 --out " + out.string(), dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("Too many levels of symbolic links"), std::string::npos) << text;
}

TEST_F(TrainHardeningTest, TheFirstSignalStopsAtAStepWithACheckpointAndTheExport) {
  const std::string args = Common() + " --layers 3 --channels 64 --context 32 --steps 400";
  for (int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(sig == SIGINT ? "SIGINT" : "SIGTERM");
    const std::string out = dir_ / (sig == SIGINT ? "int" : "term");
    Process r(args + " --out " + out, dir_ / "sig.txt");
    WaitForRows(out + "/train_log.tsv", 3, r.pid());
    ::kill(r.pid(), sig);
    const int rc = r.Wait();
    const std::string text = r.output();
    ASSERT_EQ(rc, 128 + sig) << text;
    EXPECT_NE(text.find(sig == SIGINT ? "stopped by SIGINT" : "stopped by SIGTERM"),
              std::string::npos)
        << text;
    EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
    const std::vector<std::string> steps = LogSteps(out + "/train_log.tsv");
    ASSERT_FALSE(steps.empty());
    ASSERT_LT(steps.size(), 400u) << "did not stop";
    // The checkpoint holds the last logged step, and resuming continues it
    // (the last rows are compared with a run that was never stopped below).
    auto [rrc, rtext] = Train(
        args + " --steps " + std::to_string(steps.size() + 2) + " --resume --out " + out, dir_);
    ASSERT_EQ(rrc, 0) << rtext;
    EXPECT_NE(rtext.find("resumed at step " + steps.back()), std::string::npos) << rtext;
    EXPECT_EQ(LogSteps(out + "/train_log.tsv"), Counting(1, static_cast<int>(steps.size()) + 2));
  }
}

// Settings of the swap space for a run that keeps everything in DRAM were
// taken and changed nothing, without a word.
TEST_F(TrainHardeningTest, SwapSettingsOfARunWithoutSwapAreWarnedOf) {
  ::setenv("ZTIER_NVME_CAPACITY", "1G", 1);
  auto [rc, text] =
      Train(Common() + " --steps 1 --optimizer dram --out " + (dir_ / "dram-only"), dir_);
  ::unsetenv("ZTIER_NVME_CAPACITY");
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("warning: ztier.nvme_capacity (from ZTIER_NVME_CAPACITY) is a setting of "
                      "the NVMe swap space, and this run keeps its states and params in DRAM"),
            std::string::npos)
      << text;
  std::tie(rc, text) = Train(Common() + " --steps 1 --out " + (dir_ / "default"), dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_EQ(text.find("is a setting of the NVMe swap space"), std::string::npos) << text;
}

TEST_F(TrainHardeningTest, BadInputsAreClearErrorsNeverCrashes) {
  const std::string out = " --out " + (dir_ / "bad");
  fs::create_directories(dir_ / "adir");
  struct Case {
    std::string args;
    int rc;
    const char* message;
  };
  const Case cases[] = {
      {"--swap-dir ,", 2, "empty path list"},
      {"--optimizer nvme --swap-dir " + (dir_ / "adir") + "," + (dir_ / "adir"), 2, "adir twice"},
      {"--max-live-bytes nan", 2, "is not a size"},
      {"--max-live-bytes 1e30", 2, "is not a size"},
      {"--persistence-threshold -5", 2, "is not a size"},
      {"--out ''", 2, "non-empty"},
      {"--lr nan", 2, "not a finite number"},
      {"--clip -1", 2, "is outside"},
      {"--batch 0", 2, "is outside"},
      {"--layers 1000000000", 2, "--layers 1000000000 is more than"},
      {"--steps 1e9", 2, "--steps"},
      {"--resume --overwrite", 2, "contradict"},
      {"--params nvme --optimizer dram", 2, "optimizer states on nvme"},
      // Taken, and the states kept in DRAM without a word.
      {"--optimizer dram --swap-dir " + (dir_ / "adir"), 2,
       "--swap-dir: the optimizer states are in dram (--optimizer)"},
      {"--layers 60000 --channels 60000 --heads 1", 1, "of host memory"},
      {"--data /dev/zero", 1, "not a regular file"},
      {"--data " + (dir_ / "adir"), 1, "is a directory"},
      {"--data " + (dir_ / "missing.txt"), 1, "missing.txt"},
      {"--config " + (dir_ / "adir"), 2, "is a directory"},
      {"--data " + (dir_ / "fifo"), 1, "not a regular file"},  // never waits for a writer
      {"--config " + (dir_ / "fifo"), 2, "not a regular file"},
      {"--max-live-bytes 1", 2, "less than one bf16 param"},
      {"--steps 4 --exit-after 2", 2, "has no checkpoint"},
      {"--steps 4 --exit-after 5", 2, "has no checkpoint"},
      {"--steps 4 --summary " + (dir_ / "adir"), 2, "is a directory"},
      {"--steps 4 --summary " + (dir_ / "none/s.json"), 2, "no directory"},
      {"--steps 4 --summary-skip 4 --summary " + (dir_ / "s.json"), 2, "leaves none"},
      // Taken and unused, out of range or not.
      {"--steps 4 --summary-skip 100", 2, "--summary-skip without --summary"},
      {"--job-name ''", 2, "--job-name"},
      {"--config " + (dir_ / "big-batch.json"), 2, "the gradient accumulation 2000000, outside"},
      // The accumulation it derived, rounded down to 0, was named as given.
      {"--config " + (dir_ / "odd-batch.json"), 2,
       "train_batch_size 3 is not a whole multiple of 1 rank(s) x micro batch 4"},
      // It replaced the checkpoint's manifest: the checkpoint was gone.
      {"--steps 4 --summary " + (dir_ / "bad/checkpoint/manifest.json"), 2, "the run's own files"},
      {"--steps 4 --summary " + (dir_ / "bad/model.safetensors"), 2, "the run's own files"},
      // A rename over them made a device or a FIFO a plain file, and the
      // text the run trains on JSON.
      {"--steps 4 --summary " + (dir_ / "fifo"), 2, "is not a regular file (a pipe)"},
      {"--steps 4 --summary /dev/null", 2, "is not a regular file (a device)"},
      {"--steps 4 --summary " + (dir_ / "text.txt"), 2, "is the --data file"},
      {"--job-name a\x01b", 2, "a control character"},
      // A link to nothing was "File exists".
      {"--out " + (dir_ / "dangling"), 1, "is a symbolic link to "},
      // A typo above the swap directory: it was made, on whatever was there.
      {"--swap-dir " + (dir_ / "no/such/swap"), 1, "does not exist"},
      // A file, said not to exist.
      {"--swap-dir " + (dir_ / "text.txt"), 1, "is not a directory"},
      // Hexadecimal and a sign (strtod took them).
      {"--progress-every 0x10", 2, "--progress-every wants seconds"},
      {"--progress-every +5", 2, "--progress-every wants seconds"},
      // No machine has GPU 1023: said before the engine pins the states.
      {"--device cuda --ranks 1024", 1, "no CUDA device"},
      // Shapes the CPU kernels take and the CUDA ones do not: the run
      // stopped (SIGABRT) at its first attention, its model registered.
      {"--device cuda --channels 2048 --heads 1", 2, "--channels / --heads (a head's size, 2048)"},
      {"--device cuda --context 16384 --batch 1", 2, "--context 16384 is past the most the CUDA"},
  };
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  fs::create_symlink(dir_ / "nowhere", dir_ / "dangling");
  // (With --batch 4 that is 2000000 micro-steps a step: it ran, deaf to SIGTERM.)
  std::ofstream(dir_ / "big-batch.json") << R"({"train_batch_size": 8000000})";
  std::ofstream(dir_ / "odd-batch.json") << R"({"train_batch_size": 3})";
  for (const Case& c : cases) {
    const auto start = std::chrono::steady_clock::now();
    auto [rc, text] = Train(Common() + out + " " + c.args, dir_);
    EXPECT_EQ(rc, c.rc) << c.args << "\n" << text;
    EXPECT_NE(text.find(c.message), std::string::npos) << c.args << "\n" << text;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << c.args;
  }
}

// The note beside the checkpoint describes the run that saved it. A
// resume wrote it before its first save, so a save that then failed (a
// full disk here) or was killed left the last checkpoint with the new
// run's note: the next resume with the first run's flags was warned of
// changes, and one with the failed run's flags was not. The note now
// follows each save that committed, with its step; a note of another step
// (a kill between the save and the note) is said to be.
TEST_F(TrainHardeningTest, TheNoteFollowsTheSaveThatCommitted) {
  const std::string small = dir_ / "note-small";
  SmallTmpfs tmpfs(small, "4m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a small tmpfs here: " << tmpfs.error();
  const std::string out = small + "/o";
  const std::string note = out + "/checkpoint/ztier-train-model.txt";
  const std::string flags = Common() + " --optimizer dram --no-progress --checkpoint-every 5";
  auto [rc, text] = Train(flags + " --steps 5 --out " + out, dir_);
  ASSERT_EQ(rc, 0) << text;
  std::string noted = Slurp(note);
  EXPECT_NE(noted.find("lr 0.002\n"), std::string::npos) << noted;
  EXPECT_NE(noted.find("step 5\n"), std::string::npos) << noted;
  // The disk all but full (room for a note and the log's rows, not for a
  // checkpoint): the resume's save at step 10 fails, step 5's stays.
  {
    std::ofstream filler(small + "/filler", std::ios::binary);
    const std::string page(4096, 'x');
    while (filler.write(page.data(), page.size())) {
    }
  }
  fs::resize_file(small + "/filler", fs::file_size(small + "/filler") - (64 << 10));
  std::tie(rc, text) = Train(flags + " --steps 10 --lr 0.001 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("No space left on device"), std::string::npos) << text;
  EXPECT_EQ(Slurp(note), noted) << "a failed save changed the note";
  fs::remove(small + "/filler");
  std::tie(rc, text) = Train(flags + " --steps 5 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_EQ(text.find("warning"), std::string::npos) << text;
  // A resume that saves writes its own settings and step.
  std::tie(rc, text) = Train(flags + " --steps 10 --lr 0.001 --resume --out " + out, dir_);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("--lr 0.001 (before: 0.002)"), std::string::npos) << text;
  noted = Slurp(note);
  EXPECT_NE(noted.find("lr 0.001\n"), std::string::npos) << noted;
  EXPECT_NE(noted.find("step 10\n"), std::string::npos) << noted;
  // As a kill between the save and its note leaves it.
  { std::ofstream(note, std::ios::trunc) << noted.substr(0, noted.find("step ")) << "step 5\n"; }
  std::tie(rc, text) = Train(flags + " --steps 11 --lr 0.001 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("the checkpoint is of step 10, its note"), std::string::npos) << text;
  // At the last step a resume only exports and writes no note, which left
  // the temp file of the note the kill did not rename for good. The resume
  // removes it (the note stays: which settings made the checkpoint is not
  // known, and each resume says so).
  noted = Slurp(note);
  { std::ofstream(note, std::ios::trunc) << noted.substr(0, noted.find("step ")) << "step 5\n"; }
  const std::string temp = note + ".999999999-7.tmp";
  { std::ofstream(temp) << noted; }
  std::tie(rc, text) = Train(flags + " --steps 11 --lr 0.001 --resume --out " + out, dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("the checkpoint is of step 11, its note"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(temp));
}

// A run that fails (here a full disk under its checkpoint) leaves no swap
// file behind: it held exactly the room the checkpoint needed.
TEST_F(TrainHardeningTest, AFailedRunLeavesNoSwapFileBehind) {
  const std::string small = dir_ / "small";
  SmallTmpfs tmpfs(small, "16m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a small tmpfs here: " << tmpfs.error();
  auto [rc, text] = Train(" --out " + small + "/o --steps 10 --no-progress", dir_);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(small + "/o/swap")) {
    if (e.path().filename() != "ztier-swap.lock") left.push_back(e.path().filename());
  }
  tmpfs.Unmount();
  if (text.find("does not support O_DIRECT") != std::string::npos) {
    GTEST_SKIP() << "tmpfs takes no O_DIRECT on this kernel: no swap space there";
  }
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("No space left on device"), std::string::npos) << text;
  EXPECT_TRUE(left.empty()) << left[0] << " left in the swap directory\n" << text;
}

// An --out removed under a run and taken by a second run: the first run's
// next save is refused (the second holds the checkpoint's lock), and as it
// failed it removed the swap file at its path, the second run's live one.
// A failing run removes only the swap files it made.
TEST_F(TrainHardeningTest, AFailingRunRemovesNoSwapFileOfAnotherRun) {
  const std::string out = dir_ / "taken";
  const std::string args = Common() + " --optimizer nvme --steps 100000 --checkpoint-every 1";
  Process first(args + " --out " + out, dir_ / "first.txt");
  WaitForRows(out + "/train_log.tsv", 2, first.pid());
  // No save between the removal and the second run's locks: stopped (and
  // seen stopped: the signal lands a moment after kill returns, and a run
  // still writing there made remove_all fail).
  ::kill(first.pid(), SIGSTOP);
  int st = 0;
  ASSERT_EQ(::waitpid(first.pid(), &st, WUNTRACED), first.pid());
  ASSERT_TRUE(WIFSTOPPED(st));
  std::error_code ec;
  fs::remove_all(out, ec);
  ASSERT_FALSE(ec) << ec.message();
  Process second(args + " --seed 7 --out " + out, dir_ / "second.txt");
  WaitForRows(out + "/train_log.tsv", 2, second.pid());
  struct stat before {};
  ASSERT_EQ(::stat((out + "/swap/ztier.swap").c_str(), &before), 0) << second.output();
  ::kill(first.pid(), SIGCONT);
  // (Its save fails: refused by the second run's lock, or, stopped in the
  // middle of one, its files removed under it.)
  EXPECT_EQ(first.Wait(), 1) << first.output();
  struct stat after {};
  EXPECT_EQ(::stat((out + "/swap/ztier.swap").c_str(), &after), 0)
      << "the second run's swap file was removed\n"
      << first.output();
  EXPECT_EQ(after.st_ino, before.st_ino);
  ::kill(second.pid(), SIGKILL);
}

// An export that the disk refused at the end of a run said only that: the
// user of a long run, told nothing of the checkpoint the run had saved,
// might start it again with --overwrite. It names the checkpoint and
// --resume, which then writes the export. (--out on a tmpfs with room for
// the checkpoint and half the export, sized from a run on the disk; the
// swap space elsewhere.)
TEST_F(TrainHardeningTest, AnExportTheDiskRefusesNamesTheCheckpointToResumeFrom) {
  const std::string args = Common() + " --steps 3";
  auto [rc, text] = Train(args + " --out " + (dir_ / "sized"), dir_);
  ASSERT_EQ(rc, 0) << text;
  uint64_t rest = 0, exported = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir_ / "sized")) {
    struct stat st {};
    if (!e.is_regular_file() || ::stat(e.path().c_str(), &st) != 0) continue;
    (e.path().filename() == "model.safetensors" ? exported : rest) += st.st_blocks * 512;
  }
  ASSERT_GT(exported, 8192u);
  const std::string small = dir_ / "small";
  SmallTmpfs tmpfs(small, std::to_string((rest + exported / 2) / 4096 * 4096));
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a small tmpfs here: " << tmpfs.error();
  std::tie(rc, text) = Train(args + " --out " + small + "/o --swap-dir " + dir_.sub("swap"), dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("No space left on device"), std::string::npos) << text;
  EXPECT_NE(text.find("the checkpoint of step 3 is saved in " + small +
                      "/o/checkpoint: --resume writes the export"),
            std::string::npos)
      << text;
  tmpfs.Unmount();
}

// A loss log the disk refused rows of lost them without a word, and the
// row cut short merged with the next one; the run said "done". The row the
// disk took part of is cut off again, the first refusal and the count are
// said, and every row left is whole. (The log is a link to a file on a
// small tmpfs, the rest of the run on the scratch disk.)
TEST_F(TrainHardeningTest, RowsTheDiskRefusesAreSaidAndNoRowIsTorn) {
  const std::string small = dir_ / "tiny";
  SmallTmpfs tmpfs(small, "8k");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a small tmpfs here: " << tmpfs.error();
  std::ofstream(small + "/filler") << std::string(4096, 'x');  // one of its two pages
  std::ofstream(small + "/log.tsv").flush();
  const std::string out = dir_ / "logfull";
  fs::create_directories(out);
  fs::create_symlink(small + "/log.tsv", out + "/train_log.tsv");
  auto [rc, text] =
      Train(Common() + " --steps 150 --optimizer dram --no-progress --out " + out, dir_);
  const std::string log = Slurp(small + "/log.tsv");
  tmpfs.Unmount();
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("cannot append step "), std::string::npos) << text;
  EXPECT_NE(text.find("No space left on device"), std::string::npos) << text;
  EXPECT_NE(text.find("misses the rows of "), std::string::npos) << text;
  // Rows go on where a later, shorter one fits the room a refused one
  // did not: the steps missing are those the warning counts, from the
  // step it names.
  long long missing = 0;
  int first_missing = 0;
  const size_t said = text.find("misses the rows of ");
  ASSERT_NE(said, std::string::npos) << text;
  ASSERT_EQ(std::sscanf(text.c_str() + said, "misses the rows of %lld steps (from step %d)",
                        &missing, &first_missing),
            2)
      << text;
  std::istringstream rows(log);
  std::string row;
  int n = 0, last = 0;
  std::getline(rows, row);  // the header
  while (std::getline(rows, row)) {
    EXPECT_EQ(std::count(row.begin(), row.end(), '\t'), 5) << "torn row: " << row;
    const int step = std::stoi(row);
    EXPECT_TRUE(step == last + 1 || (last + 1 >= first_missing && step > last)) << row;
    last = step;
    ++n;
  }
  EXPECT_GT(n, 10);
  EXPECT_LT(n, 150);
  EXPECT_EQ(n + missing, 150) << text;
}

// A row is context + 1 bytes, and every offset where one fits is drawn,
// the last included: the text's final window was never drawn (its last
// input byte never trained), and a text of one row was refused.
TEST_F(TrainHardeningTest, ATextOfOneRowTrainsOnThatRow) {
  const std::string data = dir_ / "row.txt";
  std::ofstream(data) << "0123456789abcdefZ";  // --context 16: exactly one row
  auto [rc, text] = Train(
      " --layers 1 --channels 16 --heads 2 --context 16 --batch 2 --steps 3 --no-progress "
      "--optimizer dram --data " +
          data + " --out " + (dir_ / "row"),
      dir_);
  EXPECT_EQ(rc, 0) << text;
  std::ofstream(data, std::ios::trunc) << "0123456789abcdef";
  std::tie(rc, text) =
      Train(" --context 16 --steps 1 --data " + data + " --out " + (dir_ / "row2"), dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("fewer than the context + 1 (one row)"), std::string::npos) << text;
}

// Through --daemon the swap directories are ztierd's: --swap-dir is refused
// naming why, and a ZTIER_NVME_PATHS of the shell is not checked as this
// run's (it failed on a directory the run would never use).
TEST_F(TrainHardeningTest, SwapDirectoriesThroughADaemonAreTheDaemons) {
  const std::string socket = dir_ / "no.sock";
  auto [rc, text] = Train(Common() + " --steps 2 --daemon " + socket + " --swap-dir " +
                              (dir_ / "missing") + " --out " + (dir_ / "a"),
                          dir_);
  EXPECT_EQ(rc, 2) << text;
  EXPECT_NE(text.find("--swap-dir: through --daemon the swap directories are ztierd's"),
            std::string::npos)
      << text;
  ::setenv("ZTIER_NVME_PATHS", (dir_ / "missing").c_str(), 1);
  std::tie(rc, text) =
      Train(Common() + " --steps 2 --daemon " + socket + " --out " + (dir_ / "b"), dir_);
  ::unsetenv("ZTIER_NVME_PATHS");
  EXPECT_EQ(text.find("does not exist"), std::string::npos) << text;
  EXPECT_NE(text.find("no ztierd listens on " + socket), std::string::npos) << text;
}

// What would fail only once every step had run fails before the first: an
// --out so deep that the checkpoint's file names pass the system's path
// limit, an export path that cannot be replaced (a directory there).
TEST_F(TrainHardeningTest, AnOutTheCheckpointOrExportCannotUseIsRefusedUpFront) {
  std::string deep = dir_ / "deep";
  while (deep.size() < 4040) deep += "/" + std::string(200, 'd');
  deep.resize(4056);  // its own files fit, a checkpoint shard's (50 bytes more) does not
  fs::create_directories(deep);
  auto [rc, text] = Train(Common() + " --steps 50 --no-progress --out " + deep, dir_);
  const std::string said = text.substr(text.size() > 300 ? text.size() - 300 : 0);
  EXPECT_EQ(rc, 1) << said;
  EXPECT_NE(text.find("past the system's"), std::string::npos) << said;
  EXPECT_EQ(text.find("step 1/"), std::string::npos) << "it trained first\n" << said;
  const std::string out = dir_ / "direxport";
  fs::create_directories(out + "/model.safetensors");
  std::tie(rc, text) = Train(Common() + " --steps 50 --no-progress --out " + out, dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("model.safetensors is not a regular file (a directory)"), std::string::npos)
      << text;
  EXPECT_FALSE(fs::exists(out + "/checkpoint/manifest.json")) << text;
  // A comma in --out, with states on nvme in <out>/swap by default: the
  // swap paths' list split it in two, and the error blamed --swap-dir.
  std::tie(rc, text) =
      Train(Common() + " --steps 5 --optimizer nvme --no-progress --out " + (dir_ / "run,1"), dir_);
  EXPECT_NE(rc, 0) << text;
  EXPECT_NE(text.find("holds a comma"), std::string::npos) << text;
  EXPECT_EQ(text.find("--swap-dir was"), std::string::npos) << text;
  EXPECT_EQ(text.find("step 1/"), std::string::npos) << "it trained first\n" << text;
}

// A file size limit (ulimit -f) killed the run with SIGXFSZ before its first
// step, printing nothing: the pool's memory files are sized with ftruncate.
// The run now says what the limit refused.
TEST_F(TrainHardeningTest, AFileSizeLimitIsAnErrorNotASilentDeath) {
  const std::string out = dir_ / "fsize";
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  rlimit limit = before;
  limit.rlim_cur = 70000000;  // under the pool's 256 MiB memory files
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  Process r(Common() + " --steps 3 --out " + out, dir_ / "fsize.txt");  // inherits it
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &before), 0);
  const int rc = r.Wait();
  EXPECT_EQ(rc, 1) << r.output();
  EXPECT_NE(r.output().find("File too large"), std::string::npos) << r.output();
}

// Threads took `ulimit -s` as their stack size, and the rank threads'
// kernels overflowed 128 KiB of it: the run died of SIGSEGV at its first
// step. ztier's threads now get at least 8 MiB whatever the limit.
TEST_F(TrainHardeningTest, ASmallStackLimitTrains) {
  const std::string out = dir_ / "stack";
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_STACK, &before), 0);
  rlimit limit = before;
  limit.rlim_cur = 128 << 10;
  ASSERT_EQ(::setrlimit(RLIMIT_STACK, &limit), 0);
  Process r(Common() + " --steps 3 --out " + out, dir_ / "stack.txt");  // inherits it
  ASSERT_EQ(::setrlimit(RLIMIT_STACK, &before), 0);
  EXPECT_EQ(r.Wait(), 0) << r.output();
  EXPECT_TRUE(fs::exists(out + "/model.safetensors")) << r.output();
}

// `ztier-train ... 2>&1 | tee log` and a terminal's Ctrl-C, which reaches
// tee too: the run died of SIGPIPE as it said it was stopping, before the
// stop's checkpoint (or a reader gone early: `| head -3`). Output to a
// reader that is gone now goes nowhere, and the run ends as it would have.
TEST_F(TrainHardeningTest, AnOutputReaderThatIsGoneDoesNotKillTheRun) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  ::close(fds[0]);  // the reader is gone
  const std::string out = dir_ / "nopipe";
  std::vector<std::string> args = {ZTIER_TRAIN_BINARY,
                                   "--layers",
                                   "2",
                                   "--channels",
                                   "32",
                                   "--heads",
                                   "2",
                                   "--context",
                                   "16",
                                   "--batch",
                                   "4",
                                   "--data",
                                   dir_ / "text.txt",
                                   "--steps",
                                   "5",
                                   "--out",
                                   out};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0)
      << (WIFSIGNALED(st) ? ztier::StrCat("killed by signal ", WTERMSIG(st)) : std::string("exit"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint/manifest.json"));
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
}

// No thread to be had (the task limit of a user, a cgroup's pids.max)
// aborted the run with "terminate called" (exit 134) wherever the engine,
// the device, the runner or the kernels started one. Each is an error that
// names the thread. (As uid 65534: root has no task limit.)
TEST_F(TrainHardeningTest, NoThreadToBeHadIsAnErrorNotAnAbort) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to run as uid 65534 with a task limit";
  if (std::system("command -v setpriv >/dev/null && command -v prlimit >/dev/null") != 0) {
    GTEST_SKIP() << "no setpriv or prlimit (util-linux)";
  }
  std::string tmp = "/tmp/ztier-nproc-XXXXXX";  // mkdtemp's template: uid 65534 reaches it
  ASSERT_NE(::mkdtemp(tmp.data()), nullptr);
  ::chmod(tmp.c_str(), 0777);
  fs::copy_file(dir_ / "text.txt", tmp + "/text.txt");
  ::chmod((tmp + "/text.txt").c_str(), 0644);
  for (int tasks : {3, 6, 9, 11}) {
    const std::string out = tmp + "/o" + std::to_string(tasks);
    const std::string cmd = "setpriv --reuid=65534 --regid=65534 --clear-groups prlimit --nproc=" +
                            std::to_string(tasks) + " " + ZTIER_TRAIN_BINARY +
                            " --layers 2 --channels 32 --heads 2 --context 16 --batch 4 --data " +
                            tmp + "/text.txt --steps 3 --no-progress --out " + out + " > " + tmp +
                            "/said.txt 2>&1";
    const int st = std::system(cmd.c_str());
    const std::string text = Slurp(tmp + "/said.txt");
    ASSERT_TRUE(WIFEXITED(st)) << tasks << "\n" << text;
    if (WEXITSTATUS(st) == 0) continue;  // enough for this run
    EXPECT_EQ(WEXITSTATUS(st), 1) << tasks << "\n" << text;
    EXPECT_TRUE(text.find("cannot start ") != std::string::npos ||
                text.find("pthread_create") != std::string::npos)
        << tasks << "\n"
        << text;
    EXPECT_EQ(text.find("terminate called"), std::string::npos) << tasks << "\n" << text;
  }
  fs::remove_all(tmp);
}

// A --out whose name holds a control character trains: the job's name
// (derived from it) shows the character as '?' (it failed at registration,
// after the directories were made).
TEST_F(TrainHardeningTest, AnOutWithAControlCharacterTrains) {
  auto [rc, text] = Train(Common() + " --steps 2 --out " + (dir_ / "a\x01b"), dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_TRUE(fs::exists(dir_ / "a\x01b/model.safetensors")) << text;
}

// The job's name from a long --out: whole UTF-8 characters (cutting one in
// half was refused: "the job name is not valid UTF-8"), and two paths with
// one long end stay two names (one ztierd refused the second run's job).
TEST_F(TrainHardeningTest, LongOutPathsGiveValidAndDistinctJobNames) {
  std::string tail;
  for (int i = 0; i < 40; ++i) tail += "\u6570\u636e";  // 240 bytes of 3-byte characters
  tail += "/";
  for (int i = 0; i < 30; ++i) tail += "\u5b9e\u9a8c";
  tail += "a";
  std::vector<std::string> names;
  for (const char* root : {"one", "two"}) {
    const fs::path out = fs::path(dir_ / root) / tail;
    fs::create_directories(out);
    auto [rc, text] = Train(Common() + " --steps 1 --optimizer dram --out " + out.string(), dir_);
    ASSERT_EQ(rc, 0) << text;
    const std::string manifest = Slurp(out / "checkpoint/manifest.json");
    const size_t at = manifest.find("\"job\"");
    ASSERT_NE(at, std::string::npos) << manifest;
    const size_t open = manifest.find('"', manifest.find(':', at)) + 1;
    names.push_back(manifest.substr(open, manifest.find('"', open) - open));
    EXPECT_LE(names.back().size(), 256u) << names.back();
    EXPECT_TRUE(names.back().ends_with(tail.substr(tail.size() - 30))) << names.back();
  }
  EXPECT_NE(names[0], names[1]);
}

// What the up-front checks allow: a --summary in the --out the run makes.
TEST_F(TrainHardeningTest, ASummaryInsideANewOutIsWritten) {
  const std::string out = dir_ / "fresh/run";
  auto [rc, text] = Train(
      Common() + " --steps 3 --summary-skip 1 --out " + out + " --summary " + out + "/speed.json",
      dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_TRUE(fs::exists(out + "/speed.json")) << text;
}

// --summary's problems are said before training, not once the run is over
// (a directory below --out was never made: exit 1 after every step), a
// resumed run measures the steps it trains (its skip was counted from step
// 0: "no step was measured"), and a summary in a swap directory is refused
// (the engine removed it as it closed: exit 0 and no file).
TEST_F(TrainHardeningTest, SummaryPathsAndResumedRunsAreCheckedUpFront) {
  const std::string out = dir_ / "sum";
  auto [rc, text] = Train(
      Common() + " --steps 8 --out " + out + " --summary " + out + "/sub/deeper/s.json", dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_TRUE(fs::exists(out + "/sub/deeper/s.json")) << text;
  std::tie(rc, text) = Train(Common() + " --steps 8 --out " + (dir_ / "sw") + " --summary " +
                                 (dir_ / "sw/swap/ztier.swap"),
                             dir_);
  EXPECT_NE(rc, 0) << text;
  EXPECT_NE(text.find("is in swap directory"), std::string::npos) << text;
  EXPECT_EQ(text.find("step 1 "), std::string::npos) << "trained first: " << text;
  // Resumed at step 36 of 40: the default skip is of its 4 steps (1).
  std::tie(rc, text) = Train(
      Common() + " --steps 40 --checkpoint-every 36 --exit-after 36 --out " + (dir_ / "res"), dir_);
  ASSERT_NE(rc, 0) << text;  // --exit-after exits abruptly
  std::tie(rc, text) = Train(Common() + " --steps 40 --resume --out " + (dir_ / "res") +
                                 " --summary " + (dir_ / "res.json"),
                             dir_);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(Slurp(dir_ / "res.json").find("\"steps_measured\": 3, \"steps_skipped\": 1"),
            std::string::npos)
      << Slurp(dir_ / "res.json");
  // At --steps already: no step to measure, said at once.
  std::tie(rc, text) = Train(Common() + " --steps 40 --resume --out " + (dir_ / "res") +
                                 " --summary " + (dir_ / "res2.json"),
                             dir_);
  EXPECT_NE(rc, 0) << text;
  EXPECT_NE(text.find("this run trains no step to measure"), std::string::npos) << text;
}

// Relative names in the working directory, as a user types them: a
// --summary with no directory part (it threw from std::filesystem and
// aborted the run before it started), and a run whose working directory
// was removed before it started.
TEST_F(TrainHardeningTest, RelativeNamesInTheWorkingDirectory) {
  const fs::path here = fs::current_path();
  ASSERT_EQ(::chdir(dir_.path().c_str()), 0);
  auto [rc, text] =
      Train(Common() + " --steps 2 --summary-skip 1 --out rel --summary s.json", dir_);
  fs::create_directories(dir_ / "gone");
  ASSERT_EQ(::chdir((dir_ / "gone").c_str()), 0);
  fs::remove(dir_ / "gone");
  auto [grc, gtext] = Train(
      Common() + " --steps 1 --out " + (dir_ / "g") + " --summary s.json " + "--job-name gone",
      dir_);
  ASSERT_EQ(::chdir(here.c_str()), 0);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_TRUE(fs::exists(dir_ / "s.json")) << text;
  EXPECT_TRUE(fs::exists(dir_ / "rel/model.safetensors")) << text;
  EXPECT_LT(grc, 128) << gtext;
}

TEST_F(TrainHardeningTest, OutThatCannotBeCreatedNamesTheRealCause) {
  std::ofstream(dir_ / "file") << "x";
  auto [rc, text] = Train(Common() + " --steps 1 --out " + (dir_ / "file/sub"), dir_);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("Not a directory"), std::string::npos) << text;
  EXPECT_EQ(text.find("not_found"), std::string::npos) << text;
}

TEST_F(TrainHardeningTest, SettingsMeanWhatTheySay) {
  // The config's device beats ztier-train's default; a flag beats the config.
  std::ofstream(dir_ / "cpu.json")
      << R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}},
                                          "gradient_accumulation_steps": 2})";
  auto [rc, text] = Train(
      Common() + " --steps 1 --config " + (dir_ / "cpu.json") + " --out " + (dir_ / "c1"), dir_);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("optimizer states in dram"), std::string::npos) << text;
  EXPECT_NE(text.find("batch 4 x 2 micro-step(s)"), std::string::npos) << text;
  EXPECT_NE(
      text.find("zero_optimization.offload_optimizer.device = cpu (from " + (dir_ / "cpu.json")),
      std::string::npos)
      << text;
  EXPECT_FALSE(fs::exists(dir_ / "c1/swap")) << "a DRAM run made a swap directory";
  auto [frc, ftext] = Train(Common() + " --steps 1 --config " + (dir_ / "cpu.json") +
                                " --optimizer nvme --accumulation 1 --out " + (dir_ / "c2"),
                            dir_);
  ASSERT_EQ(frc, 0) << ftext;
  EXPECT_NE(ftext.find("optimizer states in nvme"), std::string::npos) << ftext;
  EXPECT_NE(ftext.find("(from --optimizer)"), std::string::npos) << ftext;

  // A wrong JSON type is an error, not a directory named "5".
  std::ofstream(dir_ / "five.json")
      << R"({"zero_optimization": {"offload_optimizer": {"nvme_path": 5}}})";
  auto [brc, btext] =
      Train(Common() + " --config " + (dir_ / "five.json") + " --out " + (dir_ / "c3"), dir_);
  EXPECT_EQ(brc, 2) << btext;
  EXPECT_NE(btext.find("expected a string or a list of strings"), std::string::npos) << btext;

  // Params on NVMe with many tiny units: the swap files size themselves.
  auto [nrc, ntext] = Train(
      Common() + " --layers 20 --channels 16 --params nvme --steps 2 --out " + (dir_ / "tiny"),
      dir_);
  ASSERT_EQ(nrc, 0) << ntext;
  EXPECT_TRUE(fs::is_empty(dir_ / "tiny/swap")) << "swap files left after a clean exit";
}

}  // namespace
