// ztier engine: ztierd's service, an Engine shared by the jobs of every
// client that connects to a SOCK_SEQPACKET listener (the protocol of
// engine/protocol.h; the program around it is engine/ztierd_main.cc).
//
// Each connection has its own thread. A connection's first message is its
// hello (protocol versions); the peer's uid (SO_PEERCRED) must be root,
// the daemon's own, or on the allow-list when one is set. Jobs belong to
// (uid, connection): a job's name is scoped by its uid (two users may both
// train "gpt"; "already exists" names only the caller's own jobs), its
// handle is valid on the connection that registered it only, so no client
// can name, probe, map or unregister another's job. Requests that may block
// (a params acquire, a publish wait) or compute (a grad doorbell's norms and
// accumulation, staged copies) run on the connection's pool of threads, so
// the connection's own thread only reads and answers; replies carry the
// request's id. Published steps need no request: each job's step page (one
// int64 per unit, in its read-only params region) shows them. Bulk data
// (weights in, states out) moves through a staging memfd the client made,
// never through a path the daemon opens. Per-uid quotas bound connections
// and jobs, requests in flight over all of a uid's connections and the job
// specs they hold, and each connection bounds its requests in flight; a
// refusal names the quota and the figures. A thread that cannot be had
// refuses that request (or closes that connection), never stops the daemon.
//
// Ranks in other processes (one per GPU, as torchrun starts them) join a
// job with an attach (the same model spec, a rank of their own; the daemon
// waits a while for rank 0 to register it). A job lives while any of its
// handles does; a connection that attached rank r acts for r only. Each job
// has a collective region, memory all its ranks map read-write, in which
// they meet for collectives (client/job_collectives.cc) and hand out NCCL's
// unique id.
//
// A connection that closes (the client exited or died) has its param leases
// released and its threads joined; a job it was the last holder of is
// freed (waiters wake with Aborted), or parked for the grace period, and
// the other ranks of a job it shared are told it left (their collectives
// fail at once). The engine's counters return to where they were. Stop()
// stops accepting, tells every client why (an error reply with request id
// 0, Unavailable), unregisters the jobs and joins every thread; the DRAM
// state of the jobs is not kept (users resume from their checkpoints).
//
// Thread safety: Serve runs on one thread; Stop and stats from any thread.
// Failure: a client's bad request gets an error reply naming what is wrong;
// a protocol violation (bad framing, a wrong fd) closes that connection
// only, with a log line.
#ifndef ZTIER_ENGINE_DAEMON_H_
#define ZTIER_ENGINE_DAEMON_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/engine.h"
#include "engine/seqpacket.h"
#include "engine/settings.h"

namespace ztier::nvme {
class IoBackend;
}

namespace ztier::engine {

// See DaemonOptions::max_requests_in_flight_total.
inline constexpr int kRequestsEveryUidMayHold = 128;

struct DaemonOptions {
  // Who may connect besides root and the daemon's own uid; empty: every
  // uid the socket's permissions let in (mode 0660, group ztier).
  std::vector<uid_t> allowed_uids;
  int max_connections_per_uid = 64;
  int max_jobs_per_uid = 16;
  // Pinned DRAM and swap bytes the jobs of one uid may hold together (as
  // the engine counts them at registration); 0: only the engine's budget.
  uint64_t max_dram_bytes_per_uid = 0;
  uint64_t max_nvme_bytes_per_uid = 0;
  // Requests one connection may have blocked in the daemon at once.
  int max_requests_in_flight = 256;
  // What one uid's requests may hold at once across all its connections:
  // requests in flight (each blocked one holds a thread), and bytes of job
  // specs sent in memfds (counted twice: the bytes and their decoded form),
  // so that one user cannot take the threads or the memory every user's
  // jobs need. Past either a request is refused (ResourceExhausted).
  int max_requests_in_flight_per_uid = 1024;
  // Requests in flight on all uids' connections together (each blocked one
  // holds a thread, and the service's task limit is everyone's): five uids
  // each within their own quota took every thread systemd's default
  // TasksMax allowed, and another user's running job failed. Past half of
  // it, a uid holding its fair share (half of it over the uids with
  // requests in flight) or more is refused, so the other half stays for
  // the uids that hold less (a running job keeps a few dozen).
  // A uid holding fewer than kRequestsEveryUidMayHold (four training
  // processes' of 8 ranks: fetches, pushes, releases and waits) is never
  // refused by it,
  // so the threads may pass it by that many per uid.
  int max_requests_in_flight_total = 4096;
  uint64_t max_spec_bytes_per_uid = uint64_t{1} << 30;
  // How long a job whose last client's connection closed (without
  // unregistering it) is kept, so that a restarted rank may attach to it
  // again; then it is freed. 0: freed at once. A registration of the same
  // name replaces a parked job.
  std::chrono::milliseconds job_grace_period{0};
  // With no job for this long, the pinned DRAM the pool kept for the next
  // one (its empty regions) goes back to the system: one large job left
  // tens of GiB locked on a shared machine until a restart. 0: when the
  // last job goes.
  std::chrono::milliseconds idle_dram_release{60000};
  // A connection that has not said its hello within this is closed (a
  // silent one held its uid's connection quota for good).
  std::chrono::milliseconds hello_timeout{10000};
  // A connection's pool thread (one per request in flight) idle this long
  // ends, so a burst of blocked requests does not leave its threads behind.
  std::chrono::milliseconds pool_thread_idle{5000};
  // Operators (ztierctl quota set, drain, evict; everyone's jobs and
  // quotas) besides root and the daemon's own uid: members of this group
  // (primary or supplementary, SO_PEERGROUPS). `admin_group` is its name,
  // for messages.
  std::optional<gid_t> admin_gid;
  std::string admin_group;
  // Where quotas set by operators are kept across restarts (JSON, written
  // atomically on each change; read at Create). Empty: they last until
  // the daemon stops.
  std::string quota_file;
  // Whether the metrics label each job with its name; else with its id (the
  // id ztierctl jobs shows). The metrics endpoint answers whoever can reach
  // it, and a job's name is its user's (gpt:<their output path>): names
  // only where the endpoint is the operators' alone.
  bool metrics_job_names = false;
};

struct DaemonStats {
  int connections = 0;
  int jobs = 0;           // registered, parked, or still being freed
  uint64_t requests = 0;  // answered, since start
  uint64_t refused = 0;   // connections refused (uid, quota, protocol)
};

class Daemon {
 public:
  // Creates the engine (Engine::Create). Errors: as Engine::Create,
  // InvalidArgument (options).
  static Result<std::unique_ptr<Daemon>> Create(
      const Settings& settings, const DaemonOptions& options,
      std::shared_ptr<nvme::IoBackend> io_backend = nullptr);
  // Call after Serve returned (or when it never ran).
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Accepts connections on `listener` and serves them until Stop(); returns
  // once every connection is closed and every thread joined. Errors:
  // PosixError from accept (other than a timeout).
  Status Serve(SeqPacketListener& listener);
  // Ends Serve: stops accepting and closes every connection, telling each
  // client `reason`. Idempotent; from any thread (not a signal handler).
  void Stop(std::string_view reason);

  DaemonStats stats() const;
  Engine& engine();
  // The daemon in the Prometheus text exposition format 0.0.4: build,
  // pinned DRAM, swap per path, bytes per tier, per job steps, step times
  // (a histogram), stalls and state, quotas per uid (engine/metrics.h
  // serves it). From any thread.
  std::string MetricsText() const;

  struct Impl;

 private:
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_DAEMON_H_
