// ztier engine: the wire protocol between libztier's daemon transport and
// ztierd, the codec only (no sockets, no engine): message framing and the
// encoding of every request and reply. Depends on common/ and the wire types
// (engine/wire_types.h); the daemon client links it without the engine.
//
// Framing. One message per SOCK_SEQPACKET datagram, at most kMaxMessageBytes
// (64 KiB) including a fixed 32-byte little-endian header:
//   u32 magic "ZTWP" | u16 version | u16 type | u32 flags | u32 payload bytes
//   | u64 request id | u32 fds attached | u32 reserved (0)
// A reply carries the request's id and type with kFlagReply set, and starts
// with a status (u16 code, i32 errno, string message); the reply's fields
// follow only when the code is OK. Payloads larger than a datagram (a big
// JobSpec) travel in a sealed memfd attached to the message (kFlagMemfd),
// the datagram then holding only the header.
//
// Encoding. Integers little endian; float/double as their IEEE bits;
// strings and lists as a u32 count then the items. Decoders check every
// count against the bytes left and the limits below before allocating, use
// overflow-checked arithmetic for sizes, refuse trailing bytes, unknown
// types and enum values, and name the field that is wrong. A version
// mismatch is FailedPrecondition naming both versions.
//
// Thread safety: pure functions. Failure: Result/Status, never an abort,
// whatever the bytes.
#ifndef ZTIER_ENGINE_PROTOCOL_H_
#define ZTIER_ENGINE_PROTOCOL_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/wire_types.h"

namespace ztier::engine::protocol {

inline constexpr uint32_t kMagic = 0x5057545A;  // "ZTWP"
// Follows kWireVersion (engine/wire_types.h), whose structs it encodes; 2:
// param groups and frozen tensors in a JobSpec, set_learning_rates; 3: the
// client page, the operator's messages (status, jobs, quotas, drain,
// evict), step times and device traffic in the counters; 4: abort_step;
// 5: the job's state dtype in its handle; 6: the betas in double; 7:
// check_consistent; 8: a job spec's launch; 9: a quota's lingering bytes
// and their processes; 10: abort_step's step, the weights generation in
// the step page; 11: write_state and commit_state name the generation
// they expect (StagedData, StateCommit), and commit_state may keep the
// job's steps; 12: a swap path's waiting operations, quiet time and
// problem in the daemon status.
inline constexpr uint16_t kVersion = 12;
static_assert(kVersion == kWireVersion, "a change of the wire types is a change of the protocol");
inline constexpr size_t kHeaderBytes = 32;
inline constexpr size_t kMaxMessageBytes = size_t{64} << 10;
inline constexpr uint32_t kMaxFdsPerMessage = 4;
// A JobSpec in a memfd: bounded so a client cannot make the daemon read
// gigabytes (a million tensors' names and shapes fit).
inline constexpr uint64_t kMaxMemfdPayloadBytes = uint64_t{64} << 20;
// What ztierd holds of such a spec while a request has it, per byte of the
// memfd: the bytes, their decoded form and the copies ztierd and its engine
// make as it registers (a tensor of 14 bytes there takes about 80 decoded;
// a 255 MiB spec of scalar tensors took ztierd 4.2 GB).
inline constexpr uint64_t kMemfdPayloadHeapFactor = 16;
// Limits of the decoders (each far above real models): a JobSpec's are
// engine/wire_types.h's, which the engine keeps too (ValidateJobSpec).
using engine::kMaxDims;
using engine::kMaxNameBytes;
using engine::kMaxParamGroups;
using engine::kMaxTensorsPerUnit;
using engine::kMaxUnits;
inline constexpr uint32_t kMaxMessageText = 4096;
// The hello name of the operator's tool (DaemonControl, ztierctl): the only
// connections ztierd lets in on the operators' reserve past a uid's quota.
inline constexpr std::string_view kOperatorClientName = "ztierctl";
inline constexpr int kMaxRanks = 1 << 16;
// The operator's lists (jobs, quotas) come in pages of at most this many
// (each page's reply fits in a datagram; `more` says another follows).
inline constexpr uint32_t kMaxListed = 4096;
inline constexpr uint32_t kMaxSwapPaths = 256;
// A swap path's problem in the daemon status (cut there: the status of
// every path fits one message).
inline constexpr uint32_t kMaxSwapProblemBytes = 160;
// The longest a request may ask the daemon to wait (a day), and a step
// wait (a week: longer is a bug, not a wait). Clients ask for at most these.
inline constexpr std::chrono::milliseconds kMaxWait{int64_t{24} * 3600 * 1000};
inline constexpr std::chrono::milliseconds kMaxStepWait{int64_t{7} * 24 * 3600 * 1000};

inline constexpr uint32_t kFlagReply = 1u << 0;
inline constexpr uint32_t kFlagMemfd = 1u << 1;  // the payload is in the attached memfd
inline constexpr uint32_t kKnownFlags = kFlagReply | kFlagMemfd;

enum class MessageType : uint16_t {
  kHello = 1,           // versions and identities; the first message of a connection
  kRegisterJob = 2,     // JobSpec -> JobHandle
  kAttachJob = 3,       // AttachRequest (rank, wait, the rank's JobSpec) -> JobHandle
  kUnregisterJob = 4,   // JobRef -> ()
  kLayout = 5,          // UnitRef -> UnitLayout
  kGradInbox = 6,       // UnitRef (rank) -> SharedBuffer (client read-write)
  kGradsReady = 7,      // UnitRef (rank) -> ()
  kAcquireParams = 8,   // StepWait -> SharedBuffer (client read-only)
  kReleaseParams = 9,   // UnitRef -> ()
  kWaitPublished = 10,  // StepWait -> ()
  kPublishedStep = 11,  // UnitRef -> StepValue
  kCounters = 12,       // JobRef -> JobCounters
  kPoolStats = 13,      // () -> DramPoolStats
  kTargetStep = 14,     // JobRef -> StepValue
  kRegions = 15,        // JobRef -> RegionList, one memfd attached per region
  kWriteWeights = 16,   // StagedData + the client's staging memfd (numel fp32) -> ()
  kReadState = 17,      // StagedData + the client's staging memfd (3 x padded fp32) -> ()
  kWriteState = 18,     // StagedData + the client's staging memfd (3 x padded fp32) -> ()
  kCommitState = 19,    // StateCommit -> ()
  kJobSteps = 20,       // JobRef -> JobSteps
  // CollectiveRegionRequest -> RegionList of one region (client read-write),
  // its memfd attached: the memory the job's ranks meet in for collectives.
  kCollectiveRegion = 21,
  // JobRef -> SharedBuffer: the job's step page (engine::Engine::
  // PublishedSteps: each unit's step, then the weights' generation), in its
  // read-only params region.
  kStepPage = 22,
  // LearningRates -> (): each param group's learning rate from the job's
  // next step on (engine::Engine::SetLearningRates).
  kSetLearningRates = 23,
  // JobRef -> SharedBuffer: the job's client page (engine::Engine::
  // ClientPage), in its grad-inbox region, where runners count their
  // device traffic.
  kClientPage = 24,
  // The operator's messages (ztierctl, for any uid unless it says admin;
  // an admin is root, ztierd's own uid, or a member of its admin group):
  kDaemonStatus = 25,  // () -> DaemonStatus
  kListJobs = 26,      // ListRequest -> JobList (an admin's: every job; else the caller's)
  kGetQuota = 27,      // QuotaQuery -> QuotaList (another uid's or all: admin)
  kSetQuota = 28,      // QuotaUpdate -> QuotaList of the one uid (admin)
  kDrain = 29,         // DrainRequest -> () (admin): new jobs refused, or accepted again
  kEvictJob = 30,      // EvictRequest -> () (admin): the job is freed, its clients told why
  // AbortStepRequest -> StepValue: the grads delivered since the job's last
  // step are dropped (engine::Engine::AbortStep); `step` is the micro-steps
  // that were complete.
  kAbortStep = 31,
  // JobRef -> (): the job's units hold one state, as a save or an export
  // the client writes from read_state needs (engine::Engine::
  // CheckConsistent); asked before and after the units are read.
  kCheckConsistent = 32,
};
inline constexpr uint16_t kLastMessageType = 32;
std::string_view MessageTypeName(MessageType type);
// "training", "parked", "failed": as ztierctl and the metrics spell a job's state.
std::string_view JobStateName(JobState state);

struct Header {
  uint16_t version = kVersion;
  MessageType type = MessageType::kHello;
  uint32_t flags = 0;
  uint32_t payload_bytes = 0;
  uint64_t request_id = 0;
  uint32_t fds = 0;
};

// A whole datagram: the header (payload_bytes set from `payload`) and the
// payload. InvalidArgument if it would exceed kMaxMessageBytes (send the
// payload in a memfd instead).
Result<std::string> EncodeMessage(Header header, std::string_view payload);
// Checks a received datagram's header: magic, version (FailedPrecondition
// naming both), type, flags, reserved field, payload length equal to what
// arrived, the fd count equal to `fds_received`. Returns the header; the
// payload is datagram.substr(kHeaderBytes).
Result<Header> DecodeHeader(std::string_view datagram, uint32_t fds_received);

// ------------------------------------------------------------ payloads

struct Hello {
  uint16_t min_version = kVersion;  // the range the sender speaks
  uint16_t max_version = kVersion;
  std::string name;  // "libztier 0.x" / "ztierd 0.x", for logs
};

struct JobRef {
  int32_t job = -1;
};
struct UnitRef {
  int32_t job = -1;
  int32_t unit = -1;
  int32_t rank = 0;  // GradInbox, GradsReady; 0 otherwise
};
struct StepWait {
  int32_t job = -1;
  int32_t unit = -1;
  int64_t step = 0;
  std::chrono::milliseconds timeout{0};
};
struct StepValue {
  int64_t step = -1;
};
// The grads of `step` (the caller's version + 1) are dropped.
struct AbortStepRequest {
  int32_t job = -1;
  int64_t step = 0;
};
// A rank that runs in another process joins a registered job: `spec` is
// the model as this rank built it (it must match the job's, name included),
// and the daemon waits up to `timeout` for the job to be registered.
struct AttachRequest {
  int32_t rank = 0;
  std::chrono::milliseconds timeout{0};
  JobSpec spec;
};
// The job's collective region, of `bytes` (the first rank to ask sets the
// size; later asks must name the same).
struct CollectiveRegionRequest {
  int32_t job = -1;
  uint64_t bytes = 0;
};
struct JobHandle {
  int32_t job = -1;
  int32_t units = 0;
  int32_t ranks = 1;
  StateDtype state_dtype = StateDtype::kFp32;  // the job's (its own, else the engine's)
};
// A job's shared regions, in the order their fds are attached to the reply.
struct RegionInfo {
  uint32_t region = 0;
  uint64_t bytes = 0;
  RegionAccess access = RegionAccess::kReadOnly;
};
struct RegionList {
  std::vector<RegionInfo> regions;  // 1..kMaxFdsPerMessage
};
// Bulk data of a unit that moves through a staging memfd the client made
// and attached (sealed against shrinking, so the daemon's mapping of it can
// never fault): `bytes` of it are read (WriteWeights) or written
// (ReadState).
struct StagedData {
  int32_t job = -1;
  int32_t unit = -1;
  uint64_t bytes = 0;
  // WriteState: the job's weights generation the writer expects (as it
  // began, plus its own writes since): another client's write or commit
  // in between refuses it. -1: none (ReadState, WriteWeights).
  int64_t generation = -1;
};

// A learning rate per optimizer param group of a job, for its next steps.
// The decoder bounds the count (at most kMaxParamGroups); the count and the
// values are the engine's to judge, so both transports refuse alike.
struct LearningRates {
  int32_t job = -1;
  std::vector<float> lrs;
};

// A job's completed steps and the steps that updated its weights.
struct JobSteps {
  int32_t job = -1;
  int64_t step = 0;
  int64_t adam_step = 0;
};
// The end of a state written unit by unit (commit_state): the job holds
// `step` and `adam_step` (both -1: the steps it is at, an import's), if it
// is at weights generation `generation` (-1: not checked).
struct StateCommit {
  int32_t job = -1;
  int64_t step = 0;
  int64_t adam_step = 0;
  int64_t generation = -1;
};

// A page of a list, starting after `after` (a job id or a uid; -1: from
// the start).
struct ListRequest {
  int64_t after = -1;
};
struct JobList {
  std::vector<JobInfo> jobs;  // by id
  bool more = false;          // ask again after the last one
};
// One uid's quota (`all` false), or every uid's the daemon knows of after
// `after` (a page).
struct QuotaQuery {
  uint32_t uid = 0;
  bool all = false;
  int64_t after = -1;
};
struct QuotaList {
  Quota defaults;  // the daemon's, for uids with none of their own
  std::vector<QuotaInfo> quotas;
  bool more = false;
};
struct DrainRequest {
  bool on = true;
};
struct EvictRequest {
  int32_t job = 0;     // JobInfo::id
  std::string reason;  // told to the job's clients (may be empty)
};

// Buffers travel as engine::SharedBuffer (wire_types.h): region, offset and
// size, never a pointer; a region's memfd comes with the first reply that
// names it.

// A reply's leading status.
std::string EncodeStatus(const Status& status);

// Each payload type: Encode appends to nothing (returns the bytes), Decode
// reads exactly the whole of `bytes`. Decode errors: Corruption naming the
// field (short, trailing bytes, over a limit, an invalid enum or value).
std::string Encode(const Hello& v);
std::string Encode(const JobRef& v);
std::string Encode(const AbortStepRequest& v);
std::string Encode(const UnitRef& v);
std::string Encode(const StepWait& v);
std::string Encode(const StepValue& v);
std::string Encode(const AttachRequest& v);
std::string Encode(const JobHandle& v);
std::string Encode(const SharedBuffer& v);
std::string Encode(const RegionList& v);
std::string Encode(const StagedData& v);
std::string Encode(const JobSteps& v);
std::string Encode(const StateCommit& v);
std::string Encode(const CollectiveRegionRequest& v);
std::string Encode(const LearningRates& v);
std::string Encode(const JobSpec& v);
std::string Encode(const UnitLayout& v);
std::string Encode(const JobCounters& v);
std::string Encode(const DramPoolStats& v);
std::string Encode(const ListRequest& v);
std::string Encode(const JobList& v);
std::string Encode(const QuotaQuery& v);
std::string Encode(const QuotaList& v);
std::string Encode(const QuotaUpdate& v);
std::string Encode(const DrainRequest& v);
std::string Encode(const EvictRequest& v);
std::string Encode(const DaemonStatus& v);
// Bytes Encode(JobInfo) takes in a JobList (a page is cut to fit).
size_t EncodedBytes(const JobInfo& v);

Result<Hello> DecodeHello(std::string_view bytes);
Result<JobRef> DecodeJobRef(std::string_view bytes);
Result<AbortStepRequest> DecodeAbortStepRequest(std::string_view bytes);
Result<UnitRef> DecodeUnitRef(std::string_view bytes);
Result<StepWait> DecodeStepWait(std::string_view bytes);
Result<StepValue> DecodeStepValue(std::string_view bytes);
Result<AttachRequest> DecodeAttachRequest(std::string_view bytes);
Result<JobHandle> DecodeJobHandle(std::string_view bytes);
Result<SharedBuffer> DecodeSharedBuffer(std::string_view bytes);
Result<RegionList> DecodeRegionList(std::string_view bytes);
Result<StagedData> DecodeStagedData(std::string_view bytes);
Result<JobSteps> DecodeJobSteps(std::string_view bytes);
Result<StateCommit> DecodeStateCommit(std::string_view bytes);
Result<CollectiveRegionRequest> DecodeCollectiveRegionRequest(std::string_view bytes);
Result<LearningRates> DecodeLearningRates(std::string_view bytes);
// Also validates what the engine would refuse cheaply: names non-empty and
// bounded, 1..kMaxDims positive dims, element counts overflow-checked and
// within kMaxUnitElements / kMaxJobElements, ranks 1..kMaxRanks, finite
// hyper-parameters and group weight decays, at most kMaxParamGroups
// groups, each tensor's group one of the job's, known enum values.
Result<JobSpec> DecodeJobSpec(std::string_view bytes);
Result<UnitLayout> DecodeUnitLayout(std::string_view bytes);
Result<JobCounters> DecodeJobCounters(std::string_view bytes);
Result<DramPoolStats> DecodeDramPoolStats(std::string_view bytes);
Result<ListRequest> DecodeListRequest(std::string_view bytes);
Result<JobList> DecodeJobList(std::string_view bytes);
Result<QuotaQuery> DecodeQuotaQuery(std::string_view bytes);
Result<QuotaList> DecodeQuotaList(std::string_view bytes);
// Also checks the fields it sets: counts >= 1, known bits.
Result<QuotaUpdate> DecodeQuotaUpdate(std::string_view bytes);
Result<DrainRequest> DecodeDrainRequest(std::string_view bytes);
Result<EvictRequest> DecodeEvictRequest(std::string_view bytes);
Result<DaemonStatus> DecodeDaemonStatus(std::string_view bytes);

// A reply payload: the status, then (when OK) the rest. Returns the status
// carried (an error the daemon sent) or the bytes after it.
Result<std::string_view> DecodeReplyStatus(std::string_view bytes);

}  // namespace ztier::engine::protocol

#endif  // ZTIER_ENGINE_PROTOCOL_H_
