// ztier engine: ztierd's service (see daemon.h): the accept loop, one
// thread per connection, and the handler of every request.
#include "engine/daemon.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/dir_lock.h"
#include "common/file_util.h"
#include "common/log.h"
#include "common/numbers.h"
#include "common/version.h"
#include "engine/json_strict.h"
#include "engine/metrics.h"
#include "engine/protocol.h"
#include "engine/shared_memory.h"

namespace ztier::engine {
namespace {

namespace p = protocol;
using Clock = std::chrono::steady_clock;

// How often a connection thread looks at the stop flag while its client is
// quiet, and how long a reply may wait for room in the client's socket.
constexpr std::chrono::milliseconds kPollInterval{200};
// How long a registration waits for a job of its name whose clients hung up
// to be freed (Connection::WaitForNameLocked).
constexpr std::chrono::seconds kNameWait{30};
// The flags field of a /proc stat file (PF_* bits), or nullopt.
std::optional<unsigned long> StatFlags(const std::string& path) {  // NOLINT(runtime/int)
  Result<std::string> stat = ReadFileToString(path, 4096);
  if (!stat.ok()) return std::nullopt;
  // After the command's closing parenthesis: state ppid pgrp session
  // tty_nr tpgid flags ...
  const size_t paren = stat->rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(stat->substr(paren + 1));
  std::string skip;
  unsigned long flags = 0;  // NOLINT(runtime/int): the field's type
  for (int i = 0; i < 6; ++i) fields >> skip;
  if (!(fields >> flags)) return std::nullopt;
  return flags;
}

// Whether the /proc status file at `path` shows SIGKILL pending (SigPnd,
// the thread's own, or ShdPnd, its process's).
bool KillPending(const std::string& path) {
  Result<std::string> status = ReadFileToString(path, 16384);
  if (!status.ok()) return false;
  std::istringstream lines(*status);
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("ShdPnd:") && !line.starts_with("SigPnd:")) continue;
    const uint64_t pending = std::strtoull(line.c_str() + 7, nullptr, 16);
    if ((pending & (uint64_t{1} << (SIGKILL - 1))) != 0) return true;
  }
  return false;
}

// Whether process `pid` is on its way out with its files not yet closed:
// killed (SIGKILL pending, its own or its threads') or in its exit (every
// thread's PF_EXITING: the main thread's alone is one that ended while the
// others run on). A process of many GiB takes a while to let go of its
// memory, and closes its sockets only after. False when it cannot be told
// (gone, in another pid namespace: pid 0, or hidden: the shipped unit's
// ProtectProc=invisible hides other users' processes from ztierd, which
// then waits only for connections it sees hang up).
bool ProcessIsExiting(pid_t pid) {
  if (pid <= 0) return false;
  if (KillPending(StrCat("/proc/", pid, "/status"))) return true;
  constexpr unsigned long kPfExiting = 0x4;  // NOLINT(runtime/int)
  std::error_code ec;
  int threads = 0;
  for (const auto& task : std::filesystem::directory_iterator(StrCat("/proc/", pid, "/task"), ec)) {
    const std::optional<unsigned long> flags =  // NOLINT(runtime/int)
        StatFlags((task.path() / "stat").string());
    // (A thread not yet in its exit, with SIGKILL pending, is on its way:
    // an exit_group sends each thread one.)
    if (flags && (*flags & kPfExiting) == 0 && !KillPending((task.path() / "status").string())) {
      return false;
    }
    threads += flags.has_value();
  }
  return !ec && threads > 0;
}

// Refused connections held at once to tell their clients why (each a thread
// and a socket for up to 2 s); past it a refused connection closes at once,
// so a flood of them (from a uid over its quota, or one not allowed) costs
// ztierd no more than this.
constexpr int kMaxRefusedHeld = 32;
// How long the accept loop waits when the process is out of fds or kernel
// memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the connection stays in the
// listen backlog, and ztierd and every client it serves go on.
constexpr std::chrono::milliseconds kAcceptBackoff{100};
constexpr std::chrono::seconds kSendTimeout{30};
// The stop's last word to a client: not worth holding the stop for.
constexpr std::chrono::milliseconds kFarewellTimeout{500};
// Connections an operator (Impl::Admin) may open past its uid's quota, for
// the operator's messages only (status, jobs, quotas, drain, evict): a uid
// whose jobs filled its quota (root's, in a container) can still be looked
// at and helped.
constexpr int kOperatorReserve = 4;

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

// Blocking engine waits run in slices of this, so a connection that closes
// gets its pool threads back within a slice even while its job lives on
// (held by other ranks' connections).
constexpr std::chrono::milliseconds kWaitSlice{500};

// Why an attaching rank's model is not the job's: the first difference, or
// empty when they match.
std::string SpecDifference(const JobSpec& job, const JobSpec& rank) {
  if (job.ranks != rank.ranks) {
    return StrCat("a world size of ", rank.ranks, ", the job's is ", job.ranks);
  }
  if (job.units.size() != rank.units.size()) {
    return StrCat(rank.units.size(), " units, the job has ", job.units.size());
  }
  for (size_t u = 0; u < job.units.size(); ++u) {
    const UnitSpec& a = job.units[u];
    const UnitSpec& b = rank.units[u];
    if (a.name != b.name)
      return StrCat("unit ", u, " is '", b.name, "', the job's is '", a.name, "'");
    if (a.tensors.size() != b.tensors.size()) {
      return StrCat("unit '", a.name, "' has ", b.tensors.size(), " tensors, the job's has ",
                    a.tensors.size());
    }
    for (size_t t = 0; t < a.tensors.size(); ++t) {
      const TensorSpec& x = a.tensors[t];
      const TensorSpec& y = b.tensors[t];
      if (x.name != y.name) {
        return StrCat("unit '", a.name, "' tensor ", t, " named '", y.name, "', the job's '",
                      x.name, "'");
      }
      if (x.shape != y.shape) {
        return StrCat("unit '", a.name, "' tensor '", x.name, "' of shape ", ShapeText(y.shape),
                      ", the job's ", ShapeText(x.shape));
      }
      if (x.group != y.group) {
        return StrCat("unit '", a.name, "' tensor '", x.name, "' in param group ", y.group,
                      ", the job's in ", x.group);
      }
      if (x.frozen != y.frozen) {
        return StrCat("unit '", a.name, "' tensor '", x.name, "' ",
                      y.frozen ? "frozen" : "not frozen", ", the job's ",
                      x.frozen ? "frozen" : "not frozen");
      }
    }
  }
  if (job.optimizer_tier != rank.optimizer_tier || job.param_tier != rank.param_tier) {
    return "other tiers for the optimizer state or the params";
  }
  const std::vector<float>& x = job.optimizer.group_weight_decay;
  const std::vector<float>& y = rank.optimizer.group_weight_decay;
  if (x.size() != y.size()) {
    return StrCat(y.size(), " param group weight decays (group_weight_decay), the job has ",
                  x.size());
  }
  for (size_t g = 0; g < x.size(); ++g) {
    if (x[g] != y[g]) {
      return StrCat("weight decay ", y[g], " for param group ", g, ", the job's is ", x[g]);
    }
  }
  // The settings each rank gives, named where they differ.
  const OptimizerConfig& a = job.optimizer;
  const OptimizerConfig& b = rank.optimizer;
  const auto differs = [](std::string_view what, auto mine, auto jobs) {
    return StrCat(what, " ", mine, ", the job's ", jobs);
  };
  if (b.hyper.lr != a.hyper.lr) return differs("learning rate", b.hyper.lr, a.hyper.lr);
  if (b.hyper.beta1 != a.hyper.beta1) return differs("beta1", b.hyper.beta1, a.hyper.beta1);
  if (b.hyper.beta2 != a.hyper.beta2) return differs("beta2", b.hyper.beta2, a.hyper.beta2);
  if (b.hyper.eps != a.hyper.eps) return differs("eps", b.hyper.eps, a.hyper.eps);
  if (b.hyper.weight_decay != a.hyper.weight_decay) {
    return differs("weight decay", b.hyper.weight_decay, a.hyper.weight_decay);
  }
  if (b.hyper.mode != a.hyper.mode) {
    return differs("mode", b.hyper.mode == cpu_adam::Mode::kAdamW ? "adamw" : "adam",
                   a.hyper.mode == cpu_adam::Mode::kAdamW ? "adamw" : "adam");
  }
  if (b.hyper.bias_correction != a.hyper.bias_correction) {
    return differs("bias correction",
                   b.hyper.bias_correction == cpu_adam::BiasCorrection::kOn ? "on" : "off",
                   a.hyper.bias_correction == cpu_adam::BiasCorrection::kOn ? "on" : "off");
  }
  if (b.clip_norm != a.clip_norm) return differs("clipping norm", b.clip_norm, a.clip_norm);
  if (b.grad_accumulation != a.grad_accumulation) {
    return differs("gradient accumulation", b.grad_accumulation, a.grad_accumulation);
  }
  if (b.mode != a.mode) {
    return differs("step mode", b.mode == StepMode::kExact ? "exact" : "eager",
                   a.mode == StepMode::kExact ? "exact" : "eager");
  }
  // Whatever else the encoding holds (the launch is the attach's own check).
  JobSpec same_launch = rank;
  same_launch.launch = job.launch;
  if (p::Encode(job) != p::Encode(same_launch)) return "other optimizer settings";
  return std::string();
}

}  // namespace

struct Daemon::Impl {
  DaemonOptions options;
  std::unique_ptr<Engine> engine;
  uid_t self_uid = ::geteuid();
  const Clock::time_point started = Clock::now();

  std::atomic<bool> stopping{false};
  mutable std::mutex mu;
  std::string stop_reason;
  struct Usage {
    int connections = 0;
    int reserve = 0;  // operators' connections past the quota (kOperatorReserve)
    int jobs = 0;
    uint64_t dram_bytes = 0;  // of its jobs, as counted at registration
    uint64_t nvme_bytes = 0;
    uint64_t lingering_bytes = 0;  // of dram_bytes: see Lingering
    int lingering_jobs = 0;        // freed jobs that live processes still map: see Lingering
    int requests = 0;              // queued or running on its connections' pools
    uint64_t payload_bytes = 0;    // held by its requests' handlers (see Payload)
    uint64_t spec_bytes = 0;       // its registered jobs' specs as ztierd keeps them (SpecHeap)
    bool operator==(const Usage&) const = default;
  };
  // What outlives its connection or its job, charged to a uid until the
  // processes holding it exit (their pidfds say so):
  // - a closed connection whose process lives on (`connection`): the
  //   connection stays counted;
  // - a freed job whose regions live processes still map (`engine_job`,
  //   LingerMappersLocked): its region bytes stay counted, once however
  //   many ranks' processes map them, until the last of them exits or
  //   unregisters it (ForgetMappingLocked).
  struct Lingering {
    uid_t uid = 0;
    uint64_t bytes = 0;
    bool connection = false;
    UniqueFd pidfd;  // the connection's process
    int engine_job = -1;
    // The job's: by connection, their processes (pidfd, and pid for the
    // operator: ztierctl quota get names them).
    std::map<const void*, std::pair<UniqueFd, pid_t>> mappers;
  };
  std::vector<Lingering> lingering;  // guarded by mu

  static bool Exited(const UniqueFd& pidfd) {
    pollfd pfd{.fd = pidfd.get(), .events = POLLIN, .revents = 0};
    return ::poll(&pfd, 1, 0) != 0;
  }
  // Under mu: uncharges what `l` holds.
  void UnchargeLocked(const Lingering& l) {
    Usage& u = usage[l.uid];
    if (l.connection) --u.connections;
    if (!l.connection) --u.lingering_jobs;
    u.dram_bytes -= l.bytes;
    u.lingering_bytes -= l.bytes;
    engine->ReleaseDram(l.bytes);
  }

  // Uncharges what the exited processes held (everything: `all`).
  void ReapLingering(bool all) {
    std::lock_guard<std::mutex> lock(mu);
    std::erase_if(lingering, [&](Lingering& l) {
      std::erase_if(l.mappers, [&](const auto& m) { return all || Exited(m.second.first); });
      const bool done = l.connection ? all || Exited(l.pidfd) : l.mappers.empty();
      if (done) UnchargeLocked(l);
      return done;
    });
  }
  std::map<uid_t, Usage> usage;  // guarded by mu
  // Forgets the uids that hold nothing (ReleaseIdleDram's checks): every
  // uid that ever connected, refused ones too, kept a record here and its
  // series in the metrics for good.
  void ForgetIdleUidsLocked() {
    std::erase_if(usage, [](const auto& entry) { return entry.second == Usage{}; });
  }
  // The sum of the uids' requests, and the uids with any (guarded by mu).
  int requests_in_flight = 0;
  int uids_with_requests = 0;
  uint64_t registrations = 0;  // jobs registered, since start (ReleaseIdleDram)
  int connections = 0;         // guarded by mu
  // The operator's settings (guarded by mu): quotas set per uid (ztierctl
  // quota set; kept in options.quota_file when one is named), and drain
  // (new jobs refused).
  // Only the fields an operator named (`set`, kQuota* bits) are the uid's
  // own; the others follow the defaults of the flags, changed or not.
  struct CustomQuota {
    Quota quota;
    uint32_t set = 0;
  };
  std::map<uid_t, CustomQuota> custom_quotas;
  // The quota file as ztierd last read or wrote it (nullopt: there was
  // none), guarded by mu: a file changed since (edited by hand) is not
  // overwritten by the next quota set.
  std::optional<std::string> quota_file_text;
  // One ztierd per quota file: each rewrites the whole file at a quota set,
  // so two would undo each other's changes.
  DirLock quota_lock;
  bool draining = false;
  // The engine's totals, sampled by Serve every few seconds over the last
  // minute and a bit (guarded by mu): the window of DaemonStatus.
  struct Sample {
    Clock::time_point at;
    TierBytes bytes;
  };
  std::deque<Sample> samples;

  Quota DefaultQuota() const {
    return Quota{.max_jobs = options.max_jobs_per_uid,
                 .max_connections = options.max_connections_per_uid,
                 .max_dram_bytes = options.max_dram_bytes_per_uid,
                 .max_nvme_bytes = options.max_nvme_bytes_per_uid};
  }
  Quota QuotaForLocked(uid_t uid) const {
    Quota q = DefaultQuota();
    auto it = custom_quotas.find(uid);
    if (it == custom_quotas.end()) return q;
    const CustomQuota& c = it->second;
    if ((c.set & kQuotaMaxJobs) != 0) q.max_jobs = c.quota.max_jobs;
    if ((c.set & kQuotaMaxConnections) != 0) q.max_connections = c.quota.max_connections;
    if ((c.set & kQuotaMaxDram) != 0) q.max_dram_bytes = c.quota.max_dram_bytes;
    if ((c.set & kQuotaMaxNvme) != 0) q.max_nvme_bytes = c.quota.max_nvme_bytes;
    return q;
  }
  QuotaInfo QuotaInfoLocked(uid_t uid) const {
    QuotaInfo q{.uid = uid, .quota = QuotaForLocked(uid), .custom = custom_quotas.count(uid) != 0};
    auto u = usage.find(uid);
    if (u != usage.end()) {
      // (As the quota counts them: freed jobs that live processes still
      // map too. The line after the table names those processes.)
      q.jobs = u->second.jobs + u->second.lingering_jobs;
      q.connections = u->second.connections;
      q.dram_bytes = u->second.dram_bytes;
      q.nvme_bytes = u->second.nvme_bytes;
      q.lingering_bytes = u->second.lingering_bytes;
    }
    for (const Lingering& l : lingering) {
      if (l.uid != uid) continue;
      for (const auto& [conn, process] : l.mappers) {
        // Those alive (a pid that exited may be another process's soon),
        // each once (a process may map several freed jobs).
        if (q.lingering_pids.size() < kMaxLingeringPids && !Exited(process.first) &&
            std::find(q.lingering_pids.begin(), q.lingering_pids.end(), process.second) ==
                q.lingering_pids.end()) {
          q.lingering_pids.push_back(process.second);
        }
      }
    }
    return q;
  }

  // The custom quotas as the quota file holds them.
  std::string QuotaFileTextLocked() const {
    nlohmann::ordered_json quotas = nlohmann::ordered_json::object();
    for (const auto& [uid, c] : custom_quotas) {
      nlohmann::ordered_json fields = nlohmann::ordered_json::object();
      if ((c.set & kQuotaMaxJobs) != 0) fields["max_jobs"] = c.quota.max_jobs;
      if ((c.set & kQuotaMaxConnections) != 0) fields["max_connections"] = c.quota.max_connections;
      if ((c.set & kQuotaMaxDram) != 0) fields["max_dram_bytes"] = c.quota.max_dram_bytes;
      if ((c.set & kQuotaMaxNvme) != 0) fields["max_nvme_bytes"] = c.quota.max_nvme_bytes;
      quotas[std::to_string(uid)] = fields;
    }
    nlohmann::ordered_json doc = {{"format", "ztierd-quotas"}, {"version", 1}, {"quotas", quotas}};
    return doc.dump(2) + "\n";
  }

  // Takes the quota file for this ztierd (a lock file beside it). Another
  // ztierd's is refused; a directory where no lock file can be made (read
  // only: no quota set could write the file either) is let be, said.
  Status LockQuotaFile() {
    const std::filesystem::path file(options.quota_file);
    std::filesystem::path dir = file.parent_path();
    if (dir.empty()) dir = ".";
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) return Status::Ok();  // said by the caller
    Result<DirLock> lock = DirLock::Acquire(
        dir.string(), StrCat(".", file.filename().string(), ".lock"),
        StrCat("quota file ", options.quota_file, " (its directory)"), DirLock::Mode::kExclusive,
        "another ztierd keeps this quota file (each rewrites it whole at a quota set): give each "
        "ztierd a --quota-file of its own");
    if (lock.ok()) {
      quota_lock = std::move(lock).value();
      return Status::Ok();
    }
    if (lock.status().code() == StatusCode::kUnavailable) {
      return Status::FailedPrecondition(std::string(lock.status().message()));
    }
    ZT_LOG(kWarn, "ztierd") << "quota file " << options.quota_file
                            << ": no lock beside it, so nothing keeps a second ztierd off it ("
                            << lock.status() << ")";
    return Status::Ok();
  }

  // Reads options.quota_file (a missing file is no custom quota).
  Status LoadQuotaFile() {
    if (options.quota_file.empty()) return Status::Ok();
    ZT_RETURN_IF_ERROR(LockQuotaFile());
    std::error_code ec;
    if (!std::filesystem::exists(options.quota_file, ec)) {
      // Written at the first quota set: where it can be, said now rather
      // than to the operator who sets one.
      std::filesystem::path dir = std::filesystem::path(options.quota_file).parent_path();
      if (dir.empty()) dir = ".";
      if (!std::filesystem::is_directory(dir, ec) || ::access(dir.c_str(), W_OK | X_OK) != 0) {
        const bool missing = !std::filesystem::exists(dir, ec) && !ec;
        return Status::InvalidArgument(
            StrCat("quota file ", options.quota_file, ": ", dir.string(),
                   missing ? " does not exist" : " is not a directory ztierd can write",
                   " (the file is made at the first quota set, in a directory that is there)"));
      }
      return Status::Ok();
    }
    Result<std::string> read = ReadFileToString(options.quota_file, 16 << 20);
    if (!read.ok()) return read.status().Annotate("quota file (--quota-file)");
    std::string text = *std::move(read);
    {
      std::lock_guard<std::mutex> lock(mu);
      quota_file_text = text;
    }
    const auto bad = [&](std::string_view why) {
      return Status::InvalidArgument(StrCat("quota file ", options.quota_file, ": ", why));
    };
    Result<nlohmann::json> parsed =
        ParseJsonStrict(text, StrCat("quota file ", options.quota_file));
    if (!parsed.ok()) return parsed.status();
    nlohmann::json& doc = *parsed;
    if (!doc.is_object()) return bad("not a JSON object");
    const auto format = doc.find("format");
    if (format == doc.end() || !format->is_string() || *format != "ztierd-quotas" ||
        !doc.contains("version") || !doc["version"].is_number_integer() ||
        doc["version"].get<int64_t>() != 1) {
      return bad("not a ztierd quota file of version 1 (\"format\": \"ztierd-quotas\")");
    }
    if (!doc.contains("quotas") || !doc["quotas"].is_object()) return bad("no \"quotas\" object");
    std::map<uid_t, CustomQuota> loaded;
    for (const auto& [key, q] : doc["quotas"].items()) {
      uint64_t uid = 0;
      auto [ptr, err] = std::from_chars(key.data(), key.data() + key.size(), uid);
      if (err != std::errc() || ptr != key.data() + key.size() || uid >= UINT32_MAX) {
        return bad(StrCat("'", key, "' is not a uid"));
      }
      if (!q.is_object()) return bad(StrCat("uid ", key, ": not an object"));
      CustomQuota v;
      for (const auto& [field, value] : q.items()) {
        if (!value.is_number_unsigned()) {
          return bad(StrCat("uid ", key, ": ", field, " is not a non-negative integer"));
        }
        const uint64_t x = value.get<uint64_t>();
        if (field == "max_jobs" || field == "max_connections") {
          if (x < 1 || x > (1u << 20)) return bad(StrCat("uid ", key, ": ", field, " ", x));
          (field == "max_jobs" ? v.quota.max_jobs : v.quota.max_connections) =
              static_cast<int32_t>(x);
          v.set |= field == "max_jobs" ? kQuotaMaxJobs : kQuotaMaxConnections;
        } else if (field == "max_dram_bytes") {
          v.quota.max_dram_bytes = x;
          v.set |= kQuotaMaxDram;
        } else if (field == "max_nvme_bytes") {
          v.quota.max_nvme_bytes = x;
          v.set |= kQuotaMaxNvme;
        } else {
          return bad(StrCat("uid ", key, ": unknown field '", field, "'"));
        }
      }
      // "1001" and "01001" are one uid: which of the two would win is
      // the file's order, never what its editor meant.
      if (!loaded.emplace(static_cast<uid_t>(uid), v).second) {
        return bad(StrCat("uid ", uid, " is named twice ('", key, "')"));
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    custom_quotas = std::move(loaded);
    ZT_LOG(kInfo, "ztierd") << "quotas of " << custom_quotas.size() << " uids from "
                            << options.quota_file;
    return Status::Ok();
  }

  // Applies an operator's change of one uid's quota, keeping the quota
  // file (written atomically; the change is undone if it cannot be).
  Result<QuotaInfo> SetQuota(const QuotaUpdate& up) {
    std::lock_guard<std::mutex> lock(mu);
    if (!options.quota_file.empty()) {
      // Changed since ztierd read or wrote it (edited by hand while ztierd
      // ran): rewritten whole, the edit was lost without a word.
      std::error_code ec;
      std::optional<std::string> now;
      if (std::filesystem::exists(options.quota_file, ec)) {
        Result<std::string> text = ReadFileToString(options.quota_file, 16 << 20);
        if (!text.ok()) {
          return Status(StatusCode::kFailedPrecondition,
                        StrCat("cannot read the quota file to check it before a quota set (the "
                               "quota is unchanged): ",
                               text.status().message()),
                        text.status().sys_errno());
        }
        now = *std::move(text);
      }
      if (now != quota_file_text) {
        return Status::FailedPrecondition(StrCat(
            "quota file ", options.quota_file,
            " was changed since ztierd read it (edited by hand?); a quota set would overwrite "
            "that change, so none was made: restart ztierd to take the file as it is, or put it "
            "back (while ztierd runs, set quotas with ztierctl only)"));
      }
    }
    const auto before = custom_quotas;
    if (up.reset) {
      custom_quotas.erase(up.uid);
    } else {
      CustomQuota& c = custom_quotas[up.uid];
      if ((up.set & kQuotaMaxJobs) != 0) c.quota.max_jobs = up.quota.max_jobs;
      if ((up.set & kQuotaMaxConnections) != 0) c.quota.max_connections = up.quota.max_connections;
      if ((up.set & kQuotaMaxDram) != 0) c.quota.max_dram_bytes = up.quota.max_dram_bytes;
      if ((up.set & kQuotaMaxNvme) != 0) c.quota.max_nvme_bytes = up.quota.max_nvme_bytes;
      c.set |= up.set & (kQuotaMaxJobs | kQuotaMaxConnections | kQuotaMaxDram | kQuotaMaxNvme);
    }
    if (!options.quota_file.empty()) {
      std::string text = QuotaFileTextLocked();
      Status s = WriteFileAtomically(options.quota_file, text);
      if (!s.ok()) {
        // Failed after its rename (the directory's fsync): the file holds
        // the change, which stands, said; the next start reads it.
        Result<std::string> there = ReadFileToString(options.quota_file, 16 << 20);
        if (there.ok() && *there == text) {
          ZT_LOG(kWarn, "ztierd") << "quota file " << options.quota_file
                                  << " was written, but may not survive a crash: " << s;
          s = Status::Ok();
        }
      }
      if (s.ok()) quota_file_text = std::move(text);
      if (!s.ok()) {
        custom_quotas = before;
        // What is wrong is the file (a directory there, say), never the
        // operator's request: not InvalidArgument, ztierctl's usage error.
        if (s.code() == StatusCode::kInvalidArgument) {
          s = Status(StatusCode::kFailedPrecondition, std::string(s.message()), s.sys_errno());
        }
        return s.Annotate("keeping the quota file (the quota is unchanged)");
      }
    }
    return QuotaInfoLocked(up.uid);
  }

  // Adds a sample of the engine's totals and drops those older than the
  // window needs.
  void SampleTotals() {
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!samples.empty() && now - samples.back().at < std::chrono::seconds(5)) return;
    }
    const EngineTotals t = engine->totals();
    std::lock_guard<std::mutex> lock(mu);
    samples.push_back({now, t.bytes});
    while (samples.size() > 2 && now - samples[1].at >= std::chrono::seconds(60)) {
      samples.pop_front();
    }
  }

  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<int> refused_held{0};  // refused connections telling why (kMaxRefusedHeld)
  // The log lines any local user can make ztierd repeat (a connection
  // refused, dropped for garbage, closed): bounded, the rest counted.
  LogRate refusal_log{20, std::chrono::seconds(10)};
  LogRate connection_log{20, std::chrono::seconds(10)};
  // The lines of jobs coming and going (registered, attached, parked,
  // dropped, freed): a user's loop of short jobs wrote three a job, 250 a
  // second, past what journald keeps.
  LogRate job_log{40, std::chrono::seconds(10)};

  class Connection;
  std::list<std::unique_ptr<Connection>> live;  // guarded by mu
  std::condition_variable all_closed;

  // A registered job, shared by every connection holding a handle to it
  // (the registering one, and ranks attached from other processes). It
  // lives while any handle does; when the last goes with its connection
  // (not by an unregister), it is parked for options.job_grace_period
  // (ranks may attach again), then freed.
  struct Job {
    int engine_job = -1;
    uid_t uid = 0;
    JobSpec spec;             // as registered, with the client's (unscoped) name
    uint64_t dram_bytes = 0;  // charged to the uid
    uint64_t nvme_bytes = 0;
    uint64_t spec_bytes = 0;  // SpecHeap(spec), charged to the uid
    // Guarded by Impl::mu.
    std::multiset<const void*> holders;   // the connections with a handle, once per handle
    std::vector<const void*> rank_owner;  // per rank: the connection that attached it
    bool parked = false;
    Clock::time_point parked_until;
    bool freed = false;
    int left_rank = -1;            // the first rank whose connection closed while others held it
    bool ended_by_daemon = false;  // evicted, or ztierd stopping: its collectives were told
    Mapping collective_region;     // made on the first ask (kCollectiveRegion)
    UniqueFd collective_fd;
    uint64_t collective_bytes = 0;  // its size, in the uid's DRAM use (see OnRegister)
    // Set once by an operator's evict (ztierctl evict): every later request
    // on the job gets Aborted with `evicted_why` (written before the flag).
    std::atomic<bool> evicted{false};
    std::string evicted_why;
    // The processes sent the job's regions (OnRegions), by connection: the
    // mappings keep the memory alive past the job. A connection that
    // unregistered the job itself drops out (the client library unmaps as
    // it unregisters); the others' processes, alive when the job is freed,
    // stay charged for it until they exit (LingerMappersLocked).
    struct Mapper {
      UniqueFd pidfd;
      pid_t pid = 0;
      uint64_t bytes = 0;
    };
    std::map<const void*, Mapper> mappers;
  };
  std::map<std::pair<uid_t, std::string>, std::shared_ptr<Job>> jobs;  // guarded by mu
  // Jobs marked freed whose engine job is not yet unregistered (guarded by
  // mu): stats() still counts them, so a job it no longer shows holds no
  // memory.
  std::multiset<std::pair<uid_t, std::string>> freeing;  // (uid, name) of each
  std::condition_variable jobs_changed;                  // a job registered (attaches wait for it)

  // Under mu: tells the job's ranks that `rank` left (kCollectiveAbortOffset)
  // and wakes those waiting in its collective region; rank -1: that ztierd
  // ended the job (kCollectiveEndedByDaemon: their next request says why).
  // The first mark stays.
  static void AbortCollectivesLocked(Job& job, int rank) {
    if (rank < 0) {
      job.ended_by_daemon = true;
    } else if (job.left_rank < 0) {
      job.left_rank = rank;
    }
    if (job.collective_region.data() == nullptr) return;  // marked when it is made
    auto* base = static_cast<char*>(job.collective_region.data());
    std::atomic_ref<uint32_t> abort(*reinterpret_cast<uint32_t*>(base + kCollectiveAbortOffset));
    uint32_t none = 0;
    abort.compare_exchange_strong(
        none, rank < 0 ? kCollectiveEndedByDaemon : static_cast<uint32_t>(rank) + 1);
    ::syscall(SYS_futex, base + kCollectiveFutexOffset, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }

  // Unregisters a job nobody holds from the engine and uncharges its uid.
  // Charges the uid of each live process that still maps the freed job's
  // regions for them, until it exits (ReapLingering): an evicted job, or a
  // parked one freed after its client went, was uncharged while its memory
  // lived on in the client's mapping.
  void LingerMappersLocked(Job& job) {
    Lingering l;
    l.uid = job.uid;
    l.engine_job = job.engine_job;
    for (auto& [conn, m] : job.mappers) {
      if (!m.pidfd.valid() || stopping.load() || Exited(m.pidfd)) continue;
      l.bytes = std::max(l.bytes, m.bytes);  // the same regions, whichever rank
      l.mappers.emplace(conn, std::pair(std::move(m.pidfd), m.pid));
    }
    job.mappers.clear();
    if (l.mappers.empty() || l.bytes == 0) return;
    Usage& u = usage[job.uid];
    u.dram_bytes += l.bytes;
    u.lingering_bytes += l.bytes;
    ++u.lingering_jobs;  // each holds a pidfd per process: counted as a job
    engine->HoldDram(l.bytes);
    lingering.push_back(std::move(l));
  }

  // Under mu: a live process maps the job's regions (it lingers once freed).
  bool MappedByLiveProcessLocked(const Job& job) const {
    return std::any_of(job.mappers.begin(), job.mappers.end(), [](const auto& m) {
      return m.second.pidfd.valid() && !Exited(m.second.pidfd);
    });
  }

  // A connection unregistered a job freed under it (evicted): the client
  // library unmaps the regions as it unregisters, so the charge ends with
  // the last of the job's mappers.
  void ForgetMappingLocked(const void* conn, int engine_job) {
    std::erase_if(lingering, [&](Lingering& l) {
      if (l.connection || l.engine_job != engine_job || l.mappers.erase(conn) == 0 ||
          !l.mappers.empty()) {
        return false;
      }
      UnchargeLocked(l);
      return true;
    });
  }

  // Under mu, in the same hold that found nobody holds `job`: takes it out
  // of the jobs (no attach can find it any more) and uncharges its uid,
  // which stays charged for the regions live processes still map
  // (LingerMappersLocked). False if it was freed already.
  bool MarkFreedLocked(Job& job) {
    if (job.freed) return false;
    job.freed = true;
    freeing.emplace(job.uid, job.spec.name);
    auto it = jobs.find({job.uid, job.spec.name});
    if (it != jobs.end() && it->second.get() == &job) jobs.erase(it);
    Usage& u = usage[job.uid];
    --u.jobs;
    u.dram_bytes -= job.dram_bytes + job.collective_bytes;
    job.collective_bytes = 0;
    u.nvme_bytes -= job.nvme_bytes;
    u.spec_bytes -= job.spec_bytes;
    LingerMappersLocked(job);
    return true;
  }
  // Then, with no lock held: the engine lets the job go.
  Status Free(const std::shared_ptr<Job>& job, std::string_view why) {
    Status s = engine->UnregisterJob(job->engine_job);
    {
      std::lock_guard<std::mutex> lock(mu);
      freeing.erase(freeing.find({job->uid, job->spec.name}));
    }
    jobs_changed.notify_all();  // (a registration of the name waits: WaitForNameLocked)
    if (std::string more; job_log.Allow(&more)) {
      ZT_LOG(kInfo, "ztierd") << "uid " << job->uid << " job '" << job->spec.name << "' freed ("
                              << why << ")" << more;
    }
    return s;
  }

  // For a quota refusal: how much of `uid`'s use is parked jobs (their
  // clients went away), and when the first of them goes. Under mu.
  std::string ParkedNoteLocked(uid_t uid) const {
    int n = 0;
    uint64_t dram = 0;
    Clock::time_point first = Clock::time_point::max();
    for (const auto& [key, job] : jobs) {
      if (key.first != uid || !job->parked) continue;
      ++n;
      dram +=
          job->dram_bytes + job->collective_bytes;  // (a job of several ranks keeps its region's)
      first = std::min(first, job->parked_until);
    }
    if (n == 0) return "";
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(first - Clock::now());
    return StrCat("; ", n, " of its jobs (", dram,
                  " bytes of DRAM) are parked: their clients went away, and they wait for a "
                  "resume (registering the same name takes one over) until their grace period "
                  "ends, the first in ",
                  std::max<int64_t>(0, left.count()),
                  " s (ztierctl jobs; ztierctl evict frees one)");
  }

  // With no job (registered, parked or being freed) for
  // options.idle_dram_release, gives the pool's empty regions back to the
  // system, at every check from then on (a registration refused between
  // two checks makes regions too). A job registered since the last check
  // starts the wait over, though it is gone by this one: short jobs one
  // after another had the pool given back and pinned again at almost
  // every check. Also forgets the uids that hold nothing. Serve's thread
  // only.
  Clock::time_point idle_since{};
  uint64_t registrations_seen = 0;
  void ReleaseIdleDram() {
    int jobs = 0;
    bool registered = false;  // since the last check
    {
      std::lock_guard<std::mutex> lock(mu);
      ForgetIdleUidsLocked();
      jobs = static_cast<int>(freeing.size());
      for (const auto& [uid, u] : usage) jobs += u.jobs;
      registered = std::exchange(registrations_seen, registrations) != registrations;
    }
    const auto now = Clock::now();
    if (jobs > 0 || registered) {
      idle_since = {};
      return;
    }
    if (idle_since == Clock::time_point{}) idle_since = now;
    if (now - idle_since < options.idle_dram_release) return;
    const uint64_t bytes = engine->ReleaseIdleDram();
    if (bytes > 0) {
      ZT_LOG(kInfo, "ztierd")
          << "no jobs for "
          << std::chrono::duration_cast<std::chrono::seconds>(options.idle_dram_release).count()
          << " s: " << bytes << " bytes of pinned DRAM kept for the next job given back";
    }
  }

  // Frees the parked jobs whose grace period is over (every of them when
  // `all`).
  void ReapParked(bool all) {
    std::vector<std::shared_ptr<Job>> due;
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto now = Clock::now();
      for (const auto& [key, job] : jobs) {
        if (job->parked && job->holders.empty() && (all || now >= job->parked_until)) {
          due.push_back(job);
        }
      }
      for (const auto& job : due) MarkFreedLocked(*job);
    }
    for (const auto& job : due)
      (void)Free(job, "its grace period after its last client left ended");
  }

  bool Allowed(uid_t uid) const {
    if (uid == 0 || uid == self_uid) return true;
    if (options.allowed_uids.empty()) return true;
    return std::find(options.allowed_uids.begin(), options.allowed_uids.end(), uid) !=
           options.allowed_uids.end();
  }

  // An operator: root, ztierd's own uid, or a member of the admin group.
  bool Admin(uid_t uid, gid_t gid, const std::vector<gid_t>& groups) const {
    if (uid == 0 || uid == self_uid) return true;
    if (!options.admin_gid.has_value()) return false;
    const gid_t admin = *options.admin_gid;
    return gid == admin || std::find(groups.begin(), groups.end(), admin) != groups.end();
  }
  std::string AdminsText() const {
    std::string who = StrCat("root, uid ", self_uid);
    if (options.admin_gid.has_value()) {
      who += StrCat(" or a member of group ",
                    options.admin_group.empty() ? std::string() : "'" + options.admin_group + "' ",
                    "(gid ", *options.admin_gid, ")");
    }
    return who;
  }

  DaemonStatus Report(bool admin) {
    DaemonStatus s;
    s.version = ZTIER_VERSION_STRING;
    s.protocol = protocol::kVersion;
    s.uptime_seconds = std::chrono::duration<double>(Clock::now() - started).count();
    s.caller_is_admin = admin;
    s.optimizer_threads = static_cast<uint32_t>(engine->optimizer_threads());
    const DramPoolStats pool = engine->pool_stats();
    s.dram_budget_bytes = pool.budget_bytes;
    s.dram_reserved_bytes = pool.reserved_bytes;
    s.dram_used_bytes = pool.used_bytes;
    s.dram_page_bytes = pool.page_bytes;
    s.swap = engine->swap_usage();
    s.totals = engine->totals();
    s.requests = requests.load();
    s.refused = refused.load();
    std::lock_guard<std::mutex> lock(mu);
    s.draining = draining;
    s.connections = connections;
    for (const auto& [uid, u] : usage) s.jobs += u.jobs;
    s.jobs += static_cast<int>(freeing.size());
    if (!samples.empty()) {
      const Sample& first = samples.front();
      s.window_seconds = std::chrono::duration<double>(Clock::now() - first.at).count();
      const auto less = [](uint64_t now, uint64_t then) { return now - std::min(now, then); };
      const TierBytes& now = s.totals.bytes;
      s.window = TierBytes{.nvme_read = less(now.nvme_read, first.bytes.nvme_read),
                           .nvme_write = less(now.nvme_write, first.bytes.nvme_write),
                           .host_to_device = less(now.host_to_device, first.bytes.host_to_device),
                           .device_to_host = less(now.device_to_host, first.bytes.device_to_host)};
    }
    return s;
  }

  // The jobs (of `uid` only, unless null), by id, from after `after`.
  // The jobs (of `uid`, or all) after id `after`, in id order, at most `most`.
  std::vector<JobInfo> Jobs(std::optional<uid_t> uid, int64_t after,
                            size_t most = std::numeric_limits<size_t>::max()) {
    std::vector<std::shared_ptr<Job>> found;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [key, job] : jobs) {
        if (job->freed || job->engine_job <= after) continue;
        if (uid.has_value() && job->uid != *uid) continue;
        found.push_back(job);
      }
    }
    std::sort(found.begin(), found.end(),
              [](const auto& a, const auto& b) { return a->engine_job < b->engine_job; });
    std::vector<JobInfo> out;
    for (const auto& job : found) {
      // (A page's figures only: each page of a listing gathered every job
      // after it, so a listing was quadratic in the jobs. Counted after
      // the jobs freed meanwhile are left out: a short page ends a listing.)
      if (out.size() >= most) break;
      JobInfo j;
      j.id = job->engine_job;
      j.uid = job->uid;
      j.name = job->spec.name;
      j.world_size = job->spec.ranks;
      j.optimizer_tier = job->spec.optimizer_tier;
      j.param_tier = job->spec.param_tier;
      j.counters = engine->counters(job->engine_job);
      // (Not waiting for a step's write-backs: on a stalled drive the
      // listing, and every metrics scrape, waited with them.)
      Result<int64_t> step = engine->StepNow(job->engine_job);
      if (!step.ok()) continue;  // freed meanwhile
      j.step = *step;
      const ztier::Status failed = engine->failure(job->engine_job);
      {
        std::lock_guard<std::mutex> lock(mu);
        j.attached = static_cast<int>(job->holders.size());
        j.state = job->parked ? JobState::kParked : JobState::kTraining;
      }
      if (!failed.ok()) {
        j.state = JobState::kFailed;
        j.failure = std::string(failed.message());
      }
      j.state_dtype = StateDtypeOf(*job);
      out.push_back(std::move(j));
    }
    return out;
  }
  StateDtype engine_state_dtype = StateDtype::kFp32;
  // How a job keeps m and v: its own choice, else the engine's.
  StateDtype StateDtypeOf(const Job& job) const {
    return job.spec.state_dtype.value_or(engine_state_dtype);
  }

  // An operator frees a job: its clients' calls fail with Aborted naming
  // `why`, its ranks' collectives are woken, its uid is uncharged.
  ztier::Status Evict(int32_t id, const std::string& why) {
    std::shared_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [key, j] : jobs) {
        if (j->engine_job == id && !j->freed) job = j;
      }
      if (job == nullptr) {
        return ztier::Status::NotFound(StrCat("no job ", id, " (ztierctl jobs lists them)"));
      }
      job->evicted_why = why;
      job->evicted.store(true);
      // Ranks waiting in a collective wake; the request they then make
      // names the eviction (FindJob).
      AbortCollectivesLocked(*job, -1);
      MarkFreedLocked(*job);
    }
    return Free(job, why);
  }

  // The Prometheus text exposition of the daemon, its jobs and quotas.
  std::string MetricsText();
};

// One client connection: its socket, its jobs (by handle), the params it
// holds leases on, and the pool that runs its blocking and computing
// requests.
class Daemon::Impl::Connection {
 public:
  // `refusal` not OK: the connection only answers the client's hello with
  // it (so the client reads why, rather than a reset) and closes.
  // `reserve`: an operator's connection past its uid's quota (operator's
  // messages only).
  Connection(Impl& d, SeqPacketSocket sock, PeerCredentials peer, bool admin, bool reserve,
             Status refusal)
      : d_(d),
        sock_(std::move(sock)),
        peer_(peer),
        prefix_(ScopedPrefix(peer.uid)),
        refusal_(std::move(refusal)),
        admin_(admin),
        reserve_(reserve) {
    if (!refusal_.ok()) return;  // nothing to watch: it only says why and goes
    Result<UniqueFd> pidfd = sock_.PeerPidfd();
    if (pidfd.ok()) pidfd_ = *std::move(pidfd);
  }

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
  // A handle: the job, and the rank it attached (-1: registered on this
  // connection, which may act for every rank no other process attached).
  struct JobEntry {
    std::shared_ptr<Impl::Job> job;
    int rank = -1;
    int engine_job = -1;
    std::string name;
    Tier param_tier = Tier::kDram;
  };
  struct Request {
    p::Header header;
    std::string payload;
    std::vector<UniqueFd> fds;
    // Fds the reply carries (a job's regions, the collective region), owned
    // by the request until its reply is sent. Never looked up by request id:
    // the id is the client's to choose, and two requests of one id in
    // flight shared one entry, whose erase by one reply closed the fds the
    // other was sending (their numbers then named another user's memory).
    std::vector<UniqueFd> reply_fds;
  };

  void Loop() {
    const auto refuse_by = Clock::now() + std::chrono::seconds(2);
    const auto hello_by = Clock::now() + d_.options.hello_timeout;
    while (!d_.stopping.load()) {
      if (!refusal_.ok() && Clock::now() > refuse_by) return;
      if (!hello_done_ && Clock::now() > hello_by) {
        const Status why = Status::Unavailable(
            StrCat("no hello within ", d_.options.hello_timeout.count(), " ms of connecting"));
        // (Any user can open connections that say nothing: one of the
        // lines logged a few at a time.)
        if (std::string more; d_.refusal_log.Allow(&more)) {
          ZT_LOG(kWarn, "ztierd") << Who() << ": " << why.message() << "; closing the connection"
                                  << more;
        }
        SendError(0, p::MessageType::kHello, why);
        return;
      }
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
        std::string more;
        if (got.status().code() != StatusCode::kUnavailable && d_.refusal_log.Allow(&more)) {
          ZT_LOG(kWarn, "ztierd") << Who() << ": " << got.status() << "; closing the connection"
                                  << more;
        }
        return;
      }
      Result<p::Header> h = p::DecodeHeader(got->data, static_cast<uint32_t>(got->fds.size()));
      if (!h.ok()) {
        // The request id cannot be trusted: say why (id 0) and close. Before
        // the hello (another release's protocol version, not ztier at all)
        // that is a refused connection, counted and logged as the others.
        std::string more;
        const bool log = d_.refusal_log.Allow(&more);
        if (!hello_done_) {
          if (log) {
            ZT_LOG(kWarn, "ztierd") << "refused " << Who() << ": " << h.status().message() << more;
          }
          d_.refused.fetch_add(1);
        } else if (log) {
          ZT_LOG(kWarn, "ztierd") << Who() << ": " << h.status() << "; closing the connection"
                                  << more;
        }
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
      if (reserve_ && h->type != p::MessageType::kHello &&
          (h->type < p::MessageType::kDaemonStatus || h->type > p::MessageType::kEvictJob)) {
        if (!SendError(h->request_id, h->type,
                       Status::ResourceExhausted(
                           StrCat(AtConnectionQuota(),
                                  ": this connection, past it on the operators' reserve, takes the "
                                  "operator's messages only (ztierctl)")))) {
          return;
        }
        continue;
      }
      Request req{.header = *h,
                  .payload = got->data.substr(p::kHeaderBytes),
                  .fds = std::move(got->fds),
                  .reply_fds = {}};
      if (OnPool(req)) {
        if (!Queue(std::move(req))) return;
        continue;
      }
      Result<std::string> reply = Handle(req);
      if (!Reply(req, reply)) return;
      if (req.header.type == p::MessageType::kHello && !reply.ok()) return;
    }
  }

  // Requests that may wait on the engine (an acquire, a publish wait) or
  // compute (a grad doorbell: norms and accumulation; staged copies) run on
  // the connection's pool, so this thread only reads, decodes and answers.
  bool OnPool(const Request& req) {
    switch (req.header.type) {
      case p::MessageType::kGradsReady:
      case p::MessageType::kAttachJob:    // waits for the job to be registered
      case p::MessageType::kRegisterJob:  // may wait for a job of its name to go (and allocates)
      case p::MessageType::kWriteWeights:
      case p::MessageType::kReadState:
      case p::MessageType::kWriteState:
      case p::MessageType::kAbortStep:  // may wait for the step before's write-backs
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
  // (a thread idle for options.pool_thread_idle ends, so a connection keeps about as many
  // as it has requests in flight, at most max_requests_in_flight: kept for
  // the connection's life, one burst of waits left a uid's idle connections
  // holding thousands). Every queued request needs a
  // thread of its own: one may block until a later one (another rank's
  // grads) has run, so a request never waits behind another.
  bool Queue(Request req) {
    const p::Header header = req.header;
    Status over;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      Impl::Usage& u = d_.usage[peer_.uid];
      const int total = d_.requests_in_flight;
      const int cap = d_.options.max_requests_in_flight_total;
      // The uids with requests in flight, this one among them.
      const int uids = d_.uids_with_requests + (u.requests == 0 ? 1 : 0);
      const int share = std::max(kRequestsEveryUidMayHold, cap / (2 * uids));
      if (u.requests >= d_.options.max_requests_in_flight_per_uid) {
        over = Status::ResourceExhausted(
            StrCat("requests in flight of uid ", peer_.uid, " on all its connections: ", u.requests,
                   " of the quota of ", d_.options.max_requests_in_flight_per_uid,
                   " (daemon max_requests_in_flight_per_uid)"));
      } else if (u.requests >= kRequestsEveryUidMayHold &&
                 (total >= cap || (2 * total >= cap && u.requests >= share))) {
        const std::string figures =
            StrCat("requests in flight on all of ztierd's connections: ", total, " of ", cap,
                   " (ztierd's --max-requests-in-flight-total; each holds a thread)");
        over = Status::ResourceExhausted(
            total >= cap ? figures
                         : StrCat(figures, "; uid ", peer_.uid, " holds ", u.requests,
                                  ", at least its share of ", share, " among ", uids,
                                  " uids with requests in flight: the rest is kept for the "
                                  "others"));
      } else {
        if (u.requests++ == 0) ++d_.uids_with_requests;
        ++d_.requests_in_flight;
      }
    }
    // Said with the daemon's lock released: a client that does not read
    // may hold the send for kSendTimeout, and the lock is everyone's.
    if (!over.ok()) return SendError(header.request_id, header.type, over);
    std::unique_lock<std::mutex> lock(mu_);
    std::list<std::thread> ended;  // pool threads that ended, joined below
    Status refused;
    if (in_flight_ >= d_.options.max_requests_in_flight) {
      refused = Status::ResourceExhausted(
          StrCat("requests in flight on one connection: ", in_flight_, " of the quota of ",
                 d_.options.max_requests_in_flight,
                 " (daemon max_requests_in_flight: ztierd's --max-requests-in-flight)"));
    } else {
      ++in_flight_;
      queue_.push_back(std::move(req));
      // A woken thread stays counted as waiting until it runs, so a queue
      // longer than the waiting threads gets a new one.
      if (queue_.size() <= static_cast<size_t>(waiting_)) {
        queue_cv_.notify_one();
        return true;
      }
      try {
        // The thread takes mu_ first, so it sees its own entry set.
        pool_.emplace_back();
        const auto self = std::prev(pool_.end());
        *self = std::thread([this, self] { PoolThread(self); });
        ended = std::move(ended_);
        ended_.clear();
        lock.unlock();
        for (std::thread& t : ended) t.join();
        return true;
      } catch (const std::system_error& e) {
        // No thread to be had (the process's or the service's task limit):
        // the request is refused and ztierd goes on.
        pool_.pop_back();
        queue_.pop_back();
        --in_flight_;
        refused = Status::ResourceExhausted(
            StrCat("ztierd cannot start a thread for the request: ", e.what(),
                   " (its task limit, or the machine's, is reached)"));
      }
    }
    lock.unlock();
    RequestDone();
    return SendError(header.request_id, header.type, refused);
  }

  // A pooled request has finished (or was refused): its uid's count drops.
  void RequestDone() {
    std::lock_guard<std::mutex> lock(d_.mu);
    if (--d_.usage[peer_.uid].requests == 0) --d_.uids_with_requests;
    --d_.requests_in_flight;
  }

  // `self`: the thread's entry in pool_, which it moves to ended_ when it
  // ends idle (joined by a later Queue, or Close).
  void PoolThread(std::list<std::thread>::iterator self) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++waiting_;
      const bool woken = queue_cv_.wait_for(lock, d_.options.pool_thread_idle,
                                            [&] { return closing_ || !queue_.empty(); });
      --waiting_;
      if (!woken) {
        ended_.splice(ended_.end(), pool_, self);
        return;
      }
      if (queue_.empty()) return;  // closing
      Request req = std::move(queue_.front());
      queue_.pop_front();
      const bool skip = closing_;  // the client is gone: nobody reads the reply
      lock.unlock();
      if (!skip) {
        Result<std::string> reply = Handle(req);
        (void)Reply(req, reply);
      }
      RequestDone();
      lock.lock();
      --in_flight_;
    }
  }

  // Sends the reply to `req` with its fds, which close when `req` goes.
  bool Reply(const Request& req, const Result<std::string>& reply) {
    const p::Header& h = req.header;
    if (!reply.ok()) return SendError(h.request_id, h.type, reply.status());
    d_.requests.fetch_add(1, std::memory_order_relaxed);
    std::string payload = p::EncodeStatus(Status::Ok());
    payload += *reply;
    std::vector<int> fds;
    for (const UniqueFd& fd : req.reply_fds) fds.push_back(fd.get());
    return SendMessage(h.request_id, h.type, payload, fds);
  }

  // Never called with d_.mu held: a send may wait `timeout` for a client
  // that does not read.
  bool SendError(uint64_t id, p::MessageType type, const Status& s,
                 std::chrono::milliseconds timeout = kSendTimeout) {
    d_.requests.fetch_add(1, std::memory_order_relaxed);
    return SendMessage(id, type, p::EncodeStatus(Unscoped(s, prefix_)), {}, timeout);
  }

  bool SendMessage(uint64_t id, p::MessageType type, const std::string& payload,
                   const std::vector<int>& fds, std::chrono::milliseconds timeout = kSendTimeout) {
    Result<std::string> msg = p::EncodeMessage({.type = type,
                                                .flags = p::kFlagReply,
                                                .request_id = id,
                                                .fds = static_cast<uint32_t>(fds.size())},
                                               payload);
    if (!msg.ok()) {
      ZT_LOG(kError, "ztierd") << Who() << ": " << msg.status();
      return false;
    }
    Status s = sock_.Send(*msg, fds, timeout, &d_.stopping);
    if (!s.ok()) {
      std::string more;
      if (d_.connection_log.Allow(&more)) {
        ZT_LOG(kInfo, "ztierd") << Who() << ": " << s << "; closing the connection" << more;
      }
      sock_.Shutdown();
      return false;
    }
    return true;
  }

  // ---------------------------------------------------------- requests

  Result<JobEntry> FindJob(int32_t handle) {
    JobEntry e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(handle);
      if (it == jobs_.end()) {
        return Status::NotFound(StrCat("no job ", handle, " on this connection"));
      }
      e = it->second;
    }
    if (e.job->evicted.load()) return Evicted(e);
    return e;
  }

  // What a request on an evicted job is told: who evicted it and why.
  static Status Evicted(const JobEntry& e) {
    return Status::Aborted(StrCat("job '", e.name, "' was evicted by an operator of ztierd (",
                                  e.job->evicted_why,
                                  "); resume from the last checkpoint, if one was saved"));
  }
  // A wait's failure, or the eviction that ended it (the engine's own
  // words for a job freed under a wait name none of that).
  static Status UnlessEvicted(const JobEntry& e, Status s) {
    if (!s.ok() && e.job->evicted.load()) return Evicted(e);
    return s;
  }

  // Aborted once a rank of `e`'s job other than this connection's left it
  // (AbortCollectivesLocked) and the awaited `step` is past what the grads
  // already in make (Engine::TargetStep): that step needs the rank's part,
  // and the wait would otherwise end only at its timeout. A step the grads
  // in make is waited for (a rank saving alone after its peers closed).
  Status UnlessPeerLeft(const JobEntry& e, int64_t step) {
    int left = -1;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      left = e.job->left_rank;
    }
    if (left < 0 || left == std::max(e.rank, 0)) return Status::Ok();
    const int64_t reachable = d_.engine->TargetStep(e.engine_job);
    if (step <= reachable) return Status::Ok();
    return Status::Aborted(
        StrCat("job '", e.name, "': rank ", left,
               " left the job (its process exited or let go of the job) before its part of step ",
               step, " came", reachable < 0 ? " (the job has no weights yet)" : "",
               "; the job cannot go on: restart its ranks from the last checkpoint"));
  }

  // The operator's calls: refused (PermissionDenied) for others.
  Status RequireAdmin(std::string_view what) const {
    if (admin_) return Status::Ok();
    return Status::PermissionDenied(
        StrCat(what, ": uid ", peer_.uid,
               " is not an operator of this ztierd (operators: ", d_.AdminsText(), ")"));
  }

  Result<std::string> OnListJobs(std::string_view in) {
    ZT_ASSIGN_OR_RETURN(p::ListRequest l, p::DecodeListRequest(in));
    std::vector<JobInfo> all =
        d_.Jobs(admin_ ? std::nullopt : std::optional<uid_t>(peer_.uid), l.after,
                p::kMaxListed + 1);  // one past a page: whether there are more
    // A page that fits in one reply (its header and status included).
    p::JobList page;
    size_t bytes = 64;
    for (JobInfo& j : all) {
      const size_t b = p::EncodedBytes(j);
      if (page.jobs.size() >= p::kMaxListed || bytes + b > p::kMaxMessageBytes - p::kHeaderBytes) {
        page.more = true;
        break;
      }
      bytes += b;
      page.jobs.push_back(std::move(j));
    }
    return p::Encode(page);
  }

  Result<std::string> OnGetQuota(std::string_view in) {
    ZT_ASSIGN_OR_RETURN(p::QuotaQuery q, p::DecodeQuotaQuery(in));
    if (q.all || q.uid != peer_.uid) {
      ZT_RETURN_IF_ERROR(
          RequireAdmin(q.all ? "quota get (every uid)" : "quota get of another uid"));
    }
    p::QuotaList list;
    std::lock_guard<std::mutex> lock(d_.mu);
    list.defaults = d_.DefaultQuota();
    if (!q.all) {
      list.quotas.push_back(d_.QuotaInfoLocked(q.uid));
      return p::Encode(list);
    }
    std::set<uid_t> uids;
    for (const auto& [uid, u] : d_.usage) uids.insert(uid);
    for (const auto& [uid, quota] : d_.custom_quotas) uids.insert(uid);
    for (uid_t uid : uids) {
      if (static_cast<int64_t>(uid) <= q.after) continue;
      // A uid's entry is at most 65 bytes and 4 a lingering pid: a page of
      // them fits in a datagram.
      constexpr size_t kPage = (p::kMaxMessageBytes - 1024) / (65 + 4 * kMaxLingeringPids);
      if (list.quotas.size() >= kPage) {
        list.more = true;
        break;
      }
      list.quotas.push_back(d_.QuotaInfoLocked(uid));
    }
    return p::Encode(list);
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
        req.header.type != p::MessageType::kRegisterJob &&
        req.header.type != p::MessageType::kAttachJob) {
      return Status::InvalidArgument(
          StrCat(p::MessageTypeName(req.header.type), ": only a job spec travels in a memfd"));
    }
    switch (req.header.type) {
      case p::MessageType::kHello:
        return OnHello(in);
      case p::MessageType::kRegisterJob:
        return OnRegister(req);
      case p::MessageType::kAttachJob:
        return OnAttach(req);
      case p::MessageType::kUnregisterJob: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_RETURN_IF_ERROR(Unregister(r.job, /*closing=*/false));
        return std::string();
      }
      case p::MessageType::kCollectiveRegion:
        return OnCollectiveRegion(req);
      case p::MessageType::kStepPage: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_ASSIGN_OR_RETURN(SharedBuffer b, d_.engine->PublishedSteps(j.engine_job));
        return p::Encode(b);
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
        ZT_RETURN_IF_ERROR(CheckRank(j, r.rank));
        ZT_ASSIGN_OR_RETURN(UnitLayout l, d_.engine->Layout(j.engine_job, r.unit));
        ZT_ASSIGN_OR_RETURN(bf16 * inbox, d_.engine->GradInbox(j.engine_job, r.unit, r.rank));
        ZT_ASSIGN_OR_RETURN(SharedBuffer b,
                            d_.engine->Locate(j.engine_job, inbox, l.shard * sizeof(bf16)));
        return p::Encode(b);
      }
      case p::MessageType::kGradsReady: {
        ZT_ASSIGN_OR_RETURN(p::UnitRef r, p::DecodeUnitRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_RETURN_IF_ERROR(CheckRank(j, r.rank));
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
        ZT_RETURN_IF_ERROR(UnlessEvicted(j, Sliced(
                                                w.timeout,
                                                [&](std::chrono::milliseconds slice) {
                                                  return d_.engine->WaitPublished(
                                                      j.engine_job, w.unit, w.step, slice);
                                                },
                                                &j, w.step)));
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
        ZT_ASSIGN_OR_RETURN(p::StateCommit s, p::DecodeStateCommit(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(s.job));
        ZT_RETURN_IF_ERROR(d_.engine->CommitState(j.engine_job, s.step, s.adam_step, s.generation));
        return std::string();
      }
      case p::MessageType::kSetLearningRates: {
        // Any connection that holds the job: the one that registered it or
        // an attached rank's.
        ZT_ASSIGN_OR_RETURN(p::LearningRates l, p::DecodeLearningRates(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(l.job));
        ZT_RETURN_IF_ERROR(d_.engine->SetLearningRates(j.engine_job, l.lrs));
        return std::string();
      }
      case p::MessageType::kAbortStep: {
        // Any connection that holds the job, as set_learning_rates.
        ZT_ASSIGN_OR_RETURN(p::AbortStepRequest r, p::DecodeAbortStepRequest(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_ASSIGN_OR_RETURN(int complete, d_.engine->AbortStep(j.engine_job, r.step));
        return p::Encode(p::StepValue{.step = complete});
      }
      case p::MessageType::kCheckConsistent: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_RETURN_IF_ERROR(d_.engine->CheckConsistent(j.engine_job));
        return std::string();
      }
      case p::MessageType::kJobSteps: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_ASSIGN_OR_RETURN(auto steps, d_.engine->Steps(j.engine_job));
        return p::Encode(p::JobSteps{.job = r.job, .step = steps.first, .adam_step = steps.second});
      }
      case p::MessageType::kClientPage: {
        ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(in));
        ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
        ZT_ASSIGN_OR_RETURN(SharedBuffer b, d_.engine->ClientPage(j.engine_job));
        return p::Encode(b);
      }
      case p::MessageType::kDaemonStatus:
        if (!in.empty()) return Status::InvalidArgument("daemon_status takes no fields");
        return p::Encode(d_.Report(admin_));
      case p::MessageType::kListJobs:
        return OnListJobs(in);
      case p::MessageType::kGetQuota:
        return OnGetQuota(in);
      case p::MessageType::kSetQuota: {
        ZT_ASSIGN_OR_RETURN(QuotaUpdate u, p::DecodeQuotaUpdate(in));
        ZT_RETURN_IF_ERROR(RequireAdmin(u.reset ? "quota reset" : "quota set"));
        ZT_ASSIGN_OR_RETURN(QuotaInfo q, d_.SetQuota(u));
        ZT_LOG(kInfo, "ztierd") << Who() << ": quota of uid " << u.uid
                                << (u.reset ? " reset to the defaults" : " set") << ": jobs "
                                << q.quota.max_jobs << ", connections " << q.quota.max_connections
                                << ", DRAM " << q.quota.max_dram_bytes << " B, NVMe "
                                << q.quota.max_nvme_bytes << " B";
        p::QuotaList list;
        {
          std::lock_guard<std::mutex> lock(d_.mu);
          list.defaults = d_.DefaultQuota();
        }
        list.quotas.push_back(q);
        return p::Encode(list);
      }
      case p::MessageType::kDrain: {
        ZT_ASSIGN_OR_RETURN(p::DrainRequest r, p::DecodeDrainRequest(in));
        ZT_RETURN_IF_ERROR(RequireAdmin(r.on ? "drain" : "drain --off"));
        {
          std::lock_guard<std::mutex> lock(d_.mu);
          d_.draining = r.on;
        }
        ZT_LOG(kInfo, "ztierd") << Who() << ": "
                                << (r.on ? "draining: new jobs are refused, running jobs go on"
                                         : "no longer draining: new jobs are accepted");
        return std::string();
      }
      case p::MessageType::kEvictJob: {
        ZT_ASSIGN_OR_RETURN(p::EvictRequest r, p::DecodeEvictRequest(in));
        ZT_RETURN_IF_ERROR(RequireAdmin("evict"));
        // The reason goes into the log and onto the job's user's terminal.
        ZT_RETURN_IF_ERROR(CheckName("evict's reason", r.reason));
        const std::string why =
            StrCat("evicted by uid ", peer_.uid, r.reason.empty() ? "" : ": ", r.reason);
        ZT_RETURN_IF_ERROR(d_.Evict(r.job, why));
        ZT_LOG(kWarn, "ztierd") << Who() << ": evicted job " << r.job << " (" << why << ")";
        return std::string();
      }
    }
    return Status::InvalidArgument("unknown request");
  }

  Result<std::string> OnHello(std::string_view in) {
    ZT_ASSIGN_OR_RETURN(p::Hello h, p::DecodeHello(in));
    if (hello_done_) return Status::FailedPrecondition("a second hello on one connection");
    // A refusal here counts with those of the accept loop (the metrics'
    // refused connections, status's), and is logged as they are.
    const auto refuse = [&](Status s) {
      std::string more;
      if (d_.refusal_log.Allow(&more)) {
        ZT_LOG(kWarn, "ztierd") << "refused " << Who() << ": " << s.message() << more;
      }
      d_.refused.fetch_add(1);
      return s;
    };
    // The name goes into the log: a newline or an escape in it wrote lines
    // (and terminal sequences) of the client's own there.
    if (Status s = CheckName("the client's name", h.name); !s.ok()) return refuse(s);
    if (reserve_ && h.name != p::kOperatorClientName) {
      // Past the uid's quota on the operators' reserve: for their tool only
      // (a training session there would lock ztierctl out).
      return refuse(Status::ResourceExhausted(
          StrCat(AtConnectionQuota(), "; past it ztierd lets in only the operator's tool (",
                 p::kOperatorClientName, ")")));
    }
    if (h.min_version > p::kVersion || h.max_version < p::kVersion) {
      return refuse(Status::FailedPrecondition(
          StrCat("the client (", h.name, ") speaks protocol versions ", h.min_version, "..",
                 h.max_version, "; this ztierd speaks ", p::kVersion,
                 ": use a libztier and a ztierd of the same release")));
    }
    hello_done_ = true;
    std::string more;
    if (d_.connection_log.Allow(&more)) {
      ZT_LOG(kInfo, "ztierd") << Who() << ": " << h.name << " connected" << more;
    }
    return p::Encode(p::Hello{.name = "ztierd"});
  }

  // About the heap a registered job's spec takes in this process: ztierd's
  // copy and the engine's (with its scoped name), and the engine's layout
  // (an offset a tensor). A spec of millions of scalar tensors took
  // hundreds of MiB that no quota counted.
  static uint64_t SpecHeap(const JobSpec& spec) {
    uint64_t bytes = 0;
    for (const UnitSpec& u : spec.units) {
      bytes += sizeof(UnitSpec) + u.name.size() + 64;
      for (const TensorSpec& t : u.tensors) {
        bytes += sizeof(TensorSpec) + t.name.size() + t.shape.size() * sizeof(int64_t);
      }
    }
    uint64_t tensors = 0;
    for (const UnitSpec& u : spec.units) tensors += u.tensors.size();
    return 2 * bytes + sizeof(uint64_t) * tensors;
  }

  // A memfd payload's bytes charged to the uid while a handler holds them
  // (DaemonOptions::max_spec_bytes_per_uid); given back when the charge goes.
  class PayloadCharge {
   public:
    PayloadCharge() = default;
    PayloadCharge(const PayloadCharge&) = delete;
    PayloadCharge& operator=(const PayloadCharge&) = delete;
    ~PayloadCharge() {
      if (d_ == nullptr) return;
      std::lock_guard<std::mutex> lock(d_->mu);
      d_->usage[uid_].payload_bytes -= bytes_;
    }
    // Charges `bytes` to `uid` unless that passes the bound.
    Status Take(Impl& d, uid_t uid, uint64_t bytes) {
      std::lock_guard<std::mutex> lock(d.mu);
      Impl::Usage& u = d.usage[uid];
      if (u.payload_bytes + u.spec_bytes + bytes > d.options.max_spec_bytes_per_uid) {
        return Status::ResourceExhausted(StrCat(
            "uid ", uid, "'s requests hold ", u.payload_bytes, " bytes of job specs in ztierd",
            u.spec_bytes == 0 ? "" : StrCat(" and its registered jobs ", u.spec_bytes),
            "; this one needs ", bytes, " more, past the quota of ",
            d.options.max_spec_bytes_per_uid, " (daemon max_spec_bytes_per_uid)"));
      }
      u.payload_bytes += bytes;
      d_ = &d;
      uid_ = uid;
      bytes_ = bytes;
      return Status::Ok();
    }

    // Lowers the charge to `bytes` once less is held (the decoded spec a
    // wait keeps); never raises it.
    void LowerTo(uint64_t bytes) {
      if (d_ == nullptr || bytes >= bytes_) return;
      std::lock_guard<std::mutex> lock(d_->mu);
      d_->usage[uid_].payload_bytes -= bytes_ - bytes;
      bytes_ = bytes;
    }

   private:
    Impl* d_ = nullptr;
    uid_t uid_ = 0;
    uint64_t bytes_ = 0;
  };

  // A request's payload: in its datagram, or in the memfd it carries (then
  // charged to the uid through `charge`, for as long as the caller keeps it:
  // the bytes, their decoded form and its copies, kMemfdPayloadHeapFactor
  // times the memfd's size, before any of it is read).
  Result<std::string> Payload(Request& req, PayloadCharge* charge) {
    if ((req.header.flags & p::kFlagMemfd) != 0) {
      struct stat st {};
      if (::fstat(req.fds[0].get(), &st) != 0)
        return PosixError("fstat of the payload memfd", errno);
      const uint64_t size = std::min<uint64_t>(
          static_cast<uint64_t>(std::max<off_t>(st.st_size, 0)), p::kMaxMemfdPayloadBytes);
      if (size == 0) return Status::InvalidArgument("the payload memfd is empty");
      ZT_RETURN_IF_ERROR(charge->Take(d_, peer_.uid, p::kMemfdPayloadHeapFactor * size));
      // At most what was charged: a memfd grown since is refused.
      return ReadPayloadMemfd(req.fds[0].get(), size);
    }
    return std::move(req.payload);
  }

  Result<std::string> OnRegister(Request& req) {
    PayloadCharge charge;
    ZT_ASSIGN_OR_RETURN(std::string spec_bytes, Payload(req, &charge));
    ZT_ASSIGN_OR_RETURN(JobSpec spec, p::DecodeJobSpec(spec_bytes));
    const std::string name = spec.name;
    // What refuses the job whatever else this ztierd holds comes first: a
    // refusal changes nothing (a parked job of the name stays parked).
    ZT_RETURN_IF_ERROR(ValidateJobSpec(spec));
    // Under d_.mu: the refusals that do not depend on the job's size. A
    // parked job of the name (`parked`) is counted as gone.
    const auto refused = [&](bool parked) -> Status {
      if (d_.draining) {
        return Status::Unavailable(StrCat(
            "job '", name,
            "' refused: this ztierd is draining (an operator ran ztierctl drain; running jobs go "
            "on; new ones are refused until ztierctl drain --off: try again then)"));
      }
      // A freed job whose regions live processes still map holds its
      // memory and a pidfd of each of them: one process that registered,
      // left and registered again (a grace period set) filled ztierd's fd
      // table. Such jobs count as the uid's jobs, and so does a parked one
      // taken over while its processes live (it lingers once freed).
      const Impl::Usage& u = d_.usage[peer_.uid];
      const int jobs = u.jobs - (parked ? 1 : 0);
      const int quota = d_.QuotaForLocked(peer_.uid).max_jobs;
      if (jobs + u.lingering_jobs >= quota) {
        return Status::ResourceExhausted(
            StrCat("uid ", peer_.uid, " has ", jobs, " jobs",
                   u.lingering_jobs == 0
                       ? std::string()
                       : StrCat(" and ", u.lingering_jobs,
                                " freed ones (evicted, or left by their connections) whose memory "
                                "processes that live on still map (ztierctl quota get names them)"),
                   ", the quota (max_jobs_per_uid) is ", quota, "; job '", name, "' refused",
                   d_.ParkedNoteLocked(peer_.uid)));
      }
      return Status::Ok();
    };
    // A job of that name that its clients left (parked) gives way: a run
    // that starts again starts afresh (from its checkpoint). Not for a
    // registration refused anyway.
    std::shared_ptr<Impl::Job> parked;
    {
      std::unique_lock<std::mutex> lock(d_.mu);
      ZT_RETURN_IF_ERROR(WaitForNameLocked(lock, name));
      auto it = d_.jobs.find({peer_.uid, name});
      const bool has_parked = it != d_.jobs.end() && it->second->holders.empty();
      ZT_RETURN_IF_ERROR(refused(has_parked && !d_.MappedByLiveProcessLocked(*it->second)));
      if (has_parked) {
        parked = it->second;
        d_.MarkFreedLocked(*parked);
      }
    }
    if (parked != nullptr) (void)d_.Free(parked, "registered again");
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      ZT_RETURN_IF_ERROR(refused(false));  // (things changed meanwhile)
      ++d_.usage[peer_.uid].jobs;
      ++d_.registrations;
    }
    JobSpec scoped = spec;
    scoped.name = prefix_ + name;
    // The ranks of a job of several meet in its collective region: its bytes
    // are held in the uid's DRAM use from the registration on (parked too),
    // so that a job admitted at its quota's edge is not refused at its first
    // collective. (A one-rank job's is charged if it is ever asked for.)
    // (Ranks past what a region may hold never make one: not charged.)
    const uint64_t collective =
        spec.ranks > 1 && CollectiveRegionBytes(spec.ranks) <= kMaxCollectiveRegionBytes
            ? CollectiveRegionBytes(spec.ranks)
            : 0;
    // Over the uid's DRAM quota (requires d_.mu): the refusal, naming it.
    const auto dram_over = [&](const Impl::Usage& u, uint64_t need, uint64_t quota) {
      return Status::ResourceExhausted(StrCat(
          "job '", name, "' needs ", need, " bytes of ",
          collective == 0 ? std::string("pinned DRAM")
                          : StrCat("DRAM (", collective, " of them the collective region of its ",
                                   spec.ranks, " ranks, the rest pinned)"),
          "; uid ", peer_.uid, " holds ", u.dram_bytes, " of its quota of ", quota,
          " (max_dram_bytes_per_uid)",
          u.lingering_bytes == 0
              ? std::string()
              : StrCat(", ", u.lingering_bytes,
                       " of them freed jobs' memory that processes that live on still map"),
          d_.ParkedNoteLocked(peer_.uid)));
    };
    // The quota is checked, and the job's need held in the uid's use, before
    // the engine allocates any of it: a job over the quota never holds the
    // budget (for others' registrations) while it is being refused.
    // So is the swap quota, before the swap files grow for the job.
    const auto nvme_over = [&](const Impl::Usage& u, uint64_t need, uint64_t quota) {
      return Status::ResourceExhausted(
          StrCat("job '", name, "' needs ", need, " bytes of swap; uid ", peer_.uid, " holds ",
                 u.nvme_bytes, " of its quota of ", quota, " (max_nvme_bytes_per_uid)",
                 d_.ParkedNoteLocked(peer_.uid)));
    };
    uint64_t reserved = 0, reserved_nvme = 0;
    const auto admit = [&](uint64_t need, uint64_t nvme_need) -> Status {
      std::lock_guard<std::mutex> lock(d_.mu);
      Impl::Usage& u = d_.usage[peer_.uid];
      const Quota quota = d_.QuotaForLocked(peer_.uid);
      need += collective;
      if (quota.max_dram_bytes != 0 && u.dram_bytes + need > quota.max_dram_bytes) {
        return dram_over(u, need, quota.max_dram_bytes);
      }
      if (quota.max_nvme_bytes != 0 && u.nvme_bytes + nvme_need > quota.max_nvme_bytes) {
        return nvme_over(u, nvme_need, quota.max_nvme_bytes);
      }
      u.dram_bytes += need;
      u.nvme_bytes += nvme_need;
      reserved = need;
      reserved_nvme = nvme_need;
      return Status::Ok();
    };
    Result<int> id = d_.engine->RegisterJob(scoped, admit);
    if (!id.ok()) {
      std::lock_guard<std::mutex> lock(d_.mu);
      --d_.usage[peer_.uid].jobs;
      d_.usage[peer_.uid].dram_bytes -= reserved;
      d_.usage[peer_.uid].nvme_bytes -= reserved_nvme;
      if (spec.optimizer_tier == Tier::kNvme && d_.engine->swap_usage().empty()) {
        // The engine's message names settings of its own, which a client
        // of ztierd cannot change.
        return Status::FailedPrecondition(
            StrCat("job '", name,
                   "': this ztierd has no swap directories, so optimizer states go to its DRAM "
                   "only (ztier-train --optimizer dram, ztier.torch states=\"dram\"); swap "
                   "directories are ztierd's own settings (zero_optimization.offload_optimizer."
                   "nvme_path in its configuration; for the ztierd that ztier.torch's rank 0 "
                   "starts, offload()'s settings= or ZTIER_NVME_PATHS)"));
      }
      return id.status();
    }
    // The uid's share of the tiers, with this job's bytes as the engine
    // holds them now.
    const JobCounters held = d_.engine->counters(*id);
    auto job = std::make_shared<Impl::Job>();
    job->engine_job = *id;
    job->uid = peer_.uid;
    job->dram_bytes = held.dram_bytes;
    job->nvme_bytes = held.nvme_bytes;
    job->holders = {this};
    job->spec_bytes = SpecHeap(spec);
    // Rank 0 is the registering connection's (the others' too, as it acts
    // for them: CheckRank): another process's attach of it took the job
    // from under it.
    job->rank_owner.assign(spec.ranks, nullptr);
    job->rank_owner[0] = this;
    job->spec = std::move(spec);
    Status over;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      Impl::Usage& u = d_.usage[peer_.uid];
      u.dram_bytes -= reserved;  // now counted as the engine holds it
      u.nvme_bytes -= reserved_nvme;
      const Quota quota = d_.QuotaForLocked(peer_.uid);
      const struct {
        uint64_t max_dram_bytes_per_uid, max_nvme_bytes_per_uid;
      } o{quota.max_dram_bytes, quota.max_nvme_bytes};
      if (o.max_dram_bytes_per_uid != 0 &&
          u.dram_bytes + held.dram_bytes + collective > o.max_dram_bytes_per_uid) {
        over = dram_over(u, held.dram_bytes + collective, o.max_dram_bytes_per_uid);
      } else if (o.max_nvme_bytes_per_uid != 0 &&
                 u.nvme_bytes + held.nvme_bytes > o.max_nvme_bytes_per_uid) {
        over = nvme_over(u, held.nvme_bytes, o.max_nvme_bytes_per_uid);
      } else if (u.spec_bytes + job->spec_bytes > d_.options.max_spec_bytes_per_uid) {
        over = Status::ResourceExhausted(
            StrCat("job '", name, "': its spec takes about ", job->spec_bytes, " bytes in ztierd (",
                   job->spec.units.size(), " units); uid ", peer_.uid, "'s registered jobs hold ",
                   u.spec_bytes, " of the quota of ", d_.options.max_spec_bytes_per_uid,
                   " (daemon max_spec_bytes_per_uid: fewer, larger tensors take less)"));
      } else if (d_.jobs.count({peer_.uid, name}) != 0) {
        // The engine's names are unique, so this is a race with a parked
        // job of the name being attached again.
        over = Status::AlreadyExists(StrCat("job '", name, "' is registered already"));
      }
      if (over.ok()) {
        u.dram_bytes += held.dram_bytes + collective;
        job->collective_bytes = collective;
        u.nvme_bytes += held.nvme_bytes;
        u.spec_bytes += job->spec_bytes;
        d_.jobs[{peer_.uid, name}] = job;
      } else {
        --u.jobs;
      }
    }
    if (!over.ok()) {
      (void)d_.engine->UnregisterJob(*id);
      return over;
    }
    d_.jobs_changed.notify_all();
    const int32_t handle = AddHandle(job, -1);
    if (std::string more; d_.job_log.Allow(&more)) {
      ZT_LOG(kInfo, "ztierd") << Who() << ": job '" << name << "' registered ("
                              << job->spec.units.size() << " units, " << job->spec.ranks
                              << " ranks)" << more;
    }
    return HandleReply(handle, *job);
  }

  // What a register or an attach answers: the job's handle on this connection.
  std::string HandleReply(int32_t handle, const Impl::Job& job) const {
    return p::Encode(p::JobHandle{.job = handle,
                                  .units = static_cast<int32_t>(job.spec.units.size()),
                                  .ranks = job.spec.ranks,
                                  .state_dtype = d_.StateDtypeOf(job)});
  }

  int32_t AddHandle(const std::shared_ptr<Impl::Job>& job, int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    const int32_t handle = next_handle_++;
    jobs_[handle] = JobEntry{.job = job,
                             .rank = rank,
                             .engine_job = job->engine_job,
                             .name = job->spec.name,
                             .param_tier = job->spec.param_tier};
    return handle;
  }

  // A rank in another process joins a job of its uid, waiting up to the
  // request's timeout for the job to be registered.
  Result<std::string> OnAttach(Request& req) {
    PayloadCharge charge;
    ZT_ASSIGN_OR_RETURN(std::string bytes, Payload(req, &charge));
    ZT_ASSIGN_OR_RETURN(p::AttachRequest a, p::DecodeAttachRequest(bytes));
    bytes = std::string();  // the decoded spec is what the wait keeps
    // (charged as such: 16 times the memfd's bytes for the whole wait
    // left room for few ranks' attaches under the quota)
    charge.LowerTo(SpecHeap(a.spec));
    const std::string& name = a.spec.name;
    const auto deadline = Clock::now() + a.timeout;
    std::shared_ptr<Impl::Job> job;
    {
      std::unique_lock<std::mutex> lock(d_.mu);
      for (;;) {
        auto it = d_.jobs.find({peer_.uid, name});
        // Another launch's job that its connections left (parked) or hung
        // up on: the launch killed before this one, whose rank 0 will
        // register it again: waited for, not refused.
        const bool earlier_launch =
            it != d_.jobs.end() && a.spec.launch != 0 && it->second->spec.launch != 0 &&
            it->second->spec.launch != a.spec.launch && HeldOnlyByHungUpLocked(*it->second);
        if (it != d_.jobs.end() && !it->second->freed && !earlier_launch) {
          job = it->second;
          break;
        }
        if (d_.stopping.load() || Closing()) {
          return Status::Unavailable(StrCat("attach to job '", name,
                                            "': ztierd is stopping or "
                                            "the connection closed"));
        }
        if (Clock::now() >= deadline) {
          return Status::NotFound(StrCat(
              "no job '", name, "' of uid ", peer_.uid, " was registered within ",
              a.timeout.count(), " ms (rank 0 registers it, the other ranks attach)",
              earlier_launch ? "; the one of that name is another launch's, which its processes "
                               "left"
                             : ""));
        }
        d_.jobs_changed.wait_until(lock, std::min(deadline, Clock::now() + kPollInterval));
      }
      if (a.spec.launch != 0 && job->spec.launch != 0 && job->spec.launch != a.spec.launch) {
        return Status::FailedPrecondition(StrCat(
            "rank ", a.rank, " cannot join job '", name, "': the job of that name on this ztierd ",
            "was registered by another launch's rank 0 (two launches of uid ", peer_.uid,
            " use the name '", name, "'; give each its own name)"));
      }
      const std::string differs = SpecDifference(job->spec, a.spec);
      if (!differs.empty()) {
        return Status::FailedPrecondition(
            StrCat("rank ", a.rank, "'s model does not match job '", name, "': it has ", differs));
      }
      if (job->rank_owner[a.rank] != nullptr) {
        return Status::AlreadyExists(
            StrCat("rank ", a.rank, " of job '", name, "' is attached already"));
      }
      job->rank_owner[a.rank] = this;
      job->holders.insert(this);
      if (job->parked) {
        job->parked = false;
        if (std::string more; d_.job_log.Allow(&more)) {
          ZT_LOG(kInfo, "ztierd") << Who() << ": parked job '" << name << "' attached again"
                                  << more;
        }
      }
    }
    const int32_t handle = AddHandle(job, a.rank);
    if (std::string more; d_.job_log.Allow(&more)) {
      ZT_LOG(kInfo, "ztierd") << Who() << ": rank " << a.rank << " attached to job '" << name << "'"
                              << more;
    }
    return HandleReply(handle, *job);
  }

  // The job's collective region: made on the first ask, the same memory
  // for every rank after.
  Result<std::string> OnCollectiveRegion(Request& req) {
    ZT_ASSIGN_OR_RETURN(p::CollectiveRegionRequest c,
                        p::DecodeCollectiveRegionRequest(req.payload));
    ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(c.job));
    UniqueFd dup;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      Impl::Job& job = *j.job;
      // Its size is the job's ranks' (a one-rank job asked for a GiB).
      const uint64_t bytes = CollectiveRegionBytes(job.spec.ranks);
      if (c.bytes != bytes) {
        return Status::InvalidArgument(StrCat("job '", j.name, "' of ", job.spec.ranks,
                                              " rank(s) has a collective region of ", bytes,
                                              " bytes; a rank asked for ", c.bytes));
      }
      if (job.freed) return Status::Aborted(StrCat("job '", j.name, "' was freed"));
      // (A request that ran on as its connection closed and parked the job:
      // the ranks that attach again meet in a fresh region.)
      if (job.parked) return Status::Aborted(StrCat("job '", j.name, "' is parked"));
      if (!job.collective_fd.valid()) {
        // In the uid's DRAM use: a job of several ranks since it was
        // registered, a one-rank job's from now on.
        Impl::Usage& u = d_.usage[job.uid];
        const uint64_t quota = d_.QuotaForLocked(job.uid).max_dram_bytes;
        const bool charged = job.collective_bytes == bytes;
        if (!charged && quota != 0 && u.dram_bytes + bytes > quota) {
          return Status::ResourceExhausted(StrCat(
              "job '", j.name, "': its collective region (", bytes, " bytes for ", job.spec.ranks,
              " ranks) would take uid ", job.uid, " past its DRAM quota: it holds ", u.dram_bytes,
              " of ", quota, " (max_dram_bytes_per_uid)"));
        }
        ZT_ASSIGN_OR_RETURN(UniqueFd fd, MakeSealedMemfd("ztier-collectives", c.bytes));
        ZT_ASSIGN_OR_RETURN(job.collective_region,
                            Mapping::Map(fd.get(), kCollectiveHeaderBytes, /*writable=*/true,
                                         "the collective region"));
        job.collective_fd = std::move(fd);
        if (!charged) {
          job.collective_bytes = bytes;
          u.dram_bytes += bytes;
        }
        // A rank that left before the region was made: its peers must not
        // wait for it there.
        if (job.ended_by_daemon) {
          Impl::AbortCollectivesLocked(job, -1);
        } else if (job.left_rank >= 0) {
          Impl::AbortCollectivesLocked(job, job.left_rank);
        }
      }
      const int fd = ::fcntl(job.collective_fd.get(), F_DUPFD_CLOEXEC, 0);
      if (fd < 0) return PosixError("fcntl(F_DUPFD_CLOEXEC) of the collective region", errno);
      dup = UniqueFd(fd);
    }
    req.reply_fds.push_back(std::move(dup));
    return p::Encode(
        p::RegionList{.regions = {p::RegionInfo{
                          .region = 0, .bytes = c.bytes, .access = RegionAccess::kReadWrite}}});
  }

  // A connection that attached rank r acts for r only; the registering one
  // for rank 0 and every rank no other connection attached, each of which
  // it holds from its first use (an attach of it is then refused).
  Status CheckRank(const JobEntry& j, int rank) {
    if (j.rank >= 0) {
      if (rank == j.rank) return Status::Ok();
      return Status::FailedPrecondition(StrCat("job '", j.name, "': this connection attached rank ",
                                               j.rank, "; it cannot act for rank ", rank));
    }
    std::lock_guard<std::mutex> lock(d_.mu);
    auto& owners = j.job->rank_owner;
    if (rank >= 0 && rank < static_cast<int>(owners.size())) {
      if (owners[rank] != nullptr && owners[rank] != this) {
        return Status::FailedPrecondition(
            StrCat("job '", j.name, "': rank ", rank, " is attached by another process"));
      }
      owners[rank] = this;
    }
    return Status::Ok();
  }

  bool Closing() {
    std::lock_guard<std::mutex> lock(mu_);
    return closing_;
  }

  // The client closed its end, or died or is dying (killed, its memory
  // still being let go of): ztierd may not have read the close yet.
  bool HungUp() const {
    pollfd pfd{.fd = sock_.fd(), .events = POLLRDHUP, .revents = 0};
    if (::poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      return true;
    }
    return ProcessIsExiting(peer_.pid);
  }

  // Under d_.mu: whether every connection holding `job` hung up (none:
  // true, as for a parked job).
  static bool HeldOnlyByHungUpLocked(const Impl::Job& job) {
    return std::all_of(job.holders.begin(), job.holders.end(),
                       [](const void* c) { return static_cast<const Connection*>(c)->HungUp(); });
  }

  // Under d_.mu: a run killed and started again at once registers its
  // job's name while ztierd may not have seen the old connection close
  // yet. Waits, up to kNameWait, while the uid's job of `name` is held only
  // by connections that hung up (they free or park it as they close) or is
  // being freed; a name that a live connection holds is refused at once.
  Status WaitForNameLocked(std::unique_lock<std::mutex>& lock, const std::string& name) {
    const auto going = [&] {
      auto it = d_.jobs.find({peer_.uid, name});
      if (it != d_.jobs.end() && !it->second->holders.empty()) {
        return HeldOnlyByHungUpLocked(*it->second);
      }
      return d_.freeing.count({peer_.uid, name}) != 0;
    };
    const auto deadline = Clock::now() + kNameWait;
    while (going() && !d_.stopping.load() && Clock::now() < deadline) {
      if (Closing()) {
        return Status::Unavailable(
            StrCat("job '", name, "': the connection closed while its registration waited"));
      }
      d_.jobs_changed.wait_until(lock, std::min(deadline, Clock::now() + kPollInterval));
    }
    return Status::Ok();
  }

  // Runs an engine wait in slices of kWaitSlice until `timeout`, so a
  // closing connection is not held up by a job others keep alive, and a
  // wait for `step` of `peers`' job (when given) ends once another rank
  // left it without its part of that step (UnlessPeerLeft).
  template <class Call>
  auto Sliced(std::chrono::milliseconds timeout, Call call, const JobEntry* peers = nullptr,
              int64_t step = 0) -> decltype(call(timeout)) {
    const auto deadline = Clock::now() + timeout;
    for (bool first = true;; first = false) {
      // The first slice from the timeout itself (a wait of 300 ms said it
      // waited 299, the clock having moved on).
      const auto left = first ? timeout
                              : std::max(std::chrono::milliseconds(0),
                                         std::chrono::duration_cast<std::chrono::milliseconds>(
                                             deadline - Clock::now()));
      const auto slice = std::min(left, kWaitSlice);
      auto r = call(slice);
      const Status s = StatusOf(r);
      if (s.ok() || s.code() != StatusCode::kUnavailable) return r;
      if (peers != nullptr) ZT_RETURN_IF_ERROR(UnlessPeerLeft(*peers, step));
      if (slice == left || Closing()) {
        if (timeout <= kWaitSlice) return r;
        return Status(s.code(), StrCat(s.message(), "; waited ", timeout.count(), " ms in all"),
                      s.sys_errno());
      }
    }
  }
  static Status StatusOf(const Status& s) { return s; }
  template <class T>
  static Status StatusOf(const Result<T>& r) {
    return r.status();
  }

  Result<std::string> OnAcquire(std::string_view in) {
    ZT_ASSIGN_OR_RETURN(p::StepWait w, p::DecodeStepWait(in));
    ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(w.job));
    ZT_ASSIGN_OR_RETURN(UnitLayout l, d_.engine->Layout(j.engine_job, w.unit));
    Result<const bf16*> acquired = Sliced(
        w.timeout,
        [&](std::chrono::milliseconds slice) {
          return d_.engine->AcquireParams(j.engine_job, w.unit, w.step, slice);
        },
        &j, w.step);
    ZT_RETURN_IF_ERROR(UnlessEvicted(j, acquired.status()));
    const bf16* params = *acquired;
    Result<SharedBuffer> b = d_.engine->Locate(j.engine_job, params, l.padded * sizeof(bf16));
    if (!b.ok()) {
      (void)d_.engine->ReleaseParams(j.engine_job, w.unit);
      return b.status();
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++leases_[{j.engine_job, w.unit}];
    return p::Encode(*b);
  }

  Result<std::string> OnRegions(Request& req) {
    ZT_ASSIGN_OR_RETURN(p::JobRef r, p::DecodeJobRef(req.payload));
    ZT_ASSIGN_OR_RETURN(JobEntry j, FindJob(r.job));
    ZT_ASSIGN_OR_RETURN(std::vector<SharedBuffer> regions, d_.engine->SharedRegions(j.engine_job));
    // What a process that left the job without unregistering it stays
    // charged for while it lives (a stopped client): every region's bytes.
    // The job's pages are punched as it goes (DramPool::DestroyRegion), but
    // a page a client pinned stays allocated, in ztierd's memory cgroup,
    // until it unpins: the CUDA runner pins both regions (cudaHostRegister),
    // and a process may pin them itself (io_uring buffers, vmsplice). The
    // read-only regions alone were charged: a pinned grad inbox was in no
    // quota and not in the budget.
    uint64_t region_bytes = 0;
    for (const SharedBuffer& b : regions) region_bytes += b.region_bytes;
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
    {
      // Recorded as the fds go out, unless the job was freed meanwhile (an
      // evict between FindJob and here): its charge was settled without
      // this mapping, so none is handed out.
      std::lock_guard<std::mutex> lock(d_.mu);
      if (j.job->freed) {
        return Status::Aborted(StrCat("job '", j.name, "' was freed",
                                      j.job->evicted.load() ? ": " + j.job->evicted_why : ""));
      }
      Impl::Job::Mapper& m = j.job->mappers[this];
      if (!m.pidfd.valid() && pidfd_.valid()) {
        m.pidfd = UniqueFd(::fcntl(pidfd_.get(), F_DUPFD_CLOEXEC, 0));
      }
      m.pid = peer_.pid;
      m.bytes = region_bytes;
    }
    req.reply_fds = std::move(fds);
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
    // Pages ztierd faulted in would be its memory, in no quota of the
    // sender's (a sparse memfd of gigabytes costs its sender nothing).
    ZT_RETURN_IF_ERROR(CheckAllocated(req.fds[0].get(), need, "the staging memfd"));
    ZT_ASSIGN_OR_RETURN(
        Mapping m, Mapping::Map(req.fds[0].get(), need, /*writable=*/read, "the staging memfd"));
    auto* f = static_cast<float*>(m.data());
    if (weights) {
      ZT_RETURN_IF_ERROR(d_.engine->WriteWeights(j.engine_job, s.unit, f, l.numel));
    } else if (read) {
      ZT_RETURN_IF_ERROR(
          d_.engine->ReadState(j.engine_job, s.unit, f, f + l.padded, f + 2 * l.padded));
    } else {
      ZT_RETURN_IF_ERROR(d_.engine->WriteState(j.engine_job, s.unit, f, f + l.padded,
                                               f + 2 * l.padded, s.generation));
    }
    return std::string();
  }

  // Drops a handle: its leases, its rank, its hold on the job. The last
  // holder frees the job, or parks it when its connection closed
  // (`closing`) and a grace period is set; a handle that goes while others
  // hold the job tells their collectives its rank left.
  Status Unregister(int32_t handle, bool closing) {
    JobEntry j;
    std::vector<std::pair<int, int>> held;
    bool other_handle = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(handle);
      if (it == jobs_.end()) {
        return Status::NotFound(StrCat("no job ", handle, " on this connection"));
      }
      j = it->second;
      jobs_.erase(it);
      for (const auto& [h, e] : jobs_) other_handle |= e.engine_job == j.engine_job;
      for (auto l = leases_.begin(); !other_handle && l != leases_.end();) {
        if (l->first.first == j.engine_job) {
          for (int k = 0; k < l->second; ++k) held.push_back(l->first);
          l = leases_.erase(l);
        } else {
          ++l;
        }
      }
    }
    for (const auto& [job, unit] : held) (void)d_.engine->ReleaseParams(job, unit);
    bool free = false;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      Impl::Job& job = *j.job;
      job.holders.erase(job.holders.find(this));
      // Its last handle on the job gone, the connection holds none of its
      // ranks (the one it attached, or those it acted for as registrant).
      if (!other_handle) {
        std::replace(job.rank_owner.begin(), job.rank_owner.end(), static_cast<const void*>(this),
                     static_cast<const void*>(nullptr));
      } else if (j.rank >= 0 && job.rank_owner[j.rank] == this) {
        job.rank_owner[j.rank] = nullptr;
      }
      const auto grace = d_.options.job_grace_period;
      // A rank that goes while others hold the job (or may attach again)
      // takes part in no more collectives: its peers must not wait for it.
      // (One that goes as ztierd stops: the others are told that, not
      // that it left.)
      if (!job.holders.empty() || (closing && grace.count() > 0)) {
        Impl::AbortCollectivesLocked(job, d_.stopping.load() ? -1 : std::max(j.rank, 0));
      }
      // Who unregistered the job itself unmaps it (the client library
      // does, as it unregisters); a connection that closes keeps its place
      // among the mappers, charged when the job goes if its process lives.
      if (!closing && !other_handle) {
        job.mappers.erase(this);
        if (job.freed) d_.ForgetMappingLocked(this, j.engine_job);
      }
      if (job.holders.empty() && !job.freed) {  // (an evicted job is freed already)
        if (closing && grace.count() > 0 && !d_.stopping.load()) {
          job.parked = true;
          job.parked_until = Clock::now() + grace;
          // Ranks that attach again meet in a fresh region (the old one
          // says a rank left, to whoever still maps it).
          job.collective_region.Reset();
          job.collective_fd = UniqueFd();
          if (job.spec.ranks == 1) {  // (a job of several keeps its region's place)
            d_.usage[job.uid].dram_bytes -= job.collective_bytes;
            job.collective_bytes = 0;
          }
          job.left_rank = -1;
          job.ended_by_daemon = false;
          if (std::string more; d_.job_log.Allow(&more)) {
            ZT_LOG(kInfo, "ztierd") << Who() << ": job '" << j.name << "' parked for "
                                    << grace.count() << " ms (its last client left)" << more;
          }
        } else {
          // A closing connection that maps the job stays counted too while
          // its process lives (the job's bytes go with the job's mappers).
          linger_connection_ = linger_connection_ || (closing && job.mappers.count(this) != 0);
          free = d_.MarkFreedLocked(job);
        }
      }
    }
    d_.jobs_changed.notify_all();  // (a registration of the name waits: WaitForNameLocked)
    if (std::string more; d_.job_log.Allow(&more)) {
      ZT_LOG(kInfo, "ztierd") << Who() << ": handle of job '" << j.name << "' dropped" << more;
    }
    if (!free) return Status::Ok();
    return d_.Free(j.job, closing ? "its last client left" : "unregistered");
  }

  void UnregisterAll() {
    std::vector<int32_t> handles;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [h, j] : jobs_) handles.push_back(h);
    }
    for (int32_t h : handles) (void)Unregister(h, /*closing=*/true);
  }

  // The client is gone or the daemon stops: free what the connection held.
  void Close() {
    if (!refusal_.ok()) {
      sock_.Shutdown();
      d_.refused_held.fetch_sub(1);
      finished_.store(true);
      return;
    }
    if (d_.stopping.load()) {
      std::string reason;
      {
        std::lock_guard<std::mutex> lock(d_.mu);
        reason = d_.stop_reason;
      }
      // Briefly: a client that does not read must not hold up the stop.
      (void)SendError(0, p::MessageType::kHello, Status::Unavailable(reason), kFarewellTimeout);
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
    // No thread ends idle once closing_ is set (its wait sees it), so the
    // lists are final here.
    std::list<std::thread> pool;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pool.swap(pool_);
      pool.splice(pool.end(), ended_);
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
    // A process that outlives its connection while it may still map jobs
    // freed as it closed stays charged for the connection (Lingering; the
    // jobs' bytes are charged with the jobs); one that unregistered its
    // jobs first (a session closed normally) does not.
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      const bool lives =
          linger_connection_ && pidfd_.valid() && !Impl::Exited(pidfd_) && !d_.stopping.load();
      Impl::Usage& u = d_.usage[peer_.uid];
      if (reserve_) {
        --u.reserve;
      } else if (lives) {
        Impl::Lingering l;
        l.uid = peer_.uid;
        l.connection = true;
        l.pidfd = std::move(pidfd_);
        d_.lingering.push_back(std::move(l));
      } else {
        --u.connections;
      }
      --d_.connections;
    }
    std::string more;
    if (d_.connection_log.Allow(&more)) {
      ZT_LOG(kInfo, "ztierd") << Who() << ": connection closed" << more;
    }
    finished_.store(true);
    d_.all_closed.notify_all();
  }

  std::string Who() const { return StrCat("client pid ", peer_.pid, " uid ", peer_.uid); }
  // "uid U is at its connection quota (max_connections_per_uid: N held of
  // M)", for a connection let in on the operators' reserve.
  std::string AtConnectionQuota() const {
    int held = 0, quota = 0;
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      const auto u = d_.usage.find(peer_.uid);
      if (u != d_.usage.end()) held = u->second.connections;
      quota = d_.QuotaForLocked(peer_.uid).max_connections;
    }
    return StrCat("uid ", peer_.uid, " is at its connection quota (max_connections_per_uid: ", held,
                  " held of ", quota, ")");
  }

  Impl& d_;
  SeqPacketSocket sock_;
  const PeerCredentials peer_;
  const std::string prefix_;
  const Status refusal_;
  bool admin_ = false;    // an operator (Impl::Admin)
  bool reserve_ = false;  // past the uid's quota, on the operators' reserve
  std::thread thread_;
  std::atomic<bool> finished_{false};
  bool hello_done_ = false;  // the connection thread's

  std::mutex mu_;
  std::map<int32_t, JobEntry> jobs_;
  int32_t next_handle_ = 1;
  std::map<std::pair<int, int>, int> leases_;  // (engine job, unit) -> acquires held
  // It closed while its process mapped a job freed then (Impl::Lingering).
  bool linger_connection_ = false;  // guarded by Impl::mu
  UniqueFd pidfd_;                  // the client process (SO_PEERPIDFD), when the kernel has it
  // The pool (see Queue).
  std::deque<Request> queue_;
  std::list<std::thread> pool_, ended_;  // running or waiting; ended idle, to join
  std::condition_variable queue_cv_;
  int waiting_ = 0;    // threads in queue_cv_.wait
  int in_flight_ = 0;  // queued or running
  bool closing_ = false;
};

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() {
  Stop("ztierd is shutting down");
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->all_closed.wait(lock, [&] { return impl_->connections == 0; });
  for (auto& c : impl_->live) c->Join();
  lock.unlock();
  impl_->ReapParked(/*all=*/true);
}

Result<std::unique_ptr<Daemon>> Daemon::Create(const Settings& settings,
                                               const DaemonOptions& options,
                                               std::shared_ptr<nvme::IoBackend> io_backend) {
  if (options.max_connections_per_uid < 1 || options.max_jobs_per_uid < 1 ||
      options.max_requests_in_flight < 1 || options.max_requests_in_flight_per_uid < 1 ||
      options.max_requests_in_flight_total < 1 || options.max_spec_bytes_per_uid < 1) {
    return Status::InvalidArgument("ztierd quotas must be at least 1");
  }
  if (options.idle_dram_release.count() < 0) {
    return Status::InvalidArgument("ztierd: the idle DRAM release time cannot be negative");
  }
  if (options.job_grace_period.count() < 0) {
    return Status::InvalidArgument("ztierd: the job grace period cannot be negative");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->engine_state_dtype = settings.state_dtype;
  ZT_RETURN_IF_ERROR(impl->LoadQuotaFile());
  ZT_ASSIGN_OR_RETURN(impl->engine, Engine::Create(settings, std::move(io_backend)));
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

Engine& Daemon::engine() { return *impl_->engine; }

std::string Daemon::MetricsText() const { return impl_->MetricsText(); }

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
    s.jobs += static_cast<int>(impl_->freeing.size());
  }
  s.requests = impl_->requests.load();
  s.refused = impl_->refused.load();
  return s;
}

namespace {
int OpenConnections(Daemon::Impl& d) {
  std::lock_guard<std::mutex> lock(d.mu);
  return d.connections;
}
}  // namespace

Status Daemon::Serve(SeqPacketListener& listener) {
  Impl& d = *impl_;
  Status result;
  Clock::time_point next_accept_warning{};
  while (!d.stopping.load()) {
    d.ReapParked(/*all=*/false);
    d.ReapLingering(/*all=*/false);
    d.ReleaseIdleDram();
    d.SampleTotals();
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
      const int err = sock.status().sys_errno();
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // A flood of connections (or the jobs' fds) took the process's fd
        // limit: not a reason to end every user's jobs. Said once a while.
        if (const Clock::time_point now = Clock::now(); now >= next_accept_warning) {
          ZT_LOG(kWarn, "ztierd") << sock.status() << ": new connections wait until fds are "
                                  << "free (" << OpenConnections(d) << " connections open)";
          next_accept_warning = now + std::chrono::seconds(10);
        }
        std::this_thread::sleep_for(kAcceptBackoff);
        continue;
      }
      result = sock.status();
      break;
    }
    Result<PeerCredentials> peer = sock->Peer();
    if (!peer.ok()) {
      ZT_LOG(kWarn, "ztierd") << "a connection without credentials: " << peer.status();
      d.refused.fetch_add(1);
      continue;
    }
    Result<std::vector<gid_t>> groups = sock->PeerGroups();
    const bool admin = d.Admin(peer->uid, peer->gid, groups.ok() ? *groups : std::vector<gid_t>{});
    Status refuse;
    bool reserve = false;
    {
      std::lock_guard<std::mutex> lock(d.mu);
      Impl::Usage& u = d.usage[peer->uid];
      const int quota = d.QuotaForLocked(peer->uid).max_connections;
      if (!d.Allowed(peer->uid)) {
        refuse = Status::FailedPrecondition(
            StrCat("uid ", peer->uid, " is not on this ztierd's list of allowed users"));
      } else if (admin && u.connections >= quota && u.reserve < kOperatorReserve) {
        reserve = true;
        ++u.reserve;
        ++d.connections;
      } else if (u.connections >= quota) {
        refuse = Status::ResourceExhausted(
            StrCat("uid ", peer->uid, " has ", u.connections, " connections",
                   u.reserve > 0 ? StrCat(" (and ", u.reserve, " on the operators' reserve)") : "",
                   ", the quota (max_connections_per_uid) is ",
                   d.QuotaForLocked(peer->uid).max_connections,
                   u.lingering_bytes == 0
                       ? std::string()
                       : " (closed connections of processes that live on and may still map "
                         "freed jobs' memory count until those processes exit)"));
      } else {
        ++u.connections;
        ++d.connections;
      }
    }
    if (!refuse.ok()) {
      std::string more;
      if (d.refusal_log.Allow(&more)) {
        ZT_LOG(kWarn, "ztierd") << "refused pid " << peer->pid << ": " << refuse << more;
      }
      d.refused.fetch_add(1);
      if (d.refused_held.fetch_add(1) >= kMaxRefusedHeld) {
        d.refused_held.fetch_sub(1);
        continue;  // closed at once: too many are being told why already
      }
    }
    auto conn =
        std::make_unique<Impl::Connection>(d, *std::move(sock), *peer, admin, reserve, refuse);
    Impl::Connection* c = conn.get();
    {
      std::lock_guard<std::mutex> lock(d.mu);
      d.live.push_back(std::move(conn));
    }
    try {
      c->Start();
    } catch (const std::system_error& e) {
      // No thread to be had (the task limit): this client's connection
      // closes at once; ztierd and everyone else's go on.
      ZT_LOG(kWarn, "ztierd") << "closed the connection of pid " << peer->pid
                              << " at once: no thread for it: " << e.what();
      d.refused.fetch_add(1);
      std::lock_guard<std::mutex> lock(d.mu);
      if (refuse.ok()) {
        --(reserve ? d.usage[peer->uid].reserve : d.usage[peer->uid].connections);
        --d.connections;
      } else {
        d.refused_held.fetch_sub(1);
      }
      d.live.remove_if([c](const std::unique_ptr<Impl::Connection>& x) { return x.get() == c; });
      d.all_closed.notify_all();
    }
  }
  d.stopping.store(true);
  std::unique_lock<std::mutex> lock(d.mu);
  d.all_closed.wait(lock, [&] { return d.connections == 0; });
  for (auto& c : d.live) c->Join();
  d.live.clear();
  lock.unlock();
  d.ReapParked(/*all=*/true);
  d.ReapLingering(/*all=*/true);
  return result;
}

}  // namespace ztier::engine

namespace ztier::engine {

std::string Daemon::Impl::MetricsText() {
  using Labels = PrometheusText::Labels;
  const DaemonStatus s = Report(/*admin=*/true);
  const std::vector<JobInfo> all = Jobs(std::nullopt, -1);
  std::vector<QuotaInfo> quotas;
  {
    std::lock_guard<std::mutex> lock(mu);
    std::set<uid_t> uids;
    for (const auto& [uid, u] : usage) uids.insert(uid);
    for (const auto& [uid, q] : custom_quotas) uids.insert(uid);
    for (uid_t uid : uids) quotas.push_back(QuotaInfoLocked(uid));
  }
  PrometheusText t;
  const auto one = [&](std::string_view name, std::string_view type, std::string_view help,
                       double value, const Labels& labels = {}) {
    t.Family(name, type, help);
    t.Sample(name, labels, value);
  };
  one("ztier_build_info", "gauge", "ztierd's version and protocol (always 1).", 1,
      {{"version", s.version}, {"protocol", std::to_string(s.protocol)}});
  const double now_unix =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  one("ztier_start_time_seconds", "gauge", "When ztierd started, in seconds since the epoch.",
      std::floor(now_unix - s.uptime_seconds));
  one("ztier_draining", "gauge", "1 while new jobs are refused (ztierctl drain).",
      s.draining ? 1 : 0);
  one("ztier_connections", "gauge", "Client connections open now.", s.connections);
  one("ztier_requests_total", "counter", "Requests answered since start.",
      static_cast<double>(s.requests));
  one("ztier_refused_connections_total", "counter",
      "Connections refused (uid not allowed, connection quota, protocol).",
      static_cast<double>(s.refused));
  one("ztier_optimizer_threads", "gauge", "CPU threads of the optimizer.", s.optimizer_threads);

  one("ztier_pinned_budget_bytes", "gauge", "The pinned DRAM budget (ztier.dram_budget).",
      static_cast<double>(s.dram_budget_bytes));
  t.Family("ztier_pinned_bytes", "gauge",
           "Pinned DRAM by state: used (handed to jobs), free (reserved, not handed out).");
  t.Sample("ztier_pinned_bytes", {{"state", "used"}}, static_cast<double>(s.dram_used_bytes));
  t.Sample("ztier_pinned_bytes", {{"state", "free"}},
           static_cast<double>(s.dram_reserved_bytes - s.dram_used_bytes));

  // A gauge with one sample per swap path.
  const auto per_path = [&](const char* name, const char* help, auto value) {
    t.Family(name, "gauge", help);
    for (const SwapPathUsage& p : s.swap) {
      t.Sample(name, {{"path", p.path}}, static_cast<double>(value(p)));
    }
  };
  per_path("ztier_swap_used_bytes", "Swap bytes the jobs' objects take, per path.",
           [](const SwapPathUsage& p) { return p.used_bytes; });
  per_path("ztier_swap_file_bytes",
           "Bytes the swap file holds on the drive (its size less the holes of freed units), per "
           "path.",
           [](const SwapPathUsage& p) { return p.file_bytes; });
  per_path("ztier_swap_capacity_bytes",
           "What the swap file may grow to, per path (its cap, or the file plus the free space).",
           [](const SwapPathUsage& p) { return p.capacity_bytes; });
  per_path("ztier_swap_waiting_ops", "Disk operations waiting on the swap file's drive, per path.",
           [](const SwapPathUsage& p) { return p.waiting_ops; });
  per_path("ztier_swap_quiet_seconds",
           "While operations wait on the swap file's drive: seconds since one last finished (a "
           "stalled drive grows it); 0 when none waits. Per path.",
           [](const SwapPathUsage& p) { return p.quiet_seconds; });
  per_path("ztier_swap_healthy",
           "1 when nothing is known wrong with the swap path; 0 when the swap space failed, its "
           "filesystem is read-only, its last write or read failed or a read did not match its "
           "checksum (ztierctl status says which).",
           [](const SwapPathUsage& p) { return p.problem.empty() ? 1.0 : 0.0; });

  const EngineTotals& tot = s.totals;
  one("ztier_nvme_read_bytes_total", "counter",
      "Optimizer state and params read from the swap drives.",
      static_cast<double>(tot.bytes.nvme_read));
  one("ztier_nvme_written_bytes_total", "counter",
      "Optimizer state and params written to the swap drives.",
      static_cast<double>(tot.bytes.nvme_write));
  t.Family("ztier_host_device_bytes_total", "counter",
           "Bytes the jobs' ranks copied between their devices and ztierd's memory, as their "
           "runners report them.");
  t.Sample("ztier_host_device_bytes_total", {{"direction", "host_to_device"}},
           static_cast<double>(tot.bytes.host_to_device));
  t.Sample("ztier_host_device_bytes_total", {{"direction", "device_to_host"}},
           static_cast<double>(tot.bytes.device_to_host));
  one("ztier_grad_bytes_total", "counter", "bf16 grads delivered into the grad inboxes.",
      static_cast<double>(tot.grad_bytes_in));
  one("ztier_steps_total", "counter", "Optimizer steps of every job since start.",
      static_cast<double>(tot.steps));
  one("ztier_skipped_steps_total", "counter", "Steps skipped for inf/NaN grads since start.",
      static_cast<double>(tot.skipped_steps));
  one("ztier_optimizer_seconds_total", "counter", "Seconds the optimizer's steps took in all.",
      tot.optimizer_seconds);
  one("ztier_stall_seconds_total", "counter",
      "Seconds clients waited for params to be published, every wait summed (prefetches "
      "beside the compute too).",
      tot.stall_seconds);
  one("ztier_jobs_registered_total", "counter", "Jobs registered since start.",
      static_cast<double>(tot.jobs_registered));

  t.Family("ztier_jobs", "gauge", "Jobs by state.");
  for (JobState state : {JobState::kTraining, JobState::kParked, JobState::kFailed}) {
    int n = 0;
    for (const JobInfo& j : all) n += j.state == state;
    t.Sample("ztier_jobs", {{"state", std::string(p::JobStateName(state))}}, n);
  }
  const auto job_labels = [&](const JobInfo& j) {
    return Labels{{"uid", std::to_string(j.uid)},
                  {"job", options.metrics_job_names ? j.name : std::to_string(j.id)}};
  };
  const auto per_job = [&](std::string_view name, std::string_view type, std::string_view help,
                           auto value) {
    t.Family(name, type, help);
    for (const JobInfo& j : all) t.Sample(name, job_labels(j), value(j));
  };
  per_job("ztier_job_steps_total", "counter", "The job's optimizer steps.",
          [](const JobInfo& j) { return static_cast<double>(j.counters.steps); });
  per_job("ztier_job_skipped_steps_total", "counter", "The job's steps skipped for inf/NaN grads.",
          [](const JobInfo& j) { return static_cast<double>(j.counters.skipped_steps); });
  per_job("ztier_job_stall_seconds_total", "counter",
          "Seconds the job's clients waited for params to be published, every wait summed "
          "(prefetches beside the compute too).",
          [](const JobInfo& j) { return j.counters.stall_seconds; });
  per_job("ztier_job_dram_bytes", "gauge", "Pinned DRAM the job holds.",
          [](const JobInfo& j) { return static_cast<double>(j.counters.dram_bytes); });
  per_job("ztier_job_nvme_bytes", "gauge", "Swap space the job holds.",
          [](const JobInfo& j) { return static_cast<double>(j.counters.nvme_bytes); });
  per_job("ztier_job_last_grad_norm", "gauge", "The global grad norm of the job's last step.",
          [](const JobInfo& j) { return j.counters.last_grad_norm; });
  t.Family("ztier_job_state", "gauge", "1 for the job's state (training, parked, failed).");
  for (const JobInfo& j : all) {
    Labels l = job_labels(j);
    l.emplace_back("state", std::string(p::JobStateName(j.state)));
    t.Sample("ztier_job_state", l, 1);
  }
  t.Family("ztier_optimizer_step_seconds", "histogram",
           "How long each of the job's optimizer steps took.");
  for (const JobInfo& j : all) {
    t.Histogram("ztier_optimizer_step_seconds", job_labels(j), kStepSecondsBounds,
                j.counters.step_seconds_buckets, j.counters.optimizer_seconds);
  }

  const auto per_uid = [&](std::string_view name, auto value, std::string_view tier) {
    for (const QuotaInfo& q : quotas) {
      Labels l{{"uid", std::to_string(q.uid)}};
      if (!tier.empty()) l.emplace_back("tier", std::string(tier));
      const double v = value(q);
      if (v >= 0) t.Sample(name, l, v);
    }
  };
  t.Family("ztier_quota_used_bytes", "gauge", "Bytes a uid's jobs hold, by tier.");
  per_uid(
      "ztier_quota_used_bytes", [](const QuotaInfo& q) { return double(q.dram_bytes); }, "dram");
  per_uid(
      "ztier_quota_used_bytes", [](const QuotaInfo& q) { return double(q.nvme_bytes); }, "nvme");
  t.Family("ztier_quota_limit_bytes", "gauge",
           "A uid's byte quota, by tier (absent: no limit but the budget).");
  per_uid(
      "ztier_quota_limit_bytes",
      [](const QuotaInfo& q) {
        return q.quota.max_dram_bytes == 0 ? -1.0 : double(q.quota.max_dram_bytes);
      },
      "dram");
  per_uid(
      "ztier_quota_limit_bytes",
      [](const QuotaInfo& q) {
        return q.quota.max_nvme_bytes == 0 ? -1.0 : double(q.quota.max_nvme_bytes);
      },
      "nvme");
  t.Family("ztier_quota_jobs", "gauge",
           "Jobs a uid holds, as its job quota counts them (with freed jobs that live processes "
           "still map).");
  per_uid(
      "ztier_quota_jobs", [](const QuotaInfo& q) { return double(q.jobs); }, "");
  t.Family("ztier_quota_max_jobs", "gauge", "A uid's job quota.");
  per_uid(
      "ztier_quota_max_jobs", [](const QuotaInfo& q) { return double(q.quota.max_jobs); }, "");
  t.Family("ztier_quota_connections", "gauge", "Connections a uid holds.");
  per_uid(
      "ztier_quota_connections", [](const QuotaInfo& q) { return double(q.connections); }, "");
  t.Family("ztier_quota_max_connections", "gauge", "A uid's connection quota.");
  per_uid(
      "ztier_quota_max_connections",
      [](const QuotaInfo& q) { return double(q.quota.max_connections); }, "");
  return t.Take();
}

}  // namespace ztier::engine
