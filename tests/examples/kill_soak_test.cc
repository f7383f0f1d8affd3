// Soak (label slow): ztier-train killed with SIGKILL at random moments,
// again and again, and resumed each time from whatever it left, must end
// with exactly the model and loss log of an uninterrupted run: no kill point
// may lose or corrupt a committed checkpoint, leave a state that cannot be
// resumed, or change a single bit of the result. Kills land anywhere: in a
// step, in a checkpoint write, between files, in the export at the end.
//
// Runs for ZTIER_SOAK_SECONDS (default 120) of rounds; each round is one
// configuration (ranks, accumulation, tiers) and one seed, printed so a
// failure can be rerun. Run it with: ctest --preset release-slow
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/examples/train_testing.h"
#include "tests/testing/scratch_dir.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using ztier::testing::LogColumn;
using ztier::testing::ScratchDir;
using ztier::testing::Slurp;
using ztier::testing::TrainProcess;

struct Config {
  const char* name;
  const char* args;
};

constexpr Config kConfigs[] = {
    {"dram", " --ranks 1"},
    {"nvme-states", " --ranks 2 --accumulation 2 --optimizer nvme"},
    {"nvme-all", " --ranks 2 --optimizer nvme --params nvme"},
};

double SoakSeconds() {
  const char* env = std::getenv("ZTIER_SOAK_SECONDS");
  return env != nullptr ? std::atof(env) : 120.0;
}

TEST(KillSoakTest, RandomKillsNeverChangeTheResult) {
  ::setenv("ZTIER_WAIT_TIMEOUT", "60", 1);
  ScratchDir dir("soak");
  const std::string data = dir / "words.txt";
  ztier::testing::WriteWordSalad(data, 32 << 10);
  const auto end = Clock::now() + std::chrono::duration<double>(SoakSeconds());
  std::mt19937_64 rng(std::random_device{}());
  int rounds = 0, kills = 0;
  for (int round = 0; Clock::now() < end; ++round) {
    const Config& config = kConfigs[round % std::size(kConfigs)];
    const uint64_t seed = rng();
    const std::string common =
        " --layers 2 --channels 32 --heads 2 --context 16 --batch 4 --steps 12"
        " --checkpoint-every 1 --data " +
        data + " --seed " + std::to_string(seed % 1000) + config.args;
    SCOPED_TRACE(std::string("round ") + std::to_string(round) + ", " + config.name + ":" + common);
    const std::string whole = dir / ("whole-" + std::to_string(round));
    const std::string cut = dir / ("cut-" + std::to_string(round));

    // The uninterrupted run, timed: kills are drawn over its duration.
    const auto t0 = Clock::now();
    {
      TrainProcess p(common + " --out " + whole, dir / "whole.txt");
      ASSERT_EQ(p.Wait(), 0) << p.output();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::uniform_real_distribution<double> when(0.0, seconds * 1.1);

    // Killed until a run finishes; each start resumes if a checkpoint was
    // committed and starts afresh otherwise.
    int attempts = 0;
    for (;; ++attempts) {
      ASSERT_LT(attempts, 60) << "no run finished after 60 kills";
      const bool resume = fs::exists(fs::path(cut) / "checkpoint/manifest.json");
      TrainProcess p(common + (resume ? " --resume" : "") + " --out " + cut, dir / "cut.txt");
      const auto deadline = Clock::now() + std::chrono::duration<double>(when(rng));
      std::optional<int> rc;
      while (!(rc = p.TryWait()) && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!rc) {
        ::kill(p.pid(), SIGKILL);
        rc = p.Wait();  // 0 when it finished just before the kill
        if (*rc == 128 + SIGKILL) {
          ++kills;
          continue;
        }
      }
      ASSERT_EQ(*rc, 0) << "after " << attempts << " kills:\n" << p.output();
      break;
    }
    ASSERT_TRUE(fs::exists(fs::path(cut) / "model.safetensors"));
    EXPECT_EQ(Slurp(fs::path(whole) / "model.safetensors"),
              Slurp(fs::path(cut) / "model.safetensors"))
        << "the model differs after " << attempts << " kills";
    for (int column : {0, 1}) {  // step and loss (the rest are timings and byte counts)
      EXPECT_EQ(LogColumn(fs::path(whole) / "train_log.tsv", column),
                LogColumn(fs::path(cut) / "train_log.tsv", column))
          << "the loss log differs after " << attempts << " kills";
    }
    fs::remove_all(whole);
    fs::remove_all(cut);
    ++rounds;
  }
  std::printf("kill soak: %d rounds, %d kills, every result identical to the uninterrupted run\n",
              rounds, kills);
  EXPECT_GT(rounds, 0);
}

}  // namespace
