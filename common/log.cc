// ztier common: logging implementation (see log.h).
#include "common/log.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <string>
#include <string_view>

namespace ztier {
namespace {

// The subsystems ZT_LOG lines name (ZTIER_LOG_SUBSYS selects among them).
constexpr std::array<std::string_view, 7> kSubsystems = {
    "checkpoint", "client", "cpu_adam", "engine", "nvme", "test", "ztierd"};

struct LogConfig {
  LogLevel level = LogLevel::kWarn;
  std::string subsystems;  // empty: all
  std::string bad_level;   // a ZTIER_LOG that is no level (said once, at first use)
  std::string unknown;     // names in ZTIER_LOG_SUBSYS no part of ztier logs as

  LogConfig() {
    if (const char* env = std::getenv("ZTIER_LOG")) {
      if (const std::optional<LogLevel> parsed = ParseLogLevel(env)) {
        level = *parsed;
      } else {
        bad_level = env;
      }
    }
    if (const char* env = std::getenv("ZTIER_LOG_SUBSYS")) {
      subsystems = env;
      std::string_view list(subsystems);
      while (!list.empty()) {
        const size_t comma = list.find(',');
        const std::string_view name = list.substr(0, comma);
        if (std::find(kSubsystems.begin(), kSubsystems.end(), name) == kSubsystems.end()) {
          unknown += std::string(unknown.empty() ? "" : ", ") + "'" + std::string(name) + "'";
        }
        if (comma == std::string_view::npos) break;
        list.remove_prefix(comma + 1);
      }
    }
  }
};

}  // namespace

std::optional<LogLevel> ParseLogLevel(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "error") return LogLevel::kError;
  if (lower == "warn") return LogLevel::kWarn;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "debug") return LogLevel::kDebug;
  return std::nullopt;
}

namespace {

const LogConfig& Config() {
  static const LogConfig config = [] {
    LogConfig c;
    if (!c.bad_level.empty()) {
      const std::string line = "ztier warn log: ZTIER_LOG='" + c.bad_level +
                               "' is not error, warn, info or debug; logging at warn\n";
      [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
    }
    if (!c.unknown.empty()) {  // a typo would hide every line, warnings included
      std::string known;
      for (std::string_view k : kSubsystems) {
        if (k == "test") continue;  // the tests' own, taken but not offered
        known += std::string(known.empty() ? "" : ", ") + std::string(k);
      }
      const std::string line = "ztier warn log: ZTIER_LOG_SUBSYS names " + c.unknown +
                               ", which nothing logs as (the names: " + known + ")\n";
      [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
    }
    return c;
  }();
  return config;
}

constexpr std::string_view LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "error";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kDebug:
      return "debug";
  }
  return "?";
}

}  // namespace

bool LogEnabled(LogLevel level, std::string_view subsys) {
  const LogConfig& c = Config();
  if (static_cast<int>(level) > static_cast<int>(c.level)) return false;
  if (c.subsystems.empty()) return true;
  std::string_view list(c.subsystems);
  while (!list.empty()) {
    const size_t comma = list.find(',');
    if (list.substr(0, comma) == subsys) return true;
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return false;
}

bool LogRate::Allow(std::string* note) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (last_ != std::chrono::steady_clock::time_point{}) {
    const double refill = std::chrono::duration<double>(now - last_).count() /
                          std::chrono::duration<double>(period_).count() * burst_;
    tokens_ = std::min<double>(burst_, tokens_ + refill);
  }
  last_ = now;
  if (tokens_ < 1) {
    ++skipped_;
    return false;
  }
  tokens_ -= 1;
  note->clear();
  if (skipped_ > 0) {
    *note = " (" + std::to_string(skipped_) + " more like it not logged)";
    skipped_ = 0;
  }
  return true;
}

namespace detail {
LogLine::~LogLine() {
  std::string line = "ztier ";
  line += LevelName(level_);
  line += ' ';
  line += subsys_;
  line += ": ";
  line += os_.str();
  line += '\n';
  // One write per line so concurrent lines do not interleave; a failed log
  // write has nowhere to be reported.
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
}
}  // namespace detail

}  // namespace ztier
