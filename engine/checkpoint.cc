// ztier engine: checkpoints and safetensors files of the engine's jobs
// (Engine::SaveCheckpoint / LoadCheckpoint / ExportSafetensors /
// ImportSafetensors): the job's state as a StateAccess for the file code of
// state_files.h, and the locks on the checkpoint directories the engine's
// jobs save to. Called with the job idle and marked checkpointing.
#include <algorithm>
#include <cstring>
#include <utility>

#include "common/bf16.h"
#include "engine/engine_internal.h"
#include "engine/state_files.h"

namespace ztier::engine {

Status CheckpointDirs::Claim(const Job& job, const std::string& dir, bool pin) {
  const std::string key = CheckpointDirKey(dir);
  const ClaimedCheckpointDirs::LockFileNow now = ClaimedCheckpointDirs::Look(dir);
  std::vector<DirLock> gone;  // let go of after mu_ (a file removed each)
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, other] : jobs_) {
    if (!other.dirs.Holds(key, now, /*touch=*/id == job.id, pin && id == job.id, &gone)) continue;
    if (id == job.id) return Status::Ok();
    return Status::Unavailable(StrCat("checkpoint directory ", dir, " is used by job '",
                                      other.job_name,
                                      "' of this process for its checkpoints; choose another "
                                      "directory"));
  }
  ZT_ASSIGN_OR_RETURN(DirLock l, DirLock::Acquire(dir, kCheckpointLockFile, "checkpoint directory",
                                                  DirLock::Mode::kExclusive));
  JobDirs& mine = jobs_[job.id];
  mine.job_name = job.spec.name;
  mine.dirs.Add(key, std::move(l), pin, &gone);
  return Status::Ok();
}

void CheckpointDirs::Release(int job) {
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.erase(job);
}

JobDescription Describe(const Job& job) {
  JobDescription d{.name = job.spec.name,
                   .ranks = job.spec.ranks,
                   .optimizer = job.spec.optimizer,
                   .units = job.spec.units,
                   .layouts = {},
                   .step = job.step,
                   .adam_step = job.adam_step,
                   .state_dtype = std::string(StateDtypeName(job.state_dtype))};
  for (const Unit& u : job.units) d.layouts.push_back(u.layout);
  return d;
}

namespace {

// Sets the bf16 params of a unit from its master.
void ParamsFromMaster(const Unit& u, const StateView& view) {
  for (uint64_t i = 0; i < u.layout.padded; ++i) view.publish[i] = FloatToBf16(view.master[i]);
}

}  // namespace

// The engine's job as the file code sees it: passes over ForEachUnitState.
class EngineStateAccess final : public StateAccess {
 public:
  EngineStateAccess(Job& job, CommitFn commit) : job_(job), commit_(std::move(commit)) {}

  Status Read(const Visit& fn) override { return Pass(Access::kRead, fn, false); }
  Status Overwrite(const Visit& fn) override { return Pass(Access::kOverwrite, fn, true); }
  Status UpdateMaster(const Visit& fn) override { return Pass(Access::kUpdate, fn, true); }
  Status Commit(int64_t step, int64_t adam_step) override {
    commit_(step, adam_step);
    job_.partly_written = false;
    return Status::Ok();
  }

 private:
  // The files see fp32 m and v: 8-bit ones are dequantized into `staged`
  // before fn and quantized from it after.
  Status Pass(Access access, const Visit& fn, bool writes) {
    if (writes) job_.partly_written = true;  // until Commit
    std::vector<float> staged;  // fp32 m and v: of 8-bit states, or dropped (stateless)
    const bool int8 = job_.state_dtype == StateDtype::kInt8;
    return ForEachUnitState(
        job_, ForwardOrder(job_), access, [&](size_t k, const StateView& view) -> Status {
          const Unit& u = job_.units[k];
          UnitState state{
              .master = view.master, .exp_avg = view.exp_avg, .exp_avg_sq = view.exp_avg_sq};
          if (int8 || (writes && u.stateless)) {
            staged.resize(2 * u.layout.padded);
            state.exp_avg = staged.data();
            state.exp_avg_sq = staged.data() + u.layout.padded;
            if (int8 && access != Access::kOverwrite) {
              MomentsToFloat(job_, u, view, state.exp_avg, state.exp_avg_sq);
            }
          }
          ZT_RETURN_IF_ERROR(fn(k, state));
          if (!writes) return Status::Ok();
          ++units_written_;
          if (int8 && !u.stateless)
            MomentsFromFloat(job_, u, view, state.exp_avg, state.exp_avg_sq);
          ParamsFromMaster(u, view);
          return Status::Ok();
        });
  }

  Job& job_;
  CommitFn commit_;
};

Status SaveCheckpointImpl(Job& job, const std::string& dir, CheckpointDirs& dirs) {
  ZT_RETURN_IF_ERROR(CreateCheckpointDir(dir));
  ZT_RETURN_IF_ERROR(dirs.Claim(job, dir, /*pin=*/false));
  EngineStateAccess state(job, [](int64_t, int64_t) {});
  return SaveCheckpointFiles(Describe(job), state, dir);
}

Status LoadCheckpointImpl(Job& job, const std::string& dir, const CommitFn& commit) {
  EngineStateAccess state(job, commit);
  return LoadCheckpointFiles(Describe(job), state, dir);
}

Status ExportSafetensorsImpl(Job& job, const std::string& path, bool bf16_out) {
  EngineStateAccess state(job, [](int64_t, int64_t) {});
  return ExportSafetensorsFile(Describe(job), state, path,
                               bf16_out ? ExportType::kBFloat16 : ExportType::kFloat32);
}

Status ImportSafetensorsImpl(Job& job, const std::string& path, const CommitFn& commit) {
  EngineStateAccess state(job, commit);
  return ImportSafetensorsFile(Describe(job), state, path);
}

Status WriteUnitStateImpl(Job& job, size_t unit, const UnitState& from) {
  job.partly_written = true;  // until CommitStateImpl
  return WithUnitState(job, unit, Access::kOverwrite, [&](size_t k, const StateView& view) {
    const uint64_t bytes = job.units[k].layout.padded * sizeof(float);
    std::memcpy(view.master, from.master, bytes);
    if (!job.units[k].stateless) {  // a stateless unit keeps no m and v
      MomentsFromFloat(job, job.units[k], view, from.exp_avg, from.exp_avg_sq);
    }
    ParamsFromMaster(job.units[k], view);
    return Status::Ok();
  });
}

Status CommitStateImpl(Job& job, int64_t step, int64_t adam_step, const CommitFn& commit) {
  EngineStateAccess state(job, commit);
  return state.Commit(step, adam_step);
}

}  // namespace ztier::engine
