// The daemon transport: libztier's calls sent to ztierd over its socket
// (engine/protocol.h), with the job's regions mapped into this process. It
// links the wire code only, never the engine.
//
// One receiver thread reads every reply and hands it to the caller waiting
// on its request id, so a call that blocks in the daemon (an acquire, a
// publish wait) never holds up the others. The regions of a job are mapped
// when it registers (grad inboxes read-write, params read-only) and
// unmapped when it unregisters; the engine hands out {region, offset},
// turned into pointers here after a bounds check.
//
// Thread safety: every method from any thread. Failure: the daemon's errors
// as it sent them; Unavailable naming the socket when the daemon is gone
// (closed connection, no answer in time: every waiting call fails at once),
// with the daemon's reason when it said one (a stop); InvalidArgument for a
// region or buffer the daemon described wrongly.
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/transport.h"
#include "common/log.h"
#include "engine/protocol.h"
#include "engine/seqpacket.h"
#include "engine/shared_memory.h"

namespace ztier::client {
namespace {

namespace p = engine::protocol;
using engine::Mapping;
using engine::RegionAccess;
using engine::SeqPacketSocket;
using engine::SharedBuffer;

// How long a call that does not wait on training progress may take; calls
// that do (acquire, publish wait) get their own timeout plus this margin.
constexpr std::chrono::seconds kCallTimeout{120};

struct Reply {
  std::string payload;  // after the status
  std::vector<UniqueFd> fds;
};

class DaemonTransport final : public Transport {
 public:
  static Result<std::shared_ptr<Transport>> Connect(const std::string& path) {
    ZT_ASSIGN_OR_RETURN(SeqPacketSocket sock, SeqPacketSocket::Connect(path));
    auto t = std::shared_ptr<DaemonTransport>(new DaemonTransport(path, std::move(sock)));
    t->receiver_ = std::thread([raw = t.get()] { raw->ReceiveLoop(); });
    Result<Reply> r =
        t->Call(p::MessageType::kHello, p::Encode(p::Hello{.name = "libztier"}), {}, kCallTimeout);
    if (!r.ok()) {
      const Status& s = r.status();
      if (s.message().starts_with("ztierd at ")) return s;
      return Status(s.code(), StrCat("ztierd at ", path, ": ", s.message()), s.sys_errno());
    }
    ZT_ASSIGN_OR_RETURN(p::Hello h, p::DecodeHello(r->payload));
    ZT_LOG(kInfo, "client") << "connected to " << h.name << " at " << path;
    return std::shared_ptr<Transport>(std::move(t));
  }

  ~DaemonTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    sock_.Shutdown();
    if (receiver_.joinable()) receiver_.join();
  }

  std::string name() const override { return "daemon"; }

  Result<int> RegisterJob(const engine::JobSpec& spec) override {
    std::string bytes = p::Encode(spec);
    Result<Reply> r = Status::Internal("unsent");
    if (bytes.size() <= p::kMaxMessageBytes - p::kHeaderBytes) {
      r = Call(p::MessageType::kRegisterJob, std::move(bytes), {}, kCallTimeout);
    } else {
      ZT_ASSIGN_OR_RETURN(UniqueFd fd, engine::MemfdWithPayload("ztier-job-spec", bytes));
      const int fds[] = {fd.get()};
      r = Call(p::MessageType::kRegisterJob, "", fds, kCallTimeout, p::kFlagMemfd);
    }
    if (!r.ok()) return r.status();
    ZT_ASSIGN_OR_RETURN(p::JobHandle h, p::DecodeJobHandle(r->payload));
    if (h.units != static_cast<int32_t>(spec.units.size()) || h.ranks != spec.ranks) {
      return Status::Internal(StrCat("ztierd registered job '", spec.name, "' with ", h.units,
                                     " units and ", h.ranks, " ranks"));
    }
    Status mapped = MapRegions(h.job, static_cast<int>(spec.units.size()));
    if (!mapped.ok()) {
      (void)Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = h.job}), {},
                 kCallTimeout);
      return mapped;
    }
    return h.job;
  }

  Status UnregisterJob(int job) override {
    Result<Reply> r =
        Call(p::MessageType::kUnregisterJob, p::Encode(p::JobRef{.job = job}), {}, kCallTimeout);
    // The mappings go either way: the job is gone or the daemon is.
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.erase(job);
    return r.status();
  }

  Result<engine::UnitLayout> Layout(int job, int unit) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(job);
      if (it != jobs_.end() && unit >= 0 && unit < static_cast<int>(it->second.layouts.size()) &&
          it->second.layouts[unit].numel > 0) {
        return it->second.layouts[unit];
      }
    }
    ZT_ASSIGN_OR_RETURN(
        Reply r, Call(p::MessageType::kLayout, p::Encode(p::UnitRef{.job = job, .unit = unit}), {},
                      kCallTimeout));
    ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, p::DecodeUnitLayout(r.payload));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job);
    if (it != jobs_.end() && unit >= 0 && unit < static_cast<int>(it->second.layouts.size())) {
      it->second.layouts[unit] = l;
    }
    return l;
  }

  Status WriteWeights(int job, int unit, const float* flat, uint64_t numel) override {
    ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, Layout(job, unit));
    if (numel != l.numel) {
      return Status::InvalidArgument(
          StrCat("unit ", unit, ": ", numel, " weights given, the unit has ", l.numel));
    }
    const uint64_t bytes = numel * sizeof(float);
    ZT_ASSIGN_OR_RETURN(UniqueFd fd, engine::MakeSealedMemfd("ztier-staging", bytes));
    {
      ZT_ASSIGN_OR_RETURN(Mapping m, Mapping::Map(fd.get(), bytes, true, "the staging memfd"));
      std::memcpy(m.data(), flat, bytes);
    }
    const int fds[] = {fd.get()};
    return Call(p::MessageType::kWriteWeights,
                p::Encode(p::StagedData{.job = job, .unit = unit, .bytes = bytes}), fds,
                kCallTimeout)
        .status();
  }

  Status ReadState(int job, int unit, float* master, float* m, float* v) override {
    ZT_ASSIGN_OR_RETURN(engine::UnitLayout l, Layout(job, unit));
    const uint64_t one = l.padded * sizeof(float);
    ZT_ASSIGN_OR_RETURN(UniqueFd fd, engine::MakeSealedMemfd("ztier-staging", 3 * one));
    const int fds[] = {fd.get()};
    ZT_RETURN_IF_ERROR(Call(p::MessageType::kReadState,
                            p::Encode(p::StagedData{.job = job, .unit = unit, .bytes = 3 * one}),
                            fds, kCallTimeout)
                           .status());
    ZT_ASSIGN_OR_RETURN(Mapping map, Mapping::Map(fd.get(), 3 * one, false, "the staging memfd"));
    const char* base = static_cast<const char*>(map.data());
    std::memcpy(master, base, one);
    std::memcpy(m, base + one, one);
    std::memcpy(v, base + 2 * one, one);
    return Status::Ok();
  }

  Result<bf16*> GradInbox(int job, int unit, int rank) override {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kGradInbox,
                                      p::Encode(p::UnitRef{.job = job, .unit = unit, .rank = rank}),
                                      {}, kCallTimeout));
    ZT_ASSIGN_OR_RETURN(SharedBuffer b, p::DecodeSharedBuffer(r.payload));
    ZT_ASSIGN_OR_RETURN(void* ptr, Resolve(job, b, RegionAccess::kReadWrite));
    return static_cast<bf16*>(ptr);
  }

  Status GradsReady(int job, int unit, int rank) override {
    return Call(p::MessageType::kGradsReady,
                p::Encode(p::UnitRef{.job = job, .unit = unit, .rank = rank}), {}, kCallTimeout)
        .status();
  }

  Result<const bf16*> AcquireParams(int job, int unit, int64_t step,
                                    std::chrono::milliseconds timeout) override {
    ZT_ASSIGN_OR_RETURN(
        Reply r,
        Call(p::MessageType::kAcquireParams,
             p::Encode(p::StepWait{.job = job, .unit = unit, .step = step, .timeout = timeout}), {},
             timeout + kCallTimeout));
    ZT_ASSIGN_OR_RETURN(SharedBuffer b, p::DecodeSharedBuffer(r.payload));
    Result<void*> ptr = Resolve(job, b, RegionAccess::kReadOnly);
    if (!ptr.ok()) {
      (void)ReleaseParams(job, unit);
      return ptr.status();
    }
    return static_cast<const bf16*>(*ptr);
  }

  Status ReleaseParams(int job, int unit) override {
    return Call(p::MessageType::kReleaseParams, p::Encode(p::UnitRef{.job = job, .unit = unit}), {},
                kCallTimeout)
        .status();
  }

  Status WaitPublished(int job, int unit, int64_t step,
                       std::chrono::milliseconds timeout) override {
    return Call(p::MessageType::kWaitPublished,
                p::Encode(p::StepWait{.job = job, .unit = unit, .step = step, .timeout = timeout}),
                {}, timeout + kCallTimeout)
        .status();
  }

  int64_t PublishedStep(int job, int unit) override {
    return StepQuery(p::MessageType::kPublishedStep,
                     p::Encode(p::UnitRef{.job = job, .unit = unit}));
  }
  int64_t TargetStep(int job) override {
    return StepQuery(p::MessageType::kTargetStep, p::Encode(p::JobRef{.job = job}));
  }

  Status ClaimCheckpointDir(int, const std::string& dir) override { return NotThroughDaemon(dir); }
  Status SaveCheckpoint(int, const std::string& dir) override { return NotThroughDaemon(dir); }
  Status LoadCheckpoint(int, const std::string& dir) override { return NotThroughDaemon(dir); }
  Status ExportSafetensors(int, const std::string& path, engine::ExportType) override {
    return NotThroughDaemon(path);
  }
  Status ImportSafetensors(int, const std::string& path) override { return NotThroughDaemon(path); }

  engine::JobCounters Counters(int job) override {
    Result<Reply> r =
        Call(p::MessageType::kCounters, p::Encode(p::JobRef{.job = job}), {}, kCallTimeout);
    if (r.ok()) {
      Result<engine::JobCounters> c = p::DecodeJobCounters(r->payload);
      if (c.ok()) return *c;
      r = c.status();
    }
    ZT_LOG(kWarn, "client") << "counters of job " << job << ": " << r.status();
    return {};
  }

  engine::DramPoolStats PoolStats() override {
    Result<Reply> r = Call(p::MessageType::kPoolStats, "", {}, kCallTimeout);
    if (r.ok()) {
      Result<engine::DramPoolStats> s = p::DecodeDramPoolStats(r->payload);
      if (s.ok()) return *s;
      r = s.status();
    }
    ZT_LOG(kWarn, "client") << "pool stats: " << r.status();
    return {};
  }

  std::vector<std::pair<void*, uint64_t>> PinnedRegions(int job) override {
    std::vector<std::pair<void*, uint64_t>> out;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return out;
    for (const auto& [index, region] : it->second.regions) {
      out.emplace_back(region.mapping.data(), region.mapping.bytes());
    }
    return out;
  }

 private:
  struct Region {
    Mapping mapping;
    RegionAccess access = RegionAccess::kReadOnly;
  };
  struct Job {
    std::map<uint32_t, Region> regions;
    std::vector<engine::UnitLayout> layouts;  // numel 0: not fetched yet
  };
  struct Pending {
    bool done = false;
    Result<Reply> reply = Status::Internal("no reply");
  };

  DaemonTransport(std::string path, SeqPacketSocket sock)
      : path_(std::move(path)), sock_(std::move(sock)) {}

  static Status NotThroughDaemon(const std::string& path) {
    return Status::Unimplemented(
        StrCat("'", path,
               "': checkpoints and safetensors files are not moved through ztierd by this "
               "release; train with the embedded engine (no daemon socket) to save or load them"));
  }

  int64_t StepQuery(p::MessageType type, std::string payload) {
    Result<Reply> r = Call(type, std::move(payload), {}, kCallTimeout);
    if (!r.ok()) return -1;
    Result<p::StepValue> v = p::DecodeStepValue(r->payload);
    return v.ok() ? v->step : -1;
  }

  // Maps the job's regions, checking each memfd's size and seals first.
  Status MapRegions(int32_t job, int units) {
    ZT_ASSIGN_OR_RETURN(Reply r, Call(p::MessageType::kRegions, p::Encode(p::JobRef{.job = job}),
                                      {}, kCallTimeout));
    ZT_ASSIGN_OR_RETURN(p::RegionList list, p::DecodeRegionList(r.payload));
    if (list.regions.size() != r.fds.size()) {
      return Status::Corruption(StrCat("ztierd described ", list.regions.size(),
                                       " regions and sent ", r.fds.size(), " memfds"));
    }
    Job j;
    j.layouts.resize(static_cast<size_t>(units));
    for (size_t k = 0; k < list.regions.size(); ++k) {
      const p::RegionInfo& info = list.regions[k];
      const std::string what = StrCat("region ", info.region, " from ztierd");
      ZT_RETURN_IF_ERROR(
          engine::CheckPeerMemfd(r.fds[k].get(), info.bytes, info.bytes, info.access, what)
              .status());
      ZT_ASSIGN_OR_RETURN(Mapping m, Mapping::Map(r.fds[k].get(), info.bytes,
                                                  info.access == RegionAccess::kReadWrite, what));
      j.regions[info.region] = Region{.mapping = std::move(m), .access = info.access};
    }
    std::lock_guard<std::mutex> lock(mu_);
    jobs_[job] = std::move(j);
    return Status::Ok();
  }

  // A buffer the daemon named, as a pointer into the job's mapping.
  Result<void*> Resolve(int job, const SharedBuffer& b, RegionAccess want) {
    std::lock_guard<std::mutex> lock(mu_);
    auto j = jobs_.find(job);
    if (j == jobs_.end()) return Status::NotFound(StrCat("job ", job, " is not mapped"));
    auto r = j->second.regions.find(b.region);
    if (r == j->second.regions.end() || r->second.mapping.bytes() != b.region_bytes ||
        r->second.access != want || b.access != want) {
      return Status::InvalidArgument(StrCat("ztierd named region ", b.region,
                                            ", which is not one of the job's mapped regions with "
                                            "that size and access"));
    }
    return static_cast<char*>(r->second.mapping.data()) + b.offset;  // bounds: DecodeSharedBuffer
  }

  // Sends a request and waits for its reply (or the connection's end).
  Result<Reply> Call(p::MessageType type, std::string payload, std::span<const int> fds,
                     std::chrono::milliseconds timeout, uint32_t flags = 0) {
    auto pending = std::make_shared<Pending>();
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!dead_.ok()) return dead_;
      id = next_id_++;
      pending_[id] = pending;
    }
    auto forget = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.erase(id);
    };
    Result<std::string> msg = p::EncodeMessage(
        {.type = type, .flags = flags, .request_id = id, .fds = static_cast<uint32_t>(fds.size())},
        payload);
    if (!msg.ok()) {
      forget();
      return msg.status();
    }
    Status sent = sock_.Send(*msg, fds, std::chrono::seconds(30));
    if (!sent.ok()) {
      forget();
      // A daemon that refused or stopped said why before it closed: give
      // the receiver a moment to read that.
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::seconds(2), [&] { return !dead_.ok(); });
      }
      return Gone(sent);
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return pending->done; })) {
      pending_.erase(id);
      return Status::Unavailable(
          StrCat("ztierd at ", path_, " did not answer ", p::MessageTypeName(type), " within ",
                 std::chrono::duration_cast<std::chrono::seconds>(timeout).count(), " s"));
    }
    return std::move(pending->reply);
  }

  Status Gone(const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_.ok()) {
      dead_ = Status::Unavailable(StrCat("ztierd at ", path_, " is gone (", why.message(),
                                         "); the DRAM state of this session's jobs went with "
                                         "it: resume from a checkpoint"));
    }
    return dead_;
  }

  void ReceiveLoop() {
    for (;;) {
      pollfd pfd{.fd = sock_.fd(), .events = POLLIN, .revents = 0};
      const int n = ::poll(&pfd, 1, 500);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closing_) break;
      }
      if (n == 0 || (n < 0 && errno == EINTR)) continue;
      Result<SeqPacketSocket::Received> got =
          sock_.Receive(std::chrono::milliseconds(0), p::kMaxMessageBytes, p::kMaxFdsPerMessage);
      if (!got.ok()) {
        FailAll(got.status());
        return;
      }
      Result<p::Header> h = p::DecodeHeader(got->data, static_cast<uint32_t>(got->fds.size()));
      if (!h.ok() || (h->flags & p::kFlagReply) == 0) {
        FailAll(h.ok() ? Status::Corruption("ztierd sent a request") : h.status());
        return;
      }
      Result<std::string_view> body =
          p::DecodeReplyStatus(std::string_view(got->data).substr(p::kHeaderBytes));
      if (h->request_id == 0) {
        // The daemon's last word: why it closes the connection (a stop, a
        // refusal), passed on as it said it.
        const Status why =
            body.ok() ? Status::Corruption("ztierd sent an empty notice") : body.status();
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (dead_.ok()) {
            dead_ = Status(why.code(), StrCat("ztierd at ", path_, ": ", why.message()),
                           why.sys_errno());
          }
        }
        FailAll(why);
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(h->request_id);
      if (it == pending_.end()) continue;  // its caller gave up
      if (body.ok()) {
        it->second->reply = Reply{.payload = std::string(*body), .fds = std::move(got->fds)};
      } else {
        it->second->reply = body.status();
      }
      it->second->done = true;
      pending_.erase(it);
      cv_.notify_all();
    }
    FailAll(Status::Unavailable("the session closed"));
  }

  void FailAll(const Status& why) {
    (void)Gone(why);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : pending_) {
      p->reply = dead_;
      p->done = true;
    }
    pending_.clear();
    cv_.notify_all();
  }

  const std::string path_;
  SeqPacketSocket sock_;
  std::thread receiver_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closing_ = false;
  Status dead_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Pending>> pending_;
  std::map<int, Job> jobs_;
};

}  // namespace

Result<std::shared_ptr<Transport>> MakeDaemonTransport(const std::string& socket_path) {
  return DaemonTransport::Connect(socket_path);
}

}  // namespace ztier::client
