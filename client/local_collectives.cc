// Local collectives: the R ranks of a job are threads of this process, each
// with a host device. A collective is a rendezvous: every rank publishes its
// buffer, waits for the others, then reads its peers' memory directly, and
// waits again before anyone may reuse a buffer. The reduction sums in fp32
// in rank order and rounds to bf16 once, so the result does not depend on
// thread timing.
//
// Thread safety: each rank's object is used by one thread; the shared group
// is synchronised. Failure: a rank that does not arrive within the timeout
// fails the call with Unavailable for the ranks waiting (they are not left
// hanging forever), and the group is aborted: every later call fails, so
// no rank passes a rendezvous whose peer gave up (and read a buffer that
// peer may have freed since).
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

#include "client/ztier.h"
#include "common/numbers.h"

namespace ztier::client {
namespace {

class Group {
 public:
  Group(int world, std::chrono::milliseconds timeout)
      : world_(world), timeout_(timeout), buffers_(world) {}

  // Publishes this rank's buffer and waits for every rank to have done so.
  Status Arrive(int rank, const void* buffer, const char* what) {
    std::unique_lock<std::mutex> lock(mu_);
    buffers_[rank] = buffer;
    return BarrierLocked(lock, what);
  }
  Status Barrier(const char* what) {
    std::unique_lock<std::mutex> lock(mu_);
    return BarrierLocked(lock, what);
  }
  const void* buffer(int rank) const { return buffers_[rank]; }  // between barriers
  void Abort(std::string_view reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = StrCat("local collectives: ", reason);
    cv_.notify_all();
  }
  int world() const { return world_; }

 private:
  Status BarrierLocked(std::unique_lock<std::mutex>& lock, const char* what) {
    if (!aborted_.empty()) return Status::Aborted(aborted_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return Status::Ok();
    }
    const bool met = cv_.wait_for(lock, timeout_,
                                  [&] { return generation_ != generation || !aborted_.empty(); });
    if (generation_ != generation) return Status::Ok();
    if (!met) {
      aborted_ = StrCat("local collectives: ", what, ": only ", arrived_, " of ", world_,
                        " ranks arrived within ", FormatSeconds(timeout_),
                        "; the group's collectives are over");
      cv_.notify_all();
      return Status::Unavailable(aborted_);
    }
    return Status::Aborted(aborted_);
  }

  const int world_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::string aborted_;  // why the group's collectives are over ("": they are not)
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<const void*> buffers_;
};

class LocalCollectives final : public Collectives {
 public:
  LocalCollectives(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world(); }
  void Abort(std::string_view reason) override { group_->Abort(reason); }

  Status AllGather(bf16* buffer, size_t shard_elems, Device& device, Stream stream) override {
    ZT_RETURN_IF_ERROR(CheckHost(device));
    ZT_RETURN_IF_ERROR(device.Synchronize(stream));  // this rank's shard has landed
    ZT_RETURN_IF_ERROR(group_->Arrive(rank_, buffer, "all-gather"));
    for (int r = 0; r < group_->world(); ++r) {
      if (r == rank_) continue;
      const auto* peer = static_cast<const bf16*>(group_->buffer(r));
      std::memcpy(buffer + r * shard_elems, peer + r * shard_elems, shard_elems * sizeof(bf16));
    }
    return group_->Barrier("all-gather");
  }

  Status ReduceScatter(const bf16* input, bf16* output, size_t shard_elems, Device& device,
                       Stream stream) override {
    ZT_RETURN_IF_ERROR(CheckHost(device));
    ZT_RETURN_IF_ERROR(device.Synchronize(stream));
    ZT_RETURN_IF_ERROR(group_->Arrive(rank_, input, "reduce-scatter"));
    const size_t base = static_cast<size_t>(rank_) * shard_elems;
    for (size_t i = 0; i < shard_elems; ++i) {
      float sum = 0.0f;
      for (int r = 0; r < group_->world(); ++r) {
        sum += Bf16ToFloat(static_cast<const bf16*>(group_->buffer(r))[base + i]);
      }
      output[i] = FloatToBf16(sum);
    }
    return group_->Barrier("reduce-scatter");
  }

 private:
  static Status CheckHost(const Device& device) {
    if (device.kind() != DeviceKind::kHost) {
      return Status::InvalidArgument(StrCat("local collectives need host devices, got '",
                                            device.name(), "' (use NCCL for GPUs)"));
    }
    return Status::Ok();
  }

  std::shared_ptr<Group> group_;
  const int rank_;
};

}  // namespace

Result<std::vector<std::unique_ptr<Collectives>>> MakeLocalCollectives(
    int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1) {
    return Status::InvalidArgument(StrCat("local collectives: world size ", world_size, " < 1"));
  }
  if (timeout.count() <= 0) {
    return Status::InvalidArgument("local collectives: the timeout must be positive");
  }
  auto group = std::make_shared<Group>(world_size, timeout);
  std::vector<std::unique_ptr<Collectives>> ranks;
  for (int r = 0; r < world_size; ++r)
    ranks.push_back(std::make_unique<LocalCollectives>(group, r));
  return ranks;
}

}  // namespace ztier::client
