// ztier engine: ztierd's service (see daemon.h): the accept loop, one
// thread per connection, and the handler of every request.
#include "engine/daemon.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/numbers.h"
#include "engine/protocol.h"
#include "engine/shared_memory.h"

namespace ztier::engine {
namespace {

namespace p = protocol;
using Clock = std::chrono::steady_clock;

// How often a connection thread looks at the stop flag while its client is
// quiet, and how long a reply may wait for room in the client's socket.
constexpr std::chrono::milliseconds kPollInterval{200};
constexpr std::chrono::seconds kSendTimeout{30};

// A job's name in the engine: scoped by its owner's uid, so each user has
// a namespace of their own.
std::string ScopedPrefix(uid_t uid) { return StrCat("uid", uid, "/"); }

// The engine's message with the caller's scope taken out of job names.
Status Unscoped(const Status& s, const std::string& prefix) {
  if (s.ok()) return s;
  std::string msg(s.message());
  const std::string needle = "'" + prefix;
  for (size_t at = msg.find(needle); at != std::string::npos; at = msg.find(needle, at + 1)) {
    msg.erase(at + 1, prefix.size());
  }
  return Status(s.code(), std::move(msg), s.sys_errno());
}

}  // namespace

struct Daemon::Impl {
  DaemonOptions options;
  std::unique_ptr<Engine> engine;
  uid_t self_uid = ::geteuid();

  std::atomic<bool> stopping{false};
  mutable std::mutex mu;
  std::string stop_reason;
  struct Usage {
    int connections = 0;
    int jobs = 0;
    uint64_t dram_bytes = 0;  // of its jobs, as counted at registration
    uint64_t nvme_bytes = 0;
  };
  std::map<uid_t, Usage> usage;  // guarded by mu
  int connections = 0;           // guarded by mu
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> refused{0};

  class Connection;
  std::list<std::unique_ptr<Connection>> live;  // guarded by mu
  std::condition_variable all_closed;

  bool Allowed(uid_t uid) const {
    if (uid == 0 || uid == self_uid) return true;
    if (options.allowed_uids.empty()) return true;
    return std::find(options.allowed_uids.begin(), options.allowed_uids.end(), uid) !=
           options.allowed_uids.end();
  }
};

// One client connection: its socket, its jobs (by handle), the params it
// holds leases on, and the pool that runs its blocking and computing
// requests.
class Daemon::Impl::Connection {
 public:
  // `refusal` not OK: the connection only answers the client's hello with
  // it (so the client reads why, rather than a reset) and closes.
  Connection(Impl& d, SeqPacketSocket sock, PeerCredentials peer, Status refusal)
      : d_(d),
        sock_(std::move(sock)),
        peer_(peer),
        prefix_(ScopedPrefix(peer.uid)),
        refusal_(std::move(refusal)) {}

  void Run() {
    Loop();
    Close();
  }
  void Start() {
    thread_ = std::thread([this] { Run(); });
  }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  bool finished() const { return finished_.load(); }

 private:
  struct JobEntry {
    int engine_job = -1;
    std::string name;
    int units = 0;
    int ranks = 1;
    Tier param_tier = Tier::kDram;
    uint64_t dram_bytes = 0;  // charged to the uid
    uint64_t nvme_bytes = 0;
  };
  struct Request {
    p::Header header;
    std::string payload;
    std::vector<UniqueFd> fds;
  };

  void Loop() {
    const auto refuse_by = Clock::now() + std::chrono::seconds(2);
    while (!d_.stopping.load()) {
      if (!refusal_.ok() && Clock::now() > refuse_by) return;
      pollfd pfd{.fd = sock_.fd(), .events = POLLIN, .revents = 0};
      const int n = ::poll(&pfd, 1, static_cast<int>(kPollInterval.count()));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        ZT_LOG(kWarn, "ztierd") << Who() << ": poll: " << std::strerror(errno);
        return;
      }
      if (n == 0) continue;
      Result<SeqPacketSocket::Received> got =
          sock_.Receive(std::chrono::milliseconds(0), p::kMaxMessageBytes, p::kMaxFdsPerMessage);
      if (!got.ok()) {
        if (got.status().code() != StatusCode::kUnavailable) {
          ZT_LOG(kWarn, "ztierd") << Who() << ": " << got.status() << "; closing the connection";
        }
        return;
      }
      Result<p::Header> h = p::DecodeHeader(got->data, static_cast<uint32_t>(got->fds.size()));
      if (!h.ok()) {
        // The request id cannot be trusted: say why (id 0) and close.
        ZT_LOG(kWarn, "ztierd") << Who() << ": " << h.status() << "; closing the connection";
        SendError(0, p::MessageType::kHello, h.status());
        return;
      }
      if ((h->flags & p::kFlagReply) != 0) {
        SendError(0, h->type, Status::Corruption("a client sent a reply"));
        return;
      }
      if (!refusal_.ok()) {
        SendError(h->request_id, h->type, refusal_);
        return;
      }
      if (!hello_done_ && h->type != p::MessageType::kHello) {
        SendError(h->request_id, h->type,
                  Status::FailedPrecondition("the first message of a connection is its hello"));
        return;
      }
      Request req{
          .header = *h, .payload = got->data.substr(p::kHeaderBytes), .fds = std::move(got->fds)};
      if (OnPool(req)) {
        if (!Queue(std::move(req))) return;
        continue;
      }
      Result<std::string> reply = Handle(req);
      if (!Reply(req.header, reply)) return;
      if (req.header.type == p::MessageType::kHello && !reply.ok()) return;
    }
  }

  // Requests that may wait on the engine (an acquire, a publish wait) or
  // compute (a grad doorbell: norms and accumulation; staged copies) run on
  // the connection's pool, so this thread only reads, decodes and answers.
  bool OnPool(const Request& req) {
    switch (req.header.type) {
      case p::MessageType::kGradsReady:
      case p::MessageType::kWriteWeights:
      case p::MessageType::kReadState:
      case p::MessageType::kWriteState:
        return true;
      case p::MessageType::kAcquireParams:
      case p::MessageType::kWaitPublished:
        break;
      default:
        return false;
    }
    // Already published params in DRAM are answered at once.
    Result<p::StepWait> w = p::DecodeStepWait(req.payload);
    if (!w.ok()) return false;  // the handler names the error
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(w->job);
    if (it == jobs_.end()) return false;
    if (req.header.type == p::MessageType::kAcquireParams && it->second.param_tier != Tier::kDram) {
      return true;
    }
    return d_.engine->PublishedStep(it->second.engine_job, w->unit) < w->step;
  }

  // Hands a request to the pool: a waiting thread takes it, or a new one
  // (threads stay for the connection's life, as many as were ever busy at
  // once, at most max_requests_in_flight). Every queued request needs a
  // thread of its own: one may block until a later one (another rank's
  // grads) has run, so a request never waits behind another.
  bool Queue(Request req) {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_flight_ >= d_.options.max_requests_in_flight) {
      const Status s = Status::ResourceExhausted(
          StrCat("requests in flight on one connection: ", in_flight_, " of the quota of ",
                 d_.options.max_requests_in_flight, " (daemon max_requests_in_flight)"));
      return SendError(req.header.request_id, req.header.type, s);
    }
    ++in_flight_;
    queue_.push_back(std::move(req));
    // A woken thread stays counted as waiting until it runs, so a queue
    // longer than the waiting threads gets a new one.
    if (queue_.size() > static_cast<size_t>(waiting_)) {
      pool_.emplace_back([this] { PoolThread(); });
    } else {
      queue_cv_.notify_one();
    }
    return true;
  }

  void PoolThread() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++waiting_;
      queue_cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      --waiting_;
      if (queue_.empty()) return;  // closing
      Request req = std::move(queue_.front());
      queue_.pop_front();
      const bool skip = closing_;  // the client is gone: nobody reads the reply
      lock.unlock();
      if (!skip) {
        Result<std::string> reply = Handle(req);
        (void)Reply(req.header, reply);
      }
      lock.lock();
      --in_flight_;
    }
  }

  bool Reply(const p::Header& req, const Result<std::string>& reply) {
    if (!reply.ok()) return SendError(req.request_id, req.type, reply.status());
    d_.requests.fetch_add(1, std::memory_order_relaxed);
    std::string payload = p::EncodeStatus(Status::Ok());
    payload += *reply;
    std::vector<int> fds;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const UniqueFd& fd : reply_fds_[req.request_id]) fds.push_back(fd.get());
    }
    const bool sent = SendMessage(req.request_id, req.type, payload, fds);
    std::lock_guard<std::mutex> lock(mu_);
    reply_fds_.erase(req.request_id);
    return sent;
  }

  bool SendError(uint64_t id, p::MessageType type, const Status& s) {
    d_.requests.fetch_add(1, std::memory_order_relaxed);
    return SendMessage(id, type, p::EncodeStatus(Unscoped(s, prefix_)), {});
  }

  bool SendMessage(uint64_t id, p::MessageType type, const std::string& payload,
                   const std::vector<int>& fds) {
    Result<std::string> msg = p::EncodeMessage({.type = type,
                                                .flags = p::kFlagReply,
                                                .request_id = id,
                                                .fds = static_cast<uint32_t>(fds.size())},
                                               payload);
    if (!msg.ok()) {
      ZT_LOG(kError, "ztierd") << Who() << ": " << msg.status();
      return false;
    }
    Status s = sock_.Send(*msg, fds, kSendTimeout);
    if (!s.ok()) {
      ZT_LOG(kInfo, "ztierd") << Who() << ": " << s << "; closing the connection";
      sock_.Shutdown();
      return false;
    }
    return true;
  }

  // ---------------------------------------------------------- requests

  Result<JobEntry> FindJob(int32_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(handle);
    if (it == jobs_.end()) {
      return Status::NotFound(StrCat("no job ", handle, " on this connection"));
    }
    return it->second;
  }

  Result<std::string> Handle(Request& req) {
    const std::string_view in = req.payload;
    // Attached fds are expected only where the request carries one.
    const bool takes_fd = req.header.type == p::MessageType::kWriteWeights ||
                          req.header.type == p::MessageType::kReadState ||
                          req.header.type == p::MessageType::kWriteState ||
                          (req.header.flags & p::kFlagMemfd) != 0;
    if (!takes_fd && !req.fds.empty()) {
      return Status::InvalidArgument(StrCat(p::MessageTypeName(req.header.type), ": ",
                                            req.fds.size(), " unexpected fds (closed)"));
    }
    if (takes_fd && req.fds.size() != 1) {
      return Status::InvalidArgument(StrCat(p::MessageTypeName(req.header.type),
                                            ": needs exactly one memfd, ", req.fds.size(),
                                            " came"));
    }
    if ((req.header.flags & p::kFlagMemfd) != 0 &&
        req.header.type != p::MessageType::kRegisterJob) {
      return Status::InvalidArgument(
          StrCat(p::MessageTypeName(req.header.type), ": only a job spec travels in a memfd"));
    }
    switch (req.header.type) {
      case p::MessageType::kHello:
        return OnHello(in);
      case p::MessageType::kRegisterJob:
        return OnRegister(req);
      case p::MessageType::kAttachJob:
        return Status::Unimplemented(
            "attaching ranks that run in other processes to one job is not supported by this "
            "ztierd; run the ranks as threads of one process");
      case p::MessageType::kUnregisterJob: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_RETURN_IF_ERROR(Unregister(r.job));
        return std::string();
      }
      case p::MessageType::kLayout: {
        ZT_ASSIGN_OR_RETURN(p::UnitRef r, p::DecodeUnitRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_ASSIGN_OR_RETURN(UnitLayout l, d_.engine->Layout(j.engine_job, r.unit));
        return p::Encode(l);
      }
      case p::MessageType::kGradInbox: {
        ZT_ASSIGN_OR_RETURN(p::UnitRef r, p::DecodeUnitRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_ASSIGN_OR_RETURN(UnitLayout l, d_.engine->Layout(j.engine_job, r.unit));
        ZT_ASSIGN_OR_RETURN(bf16 * inbox, d_.engine->GradInbox(j.engine_job, r.unit, r.rank));
        ZT_ASSIGN_OR_RETURN(SharedBuffer b,
                            d_.engine->Locate(j.engine_job, inbox, l.shard * sizeof(bf16)));
        return p::Encode(b);
      }
      case p::MessageType::kGradsReady: {
        ZT_ASSIGN_OR_RETURN(p::UnitRef r, p::DecodeUnitRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_RETURN_IF_ERROR(d_.engine->GradsReady(j.engine_job, r.unit, r.rank));
        return std::string();
      }
      case p::MessageType::kAcquireParams:
        return OnAcquire(in);
      case p::MessageType::kReleaseParams: {
        ZT_ASSIGN_OR_RETURN(p::UnitRef r, p::DecodeUnitRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = leases_.find({j.engine_job, r.unit});
          if (it == leases_.end()) {
            return Status::FailedPrecondition(
                StrCat("job '", j.name, "' unit ", r.unit, ": released without an acquire"));
          }
          if (--it->second == 0) leases_.erase(it);
        }
        ZT_RETURN_IF_ERROR(d_.engine->ReleaseParams(j.engine_job, r.unit));
        return std::string();
      }
      case p::MessageType::kWaitPublished: {
        ZT_ASSIGN_OR_RETURN(p::StepWait w, p::DecodeStepWait(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(w.job));
        ZT_RETURN_IF_ERROR(d_.engine->WaitPublished(j.engine_job, w.unit, w.step, w.timeout));
        return std::string();
      }
      case p::MessageType::kPublishedStep: {
        ZT_ASSIGN_OR_RETURN(p::UnitRef r, p::DecodeUnitRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        return p::Encode(p::StepValue{.step = d_.engine->PublishedStep(j.engine_job, r.unit)});
      }
      case p::MessageType::kTargetStep: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        return p::Encode(p::StepValue{.step = d_.engine->TargetStep(j.engine_job)});
      }
      case p::MessageType::kCounters: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        return p::Encode(d_.engine->counters(j.engine_job));
      }
      case p::MessageType::kPoolStats:
        if (!in.empty()) return Status::InvalidArgument("pool_stats takes no fields");
        return p::Encode(d_.engine->pool_stats());
      case p::MessageType::kRegions:
        return OnRegions(req);
      case p::MessageType::kWriteWeights:
      case p::MessageType::kReadState:
      case p::MessageType::kWriteState:
        return OnStaged(req);
      case p::MessageType::kCommitState: {
        ZT_ASSIGN_OR_RETURN(p::JobSteps s, p::DecodeJobSteps(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(s.job));
        ZT_RETURN_IF_ERROR(d_.engine->CommitState(j.engine_job, s.step, s.adam_step));
        return std::string();
      }
      case p::MessageType::kJobSteps: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_ASSIGN_OR_RETURN(auto steps, d_.engine->Steps(j.engine_job));
        return p::Encode(p::JobSteps{.job = r.job, .step = steps.first, .adam_step = steps.second});
      }
    }
    return Status::InvalidArgument("unknown request");
  }

  Result<std::string> OnHello(std::string_view in) {
    ZT_ASSIGN_OR_RETURN(p::Hello h, p::DecodeHello(in));
    if (hello_done_) return Status::FailedPrecondition("a second hello on one connection");
    if (h.min_version > p::kVersion || h.max_version < p::kVersion) {
      return Status::FailedPrecondition(
          StrCat("the client (", h.name, ") speaks protocol versions ", h.min_version, "..",
                 h.max_version, "; this ztierd speaks ", p::kVersion,
                 ": use a libztier and a ztierd of the same release"));
    }
    hello_done_ = true;
    ZT_LOG(kInfo, "ztierd") << Who() << ": " << h.name << " connected";
    return p::Encode(p::Hello{.name = "ztierd"});
  }

  Result<std::string> OnRegister(Request& req) {
    std::string spec_bytes;
    if ((req.header.flags & p::kFlagMemfd) != 0) {
      ZT_ASSIGN_OR_RETURN(spec_bytes, ReadPayloadMemfd(req.fds[0].get(), p::kMaxMemfdPayloadBytes));
    } else {
      spec_bytes = std::move(req.payload);
    }
    ZT_ASSIGN_OR_RETURN(JobSpec spec, p::DecodeJobSpec(spec_bytes));
    const std::string name = spec.name;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      const int jobs = d_.usage[peer_.uid].jobs;
      if (jobs >= d_.options.max_jobs_per_uid) {
        return Status::ResourceExhausted(
            StrCat("uid ", peer_.uid, " has ", jobs, " jobs, the quota (max_jobs_per_uid) is ",
                   d_.options.max_jobs_per_uid, "; job '", name, "' refused"));
      }
      ++d_.usage[peer_.uid].jobs;
    }
    spec.name = prefix_ + name;
    Result<int> id = d_.engine->RegisterJob(spec);
    if (!id.ok()) {
      std::lock_guard<std::mutex> lock(d_.mu);
      --d_.usage[peer_.uid].jobs;
      return id.status();
    }
    // The uid's share of the tiers, with this job's bytes as the engine
    // holds them now.
    const JobCounters held = d_.engine->counters(*id);
    Status over;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      Impl::Usage& u = d_.usage[peer_.uid];
      const DaemonOptions& o = d_.options;
      if (o.max_dram_bytes_per_uid != 0 &&
          u.dram_bytes + held.dram_bytes > o.max_dram_bytes_per_uid) {
        over = Status::ResourceExhausted(
            StrCat("job '", name, "' needs ", held.dram_bytes, " bytes of pinned DRAM; uid ",
                   peer_.uid, " holds ", u.dram_bytes, " of its quota of ",
                   o.max_dram_bytes_per_uid, " (max_dram_bytes_per_uid)"));
      } else if (o.max_nvme_bytes_per_uid != 0 &&
                 u.nvme_bytes + held.nvme_bytes > o.max_nvme_bytes_per_uid) {
        over = Status::ResourceExhausted(
            StrCat("job '", name, "' needs ", held.nvme_bytes, " bytes of swap; uid ", peer_.uid,
                   " holds ", u.nvme_bytes, " of its quota of ", o.max_nvme_bytes_per_uid,
                   " (max_nvme_bytes_per_uid)"));
      }
      if (over.ok()) {
        u.dram_bytes += held.dram_bytes;
        u.nvme_bytes += held.nvme_bytes;
      } else {
        --u.jobs;
      }
    }
    if (!over.ok()) {
      (void)d_.engine->UnregisterJob(*id);
      return over;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const int32_t handle = next_handle_++;
    jobs_[handle] = JobEntry{.engine_job = *id,
                             .name = name,
                             .units = static_cast<int>(spec.units.size()),
                             .ranks = spec.ranks,
                             .param_tier = spec.param_tier,
                             .dram_bytes = held.dram_bytes,
                             .nvme_bytes = held.nvme_bytes};
    ZT_LOG(kInfo, "ztierd") << Who() << ": job '" << name << "' registered (" << spec.units.size()
                            << " units, " << spec.ranks << " ranks)";
    return p::Encode(p::JobHandle{
        .job = handle, .units = static_cast<int32_t>(spec.units.size()), .ranks = spec.ranks});
  }

  Result<std::string> OnAcquire(std::string_view in) {
    ZT_ASSIGN_OR_RETURN(p::StepWait w, p::DecodeStepWait(in));
    ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(w.job));
    ZT_ASSIGN_OR_RETURN(UnitLayout l, d_.engine->Layout(j.engine_job, w.unit));
    ZT_ASSIGN_OR_RETURN(const bf16* params,
                        d_.engine->AcquireParams(j.engine_job, w.unit, w.step, w.timeout));
    Result<SharedBuffer> b = d_.engine->Locate(j.engine_job, params, l.padded * sizeof(bf16));
    if (!b.ok()) {
      (void)d_.engine->ReleaseParams(j.engine_job, w.unit);
      return b.status();
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++leases_[{j.engine_job, w.unit}];
    return p::Encode(*b);
  }

  Result<std::string> OnRegions(const Request& req) {
    ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(req.payload));
    ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
    ZT_ASSIGN_OR_RETURN(std::vector<SharedBuffer> regions, d_.engine->SharedRegions(j.engine_job));
    if (regions.empty() || regions.size() > p::kMaxFdsPerMessage) {
      return Status::Internal(StrCat("job '", j.name, "' has ", regions.size(), " regions"));
    }
    p::RegionList list;
    std::vector<UniqueFd> fds;
    for (const SharedBuffer& b : regions) {
      ZT_ASSIGN_OR_RETURN(UniqueFd fd, d_.engine->DupRegionFd(j.engine_job, b.region));
      fds.push_back(std::move(fd));
      list.regions.push_back(
          p::RegionInfo{.region = b.region, .bytes = b.region_bytes, .access = b.access});
    }
    std::lock_guard<std::mutex> lock(mu_);
    reply_fds_[req.header.request_id] = std::move(fds);
    return p::Encode(list);
  }

  // Weights in, a unit's state out or in, through the client's staging memfd.
  Result<std::string> OnStaged(const Request& req) {
    const bool weights = req.header.type == p::MessageType::kWriteWeights;
    const bool read = req.header.type == p::MessageType::kReadState;
    ZT_ASSIGN_OR_RETURN(p::StagedData s, p::DecodeStagedData(req.payload));
    ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(s.job));
    ZT_ASSIGN_OR_RETURN(UnitLayout l, d_.engine->Layout(j.engine_job, s.unit));
    const uint64_t need = weights ? l.numel * sizeof(float) : 3 * l.padded * sizeof(float);
    if (s.bytes != need) {
      return Status::InvalidArgument(StrCat("job '", j.name, "' unit ", s.unit, ": ", s.bytes,
                                            " staged bytes, the unit needs ", need));
    }
    ZT_RETURN_IF_ERROR(CheckPeerMemfd(req.fds[0].get(), need, UINT64_MAX, RegionAccess::kReadWrite,
                                      "the staging memfd")
                           .status());
    ZT_ASSIGN_OR_RETURN(
        Mapping m, Mapping::Map(req.fds[0].get(), need, /*writable=*/read, "the staging memfd"));
    auto* f = static_cast<float*>(m.data());
    if (weights) {
      ZT_RETURN_IF_ERROR(d_.engine->WriteWeights(j.engine_job, s.unit, f, l.numel));
    } else if (read) {
      ZT_RETURN_IF_ERROR(
          d_.engine->ReadState(j.engine_job, s.unit, f, f + l.padded, f + 2 * l.padded));
    } else {
      ZT_RETURN_IF_ERROR(
          d_.engine->WriteState(j.engine_job, s.unit, f, f + l.padded, f + 2 * l.padded));
    }
    return std::string();
  }

  Status Unregister(int32_t handle) {
    JobEntry j;
    std::vector<std::pair<int, int>> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(handle);
      if (it == jobs_.end()) {
        return Status::NotFound(StrCat("no job ", handle, " on this connection"));
      }
      j = it->second;
      jobs_.erase(it);
      for (auto l = leases_.begin(); l != leases_.end();) {
        if (l->first.first == j.engine_job) {
          for (int k = 0; k < l->second; ++k) held.push_back(l->first);
          l = leases_.erase(l);
        } else {
          ++l;
        }
      }
    }
    for (const auto& [job, unit] : held) (void)d_.engine->ReleaseParams(job, unit);
    Status s = d_.engine->UnregisterJob(j.engine_job);
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      Impl::Usage& u = d_.usage[peer_.uid];
      --u.jobs;
      u.dram_bytes -= j.dram_bytes;
      u.nvme_bytes -= j.nvme_bytes;
    }
    ZT_LOG(kInfo, "ztierd") << Who() << ": job '" << j.name << "' unregistered";
    return s;
  }

  void UnregisterAll() {
    std::vector<int32_t> handles;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [h, j] : jobs_) handles.push_back(h);
    }
    for (int32_t h : handles) (void)Unregister(h);
  }

  // The client is gone or the daemon stops: free what the connection held.
  void Close() {
    if (!refusal_.ok()) {
      sock_.Shutdown();
      finished_.store(true);
      return;
    }
    if (d_.stopping.load()) {
      std::string reason;
      {
        std::lock_guard<std::mutex> lock(d_.mu);
        reason = d_.stop_reason;
      }
      (void)SendError(0, p::MessageType::kHello, Status::Unavailable(reason));
    }
    // No queued request starts from now on; unregistering the jobs ends
    // the waits of the requests running (Aborted), so the pool can be joined.
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    queue_cv_.notify_all();
    UnregisterAll();
    sock_.Shutdown();
    std::vector<std::thread> pool;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pool.swap(pool_);
    }
    for (std::thread& t : pool) t.join();
    UnregisterAll();  // any a running request registered meanwhile
    // A worker may have taken a lease after its job's handles were read.
    std::map<std::pair<int, int>, int> leases;
    {
      std::lock_guard<std::mutex> lock(mu_);
      leases.swap(leases_);
    }
    for (const auto& [key, n] : leases) {
      for (int k = 0; k < n; ++k) (void)d_.engine->ReleaseParams(key.first, key.second);
    }
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      --d_.usage[peer_.uid].connections;
      --d_.connections;
    }
    ZT_LOG(kInfo, "ztierd") << Who() << ": connection closed";
    finished_.store(true);
    d_.all_closed.notify_all();
  }

  std::string Who() const { return StrCat("client pid ", peer_.pid, " uid ", peer_.uid); }

  Impl& d_;
  SeqPacketSocket sock_;
  const PeerCredentials peer_;
  const std::string prefix_;
  const Status refusal_;
  std::thread thread_;
  std::atomic<bool> finished_{false};
  bool hello_done_ = false;  // the connection thread's

  std::mutex mu_;
  std::map<int32_t, JobEntry> jobs_;
  int32_t next_handle_ = 1;
  std::map<std::pair<int, int>, int> leases_;  // (engine job, unit) -> acquires held
  // The pool (see Queue).
  std::deque<Request> queue_;
  std::vector<std::thread> pool_;
  std::condition_variable queue_cv_;
  int waiting_ = 0;    // threads in queue_cv_.wait
  int in_flight_ = 0;  // queued or running
  bool closing_ = false;
  std::map<uint64_t, std::vector<UniqueFd>> reply_fds_;  // fds to attach to a reply
};

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() {
  Stop("ztierd is shutting down");
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->all_closed.wait(lock, [&] { return impl_->connections == 0; });
  for (auto& c : impl_->live) c->Join();
}

Result<std::unique_ptr<Daemon>> Daemon::Create(const Settings& settings,
                                               const DaemonOptions& options,
                                               std::shared_ptr<nvme::IoBackend> io_backend) {
  if (options.max_connections_per_uid < 1 || options.max_jobs_per_uid < 1 ||
      options.max_requests_in_flight < 1) {
    return Status::InvalidArgument("ztierd quotas must be at least 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  ZT_ASSIGN_OR_RETURN(impl->engine, Engine::Create(settings, std::move(io_backend)));
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

Engine& Daemon::engine() { return *impl_->engine; }

void Daemon::Stop(std::string_view reason) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->stopping.load()) return;
  impl_->stop_reason = std::string(reason);
  impl_->stopping.store(true);
}

DaemonStats Daemon::stats() const {
  DaemonStats s;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    s.connections = impl_->connections;
    for (const auto& [uid, u] : impl_->usage) s.jobs += u.jobs;
  }
  s.requests = impl_->requests.load();
  s.refused = impl_->refused.load();
  return s;
}

Status Daemon::Serve(SeqPacketListener& listener) {
  Impl& d = *impl_;
  Status result;
  while (!d.stopping.load()) {
    // Join connections that ended.
    {
      std::lock_guard<std::mutex> lock(d.mu);
      for (auto it = d.live.begin(); it != d.live.end();) {
        if ((*it)->finished()) {
          (*it)->Join();
          it = d.live.erase(it);
        } else {
          ++it;
        }
      }
    }
    Result<SeqPacketSocket> sock = listener.Accept(kPollInterval);
    if (!sock.ok()) {
      if (sock.status().code() == StatusCode::kUnavailable) continue;
      result = sock.status();
      break;
    }
    Result<PeerCredentials> peer = sock->Peer();
    if (!peer.ok()) {
      ZT_LOG(kWarn, "ztierd") << "a connection without credentials: " << peer.status();
      d.refused.fetch_add(1);
      continue;
    }
    Status refuse;
    {
      std::lock_guard<std::mutex> lock(d.mu);
      Impl::Usage& u = d.usage[peer->uid];
      if (!d.Allowed(peer->uid)) {
        refuse = Status::FailedPrecondition(
            StrCat("uid ", peer->uid, " is not on this ztierd's list of allowed users"));
      } else if (u.connections >= d.options.max_connections_per_uid) {
        refuse = Status::ResourceExhausted(
            StrCat("uid ", peer->uid, " has ", u.connections,
                   " connections, the quota (max_connections_per_uid) is ",
                   d.options.max_connections_per_uid));
      } else {
        ++u.connections;
        ++d.connections;
      }
    }
    if (!refuse.ok()) {
      ZT_LOG(kWarn, "ztierd") << "refused pid " << peer->pid << ": " << refuse;
      d.refused.fetch_add(1);
    }
    auto conn = std::make_unique<Impl::Connection>(d, *std::move(sock), *peer, refuse);
    Impl::Connection* c = conn.get();
    {
      std::lock_guard<std::mutex> lock(d.mu);
      d.live.push_back(std::move(conn));
    }
    c->Start();
  }
  d.stopping.store(true);
  std::unique_lock<std::mutex> lock(d.mu);
  d.all_closed.wait(lock, [&] { return d.connections == 0; });
  for (auto& c : d.live) c->Join();
  d.live.clear();
  return result;
}

}  // namespace ztier::engine
