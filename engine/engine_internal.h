// ztier engine internal: the job and unit records shared by engine.cc and
// checkpoint.cc. Only engine/*.cc include this.
#ifndef ZTIER_ENGINE_ENGINE_INTERNAL_H_
#define ZTIER_ENGINE_ENGINE_INTERNAL_H_

#include <functional>
#include <string>
#include <vector>

#include "engine/dram_pool.h"
#include "engine/engine.h"

namespace ztier::engine {

struct Unit {
  UnitLayout layout;
  DramBlock master, exp_avg, exp_avg_sq, publish, inbox, accum;
  std::vector<uint8_t> arrived;  // by rank, this micro-step
  int arrived_count = 0;
  int micro = 0;                 // micro-steps completed toward the next step
  std::vector<double> shard_sq;  // by rank, at the accumulation boundary
  bool ready = false;            // grads complete for the pending step
  int64_t published = -1;        // step held by the publish buffer
  float* f(const DramBlock& b) const { return static_cast<float*>(b.ptr); }
};

struct Job {
  int id = 0;
  JobSpec spec;
  std::vector<Unit> units;
  int64_t step = 0;       // completed steps (what clients wait for)
  int64_t adam_step = 0;  // steps that updated the weights (bias correction)
  int ready_units = 0;
  int eager_done = 0;
  Status failure;
  bool removed = false;
  bool checkpointing = false;  // a save or load owns the buffers
  JobCounters counters;
  DramPool* pool = nullptr;

  ~Job() {
    for (Unit& u : units) {
      for (DramBlock* b : {&u.master, &u.exp_avg, &u.exp_avg_sq, &u.publish, &u.inbox, &u.accum}) {
        if (b->ptr != nullptr) pool->Free(*b);
      }
    }
  }
};

// Publishes a unit as holding `step` (engine.cc: under the engine lock).
using PublishFn = std::function<void(Unit&, int64_t step)>;

// Called with the job idle (no grads pending) and marked checkpointing.
Status SaveCheckpointImpl(Job& job, const std::string& dir);
Status LoadCheckpointImpl(Job& job, const std::string& dir, const PublishFn& publish);
Status ExportSafetensorsImpl(const Job& job, const std::string& path, bool bf16_out);
Status ImportSafetensorsImpl(Job& job, const std::string& path, const PublishFn& publish);

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_ENGINE_INTERNAL_H_
