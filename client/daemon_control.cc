// libztier: DaemonControl, ztierd's operator interface (see ztier.h), over
// the daemon transport's connection (client/transport.h ControlTransport).
#include "client/transport.h"
#include "client/ztier.h"

namespace ztier::client {

Result<std::unique_ptr<DaemonControl>> DaemonControl::Connect(
    const std::string& socket, std::chrono::milliseconds call_timeout) {
  if (socket.empty()) return Status::InvalidArgument("no ztierd socket named");
  ZT_ASSIGN_OR_RETURN(std::shared_ptr<ControlTransport> t, MakeDaemonControl(socket, call_timeout));
  return std::unique_ptr<DaemonControl>(new DaemonControl(std::move(t)));
}

DaemonControl::~DaemonControl() = default;

Result<engine::DaemonStatus> DaemonControl::GetStatus() { return t_->DaemonStatus(); }

Result<std::vector<engine::JobInfo>> DaemonControl::Jobs() {
  std::vector<engine::JobInfo> all;
  int64_t after = -1;
  for (bool more = true; more;) {
    ZT_ASSIGN_OR_RETURN(std::vector<engine::JobInfo> page, t_->ListJobs(after, &more));
    if (page.empty()) break;
    after = page.back().id;
    for (engine::JobInfo& j : page) all.push_back(std::move(j));
  }
  return all;
}

Result<engine::QuotaInfo> DaemonControl::GetQuota(uint32_t uid) {
  engine::Quota defaults;
  bool more = false;
  ZT_ASSIGN_OR_RETURN(std::vector<engine::QuotaInfo> q,
                      t_->GetQuotas(uid, /*all=*/false, -1, &defaults, &more));
  if (q.size() != 1) {
    return Status::Corruption(StrCat("ztierd answered a quota query with ", q.size(), " quotas"));
  }
  return q[0];
}

Result<std::vector<engine::QuotaInfo>> DaemonControl::AllQuotas(engine::Quota* defaults) {
  std::vector<engine::QuotaInfo> all;
  int64_t after = -1;
  for (bool more = true; more;) {
    ZT_ASSIGN_OR_RETURN(std::vector<engine::QuotaInfo> page,
                        t_->GetQuotas(0, /*all=*/true, after, defaults, &more));
    if (page.empty()) break;
    after = page.back().uid;
    for (engine::QuotaInfo& q : page) all.push_back(q);
  }
  return all;
}

Result<engine::QuotaInfo> DaemonControl::SetQuota(const engine::QuotaUpdate& update) {
  return t_->SetQuota(update);
}

Status DaemonControl::Drain(bool on) { return t_->Drain(on); }

Status DaemonControl::Evict(int32_t id, const std::string& reason) {
  return t_->EvictJob(id, reason);
}

}  // namespace ztier::client
