// Test support for the engine's tests: an engine on a scratch swap space,
// a small model, deterministic training, and snapshots of a job's state.
#ifndef ZTIER_TESTS_ENGINE_ENGINE_TESTING_H_
#define ZTIER_TESTS_ENGINE_ENGINE_TESTING_H_

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "nvme/io_backend.h"
#include "tests/testing/scratch_dir.h"

namespace ztier::engine::testing {

using namespace std::chrono_literals;
using ztier::testing::ScratchDir;

// With `swap`: two swap paths under it, 4 KiB stripes so every unit of the
// small model spans several stripes on both paths (its largest state object
// is 28 KiB, its params 8 KiB), and a 3-slot ring (the smallest) so the
// pipeline wraps around.
inline std::unique_ptr<Engine> MakeEngine(uint64_t budget = uint64_t{1} << 30,
                                          const ScratchDir* swap = nullptr,
                                          uint64_t swap_capacity = uint64_t{64} << 20,
                                          std::shared_ptr<nvme::IoBackend> backend = nullptr,
                                          StateDtype state_dtype = StateDtype::kFp32) {
  Settings s;
  s.state_dtype = state_dtype;
  s.dram_budget_bytes = budget;
  s.optimizer_threads = 2;
  s.pin_memory = false;
  if (swap != nullptr) {
    s.nvme_paths = {swap->sub("drive0"), swap->sub("drive1")};
    s.nvme_capacity_per_path = swap_capacity;
    s.stripe_bytes = 4096;  // every unit's state spans several stripes, on both paths
    s.buffer_count = 3;
  }
  Result<std::unique_ptr<Engine>> e = Engine::Create(s, std::move(backend));
  ZT_CHECK_MSG(e.ok(), e.status().ToString());
  return std::move(e).value();
}

inline JobSpec SmallModel(const std::string& name, int ranks, float clip, int accum,
                          StepMode mode) {
  JobSpec j;
  j.name = name;
  j.ranks = ranks;
  j.optimizer.hyper = {.lr = 1e-2f, .weight_decay = 0.01f};
  j.optimizer.clip_norm = clip;
  j.optimizer.grad_accumulation = accum;
  j.optimizer.mode = mode;
  j.units.push_back({"embed", {{"wte", {97, 24}}}});
  for (int b = 0; b < 2; ++b) {
    const std::string p = "block" + std::to_string(b);
    j.units.push_back(
        {p, {{p + ".w1", {24, 40}}, {p + ".b1", {40}}, {p + ".w2", {40, 24}}, {p + ".ln", {24}}}});
  }
  j.units.push_back({"head", {{"w", {24, 97}}}});
  return j;
}

// A copy of the unit's published params, through AcquireParams (either tier).
inline std::vector<bf16> PublishedCopy(Engine& e, int job, int unit, size_t n) {
  Result<const bf16*> p = e.AcquireParams(job, unit, e.PublishedStep(job, unit), 30s);
  ZT_CHECK_MSG(p.ok(), p.status().ToString());
  std::vector<bf16> out(*p, *p + n);
  ZT_CHECK(e.ReleaseParams(job, unit).ok());
  return out;
}

// Rings unit k's grads (all ranks) with the given value everywhere.
inline void Ring(Engine& e, int job, int k, int ranks, float value) {
  for (int r = 0; r < ranks; ++r) {
    const UnitLayout l = *e.Layout(job, k);
    bf16* g = *e.GradInbox(job, k, r);
    for (uint64_t i = 0; i < l.shard; ++i) g[i] = FloatToBf16(value);
    ASSERT_TRUE(e.GradsReady(job, k, r).ok());
  }
}

// Trains `steps` steps of the small model with deterministic grads.
inline void Train(Engine& e, int job, int ranks, int from_step, int steps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  if (from_step == 0) {  // initial weights, published as step 0
    for (int k = 0; k < 4; ++k) {
      const UnitLayout l = *e.Layout(job, k);
      std::vector<float> w(l.numel);
      for (float& x : w) x = 0.1f * normal(rng);
      ASSERT_TRUE(e.WriteWeights(job, k, w.data(), w.size()).ok());
    }
  }
  for (int step = from_step + 1; step <= from_step + steps; ++step) {
    for (int k = 3; k >= 0; --k) {
      ASSERT_TRUE(e.WaitPublished(job, k, step - 1, 30s).ok());
      const UnitLayout l = *e.Layout(job, k);
      std::vector<bf16> g(l.padded, bf16{0});
      for (uint64_t i = 0; i < l.numel; ++i) g[i] = FloatToBf16(normal(rng));
      for (int r = 0; r < ranks; ++r) {
        std::memcpy(*e.GradInbox(job, k, r), g.data() + r * l.shard, l.shard * sizeof(bf16));
        ASSERT_TRUE(e.GradsReady(job, k, r).ok());
      }
    }
    for (int k = 0; k < 4; ++k) {
      const Status s = e.WaitPublished(job, k, step, 30s);
      ASSERT_TRUE(s.ok()) << s;
    }
  }
}

struct State {
  std::vector<std::vector<float>> p, m, v;
  std::vector<std::vector<bf16>> out;
};

inline State Snapshot(Engine& e, int job) {
  State s;
  for (int k = 0; k < 4; ++k) {
    const UnitLayout l = *e.Layout(job, k);
    std::vector<float> p(l.padded), m(l.padded), v(l.padded);
    const Status read = e.ReadState(job, k, p.data(), m.data(), v.data());
    EXPECT_TRUE(read.ok()) << read;
    // Only the first numel elements carry state; padding depends on R.
    p.resize(l.numel);
    m.resize(l.numel);
    v.resize(l.numel);
    s.p.push_back(p);
    s.m.push_back(m);
    s.v.push_back(v);
    s.out.push_back(PublishedCopy(e, job, k, l.numel));
  }
  return s;
}

inline bool Same(const State& a, const State& b) {
  for (size_t k = 0; k < a.p.size(); ++k) {
    if (std::memcmp(a.p[k].data(), b.p[k].data(), a.p[k].size() * 4) != 0 ||
        std::memcmp(a.m[k].data(), b.m[k].data(), a.m[k].size() * 4) != 0 ||
        std::memcmp(a.v[k].data(), b.v[k].data(), a.v[k].size() * 4) != 0 ||
        std::memcmp(a.out[k].data(), b.out[k].data(), a.out[k].size() * 2) != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace ztier::engine::testing

#endif  // ZTIER_TESTS_ENGINE_ENGINE_TESTING_H_
