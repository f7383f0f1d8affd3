// Job collectives (client::MakeJobCollectives): the ranks of one job meet
// in the job's collective region (Transport::CollectiveRegion), memory every
// rank maps read-write whether it is a thread of this process or a process
// attached through ztierd.
//
// Region layout (after engine/wire_types.h's two words, which ztierd also
// writes):
//   u32 abort       0, or 1 + the rank that left or gave up, or
//                   kCollectiveEndedByDaemon (ztierd evicted or stopped the job)
//   u32 generation  the barrier's generation; the futex every waiter sleeps on
//   u32 arrived     ranks at the barrier now
//   u32 world       the world size, set by the first rank (a check)
//   u32 nccl_round  how many NCCL ids rank 0 has handed out
//   u8[128] at 64   the latest NCCL unique id
//   u32[] at 256    per rank: the NCCL ids it has taken
//   from kCollectiveHeaderBytes: one slot of kSlotBytes per rank
//
// Host devices: a collective moves its buffers through the slots in chunks
// (copy in, barrier, read the peers' slots, barrier). The reduction sums
// in fp32 in rank order and rounds to bf16 once, as the local backend
// does, so the results are bit-identical to MakeLocalCollectives whatever
// the chunking. The barrier is a counter and a generation word with
// FUTEX_WAIT / FUTEX_WAKE on shared (not private) futexes, so it works
// across processes.
//
// CUDA devices: NCCL (MakeNcclRankCollectives); rank 0 makes the unique id
// and publishes it in the region, the others wait for it. The region's
// abort word also ends NCCL's waits (NcclPeers), and a rank that gives up
// there marks it.
//
// Thread safety: one object per rank, used by that rank's thread. Failure:
// a rank that left (ztierd writes the abort word when its connection
// closes) fails every waiting and later collective of the others with
// Aborted naming it; a job ztierd ended (evicted, ztierd stopping) fails
// them with ztierd's reason, which the next request on the job brings; a
// ztierd that is gone (its transport's Health, checked as a waiter wakes)
// fails them with Unavailable saying so, not at the timeout; a rank that
// waits longer than the timeout (the caller's; ztier.torch passes
// ztier.wait_timeout) gives up with Unavailable and marks the region
// aborted, so its peers stop too.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "client/transport.h"
#include "client/ztier.h"
#include "common/numbers.h"
#include "engine/wire_types.h"

namespace ztier::client {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kSlotBytes = engine::kCollectiveSlotBytes;
constexpr uint64_t kArrivedOffset = 8;
constexpr uint64_t kWorldOffset = 12;
constexpr uint64_t kNcclRoundOffset = 16;
constexpr uint64_t kNcclIdOffset = 64;
constexpr uint64_t kNcclTakenOffset = 256;  // u32 per rank: the NCCL ids it has taken
constexpr uint64_t kMaxNcclRanks = (engine::kCollectiveHeaderBytes - kNcclTakenOffset) / 4;
constexpr std::chrono::milliseconds kWakeCheck{100};  // abort checks while asleep
// How long a rank told that ztierd ended its job waits to hear why.
constexpr std::chrono::seconds kFarewellWait{3};

// Why the job's engine is of no more use: Ok while it is (the transport's
// Health); the reason ztierd ended the job, asked for when the region says
// it did.
class EngineWatch {
 public:
  EngineWatch(std::weak_ptr<Transport> transport, int job)
      : transport_(std::move(transport)), job_(job), ended_(std::make_shared<Ended>()) {}
  Status Health() const {
    std::shared_ptr<Transport> t = transport_.lock();
    return t == nullptr ? Status::Ok() : t->Health();
  }
  // An evicted job's next request is refused with the eviction's reason;
  // a stopping ztierd says why as it closes each connection, this one
  // perhaps a moment after the one whose close woke the waiters.
  // Asked once; the answer is kept for every later collective (and copy).
  Status WhyEnded() const {
    std::lock_guard<std::mutex> lock(ended_->mu);
    if (!ended_->why.has_value()) ended_->why = AskWhyEnded();
    return *ended_->why;
  }

 private:
  struct Ended {
    std::mutex mu;
    std::optional<Status> why;
  };
  Status AskWhyEnded() const {
    std::shared_ptr<Transport> t = transport_.lock();
    if (t != nullptr) {
      Result<engine::JobCounters> c = t->Counters(job_);
      if (!c.ok()) return c.status();
      const auto deadline = std::chrono::steady_clock::now() + kFarewellWait;
      while (std::chrono::steady_clock::now() < deadline) {
        ZT_RETURN_IF_ERROR(t->Health());
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    return Status::Aborted("ztierd ended the job (an operator's eviction, or ztierd stopping)");
  }

  std::weak_ptr<Transport> transport_;
  int job_;
  std::shared_ptr<Ended> ended_;
};

// The shared words of the region's header.
class RegionHeader {
 public:
  RegionHeader(void* base, const EngineWatch& watch)
      : base_(static_cast<char*>(base)), watch_(watch) {}

  std::atomic_ref<uint32_t> word(uint64_t offset) const {
    return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(base_ + offset));
  }
  std::atomic_ref<uint32_t> abort() const { return word(engine::kCollectiveAbortOffset); }
  std::atomic_ref<uint32_t> generation() const { return word(engine::kCollectiveFutexOffset); }
  char* at(uint64_t offset) const { return base_ + offset; }

  // Aborted naming the rank that left, ztierd's reason for ending the job,
  // Unavailable when ztierd is gone, or OK.
  Status CheckAbort(const std::string& who) const {
    const uint32_t a = abort().load();
    if (a == engine::kCollectiveEndedByDaemon) return watch_.WhyEnded().Annotate(who);
    if (a != 0) {
      return Status::Aborted(
          StrCat(who, ": rank ", a - 1,
                 " left the job (its process exited, it failed, or it gave up waiting)"));
    }
    return watch_.Health().Annotate(who);
  }
  // Marks the region aborted by `rank` (the first mark stays) and wakes
  // every waiter.
  void Abort(int rank) const {
    uint32_t none = 0;
    abort().compare_exchange_strong(none, static_cast<uint32_t>(rank) + 1);
    WakeAll();
  }
  void WakeAll() const {
    ::syscall(SYS_futex, at(engine::kCollectiveFutexOffset), FUTEX_WAKE, INT32_MAX, nullptr,
              nullptr, 0);
  }
  // Sleeps while the generation is `seen`, at most kWakeCheck.
  void Sleep(uint32_t seen) const {
    timespec ts{.tv_sec = 0, .tv_nsec = kWakeCheck.count() * 1000 * 1000};
    ::syscall(SYS_futex, at(engine::kCollectiveFutexOffset), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }

 private:
  char* base_;
  const EngineWatch& watch_;
};

class ShmCollectives final : public Collectives {
 public:
  // Shares the ownership of the mapping (`region`).
  ShmCollectives(std::shared_ptr<void> region, EngineWatch watch, int rank, int world,
                 std::string who, std::chrono::milliseconds timeout)
      : region_(std::move(region)),
        watch_(std::move(watch)),
        h_(region_.get(), watch_),
        rank_(rank),
        world_(world),
        who_(std::move(who)),
        timeout_(timeout) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  void Abort(std::string_view reason) override {
    (void)reason;  // the region keeps the rank, which its peers name
    h_.Abort(rank_);
  }

  Status AllGather(bf16* buffer, size_t shard_elems, Device& device, Stream stream) override {
    ZT_RETURN_IF_ERROR(CheckHost(device));
    ZT_RETURN_IF_ERROR(device.Synchronize(stream));  // this rank's shard has landed
    const size_t chunk = kSlotBytes / sizeof(bf16);
    for (size_t off = 0; off < shard_elems; off += chunk) {
      const size_t n = std::min(chunk, shard_elems - off);
      std::memcpy(slot(rank_), buffer + rank_ * shard_elems + off, n * sizeof(bf16));
      ZT_RETURN_IF_ERROR(Barrier("all-gather"));
      for (int r = 0; r < world_; ++r) {
        if (r != rank_) std::memcpy(buffer + r * shard_elems + off, slot(r), n * sizeof(bf16));
      }
      ZT_RETURN_IF_ERROR(Barrier("all-gather"));
    }
    return Status::Ok();
  }

  Status ReduceScatter(const bf16* input, bf16* output, size_t shard_elems, Device& device,
                       Stream stream) override {
    ZT_RETURN_IF_ERROR(CheckHost(device));
    ZT_RETURN_IF_ERROR(device.Synchronize(stream));
    const size_t chunk = kSlotBytes / sizeof(bf16) / world_;
    for (size_t off = 0; off < shard_elems; off += chunk) {
      const size_t n = std::min(chunk, shard_elems - off);
      for (int d = 0; d < world_; ++d) {
        std::memcpy(slot(rank_) + d * chunk, input + d * shard_elems + off, n * sizeof(bf16));
      }
      ZT_RETURN_IF_ERROR(Barrier("reduce-scatter"));
      for (size_t i = 0; i < n; ++i) {
        float sum = 0.0f;
        for (int r = 0; r < world_; ++r) sum += Bf16ToFloat(slot(r)[rank_ * chunk + i]);
        output[off + i] = FloatToBf16(sum);
      }
      ZT_RETURN_IF_ERROR(Barrier("reduce-scatter"));
    }
    return Status::Ok();
  }

 private:
  bf16* slot(int r) const {
    return reinterpret_cast<bf16*>(h_.at(engine::kCollectiveHeaderBytes + r * kSlotBytes));
  }

  Status CheckHost(const Device& device) const {
    if (device.kind() != DeviceKind::kHost) {
      return Status::InvalidArgument(
          StrCat(who_, ": shared-memory collectives need host devices, got '", device.name(), "'"));
    }
    return h_.CheckAbort(who_);
  }

  Status Barrier(const char* what) {
    const uint32_t seen = h_.generation().load();
    ZT_RETURN_IF_ERROR(h_.CheckAbort(who_));
    if (h_.word(kArrivedOffset).fetch_add(1) + 1 == static_cast<uint32_t>(world_)) {
      h_.word(kArrivedOffset).store(0);
      h_.generation().fetch_add(1);
      h_.WakeAll();
      return Status::Ok();
    }
    const auto deadline = Clock::now() + timeout_;
    while (h_.generation().load() == seen) {
      ZT_RETURN_IF_ERROR(h_.CheckAbort(who_));
      if (Clock::now() >= deadline) {
        h_.Abort(rank_);
        return Status::Unavailable(StrCat(who_, ": ", what, ": only ",
                                          h_.word(kArrivedOffset).load(), " of ", world_,
                                          " ranks arrived within ", FormatSeconds(timeout_)));
      }
      h_.Sleep(seen);
    }
    return Status::Ok();
  }

  const std::shared_ptr<void> region_;
  const EngineWatch watch_;
  const RegionHeader h_;
  const int rank_;
  const int world_;
  const std::string who_;
  const std::chrono::milliseconds timeout_;
};

Result<std::unique_ptr<Collectives>> MakeNcclForJob(std::shared_ptr<void> region,
                                                    const EngineWatch& watch, int rank, int world,
                                                    Device& device, const std::string& who,
                                                    std::chrono::milliseconds timeout) {
  const RegionHeader h(region.get(), watch);
  // The ranks make their collectives in the same order, so the n-th call
  // of every rank uses rank 0's n-th id; each rank counts its calls in its
  // own word of the region.
  if (static_cast<uint64_t>(world) > kMaxNcclRanks) {
    return Status::InvalidArgument(
        StrCat(who, ": at most ", kMaxNcclRanks, " NCCL ranks meet through the region"));
  }
  const uint32_t round =
      h.word(kNcclTakenOffset + static_cast<uint64_t>(rank) * 4).fetch_add(1) + 1;
  NcclId id;
  if (rank == 0) {
    ZT_ASSIGN_OR_RETURN(id, MakeNcclId());
    std::memcpy(h.at(kNcclIdOffset), id.data(), id.size());
    h.word(kNcclRoundOffset).store(round);
  } else {
    const auto deadline = Clock::now() + timeout;
    while (h.word(kNcclRoundOffset).load() < round) {
      ZT_RETURN_IF_ERROR(h.CheckAbort(who));
      if (Clock::now() >= deadline) {
        return Status::Unavailable(
            StrCat(who, ": rank 0 handed out no NCCL unique id within ", FormatSeconds(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::memcpy(id.data(), h.at(kNcclIdOffset), id.size());
  }
  // The region stays mapped while the collectives may read its abort word.
  NcclPeers peers{
      .left = [region, watch, who] { return RegionHeader(region.get(), watch).CheckAbort(who); },
      .leave = [region, watch, rank] { RegionHeader(region.get(), watch).Abort(rank); },
      .timeout = timeout};
  return MakeNcclRankCollectives(device.ordinal(), rank, world, id, std::move(peers));
}

}  // namespace

Result<std::unique_ptr<Collectives>> MakeJobCollectives(Model& model, int rank, Device& device,
                                                        std::chrono::milliseconds timeout) {
  const int world = model.spec().world_size;
  const std::string who = StrCat("model '", model.spec().name, "' rank ", rank, " collectives");
  if (rank < 0 || rank >= world) {
    return Status::InvalidArgument(StrCat(who, ": rank out of range for world size ", world));
  }
  if (timeout.count() <= 0) {
    return Status::InvalidArgument(StrCat(who, ": the timeout must be positive"));
  }
  timeout = engine::ClampWait(timeout);  // the clock's nanoseconds hold it
  if (model.attached_rank() >= 0 && model.attached_rank() != rank) {
    return Status::InvalidArgument(
        StrCat(who, ": this process attached as rank ", model.attached_rank()));
  }
  const uint64_t bytes = engine::CollectiveRegionBytes(world);
  if (bytes > engine::kMaxCollectiveRegionBytes) {
    return Status::InvalidArgument(StrCat(who, ": ", world, " ranks need a collective region of ",
                                          bytes, " bytes, over the limit of ",
                                          engine::kMaxCollectiveRegionBytes));
  }
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<void> region,
                      model.transport().CollectiveRegion(model.job(), bytes));
  EngineWatch watch(model.transport_, model.job());
  const RegionHeader h(region.get(), watch);
  uint32_t expected = 0;
  if (!h.word(kWorldOffset).compare_exchange_strong(expected, static_cast<uint32_t>(world)) &&
      expected != static_cast<uint32_t>(world)) {
    return Status::Internal(
        StrCat(who, ": the job's collective region is set up for ", expected, " ranks"));
  }
  ZT_RETURN_IF_ERROR(h.CheckAbort(who));
  if (device.kind() == DeviceKind::kCuda) {
    return MakeNcclForJob(std::move(region), watch, rank, world, device, who, timeout);
  }
  return std::unique_ptr<Collectives>(std::make_unique<ShmCollectives>(
      std::move(region), std::move(watch), rank, world, who, timeout));
}

}  // namespace ztier::client
