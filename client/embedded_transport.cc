// The embedded transport: the engine in this process, every call forwarded
// to an engine::Engine the transport owns. The only part of libztier that
// links the engine; the daemon transport talks to ztierd instead.
//
// Thread safety: as engine::Engine (every method from any thread).
// Failure: the engine's errors, unchanged.
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "client/transport.h"
#include "engine/engine.h"
#include "engine/shared_memory.h"

namespace ztier::client {
namespace {

class EmbeddedTransport final : public Transport {
 public:
  explicit EmbeddedTransport(std::unique_ptr<engine::Engine> engine) : e_(std::move(engine)) {}
  std::string name() const override { return "embedded"; }

  Result<int> RegisterJob(const engine::JobSpec& spec) override {
    ZT_RETURN_IF_ERROR(engine::ValidateJobSpec(spec));  // as a client of ztierd checks it
    return e_->RegisterJob(spec);
  }
  Result<int> AttachJob(const engine::JobSpec& spec, int rank,
                        std::chrono::milliseconds /*timeout*/) override {
    return Status::FailedPrecondition(
        StrCat("model '", spec.name, "' rank ", rank,
               ": ranks in other processes attach to a job through ztierd (set "
               "ztier.daemon_socket); the embedded engine serves the ranks of this process"));
  }
  Result<std::shared_ptr<void>> CollectiveRegion(int job, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(job);
    if (it == regions_.end()) {
      ZT_ASSIGN_OR_RETURN(UniqueFd fd, engine::MakeSealedMemfd("ztier-collectives", bytes));
      ZT_ASSIGN_OR_RETURN(engine::Mapping m,
                          engine::Mapping::Map(fd.get(), bytes, true, "the collective region"));
      it = regions_.emplace(job, std::make_shared<engine::Mapping>(std::move(m))).first;
    }
    if (it->second->bytes() != bytes) {
      return Status::InvalidArgument(StrCat("job ", job, ": its collective region has ",
                                            it->second->bytes(), " bytes, a rank asked for ",
                                            bytes));
    }
    return std::shared_ptr<void>(it->second, it->second->data());
  }
  Status UnregisterJob(int job) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      regions_.erase(job);
    }
    return e_->UnregisterJob(job);
  }
  Result<engine::UnitLayout> Layout(int job, int unit) override { return e_->Layout(job, unit); }
  Status WriteWeights(int job, int unit, const float* flat, uint64_t numel) override {
    return e_->WriteWeights(job, unit, flat, numel);
  }
  Status ReadState(int job, int unit, float* master, float* m, float* v) override {
    return e_->ReadState(job, unit, master, m, v);
  }
  Status SetLearningRates(int job, const std::vector<float>& lrs) override {
    return e_->SetLearningRates(job, lrs);
  }
  Result<bf16*> GradInbox(int job, int unit, int rank) override {
    return e_->GradInbox(job, unit, rank);
  }
  Result<uint64_t*> ClientCounters(int job, int rank) override {
    return e_->ClientCounters(job, rank);
  }
  Status GradsReady(int job, int unit, int rank) override {
    return e_->GradsReady(job, unit, rank);
  }
  Result<int> AbortStep(int job, int64_t step) override { return e_->AbortStep(job, step); }
  Result<const bf16*> AcquireParams(int job, int unit, int64_t step,
                                    std::chrono::milliseconds timeout) override {
    return e_->AcquireParams(job, unit, step, timeout);
  }
  Status ReleaseParams(int job, int unit) override { return e_->ReleaseParams(job, unit); }
  Status WaitPublished(int job, int unit, int64_t step,
                       std::chrono::milliseconds timeout) override {
    return e_->WaitPublished(job, unit, step, timeout);
  }
  Result<int64_t> PublishedStep(int job, int unit) override { return e_->PublishedStep(job, unit); }
  Result<int64_t> WeightsGeneration(int job) override {
    const int64_t g = e_->WeightsGeneration(job);
    if (g < 0) return Status::NotFound(StrCat("no job ", job));
    return g;
  }
  Result<int64_t> TargetStep(int job) override { return e_->TargetStep(job); }
  Status ClaimCheckpointDir(int job, const std::string& dir, bool until_closed) override {
    return e_->ClaimCheckpointDir(job, dir, until_closed);
  }
  Status SaveCheckpoint(int job, const std::string& dir) override {
    return e_->SaveCheckpoint(job, dir);
  }
  Status LoadCheckpoint(int job, const std::string& dir) override {
    return e_->LoadCheckpoint(job, dir);
  }
  Status ExportSafetensors(int job, const std::string& path, engine::ExportType type) override {
    return e_->ExportSafetensors(job, path, type);
  }
  Status ImportSafetensors(int job, const std::string& path) override {
    return e_->ImportSafetensors(job, path);
  }
  Result<engine::JobCounters> Counters(int job) override { return e_->counters(job); }
  Result<engine::StateDtype> StateDtype(int job) override { return e_->state_dtype(job); }
  engine::DramPoolStats PoolStats() override { return e_->pool_stats(); }
  std::vector<HostRegion> PinnedRegions(int job) override {
    // The engine's own mappings, in this process: read-write.
    std::vector<HostRegion> out;
    for (const auto& [base, bytes] : e_->PinnedRegions(job)) {
      out.push_back({.base = base, .bytes = bytes, .access = HostAccess::kReadWrite});
    }
    return out;
  }

 private:
  std::unique_ptr<engine::Engine> e_;
  std::mutex mu_;
  std::map<int, std::shared_ptr<engine::Mapping>> regions_;  // collective regions, by job
};

}  // namespace

Result<std::shared_ptr<Transport>> MakeEmbeddedTransport(
    const engine::Settings& settings, std::shared_ptr<nvme::IoBackend> io_backend) {
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> e,
                      engine::Engine::Create(settings, std::move(io_backend)));
  return std::shared_ptr<Transport>(std::make_shared<EmbeddedTransport>(std::move(e)));
}

}  // namespace ztier::client
