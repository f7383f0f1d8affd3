// Test support: plain in-memory training of the GPT example, the reference
// the stage-3 runner is checked against. Every unit's fp32 master, moments
// and bf16 weights sit in ordinary memory; each rank's grads are captured
// as the model pushes them, reduced over ranks (fp32 sum in rank order,
// one rounding to bf16, as the local collectives), accumulated in fp32 (as
// the engine does), clipped by the global norm (per-shard squared norms
// summed unit by unit, rank by rank, as the engine does) and stepped by the
// same cpu_adam kernel (StepInt8 for 8-bit states). Ranks run one after
// the other on the caller's thread.
#ifndef ZTIER_TESTS_CLIENT_MEMORY_TRAINER_H_
#define ZTIER_TESTS_CLIENT_MEMORY_TRAINER_H_

#include <cmath>
#include <memory>
#include <vector>

#include "client/ztier.h"
#include "cpu_adam/adamw.h"
#include "examples/gpt/gpt.h"
#include "tests/testing/cpu_adam_testing.h"

namespace ztier::testing {

class MemoryTrainer {
 public:
  // Errors: as gpt::Gpt::Create and cpu_adam::Executor::Create.
  static Result<std::unique_ptr<MemoryTrainer>> Create(
      const gpt::Config& config, const std::vector<engine::UnitLayout>& layouts,
      const engine::OptimizerConfig& optimizer, int ranks, int batch,
      const std::vector<std::vector<float>>& initial /* per unit, numel */,
      engine::StateDtype state_dtype = engine::StateDtype::kFp32) {
    auto t = std::unique_ptr<MemoryTrainer>(new MemoryTrainer());
    t->optimizer_ = optimizer;
    t->int8_ = state_dtype == engine::StateDtype::kInt8;
    t->ranks_ = ranks;
    ZT_ASSIGN_OR_RETURN(t->device_, client::MakeHostDevice());
    ZT_ASSIGN_OR_RETURN(cpu_adam::Executor exec, cpu_adam::Executor::Create({.threads = 2}));
    t->exec_ = std::make_unique<cpu_adam::Executor>(std::move(exec));
    for (size_t k = 0; k < layouts.size(); ++k) {
      Unit u;
      u.layout = layouts[k];
      const uint64_t n = u.layout.padded;
      u.p.assign(n, 0.0f);
      u.m.assign(n, 0.0f);
      u.v.assign(n, 0.0f);
      u.q = adam_testing::Int8Moments(n, u.layout.offsets);
      u.acc.assign(n, 0.0f);
      u.grads.assign(n, bf16{0});
      u.out.assign(n, bf16{0});
      std::copy(initial[k].begin(), initial[k].end(), u.p.begin());
      for (uint64_t i = 0; i < n; ++i) u.out[i] = FloatToBf16(u.p[i]);
      t->units_.push_back(std::move(u));
    }
    for (int r = 0; r < ranks; ++r) {
      ZT_ASSIGN_OR_RETURN(std::unique_ptr<gpt::Gpt> model,
                          gpt::Gpt::Create(config, batch, *t->device_, layouts));
      t->models_.push_back(std::move(model));
      t->sources_.push_back(std::make_unique<Source>(*t));
    }
    return t;
  }

  // One micro-step of every rank (rank r reads tokens[r]); the losses.
  Result<std::vector<float>> MicroStep(const std::vector<const int32_t*>& tokens) {
    const float scale = 1.0f / static_cast<float>(ranks_ * optimizer_.grad_accumulation);
    std::vector<float> losses;
    std::vector<std::vector<std::vector<bf16>>> pushed(ranks_);  // [rank][unit]
    for (int r = 0; r < ranks_; ++r) {
      ZT_ASSIGN_OR_RETURN(float loss, models_[r]->TrainMicroStep(*sources_[r], tokens[r], scale));
      losses.push_back(loss);
      pushed[r] = std::move(sources_[r]->pushed);
      sources_[r]->pushed.assign(units_.size(), {});
    }
    for (size_t k = 0; k < units_.size(); ++k) {
      Unit& u = units_[k];
      for (uint64_t i = 0; i < u.layout.padded; ++i) {
        bf16 g = pushed[0][k][i];
        if (ranks_ > 1) {
          float sum = 0.0f;
          for (int r = 0; r < ranks_; ++r) sum += Bf16ToFloat(pushed[r][k][i]);
          g = FloatToBf16(sum);
        }
        u.grads[i] = g;
        if (micro_ == 0) {
          u.acc[i] = Bf16ToFloat(g);
        } else {
          u.acc[i] += Bf16ToFloat(g);
        }
      }
    }
    if (++micro_ == optimizer_.grad_accumulation) {
      micro_ = 0;
      ZT_RETURN_IF_ERROR(OptimizerStep());
    }
    return losses;
  }

  const std::vector<float>& master(int unit) const { return units_[unit].p; }
  int64_t steps() const { return adam_step_; }

 private:
  struct Unit {
    engine::UnitLayout layout;
    std::vector<float> p, m, v, acc;
    adam_testing::Int8Moments q;  // 8-bit states
    std::vector<bf16> grads, out;
  };

  // A rank's view: every rank reads the same weights; grads are captured.
  class Source final : public gpt::WeightSource {
   public:
    explicit Source(MemoryTrainer& t) : t_(t), buffers(t.units_.size()), pushed(t.units_.size()) {}
    Result<const bf16*> Acquire(int unit) override { return t_.units_[unit].out.data(); }
    Status Release(int) override { return Status::Ok(); }
    Result<bf16*> GradBuffer(int unit) override {
      if (buffers[unit].empty()) buffers[unit].assign(t_.units_[unit].layout.padded, bf16{0});
      return buffers[unit].data();
    }
    Status PushGrads(int unit) override {
      pushed[unit] = std::move(buffers[unit]);
      buffers[unit].clear();
      return Status::Ok();
    }

   private:
    MemoryTrainer& t_;

   public:
    std::vector<std::vector<bf16>> buffers, pushed;
  };

  MemoryTrainer() = default;

  Status OptimizerStep() {
    const bool accum = optimizer_.grad_accumulation > 1;
    double total = 0.0;
    for (const Unit& u : units_) {
      for (int r = 0; r < ranks_; ++r) {
        const uint64_t off = static_cast<uint64_t>(r) * u.layout.shard;
        ZT_ASSIGN_OR_RETURN(
            double sq,
            accum ? cpu_adam::SquaredNorm(u.acc.data() + off, cpu_adam::GradType::kFloat32,
                                          u.layout.shard, *exec_)
                  : cpu_adam::SquaredNorm(u.grads.data() + off, cpu_adam::GradType::kBFloat16,
                                          u.layout.shard, *exec_));
        total += sq;
      }
    }
    const double norm = std::sqrt(total);
    const float clip = optimizer_.clip_norm;
    const float scale = cpu_adam::ClipScale(norm, clip);
    ++adam_step_;
    for (Unit& u : units_) {
      const cpu_adam::Shard shard{
          .count = u.layout.padded,
          .grads = accum ? static_cast<const void*>(u.acc.data()) : u.grads.data(),
          .grad_type = accum ? cpu_adam::GradType::kFloat32 : cpu_adam::GradType::kBFloat16,
          .params = u.p.data(),
          .exp_avg = u.m.data(),
          .exp_avg_sq = u.v.data(),
          .params_out = u.out.data()};
      const cpu_adam::StepOptions options{
          .step = adam_step_, .grad_scale = scale, .grad_check = cpu_adam::GradCheck::kPrechecked};
      if (int8_) {
        ZT_RETURN_IF_ERROR(
            cpu_adam::StepInt8(optimizer_.hyper, options, u.q.ShardOf(shard), {}, *exec_).status());
        continue;
      }
      ZT_RETURN_IF_ERROR(cpu_adam::Step(optimizer_.hyper, options, shard, *exec_).status());
    }
    return Status::Ok();
  }

  engine::OptimizerConfig optimizer_;
  bool int8_ = false;
  int ranks_ = 1;
  int micro_ = 0;
  int64_t adam_step_ = 0;
  std::unique_ptr<client::Device> device_;
  std::unique_ptr<cpu_adam::Executor> exec_;
  std::vector<Unit> units_;
  std::vector<std::unique_ptr<gpt::Gpt>> models_;
  std::vector<std::unique_ptr<Source>> sources_;
};

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_CLIENT_MEMORY_TRAINER_H_
