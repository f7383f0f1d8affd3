// ztier-bench helpers (see bench_util.h).
#include "benchmarks/bench_util.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "common/file_util.h"
#include "common/numbers.h"
#include "common/unique_fd.h"
#include "common/utf8.h"

namespace ztier::bench {

// A count takes the size grammar (64K elements), and is called a count.
Result<uint64_t> ParseCount(std::string_view text) {
  Result<uint64_t> n = ParseSize(text);
  if (n.ok()) return n;
  if (n.status().message().find("too large") != std::string_view::npos) {
    return Status::InvalidArgument(StrCat("count '", text, "' is too large"));
  }
  return Status::InvalidArgument(
      StrCat("'", text, "' is not a count (a whole number, or one with K, M, G or T)"));
}

Result<std::vector<uint64_t>> ParseCountList(std::string_view text) {
  std::vector<uint64_t> out;
  while (!text.empty()) {
    const size_t comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    if (item.empty()) return Status::InvalidArgument("an empty item in a comma-separated list");
    ZT_ASSIGN_OR_RETURN(uint64_t v, ParseCount(item));
    out.push_back(v);
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
    if (text.empty()) return Status::InvalidArgument("an empty item in a comma-separated list");
  }
  if (out.empty()) return Status::InvalidArgument("empty list");
  return out;
}

Result<uint64_t> ArgReader::Number(uint64_t lo, uint64_t hi,
                                   Result<uint64_t> (*parse)(std::string_view)) {
  const std::string option(arg());
  ZT_ASSIGN_OR_RETURN(std::string_view v, Value());
  Result<uint64_t> n = parse(v);
  // Named by its option and range ('-1' was "not a size" of no option),
  // with why it is not a count ("1.5K: want 1..N" did not say).
  const std::string range = hi == UINT64_MAX ? StrCat("at least ", lo) : StrCat(lo, "..", hi);
  if (!n.ok()) {
    return Status::InvalidArgument(
        StrCat(option, " ", v, ": ", n.status().message(), "; want ", range));
  }
  if (*n < lo || *n > hi) return Status::InvalidArgument(StrCat(option, " ", v, ": want ", range));
  return *n;
}

Status ArgReader::Unrecognized() const {
  if (Is("-h") || Is("--help")) return Status::Aborted("help");
  return Status::InvalidArgument(StrCat("unknown option '", arg(), "'"));
}

int UsageExit(const Status& s, const char* subcommand, const char* usage) {
  if (s.code() == StatusCode::kAborted) {
    std::fputs(usage, stdout);
    return 0;
  }
  std::fprintf(stderr, "ztier-bench %s: %s\n%s", subcommand, std::string(s.message()).c_str(),
               usage);
  return 2;
}

int FailExit(const Status& s, const char* subcommand) {
  std::fprintf(stderr, "ztier-bench %s: %s\n", subcommand, s.ToString().c_str());
  return 1;
}

Status CheckFitsInMemory(double bytes, std::string_view what) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return Status::Ok();  // unknown: let the allocation say
  const uint64_t physical = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
  if (bytes <= 0.9 * static_cast<double>(physical)) return Status::Ok();
  char needed[32];
  std::snprintf(needed, sizeof(needed), "%.0f", bytes);
  return Status::InvalidArgument(StrCat(what, " needs ", needed,
                                        " bytes of memory; this machine has ", physical,
                                        " (choose a smaller size)"));
}

Status CheckFitsOnDisk(const std::vector<std::string>& paths, uint64_t bytes_per_path,
                       std::string_view what) {
  std::map<dev_t, std::pair<std::string, uint64_t>> need;  // by filesystem: a path, the bytes
  for (const std::string& p : paths) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) continue;
    auto [it, fresh] = need.try_emplace(st.st_dev, p, 0);
    it->second.second += bytes_per_path;
  }
  for (const auto& [dev, entry] : need) {
    const auto& [path, bytes] = entry;
    struct statvfs vfs {};
    if (::statvfs(path.c_str(), &vfs) != 0) continue;
    const uint64_t free = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (bytes > free) {
      return Status::ResourceExhausted(StrCat(what, " needs ", bytes,
                                              " bytes on the filesystem of ", path, ", which has ",
                                              free, " free (choose a smaller size)"));
    }
  }
  return Status::Ok();
}

void NoteRatioPastOne(double ratio, std::string_view where, std::string_view meaning,
                      std::string_view advice) {
  if (!(ratio > 1.05)) return;
  std::printf(
      "note: a ratio past 1 (%.2f%s%.*s) means %.*s, so it bounds nothing in that case; "
      "%.*s\n",
      ratio, where.empty() ? "" : " ", static_cast<int>(where.size()), where.data(),
      static_cast<int>(meaning.size()), meaning.data(), static_cast<int>(advice.size()),
      advice.data());
}

std::string FormatCount(uint64_t n) {
  if (n != 0 && n % (uint64_t{1} << 30) == 0) return StrCat(n >> 30, "G");
  if (n != 0 && n % (uint64_t{1} << 20) == 0) return StrCat(n >> 20, "M");
  if (n != 0 && n % (uint64_t{1} << 10) == 0) return StrCat(n >> 10, "K");
  return StrCat(n);
}

void JsonObject::Key(std::string_view key) {
  if (!body_.empty()) body_ += ",";
  body_ += JsonQuote(key);  // keys come from outside too (the environment's names)
  body_ += ":";
}

std::string JsonNumber(double value) {
  if (!std::isfinite(value)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", value);
  return buf;
}

JsonObject& JsonObject::Add(std::string_view key, double value) {
  Key(key);
  body_ += JsonNumber(value);
  return *this;
}

JsonObject& JsonObject::Add(std::string_view key, int64_t value) {
  Key(key);
  body_ += std::to_string(value);
  return *this;
}

std::string JsonQuote(std::string_view s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      // A byte that is not UTF-8 (a path's) as U+FFFD: passed through, the
      // output was no JSON a parser takes.
      const Utf8Char u = DecodeUtf8(s, i);
      if (u.length == 0) {
        out += "\\ufffd";
        ++i;
      } else {
        out.append(s.substr(i, u.length));
        i += u.length;
      }
      continue;
    }
    ++i;
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
      continue;
    }
    out += c;
  }
  return out + "\"";
}

JsonObject& JsonObject::Add(std::string_view key, std::string_view value) {
  Key(key);
  body_ += JsonQuote(value);
  return *this;
}

JsonObject& JsonObject::Add(std::string_view key, bool value) {
  Key(key);
  body_ += value ? "true" : "false";
  return *this;
}

JsonObject& JsonObject::AddRaw(std::string_view key, std::string_view json) {
  Key(key);
  body_ += json;
  return *this;
}

std::string JsonArray(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ",";
    out += items[i];
  }
  return out + "]";
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  // Rank ceil(q n), counted from 1 (p99 of 100 samples is the 99th, not the
  // largest); the slack keeps 0.99 * 100 from rounding up past 99.
  const double rank = std::ceil(static_cast<double>(v.size()) * q - 1e-9);
  return v[std::clamp<size_t>(static_cast<size_t>(std::max(rank, 1.0)) - 1, 0, v.size() - 1)];
}

Status CheckBenchDirectory(const std::string& path, std::string_view flag, bool is_default,
                           std::string_view advice) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return Status::Ok();
  const std::string named =
      is_default ? StrCat("the default ", flag, " ./", path) : StrCat(flag, " ", path);
  if (std::filesystem::exists(std::filesystem::symlink_status(path, ec))) {
    return Status::FailedPrecondition(StrCat(
        named, " is not a directory (", is_default ? "remove what is there, or give " : "give ",
        flag, " a directory on the drive to test)"));
  }
  return Status::NotFound(StrCat(named, " is not an existing directory", advice));
}

Status CheckOnADrive(const std::string& path, std::string_view flag) {
  if (const std::string_view memory = MemoryFilesystemOf(path); !memory.empty()) {
    return Status::InvalidArgument(
        StrCat(flag, " ", path, " is on ", memory,
               ", which is memory: its figures would be the RAM's, not a drive's (give a "
               "directory on the drive to test)"));
  }
  return Status::Ok();
}

DefaultDir::DefaultDir(std::string path) : path_(std::move(path)) {
  std::error_code ec;
  if (!std::filesystem::exists(path_, ec)) made_ = std::filesystem::create_directories(path_, ec);
}

DefaultDir::~DefaultDir() {
  std::error_code ec;
  if (made_) std::filesystem::remove(path_, ec);  // only if empty
}

StopSignals::StopSignals() {
  sigemptyset(&stops_);
  // SIGPIPE too: a reader of the output gone (`| head -1`) killed the
  // subcommand at its next line, leaving its files.
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaddset(&stops_, sig);
  pthread_sigmask(SIG_BLOCK, &stops_, &before_);
}

StopSignals::~StopSignals() {
  // A stop that came and was handled is not raised again as the mask lifts.
  const timespec none{};
  while (::sigtimedwait(&stops_, nullptr, &none) > 0) {
  }
  pthread_sigmask(SIG_SETMASK, &before_, nullptr);
}

int StopSignals::Stopped() {
  const timespec none{};
  for (int sig; (sig = ::sigtimedwait(&stops_, nullptr, &none)) > 0;) {
    if (stopped_ == 0) stopped_ = sig;
  }
  return stopped_;
}

Status StopSignals::Error(std::string_view what) const {
  return Status::Aborted(StrCat("stopped by ", strsignal(stopped_), " (", what, ")"));
}

Result<int> StopSignals::Run(const std::vector<std::string>& argv, const std::string& out,
                             const std::string& err) {
  if (Stopped() != 0) return Error(StrCat(argv[0], " not started"));
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setsigmask(&attr, &before_);  // its signals as this program's were
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETPGROUP);
  // The output files are opened here, not by the spawn: a directory that
  // refuses them is said as such, not as a program that could not start.
  const auto open_output = [](const std::string& path) -> Result<UniqueFd> {
    const int fd = path.empty()
                       ? ::open("/dev/null", O_WRONLY | O_CLOEXEC)
                       : ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
      return PosixError(StrCat("cannot write ", path.empty() ? "/dev/null" : path), errno);
    return UniqueFd(fd);
  };
  ZT_ASSIGN_OR_RETURN(UniqueFd out_fd, open_output(out));
  UniqueFd err_fd;
  if (err.empty() || err != out) {
    ZT_ASSIGN_OR_RETURN(err_fd, open_output(err));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_fd.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_fd.valid() ? err_fd.get() : out_fd.get(),
                                   STDERR_FILENO);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return Status::IoError(StrCat("starting ", argv[0], ": ", std::strerror(rc)));
  int status = 0;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) return PosixError(StrCat("wait for ", argv[0]), errno);
    const timespec tick{.tv_sec = 0, .tv_nsec = 100'000'000};
    const int sig = ::sigtimedwait(&stops_, nullptr, &tick);
    if (sig > 0) {
      // (The program writes to files, not to this one's gone reader: it
      // is told to stop as a terminal's stop would.)
      ::kill(pid, sig == SIGPIPE ? SIGTERM : sig);
      if (stopped_ == 0) stopped_ = sig;
    }
  }
  return status;
}

LinePacer::LinePacer(std::FILE* out, double every_seconds)
    : terminal_(isatty(fileno(out)) == 1), every_seconds_(every_seconds) {}

bool LinePacer::Due(int64_t i, int64_t count) {
  const double now = NowSeconds();
  if (terminal_ || i == 0 || i + 1 >= count || now - last_printed_ >= every_seconds_) {
    last_printed_ = now;
    return true;
  }
  ++held_back_;
  return false;
}

}  // namespace ztier::bench
