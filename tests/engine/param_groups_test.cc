// Tests of optimizer param groups, frozen tensors and learning rates set per
// step (Engine::SetLearningRates):
//  - bit for bit against cpu_adam::Step called on each run of adjacent
//    tensors of one group, from the same state: two groups of different
//    weight decay and frozen tensors, in units of several tensors whose
//    boundaries fall inside the two ranks' shards, with accumulation 1 and
//    2, clipping on and off, exact and eager modes, states and params in
//    DRAM or on NVMe; the learning rates changed between steps;
//  - a frozen tensor's master, m and v stay as they were and its params are
//    its master rounded to bf16, whatever grads it gets (they count in the
//    norm only);
//  - a job without groups takes a new learning rate at its next step;
//  - refusals: a learning rate count or value, an unknown job, a group out
//    of range, a group's weight decay;
//  - a checkpoint of a job with groups loads into one without;
//  - a unit whose tensors are all frozen keeps no m and v in DRAM (they read
//    as zeros; what a checkpoint or WriteState brings for them is dropped).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tests/engine/engine_testing.h"
#include "tests/testing/scratch_dir.h"

namespace ztier::engine {
namespace {

using namespace std::chrono_literals;
using namespace testing;

TensorSpec Tensor(std::string name, std::vector<int64_t> shape, uint32_t group,
                  bool frozen = false) {
  return TensorSpec{
      .name = std::move(name), .shape = std::move(shape), .group = group, .frozen = frozen};
}

// Two ranks; group 0 decays (0.1), group 1 does not (biases and norms); a
// frozen tensor between trained ones, a frozen unit, and a unit of one
// group (one run). Tensor boundaries fall inside shards: "embed" (1224 of
// 1280 elements, shards of 640) has wte/wpe at 888; "block" (2008 of 2048,
// shards of 1024) has w2 across 1024.
JobSpec GroupedModel(const std::string& name, float clip, int accum, StepMode mode) {
  JobSpec j;
  j.name = name;
  j.ranks = 2;
  // hyper.weight_decay is unused once the groups have theirs.
  j.optimizer.hyper = {.lr = 1e-2f, .weight_decay = 0.5f};
  j.optimizer.clip_norm = clip;
  j.optimizer.grad_accumulation = accum;
  j.optimizer.mode = mode;
  j.optimizer.group_weight_decay = {0.1f, 0.0f};
  j.units.push_back(
      {"embed",
       {Tensor("wte", {37, 24}, 0), Tensor("wpe", {13, 24}, 0, true), Tensor("ln", {24}, 1)}});
  j.units.push_back({"block",
                     {Tensor("w1", {24, 40}, 0), Tensor("b1", {40}, 1), Tensor("w2", {40, 24}, 0),
                      Tensor("b2", {24}, 1), Tensor("ln", {24}, 1, true)}});
  j.units.push_back({"frozen", {Tensor("w", {30, 10}, 0, true)}});
  j.units.push_back({"head", {Tensor("w", {24, 50}, 0), Tensor("b", {50}, 0)}});
  return j;
}

// Adjacent tensors of one (group, frozen): [begin, end) of the padded
// buffer, the last run taking the padding.
struct Run {
  uint64_t begin = 0, end = 0;
  uint32_t group = 0;
  bool frozen = false;
};

std::vector<Run> RunsOf(const UnitSpec& us, const UnitLayout& l) {
  std::vector<Run> runs;
  for (size_t t = 0; t < us.tensors.size(); ++t) {
    const TensorSpec& ts = us.tensors[t];
    if (!runs.empty() && runs.back().group == ts.group && runs.back().frozen == ts.frozen) {
      continue;
    }
    if (!runs.empty()) runs.back().end = l.offsets[t];
    runs.push_back({.begin = l.offsets[t], .group = ts.group, .frozen = ts.frozen});
  }
  runs.back().end = l.padded;
  return runs;
}

// Every tensor of unit k frozen, states in DRAM: the engine keeps no m, v.
bool Stateless(const JobSpec& spec, int k) {
  if (spec.optimizer_tier != Tier::kDram) return false;
  for (const TensorSpec& t : spec.units[k].tensors) {
    if (!t.frozen) return false;
  }
  return true;
}

struct RefUnit {
  UnitLayout layout;
  std::vector<Run> runs;
  std::vector<float> p, m, v, acc;
  std::vector<bf16> out;
  std::vector<float> p0, m0, v0;  // as set before the first step
};

// Sets every unit's master, m and v (v >= 0, all nonzero, so that a frozen
// tensor's staying put is seen) and commits them as step 0.
std::vector<RefUnit> InitialState(Engine& e, int job, const JobSpec& spec, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<RefUnit> units;
  for (int k = 0; k < static_cast<int>(spec.units.size()); ++k) {
    RefUnit u;
    u.layout = *e.Layout(job, k);
    u.runs = RunsOf(spec.units[k], u.layout);
    const uint64_t n = u.layout.padded;
    u.p.assign(n, 0.0f);
    u.m.assign(n, 0.0f);
    u.v.assign(n, 0.0f);
    for (uint64_t i = 0; i < u.layout.numel; ++i) {
      u.p[i] = 0.1f * normal(rng);
      u.m[i] = 0.01f * normal(rng);
      u.v[i] = 1e-4f * std::fabs(normal(rng));
    }
    u.acc.assign(n, 0.0f);
    u.out.assign(n, bf16{0});
    EXPECT_TRUE(e.WriteState(job, k, u.p.data(), u.m.data(), u.v.data()).ok());
    if (Stateless(spec, k)) {  // the engine keeps no m and v for it: they read as zeros
      u.m.assign(n, 0.0f);
      u.v.assign(n, 0.0f);
    }
    u.p0 = u.p;
    u.m0 = u.m;
    u.v0 = u.v;
    units.push_back(std::move(u));
  }
  EXPECT_TRUE(e.CommitState(job, 0, 0).ok());
  return units;
}

// Steps `spec` (registered as `job`) `lrs.size()` times through the engine
// and through the reference (cpu_adam::Step per run, with the group's
// learning rate and weight decay), comparing every byte of master, m, v and
// the published params after each step. lrs[s], when not empty, is set for
// step s + 1 just before its last grads (exact mode) or before its first
// (eager mode, where each unit's update takes them as it starts).
void StepAgainstReference(Engine& e, int job, const JobSpec& spec,
                          const std::vector<std::vector<float>>& lrs, uint64_t seed) {
  SCOPED_TRACE(StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Result<cpu_adam::Executor> exec = cpu_adam::Executor::Create({.threads = 2});
  ASSERT_TRUE(exec.ok());
  const OptimizerConfig& o = spec.optimizer;
  const int ranks = spec.ranks;
  const int accum = o.grad_accumulation;
  const int nunits = static_cast<int>(spec.units.size());
  std::vector<RefUnit> ref = InitialState(e, job, spec, rng);
  std::vector<float> now_lrs(o.group_weight_decay.empty() ? 1 : o.group_weight_decay.size(),
                             o.hyper.lr);
  for (int step = 1; step <= static_cast<int>(lrs.size()); ++step) {
    const std::vector<float>& set = lrs[step - 1];
    if (!set.empty()) now_lrs = set;
    // Every micro-step's grads, nonzero for frozen tensors too (ignored
    // there, but counted in the norm); the last step's "block" grads have
    // an outlier so that clipping bites.
    std::vector<std::vector<std::vector<bf16>>> grads(accum);  // [micro][unit][padded]
    for (int a = 0; a < accum; ++a) {
      for (int k = 0; k < nunits; ++k) {
        std::vector<bf16> g(ref[k].layout.padded, bf16{0});
        const float big = step == static_cast<int>(lrs.size()) && k == 1 ? 50.0f : 1.0f;
        for (uint64_t i = 0; i < ref[k].layout.numel; ++i) g[i] = FloatToBf16(big * normal(rng));
        grads[a].push_back(std::move(g));
      }
    }
    // Backward order; the last delivery is micro accum - 1, unit 0, rank 1.
    const bool eager = o.mode == StepMode::kEager;
    if (!set.empty() && eager) {
      ASSERT_TRUE(e.SetLearningRates(job, set).ok());
    }
    for (int a = 0; a < accum; ++a) {
      for (int k = nunits - 1; k >= 0; --k) {
        ASSERT_TRUE(e.WaitPublished(job, k, step - 1, 30s).ok());
        const uint64_t shard = ref[k].layout.shard;
        for (int r = 0; r < ranks; ++r) {
          if (!set.empty() && !eager && a == accum - 1 && k == 0 && r == ranks - 1) {
            ASSERT_TRUE(e.SetLearningRates(job, set).ok());
          }
          std::memcpy(*e.GradInbox(job, k, r), grads[a][k].data() + r * shard,
                      shard * sizeof(bf16));
          Status s = e.GradsReady(job, k, r);
          ASSERT_TRUE(s.ok()) << s;
        }
      }
    }
    // The reference: accumulate, a norm per (unit, rank) summed in unit then
    // rank order, clip, then each run of each unit.
    double total = 0.0;
    for (int k = 0; k < nunits; ++k) {
      RefUnit& u = ref[k];
      const uint64_t shard = u.layout.shard;
      for (int r = 0; r < ranks; ++r) {
        double sq;
        if (accum > 1) {
          for (uint64_t i = r * shard; i < (r + 1) * shard; ++i) {
            u.acc[i] = Bf16ToFloat(grads[0][k][i]);
            for (int a = 1; a < accum; ++a) u.acc[i] += Bf16ToFloat(grads[a][k][i]);
          }
          sq = *cpu_adam::SquaredNorm(u.acc.data() + r * shard, cpu_adam::GradType::kFloat32, shard,
                                      *exec);
        } else {
          sq = *cpu_adam::SquaredNorm(grads[0][k].data() + r * shard, cpu_adam::GradType::kBFloat16,
                                      shard, *exec);
        }
        total += sq;
      }
    }
    const double norm = std::sqrt(total);
    const float clip = o.clip_norm;
    const float scale = cpu_adam::ClipScale(norm, clip);
    for (int k = 0; k < nunits; ++k) {
      RefUnit& u = ref[k];
      for (const Run& run : u.runs) {
        if (run.frozen) {
          for (uint64_t i = run.begin; i < run.end; ++i) u.out[i] = FloatToBf16(u.p[i]);
          continue;
        }
        cpu_adam::Hyper h = o.hyper;
        h.lr = now_lrs[run.group];
        if (!o.group_weight_decay.empty()) h.weight_decay = o.group_weight_decay[run.group];
        const cpu_adam::Shard shard{
            .count = run.end - run.begin,
            .grads = accum > 1 ? static_cast<const void*>(u.acc.data() + run.begin)
                               : static_cast<const void*>(grads[0][k].data() + run.begin),
            .grad_type = accum > 1 ? cpu_adam::GradType::kFloat32 : cpu_adam::GradType::kBFloat16,
            .params = u.p.data() + run.begin,
            .exp_avg = u.m.data() + run.begin,
            .exp_avg_sq = u.v.data() + run.begin,
            .params_out = u.out.data() + run.begin};
        ASSERT_TRUE(
            cpu_adam::Step(
                h,
                {.step = step, .grad_scale = scale, .grad_check = cpu_adam::GradCheck::kPrechecked},
                shard, *exec)
                .ok());
      }
    }
    // The engine's step, byte for byte; frozen runs as they were.
    for (int k = 0; k < nunits; ++k) {
      ASSERT_TRUE(e.WaitPublished(job, k, step, 30s).ok());
      const RefUnit& u = ref[k];
      const uint64_t n = u.layout.padded;
      std::vector<float> p(n), m(n), v(n);
      ASSERT_TRUE(e.ReadState(job, k, p.data(), m.data(), v.data()).ok());
      const std::vector<bf16> out = PublishedCopy(e, job, k, n);
      const std::string where = StrCat("unit ", k, " step ", step);
      ASSERT_EQ(std::memcmp(p.data(), u.p.data(), n * 4), 0) << "master, " << where;
      ASSERT_EQ(std::memcmp(m.data(), u.m.data(), n * 4), 0) << "exp_avg, " << where;
      ASSERT_EQ(std::memcmp(v.data(), u.v.data(), n * 4), 0) << "exp_avg_sq, " << where;
      ASSERT_EQ(std::memcmp(out.data(), u.out.data(), n * 2), 0) << "published, " << where;
      bool trained = false;
      for (const Run& run : u.runs) {
        const size_t bytes = (run.end - run.begin) * 4;
        if (!run.frozen) {
          trained =
              trained || std::memcmp(p.data() + run.begin, u.p0.data() + run.begin, bytes) != 0;
          continue;
        }
        EXPECT_EQ(std::memcmp(p.data() + run.begin, u.p0.data() + run.begin, bytes), 0)
            << "a frozen master moved, " << where;
        EXPECT_EQ(std::memcmp(m.data() + run.begin, u.m0.data() + run.begin, bytes), 0)
            << "a frozen exp_avg moved, " << where;
        EXPECT_EQ(std::memcmp(v.data() + run.begin, u.v0.data() + run.begin, bytes), 0)
            << "a frozen exp_avg_sq moved, " << where;
        for (uint64_t i = run.begin; i < run.end; ++i) {
          ASSERT_EQ(out[i].bits, FloatToBf16(u.p0[i]).bits) << "frozen params, " << where;
        }
      }
      const bool has_trained_run = [&] {
        for (const Run& run : u.runs) {
          if (!run.frozen) return true;
        }
        return false;
      }();
      EXPECT_EQ(trained, has_trained_run) << where;
    }
  }
}

// Where a job's optimizer states and params live.
enum class Placement { kDram, kNvmeAll };

class ParamGroupsTest
    : public ::testing::TestWithParam<std::tuple<int, float, StepMode, Placement>> {};

TEST_P(ParamGroupsTest, BitForBitWithCpuAdamPerRunOfTensors) {
  const auto [accum, clip, mode, placement] = GetParam();
  ScratchDir swap("swap");
  auto engine = MakeEngine(uint64_t{1} << 30, placement == Placement::kDram ? nullptr : &swap);
  JobSpec spec = GroupedModel("groups", clip, accum, mode);
  if (placement == Placement::kNvmeAll) spec.optimizer_tier = spec.param_tier = Tier::kNvme;
  Result<int> job = engine->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  // Step 1 at hyper.lr, then a scheduler's rates, kept for step 3; at step
  // 4 group 0's rate is 0 (its masters stay, its m and v move).
  const std::vector<std::vector<float>> lrs = {{}, {3e-2f, 5e-3f}, {}, {0.0f, 2e-2f}};
  StepAgainstReference(*engine, *job, spec, lrs, std::random_device{}());
  EXPECT_EQ(engine->counters(*job).steps, static_cast<int64_t>(lrs.size()));
}

std::vector<ParamGroupsTest::ParamType> GroupCases() {
  std::vector<ParamGroupsTest::ParamType> out;
  for (int accum : {1, 2}) {
    for (Placement p : {Placement::kDram, Placement::kNvmeAll}) {
      out.emplace_back(accum, 0.0f, StepMode::kExact, p);
      out.emplace_back(accum, 1.0f, StepMode::kExact, p);
      out.emplace_back(accum, 0.0f, StepMode::kEager, p);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Modes, ParamGroupsTest, ::testing::ValuesIn(GroupCases()),
                         [](const ::testing::TestParamInfo<ParamGroupsTest::ParamType>& p) {
                           return StrCat(
                               "acc", std::get<0>(p.param),
                               std::get<1>(p.param) > 0 ? "_clip" : "_noclip",
                               std::get<2>(p.param) == StepMode::kExact ? "_exact" : "_eager",
                               std::get<3>(p.param) == Placement::kDram ? "_dram" : "_nvme_all");
                         });

// A job without groups is one AdamW pass a unit, as it always was; a new
// learning rate reaches its next step, and the one after keeps it.
TEST(LearningRatesTest, AJobWithoutGroupsTakesTheNewRateAtItsNextStep) {
  for (int accum : {1, 2}) {
    SCOPED_TRACE(StrCat("accumulation ", accum));
    auto engine = MakeEngine();
    const JobSpec spec = SmallModel("plain", 2, 1.0f, accum, StepMode::kExact);
    Result<int> job = engine->RegisterJob(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_NO_FATAL_FAILURE(
        StepAgainstReference(*engine, *job, spec, {{}, {5e-2f}, {}, {1e-3f}}, 11 + accum));
  }
}

TEST(LearningRatesTest, RefusalsNameTheCountTheGroupAndTheJob) {
  auto engine = MakeEngine();
  Result<int> grouped = engine->RegisterJob(GroupedModel("grouped", 0.0f, 1, StepMode::kExact));
  Result<int> plain = engine->RegisterJob(SmallModel("plain", 1, 0.0f, 1, StepMode::kExact));
  ASSERT_TRUE(grouped.ok() && plain.ok()) << grouped.status() << plain.status();
  EXPECT_TRUE(engine->SetLearningRates(*grouped, {1e-3f, 0.0f}).ok());
  EXPECT_TRUE(engine->SetLearningRates(*plain, {1e-3f}).ok());
  auto refused = [&](int job, const std::vector<float>& lrs, StatusCode code,
                     const std::vector<std::string>& says) {
    Status s = engine->SetLearningRates(job, lrs);
    EXPECT_EQ(s.code(), code) << s;
    for (const std::string& w : says) EXPECT_NE(s.ToString().find(w), std::string::npos) << s;
  };
  refused(*grouped, {1e-3f}, StatusCode::kInvalidArgument, {"1 learning rates", "2 param groups"});
  refused(*grouped, {}, StatusCode::kInvalidArgument, {"0 learning rates"});
  refused(*plain, {1e-3f, 1e-3f}, StatusCode::kInvalidArgument, {"2 learning rates", "1 param"});
  refused(*grouped, {1e-3f, -1e-3f}, StatusCode::kInvalidArgument,
          {"'grouped'", "param group 1", "finite and >= 0"});
  refused(*grouped, {std::numeric_limits<float>::quiet_NaN(), 1e-3f}, StatusCode::kInvalidArgument,
          {"param group 0", "nan"});
  refused(*plain, {std::numeric_limits<float>::infinity()}, StatusCode::kInvalidArgument,
          {"param group 0", "inf"});
  refused(12345, {1e-3f}, StatusCode::kNotFound, {"12345"});
}

TEST(ParamGroupsJobTest, RegisterRefusesAGroupOutOfRangeAndABadWeightDecay) {
  auto engine = MakeEngine();
  auto refused = [&](const JobSpec& spec, const std::vector<std::string>& says) {
    Result<int> r = engine->RegisterJob(spec);
    ASSERT_FALSE(r.ok()) << spec.name;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    for (const std::string& w : says) {
      EXPECT_NE(r.status().ToString().find(w), std::string::npos) << r.status();
    }
  };
  JobSpec j = GroupedModel("g", 0.0f, 1, StepMode::kExact);
  j.units[1].tensors[3].group = 2;
  refused(j, {"job 'g'", "unit 'block'", "tensor 'b2'", "param group 2", "has 2"});
  j = SmallModel("plain", 1, 0.0f, 1, StepMode::kExact);
  j.units[2].tensors[1].group = 1;  // no group_weight_decay: group 0 only
  refused(j, {"job 'plain'", "unit 'block1'", "tensor 'block1.b1'", "param group 1"});
  j = GroupedModel("g", 0.0f, 1, StepMode::kExact);
  j.optimizer.group_weight_decay[1] = -0.1f;
  refused(j, {"job 'g'", "param group 1", "weight decay"});
  j.optimizer.group_weight_decay[1] = std::numeric_limits<float>::quiet_NaN();
  refused(j, {"job 'g'", "param group 1", "weight decay"});
  // Frozen tensors alone, without groups, are fine; so is every tensor
  // frozen.
  j = SmallModel("frozen", 1, 0.0f, 1, StepMode::kExact);
  for (UnitSpec& u : j.units) {
    for (TensorSpec& t : u.tensors) t.frozen = true;
  }
  EXPECT_TRUE(engine->RegisterJob(j).ok());
}

// Which group a tensor is in and whether it is frozen is no part of the
// layout: a checkpoint of a job with groups loads into one without.
TEST(ParamGroupsJobTest, ACheckpointLoadsIntoAJobWithOtherGroups) {
  ScratchDir dir("ckpt");
  auto engine = MakeEngine();
  const JobSpec grouped = GroupedModel("grouped", 1.0f, 1, StepMode::kExact);
  Result<int> a = engine->RegisterJob(grouped);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_NO_FATAL_FAILURE(StepAgainstReference(*engine, *a, grouped, {{}, {2e-2f, 1e-3f}}, 5));
  ASSERT_TRUE(engine->SaveCheckpoint(*a, dir.path()).ok());
  JobSpec plain = grouped;
  plain.name = "plain";
  plain.optimizer.group_weight_decay.clear();
  for (UnitSpec& u : plain.units) {
    for (TensorSpec& t : u.tensors) t = TensorSpec{.name = t.name, .shape = t.shape};
  }
  Result<int> b = engine->RegisterJob(plain);
  ASSERT_TRUE(b.ok()) << b.status();
  Status loaded = engine->LoadCheckpoint(*b, dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded;
  for (int k = 0; k < static_cast<int>(grouped.units.size()); ++k) {
    const uint64_t n = engine->Layout(*a, k)->padded;
    std::vector<float> pa(n), ma(n), va(n), pb(n), mb(n), vb(n);
    ASSERT_TRUE(engine->ReadState(*a, k, pa.data(), ma.data(), va.data()).ok());
    ASSERT_TRUE(engine->ReadState(*b, k, pb.data(), mb.data(), vb.data()).ok());
    EXPECT_EQ(pa, pb) << "unit " << k;
    EXPECT_EQ(ma, mb) << "unit " << k;
    EXPECT_EQ(va, vb) << "unit " << k;
  }
  EXPECT_EQ(engine->PublishedStep(*b, 0), 2);
}

// A unit of frozen tensors only keeps its master and no m and v: the job
// holds 8 bytes a param less for it, reads them as zeros, and a checkpoint
// round trip through it (and WriteState with nonzero moments) works.
TEST(ParamGroupsJobTest, AFrozenUnitKeepsNoMoments) {
  auto engine = MakeEngine();
  const JobSpec frozen = GroupedModel("frozen", 0.0f, 1, StepMode::kExact);
  JobSpec trained = frozen;
  trained.name = "trained";
  for (TensorSpec& t : trained.units[2].tensors) t.frozen = false;
  Result<int> a = engine->RegisterJob(frozen);
  Result<int> b = engine->RegisterJob(trained);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const uint64_t n = engine->Layout(*a, 2)->padded;
  EXPECT_GE(engine->counters(*b).dram_bytes - engine->counters(*a).dram_bytes, 2 * n * 4);
  std::vector<float> p(n, 0.5f), m(n, 0.25f), v(n, 0.125f);
  ASSERT_TRUE(engine->WriteState(*a, 2, p.data(), m.data(), v.data()).ok());
  std::vector<float> rp(n), rm(n, 1.0f), rv(n, 1.0f);
  ASSERT_TRUE(engine->ReadState(*a, 2, rp.data(), rm.data(), rv.data()).ok());
  EXPECT_EQ(rp, p);
  EXPECT_EQ(rm, std::vector<float>(n, 0.0f));
  EXPECT_EQ(rv, std::vector<float>(n, 0.0f));
  ASSERT_NO_FATAL_FAILURE(StepAgainstReference(*engine, *a, frozen, {{}, {}}, 9));
  ScratchDir dir("ckpt");
  ASSERT_TRUE(engine->SaveCheckpoint(*a, dir.path()).ok());
  Status loaded = engine->LoadCheckpoint(*a, dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded;
  // Into the job that trains that unit: its m and v are the zeros saved.
  loaded = engine->LoadCheckpoint(*b, dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded;
  ASSERT_TRUE(engine->ReadState(*b, 2, rp.data(), rm.data(), rv.data()).ok());
  EXPECT_EQ(rm, std::vector<float>(n, 0.0f));
  std::vector<float> ap(n);
  ASSERT_TRUE(engine->ReadState(*a, 2, ap.data(), nullptr, nullptr).ok());
  EXPECT_EQ(rp, ap);
}

}  // namespace
// 8-bit states: a frozen tensor between trained ones, all off the block
// grid, keeps its m and v to the bit while its neighbours train with grads
// 100 times its moments (its quantization groups are its own: sharing
// blocks with them, its moments were quantized again under their growing
// absmax every step, and drifted).
TEST(ParamGroupsJobTest, AFrozenTensorsEightBitMomentsStayPut) {
  auto engine =
      MakeEngine(uint64_t{1} << 30, nullptr, uint64_t{64} << 20, nullptr, StateDtype::kInt8);
  JobSpec spec;
  spec.name = "frozen8";
  spec.ranks = 1;
  spec.optimizer.hyper = {.lr = 1e-2f};
  spec.units.push_back({"u",
                        {{.name = "a", .shape = {300}},
                         {.name = "frozen", .shape = {200}, .frozen = true},
                         {.name = "b", .shape = {333}}}});
  Result<int> job = engine->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const UnitLayout l = *engine->Layout(*job, 0);
  const uint64_t n = l.padded, lo = l.offsets[1], hi = l.offsets[2];
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
  for (uint64_t i = 0; i < l.numel; ++i) {
    p[i] = normal(rng);
    m[i] = 1e-3f * normal(rng);
    v[i] = 1e-6f * std::fabs(normal(rng));
  }
  ASSERT_TRUE(engine->WriteState(*job, 0, p.data(), m.data(), v.data()).ok());
  ASSERT_TRUE(engine->CommitState(*job, 0, 0).ok());
  std::vector<float> m0(n), v0(n);
  ASSERT_TRUE(engine->ReadState(*job, 0, nullptr, m0.data(), v0.data()).ok());
  for (int step = 1; step <= 20; ++step) {
    std::vector<bf16> g(n, bf16{0});
    for (uint64_t i = 0; i < l.numel; ++i) g[i] = FloatToBf16(0.1f * step * normal(rng));
    std::memcpy(*engine->GradInbox(*job, 0, 0), g.data(), n * sizeof(bf16));
    ASSERT_TRUE(engine->GradsReady(*job, 0, 0).ok());
    ASSERT_TRUE(engine->WaitPublished(*job, 0, step, 30s).ok());
  }
  std::vector<float> m1(n), v1(n);
  ASSERT_TRUE(engine->ReadState(*job, 0, nullptr, m1.data(), v1.data()).ok());
  for (uint64_t i = lo; i < hi; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(m1[i]), std::bit_cast<uint32_t>(m0[i])) << "m, element " << i;
    ASSERT_EQ(std::bit_cast<uint32_t>(v1[i]), std::bit_cast<uint32_t>(v0[i])) << "v, element " << i;
  }
  EXPECT_NE(m1[0], m0[0]);  // the neighbours trained
  EXPECT_NE(m1[hi], m0[hi]);
}

}  // namespace ztier::engine
