// ztierd: the per-node offload service. One engine (pinned DRAM pool, NVMe
// swap space, CPU AdamW) shared by the training jobs of every user allowed
// to connect to its socket (engine/daemon.h).
//
//   ztierd --socket /tmp/ztierd.sock --config /etc/ztier/ztierd.json
//   (by hand; /run/ztier is root's, for the socket unit)
//   systemd: ztierd.socket hands the listening socket over (LISTEN_FDS)
//
// Settings come from --config (the same file format as ztier-train's: a
// DeepSpeed ds_config with ztier's keys under "ztier"), then ZTIER_*
// variables; only the engine's part (budget, swap paths, threads, pages)
// matters here, since each job brings its own optimizer and placement.
// Under systemd it speaks sd_notify: READY=1 once the engine and the
// socket are up, STATUS= with the connections and jobs, WATCHDOG=1 at half
// the interval systemd asks for, STOPPING=1 on SIGTERM. SIGTERM / SIGINT
// stop accepting, tell every client why, free every job and exit 0.
//
// Exit codes: 0 stopped by a signal, 1 a runtime error (printed), 2 bad
// usage (flags, config, environment; an engine the settings cannot make,
// such as a swap directory missing or read-only).
#include <grp.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/file_util.h"
#include "common/log.h"
#include "common/numbers.h"
#include "common/utf8.h"
#include "common/version.h"
#include "engine/daemon.h"
#include "engine/metrics.h"
#include "engine/protocol.h"
#include "engine/seqpacket.h"
#include "engine/settings.h"
#include "engine/systemd.h"

extern char** environ;

namespace ztier::ztierd {
namespace {

using engine::Daemon;
using engine::DaemonOptions;

struct Flags {
  std::string socket;
  std::string config;
  mode_t socket_mode = 0660;
  std::string metrics;  // --metrics ADDRESS
  std::string admin_group = "ztier-admin";
  bool admin_group_named = false;
  bool requests_total_named = false;
  DaemonOptions daemon;
};

void Usage(std::ostream& out) {
  out << "usage: ztierd [--version] [--socket PATH] [--config FILE] [--socket-mode OCTAL]\n"
         "              [--allow-uid UID]... [--max-jobs-per-uid N]\n"
         "              [--max-connections-per-uid N] [--max-requests-in-flight N]\n"
         "              [--max-requests-in-flight-total N]\n"
         "              [--max-dram-per-uid SIZE] [--max-nvme-per-uid SIZE]\n"
         "              [--job-grace-seconds N] [--idle-release-seconds N]\n"
         "              [--metrics ADDRESS] [--metrics-job-names yes|no]\n"
         "              [--admin-group NAME] [--quota-file FILE] [--describe-settings]\n"
         "\n"
         "  --socket PATH   listen on PATH (not needed under systemd socket activation)\n"
         "  --config FILE   engine settings: a ds_config with ztier's keys (DRAM budget,\n"
         "                  NVMe swap paths, optimizer threads); ZTIER_* variables apply on top\n"
         "  --socket-mode   permissions of the socket ztierd binds (default 0660)\n"
         "  --allow-uid     a uid (or user name) that may connect besides root and ztierd's own "
         "(repeat);\n"
         "                  none: every uid the socket's permissions let in\n"
         "  --max-jobs-per-uid, --max-connections-per-uid (defaults 16, 64),\n"
         "  --max-requests-in-flight (per connection, default 256, at least 32),\n"
         "  --max-requests-in-flight-total (all uids together, each a thread; default\n"
         "                  4096, at most half of the service's task limit; past half of\n"
         "                  it, a uid holding its fair share or more is refused),\n"
         "  --max-dram-per-uid, --max-nvme-per-uid (bytes, e.g. 64G; default: none): quotas\n"
         "  --job-grace-seconds  keep a job whose last client died this long, so a\n"
         "                  restarted rank can attach to it again (default 0: free it at once)\n"
         "  --idle-release-seconds  with no job this long, give the pinned DRAM kept for\n"
         "                  the next job back to the system (default 60; 0: when the last\n"
         "                  job goes)\n"
         "  --metrics ADDRESS  serve Prometheus metrics at http://ADDRESS/metrics: HOST:PORT\n"
         "                  (e.g. 127.0.0.1:9464) or unix:PATH; under systemd the socket\n"
         "                  named \"metrics\" (ztierd-metrics.socket) is used instead\n"
         "  --metrics-job-names  label each job's metrics with its name (yes) or its id\n"
         "                  (no, the default: whoever reaches the endpoint reads them)\n"
         "  --admin-group NAME  members may set quotas, drain and evict (ztierctl), besides\n"
         "                  root and ztierd's own user (default ztier-admin, if it exists)\n"
         "  --quota-file FILE  keep quotas set with ztierctl there across restarts\n"
         "  --describe-settings  print every setting as a markdown table and exit\n";
}

// The least --max-requests-in-flight: 8 local ranks' fetches, pushes and
// releases on one connection (a rank keeps up to 4 in flight).
constexpr int64_t kLeastRequestsInFlight = 32;

// The most threads this process may have, where something bounds them: its
// cgroup's pids.max (systemd's TasksMax, the least along the cgroup's
// path) and, for a user other than root, RLIMIT_NPROC; none when neither
// bounds them (`what` names the one that does).
std::optional<int64_t> TaskLimit(std::string* what) {
  std::optional<int64_t> limit;
  const auto take = [&](int64_t n, const std::string& name) {
    if (!limit.has_value() || n < *limit) {
      limit = n;
      *what = name;
    }
  };
  // The cgroup's pids.max and its ancestors': cgroup v2 ("0::/path") or
  // the v1 pids controller ("N:pids:/path").
  Result<std::string> cgroups = ReadFileToString("/proc/self/cgroup", 1 << 16);
  if (cgroups.ok()) {
    std::istringstream lines(*cgroups);
    for (std::string line; std::getline(lines, line);) {
      std::string root;
      std::string path;
      if (line.starts_with("0::/")) {
        root = "/sys/fs/cgroup";
        path = line.substr(3);
      } else if (const size_t at = line.find(":pids:/"); at != std::string::npos) {
        root = "/sys/fs/cgroup/pids";
        path = line.substr(at + 6);
      } else {
        continue;
      }
      for (;;) {
        const std::string file = StrCat(root, path, path == "/" ? "" : "/", "pids.max");
        Result<std::string> text = ReadFileToString(file, 64);
        if (text.ok()) {
          int64_t n = 0;  // a number, or "max"
          auto [ptr, ec] = std::from_chars(text->data(), text->data() + text->size(), n);
          if (ec == std::errc() && (ptr == text->data() + text->size() || *ptr == '\n')) {
            take(n, StrCat(file, " (TasksMax)"));
          }
        }
        if (path == "/" || path.empty()) break;
        const size_t slash = path.rfind('/');  // the parent; "/" for "/a"
        path.resize(slash == 0 ? 1 : slash);
      }
    }
  }
  rlimit nproc{};
  if (::geteuid() != 0 && ::getrlimit(RLIMIT_NPROC, &nproc) == 0 &&
      nproc.rlim_cur != RLIM_INFINITY) {
    take(static_cast<int64_t>(nproc.rlim_cur), "RLIMIT_NPROC");
  }
  return limit;
}

Result<int64_t> IntFlag(std::string_view flag, std::string_view text, int64_t lo, int64_t hi) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v < lo || v > hi) {
    return Status::InvalidArgument(
        StrCat(flag, ": '", text, "' is not an integer in ", lo, "..", hi));
  }
  return v;
}

Result<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      Usage(std::cout);
      std::exit(0);
    }
    if (a == "--version") {
      std::printf("ztierd %s (protocol %d)\n", ZTIER_VERSION_STRING,
                  static_cast<int>(engine::protocol::kVersion));
      std::exit(0);
    }
    if (a == "--describe-settings") {  // the table of docs/configuration.md
      std::fputs(engine::DescribeSettings().c_str(), stdout);
      std::exit(0);
    }
    if (a.rfind("--", 0) != 0) {
      return Status::InvalidArgument(
          StrCat("unexpected argument '", a, "' (ztierd takes flags only)"));
    }
    if (i + 1 >= argc) {
      return Status::InvalidArgument(
          StrCat(a, " needs a value, or is not a flag of ztierd (--help lists them)"));
    }
    const char* v = argv[++i];
    // An empty value (a unit's ${VARIABLE} unset, say) is no value: the
    // default it would leave in silence (no quota file, no config) is not
    // what was asked for.
    if (*v == '\0') return Status::InvalidArgument(StrCat(a, ": an empty value"));
    if (a == "--socket") {
      f.socket = v;
    } else if (a == "--config") {
      f.config = v;
    } else if (a == "--socket-mode") {
      // from_chars: octal digits only (strtoul took a leading blank or sign).
      unsigned long mode = 0;
      const std::string_view text(v);
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), mode, 8);
      if (ec != std::errc() || end != text.data() + text.size() || mode > 0777) {
        return Status::InvalidArgument(
            StrCat("--socket-mode: '", v, "' is not an octal mode of at most 0777"));
      }
      f.socket_mode = static_cast<mode_t>(mode);
    } else if (a == "--allow-uid") {
      // A uid, or a user's name (as ztierctl takes them).
      Result<uint32_t> uid = ParseUid(v);
      if (!uid.ok()) return uid.status().Annotate(a);
      f.daemon.allowed_uids.push_back(static_cast<uid_t>(*uid));
    } else if (a == "--max-jobs-per-uid") {
      ZT_ASSIGN_OR_RETURN(int64_t n, IntFlag(a, v, 1, 1 << 20));
      f.daemon.max_jobs_per_uid = static_cast<int>(n);
    } else if (a == "--max-connections-per-uid") {
      ZT_ASSIGN_OR_RETURN(int64_t n, IntFlag(a, v, 1, 1 << 20));
      f.daemon.max_connections_per_uid = static_cast<int>(n);
    } else if (a == "--max-dram-per-uid" || a == "--max-nvme-per-uid") {
      // 0 or none: no limit (as ztierctl quota set takes it).
      Result<uint64_t> bytes =
          std::string_view(v) == "none" ? Result<uint64_t>(uint64_t{0}) : ParseSize(v);
      if (!bytes.ok()) return bytes.status().Annotate(a);
      (a == "--max-dram-per-uid" ? f.daemon.max_dram_bytes_per_uid
                                 : f.daemon.max_nvme_bytes_per_uid) = *bytes;
    } else if (a == "--job-grace-seconds") {
      ZT_ASSIGN_OR_RETURN(int64_t n, IntFlag(a, v, 0, 7 * 24 * 3600));
      f.daemon.job_grace_period = std::chrono::seconds(n);
    } else if (a == "--idle-release-seconds") {
      ZT_ASSIGN_OR_RETURN(int64_t n, IntFlag(a, v, 0, 7 * 24 * 3600));
      f.daemon.idle_dram_release = std::chrono::seconds(n);
    } else if (a == "--metrics") {
      f.metrics = v;
    } else if (a == "--metrics-job-names") {
      const std::string_view yes_no = v;
      if (yes_no != "yes" && yes_no != "no") {
        return Status::InvalidArgument(
            StrCat("--metrics-job-names: '", yes_no, "' is not yes or no"));
      }
      f.daemon.metrics_job_names = yes_no == "yes";
    } else if (a == "--admin-group") {
      f.admin_group = v;
      f.admin_group_named = true;
    } else if (a == "--quota-file") {
      f.daemon.quota_file = v;
    } else if (a == "--max-requests-in-flight") {
      ZT_ASSIGN_OR_RETURN(int64_t n, IntFlag(a, v, 1, 1 << 16));
      if (n < kLeastRequestsInFlight) {
        // Below it a training process's own calls are refused, and its
        // jobs fail, rather than wait.
        return Status::InvalidArgument(
            StrCat(a, ": ", n, " is below ", kLeastRequestsInFlight,
                   ", what a training process of 8 local ranks keeps in flight on its "
                   "connection (each rank's param fetches, grad pushes and releases): its jobs "
                   "would fail"));
      }
      f.daemon.max_requests_in_flight = static_cast<int>(n);
    } else if (a == "--max-requests-in-flight-total") {
      ZT_ASSIGN_OR_RETURN(int64_t n, IntFlag(a, v, 2 * engine::kRequestsEveryUidMayHold, 1 << 20));
      f.daemon.max_requests_in_flight_total = static_cast<int>(n);
      f.requests_total_named = true;
    } else {
      return Status::InvalidArgument(StrCat("unknown flag '", a, "'"));
    }
  }
  return f;
}

// Says why the engine could not be made; the exit code: 2 where starting
// again cannot help until the settings change (a bad value, a swap
// directory missing, read-only or not ztierd's to write: systemd's
// RestartPreventExitStatus=2 then stops the restarts), 1 otherwise.
// Whether only a change of settings can fix `s` (exit 2: systemd does not
// restart it every 2 s for ever), not a retry (exit 1).
bool SettingsError(const Status& s) {
  const int err = s.sys_errno();
  const StatusCode c = s.code();
  return c == StatusCode::kInvalidArgument || c == StatusCode::kNotFound ||
         c == StatusCode::kFailedPrecondition || c == StatusCode::kPermissionDenied ||
         err == EROFS || err == EACCES || err == EPERM || err == ENOENT || err == ENOTDIR ||
         err == EISDIR || err == ENAMETOOLONG;
}

int EngineFailure(const Status& s) {
  std::fprintf(stderr, "ztierd: %s\n", ztier::PrintableUtf8(s.ToString()).c_str());
  const int err = s.sys_errno();
  // Under ProtectSystem=strict a path left out of ReadWritePaths= is
  // read-only (EROFS); one listed there but not user ztier's is EACCES.
  if (err == EROFS && std::getenv("INVOCATION_ID") != nullptr) {  // started by systemd
    std::fprintf(stderr,
                 "ztierd: under systemd (ProtectSystem=strict) every swap directory must be "
                 "listed in ReadWritePaths= of ztierd.service: systemctl edit ztierd.service "
                 "(deploy/README.md)\n");
  } else if (err == EACCES) {  // (EPERM is also io_uring disabled by sysctl)
    std::fprintf(stderr,
                 "ztierd: the path named above must be usable by the user ztierd runs as (uid "
                 "%u; the service's is ztier: chown ztier:ztier PATH)\n",
                 static_cast<unsigned>(::geteuid()));
  }
  return SettingsError(s) ? 2 : 1;
}

// The listening sockets: systemd's (LISTEN_FDS: the one named "control",
// or the only one; and the one named "metrics", kept in `*metrics_fd`),
// else --socket.
Result<engine::SeqPacketListener> OpenListener(const Flags& f, int* metrics_fd,
                                               std::string* where) {
  ZT_ASSIGN_OR_RETURN(std::vector<engine::systemd::ListenFd> fds, engine::systemd::TakeListenFds());
  *metrics_fd = -1;
  if (!fds.empty()) {
    int chosen = -1, metrics = 0;
    for (const auto& l : fds) {
      if (l.name == "control" || fds.size() == 1) chosen = l.fd;
      if (l.name == "metrics" && fds.size() > 1) {
        *metrics_fd = l.fd;
        ++metrics;
      }
    }
    for (const auto& l : fds) {
      if (l.fd != chosen && l.fd != *metrics_fd) ::close(l.fd);
    }
    if (metrics > 1) {  // one would be served, the others' scrapes left hanging
      return Status::InvalidArgument(StrCat(
          "systemd passed ", metrics,
          " sockets named 'metrics'; ztierd serves one (a drop-in of ztierd-metrics.socket that "
          "sets ListenStream= must clear the unit's first, with an empty ListenStream= line)"));
    }
    if (chosen < 0) {
      return Status::InvalidArgument(
          "systemd passed sockets, none named 'control' (FileDescriptorName=control)");
    }
    *where = StrCat("the socket systemd passed (fd ", chosen, ")");
    return engine::SeqPacketListener::FromFd(chosen);
  }
  if (f.socket.empty()) {
    return Status::InvalidArgument("no --socket and no socket from systemd (LISTEN_FDS)");
  }
  ZT_ASSIGN_OR_RETURN(engine::SeqPacketListener l,
                      engine::SeqPacketListener::Listen(f.socket, f.socket_mode));
  *where = f.socket;
  return l;
}

int Run(const Flags& f) {
  // Signals are taken by one thread (sigwait); block them before any other
  // thread starts so none of those gets them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  // Taken too, and said, never fatal: an operator's habitual `kill -HUP`
  // (reload) or a stray SIGUSR1 ended every user's job silently.
  sigaddset(&stop_signals, SIGHUP);
  sigaddset(&stop_signals, SIGUSR1);
  sigaddset(&stop_signals, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  ::signal(SIGXFSZ, SIG_IGN);  // past ulimit -f: EFBIG, said, not a silent death
  // Each connection holds a socket and a pidfd, each job its regions'
  // memfds: the soft fd limit systemd gives a service (1024) is far below
  // what the hard one allows and what many users' jobs need. (ztierd never
  // uses select(), which the soft limit protects.)
  if (rlimit nofile{};
      ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &nofile) != 0) {
      ZT_LOG(kWarn, "ztierd") << "cannot raise the fd limit to " << nofile.rlim_max << ": "
                              << std::strerror(errno);
    }
  }

  engine::Settings settings;
  if (!f.config.empty()) {
    Result<engine::Settings> s = engine::LoadSettings(f.config);
    if (!s.ok()) {
      std::fprintf(stderr, "ztierd: %s\n", ztier::PrintableUtf8(s.status().ToString()).c_str());
      return 2;
    }
    settings = *std::move(s);
  }
  Result<engine::Settings> env = engine::ApplyEnvironment(settings, environ);
  if (!env.ok()) {
    std::fprintf(stderr, "ztierd: %s\n", ztier::PrintableUtf8(env.status().ToString()).c_str());
    return 2;
  }
  settings = *std::move(env);
  if (Status v = engine::Validate(settings); !v.ok()) {
    std::fprintf(stderr, "ztierd: %s\n", ztier::PrintableUtf8(v.ToString()).c_str());
    return 2;
  }
  if (const std::vector<std::string> client = engine::ClientOnlySettingsSet(settings);
      !client.empty()) {
    std::string list;
    for (const std::string& c : client) list += StrCat(list.empty() ? "" : ", ", c);
    ZT_LOG(kWarn, "ztierd") << "settings that only a client reads change nothing here (each job "
                               "brings its own, from its config, variables or flags): "
                            << ztier::PrintableUtf8(list);
  }

  Result<engine::systemd::Notifier> notifier = engine::systemd::Notifier::FromEnvironment();
  if (!notifier.ok()) {
    std::fprintf(stderr, "ztierd: %s\n",
                 ztier::PrintableUtf8(notifier.status().ToString()).c_str());
    return 2;
  }
  Result<std::optional<std::chrono::microseconds>> watchdog = engine::systemd::WatchdogInterval();
  if (!watchdog.ok()) {
    std::fprintf(stderr, "ztierd: %s\n",
                 ztier::PrintableUtf8(watchdog.status().ToString()).c_str());
    return 2;
  }
  // Operators: members of the admin group, when it exists.
  DaemonOptions options = f.daemon;
  {
    std::vector<char> buf(16384);
    group g{};
    group* found = nullptr;
    const int rc = ::getgrnam_r(f.admin_group.c_str(), &g, buf.data(), buf.size(), &found);
    if (rc == 0 && found != nullptr) {
      options.admin_gid = found->gr_gid;
      options.admin_group = f.admin_group;
      ZT_LOG(kInfo, "ztierd") << "operators: root, uid " << ::geteuid() << " and group "
                              << f.admin_group << " (gid " << found->gr_gid << ")";
    } else if (f.admin_group_named) {
      std::fprintf(stderr, "ztierd: --admin-group: no group '%s'\n", f.admin_group.c_str());
      return 2;
    } else {
      ZT_LOG(kInfo, "ztierd") << "operators: root and uid " << ::geteuid() << " (no group "
                              << f.admin_group << ")";
    }
  }
  // Requests in flight hold a thread each: their total stays under half of
  // the task limit (connections, the engine and the other half's fair
  // shares need the rest).
  {
    std::string what;
    const std::optional<int64_t> tasks = TaskLimit(&what);
    const int64_t fits = tasks.has_value() ? *tasks / 2 : INT64_MAX;
    if (options.max_requests_in_flight_total > fits) {
      const int lowered =
          static_cast<int>(std::max<int64_t>(2 * engine::kRequestsEveryUidMayHold, fits));
      const std::string says =
          StrCat("requests in flight on all connections: ", options.max_requests_in_flight_total,
                 " lowered to ", lowered, " for the task limit of ", *tasks, " (", what,
                 "): each holds a thread", lowered > fits ? " (the least it may be)" : "");
      if (f.requests_total_named) {
        ZT_LOG(kWarn, "ztierd") << says;
      } else {
        ZT_LOG(kInfo, "ztierd") << says;
      }
      options.max_requests_in_flight_total = lowered;
    }
  }
  int metrics_fd = -1;
  std::string listening_on;  // said once ztierd serves (not before a refusal)
  Result<engine::SeqPacketListener> listener = OpenListener(f, &metrics_fd, &listening_on);
  if (!listener.ok()) {
    std::fprintf(stderr, "ztierd: %s\n",
                 ztier::PrintableUtf8(listener.status().ToString()).c_str());
    return SettingsError(listener.status()) ? 2 : 1;
  }
  // The metrics listener: systemd's socket, else --metrics.
  std::unique_ptr<engine::MetricsServer> metrics;
  if (metrics_fd >= 0 || !f.metrics.empty()) {
    Result<std::unique_ptr<engine::MetricsServer>> m =
        metrics_fd >= 0 ? engine::MetricsServer::FromFd(metrics_fd)
                        : engine::MetricsServer::Listen(f.metrics);
    if (!m.ok()) {
      std::fprintf(stderr, "ztierd: %s\n", ztier::PrintableUtf8(m.status().ToString()).c_str());
      (void)listener->Close();  // the control socket goes too
      return SettingsError(m.status()) ? 2 : 1;
    }
    metrics = *std::move(m);
  }
  (void)notifier->SetStatus("starting the engine");
  Result<std::unique_ptr<Daemon>> daemon = Daemon::Create(settings, options);
  if (!daemon.ok()) {
    (void)listener->Close();
    return EngineFailure(daemon.status());
  }
  Daemon& d = **daemon;

  std::atomic<bool> done{false};
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> stop_requested{false};
  std::thread signals([&] {
    int sig = 0;
    while (sigwait(&stop_signals, &sig) == 0) {
      if (sig == SIGTERM || sig == SIGINT) break;
      if (done.load()) return;
      if (sig == SIGHUP) {
        ZT_LOG(kWarn, "ztierd") << "received SIGHUP: ignored (ztierd reads its configuration "
                                   "only at start; restarting it applies a change, and ends "
                                   "every job: quotas change at once with ztierctl quota set)";
      } else {
        ZT_LOG(kWarn, "ztierd") << "received " << (sig == SIGUSR1 ? "SIGUSR1" : "SIGUSR2")
                                << ": ignored";
      }
    }
    if (done.load()) return;
    ZT_LOG(kInfo, "ztierd") << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
                            << ": stopping";
    stop_requested.store(true);
    (void)notifier->Stopping();
    (void)notifier->ExtendTimeout(std::chrono::seconds(30));
    d.Stop(StrCat("ztierd is stopping (", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                  "); the DRAM state of its jobs is gone: resume from the last checkpoint, if one "
                  "was saved"));
  });
  // The watchdog and the status line, from one thread.
  std::thread pinger([&] {
    const auto interval =
        watchdog->has_value()
            ? std::chrono::duration_cast<std::chrono::milliseconds>(**watchdog) / 2
            : std::chrono::milliseconds(5000);
    std::unique_lock<std::mutex> lock(mu);
    while (!done.load()) {
      const engine::DaemonStats s = d.stats();
      (void)notifier->SetStatus(StrCat(stop_requested.load() ? "stopping: " : "serving: ",
                                       s.connections, " connections, ", s.jobs, " jobs"));
      if (watchdog->has_value()) (void)notifier->Watchdog();
      cv.wait_for(lock, interval, [&] { return done.load(); });
    }
  });

  ZT_LOG(kInfo, "ztierd") << "listening on " << listening_on;
  if (metrics != nullptr) {
    metrics->Start([&d] { return d.MetricsText(); });
    ZT_LOG(kInfo, "ztierd") << "metrics at http://" << metrics->address() << "/metrics";
  }
  (void)notifier->Notify("READY=1\nSTATUS=serving: 0 connections, 0 jobs");
  ZT_LOG(kInfo, "ztierd") << "ready";
  Status served = d.Serve(*listener);
  if (metrics != nullptr) metrics->Stop();
  {
    std::lock_guard<std::mutex> lock(mu);
    done.store(true);
  }
  cv.notify_all();
  pinger.join();
  // Wake the signal thread if Serve ended on its own (an accept error).
  pthread_kill(signals.native_handle(), SIGTERM);
  signals.join();
  (void)listener->Close();
  daemon->reset();
  if (!served.ok()) {
    std::fprintf(stderr, "ztierd: %s\n", ztier::PrintableUtf8(served.ToString()).c_str());
    return 1;
  }
  ZT_LOG(kInfo, "ztierd") << "stopped";
  return 0;
}

}  // namespace
}  // namespace ztier::ztierd

int main(int argc, char** argv) {
  ztier::OpenClosedStandardFds();  // a closed stderr is not the next socket's number
  // A service logs its clients coming and going (ZTIER_LOG overrides). A
  // ZTIER_LOG that is no level (a typo in the unit) keeps the service's
  // info, said (the library's fallback, warn, hid those lines).
  if (const char* set = std::getenv("ZTIER_LOG")) {
    const std::string_view v(set);
    if (!ztier::ParseLogLevel(v).has_value()) {
      std::fprintf(stderr,
                   "ztierd: ZTIER_LOG='%s' is not error, warn, info or debug; logging at info\n",
                   ztier::PrintableUtf8(v).c_str());
      ::setenv("ZTIER_LOG", "info", /*overwrite=*/1);
    }
  }
  ::setenv("ZTIER_LOG", "info", /*overwrite=*/0);
  ztier::Result<ztier::ztierd::Flags> flags = ztier::ztierd::ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "ztierd: %s\n\n", ztier::PrintableUtf8(flags.status().ToString()).c_str());
    ztier::ztierd::Usage(std::cerr);
    return 2;
  }
  return ztier::ztierd::Run(*flags);
}
