// ztier engine: access to units' fp32 optimizer state wherever it lives
// (see ForEachUnitState in engine_internal.h).
//
// NVMe tier pipeline. Unit order[i] goes to ring slot i % B (B slots). Before
// fn runs on order[i], reads are in flight for order[i+1 .. i+B-2]; the slot
// of order[i-1] is being written back. A slot is read into only after its
// previous write-back completed, so at most B units' states are in DRAM at
// once, whatever the model size. On an error the pipeline still waits for
// every I/O in flight before returning: the slots are reused afterwards.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>

#include "engine/engine_internal.h"

namespace ztier::engine {
namespace {

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

bool ParamsOnNvme(const Job& job) { return job.spec.param_tier == Tier::kNvme; }

// A slot holds master, m, v and, with params on NVMe, the bf16 params after
// StateBytes; otherwise the params go to the DRAM publish buffer.
// m and v at `moments` (MomentBytes of the job's dtype).
void SetMoments(const Job& job, const Unit& u, void* moments, StateView& view) {
  if (job.state_dtype == StateDtype::kInt8) {
    view.q = Int8View(moments, u);
  } else {
    view.exp_avg = static_cast<float*>(moments);
    view.exp_avg_sq = view.exp_avg + u.layout.padded;
  }
}

StateView SlotView(const Job& job, Unit& u, const DramBlock& slot) {
  auto* base = static_cast<float*>(slot.ptr);
  const uint64_t n = u.layout.padded;
  StateView view;
  view.master = base;
  view.publish =
      ParamsOnNvme(job)
          ? reinterpret_cast<bf16*>(static_cast<char*>(slot.ptr) + StateBytes(u, job.state_dtype))
          : static_cast<bf16*>(u.publish.ptr);
  SetMoments(job, u, base + n, view);
  return view;
}

StateView BlockView(const Job& job, Unit& u) {
  StateView view;
  view.master = u.f(u.master);
  view.publish = static_cast<bf16*>(u.publish.ptr);
  if (u.stateless) {  // only master is kept; m and v read as zeros
    float* zeros = const_cast<float*>(u.zero_state);
    if (job.state_dtype == StateDtype::kInt8) {
      view.q = Int8View(zeros, u);
    } else {
      view.exp_avg = view.exp_avg_sq = zeros;
    }
    return view;
  }
  if (job.state_dtype == StateDtype::kInt8) {
    view.q = Int8View(u.exp_avg.ptr, u);
  } else {
    view.exp_avg = u.f(u.exp_avg);
    view.exp_avg_sq = u.f(u.exp_avg_sq);
  }
  return view;
}

// A unit's state as one read or write of `buffer` (a ring slot).
nvme::IoRange StateRange(const Job& job, const Unit& u, void* buffer) {
  return nvme::IoRange{.object = u.swap_object,
                       .offset = 0,
                       .length = StateBytes(u, job.state_dtype),
                       .buffer = buffer};
}

// Waits for a ticket, counting the time blocked as I/O wait.
Status WaitIo(StateRing& ring, const nvme::IoTicket& t) {
  if (!t.valid()) return Status::Ok();
  const auto t0 = std::chrono::steady_clock::now();
  Status s = t.Wait();
  AddElapsed(ring.io_wait_ns, t0);
  return s;
}

}  // namespace

uint64_t MomentBytes(const Unit& u, StateDtype dtype) {
  const uint64_t n = u.layout.padded;
  return dtype == StateDtype::kInt8 ? 2 * n + 2 * 4 * cpu_adam::QuantGroups(n, u.quant_cuts)
                                    : 2 * 4 * n;
}

cpu_adam::Int8Moments Int8View(void* base, const Unit& u) {
  // padded is a multiple of kAlignElements, so the absmax arrays are aligned.
  auto* bytes = static_cast<uint8_t*>(base);
  const uint64_t n = u.layout.padded;
  auto* scales = reinterpret_cast<float*>(bytes + 2 * n);
  return {.m = bytes,
          .v = bytes + n,
          .m_absmax = scales,
          .v_absmax = scales + cpu_adam::QuantGroups(n, u.quant_cuts),
          .cuts = u.quant_cuts};
}

uint64_t StateBytes(const Unit& u, StateDtype dtype) {
  return RoundUp(u.layout.padded * 4 + MomentBytes(u, dtype), 4096);
}

void MomentsToFloat(const Job& job, const Unit& u, const StateView& view, float* m, float* v) {
  const uint64_t n = u.layout.padded;
  if (job.state_dtype == StateDtype::kInt8) {
    if (m) {
      cpu_adam::Dequantize(cpu_adam::QuantMap::kSigned, view.q.m, view.q.m_absmax, n, m,
                           view.q.cuts);
    }
    if (v) {
      cpu_adam::Dequantize(cpu_adam::QuantMap::kUnsigned, view.q.v, view.q.v_absmax, n, v,
                           view.q.cuts);
    }
    return;
  }
  if (m) std::memcpy(m, view.exp_avg, n * sizeof(float));
  if (v) std::memcpy(v, view.exp_avg_sq, n * sizeof(float));
}

void MomentsFromFloat(const Job& job, const Unit& u, const StateView& view, const float* m,
                      const float* v) {
  const uint64_t n = u.layout.padded;
  if (job.state_dtype == StateDtype::kInt8) {
    cpu_adam::Quantize(cpu_adam::QuantMap::kSigned, m, n, view.q.m, view.q.m_absmax, view.q.cuts);
    cpu_adam::Quantize(cpu_adam::QuantMap::kUnsigned, v, n, view.q.v, view.q.v_absmax, view.q.cuts);
    return;
  }
  std::memcpy(view.exp_avg, m, n * sizeof(float));
  std::memcpy(view.exp_avg_sq, v, n * sizeof(float));
}
uint64_t ParamBytes(const UnitLayout& layout) { return RoundUp(layout.padded * 2, 4096); }

std::vector<size_t> ForwardOrder(const Job& job) {
  std::vector<size_t> order(job.units.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  return order;
}

Status ForEachUnitState(Job& job, const std::vector<size_t>& order, Access access, const UnitFn& fn,
                        const StoredFn& stored, const StoredFn& computed) {
  if (job.ring == nullptr) {
    for (size_t k : order) {
      ZT_RETURN_IF_ERROR(fn(k, BlockView(job, job.units[k])));
      if (computed && access != Access::kRead) computed(k);
      if (stored) stored(k);
    }
    return Status::Ok();
  }
  StateRing& ring = *job.ring;
  std::lock_guard<std::mutex> lock(ring.mu);
  const size_t slots = ring.slots.size();
  const size_t lookahead = slots - 2;  // one slot computing, one writing back
  std::vector<nvme::IoTicket> reads(slots), writes(slots);
  // An exception out of `fn` (oneTBB's, when it cannot start a worker)
  // skipped the drain below: the next pass, or the job's end that frees
  // the slots, met I/O still landing in them.
  struct DrainOnThrow {
    StateRing& ring;
    std::vector<nvme::IoTicket>& reads;
    std::vector<nvme::IoTicket>& writes;
    const int exceptions = std::uncaught_exceptions();
    ~DrainOnThrow() {
      if (std::uncaught_exceptions() == exceptions) return;
      for (auto* tickets : {&reads, &writes}) {
        for (nvme::IoTicket& t : *tickets) {
          if (t.valid()) (void)WaitIo(ring, t);
        }
      }
    }
  } drain_on_throw{ring, reads, writes};
  std::vector<size_t> writing(slots);  // index into order of the unit a slot writes back
  auto unit_name = [&](size_t i) { return StrCat("unit '", job.spec.units[order[i]].name, "'"); };
  auto state_range = [&](size_t i, size_t slot) {
    return StateRange(job, job.units[order[i]], ring.slots[slot].ptr);
  };
  // Reads preloaded for this order are this pass's first; others are
  // waited for and dropped.
  size_t next_read = 0;
  const std::vector<size_t>& pre = ring.preload_units;
  const bool adopt = access != Access::kOverwrite && !pre.empty() && pre.size() <= order.size() &&
                     std::equal(pre.begin(), pre.end(), order.begin());
  for (size_t slot = 0; slot < ring.preload_reads.size(); ++slot) {
    if (adopt) {
      reads[slot] = std::move(ring.preload_reads[slot]);
    } else if (ring.preload_reads[slot].valid()) {
      (void)WaitIo(ring, ring.preload_reads[slot]);
    }
  }
  if (adopt) next_read = pre.size();
  ring.preload_reads.clear();
  ring.preload_units.clear();
  // Waits for a slot's write-back, if any.
  auto finish_write = [&](size_t slot) -> Status {
    if (!writes[slot].valid()) return Status::Ok();
    Status s = WaitIo(ring, writes[slot]);
    writes[slot] = {};
    if (!s.ok()) return s.Annotate(StrCat("write back ", unit_name(writing[slot])));
    Unit& u = job.units[order[writing[slot]]];
    ring.bytes_written.fetch_add(
        StateBytes(u, job.state_dtype) + (ParamsOnNvme(job) ? ParamBytes(u.layout) : 0),
        std::memory_order_relaxed);
    if (ParamsOnNvme(job)) u.param_current.fetch_xor(1, std::memory_order_release);
    if (stored) stored(order[writing[slot]]);
    return Status::Ok();
  };

  Status status;
  for (size_t i = 0; i < order.size() && status.ok(); ++i) {
    // Reads ahead, each into a slot whose write-back is done.
    while (status.ok() && next_read < order.size() && next_read <= i + lookahead) {
      const size_t slot = next_read % slots;
      status = finish_write(slot);
      if (!status.ok()) break;
      if (access != Access::kOverwrite) {
        const nvme::IoRange range = state_range(next_read, slot);
        reads[slot] = ring.swap->Submit(nvme::IoDirection::kRead, {&range, 1});
      }
      ++next_read;
    }
    if (!status.ok()) break;
    const size_t slot = i % slots;
    Unit& u = job.units[order[i]];
    if (reads[slot].valid()) {
      status = WaitIo(ring, reads[slot]);
      reads[slot] = {};
      if (!status.ok()) {
        status = status.Annotate(StrCat("read ", unit_name(i)));
        break;
      }
      ring.bytes_read.fetch_add(StateBytes(u, job.state_dtype), std::memory_order_relaxed);
    }
    const StateView view = SlotView(job, u, ring.slots[slot]);
    status = fn(order[i], view);
    if (!status.ok()) continue;
    if (access == Access::kRead) {
      if (stored) stored(order[i]);
      continue;
    }
    if (computed) computed(order[i]);
    std::vector<nvme::IoRange> ranges = {state_range(i, slot)};
    if (ParamsOnNvme(job)) {  // into the copy clients are not reading
      const uint8_t next = u.param_current.load(std::memory_order_acquire) ^ 1;
      ranges.push_back({.object = u.param_objects[next],
                        .offset = 0,
                        .length = ParamBytes(u.layout),
                        .buffer = view.publish});
    }
    writes[slot] = ring.swap->Submit(nvme::IoDirection::kWrite, ranges);
    writing[slot] = i;
    // Finish write-backs that are already done, so their units are
    // published without waiting for their slot's next use.
    for (size_t w = 0; w < slots && status.ok(); ++w) {
      if (w != slot && writes[w].valid() && writes[w].Done()) status = finish_write(w);
    }
  }
  // Drain: the slots must be idle when the ring is released. A read-ahead
  // past an error is waited for and its data dropped.
  for (size_t slot = 0; slot < slots; ++slot) {
    if (reads[slot].valid()) (void)WaitIo(ring, reads[slot]);
    Status w = finish_write(slot);
    if (status.ok()) status = w;
  }
  return status;
}

void PreloadUnitStates(Job& job, const std::vector<size_t>& order) {
  if (job.ring == nullptr) return;
  StateRing& ring = *job.ring;
  std::lock_guard<std::mutex> lock(ring.mu);
  if (!ring.preload_units.empty()) return;
  const size_t count = std::min(order.size(), ring.slots.size() - 1);
  for (size_t i = 0; i < count; ++i) {
    const nvme::IoRange range = StateRange(job, job.units[order[i]], ring.slots[i].ptr);
    ring.preload_reads.push_back(ring.swap->Submit(nvme::IoDirection::kRead, {&range, 1}));
    ring.preload_units.push_back(order[i]);
  }
}

Status WithUnitState(Job& job, size_t unit, Access access, const UnitFn& fn,
                     const StoredFn& stored) {
  return ForEachUnitState(job, {unit}, access, fn, stored);
}

}  // namespace ztier::engine
