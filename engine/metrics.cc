// ztier engine: the Prometheus text writer and the metrics listener (see
// metrics.h).
#include "engine/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <vector>

#include "common/log.h"
#include "common/utf8.h"

namespace ztier::engine {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
constexpr auto kRequestTimeout = std::chrono::seconds(2);
constexpr auto kSendTimeout = std::chrono::seconds(5);
constexpr auto kDrainTimeout = std::chrono::milliseconds(200);
constexpr size_t kMaxDrainBytes = size_t{1} << 20;
constexpr size_t kMaxPending = 64;

std::string Response(std::string_view status, std::string_view content_type, std::string_view body,
                     bool head, std::string_view extra_headers = {}) {
  std::string out = StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                           "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                           "Connection: close\r\n\r\n");
  if (!head) out += body;
  return out;
}

// What kind of socket `fd` is and where it listens.
Result<std::string> DescribeListener(int fd) {
  int type = 0, listening = 0;
  socklen_t len = sizeof(type);
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) {
    return PosixError("the metrics socket: getsockopt(SO_TYPE)", errno);
  }
  len = sizeof(listening);
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0) {
    return PosixError("the metrics socket: getsockopt(SO_ACCEPTCONN)", errno);
  }
  if (type != SOCK_STREAM || listening == 0) {
    return Status::InvalidArgument(
        "the metrics socket is not a listening stream socket (ListenStream= in "
        "ztierd-metrics.socket)");
  }
  sockaddr_storage ss{};
  len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
    return PosixError("the metrics socket: getsockname", errno);
  }
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return StrCat(host, ":", ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return StrCat("[", host, "]:", ntohs(a->sin6_port));
  }
  if (ss.ss_family == AF_UNIX) {
    const auto* a = reinterpret_cast<const sockaddr_un*>(&ss);
    return StrCat("unix:", std::string(a->sun_path, strnlen(a->sun_path, sizeof(a->sun_path))));
  }
  return Status::InvalidArgument(StrCat("the metrics socket's family ", ss.ss_family));
}

}  // namespace

// ------------------------------------------------------------ the text

std::string EscapeLabelValue(std::string_view raw) {
  // The format is UTF-8: a byte that is not (a swap path's, say) would make
  // every scrape unparseable.
  const std::string value = PrintableUtf8(raw);
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) < 9.007199254740992e15) {
    return StrCat(static_cast<int64_t>(value));
  }
  // The shortest rendering that reads back as the same double.
  char buf[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  return buf;
}

void PrometheusText::Family(std::string_view name, std::string_view type, std::string_view help) {
  out_ += StrCat("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void PrometheusText::Line(std::string_view name, std::string_view suffix, const Labels& labels,
                          std::string_view extra_label, std::string_view extra_value,
                          double value) {
  out_ += name;
  out_ += suffix;
  if (!labels.empty() || !extra_label.empty()) {
    out_ += '{';
    bool first = true;
    for (const auto& [k, v] : labels) {
      if (!first) out_ += ',';
      first = false;
      out_ += StrCat(k, "=\"", EscapeLabelValue(v), "\"");
    }
    if (!extra_label.empty()) {
      if (!first) out_ += ',';
      out_ += StrCat(extra_label, "=\"", extra_value, "\"");
    }
    out_ += '}';
  }
  out_ += ' ';
  out_ += FormatMetricValue(value);
  out_ += '\n';
}

void PrometheusText::Sample(std::string_view name, const Labels& labels, double value) {
  Line(name, "", labels, "", "", value);
}

void PrometheusText::Histogram(std::string_view name, const Labels& labels,
                               std::span<const double> bounds, std::span<const uint64_t> counts,
                               double sum) {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds.size(); ++i) {
    cumulative += i < counts.size() ? counts[i] : 0;
    Line(name, "_bucket", labels, "le", FormatMetricValue(bounds[i]),
         static_cast<double>(cumulative));
  }
  if (counts.size() > bounds.size()) cumulative += counts[bounds.size()];
  Line(name, "_bucket", labels, "le", "+Inf", static_cast<double>(cumulative));
  Line(name, "_sum", labels, "", "", sum);
  Line(name, "_count", labels, "", "", static_cast<double>(cumulative));
}

// ------------------------------------------------------------ the listener

MetricsServer::MetricsServer(UniqueFd fd, std::string address, std::string unix_path)
    : listen_fd_(std::move(fd)), address_(std::move(address)), unix_path_(std::move(unix_path)) {
  // Non-blocking: Run accepts every connection waiting, until EAGAIN.
  const int flags = ::fcntl(listen_fd_.get(), F_GETFL);
  if (flags >= 0) (void)::fcntl(listen_fd_.get(), F_SETFL, flags | O_NONBLOCK);
}

MetricsServer::~MetricsServer() {
  Stop();
  // The socket file, if it is still the one this server bound (another
  // server may have replaced it since).
  struct stat st {};
  if (!unix_path_.empty() && ::lstat(unix_path_.c_str(), &st) == 0 &&
      std::pair(st.st_dev, st.st_ino) == unix_inode_) {
    ::unlink(unix_path_.c_str());
  }
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Listen(std::string_view address) {
  const auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(
        StrCat("metrics address '", address, "': ", why,
               " (HOST:PORT, e.g. 127.0.0.1:9464 or [::1]:9464, or unix:PATH)"));
  };
  if (address.starts_with("unix:")) {
    const std::string path(address.substr(5));
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    if (path.empty() || path.size() >= sizeof(sa.sun_path)) {
      return bad(StrCat("a Unix socket's path takes 1 to ", sizeof(sa.sun_path) - 1,
                        " bytes, this one ", path.size()));
    }
    std::memcpy(sa.sun_path, path.data(), path.size());
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return PosixError("socket(AF_UNIX) for the metrics", errno);
    // A socket file a previous run left (nobody listens on it: connect
    // says ECONNREFUSED) is replaced; one that a live server answers on,
    // or any socket connect says something else of (a ztierd's control
    // socket, of another type, said EPROTOTYPE: it was taken over), is not.
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) return bad("something other than a socket is there");
      // Non-blocking: a live server with a full backlog says EAGAIN at once.
      UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!probe.valid()) return PosixError("socket(AF_UNIX) for the metrics probe", errno);
      const int rc = ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
      const int err = rc == 0 ? 0 : errno;
      if (err == EPROTOTYPE) {
        return Status(StatusCode::kUnavailable,
                      StrCat("metrics socket ", path,
                             " is in use: a socket of another kind is live there (a ztierd's "
                             "control socket?); give the metrics a path of their own"));
      }
      if (err != ECONNREFUSED && err != ENOENT) {  // (ENOENT: gone since the lstat)
        return Status(StatusCode::kUnavailable,
                      StrCat("metrics socket ", path, " is in use: a server (another ztierd?) ",
                             err == 0 || err == EAGAIN
                                 ? "answers there"
                                 : StrCat("is there (connect: ", std::strerror(err), ")")));
      }
      ::unlink(path.c_str());
    }
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) {
      return PosixError(StrCat("bind the metrics socket ", path), errno);
    }
    if (::chmod(path.c_str(), 0660) != 0 || ::listen(fd.get(), 128) != 0 ||
        ::lstat(path.c_str(), &st) != 0) {
      const int err = errno;
      ::unlink(path.c_str());
      return PosixError(StrCat("listen on the metrics socket ", path), err);
    }
    auto server = std::unique_ptr<MetricsServer>(
        new MetricsServer(std::move(fd), StrCat("unix:", path), path));
    server->unix_inode_ = {st.st_dev, st.st_ino};
    return server;
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) return bad("no port");
  if (colon == 0) return bad("no host before the port");
  std::string_view host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  const std::string_view port_text = address.substr(colon + 1);
  unsigned port = 0;
  auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || ptr != port_text.data() + port_text.size() || port > 65535) {
    return bad("the port is not a number in 0..65535");
  }
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family = AF_INET;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    family = AF_INET6;
    const std::string h(host.substr(1, host.size() - 2));
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET6, h.c_str(), &a->sin6_addr) != 1) return bad("not an IPv6 address");
    len = sizeof(sockaddr_in6);
  } else {
    const std::string h(host);
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET, h.c_str(), &a->sin_addr) != 1) return bad("not an IPv4 address");
    len = sizeof(sockaddr_in);
  }
  UniqueFd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return PosixError("socket() for the metrics", errno);
  const int one = 1;
  (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&ss), len) != 0) {
    return PosixError(StrCat("bind the metrics listener to ", address), errno);
  }
  if (::listen(fd.get(), 128) != 0) {
    return PosixError(StrCat("listen on ", address, " for the metrics"), errno);
  }
  ZT_ASSIGN_OR_RETURN(std::string bound, DescribeListener(fd.get()));
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(fd), std::move(bound), ""));
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::FromFd(int fd) {
  UniqueFd owned(fd);
  ZT_ASSIGN_OR_RETURN(std::string address, DescribeListener(owned.get()));
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(owned), std::move(address), ""));
}

void MetricsServer::Start(std::function<std::string()> render) {
  render_ = std::move(render);
  thread_ = std::thread([this] { Run(); });
}

void MetricsServer::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void MetricsServer::Run() {
  // Every connection is served side by side, none with a blocking call: its
  // request head read as it comes (kRequestTimeout for all of it), its
  // answer written as the client takes it (kSendTimeout), and after a 431
  // what it still sends read and dropped (kDrainTimeout) so that the close
  // does not reset the answer away. A client that says nothing, trickles
  // or reads nothing holds up nobody else's scrape. At most kMaxPending at
  // once: past it the oldest still reading its head goes.
  enum class Phase { kReading, kWriting, kDraining };
  struct Conn {
    UniqueFd fd;
    Phase phase = Phase::kReading;
    std::string req;  // the head so far
    std::string out;  // the answer; `sent` of it gone
    size_t sent = 0;
    bool drain = false;  // after the answer: read the rest, then close
    size_t drained = 0;
    std::chrono::steady_clock::time_point deadline;
  };
  std::deque<Conn> conns;
  std::vector<pollfd> pfds;
  // Moves `c` on as far as it goes without waiting; false once it is done
  // (closed with it).
  const auto advance = [&](Conn& c, short revents, std::chrono::steady_clock::time_point now) {
    if (c.phase == Phase::kReading && (revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      char buf[2048];
      const ssize_t n = ::recv(
          c.fd.get(), buf, std::min(sizeof(buf), kMaxRequestBytes - c.req.size()), MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) return now < c.deadline;
      if (n <= 0) return false;  // gone
      c.req.append(buf, static_cast<size_t>(n));
      const bool complete =
          c.req.find("\r\n\r\n") != std::string::npos || c.req.find("\n\n") != std::string::npos;
      if (!complete && c.req.size() < kMaxRequestBytes) return now < c.deadline;
      c.out = Answer(c.req, &c.drain);
      c.phase = Phase::kWriting;
      c.deadline = now + kSendTimeout;
      revents = POLLOUT;
    }
    if (c.phase == Phase::kWriting && (revents & (POLLOUT | POLLHUP | POLLERR)) != 0) {
      while (c.sent < c.out.size()) {
        const ssize_t n = ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent,
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return now < c.deadline;
        if (n <= 0) {
          ZT_LOG(kDebug, "ztierd") << "metrics: a client went before its answer was sent";
          return false;
        }
        c.sent += static_cast<size_t>(n);
      }
      if (!c.drain) return false;  // answered: closed
      ::shutdown(c.fd.get(), SHUT_WR);
      c.phase = Phase::kDraining;
      c.deadline = now + kDrainTimeout;
      revents = POLLIN;
    }
    if (c.phase == Phase::kDraining && (revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      char sink[4096];
      while (c.drained < kMaxDrainBytes) {
        const ssize_t n = ::recv(c.fd.get(), sink, sizeof(sink), MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return now < c.deadline;
        if (n <= 0) return false;
        c.drained += static_cast<size_t>(n);
      }
      return false;
    }
    return now < c.deadline;
  };
  while (!stop_.load()) {
    pfds.assign(1, pollfd{.fd = listen_fd_.get(), .events = POLLIN, .revents = 0});
    for (const Conn& c : conns) {
      pfds.push_back({.fd = c.fd.get(),
                      .events = static_cast<short>(c.phase == Phase::kWriting ? POLLOUT : POLLIN),
                      .revents = 0});
    }
    if (::poll(pfds.data(), pfds.size(), 200) < 0 && errno != EINTR) {
      ZT_LOG(kWarn, "ztierd") << "metrics: poll: " << std::strerror(errno);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    std::deque<Conn> still;
    for (size_t i = 0; i < conns.size(); ++i) {
      if (advance(conns[i], pfds[i + 1].revents, now)) still.push_back(std::move(conns[i]));
    }
    conns.swap(still);
    if ((pfds[0].revents & POLLIN) == 0) continue;
    // Every connection waiting (one a round left a burst of scrapers in
    // the backlog, retrying their SYNs a second later).
    for (size_t taken = 0; taken < kMaxPending; ++taken) {
      const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == ECONNABORTED || errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          ZT_LOG(kWarn, "ztierd") << "metrics: accept: " << std::strerror(errno);
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        break;
      }
      if (conns.size() >= kMaxPending) {
        auto oldest = std::find_if(conns.begin(), conns.end(),
                                   [](const Conn& c) { return c.phase == Phase::kReading; });
        conns.erase(oldest != conns.end() ? oldest : conns.begin());
      }
      Conn c;
      c.fd = UniqueFd(fd);
      c.deadline = now + kRequestTimeout;
      conns.push_back(std::move(c));
    }
  }
}

std::string MetricsServer::Answer(std::string_view req, bool* drain) {
  *drain = false;
  if (req.find("\r\n\r\n") == std::string_view::npos &&
      req.find("\n\n") == std::string_view::npos) {
    // The rest of the request is read (briefly, boundedly) before the
    // close: closing with input unread resets the connection, and the
    // client then sees a reset instead of the answer.
    *drain = true;
    return Response("431 Request Header Fields Too Large", "text/plain", "request too large\n",
                    false);
  }
  // "METHOD SP TARGET SP HTTP/x.y"
  const std::string_view line = req.substr(0, req.find_first_of("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || !line.substr(sp2 + 1).starts_with("HTTP/")) {
    return Response("400 Bad Request", "text/plain", "bad request\n", false);
  }
  const std::string_view method = line.substr(0, sp1);
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    return Response("405 Method Not Allowed", "text/plain", "GET /metrics\n", false,
                    "Allow: GET, HEAD\r\n");
  }
  if (target != "/metrics") {
    return Response("404 Not Found", "text/plain", "ztierd serves its metrics at /metrics\n", head);
  }
  const std::string body = render_();
  scrapes_.fetch_add(1);
  return Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", body, head);
}

}  // namespace ztier::engine
