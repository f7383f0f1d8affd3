// Tests of the engine's step pipeline (states in DRAM and on NVMe):
//  - bit-for-bit against calling cpu_adam directly on the same flat buffers
//    in a plain loop (clipping on/off, accumulation 1 and 3, R = 1 and 2,
//    exact and eager modes, states in DRAM or on NVMe through a 3-slot ring
//    over two swap paths, fp32 or 8-bit m and v), with ranks as concurrent
//    threads;
//  - overlap: eager updates a unit before the last grads arrive; exact
//    mode publishes unit 0 while the last unit is still being updated;
//  - inf/NaN grads skip the step in exact mode and fail it in eager mode;
//  - budgets, validation and unregistering; swap capacity;
//  - NVMe faults during a step (I/O error, full disk, a flipped bit) fail
//    the job clearly, and the last committed checkpoint still loads.
#include "engine/engine.h"
#include "tests/engine/engine_testing.h"
#include "tests/testing/cpu_adam_testing.h"
#include "tests/testing/scratch_dir.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/crc32c.h"
#include "engine/checkpoint_manifest.h"
#include "nvme/io_backend.h"

namespace ztier::engine {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

using testing::ScratchDir;
using namespace testing;

// The same job done by hand: flat buffers and cpu_adam calls in a loop.
struct Reference {
  struct U {
    UnitLayout layout;
    std::vector<float> p, m, v, acc;
    ztier::adam_testing::Int8Moments q;  // 8-bit states
    std::vector<bf16> out;
    std::vector<double> sq;
  };
  std::vector<U> units;
  int64_t adam_step = 0;
};

// Where a job's optimizer states and params live.
enum class Placement { kDram, kNvmeStates, kNvmeAll };

JobSpec Place(JobSpec spec, Placement p) {
  spec.optimizer_tier = p == Placement::kDram ? Tier::kDram : Tier::kNvme;
  spec.param_tier = p == Placement::kNvmeAll ? Tier::kNvme : Tier::kDram;
  return spec;
}

class EngineStepTest : public ::testing::TestWithParam<
                           std::tuple<int, float, int, StepMode, Placement, StateDtype>> {};

TEST_P(EngineStepTest, BitForBitWithPlainCpuAdamLoop) {
  const auto [ranks, clip, accum, mode, placement, dtype] = GetParam();
  const bool int8 = dtype == StateDtype::kInt8;
  const Tier tier = placement == Placement::kDram ? Tier::kDram : Tier::kNvme;
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  ScratchDir swap("swap");
  auto engine = MakeEngine(uint64_t{1} << 30, tier == Tier::kNvme ? &swap : nullptr,
                           uint64_t{64} << 20, nullptr, dtype);
  const JobSpec spec = Place(SmallModel("eq", ranks, clip, accum, mode), placement);
  Result<int> job = engine->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  Result<cpu_adam::Executor> exec = cpu_adam::Executor::Create({.threads = 2});
  ASSERT_TRUE(exec.ok());

  const int nunits = static_cast<int>(spec.units.size());
  Reference ref;
  for (int k = 0; k < nunits; ++k) {
    Result<UnitLayout> l = engine->Layout(*job, k);
    ASSERT_TRUE(l.ok());
    Reference::U u;
    u.layout = *l;
    const uint64_t n = l->padded;
    u.p.assign(n, 0.0f);
    u.m.assign(n, 0.0f);
    u.v.assign(n, 0.0f);
    u.acc.assign(n, 0.0f);
    u.out.assign(n, bf16{0});
    u.sq.assign(ranks, 0.0);
    u.q = ztier::adam_testing::Int8Moments(n, l->offsets);
    for (uint64_t i = 0; i < l->numel; ++i) u.p[i] = 0.1f * normal(rng);
    ASSERT_TRUE(engine->WriteWeights(*job, k, u.p.data(), l->numel).ok());
    ref.units.push_back(std::move(u));
  }

  const int steps = 4;
  for (int step = 1; step <= steps; ++step) {
    // Grads of every micro-step, made up front (the last step has an
    // outlier so clipping bites).
    std::vector<std::vector<std::vector<bf16>>> grads(accum);  // [micro][unit][padded]
    for (int a = 0; a < accum; ++a) {
      for (int k = 0; k < nunits; ++k) {
        std::vector<bf16> g(ref.units[k].layout.padded, bf16{0});
        for (uint64_t i = 0; i < ref.units[k].layout.numel; ++i) {
          g[i] = FloatToBf16(normal(rng) * (step == steps && k == 1 ? 50.0f : 1.0f));
        }
        grads[a].push_back(std::move(g));
      }
    }
    for (int a = 0; a < accum; ++a) {
      // Backward order, each rank on its own thread, as R GPUs would.
      std::vector<std::thread> rank_threads;
      std::atomic<int> errors{0};
      for (int r = 0; r < ranks; ++r) {
        rank_threads.emplace_back([&, r] {
          for (int k = nunits - 1; k >= 0; --k) {
            // The forward pass of this step waited for every unit's publish.
            if (!engine->WaitPublished(*job, k, step - 1, 30s).ok()) ++errors;
            Result<bf16*> inbox = engine->GradInbox(*job, k, r);
            const uint64_t shard = ref.units[k].layout.shard;
            std::memcpy(*inbox, grads[a][k].data() + r * shard, shard * sizeof(bf16));
            Status s = engine->GradsReady(*job, k, r);
            if (!s.ok()) {
              ADD_FAILURE() << s;
              ++errors;
            }
          }
        });
      }
      for (auto& t : rank_threads) t.join();
      ASSERT_EQ(errors.load(), 0);
    }
    // Reference step: accumulate, norm per (unit, rank), clip, update.
    double total = 0.0;
    for (int k = 0; k < nunits; ++k) {
      Reference::U& u = ref.units[k];
      const uint64_t shard = u.layout.shard;
      for (int r = 0; r < ranks; ++r) {
        if (accum > 1) {
          for (uint64_t i = r * shard; i < (r + 1) * shard; ++i) {
            u.acc[i] = Bf16ToFloat(grads[0][k][i]);
            for (int a = 1; a < accum; ++a) u.acc[i] += Bf16ToFloat(grads[a][k][i]);
          }
          u.sq[r] = *cpu_adam::SquaredNorm(u.acc.data() + r * shard, cpu_adam::GradType::kFloat32,
                                           shard, *exec);
        } else {
          u.sq[r] = *cpu_adam::SquaredNorm(grads[0][k].data() + r * shard,
                                           cpu_adam::GradType::kBFloat16, shard, *exec);
        }
      }
    }
    for (const auto& u : ref.units) {
      for (double s : u.sq) total += s;
    }
    const double norm = std::sqrt(total);
    const float scale = cpu_adam::ClipScale(norm, clip);
    ++ref.adam_step;
    for (int k = 0; k < nunits; ++k) {
      Reference::U& u = ref.units[k];
      const cpu_adam::Shard shard{
          .count = u.layout.padded,
          .grads = accum > 1 ? static_cast<const void*>(u.acc.data()) : grads[0][k].data(),
          .grad_type = accum > 1 ? cpu_adam::GradType::kFloat32 : cpu_adam::GradType::kBFloat16,
          .params = u.p.data(),
          .exp_avg = u.m.data(),
          .exp_avg_sq = u.v.data(),
          .params_out = u.out.data()};
      const cpu_adam::StepOptions options{.step = ref.adam_step,
                                          .grad_scale = scale,
                                          .grad_check = cpu_adam::GradCheck::kPrechecked};
      if (int8) {
        ASSERT_TRUE(
            cpu_adam::StepInt8(spec.optimizer.hyper, options, u.q.ShardOf(shard), {}, *exec).ok());
        u.q.Dequantize(u.m.data(), u.v.data());
      } else {
        ASSERT_TRUE(cpu_adam::Step(spec.optimizer.hyper, options, shard, *exec).ok());
      }
    }
    // Engine side: wait for the step. Once a unit shows it, the counters
    // show its grad norm (with states on NVMe a unit is visible before its
    // write-back is done, and the step counts only after). Then compare
    // every byte.
    ASSERT_TRUE(engine->WaitPublished(*job, 0, step, 30s).ok());
    if (mode == StepMode::kExact) {
      EXPECT_EQ(engine->counters(*job).last_grad_norm, norm) << "step " << step;
    }
    for (int k = 0; k < nunits; ++k) {
      ASSERT_TRUE(engine->WaitPublished(*job, k, step, 30s).ok());
    }
    for (int k = 0; k < nunits; ++k) {
      Reference::U& u = ref.units[k];
      std::vector<float> p(u.layout.padded), m(u.layout.padded), v(u.layout.padded);
      ASSERT_TRUE(engine->ReadState(*job, k, p.data(), m.data(), v.data()).ok());
      ASSERT_EQ(std::memcmp(p.data(), u.p.data(), p.size() * 4), 0)
          << "master, unit " << k << " step " << step;
      ASSERT_EQ(std::memcmp(m.data(), u.m.data(), m.size() * 4), 0) << "exp_avg, unit " << k;
      ASSERT_EQ(std::memcmp(v.data(), u.v.data(), v.size() * 4), 0) << "exp_avg_sq, unit " << k;
      const std::vector<bf16> pub = PublishedCopy(*engine, *job, k, u.out.size());
      ASSERT_EQ(std::memcmp(pub.data(), u.out.data(), u.out.size() * 2), 0)
          << "publish, unit " << k;
    }
  }
  const JobCounters c = engine->counters(*job);
  EXPECT_EQ(c.steps, steps);
  EXPECT_EQ(c.skipped_steps, 0);
  EXPECT_GT(c.optimizer_seconds, 0.0);
  EXPECT_GT(c.compute_seconds, 0.0);
  EXPECT_EQ(c.grad_bytes_in, [&] {
    uint64_t b = 0;
    for (const auto& u : ref.units) b += u.layout.padded * 2;
    return b * steps * accum;
  }());
  if (tier == Tier::kNvme) {  // every step read and wrote every unit's state
    uint64_t state = 0;
    for (const auto& u : ref.units) {
      const uint64_t n = u.layout.padded;
      const uint64_t bytes = int8 ? 6 * n + 8 * cpu_adam::QuantGroups(n, u.q.cuts) : 12 * n;
      state += (bytes + 4095) / 4096 * 4096;
    }
    EXPECT_GE(c.nvme_write_bytes, state * steps);
    EXPECT_GE(c.nvme_read_bytes, state * steps);
    uint64_t params = 0;
    for (const auto& u : ref.units) params += (u.layout.padded * 2 + 4095) / 4096 * 4096;
    EXPECT_EQ(c.nvme_bytes, state + (placement == Placement::kNvmeAll ? 2 * params : 0));
    if (placement == Placement::kNvmeAll) {
      EXPECT_GT(c.nvme_param_read_bytes, 0u);
    }
  } else {
    EXPECT_EQ(c.nvme_read_bytes, 0u);
  }
}

// Every combination except eager with clipping, which RegisterJob refuses
// (EngineJobsTest covers that).
std::vector<EngineStepTest::ParamType> StepCases() {
  std::vector<EngineStepTest::ParamType> out;
  for (int ranks : {1, 2}) {
    for (float clip : {0.0f, 1.0f}) {
      for (int accum : {1, 3}) {
        for (StepMode mode : {StepMode::kExact, StepMode::kEager}) {
          if (mode == StepMode::kEager && clip > 0.0f) continue;
          for (Placement p : {Placement::kDram, Placement::kNvmeStates, Placement::kNvmeAll}) {
            out.emplace_back(ranks, clip, accum, mode, p, StateDtype::kFp32);
            out.emplace_back(ranks, clip, accum, mode, p, StateDtype::kInt8);
          }
        }
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Modes, EngineStepTest, ::testing::ValuesIn(StepCases()),
                         [](const ::testing::TestParamInfo<EngineStepTest::ParamType>& p) {
                           return StrCat(
                               "R", std::get<0>(p.param),
                               std::get<1>(p.param) > 0 ? "_clip" : "_noclip", "_acc",
                               std::get<2>(p.param),
                               std::get<3>(p.param) == StepMode::kExact ? "_exact" : "_eager",
                               std::get<4>(p.param) == Placement::kDram         ? "_dram"
                               : std::get<4>(p.param) == Placement::kNvmeStates ? "_nvme_states"
                                                                                : "_nvme_all",
                               std::get<5>(p.param) == StateDtype::kInt8 ? "_int8" : "");
                         });

TEST(EngineOverlapTest, EagerUpdatesAUnitBeforeTheLastGradsArrive) {
  auto engine = MakeEngine();
  Result<int> job = engine->RegisterJob(SmallModel("eager", 1, 0.0f, 1, StepMode::kEager));
  ASSERT_TRUE(job.ok());
  const int n = 4;
  for (int k = n - 1; k >= 1; --k) Ring(*engine, *job, k, 1, 0.5f);
  // Unit 0's grads have not arrived, yet the last unit is already published.
  EXPECT_TRUE(engine->WaitPublished(*job, n - 1, 1, 10s).ok());
  EXPECT_EQ(engine->PublishedStep(*job, 0), -1);
  Ring(*engine, *job, 0, 1, 0.5f);
  EXPECT_TRUE(engine->WaitPublished(*job, 0, 1, 10s).ok());
}

// An eager step midway (some units updated, others waiting for their
// grads) holds no one state: a save then was taken (every unit looked idle
// once its update was done), a checkpoint of units a step apart.
TEST(EngineOverlapTest, ASaveInTheMiddleOfAnEagerStepIsRefused) {
  auto engine = MakeEngine();
  Result<int> job = engine->RegisterJob(SmallModel("eager-save", 1, 0.0f, 1, StepMode::kEager));
  ASSERT_TRUE(job.ok());
  const int n = 4;
  for (int k = n - 1; k >= 1; --k) Ring(*engine, *job, k, 1, 0.5f);
  for (int k = n - 1; k >= 1; --k) ASSERT_TRUE(engine->WaitPublished(*job, k, 1, 10s).ok());
  ScratchDir dir("eager-save");
  const Status midway = engine->SaveCheckpoint(*job, dir.path());
  EXPECT_EQ(midway.code(), StatusCode::kFailedPrecondition) << midway;
  EXPECT_NE(midway.ToString().find("in flight"), std::string::npos) << midway;
  Ring(*engine, *job, 0, 1, 0.5f);
  ASSERT_TRUE(engine->WaitPublished(*job, 0, 1, 10s).ok());
  EXPECT_TRUE(engine->SaveCheckpoint(*job, dir.path()).ok());
}

TEST(EngineOverlapTest, ExactModePublishesUnitZeroBeforeTheLastUnitIsDone) {
  auto engine = MakeEngine();
  JobSpec spec;
  spec.name = "big-tail";
  spec.optimizer.clip_norm = 1.0f;
  spec.units = {{"small", {{"w", {64, 64}}}}, {"huge", {{"w", {4096, 4096}}}}};
  Result<int> job = engine->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  Ring(*engine, *job, 1, 1, 0.25f);
  Ring(*engine, *job, 0, 1, 0.25f);
  // Unit 0 is published while the 16M-element unit 1 is still being updated.
  bool seen_zero_first = false;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (engine->PublishedStep(*job, 0) < 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "unit 0 was not published in 60 s";
    std::this_thread::yield();
  }
  seen_zero_first = engine->PublishedStep(*job, 1) < 1;
  EXPECT_TRUE(seen_zero_first) << "unit 0 was published only after the last unit";
  EXPECT_TRUE(engine->WaitPublished(*job, 1, 1, 30s).ok());
}

// A unit's grads for the next step, delivered once the unit is published
// (as WaitPublished's contract allows: a unit a forward skips lets the
// others' next grads in early) while a bigger unit of the step is still
// being updated. The job-wide count of ready units took them for the
// step's: a second step was queued at once, which updated the big unit again
// with its old grads, and the job then stalled. Each step counts its own.
TEST(EngineOverlapTest, NextStepGradsOfAPublishedUnitWaitForTheirStep) {
  auto engine = MakeEngine();
  JobSpec spec;
  spec.name = "early";
  spec.units = {{"small", {{"w", {64, 64}}}}, {"huge", {{"w", {4096, 4096}}}}};
  JobSpec in_order = spec;
  in_order.name = "in-order";
  Result<int> job = engine->RegisterJob(spec);
  Result<int> ref = engine->RegisterJob(in_order);
  ASSERT_TRUE(job.ok() && ref.ok()) << job.status() << ref.status();
  for (int j : {*job, *ref}) {
    for (int k = 0; k < 2; ++k) {
      std::vector<float> w(engine->Layout(j, k)->numel, 0.5f);
      ASSERT_TRUE(engine->WriteWeights(j, k, w.data(), w.size()).ok());
    }
  }
  Ring(*engine, *job, 1, 1, 0.25f);
  Ring(*engine, *job, 0, 1, 0.25f);
  ASSERT_TRUE(engine->WaitPublished(*job, 0, 1, 60s).ok());
  Ring(*engine, *job, 0, 1, -0.5f);  // step 2's, the 16M-element unit 1 likely still updating
  ASSERT_TRUE(engine->WaitPublished(*job, 1, 1, 60s).ok());
  EXPECT_EQ(engine->TargetStep(*job), 1);  // unit 1's step-2 grads are not in
  Ring(*engine, *job, 1, 1, -0.5f);
  for (int k = 0; k < 2; ++k) {
    const Status s = engine->WaitPublished(*job, k, 2, 60s);
    ASSERT_TRUE(s.ok()) << s;
  }
  for (float g : {0.25f, -0.5f}) {
    Ring(*engine, *ref, 1, 1, g);
    Ring(*engine, *ref, 0, 1, g);
    for (int k = 0; k < 2; ++k)
      ASSERT_TRUE(engine->WaitPublished(*ref, k, g > 0 ? 1 : 2, 60s).ok());
  }
  for (int k = 0; k < 2; ++k) {
    const UnitLayout l = *engine->Layout(*job, k);
    std::vector<float> a(l.padded), b(l.padded);
    ASSERT_TRUE(engine->ReadState(*job, k, a.data(), nullptr, nullptr).ok());
    ASSERT_TRUE(engine->ReadState(*ref, k, b.data(), nullptr, nullptr).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "unit " << k;
  }
  EXPECT_EQ(engine->Steps(*job)->first, 2);
  // And the next step goes as usual.
  Ring(*engine, *job, 1, 1, 0.1f);
  Ring(*engine, *job, 0, 1, 0.1f);
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(engine->WaitPublished(*job, k, 3, 60s).ok());
}

// Sets units 0..n-1 of `job` to weights of 0.5; returns each unit's fp32
// master (padded) as the engine then holds it.
std::vector<std::vector<float>> HalvesAndTheirMasters(Engine& engine, int job, int n) {
  std::vector<std::vector<float>> masters(n);
  for (int k = 0; k < n; ++k) {
    const UnitLayout l = *engine.Layout(job, k);
    std::vector<float> w(l.numel, 0.5f);
    EXPECT_TRUE(engine.WriteWeights(job, k, w.data(), w.size()).ok());
    masters[k].resize(l.padded);
    EXPECT_TRUE(engine.ReadState(job, k, masters[k].data(), nullptr, nullptr).ok());
  }
  return masters;
}

TEST(EngineFaultTest, NonFiniteGradsSkipTheStepInExactMode) {
  auto engine = MakeEngine();
  Result<int> job = engine->RegisterJob(SmallModel("nan", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(job.ok());
  const int n = 4;
  const std::vector<std::vector<float>> before = HalvesAndTheirMasters(*engine, *job, n);
  for (int k = n - 1; k >= 0; --k) Ring(*engine, *job, k, 1, k == 2 ? NAN : 0.1f);
  for (int k = 0; k < n; ++k) {
    ASSERT_TRUE(engine->WaitPublished(*job, k, 1, 10s).ok());
    std::vector<float> now(before[k].size());
    ASSERT_TRUE(engine->ReadState(*job, k, now.data(), nullptr, nullptr).ok());
    EXPECT_EQ(now, before[k]) << "a skipped step changed unit " << k;
  }
  EXPECT_EQ(engine->counters(*job).skipped_steps, 1);
  // The next step is a normal one.
  for (int k = n - 1; k >= 0; --k) Ring(*engine, *job, k, 1, 0.1f);
  for (int k = 0; k < n; ++k) ASSERT_TRUE(engine->WaitPublished(*job, k, 2, 10s).ok());
  EXPECT_EQ(engine->counters(*job).steps, 2);
}

// Finite grads too large for fp32 moments (v would be inf) skip the step
// as inf/NaN ones do; with clipping on they are clipped and train.
TEST(EngineFaultTest, GradsTooLargeForTheMomentsSkipTheStepUnlessClipped) {
  auto engine = MakeEngine();
  for (const float clip : {0.0f, 1.0f}) {
    Result<int> job = engine->RegisterJob(
        SmallModel(clip > 0 ? "huge-clipped" : "huge", 1, clip, 1, StepMode::kExact));
    ASSERT_TRUE(job.ok()) << job.status();
    const int n = 4;
    const std::vector<std::vector<float>> before = HalvesAndTheirMasters(*engine, *job, n);
    for (int k = n - 1; k >= 0; --k) Ring(*engine, *job, k, 1, k == 1 ? 1e30f : 0.1f);
    for (int k = 0; k < n; ++k) {
      ASSERT_TRUE(engine->WaitPublished(*job, k, 1, 10s).ok());
      std::vector<float> master(before[k].size()), m(master.size()), v(master.size());
      ASSERT_TRUE(engine->ReadState(*job, k, master.data(), m.data(), v.data()).ok());
      for (size_t i = 0; i < v.size(); ++i) {
        ASSERT_TRUE(std::isfinite(v[i])) << k << " " << i;
      }
      if (clip == 0.0f) {
        EXPECT_EQ(master, before[k]) << "a skipped step changed unit " << k;
      }
    }
    EXPECT_EQ(engine->counters(*job).skipped_steps, clip == 0.0f ? 1 : 0);
  }
}

// A wait that no grads can ever end fails at once, naming the steps.
TEST(EngineFaultTest, AWaitForAStepNoGradsCanReachFailsAtOnce) {
  auto engine = MakeEngine();
  Result<int> job = engine->RegisterJob(SmallModel("ahead", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(job.ok());
  Train(*engine, *job, 1, 0, 2, 3);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = engine->WaitPublished(*job, 1, 4, 60s);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("the job has done 2 steps"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_EQ(engine->AcquireParams(*job, 1, 4, 60s).status().code(),
            StatusCode::kFailedPrecondition);
  // One step ahead is what a client waits for after sending its grads;
  // its timeout names the job and the unit (it said "unit 1 of job 0").
  s = engine->WaitPublished(*job, 1, 3, 10ms);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("job 'ahead' unit 'block0' did not reach step 3 within 10 ms"),
            std::string::npos)
      << s;
}

TEST(EngineFaultTest, NonFiniteGradsFailAnEagerStepLoudly) {
  auto engine = MakeEngine();
  Result<int> job = engine->RegisterJob(SmallModel("eager-nan", 1, 0.0f, 1, StepMode::kEager));
  ASSERT_TRUE(job.ok());
  Ring(*engine, *job, 3, 1, INFINITY);
  Status s = engine->WaitPublished(*job, 3, 1, 10s);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("eager"), std::string::npos) << s;
  EXPECT_EQ(engine->GradsReady(*job, 2, 0).code(), StatusCode::kAborted);
}

// Delivers one step's grads (value everywhere) for every unit, backward.
void RingAll(Engine& e, int job, float value) {
  for (int k = 3; k >= 0; --k) Ring(e, job, k, 1, value);
}

// Waits until the job finishes step `step` or fails; the first unit status
// that is not Ok.
Status WaitStep(Engine& e, int job, int64_t step) {
  for (int k = 0; k < 4; ++k) ZT_RETURN_IF_ERROR(e.WaitPublished(job, k, step, 30s));
  return Status::Ok();
}

// Delivers one micro-step's grads (normal values) of every unit and rank,
// backward.
void DeliverMicroStep(Engine& e, int job, int ranks, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int k = 3; k >= 0; --k) {
    const UnitLayout l = *e.Layout(job, k);
    for (int r = 0; r < ranks; ++r) {
      bf16* g = *e.GradInbox(job, k, r);
      for (uint64_t i = 0; i < l.shard; ++i) g[i] = FloatToBf16(normal(rng));
      ASSERT_TRUE(e.GradsReady(job, k, r).ok());
    }
  }
}

// A step's grads delivered in part (a backward that failed), then
// discarded: the job trains on exactly as one that never saw them, for
// gradient accumulation 1 and 3, one rank and two, states in DRAM and on
// NVMe (whose first units' states are read ahead once the step's first
// unit is ready).
class EngineAbortTest : public ::testing::TestWithParam<std::tuple<int, int, Placement, StepMode>> {
};

TEST_P(EngineAbortTest, DiscardedGradsLeaveNoTrace) {
  const auto [accum, ranks, placement, mode] = GetParam();
  ScratchDir swap("swap");
  auto e = MakeEngine(uint64_t{1} << 30, &swap);
  const float clip = mode == StepMode::kExact ? 1.0f : 0.0f;
  Result<int> a = e->RegisterJob(Place(SmallModel("a", ranks, clip, accum, mode), placement));
  Result<int> b = e->RegisterJob(Place(SmallModel("b", ranks, clip, accum, mode), placement));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  Train(*e, *a, ranks, 0, 0, 5);  // the same initial weights
  Train(*e, *b, ranks, 0, 0, 5);
  std::mt19937_64 junk(99);
  // Complete micro-steps (accumulation > 1), then part of one: units 3 and
  // 2 from every rank, unit 1 from rank 0 (exact mode; eager mode would
  // update unit 3 at once).
  for (int m = 0; m + 1 < accum; ++m) DeliverMicroStep(*e, *a, ranks, junk);
  if (mode == StepMode::kExact) {
    for (int k : {3, 2}) Ring(*e, *a, k, ranks, 9.0f);
  }
  Ring(*e, *a, 1, 1, 9.0f);
  Result<int> complete = e->AbortStep(*a, 1);
  ASSERT_TRUE(complete.ok()) << complete.status();
  EXPECT_EQ(*complete, accum - 1);
  EXPECT_EQ(e->TargetStep(*a), 0);
  // Nothing is left to discard; the same grads may be delivered again.
  EXPECT_EQ(*e->AbortStep(*a, 1), 0);
  for (int step = 1; step <= 2; ++step) {
    for (int job : {*a, *b}) {
      std::mt19937_64 rng(step);
      for (int m = 0; m < accum; ++m) DeliverMicroStep(*e, job, ranks, rng);
      for (int k = 0; k < 4; ++k) ASSERT_TRUE(e->WaitPublished(job, k, step, 30s).ok());
    }
  }
  EXPECT_TRUE(Same(Snapshot(*e, *a), Snapshot(*e, *b)));
  EXPECT_EQ(e->counters(*a).steps, 2);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EngineAbortTest,
    ::testing::Values(std::make_tuple(1, 1, Placement::kDram, StepMode::kExact),
                      std::make_tuple(3, 2, Placement::kDram, StepMode::kExact),
                      std::make_tuple(1, 2, Placement::kNvmeStates, StepMode::kExact),
                      std::make_tuple(3, 1, Placement::kNvmeAll, StepMode::kExact),
                      std::make_tuple(2, 2, Placement::kDram, StepMode::kEager)),
    [](const auto& p) {
      return StrCat("acc", std::get<0>(p.param), "_r", std::get<1>(p.param),
                    std::get<2>(p.param) == Placement::kDram ? "_dram" : "_nvme",
                    std::get<3>(p.param) == StepMode::kExact ? "_exact" : "_eager",
                    std::get<2>(p.param) == Placement::kNvmeAll ? "_params" : "");
    });

// A clip so small that clip / norm rounds to 0 in fp32 scales the grads to
// nothing, as torch's clip_grad_norm_ does (that grad_scale of 0 was
// refused by the kernel and failed the job).
TEST(EngineClipTest, AClipWhoseScaleRoundsToZeroStillSteps) {
  auto e = MakeEngine();
  Result<int> job = e->RegisterJob(
      SmallModel("tiny-clip", 1, std::numeric_limits<float>::denorm_min(), 1, StepMode::kExact));
  ASSERT_TRUE(job.ok()) << job.status();
  Train(*e, *job, 1, 0, 2, 3);
  EXPECT_TRUE(e->failure(*job).ok()) << e->failure(*job);
  EXPECT_EQ(e->counters(*job).steps, 2);
  EXPECT_EQ(e->counters(*job).skipped_steps, 0);
}

// Grads the optimizer has begun to apply are not discarded: an exact step
// whose every unit's grads are in (its write-backs slowed, so it is still
// running), a unit updated in eager mode. The step completes as usual.
TEST(EngineAbortTest, AStepUnderWayIsNotDiscarded) {
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  Result<int> exact = e->RegisterJob(
      Place(SmallModel("exact", 1, 1.0f, 1, StepMode::kExact), Placement::kNvmeStates));
  Result<int> eager = e->RegisterJob(SmallModel("eager", 1, 0.0f, 1, StepMode::kEager));
  ASSERT_TRUE(exact.ok() && eager.ok()) << exact.status() << eager.status();
  Train(*e, *exact, 1, 0, 0, 5);
  Train(*e, *eager, 1, 0, 0, 5);
  fault->SlowDown(nvme::IoKind::kWrite, 200ms);
  RingAll(*e, *exact, 0.1f);
  Result<int> refused = e->AbortStep(*exact, 1);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("every unit's grads are in"), std::string::npos)
      << refused.status();
  fault->SlowDown(nvme::IoKind::kWrite, 0ms);
  EXPECT_TRUE(WaitStep(*e, *exact, 1).ok());
  // The step before still writing back (its units published already, as
  // states on NVMe allow) is not this step under way: the abort waits for
  // it, then drops the new grads (it was refused, naming the wrong step).
  fault->SlowDown(nvme::IoKind::kWrite, 100ms);
  RingAll(*e, *exact, 0.1f);
  for (int k = 0; k < 4; ++k) {
    while (e->PublishedStep(*exact, k) < 2) std::this_thread::sleep_for(1ms);
  }
  Ring(*e, *exact, 3, 1, 0.1f);  // step 3's first grads
  Result<int> dropped = e->AbortStep(*exact, 3);
  EXPECT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(e->Steps(*exact)->first, 2);
  fault->SlowDown(nvme::IoKind::kWrite, 0ms);
  RingAll(*e, *exact, 0.1f);
  EXPECT_TRUE(WaitStep(*e, *exact, 3).ok());

  Ring(*e, *eager, 3, 1, 0.1f);
  refused = e->AbortStep(*eager, 1);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("eager"), std::string::npos) << refused.status();
  for (int k = 2; k >= 0; --k) Ring(*e, *eager, k, 1, 0.1f);
  EXPECT_TRUE(WaitStep(*e, *eager, 1).ok());
  EXPECT_EQ(e->AbortStep(9, 1).status().code(), StatusCode::kNotFound);
}

// With states on NVMe a unit is visible before its write-back, so all of
// the next step's grads can be in while the step before writes back: that
// step is queued behind it. One flag stood for both and the first's
// completion cleared it: an abort then said it discarded the queued step's
// grads (zeroing their norm) and the step ran anyway, unclipped.
TEST(EngineAbortTest, AStepQueuedBehindOneWritingBackIsNotDiscarded) {
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  Result<int> job = e->RegisterJob(
      Place(SmallModel("queued", 1, 1.0f, 1, StepMode::kExact), Placement::kNvmeStates));
  ASSERT_TRUE(job.ok()) << job.status();
  Train(*e, *job, 1, 0, 1, 5);
  fault->SlowDown(nvme::IoKind::kWrite, 100ms);
  RingAll(*e, *job, 0.1f);  // step 2
  for (int k = 0; k < 4; ++k) {
    while (e->PublishedStep(*job, k) < 2) std::this_thread::sleep_for(1ms);
  }
  RingAll(*e, *job, 100.0f);  // all of step 3's: queued behind step 2's write-backs
  // Step 3 is still queued or running: its write-backs are slowed. (Not
  // Steps(), which waits for write-backs: on a loaded machine it could miss
  // the moment between step 2's and step 3's and see step 3 done.)
  ASSERT_LT(e->counters(*job).steps, 3);
  Result<int> refused = e->AbortStep(*job, 3);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("every unit's grads are in"), std::string::npos)
      << refused.status();
  fault->SlowDown(nvme::IoKind::kWrite, 0ms);
  ASSERT_TRUE(WaitStep(*e, *job, 3).ok());
  EXPECT_GT(e->counters(*job).last_grad_norm, 100.0) << "step 3 ran without its grads' norm";
  EXPECT_EQ(e->Steps(*job)->first, 3);
}

// A wait that timed out on a drive that does not answer said only the step
// the unit holds: it names the swap file and the disk operations waiting
// there. One that times out with the drives answering says nothing of them.
TEST(EngineStallTest, AWaitThatTimesOutOnAStalledDriveNamesTheSwapFile) {
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  Result<int> job = e->RegisterJob(
      Place(SmallModel("stalled", 1, 1.0f, 1, StepMode::kExact), Placement::kNvmeStates));
  ASSERT_TRUE(job.ok()) << job.status();
  Train(*e, *job, 1, 0, 1, 5);
  ASSERT_TRUE(e->Steps(*job).ok());  // step 1's write-backs done
  fault->SlowDown(nvme::IoKind::kRead, 3000ms);
  RingAll(*e, *job, 0.1f);  // step 2: its state reads wait on the drive
  const Status timed_out = e->WaitPublished(*job, 3, 2, 2500ms);
  fault->SlowDown(nvme::IoKind::kRead, 0ms);
  EXPECT_EQ(timed_out.code(), StatusCode::kUnavailable) << timed_out;
  EXPECT_NE(timed_out.message().find("swap file " + swap.path() + "/drive0/ztier.swap: "),
            std::string::npos)
      << timed_out;
  EXPECT_NE(timed_out.message().find("disk operation(s) waiting, none finished for"),
            std::string::npos)
      << timed_out;
  ASSERT_TRUE(WaitStep(*e, *job, 2).ok());
  ASSERT_TRUE(e->Steps(*job).ok());
  // No grads of step 3 come: a timeout of the client's, not the drive's.
  const Status idle = e->WaitPublished(*job, 0, 3, 200ms);
  EXPECT_EQ(idle.code(), StatusCode::kUnavailable) << idle;
  EXPECT_EQ(idle.message().find("swap file"), std::string::npos) << idle;
}

// An abort that comes after its step completed (a backward that failed
// once its last grads were out, and the step ran meanwhile) found nothing
// pending and said it dropped the grads: they had been applied, and the
// caller went on a step behind the job, each later step applied twice.
TEST(EngineAbortTest, AnAbortAfterItsStepCompletedIsRefused) {
  auto e = MakeEngine();
  Result<int> job = e->RegisterJob(SmallModel("late-abort", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(job.ok()) << job.status();
  Train(*e, *job, 1, 0, 1, 5);
  RingAll(*e, *job, 0.1f);  // step 2's grads, all of them
  ASSERT_TRUE(WaitStep(*e, *job, 2).ok());
  Result<int> late = e->AbortStep(*job, 2);
  EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition) << late.status();
  EXPECT_NE(late.status().message().find("applied them (the job is at step 2)"), std::string::npos)
      << late.status();
  EXPECT_EQ(e->AbortStep(*job, 0).status().code(), StatusCode::kInvalidArgument);
  // The next step's grads are what an abort now drops.
  Ring(*e, *job, 3, 1, 0.1f);
  Result<int> dropped = e->AbortStep(*job, 3);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(*dropped, 0);
  RingAll(*e, *job, 0.1f);
  EXPECT_TRUE(WaitStep(*e, *job, 3).ok());
  EXPECT_EQ(e->counters(*job).steps, 3);
}

// An abort right after Step(), nothing of the next step pushed yet, while
// the step before still runs: it was refused as that step "begun", naming
// the wrong step. It waits for that step, then drops nothing.
// In eager mode the step's updates still queued were taken for the next
// step's, "begun".
TEST(EngineAbortTest, AnAbortOfTheNextStepWaitsForTheOneRunning) {
  for (const StepMode mode : {StepMode::kExact, StepMode::kEager}) {
    SCOPED_TRACE(mode == StepMode::kExact ? "exact" : "eager");
    ScratchDir swap("swap");
    auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
    auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
    Result<int> job = e->RegisterJob(
        Place(SmallModel("abort-next", 1, mode == StepMode::kExact ? 1.0f : 0.0f, 1, mode),
              Placement::kNvmeStates));
    ASSERT_TRUE(job.ok()) << job.status();
    Train(*e, *job, 1, 0, 1, 5);
    fault->SlowDown(nvme::IoKind::kWrite, 100ms);
    RingAll(*e, *job, 0.1f);  // step 2, slowed
    ASSERT_LT(e->counters(*job).steps, 2);
    Result<int> none = e->AbortStep(*job, 3);
    fault->SlowDown(nvme::IoKind::kWrite, 0ms);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(*none, 0);
    EXPECT_EQ(e->Steps(*job)->first, 2);
    RingAll(*e, *job, 0.1f);
    EXPECT_TRUE(WaitStep(*e, *job, 3).ok());
  }
}

// A step's learning rates are those set before its last grads arrived: a
// rate set after them (a C++ loop's schedule for the next step, right after
// Step()) went into the step whose task had not started yet, so the result
// depended on when the job's strand got to it.
TEST(EngineOverlapTest, ARateSetAfterAStepsLastGradsIsTheNextSteps) {
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  Result<int> job = e->RegisterJob(
      Place(SmallModel("late-lr", 1, 1.0f, 1, StepMode::kExact), Placement::kNvmeStates));
  Result<int> ref = e->RegisterJob(
      Place(SmallModel("ref-lr", 1, 1.0f, 1, StepMode::kExact), Placement::kNvmeStates));
  ASSERT_TRUE(job.ok() && ref.ok()) << job.status() << ref.status();
  Train(*e, *job, 1, 0, 1, 5);
  Train(*e, *ref, 1, 0, 1, 5);
  for (int j : {*ref, *job}) {
    fault->SlowDown(nvme::IoKind::kWrite, j == *job ? 100ms : 0ms);
    RingAll(*e, j, 0.1f);  // step 2
    for (int k = 0; k < 4; ++k) {
      while (e->PublishedStep(j, k) < 2) std::this_thread::sleep_for(1ms);
    }
    RingAll(*e, j, -0.2f);  // step 3's last grads: queued behind step 2's write-backs
    // For step 4; the reference sets it once step 3 is done.
    if (j == *job) {
      ASSERT_TRUE(e->SetLearningRates(j, {0.0f}).ok());
    }
    fault->SlowDown(nvme::IoKind::kWrite, 0ms);
    ASSERT_TRUE(WaitStep(*e, j, 3).ok());
    if (j == *ref) {
      ASSERT_TRUE(e->SetLearningRates(j, {0.0f}).ok());
    }
  }
  EXPECT_TRUE(Same(Snapshot(*e, *job), Snapshot(*e, *ref)))
      << "step 3 ran at the rate set after its grads";
}

// Threads registering one name at once: each found the name free (checked,
// the lock dropped while the job was built) and all registered it. One
// registers; the others are AlreadyExists, as one after another.
TEST(EngineJobsTest, OneNameRegisteredByThreadsAtOnceIsOneJob) {
  auto engine = MakeEngine();
  for (int round = 0; round < 40; ++round) {
    const std::string name = StrCat("same-", round);
    std::vector<Status> got(4);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < 4) std::this_thread::yield();
        got[t] = engine->RegisterJob(SmallModel(name, 1, 0.0f, 1, StepMode::kExact)).status();
      });
    }
    for (std::thread& th : threads) th.join();
    int ok = 0;
    for (const Status& s : got) {
      ok += s.ok();
      if (!s.ok()) {
        EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s;
      }
    }
    ASSERT_EQ(ok, 1) << "round " << round << ": " << ok << " registrations of '" << name << "'";
  }
}

// What a job hands its clients (grad inboxes, publish buffers, the param
// cache) lies in regions of its own: never another job's, the params'
// sealed so no other process can map them writable, and gone with the job.
TEST(EngineJobsTest, EachJobSharesOnlyItsOwnRegions) {
  ScratchDir swap("swap");
  auto engine = MakeEngine(uint64_t{1} << 30, &swap);
  Result<int> a = engine->RegisterJob(SmallModel("a", 2, 0.0f, 1, StepMode::kExact));
  JobSpec nvme = SmallModel("b", 1, 0.0f, 1, StepMode::kExact);
  nvme.optimizer_tier = nvme.param_tier = Tier::kNvme;
  Result<int> b = engine->RegisterJob(nvme);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  auto inside = [](const void* p, const std::vector<std::pair<void*, uint64_t>>& regions) {
    const auto* c = static_cast<const char*>(p);
    for (const auto& [base, bytes] : regions) {
      if (c >= static_cast<char*>(base) && c < static_cast<char*>(base) + bytes) return true;
    }
    return false;
  };
  const auto ra = engine->PinnedRegions(*a), rb = engine->PinnedRegions(*b);
  ASSERT_EQ(ra.size(), 2u);
  ASSERT_EQ(rb.size(), 2u);
  for (int k = 0; k < 4; ++k) {
    for (int rank = 0; rank < 2; ++rank) {
      bf16* inbox = *engine->GradInbox(*a, k, rank);
      EXPECT_TRUE(inside(inbox, ra));
      EXPECT_FALSE(inside(inbox, rb));
    }
    EXPECT_TRUE(inside(*engine->Published(*a, k), ra));
    EXPECT_TRUE(inside(*engine->GradInbox(*b, k, 0), rb));
  }
  ASSERT_TRUE(engine->WriteWeights(*b, 0, std::vector<float>(97 * 24, 0.5f).data(), 97 * 24).ok());
  Result<const bf16*> cached = engine->AcquireParams(*b, 0, 0, 30s);  // a param cache slot
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_TRUE(inside(*cached, rb));
  ASSERT_TRUE(engine->ReleaseParams(*b, 0).ok());
  ASSERT_TRUE(engine->UnregisterJob(*a).ok());
  EXPECT_TRUE(engine->PinnedRegions(*a).empty());
  EXPECT_EQ(engine->PinnedRegions(*b).size(), 2u);
}

// The step page holds a word per unit and the weights' generation: its
// room was a word per unit, so a job of 512 or 1024 units (the page a whole
// number of 4 KiB) could not register.
TEST(EngineJobsTest, JobsOfAnyNumberOfUnitsHaveTheirStepPage) {
  ScratchDir swap("swap");
  auto engine = MakeEngine(uint64_t{1} << 30, &swap);
  for (const int units : {511, 512, 1024}) {
    for (const Tier tier : {Tier::kDram, Tier::kNvme}) {
      JobSpec spec;
      spec.name = StrCat("units-", units, "-", tier == Tier::kNvme ? "nvme" : "dram");
      spec.param_tier = spec.optimizer_tier = tier;
      for (int u = 0; u < units; ++u) {
        spec.units.push_back({StrCat("u", u), {{StrCat("u", u, ".w"), {64}}}});
      }
      Result<int> job = engine->RegisterJob(spec);
      ASSERT_TRUE(job.ok()) << spec.name << ": " << job.status();
      EXPECT_EQ(engine->WeightsGeneration(*job), 0);
      for (int u = 0; u < units; ++u) EXPECT_EQ(engine->PublishedStep(*job, u), -1);
      ASSERT_TRUE(engine->UnregisterJob(*job).ok());
    }
  }
}

// A read of a unit's state between steps (ztierd's per-unit reads of a
// save) copies DRAM states with no lock a step waits for: a step whose
// last grads came during the copy updated the unit under it, and the read
// returned a unit half of one step and half of the next. A read during
// which a step's update was posted is refused.
TEST(EngineJobsTest, AStateReadDuringWhichAStepBeganIsRefused) {
  // Certain: NVMe states read slowly, the step's grads in midway (its
  // update waits for the read's slots, and was posted all the same).
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  for (const Placement placement : {Placement::kNvmeStates, Placement::kDram}) {
    const bool nvme = placement == Placement::kNvmeStates;
    SCOPED_TRACE(nvme ? "nvme" : "dram");
    JobSpec spec;
    spec.name = nvme ? "torn-nvme" : "torn-dram";
    spec.optimizer.hyper = {.lr = 1e-2f};
    spec.units.push_back({"big", {{"big.w", {nvme ? int64_t{1024} : int64_t{12} << 20}}}});
    Result<int> job = e->RegisterJob(Place(spec, placement));
    ASSERT_TRUE(job.ok()) << job.status();
    const UnitLayout l = *e->Layout(*job, 0);
    ASSERT_TRUE(e->WriteWeights(*job, 0, std::vector<float>(l.numel, 0.5f).data(), l.numel).ok());
    std::vector<float> p(l.padded), m(l.padded), v(l.padded);
    for (int step = 1; step <= (nvme ? 1 : 4); ++step) {
      std::vector<float> before(l.padded);
      ASSERT_TRUE(e->ReadState(*job, 0, before.data(), m.data(), v.data()).ok());
      if (nvme) fault->SlowDown(nvme::IoKind::kRead, 200ms);
      std::thread ring([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(nvme ? 30 : step));
        Ring(*e, *job, 0, 1, 0.25f);
      });
      const Status read = e->ReadState(*job, 0, p.data(), m.data(), v.data());
      ring.join();
      fault->SlowDown(nvme::IoKind::kRead, 0ms);
      if (read.ok()) {
        EXPECT_FALSE(nvme) << "a read during which the step began was not refused";
        // (DRAM: the step came after the copy.)
        EXPECT_EQ(p, before) << "step " << step << ": a read that succeeded is not of one step";
      } else {
        EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition) << read;
        EXPECT_TRUE(read.message().find("began while unit 0 was read") != std::string::npos ||
                    read.message().find("in flight") != std::string::npos)
            << read;
      }
      ASSERT_TRUE(e->WaitPublished(*job, 0, step, 30s).ok());
    }
    ASSERT_TRUE(e->UnregisterJob(*job).ok());
  }
}

// A job unregistered while its step ran kept its memory (and its swap)
// until the step had gone over every unit: a run killed mid-step and
// started again at once (through ztierd, as its connection closes) was
// refused for DRAM or swap that a job no longer there held. The step stops
// at its next unit, and a registration short of either waits for them.
TEST(EngineJobsTest, AJobUnregisteredMidStepLetsARegistrationRightAfterHaveItsMemory) {
  ScratchDir swap("swap");
  for (const Placement placement : {Placement::kDram, Placement::kNvmeStates}) {
    const bool nvme = placement == Placement::kNvmeStates;
    SCOPED_TRACE(nvme ? "swap cap" : "dram budget");
    // Room for one such job, not two: fp32 master, m and v of 16M elements
    // are 192 MiB, in DRAM or in the swap files (two paths of 128 MiB).
    auto e = nvme ? MakeEngine(uint64_t{1} << 30, &swap, uint64_t{128} << 20)
                  : MakeEngine(uint64_t{400} << 20);
    JobSpec spec;
    spec.name = "restarted";
    spec.optimizer.hyper = {.lr = 1e-2f};
    for (int k = 0; k < 8; ++k) {
      const std::string name = "u" + std::to_string(k);
      spec.units.push_back({name, {{name + ".w", {int64_t{2} << 20}}}});
    }
    spec = Place(spec, placement);
    for (int trial = 0; trial < 3; ++trial) {
      Result<int> job = e->RegisterJob(spec);
      ASSERT_TRUE(job.ok()) << job.status();
      for (int k = 0; k < 8; ++k) {
        const UnitLayout l = *e->Layout(*job, k);
        ASSERT_TRUE(
            e->WriteWeights(*job, k, std::vector<float>(l.numel, 0.5f).data(), l.numel).ok());
      }
      for (int k = 7; k >= 0; --k) Ring(*e, *job, k, 1, 0.25f);  // the step is posted
      if (trial > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5 * trial));
      ASSERT_TRUE(e->UnregisterJob(*job).ok());
      Result<int> again = e->RegisterJob(spec);
      ASSERT_TRUE(again.ok()) << "trial " << trial << ": " << again.status();
      ASSERT_TRUE(e->UnregisterJob(*again).ok());
    }
  }
}

// A state read while another thread replaced the state (ztierd's save of
// one client while another loaded a checkpoint, or wrote a unit's state)
// was not looked at: it returned a unit half of the old state and half of
// the new. A read during which the state was replaced, or that begins while
// it is being replaced, is refused.
TEST(EngineJobsTest, AStateReadWhileTheStateIsReplacedIsRefused) {
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  for (const Placement placement : {Placement::kNvmeStates, Placement::kDram}) {
    const bool nvme = placement == Placement::kNvmeStates;
    SCOPED_TRACE(nvme ? "nvme" : "dram");
    JobSpec spec;
    spec.name = nvme ? "replaced-nvme" : "replaced-dram";
    spec.units.push_back({"big", {{"big.w", {nvme ? int64_t{1024} : int64_t{12} << 20}}}});
    Result<int> job = e->RegisterJob(Place(spec, placement));
    ASSERT_TRUE(job.ok()) << job.status();
    const UnitLayout l = *e->Layout(*job, 0);
    std::vector<float> p(l.padded), m(l.padded), v(l.padded);
    int refused = 0;
    // NVMe: the write is slow, the read certain to begin while it runs.
    // DRAM: the copies race, a read begun before the write and ending
    // after it tells only by the count of replacements.
    for (int round = 1; round <= (nvme ? 1 : 8); ++round) {
      const float value = 0.125f * static_cast<float>(round);
      const std::vector<float> state(l.padded, value);
      if (nvme) fault->SlowDown(nvme::IoKind::kWrite, 300ms);
      std::atomic<bool> started{false};
      std::thread writer([&] {
        started = true;
        EXPECT_TRUE(e->WriteState(*job, 0, state.data(), state.data(), state.data()).ok());
      });
      while (!started.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(nvme ? 50 : round % 3));
      const Status read = e->ReadState(*job, 0, p.data(), m.data(), v.data());
      writer.join();
      fault->SlowDown(nvme::IoKind::kWrite, 0ms);
      if (read.ok()) {
        EXPECT_FALSE(nvme) << "a read begun while the state was written was not refused";
        const float first = p[0];
        EXPECT_TRUE(first == value || first == value - 0.125f) << first;
        EXPECT_EQ(std::count(p.begin(), p.end(), first), static_cast<long>(p.size()))
            << "round " << round << ": a read that succeeded is not of one state";
      } else {
        ++refused;
        EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition) << read;
        EXPECT_NE(read.message().find("was being replaced"), std::string::npos) << read;
      }
    }
    std::printf("%s: %d of the reads refused\n", spec.name.c_str(), refused);
    ASSERT_TRUE(e->ReadState(*job, 0, p.data(), m.data(), v.data()).ok());  // between: read
    ASSERT_TRUE(e->UnregisterJob(*job).ok());
  }
}

// A state written unit by unit holds what training could have left, as a
// loaded checkpoint must: a NaN master, an infinite m or a negative v is
// refused naming the tensor and the element, and the unit keeps its state.
// A unit whose tensors are all frozen keeps no m and v: they are not checked.
TEST(EngineJobsTest, AStateWrittenWithImpossibleValuesIsRefusedNamingWhere) {
  auto e = MakeEngine();
  JobSpec spec;
  spec.name = "impossible";
  spec.units.push_back({"u0", {{"u0.a", {10}}, {"u0.b", {50}}}});
  spec.units.push_back({"u1", {{.name = "u1.w", .shape = {64}, .frozen = true}}});
  Result<int> job = e->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const UnitLayout l = *e->Layout(*job, 0);
  ASSERT_GT(l.padded, l.numel);
  const std::vector<float> good(l.padded, 0.5f);
  ASSERT_TRUE(e->WriteState(*job, 0, good.data(), good.data(), good.data()).ok());
  struct Case {
    int array;  // 0 master, 1 m, 2 v
    float value;
    const char* words;
  };
  const float inf = std::numeric_limits<float>::infinity();
  for (const Case& c : {Case{0, std::nanf(""), "tensor 'u0.b' element 3 has fp32 master nan"},
                        Case{0, 3.4e38f, "tensor 'u0.b' element 3 has fp32 master"},
                        Case{1, -inf, "tensor 'u0.b' element 3 has m (exp_avg) -inf"},
                        Case{2, -1.0f, "tensor 'u0.b' element 3 has v (exp_avg_sq) -1"},
                        Case{2, std::nanf(""), "has v (exp_avg_sq) nan"}}) {
    std::vector<float> arrays[3] = {good, good, good};
    arrays[c.array][13] = c.value;
    const Status st = e->WriteState(*job, 0, arrays[0].data(), arrays[1].data(), arrays[2].data());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(c.words), std::string::npos) << st;
    EXPECT_NE(st.message().find("nothing was written"), std::string::npos) << st;
  }
  std::vector<float> padding = good;
  padding.back() = std::nanf("");
  EXPECT_NE(e->WriteState(*job, 0, padding.data(), good.data(), good.data())
                .message()
                .find("its padding has fp32 master nan"),
            std::string::npos);
  std::vector<float> p(l.padded), m(l.padded), v(l.padded);
  ASSERT_TRUE(e->ReadState(*job, 0, p.data(), m.data(), v.data()).ok());
  EXPECT_EQ(p, good);
  EXPECT_EQ(m, good);
  EXPECT_EQ(v, good);
  // The frozen unit: its moments are dropped, whatever they hold.
  const UnitLayout l1 = *e->Layout(*job, 1);
  const std::vector<float> half(l1.padded, 0.5f), nans(l1.padded, std::nanf(""));
  const Status frozen = e->WriteState(*job, 1, half.data(), nans.data(), nans.data());
  EXPECT_TRUE(frozen.ok()) << frozen;
  ASSERT_TRUE(e->CommitState(*job, 0, 0).ok());
  ASSERT_TRUE(e->UnregisterJob(*job).ok());
}

// A state written unit by unit (ztierd's clients' loads and imports) names
// the weights generation it expects: another writer's write or commit in
// between refuses the rest of it, so two loads never leave a mix while
// both say ok. An import's commit keeps the steps the job is at.
TEST(EngineJobsTest, AStateWrittenUnitByUnitIsRefusedAfterAnotherWritersWrite) {
  auto e = MakeEngine();
  JobSpec spec;
  spec.name = "writers";
  for (int u = 0; u < 2; ++u)
    spec.units.push_back({StrCat("u", u), {{StrCat("u", u, ".w"), {64}}}});
  Result<int> job = e->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const UnitLayout l = *e->Layout(*job, 0);
  const std::vector<float> a(l.padded, 1.0f), b(l.padded, 2.0f);
  const int64_t g = e->WeightsGeneration(*job);
  ASSERT_TRUE(e->WriteState(*job, 0, a.data(), a.data(), a.data(), g).ok());  // A: unit 0
  // B, from the generation A's write left: both units and its commit.
  ASSERT_TRUE(e->WriteState(*job, 0, b.data(), b.data(), b.data(), g + 1).ok());
  ASSERT_TRUE(e->WriteState(*job, 1, b.data(), b.data(), b.data(), g + 2).ok());
  ASSERT_TRUE(e->CommitState(*job, 0, 0, g + 3).ok());
  // A goes on: refused, its unit 1 and its commit.
  const Status a1 = e->WriteState(*job, 1, a.data(), a.data(), a.data(), g + 1);
  EXPECT_EQ(a1.code(), StatusCode::kFailedPrecondition) << a1;
  EXPECT_NE(a1.message().find("another load, import or state write"), std::string::npos) << a1;
  EXPECT_EQ(e->CommitState(*job, 0, 0, g + 1).code(), StatusCode::kFailedPrecondition);
  std::vector<float> p(l.padded), m(l.padded), v(l.padded);
  for (int u = 0; u < 2; ++u) {
    ASSERT_TRUE(e->ReadState(*job, u, p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p, b) << "unit " << u << " is not B's";
  }
  // Interleaved the other way: A's unit 0, B's unit 0, A refused, B goes
  // on and commits (a refused write moves no generation B expects).
  const std::vector<float> c(l.padded, 3.0f);
  const int64_t h = e->WeightsGeneration(*job);
  ASSERT_TRUE(e->WriteState(*job, 0, a.data(), a.data(), a.data(), h).ok());
  ASSERT_TRUE(e->WriteState(*job, 0, c.data(), c.data(), c.data(), h + 1).ok());
  EXPECT_EQ(e->WriteState(*job, 1, a.data(), a.data(), a.data(), h + 1).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->WriteState(*job, 9, a.data(), a.data(), a.data(), h + 2).code(),
            StatusCode::kOutOfRange);
  ASSERT_TRUE(e->WriteState(*job, 1, c.data(), c.data(), c.data(), h + 2).ok());
  ASSERT_TRUE(e->CommitState(*job, 0, 0, h + 3).ok());
  EXPECT_TRUE(e->CheckConsistent(*job).ok());
  for (int u = 0; u < 2; ++u) {
    ASSERT_TRUE(e->ReadState(*job, u, p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p, c) << "unit " << u << " is not B's";
  }
  // Steps kept: a step, then a commit of the steps the job is at.
  Ring(*e, *job, 1, 1, 0.25f);
  Ring(*e, *job, 0, 1, 0.25f);
  ASSERT_TRUE(e->WaitPublished(*job, 0, 1, 30s).ok());
  ASSERT_TRUE(e->CommitState(*job, kKeepSteps, kKeepSteps).ok());
  EXPECT_EQ(*e->Steps(*job), (std::pair<int64_t, int64_t>{1, 1}));
  EXPECT_EQ(e->PublishedStep(*job, 1), 1);
  EXPECT_EQ(e->CommitState(*job, kKeepSteps, 0).code(), StatusCode::kInvalidArgument);
  // A step the next one would overflow from.
  EXPECT_EQ(e->CommitState(*job, INT64_MAX, 0).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(e->UnregisterJob(*job).ok());
}

// Initial weights set while a load or a state write ran (another thread,
// another client of ztierd) went in between its units: the load said ok
// over a unit that held the weights set, or a read returned half of each.
// Setting weights waits for a call under way, and moves the weights
// generation a load through ztierd checks. Weights set from several
// threads at once each wait their turn (none is refused).
TEST(EngineJobsTest, WeightsSetDuringALoadWaitForIt) {
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  JobSpec spec;
  spec.name = "set-during-load";
  for (int u = 0; u < 8; ++u)
    spec.units.push_back({StrCat("u", u), {{StrCat("u", u, ".w"), {1024}}}});
  Result<int> job = e->RegisterJob(Place(spec, Placement::kNvmeStates));
  ASSERT_TRUE(job.ok()) << job.status();
  const UnitLayout l = *e->Layout(*job, 0);
  const std::vector<float> state(l.padded, 0.5f), weights(l.numel, 2.0f);
  fault->SlowDown(nvme::IoKind::kWrite, 300ms);
  std::atomic<bool> started{false}, written{false};
  std::thread writer([&] {
    started = true;
    EXPECT_TRUE(e->WriteState(*job, 0, state.data(), state.data(), state.data()).ok());
    written = true;
  });
  while (!started.load()) std::this_thread::yield();
  std::this_thread::sleep_for(50ms);
  const int64_t g = e->WeightsGeneration(*job);
  const Status set = e->WriteWeights(*job, 0, weights.data(), weights.size());
  EXPECT_TRUE(written.load()) << "the weights went in while the state was written";
  writer.join();
  fault->SlowDown(nvme::IoKind::kWrite, 0ms);
  ASSERT_TRUE(set.ok()) << set;
  EXPECT_GE(e->WeightsGeneration(*job), g + 2);  // the write's, then the weights'
  std::vector<float> p(l.padded), m(l.padded), v(l.padded);
  ASSERT_TRUE(e->ReadState(*job, 0, p.data(), m.data(), v.data()).ok());
  std::vector<float> want(l.padded, 0.0f);
  std::fill_n(want.begin(), l.numel, 2.0f);
  EXPECT_EQ(p, want);
  // Several threads, a unit each, twice over: all go in.
  std::vector<std::thread> setters;
  std::atomic<int> refused{0};
  for (int t = 0; t < 4; ++t) {
    setters.emplace_back([&, t] {
      for (int k = 2 * t; k < 2 * t + 2; ++k) {
        const std::vector<float> w(l.numel, static_cast<float>(k));
        for (int again = 0; again < 2; ++again) {
          if (!e->WriteWeights(*job, k, w.data(), w.size()).ok()) ++refused;
        }
      }
    });
  }
  for (std::thread& t : setters) t.join();
  EXPECT_EQ(refused.load(), 0);
  for (int k = 0; k < 8; ++k) {
    ASSERT_TRUE(e->ReadState(*job, k, p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p[0], static_cast<float>(k));
  }
  ASSERT_TRUE(e->UnregisterJob(*job).ok());
}

// What a client of the daemon does, in one process: map the job's regions
// through the fds the engine gives, write grads through the read-write
// mapping of the inbox, and read the new params through a read-only
// mapping of the publish region, which cannot be mapped writable.
TEST(EngineJobsTest, ClientsReachTheirBuffersThroughRegionFds) {
  auto engine = MakeEngine();
  Result<int> job = engine->RegisterJob(SmallModel("mapped", 2, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(job.ok()) << job.status();
  struct Mapping {
    void* base = MAP_FAILED;
    uint64_t bytes = 0;
    ~Mapping() {
      if (base != MAP_FAILED) ::munmap(base, bytes);
    }
  };
  std::map<uint32_t, Mapping> maps;
  auto map = [&](const SharedBuffer& b) -> char* {
    Mapping& m = maps[b.region];
    if (m.base == MAP_FAILED) {
      Result<UniqueFd> fd = engine->DupRegionFd(*job, b.region);
      EXPECT_TRUE(fd.ok()) << fd.status();
      const int prot = PROT_READ | (b.access == RegionAccess::kReadWrite ? PROT_WRITE : 0);
      m.base = ::mmap(nullptr, b.region_bytes, prot, MAP_SHARED, fd->get(), 0);
      m.bytes = b.region_bytes;
      EXPECT_NE(m.base, MAP_FAILED) << std::strerror(errno);
      if (b.access == RegionAccess::kReadOnly) {
        EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(), 0),
                  MAP_FAILED);  // sealed: no writable mapping, for anyone
      }
    }
    return static_cast<char*>(m.base) + b.offset;
  };
  for (int k = 0; k < 4; ++k) {
    const UnitLayout l = *engine->Layout(*job, k);
    std::vector<float> w(l.numel, 0.25f);
    ASSERT_TRUE(engine->WriteWeights(*job, k, w.data(), l.numel).ok());
  }
  for (int k = 3; k >= 0; --k) {
    const UnitLayout l = *engine->Layout(*job, k);
    for (int rank = 0; rank < 2; ++rank) {
      Result<SharedBuffer> b = engine->Locate(*job, *engine->GradInbox(*job, k, rank), l.shard * 2);
      ASSERT_TRUE(b.ok()) << b.status();
      ASSERT_EQ(b->access, RegionAccess::kReadWrite);
      auto* g = reinterpret_cast<bf16*>(map(*b));
      for (uint64_t i = 0; i < l.shard; ++i) g[i] = FloatToBf16(1.0f);
      ASSERT_TRUE(engine->GradsReady(*job, k, rank).ok());
    }
  }
  for (int k = 0; k < 4; ++k) {
    ASSERT_TRUE(engine->WaitPublished(*job, k, 1, 30s).ok());
    const UnitLayout l = *engine->Layout(*job, k);
    const bf16* published = *engine->Published(*job, k);
    Result<SharedBuffer> b = engine->Locate(*job, published, l.padded * 2);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(b->access, RegionAccess::kReadOnly);
    const auto* seen = reinterpret_cast<const bf16*>(map(*b));
    EXPECT_EQ(std::memcmp(seen, published, l.padded * 2), 0);
    EXPECT_LT(Bf16ToFloat(seen[0]), 0.25f) << "the step moved the weight against the grad";
  }
  int stack = 0;
  EXPECT_EQ(engine->Locate(*job, &stack, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->DupRegionFd(*job, 99999).status().code(), StatusCode::kNotFound);
}

// The step the engine is heading to: a step only once every unit's grads
// are in (exact mode); some units' grads alone make none.
TEST(EngineJobsTest, TargetStepCountsOnlyAStepThatWillHappen) {
  auto engine = MakeEngine();
  Result<int> job = engine->RegisterJob(SmallModel("target", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(engine->TargetStep(*job), -1);  // no weights yet
  for (int k = 0; k < 4; ++k) {
    const UnitLayout l = *engine->Layout(*job, k);
    ASSERT_TRUE(
        engine->WriteWeights(*job, k, std::vector<float>(l.numel, 0.1f).data(), l.numel).ok());
  }
  EXPECT_EQ(engine->TargetStep(*job), 0);
  for (int k = 3; k >= 1; --k) Ring(*engine, *job, k, 1, 0.5f);
  EXPECT_EQ(engine->TargetStep(*job), 0) << "three of four units' grads make no step";
  Ring(*engine, *job, 0, 1, 0.5f);
  EXPECT_EQ(engine->TargetStep(*job), 1);
  ASSERT_TRUE(engine->WaitPublished(*job, 3, 1, 30s).ok());
  EXPECT_EQ(engine->TargetStep(*job), 1);
  EXPECT_EQ(engine->TargetStep(12345), -1);
}

// The swap space's staging buffers (queue depth x stripe a path, pinned)
// are bounded by the DRAM budget: 1G stripes took 17 GB for a tiny model.
TEST(EngineJobsTest, SwapStagingPastTheBudgetIsRefusedUpFront) {
  ScratchDir swap("swap");
  Settings s;
  s.dram_budget_bytes = uint64_t{1} << 30;
  s.pin_memory = false;
  s.nvme_paths = {swap.sub("d0"), swap.sub("d1")};
  s.stripe_bytes = uint64_t{1} << 30;
  s.queue_depth = 16;
  Result<std::unique_ptr<Engine>> e = Engine::Create(s);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status();
  EXPECT_NE(e.status().message().find("staging buffers"), std::string::npos) << e.status();
  EXPECT_NE(e.status().message().find("aio.block_size"), std::string::npos) << e.status();
  s.stripe_bytes = uint64_t{1} << 20;  // 16 x 1M x 2 paths: fine
  EXPECT_TRUE(Engine::Create(s).ok());
}

// A weight that is not finite would make every step's grads so (every step
// skipped): refused, naming the tensor and element.
TEST(EngineJobsTest, NonFiniteWeightsAreRefused) {
  std::unique_ptr<Engine> engine = MakeEngine();
  JobSpec spec;
  spec.name = "finite";
  spec.units = {{"u0", {{"w", {8}}, {"b", {8}}}}};
  Result<int> job = engine->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<float> w(16, 0.5f);
  w[11] = std::numeric_limits<float>::infinity();
  Status bad = engine->WriteWeights(*job, 0, w.data(), w.size());
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("tensor 'b' element 3 is inf"), std::string::npos) << bad;
  // Finite in fp32, Inf in bf16: the forward pass would read Inf.
  w[11] = -3.4e38f;
  bad = engine->WriteWeights(*job, 0, w.data(), w.size());
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("within bf16's range"), std::string::npos) << bad;
  w[11] = 3.38e38f;  // the largest bf16 is 3.3895e38
  EXPECT_TRUE(engine->WriteWeights(*job, 0, w.data(), w.size()).ok());
  w[11] = 0.5f;
  EXPECT_TRUE(engine->WriteWeights(*job, 0, w.data(), w.size()).ok());
}

// The client page is the client's to write: a word that goes back, or
// jumps past what any link could move, never reaches the engine's totals
// (every user's, in the metrics), while the job runs or after it is gone.
TEST(EngineJobsTest, BadClientCounterWordsNeverReachTheTotals) {
  auto engine = MakeEngine(uint64_t{64} << 20);
  Result<int> a = engine->RegisterJob(SmallModel("a", 2, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(a.ok());
  Result<uint64_t*> rank1 = engine->ClientCounters(*a, 1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  uint64_t& h2d = (*rank1)[kHostToDeviceBytes];
  const auto total = [&] { return engine->totals().bytes.host_to_device; };
  h2d = 1000;
  EXPECT_EQ(total(), 1000u);
  h2d = ~uint64_t{0} - 5;  // would make the sum wrap, and go back
  EXPECT_EQ(total(), 1000u);
  h2d = 500;  // back
  EXPECT_EQ(total(), 1000u);
  EXPECT_EQ(engine->counters(*a).host_to_device_bytes, 1000u);
  h2d = 4000;
  EXPECT_EQ(total(), 4000u);
  h2d = ~uint64_t{0};
  ASSERT_TRUE(engine->UnregisterJob(*a).ok());
  EXPECT_EQ(total(), 4000u);
}

// ztierd's per-uid DRAM quota is checked before the engine allocates: a
// registration over it held the shared budget (and refused others') until
// the check after it undid it.
TEST(EngineJobsTest, AdmitSeesTheNeedBeforeAnyOfItIsAllocated) {
  auto engine = MakeEngine(uint64_t{256} << 20);
  const uint64_t used = engine->pool_stats().used_bytes;
  uint64_t asked = 0, used_then = UINT64_MAX;
  Result<int> refused = engine->RegisterJob(SmallModel("over", 1, 0.0f, 1, StepMode::kExact),
                                            [&](uint64_t dram, uint64_t) {
                                              asked = dram;
                                              used_then = engine->pool_stats().used_bytes;
                                              return Status::ResourceExhausted("over its quota");
                                            });
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(refused.status().message(), "over its quota");
  EXPECT_EQ(used_then, used);
  EXPECT_EQ(engine->pool_stats().used_bytes, used);
  // Admitted, the job holds about what it was said to need.
  Result<int> job = engine->RegisterJob(SmallModel("over", 1, 0.0f, 1, StepMode::kExact),
                                        [&](uint64_t dram, uint64_t) {
                                          EXPECT_EQ(dram, asked);
                                          return Status::Ok();
                                        });
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_GT(asked, 0u);
  EXPECT_EQ(engine->counters(*job).dram_bytes, asked);
}

TEST(EngineJobsTest, BudgetsValidationAndUnregister) {
  auto engine = MakeEngine(uint64_t{64} << 20);
  Result<int> a = engine->RegisterJob(SmallModel("a", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(a.ok());
  JobSpec big;
  big.name = "too-big";
  big.units = {{"w", {{"w", {4096, 4096}}}}};  // 16M params x 16 B > 64 MiB
  Result<int> b = engine->RegisterJob(big);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("job 'too-big'"), std::string::npos) << b.status();
  // Its one unit's states would need more on NVMe (the staging ring holds
  // buffer_count of them): NVMe is not offered. It was, whatever the units.
  EXPECT_EQ(b.status().message().find("on nvme"), std::string::npos) << b.status();
  JobSpec many;
  many.name = "many-units";
  for (int k = 0; k < 64; ++k) many.units.push_back({StrCat("u", k), {{"w", {256, 256}}}});
  b = engine->RegisterJob(many);
  ASSERT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status();
  EXPECT_NE(b.status().message().find("or put the optimizer states on nvme ("), std::string::npos)
      << b.status();
  // Over the budget with its states on NVMe too: that was offered as if
  // it fit; the budget it would take is said instead.
  JobSpec more;
  more.name = "more-units";
  for (int k = 0; k < 64; ++k) more.units.push_back({StrCat("u", k), {{"w", {512, 512}}}});
  b = engine->RegisterJob(more);
  ASSERT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status();
  EXPECT_EQ(b.status().message().find("or put the optimizer states on nvme"), std::string::npos)
      << b.status();
  EXPECT_NE(b.status().message().find("with the optimizer states on nvme the job needs "),
            std::string::npos)
      << b.status();
  // Job a is untouched and still steps.
  for (int k = 3; k >= 0; --k) Ring(*engine, *a, k, 1, 0.1f);
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(engine->WaitPublished(*a, k, 1, 10s).ok());

  EXPECT_EQ(engine->RegisterJob(SmallModel("a", 1, 0, 1, StepMode::kExact)).status().code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(engine->RegisterJob(SmallModel("c", 1, 1.0f, 1, StepMode::kEager)).status().code(),
            StatusCode::kInvalidArgument);
  JobSpec nvme = SmallModel("d", 1, 0, 1, StepMode::kExact);
  nvme.optimizer_tier = Tier::kNvme;  // this engine has no swap paths
  Result<int> no_swap = engine->RegisterJob(nvme);
  EXPECT_EQ(no_swap.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(no_swap.status().message().find("nvme_path"), std::string::npos) << no_swap.status();
  nvme.optimizer_tier = Tier::kDram;
  nvme.param_tier = Tier::kNvme;
  EXPECT_EQ(engine->RegisterJob(nvme).status().code(), StatusCode::kInvalidArgument);
  // A spec of many units and ranks is refused before the engine makes
  // each unit's per-rank bookkeeping (ztierd took a gigabyte per such
  // request to refuse it for the budget).
  JobSpec wide;
  wide.name = "wide";
  wide.ranks = 1024;
  for (int k = 0; k < 4097; ++k) wide.units.push_back({StrCat("u", k), {{"w", {1}}}});
  const Status refused = engine->RegisterJob(wide).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("4097 units x 1024 ranks is more than 4194304"),
            std::string::npos)
      << refused;
  wide.units.resize(kMaxUnits + 1, wide.units[0]);
  wide.ranks = 1;
  EXPECT_EQ(engine->RegisterJob(wide).status().code(), StatusCode::kInvalidArgument);
  JobSpec zero = SmallModel("e", 1, 0, 1, StepMode::kExact);
  zero.units[0].tensors[0].shape = {0, 3};
  EXPECT_EQ(engine->RegisterJob(zero).status().code(), StatusCode::kInvalidArgument);
  // Enum values out of range were taken as some mode or tier.
  JobSpec odd = SmallModel("f", 1, 0, 1, static_cast<StepMode>(7));
  EXPECT_EQ(engine->RegisterJob(odd).status().code(), StatusCode::kInvalidArgument);
  odd = SmallModel("f", 1, 0, 1, StepMode::kExact);
  odd.param_tier = static_cast<Tier>(7);
  EXPECT_EQ(engine->RegisterJob(odd).status().code(), StatusCode::kInvalidArgument);
  odd = SmallModel("f", 1, 0, 1, StepMode::kExact);
  odd.state_dtype = static_cast<StateDtype>(7);
  EXPECT_EQ(engine->RegisterJob(odd).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      engine
          ->ExportSafetensors(*a, "/nonexistent/x.safetensors", static_cast<Engine::ExportType>(7))
          .code(),
      StatusCode::kInvalidArgument);

  // Double delivery in one micro-step is refused.
  Ring(*engine, *a, 3, 1, 0.1f);
  EXPECT_EQ(engine->GradsReady(*a, 3, 0).code(), StatusCode::kFailedPrecondition);

  ASSERT_TRUE(engine->UnregisterJob(*a).ok());
  EXPECT_EQ(engine->UnregisterJob(*a).code(), StatusCode::kNotFound);
  // Its memory is back: the big job that did not fit next to it still does not
  // fit alone (64 MiB), but a second small job does.
  EXPECT_TRUE(engine->RegisterJob(SmallModel("f", 2, 0, 3, StepMode::kExact)).ok());
}

}  // namespace
}  // namespace ztier::engine

namespace ztier::engine {
namespace {

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::current_path() / ("ckpt-test-" + std::to_string(::getpid()) + "-" +
                                 ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // An engine whose swap drive can be slowed (its fault backend), with a
  // job of states on NVMe trained one step.
  struct SlowDriveJob {
    SlowDriveJob()
        : swap("swap"),
          fault(std::make_shared<nvme::FaultBackend>(nvme::MakeThreadBackend())),
          engine(MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault)) {
      Result<int> j = engine->RegisterJob(
          Place(SmallModel("busy", 1, 0.0f, 1, StepMode::kExact), Placement::kNvmeStates));
      EXPECT_TRUE(j.ok()) << j.status();
      job = j.ok() ? *j : -1;
      if (job >= 0) Train(*engine, job, 1, 0, 1, 7);
    }
    ScratchDir swap;
    std::shared_ptr<nvme::FaultBackend> fault;
    std::unique_ptr<Engine> engine;
    int job = -1;
  };

  // Waits (bounded) until a save, load or other checkpointing call of the
  // job is under way: a second one is refused as such meanwhile.
  static bool CheckpointUnderWay(Engine& e, int job) {
    for (int i = 0; i < 500; ++i) {
      const Status busy = e.CheckConsistent(job);
      if (busy.message().find("another checkpoint is in progress") != std::string::npos) {
        return true;
      }
      std::this_thread::sleep_for(2ms);
    }
    return false;
  }

  fs::path dir_;
};

TEST_F(CheckpointTest, RoundTripSameAndDifferentRanks) {
  auto a = MakeEngine();
  Result<int> ja = a->RegisterJob(SmallModel("ckpt", 2, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(ja.ok());
  Train(*a, *ja, 2, 0, 3, 7);
  const State saved = Snapshot(*a, *ja);
  ASSERT_TRUE(a->SaveCheckpoint(*ja, dir_.string()).ok());

  for (int ranks : {2, 1, 3}) {
    SCOPED_TRACE(StrCat("load into R = ", ranks));
    auto b = MakeEngine();
    Result<int> jb = b->RegisterJob(SmallModel("ckpt", ranks, 1.0f, 1, StepMode::kExact));
    ASSERT_TRUE(jb.ok());
    Status s = b->LoadCheckpoint(*jb, dir_.string());
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(Same(Snapshot(*b, *jb), saved));
    EXPECT_EQ(b->PublishedStep(*jb, 0), 3);
    // Resumed training matches the original run continued.
    if (ranks == 2) {
      Train(*a, *ja, 2, 3, 2, 99);
      Train(*b, *jb, 2, 3, 2, 99);
      EXPECT_TRUE(Same(Snapshot(*a, *ja), Snapshot(*b, *jb)));
    }
  }
}

// The moments were made with the checkpoint's optimizer settings: loading
// them into a job with others (here clipping off) is said, naming what
// differs (it was silent); the learning rate, which schedules move, is not.
TEST_F(CheckpointTest, OtherOptimizerSettingsAreSaidAtLoad) {
  auto a = MakeEngine();
  Result<int> ja = a->RegisterJob(SmallModel("ckpt", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(ja.ok());
  Train(*a, *ja, 1, 0, 1, 7);
  ASSERT_TRUE(a->SaveCheckpoint(*ja, dir_.string()).ok());
  for (float clip : {1.0f, 0.0f}) {
    auto b = MakeEngine();
    Result<int> jb = b->RegisterJob(SmallModel("ckpt", 1, clip, 1, StepMode::kExact));
    ASSERT_TRUE(jb.ok());
    ::testing::internal::CaptureStderr();
    Status s = b->LoadCheckpoint(*jb, dir_.string());
    const std::string said = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(s.ok()) << s;
    const bool warned = said.find("saved with other optimizer settings") != std::string::npos;
    EXPECT_EQ(warned, clip == 0.0f) << said;
    if (clip == 0.0f) {
      EXPECT_NE(said.find("clip_norm 1.0 -> 0.0"), std::string::npos) << said;
    }
  }
}

TEST_F(CheckpointTest, OlderFilesGoOnlyAfterTheNewManifestIsIn) {
  auto e = MakeEngine();
  Result<int> j = e->RegisterJob(SmallModel("ckpt", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(j.ok());
  Train(*e, *j, 1, 0, 1, 3);
  ASSERT_TRUE(e->SaveCheckpoint(*j, dir_.string()).ok());
  Train(*e, *j, 1, 1, 1, 4);
  ASSERT_TRUE(e->SaveCheckpoint(*j, dir_.string()).ok());
  int files = 0;
  for (const auto& f : fs::directory_iterator(dir_)) {
    const std::string n = f.path().filename().string();
    if (n.starts_with("unit-")) {
      ++files;
      EXPECT_NE(n.find("-step-2-"), std::string::npos) << n << " outlived its checkpoint";
    }
  }
  EXPECT_EQ(files, 4);
}

TEST_F(CheckpointTest, DamagedCheckpointsAreRejectedClearly) {
  auto e = MakeEngine();
  Result<int> j = e->RegisterJob(SmallModel("ckpt", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(j.ok());
  Train(*e, *j, 1, 0, 1, 5);
  ASSERT_TRUE(e->SaveCheckpoint(*j, dir_.string()).ok());
  Train(*e, *j, 1, 1, 1, 6);  // the job moves on: a partial load would show
  const State before = Snapshot(*e, *j);
  const fs::path manifest = dir_ / "manifest.json";
  std::string good_manifest;
  {
    std::ifstream in(manifest);
    good_manifest.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  fs::path unit_file;
  for (const auto& f : fs::directory_iterator(dir_)) {
    if (f.path().filename().string().starts_with("unit-1-")) unit_file = f.path();
  }
  ASSERT_FALSE(unit_file.empty());
  std::string good_unit;
  {
    std::ifstream in(unit_file, std::ios::binary);
    good_unit.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto put = [](const fs::path& p, const std::string& data) {
    std::ofstream(p, std::ios::binary | std::ios::trunc)
        .write(data.data(), static_cast<std::streamsize>(data.size()));
  };
  auto load = [&] { return e->LoadCheckpoint(*j, dir_.string()); };

  std::string flipped = good_unit;
  flipped[good_unit.size() / 2] ^= 0x04;
  put(unit_file, flipped);
  Status s = load();
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find(unit_file.filename().string()), std::string::npos) << s;
  put(unit_file, good_unit.substr(0, good_unit.size() - 100));
  s = load();
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s;
  put(unit_file, good_unit);

  std::string edited = good_manifest;
  edited.replace(edited.find("\"step\": 1"), 9, "\"step\": 7");
  put(manifest, edited);
  s = load();
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find("checksum mismatch"), std::string::npos) << s;
  put(manifest, good_manifest.substr(0, good_manifest.size() / 2));
  s = load();
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  // Bytes after a NUL were dropped, and the damaged manifest loaded.
  put(manifest, good_manifest + std::string(1, '\0') + "garbage");
  s = load();
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
  EXPECT_NE(s.message().find("a NUL byte"), std::string::npos) << s;
  put(manifest, good_manifest);

  // Values no training leaves (NaN in a master, v < 0) under checksums
  // made over them: refused, naming the tensor (it trained on as NaN, every
  // step skipped).
  // Nor an m or v past what a step's grads bound them to: a forged m of
  // 3e38 loaded, and its first step took the master to -inf.
  for (const auto& [array, value] :
       {std::pair{0, NAN}, {2, -1.0f}, {1, 3e38f}, {2, 3e38f}, {0, 3.4e38f}}) {
    std::string forged = good_unit;
    const uint64_t shard = (good_unit.size() - kShardHeaderBytes) / 12;
    std::memcpy(forged.data() + kShardHeaderBytes + (array * shard + 3) * 4, &value, 4);
    put(unit_file, forged);
    Result<CheckpointManifest> m = DecodeCheckpointManifest(good_manifest, "manifest");
    ASSERT_TRUE(m.ok()) << m.status();
    m->units[1].shards[0].crc32c = Crc32c(forged.data(), forged.size());
    put(manifest, EncodeCheckpointManifest(*m));
    s = load();
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s;
    EXPECT_NE(s.message().find("tensor 'block0.w1' element 3"), std::string::npos) << s;
    const std::string said = StrCat(array == 0   ? "fp32 master "
                                    : array == 1 ? "m (exp_avg) "
                                                 : "v (exp_avg_sq) ",
                                    value);
    EXPECT_NE(s.message().find(said), std::string::npos) << said << ": " << s;
  }
  put(unit_file, good_unit);
  put(manifest, good_manifest);

  // A job of another shape is refused, naming the unit.
  JobSpec other = SmallModel("other", 1, 0.0f, 1, StepMode::kExact);
  other.units[2].tensors[0].shape = {24, 41};
  Result<int> jo = e->RegisterJob(other);
  ASSERT_TRUE(jo.ok());
  s = e->LoadCheckpoint(*jo, dir_.string());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("block1"), std::string::npos) << s;

  // Failed loads left the job's state alone, and the good checkpoint loads.
  EXPECT_TRUE(Same(Snapshot(*e, *j), before));
  EXPECT_TRUE(load().ok());
  EXPECT_FALSE(Same(Snapshot(*e, *j), before));
  EXPECT_EQ(e->PublishedStep(*j, 0), 1);
  EXPECT_EQ(e->LoadCheckpoint(*j, (dir_ / "missing").string()).code(), StatusCode::kNotFound);
}

TEST_F(CheckpointTest, RefusedWhileGradsAreInFlight) {
  auto e = MakeEngine();
  Result<int> j = e->RegisterJob(SmallModel("busy", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(j.ok());
  Ring(*e, *j, 3, 1, 0.1f);  // one unit's grads in, step pending
  EXPECT_EQ(e->SaveCheckpoint(*j, dir_.string()).code(), StatusCode::kFailedPrecondition);
}

// A save from another thread while training goes on: the next step's
// grads that arrive during it wait for it, and the checkpoint holds the
// step it began at. (They were refused, and the runner that pushed them
// failed for good.) The save is slowed by a slow drive under the states.
TEST_F(CheckpointTest, GradsArrivingDuringASaveWaitForItsEnd) {
  SlowDriveJob r;
  ASSERT_GE(r.job, 0);
  Engine* e = r.engine.get();
  const int j = r.job;
  const State at_one = Snapshot(*e, j);
  r.fault->SlowDown(nvme::IoKind::kRead, 40ms);
  Status saved = Status::Internal("not run");
  std::thread saver([&] { saved = e->SaveCheckpoint(j, dir_.string()); });
  // The save under way, the next step's grads come.
  EXPECT_TRUE(CheckpointUnderWay(*e, j)) << "the save was never seen under way";
  for (int k = 3; k >= 0; --k) Ring(*e, j, k, 1, 0.25f);
  saver.join();
  ASSERT_TRUE(saved.ok()) << saved;
  r.fault->Reset();
  for (int k = 0; k < 4; ++k) ASSERT_TRUE(e->WaitPublished(j, k, 2, 30s).ok());
  EXPECT_FALSE(Same(Snapshot(*e, j), at_one)) << "the step did not run";
  auto b = MakeEngine();
  Result<int> jb = b->RegisterJob(SmallModel("busy", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(jb.ok());
  ASSERT_TRUE(b->LoadCheckpoint(*jb, dir_.string()).ok());
  EXPECT_TRUE(Same(Snapshot(*b, *jb), at_one));
  EXPECT_EQ(b->PublishedStep(*jb, 0), 1);
}

// Grads that arrive during a load from another thread are of the state
// the load replaces: refused, naming why, once it is done (waited through,
// they were applied to the loaded state: its next step was made from
// grads of other weights). The job then trains on from the loaded step.
TEST_F(CheckpointTest, GradsArrivingDuringALoadAreRefusedOnceItIsDone) {
  SlowDriveJob r;
  ASSERT_GE(r.job, 0);
  Engine* e = r.engine.get();
  const int j = r.job;
  const State at_one = Snapshot(*e, j);
  ASSERT_TRUE(e->SaveCheckpoint(j, dir_.string()).ok());
  Train(*e, j, 1, 1, 2, 8);
  r.fault->SlowDown(nvme::IoKind::kWrite, 40ms);
  Status loaded = Status::Internal("not run");
  std::thread loader([&] { loaded = e->LoadCheckpoint(j, dir_.string()); });
  EXPECT_TRUE(CheckpointUnderWay(*e, j)) << "the load was never seen under way";
  const UnitLayout l = *e->Layout(j, 3);
  bf16* g = *e->GradInbox(j, 3, 0);
  std::fill(g, g + l.shard, FloatToBf16(0.25f));
  const Status late = e->GradsReady(j, 3, 0);
  loader.join();
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late;
  EXPECT_NE(late.message().find("its state was replaced"), std::string::npos) << late;
  r.fault->Reset();
  EXPECT_TRUE(Same(Snapshot(*e, j), at_one));
  EXPECT_EQ(e->PublishedStep(j, 3), 1);
  Train(*e, j, 1, 1, 1, 9);
  EXPECT_EQ(e->PublishedStep(j, 3), 2);
}

// Checkpoints move between fp32 and 8-bit states both ways: int8 -> fp32
// dequantizes (the fp32 job holds exactly the int8 job's values), fp32 ->
// int8 quantizes (and quantizing those values again changes nothing), an
// int8 job saved and loaded again (DRAM -> NVMe) trains on bit for bit.
TEST_F(CheckpointTest, CheckpointsLoadAcrossStateDtypes) {
  ScratchDir swap("swap");
  auto i8 = MakeEngine(uint64_t{1} << 30, nullptr, uint64_t{64} << 20, nullptr, StateDtype::kInt8);
  Result<int> ji = i8->RegisterJob(SmallModel("dtypes", 2, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(ji.ok()) << ji.status();
  Train(*i8, *ji, 2, 0, 3, 21);
  const State trained = Snapshot(*i8, *ji);
  ASSERT_TRUE(i8->SaveCheckpoint(*ji, dir_.string()).ok());
  auto manifest = [](const fs::path& dir) {
    std::ifstream in(dir / "manifest.json");
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_NE(manifest(dir_).find("\"state_dtype\": \"int8\""), std::string::npos);

  auto f32 = MakeEngine();
  Result<int> jf = f32->RegisterJob(SmallModel("dtypes", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(jf.ok());
  ASSERT_TRUE(f32->LoadCheckpoint(*jf, dir_.string()).ok());
  EXPECT_TRUE(Same(Snapshot(*f32, *jf), trained)) << "int8 -> fp32 is not the dequantized state";
  EXPECT_EQ(f32->PublishedStep(*jf, 0), 3);

  const std::string back = (dir_ / "back").string();
  ASSERT_TRUE(f32->SaveCheckpoint(*jf, back).ok());
  EXPECT_NE(manifest(back).find("\"state_dtype\": \"fp32\""), std::string::npos);
  auto n8 = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, nullptr, StateDtype::kInt8);
  JobSpec nspec = SmallModel("dtypes", 2, 1.0f, 1, StepMode::kExact);
  nspec.optimizer_tier = Tier::kNvme;
  Result<int> jn = n8->RegisterJob(nspec);
  ASSERT_TRUE(jn.ok()) << jn.status();
  ASSERT_TRUE(n8->LoadCheckpoint(*jn, back).ok());
  EXPECT_TRUE(Same(Snapshot(*n8, *jn), trained)) << "fp32 -> int8 changed quantized values";
  Train(*i8, *ji, 2, 3, 2, 22);
  Train(*n8, *jn, 2, 3, 2, 22);
  EXPECT_TRUE(Same(Snapshot(*i8, *ji), Snapshot(*n8, *jn)));
}

// Int8 states of an older version could hold v as 0 beside a nonzero m
// (a v too small for its block's code map); loaded, such an element stepped
// by lr * m / eps. A checkpoint of int8 states loads v as m^2 there, into
// fp32 and int8 jobs alike; every other element loads as saved.
TEST_F(CheckpointTest, AnInt8CheckpointsVanishedSecondMomentsLoadAsMSquared) {
  auto i8 = MakeEngine(uint64_t{1} << 30, nullptr, uint64_t{64} << 20, nullptr, StateDtype::kInt8);
  Result<int> ji = i8->RegisterJob(SmallModel("vanished", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(ji.ok()) << ji.status();
  Train(*i8, *ji, 1, 0, 2, 31);
  // What the old quantizer left: v 0 at some elements whose m is not.
  const UnitLayout l = *i8->Layout(*ji, 1);
  std::vector<float> p(l.padded), m(l.padded), v(l.padded);
  ASSERT_TRUE(i8->ReadState(*ji, 1, p.data(), m.data(), v.data()).ok());
  // The five with the smallest v (as such elements' were: m^2 stays far
  // below its block's largest v, whose codes then stay as they are).
  std::vector<uint64_t> vanished;
  for (uint64_t i = 0; i < l.numel; ++i) {
    if (m[i] != 0.0f && v[i] != 0.0f) vanished.push_back(i);
  }
  ASSERT_GE(vanished.size(), 5u);
  std::partial_sort(vanished.begin(), vanished.begin() + 5, vanished.end(),
                    [&](uint64_t a, uint64_t b) { return v[a] < v[b]; });
  vanished.resize(5);
  for (uint64_t i : vanished) v[i] = 0.0f;
  const auto [step, adam_step] = *i8->Steps(*ji);
  ASSERT_TRUE(i8->WriteState(*ji, 1, p.data(), m.data(), v.data()).ok());
  ASSERT_TRUE(i8->CommitState(*ji, step, adam_step).ok());
  const State saved = Snapshot(*i8, *ji);
  for (uint64_t i : vanished) ASSERT_EQ(saved.v[1][i], 0.0f);
  ASSERT_TRUE(i8->SaveCheckpoint(*ji, dir_.string()).ok());

  for (const StateDtype dtype : {StateDtype::kFp32, StateDtype::kInt8}) {
    SCOPED_TRACE(dtype == StateDtype::kInt8 ? "into int8" : "into fp32");
    auto e = MakeEngine(uint64_t{1} << 30, nullptr, uint64_t{64} << 20, nullptr, dtype);
    Result<int> j = e->RegisterJob(SmallModel("vanished", 1, 1.0f, 1, StepMode::kExact));
    ASSERT_TRUE(j.ok()) << j.status();
    ASSERT_TRUE(e->LoadCheckpoint(*j, dir_.string()).ok());
    State loaded = Snapshot(*e, *j);
    for (uint64_t i : vanished) {
      if (dtype == StateDtype::kFp32) {
        EXPECT_EQ(loaded.v[1][i], saved.m[1][i] * saved.m[1][i]) << "element " << i;
      } else {
        EXPECT_GT(loaded.v[1][i], 0.0f) << "element " << i;
      }
      loaded.v[1][i] = 0.0f;
    }
    EXPECT_TRUE(Same(loaded, saved)) << "other elements changed";
  }
}

// States on NVMe give the same training as states in DRAM, and checkpoints
// move between the tiers both ways.
TEST_F(CheckpointTest, NvmeStatesTrainAsDramStatesAndCheckpointAcrossTiers) {
  ScratchDir swap("swap");
  auto d = MakeEngine();
  auto n = MakeEngine(uint64_t{1} << 30, &swap);
  Result<int> jd = d->RegisterJob(SmallModel("tiers", 2, 1.0f, 1, StepMode::kExact));
  JobSpec nspec = SmallModel("tiers", 2, 1.0f, 1, StepMode::kExact);
  nspec.optimizer_tier = Tier::kNvme;
  Result<int> jn = n->RegisterJob(nspec);
  ASSERT_TRUE(jd.ok() && jn.ok()) << jn.status();
  Train(*d, *jd, 2, 0, 3, 11);
  Train(*n, *jn, 2, 0, 3, 11);
  ASSERT_TRUE(Same(Snapshot(*d, *jd), Snapshot(*n, *jn)));
  ASSERT_TRUE(n->RoundTripStates(*jn).ok());  // a no-op for the state
  ASSERT_TRUE(Same(Snapshot(*d, *jd), Snapshot(*n, *jn)));

  // NVMe -> file -> a DRAM job with another rank count, and back.
  ASSERT_TRUE(n->SaveCheckpoint(*jn, dir_.string()).ok());
  auto d1 = MakeEngine();
  Result<int> jd1 = d1->RegisterJob(SmallModel("tiers", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(jd1.ok());
  ASSERT_TRUE(d1->LoadCheckpoint(*jd1, dir_.string()).ok());
  EXPECT_TRUE(Same(Snapshot(*d1, *jd1), Snapshot(*d, *jd)));
  Train(*d, *jd, 2, 3, 1, 12);
  // dir_ belongs to n's job now (it saved there): d saves elsewhere.
  EXPECT_EQ(d->SaveCheckpoint(*jd, dir_.string()).code(), StatusCode::kUnavailable);
  const std::string back = (dir_ / "back").string();
  ASSERT_TRUE(d->SaveCheckpoint(*jd, back).ok());
  ASSERT_TRUE(n->LoadCheckpoint(*jn, back).ok());
  EXPECT_TRUE(Same(Snapshot(*n, *jn), Snapshot(*d, *jd)));

  // Safetensors export of an NVMe job equals the DRAM job's, byte for byte.
  const std::string fd = (dir_ / "d.safetensors").string(), fn = (dir_ / "n.safetensors").string();
  ASSERT_TRUE(d->ExportSafetensors(*jd, fd, Engine::ExportType::kFloat32).ok());
  ASSERT_TRUE(n->ExportSafetensors(*jn, fn, Engine::ExportType::kFloat32).ok());
  auto slurp = [](const std::string& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(slurp(fd), slurp(fn));
}

TEST(EngineSwapTest, OverCapacityIsClearAndHarmsNoOtherJob) {
  ScratchDir swap("swap");
  auto e = MakeEngine(uint64_t{1} << 30, &swap, /*swap_capacity=*/uint64_t{4} << 20);
  JobSpec a = SmallModel("fits", 1, 0.0f, 1, StepMode::kExact);
  a.optimizer_tier = Tier::kNvme;
  Result<int> ja = e->RegisterJob(a);
  ASSERT_TRUE(ja.ok()) << ja.status();
  JobSpec big;
  big.name = "too-big";
  big.optimizer_tier = Tier::kNvme;
  big.units = {{"u0", {{"w", {256, 1024}}}}, {"u1", {{"w", {512, 1024}}}}};  // 9 MiB of state
  Result<int> jb = e->RegisterJob(big);
  ASSERT_FALSE(jb.ok());
  EXPECT_EQ(jb.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(jb.status().message().find("job 'too-big'"), std::string::npos) << jb.status();
  // The whole job's need, up front, and a cap that takes it: a unit at a
  // time, each refusal named the next unit's shortfall, and a cap raised
  // by it was refused again at the unit after.
  const std::string said(jb.status().message());
  EXPECT_NE(said.find(StrCat("needs ", 9 << 20, " bytes")), std::string::npos) << said;
  const size_t at = said.find("raise it to at least ");
  ASSERT_NE(at, std::string::npos) << said;
  const uint64_t raised = std::stoull(said.substr(at + std::strlen("raise it to at least ")));
  {
    ScratchDir swap2("swap-roomy");
    auto roomy = MakeEngine(uint64_t{1} << 30, &swap2, raised);
    ASSERT_TRUE(roomy->RegisterJob(a).ok());
    Result<int> fits = roomy->RegisterJob(big);
    EXPECT_TRUE(fits.ok()) << fits.status() << " (a cap of " << raised << " per path)";
  }
  // The first job still trains; after it leaves, its space is free again.
  Train(*e, *ja, 1, 0, 2, 5);
  ASSERT_TRUE(e->UnregisterJob(*ja).ok());
  big.units.pop_back();  // 3 MiB: fits in the 8 MiB once "fits" is gone
  EXPECT_TRUE(e->RegisterJob(big).ok());
}

// Jobs step side by side: a job whose step waits on a slow drive does not
// hold up another job's DRAM step, and each trains as it would alone.
// More slow-drive jobs than there are stepping threads (one uid may have 16):
// with one pool of 4 for every job, four such steps held every thread and
// a DRAM job's step waited for them.
TEST(EngineJobsTest, SlowDriveJobsDoNotHoldUpADramJob) {
  ScratchDir swap("swap");
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeThreadBackend());
  auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
  std::vector<int> slow;
  for (int j = 0; j < 5; ++j) {
    Result<int> id = e->RegisterJob(
        Place(SmallModel(StrCat("slow", j), 1, 1.0f, 1, StepMode::kExact), Placement::kNvmeStates));
    ASSERT_TRUE(id.ok()) << id.status();
    slow.push_back(*id);
    Train(*e, *id, 1, 0, 1, 5 + j);
  }
  Result<int> fast = e->RegisterJob(SmallModel("fast", 1, 1.0f, 1, StepMode::kExact));
  ASSERT_TRUE(fast.ok()) << fast.status();
  Train(*e, *fast, 1, 0, 1, 11);
  // Every state read and write-back of the slow jobs' next steps now takes
  // 40 ms: together they take seconds.
  fault->SlowDown(nvme::IoKind::kRead, 40ms);
  fault->SlowDown(nvme::IoKind::kWrite, 40ms);
  for (int id : slow) {
    for (int k = 3; k >= 0; --k) Ring(*e, id, k, 1, 0.5f);
  }
  std::this_thread::sleep_for(50ms);  // their steps under way
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 3; k >= 0; --k) Ring(*e, *fast, k, 1, 0.25f);
  for (int k = 0; k < 4; ++k) ASSERT_TRUE(e->WaitPublished(*fast, k, 2, 30s).ok());
  const double fast_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int slow_done_first = 0;
  for (int id : slow) slow_done_first += e->PublishedStep(id, 3) >= 2;
  EXPECT_EQ(slow_done_first, 0) << "slow jobs finished first after all";
  for (int id : slow) {
    for (int k = 0; k < 4; ++k) ASSERT_TRUE(e->WaitPublished(id, k, 2, 60s).ok());
  }
  const double slow_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("the DRAM job's step took %.3f s, the slow-drive jobs' %.3f s\n", fast_s, slow_s);
  EXPECT_LT(fast_s, 0.5 * slow_s);
  fault->Reset();
  // All go on as if alone.
  Train(*e, slow[0], 1, 2, 1, 7);
  Train(*e, *fast, 1, 2, 1, 8);
}

// ztier.io_backend threads (what a kernel without io_uring gets) trains
// exactly as io_uring does, params on NVMe included.
TEST(EngineSwapTest, TheThreadBackendTrainsExactlyAsIoUring) {
  ScratchDir swap_a("swap-a"), swap_b("swap-b");
  auto uring = MakeEngine(uint64_t{1} << 30, &swap_a);
  auto threads = MakeEngine(uint64_t{1} << 30, &swap_b, uint64_t{64} << 20,
                            std::shared_ptr<nvme::IoBackend>(nvme::MakeThreadBackend()));
  const JobSpec spec = Place(SmallModel("io", 2, 1.0f, 1, StepMode::kExact), Placement::kNvmeAll);
  Result<int> ju = uring->RegisterJob(spec);
  Result<int> jt = threads->RegisterJob(spec);
  ASSERT_TRUE(ju.ok() && jt.ok()) << jt.status();
  Train(*uring, *ju, 2, 0, 3, 21);
  Train(*threads, *jt, 2, 0, 3, 21);
  EXPECT_TRUE(Same(Snapshot(*uring, *ju), Snapshot(*threads, *jt)));
  EXPECT_GT(threads->counters(*jt).nvme_write_bytes, 0u);
  // A job's swap bytes (what quotas count) are the space its objects take
  // in the files, whole stripes (they were the objects' sizes).
  uint64_t used = 0;
  for (const SwapPathUsage& p : threads->swap_usage()) used += p.used_bytes;
  EXPECT_EQ(threads->counters(*jt).nvme_bytes, used);
}

// Params on NVMe: leases hold cache slots, a full cache times out clearly,
// a release frees a slot, prefetched units are served from the cache, and
// a new publish is never served from an out-of-date copy.
TEST(EngineSwapTest, ParamCacheLeasesPrefetchAndFreshness) {
  ScratchDir swap("swap");
  auto e = MakeEngine(uint64_t{1} << 30, &swap);  // buffer_count 3
  Result<int> j =
      e->RegisterJob(Place(SmallModel("pc", 1, 0.0f, 1, StepMode::kExact), Placement::kNvmeAll));
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(e->Published(*j, 0).status().code(), StatusCode::kFailedPrecondition);
  std::vector<std::vector<float>> w(4);
  for (int k = 0; k < 4; ++k) {
    const UnitLayout l = *e->Layout(*j, k);
    w[k].assign(l.numel, 0.25f * (k + 1));
    ASSERT_TRUE(e->WriteWeights(*j, k, w[k].data(), l.numel).ok());
  }
  const uint64_t before = e->counters(*j).nvme_param_read_bytes;
  // Unit 0 read, units 1 prefetched (3 slots: depth 1).
  Result<const bf16*> p0 = e->AcquireParams(*j, 0, 0, 5s);
  ASSERT_TRUE(p0.ok()) << p0.status();
  EXPECT_EQ(Bf16ToFloat((*p0)[0]), 0.25f);
  const uint64_t after_first = e->counters(*j).nvme_param_read_bytes;
  EXPECT_GT(after_first, before);
  Result<const bf16*> p1 = e->AcquireParams(*j, 1, 0, 5s);
  ASSERT_TRUE(p1.ok());
  EXPECT_EQ(Bf16ToFloat((*p1)[0]), 0.5f);
  Result<const bf16*> p2 = e->AcquireParams(*j, 2, 0, 5s);
  ASSERT_TRUE(p2.ok());
  EXPECT_EQ(Bf16ToFloat((*p2)[0]), 0.75f);
  // All three slots held: the fourth unit waits, then says why.
  Result<const bf16*> p3 = e->AcquireParams(*j, 3, 0, 200ms);
  EXPECT_EQ(p3.status().code(), StatusCode::kUnavailable) << p3.status();
  EXPECT_NE(p3.status().message().find("buffer_count"), std::string::npos) << p3.status();
  // A release from another thread lets it through.
  std::thread releaser([&] {
    std::this_thread::sleep_for(50ms);
    ASSERT_TRUE(e->ReleaseParams(*j, 0).ok());
  });
  p3 = e->AcquireParams(*j, 3, 0, 5s);
  releaser.join();
  ASSERT_TRUE(p3.ok()) << p3.status();
  EXPECT_EQ(Bf16ToFloat((*p3)[0]), 1.0f);
  for (int k : {1, 2, 3}) ASSERT_TRUE(e->ReleaseParams(*j, k).ok());
  EXPECT_EQ(e->ReleaseParams(*j, 3).code(), StatusCode::kFailedPrecondition);

  // A step publishes new params; a cached copy of the old ones is not used.
  // Unit 3 is in the cache, unleased, when the step publishes; it is
  // acquired first afterwards, so its stale slot is the one on offer.
  ASSERT_TRUE(e->AcquireParams(*j, 3, 0, 5s).ok());  // cached
  ASSERT_TRUE(e->ReleaseParams(*j, 3).ok());
  for (int k = 3; k >= 0; --k) Ring(*e, *j, k, 1, 1.0f);
  for (int k : {3, 0, 1, 2}) {
    Result<const bf16*> p = e->AcquireParams(*j, k, 1, 10s);
    ASSERT_TRUE(p.ok()) << p.status();
    std::vector<float> master(e->Layout(*j, k)->padded);
    ASSERT_TRUE(e->ReadState(*j, k, master.data(), nullptr, nullptr).ok());
    EXPECT_NE(master[0], w[k][0]);
    EXPECT_EQ((*p)[0].bits, FloatToBf16(master[0]).bits) << "unit " << k;
    ASSERT_TRUE(e->ReleaseParams(*j, k).ok());
  }
}

TEST_F(CheckpointTest, NvmeFaultsDuringAStepFailClearlyAndTheCheckpointStillLoads) {
  struct Case {
    const char* name;
    std::function<void(nvme::FaultBackend&)> arm;
    StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"write EIO", [](nvme::FaultBackend& f) { f.FailNth(nvme::IoKind::kWrite, 2, EIO); },
       StatusCode::kIoError, "write back"},
      {"full disk", [](nvme::FaultBackend& f) { f.FailFrom(nvme::IoKind::kWrite, 1, ENOSPC); },
       StatusCode::kResourceExhausted, "write back"},
      {"read EIO", [](nvme::FaultBackend& f) { f.FailNth(nvme::IoKind::kRead, 3, EIO); },
       StatusCode::kIoError, "read unit"},
      {"flipped bit", [](nvme::FaultBackend& f) { f.FlipBitOnNthRead(2); }, StatusCode::kCorruption,
       "read unit"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ScratchDir swap("swap");
    auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
    auto e = MakeEngine(uint64_t{1} << 30, &swap, uint64_t{64} << 20, fault);
    JobSpec spec = SmallModel("faulty", 1, 1.0f, 1, StepMode::kExact);
    spec.optimizer_tier = Tier::kNvme;
    Result<int> j = e->RegisterJob(spec);
    ASSERT_TRUE(j.ok()) << j.status();
    // A bystander on the same swap space (params there too), idle while
    // the faulty job steps.
    const JobSpec bystander_spec =
        Place(SmallModel("bystander", 1, 1.0f, 1, StepMode::kExact), Placement::kNvmeAll);
    Result<int> b = e->RegisterJob(bystander_spec);
    ASSERT_TRUE(b.ok()) << b.status();
    Train(*e, *b, 1, 0, 2, 33);
    const State bystander = Snapshot(*e, *b);
    Train(*e, *j, 1, 0, 2, 21);
    const State committed = Snapshot(*e, *j);
    ASSERT_TRUE(e->SaveCheckpoint(*j, dir_.string()).ok());

    c.arm(*fault);
    RingAll(*e, *j, 0.05f);
    Status s = WaitStep(*e, *j, 3);
    ASSERT_EQ(s.code(), StatusCode::kAborted) << s;
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s;
    EXPECT_NE(s.message().find("step 3"), std::string::npos) << s;
    EXPECT_NE(s.message().find(StatusCodeName(c.code)), std::string::npos) << s;
    // The failed job refuses more work, loudly.
    EXPECT_EQ(e->GradsReady(*j, 3, 0).code(), StatusCode::kAborted);
    EXPECT_EQ(e->SaveCheckpoint(*j, dir_.string()).code(), StatusCode::kAborted);
    fault->Reset();
    if (c.code != StatusCode::kCorruption && std::string_view(c.says) == "write back") {
      // What a failed write was writing reads back as lost, never as the
      // bytes that were there before.
      int lost = 0;
      for (int k = 0; k < 4; ++k) {
        std::vector<float> m(e->Layout(*j, k)->padded);
        Status r = e->ReadState(*j, k, m.data(), nullptr, nullptr);
        if (!r.ok()) {
          EXPECT_NE(r.message().find("last write failed"), std::string::npos) << r;
          ++lost;
        }
      }
      EXPECT_GT(lost, 0) << "a unit whose write failed read back without an error";
    }
    ASSERT_TRUE(e->UnregisterJob(*j).ok());
    // The bystander's state is untouched, byte for byte, and it trains on.
    EXPECT_TRUE(Same(Snapshot(*e, *b), bystander)) << "a fault of another job changed it";
    RingAll(*e, *b, 0.05f);
    EXPECT_TRUE(WaitStep(*e, *b, 3).ok());

    // Recovery: a new job on the same engine loads the last checkpoint.
    Result<int> again = e->RegisterJob(spec);
    ASSERT_TRUE(again.ok()) << again.status();
    Status loaded = e->LoadCheckpoint(*again, dir_.string());
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_TRUE(Same(Snapshot(*e, *again), committed));
    RingAll(*e, *again, 0.05f);
    EXPECT_TRUE(WaitStep(*e, *again, 3).ok());
  }
}

}  // namespace
}  // namespace ztier::engine
