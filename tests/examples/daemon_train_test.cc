// ztier-train through ztierd, as a user runs it: the same model as the
// embedded engine gives, bit for bit; a ztierd killed (SIGKILL) mid-run
// makes the run fail at once with a clear error, and a restarted ztierd plus
// `ztier-train --resume` ends with exactly the weights of an uninterrupted
// run; two runs of one user share a ztierd. Runs the installed-layout binaries (ZTIER_TRAIN_BINARY,
// ZTIERD_BINARY) in a scratch dir.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/examples/train_testing.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/ztierd_process.h"

namespace {

namespace fs = std::filesystem;

using ztier::testing::LogColumn;
using ztier::testing::Losses;
using ztier::testing::ScratchDir;
using ztier::testing::Slurp;
using ztier::testing::TrainProcess;
using ztier::testing::WriteWordSalad;
using ztier::testing::ZtierdProcess;

int Train(const std::string& args) {
  ScratchDir logs("train-log");
  return ztier::testing::TrainPrinted(args, logs / "output.txt");
}

constexpr char kSmall[] =
    " --layers 2 --channels 64 --heads 4 --context 32 --batch 8 --lr 3e-3 --seed 7"
    " --optimizer dram --ranks 2 --accumulation 2";

TEST(DaemonTrainTest, ThroughZtierdTheModelIsTheEmbeddedOneBitForBit) {
  ScratchDir dir("daemon-train");
  const std::string data = dir / "words.txt";
  WriteWordSalad(data, 32 << 10);
  const std::string common = std::string(kSmall) + " --steps 8 --data " + data;
  ASSERT_EQ(Train(common + " --out " + (dir / "embedded")), 0);
  ZtierdProcess d(ZTIERD_BINARY, {});
  ASSERT_EQ(Train(common + " --daemon " + d.socket() + " --out " + (dir / "daemon")), 0) << d.log();
  const std::string embedded = Slurp(dir / "embedded/model.safetensors");
  ASSERT_FALSE(embedded.empty());
  EXPECT_EQ(embedded, Slurp(dir / "daemon/model.safetensors"));
  EXPECT_EQ(Losses(dir / "embedded/train_log.tsv"), Losses(dir / "daemon/train_log.tsv"));
  // The checkpoint the client wrote is the embedded engine's format: it
  // resumes embedded.
  ASSERT_EQ(Train(std::string(kSmall) + " --steps 10 --data " + data + " --resume --out " +
                  (dir / "daemon")),
            0);
}

// NVMe placements through a ztierd without swap directories name what the
// user can change (the engine's own message named its swap settings, which
// only ztierd's administrator can set; --params nvme blamed a flag not given).
TEST(DaemonTrainTest, NvmePlacementsOnAZtierdWithoutSwapSayWhatToDo) {
  ScratchDir dir("daemon-noswap");
  const std::string data = dir / "words.txt";
  WriteWordSalad(data, 32 << 10);
  ZtierdProcess d(ZTIERD_BINARY, {});
  const std::string common = " --layers 2 --channels 32 --heads 2 --context 16 --steps 1 --data " +
                             data + " --daemon " + d.socket();
  auto [rc, out] =
      ztier::testing::RunTrain(common + " --optimizer nvme --out " + (dir / "a"), dir / "a.txt");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("this ztierd has no swap directories"), std::string::npos) << out;
  EXPECT_NE(out.find("--optimizer dram"), std::string::npos) << out;
  std::tie(rc, out) =
      ztier::testing::RunTrain(common + " --params nvme --out " + (dir / "b"), dir / "b.txt");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("which are in dram (ztier-train's default through ztierd): --optimizer nvme"),
            std::string::npos)
      << out;
}

// An engine setting of the shell (ZTIER_DRAM_BUDGET) is ztierd's through
// --daemon: the run warns of it, and its setup does not list it as the
// run's (it was listed beside ztierd's own budget).
TEST(DaemonTrainTest, AnEngineSettingOfTheShellIsNotListedAsTheRuns) {
  ScratchDir dir("daemon-engine-setting");
  const std::string data = dir / "words.txt";
  WriteWordSalad(data, 32 << 10);
  ZtierdProcess d(ZTIERD_BINARY, {});
  ::setenv("ZTIER_DRAM_BUDGET", "1G", 1);
  auto [rc, out] = ztier::testing::RunTrain(
      " --layers 2 --channels 32 --heads 2 --context 16 --steps 1 --data " + data + " --daemon " +
          d.socket() + " --lr 0.002 --out " + (dir / "a"),
      dir / "a.txt");
  ::unsetenv("ZTIER_DRAM_BUDGET");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ztier.dram_budget (from ZTIER_DRAM_BUDGET) is an engine setting"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("setting ztier.dram_budget"), std::string::npos) << out;
  EXPECT_NE(out.find("setting optimizer.params.lr = 0.002 (from --lr)"), std::string::npos) << out;
}

// --summary named the run's own state dtype (fp32, the default) where
// ztierd's setting (int8) was the one the job ran with and saved.
TEST(DaemonTrainTest, TheSummarySaysTheStateDtypeTheJobRanWith) {
  ScratchDir dir("daemon-dtype");
  const std::string data = dir / "words.txt";
  WriteWordSalad(data, 32 << 10);
  const std::string config = dir / "ztierd.json";
  {
    std::FILE* f = std::fopen(config.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(R"({"ztier": {"state_dtype": "int8"}})", f);
    std::fclose(f);
  }
  ZtierdProcess d(ZTIERD_BINARY, {"--config", config});
  const std::string summary = dir / "summary.json";
  ASSERT_EQ(
      Train(" --layers 2 --channels 32 --heads 2 --context 16 --steps 3 --summary-skip 1"
            " --data " +
            data + " --daemon " + d.socket() + " --out " + (dir / "run") + " --summary " + summary),
      0)
      << d.log();
  EXPECT_NE(Slurp(summary).find(R"("state_dtype": "int8")"), std::string::npos) << Slurp(summary);
  EXPECT_NE(Slurp(dir / "run/checkpoint/manifest.json").find("int8"), std::string::npos);
}

TEST(DaemonTrainTest, AKilledZtierdFailsTheRunFastAndARestartedOneResumesIt) {
  ScratchDir dir("daemon-train");
  const std::string data = dir / "words.txt";
  WriteWordSalad(data, 32 << 10);
  const int steps = 60;
  const std::string common =
      std::string(kSmall) + " --steps " + std::to_string(steps) + " --data " + data;
  ASSERT_EQ(Train(common + " --out " + (dir / "whole")), 0);

  ZtierdProcess d(ZTIERD_BINARY, {});
  const std::string cut = dir / "cut";
  ::setenv("ZTIER_WAIT_TIMEOUT", "60", 1);
  TrainProcess run(common + " --checkpoint-every 5 --daemon " + d.socket() + " --out " + cut,
                   dir / "cut-output.txt");
  // Kill ztierd once the run has checkpointed and gone on.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  while (std::chrono::steady_clock::now() < deadline && !run.TryWait().has_value() &&
         LogColumn(cut + "/train_log.tsv", 0).size() < 8) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_FALSE(run.TryWait().has_value()) << run.output();
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_EQ(d.SignalAndWait(SIGKILL), 128 + SIGKILL);
  const int rc = run.Wait(std::chrono::seconds(60));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("ztier-train exited %d %.2f s after ztierd was killed:\n%s\n", rc, seconds,
              run.output().c_str());
  EXPECT_EQ(rc, 1);
  EXPECT_LT(seconds, 10.0);
  EXPECT_NE(run.output().find("ztierd at " + d.socket()), std::string::npos) << run.output();
  EXPECT_FALSE(fs::exists(cut + "/model.safetensors"));
  // It says what is left to go on from (it said only ztierd's failure).
  const size_t said = run.output().find("the last checkpoint saved, of step ");
  ASSERT_NE(said, std::string::npos) << run.output();
  const int saved_step = std::atoi(run.output().c_str() + said + 35);
  EXPECT_GE(saved_step, 5) << run.output();
  EXPECT_NE(run.output().find("--resume continues from it"), std::string::npos) << run.output();

  d.Start();  // a new ztierd on the same path; the DRAM state is gone
  ASSERT_EQ(Train(common + " --resume --daemon " + d.socket() + " --out " + cut), 0) << d.log();
  const std::string whole = Slurp(dir / "whole/model.safetensors");
  ASSERT_FALSE(whole.empty());
  EXPECT_EQ(whole, Slurp(cut + "/model.safetensors"));
  EXPECT_EQ(Losses(dir / "whole/train_log.tsv"), Losses(cut + "/train_log.tsv"));
}

// Two runs of one user on one ztierd at once, on their own --out: each is
// its own job (named from its --out), neither is refused or replaced, and
// each ends with the model it trains alone.
TEST(DaemonTrainTest, TwoRunsOfOneUserShareAZtierd) {
  ScratchDir dir("daemon-train");
  const std::string data = dir / "words.txt";
  WriteWordSalad(data, 32 << 10);
  const std::string common =
      " --layers 2 --channels 32 --heads 2 --context 16 --batch 4 --optimizer dram --steps 12"
      " --data " +
      data;
  ASSERT_EQ(Train(common + " --out " + (dir / "alone")), 0);
  ZtierdProcess d(ZTIERD_BINARY, {});
  ::setenv("ZTIER_WAIT_TIMEOUT", "60", 1);
  TrainProcess a(common + " --daemon " + d.socket() + " --out " + (dir / "a"), dir / "a.txt");
  TrainProcess b(common + " --daemon " + d.socket() + " --out " + (dir / "b"), dir / "b.txt");
  EXPECT_EQ(a.Wait(std::chrono::seconds(120)), 0) << a.output() << d.log();
  EXPECT_EQ(b.Wait(std::chrono::seconds(120)), 0) << b.output() << d.log();
  const std::string alone = Slurp(dir / "alone/model.safetensors");
  ASSERT_FALSE(alone.empty());
  EXPECT_EQ(alone, Slurp(dir / "a/model.safetensors"));
  EXPECT_EQ(alone, Slurp(dir / "b/model.safetensors"));
}

// A second run on the --out of one training through the same ztierd was
// told that another job had its name, and to give it another --job-name,
// which only ran into the first run's checkpoint lock. It is told that the
// --out is taken.
TEST(DaemonTrainTest, ASecondRunOnOneOutThroughZtierdIsToldTheOutIsTaken) {
  ScratchDir dir("daemon-same-out");
  const std::string data = dir / "words.txt";
  WriteWordSalad(data, 32 << 10);
  ZtierdProcess d(ZTIERD_BINARY, {});
  const std::string common = " --layers 1 --channels 32 --heads 2 --context 16 --batch 2 --data " +
                             data + " --daemon " + d.socket() + " --out " + (dir / "same");
  TrainProcess first(common + " --steps 100000", dir / "first.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (std::chrono::steady_clock::now() < deadline && !first.TryWait().has_value() &&
         LogColumn(dir / "same/train_log.tsv", 0).empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_FALSE(first.TryWait().has_value()) << first.output();
  auto [rc, out] = ztier::testing::RunTrain(common + " --steps 10 --overwrite", dir / "second.txt");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("another run on --out " + (dir / "same")), std::string::npos) << out;
  EXPECT_EQ(out.find("--job-name"), std::string::npos) << out;
  EXPECT_FALSE(first.TryWait().has_value()) << first.output();
  // Its pool is ztierd's, made with ztierd's settings (huge pages off
  // here): no hint at the kernel's policy or at this client's setting.
  EXPECT_NE(first.output().find("4 KiB pages"), std::string::npos) << first.output();
  EXPECT_EQ(first.output().find("ztier.huge_pages"), std::string::npos) << first.output();
}

}  // namespace
