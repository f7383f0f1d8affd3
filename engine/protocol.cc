// ztier engine: the wire protocol's codec (see protocol.h).
#include "engine/protocol.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common/numbers.h"

namespace ztier::engine::protocol {
namespace {

static_assert(std::endian::native == std::endian::little, "the wire is little endian");

// Appends fields; sizes are the caller's (encoders only see valid structs).
class Writer {
 public:
  template <class T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    char bytes[sizeof(T)];
    std::memcpy(bytes, &v, sizeof(T));
    out_.append(bytes, sizeof(T));
  }
  void Str(std::string_view s) {
    Put(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads fields, each checked against the bytes left; the first failure
// sticks and names its field.
class Reader {
 public:
  Reader(std::string_view bytes, std::string_view what) : in_(bytes), what_(what) {}

  template <class T>
  bool Get(T* v, std::string_view field) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (!status_.ok()) return false;
    if (in_.size() < sizeof(T)) return Fail(StrCat(field, ": the message ends early"));
    std::memcpy(v, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool Str(std::string* s, std::string_view field, uint32_t max_bytes) {
    uint32_t n = 0;
    if (!Get(&n, field)) return false;
    if (n > max_bytes) return Fail(StrCat(field, ": ", n, " bytes, over the limit of ", max_bytes));
    if (in_.size() < n)
      return Fail(StrCat(field, ": ", n, " bytes announced, ", in_.size(), " left"));
    s->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  // A count of items of at least `min_item_bytes` each: refused before
  // anything is allocated when the bytes left cannot hold them.
  bool Count(uint32_t* n, std::string_view field, uint32_t max, size_t min_item_bytes) {
    if (!Get(n, field)) return false;
    if (*n > max) return Fail(StrCat(field, ": ", *n, ", over the limit of ", max));
    if (min_item_bytes > 0 && *n > in_.size() / min_item_bytes) {
      return Fail(StrCat(field, ": ", *n, " items cannot fit in the ", in_.size(), " bytes left"));
    }
    return true;
  }
  bool Fail(std::string_view why) {
    if (status_.ok()) status_ = Status::Corruption(StrCat(what_, ": ", why));
    return false;
  }
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // The status after the last field: trailing bytes are an error.
  Status Finish() {
    if (status_.ok() && !in_.empty()) {
      Fail(StrCat(in_.size(), " bytes after the last field"));
    }
    return status_;
  }
  std::string_view rest() const { return in_; }

 private:
  std::string_view in_;
  std::string_view what_;
  Status status_;
};

template <class T>
Result<T> Done(Reader& r, T v) {
  Status s = r.Finish();
  if (!s.ok()) return s;
  return v;
}

bool Finite(double x) { return std::isfinite(x); }

bool ValidAccess(uint8_t access) {
  return access == static_cast<uint8_t>(RegionAccess::kReadWrite) ||
         access == static_cast<uint8_t>(RegionAccess::kReadOnly);
}

}  // namespace

std::string_view MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kHello:
      return "hello";
    case MessageType::kRegisterJob:
      return "register_job";
    case MessageType::kAttachJob:
      return "attach_job";
    case MessageType::kCollectiveRegion:
      return "collective_region";
    case MessageType::kStepPage:
      return "step_page";
    case MessageType::kSetLearningRates:
      return "set_learning_rates";
    case MessageType::kAbortStep:
      return "abort_step";
    case MessageType::kCheckConsistent:
      return "check_consistent";
    case MessageType::kUnregisterJob:
      return "unregister_job";
    case MessageType::kLayout:
      return "layout";
    case MessageType::kGradInbox:
      return "grad_inbox";
    case MessageType::kGradsReady:
      return "grads_ready";
    case MessageType::kAcquireParams:
      return "acquire_params";
    case MessageType::kReleaseParams:
      return "release_params";
    case MessageType::kWaitPublished:
      return "wait_published";
    case MessageType::kPublishedStep:
      return "published_step";
    case MessageType::kCounters:
      return "counters";
    case MessageType::kPoolStats:
      return "pool_stats";
    case MessageType::kTargetStep:
      return "target_step";
    case MessageType::kRegions:
      return "regions";
    case MessageType::kWriteWeights:
      return "write_weights";
    case MessageType::kReadState:
      return "read_state";
    case MessageType::kWriteState:
      return "write_state";
    case MessageType::kCommitState:
      return "commit_state";
    case MessageType::kJobSteps:
      return "job_steps";
    case MessageType::kClientPage:
      return "client_page";
    case MessageType::kDaemonStatus:
      return "daemon_status";
    case MessageType::kListJobs:
      return "list_jobs";
    case MessageType::kGetQuota:
      return "get_quota";
    case MessageType::kSetQuota:
      return "set_quota";
    case MessageType::kDrain:
      return "drain";
    case MessageType::kEvictJob:
      return "evict_job";
  }
  return "unknown";
}

std::string_view JobStateName(JobState state) {
  switch (state) {
    case JobState::kTraining:
      return "training";
    case JobState::kParked:
      return "parked";
    case JobState::kFailed:
      return "failed";
  }
  return "unknown";
}

// ------------------------------------------------------------ framing

Result<std::string> EncodeMessage(Header header, std::string_view payload) {
  if (payload.size() > kMaxMessageBytes - kHeaderBytes) {
    return Status::InvalidArgument(StrCat(MessageTypeName(header.type), " message: a payload of ",
                                          payload.size(), " bytes does not fit in a ",
                                          kMaxMessageBytes, "-byte message; send it in a memfd"));
  }
  if (header.fds > kMaxFdsPerMessage) {
    return Status::InvalidArgument(StrCat("a message carries at most ", kMaxFdsPerMessage, " fds"));
  }
  Writer w;
  w.Put(kMagic);
  w.Put(header.version);
  w.Put(static_cast<uint16_t>(header.type));
  w.Put(header.flags);
  w.Put(static_cast<uint32_t>(payload.size()));
  w.Put(header.request_id);
  w.Put(header.fds);
  w.Put(uint32_t{0});
  std::string out = w.Take();
  out.append(payload);
  return out;
}

Result<Header> DecodeHeader(std::string_view datagram, uint32_t fds_received) {
  if (datagram.size() < kHeaderBytes) {
    return Status::Corruption(StrCat("message of ", datagram.size(), " bytes, shorter than the ",
                                     kHeaderBytes, "-byte header"));
  }
  if (datagram.size() > kMaxMessageBytes) {
    return Status::Corruption(
        StrCat("message of ", datagram.size(), " bytes, over the limit of ", kMaxMessageBytes));
  }
  Reader r(datagram.substr(0, kHeaderBytes), "message header");
  uint32_t magic = 0, flags = 0, payload = 0, fds = 0, reserved = 0;
  uint16_t version = 0, type = 0;
  uint64_t id = 0;
  r.Get(&magic, "magic");
  r.Get(&version, "version");
  r.Get(&type, "type");
  r.Get(&flags, "flags");
  r.Get(&payload, "payload bytes");
  r.Get(&id, "request id");
  r.Get(&fds, "fd count");
  r.Get(&reserved, "reserved");
  ZT_RETURN_IF_ERROR(r.Finish());
  if (magic != kMagic) {
    return Status::Corruption(StrCat("not a ztier message (magic 0x", std::hex, magic, ")"));
  }
  if (version != kVersion) {
    return Status::FailedPrecondition(StrCat("protocol version ", version,
                                             " from the peer; this side speaks version ", kVersion,
                                             ": use a libztier and a ztierd of the same release"));
  }
  if (type == 0 || type > kLastMessageType) {
    return Status::Corruption(StrCat("unknown message type ", type));
  }
  if ((flags & ~kKnownFlags) != 0) {
    return Status::Corruption(StrCat("unknown flags 0x", std::hex, flags & ~kKnownFlags));
  }
  if (reserved != 0) return Status::Corruption("the header's reserved field is not zero");
  if (payload != datagram.size() - kHeaderBytes) {
    return Status::Corruption(StrCat("the header announces ", payload, " payload bytes, ",
                                     datagram.size() - kHeaderBytes, " arrived"));
  }
  if (fds != fds_received) {
    return Status::Corruption(
        StrCat("the header announces ", fds, " fds, ", fds_received, " arrived"));
  }
  if ((flags & kFlagMemfd) != 0 && (payload != 0 || fds < 1)) {
    return Status::Corruption("a memfd payload comes alone, with its fd attached");
  }
  return Header{.version = version,
                .type = static_cast<MessageType>(type),
                .flags = flags,
                .payload_bytes = payload,
                .request_id = id,
                .fds = fds};
}

// ------------------------------------------------------------ status

std::string EncodeStatus(const Status& status) {
  Writer w;
  w.Put(static_cast<uint16_t>(status.code()));
  w.Put(static_cast<int32_t>(status.sys_errno()));
  const std::string_view msg = status.message();
  w.Str(msg.substr(0, kMaxMessageText));
  return w.Take();
}

Result<std::string_view> DecodeReplyStatus(std::string_view bytes) {
  Reader r(bytes, "reply status");
  uint16_t code = 0;
  int32_t sys_errno = 0;
  std::string message;
  r.Get(&code, "code");
  r.Get(&sys_errno, "errno");
  r.Str(&message, "message", kMaxMessageText);
  if (code > static_cast<uint16_t>(StatusCode::kLast)) r.Fail(StrCat("unknown code ", code));
  ZT_RETURN_IF_ERROR(r.status());
  if (code != 0) {
    if (!r.rest().empty()) return Status::Corruption("reply status: an error reply carries fields");
    return Status(static_cast<StatusCode>(code), std::move(message), sys_errno);
  }
  return r.rest();
}

// ------------------------------------------------------------ small payloads

std::string Encode(const Hello& v) {
  Writer w;
  w.Put(v.min_version);
  w.Put(v.max_version);
  w.Str(v.name);
  return w.Take();
}

Result<Hello> DecodeHello(std::string_view bytes) {
  Reader r(bytes, "hello");
  Hello v;
  r.Get(&v.min_version, "min_version");
  r.Get(&v.max_version, "max_version");
  r.Str(&v.name, "name", kMaxNameBytes);
  if (v.min_version > v.max_version) r.Fail("min_version is above max_version");
  return Done(r, std::move(v));
}

std::string Encode(const JobRef& v) {
  Writer w;
  w.Put(v.job);
  return w.Take();
}

Result<JobRef> DecodeJobRef(std::string_view bytes) {
  Reader r(bytes, "job ref");
  JobRef v;
  r.Get(&v.job, "job");
  if (v.job < 0) r.Fail(StrCat("job ", v.job, " is negative"));
  return Done(r, v);
}

std::string Encode(const AbortStepRequest& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.step);
  return w.Take();
}

Result<AbortStepRequest> DecodeAbortStepRequest(std::string_view bytes) {
  Reader r(bytes, "abort step request");
  AbortStepRequest v;
  r.Get(&v.job, "job");
  r.Get(&v.step, "step");
  if (v.job < 0) r.Fail(StrCat("job ", v.job, " is negative"));
  if (v.step < 1) r.Fail(StrCat("step ", v.step, ": steps count from 1"));
  return Done(r, v);
}

std::string Encode(const UnitRef& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.unit);
  w.Put(v.rank);
  return w.Take();
}

Result<UnitRef> DecodeUnitRef(std::string_view bytes) {
  Reader r(bytes, "unit ref");
  UnitRef v;
  r.Get(&v.job, "job");
  r.Get(&v.unit, "unit");
  r.Get(&v.rank, "rank");
  if (v.job < 0 || v.unit < 0 || v.rank < 0 || v.rank >= kMaxRanks) {
    r.Fail(StrCat("job ", v.job, ", unit ", v.unit, ", rank ", v.rank, ": out of range"));
  }
  return Done(r, v);
}

std::string Encode(const StepWait& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.unit);
  w.Put(v.step);
  w.Put(static_cast<int64_t>(v.timeout.count()));
  return w.Take();
}

Result<StepWait> DecodeStepWait(std::string_view bytes) {
  Reader r(bytes, "step wait");
  StepWait v;
  int64_t ms = 0;
  r.Get(&v.job, "job");
  r.Get(&v.unit, "unit");
  r.Get(&v.step, "step");
  r.Get(&ms, "timeout_ms");
  if (v.job < 0 || v.unit < 0) r.Fail(StrCat("job ", v.job, ", unit ", v.unit, ": out of range"));
  if (v.step < 0) r.Fail(StrCat("step ", v.step, " is negative"));
  if (ms < 0 || ms > kMaxStepWait.count()) r.Fail(StrCat("timeout_ms ", ms));
  v.timeout = std::chrono::milliseconds(ms);
  return Done(r, v);
}

std::string Encode(const StepValue& v) {
  Writer w;
  w.Put(v.step);
  return w.Take();
}

Result<StepValue> DecodeStepValue(std::string_view bytes) {
  Reader r(bytes, "step value");
  StepValue v;
  r.Get(&v.step, "step");
  if (v.step < -1) r.Fail(StrCat("step ", v.step));
  return Done(r, v);
}

std::string Encode(const AttachRequest& v) {
  Writer w;
  w.Put(v.rank);
  w.Put(static_cast<int64_t>(v.timeout.count()));
  std::string out = w.Take();
  out += Encode(v.spec);
  return out;
}

Result<AttachRequest> DecodeAttachRequest(std::string_view bytes) {
  Reader r(bytes, "attach request");
  AttachRequest v;
  int64_t timeout_ms = 0;
  r.Get(&v.rank, "rank");
  r.Get(&timeout_ms, "timeout");
  if (!r.ok()) return r.status();
  if (timeout_ms < 0 || timeout_ms > kMaxWait.count()) {
    r.Fail(StrCat("timeout ", timeout_ms, " ms"));
    return r.status();
  }
  v.timeout = std::chrono::milliseconds(timeout_ms);
  Result<JobSpec> spec = DecodeJobSpec(r.rest());
  if (!spec.ok()) {
    return Status::Corruption(StrCat("attach request: ", spec.status().message()));
  }
  v.spec = *std::move(spec);
  if (v.rank < 0 || v.rank >= v.spec.ranks) {
    return Status::Corruption(
        StrCat("attach request: rank ", v.rank, " out of range for ", v.spec.ranks, " ranks"));
  }
  return v;
}

std::string Encode(const CollectiveRegionRequest& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.bytes);
  return w.Take();
}

Result<CollectiveRegionRequest> DecodeCollectiveRegionRequest(std::string_view bytes) {
  Reader r(bytes, "collective region request");
  CollectiveRegionRequest v;
  r.Get(&v.job, "job");
  r.Get(&v.bytes, "bytes");
  if (v.job < 0) r.Fail(StrCat("job ", v.job));
  if (v.bytes < kCollectiveHeaderBytes || v.bytes > kMaxCollectiveRegionBytes ||
      v.bytes % 4096 != 0) {
    r.Fail(StrCat("bytes ", v.bytes, " (a multiple of 4096 in [", kCollectiveHeaderBytes, ", ",
                  kMaxCollectiveRegionBytes, "])"));
  }
  return Done(r, v);
}

std::string Encode(const JobHandle& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.units);
  w.Put(v.ranks);
  w.Put(static_cast<uint8_t>(v.state_dtype));
  return w.Take();
}

Result<JobHandle> DecodeJobHandle(std::string_view bytes) {
  Reader r(bytes, "job handle");
  JobHandle v;
  uint8_t dtype = 0;
  r.Get(&v.job, "job");
  r.Get(&v.units, "units");
  r.Get(&v.ranks, "ranks");
  r.Get(&dtype, "state_dtype");
  if (v.job < 0 || v.units < 1 || v.units > static_cast<int32_t>(kMaxUnits) || v.ranks < 1 ||
      v.ranks > kMaxRanks) {
    r.Fail(StrCat("job ", v.job, ", ", v.units, " units, ", v.ranks, " ranks: out of range"));
  }
  if (dtype > static_cast<uint8_t>(StateDtype::kInt8)) r.Fail(StrCat("state_dtype ", int{dtype}));
  v.state_dtype = static_cast<StateDtype>(dtype);
  return Done(r, v);
}

std::string Encode(const SharedBuffer& v) {
  Writer w;
  w.Put(v.region);
  w.Put(v.region_bytes);
  w.Put(v.offset);
  w.Put(v.bytes);
  w.Put(static_cast<uint8_t>(v.access));
  return w.Take();
}

Result<SharedBuffer> DecodeSharedBuffer(std::string_view bytes) {
  Reader r(bytes, "shared buffer");
  SharedBuffer v;
  uint8_t access = 0;
  r.Get(&v.region, "region");
  r.Get(&v.region_bytes, "region_bytes");
  r.Get(&v.offset, "offset");
  r.Get(&v.bytes, "bytes");
  r.Get(&access, "access");
  if (!ValidAccess(access)) r.Fail(StrCat("access ", int{access}));
  v.access = static_cast<RegionAccess>(access);
  const std::optional<uint64_t> end = CheckedAdd(v.offset, v.bytes);
  if (!end || *end > v.region_bytes || v.bytes == 0) {
    r.Fail(StrCat("the buffer [", v.offset, ", +", v.bytes, ") is not inside its region of ",
                  v.region_bytes, " bytes"));
  }
  return Done(r, v);
}

std::string Encode(const RegionList& v) {
  Writer w;
  w.Put(static_cast<uint32_t>(v.regions.size()));
  for (const RegionInfo& r : v.regions) {
    w.Put(r.region);
    w.Put(r.bytes);
    w.Put(static_cast<uint8_t>(r.access));
  }
  return w.Take();
}

Result<RegionList> DecodeRegionList(std::string_view bytes) {
  Reader r(bytes, "region list");
  RegionList v;
  uint32_t n = 0;
  if (r.Count(&n, "regions", kMaxFdsPerMessage, 13)) {
    if (n == 0) r.Fail("no regions");
    v.regions.resize(n);
    for (RegionInfo& info : v.regions) {
      uint8_t access = 0;
      r.Get(&info.region, "region");
      r.Get(&info.bytes, "bytes");
      r.Get(&access, "access");
      if (!r.ok()) break;
      if (!ValidAccess(access)) r.Fail(StrCat("access ", int{access}));
      // A region is a mapping of this machine's memory: 2^48 bytes is past any.
      if (info.bytes == 0 || info.bytes > (uint64_t{1} << 48) || info.bytes % 4096 != 0) {
        r.Fail(StrCat("region ", info.region, " of ", info.bytes, " bytes"));
      }
      info.access = static_cast<RegionAccess>(access);
    }
  }
  return Done(r, std::move(v));
}

std::string Encode(const StagedData& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.unit);
  w.Put(v.bytes);
  w.Put(v.generation);
  return w.Take();
}

Result<StagedData> DecodeStagedData(std::string_view bytes) {
  Reader r(bytes, "staged data");
  StagedData v;
  r.Get(&v.job, "job");
  r.Get(&v.unit, "unit");
  r.Get(&v.bytes, "bytes");
  r.Get(&v.generation, "generation");
  if (v.job < 0 || v.unit < 0) r.Fail(StrCat("job ", v.job, ", unit ", v.unit, ": out of range"));
  if (v.generation < -1) r.Fail(StrCat("generation ", v.generation));
  // Three fp32 copies of the largest unit, padded.
  if (v.bytes == 0 || v.bytes > 3 * 4 * (kMaxUnitElements + kMaxRanks * kAlignElements)) {
    r.Fail(StrCat("bytes ", v.bytes));
  }
  return Done(r, v);
}

std::string Encode(const JobSteps& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.step);
  w.Put(v.adam_step);
  return w.Take();
}

Result<JobSteps> DecodeJobSteps(std::string_view bytes) {
  Reader r(bytes, "job steps");
  JobSteps v;
  r.Get(&v.job, "job");
  r.Get(&v.step, "step");
  r.Get(&v.adam_step, "adam_step");
  if (v.job < 0) r.Fail(StrCat("job ", v.job, " is negative"));
  if (v.step < 0 || v.step > kMaxStep || v.adam_step < 0 || v.adam_step > v.step) {
    r.Fail(StrCat("step ", v.step, ", adam_step ", v.adam_step));
  }
  return Done(r, v);
}

std::string Encode(const StateCommit& v) {
  Writer w;
  w.Put(v.job);
  w.Put(v.step);
  w.Put(v.adam_step);
  w.Put(v.generation);
  return w.Take();
}

Result<StateCommit> DecodeStateCommit(std::string_view bytes) {
  Reader r(bytes, "state commit");
  StateCommit v;
  r.Get(&v.job, "job");
  r.Get(&v.step, "step");
  r.Get(&v.adam_step, "adam_step");
  r.Get(&v.generation, "generation");
  if (v.job < 0) r.Fail(StrCat("job ", v.job, " is negative"));
  const bool keep = v.step == -1 && v.adam_step == -1;
  if (!keep && (v.step < 0 || v.step > kMaxStep || v.adam_step < 0 || v.adam_step > v.step)) {
    r.Fail(StrCat("step ", v.step, ", adam_step ", v.adam_step));
  }
  if (v.generation < -1) r.Fail(StrCat("generation ", v.generation));
  return Done(r, v);
}

std::string Encode(const LearningRates& v) {
  Writer w;
  w.Put(v.job);
  w.Put(static_cast<uint32_t>(v.lrs.size()));
  for (float lr : v.lrs) w.Put(lr);
  return w.Take();
}

Result<LearningRates> DecodeLearningRates(std::string_view bytes) {
  Reader r(bytes, "learning rates");
  LearningRates v;
  uint32_t n = 0;
  r.Get(&v.job, "job");
  if (v.job < 0) r.Fail(StrCat("job ", v.job, " is negative"));
  if (r.Count(&n, "learning rates", kMaxParamGroups, sizeof(float))) {
    v.lrs.resize(n);
    for (float& lr : v.lrs) r.Get(&lr, "learning rate");
  }
  return Done(r, std::move(v));
}

// ------------------------------------------------------------ job spec

std::string Encode(const JobSpec& v) {
  Writer w;
  w.Str(v.name);
  w.Put(static_cast<int32_t>(v.ranks));
  w.Put(static_cast<uint8_t>(v.optimizer_tier));
  w.Put(static_cast<uint8_t>(v.param_tier));
  const cpu_adam::Hyper& h = v.optimizer.hyper;
  w.Put(h.lr);
  w.Put(h.beta1);
  w.Put(h.beta2);
  w.Put(h.eps);
  w.Put(h.weight_decay);
  w.Put(static_cast<uint8_t>(h.mode));
  w.Put(static_cast<uint8_t>(h.bias_correction));
  w.Put(v.optimizer.clip_norm);
  w.Put(static_cast<int32_t>(v.optimizer.grad_accumulation));
  w.Put(static_cast<uint8_t>(v.optimizer.mode));
  // 0: the engine's, else 1 + the dtype.
  w.Put(static_cast<uint8_t>(v.state_dtype ? 1 + static_cast<uint8_t>(*v.state_dtype) : 0));
  w.Put(v.launch);
  w.Put(static_cast<uint32_t>(v.optimizer.group_weight_decay.size()));
  for (float f : v.optimizer.group_weight_decay) w.Put(f);
  w.Put(static_cast<uint32_t>(v.units.size()));
  for (const UnitSpec& u : v.units) {
    w.Str(u.name);
    w.Put(static_cast<uint32_t>(u.tensors.size()));
    for (const TensorSpec& t : u.tensors) {
      w.Str(t.name);
      w.Put(static_cast<uint32_t>(t.shape.size()));
      for (int64_t d : t.shape) w.Put(d);
      w.Put(t.group);
      w.Put(static_cast<uint8_t>(t.frozen ? 1 : 0));
    }
  }
  return w.Take();
}

Result<JobSpec> DecodeJobSpec(std::string_view bytes) {
  Reader r(bytes, "job spec");
  JobSpec v;
  int32_t ranks = 0, accumulation = 0;
  uint8_t opt_tier = 0, param_tier = 0, mode = 0, bias = 0, step_mode = 0, dtype = 0;
  cpu_adam::Hyper& h = v.optimizer.hyper;
  r.Str(&v.name, "name", kMaxNameBytes);
  r.Get(&ranks, "ranks");
  r.Get(&opt_tier, "optimizer_tier");
  r.Get(&param_tier, "param_tier");
  r.Get(&h.lr, "lr");
  r.Get(&h.beta1, "beta1");
  r.Get(&h.beta2, "beta2");
  r.Get(&h.eps, "eps");
  r.Get(&h.weight_decay, "weight_decay");
  r.Get(&mode, "optimizer mode");
  r.Get(&bias, "bias_correction");
  r.Get(&v.optimizer.clip_norm, "clip_norm");
  r.Get(&accumulation, "grad_accumulation");
  r.Get(&step_mode, "step mode");
  r.Get(&dtype, "state_dtype");
  r.Get(&v.launch, "launch");
  if (v.name.empty()) r.Fail("name is empty");
  if (dtype > 1 + static_cast<uint8_t>(StateDtype::kInt8))
    r.Fail(StrCat("state_dtype ", int{dtype}));
  if (dtype != 0) v.state_dtype = static_cast<StateDtype>(dtype - 1);
  if (ranks < 1 || ranks > kMaxRanks) r.Fail(StrCat("ranks ", ranks, " out of 1..", kMaxRanks));
  if (opt_tier > 1 || param_tier > 1) r.Fail("unknown tier");
  if (mode > 1 || bias > 1 || step_mode > 1) r.Fail("unknown optimizer enum value");
  for (double f : {double{h.lr}, h.beta1, h.beta2, double{h.eps}, double{h.weight_decay},
                   double{v.optimizer.clip_norm}}) {
    if (!Finite(f)) r.Fail("a hyper-parameter is not finite");
  }
  if (accumulation < 1 || accumulation > (1 << 20)) {
    r.Fail(StrCat("grad_accumulation ", accumulation));
  }
  v.ranks = ranks;
  v.optimizer_tier = static_cast<Tier>(opt_tier);
  v.param_tier = static_cast<Tier>(param_tier);
  h.mode = static_cast<cpu_adam::Mode>(mode);
  h.bias_correction = static_cast<cpu_adam::BiasCorrection>(bias);
  v.optimizer.grad_accumulation = accumulation;
  v.optimizer.mode = static_cast<StepMode>(step_mode);
  std::vector<float>& group_decay = v.optimizer.group_weight_decay;
  uint32_t groups = 0;
  if (r.Count(&groups, "group_weight_decay", kMaxParamGroups, sizeof(float))) {
    group_decay.resize(groups);
    for (float& f : group_decay) r.Get(&f, "group weight decay");
  }
  for (size_t g = 0; g < group_decay.size() && r.ok(); ++g) {
    if (!Finite(group_decay[g]))
      r.Fail(StrCat("the weight decay of param group ", g, " is not finite"));
  }
  const uint64_t job_groups = group_decay.empty() ? 1 : group_decay.size();

  uint32_t units = 0;
  // A unit is at least its name's length and its tensor count: 8 bytes.
  if (!r.Count(&units, "units", kMaxUnits, 8)) return r.status();
  if (units == 0) r.Fail("no units");
  uint64_t job_elements = 0;
  v.units.reserve(units);
  for (uint32_t k = 0; k < units && r.ok(); ++k) {
    UnitSpec u;
    uint32_t tensors = 0;
    r.Str(&u.name, "unit name", kMaxNameBytes);
    // A tensor is at least its name's length, its rank, its group and its
    // frozen flag: 13 bytes.
    if (!r.Count(&tensors, "tensors", kMaxTensorsPerUnit, 13)) break;
    if (tensors == 0) r.Fail(StrCat("unit ", k, " has no tensors"));
    uint64_t unit_elements = 0;
    u.tensors.reserve(tensors);
    for (uint32_t t = 0; t < tensors && r.ok(); ++t) {
      TensorSpec ts;
      uint32_t dims = 0;
      r.Str(&ts.name, "tensor name", kMaxNameBytes);
      if (!r.Count(&dims, "dims", kMaxDims, 8)) break;  // 0: a scalar
      uint64_t elements = 1;
      for (uint32_t d = 0; d < dims; ++d) {
        int64_t dim = 0;
        if (!r.Get(&dim, "dim")) break;
        if (dim < 1) {
          r.Fail(StrCat("unit ", k, " tensor ", t, ": dim ", dim));
          break;
        }
        const std::optional<uint64_t> e = CheckedMul(elements, static_cast<uint64_t>(dim));
        if (!e || *e > kMaxUnitElements) {
          r.Fail(StrCat("unit ", k, " tensor ", t, ": more than ", kMaxUnitElements, " elements"));
          break;
        }
        elements = *e;
        ts.shape.push_back(dim);
      }
      uint8_t frozen = 0;
      r.Get(&ts.group, "group");
      r.Get(&frozen, "frozen");
      if (frozen > 1) r.Fail(StrCat("unit ", k, " tensor ", t, ": frozen ", int{frozen}));
      if (r.ok() && ts.group >= job_groups) {
        r.Fail(StrCat("unit ", k, " ('", u.name, "') tensor ", t, " ('", ts.name,
                      "'): param group ", ts.group, ", the job has ", job_groups,
                      group_decay.empty() ? " (no group_weight_decay)" : " (group_weight_decay)"));
      }
      ts.frozen = frozen == 1;
      if (ts.name.empty()) r.Fail(StrCat("unit ", k, " tensor ", t, ": empty name"));
      unit_elements += elements;  // each <= 2^40, at most 2^16 of them: no overflow
      u.tensors.push_back(std::move(ts));
    }
    if (u.name.empty()) r.Fail(StrCat("unit ", k, ": empty name"));
    if (unit_elements > kMaxUnitElements) {
      r.Fail(StrCat("unit ", k, ": more than ", kMaxUnitElements, " elements"));
    }
    job_elements += unit_elements;  // each <= 2^40, at most 2^20 units: no overflow
    if (job_elements > kMaxJobElements) {
      r.Fail(StrCat("the job has more than ", kMaxJobElements, " elements"));
    }
    v.units.push_back(std::move(u));
  }
  return Done(r, std::move(v));
}

// ------------------------------------------------------------ replies

std::string Encode(const UnitLayout& v) {
  Writer w;
  w.Put(v.numel);
  w.Put(v.padded);
  w.Put(v.shard);
  w.Put(static_cast<uint32_t>(v.offsets.size()));
  for (uint64_t o : v.offsets) w.Put(o);
  return w.Take();
}

Result<UnitLayout> DecodeUnitLayout(std::string_view bytes) {
  Reader r(bytes, "unit layout");
  UnitLayout v;
  uint32_t n = 0;
  r.Get(&v.numel, "numel");
  r.Get(&v.padded, "padded");
  r.Get(&v.shard, "shard");
  if (r.Count(&n, "offsets", kMaxTensorsPerUnit, 8)) {
    v.offsets.resize(n);
    for (uint64_t& o : v.offsets) r.Get(&o, "offset");
  }
  if (v.numel == 0 || v.numel > kMaxUnitElements || v.padded < v.numel ||
      v.padded > kMaxUnitElements + kMaxRanks * kAlignElements || v.shard == 0 ||
      v.padded % v.shard != 0) {
    r.Fail(StrCat("numel ", v.numel, ", padded ", v.padded, ", shard ", v.shard, ": inconsistent"));
  }
  for (size_t i = 0; i < v.offsets.size(); ++i) {
    if (v.offsets[i] >= v.numel || (i > 0 && v.offsets[i] <= v.offsets[i - 1])) {
      r.Fail(StrCat("tensor offset ", i, " (", v.offsets[i], ") out of order or past numel"));
      break;
    }
  }
  return Done(r, std::move(v));
}

namespace {

void PutCounters(Writer& w, const JobCounters& v) {
  for (int64_t x : {v.steps, v.skipped_steps}) w.Put(x);
  for (double x : {v.optimizer_seconds, v.last_step_seconds, v.stall_seconds, v.last_grad_norm,
                   v.compute_seconds, v.io_wait_seconds}) {
    w.Put(x);
  }
  for (uint64_t x : v.step_seconds_buckets) w.Put(x);
  for (uint64_t x : {v.dram_bytes, v.dram_page_bytes, v.nvme_bytes, v.grad_bytes_in,
                     v.nvme_read_bytes, v.nvme_write_bytes, v.nvme_param_read_bytes,
                     v.host_to_device_bytes, v.device_to_host_bytes}) {
    w.Put(x);
  }
}

void GetCounters(Reader& r, JobCounters* out) {
  JobCounters& v = *out;
  r.Get(&v.steps, "steps");
  r.Get(&v.skipped_steps, "skipped_steps");
  r.Get(&v.optimizer_seconds, "optimizer_seconds");
  r.Get(&v.last_step_seconds, "last_step_seconds");
  r.Get(&v.stall_seconds, "stall_seconds");
  r.Get(&v.last_grad_norm, "last_grad_norm");
  r.Get(&v.compute_seconds, "compute_seconds");
  r.Get(&v.io_wait_seconds, "io_wait_seconds");
  for (uint64_t& b : v.step_seconds_buckets) r.Get(&b, "step_seconds_buckets");
  r.Get(&v.dram_bytes, "dram_bytes");
  r.Get(&v.dram_page_bytes, "dram_page_bytes");
  r.Get(&v.nvme_bytes, "nvme_bytes");
  r.Get(&v.grad_bytes_in, "grad_bytes_in");
  r.Get(&v.nvme_read_bytes, "nvme_read_bytes");
  r.Get(&v.nvme_write_bytes, "nvme_write_bytes");
  r.Get(&v.nvme_param_read_bytes, "nvme_param_read_bytes");
  r.Get(&v.host_to_device_bytes, "host_to_device_bytes");
  r.Get(&v.device_to_host_bytes, "device_to_host_bytes");
  if (!r.ok()) return;
  if (v.steps < 0 || v.skipped_steps < 0 || v.skipped_steps > v.steps) {
    r.Fail(StrCat("steps ", v.steps, ", skipped ", v.skipped_steps));
  }
  uint64_t bucketed = 0;
  for (uint64_t b : v.step_seconds_buckets) {
    if (b > static_cast<uint64_t>(INT64_MAX) - bucketed) {
      r.Fail("step_seconds_buckets overflow");
      return;
    }
    bucketed += b;
  }
  if (v.steps >= 0 && bucketed > static_cast<uint64_t>(v.steps)) {
    r.Fail(StrCat("step_seconds_buckets count ", bucketed, " steps of ", v.steps));
  }
  for (double x : {v.optimizer_seconds, v.last_step_seconds, v.stall_seconds, v.compute_seconds,
                   v.io_wait_seconds}) {
    if (!Finite(x) || x < 0) {
      r.Fail(StrCat("a time of ", x, " s"));
      break;
    }
  }
}

void PutTierBytes(Writer& w, const TierBytes& v) {
  for (uint64_t x : {v.nvme_read, v.nvme_write, v.host_to_device, v.device_to_host}) w.Put(x);
}

void GetTierBytes(Reader& r, TierBytes* v, std::string_view field) {
  r.Get(&v->nvme_read, field);
  r.Get(&v->nvme_write, field);
  r.Get(&v->host_to_device, field);
  r.Get(&v->device_to_host, field);
}

void PutQuota(Writer& w, const Quota& q) {
  w.Put(q.max_jobs);
  w.Put(q.max_connections);
  w.Put(q.max_dram_bytes);
  w.Put(q.max_nvme_bytes);
}

void GetQuota(Reader& r, Quota* q) {
  r.Get(&q->max_jobs, "max_jobs");
  r.Get(&q->max_connections, "max_connections");
  r.Get(&q->max_dram_bytes, "max_dram_bytes");
  r.Get(&q->max_nvme_bytes, "max_nvme_bytes");
  if (r.ok() && (q->max_jobs < 1 || q->max_connections < 1)) {
    r.Fail(StrCat("max_jobs ", q->max_jobs, ", max_connections ", q->max_connections,
                  " (at least 1 each)"));
  }
}

void PutJobInfo(Writer& w, const JobInfo& v) {
  w.Put(v.id);
  w.Put(v.uid);
  w.Str(v.name);
  w.Put(static_cast<uint8_t>(v.state));
  w.Str(std::string_view(v.failure).substr(0, kMaxMessageText));
  w.Put(v.world_size);
  w.Put(v.attached);
  w.Put(v.step);
  w.Put(static_cast<uint8_t>(v.state_dtype));
  w.Put(static_cast<uint8_t>(v.optimizer_tier));
  w.Put(static_cast<uint8_t>(v.param_tier));
  PutCounters(w, v.counters);
}

void GetJobInfo(Reader& r, JobInfo* out) {
  JobInfo& v = *out;
  uint8_t state = 0, dtype = 0, otier = 0, ptier = 0;
  r.Get(&v.id, "id");
  r.Get(&v.uid, "uid");
  r.Str(&v.name, "name", kMaxNameBytes);
  r.Get(&state, "state");
  r.Str(&v.failure, "failure", kMaxMessageText);
  r.Get(&v.world_size, "world_size");
  r.Get(&v.attached, "attached");
  r.Get(&v.step, "step");
  r.Get(&dtype, "state_dtype");
  r.Get(&otier, "optimizer_tier");
  r.Get(&ptier, "param_tier");
  GetCounters(r, &v.counters);
  if (!r.ok()) return;
  if (state > static_cast<uint8_t>(JobState::kFailed)) r.Fail(StrCat("state ", int{state}));
  if (dtype > static_cast<uint8_t>(StateDtype::kInt8)) r.Fail(StrCat("state_dtype ", int{dtype}));
  if (otier > 1 || ptier > 1) r.Fail("tier");
  if (v.world_size < 1 || v.world_size > kMaxRanks || v.attached < 0 || v.step < 0 || v.id < 0) {
    r.Fail(StrCat("job ", v.id, ": world size ", v.world_size, ", attached ", v.attached, ", step ",
                  v.step));
  }
  v.state = static_cast<JobState>(state);
  v.state_dtype = static_cast<StateDtype>(dtype);
  v.optimizer_tier = static_cast<Tier>(otier);
  v.param_tier = static_cast<Tier>(ptier);
}

// The smallest an encoded JobInfo can be (empty strings), for Count().
constexpr size_t kMinJobInfoBytes =
    4 + 4 + 4 + 1 + 4 + 4 + 4 + 8 + 3 + 2 * 8 + 6 * 8 + (kStepSecondsBounds.size() + 1) * 8 + 9 * 8;

}  // namespace

std::string Encode(const JobCounters& v) {
  Writer w;
  PutCounters(w, v);
  return w.Take();
}

Result<JobCounters> DecodeJobCounters(std::string_view bytes) {
  Reader r(bytes, "job counters");
  JobCounters v;
  GetCounters(r, &v);
  return Done(r, v);
}

std::string Encode(const DramPoolStats& v) {
  Writer w;
  for (uint64_t x : {v.budget_bytes, v.reserved_bytes, v.used_bytes}) w.Put(x);
  for (uint32_t x : {v.regions, v.locked_regions, v.hugetlb_regions}) w.Put(x);
  for (uint64_t x : {v.huge_page_bytes, v.page_bytes}) w.Put(x);
  return w.Take();
}

Result<DramPoolStats> DecodeDramPoolStats(std::string_view bytes) {
  Reader r(bytes, "pool stats");
  DramPoolStats v;
  r.Get(&v.budget_bytes, "budget_bytes");
  r.Get(&v.reserved_bytes, "reserved_bytes");
  r.Get(&v.used_bytes, "used_bytes");
  r.Get(&v.regions, "regions");
  r.Get(&v.locked_regions, "locked_regions");
  r.Get(&v.hugetlb_regions, "hugetlb_regions");
  r.Get(&v.huge_page_bytes, "huge_page_bytes");
  r.Get(&v.page_bytes, "page_bytes");
  if (v.used_bytes > v.reserved_bytes || v.locked_regions > v.regions ||
      v.hugetlb_regions > v.regions) {
    r.Fail("used, locked or huge-page figures exceed the totals");
  }
  return Done(r, v);
}

// ------------------------------------------------------------ the operator's

std::string Encode(const ListRequest& v) {
  Writer w;
  w.Put(v.after);
  return w.Take();
}

Result<ListRequest> DecodeListRequest(std::string_view bytes) {
  Reader r(bytes, "list request");
  ListRequest v;
  r.Get(&v.after, "after");
  if (v.after < -1) r.Fail(StrCat("after ", v.after));
  return Done(r, v);
}

size_t EncodedBytes(const JobInfo& v) {
  Writer w;
  PutJobInfo(w, v);
  return w.Take().size();
}

std::string Encode(const JobList& v) {
  Writer w;
  w.Put(static_cast<uint32_t>(v.jobs.size()));
  for (const JobInfo& j : v.jobs) PutJobInfo(w, j);
  w.Put(static_cast<uint8_t>(v.more));
  return w.Take();
}

Result<JobList> DecodeJobList(std::string_view bytes) {
  Reader r(bytes, "job list");
  JobList v;
  uint32_t n = 0;
  uint8_t more = 0;
  if (r.Count(&n, "jobs", kMaxListed, kMinJobInfoBytes)) {
    v.jobs.resize(n);
    for (JobInfo& j : v.jobs) GetJobInfo(r, &j);
  }
  r.Get(&more, "more");
  if (more > 1) r.Fail(StrCat("more ", int{more}));
  v.more = more == 1;
  return Done(r, std::move(v));
}

std::string Encode(const QuotaQuery& v) {
  Writer w;
  w.Put(v.uid);
  w.Put(static_cast<uint8_t>(v.all));
  w.Put(v.after);
  return w.Take();
}

Result<QuotaQuery> DecodeQuotaQuery(std::string_view bytes) {
  Reader r(bytes, "quota query");
  QuotaQuery v;
  uint8_t all = 0;
  r.Get(&v.uid, "uid");
  r.Get(&all, "all");
  r.Get(&v.after, "after");
  if (all > 1) r.Fail(StrCat("all ", int{all}));
  if (v.after < -1 || v.after > UINT32_MAX) r.Fail(StrCat("after ", v.after));
  v.all = all == 1;
  return Done(r, v);
}

std::string Encode(const QuotaList& v) {
  Writer w;
  PutQuota(w, v.defaults);
  w.Put(static_cast<uint32_t>(v.quotas.size()));
  for (const QuotaInfo& q : v.quotas) {
    w.Put(q.uid);
    PutQuota(w, q.quota);
    w.Put(static_cast<uint8_t>(q.custom));
    w.Put(q.jobs);
    w.Put(q.connections);
    w.Put(q.dram_bytes);
    w.Put(q.nvme_bytes);
    w.Put(q.lingering_bytes);
    w.Put(static_cast<uint32_t>(q.lingering_pids.size()));
    for (int32_t pid : q.lingering_pids) w.Put(pid);
  }
  w.Put(static_cast<uint8_t>(v.more));
  return w.Take();
}

Result<QuotaList> DecodeQuotaList(std::string_view bytes) {
  Reader r(bytes, "quota list");
  QuotaList v;
  GetQuota(r, &v.defaults);
  uint32_t n = 0;
  if (r.Count(&n, "quotas", kMaxListed, 4 + 24 + 1 + 8 + 16 + 12)) {
    v.quotas.resize(n);
    for (QuotaInfo& q : v.quotas) {
      uint8_t custom = 0;
      r.Get(&q.uid, "uid");
      GetQuota(r, &q.quota);
      r.Get(&custom, "custom");
      r.Get(&q.jobs, "jobs");
      r.Get(&q.connections, "connections");
      r.Get(&q.dram_bytes, "dram_bytes");
      r.Get(&q.nvme_bytes, "nvme_bytes");
      r.Get(&q.lingering_bytes, "lingering_bytes");
      uint32_t pids = 0;
      if (r.Count(&pids, "lingering_pids", kMaxLingeringPids, 4)) {
        q.lingering_pids.resize(pids);
        for (int32_t& pid : q.lingering_pids) r.Get(&pid, "lingering pid");
      }
      if (custom > 1 || q.jobs < 0 || q.connections < 0 || q.lingering_bytes > q.dram_bytes) {
        r.Fail(StrCat("uid ", q.uid, ": usage"));
      }
      q.custom = custom == 1;
      if (!r.ok()) break;
    }
  }
  uint8_t more = 0;
  r.Get(&more, "more");
  if (more > 1) r.Fail(StrCat("more ", int{more}));
  v.more = more == 1;
  return Done(r, std::move(v));
}

std::string Encode(const QuotaUpdate& v) {
  Writer w;
  w.Put(v.uid);
  w.Put(v.set);
  w.Put(static_cast<uint8_t>(v.reset));
  w.Put(v.quota.max_jobs);
  w.Put(v.quota.max_connections);
  w.Put(v.quota.max_dram_bytes);
  w.Put(v.quota.max_nvme_bytes);
  return w.Take();
}

Result<QuotaUpdate> DecodeQuotaUpdate(std::string_view bytes) {
  Reader r(bytes, "quota update");
  QuotaUpdate v;
  uint8_t reset = 0;
  r.Get(&v.uid, "uid");
  r.Get(&v.set, "set");
  r.Get(&reset, "reset");
  r.Get(&v.quota.max_jobs, "max_jobs");
  r.Get(&v.quota.max_connections, "max_connections");
  r.Get(&v.quota.max_dram_bytes, "max_dram_bytes");
  r.Get(&v.quota.max_nvme_bytes, "max_nvme_bytes");
  constexpr uint32_t kKnown = kQuotaMaxJobs | kQuotaMaxConnections | kQuotaMaxDram | kQuotaMaxNvme;
  if (reset > 1) r.Fail(StrCat("reset ", int{reset}));
  if ((v.set & ~kKnown) != 0) r.Fail(StrCat("unknown quota fields 0x", v.set & ~kKnown));
  if (reset == 1 && v.set != 0) r.Fail("a reset sets no fields");
  if (reset == 0 && v.set == 0) r.Fail("a quota update sets at least one field");
  if ((v.set & kQuotaMaxJobs) != 0 && (v.quota.max_jobs < 1 || v.quota.max_jobs > (1 << 20))) {
    r.Fail(StrCat("max_jobs ", v.quota.max_jobs, " (1..", 1 << 20, ")"));
  }
  if ((v.set & kQuotaMaxConnections) != 0 &&
      (v.quota.max_connections < 1 || v.quota.max_connections > (1 << 20))) {
    r.Fail(StrCat("max_connections ", v.quota.max_connections, " (1..", 1 << 20, ")"));
  }
  v.reset = reset == 1;
  return Done(r, v);
}

std::string Encode(const DrainRequest& v) {
  Writer w;
  w.Put(static_cast<uint8_t>(v.on));
  return w.Take();
}

Result<DrainRequest> DecodeDrainRequest(std::string_view bytes) {
  Reader r(bytes, "drain request");
  uint8_t on = 0;
  r.Get(&on, "on");
  if (on > 1) r.Fail(StrCat("on ", int{on}));
  return Done(r, DrainRequest{.on = on == 1});
}

std::string Encode(const EvictRequest& v) {
  Writer w;
  w.Put(v.job);
  w.Str(v.reason);
  return w.Take();
}

Result<EvictRequest> DecodeEvictRequest(std::string_view bytes) {
  Reader r(bytes, "evict request");
  EvictRequest v;
  r.Get(&v.job, "job");
  r.Str(&v.reason, "reason", kMaxNameBytes);
  if (v.job < 0) r.Fail(StrCat("job ", v.job));
  return Done(r, std::move(v));
}

std::string Encode(const DaemonStatus& v) {
  Writer w;
  w.Str(v.version);
  w.Put(v.protocol);
  w.Put(v.uptime_seconds);
  w.Put(static_cast<uint8_t>(v.draining));
  w.Put(static_cast<uint8_t>(v.caller_is_admin));
  w.Put(v.optimizer_threads);
  w.Put(v.connections);
  w.Put(v.jobs);
  for (uint64_t x : {v.requests, v.refused, v.dram_budget_bytes, v.dram_reserved_bytes,
                     v.dram_used_bytes, v.dram_page_bytes}) {
    w.Put(x);
  }
  w.Put(static_cast<uint32_t>(v.swap.size()));
  for (const SwapPathUsage& p : v.swap) {
    w.Str(p.path);
    for (uint64_t x : {p.used_bytes, p.file_bytes, p.capacity_bytes, p.waiting_ops}) w.Put(x);
    w.Put(p.quiet_seconds);
    w.Str(std::string_view(p.problem).substr(0, kMaxSwapProblemBytes));
  }
  const EngineTotals& t = v.totals;
  PutTierBytes(w, t.bytes);
  w.Put(t.grad_bytes_in);
  w.Put(t.steps);
  w.Put(t.skipped_steps);
  w.Put(t.optimizer_seconds);
  w.Put(t.stall_seconds);
  w.Put(t.jobs_registered);
  PutTierBytes(w, v.window);
  w.Put(v.window_seconds);
  return w.Take();
}

Result<DaemonStatus> DecodeDaemonStatus(std::string_view bytes) {
  Reader r(bytes, "daemon status");
  DaemonStatus v;
  uint8_t draining = 0, admin = 0;
  r.Str(&v.version, "version", kMaxNameBytes);
  r.Get(&v.protocol, "protocol");
  r.Get(&v.uptime_seconds, "uptime_seconds");
  r.Get(&draining, "draining");
  r.Get(&admin, "caller_is_admin");
  r.Get(&v.optimizer_threads, "optimizer_threads");
  r.Get(&v.connections, "connections");
  r.Get(&v.jobs, "jobs");
  r.Get(&v.requests, "requests");
  r.Get(&v.refused, "refused");
  r.Get(&v.dram_budget_bytes, "dram_budget_bytes");
  r.Get(&v.dram_reserved_bytes, "dram_reserved_bytes");
  r.Get(&v.dram_used_bytes, "dram_used_bytes");
  r.Get(&v.dram_page_bytes, "dram_page_bytes");
  uint32_t n = 0;
  if (r.Count(&n, "swap", kMaxSwapPaths, 4 + 40 + 4)) {
    v.swap.resize(n);
    for (SwapPathUsage& p : v.swap) {
      r.Str(&p.path, "swap path", kMaxNameBytes);
      r.Get(&p.used_bytes, "used_bytes");
      r.Get(&p.file_bytes, "file_bytes");
      r.Get(&p.capacity_bytes, "capacity_bytes");
      r.Get(&p.waiting_ops, "waiting_ops");
      r.Get(&p.quiet_seconds, "quiet_seconds");
      r.Str(&p.problem, "swap problem", kMaxSwapProblemBytes);
      if (r.ok() && !(Finite(p.quiet_seconds) && p.quiet_seconds >= 0)) {
        r.Fail(StrCat("quiet_seconds ", p.quiet_seconds));
      }
      if (!r.ok()) break;
    }
  }
  EngineTotals& t = v.totals;
  GetTierBytes(r, &t.bytes, "totals");
  r.Get(&t.grad_bytes_in, "grad_bytes_in");
  r.Get(&t.steps, "steps");
  r.Get(&t.skipped_steps, "skipped_steps");
  r.Get(&t.optimizer_seconds, "optimizer_seconds");
  r.Get(&t.stall_seconds, "stall_seconds");
  r.Get(&t.jobs_registered, "jobs_registered");
  GetTierBytes(r, &v.window, "window");
  r.Get(&v.window_seconds, "window_seconds");
  if (!r.ok()) return r.status();
  if (draining > 1 || admin > 1) r.Fail("a flag is not 0 or 1");
  if (!Finite(v.uptime_seconds) || v.uptime_seconds < 0 || !Finite(v.window_seconds) ||
      v.window_seconds < 0 || !Finite(t.optimizer_seconds) || !Finite(t.stall_seconds)) {
    r.Fail("a time is negative or not finite");
  }
  if (v.connections < 0 || v.jobs < 0 || t.steps < 0 || t.skipped_steps < 0 ||
      t.jobs_registered < 0 || v.dram_used_bytes > v.dram_reserved_bytes) {
    r.Fail("a count is negative, or DRAM in use exceeds what is reserved");
  }
  v.draining = draining == 1;
  v.caller_is_admin = admin == 1;
  return Done(r, std::move(v));
}

}  // namespace ztier::engine::protocol
