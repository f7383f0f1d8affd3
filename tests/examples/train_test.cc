// ztier-train end to end, as a user runs it: the loss falls on the real
// text corpus within a short run, and a run killed right after a checkpoint
// and resumed from it ends with exactly the weights of an uninterrupted run.
// Runs the installed-layout binary (ZTIER_TRAIN_BINARY) in a scratch dir.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testing/scratch_dir.h"

namespace {

namespace fs = std::filesystem;

using ztier::testing::ScratchDir;

// Runs ztier-train with `args`; its exit code (or -1). A run that hangs is
// killed after 5 minutes (exit 124) rather than waiting for ctest's timeout,
// and a rank that waits 60 s on the engine fails with its own message.
int Train(const std::string& args) {
  const std::string cmd = "ZTIER_WAIT_TIMEOUT=60 timeout -k 10 300 " +
                          std::string(ZTIER_TRAIN_BINARY) + " --no-progress " + args + " 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::vector<double> Losses(const std::string& log) {
  std::ifstream in(log);
  std::string line;
  std::getline(in, line);  // header
  std::vector<double> out;
  while (std::getline(in, line)) {
    std::istringstream row(line);
    int step;
    double loss;
    row >> step >> loss;
    out.push_back(loss);
  }
  return out;
}

std::string Bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

constexpr char kSmall[] =
    " --layers 2 --channels 64 --heads 4 --context 32 --batch 8 --lr 3e-3 --seed 7";

TEST(TrainTest, LossFallsOnTheFortunesCorpus) {
  if (!fs::exists("/usr/share/games/fortunes/fortunes")) {
    GTEST_SKIP() << "no fortunes corpus (Debian package 'fortunes'; scripts/install_deps.sh)";
  }
  ScratchDir dir("train");
  ASSERT_EQ(Train(std::string(kSmall) + " --steps 80 --out " + (dir / "run")), 0);
  const std::vector<double> loss = Losses(dir / "run/train_log.tsv");
  ASSERT_EQ(loss.size(), 80u);
  // A byte-level model starts near ln(256) = 5.55 nats; after 80 steps the
  // mean of the last ten must be 2 nats lower (this model reaches about 3.3;
  // a longer run goes on down).
  double tail = 0;
  for (size_t i = loss.size() - 10; i < loss.size(); ++i) tail += loss[i] / 10;
  EXPECT_GT(loss.front(), 5.0);
  EXPECT_LT(tail, 3.5) << "first " << loss.front() << ", last ten " << tail;
  EXPECT_TRUE(fs::exists(dir / "run/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "run/checkpoint/manifest.json"));
}

TEST(TrainTest, KilledAndResumedRunMatchesAnUninterruptedOne) {
  ScratchDir dir("train");
  const std::string data = dir / "text.txt";
  {
    std::ofstream text(data);
    for (int i = 0; i < 200; ++i) {
      text << "The quick brown fox jumps over the lazy dog " << i << ". ";
    }
  }
  const std::string common = std::string(kSmall) + " --steps 6 --data " + data +
                             " --optimizer nvme --accumulation 2 --ranks 2";
  ASSERT_EQ(Train(common + " --out " + (dir / "whole")), 0);
  // Dies abruptly (no destructors, no flush) right after step 3's checkpoint.
  ASSERT_EQ(Train(common + " --checkpoint-every 3 --exit-after 3 --out " + (dir / "cut")), 3);
  ASSERT_FALSE(fs::exists(dir / "cut/model.safetensors"));
  ASSERT_EQ(Train(common + " --resume --out " + (dir / "cut")), 0);
  const std::string whole = Bytes(dir / "whole/model.safetensors");
  ASSERT_FALSE(whole.empty());
  EXPECT_EQ(whole, Bytes(dir / "cut/model.safetensors"));
  const std::vector<double> a = Losses(dir / "whole/train_log.tsv");
  const std::vector<double> b = Losses(dir / "cut/train_log.tsv");
  EXPECT_EQ(a, b);  // the resumed run appended steps 4..6 to the same log
}

TEST(TrainTest, BadFlagsAreUsageErrors) {
  EXPECT_EQ(Train("--steps 0"), 2);
  EXPECT_EQ(Train("--heads 3 --channels 64"), 2);
  EXPECT_EQ(Train("--params nvme --optimizer dram"), 2);
  EXPECT_EQ(Train("--no-such-flag"), 2);
  ScratchDir dir("train");
  EXPECT_EQ(Train("--data " + (dir / "missing.txt") + " --out " + (dir / "o")), 1);
}

}  // namespace
