// Session and Model: opening an engine through a transport, and a
// registered model's calls (weights, checkpoints, exports, counters).
// Thread safety: as client/ztier.h. Failure: errors come back from the
// engine with the model's name added.
#include <algorithm>
#include <chrono>

#include "client/transport.h"
#include "client/ztier.h"
#include "common/log.h"
#include "engine/state_files.h"

namespace ztier::client {

// ------------------------------------------------------------------ Session

Session::Session(std::shared_ptr<Transport> transport, engine::Settings settings)
    : transport_(std::move(transport)), settings_(std::move(settings)) {}
Session::~Session() = default;

Result<std::unique_ptr<Session>> Session::Open(const SessionOptions& options) {
  const std::string& socket =
      !options.daemon_socket.empty() ? options.daemon_socket : options.settings.daemon_socket;
  std::shared_ptr<Transport> t;
  if (!socket.empty()) {
    ZT_ASSIGN_OR_RETURN(t, MakeDaemonTransport(socket));
    // The engine-wide settings are the daemon's: say so for each one this
    // process set (its jobs' own, like ztier.state_dtype, travel with
    // them), unless the daemon was made with them.
    for (const auto& [key, from] : engine::EngineOnlySettingsSet(options.settings)) {
      if (options.daemon_has_these_settings) break;
      ZT_LOG(kWarn, "client") << key << " (from " << from
                              << ") is an engine setting: through ztierd at " << socket
                              << " the daemon's own applies (its --config, "
                                 "/etc/ztier/ztierd.json under systemd)";
    }
  } else {
    ZT_ASSIGN_OR_RETURN(t, MakeEmbeddedTransport(options.settings, options.io_backend));
  }
  ZT_LOG(kInfo, "client") << "session open (" << t->name() << " engine)";
  return std::unique_ptr<Session>(new Session(ForkSafe(std::move(t)), options.settings));
}

std::string Session::transport_name() const { return transport_->name(); }

Status Session::Health() const { return transport_->Health(); }

engine::DramPoolStats Session::pool_stats() const { return transport_->PoolStats(); }

Result<std::unique_ptr<Model>> Session::RegisterModel(const ModelSpec& spec) {
  return OpenModel(spec, -1, std::chrono::milliseconds(0));
}

Result<std::unique_ptr<Model>> Session::AttachModel(const ModelSpec& spec, int rank,
                                                    std::chrono::milliseconds timeout) {
  if (rank < 0 || rank >= spec.world_size) {
    return Status::InvalidArgument(StrCat("model '", spec.name, "': rank ", rank,
                                          " out of range for world size ", spec.world_size));
  }
  return OpenModel(spec, rank, timeout);
}

Result<std::unique_ptr<Model>> Session::OpenModel(const ModelSpec& spec, int rank,
                                                  std::chrono::milliseconds timeout) {
  if (spec.world_size < 1) {
    return Status::InvalidArgument(
        StrCat("model '", spec.name, "': world size ", spec.world_size, " < 1"));
  }
  engine::JobSpec job{.name = spec.name,
                      .units = spec.units,
                      .ranks = spec.world_size,
                      .optimizer = spec.optimizer,
                      .optimizer_tier = spec.optimizer_tier,
                      .param_tier = spec.param_tier,
                      .state_dtype = spec.state_dtype,
                      .launch = spec.launch};
  if (!job.state_dtype && settings_.sources.count("ztier.state_dtype") != 0) {
    job.state_dtype = settings_.state_dtype;
  }
  ZT_ASSIGN_OR_RETURN(
      int id, rank < 0 ? transport_->RegisterJob(job) : transport_->AttachJob(job, rank, timeout));
  std::vector<engine::UnitLayout> layouts;
  for (int u = 0; u < static_cast<int>(spec.units.size()); ++u) {
    Result<engine::UnitLayout> l = transport_->Layout(id, u);
    if (!l.ok()) {
      (void)transport_->UnregisterJob(id);
      return l.status();
    }
    layouts.push_back(*std::move(l));
  }
  return std::unique_ptr<Model>(new Model(transport_, id, spec, std::move(layouts), rank));
}

RunnerOptions RunnerOptionsFrom(const engine::Settings& settings) {
  RunnerOptions o;
  o.prefetch_depth = settings.prefetch_depth;
  o.max_live_bytes = settings.max_live_parameters * sizeof(bf16);
  o.persistence_threshold = settings.param_persistence_threshold * sizeof(bf16);
  o.coalesce_bytes = settings.coalesce_bytes;
  o.timeout = std::chrono::seconds(settings.wait_timeout_seconds);
  return o;
}

// -------------------------------------------------------------------- Model

Model::Model(std::shared_ptr<Transport> transport, int job, Session::ModelSpec spec,
             std::vector<engine::UnitLayout> layouts, int attached_rank)
    : transport_(std::move(transport)),
      job_(job),
      spec_(std::move(spec)),
      layouts_(std::move(layouts)),
      attached_rank_(attached_rank) {}

Model::~Model() {
  // Always: a gone ztierd's transport still lets go of the job's mappings
  // and checkpoint directory here. Said only where the engine is there to
  // say it to (not gone, nor the parent's of a forked child).
  Status s = transport_->UnregisterJob(job_);
  if (!s.ok() && transport_->Health().ok()) {
    ZT_LOG(kWarn, "client") << "unregister model '" << spec_.name << "': " << s;
  }
}

Result<int> Model::FindUnit(const std::string& name) const {
  for (int u = 0; u < units(); ++u) {
    if (spec_.units[u].name == name) return u;
  }
  return Status::NotFound(StrCat("model '", spec_.name, "' has no unit '", name, "'"));
}

Status Model::SetWeights(int unit, const float* flat, uint64_t numel) {
  if (unit < 0 || unit >= units()) {
    return Status::OutOfRange(StrCat("model '", spec_.name, "' has no unit ", unit));
  }
  if (flat == nullptr) return Status::InvalidArgument("SetWeights: null weights");
  return transport_->WriteWeights(job_, unit, flat, numel);
}

Status Model::ImportSafetensors(const std::string& path) {
  return transport_->ImportSafetensors(job_, path);
}
Status Model::ExportSafetensors(const std::string& path, engine::Engine::ExportType type) {
  return transport_->ExportSafetensors(job_, path, type);
}
Status Model::TidyCheckpointDir(const std::string& dir) {
  ZT_RETURN_IF_ERROR(ClaimCheckpointDir(dir, /*until_closed=*/false));  // as a save's
  return engine::RemoveUnnamedCheckpointFiles(dir);
}
Status Model::RemoveCheckpoint(const std::string& dir) {
  ZT_RETURN_IF_ERROR(ClaimCheckpointDir(dir, /*until_closed=*/false));  // as a save's
  return engine::RemoveCheckpointFiles(dir);
}
Status Model::ClaimCheckpointDir(const std::string& dir, bool until_closed) {
  return transport_->ClaimCheckpointDir(job_, dir, until_closed);
}
Status Model::SaveCheckpoint(const std::string& dir) {
  return transport_->SaveCheckpoint(job_, dir);
}
Status Model::LoadCheckpoint(const std::string& dir) {
  return transport_->LoadCheckpoint(job_, dir);
}

Status Model::SetLearningRates(const std::vector<float>& lrs) {
  return transport_->SetLearningRates(job_, lrs);
}

Status Model::ReadMaster(int unit, std::vector<float>* master) const {
  if (unit < 0 || unit >= units()) {
    return Status::OutOfRange(StrCat("model '", spec_.name, "' has no unit ", unit));
  }
  if (master == nullptr) return Status::InvalidArgument("ReadMaster: null vector");
  const uint64_t n = layouts_[unit].padded;
  master->assign(n, 0.0f);
  std::vector<float> m(n), v(n);
  return transport_->ReadState(job_, unit, master->data(), m.data(), v.data());
}

Result<int64_t> Model::PublishedStep() const {
  int64_t step = INT64_MAX;
  for (int u = 0; u < units(); ++u) {
    ZT_ASSIGN_OR_RETURN(const int64_t s, transport_->PublishedStep(job_, u));
    if (s < 0) {
      return Status::FailedPrecondition(
          StrCat("model '", spec_.name, "': unit '", spec_.units[u].name, "' has no weights yet"));
    }
    step = std::min(step, s);
  }
  return step;
}

int64_t Model::published_step() const {
  Result<int64_t> step = PublishedStep();
  return step.ok() ? *step : -1;
}

Status Model::WaitPublished(int64_t step, std::chrono::milliseconds timeout) const {
  // Cut here for either transport (ztierd's adds its call timeout to it).
  // One deadline for every unit: each unit's wait gets what is left of it.
  timeout = engine::ClampWait(timeout);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int u = 0; u < units(); ++u) {
    const auto left = std::max<std::chrono::milliseconds>(
        std::chrono::milliseconds{0},
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
    ZT_RETURN_IF_ERROR(transport_->WaitPublished(job_, u, step, left));
  }
  return Status::Ok();
}

Result<engine::JobCounters> Model::counters() const { return transport_->Counters(job_); }

Result<engine::StateDtype> Model::state_dtype() const { return transport_->StateDtype(job_); }

}  // namespace ztier::client
