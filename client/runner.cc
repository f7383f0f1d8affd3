// The stage-3 runner: one rank's unit fetches (engine -> device) and grad
// pushes (device -> engine), around the rank's compute.
//
// The rank's thread (the caller) makes every decision: which unit to fetch,
// when, into which buffer, what to free; transfer threads only execute the
// queues of fetches and pushes, strictly in the order the caller queued
// them. Decisions therefore depend only on the sequence of calls, never on
// timing, and the live-bytes cap is exact: a unit's device buffer is
// allocated when its fetch is queued, and a fetch is queued only when the
// buffer fits under the cap. With R = 1 fetches and pushes have a thread and
// a device stream each (kCopy, kCopyOut), so grads going to the host
// overlap params coming in and a push waiting for the engine never holds up
// a fetch. With R > 1 one thread runs both in the caller's order, so all
// ranks of a job issue the same collectives in the same order (an NCCL
// requirement); their copies still go on the two streams.
//
// A fetch of unit k for version v: wait until the engine has published k at
// v (AcquireParams), copy the rank's shard (or, with R = 1, the unit) to the
// device on the copy stream, all-gather the shards (R > 1), release the
// engine's copy. A push: wait for the compute stream's grads, reduce-scatter
// (R > 1), copy this rank's shard into the engine's grad inbox, ring the
// doorbell (GradsReady), free the grad buffer.
//
// Prefetch: the acquire order of the first micro-step is learned (per kind
// of pass, SetOrder: training's passes end at Step(), others at the next
// SetOrder of their kind); later, on
// Acquire(position i), the units at positions i+1 .. i+depth are queued if
// absent and under the cap. A released unit that is acquired again within
// that window stays on the device. Step() queues the first `depth` units of
// the next micro-step, at the version it reads, right after the last push:
// their fetch waits on the engine's optimizer unit by unit, which is the
// overlap of the optimizer with the next forward pass.
//
// Coalescing (options.coalesce_bytes): a fetch of a small unit takes along
// the small units after it in the learned order; those the engine has
// published when the first is copied go in one copy of their span of the
// engine's memory into a staging buffer, then device-side copies into their
// buffers (each rank copies them whole: no all-gather), and the rest follow
// as they are published. With R = 1 a small push takes along the small
// pushes queued behind it that are ready: into the staging buffer laid out
// as their inboxes are, and to the host in one copy. Nothing waits for a
// later unit to fill a copy. Where the units' host buffers are not one span
// (params on NVMe: no fetch coalescing) the copies go one by one.
//
// With R > 1 a fetch of a unit that is not small but whose shard is, and
// that was fetched at this version before (the backward's fetches, after
// the forward's), takes along the units after it in the learned order that
// are the same and lie next to it in the engine's memory (the publish
// buffers of a job are in unit order, page-rounded), while their span
// stays within R x coalesce_bytes. The grouping follows the calls alone,
// since every rank must issue the same all-gather, so a run waits for all
// its units; fetched before at this version, they are published, and a run
// never holds a unit back for the optimizer's work on a later one. Each
// rank copies its R-th of the span, and one all-gather fills in the rest:
// a copy a rank for the run where there was one a unit, each about R times
// larger.
//
// With R > 1 a push whose shard is small is held by the caller in an open
// run, which is queued as one transfer when the next push cannot join it
// (not small, its whole inbox not next to the run's span, or the span would
// outgrow the staging of R x coalesce_bytes), and at Step() or destruction:
// the grouping follows the calls alone, so every rank queues the same
// collectives (which pushes are ready when, TakeReadyPushes' rule, would
// differ between ranks). A unit's inbox is its R shards in rank order and
// a job's inboxes lie in unit order, page-rounded, so a run's whole inboxes
// are one span of host memory: each unit's full grads go into the staging
// at its offset in the span, one reduce-scatter cuts the span into R equal
// chunks, and each rank copies its chunk (clipped to the span: the page
// after it may hold another unit's grads, not yet consumed) to the host.
// A rank's chunk holds parts of other ranks' shards, and GradsReady(unit,
// rank) makes the engine read the rank's shard, so the doorbells ring only
// after a small collective that no rank passes before every rank's copy
// has landed. A held push keeps its grad buffer until its run goes (grads
// do not count toward the live-bytes cap, which is for params); every rank
// must be given the same coalesce_bytes (so it must for fetches too).
//
// Failure: the first transfer error is kept; it fails the acquire or Step
// that waits on it and every later call.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "client/transport.h"
#include "client/ztier.h"
#include "common/log.h"
#include "common/thread.h"

namespace ztier::client {

using Clock = std::chrono::steady_clock;

namespace {

// Completion of one queued transfer.
struct Ticket {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;

  void Complete(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      status = std::move(s);
    }
    cv.notify_all();
  }
  Status Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return status;
  }
};

// What the transfer thread was doing over an interval (runner stats).
enum class Phase : uint8_t { kOptimizer, kHostToDevice, kDeviceToHost, kCollective, kCompute };
struct PhaseSpan {
  Clock::time_point start, end;
  Phase phase;
  bool push;  // of a push (else of a fetch)
};

// One unit of a transfer: its buffer (a fetch's param buffer, a push's
// grad buffer), the grads' readiness (push) and the caller's ticket.
struct Part {
  int unit;
  void* buffer;
  // Push: the compute stream's grads are written. Fetch into a buffer kept
  // (a persistent unit's, refreshed): the compute stream's work queued
  // before the fetch, which may still read the old params, is done.
  std::unique_ptr<Event> ready;
  std::shared_ptr<Ticket> ticket;
  bool done = false;  // its ticket completed (a coalesced fetch completes parts as it goes)
};

// A fetch or push of one unit, or of a coalesced run of small units (one
// copy over the link through a staging buffer; parts in order).
struct Transfer {
  enum class Kind : uint8_t { kFetch, kPush } kind;
  int64_t version;
  std::vector<Part> parts;
  bool run = false;  // a fetch run of units whose shard is small (R > 1)
};

// The caller's view of one unit.
struct UnitState {
  std::string name;
  uint64_t padded = 0, shard = 0, bytes = 0;  // bytes of the full bf16 unit
  bool persistent = false;
  void* params = nullptr;         // device buffer, while resident or in flight
  int64_t version = -1;           // version the buffer holds (or is being fetched at)
  int64_t fetched = -1;           // the last version a fetch of it was queued at
  std::shared_ptr<Ticket> fetch;  // the fetch filling `params`
  int holds = 0;
  bool stale = false;  // held when the weights were replaced: fetched again after
  Clock::time_point acquired_at;
  void* grads = nullptr;  // from GradBuffer until PushGrads
  bool pushed = false;    // this micro-step
  bf16* inbox = nullptr;  // the engine's inbox for this rank's shard
  // The unit's whole inbox (every rank's shard, `bytes` long), for runs of
  // pushes with R > 1; null where it does not lie in a registered region.
  uint8_t* inbox_start = nullptr;
};

}  // namespace

struct Stage3Runner::Impl {
  Model* model = nullptr;
  Transport* transport = nullptr;
  Device* device = nullptr;
  Collectives* collectives = nullptr;
  RunnerOptions options;
  int rank = 0, world = 1, job = 0, accumulation = 1;
  int64_t weights_generation = 0;  // the engine's, as of the copies on the device
  bool claimed_rank = false;       // in model->runner_ranks_
  std::vector<UnitState> units;
  void* shard_buffer = nullptr;  // reduce-scatter output (R > 1)
  // Coalesced copies (options.coalesce_bytes): a staging buffer on the
  // device for each direction, `staging_bytes` for fetches and R times that
  // for pushes (a run's span of whole inboxes); null when no unit is small
  // enough. With R > 1 a push run's reduce-scatter lands in `push_chunk`
  // (`staging_bytes`), and `barrier` holds the R + 1 elements of the
  // collective that tells every chunk has landed.
  void *fetch_staging = nullptr, *push_staging = nullptr;
  void *push_chunk = nullptr, *barrier = nullptr;
  uint64_t staging_bytes = 0;
  // Fetches of units whose shard is small go in runs (R > 1, params in
  // DRAM: the publish buffers lie side by side in unit order).
  bool fetch_runs = false;
  std::vector<std::pair<void*, uint64_t>> host_ranges;  // registered with the device

  // Caller-thread state.
  int64_t version = 0;
  int64_t micro = 0;
  uint64_t live_bytes = 0;  // param buffers allocated (resident or in flight)
  // The active order (SetOrder's key `order_key`): learned, being recorded,
  // and how far this pass follows it. Other keys' orders wait in `orders`.
  std::vector<int> learned, recording;
  size_t position = 0;     // in `learned`, this pass
  bool following = false;  // this pass still matches `learned`
  struct Order {
    std::vector<int> learned, recording;
    size_t position = 0;
    bool following = false;
  };
  int order_key = 0;
  std::map<int, Order> orders;
  // The open run of small pushes (R > 1), not queued yet, and the span of
  // host memory its units' whole inboxes cover.
  std::optional<Transfer> run;
  uint8_t *run_start = nullptr, *run_end = nullptr;
  RunnerStats stats;
  // Transfer threads: `thread` runs `queue` (fetches, and with R > 1 the
  // pushes too); with R = 1 `push_thread` runs `push_queue`.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Transfer> queue, push_queue;
  size_t in_flight = 0;  // queued or running
  bool stop = false;
  Status failure;  // first transfer error
  uint64_t h2d = 0, d2h = 0;
  int64_t h2d_copies = 0, d2h_copies = 0;
  // The transfer thread's phases not yet laid against a wait of the caller
  // (pruned at each wait's end: waits are sequential, on the caller thread).
  std::deque<PhaseSpan> spans;
  // This rank's words of the job's client page (engine/wire_types.h),
  // where the engine (and ztierd's operators) see its device traffic.
  uint64_t* client_counters = nullptr;
  std::thread thread, push_thread;
  ProcessOwner owner;

  // A step this runner began and did not finish (closed mid-backward: an
  // exception's unwind, a Python object collected) goes with it. Its grads
  // left in the engine made every later runner's pushes arrive "before the
  // optimizer finished this one", and saves refused, for good. One rank
  // only: with peers in the step, they hold theirs (restart from a
  // checkpoint, as AbortStep says).
  // Whether this runner has begun a step: grads pushed this micro-step, or
  // micro-steps of the window done.
  bool StepBegun() const {
    return micro % accumulation != 0 ||
           std::any_of(units.begin(), units.end(), [](const UnitState& u) { return u.pushed; });
  }

  void DropUnfinishedStep() {
    // A runner that failed (a transfer's error) leaves the job as healthy
    // as ever, its grads too: they go the same way.
    if (world != 1 || transport == nullptr || !StepBegun()) return;
    Result<int> dropped = transport->AbortStep(job, version + 1);
    if (dropped.ok()) {
      ZT_LOG(kInfo, "client") << "runner of model '" << model->spec().name
                              << "' closed mid-step: the grads of step " << version + 1
                              << " it had pushed are dropped";
    } else if (failure.ok()) {  // else the job (or ztierd) may have gone with the failure
      ZT_LOG(kWarn, "client") << "runner of model '" << model->spec().name
                              << "' closed mid-step, and its grads could not be dropped: "
                              << dropped.status();
    }
  }

  void CountTraffic(engine::ClientCounter which, uint64_t bytes) {
    std::atomic_ref<uint64_t>(client_counters[which]).fetch_add(bytes, std::memory_order_relaxed);
  }

  ~Impl() {
    // Finish what is queued rather than drop it: with R > 1 a peer may
    // already be inside the collective of a queued fetch, and would wait for
    // this rank forever. (After a failure the queue drains without work.)
    // A run of pushes still open goes too: the peers queue theirs.
    QueueRun();
    (void)Drain();
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
    if (push_thread.joinable()) push_thread.join();
    DropUnfinishedStep();
    for (UnitState& u : units) {
      device->Free(u.params);
      device->Free(u.grads);
    }
    device->Free(shard_buffer);
    device->Free(fetch_staging);
    device->Free(push_staging);
    device->Free(push_chunk);
    device->Free(barrier);
    for (const auto& [base, bytes] : host_ranges) {
      Status s = device->UnregisterHost(base, bytes);
      if (!s.ok()) {
        ZT_LOG(kWarn, "client") << "runner: " << s;
      }
    }
    if (claimed_rank) {
      std::lock_guard<std::mutex> lock(model->runners_mu_);
      model->runner_ranks_.erase(rank);
    }
  }

  // ---------------------------------------------------------- transfer side

  void Loop(std::deque<Transfer>& q) {
    for (;;) {
      Transfer t;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !q.empty(); });
        if (q.empty()) return;
        t = std::move(q.front());
        q.pop_front();
      }
      Status s = failure_snapshot();
      if (s.ok()) s = t.kind == Transfer::Kind::kFetch ? Fetch(t) : Push(t);
      if (!s.ok()) RecordFailure(s);
      for (Part& p : t.parts) {
        if (!p.done) p.ticket->Complete(s);
      }
      Finish(t);
    }
  }

  // Moves into `t` the small units' pushes queued behind it whose grads are
  // written already and whose inboxes are free (R = 1), as far as one
  // staging buffer holds them. Never waits for one: a push held for a
  // later unit's backward, or for the engine, would hold back the engine's
  // work on its grads, and its step.
  void TakeReadyPushes(Transfer& t) {
    const auto bytes = [&](const Part& p) { return units[p.unit].shard * sizeof(bf16); };
    uint64_t span = PageRound(bytes(t.parts[0]));
    for (;;) {
      // This thread alone pops the queue, and the caller only appends to it
      // (a deque's elements stay put): the front looked at stays valid, and
      // stays the front, until this thread pops it.
      const Part* p = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (push_queue.empty()) return;
        const Transfer& next = push_queue.front();
        if (next.version != t.version || next.parts.size() != 1) return;
        p = &next.parts[0];
      }
      if (!SmallPush(bytes(*p)) || span + PageRound(bytes(*p)) > staging_bytes ||
          !p->ready->Done() || !Published(p->unit, t.version)) {
        return;
      }
      span += PageRound(bytes(*p));
      std::lock_guard<std::mutex> lock(mu);
      t.parts.push_back(std::move(push_queue.front().parts[0]));
      push_queue.pop_front();
      --in_flight;  // one transfer now (`t` still is, until it finishes)
    }
  }

  // Records that a transfer thread spent [start, now) in `phase` for a
  // fetch or a push; returns now, the next phase's start.
  Clock::time_point Mark(Phase phase, bool push, Clock::time_point start) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mu);
    spans.push_back({start, now, phase, push});
    return now;
  }

  // Adds the caller's wait [t0, t1) to the stats by the phases it overlapped;
  // the part no phase covers (a transfer thread between transfers) goes to
  // `rest`. A wait for a fetch (Acquire) counts the fetches' phases, one for
  // the pushes (Step) the pushes': with R = 1 they run at once on their own
  // threads, and each second is counted once. With R > 1 one thread runs
  // both in order, and a fetch may wait behind a push: every phase counts.
  // Spans that end by t1 are dropped: later waits start after it.
  void Attribute(Clock::time_point t0, Clock::time_point t1, Phase rest, bool for_push) {
    double by_phase[5] = {};
    double covered = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const PhaseSpan& sp : spans) {
        if (world == 1 && sp.push != for_push) continue;
        const Clock::time_point a = std::max(sp.start, t0), b = std::min(sp.end, t1);
        if (b <= a) continue;
        const double d = std::chrono::duration<double>(b - a).count();
        by_phase[static_cast<int>(sp.phase)] += d;
        covered += d;
      }
      while (!spans.empty() && spans.front().end <= t1) spans.pop_front();
    }
    by_phase[static_cast<int>(rest)] +=
        std::max(0.0, std::chrono::duration<double>(t1 - t0).count() - covered);
    stats.wait_optimizer_seconds += by_phase[static_cast<int>(Phase::kOptimizer)];
    stats.wait_h2d_seconds += by_phase[static_cast<int>(Phase::kHostToDevice)];
    stats.wait_d2h_seconds += by_phase[static_cast<int>(Phase::kDeviceToHost)];
    stats.wait_collective_seconds += by_phase[static_cast<int>(Phase::kCollective)];
  }

  // Whether the engine has published `unit` at `version` already (an error
  // asking is a no: the acquire that waits for it then says what it is).
  bool Published(int unit, int64_t version) {
    Result<int64_t> step = transport->PublishedStep(job, unit);
    return step.ok() && *step >= version;
  }

  Status failure_snapshot() {
    std::lock_guard<std::mutex> lock(mu);
    return failure;
  }

  // The first transfer error, or the transport's own once it knows the
  // engine is gone (kept as the failure): a call that needs no transfer
  // (a resident unit's acquire, a push that is only queued) says so too,
  // before any complaint about the call itself.
  Status CheckAlive() {
    // First, before any lock: in a forked child the parent's transfer
    // threads may have held one at the fork, for good.
    ZT_RETURN_IF_ERROR(owner.Check("a runner call"));
    Status s = failure_snapshot();
    if (s.ok()) s = transport->Health();
    if (!s.ok()) RecordFailure(s);
    return s;
  }

  // Keeps the first failure. From then on this rank makes no collectives
  // (its queue drains without work): its peers' are ended at once, rather
  // than left to wait out their timeout for it.
  void RecordFailure(const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!failure.ok()) return;
      failure = s;
    }
    if (collectives != nullptr && collectives->world_size() > 1) {
      collectives->Abort(StrCat("rank ", rank, " failed: ", s.message()));
    }
  }

  // `s`, recorded as the rank's failure where R > 1 and not ok: a call that
  // failed midway (a device allocation, a fetch it could not queue) left
  // this rank's collectives out of step with its peers' (AbortStep is
  // refused with R > 1), so they are ended now rather than left waiting
  // for it.
  Status FailsRank(Status s) {
    if (!s.ok() && world > 1) RecordFailure(s);
    return s;
  }

  void Finish(Transfer& t) {
    if (t.kind == Transfer::Kind::kPush) {
      for (Part& p : t.parts) device->Free(p.buffer);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      --in_flight;
    }
    cv.notify_all();
  }

  // Waits for everything queued on a copy stream, collectives included
  // (which end the wait where a peer failed: Collectives::Wait). A world of
  // one queues no collective, and its fetch and push threads both wait here.
  Status SyncCopies(Stream stream) {
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Event> done, device->Record(stream));
    return world > 1 ? collectives->Wait(*done) : done->Synchronize();
  }

  void CountCopies(uint64_t bytes, int64_t copies, bool to_device) {
    CountTraffic(to_device ? engine::kHostToDeviceBytes : engine::kDeviceToHostBytes, bytes);
    std::lock_guard<std::mutex> lock(mu);
    (to_device ? h2d : d2h) += bytes;
    (to_device ? h2d_copies : d2h_copies) += copies;
  }

  Status Fetch(Transfer& t) {
    // A buffer refreshed in place is written only after the compute queued
    // before its fetch (a forward or an eval between the backward and
    // Step(), reading the old params) is done.
    for (const Part& p : t.parts) {
      if (p.ready != nullptr) ZT_RETURN_IF_ERROR(device->Wait(Stream::kCopy, *p.ready));
    }
    if (SmallFetch(units[t.parts[0].unit].bytes)) return FetchCoalesced(t);
    if (t.run) return FetchRun(t);
    const int unit = t.parts[0].unit;
    const UnitState& u = units[unit];
    Clock::time_point at = Clock::now();
    ZT_ASSIGN_OR_RETURN(const bf16* host,
                        transport->AcquireParams(job, unit, t.version, options.timeout));
    at = Mark(Phase::kOptimizer, false, at);
    auto* dst = static_cast<bf16*>(t.parts[0].buffer);
    Status s;
    if (world == 1) {
      s = device->CopyToDevice(dst, host, u.bytes, Stream::kCopy);
      if (s.ok()) s = SyncCopies(Stream::kCopy);
      Mark(Phase::kHostToDevice, false, at);
    } else {
      const uint64_t off = static_cast<uint64_t>(rank) * u.shard;
      s = device->CopyToDevice(dst + off, host + off, u.shard * sizeof(bf16), Stream::kCopy);
      if (s.ok()) s = SyncCopies(Stream::kCopy);
      at = Mark(Phase::kHostToDevice, false, at);
      if (s.ok()) s = collectives->AllGather(dst, u.shard, *device, Stream::kCopy);
      if (s.ok()) s = SyncCopies(Stream::kCopy);
      Mark(Phase::kCollective, false, at);
    }
    Status r = transport->ReleaseParams(job, unit);
    ZT_RETURN_IF_ERROR(s);
    ZT_RETURN_IF_ERROR(r);
    CountCopies(world == 1 ? u.bytes : u.shard * sizeof(bf16), 1, /*to_device=*/true);
    return Status::Ok();
  }

  // Where host ranges of `bytes[i]` at `host[i]` lie in one span that a
  // staging buffer of `capacity` bytes holds: in address order, each after
  // the one before, at most the rest of its page apart (the engine's buffers
  // of a job are page-rounded blocks of one region, in unit order). Their
  // offsets in the span, the span's start and its length; nothing when they
  // do not (params on NVMe come from cache slots in any order), and the
  // copies go one by one.
  template <typename Byte>  // uint8_t (inboxes) or const uint8_t (params)
  struct SpanLayout {
    std::vector<uint64_t> offsets;
    Byte* start;
    uint64_t length;
  };
  template <typename Byte>
  static std::optional<SpanLayout<Byte>> Span(const std::vector<Byte*>& host,
                                              const std::vector<uint64_t>& bytes,
                                              uint64_t capacity) {
    std::vector<size_t> order(host.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return host[a] < host[b]; });
    for (size_t i = 1; i < order.size(); ++i) {
      const Byte* end = host[order[i - 1]] + bytes[order[i - 1]];
      const Byte* next = host[order[i]];
      if (next < end || next - end >= 4096) return std::nullopt;
    }
    Byte* start = host[order.front()];
    const uint64_t length = host[order.back()] + bytes[order.back()] - start;
    if (length > capacity) return std::nullopt;
    SpanLayout<Byte> span{
        .offsets = std::vector<uint64_t>(host.size()), .start = start, .length = length};
    for (size_t i = 0; i < host.size(); ++i) span.offsets[i] = host[i] - start;
    return span;
  }

  // Small units, each whole on every rank (no all-gather: for units this
  // small the collective's latency is what costs), in one copy to the
  // staging buffer, then to their buffers on the device. The first unit not
  // copied yet is waited for; the units after it that the engine has
  // already published join its copy. A later unit is never waited for: that
  // would hold the earlier ones back from the compute waiting on them (the
  // next forward starts as soon as unit 0 is updated). So while the
  // optimizer is publishing units one by one they go as it publishes them,
  // and units published already (a step done, persistent units refreshed)
  // go together. Parts complete as their copy lands.
  Status FetchCoalesced(Transfer& t) {
    for (size_t next = 0; next < t.parts.size();) {
      Clock::time_point at = Clock::now();
      std::vector<const uint8_t*> host;
      std::vector<uint64_t> bytes;
      Status s;
      for (size_t i = next; i < t.parts.size(); ++i) {
        const int unit = t.parts[i].unit;
        if (i > next && !Published(unit, t.version)) break;
        Result<const bf16*> h = transport->AcquireParams(job, unit, t.version, options.timeout);
        if (!h.ok()) {
          s = h.status();
          break;
        }
        host.push_back(reinterpret_cast<const uint8_t*>(*h));
        bytes.push_back(units[unit].bytes);
      }
      at = Mark(Phase::kOptimizer, false, at);
      const size_t end = next + host.size();
      uint64_t moved = 0;
      int64_t copies = 0;
      if (s.ok()) {
        // One unit alone goes straight to its buffer.
        std::optional<SpanLayout<const uint8_t>> span;
        if (host.size() > 1) span = Span(host, bytes, staging_bytes);
        if (span) {
          s = device->CopyToDevice(fetch_staging, span->start, span->length, Stream::kCopy);
          for (size_t i = 0; s.ok() && i < host.size(); ++i) {
            s = device->CopyOnDevice(t.parts[next + i].buffer,
                                     static_cast<uint8_t*>(fetch_staging) + span->offsets[i],
                                     bytes[i], Stream::kCopy);
          }
          moved = span->length;
          copies = 1;
        } else {
          for (size_t i = 0; s.ok() && i < host.size(); ++i) {
            s = device->CopyToDevice(t.parts[next + i].buffer, host[i], bytes[i], Stream::kCopy);
            moved += bytes[i];
            ++copies;
          }
        }
        if (s.ok()) s = SyncCopies(Stream::kCopy);
        Mark(Phase::kHostToDevice, false, at);
      }
      for (size_t i = next; i < end; ++i) {
        Status r = transport->ReleaseParams(job, t.parts[i].unit);
        if (s.ok()) s = r;
      }
      ZT_RETURN_IF_ERROR(s);
      CountCopies(moved, copies, /*to_device=*/true);
      for (size_t i = next; i < end; ++i) {
        t.parts[i].ticket->Complete(Status::Ok());
        t.parts[i].done = true;
      }
      next = end;
    }
    return Status::Ok();
  }

  // A run's span of `length` bytes (R > 1, a fetch's or a push's) is cut
  // into R equal chunks of whole kAlignElements blocks, aligned for the
  // collective and the copy: the bytes of one.
  uint64_t RunChunk(uint64_t length) const {
    const uint64_t quantum = static_cast<uint64_t>(world) * engine::kAlignElements * sizeof(bf16);
    return (length + quantum - 1) / quantum * quantum / world;
  }

  // Where the units of a fetch run (R > 1) lie in its span: ordered by unit,
  // each at the next page after the one before, as the engine lays out a
  // job's publish buffers. Offsets by part, and the span's length.
  struct RunLayout {
    std::vector<uint64_t> offsets;
    uint64_t length = 0;
  };
  RunLayout LayRun(const std::vector<Part>& parts) const {
    std::vector<size_t> order(parts.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return parts[a].unit < parts[b].unit; });
    RunLayout layout{.offsets = std::vector<uint64_t>(parts.size()), .length = 0};
    for (size_t i : order) {
      layout.offsets[i] = PageRound(layout.length);
      layout.length = layout.offsets[i] + units[parts[i].unit].bytes;
    }
    return layout;
  }

  // A run of units whose shards are small (R > 1), grouped by the caller
  // (QueueFetch), all published at the version first: the run's span (its
  // units side by side, LayRun) is cut into R chunks of whole blocks; each
  // rank copies its chunk (clipped to the span) into the staging buffer at
  // the chunk's offset, one all-gather fills in the rest, and the units go
  // from there to their buffers. The chunks follow from the units' sizes
  // alone, so every rank makes the same collectives. Where the units' host
  // buffers are not laid out as the span (no engine does so, but a rank
  // could not tell) a rank copies its chunk unit by unit.
  Status FetchRun(Transfer& t) {
    const RunLayout layout = LayRun(t.parts);
    Clock::time_point at = Clock::now();
    std::vector<const uint8_t*> host;
    Status s;
    for (const Part& p : t.parts) {
      Result<const bf16*> h = transport->AcquireParams(job, p.unit, t.version, options.timeout);
      if (!h.ok()) {
        s = h.status();
        break;
      }
      host.push_back(reinterpret_cast<const uint8_t*>(*h));
    }
    at = Mark(Phase::kOptimizer, false, at);
    uint64_t moved = 0;
    int64_t copies = 0;
    if (s.ok()) {
      const uint64_t chunk = RunChunk(layout.length);
      const uint64_t lo = std::min(layout.length, static_cast<uint64_t>(rank) * chunk);
      const uint64_t hi = std::min(layout.length, lo + chunk);
      auto* staging = static_cast<uint8_t*>(push_staging);
      // The host span's start, where its units lie as laid out.
      const uint8_t* start = host[0] - layout.offsets[0];
      bool as_laid = true;
      for (size_t i = 0; i < host.size(); ++i)
        as_laid = as_laid && host[i] == start + layout.offsets[i];
      if (hi > lo && as_laid) {
        s = device->CopyToDevice(staging + lo, start + lo, hi - lo, Stream::kCopy);
        moved = hi - lo;
        copies = 1;
      } else {
        for (size_t i = 0; s.ok() && i < host.size(); ++i) {
          const uint64_t a = std::max(lo, layout.offsets[i]);
          const uint64_t b = std::min(hi, layout.offsets[i] + units[t.parts[i].unit].bytes);
          if (b <= a) continue;
          s = device->CopyToDevice(staging + a, host[i] + (a - layout.offsets[i]), b - a,
                                   Stream::kCopy);
          moved += b - a;
          ++copies;
        }
      }
      if (s.ok()) s = SyncCopies(Stream::kCopy);
      at = Mark(Phase::kHostToDevice, false, at);
      if (s.ok()) {
        s = collectives->AllGather(reinterpret_cast<bf16*>(staging), chunk / sizeof(bf16), *device,
                                   Stream::kCopy);
        if (s.ok()) s = SyncCopies(Stream::kCopy);
        at = Mark(Phase::kCollective, false, at);
      }
      for (size_t i = 0; s.ok() && i < t.parts.size(); ++i) {
        s = device->CopyOnDevice(t.parts[i].buffer, staging + layout.offsets[i],
                                 units[t.parts[i].unit].bytes, Stream::kCopy);
      }
      if (s.ok()) s = SyncCopies(Stream::kCopy);
      Mark(Phase::kHostToDevice, false, at);
    }
    for (size_t i = 0; i < host.size(); ++i) {
      Status r = transport->ReleaseParams(job, t.parts[i].unit);
      if (s.ok()) s = r;
    }
    ZT_RETURN_IF_ERROR(s);
    CountCopies(moved, copies, /*to_device=*/true);
    return Status::Ok();
  }

  Status Push(Transfer& t) {
    if (world > 1 && t.parts.size() > 1) return PushRun(t);
    if (world == 1 && SmallPush(units[t.parts[0].unit].shard * sizeof(bf16))) return PushSmall(t);
    const int unit = t.parts[0].unit;
    const UnitState& u = units[unit];
    // The compute stream's kernels that write the grads finish first (what
    // a wait spends here is compute).
    Clock::time_point at = Clock::now();
    ZT_RETURN_IF_ERROR(t.parts[0].ready->Synchronize());
    ZT_RETURN_IF_ERROR(device->Wait(Stream::kCopyOut, *t.parts[0].ready));
    at = Mark(Phase::kCompute, true, at);
    // The inbox is free once the engine has consumed the grads of the step
    // before: it has then published this version.
    ZT_RETURN_IF_ERROR(transport->WaitPublished(job, unit, t.version, options.timeout));
    at = Mark(Phase::kOptimizer, true, at);
    const void* src = t.parts[0].buffer;
    if (world > 1) {
      ZT_RETURN_IF_ERROR(collectives->ReduceScatter(static_cast<const bf16*>(src),
                                                    static_cast<bf16*>(shard_buffer), u.shard,
                                                    *device, Stream::kCopyOut));
      ZT_RETURN_IF_ERROR(SyncCopies(Stream::kCopyOut));
      at = Mark(Phase::kCollective, true, at);
      src = shard_buffer;
    }
    ZT_RETURN_IF_ERROR(device->CopyToHost(u.inbox, src, u.shard * sizeof(bf16), Stream::kCopyOut));
    ZT_RETURN_IF_ERROR(SyncCopies(Stream::kCopyOut));
    Mark(Phase::kDeviceToHost, true, at);
    ZT_RETURN_IF_ERROR(transport->GradsReady(job, unit, rank));
    CountCopies(u.shard * sizeof(bf16), 1, /*to_device=*/false);
    return Status::Ok();
  }

  // A small unit's grads (R = 1), with those of the small units queued
  // behind it that are ready (TakeReadyPushes): into the staging buffer on
  // the device, laid out as their inboxes are on the host, then in one copy
  // to the host.
  Status PushSmall(Transfer& t) {
    Clock::time_point at = Clock::now();
    ZT_RETURN_IF_ERROR(t.parts[0].ready->Synchronize());
    at = Mark(Phase::kCompute, true, at);
    ZT_RETURN_IF_ERROR(transport->WaitPublished(job, t.parts[0].unit, t.version, options.timeout));
    at = Mark(Phase::kOptimizer, true, at);
    TakeReadyPushes(t);
    std::vector<uint8_t*> host;
    std::vector<uint64_t> bytes;
    for (const Part& p : t.parts) {
      ZT_RETURN_IF_ERROR(device->Wait(Stream::kCopyOut, *p.ready));
      host.push_back(reinterpret_cast<uint8_t*>(units[p.unit].inbox));
      bytes.push_back(units[p.unit].shard * sizeof(bf16));
    }
    uint64_t moved = 0;
    int64_t copies = 0;
    std::optional<SpanLayout<uint8_t>> span;
    if (t.parts.size() > 1) span = Span(host, bytes, staging_bytes);
    if (span) {
      for (size_t i = 0; i < t.parts.size(); ++i) {
        ZT_RETURN_IF_ERROR(
            device->CopyOnDevice(static_cast<uint8_t*>(push_staging) + span->offsets[i],
                                 t.parts[i].buffer, bytes[i], Stream::kCopyOut));
      }
      ZT_RETURN_IF_ERROR(
          device->CopyToHost(span->start, push_staging, span->length, Stream::kCopyOut));
      moved = span->length;
      copies = 1;
    } else {
      for (size_t i = 0; i < t.parts.size(); ++i) {
        ZT_RETURN_IF_ERROR(
            device->CopyToHost(host[i], t.parts[i].buffer, bytes[i], Stream::kCopyOut));
        moved += bytes[i];
        ++copies;
      }
    }
    ZT_RETURN_IF_ERROR(SyncCopies(Stream::kCopyOut));
    Mark(Phase::kDeviceToHost, true, at);
    for (const Part& p : t.parts) ZT_RETURN_IF_ERROR(transport->GradsReady(job, p.unit, rank));
    CountCopies(moved, copies, /*to_device=*/false);
    return Status::Ok();
  }

  // A run of small units' pushes (R > 1), grouped by the caller (QueuePush):
  // each unit's full grads into the staging buffer at its inbox's offset in
  // the run's span (the gaps zero), one reduce-scatter of the span cut into
  // R chunks, this rank's chunk to the host, and the doorbells once every
  // rank's chunk has landed. Every unit's grads go as they would alone: the
  // sum over ranks is elementwise, so the grouping changes no bit.
  Status PushRun(Transfer& t) {
    Clock::time_point at = Clock::now();
    for (const Part& p : t.parts) {
      ZT_RETURN_IF_ERROR(p.ready->Synchronize());
      ZT_RETURN_IF_ERROR(device->Wait(Stream::kCopyOut, *p.ready));
    }
    at = Mark(Phase::kCompute, true, at);
    // Every inbox of the span is free: the engine consumed the step before's grads.
    for (const Part& p : t.parts) {
      ZT_RETURN_IF_ERROR(transport->WaitPublished(job, p.unit, t.version, options.timeout));
    }
    at = Mark(Phase::kOptimizer, true, at);
    std::vector<uint8_t*> host;
    std::vector<uint64_t> bytes;
    for (const Part& p : t.parts) {
      host.push_back(units[p.unit].inbox_start);
      bytes.push_back(units[p.unit].bytes);
    }
    const std::optional<SpanLayout<uint8_t>> span = Span(host, bytes, PushSpanCapacity());
    ZT_CHECK_MSG(span.has_value(), "a run of pushes whose inboxes are not one span");
    // The padding past the span is reduced but never copied.
    const uint64_t chunk = RunChunk(span->length);
    const uint64_t padded = chunk * world;
    auto* staging = static_cast<uint8_t*>(push_staging);
    ZT_RETURN_IF_ERROR(device->Memset(staging, 0, padded, Stream::kCopyOut));
    for (size_t i = 0; i < t.parts.size(); ++i) {
      ZT_RETURN_IF_ERROR(device->CopyOnDevice(staging + span->offsets[i], t.parts[i].buffer,
                                              bytes[i], Stream::kCopyOut));
    }
    ZT_RETURN_IF_ERROR(collectives->ReduceScatter(reinterpret_cast<const bf16*>(staging),
                                                  static_cast<bf16*>(push_chunk),
                                                  chunk / sizeof(bf16), *device, Stream::kCopyOut));
    ZT_RETURN_IF_ERROR(SyncCopies(Stream::kCopyOut));
    at = Mark(Phase::kCollective, true, at);
    // This rank's chunk, clipped to the span: the page after it may be the
    // next unit's inbox, holding grads the engine has not consumed.
    const uint64_t begin = static_cast<uint64_t>(rank) * chunk;
    const uint64_t mine = begin < span->length ? std::min(chunk, span->length - begin) : 0;
    if (mine > 0) {
      ZT_RETURN_IF_ERROR(
          device->CopyToHost(span->start + begin, push_chunk, mine, Stream::kCopyOut));
      ZT_RETURN_IF_ERROR(SyncCopies(Stream::kCopyOut));
    }
    at = Mark(Phase::kDeviceToHost, true, at);
    // A rank's shard may have come in another rank's chunk. This collective
    // completes on no rank before every rank has issued it, and each issues
    // it only once its own copy is done: after it, the whole span is in.
    auto* b = static_cast<bf16*>(barrier);
    ZT_RETURN_IF_ERROR(
        collectives->ReduceScatter(b, b + BarrierOutput(), 1, *device, Stream::kCopyOut));
    ZT_RETURN_IF_ERROR(SyncCopies(Stream::kCopyOut));
    Mark(Phase::kCollective, true, at);
    for (const Part& p : t.parts) ZT_RETURN_IF_ERROR(transport->GradsReady(job, p.unit, rank));
    CountCopies(mine, mine > 0 ? 1 : 0, /*to_device=*/false);
    return Status::Ok();
  }

  // ------------------------------------------------------------ caller side

  void Enqueue(Transfer t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++in_flight;
      (world == 1 && t.kind == Transfer::Kind::kPush ? push_queue : queue).push_back(std::move(t));
    }
    cv.notify_all();
  }

  // Queues the push of `p`'s unit: with R > 1 a small one joins the open
  // run if its whole inbox lies next to the run's span (pushes come in
  // backward order, so before it, usually) and the span stays within the
  // staging; whatever cannot join sends the run first.
  void QueuePush(Part p) {
    const UnitState& u = units[p.unit];
    const bool small = world > 1 && u.inbox_start != nullptr && SmallPush(u.shard * sizeof(bf16));
    uint8_t* const start = u.inbox_start;
    uint8_t* const end = small ? start + u.bytes : nullptr;
    if (run) {
      bool joins = false;
      if (small) {
        const bool after = start >= run_end && start - run_end < 4096;
        const bool before = run_start >= end && run_start - end < 4096;
        const auto length =
            static_cast<uint64_t>(std::max(end, run_end) - std::min(start, run_start));
        joins = (after || before) && length <= PushSpanCapacity();
      }
      if (joins) {
        run_start = std::min(start, run_start);
        run_end = std::max(end, run_end);
        run->parts.push_back(std::move(p));
        return;
      }
      QueueRun();
    }
    Transfer t{.kind = Transfer::Kind::kPush, .version = version, .parts = {}};
    t.parts.push_back(std::move(p));
    if (!small) {
      Enqueue(std::move(t));
      return;
    }
    run = std::move(t);
    run_start = start;
    run_end = end;
  }

  // Queues the open run of pushes, if any (alone, a unit goes as any push).
  void QueueRun() {
    if (!run) return;
    Enqueue(std::move(*run));
    run.reset();
  }

  Status Drain() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
    return failure;
  }

  Status CheckUnit(int unit, const char* what) const {
    if (unit < 0 || unit >= static_cast<int>(units.size())) {
      return Status::OutOfRange(StrCat(what, ": model '", model->spec().name, "' has no unit ",
                                       unit, " (it has ", units.size(), ")"));
    }
    return Status::Ok();
  }

  // No unit is acquired (what ends or undoes a micro-step needs).
  Status CheckNothingHeld(const char* what) const {
    for (const UnitState& u : units) {
      if (u.holds > 0) {
        return Status::FailedPrecondition(
            StrCat(what, ": unit '", u.name, "' is still acquired; release every unit first"));
      }
    }
    return Status::Ok();
  }

  // A known unit whose grads were not pushed yet this micro-step.
  Status CheckGradsOpen(int unit, const char* what) const {
    ZT_RETURN_IF_ERROR(CheckUnit(unit, what));
    if (units[unit].pushed) {
      return Status::FailedPrecondition(StrCat(what, ": the grads of unit '", units[unit].name,
                                               "' were already pushed this micro-step"));
    }
    return Status::Ok();
  }

  // Resident or in flight at the version this micro-step reads.
  bool Current(const UnitState& u) const { return u.params != nullptr && u.version == version; }

  // Weights replaced at the step they were at (set, loaded or imported
  // between steps; Engine::WeightsGeneration): the copies of that step on
  // the device are out of date, though Current says they are not (a
  // persistent unit served the old weights for good). They are fetched
  // again; one held now, after its last release. World size 1 only: with
  // R > 1 every rank would have to see the change at the same acquire, or
  // their all-gathers pair up wrong (each reads it when it happens to);
  // their runners are made again after a replacement (Stage3Runner).
  Status FollowWeights() {
    if (world > 1) return Status::Ok();
    ZT_ASSIGN_OR_RETURN(int64_t now, transport->WeightsGeneration(job));
    if (now == weights_generation) return Status::Ok();
    // A checkpoint of another step moves the job to its step: the runner's
    // with it (else it waited for a step the job would not reach, or
    // counted behind it). Between steps only: with a unit held, grads
    // pushed (or queued to be) or a window of micro-steps open, the
    // runner's step stays, and what it does next says what is wrong.
    const bool held =
        std::any_of(units.begin(), units.end(), [](const UnitState& u) { return u.holds > 0; });
    if (!held && !StepBegun()) {
      ZT_ASSIGN_OR_RETURN(const int64_t step, transport->TargetStep(job));
      if (step >= 0) version = step;
    }
    weights_generation = now;
    for (UnitState& u : units) {
      if (u.params == nullptr) continue;
      if (u.holds > 0) {
        u.stale = true;
        continue;
      }
      if (u.fetch != nullptr) (void)u.fetch->Wait();  // its error, if any, is in `failure`
      u.fetch.reset();
      u.version = -1;  // its buffer stays, for the fetch again
    }
    return Status::Ok();
  }

  static uint64_t PageRound(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

  // Whether a fetch or a push of this many bytes is coalesced with others.
  bool SmallFetch(uint64_t bytes) const {
    return fetch_staging != nullptr && bytes < options.coalesce_bytes;
  }
  bool SmallPush(uint64_t bytes) const {
    return push_staging != nullptr && bytes < options.coalesce_bytes;
  }
  // Whether a unit's fetch may go in a run of them (R > 1): not small, but
  // its shard is, and fetched at this version before (so published: a run
  // waits for every unit in it, and must never wait on the optimizer). A
  // run borrows the push staging: with R > 1 one thread runs every
  // transfer, one at a time.
  bool RunFetch(const UnitState& u) const {
    return world > 1 && fetch_runs && push_staging != nullptr && u.fetched == version &&
           u.bytes >= options.coalesce_bytes && SmallPush(u.shard * sizeof(bf16));
  }
  // The longest span of inboxes a push's staging holds.
  uint64_t PushSpanCapacity() const { return static_cast<uint64_t>(world) * staging_bytes; }
  // Where the barrier's output element lies in `barrier`, after its R inputs
  // (aligned as a buffer of its own).
  uint64_t BarrierOutput() const {
    return (static_cast<uint64_t>(world) + engine::kAlignElements - 1) / engine::kAlignElements *
           engine::kAlignElements;
  }

  // Points the unit's buffer (allocated now unless a persistent buffer is
  // kept) at the current version, for a fetch that `t` will carry.
  Status AddFetchPart(Transfer& t, int unit) {
    UnitState& u = units[unit];
    std::unique_ptr<Event> reads_done;
    if (u.params == nullptr) {
      ZT_ASSIGN_OR_RETURN(u.params, device->Allocate(u.bytes, MemoryPurpose::kParams));
      live_bytes += u.bytes;
    } else {
      ZT_ASSIGN_OR_RETURN(reads_done, device->Record(Stream::kCompute));
    }
    u.version = version;
    u.fetched = version;
    u.fetch = std::make_shared<Ticket>();
    ++stats.fetches;
    t.parts.push_back(
        {.unit = unit, .buffer = u.params, .ready = std::move(reads_done), .ticket = u.fetch});
    return Status::Ok();
  }

  // Queues the fetch of `unit` at the current version. A small unit takes
  // along the small units after it in the learned order from position
  // `next` (while this pass follows it) that are not current, as long as
  // they fit in one staging buffer and under the cap: one copy over the
  // link for all of them. A unit that may go in a run (RunFetch) takes
  // along those after it that may too and lie next to the run's units.
  Status QueueFetch(int unit, size_t next) {
    Transfer t{.kind = Transfer::Kind::kFetch, .version = version, .parts = {}};
    const bool run = RunFetch(units[unit]);
    ZT_RETURN_IF_ERROR(AddFetchPart(t, unit));
    Status refused;
    if (SmallFetch(units[unit].bytes)) {
      uint64_t span = PageRound(units[unit].bytes);
      for (size_t i = next; following && i < learned.size(); ++i) {
        const UnitState& w = units[learned[i]];
        if (Current(w)) continue;  // resident, in flight, or already in this copy
        if (!SmallFetch(w.bytes) || span + PageRound(w.bytes) > staging_bytes) break;
        const uint64_t need = w.params == nullptr ? w.bytes : 0;
        if (options.max_live_bytes > 0 && live_bytes + need > options.max_live_bytes) break;
        // A unit the device cannot take now is fetched on its own later
        // (AddFetchPart changes nothing when it fails).
        if (!AddFetchPart(t, learned[i]).ok()) break;
        span += PageRound(w.bytes);
      }
    } else if (run) {
      // Units side by side in the engine's memory (each next to the run's
      // units, in either direction), while their span fits the staging.
      int lo = unit, hi = unit;
      for (size_t i = next; following && i < learned.size(); ++i) {
        const int k = learned[i];
        const UnitState& w = units[k];
        if (Current(w)) continue;
        if (!RunFetch(w) || (k != lo - 1 && k != hi + 1)) break;
        uint64_t span = 0;
        for (int j = std::min(lo, k); j <= std::max(hi, k); ++j) {
          span = PageRound(span) + units[j].bytes;
        }
        if (span > PushSpanCapacity()) break;
        const uint64_t need = w.params == nullptr ? w.bytes : 0;
        if (options.max_live_bytes > 0 && live_bytes + need > options.max_live_bytes) break;
        // A unit the device cannot take now fails the fetch (its callers
        // fail the rank): a shorter run here than the peers' would be an
        // all-gather of another size, and the unit's own fetch later one
        // they never make. What was added still goes, to be waited on.
        refused = AddFetchPart(t, k);
        if (!refused.ok()) break;
        lo = std::min(lo, k);
        hi = std::max(hi, k);
      }
      // Alone, a unit goes as any (straight into its buffer).
      t.run = t.parts.size() > 1;
    }
    Enqueue(std::move(t));
    return refused;
  }

  // Gives a unit's buffer back to the device (after its fetch is done).
  void Evict(UnitState& u) {
    if (u.fetch != nullptr) (void)u.fetch->Wait();  // its error, if any, is in `failure`
    u.fetch.reset();
    device->Free(u.params);
    u.params = nullptr;
    u.version = -1;
    live_bytes -= u.bytes;
  }

  bool InWindow(int unit) const {
    if (!following || options.prefetch_depth <= 0) return false;
    const size_t end = std::min(learned.size(), position + options.prefetch_depth);
    for (size_t i = position; i < end; ++i) {
      if (learned[i] == unit) return true;
    }
    return false;
  }

  // Queues the units at positions [from, from + depth) of the learned order
  // that are not current, while they fit under the cap. Best effort: it
  // stops at a unit it cannot queue now (the device out of memory, say),
  // which its own Acquire fetches then, making room under the cap or
  // failing with the reason; the call that prefetched (another unit's
  // Acquire, a Step the engine already took) does not fail for it. With
  // R > 1 the rank fails instead: its peers' prefetches went on, and their
  // collectives would pair with another unit's or a push's of this rank
  // (wrong params or a hang).
  void Prefetch(size_t from) {
    const size_t end = std::min(learned.size(), from + std::max(0, options.prefetch_depth));
    for (size_t i = from; i < end; ++i) {
      UnitState& u = units[learned[i]];
      if (Current(u)) continue;
      const uint64_t need = u.params == nullptr ? u.bytes : 0;
      if (options.max_live_bytes > 0 && live_bytes + need > options.max_live_bytes) break;
      const Status s = QueueFetch(learned[i], i + 1);
      if (!s.ok() && world > 1) {
        RecordFailure(Status(
            s.code(),
            StrCat("prefetch of unit '", u.name, "': ", s.message(), "; with ", world,
                   " ranks every rank must prefetch alike (each fetch is a collective), "
                   "so a prefetch the device cannot make fails the rank: cap the live bytes "
                   "(max_live_bytes, stage3_max_live_parameters) below the device's free memory")));
        return;
      }
      if (!s.ok() && s.code() != StatusCode::kResourceExhausted) {
        // Another error (the device's) is the unit's: its Acquire meets it
        // again and says it; nothing more is prefetched past it now.
        ZT_LOG(kDebug, "client") << "prefetch of unit '" << u.name << "': " << s;
        break;
      }
      if (!s.ok()) {
        ++stats.prefetches_refused;
        if (stats.prefetches_refused == 1) {
          ZT_LOG(kWarn, "client")
              << "model '" << model->spec().name << "' rank " << rank << ": prefetch of unit '"
              << u.name << "' stopped (" << s
              << "); it is fetched when acquired. A cap on the live bytes "
                 "(max_live_bytes) below the device's free memory keeps the prefetch "
                 "within it (said once)";
        }
        break;
      }
    }
  }

  // Makes room under the cap for `unit` by evicting unheld units, the ones
  // needed last first. Errors: ResourceExhausted when held units fill it.
  Status MakeRoom(int unit) {
    const UnitState& want = units[unit];
    if (options.max_live_bytes == 0 || want.params != nullptr) return Status::Ok();
    if (live_bytes + want.bytes <= options.max_live_bytes) return Status::Ok();
    // Each unit's next use in the learned order from here (none: farthest),
    // found in one pass: a scan per unit made each eviction cost units x
    // order length.
    std::vector<size_t> next_use(units.size(), SIZE_MAX);
    for (size_t i = learned.size(); i-- > position;) next_use[learned[i]] = i;
    while (live_bytes + want.bytes > options.max_live_bytes) {
      int victim = -1;
      size_t victim_next = 0;
      for (int k = 0; k < static_cast<int>(units.size()); ++k) {
        const UnitState& u = units[k];
        if (k == unit || u.params == nullptr || u.holds > 0) continue;
        const size_t next = next_use[k];
        if (victim < 0 || next > victim_next) {
          victim = k;
          victim_next = next;
        }
      }
      if (victim < 0) {
        std::string held;
        for (const UnitState& u : units) {
          if (u.holds > 0) held += StrCat(held.empty() ? "" : ", ", u.name, " (", u.bytes, " B)");
        }
        return Status::ResourceExhausted(
            StrCat("unit '", want.name, "' needs ", want.bytes, " bytes on the device, but the ",
                   "live-bytes cap of ", options.max_live_bytes, " bytes is held by: ", held,
                   "; release units first or raise max_live_bytes"));
      }
      Evict(units[victim]);
    }
    return Status::Ok();
  }

  // Ends the active order's pass: a pass that left the learned order (or
  // the first pass) becomes the learned one; the next pass starts over.
  void FinishPass() {
    if (!recording.empty() && (learned.empty() || !following)) learned = recording;
    recording.clear();
    position = 0;
    following = !learned.empty();
  }

  // Parks the active order and makes `key`'s active (empty if new).
  void SwitchOrder(int key) {
    orders[order_key] = Order{std::move(learned), std::move(recording), position, following};
    Order next;
    if (auto it = orders.find(key); it != orders.end()) {
      next = std::move(it->second);
      orders.erase(it);
    }
    learned = std::move(next.learned);
    recording = std::move(next.recording);
    position = next.position;
    following = next.following;
    order_key = key;
  }

  void Learn(int unit) {
    recording.push_back(unit);
    if (!following) return;
    if (position < learned.size() && learned[position] == unit) {
      ++position;
      return;
    }
    following = false;
    ++stats.order_changes;
    ZT_LOG(kInfo, "client") << "model '" << model->spec().name << "' rank " << rank
                            << ": unit order changed at acquire " << position << " (expected "
                            << (position < learned.size() ? units[learned[position]].name
                                                          : std::string("none"))
                            << ", got " << units[unit].name
                            << "); prefetching stops until the new order is learned at Step()";
  }
};

Stage3Runner::Stage3Runner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Stage3Runner::~Stage3Runner() {
  // A forked child's copy is left alone (client/transport.h ProcessOwner):
  // its transfer threads, their condition variables' waiters, the device
  // and the engine are the parent's.
  if (impl_->owner.forked()) (void)impl_.release();
}

Result<std::unique_ptr<Stage3Runner>> Stage3Runner::Create(Model& model, int rank, Device& device,
                                                           Collectives* collectives,
                                                           const RunnerOptions& options) {
  const Session::ModelSpec& spec = model.spec();
  const std::string who = StrCat("model '", spec.name, "' rank ", rank);
  if (rank < 0 || rank >= spec.world_size) {
    return Status::InvalidArgument(
        StrCat(who, ": rank out of range for world size ", spec.world_size));
  }
  if (model.attached_rank() >= 0 && rank != model.attached_rank()) {
    return Status::InvalidArgument(
        StrCat(who, ": this process attached to the model as rank ", model.attached_rank()));
  }
  if ((spec.world_size > 1 || collectives != nullptr) &&
      (collectives == nullptr || collectives->world_size() != spec.world_size ||
       collectives->rank() != rank)) {
    return Status::InvalidArgument(
        StrCat(who, ": world size ", spec.world_size,
               " needs collectives of that size for this rank (got ",
               collectives == nullptr
                   ? std::string("none")
                   : StrCat("rank ", collectives->rank(), " of ", collectives->world_size()),
               ")"));
  }
  if (options.coalesce_bytes > (uint64_t{1} << 30)) {
    return Status::InvalidArgument(
        StrCat(who, ": coalesce_bytes ", options.coalesce_bytes, " is over 1 GiB"));
  }
  if (options.prefetch_depth < 0) {
    return Status::InvalidArgument(
        StrCat(who, ": prefetch depth ", options.prefetch_depth, " < 0"));
  }
  if (options.timeout.count() < 0) {
    return Status::InvalidArgument(
        StrCat(who, ": timeout ", options.timeout.count(), " ms is negative"));
  }
  auto impl = std::make_unique<Impl>();
  Impl& r = *impl;
  r.model = &model;
  r.transport = &model.transport();
  r.device = &device;
  r.collectives = collectives;
  r.options = options;
  r.rank = rank;
  {
    std::lock_guard<std::mutex> lock(model.runners_mu_);
    if (!model.runner_ranks_.insert(rank).second) {
      return Status::FailedPrecondition(
          StrCat(who, ": this process already has a runner for that rank (its pushes would add ",
                 "to the other's in one step); destroy that runner first"));
    }
  }
  r.claimed_rank = true;
  r.world = spec.world_size;
  r.job = model.job();
  r.accumulation = spec.optimizer.grad_accumulation;
  ZT_ASSIGN_OR_RETURN(r.client_counters, r.transport->ClientCounters(r.job, rank));
  uint64_t max_shard = 0;
  for (int k = 0; k < model.units(); ++k) {
    const engine::UnitLayout& l = model.layout(k);
    UnitState u;
    u.name = spec.units[k].name;
    u.padded = l.padded;
    u.shard = l.shard;
    u.bytes = l.padded * sizeof(bf16);
    u.persistent = u.bytes <= options.persistence_threshold;
    if (options.max_live_bytes > 0 && u.bytes > options.max_live_bytes) {
      return Status::InvalidArgument(StrCat(who, ": unit '", u.name, "' takes ", u.bytes,
                                            " bytes, more than the live-bytes cap of ",
                                            options.max_live_bytes));
    }
    ZT_ASSIGN_OR_RETURN(u.inbox, r.transport->GradInbox(r.job, k, rank));
    max_shard = std::max(max_shard, l.shard);
    Result<int64_t> published = r.transport->PublishedStep(r.job, k);
    if (published.ok() && *published < 0 && model.attached_rank() >= 0) {
      // A rank in another process starts beside rank 0, which sets the
      // weights: wait for them (as long as a transfer may wait).
      ZT_RETURN_IF_ERROR(r.transport->WaitPublished(r.job, k, 0, options.timeout)
                             .Annotate(StrCat(who, ": waiting for rank 0 to set the weights")));
      published = r.transport->PublishedStep(r.job, k);
    }
    if (!published.ok()) return published.status().Annotate(who);
    if (*published < 0) {
      return Status::FailedPrecondition(
          StrCat(who, ": unit '", u.name,
                 "' has no weights yet; set them (SetWeights, ImportSafetensors or "
                 "LoadCheckpoint) before creating a runner"));
    }
    r.units.push_back(std::move(u));
  }
  // A step may still be running (another runner's Step() returns before the
  // engine's optimizer is done, and exact mode publishes units in forward
  // order): this runner reads the step the engine is heading to. (The lowest
  // published step would copy params the optimizer is rewriting and push
  // grads into an inbox it still reads.)
  // The weights every unit has now (each published above): a change after
  // this is one the runner's copies may not have.
  ZT_ASSIGN_OR_RETURN(r.weights_generation, r.transport->WeightsGeneration(r.job));
  Result<int64_t> target = r.transport->TargetStep(r.job);
  if (!target.ok()) return target.status().Annotate(who);
  r.version = *target;
  if (r.version < 0) {
    return Status::FailedPrecondition(StrCat(who, ": the job is gone or has no weights"));
  }
  // The job's regions, for DMA; unregistered when the runner goes (before
  // the job, which unmaps them).
  for (const HostRegion& region : r.transport->PinnedRegions(r.job)) {
    ZT_RETURN_IF_ERROR(device.RegisterHost(region.base, region.bytes, region.access));
    r.host_ranges.emplace_back(region.base, region.bytes);
  }
  if (r.world > 1) {
    ZT_ASSIGN_OR_RETURN(r.shard_buffer,
                        device.Allocate(max_shard * sizeof(bf16), MemoryPurpose::kGrads));
  }
  // A unit's whole inbox, its R shards in rank order (Engine::GradInbox),
  // for runs of pushes; one outside the registered regions (no engine lays
  // it out so, but this rank could not copy it) is pushed alone.
  for (UnitState& u : r.units) {
    auto* start = reinterpret_cast<uint8_t*>(u.inbox - static_cast<uint64_t>(rank) * u.shard);
    for (const auto& [base, bytes] : r.host_ranges) {
      auto* b = static_cast<uint8_t*>(base);
      if (start >= b && start + u.bytes <= b + bytes) u.inbox_start = start;
    }
  }
  // Staging for coalesced copies, when some unit is small: fetches with
  // params in DRAM (the engine's publish buffers lie in unit order; on NVMe
  // a fetch takes a param cache slot per unit, and a run of units could
  // hold them all) and a unit under coalesce_bytes; pushes with a shard
  // under it. With R > 1 a push run's staging holds the span of its units'
  // whole inboxes (R x coalesce_bytes), the reduce-scatter's output one
  // chunk of it (coalesce_bytes).
  r.staging_bytes = Impl::PageRound(options.coalesce_bytes);
  const bool small_unit = std::any_of(r.units.begin(), r.units.end(), [&](const UnitState& u) {
    return u.bytes < options.coalesce_bytes;
  });
  const bool small_shard = std::any_of(r.units.begin(), r.units.end(), [&](const UnitState& u) {
    return u.shard * sizeof(bf16) < options.coalesce_bytes;
  });
  r.fetch_runs = r.world > 1 && spec.param_tier == engine::Tier::kDram;
  if (small_unit && spec.param_tier == engine::Tier::kDram) {
    ZT_ASSIGN_OR_RETURN(r.fetch_staging, device.Allocate(r.staging_bytes, MemoryPurpose::kOther));
  }
  if (small_shard) {
    ZT_ASSIGN_OR_RETURN(r.push_staging,
                        device.Allocate(r.PushSpanCapacity(), MemoryPurpose::kOther));
    if (r.world == 1) {
      // What lies between the units' grads in a coalesced push reaches the
      // host too (the unused tails of their inboxes' pages): zeros. (With
      // R > 1 each run zeroes its span first.)
      ZT_RETURN_IF_ERROR(device.Memset(r.push_staging, 0, r.staging_bytes, Stream::kCopyOut));
    } else {
      ZT_ASSIGN_OR_RETURN(r.push_chunk, device.Allocate(r.staging_bytes, MemoryPurpose::kOther));
      const uint64_t barrier_bytes = (r.BarrierOutput() + engine::kAlignElements) * sizeof(bf16);
      ZT_ASSIGN_OR_RETURN(r.barrier, device.Allocate(barrier_bytes, MemoryPurpose::kOther));
      ZT_RETURN_IF_ERROR(device.Memset(r.barrier, 0, barrier_bytes, Stream::kCopyOut));
    }
    ZT_RETURN_IF_ERROR(r.SyncCopies(Stream::kCopyOut));
  }
  ZT_ASSIGN_OR_RETURN(r.thread,
                      StartThread("the runner's transfer thread", [&r] { r.Loop(r.queue); }));
  if (r.world == 1) {
    ZT_ASSIGN_OR_RETURN(r.push_thread, StartThread("the runner's grad push thread",
                                                   [&r] { r.Loop(r.push_queue); }));
  }
  return std::unique_ptr<Stage3Runner>(new Stage3Runner(std::move(impl)));
}

Result<const bf16*> Stage3Runner::Acquire(int unit) {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.CheckAlive());
  ZT_RETURN_IF_ERROR(r.CheckUnit(unit, "Acquire"));
  UnitState& u = r.units[unit];
  ZT_RETURN_IF_ERROR(r.FollowWeights());
  r.Learn(unit);
  if (r.Current(u)) {
    ++r.stats.prefetch_hits;
  } else {
    if (u.holds > 0) {  // held at an older version: a Step() came in between
      return Status::FailedPrecondition(
          StrCat("Acquire: unit '", u.name, "' is still held from the previous step"));
    }
    ZT_RETURN_IF_ERROR(r.MakeRoom(unit));  // (each rank alike: the caps are the same)
    ZT_RETURN_IF_ERROR(r.FailsRank(r.QueueFetch(unit, r.position)));
  }
  if (r.following) r.Prefetch(r.position);
  const Clock::time_point t0 = Clock::now();
  Status s = u.fetch != nullptr ? u.fetch->Wait() : Status::Ok();
  const Clock::time_point t1 = Clock::now();
  r.stats.acquire_wait_seconds += std::chrono::duration<double>(t1 - t0).count();
  r.Attribute(t0, t1, Phase::kHostToDevice, /*for_push=*/false);
  if (!s.ok()) return s.Annotate(StrCat("fetch unit '", u.name, "' at step ", u.version));
  // Kernels on the compute stream see the copy (complete: the fetch synchronized it).
  ++u.holds;
  u.acquired_at = Clock::now();
  return static_cast<const bf16*>(u.params);
}

Status Stage3Runner::Release(int unit) {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.owner.Check("Release"));
  ZT_RETURN_IF_ERROR(r.CheckUnit(unit, "Release"));
  UnitState& u = r.units[unit];
  if (u.holds == 0) {
    return Status::FailedPrecondition(StrCat("Release: unit '", u.name, "' is not acquired"));
  }
  if (r.options.record_compute_spans) {
    r.device->AddSpan(
        {.stream = Stream::kCompute, .label = u.name, .start = u.acquired_at, .end = Clock::now()});
  }
  if (--u.holds > 0) return Status::Ok();
  if (u.stale) {  // the weights were replaced while it was held
    u.stale = false;
    u.version = -1;
  }
  if (u.persistent || r.InWindow(unit)) return Status::Ok();
  r.Evict(u);  // its fetch is done: it was acquired
  return Status::Ok();
}

Result<bf16*> Stage3Runner::GradBuffer(int unit) {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.CheckAlive());
  ZT_RETURN_IF_ERROR(r.CheckGradsOpen(unit, "GradBuffer"));
  UnitState& u = r.units[unit];
  if (u.grads == nullptr) {
    Result<void*> grads = r.device->Allocate(u.bytes, MemoryPurpose::kGrads);
    ZT_RETURN_IF_ERROR(r.FailsRank(grads.status()));
    u.grads = *grads;
    ZT_RETURN_IF_ERROR(r.FailsRank(r.device->Memset(u.grads, 0, u.bytes, Stream::kCompute)));
  }
  return static_cast<bf16*>(u.grads);
}

Status Stage3Runner::PushGrads(int unit) {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.CheckAlive());
  ZT_RETURN_IF_ERROR(r.CheckGradsOpen(unit, "PushGrads"));
  UnitState& u = r.units[unit];
  if (u.grads == nullptr) {
    return Status::FailedPrecondition(
        StrCat("PushGrads: unit '", u.name, "' has no grad buffer (call GradBuffer first)"));
  }
  Result<std::unique_ptr<Event>> ready = r.device->Record(Stream::kCompute);
  ZT_RETURN_IF_ERROR(r.FailsRank(ready.status()));
  Part part{.unit = unit,
            .buffer = u.grads,
            .ready = *std::move(ready),
            .ticket = std::make_shared<Ticket>()};
  u.grads = nullptr;
  u.pushed = true;
  r.QueuePush(std::move(part));
  return Status::Ok();
}

Status Stage3Runner::PushGrads(int unit, const bf16* grads, uint64_t count) {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.CheckAlive());
  ZT_RETURN_IF_ERROR(r.CheckUnit(unit, "PushGrads"));
  const engine::UnitLayout& l = r.model->layout(unit);
  if (grads == nullptr || (count != l.numel && count != l.padded)) {
    return Status::InvalidArgument(StrCat("PushGrads: unit '", r.units[unit].name, "' takes ",
                                          l.numel, " grads (or ", l.padded, " padded), got ",
                                          grads == nullptr ? std::string("null") : StrCat(count)));
  }
  ZT_ASSIGN_OR_RETURN(bf16 * buffer, GradBuffer(unit));
  ZT_RETURN_IF_ERROR(
      r.FailsRank(r.device->CopyOnDevice(buffer, grads, count * sizeof(bf16), Stream::kCompute)));
  return PushGrads(unit);
}

Status Stage3Runner::Step() {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.owner.Check("Step"));  // before QueueRun's lock
  // The open run of pushes goes first, whatever Step finds wrong: the
  // peers' runs go at their Step(), and a push made is a push sent.
  r.QueueRun();
  // A transfer that failed (a ztierd that went away, say) is the cause of
  // whatever else is wrong with this micro-step: say it first.
  ZT_RETURN_IF_ERROR(r.CheckAlive());
  std::string missing;
  int pushed = 0;
  for (const UnitState& u : r.units) {
    if (u.pushed) {
      ++pushed;
    } else if (missing.size() < 200) {
      missing += StrCat(missing.empty() ? "" : ", ", u.name);
    }
  }
  if (pushed == 0) {
    return Status::FailedPrecondition(
        StrCat("Step: no grads were pushed since the last Step() of model '", r.model->spec().name,
               "' (Step called twice?)"));
  }
  if (pushed < static_cast<int>(r.units.size())) {
    return Status::FailedPrecondition(StrCat("Step: ", r.units.size() - pushed,
                                             " units have no grads this micro-step: ", missing));
  }
  ZT_RETURN_IF_ERROR(r.CheckNothingHeld("Step"));
  const Clock::time_point t0 = Clock::now();
  Status s = r.Drain();
  const Clock::time_point t1 = Clock::now();
  r.stats.step_wait_seconds += std::chrono::duration<double>(t1 - t0).count();
  r.Attribute(t0, t1, Phase::kDeviceToHost, /*for_push=*/true);
  ZT_RETURN_IF_ERROR(s);
  for (UnitState& u : r.units) {
    u.pushed = false;
    if (u.params != nullptr && !u.persistent) r.Evict(u);  // prefetched, never used
    u.fetch.reset();
  }
  ++r.stats.micro_steps;
  if (++r.micro % r.accumulation == 0) ++r.version;
  if (r.order_key != 0) {  // a pass of another kind was open: it ends here
    r.FinishPass();
    r.SwitchOrder(0);
  }
  r.FinishPass();
  if (r.following) r.Prefetch(0);
  return Status::Ok();
}

Result<int> Stage3Runner::AbortStep() {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.CheckAlive());
  if (r.world > 1) {
    return Status::FailedPrecondition(
        StrCat("AbortStep: model '", r.model->spec().name, "' trains on ", r.world,
               " ranks, whose collectives a failed backward on one leaves waiting: restart the "
               "job from its last checkpoint"));
  }
  ZT_RETURN_IF_ERROR(r.CheckNothingHeld("AbortStep"));
  ZT_RETURN_IF_ERROR(r.Drain());
  ZT_ASSIGN_OR_RETURN(int complete, r.transport->AbortStep(r.job, r.version + 1));
  // The runner's own state first, as the engine's now is: the step afresh.
  for (UnitState& u : r.units) u.pushed = false;
  r.micro -= r.micro % r.accumulation;
  // A pass cut short teaches no order: neither the active kind's (parked
  // by the switch, it was learned at that kind's next pass) nor training's.
  const auto forget_pass = [&r] {
    r.recording.clear();
    r.position = 0;
    r.following = !r.learned.empty();
  };
  forget_pass();
  if (r.order_key != 0) {
    r.SwitchOrder(0);
    forget_pass();
  }
  for (UnitState& u : r.units) {
    if (u.grads != nullptr) {
      ZT_RETURN_IF_ERROR(r.device->Memset(u.grads, 0, u.bytes, Stream::kCompute));
    }
  }
  if (r.following) r.Prefetch(0);
  return complete;
}

Result<int> Stage3Runner::ReleaseAll() {
  int released = 0;
  for (int k = 0; k < static_cast<int>(impl_->units.size()); ++k) {
    while (impl_->units[k].holds > 0) {
      ZT_RETURN_IF_ERROR(Release(k));
      ++released;
    }
  }
  return released;
}

Status Stage3Runner::SetOrder(int key) {
  Impl& r = *impl_;
  ZT_RETURN_IF_ERROR(r.owner.Check("SetOrder"));
  if (key < 0) return Status::InvalidArgument(StrCat("SetOrder: key ", key, " < 0"));
  if (key == r.order_key && key == 0) return Status::Ok();
  if (r.order_key != 0) r.FinishPass();  // that kind's pass ends
  if (key != r.order_key) r.SwitchOrder(key);
  if (key != 0) r.FinishPass();  // a new pass of this kind
  if (r.following) r.Prefetch(r.position);
  return Status::Ok();
}

int Stage3Runner::order_key() const { return impl_->order_key; }

int64_t Stage3Runner::version() const { return impl_->version; }

RunnerStats Stage3Runner::stats() const {
  Impl& r = *impl_;
  RunnerStats s = r.stats;
  if (r.owner.forked()) return s;  // the transfer threads' lock is the parent's
  std::lock_guard<std::mutex> lock(r.mu);
  s.h2d_bytes = r.h2d;
  s.d2h_bytes = r.d2h;
  s.h2d_copies = r.h2d_copies;
  s.d2h_copies = r.d2h_copies;
  return s;
}

std::vector<int> Stage3Runner::learned_order() const { return impl_->learned; }

}  // namespace ztier::client
