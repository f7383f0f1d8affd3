// The stage-3 runner end to end on the host device backend: the GPT example
// trained through Session / Model / Stage3Runner against the same model
// trained with every weight in memory (tests/client/memory_trainer.h), bit
// for bit, over placements, ranks, clipping, accumulation and prefetch
// depths; the live-bytes cap read from the device's high-water mark; the
// overlap of copies with compute in the device timeline; resume from a
// checkpoint; and errors for bad use.
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "client/transport.h"
#include "client/ztier.h"
#include "common/file_util.h"
#include "engine/checkpoint_manifest.h"
#include "examples/gpt/gpt.h"
#include "nvme/io_backend.h"
#include "tests/client/memory_trainer.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/spawn_self.h"
#include "tests/testing/test_daemon.h"

namespace ztier::client {
namespace {

using engine::Tier;

constexpr char kText[] =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way.";

using testing::ScratchDir;

gpt::Config TinyGpt(bool tied = true) {
  return {.vocab = 256, .context = 16, .channels = 32, .layers = 2, .heads = 4, .tied_head = tied};
}

// Batch rows of context + 1 tokens for (micro-step, rank): windows of kText.
std::vector<int32_t> Tokens(const gpt::Config& c, int batch, int64_t micro, int rank, int ranks) {
  const size_t len = sizeof(kText) - 1;
  std::vector<int32_t> t;
  for (int b = 0; b < batch; ++b) {
    const size_t start =
        static_cast<size_t>(((micro * ranks + rank) * batch + b) * 7) % (len - c.context - 1);
    for (int i = 0; i <= c.context; ++i) t.push_back(static_cast<unsigned char>(kText[start + i]));
  }
  return t;
}

struct TrainSetup {
  Tier optimizer_tier = Tier::kDram;
  Tier param_tier = Tier::kDram;
  int ranks = 1;
  float clip = 0.0f;
  int accumulation = 1;
  int prefetch = 2;
  uint64_t max_live_bytes = 0;
  uint64_t persistence_threshold = 0;
  gpt::Config gpt = TinyGpt();
  int batch = 2;
  // Host devices in their test mode: copies wait 2 ms and fail the stream if
  // their source changes before they run (a lease released too early).
  bool checked_copies = false;
  // The ranks meet in the job's collective region (MakeJobCollectives)
  // rather than through local collectives.
  bool job_collectives = false;
  engine::StateDtype state_dtype = engine::StateDtype::kFp32;
  // Copies under this many bytes are coalesced (RunnerOptions; 0: each
  // unit alone). The default takes every unit of the tiny GPT.
  uint64_t coalesce_bytes = RunnerOptions{}.coalesce_bytes;
};

std::string Name(const TrainSetup& s) {
  return StrCat(
      s.optimizer_tier == Tier::kNvme ? (s.param_tier == Tier::kNvme ? "nvmeall" : "nvme") : "dram",
      "_r", s.ranks, s.clip > 0 ? "_clip" : "", "_acc", s.accumulation, "_d", s.prefetch,
      s.checked_copies ? "_checked" : "", s.job_collectives ? "_job" : "",
      s.state_dtype == engine::StateDtype::kInt8 ? "_int8" : "",
      s.gpt.layers != TinyGpt().layers ? StrCat("_l", s.gpt.layers) : "",
      s.coalesce_bytes == 0                                ? "_alone"
      : s.coalesce_bytes == RunnerOptions{}.coalesce_bytes ? ""
                                                           : StrCat("_coalesce", s.coalesce_bytes));
}

engine::OptimizerConfig Optimizer(const TrainSetup& s) {
  engine::OptimizerConfig o;
  o.hyper.lr = 3e-3f;
  o.hyper.weight_decay = 0.01f;
  o.clip_norm = s.clip;
  o.grad_accumulation = s.accumulation;
  return o;
}

SessionOptions Options(const TrainSetup& s, const std::string& swap_dir) {
  SessionOptions o;
  o.settings.dram_budget_bytes = uint64_t{256} << 20;
  o.settings.huge_pages = engine::HugePages::kNone;
  // Checked copies go with poisoned param slots: a lease given back before
  // its copy ran then always shows (params on NVMe).
  o.settings.poison_released_params = s.checked_copies;
  o.settings.state_dtype = s.state_dtype;
  if (s.optimizer_tier == Tier::kNvme) {
    o.settings.nvme_paths = {swap_dir + "/a", swap_dir + "/b"};
    for (const std::string& p : o.settings.nvme_paths) std::filesystem::create_directories(p);
    o.settings.nvme_capacity_per_path = uint64_t{64} << 20;
    o.settings.stripe_bytes = 64 << 10;
    o.settings.buffer_count = 3;
  }
  return o;
}

// What a training run leaves behind, for comparison.
struct RunResult {
  std::vector<std::vector<float>> losses;  // [micro-step][rank]
  std::vector<std::vector<float>> master;  // [unit] padded
  std::vector<RunnerStats> stats;          // per rank
  std::vector<MemoryStats> param_memory;   // per rank
  std::vector<TimelineSpan> timeline;      // rank 0
};

Session::ModelSpec Spec(const TrainSetup& s, const std::string& name) {
  return {.name = name,
          .units = gpt::UnitSpecs(s.gpt),
          .optimizer = Optimizer(s),
          .optimizer_tier = s.optimizer_tier,
          .param_tier = s.param_tier,
          .world_size = s.ranks};
}

std::vector<std::vector<float>> InitialWeights(const gpt::Config& c, const Model& model) {
  std::vector<std::vector<float>> w;
  for (int k = 0; k < model.units(); ++k) {
    w.emplace_back(model.layout(k).numel);
    gpt::InitUnit(c, k, 1234, model.layout(k), w.back());
  }
  return w;
}

// Registers the model and sets its initial weights.
Result<std::unique_ptr<Model>> RegisterWithWeights(Session& session, const TrainSetup& s,
                                                   const std::string& name) {
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, session.RegisterModel(Spec(s, name)));
  const auto init = InitialWeights(s.gpt, *model);
  for (int k = 0; k < model->units(); ++k) {
    ZT_RETURN_IF_ERROR(model->SetWeights(k, init[k].data(), init[k].size()));
  }
  return model;
}

// The GPT of `s` on `device`, laid out as `model`'s units are.
Result<std::unique_ptr<gpt::Gpt>> GptFor(const TrainSetup& s, const Model& model, Device& device) {
  std::vector<engine::UnitLayout> layouts;
  for (int k = 0; k < model.units(); ++k) layouts.push_back(model.layout(k));
  return gpt::Gpt::Create(s.gpt, s.batch, device, layouts);
}

// Trains micro-steps [first, last) through the runner, one thread per rank
// (or only rank `only_rank`, whose peers run in other processes).
Status TrainThroughRunner(const TrainSetup& s, Model& model, int64_t first, int64_t last,
                          RunResult* out, bool timeline = false, int only_rank = -1) {
  std::vector<std::unique_ptr<Collectives>> coll;
  if (s.ranks > 1 && !s.job_collectives) {
    ZT_ASSIGN_OR_RETURN(coll, MakeLocalCollectives(s.ranks));
  }
  out->losses.assign(last - first, std::vector<float>(s.ranks, 0.0f));
  out->stats.assign(s.ranks, {});
  out->param_memory.assign(s.ranks, {});
  std::vector<Status> status(s.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < s.ranks; ++r) {
    if (only_rank >= 0 && r != only_rank) continue;
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        HostDeviceOptions device_options;
        if (s.checked_copies) {
          device_options = {.copy_delay = std::chrono::milliseconds(2), .check_copy_sources = true};
        }
        ZT_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, MakeHostDevice(device_options));
        dev->EnableTimeline(timeline);
        ZT_ASSIGN_OR_RETURN(std::unique_ptr<gpt::Gpt> net, GptFor(s, model, *dev));
        std::unique_ptr<Collectives> job_coll;
        if (s.job_collectives) {
          ZT_ASSIGN_OR_RETURN(job_coll, MakeJobCollectives(model, r, *dev));
        }
        Collectives* rank_coll =
            s.job_collectives ? job_coll.get() : (s.ranks > 1 ? coll[r].get() : nullptr);
        const RunnerOptions options{.prefetch_depth = s.prefetch,
                                    .max_live_bytes = s.max_live_bytes,
                                    .persistence_threshold = s.persistence_threshold,
                                    .coalesce_bytes = s.coalesce_bytes,
                                    .timeout = std::chrono::seconds(60),
                                    .record_compute_spans = timeline};
        ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                            Stage3Runner::Create(model, r, *dev, rank_coll, options));
        gpt::SourceOf<Stage3Runner> source(*runner);
        const float scale = 1.0f / static_cast<float>(s.ranks * s.accumulation);
        for (int64_t micro = first; micro < last; ++micro) {
          const std::vector<int32_t> tokens = Tokens(s.gpt, s.batch, micro, r, s.ranks);
          ZT_ASSIGN_OR_RETURN(float loss, net->TrainMicroStep(source, tokens.data(), scale));
          out->losses[micro - first][r] = loss;
          ZT_RETURN_IF_ERROR(runner->Step());
        }
        out->stats[r] = runner->stats();
        runner.reset();
        out->param_memory[r] = dev->memory(MemoryPurpose::kParams);
        if (r == 0) out->timeline = dev->timeline();
        return Status::Ok();
      }();
      // Said at once: the other ranks may wait in a collective for long.
      if (!status[r].ok()) std::fprintf(stderr, "rank %d: %s\n", r, status[r].ToString().c_str());
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& st : status) ZT_RETURN_IF_ERROR(st);
  return Status::Ok();
}

// Every unit's fp32 master once the engine has published `steps`.
Status ReadMasters(Model& model, int64_t steps, RunResult* out) {
  ZT_RETURN_IF_ERROR(model.WaitPublished(steps, std::chrono::seconds(60)));
  out->master.resize(model.units());
  for (int k = 0; k < model.units(); ++k) ZT_RETURN_IF_ERROR(model.ReadMaster(k, &out->master[k]));
  return Status::Ok();
}

Result<RunResult> RunZtier(const TrainSetup& s, int steps, bool timeline = false) {
  ScratchDir swap("runner-swap");
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Session> session,
                      testing::OpenTestSession(Options(s, swap.path())));
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, RegisterWithWeights(*session, s, "gpt"));
  RunResult out;
  ZT_RETURN_IF_ERROR(TrainThroughRunner(s, *model, 0, steps * s.accumulation, &out, timeline));
  ZT_RETURN_IF_ERROR(ReadMasters(*model, steps, &out));
  return out;
}

Result<RunResult> RunInMemory(const TrainSetup& s, int steps) {
  // The layouts of the same registration (padding depends on the ranks).
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Session> session,
                      testing::OpenTestSession(Options(TrainSetup{}, "")));
  TrainSetup dram = s;
  dram.optimizer_tier = dram.param_tier = Tier::kDram;
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, session->RegisterModel(Spec(dram, "layouts")));
  std::vector<engine::UnitLayout> layouts;
  for (int k = 0; k < model->units(); ++k) layouts.push_back(model->layout(k));
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<testing::MemoryTrainer> ref,
                      testing::MemoryTrainer::Create(s.gpt, layouts, Optimizer(s), s.ranks, s.batch,
                                                     InitialWeights(s.gpt, *model), s.state_dtype));
  RunResult out;
  for (int64_t micro = 0; micro < steps * s.accumulation; ++micro) {
    std::vector<std::vector<int32_t>> tokens;
    std::vector<const int32_t*> ptrs;
    for (int r = 0; r < s.ranks; ++r) tokens.push_back(Tokens(s.gpt, s.batch, micro, r, s.ranks));
    for (const auto& t : tokens) ptrs.push_back(t.data());
    ZT_ASSIGN_OR_RETURN(std::vector<float> losses, ref->MicroStep(ptrs));
    out.losses.push_back(losses);
  }
  for (int k = 0; k < model->units(); ++k) out.master.push_back(ref->master(k));
  return out;
}

void ExpectSameTraining(const RunResult& a, const RunResult& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    ASSERT_EQ(a.losses[i].size(), b.losses[i].size());
    for (size_t r = 0; r < a.losses[i].size(); ++r) {
      // Bit for bit: the same kernels in the same order on the same bf16 weights.
      EXPECT_EQ(std::memcmp(&a.losses[i][r], &b.losses[i][r], sizeof(float)), 0)
          << "micro-step " << i << " rank " << r << ": " << a.losses[i][r] << " vs "
          << b.losses[i][r];
    }
  }
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t k = 0; k < a.master.size(); ++k) {
    ASSERT_EQ(a.master[k].size(), b.master[k].size());
    EXPECT_EQ(std::memcmp(a.master[k].data(), b.master[k].data(), a.master[k].size() * 4), 0)
        << "fp32 master of unit " << k;
  }
}

// Loads `ckpt` into a fresh model and trains micro-steps [first, last).
Status ResumeAndTrain(Model& model, const std::string& ckpt, const TrainSetup& s, int64_t first,
                      int64_t last, RunResult* out) {
  ZT_RETURN_IF_ERROR(model.LoadCheckpoint(ckpt));
  if (model.published_step() != first / s.accumulation) {
    return Status::Internal(StrCat("the checkpoint holds step ", model.published_step()));
  }
  ZT_RETURN_IF_ERROR(TrainThroughRunner(s, model, first, last, out));
  return ReadMasters(model, last / s.accumulation, out);
}

// The first part of a run followed by its resumed part equals `whole`.
void ExpectResumedEqualsWhole(const RunResult& first, const RunResult& second,
                              const RunResult& whole) {
  RunResult resumed;
  resumed.losses = first.losses;
  resumed.losses.insert(resumed.losses.end(), second.losses.begin(), second.losses.end());
  resumed.master = second.master;
  ExpectSameTraining(resumed, whole);
}

class RunnerEquivalenceTest : public ::testing::TestWithParam<TrainSetup> {};

TEST_P(RunnerEquivalenceTest, MatchesInMemoryTrainingBitForBit) {
  const TrainSetup s = GetParam();
  const int steps = 3;
  Result<RunResult> ztier = RunZtier(s, steps);
  ASSERT_TRUE(ztier.ok()) << ztier.status();
  Result<RunResult> ref = RunInMemory(s, steps);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ExpectSameTraining(*ztier, *ref);
  // The loss moved: training happened.
  EXPECT_NE(ztier->losses.front()[0], ztier->losses.back()[0]);
  for (const RunnerStats& st : ztier->stats) {
    EXPECT_EQ(st.micro_steps, steps * s.accumulation);
    if (s.prefetch > 0) {
      EXPECT_GT(st.prefetch_hits, 0);
    }
    EXPECT_EQ(st.order_changes, 0);
    EXPECT_GT(st.h2d_bytes, 0u);
    EXPECT_GT(st.d2h_bytes, 0u);
  }
}

std::vector<TrainSetup> EquivalenceCases() {
  std::vector<TrainSetup> cases;
  const int depths[] = {0, 1, 3};
  int i = 0;
  for (Tier tier : {Tier::kDram, Tier::kNvme}) {
    for (int ranks : {1, 2}) {
      for (float clip : {0.0f, 0.05f}) {
        for (int accum : {1, 2}) {
          TrainSetup s;
          s.optimizer_tier = tier;
          s.ranks = ranks;
          s.clip = clip;
          s.accumulation = accum;
          s.prefetch = depths[i++ % 3];
          cases.push_back(s);
        }
      }
    }
  }
  // Every depth on one configuration, and params on NVMe too.
  for (int depth : {0, 1, 3}) {
    TrainSetup s;
    s.ranks = 2;
    s.clip = 0.05f;
    s.prefetch = depth;
    s.optimizer_tier = s.param_tier = Tier::kNvme;
    cases.push_back(s);
  }
  // The ranks meet in the job's collective region: bit-identical to local
  // collectives (and to the in-memory reference).
  for (int ranks : {2, 3}) {
    TrainSetup s;
    s.ranks = ranks;
    s.clip = 0.05f;
    s.accumulation = ranks == 2 ? 2 : 1;
    s.optimizer_tier = ranks == 2 ? Tier::kDram : Tier::kNvme;
    s.job_collectives = true;
    cases.push_back(s);
  }
  // Slow, checked copies and poisoned param slots: a lease or buffer given
  // back before the copy that reads it has run fails the run instead of
  // passing on a fast copy thread.
  for (int ranks : {1, 2}) {
    for (Tier tier : {Tier::kDram, Tier::kNvme}) {
      TrainSetup s;
      s.ranks = ranks;
      s.prefetch = 2;
      s.optimizer_tier = s.param_tier = tier;
      s.checked_copies = true;
      cases.push_back(s);
    }
  }
  // Each unit copied alone, and runs of units split between coalesced
  // copies (a limit that takes two or three of the tiny GPT's units).
  for (uint64_t coalesce : {uint64_t{0}, uint64_t{40} << 10}) {
    for (int ranks : {1, 2}) {
      TrainSetup s;
      s.ranks = ranks;
      s.clip = 0.05f;
      s.accumulation = ranks;
      s.prefetch = ranks;
      s.checked_copies = ranks == 1;
      s.persistence_threshold = coalesce == 0 ? 0 : 8192;
      s.coalesce_bytes = coalesce;
      cases.push_back(s);
    }
  }
  // Fetch runs (R > 1): a four-layer tiny GPT and a limit its blocks are
  // just over (a block's 25.6 KB whole, its shard under half of it): two or
  // three side by side take an all-gather of one span, a block left over
  // one of its own; checked copies with two ranks.
  for (int ranks : {2, 3}) {
    TrainSetup s;
    s.ranks = ranks;
    s.clip = 0.05f;
    s.accumulation = 2;
    s.gpt.layers = 4;
    s.checked_copies = ranks == 2;
    s.coalesce_bytes = 25000;
    cases.push_back(s);
  }
  return cases;
}

// 8-bit m and v: the in-memory reference calls the same StepInt8.
std::vector<TrainSetup> Int8Cases() {
  std::vector<TrainSetup> cases;
  for (Tier tier : {Tier::kDram, Tier::kNvme}) {
    for (int ranks : {1, 2}) {
      TrainSetup s;
      s.ranks = ranks;
      s.clip = ranks == 2 ? 0.05f : 0.0f;
      s.accumulation = ranks;
      s.optimizer_tier = s.param_tier = tier;
      s.state_dtype = engine::StateDtype::kInt8;
      cases.push_back(s);
    }
  }
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Int8States, RunnerEquivalenceTest, ::testing::ValuesIn(Int8Cases()),
                         [](const auto& test) { return Name(test.param); });

INSTANTIATE_TEST_SUITE_P(Placements, RunnerEquivalenceTest, ::testing::ValuesIn(EquivalenceCases()),
                         [](const auto& test) { return Name(test.param); });

TEST(RunnerTest, LearnsTheAcquireOrder) {
  TrainSetup s;
  s.gpt.tied_head = true;
  auto session = testing::OpenTestSession(Options(s, ""));
  ASSERT_TRUE(session.ok());
  auto model = RegisterWithWeights(**session, s, "order");
  ASSERT_TRUE(model.ok()) << model.status();
  auto dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok());
  auto net = GptFor(s, **model, **dev);
  ASSERT_TRUE(net.ok());
  auto runner = Stage3Runner::Create(**model, 0, **dev, nullptr, {});
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_TRUE((*runner)->learned_order().empty());
  gpt::SourceOf<Stage3Runner> source(**runner);
  const auto tokens = Tokens(s.gpt, s.batch, 0, 0, 1);
  ASSERT_TRUE((*net)->TrainMicroStep(source, tokens.data(), 1.0f).ok());
  ASSERT_TRUE((*runner)->Step().ok());
  // Forward 0 .. head (with the tied embedding beside the head), backward back to 0.
  const int head = (*model)->units() - 1;
  const std::vector<int> learned = (*runner)->learned_order();
  ASSERT_FALSE(learned.empty());
  EXPECT_EQ(learned.front(), 0);
  EXPECT_EQ(learned.back(), 0);
  EXPECT_NE(std::find(learned.begin(), learned.end(), head), learned.end());
  EXPECT_EQ((*runner)->version(), 1);
  ASSERT_TRUE((*net)->TrainMicroStep(source, tokens.data(), 1.0f).ok());
  ASSERT_TRUE((*runner)->Step().ok());
  EXPECT_EQ((*runner)->stats().order_changes, 0);
  EXPECT_GT((*runner)->stats().prefetch_hits, 0);
}

TEST(RunnerTest, LiveBytesCapHoldsAndTrainingIsUnchanged) {
  TrainSetup s;
  s.gpt.tied_head = false;
  s.prefetch = 3;
  Result<RunResult> free_run = RunZtier(s, 2);
  ASSERT_TRUE(free_run.ok()) << free_run.status();
  // The largest unit is the untied head or embedding (V x C bf16); cap at
  // two of those: prefetching is limited by bytes, not by depth.
  uint64_t largest = 0;
  {
    auto session = testing::OpenTestSession(Options(s, ""));
    ASSERT_TRUE(session.ok());
    auto model = (*session)->RegisterModel(Spec(s, "sizes"));
    ASSERT_TRUE(model.ok());
    for (int k = 0; k < (*model)->units(); ++k) {
      largest = std::max(largest, (*model)->layout(k).padded * sizeof(bf16));
    }
  }
  TrainSetup capped = s;
  capped.max_live_bytes = 2 * largest;
  Result<RunResult> capped_run = RunZtier(capped, 2);
  ASSERT_TRUE(capped_run.ok()) << capped_run.status();
  std::printf("param bytes on the device: high-water %llu under a cap of %llu; %llu uncapped\n",
              static_cast<unsigned long long>(capped_run->param_memory[0].high_water),
              static_cast<unsigned long long>(capped.max_live_bytes),
              static_cast<unsigned long long>(free_run->param_memory[0].high_water));
  EXPECT_LE(capped_run->param_memory[0].high_water, capped.max_live_bytes);
  EXPECT_GT(free_run->param_memory[0].high_water, capped.max_live_bytes)
      << "the uncapped run should prefetch past the cap, or the cap is not what limits";
  EXPECT_EQ(capped_run->param_memory[0].bytes, 0u);  // everything freed with the runner
  ExpectSameTraining(*capped_run, *free_run);
}

TEST(RunnerTest, PersistentUnitsStayOnTheDevice) {
  TrainSetup s;
  s.persistence_threshold = uint64_t{1} << 30;  // every unit
  Result<RunResult> run = RunZtier(s, 2);
  ASSERT_TRUE(run.ok()) << run.status();
  TrainSetup plain;
  Result<RunResult> ref = RunZtier(plain, 2);
  ASSERT_TRUE(ref.ok());
  ExpectSameTraining(*run, *ref);
  // Each unit is fetched once per step, not once per use.
  EXPECT_LT(run->stats[0].fetches, ref->stats[0].fetches);
}

// Overlap in the host device's timeline: time the H2D copies spend inside
// compute spans (acquire to release of another unit).
double OverlapSeconds(const std::vector<TimelineSpan>& spans) {
  double overlap = 0.0;
  for (const TimelineSpan& c : spans) {
    if (c.stream != Stream::kCompute) continue;
    for (const TimelineSpan& h : spans) {
      if (h.stream != Stream::kCopy || h.label != "h2d") continue;
      const auto start = std::max(c.start, h.start);
      const auto end = std::min(c.end, h.end);
      if (end > start) overlap += std::chrono::duration<double>(end - start).count();
    }
  }
  return overlap;
}

TEST(RunnerTest, PrefetchOverlapsCopiesWithCompute) {
  TrainSetup s;
  // Units of 6 MiB: a copy takes long enough to show in the timeline.
  s.gpt = {
      .vocab = 256, .context = 32, .channels = 512, .layers = 3, .heads = 4, .tied_head = false};
  s.prefetch = 2;
  Result<RunResult> on = RunZtier(s, 2, /*timeline=*/true);
  ASSERT_TRUE(on.ok()) << on.status();
  s.prefetch = 0;
  Result<RunResult> off = RunZtier(s, 2, /*timeline=*/true);
  ASSERT_TRUE(off.ok()) << off.status();
  const double with = OverlapSeconds(on->timeline);
  const double without = OverlapSeconds(off->timeline);
  std::printf("h2d copy time inside compute spans: %.4f s with prefetch 2, %.4f s with 0\n", with,
              without);
  // Without prefetch a unit is copied only while the rank waits for it.
  EXPECT_EQ(without, 0.0);
  EXPECT_GT(with, 0.0);
  ExpectSameTraining(*on, *off);
}

TEST(RunnerTest, WaitsAreSplitByWhatTheTransfersDidEachSecondOnce) {
  // Checked copies take 2 ms each; without prefetch every acquire waits for
  // its unit's copy, and each Step for at least the last push's.
  for (Tier tier : {Tier::kDram, Tier::kNvme}) {
    TrainSetup s;
    s.optimizer_tier = tier;
    s.prefetch = 0;
    s.checked_copies = true;
    const int steps = 4;
    Result<RunResult> r = RunZtier(s, steps);
    ASSERT_TRUE(r.ok()) << r.status();
    const RunnerStats& st = r->stats[0];
    const double waits = st.acquire_wait_seconds + st.step_wait_seconds;
    const double split = st.wait_optimizer_seconds + st.wait_h2d_seconds + st.wait_d2h_seconds +
                         st.wait_collective_seconds;
    std::printf(
        "%s: waits %.4f s = optimizer %.4f + h2d %.4f + d2h %.4f + collectives %.4f (+ compute "
        "%.4f); %lld fetches\n",
        tier == Tier::kNvme ? "nvme" : "dram", waits, st.wait_optimizer_seconds,
        st.wait_h2d_seconds, st.wait_d2h_seconds, st.wait_collective_seconds, waits - split,
        static_cast<long long>(st.fetches));
    // Each second of a wait is counted once, in one of the parts (or left
    // to compute), none below zero.
    EXPECT_LE(split, waits + 1e-6);
    EXPECT_GE(st.wait_optimizer_seconds, 0.0);
    EXPECT_EQ(st.wait_collective_seconds, 0.0);  // one rank
    EXPECT_GE(st.wait_h2d_seconds, 0.9 * 0.002 * static_cast<double>(st.fetches));
    EXPECT_GE(st.wait_d2h_seconds, 0.9 * 0.002 * steps);
  }
}

TEST(RunnerTest, ResumeFromACheckpointMatchesAnUninterruptedRun) {
  TrainSetup s;
  s.optimizer_tier = Tier::kNvme;
  s.accumulation = 2;
  const int steps = 4, stop_after = 2;
  Result<RunResult> whole = RunZtier(s, steps);
  ASSERT_TRUE(whole.ok()) << whole.status();

  ScratchDir ckpt("runner-ckpt");
  RunResult first, second;
  {
    ScratchDir swap("runner-swap");
    auto session = testing::OpenTestSession(Options(s, swap.path()));
    ASSERT_TRUE(session.ok());
    auto model = RegisterWithWeights(**session, s, "gpt");
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE(TrainThroughRunner(s, **model, 0, stop_after * s.accumulation, &first).ok());
    ASSERT_TRUE(ReadMasters(**model, stop_after, &first).ok());
    Status checkpointed = (*model)->SaveCheckpoint(ckpt.path());
    ASSERT_TRUE(checkpointed.ok()) << checkpointed;
  }
  {
    // A new engine: nothing survives but the checkpoint.
    ScratchDir swap("runner-swap");
    auto session = testing::OpenTestSession(Options(s, swap.path()));
    ASSERT_TRUE(session.ok());
    auto model = (*session)->RegisterModel(Spec(s, "gpt"));
    ASSERT_TRUE(model.ok());
    Status trained = ResumeAndTrain(**model, ckpt.path(), s, stop_after * s.accumulation,
                                    steps * s.accumulation, &second);
    ASSERT_TRUE(trained.ok()) << trained;
  }
  ExpectResumedEqualsWhole(first, second, *whole);
}

// A full disk while the engine writes back step 3's states: the rank's next
// acquire fails with the engine's error (naming the step and the write-back),
// nothing hangs, and a new model loaded from the step-2 checkpoint trains on
// exactly as an uninterrupted run.
TEST(RunnerTest, AFullDiskFailsTheStepClearlyAndTheCheckpointResumes) {
  TrainSetup s;
  s.optimizer_tier = Tier::kNvme;
  const int steps = 4, saved = 2;
  Result<RunResult> whole = RunZtier(s, steps);
  ASSERT_TRUE(whole.ok()) << whole.status();

  ScratchDir swap("runner-swap"), ckpt("runner-ckpt");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  SessionOptions options = Options(s, swap.path());
  options.io_backend = fault;
  auto session = testing::OpenTestSession(options);
  ASSERT_TRUE(session.ok()) << session.status();
  RunResult first;
  {
    auto model = RegisterWithWeights(**session, s, "gpt");
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE(TrainThroughRunner(s, **model, 0, saved, &first).ok());
    ASSERT_TRUE((*model)->WaitPublished(saved, std::chrono::seconds(60)).ok());
    Status checkpointed = (*model)->SaveCheckpoint(ckpt.path());
    ASSERT_TRUE(checkpointed.ok()) << checkpointed;
    fault->FailFrom(nvme::IoKind::kWrite, 1, ENOSPC);
    RunResult failed;
    Status st = TrainThroughRunner(s, **model, saved, steps, &failed);
    ASSERT_FALSE(st.ok());
    std::printf("the rank saw: %s\n", st.ToString().c_str());
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st;
    EXPECT_NE(st.ToString().find("step 3"), std::string::npos) << st;
    EXPECT_NE(st.ToString().find("write back"), std::string::npos) << st;
    EXPECT_NE(st.ToString().find("No space left"), std::string::npos) << st;
  }
  fault->Reset();
  auto model = (*session)->RegisterModel(Spec(s, "gpt-resumed"));
  ASSERT_TRUE(model.ok()) << model.status();
  RunResult second;
  Status trained = ResumeAndTrain(**model, ckpt.path(), s, saved, steps, &second);
  ASSERT_TRUE(trained.ok()) << trained;
  ExpectResumedEqualsWhole(first, second, *whole);
}

// A model whose states are on NVMe through a fault-injecting backend (a
// drive a test may slow down), one step trained and published.
struct SlowDriveRun {
  TrainSetup s;
  ScratchDir swap{"runner-swap"};
  std::shared_ptr<nvme::FaultBackend> fault =
      std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  std::unique_ptr<Session> session;
  std::unique_ptr<Model> model;
  RunResult out;

  Status Start() {
    s.optimizer_tier = Tier::kNvme;
    s.prefetch = 0;  // a runner gone waits for no fetch of the next step's params
    SessionOptions options = Options(s, swap.path());
    options.io_backend = fault;
    ZT_ASSIGN_OR_RETURN(session, testing::OpenTestSession(options));
    ZT_ASSIGN_OR_RETURN(model, RegisterWithWeights(*session, s, "gpt"));
    ZT_RETURN_IF_ERROR(TrainThroughRunner(s, *model, 0, 1, &out));
    return model->WaitPublished(1, std::chrono::seconds(60));
  }
};

// A load whose write of a unit fails on the drive (NVMe states) leaves the
// job partly loaded, and says so: through ztierd the client counted only
// the writes that succeeded, so a first write that failed in ztierd's
// engine said nothing of it. Loading again recovers.
TEST(RunnerTest, ALoadWhoseFirstWriteFailsOnTheDriveSaysTheJobIsPartlyLoaded) {
  SlowDriveRun r;
  ASSERT_TRUE(r.Start().ok());
  ScratchDir ckpt("runner-ckpt");
  ASSERT_TRUE(r.model->SaveCheckpoint(ckpt.path()).ok());
  for (const auto& [err, code] :
       {std::pair{EIO, StatusCode::kIoError}, std::pair{ENOSPC, StatusCode::kResourceExhausted}}) {
    SCOPED_TRACE(std::strerror(err));
    r.fault->FailFrom(nvme::IoKind::kWrite, 1, err);
    Status st = r.model->LoadCheckpoint(ckpt.path());
    r.fault->Reset();
    ASSERT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find("partly loaded"), std::string::npos) << st;
    EXPECT_EQ(r.model->SaveCheckpoint(ckpt.path()).code(), StatusCode::kFailedPrecondition);
    Status again = r.model->LoadCheckpoint(ckpt.path());
    EXPECT_TRUE(again.ok()) << again;
    EXPECT_TRUE(r.model->SaveCheckpoint(ckpt.path()).ok());
  }
}

// Model::WaitPublished's timeout bounds the whole call: units that publish
// one after another, each within the timeout of the one before, are not
// waited for up to units x timeout (each unit's wait had the whole timeout).
TEST(RunnerTest, WaitPublishedsTimeoutBoundsTheWholeCall) {
  using namespace std::chrono_literals;
  SlowDriveRun r;
  ASSERT_TRUE(r.Start().ok());
  ASSERT_GE(r.model->units(), 3);
  r.fault->SlowDown(nvme::IoKind::kRead, 120ms);  // each unit's states come slowly
  ASSERT_TRUE(TrainThroughRunner(r.s, *r.model, 1, 2, &r.out).ok());  // step 2's grads are in
  const auto t0 = std::chrono::steady_clock::now();
  Status waited = r.model->WaitPublished(2, 400ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  std::printf("WaitPublished(2, 400 ms): %s after %.0f ms\n", waited.ToString().c_str(),
              std::chrono::duration<double, std::milli>(took).count());
  EXPECT_EQ(waited.code(), StatusCode::kUnavailable) << waited;
  EXPECT_LT(took, 1200ms);
  r.fault->SlowDown(nvme::IoKind::kRead, 0ms);
  EXPECT_TRUE(r.model->WaitPublished(2, std::chrono::seconds(60)).ok());
}

// A save right after a step's last grads went (the step queued or running
// in the engine) was refused "in flight", or, through ztierd, read the
// state as the step ended ("went from step"). It waits for that step, and
// saves it.
TEST(RunnerTest, ASaveRightAfterAStepsLastGradsSavesThatStep) {
  using namespace std::chrono_literals;
  SlowDriveRun r;
  ASSERT_TRUE(r.Start().ok());
  r.fault->SlowDown(nvme::IoKind::kRead, 30ms);                       // the step takes a while
  ASSERT_TRUE(TrainThroughRunner(r.s, *r.model, 1, 2, &r.out).ok());  // step 2's grads are in
  ScratchDir ck("save-after-grads");
  const Status saved = r.model->SaveCheckpoint(ck.path());
  r.fault->SlowDown(nvme::IoKind::kRead, 0ms);
  ASSERT_TRUE(saved.ok()) << saved;
  Result<std::string> text = ReadFileToString(ck.path() + "/manifest.json", 1 << 20);
  ASSERT_TRUE(text.ok()) << text.status();
  Result<engine::CheckpointManifest> m = engine::DecodeCheckpointManifest(*text, "manifest");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step, 2);
  EXPECT_TRUE(r.model->WaitPublished(2, 0ms).ok());
}

// Through ztierd a save reads the job's units one by one. A load of a
// checkpoint at the same step between two of those reads (another client,
// or another thread of this one) left the step as it was, and the save
// wrote some units of the old state and some of the loaded one. A save
// either refuses or writes one state.
TEST(RunnerTest, ASaveDuringALoadIsOfOneStateOrRefused) {
  using namespace std::chrono_literals;
  SlowDriveRun r;
  ASSERT_TRUE(r.Start().ok());
  ASSERT_GE(r.model->units(), 3);
  ScratchDir a("load-during-save-a"), b("load-during-save-b");
  ASSERT_TRUE(r.model->SaveCheckpoint(a.path()).ok());
  ASSERT_TRUE(TrainThroughRunner(r.s, *r.model, 1, 2, &r.out).ok());
  ASSERT_TRUE(r.model->WaitPublished(2, 60s).ok());
  RunResult loaded;  // state B, at step 2
  ASSERT_TRUE(ReadMasters(*r.model, 2, &loaded).ok());
  ASSERT_TRUE(r.model->SaveCheckpoint(b.path()).ok());
  // Step 2 again from A, at another learning rate: another state at step 2.
  ASSERT_TRUE(r.model->LoadCheckpoint(a.path()).ok());
  ASSERT_TRUE(r.model->SetLearningRates({1e-2f}).ok());
  ASSERT_TRUE(TrainThroughRunner(r.s, *r.model, 1, 2, &r.out).ok());
  ASSERT_TRUE(r.model->WaitPublished(2, 60s).ok());
  RunResult own;
  ASSERT_TRUE(ReadMasters(*r.model, 2, &own).ok());
  ASSERT_NE(own.master, loaded.master);

  ScratchDir d("load-during-save-d");
  ASSERT_TRUE(r.model->SaveCheckpoint(d.path()).ok());
  // The first round's reads are slow, the load certain to come during one;
  // the others' are not, and a load mostly comes between two.
  int refused = 0;
  for (int round = 0; round < 10; ++round) {
    SCOPED_TRACE(StrCat("round ", round));
    ASSERT_TRUE(r.model->LoadCheckpoint(d.path()).ok());
    if (round == 0) r.fault->SlowDown(nvme::IoKind::kRead, 120ms);
    ScratchDir c("load-during-save-c");
    Status saved;
    std::thread saver([&] { saved = r.model->SaveCheckpoint(c.path()); });
    std::this_thread::sleep_for(round == 0 ? 150ms : std::chrono::milliseconds(round));
    const Status load = r.model->LoadCheckpoint(b.path());
    saver.join();
    r.fault->SlowDown(nvme::IoKind::kRead, 0ms);
    EXPECT_TRUE(load.ok() || load.code() == StatusCode::kFailedPrecondition) << load;
    if (!saved.ok()) {
      EXPECT_EQ(saved.code(), StatusCode::kFailedPrecondition) << saved;
      ++refused;
      continue;
    }
    ASSERT_TRUE(r.model->LoadCheckpoint(c.path()).ok());
    RunResult got;
    ASSERT_TRUE(ReadMasters(*r.model, 2, &got).ok());
    int own_units = 0, loaded_units = 0;
    for (int k = 0; k < r.model->units(); ++k) {
      own_units += got.master[k] == own.master[k];
      loaded_units += got.master[k] == loaded.master[k];
    }
    EXPECT_TRUE(own_units == r.model->units() || loaded_units == r.model->units())
        << "the save wrote " << own_units << " units of the state it began with and "
        << loaded_units << " of the one loaded meanwhile";
  }
  std::printf("%d of 10 saves refused\n", refused);
}

// ------------------------------------ multi-call state passes through ztierd

// A model of `n` one-tensor units of 1000 floats.
Session::ModelSpec FlatUnits(const std::string& name, int n) {
  Session::ModelSpec m;
  m.name = name;
  for (int u = 0; u < n; ++u) {
    m.units.push_back(
        {.name = StrCat("u", u), .tensors = {{.name = StrCat("u", u, ".w"), .shape = {1000}}}});
  }
  return m;
}

Status SetEveryWeight(Model& m, float x) {
  std::vector<float> w(1000, x);
  for (int k = 0; k < m.units(); ++k) ZT_RETURN_IF_ERROR(m.SetWeights(k, w.data(), w.size()));
  return Status::Ok();
}

// The value every weight of unit k holds (NaN when they differ, -1 when
// it cannot be read).
float UnitValue(Model& m, int k) {
  std::vector<float> got;
  if (!m.ReadMaster(k, &got).ok()) return -1;
  for (uint64_t i = 0; i < 1000; ++i) {
    if (got[i] != got[0]) return std::nanf("");
  }
  return got[0];
}

int UnitsHolding(Model& m, float x) {
  int n = 0;
  for (int k = 0; k < m.units(); ++k) n += UnitValue(m, k) == x;
  return n;
}

// Holds the thread that opens a file whose path has `needle` for the
// `nth` time (from 0) until Release(): a load's apply pass of that unit,
// an import's read of its file.
struct FilePause {
  std::mutex mu;
  std::condition_variable cv;
  bool paused = false, released = false;
  std::atomic<int> opens{0};
  void Install(std::string needle, int nth) {
    SetFileFaultHook([this, needle, nth](FileOp op, const std::string& path) {
      if (op != FileOp::kOpen || path.find(needle) == std::string::npos) return 0;
      if (opens.fetch_add(1) != nth) return 0;
      std::unique_lock<std::mutex> lock(mu);
      paused = true;
      cv.notify_all();
      cv.wait(lock, [&] { return released; });
      return 0;
    });
  }
  bool WaitPaused(std::chrono::milliseconds t) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, t, [&] { return paused; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
    cv.notify_all();
  }
  ~FilePause() {
    Release();
    SetFileFaultHook({});
  }
};

SessionOptions SmallSession() {
  SessionOptions o;
  o.settings = testing::SmallEngine();
  return o;
}

// Through ztierd a load is a write of each unit, then a commit: a second
// load (another client, or thread) in between wrote its units and
// committed, the first went on, and both said ok over a job of units of
// both checkpoints, which then saved as one. The second is refused (as
// embedded), or the state is wholly that of a load that said ok.
TEST(RunnerTest, TwoLoadsAtOnceLeaveOneCheckpoint) {
  using namespace std::chrono_literals;
  auto s = testing::OpenTestSession(SmallSession());
  ASSERT_TRUE(s.ok()) << s.status();
  auto m = (*s)->RegisterModel(FlatUnits("two-loads", 3));
  ASSERT_TRUE(m.ok()) << m.status();
  Model& model = **m;
  ScratchDir dir("two-loads");
  const std::string x = dir / "x", y = dir / "y";
  ASSERT_TRUE(SetEveryWeight(model, 1.0f).ok());
  ASSERT_TRUE(model.SaveCheckpoint(x).ok());
  ASSERT_TRUE(SetEveryWeight(model, 2.0f).ok());
  ASSERT_TRUE(model.SaveCheckpoint(y).ok());
  Status a, b;
  {
    FilePause pause;
    pause.Install("/x/unit-1-", 1);  // the first open checks; the second applies, unit 0 in
    std::thread loader([&] { a = model.LoadCheckpoint(x); });
    ASSERT_TRUE(pause.WaitPaused(30s));
    b = model.LoadCheckpoint(y);
    pause.Release();
    loader.join();
  }
  const int xs = UnitsHolding(model, 1.0f), ys = UnitsHolding(model, 2.0f);
  EXPECT_TRUE(xs == model.units() || ys == model.units())
      << xs << " units of x and " << ys << " of y; load x: " << a << "; load y: " << b;
  if (xs == model.units()) {
    EXPECT_TRUE(a.ok()) << a;
  }
  if (ys == model.units()) {
    EXPECT_TRUE(b.ok()) << b;
  }
  EXPECT_FALSE(a.ok() && b.ok()) << "both loads said ok";
  for (const Status& st : {a, b}) {
    // The job holds the other's state whole, not part of this one's.
    EXPECT_EQ(st.message().find("partly loaded"), std::string::npos) << st;
  }
}

// An import (read a unit, set its master, write it back) during another
// client's load: the import's commit cleared the load's mark, the load
// went on, and the job held units of both, each call said ok.
TEST(RunnerTest, AnImportDuringALoadLeavesOneState) {
  using namespace std::chrono_literals;
  auto s = testing::OpenTestSession(SmallSession());
  ASSERT_TRUE(s.ok()) << s.status();
  auto m = (*s)->RegisterModel(FlatUnits("load-import", 3));
  ASSERT_TRUE(m.ok()) << m.status();
  Model& model = **m;
  ScratchDir dir("load-import");
  const std::string x = dir / "x", z = dir / "z.safetensors";
  ASSERT_TRUE(SetEveryWeight(model, 1.0f).ok());
  ASSERT_TRUE(model.SaveCheckpoint(x).ok());
  ASSERT_TRUE(SetEveryWeight(model, 3.0f).ok());
  ASSERT_TRUE(model.ExportSafetensors(z, engine::Engine::ExportType::kFloat32).ok());
  ASSERT_TRUE(SetEveryWeight(model, 0.0f).ok());
  Status loaded, imported;
  {
    FilePause pause;
    pause.Install("/x/unit-1-", 1);
    std::thread loader([&] { loaded = model.LoadCheckpoint(x); });
    ASSERT_TRUE(pause.WaitPaused(30s));
    imported = model.ImportSafetensors(z);
    pause.Release();
    loader.join();
  }
  const int xs = UnitsHolding(model, 1.0f), zs = UnitsHolding(model, 3.0f);
  EXPECT_TRUE(xs == model.units() || zs == model.units())
      << xs << " units of x and " << zs << " of z; load: " << loaded << "; import: " << imported;
  EXPECT_FALSE(loaded.ok() && imported.ok()) << "both said ok";
}

// An import through ztierd read the job's step before it read the file,
// and committed that step: a training step taken meanwhile was undone in
// the step count (its moments kept), and the runner then waited its whole
// timeout for a step the job would not take.
TEST(RunnerTest, AnImportKeepsTheStepTheJobReached) {
  using namespace std::chrono_literals;
  auto s = testing::OpenTestSession(SmallSession());
  ASSERT_TRUE(s.ok()) << s.status();
  auto m = (*s)->RegisterModel(FlatUnits("import-step", 2));
  ASSERT_TRUE(m.ok()) << m.status();
  Model& model = **m;
  ASSERT_TRUE(SetEveryWeight(model, 1.0f).ok());
  auto dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok()) << dev.status();
  RunnerOptions options;
  options.timeout = 5s;
  auto r = Stage3Runner::Create(model, 0, **dev, nullptr, options);
  ASSERT_TRUE(r.ok()) << r.status();
  const auto step = [&]() -> Status {
    for (int k : {1, 0}) {
      ZT_ASSIGN_OR_RETURN(bf16 * g, (*r)->GradBuffer(k));
      std::fill_n(g, 1000, FloatToBf16(0.25f));
      ZT_RETURN_IF_ERROR((*r)->PushGrads(k));
    }
    return (*r)->Step();
  };
  ASSERT_TRUE(step().ok());
  ASSERT_TRUE(model.WaitPublished(1, 30s).ok());
  ScratchDir dir("import-step");
  const std::string z = dir / "z.safetensors";
  ASSERT_TRUE(model.ExportSafetensors(z, engine::Engine::ExportType::kFloat32).ok());
  Status imported, stepped;
  {
    FilePause pause;
    pause.Install("z.safetensors", 0);
    std::thread importer([&] { imported = model.ImportSafetensors(z); });
    ASSERT_TRUE(pause.WaitPaused(30s));
    std::atomic<bool> done{false};
    // Embedded, the step's grads wait for the import (and are refused).
    std::thread trainer([&] {
      stepped = step();
      if (stepped.ok()) stepped = model.WaitPublished(2, 30s);
      done = true;
    });
    // Through ztierd the step completes during the import's pause (waited
    // for, however slow the machine); embedded its grads wait for the
    // import, and 2 s tell.
    const int waits = testing::DaemonUnderTest() ? 6000 : 200;
    for (int i = 0; i < waits && !done; ++i) std::this_thread::sleep_for(10ms);
    pause.Release();
    importer.join();
    trainer.join();
  }
  ASSERT_TRUE(imported.ok()) << imported;
  if (!stepped.ok()) return;  // refused: of the state before the import
  EXPECT_EQ(model.published_step(), 2) << "the import took the job back a step";
  const Status next = step();
  EXPECT_TRUE(next.ok()) << next;
  EXPECT_TRUE(model.WaitPublished(3, 10s).ok());
}

// While another client's load is under way, a save or an export is told
// that it may be (as embedded: "in progress"), not only that a load failed
// midway and to load again (a second load then mixed the two).
TEST(RunnerTest, ASaveDuringAnotherClientsLoadIsToldItIsUnderWay) {
  using namespace std::chrono_literals;
  auto s = testing::OpenTestSession(SmallSession());
  ASSERT_TRUE(s.ok()) << s.status();
  auto m = (*s)->RegisterModel(FlatUnits("save-during-load", 3));
  ASSERT_TRUE(m.ok()) << m.status();
  Model& model = **m;
  ScratchDir dir("save-during-load");
  const std::string x = dir / "x";
  ASSERT_TRUE(SetEveryWeight(model, 1.0f).ok());
  ASSERT_TRUE(model.SaveCheckpoint(x).ok());
  ASSERT_TRUE(SetEveryWeight(model, 2.0f).ok());
  Status loaded, saved, exported;
  {
    FilePause pause;
    pause.Install("/x/unit-1-", 1);
    std::thread loader([&] { loaded = model.LoadCheckpoint(x); });
    ASSERT_TRUE(pause.WaitPaused(30s));
    saved = model.SaveCheckpoint(dir / "c");
    exported = model.ExportSafetensors(dir / "e.safetensors", engine::Engine::ExportType::kFloat32);
    pause.Release();
    loader.join();
  }
  EXPECT_TRUE(loaded.ok()) << loaded;
  for (const Status& st : {saved, exported}) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
    EXPECT_TRUE(st.message().find("under way") != std::string::npos ||
                st.message().find("in progress") != std::string::npos)
        << st;
  }
  EXPECT_EQ(UnitsHolding(model, 1.0f), model.units());
}

// ------------------------------------------------------------- bad use --

// A weight source that interrupts a backward pass: the push after
// `FailAfter(n)`'s n more pushes fails (as a KeyboardInterrupt or an error
// in the training loop would, midway), and the units the pass held are
// released afterwards, as a training loop's cleanup does.
class InterruptingSource final : public gpt::WeightSource {
 public:
  explicit InterruptingSource(Stage3Runner& runner) : runner_(runner) {}
  void FailAfter(int pushes) { left_ = pushes; }
  Result<const bf16*> Acquire(int unit) override {
    ZT_ASSIGN_OR_RETURN(const bf16* p, runner_.Acquire(unit));
    held_.push_back(unit);
    return p;
  }
  Status Release(int unit) override {
    ZT_RETURN_IF_ERROR(runner_.Release(unit));
    held_.erase(std::find(held_.begin(), held_.end(), unit));
    return Status::Ok();
  }
  Result<bf16*> GradBuffer(int unit) override { return runner_.GradBuffer(unit); }
  Status PushGrads(int unit) override {
    if (left_ == 0) {
      left_ = -1;
      return Status::Aborted("interrupted");
    }
    if (left_ > 0) --left_;
    return runner_.PushGrads(unit);
  }
  Status ReleaseHeld() {
    while (!held_.empty()) ZT_RETURN_IF_ERROR(Release(held_.back()));
    return Status::Ok();
  }

 private:
  Stage3Runner& runner_;
  int left_ = -1;
  std::vector<int> held_;
};

// Backward passes interrupted midway, their steps aborted and trained
// again: the run ends bit for bit as the in-memory one that was never
// interrupted (losses, fp32 masters), with gradient accumulation (the
// step's earlier micro-steps go too) and with states on NVMe; in the first
// step (no order learned yet) and a later one (prefetching by the order).
TEST(RunnerTest, AnAbortedStepLeavesNoTraceOfItsGrads) {
  TrainSetup accumulating;
  accumulating.accumulation = 2;
  TrainSetup nvme;
  nvme.optimizer_tier = Tier::kNvme;
  for (const TrainSetup& s : {accumulating, nvme}) {
    SCOPED_TRACE(Name(s));
    const int steps = 3;
    Result<RunResult> expected = RunInMemory(s, steps);
    ASSERT_TRUE(expected.ok()) << expected.status();
    ScratchDir swap("runner-swap");
    auto session = testing::OpenTestSession(Options(s, swap.path()));
    ASSERT_TRUE(session.ok()) << session.status();
    auto model = RegisterWithWeights(**session, s, "gpt");
    ASSERT_TRUE(model.ok()) << model.status();
    auto dev = MakeHostDevice();
    ASSERT_TRUE(dev.ok());
    auto net = GptFor(s, **model, **dev);
    ASSERT_TRUE(net.ok()) << net.status();
    auto runner = Stage3Runner::Create(**model, 0, **dev, nullptr, {.prefetch_depth = s.prefetch});
    ASSERT_TRUE(runner.ok()) << runner.status();
    InterruptingSource source(**runner);
    const int acc = s.accumulation;
    // Micro-step -> the pushes its first attempt makes before it fails.
    std::map<int64_t, int> interrupt = {{acc - 1, 2}, {acc, 1}};
    RunResult got;
    for (int64_t micro = 0; micro < steps * acc;) {
      const std::vector<int32_t> tokens = Tokens(s.gpt, s.batch, micro, 0, 1);
      const auto it = interrupt.find(micro);
      if (it != interrupt.end()) {
        source.FailAfter(it->second);
        interrupt.erase(it);
        Result<float> loss = (*net)->TrainMicroStep(source, tokens.data(), 1.0f / acc);
        ASSERT_FALSE(loss.ok());
        EXPECT_NE(loss.status().ToString().find("interrupted"), std::string::npos) << loss.status();
        ASSERT_TRUE(source.ReleaseHeld().ok());
        Result<int> discarded = (*runner)->AbortStep();
        ASSERT_TRUE(discarded.ok()) << discarded.status();
        EXPECT_EQ(*discarded, micro % acc);
        EXPECT_EQ((*runner)->version(), micro / acc);
        micro -= micro % acc;  // the step starts afresh
        got.losses.resize(micro);
        continue;
      }
      Result<float> loss = (*net)->TrainMicroStep(source, tokens.data(), 1.0f / acc);
      ASSERT_TRUE(loss.ok()) << loss.status();
      got.losses.push_back({*loss});
      ASSERT_TRUE((*runner)->Step().ok());
      ++micro;
    }
    EXPECT_TRUE(interrupt.empty());
    ASSERT_TRUE(ReadMasters(**model, steps, &got).ok());
    ExpectSameTraining(got, *expected);
  }
}

class RunnerErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto session = testing::OpenTestSession(Options(s_, ""));
    ASSERT_TRUE(session.ok());
    session_ = *std::move(session);
    auto model = RegisterWithWeights(*session_, s_, "bad");
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    auto dev = MakeHostDevice();
    ASSERT_TRUE(dev.ok());
    dev_ = *std::move(dev);
    auto runner = Stage3Runner::Create(*model_, 0, *dev_, nullptr, {});
    ASSERT_TRUE(runner.ok()) << runner.status();
    runner_ = *std::move(runner);
  }

  TrainSetup s_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<Stage3Runner> runner_;
};

TEST_F(RunnerErrorsTest, UnknownUnit) {
  Result<const bf16*> p = runner_->Acquire(99);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(p.status().ToString().find("no unit 99"), std::string::npos) << p.status();
  EXPECT_EQ(runner_->Release(-1).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(runner_->PushGrads(42).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(runner_->GradBuffer(7).status().code(), StatusCode::kOutOfRange);
}

TEST_F(RunnerErrorsTest, ReleaseWithoutAcquireAndPushWithoutBuffer) {
  Status s = runner_->Release(0);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.ToString().find("not acquired"), std::string::npos) << s;
  s = runner_->PushGrads(0);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.ToString().find("GradBuffer"), std::string::npos) << s;
}

TEST_F(RunnerErrorsTest, PushingTwiceAndSteppingTwice) {
  for (int k = model_->units() - 1; k >= 0; --k) {
    ASSERT_TRUE(runner_->GradBuffer(k).ok());
    ASSERT_TRUE(runner_->PushGrads(k).ok());
  }
  EXPECT_EQ(runner_->PushGrads(0).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(runner_->GradBuffer(0).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(runner_->Step().ok());
  Status twice = runner_->Step();
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(twice.ToString().find("Step called twice"), std::string::npos) << twice;
}

TEST_F(RunnerErrorsTest, GradsOfTheWrongSize) {
  const engine::UnitLayout& l = model_->layout(1);
  std::vector<bf16> grads(l.padded + 1, FloatToBf16(0.5f));
  Status s = runner_->PushGrads(1, grads.data(), l.numel - 1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.ToString().find(StrCat("takes ", l.numel, " grads")), std::string::npos) << s;
  EXPECT_EQ(runner_->PushGrads(1, grads.data(), l.padded + 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(runner_->PushGrads(1, nullptr, l.numel).code(), StatusCode::kInvalidArgument);
  // The right size goes through, once.
  EXPECT_TRUE(runner_->PushGrads(1, grads.data(), l.numel).ok());
  EXPECT_EQ(runner_->PushGrads(1, grads.data(), l.numel).code(), StatusCode::kFailedPrecondition);
}

TEST_F(RunnerErrorsTest, StepWithMissingGradsNamesTheUnits) {
  ASSERT_TRUE(runner_->GradBuffer(0).ok());
  ASSERT_TRUE(runner_->PushGrads(0).ok());
  Status s = runner_->Step();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.ToString().find("h.0"), std::string::npos) << s;
}

TEST_F(RunnerErrorsTest, StepWhileAUnitIsHeld) {
  ASSERT_TRUE(runner_->Acquire(1).ok());
  for (int k = 0; k < model_->units(); ++k) {
    ASSERT_TRUE(runner_->GradBuffer(k).ok());
    ASSERT_TRUE(runner_->PushGrads(k).ok());
  }
  Status s = runner_->Step();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.ToString().find("still acquired"), std::string::npos) << s;
  ASSERT_TRUE(runner_->Release(1).ok());
  EXPECT_TRUE(runner_->Step().ok());
}

TEST_F(RunnerErrorsTest, AnAbortWhileAUnitIsHeldIsRefused) {
  ASSERT_TRUE(runner_->GradBuffer(3).ok());
  ASSERT_TRUE(runner_->PushGrads(3).ok());
  ASSERT_TRUE(runner_->Acquire(1).ok());
  Result<int> s = runner_->AbortStep();
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().ToString().find("still acquired"), std::string::npos) << s.status();
  ASSERT_TRUE(runner_->Release(1).ok());
  ASSERT_TRUE(runner_->AbortStep().ok());
  // Unit 3 takes grads again in the step started afresh.
  EXPECT_TRUE(runner_->GradBuffer(3).ok());
}

// A runner closed mid-step (an exception's unwind, a Python object
// collected) left its pushed grads in the engine: every later runner's
// pushes "arrived before the optimizer finished this one", and saves were
// refused, for good. One rank's runner drops its unfinished step as it
// goes; the next trains, and the model saves.
TEST_F(RunnerErrorsTest, ARunnerClosedMidStepLeavesNoGradsForTheNext) {
  using namespace std::chrono_literals;
  ASSERT_TRUE(runner_->GradBuffer(3).ok());
  ASSERT_TRUE(runner_->PushGrads(3).ok());
  ASSERT_TRUE(runner_->Acquire(0).ok());
  runner_.reset();
  auto next = Stage3Runner::Create(*model_, 0, *dev_, nullptr, {});
  ASSERT_TRUE(next.ok()) << next.status();
  for (int k = model_->units() - 1; k >= 0; --k) {
    ASSERT_TRUE((*next)->GradBuffer(k).ok());
    Status pushed = (*next)->PushGrads(k);
    ASSERT_TRUE(pushed.ok()) << pushed;
  }
  Status stepped = (*next)->Step();
  ASSERT_TRUE(stepped.ok()) << stepped;
  ASSERT_TRUE(model_->WaitPublished(1, 30s).ok());
  ScratchDir ckpt("runner-ckpt");
  Status saved = model_->SaveCheckpoint(ckpt.path());
  EXPECT_TRUE(saved.ok()) << saved;
}

// A checkpoint of another step loaded while a runner lives: the runner
// kept its own step, so one of an earlier step left it waiting for a step
// the job would never reach ("a client at the wrong step"), and one of a
// later step had it count steps behind the job's for good. A runner of one
// rank takes the job's step with its weights.
TEST_F(RunnerErrorsTest, ARunnerFollowsACheckpointOfAnotherStep) {
  using namespace std::chrono_literals;
  const auto step = [&] {
    for (int k = model_->units() - 1; k >= 0; --k) {
      ASSERT_TRUE(runner_->Acquire(k).ok());
      ASSERT_TRUE(runner_->Release(k).ok());
      ASSERT_TRUE(runner_->GradBuffer(k).ok());
      ASSERT_TRUE(runner_->PushGrads(k).ok());
    }
    ASSERT_TRUE(runner_->Step().ok());
    ASSERT_TRUE(model_->WaitPublished(runner_->version(), 30s).ok());
  };
  ScratchDir early("runner-ckpt-early"), late("runner-ckpt-late");
  step();
  ASSERT_TRUE(model_->SaveCheckpoint(early.path()).ok());
  step();
  step();
  ASSERT_TRUE(model_->SaveCheckpoint(late.path()).ok());
  ASSERT_EQ(runner_->version(), 3);
  for (const auto& [dir, at] : {std::pair{early.path(), 1}, std::pair{late.path(), 3}}) {
    SCOPED_TRACE(StrCat("a checkpoint of step ", at));
    ASSERT_TRUE(model_->LoadCheckpoint(dir).ok());
    step();
    EXPECT_EQ(runner_->version(), at + 1);
    EXPECT_EQ(*model_->PublishedStep(), at + 1);
  }
}

// A backward that fails after its last push, the step run meanwhile: the
// abort found nothing pending and said it dropped the grads, which had been
// applied; the runner stayed a step behind the job (the retried micro-step
// applied a second update). It is refused, and Step() goes on.
TEST_F(RunnerErrorsTest, AnAbortAfterTheStepRanIsRefused) {
  using namespace std::chrono_literals;
  for (int k = model_->units() - 1; k >= 0; --k) {
    ASSERT_TRUE(runner_->GradBuffer(k).ok());
    ASSERT_TRUE(runner_->PushGrads(k).ok());
  }
  ASSERT_TRUE(model_->WaitPublished(1, 30s).ok());
  Result<int> late = runner_->AbortStep();
  EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition) << late.status();
  EXPECT_NE(late.status().ToString().find("applied them"), std::string::npos) << late.status();
  ASSERT_TRUE(runner_->Step().ok());
  EXPECT_EQ(runner_->version(), 1);
  EXPECT_EQ(*model_->PublishedStep(), 1);
}

// Every unit's params as the runner hands them out equal bf16 of the
// engine's masters (the released units stay on the device: persistent).
void ExpectCurrentWeights(Stage3Runner& runner, const Model& model, const std::string& when) {
  for (int k = 0; k < model.units(); ++k) {
    std::vector<float> master;
    ASSERT_TRUE(model.ReadMaster(k, &master).ok());
    Result<const bf16*> params = runner.Acquire(k);
    ASSERT_TRUE(params.ok()) << params.status();
    int wrong = 0;
    for (uint64_t i = 0; i < model.layout(k).numel; ++i) {
      wrong += (*params)[i] != FloatToBf16(master[i]);
    }
    EXPECT_EQ(wrong, 0) << "unit " << k << " " << when;
    ASSERT_TRUE(runner.Release(k).ok());
  }
}

// Weights replaced at the step they were at (set before the first step,
// imported or loaded between steps): units the runner kept on the device
// (persistent, or prefetched by Step()) were the old weights' for good,
// while the optimizer applied their grads to the new masters. They are
// fetched again, a unit held meanwhile after its release.
TEST(RunnerWeightsTest, WeightsReplacedAtTheirStepAreFetchedAgain) {
  using namespace std::chrono_literals;
  TrainSetup s;
  ScratchDir dir("replaced");
  Result<std::unique_ptr<Session>> session = testing::OpenTestSession(Options(s, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  Result<std::unique_ptr<Model>> model = RegisterWithWeights(**session, s, "replaced");
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  Result<std::unique_ptr<Device>> dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok());
  Result<std::unique_ptr<Stage3Runner>> made =
      Stage3Runner::Create(m, 0, **dev, nullptr, {.persistence_threshold = uint64_t{1} << 30});
  ASSERT_TRUE(made.ok()) << made.status();
  Stage3Runner& runner = **made;
  const auto step = [&] {
    for (int k = m.units() - 1; k >= 0; --k) {
      Result<bf16*> g = runner.GradBuffer(k);
      ASSERT_TRUE(g.ok()) << g.status();
      std::fill_n(*g, m.layout(k).padded, FloatToBf16(0.01f));
      ASSERT_TRUE(runner.PushGrads(k).ok());
    }
    ASSERT_TRUE(runner.Step().ok());
    ASSERT_TRUE(m.WaitPublished(runner.version(), 30s).ok());
  };
  ExpectCurrentWeights(runner, m, "at the start");
  // Set again before the first step, unit 0 held meanwhile.
  ASSERT_TRUE(runner.Acquire(0).ok());
  std::vector<float> master;
  for (int k = 0; k < m.units(); ++k) {
    ASSERT_TRUE(m.ReadMaster(k, &master).ok());
    for (float& w : master) w *= 0.5f;
    master.resize(m.layout(k).numel);
    ASSERT_TRUE(m.SetWeights(k, master.data(), master.size()).ok());
  }
  ASSERT_TRUE(runner.Release(0).ok());
  ExpectCurrentWeights(runner, m, "after SetWeights");
  step();
  const std::string file = dir.path() + "/step1.safetensors";
  ASSERT_TRUE(m.ExportSafetensors(file, engine::Engine::ExportType::kFloat32).ok());
  ASSERT_TRUE(m.SaveCheckpoint(dir.path() + "/ck").ok());
  step();
  ExpectCurrentWeights(runner, m, "after a step");
  ASSERT_TRUE(m.ImportSafetensors(file).ok());  // step 1's weights, at step 2
  ExpectCurrentWeights(runner, m, "after an import");
  step();
  ASSERT_TRUE(m.SaveCheckpoint(dir.path() + "/ck3").ok());
  ASSERT_TRUE(m.ImportSafetensors(file).ok());
  ASSERT_TRUE(m.LoadCheckpoint(dir.path() + "/ck3").ok());  // step 3's, at step 3
  ExpectCurrentWeights(runner, m, "after a load");
}

// One micro-step acquiring `order`, then every unit's grads, then Step().
Status MicroStep(Stage3Runner& runner, const std::vector<int>& order, int units) {
  for (int k : order) {
    ZT_RETURN_IF_ERROR(runner.Acquire(k).status());
    ZT_RETURN_IF_ERROR(runner.Release(k));
  }
  for (int k = units - 1; k >= 0; --k) {
    ZT_RETURN_IF_ERROR(runner.GradBuffer(k).status());
    ZT_RETURN_IF_ERROR(runner.PushGrads(k));
  }
  return runner.Step();
}

TEST_F(RunnerErrorsTest, AChangedOrderIsCountedAndRelearned) {
  const int n = model_->units();
  std::vector<int> forward(n), reversed(n);
  for (int k = 0; k < n; ++k) forward[k] = reversed[n - 1 - k] = k;
  ASSERT_TRUE(MicroStep(*runner_, forward, n).ok());
  EXPECT_EQ(runner_->learned_order(), forward);
  ASSERT_TRUE(MicroStep(*runner_, forward, n).ok());
  EXPECT_EQ(runner_->stats().order_changes, 0);
  const int64_t hits = runner_->stats().prefetch_hits;
  EXPECT_GT(hits, 0);
  ASSERT_TRUE(MicroStep(*runner_, reversed, n).ok());
  EXPECT_EQ(runner_->stats().order_changes, 1);
  EXPECT_EQ(runner_->learned_order(), reversed);
  ASSERT_TRUE(MicroStep(*runner_, reversed, n).ok());
  EXPECT_EQ(runner_->stats().order_changes, 1);
  EXPECT_GT(runner_->stats().prefetch_hits, hits);  // prefetching by the new order
  EXPECT_EQ(runner_->version(), 4);
}

// Passes of another kind (evaluation, key 1) between training micro-steps
// keep an order of their own: neither kind makes the other relearn, and
// each prefetches by its own order once learned.
TEST_F(RunnerErrorsTest, PassesOfAnotherKindKeepTheirOwnOrder) {
  const int n = model_->units();
  std::vector<int> forward(n), reversed(n);
  for (int k = 0; k < n; ++k) forward[k] = reversed[n - 1 - k] = k;
  int64_t eval_hits = 0;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(StrCat("round ", round));
    ASSERT_TRUE(runner_->SetOrder(0).ok());
    ASSERT_TRUE(MicroStep(*runner_, forward, n).ok());
    EXPECT_EQ(runner_->learned_order(), forward);
    ASSERT_TRUE(runner_->SetOrder(1).ok());
    EXPECT_EQ(runner_->order_key(), 1);
    const int64_t hits = runner_->stats().prefetch_hits;
    for (int k : reversed) {
      ASSERT_TRUE(runner_->Acquire(k).ok());
      ASSERT_TRUE(runner_->Release(k).ok());
    }
    if (round > 0) {
      EXPECT_EQ(runner_->learned_order(), reversed);
      eval_hits += runner_->stats().prefetch_hits - hits;
    }
  }
  EXPECT_EQ(runner_->stats().order_changes, 0);
  EXPECT_GT(eval_hits, 0);  // evaluation passes prefetch by their own order
  // Step() ends a pass of another kind and goes back to training's order.
  ASSERT_TRUE(runner_->SetOrder(1).ok());
  ASSERT_TRUE(MicroStep(*runner_, forward, n).ok());
  EXPECT_EQ(runner_->order_key(), 0);
  EXPECT_EQ(runner_->learned_order(), forward);
  EXPECT_EQ(runner_->SetOrder(-1).code(), StatusCode::kInvalidArgument);
}

// Exact fetch and hit counts for a known order (the 4 units forward, each
// released at once, no persistent units): the learning micro-step fetches
// every unit; Step() then prefetches the first `depth` units of the next
// one; in a later micro-step every acquire hits and the fetches are the
// units past the window plus the next Step()'s prefetch: 4 a micro-step.
TEST_F(RunnerErrorsTest, PrefetchFetchesExactlyTheNextUnitsOfTheLearnedOrder) {
  const int n = model_->units();
  ASSERT_EQ(n, 4);
  const std::vector<int> forward = {0, 1, 2, 3};
  for (int depth : {0, 1, 2, 3}) {
    SCOPED_TRACE(StrCat("prefetch depth ", depth));
    RunnerOptions o;
    o.prefetch_depth = depth;
    o.persistence_threshold = 0;
    o.coalesce_bytes = 0;  // each unit fetched alone (coalescing has its own test)
    runner_.reset();
    auto runner = Stage3Runner::Create(*model_, 0, *dev_, nullptr, o);
    ASSERT_TRUE(runner.ok()) << runner.status();
    for (int micro = 1; micro <= 3; ++micro) {
      const Status s = MicroStep(**runner, forward, n);
      ASSERT_TRUE(s.ok()) << "micro-step " << micro << ": " << s;
      const RunnerStats st = (*runner)->stats();
      EXPECT_EQ(st.fetches, n + depth + (micro - 1) * n) << "after micro-step " << micro;
      EXPECT_EQ(st.prefetch_hits, depth == 0 ? 0 : (micro - 1) * n) << "after micro-step " << micro;
    }
  }
}

// Coalesced copies, counted exactly. The tiny GPT's 4 units are all under
// the default limit; forward order, depth 2, two micro-steps a step. The
// learning micro-step fetches each unit alone (no order is known yet);
// its Step() fetches the whole next micro-step in one copy (the prefetch of
// unit 0 takes along the small units after it, past the prefetch depth):
// the version did not change, so every unit is published already. At a
// step's end the fetch goes as the optimizer publishes the units (between
// 1 and 4 copies), and the micro-step after it is one copy again. Pushes
// take along the ones queued behind them: copies take 5 ms here, so the
// first push's copy is under way while the other three are queued, and
// they go together (2 copies a micro-step; 1 when all four were queued
// before the first ran). The bytes moved are the units' page-rounded
// spans; training matches each-unit-alone bit for bit (the equivalence
// cases).
TEST(RunnerTest, SmallUnitsGoInOneCopyEachWay) {
  TrainSetup s;
  s.accumulation = 2;
  auto session = testing::OpenTestSession(Options(s, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  auto model = RegisterWithWeights(**session, s, "small");
  ASSERT_TRUE(model.ok()) << model.status();
  auto dev = MakeHostDevice({.copy_delay = std::chrono::milliseconds(5)});
  ASSERT_TRUE(dev.ok());
  const int n = (*model)->units();
  ASSERT_EQ(n, 4);
  uint64_t bytes = 0, span = 0;
  for (int k = 0; k < n; ++k) {
    const uint64_t b = (*model)->layout(k).padded * sizeof(bf16);
    ASSERT_LT(b, RunnerOptions{}.coalesce_bytes);
    bytes += b;
    span += k + 1 < n ? (b + 4095) / 4096 * 4096 : b;
  }
  RunnerOptions o;
  o.persistence_threshold = 0;
  auto runner = Stage3Runner::Create(**model, 0, **dev, nullptr, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  const std::vector<int> forward = {0, 1, 2, 3};
  int64_t copies = 0, pushes = 0;
  uint64_t moved = 0, pushed = 0;
  for (int micro = 1; micro <= 4; ++micro) {
    SCOPED_TRACE(StrCat("micro-step ", micro));
    for (int k : forward) {
      ASSERT_TRUE((*runner)->Acquire(k).ok());
      ASSERT_TRUE((*runner)->Release(k).ok());
    }
    RunnerStats stats = (*runner)->stats();  // every fetch of this micro-step is done
    EXPECT_EQ(stats.fetches, n * micro);
    EXPECT_EQ(stats.prefetch_hits, n * (micro - 1));
    if (micro == 3) {  // the first micro-step of step 2
      EXPECT_GE(stats.h2d_copies - copies, 1);
      EXPECT_LE(stats.h2d_copies - copies, n);
      EXPECT_GE(stats.h2d_bytes - moved, bytes);
      EXPECT_LE(stats.h2d_bytes - moved, span);
    } else {
      EXPECT_EQ(stats.h2d_copies - copies, micro == 1 ? n : 1);
      EXPECT_EQ(stats.h2d_bytes - moved, micro == 1 ? bytes : span);
    }
    copies = stats.h2d_copies;
    moved = stats.h2d_bytes;
    for (int k = n - 1; k >= 0; --k) {
      ASSERT_TRUE((*runner)->GradBuffer(k).ok());
      ASSERT_TRUE((*runner)->PushGrads(k).ok());
    }
    ASSERT_TRUE((*runner)->Step().ok());
    stats = (*runner)->stats();  // Step() waited for the pushes
    EXPECT_GE(stats.d2h_copies - pushes, 1);
    EXPECT_LE(stats.d2h_copies - pushes, 2);
    EXPECT_GE(stats.d2h_bytes - pushed, bytes);
    EXPECT_LE(stats.d2h_bytes - pushed, span);
    pushes = stats.d2h_copies;
    pushed = stats.d2h_bytes;
  }
  // Off: a copy per unit each way.
  runner->reset();
  o.coalesce_bytes = 0;
  runner = Stage3Runner::Create(**model, 0, **dev, nullptr, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE(MicroStep(**runner, forward, n).ok());
  ASSERT_TRUE(MicroStep(**runner, forward, n).ok());
  for (int k : forward) {  // a third forward pass: every fetch queued so far has landed
    ASSERT_TRUE((*runner)->Acquire(k).ok());
    ASSERT_TRUE((*runner)->Release(k).ok());
  }
  const RunnerStats stats = (*runner)->stats();
  EXPECT_EQ(stats.fetches, 3 * n);
  EXPECT_EQ(stats.h2d_copies, stats.fetches);
  EXPECT_EQ(stats.d2h_copies, 2 * n);
  EXPECT_EQ(stats.d2h_bytes, 2 * bytes);
}

// Runs `rank(r)` for r in [0, ranks) on a thread each; the first error.
// Each rank's error is said at once: the others may wait for it in a
// collective for long.
Status OnRankThreads(int ranks, const std::function<Status(int)>& rank) {
  std::vector<Status> status(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = rank(r);
      if (!status[r].ok()) std::fprintf(stderr, "rank %d: %s\n", r, status[r].ToString().c_str());
    });
  }
  for (std::thread& th : threads) th.join();
  for (const Status& st : status) ZT_RETURN_IF_ERROR(st);
  return Status::Ok();
}

// Grads that differ by unit, rank, step and element, none zero.
std::vector<bf16> SyntheticGrads(size_t n, int unit, int rank, int step) {
  std::vector<bf16> g(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = FloatToBf16(0.01f * static_cast<float>(1 + (i * 7 + unit * 5 + rank * 3 + step) % 23));
  }
  return g;
}

// With R > 1 the pushes of units whose shard is small go in runs, grouped
// as the calls come: the tiny GPT's backward pushes its four units in
// reverse order, side by side in the engine's memory, so each rank makes
// one copy a micro-step (one a unit without coalescing), the ranks' copies
// together cover the run's span once, and training is the in-memory
// reference's bit for bit (the sum over ranks is elementwise, so grouping
// cannot change it). Three ranks cut the span into chunks padded to whole
// blocks.
TEST(RunnerTest, PushesOfSmallShardsGoInOneCopyPerRunAndRank) {
  for (int ranks : {2, 3}) {
    SCOPED_TRACE(StrCat(ranks, " ranks"));
    TrainSetup s;
    s.ranks = ranks;
    s.clip = 0.05f;
    s.accumulation = 2;
    const int steps = 2;
    const int64_t micro = steps * s.accumulation;
    Result<RunResult> coalesced = RunZtier(s, steps);
    ASSERT_TRUE(coalesced.ok()) << coalesced.status();
    TrainSetup alone_setup = s;
    alone_setup.coalesce_bytes = 0;
    Result<RunResult> alone = RunZtier(alone_setup, steps);
    ASSERT_TRUE(alone.ok()) << alone.status();
    Result<RunResult> ref = RunInMemory(s, steps);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ExpectSameTraining(*coalesced, *ref);
    ExpectSameTraining(*alone, *ref);

    // The span of the units' whole inboxes, each starting on a page.
    auto session = testing::OpenTestSession(Options(s, ""));
    ASSERT_TRUE(session.ok()) << session.status();
    auto model = (*session)->RegisterModel(Spec(s, "layouts"));
    ASSERT_TRUE(model.ok()) << model.status();
    const int n = (*model)->units();
    ASSERT_EQ(n, 4);
    uint64_t span = 0, shards = 0;
    for (int k = 0; k < n; ++k) {
      const engine::UnitLayout& l = (*model)->layout(k);
      ASSERT_LT(l.shard * sizeof(bf16), RunnerOptions{}.coalesce_bytes);
      const uint64_t b = l.padded * sizeof(bf16);
      span += k + 1 < n ? (b + 4095) / 4096 * 4096 : b;
      shards += l.shard * sizeof(bf16);
    }
    uint64_t moved = 0;
    for (int r = 0; r < ranks; ++r) {
      SCOPED_TRACE(StrCat("rank ", r));
      EXPECT_EQ(coalesced->stats[r].d2h_copies, micro);
      EXPECT_EQ(alone->stats[r].d2h_copies, micro * n);
      EXPECT_EQ(alone->stats[r].d2h_bytes, micro * shards);
      moved += coalesced->stats[r].d2h_bytes;
    }
    EXPECT_EQ(moved, micro * span);
  }
}

// A run's span is cut into R chunks padded to whole blocks, and the last
// rank's chunk stops at the span's end: the page after it may be the inbox
// of a unit whose grads the engine holds and has not used yet. Three ranks
// push a large unit c first (alone: its shard is over the limit), then b
// and a, small and before it in memory, in one run whose span (a's page,
// b's three, up to c's inbox) is no whole number of blocks: copied
// unclipped, rank 2's chunk would zero the start of c's grads before the
// optimizer reads them (after a's). The masters are those of every unit
// pushed alone, bit for bit, and the ranks' copies of the run add up to its
// span exactly.
TEST(RunnerTest, ARunsLastChunkStopsAtTheSpansEnd) {
  constexpr int kRanks = 3;
  constexpr int kSteps = 2;
  const Session::ModelSpec spec{
      .name = "clip",
      .units = {{"a", {{"w", {192}}}}, {"b", {{"w", {6144}}}}, {"c", {{"w", {24576}}}}},
      .optimizer = Optimizer(TrainSetup{}),
      .world_size = kRanks};
  const uint64_t limit = 16 << 10;  // takes a's and b's shards, not c's
  struct Outcome {
    std::vector<std::vector<float>> master;
    std::vector<RunnerStats> stats;
    uint64_t span = 0, c_shard = 0;
  };
  const auto train = [&](uint64_t coalesce_bytes) -> Result<Outcome> {
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Session> session,
                        testing::OpenTestSession(Options(TrainSetup{}, "")));
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, session->RegisterModel(spec));
    Outcome out;
    // The premise: a and b make one span that ends where c's inbox starts.
    Transport& t = model->transport();
    std::vector<const uint8_t*> inbox;
    for (int k = 0; k < 3; ++k) {
      std::vector<float> w(model->layout(k).numel, 0.01f);
      ZT_RETURN_IF_ERROR(model->SetWeights(k, w.data(), w.size()));
      ZT_ASSIGN_OR_RETURN(bf16 * p, t.GradInbox(model->job(), k, 0));
      inbox.push_back(reinterpret_cast<const uint8_t*>(p));
    }
    out.span = static_cast<uint64_t>(inbox[2] - inbox[0]);
    out.c_shard = model->layout(2).shard * sizeof(bf16);
    if (inbox[1] - inbox[0] != 4096 || out.span != 4 * 4096 ||
        out.span % (kRanks * engine::kAlignElements * sizeof(bf16)) == 0) {
      return Status::Internal(StrCat("inboxes at +", inbox[1] - inbox[0], " and +", out.span));
    }
    ZT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Collectives>> coll,
                        MakeLocalCollectives(kRanks));
    out.stats.resize(kRanks);
    ZT_RETURN_IF_ERROR(OnRankThreads(kRanks, [&](int r) -> Status {
      ZT_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, MakeHostDevice());
      ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                          Stage3Runner::Create(*model, r, *dev, coll[r].get(),
                                               {.coalesce_bytes = coalesce_bytes,
                                                .timeout = std::chrono::seconds(60)}));
      for (int step = 0; step < kSteps; ++step) {
        for (int k = 0; k < 3; ++k) {
          ZT_RETURN_IF_ERROR(runner->Acquire(k).status());
          ZT_RETURN_IF_ERROR(runner->Release(k));
        }
        for (int k = 2; k >= 0; --k) {
          const std::vector<bf16> g = SyntheticGrads(model->layout(k).padded, k, r, step);
          ZT_RETURN_IF_ERROR(runner->PushGrads(k, g.data(), g.size()));
        }
        ZT_RETURN_IF_ERROR(runner->Step());
      }
      out.stats[r] = runner->stats();
      return Status::Ok();
    }));
    ZT_RETURN_IF_ERROR(model->WaitPublished(kSteps, std::chrono::seconds(60)));
    out.master.resize(3);
    for (int k = 0; k < 3; ++k) ZT_RETURN_IF_ERROR(model->ReadMaster(k, &out.master[k]));
    return out;
  };
  Result<Outcome> coalesced = train(limit);
  ASSERT_TRUE(coalesced.ok()) << coalesced.status();
  Result<Outcome> alone = train(0);
  ASSERT_TRUE(alone.ok()) << alone.status();
  for (int k = 0; k < 3; ++k) {
    ASSERT_EQ(coalesced->master[k].size(), alone->master[k].size());
    EXPECT_EQ(std::memcmp(coalesced->master[k].data(), alone->master[k].data(),
                          alone->master[k].size() * sizeof(float)),
              0)
        << "fp32 master of unit " << k;
  }
  uint64_t moved = 0;
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(coalesced->stats[r].d2h_copies, 2 * kSteps) << "rank " << r;  // c, then the run
    EXPECT_EQ(alone->stats[r].d2h_copies, 3 * kSteps) << "rank " << r;
    moved += coalesced->stats[r].d2h_bytes;
  }
  EXPECT_EQ(moved, kSteps * (kRanks * coalesced->c_shard + coalesced->span));
}

// With R > 1 the fetches of units whose shard is small (but not the whole
// unit) go in runs of units side by side in the engine's memory, grouped
// as the calls come, once fetched at the step's version before. Three
// ranks, a 16 KiB limit: a, b and c take 24 KiB each (8 KiB shards), d 60
// KiB (a 20 KiB shard, fetched as before). Once the order is learned, the
// forward fetches a unit at a time (the first at the version: a run would
// wait for the optimizer's later units), and the backward, d still held,
// fetches c and b in one span of 48 KiB (b's page-rounded block, then c):
// a chunk of 16 KiB a rank and one all-gather; a cannot join (the span
// would outgrow 3 x 16 KiB) and goes as before. What each rank acquires is
// what it acquires with every unit fetched alone, byte for byte, and the
// copies and bytes a rank makes are exactly those.
TEST(RunnerTest, FetchesOfSmallShardsGoInRunsOfOneCopyARank) {
  constexpr int kRanks = 3;
  constexpr int kSteps = 3;
  constexpr uint64_t kLimit = 16 << 10;
  const Session::ModelSpec spec{.name = "fetch-runs",
                                .units = {{"a", {{"w", {12288}}}},
                                          {"b", {{"w", {12288}}}},
                                          {"c", {{"w", {12288}}}},
                                          {"d", {{"w", {30720}}}}},
                                .optimizer = Optimizer(TrainSetup{}),
                                .world_size = kRanks};
  struct Outcome {
    std::vector<std::vector<std::vector<uint8_t>>> seen;  // [rank][step * 8 + acquire]
    std::vector<RunnerStats> stats;
  };
  const auto train = [&](uint64_t coalesce_bytes) -> Result<Outcome> {
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Session> session,
                        testing::OpenTestSession(Options(TrainSetup{}, "")));
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, session->RegisterModel(spec));
    for (int k = 0; k < 4; ++k) {
      std::vector<float> w(model->layout(k).numel);
      for (size_t i = 0; i < w.size(); ++i) w[i] = 0.001f * static_cast<float>((i * 13 + k) % 97);
      ZT_RETURN_IF_ERROR(model->SetWeights(k, w.data(), w.size()));
    }
    ZT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Collectives>> coll,
                        MakeLocalCollectives(kRanks));
    Outcome out;
    out.seen.resize(kRanks);
    out.stats.resize(kRanks);
    ZT_RETURN_IF_ERROR(OnRankThreads(kRanks, [&](int r) -> Status {
      ZT_ASSIGN_OR_RETURN(
          std::unique_ptr<Device> dev,
          MakeHostDevice({.copy_delay = std::chrono::milliseconds(1), .check_copy_sources = true}));
      ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                          Stage3Runner::Create(*model, r, *dev, coll[r].get(),
                                               {.prefetch_depth = 2,
                                                .coalesce_bytes = coalesce_bytes,
                                                .timeout = std::chrono::seconds(60)}));
      const auto see = [&](int k) -> Status {
        ZT_ASSIGN_OR_RETURN(const bf16* p, runner->Acquire(k));
        const auto* b = reinterpret_cast<const uint8_t*>(p);
        out.seen[r].emplace_back(b, b + model->layout(k).padded * sizeof(bf16));
        return Status::Ok();
      };
      for (int step = 0; step < kSteps; ++step) {
        for (int k = 0; k < 4; ++k) {
          ZT_RETURN_IF_ERROR(see(k));
          ZT_RETURN_IF_ERROR(runner->Release(k));
        }
        for (int k = 3; k >= 0; --k) {
          ZT_RETURN_IF_ERROR(see(k));
          const std::vector<bf16> g = SyntheticGrads(model->layout(k).padded, k, r, step);
          ZT_RETURN_IF_ERROR(runner->PushGrads(k, g.data(), g.size()));
          ZT_RETURN_IF_ERROR(runner->Release(k));
        }
        ZT_RETURN_IF_ERROR(runner->Step());
      }
      out.stats[r] = runner->stats();
      return Status::Ok();
    }));
    return out;
  };
  Result<Outcome> runs = train(kLimit);
  ASSERT_TRUE(runs.ok()) << runs.status();
  Result<Outcome> alone = train(0);
  ASSERT_TRUE(alone.ok()) << alone.status();
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(StrCat("rank ", r));
    ASSERT_EQ(runs->seen[r].size(), alone->seen[r].size());
    for (size_t i = 0; i < alone->seen[r].size(); ++i) {
      EXPECT_TRUE(runs->seen[r][i] == alone->seen[r][i]) << "step " << i / 8 << " unit "
                                                         << "abcddcba"[i % 8] << " differs";
      if (r > 0) {
        EXPECT_TRUE(alone->seen[r][i] == alone->seen[0][i]);
      }
    }
    // The first step follows no learned order: a copy a fetch, each unit
    // twice. Then each step: a unit at a time forward; backward the run's
    // chunk and a's shard (d held since the forward).
    const uint64_t shard = 8 << 10, d_shard = 20 << 10;
    const uint64_t forward = 3 * shard + d_shard;
    EXPECT_EQ(runs->stats[r].h2d_copies, 8 + (kSteps - 1) * (4 + 2));
    EXPECT_EQ(runs->stats[r].h2d_bytes, 2 * forward + (kSteps - 1) * (forward + 2 * shard + shard));
    EXPECT_EQ(alone->stats[r].h2d_copies, 8 + (kSteps - 1) * (4 + 3));
    EXPECT_EQ(alone->stats[r].h2d_bytes, 2 * forward + (kSteps - 1) * (forward + 3 * shard));
  }
}

// A test session and `spec` registered in it, each unit's weights
// 0.01 x (its index + 1).
struct Registered {
  std::unique_ptr<Session> session;
  std::unique_ptr<Model> model;  // (goes before its session)
};
Result<Registered> RegisterWithWeights(const Session::ModelSpec& spec) {
  Registered r;
  ZT_ASSIGN_OR_RETURN(r.session, testing::OpenTestSession(Options(TrainSetup{}, "")));
  ZT_ASSIGN_OR_RETURN(r.model, r.session->RegisterModel(spec));
  for (int k = 0; k < r.model->units(); ++k) {
    std::vector<float> w(r.model->layout(k).numel, 0.01f * static_cast<float>(k + 1));
    ZT_RETURN_IF_ERROR(r.model->SetWeights(k, w.data(), w.size()));
  }
  return r;
}

// A device that refuses params memory once `allowed` more allocations of
// it were made (negative: never), as a GPU whose memory others took.
class RefusingDevice final : public Device {
 public:
  explicit RefusingDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}
  void Allow(int more) { allowed_ = more; }

  DeviceKind kind() const override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  int ordinal() const override { return inner_->ordinal(); }
  Result<void*> Allocate(size_t bytes, MemoryPurpose purpose) override {
    if (purpose == MemoryPurpose::kParams && allowed_ >= 0 && allowed_-- == 0) {
      return Status::ResourceExhausted(StrCat("refusing device: no room for ", bytes, " bytes"));
    }
    return inner_->Allocate(bytes, purpose);
  }
  void Free(void* ptr) override { inner_->Free(ptr); }
  MemoryStats memory(MemoryPurpose purpose) const override { return inner_->memory(purpose); }
  void ResetHighWater() override { inner_->ResetHighWater(); }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream stream) override {
    return inner_->CopyToDevice(dst, src, bytes, stream);
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes, Stream stream) override {
    return inner_->CopyToHost(dst, src, bytes, stream);
  }
  Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream stream) override {
    return inner_->CopyOnDevice(dst, src, bytes, stream);
  }
  Status Memset(void* dst, int value, size_t bytes, Stream stream) override {
    return inner_->Memset(dst, value, bytes, stream);
  }
  Result<std::unique_ptr<Event>> Record(Stream stream) override { return inner_->Record(stream); }
  Status Wait(Stream stream, Event& event) override { return inner_->Wait(stream, event); }
  Status Synchronize(Stream stream) override { return inner_->Synchronize(stream); }
  void* native_stream(Stream stream) const override { return inner_->native_stream(stream); }
  Status RegisterHost(void* ptr, size_t bytes, HostAccess access) override {
    return inner_->RegisterHost(ptr, bytes, access);
  }
  Status UnregisterHost(void* ptr, size_t bytes) override {
    return inner_->UnregisterHost(ptr, bytes);
  }
  void EnableTimeline(bool on) override { inner_->EnableTimeline(on); }
  void AddSpan(TimelineSpan span) override { inner_->AddSpan(std::move(span)); }
  std::vector<TimelineSpan> timeline() const override { return inner_->timeline(); }

 private:
  std::unique_ptr<Device> inner_;
  std::atomic<int> allowed_{-1};
};

// A run of fetches (R > 1, small shards) one of whose units the device
// cannot take on one rank: that rank fails and its peers are told. Before,
// its run went shorter than its peers' (an all-gather of another size,
// then the unit's own fetch, which they never made): a hang, or params
// from the wrong units. The layout of FetchesOfSmallShardsGoInRunsOfOneCopyARank;
// rank 0's device refuses b's params in the second step's run of c and b.
TEST(RunnerTest, ARunOfFetchesOneRankCannotHoldFailsThatRankAndItsPeers) {
  constexpr int kRanks = 3;
  const Session::ModelSpec spec{.name = "fetch-run-refused",
                                .units = {{"a", {{"w", {12288}}}},
                                          {"b", {{"w", {12288}}}},
                                          {"c", {{"w", {12288}}}},
                                          {"d", {{"w", {30720}}}}},
                                .optimizer = Optimizer(TrainSetup{}),
                                .world_size = kRanks};
  Result<Registered> registered = RegisterWithWeights(spec);
  ASSERT_TRUE(registered.ok()) << registered.status();
  Model& model = *registered->model;
  auto coll = MakeLocalCollectives(kRanks, std::chrono::seconds(30));
  ASSERT_TRUE(coll.ok()) << coll.status();
  std::vector<Status> outcome(kRanks);
  std::vector<RunnerStats> stats(kRanks);
  const auto t0 = std::chrono::steady_clock::now();
  const Status ran = OnRankThreads(kRanks, [&](int r) -> Status {
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Device> host, MakeHostDevice());
    RefusingDevice dev(std::move(host));
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                        Stage3Runner::Create(model, r, dev, (*coll)[r].get(),
                                             {.prefetch_depth = 2,
                                              .coalesce_bytes = 16 << 10,
                                              .timeout = std::chrono::seconds(30)}));
    outcome[r] = [&]() -> Status {
      for (int step = 0; step < 2; ++step) {
        for (int k = 0; k < 4; ++k) {
          // The forward's Acquire(d) prefetches the backward's c, which
          // takes b along (fetched at this version before, next to it).
          if (r == 0 && step == 1 && k == 3) dev.Allow(1);
          ZT_RETURN_IF_ERROR(runner->Acquire(k).status());
          ZT_RETURN_IF_ERROR(runner->Release(k));
        }
        for (int k = 3; k >= 0; --k) {
          ZT_RETURN_IF_ERROR(runner->Acquire(k).status());
          const std::vector<bf16> g = SyntheticGrads(model.layout(k).padded, k, r, step);
          ZT_RETURN_IF_ERROR(runner->PushGrads(k, g.data(), g.size()));
          ZT_RETURN_IF_ERROR(runner->Release(k));
        }
        ZT_RETURN_IF_ERROR(runner->Step());
      }
      return Status::Ok();
    }();
    stats[r] = runner->stats();
    return Status::Ok();
  });
  ASSERT_TRUE(ran.ok()) << ran;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  ASSERT_FALSE(outcome[0].ok());
  EXPECT_NE(outcome[0].message().find("refusing device"), std::string::npos) << outcome[0];
  EXPECT_NE(outcome[0].message().find("every rank must prefetch alike"), std::string::npos)
      << outcome[0];
  for (int r = 1; r < kRanks; ++r) {
    ASSERT_FALSE(outcome[r].ok()) << "rank " << r;
    EXPECT_NE(outcome[r].message().find("rank 0 failed"), std::string::npos) << outcome[r];
  }
}

// A limit over 1 GiB is refused.
TEST_F(RunnerErrorsTest, CoalesceLimitIsChecked) {
  RunnerOptions o;
  o.coalesce_bytes = (uint64_t{1} << 30) + 1;
  auto runner = Stage3Runner::Create(*model_, 0, *dev_, nullptr, o);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(runner.status().ToString().find("coalesce_bytes"), std::string::npos)
      << runner.status();
}

// Two small units and a 4M-param head (a few milliseconds of AdamW, so
// the engine's step is still running for a while after the head's grads
// land), with weights set.
Result<std::unique_ptr<Model>> RegisterTailHeavy(Session& session, const TrainSetup& s) {
  Session::ModelSpec spec{
      .name = "tail-heavy",
      .units = {{"a", {{"w", {4096}}}}, {"b", {{"w", {4096}}}}, {"head", {{"w", {2048, 2048}}}}},
      .optimizer = Optimizer(s)};
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, session.RegisterModel(spec));
  for (int k = 0; k < 3; ++k) {
    std::vector<float> w(model->layout(k).numel, 0.01f);
    ZT_RETURN_IF_ERROR(model->SetWeights(k, w.data(), w.size()));
  }
  return model;
}

// A runner made right after another one's Step(), while the engine's
// optimizer still runs that step (exact mode publishes units in forward
// order, so the first units already hold it), reads that step: the head it
// acquires is the updated one, never the weights from before the step for
// some units and after it for others, and its pushes wait for that step.
// The last unit is large (4M params, a
// few milliseconds of AdamW) so the step is still running when the next
// runner starts; rounds where it was not prove nothing and are counted.
TEST(RunnerTest, ARunnerMadeWhileAStepRunsReadsThatStep) {
  TrainSetup s;
  auto session = testing::OpenTestSession(Options(s, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  auto model = RegisterTailHeavy(**session, s);
  ASSERT_TRUE(model.ok()) << model.status();
  auto dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok());
  Transport& t = (*model)->transport();
  const int job = (*model)->job();
  int in_flight = 0;
  for (int round = 0; round < 10; ++round) {
    // No prefetch: the last runner's would wait for the step to finish.
    auto runner = Stage3Runner::Create(**model, 0, **dev, nullptr, {.prefetch_depth = 0});
    ASSERT_TRUE(runner.ok()) << runner.status();
    int64_t low = INT64_MAX, high = -1;
    for (int k = 0; k < 3; ++k) {
      low = std::min(low, t.PublishedStep(job, k).value());
      high = std::max(high, t.PublishedStep(job, k).value());
    }
    in_flight += low < high;
    const int64_t version = (*runner)->version();
    // Reading an older step would copy the head while the optimizer
    // rewrites it in place, and push grads into an inbox it still reads.
    EXPECT_GE(version, high) << "round " << round;
    ASSERT_TRUE((*runner)->Acquire(2).ok());
    ASSERT_TRUE((*runner)->Release(2).ok());
    // Once the engine is done every unit holds exactly the runner's step.
    for (int k = 0; k < 3; ++k) {
      ASSERT_TRUE(t.WaitPublished(job, k, version, std::chrono::seconds(30)).ok());
      EXPECT_EQ(t.PublishedStep(job, k).value(), version) << "round " << round << ", unit " << k;
    }
    const Status st = MicroStep(**runner, {}, 3);
    ASSERT_TRUE(st.ok()) << "round " << round << ": " << st;
  }
  std::printf("%d of 10 runners were made while a step ran\n", in_flight);
}

// A coalesced fetch never waits for a later unit: the next micro-step's
// fetch queued at Step() takes all three units (the limit is set to take
// even the 8 MB head), but unit 0 reaches the device as soon as the engine
// has updated it, while the head's update (4M params) still runs. Waiting
// for the whole run would put the optimizer's full step on the critical
// path; rounds where the head was done first prove nothing and are
// counted, and at least one round in twenty must show it.
TEST(RunnerTest, ACoalescedFetchNeverWaitsForALaterUnit) {
  TrainSetup s;
  auto session = testing::OpenTestSession(Options(s, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  auto model = RegisterTailHeavy(**session, s);
  ASSERT_TRUE(model.ok()) << model.status();
  auto dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok());
  Transport& t = (*model)->transport();
  const int job = (*model)->job();
  auto runner = Stage3Runner::Create(**model, 0, **dev, nullptr,
                                     {.prefetch_depth = 2, .coalesce_bytes = uint64_t{64} << 20});
  ASSERT_TRUE(runner.ok()) << runner.status();
  const std::vector<int> forward = {0, 1, 2};
  ASSERT_TRUE(MicroStep(**runner, forward, 3).ok());  // learns the order
  int early = 0;
  for (int round = 0; round < 20; ++round) {
    // Step() has queued the fetch of all three units at this version.
    const int64_t version = (*runner)->version();
    ASSERT_TRUE((*runner)->Acquire(0).ok());
    early += t.PublishedStep(job, 2).value() < version;
    ASSERT_TRUE((*runner)->Release(0).ok());
    for (int k : {1, 2}) {
      ASSERT_TRUE((*runner)->Acquire(k).ok());
      ASSERT_TRUE((*runner)->Release(k).ok());
    }
    for (int k = 2; k >= 0; --k) {
      ASSERT_TRUE((*runner)->GradBuffer(k).ok());
      ASSERT_TRUE((*runner)->PushGrads(k).ok());
    }
    ASSERT_TRUE((*runner)->Step().ok());
  }
  std::printf("%d of 20 rounds had unit 0 on the device before the head was updated\n", early);
  EXPECT_GE(early, 1);
  EXPECT_EQ((*runner)->stats().prefetch_hits, 60);
}

// Bad use of the C++ API is an error, never a crash: null buffers, an
// unknown unit's layout, a negative timeout, collectives of another world.
TEST_F(RunnerErrorsTest, NullBuffersUnknownUnitsAndBadOptionsAreErrors) {
  EXPECT_EQ(model_->SetWeights(0, nullptr, model_->layout(0).numel).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(model_->ReadMaster(0, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model_->layout(model_->units()).numel, 0u);
  EXPECT_EQ(model_->layout(-1).numel, 0u);
  // milliseconds::min() overflowed into a wait (UB): now no wait at all.
  const Status s = model_->WaitPublished(5, std::chrono::milliseconds::min());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;  // no grads can reach step 5
  EXPECT_TRUE(model_->WaitPublished(0, std::chrono::milliseconds::min()).ok());
  runner_.reset();  // one runner a rank
  auto r = Stage3Runner::Create(*model_, 0, *dev_, nullptr, {.timeout = std::chrono::seconds(-1)});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
  auto coll = MakeLocalCollectives(2);
  ASSERT_TRUE(coll.ok()) << coll.status();
  r = Stage3Runner::Create(*model_, 0, *dev_, (*coll)[0].get(), {});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().ToString().find("world size 1"), std::string::npos) << r.status();
}

// A rank that gave up on a rendezvous (timed out) stayed counted: the next
// rank to arrive passed it alone and read the departed rank's buffer, which
// may be freed by then. The group is over once a rank gives up.
TEST(LocalCollectivesTest, ARankThatGaveUpEndsTheGroupsCollectives) {
  auto coll = MakeLocalCollectives(2, std::chrono::milliseconds(100));
  ASSERT_TRUE(coll.ok()) << coll.status();
  auto dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok()) << dev.status();
  std::vector<bf16> zero(8, FloatToBf16(0.0f)), one(8, FloatToBf16(1.0f));
  const Status alone = (*coll)[0]->AllGather(zero.data(), 4, **dev, Stream::kCompute);
  EXPECT_EQ(alone.code(), StatusCode::kUnavailable) << alone;
  // Rank 1 comes late: refused, never passing with rank 0's buffer.
  const Status late = (*coll)[1]->AllGather(one.data(), 4, **dev, Stream::kCompute);
  EXPECT_EQ(late.code(), StatusCode::kAborted) << late;
  EXPECT_EQ(Bf16ToFloat(one[0]), 1.0f);
  EXPECT_EQ((*coll)[0]->ReduceScatter(zero.data(), one.data(), 4, **dev, Stream::kCompute).code(),
            StatusCode::kAborted);
  EXPECT_EQ(MakeLocalCollectives(2, std::chrono::milliseconds(0)).status().code(),
            StatusCode::kInvalidArgument);
}

// A job's ranks wait for each other as long as they were told
// (ztier.torch passes ztier.wait_timeout): the wait was ten minutes
// whatever the caller asked.
TEST(JobCollectivesTest, ARankWaitsForItsPeersAsLongAsItWasTold) {
  TrainSetup s;
  s.ranks = 2;
  Result<Registered> r = RegisterWithWeights(Spec(s, "told"));
  ASSERT_TRUE(r.ok()) << r.status();
  Result<std::unique_ptr<Device>> dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ(MakeJobCollectives(*r->model, 0, **dev, std::chrono::milliseconds(0)).status().code(),
            StatusCode::kInvalidArgument);
  Result<std::unique_ptr<Collectives>> rank0 =
      MakeJobCollectives(*r->model, 0, **dev, std::chrono::milliseconds(300));
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  Result<std::unique_ptr<Collectives>> rank1 = MakeJobCollectives(*r->model, 1, **dev);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  std::vector<bf16> buffer(2 * 64);
  const auto t0 = std::chrono::steady_clock::now();
  const Status alone = (*rank0)->AllGather(buffer.data(), 64, **dev, Stream::kCompute);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(alone.code(), StatusCode::kUnavailable) << alone;
  EXPECT_NE(alone.ToString().find("within 0.3 s"), std::string::npos) << alone;
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  EXPECT_LT(waited, std::chrono::seconds(5));
  // Rank 1 comes late and is told rank 0 gave up, at once.
  const Status late = (*rank1)->AllGather(buffer.data(), 64, **dev, Stream::kCompute);
  EXPECT_EQ(late.code(), StatusCode::kAborted) << late;
  EXPECT_NE(late.ToString().find("rank 0 left"), std::string::npos) << late;
}

// Rank 1's collectives, whose first all-gather fails (a transfer error of
// its own); the rest goes to the group's.
class FailingFirstGather final : public Collectives {
 public:
  explicit FailingFirstGather(Collectives* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Status AllGather(bf16* buffer, size_t shard_elems, Device& device, Stream stream) override {
    if (!failed_) {
      failed_ = true;
      return Status::IoError("a copy that failed");
    }
    return inner_->AllGather(buffer, shard_elems, device, stream);
  }
  Status ReduceScatter(const bf16* input, bf16* output, size_t shard_elems, Device& device,
                       Stream stream) override {
    return inner_->ReduceScatter(input, output, shard_elems, device, stream);
  }
  void Abort(std::string_view reason) override { inner_->Abort(reason); }

 private:
  Collectives* inner_;
  bool failed_ = false;
};

// A rank whose transfer failed made no more collectives, and its peers
// waited for it until their timeout (10 minutes; for ever under NCCL).
// They now fail at once, told which rank failed.
TEST(RunnerTest, ARankThatFailsEndsItsPeersCollectivesAtOnce) {
  constexpr int kRanks = 2;
  const Session::ModelSpec spec{.name = "peers",
                                .units = {{"a", {{"w", {4096}}}}, {"b", {{"w", {4096}}}}},
                                .optimizer = Optimizer(TrainSetup{}),
                                .world_size = kRanks};
  Result<std::unique_ptr<Session>> session = testing::OpenTestSession(Options(TrainSetup{}, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  Result<std::unique_ptr<Model>> model = (*session)->RegisterModel(spec);
  ASSERT_TRUE(model.ok()) << model.status();
  for (int k = 0; k < 2; ++k) {
    std::vector<float> w((*model)->layout(k).numel, 0.01f);
    ASSERT_TRUE((*model)->SetWeights(k, w.data(), w.size()).ok());
  }
  auto coll = MakeLocalCollectives(kRanks, std::chrono::seconds(60));
  ASSERT_TRUE(coll.ok()) << coll.status();
  FailingFirstGather failing((*coll)[1].get());
  std::vector<Status> acquired(kRanks);
  const auto t0 = std::chrono::steady_clock::now();
  const Status ran = OnRankThreads(kRanks, [&](int r) -> Status {
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, MakeHostDevice());
    Collectives* c = r == 1 ? static_cast<Collectives*>(&failing) : (*coll)[0].get();
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                        Stage3Runner::Create(**model, r, *dev, c,
                                             {.prefetch_depth = 0,
                                              .coalesce_bytes = 0,  // an all-gather a unit
                                              .timeout = std::chrono::seconds(60)}));
    acquired[r] = runner->Acquire(0).status();
    return Status::Ok();
  });
  ASSERT_TRUE(ran.ok()) << ran;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_EQ(acquired[1].code(), StatusCode::kIoError) << acquired[1];
  EXPECT_EQ(acquired[0].code(), StatusCode::kAborted) << acquired[0];
  EXPECT_NE(acquired[0].message().find("rank 1 failed"), std::string::npos) << acquired[0];
}

// A device too small for the whole prefetch window (no cap set): the
// prefetch stops at the unit the device cannot take, and neither the call
// that prefetched (SetOrder starting a pass, another unit's Acquire; Step
// and AbortStep alike) fails for it; that unit is fetched when acquired,
// once there is room. Evaluation passes (no grads) on a device that holds
// three of the four units but not the window of three after unit 0.
TEST_F(RunnerErrorsTest, APrefetchTheDeviceCannotHoldFailsNoOtherCall) {
  const int n = model_->units();
  ASSERT_EQ(n, 4);
  const RunnerOptions o{.prefetch_depth = 3, .persistence_threshold = 0, .coalesce_bytes = 0};
  runner_.reset();
  const auto allocated = [](const Device& dev) {
    uint64_t total = 0;
    for (int p = 0; p < kMemoryPurposes; ++p) {
      total += dev.memory(static_cast<MemoryPurpose>(p)).bytes;
    }
    return total;
  };
  uint64_t base = 0;  // what a runner allocates up front
  {
    auto runner = Stage3Runner::Create(*model_, 0, *dev_, nullptr, o);
    ASSERT_TRUE(runner.ok()) << runner.status();
    base = allocated(*dev_);
  }
  std::vector<uint64_t> bytes;
  for (int k = 0; k < n; ++k) bytes.push_back(model_->layout(k).padded * sizeof(bf16));
  auto small = MakeHostDevice({.memory_bytes = base + bytes[0] + bytes[1] + bytes[2] - 1});
  ASSERT_TRUE(small.ok());
  auto runner = Stage3Runner::Create(*model_, 0, **small, nullptr, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  for (int pass = 1; pass <= 3; ++pass) {
    SCOPED_TRACE(StrCat("pass ", pass));
    const Status started = (*runner)->SetOrder(1);
    ASSERT_TRUE(started.ok()) << started;
    for (int k = 0; k < n; ++k) {
      const Result<const bf16*> p = (*runner)->Acquire(k);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE((*runner)->Release(k).ok());
    }
  }
  const RunnerStats st = (*runner)->stats();
  EXPECT_GT(st.prefetches_refused, 0);
  EXPECT_GT(st.prefetch_hits, 0);  // what fits is still prefetched
}

// With R > 1 each fetch is a collective, so a rank whose device cannot
// take a prefetch its peers made must not go on fetching later: its
// all-gathers paired with other units' (wrong params, or a hang). It fails,
// naming the fix, and its peers are told at once. So does a rank whose
// call failed midway (a fetch or a grad buffer the device cannot hold):
// before, its peers waited for its collectives until their timeout.
TEST(RunnerTest, ARankWhoseDeviceRefusesMemoryFailsWithItsPeers) {
  constexpr int kRanks = 2;
  const Session::ModelSpec spec{.name = "device-ranks",
                                .units = {{"a", {{"w", {8192}}}},
                                          {"b", {{"w", {8192}}}},
                                          {"c", {{"w", {8192}}}},
                                          {"d", {{"w", {8192}}}}},
                                .optimizer = Optimizer(TrainSetup{}),
                                .world_size = kRanks};
  Result<Registered> registered = RegisterWithWeights(spec);
  ASSERT_TRUE(registered.ok()) << registered.status();
  Model& model = *registered->model;
  const uint64_t unit_bytes = model.layout(0).padded * sizeof(bf16);
  // Rank 0's device holds `units` units past what a runner allocates up
  // front, rank 1's any number; each rank runs three passes, evaluation
  // (all-gathers only) or training.
  const auto run = [&](int units, int depth, bool training) -> std::vector<Status> {
    const RunnerOptions o{.prefetch_depth = depth,
                          .persistence_threshold = 0,
                          .coalesce_bytes = 0,
                          .timeout = std::chrono::seconds(30)};
    uint64_t base = 0;
    {
      auto coll = MakeLocalCollectives(kRanks);
      auto dev = MakeHostDevice();
      EXPECT_TRUE(coll.ok() && dev.ok());
      auto runner = Stage3Runner::Create(model, 0, **dev, (*coll)[0].get(), o);
      EXPECT_TRUE(runner.ok()) << runner.status();
      for (int p = 0; p < kMemoryPurposes; ++p) {
        base += (*dev)->memory(static_cast<MemoryPurpose>(p)).bytes;
      }
    }
    auto coll = MakeLocalCollectives(kRanks, std::chrono::seconds(30));
    EXPECT_TRUE(coll.ok()) << coll.status();
    std::vector<Status> outcome(kRanks);
    const Status ran = OnRankThreads(kRanks, [&](int r) -> Status {
      ZT_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev,
                          MakeHostDevice({.memory_bytes = r == 0 ? base + units * unit_bytes : 0}));
      ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                          Stage3Runner::Create(model, r, *dev, (*coll)[r].get(), o));
      outcome[r] = [&]() -> Status {
        for (int pass = 0; pass < 3; ++pass) {
          if (!training) ZT_RETURN_IF_ERROR(runner->SetOrder(1));
          for (int k = 0; k < 4; ++k) {
            ZT_RETURN_IF_ERROR(runner->Acquire(k).status());
            ZT_RETURN_IF_ERROR(runner->Release(k));
          }
          if (!training) continue;
          for (int k = 3; k >= 0; --k) {
            const std::vector<bf16> g = SyntheticGrads(model.layout(k).padded, k, r, pass);
            ZT_RETURN_IF_ERROR(runner->PushGrads(k, g.data(), g.size()));
          }
          ZT_RETURN_IF_ERROR(runner->Step());
        }
        return Status::Ok();
      }();
      return Status::Ok();
    });
    EXPECT_TRUE(ran.ok()) << ran;
    return outcome;
  };
  // Evaluation passes: the second one's prefetch (the three units after
  // the first) does not fit rank 0's device of two units.
  auto t0 = std::chrono::steady_clock::now();
  std::vector<Status> outcome = run(2, 3, /*training=*/false);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  ASSERT_FALSE(outcome[0].ok());
  EXPECT_NE(outcome[0].message().find("every rank must prefetch alike"), std::string::npos)
      << outcome[0];
  EXPECT_NE(outcome[0].message().find("max_live_bytes"), std::string::npos) << outcome[0];
  ASSERT_FALSE(outcome[1].ok());
  EXPECT_NE(outcome[1].message().find("rank 0 failed"), std::string::npos) << outcome[1];
  // Training on a device with no room for a unit: rank 0's first Acquire
  // fails, and rank 1's all-gather ends with it.
  t0 = std::chrono::steady_clock::now();
  outcome = run(0, 0, /*training=*/true);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  ASSERT_FALSE(outcome[0].ok());
  EXPECT_EQ(outcome[0].code(), StatusCode::kResourceExhausted) << outcome[0];
  ASSERT_FALSE(outcome[1].ok());
  EXPECT_NE(outcome[1].message().find("rank 0 failed"), std::string::npos) << outcome[1];
}

TEST_F(RunnerErrorsTest, UnitLargerThanTheCap) {
  runner_.reset();  // one runner a rank
  auto r = Stage3Runner::Create(*model_, 0, *dev_, nullptr, {.max_live_bytes = 1024});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().ToString().find("live-bytes cap"), std::string::npos) << r.status();
}

TEST_F(RunnerErrorsTest, HeldUnitsFillingTheCap) {
  runner_.reset();  // one runner a rank
  const uint64_t two = (model_->layout(1).padded + model_->layout(2).padded) * sizeof(bf16);
  auto r = Stage3Runner::Create(*model_, 0, *dev_, nullptr,
                                {.prefetch_depth = 0, .max_live_bytes = two});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)->Acquire(1).ok());
  ASSERT_TRUE((*r)->Acquire(2).ok());
  Result<const bf16*> third = (*r)->Acquire(0);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().ToString().find("h.0"), std::string::npos) << third.status();
  ASSERT_TRUE((*r)->Release(1).ok());
  ASSERT_TRUE((*r)->Release(2).ok());
}

// A second runner for a rank this process serves already is refused: its
// pushes went to the same inboxes as the first's, and the engine took two
// optimizer steps for one. The rank is free again once the first is gone.
TEST_F(RunnerErrorsTest, ASecondRunnerForARankIsRefused) {
  auto second = Stage3Runner::Create(*model_, 0, *dev_, nullptr, {});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition) << second.status();
  EXPECT_NE(second.status().message().find("already has a runner"), std::string::npos)
      << second.status();
  runner_.reset();
  second = Stage3Runner::Create(*model_, 0, *dev_, nullptr, {});
  EXPECT_TRUE(second.ok()) << second.status();
}

TEST_F(RunnerErrorsTest, BadRanksAndCollectives) {
  EXPECT_EQ(Stage3Runner::Create(*model_, 1, *dev_, nullptr, {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Stage3Runner::Create(*model_, 0, *dev_, nullptr, {.prefetch_depth = -1}).status().code(),
      StatusCode::kInvalidArgument);
  TrainSetup two = s_;
  two.ranks = 2;
  auto model = session_->RegisterModel(Spec(two, "two"));
  ASSERT_TRUE(model.ok());
  Status s = Stage3Runner::Create(**model, 0, *dev_, nullptr, {}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.ToString().find("collectives"), std::string::npos) << s;
}

TEST_F(RunnerErrorsTest, RunnerBeforeWeights) {
  auto model = session_->RegisterModel(Spec(s_, "empty"));
  ASSERT_TRUE(model.ok());
  Status s = Stage3Runner::Create(**model, 0, *dev_, nullptr, {}).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.ToString().find("no weights"), std::string::npos) << s;
}

TEST_F(RunnerErrorsTest, ModelLargerThanTheTiers) {
  TrainSetup big = s_;
  big.gpt.channels = 512;
  big.gpt.layers = 8;
  auto model = session_->RegisterModel(Spec(big, "too-big"));  // 256 MiB of DRAM
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(model.status().ToString().find("too-big"), std::string::npos) << model.status();
}

TEST(SessionTest, ADaemonSocketWithNothingListeningIsUnavailableNamingIt) {
  ScratchDir dir("no-daemon");
  SessionOptions o;
  o.daemon_socket = dir.path() + "/ztierd.sock";
  auto session = Session::Open(o);
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), StatusCode::kUnavailable) << session.status();
  EXPECT_NE(session.status().ToString().find(o.daemon_socket), std::string::npos)
      << session.status();
  // The same through the setting (ztier.daemon_socket, ZTIER_DAEMON_SOCKET).
  SessionOptions by_setting;
  by_setting.settings.daemon_socket = o.daemon_socket;
  session = Session::Open(by_setting);
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), StatusCode::kUnavailable) << session.status();
}

TEST(SessionTest, ASaveWhileGradsOfAStepAreInFlightIsRefused) {
  TrainSetup s;
  s.clip = 0.05f;  // the step waits for every unit's grads (the global norm)
  auto session = testing::OpenTestSession(Options(s, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  auto model = RegisterWithWeights(**session, s, "mid-step");
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  const int last = m.units() - 1;
  Result<bf16*> inbox = m.transport().GradInbox(m.job(), last, 0);
  ASSERT_TRUE(inbox.ok()) << inbox.status();
  std::fill(*inbox, *inbox + m.layout(last).shard, FloatToBf16(0.01f));
  ASSERT_TRUE(m.transport().GradsReady(m.job(), last, 0).ok());
  ScratchDir ckpt("mid-step-ckpt");
  const Status saved = m.SaveCheckpoint(ckpt.path());
  EXPECT_EQ(saved.code(), StatusCode::kFailedPrecondition) << saved;
  EXPECT_NE(saved.ToString().find("in flight"), std::string::npos) << saved;
}

TEST(SessionTest, TheTransportIsTheOneAskedFor) {
  auto session = testing::OpenTestSession(Options(TrainSetup{}, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->transport_name(), testing::DaemonUnderTest() ? "daemon" : "embedded");
}

// Param groups and frozen tensors through a Model, and learning rates set
// per step (Model::SetLearningRates): through either transport the job
// steps bit for bit as an engine in this process driven the same way; a
// group whose rate is 0 keeps its masters, a frozen tensor keeps its.
TEST(SessionTest, LearningRatesSetThroughTheModelReachTheNextStep) {
  engine::OptimizerConfig o;
  o.hyper.lr = 1e-2f;
  o.clip_norm = 1.0f;
  o.group_weight_decay = {0.1f, 0.0f};
  const std::vector<engine::UnitSpec> units = {
      {.name = "a",
       .tensors = {{.name = "w", .shape = {20, 9}, .group = 0},
                   {.name = "b", .shape = {9}, .group = 1},
                   {.name = "pos", .shape = {7, 9}, .group = 0, .frozen = true}}},
      {.name = "b", .tensors = {{.name = "w", .shape = {9, 30}, .group = 0}}}};
  const Session::ModelSpec spec{.name = "lrs", .units = units, .optimizer = o, .world_size = 2};
  const std::vector<std::vector<float>> lrs = {{}, {0.0f, 5e-2f}, {3e-3f, 0.0f}};

  // The same job in an engine of this process.
  Result<std::unique_ptr<engine::Engine>> e =
      engine::Engine::Create(Options(TrainSetup{}, "").settings);
  ASSERT_TRUE(e.ok()) << e.status();
  Result<int> ref = (*e)->RegisterJob({.name = "ref", .units = units, .ranks = 2, .optimizer = o});
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto session = testing::OpenTestSession(Options(TrainSetup{}, ""));
  ASSERT_TRUE(session.ok()) << session.status();
  auto model = (*session)->RegisterModel(spec);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  Transport& t = m.transport();
  for (int k = 0; k < m.units(); ++k) {
    std::vector<float> w(m.layout(k).numel);
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.01f * static_cast<float>(i % 17) - 0.08f;
    ASSERT_TRUE(m.SetWeights(k, w.data(), w.size()).ok());
    ASSERT_TRUE((*e)->WriteWeights(*ref, k, w.data(), w.size()).ok());
  }
  std::vector<std::vector<float>> before(m.units());
  for (int step = 1; step <= static_cast<int>(lrs.size()); ++step) {
    const std::vector<float>& set = lrs[step - 1];
    if (!set.empty()) {
      ASSERT_TRUE(m.SetLearningRates(set).ok());
      ASSERT_TRUE((*e)->SetLearningRates(*ref, set).ok());
    }
    for (int k = 0; k < m.units(); ++k) ASSERT_TRUE(m.ReadMaster(k, &before[k]).ok());
    for (int k = m.units() - 1; k >= 0; --k) {
      const uint64_t shard = m.layout(k).shard;
      for (int r = 0; r < 2; ++r) {
        std::vector<bf16> g(shard);
        for (uint64_t i = 0; i < shard; ++i) {
          g[i] = FloatToBf16(0.05f * static_cast<float>((i * 7 + step + r) % 11) - 0.25f);
        }
        Result<bf16*> inbox = t.GradInbox(m.job(), k, r);
        ASSERT_TRUE(inbox.ok()) << inbox.status();
        std::copy(g.begin(), g.end(), *inbox);
        ASSERT_TRUE(t.GradsReady(m.job(), k, r).ok());
        std::copy(g.begin(), g.end(), *(*e)->GradInbox(*ref, k, r));
        ASSERT_TRUE((*e)->GradsReady(*ref, k, r).ok());
      }
    }
    ASSERT_TRUE(m.WaitPublished(step, std::chrono::seconds(30)).ok());
    for (int k = 0; k < m.units(); ++k) {
      ASSERT_TRUE((*e)->WaitPublished(*ref, k, step, std::chrono::seconds(30)).ok());
      std::vector<float> got, want(m.layout(k).padded);
      ASSERT_TRUE(m.ReadMaster(k, &got).ok());
      ASSERT_TRUE((*e)->ReadState(*ref, k, want.data(), nullptr, nullptr).ok());
      ASSERT_EQ(got, want) << "unit " << k << " step " << step;
    }
    // Unit "a": w [0, 180) in group 0, b [180, 189) in group 1, pos frozen.
    std::vector<float> a;
    ASSERT_TRUE(m.ReadMaster(0, &a).ok());
    auto moved = [&](uint64_t begin, uint64_t end) {
      return !std::equal(a.begin() + begin, a.begin() + end, before[0].begin() + begin);
    };
    EXPECT_FALSE(moved(189, 252)) << "a frozen tensor moved at step " << step;
    if (!set.empty()) {
      EXPECT_EQ(moved(0, 180), set[0] > 0.0f) << "group 0 at step " << step;
      EXPECT_EQ(moved(180, 189), set[1] > 0.0f) << "group 1 at step " << step;
    }
  }
  // Refusals, named alike through either transport.
  Status s = m.SetLearningRates({1e-3f});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.ToString().find("1 learning rates for its 2 param groups"), std::string::npos) << s;
  EXPECT_NE(s.ToString().find("job 'lrs'"), std::string::npos) << s;
  s = m.SetLearningRates({1e-3f, -1.0f});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.ToString().find("param group 1"), std::string::npos) << s;
  s = m.SetLearningRates({std::nanf(""), 1e-3f});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.ToString().find("param group 0"), std::string::npos) << s;
}

// ------------------------------------------------------- ranks in processes

constexpr int kProcessSteps = 3;

TrainSetup ProcessSetup() {
  TrainSetup s;
  s.ranks = 3;
  s.clip = 0.05f;
  s.accumulation = 2;
  s.job_collectives = true;
  return s;
}

TrainSetup HoldSetup() {
  TrainSetup s;
  s.ranks = 2;
  s.job_collectives = true;
  return s;
}

// A rank that runs in a process of its own, for the tests below: this
// binary started again with ZTIER_TEST_RANK=SOCKET,RANK,MODE[,READY_FILE].
// MODE train: attach to model "mp" and train with the other ranks; hold:
// attach to "hold", meet the others' collective region, create READY_FILE
// and wait to be killed.
// A ztierd of its own for a test, and a session through it (and a second
// one, a connection of another rank's, where asked for).
struct DaemonAndSession {
  std::unique_ptr<testing::TestDaemon> daemon;
  std::unique_ptr<Session> session;
  std::unique_ptr<Session> second;
  std::string socket() const { return daemon->socket(); }
};
Result<DaemonAndSession> StartDaemon(const TrainSetup& s, bool second_connection = false,
                                     const std::string& swap_dir = "",
                                     std::shared_ptr<nvme::IoBackend> io = nullptr) {
  DaemonAndSession out;
  ZT_ASSIGN_OR_RETURN(out.daemon,
                      testing::TestDaemon::Start(Options(s, swap_dir).settings, {}, std::move(io)));
  SessionOptions o;
  o.daemon_socket = out.daemon->socket();
  ZT_ASSIGN_OR_RETURN(out.session, Session::Open(o));
  if (second_connection) {
    ZT_ASSIGN_OR_RETURN(out.second, Session::Open(o));
  }
  return out;
}

TEST(RanksInProcessesTest, AttachedRank) {
  const char* env = std::getenv("ZTIER_TEST_RANK");
  if (env == nullptr) GTEST_SKIP() << "a helper process of the tests below";
  std::vector<std::string> f;
  for (std::string_view rest = env;;) {
    const size_t comma = rest.find(',');
    f.emplace_back(rest.substr(0, comma));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  ASSERT_GE(f.size(), 3u) << env;
  const int rank = std::stoi(f[1]);
  const bool hold = f[2] == "hold";
  SessionOptions o;
  o.daemon_socket = f[0];
  Result<std::unique_ptr<Session>> session = Session::Open(o);
  ASSERT_TRUE(session.ok()) << session.status();
  const TrainSetup s = hold ? HoldSetup() : ProcessSetup();
  Result<std::unique_ptr<Model>> model =
      (*session)->AttachModel(Spec(s, hold ? "hold" : "mp"), rank, std::chrono::seconds(60));
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->attached_rank(), rank);
  if (hold) {
    Result<std::unique_ptr<Device>> dev = MakeHostDevice();
    ASSERT_TRUE(dev.ok()) << dev.status();
    Result<std::unique_ptr<Collectives>> coll = MakeJobCollectives(**model, rank, **dev);
    ASSERT_TRUE(coll.ok()) << coll.status();
    ASSERT_EQ(f.size(), 4u);
    std::FILE* ready = std::fopen(f[3].c_str(), "w");
    ASSERT_NE(ready, nullptr);
    std::fclose(ready);
    std::this_thread::sleep_for(std::chrono::minutes(10));
    return;
  }
  RunResult out;
  const Status st = TrainThroughRunner(s, **model, 0, kProcessSteps * s.accumulation, &out,
                                       /*timeline=*/false, rank);
  ASSERT_TRUE(st.ok()) << st;
}

TEST(RanksInProcessesTest, RanksInProcessesTrainBitIdenticalToRanksAsThreads) {
  const TrainSetup s = ProcessSetup();
  if (!testing::DaemonUnderTest()) {
    // The embedded engine serves its own process's ranks only.
    auto session = testing::OpenTestSession(Options(s, ""));
    ASSERT_TRUE(session.ok()) << session.status();
    auto m = (*session)->AttachModel(Spec(s, "mp"), 1, std::chrono::seconds(1));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition) << m.status();
    EXPECT_NE(m.status().ToString().find("ztierd"), std::string::npos) << m.status();
    return;
  }
  Result<RunResult> threads = RunZtier(s, kProcessSteps);
  ASSERT_TRUE(threads.ok()) << threads.status();

  Result<DaemonAndSession> d = StartDaemon(s);
  ASSERT_TRUE(d.ok()) << d.status();
  Session* session = d->session.get();
  // The other ranks start first: they wait for rank 0 to register.
  std::vector<pid_t> pids;
  for (int r = 1; r < s.ranks; ++r) {
    Result<pid_t> pid =
        testing::SpawnSelf("RanksInProcessesTest.AttachedRank",
                           {StrCat("ZTIER_TEST_RANK=", d->socket(), ",", r, ",train")});
    ASSERT_TRUE(pid.ok()) << pid.status();
    pids.push_back(*pid);
  }
  Result<std::unique_ptr<Model>> model = RegisterWithWeights(*session, s, "mp");
  ASSERT_TRUE(model.ok()) << model.status();
  RunResult out;
  const Status st = TrainThroughRunner(s, **model, 0, kProcessSteps * s.accumulation, &out,
                                       /*timeline=*/false, /*only_rank=*/0);
  for (pid_t pid : pids) {
    Result<int> code = testing::WaitChild(pid);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << "the process of a rank failed (its output is above)";
  }
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(ReadMasters(**model, kProcessSteps, &out).ok());
  // Rank 0's losses and every master weight, bit for bit.
  ASSERT_EQ(out.losses.size(), threads->losses.size());
  for (size_t i = 0; i < out.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&out.losses[i][0], &threads->losses[i][0], sizeof(float)), 0)
        << "micro-step " << i << ": " << out.losses[i][0] << " vs " << threads->losses[i][0];
  }
  ASSERT_EQ(out.master.size(), threads->master.size());
  for (size_t k = 0; k < out.master.size(); ++k) {
    EXPECT_EQ(std::memcmp(out.master[k].data(), threads->master[k].data(),
                          out.master[k].size() * sizeof(float)),
              0)
        << "fp32 master of unit " << k;
  }
  EXPECT_NE(threads->losses.front()[0], threads->losses.back()[0]);
}

TEST(RanksInProcessesTest, AKilledRankFailsItsPeersCollectivesAtOnce) {
  if (!testing::DaemonUnderTest()) GTEST_SKIP() << "ranks in other processes need ztierd";
  const TrainSetup s = HoldSetup();
  Result<DaemonAndSession> d = StartDaemon(s);
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Model>> model = d->session->RegisterModel(Spec(s, "hold"));
  ASSERT_TRUE(model.ok()) << model.status();
  ScratchDir dir("killed-rank");
  const std::string ready = dir.path() + "/ready";
  Result<pid_t> pid =
      testing::SpawnSelf("RanksInProcessesTest.AttachedRank",
                         {StrCat("ZTIER_TEST_RANK=", d->socket(), ",1,hold,", ready)});
  ASSERT_TRUE(pid.ok()) << pid.status();
  ASSERT_TRUE(testing::WaitForFile(ready)) << "rank 1 did not attach";
  Result<std::unique_ptr<Device>> dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok()) << dev.status();
  Result<std::unique_ptr<Collectives>> coll = MakeJobCollectives(**model, 0, **dev);
  ASSERT_TRUE(coll.ok()) << coll.status();
  std::vector<bf16> buffer(2 * 64);
  Status gathered;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread rank0(
      [&] { gathered = (*coll)->AllGather(buffer.data(), 64, **dev, Stream::kCompute); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::kill(*pid, SIGKILL);
  (void)testing::WaitChild(*pid);
  rank0.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(gathered.code(), StatusCode::kAborted) << gathered;
  EXPECT_NE(gathered.ToString().find("rank 1 left"), std::string::npos) << gathered;
  // Later collectives fail at once too.
  EXPECT_EQ((*coll)->AllGather(buffer.data(), 64, **dev, Stream::kCompute).code(),
            StatusCode::kAborted);
}

// A rank waiting in a collective for a peer that is slow (alive) when
// ztierd ends the job: an operator's eviction reached it as "rank 0 left
// the job", and ztierd stopping as the same; a ztierd that was gone left
// it waiting for its whole timeout. It is told ztierd's reason.
TEST(RanksInProcessesTest, ZtierdsEndOfTheJobReachesARankWaitingInACollective) {
  if (!testing::DaemonUnderTest()) GTEST_SKIP() << "ranks in other processes need ztierd";
  for (const bool evict : {true, false}) {
    SCOPED_TRACE(evict ? "evicted" : "ztierd stops");
    TrainSetup s;
    s.ranks = 2;
    Result<DaemonAndSession> d = StartDaemon(s, /*second_connection=*/true);
    ASSERT_TRUE(d.ok()) << d.status();
    Result<std::unique_ptr<Model>> m0 = d->session->RegisterModel(Spec(s, "ended"));
    ASSERT_TRUE(m0.ok()) << m0.status();
    Result<std::unique_ptr<Model>> m1 = d->second->AttachModel(Spec(s, "ended"), 1);
    ASSERT_TRUE(m1.ok()) << m1.status();
    Result<std::unique_ptr<Device>> dev = MakeHostDevice();
    ASSERT_TRUE(dev.ok()) << dev.status();
    Result<std::unique_ptr<Collectives>> coll = MakeJobCollectives(**m0, 0, **dev);
    ASSERT_TRUE(coll.ok()) << coll.status();
    std::vector<bf16> buffer(2 * 64);
    Status gathered;
    std::thread rank0(
        [&] { gathered = (*coll)->AllGather(buffer.data(), 64, **dev, Stream::kCompute); });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 1 never comes
    const auto t0 = std::chrono::steady_clock::now();
    if (evict) {
      Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect(d->socket());
      ASSERT_TRUE(c.ok()) << c.status();
      Result<std::vector<engine::JobInfo>> jobs = (*c)->Jobs();
      ASSERT_TRUE(jobs.ok() && jobs->size() == 1) << jobs.status();
      ASSERT_TRUE((*c)->Evict(jobs->front().id, "maintenance at noon").ok());
    } else {
      d->daemon->daemon().Stop("ztierd stops for a test");
    }
    rank0.join();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    EXPECT_FALSE(gathered.ok());
    EXPECT_EQ(gathered.ToString().find("left the job"), std::string::npos) << gathered;
    EXPECT_NE(gathered.ToString().find(evict ? "maintenance at noon" : "ztierd stops for a test"),
              std::string::npos)
        << gathered;
  }
}

// A rank's wait for a publish, or an acquire, needs every rank's part (its
// weights, its grads): one that left ends them at once. Rank 1 waited for
// rank 0's weights after rank 0's process died, for its whole timeout (ten
// minutes), and then said nothing of rank 0.
TEST(RanksInProcessesTest, ARankThatLeftEndsItsPeersWaitsForPublishes) {
  if (!testing::DaemonUnderTest()) GTEST_SKIP() << "ranks in other processes need ztierd";
  TrainSetup s;
  s.ranks = 2;
  Result<DaemonAndSession> d = StartDaemon(s, /*second_connection=*/true);
  ASSERT_TRUE(d.ok()) << d.status();
  Session* b = d->second.get();  // rank 1's connection
  Result<std::unique_ptr<Model>> m0 = d->session->RegisterModel(Spec(s, "left"));
  ASSERT_TRUE(m0.ok()) << m0.status();
  Result<std::unique_ptr<Model>> m1 = b->AttachModel(Spec(s, "left"), 1);
  ASSERT_TRUE(m1.ok()) << m1.status();
  Transport& t = (*m1)->transport();
  const int job = (*m1)->job();
  Status waited, acquired;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread wait([&] { waited = t.WaitPublished(job, 0, 0, std::chrono::minutes(1)); });
  std::thread acquire([&] {
    Result<const bf16*> a = t.AcquireParams(job, 1, 0, std::chrono::minutes(1));
    acquired = a.status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  m0->reset();  // rank 0 goes before it set the weights
  wait.join();
  acquire.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  for (const Status& st : {waited, acquired}) {
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st;
    EXPECT_NE(st.ToString().find("rank 0 left the job"), std::string::npos) << st;
  }
}

// A rank that let go of the job once its grads of a step were in leaves
// that step to be made: a peer's wait for it goes on (a rank saving alone
// after the others closed), where a wait for a step that needs the rank's
// grads ends (above).
TEST(RanksInProcessesTest, AStepWhoseGradsAreAllInIsWaitedForAfterARankLeft) {
  if (!testing::DaemonUnderTest()) GTEST_SKIP() << "ranks in other processes need ztierd";
  using namespace std::chrono_literals;
  TrainSetup s;
  s.ranks = 2;
  s.optimizer_tier = Tier::kNvme;
  ScratchDir swap("left-after");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  Result<DaemonAndSession> d = StartDaemon(s, /*second_connection=*/true, swap.path(), fault);
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Model>> m0 = RegisterWithWeights(*d->session, s, "after");
  ASSERT_TRUE(m0.ok()) << m0.status();
  Result<std::unique_ptr<Model>> m1 = d->second->AttachModel(Spec(s, "after"), 1);
  ASSERT_TRUE(m1.ok()) << m1.status();
  // The update reads each unit's states slowly: the wait for its publish
  // outlasts ztierd's wait slices.
  fault->SlowDown(nvme::IoKind::kRead, 700ms);
  for (int k = (*m0)->units() - 1; k >= 0; --k) {
    for (Model* m : {m0->get(), m1->get()}) {
      const int rank = m == m0->get() ? 0 : 1;
      Result<bf16*> inbox = m->transport().GradInbox(m->job(), k, rank);
      ASSERT_TRUE(inbox.ok()) << inbox.status();
      std::fill_n(*inbox, m->layout(k).shard, FloatToBf16(0.01f));
      ASSERT_TRUE(m->transport().GradsReady(m->job(), k, rank).ok());
    }
  }
  m1->reset();  // rank 1 goes, its part of step 1 in
  const Status waited = (*m0)->WaitPublished(1, std::chrono::minutes(1));
  EXPECT_TRUE(waited.ok()) << waited;
  fault->SlowDown(nvme::IoKind::kRead, 0ms);
}

TEST(RanksInProcessesTest, AttachRefusalsAndWhoMayActForWhichRank) {
  if (!testing::DaemonUnderTest()) GTEST_SKIP() << "ranks in other processes need ztierd";
  TrainSetup s;
  s.ranks = 2;
  Result<DaemonAndSession> d = StartDaemon(s, /*second_connection=*/true);
  ASSERT_TRUE(d.ok()) << d.status();
  Session* b = d->second.get();  // a second connection
  Result<std::unique_ptr<Model>> m0 = d->session->RegisterModel(Spec(s, "r"));
  ASSERT_TRUE(m0.ok()) << m0.status();
  EXPECT_EQ((*m0)->attached_rank(), -1);

  auto refused = [&](const TrainSetup& setup, const std::string& name, int rank, StatusCode code,
                     const std::string& says) {
    auto m = b->AttachModel(Spec(setup, name), rank, std::chrono::milliseconds(200));
    ASSERT_FALSE(m.ok()) << name;
    EXPECT_EQ(m.status().code(), code) << m.status();
    EXPECT_NE(m.status().ToString().find(says), std::string::npos) << m.status();
  };
  refused(s, "nope", 1, StatusCode::kNotFound, "'nope'");
  TrainSetup wider = s;
  wider.gpt.channels = 64;
  refused(wider, "r", 1, StatusCode::kFailedPrecondition, "does not match");
  TrainSetup three = s;
  three.ranks = 3;
  refused(three, "r", 1, StatusCode::kFailedPrecondition, "world size");
  refused(s, "r", 2, StatusCode::kInvalidArgument, "rank 2");

  Result<std::unique_ptr<Model>> m1 = b->AttachModel(Spec(s, "r"), 1);
  ASSERT_TRUE(m1.ok()) << m1.status();
  EXPECT_EQ((*m1)->attached_rank(), 1);
  refused(s, "r", 1, StatusCode::kAlreadyExists, "attached already");
  // Rank 0 is the registering process's: another process's attach of it
  // took the job from under it, and its peers failed (rank 0 left).
  refused(s, "r", 0, StatusCode::kAlreadyExists, "rank 0 of job 'r' is attached already");
  // The attached rank acts for itself only; rank 0's process no longer
  // acts for it.
  Result<bf16*> inbox = (*m1)->transport().GradInbox((*m1)->job(), 0, 0);
  ASSERT_FALSE(inbox.ok());
  EXPECT_EQ(inbox.status().code(), StatusCode::kFailedPrecondition) << inbox.status();
  const Status ready = (*m0)->transport().GradsReady((*m0)->job(), 0, 1);
  EXPECT_EQ(ready.code(), StatusCode::kFailedPrecondition) << ready;
  EXPECT_NE(ready.ToString().find("another process"), std::string::npos) << ready;
  Result<std::unique_ptr<Device>> dev = MakeHostDevice();
  ASSERT_TRUE(dev.ok());
  EXPECT_EQ(Stage3Runner::Create(**m1, 0, **dev, nullptr, {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeJobCollectives(**m1, 0, **dev).status().code(), StatusCode::kInvalidArgument);
  // The job lives while any rank holds it; a rank that went (here before
  // the collective region was even made) takes part in no collectives, so
  // its peers' fail at once rather than wait for it.
  m0->reset();
  EXPECT_TRUE((*m1)->transport().Layout((*m1)->job(), 0).ok());
  Result<std::unique_ptr<Collectives>> coll = MakeJobCollectives(**m1, 1, **dev);
  Status gathered =
      coll.ok() ? (*coll)->AllGather(nullptr, 0, **dev, Stream::kCompute) : coll.status();
  EXPECT_EQ(gathered.code(), StatusCode::kAborted) << gathered;
  EXPECT_NE(gathered.ToString().find("rank 0 left"), std::string::npos) << gathered;
  coll = Status::Aborted("dropped");
  EXPECT_EQ(d->daemon->daemon().stats().jobs, 1);
  m1->reset();
  EXPECT_EQ(d->daemon->daemon().stats().jobs, 0);
}

}  // namespace
}  // namespace ztier::client
