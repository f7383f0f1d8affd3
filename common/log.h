// ztier common: logging by subsystem.
//
// ZTIER_LOG=error|warn|info|debug sets the level (default warn);
// ZTIER_LOG_SUBSYS=cpu_adam,nvme,... restricts output to those subsystems
// (default all). Subsystems are named after the folders. Lines go to stderr
// (journald picks them up under systemd) as "ztier <level> <subsys>: message".
//
// Usage: ZT_LOG(kInfo, "cpu_adam") << "arena on NUMA node " << node;
// The stream is only evaluated when the line is enabled. Thread-safe: each
// line is written with one write call.
#ifndef ZTIER_COMMON_LOG_H_
#define ZTIER_COMMON_LOG_H_

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace ztier {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// True if a line at `level` for `subsys` would be printed.
bool LogEnabled(LogLevel level, std::string_view subsys);
// The level ZTIER_LOG names ("error", "warn", "info", "debug", in any
// case); nullopt for anything else.
std::optional<LogLevel> ParseLogLevel(std::string_view name);

// A budget for a line that others can make a process repeat at will (a
// connection closed, a connection refused): `burst` lines at once, then
// `burst` a `period`; the lines over it are counted, and said with the next
// one logged. So a flood neither fills the log (nor journald's rate limit,
// which would drop the lines that matter) nor goes unseen. Thread-safe.
class LogRate {
 public:
  LogRate(int burst, std::chrono::steady_clock::duration period)
      : burst_(burst), period_(period), tokens_(burst) {}
  // Whether to log a line now; then *note is what to append to it ("" or
  // " (N more like it not logged)").
  bool Allow(std::string* note);

 private:
  const int burst_;
  const std::chrono::steady_clock::duration period_;
  std::mutex mu_;
  double tokens_;
  std::chrono::steady_clock::time_point last_{};
  uint64_t skipped_ = 0;
};

namespace detail {
class LogLine {
 public:
  LogLine(LogLevel level, std::string_view subsys) : level_(level), subsys_(subsys) {}
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  ~LogLine();
  std::ostream& stream() { return os_; }

 private:
  LogLevel level_;
  std::string_view subsys_;
  std::ostringstream os_;
};
}  // namespace detail
}  // namespace ztier

#define ZT_LOG(level, subsys)                                   \
  if (!::ztier::LogEnabled(::ztier::LogLevel::level, subsys)) { \
  } else                                                        \
    ::ztier::detail::LogLine(::ztier::LogLevel::level, subsys).stream()

#endif  // ZTIER_COMMON_LOG_H_
