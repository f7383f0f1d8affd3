// ProcessOwner and ForkSafe (client/transport.h): what a forked child may do
// with its parent's session, model and runner objects: nothing but exit or
// drop them. A training loop's data workers (a DataLoader's) are forked
// children that hold copies of them.
//
// Thread safety: as the transport wrapped. Failure: FailedPrecondition in a
// forked child, for every call.
#include <unistd.h>

#include "client/transport.h"

namespace ztier::client {

ProcessOwner::ProcessOwner() : pid_(static_cast<int>(::getpid())) {}

bool ProcessOwner::forked() const { return static_cast<int>(::getpid()) != pid_; }

Status ProcessOwner::Check(std::string_view what) const {
  if (!forked()) return Status::Ok();
  return Status::FailedPrecondition(StrCat(
      what, " in process ", ::getpid(), ", a child forked from process ", pid_,
      ", which owns this ztier session: a forked child cannot use its parent's session, models "
      "or runners (open a session of its own)"));
}

namespace {

class ForkSafeTransport final : public Transport {
 public:
  explicit ForkSafeTransport(std::shared_ptr<Transport> inner) : inner_(std::move(inner)) {}
  ~ForkSafeTransport() override {
    // The parent's engine and connection are the parent's: never torn down here.
    if (owner_.forked()) new std::shared_ptr<Transport>(std::move(inner_));
  }

  std::string name() const override { return inner_->name(); }
  Status Health() override {
    ZT_RETURN_IF_ERROR(owner_.Check("a call"));
    return inner_->Health();
  }
  Result<int> RegisterJob(const engine::JobSpec& spec) override {
    ZT_RETURN_IF_ERROR(owner_.Check("registering a model"));
    return inner_->RegisterJob(spec);
  }
  Result<int> AttachJob(const engine::JobSpec& spec, int rank,
                        std::chrono::milliseconds timeout) override {
    ZT_RETURN_IF_ERROR(owner_.Check("attaching a rank"));
    return inner_->AttachJob(spec, rank, timeout);
  }
  Result<std::shared_ptr<void>> CollectiveRegion(int job, uint64_t bytes) override {
    ZT_RETURN_IF_ERROR(owner_.Check("mapping a collective region"));
    return inner_->CollectiveRegion(job, bytes);
  }
  Status UnregisterJob(int job) override {
    ZT_RETURN_IF_ERROR(owner_.Check("closing a model"));
    return inner_->UnregisterJob(job);
  }
  Result<engine::UnitLayout> Layout(int job, int unit) override {
    ZT_RETURN_IF_ERROR(owner_.Check("reading a layout"));
    return inner_->Layout(job, unit);
  }
  Status WriteWeights(int job, int unit, const float* flat, uint64_t numel) override {
    ZT_RETURN_IF_ERROR(owner_.Check("setting weights"));
    return inner_->WriteWeights(job, unit, flat, numel);
  }
  Status ReadState(int job, int unit, float* master, float* m, float* v) override {
    ZT_RETURN_IF_ERROR(owner_.Check("reading a unit's state"));
    return inner_->ReadState(job, unit, master, m, v);
  }
  Status SetLearningRates(int job, const std::vector<float>& lrs) override {
    ZT_RETURN_IF_ERROR(owner_.Check("setting learning rates"));
    return inner_->SetLearningRates(job, lrs);
  }
  Result<bf16*> GradInbox(int job, int unit, int rank) override {
    ZT_RETURN_IF_ERROR(owner_.Check("a grad inbox"));
    return inner_->GradInbox(job, unit, rank);
  }
  Status GradsReady(int job, int unit, int rank) override {
    ZT_RETURN_IF_ERROR(owner_.Check("delivering grads"));
    return inner_->GradsReady(job, unit, rank);
  }
  Result<int> AbortStep(int job, int64_t step) override {
    ZT_RETURN_IF_ERROR(owner_.Check("aborting a step"));
    return inner_->AbortStep(job, step);
  }
  Result<const bf16*> AcquireParams(int job, int unit, int64_t step,
                                    std::chrono::milliseconds timeout) override {
    ZT_RETURN_IF_ERROR(owner_.Check("fetching params"));
    return inner_->AcquireParams(job, unit, step, timeout);
  }
  Status ReleaseParams(int job, int unit) override {
    ZT_RETURN_IF_ERROR(owner_.Check("releasing params"));
    return inner_->ReleaseParams(job, unit);
  }
  Status WaitPublished(int job, int unit, int64_t step,
                       std::chrono::milliseconds timeout) override {
    ZT_RETURN_IF_ERROR(owner_.Check("waiting for a step"));
    return inner_->WaitPublished(job, unit, step, timeout);
  }
  Result<int64_t> PublishedStep(int job, int unit) override {
    ZT_RETURN_IF_ERROR(owner_.Check("reading a unit's step"));
    return inner_->PublishedStep(job, unit);
  }
  Result<int64_t> WeightsGeneration(int job) override {
    ZT_RETURN_IF_ERROR(owner_.Check("reading the weights' generation"));
    return inner_->WeightsGeneration(job);
  }
  Result<int64_t> TargetStep(int job) override {
    ZT_RETURN_IF_ERROR(owner_.Check("reading the job's step"));
    return inner_->TargetStep(job);
  }
  Status ClaimCheckpointDir(int job, const std::string& dir, bool until_closed) override {
    ZT_RETURN_IF_ERROR(owner_.Check("claiming a checkpoint directory"));
    return inner_->ClaimCheckpointDir(job, dir, until_closed);
  }
  Status SaveCheckpoint(int job, const std::string& dir) override {
    ZT_RETURN_IF_ERROR(owner_.Check("saving a checkpoint"));
    return inner_->SaveCheckpoint(job, dir);
  }
  Status LoadCheckpoint(int job, const std::string& dir) override {
    ZT_RETURN_IF_ERROR(owner_.Check("loading a checkpoint"));
    return inner_->LoadCheckpoint(job, dir);
  }
  Status ExportSafetensors(int job, const std::string& path, engine::ExportType type) override {
    ZT_RETURN_IF_ERROR(owner_.Check("exporting weights"));
    return inner_->ExportSafetensors(job, path, type);
  }
  Status ImportSafetensors(int job, const std::string& path) override {
    ZT_RETURN_IF_ERROR(owner_.Check("importing weights"));
    return inner_->ImportSafetensors(job, path);
  }
  Result<engine::StateDtype> StateDtype(int job) override {
    ZT_RETURN_IF_ERROR(owner_.Check("reading the state dtype"));
    return inner_->StateDtype(job);
  }
  Result<engine::JobCounters> Counters(int job) override {
    ZT_RETURN_IF_ERROR(owner_.Check("reading counters"));
    return inner_->Counters(job);
  }
  engine::DramPoolStats PoolStats() override {
    return owner_.forked() ? engine::DramPoolStats{} : inner_->PoolStats();
  }
  std::vector<HostRegion> PinnedRegions(int job) override {
    if (owner_.forked()) return {};
    return inner_->PinnedRegions(job);
  }
  Result<uint64_t*> ClientCounters(int job, int rank) override {
    ZT_RETURN_IF_ERROR(owner_.Check("the client page"));
    return inner_->ClientCounters(job, rank);
  }

 private:
  ProcessOwner owner_;
  std::shared_ptr<Transport> inner_;
};

}  // namespace

std::shared_ptr<Transport> ForkSafe(std::shared_ptr<Transport> inner) {
  return std::make_shared<ForkSafeTransport>(std::move(inner));
}

}  // namespace ztier::client
