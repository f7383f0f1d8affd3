// ztier engine internal: the job and unit records shared by engine.cc and
// checkpoint.cc. Only engine/*.cc include this.
#ifndef ZTIER_ENGINE_ENGINE_INTERNAL_H_
#define ZTIER_ENGINE_ENGINE_INTERNAL_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/dram_pool.h"
#include "engine/engine.h"
#include "nvme/swap_space.h"

namespace ztier::engine {

// A unit's fp32 state where it can be read and written now: its DRAM blocks,
// or a ring slot holding it while it is staged from NVMe.
struct StateView {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

struct Unit {
  UnitLayout layout;
  // fp32 state in DRAM (optimizer tier dram); empty blocks on the NVMe tier,
  // where the state is swap object `swap_object`: master, m, v back to back.
  DramBlock master, exp_avg, exp_avg_sq, publish, inbox, accum;
  uint64_t swap_object = 0;
  std::vector<uint8_t> arrived;  // by rank, this micro-step
  int arrived_count = 0;
  int micro = 0;                 // micro-steps completed toward the next step
  std::vector<double> shard_sq;  // by rank, at the accumulation boundary
  bool ready = false;            // grads complete for the pending step
  int64_t published = -1;        // step held by the publish buffer
  float* f(const DramBlock& b) const { return static_cast<float*>(b.ptr); }
};

// The pinned ring that stages NVMe-resident units: buffer_count slots, each
// as large as the job's largest unit state. `mu` is held by whoever uses the
// slots (a step on the engine thread, or a synchronous access between
// steps), so accesses never interleave; every I/O is complete when it is
// released.
struct StateRing {
  nvme::SwapSpace* swap = nullptr;
  std::mutex mu;
  std::vector<DramBlock> slots;
  // Traffic and time, read by counters() without `mu`.
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0};
  std::atomic<uint64_t> io_wait_ns{0};  // the engine blocked on the drives
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
  std::unique_ptr<StateRing> ring;      // optimizer tier nvme only
  std::atomic<uint64_t> compute_ns{0};  // in cpu_adam::Step

  ~Job() {
    for (Unit& u : units) {
      for (DramBlock* b : {&u.master, &u.exp_avg, &u.exp_avg_sq, &u.publish, &u.inbox, &u.accum}) {
        if (b->ptr != nullptr) pool->Free(*b);
      }
      if (ring != nullptr && u.swap_object != 0) (void)ring->swap->Free(u.swap_object);
    }
    if (ring != nullptr) {
      for (const DramBlock& b : ring->slots) pool->Free(b);
    }
  }
};

// Bytes of a unit's state as one swap object and one ring slot: master, m
// and v of `padded` fp32 each, rounded up to 4 KiB so transfers go straight
// to the drive.
uint64_t StateBytes(const UnitLayout& layout);

// Runs `fn(k, view)` for each unit index in `order`, with the unit's fp32
// state in reach. DRAM tier: views of the unit's blocks, in order. NVMe tier:
// a pipeline over the ring (holding ring->mu throughout): while fn works on
// one unit the ring reads ahead the next buffer_count - 2 units and writes
// back the previous one (when `write_back`). Returns after every I/O is
// done. The first error (fn's, or an I/O error naming the unit) stops it.
enum class WriteBack : uint8_t { kNo, kYes };
using UnitFn = std::function<Status(size_t unit, const StateView& state)>;
Status ForEachUnitState(Job& job, const std::vector<size_t>& order, WriteBack write_back,
                        const UnitFn& fn);
// The same for one unit.
Status WithUnitState(Job& job, size_t unit, WriteBack write_back, const UnitFn& fn);
// 0, 1, ..., units - 1.
std::vector<size_t> ForwardOrder(const Job& job);

// Publishes a unit as holding `step` (engine.cc: under the engine lock).
using PublishFn = std::function<void(Unit&, int64_t step)>;

// Called with the job idle (no grads pending) and marked checkpointing.
Status SaveCheckpointImpl(Job& job, const std::string& dir);
Status LoadCheckpointImpl(Job& job, const std::string& dir, const PublishFn& publish);
Status ExportSafetensorsImpl(Job& job, const std::string& path, bool bf16_out);
Status ImportSafetensorsImpl(Job& job, const std::string& path, const PublishFn& publish);

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_ENGINE_INTERNAL_H_
