// ztier engine: Prometheus metrics, written and served.
//
// PrometheusText writes the text exposition format 0.0.4 directly (HELP
// and TYPE lines, escaped label values, histograms as cumulative _bucket
// series with _sum and _count). MetricsServer answers HTTP GET /metrics on
// a listening stream socket: TCP (loopback by default) or a Unix socket,
// bound here (`ztierd --metrics ADDRESS`) or inherited from systemd
// (ztierd-metrics.socket, LISTEN_FDS). It is written directly rather than
// through prometheus-cpp, which cannot serve an inherited socket.
//
// The server is deliberately small: one thread, one request per connection
// (Connection: close), a request of at most 8 KiB read within 2 s, GET and
// HEAD of /metrics only (404 for other paths, 405 for other methods). The
// thread never waits on one client: every connection's request is read,
// and its answer written, as its bytes come and go, side by side (at most
// 64 at once; 5 s to take the answer). A silent, trickling or
// non-reading client holds up no one else's scrape.
//
// Thread safety: PrometheusText is a value type for one thread.
// MetricsServer: Start once; Stop (also the destructor) from any thread,
// waits for the serving thread. Failure: Listen/FromFd return a Status
// naming the address; a connection that fails mid-request is dropped with
// a debug log line, and the server goes on.
#ifndef ZTIER_ENGINE_METRICS_H_
#define ZTIER_ENGINE_METRICS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ztier::engine {

class PrometheusText {
 public:
  using Labels = std::vector<std::pair<std::string_view, std::string>>;

  // Starts a metric family: its HELP and TYPE lines. `type`: counter,
  // gauge or histogram. Each family once, before its samples.
  void Family(std::string_view name, std::string_view type, std::string_view help);
  // One sample `name{labels} value`.
  void Sample(std::string_view name, const Labels& labels, double value);
  // A histogram's series under the family `name`: `counts` holds
  // bounds.size() + 1 non-cumulative counts (the last: above every bound),
  // written as cumulative _bucket{le=...} lines, then _sum and _count.
  void Histogram(std::string_view name, const Labels& labels, std::span<const double> bounds,
                 std::span<const uint64_t> counts, double sum);

  std::string Take() { return std::move(out_); }

 private:
  void Line(std::string_view name, std::string_view suffix, const Labels& labels,
            std::string_view extra_label, std::string_view extra_value, double value);
  std::string out_;
};

// A label value with \ " and newlines escaped, as the format wants.
std::string EscapeLabelValue(std::string_view value);
// A sample value: integers exactly, others in the fewest digits that read
// back as the same double;
// NaN and infinities as Prometheus spells them.
std::string FormatMetricValue(double value);

class MetricsServer {
 public:
  // Binds and listens on `address`: "HOST:PORT" (an IPv4 address, or an
  // IPv6 one in brackets; port 0 picks a free one, see address()), or
  // "unix:PATH" (a stale socket file there is replaced, a live one is
  // not; mode 0660). Errors: InvalidArgument (the address), Unavailable (a
  // server answers on PATH), PosixError (socket, bind, listen: e.g. the
  // port is taken).
  static Result<std::unique_ptr<MetricsServer>> Listen(std::string_view address);
  // Serves on a listening stream socket someone else made (systemd's);
  // takes ownership. Errors: InvalidArgument (not a listening stream socket).
  static Result<std::unique_ptr<MetricsServer>> FromFd(int fd);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Serves on a thread of its own until Stop(): every GET /metrics gets
  // what `render` returns then.
  void Start(std::function<std::string()> render);
  void Stop();
  // Where it listens: "127.0.0.1:9464", "[::1]:9464" or "unix:/path".
  const std::string& address() const { return address_; }
  uint64_t scrapes() const { return scrapes_.load(); }

 private:
  MetricsServer(UniqueFd fd, std::string address, std::string unix_path);
  void Run();
  // The answer to the request `req` (its head, or kMaxRequestBytes of it);
  // `drain`: the rest of the request is to be read before the close.
  std::string Answer(std::string_view req, bool* drain);

  UniqueFd listen_fd_;
  std::string address_;
  std::string unix_path_;                 // removed on destruction when we bound it
  std::pair<dev_t, ino_t> unix_inode_{};  // of the socket file we bound
  std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> scrapes_{0};
  std::thread thread_;
};

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_METRICS_H_
