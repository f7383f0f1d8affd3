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

#include <sstream>
#include <string_view>

namespace ztier {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// True if a line at `level` for `subsys` would be printed.
bool LogEnabled(LogLevel level, std::string_view subsys);

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
