// ztierctl: the operator's tool for ztierd, speaking its protocol through
// libztier's DaemonControl (client/ztier.h).
//
//   ztierctl [--socket PATH] [--json] status
//   ztierctl [--socket PATH] [--json] jobs
//   ztierctl [--socket PATH] [--json] quota get [UID | all]
//   ztierctl [--socket PATH] [--json] quota set UID [--jobs N] [--connections N]
//                                                   [--dram SIZE] [--nvme SIZE]
//   ztierctl [--socket PATH] quota reset UID
//   ztierctl [--socket PATH] drain [--off]
//   ztierctl [--socket PATH] evict JOB [--reason TEXT]
//
// The socket: --socket, else $ZTIER_DAEMON_SOCKET, else
// /run/ztier/ztierd.sock (ztierd.socket's). Human output is aligned
// tables; --json prints one JSON object (docs/operations.md documents its
// fields, which only ever grow).
//
// Exit codes: 0 done; 1 ztierd answered with an error (a job that does not
// exist, a quota file it could not write); 2 bad arguments; 3 ztierd is
// not running (nothing listens at the socket); 4 refused (not an operator,
// or the socket's permissions or ztierd's list of users keep this uid out).
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "client/ztier.h"
#include "common/numbers.h"
#include "common/utf8.h"
#include "common/version.h"
#include "engine/engine.h"
#include "engine/protocol.h"
#include "engine/seqpacket.h"

namespace ztier::ztierctl {
namespace {

using engine::DaemonStatus;
using engine::JobInfo;
using engine::QuotaInfo;
using Json = nlohmann::ordered_json;

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNotRunning = 3;
constexpr int kExitRefused = 4;
constexpr const char* kDefaultSocket = "/run/ztier/ztierd.sock";

void Usage(std::FILE* out) {
  std::fprintf(out,
               "usage: ztierctl [--socket PATH] [--json] [--timeout S] COMMAND\n"
               "\n"
               "commands:\n"
               "  status                      version, uptime, pinned DRAM, swap per path,\n"
               "                              bytes moved per tier (since start, last minute)\n"
               "  jobs                        jobs: owner, name, state, ranks, step, DRAM and\n"
               "                              NVMe bytes, step time, stalls, grad norm\n"
               "                              (an operator sees every job, others their own)\n"
               "  quota get [UID|all]         a uid's quota and use (default: yours)\n"
               "  quota set UID [--jobs N] [--connections N] [--dram SIZE] [--nvme SIZE]\n"
               "                              (SIZE: 64G, 512M, ...; 0 or none: no limit)\n"
               "  quota reset UID             back to ztierd's defaults\n"
               "                              (UID: a number or a user's name)\n"
               "  drain [--off]               refuse new jobs (running ones go on), or stop\n"
               "  evict JOB [--reason TEXT]   free a job (its id from `jobs`); its clients\n"
               "                              are told why\n"
               "Setting quotas, drain, evict and other uids' quotas are for operators: root,\n"
               "ztierd's own user, or members of its admin group (ztier-admin).\n"
               "\n"
               "options:\n"
               "  --socket PATH   ztierd's socket (default $ZTIER_DAEMON_SOCKET, else %s)\n"
               "  --json          one JSON object on stdout instead of tables\n"
               "  --timeout S     wait at most S seconds for ztierd's answer (default 10;\n"
               "                  a stopped or hung ztierd is then said, exit 3)\n"
               "  --version, --help\n"
               "  --              what follows is the command's own (an evict reason\n"
               "                  such as \"--json\")\n"
               "\n"
               "exit codes: 0 done, 1 ztierd answered with an error, 2 bad arguments,\n"
               "            3 ztierd is not running, 4 refused (not allowed)\n",
               kDefaultSocket);
}

struct UsageError {
  std::string message;
};

// ------------------------------------------------------------ formatting

std::string Bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(b));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
  }
  return buf;
}

std::string Rate(uint64_t bytes, double seconds) {
  if (seconds <= 0) return "-";
  return Bytes(static_cast<uint64_t>(static_cast<double>(bytes) / seconds)) + "/s";
}

std::string Duration(double s) {
  const auto t = static_cast<long long>(s);
  char buf[64];
  if (t >= 86400) {
    std::snprintf(buf, sizeof(buf), "%lldd %02lldh %02lldm", t / 86400, t % 86400 / 3600,
                  t % 3600 / 60);
  } else if (t >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lldh %02lldm %02llds", t / 3600, t % 3600 / 60, t % 60);
  } else if (t >= 60) {
    std::snprintf(buf, sizeof(buf), "%lldm %02llds", t / 60, t % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1fs", s);
  }
  return buf;
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// Rows of cells printed with each column as wide as its widest cell on a
// terminal (a name in CJK characters takes two columns a character)
// (numbers right-aligned: columns named in `right`).
void PrintTable(const std::vector<std::vector<std::string>>& rows, const std::vector<bool>& right,
                std::string_view indent = "") {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    if (width.size() < r.size()) width.resize(r.size(), 0);
    for (size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], DisplayWidth(r[c]));
  }
  for (const auto& r : rows) {
    std::string line(indent);
    for (size_t c = 0; c < r.size(); ++c) {
      const size_t pad = width[c] - DisplayWidth(r[c]);
      const bool last = c + 1 == r.size();
      if (c < right.size() && right[c]) {
        line += std::string(pad, ' ') + r[c];
      } else {
        line += r[c] + (last ? "" : std::string(pad, ' '));
      }
      if (!last) line += "  ";
    }
    std::printf("%s\n", line.c_str());
  }
}

std::string Limit(uint64_t bytes) { return bytes == 0 ? "none" : Bytes(bytes); }

// ------------------------------------------------------------ JSON

Json TierJson(const engine::TierBytes& t) {
  return {{"nvme_read_bytes", t.nvme_read},
          {"nvme_write_bytes", t.nvme_write},
          {"host_to_device_bytes", t.host_to_device},
          {"device_to_host_bytes", t.device_to_host}};
}

// How a swap path's drive is doing, for the status table: "ok", its
// problem, or the operations waiting on it once none has finished for a
// second or more (a stalled drive).
std::string SwapDrive(const engine::SwapPathUsage& p) {
  std::string out = p.problem.empty() ? "ok" : PrintableUtf8(p.problem);
  if (p.waiting_ops > 0 && p.quiet_seconds >= 1) {
    out += StrCat(", ", p.waiting_ops, " op(s) waiting, none done for ", Duration(p.quiet_seconds));
  }
  return out;
}

Json StatusJson(const DaemonStatus& s) {
  Json swap = Json::array();
  for (const auto& p : s.swap) {
    swap.push_back({{"path", p.path},
                    {"used_bytes", p.used_bytes},
                    {"file_bytes", p.file_bytes},
                    {"capacity_bytes", p.capacity_bytes},
                    {"waiting_ops", p.waiting_ops},
                    {"quiet_seconds", p.quiet_seconds},
                    {"problem", p.problem}});
  }
  const engine::EngineTotals& t = s.totals;
  return {{"version", s.version},
          {"protocol", s.protocol},
          {"uptime_seconds", s.uptime_seconds},
          {"draining", s.draining},
          {"caller_is_admin", s.caller_is_admin},
          {"optimizer_threads", s.optimizer_threads},
          {"connections", s.connections},
          {"jobs", s.jobs},
          {"requests", s.requests},
          {"refused_connections", s.refused},
          {"dram",
           {{"budget_bytes", s.dram_budget_bytes},
            {"reserved_bytes", s.dram_reserved_bytes},
            {"used_bytes", s.dram_used_bytes},
            {"page_bytes", s.dram_page_bytes}}},
          {"swap", swap},
          {"since_start",
           {{"bytes", TierJson(t.bytes)},
            {"grad_bytes", t.grad_bytes_in},
            {"steps", t.steps},
            {"skipped_steps", t.skipped_steps},
            {"optimizer_seconds", t.optimizer_seconds},
            {"stall_seconds", t.stall_seconds},
            {"jobs_registered", t.jobs_registered}}},
          {"last_minute", {{"seconds", s.window_seconds}, {"bytes", TierJson(s.window)}}}};
}

Json JobJson(const JobInfo& j) {
  const engine::JobCounters& c = j.counters;
  return {{"id", j.id},
          {"uid", j.uid},
          {"name", j.name},
          {"state", engine::protocol::JobStateName(j.state)},
          {"failure", j.failure},
          {"world_size", j.world_size},
          {"attached", j.attached},
          {"step", j.step},
          {"state_dtype", std::string(engine::StateDtypeName(j.state_dtype))},
          {"optimizer_tier", j.optimizer_tier == engine::Tier::kNvme ? "nvme" : "dram"},
          {"param_tier", j.param_tier == engine::Tier::kNvme ? "nvme" : "dram"},
          {"dram_bytes", c.dram_bytes},
          {"nvme_bytes", c.nvme_bytes},
          {"steps", c.steps},
          {"skipped_steps", c.skipped_steps},
          {"last_step_seconds", c.last_step_seconds},
          {"optimizer_seconds", c.optimizer_seconds},
          {"stall_seconds", c.stall_seconds},
          {"last_grad_norm", std::isfinite(c.last_grad_norm) ? Json(c.last_grad_norm) : Json()},
          {"nvme_read_bytes", c.nvme_read_bytes + c.nvme_param_read_bytes},
          {"nvme_write_bytes", c.nvme_write_bytes},
          {"host_to_device_bytes", c.host_to_device_bytes},
          {"device_to_host_bytes", c.device_to_host_bytes}};
}

Json QuotaJson(const engine::Quota& q) {
  return {{"max_jobs", q.max_jobs},
          {"max_connections", q.max_connections},
          {"max_dram_bytes", q.max_dram_bytes},
          {"max_nvme_bytes", q.max_nvme_bytes}};
}

Json QuotaInfoJson(const QuotaInfo& q) {
  return {{"uid", q.uid},
          {"custom", q.custom},
          {"quota", QuotaJson(q.quota)},
          {"use",
           {{"jobs", q.jobs},
            {"connections", q.connections},
            {"dram_bytes", q.dram_bytes},
            {"nvme_bytes", q.nvme_bytes},
            {"lingering_dram_bytes", q.lingering_bytes},
            {"lingering_pids", q.lingering_pids}}}};
}

// Text that is not UTF-8 (a path, a value as the user typed it) is printed
// with U+FFFD for its bad bytes: nlohmann's dump() throws on it, which ended
// ztierctl with an abort and a core dump.
void PrintJson(const Json& j) {
  std::printf("%s\n", j.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
}

// ------------------------------------------------------------ commands

struct Options {
  std::string socket;
  bool json = false;
  int timeout_seconds = 10;       // --timeout: for ztierd's answer to each call
  std::vector<std::string> args;  // the command and its arguments
};

void PrintStatus(const DaemonStatus& s) {
  std::printf("ztierd %s (protocol %u), up %s, %s\n", s.version.c_str(), s.protocol,
              Duration(s.uptime_seconds).c_str(),
              s.draining ? "DRAINING (new jobs are refused)" : "accepting jobs");
  std::printf("%d connections, %d jobs, %llu requests, %llu connections refused\n", s.connections,
              s.jobs, static_cast<unsigned long long>(s.requests),
              static_cast<unsigned long long>(s.refused));
  std::printf("optimizer threads: %u\n", s.optimizer_threads);
  std::printf("pinned DRAM: %s used of a %s budget (%s reserved, %s pages)\n",
              Bytes(s.dram_used_bytes).c_str(), Bytes(s.dram_budget_bytes).c_str(),
              Bytes(s.dram_reserved_bytes).c_str(),
              s.dram_page_bytes == 0 ? "no" : Bytes(s.dram_page_bytes).c_str());
  if (s.swap.empty()) {
    std::printf("swap: none (no NVMe paths configured)\n");
  } else {
    std::printf("swap:\n");
    std::vector<std::vector<std::string>> rows = {{"PATH", "USED", "FILE", "CAPACITY", "DRIVE"}};
    for (const auto& p : s.swap) {
      rows.push_back({p.path, Bytes(p.used_bytes), Bytes(p.file_bytes), Bytes(p.capacity_bytes),
                      SwapDrive(p)});
    }
    PrintTable(rows, {false, true, true, true, false}, "  ");
  }
  std::printf("bytes moved:\n");
  const engine::TierBytes& a = s.totals.bytes;
  const engine::TierBytes& w = s.window;
  const std::string window = StrCat("LAST ", Fixed(s.window_seconds, 0), " S");
  std::vector<std::vector<std::string>> rows = {{"TIER", "SINCE START", window, "RATE"}};
  const auto row = [&](const char* name, uint64_t total, uint64_t recent) {
    rows.push_back({name, Bytes(total), Bytes(recent), Rate(recent, s.window_seconds)});
  };
  row("nvme read", a.nvme_read, w.nvme_read);
  row("nvme write", a.nvme_write, w.nvme_write);
  row("host->device", a.host_to_device, w.host_to_device);
  row("device->host", a.device_to_host, w.device_to_host);
  PrintTable(rows, {false, true, true, true}, "  ");
  std::printf(
      "steps: %lld (%lld skipped) by %lld jobs since start, optimizer %s, stalls %s\n",
      static_cast<long long>(s.totals.steps), static_cast<long long>(s.totals.skipped_steps),
      static_cast<long long>(s.totals.jobs_registered),
      Duration(s.totals.optimizer_seconds).c_str(), Duration(s.totals.stall_seconds).c_str());
}

void PrintJobs(const std::vector<JobInfo>& jobs) {
  if (jobs.empty()) {
    std::printf("no jobs\n");
    return;
  }
  std::vector<std::vector<std::string>> rows = {{"ID", "UID", "NAME", "STATE", "RANKS", "STEP",
                                                 "DRAM", "NVME", "LAST STEP", "STALLS",
                                                 "GRAD NORM"}};
  for (const JobInfo& j : jobs) {
    const engine::JobCounters& c = j.counters;
    rows.push_back(
        {std::to_string(j.id), std::to_string(j.uid), j.name,
         std::string(engine::protocol::JobStateName(j.state)),
         StrCat(j.attached, "/", j.world_size), std::to_string(j.step), Bytes(c.dram_bytes),
         Bytes(c.nvme_bytes), c.steps == 0 ? "-" : Fixed(c.last_step_seconds, 3) + " s",
         Fixed(c.stall_seconds, 2) + " s", c.steps == 0 ? "-" : Fixed(c.last_grad_norm, 4)});
  }
  PrintTable(rows, {true, true, false, false, true, true, true, true, true, true, true});
  for (const JobInfo& j : jobs) {
    if (!j.failure.empty()) std::printf("job %d failed: %s\n", j.id, j.failure.c_str());
  }
}

void PrintQuotas(const std::vector<QuotaInfo>& quotas) {
  std::vector<std::vector<std::string>> rows = {
      {"UID", "JOBS", "CONNECTIONS", "DRAM", "NVME", "QUOTA"}};
  for (const QuotaInfo& q : quotas) {
    rows.push_back({std::to_string(q.uid), StrCat(q.jobs, "/", q.quota.max_jobs),
                    StrCat(q.connections, "/", q.quota.max_connections),
                    Bytes(q.dram_bytes) + " / " + Limit(q.quota.max_dram_bytes),
                    Bytes(q.nvme_bytes) + " / " + Limit(q.quota.max_nvme_bytes),
                    q.custom ? "set" : "default"});
  }
  PrintTable(rows, {true, true, true, true, true, false});
  // Memory of freed jobs (evicted, or parked and gone) that a live process
  // still maps: no job shows it, so the operator is told who holds it.
  for (const QuotaInfo& q : quotas) {
    if (q.lingering_bytes == 0) continue;
    std::string pids;
    for (int32_t pid : q.lingering_pids) pids += StrCat(pids.empty() ? "" : ", ", pid);
    std::printf(
        "uid %u: %s of its DRAM is a freed job's memory that live processes still map (pid%s "
        "%s): it is freed when they exit (a stopped client: continue or kill it)\n",
        q.uid, Bytes(q.lingering_bytes).c_str(), q.lingering_pids.size() == 1 ? "" : "s",
        pids.c_str());
  }
}

// An id ("a job id"): a decimal below 2^32 - 1.
uint32_t ParseId(std::string_view text, std::string_view what) {
  uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v >= UINT32_MAX) {
    throw UsageError{StrCat("'", text, "' is not ", what)};
  }
  return static_cast<uint32_t>(v);
}

// A uid: a decimal, or a user's name (the passwd database's).
uint32_t ParseUidArg(std::string_view text) {
  Result<uint32_t> uid = ztier::ParseUid(text);
  if (!uid.ok()) throw UsageError{std::string(uid.status().message())};
  return *uid;
}

int32_t ParseCount(std::string_view flag, std::string_view text) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v < 1 || v > (1 << 20)) {
    throw UsageError{StrCat(flag, ": '", text, "' is not a count in 1..", 1 << 20)};
  }
  return static_cast<int32_t>(v);
}

uint64_t ParseBytes(std::string_view flag, std::string_view text) {
  if (text == "none") return 0;
  Result<uint64_t> b = ParseSize(text);
  if (!b.ok()) throw UsageError{StrCat(flag, ": ", b.status().message())};
  return *b;
}

// With --json a failure is a JSON object on stdout too, so a script that
// reads stdout learns why: {"error": {"code", "message", "exit"}}.
int JsonError(bool json, std::string_view code, std::string_view message, int exit) {
  if (json) {
    PrintJson({{"error", {{"code", code}, {"message", message}, {"exit", exit}}}});
  }
  return exit;
}

// Turns a failed call into the exit code that says what kind it is.
int Fail(const Status& s, bool json) {
  std::fprintf(stderr, "ztierctl: %s\n", s.ToString().c_str());
  int exit = kExitError;
  switch (s.code()) {
    case StatusCode::kPermissionDenied:
      exit = kExitRefused;
      break;
    case StatusCode::kInvalidArgument:
      exit = kExitUsage;
      break;
    case StatusCode::kUnavailable:  // gone, or no answer within --timeout
      exit = kExitNotRunning;
      break;
    default:
      break;
  }
  return JsonError(json, StatusCodeName(s.code()), s.message(), exit);
}

int Run(const Options& o) {
  const std::vector<std::string>& a = o.args;
  if (a.empty()) throw UsageError{"no command"};
  const std::string& cmd = a[0];
  // Checks the arguments before connecting: a typo is a usage error even
  // when ztierd is down.
  engine::QuotaUpdate update;
  std::string reason;
  int32_t evict_id = 0;
  bool drain_on = true;
  bool quota_all = false;
  uint32_t quota_uid = static_cast<uint32_t>(::getuid());
  if (cmd == "status" || cmd == "jobs") {
    if (a.size() != 1) throw UsageError{StrCat(cmd, " takes no arguments")};
  } else if (cmd == "quota") {
    if (a.size() < 2) throw UsageError{"quota: get, set or reset"};
    if (a[1] == "get") {
      if (a.size() > 3) throw UsageError{"quota get [UID|all]"};
      if (a.size() == 3 && a[2] == "all") {
        quota_all = true;
      } else if (a.size() == 3) {
        quota_uid = ParseUidArg(a[2]);
      }
    } else if (a[1] == "reset") {
      if (a.size() != 3) throw UsageError{"quota reset UID"};
      update.uid = ParseUidArg(a[2]);
      update.reset = true;
    } else if (a[1] == "set") {
      if (a.size() < 3) throw UsageError{"quota set UID [--jobs N] ..."};
      update.uid = ParseUidArg(a[2]);
      for (size_t i = 3; i < a.size(); i += 2) {
        const std::string& f = a[i];
        if (!f.starts_with("--")) {
          throw UsageError{StrCat("quota set: '", f,
                                  "' is not a flag (--jobs, --connections, "
                                  "--dram, --nvme)")};
        }
        if (i + 1 >= a.size()) throw UsageError{StrCat(f, " needs a value")};
        const std::string& v = a[i + 1];
        if (f == "--jobs") {
          update.quota.max_jobs = ParseCount(f, v);
          update.set |= engine::kQuotaMaxJobs;
        } else if (f == "--connections") {
          update.quota.max_connections = ParseCount(f, v);
          update.set |= engine::kQuotaMaxConnections;
        } else if (f == "--dram") {
          update.quota.max_dram_bytes = ParseBytes(f, v);
          update.set |= engine::kQuotaMaxDram;
        } else if (f == "--nvme") {
          update.quota.max_nvme_bytes = ParseBytes(f, v);
          update.set |= engine::kQuotaMaxNvme;
        } else {
          throw UsageError{StrCat("quota set: unknown flag '", f, "'")};
        }
      }
      if (update.set == 0) {
        throw UsageError{"quota set: name at least one of --jobs, --connections, --dram, --nvme"};
      }
    } else {
      throw UsageError{StrCat("quota: unknown subcommand '", a[1], "' (get, set, reset)")};
    }
  } else if (cmd == "drain") {
    if (a.size() == 2 && a[1] == "--off") {
      drain_on = false;
    } else if (a.size() != 1) {
      const std::string& odd = a[1] == "--off" ? a[2] : a[1];  // the first not understood
      throw UsageError{StrCat("drain: unknown argument '", odd, "' (drain [--off])")};
    }
  } else if (cmd == "evict") {
    if (a.size() != 2 && !(a.size() == 4 && a[2] == "--reason")) {
      throw UsageError{"evict JOB [--reason TEXT]"};
    }
    constexpr const char* kJobId = "a job id (the id column of `ztierctl jobs`)";
    const uint32_t id = ParseId(a[1], kJobId);
    if (id > INT32_MAX) throw UsageError{StrCat("'", a[1], "' is not ", kJobId)};
    evict_id = static_cast<int32_t>(id);
    if (a.size() == 4) reason = a[3];
    if (Status s = engine::CheckName("evict --reason", reason); !s.ok()) {
      throw UsageError{std::string(s.message())};
    }
  } else {
    throw UsageError{StrCat("unknown command '", cmd, "'")};
  }

  Result<std::unique_ptr<client::DaemonControl>> conn =
      client::DaemonControl::Connect(o.socket, std::chrono::seconds(o.timeout_seconds));
  if (!conn.ok()) {
    const Status& s = conn.status();
    std::fprintf(stderr, "ztierctl: %s\n", s.ToString().c_str());
    if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kNotFound) {
      std::fprintf(stderr,
                   "ztierctl: is ztierd running? (systemctl status ztierd.socket; or name its "
                   "socket with --socket)\n");
      return JsonError(o.json, StatusCodeName(s.code()), s.message(), kExitNotRunning);
    }
    if (s.code() == StatusCode::kFailedPrecondition || s.code() == StatusCode::kPermissionDenied) {
      return JsonError(o.json, StatusCodeName(s.code()), s.message(), kExitRefused);
    }
    if (s.code() == StatusCode::kInvalidArgument) {  // --socket names no socket
      return JsonError(o.json, StatusCodeName(s.code()), s.message(), kExitUsage);
    }
    return JsonError(o.json, StatusCodeName(s.code()), s.message(), kExitError);
  }
  client::DaemonControl& c = **conn;

  if (cmd == "status") {
    Result<DaemonStatus> s = c.GetStatus();
    if (!s.ok()) return Fail(s.status(), o.json);
    o.json ? PrintJson(StatusJson(*s)) : PrintStatus(*s);
  } else if (cmd == "jobs") {
    Result<std::vector<JobInfo>> jobs = c.Jobs();
    if (!jobs.ok()) return Fail(jobs.status(), o.json);
    if (o.json) {
      Json list = Json::array();
      for (const JobInfo& j : *jobs) list.push_back(JobJson(j));
      PrintJson({{"jobs", list}});
    } else {
      PrintJobs(*jobs);
    }
  } else if (cmd == "quota" && a[1] == "get") {
    std::vector<QuotaInfo> quotas;
    engine::Quota defaults;
    if (quota_all) {
      Result<std::vector<QuotaInfo>> all = c.AllQuotas(&defaults);
      if (!all.ok()) return Fail(all.status(), o.json);
      quotas = *std::move(all);
    } else {
      Result<QuotaInfo> q = c.GetQuota(quota_uid);
      if (!q.ok()) return Fail(q.status(), o.json);
      quotas.push_back(*q);
    }
    if (o.json) {
      Json list = Json::array();
      for (const QuotaInfo& q : quotas) list.push_back(QuotaInfoJson(q));
      Json out = {{"quotas", list}};
      if (quota_all) out["defaults"] = QuotaJson(defaults);
      PrintJson(out);
    } else {
      if (quota_all) {
        std::printf("defaults: %d jobs, %d connections, DRAM %s, NVMe %s\n", defaults.max_jobs,
                    defaults.max_connections, Limit(defaults.max_dram_bytes).c_str(),
                    Limit(defaults.max_nvme_bytes).c_str());
      }
      PrintQuotas(quotas);
    }
  } else if (cmd == "quota") {
    Result<QuotaInfo> q = c.SetQuota(update);
    if (!q.ok()) return Fail(q.status(), o.json);
    o.json ? PrintJson({{"quotas", Json::array({QuotaInfoJson(*q)})}}) : PrintQuotas({*q});
  } else if (cmd == "drain") {
    Status s = c.Drain(drain_on);
    if (!s.ok()) return Fail(s, o.json);
    if (o.json) {
      PrintJson({{"draining", drain_on}});
    } else {
      std::printf(drain_on ? "draining: new jobs are refused; running jobs go on\n"
                           : "accepting new jobs again\n");
    }
  } else if (cmd == "evict") {
    Status s = c.Evict(evict_id, reason);
    if (!s.ok()) return Fail(s, o.json);
    o.json ? PrintJson({{"evicted", evict_id}}) : (void)std::printf("job %d evicted\n", evict_id);
  }
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  const char* env = std::getenv("ZTIER_DAEMON_SOCKET");
  o.socket = env != nullptr && *env != '\0' ? env : kDefaultSocket;
  try {
    int i = 1;
    bool operands_only = false;  // after "--": an evict reason may be "--json"
    for (; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (operands_only) {
        o.args.emplace_back(arg);
        continue;
      }
      if (arg == "--") {
        operands_only = true;
        continue;
      }
      if (arg == "--help" || arg == "-h") {
        Usage(stdout);
        return 0;
      }
      if (arg == "--version") {
        std::printf("ztierctl %s (protocol %d)\n", ZTIER_VERSION_STRING,
                    static_cast<int>(engine::protocol::kVersion));
        return 0;
      }
      if (arg == "--json") {
        o.json = true;
      } else if (arg == "--socket") {
        if (i + 1 >= argc) throw UsageError{"--socket needs a path"};
        o.socket = argv[++i];
      } else if (arg.starts_with("--socket=")) {
        o.socket = std::string(arg.substr(9));
      } else if (arg == "--timeout" || arg.starts_with("--timeout=")) {
        std::string_view v;
        if (arg == "--timeout") {
          if (i + 1 >= argc) throw UsageError{"--timeout needs a number of seconds"};
          v = argv[++i];
        } else {
          v = arg.substr(10);
        }
        int n = 0;
        auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
        if (ec != std::errc() || end != v.data() + v.size() || n < 1 || n > 3600) {
          throw UsageError{StrCat("--timeout '", v, "': a whole number of seconds, 1..3600")};
        }
        o.timeout_seconds = n;
      } else if (arg.starts_with("-") && o.args.empty()) {
        throw UsageError{StrCat("unknown option '", arg, "'")};
      } else {
        o.args.emplace_back(arg);
      }
    }
    if (o.socket.empty()) throw UsageError{"--socket: an empty path"};
    if (Status s = engine::CheckSocketPath(o.socket); !s.ok()) {
      throw UsageError{StrCat("--socket: ", s.message())};
    }
    return Run(o);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "ztierctl: %s\n\n", e.message.c_str());
    Usage(stderr);
    return JsonError(o.json, "usage", e.message, kExitUsage);
  }
}

}  // namespace
}  // namespace ztier::ztierctl

int main(int argc, char** argv) {
  // The tool prints its own errors; the library's info lines would be noise.
  ::setenv("ZTIER_LOG", "warn", /*overwrite=*/0);
  return ztier::ztierctl::Main(argc, argv);
}
