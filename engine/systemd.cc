// ztier engine: sd_notify, the watchdog interval and socket activation,
// spoken directly (see systemd.h).
#include "engine/systemd.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>

namespace ztier::engine::systemd {
namespace {

constexpr int kListenFdsStart = 3;  // SD_LISTEN_FDS_START

// A non-negative decimal number, the whole string.
std::optional<uint64_t> ParseUnsigned(std::string_view s) {
  uint64_t v = 0;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || p != end) return std::nullopt;
  return v;
}

std::string_view Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string_view() : std::string_view(v);
}

}  // namespace

Result<Notifier> Notifier::FromEnvironment() {
  const std::string_view address = Env("NOTIFY_SOCKET");
  if (address.empty()) return Notifier();
  return ForAddress(std::string(address));
}

Result<Notifier> Notifier::ForAddress(const std::string& address) {
  sockaddr_un addr{};
  if (address.size() < 2 || (address[0] != '/' && address[0] != '@') ||
      address.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(StrCat("NOTIFY_SOCKET '", address,
                                          "': not an absolute path or an @abstract name of at "
                                          "most ",
                                          sizeof(addr.sun_path) - 1, " bytes"));
  }
  Notifier n;
  n.fd_.reset(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!n.fd_.valid()) return PosixError("socket(AF_UNIX, SOCK_DGRAM) for sd_notify", errno);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, address.data(), address.size());
  if (address[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size() +
                                               (address[0] == '@' ? 0 : 1));
  if (::connect(n.fd_.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    const int err = errno;
    return Status(StatusCode::kUnavailable,
                  StrCat("NOTIFY_SOCKET ", address, ": ", std::strerror(err)), err);
  }
  n.address_ = address;
  return n;
}

Status Notifier::Notify(std::string_view state) {
  if (!fd_.valid()) return Status::Ok();
  for (;;) {
    const ssize_t n = ::send(fd_.get(), state.data(), state.size(), MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(state.size())) return Status::Ok();
    if (n < 0 && errno == EINTR) continue;
    const int err = n < 0 ? errno : EMSGSIZE;
    if (err == ECONNREFUSED || err == ENOENT || err == EPIPE) {
      return Status(StatusCode::kUnavailable,
                    StrCat("sd_notify to ", address_, ": the service manager's socket is gone (",
                           std::strerror(err), ")"),
                    err);
    }
    return PosixError(StrCat("sd_notify to ", address_), err);
  }
}

Status Notifier::SetStatus(std::string_view text) {
  std::string line(text.substr(0, 1024));
  for (char& c : line) {
    if (c == '\n') c = ' ';  // one assignment per line
  }
  return Notify("STATUS=" + line);
}

Status Notifier::ExtendTimeout(std::chrono::microseconds more) {
  return Notify(StrCat("EXTEND_TIMEOUT_USEC=", more.count()));
}

Result<std::optional<std::chrono::microseconds>> WatchdogInterval() {
  const std::string_view usec = Env("WATCHDOG_USEC");
  if (usec.empty()) return std::optional<std::chrono::microseconds>();
  const std::string_view pid = Env("WATCHDOG_PID");
  if (!pid.empty()) {
    const std::optional<uint64_t> p = ParseUnsigned(pid);
    if (!p) return Status::InvalidArgument(StrCat("WATCHDOG_PID '", pid, "' is not a pid"));
    if (*p != static_cast<uint64_t>(::getpid())) {
      return std::optional<std::chrono::microseconds>();  // meant for another process
    }
  }
  const std::optional<uint64_t> v = ParseUnsigned(usec);
  if (!v || *v == 0 || *v > (uint64_t{1} << 50)) {
    return Status::InvalidArgument(StrCat("WATCHDOG_USEC '", usec, "' is not a positive number"));
  }
  return std::optional<std::chrono::microseconds>(std::chrono::microseconds(*v));
}

Result<std::vector<ListenFd>> TakeListenFds() {
  const std::string pid_text(Env("LISTEN_PID"));
  const std::string count_text(Env("LISTEN_FDS"));
  const std::string names_text(Env("LISTEN_FDNAMES"));
  ::unsetenv("LISTEN_PID");
  ::unsetenv("LISTEN_FDS");
  ::unsetenv("LISTEN_FDNAMES");
  std::vector<ListenFd> out;
  if (count_text.empty()) return out;
  const std::optional<uint64_t> pid = ParseUnsigned(pid_text);
  if (!pid) return Status::InvalidArgument(StrCat("LISTEN_PID '", pid_text, "' is not a pid"));
  if (*pid != static_cast<uint64_t>(::getpid())) return out;  // for another process
  const std::optional<uint64_t> count = ParseUnsigned(count_text);
  if (!count || *count > 64) {
    return Status::InvalidArgument(StrCat("LISTEN_FDS '", count_text, "' is not a count of fds"));
  }
  std::vector<std::string> names;
  for (size_t start = 0; !names_text.empty() && start <= names_text.size();) {
    const size_t colon = names_text.find(':', start);
    const size_t end = colon == std::string::npos ? names_text.size() : colon;
    names.push_back(names_text.substr(start, end - start));
    start = end + 1;
  }
  Status bad;
  if (!names.empty() && names.size() != *count) {
    bad = Status::InvalidArgument(
        StrCat("LISTEN_FDNAMES names ", names.size(), " fds, LISTEN_FDS ", *count));
  }
  for (uint64_t i = 0; i < *count; ++i) {
    const int fd = kListenFdsStart + static_cast<int>(i);
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags < 0) {
      const int err = errno;
      if (bad.ok()) bad = PosixError(StrCat("LISTEN_FDS: fd ", fd, " was not passed"), err);
      continue;
    }
    ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
    out.push_back({.fd = fd, .name = i < names.size() ? names[i] : "unknown"});
  }
  if (!bad.ok()) {
    for (const ListenFd& l : out) ::close(l.fd);
    return bad;
  }
  return out;
}

}  // namespace ztier::engine::systemd
