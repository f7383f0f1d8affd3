// ztier-bench: small helpers shared by the subcommands — size and argument
// parsing, exit codes, a flat JSON object writer, a monotonic timer, and the
// pacing of per-iteration lines.
// Not thread-safe; used from the benchmark's main thread only.
#ifndef ZTIER_BENCHMARKS_BENCH_UTIL_H_
#define ZTIER_BENCHMARKS_BENCH_UTIL_H_

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/numbers.h"
#include "common/status.h"

namespace ztier::bench {

// "4096", "16M", "1G", "64Ki" -> count: common/numbers.h's ParseSize (K, M,
// G, T are powers of 1024).
Result<uint64_t> ParseCount(std::string_view text);

// Comma-separated list of counts: "16M,64M".
Result<std::vector<uint64_t>> ParseCountList(std::string_view text);

// Exit code for a subcommand whose arguments did not parse: prints `usage`
// to stdout and returns 0 for --help (Aborted "help"), else prints the error
// and usage to stderr and returns 2.
int UsageExit(const Status& s, const char* subcommand, const char* usage);

// Exit code for a subcommand that failed while running: prints
// "ztier-bench <subcommand>: <status>" to stderr and returns 1.
int FailExit(const Status& s, const char* subcommand);

// "64M" style rendering for counts that are multiples of 1024.
std::string FormatCount(uint64_t n);
// A ratio to a limit past 1 (by more than 5%, noise aside) says the limit
// measured beside it was no limit in that case: printed as a note, "note:
// a ratio past 1 (<ratio> <where>) means <meaning>, so it bounds nothing in
// that case; <advice>". Nothing for a ratio up to 1.05.
void NoteRatioPastOne(double ratio, std::string_view where, std::string_view meaning,
                      std::string_view advice);

// InvalidArgument naming `what` and both figures when `bytes` of memory
// would pass 90% of this machine's physical memory: said before allocating,
// so a size meant for a bigger machine is a clear error here, not a run that
// the kernel's OOM killer ends (taking others' memory meanwhile). A double,
// so a product of sizes past 2^64 is still counted, not wrapped.
Status CheckFitsInMemory(double bytes, std::string_view what);

// ResourceExhausted naming `what`, the filesystem's path and both figures
// when `bytes_per_path` on each of `paths` (those on one filesystem added
// up) would not fit the space free there: said before a swap file grows,
// so a size meant for bigger drives does not fill this machine's disk
// first. A path that cannot be asked passes (the writes will say).
Status CheckFitsOnDisk(const std::vector<std::string>& paths, uint64_t bytes_per_path,
                       std::string_view what);

// OK when `path`, given as `flag` (or its default, `is_default`), is a
// directory; else NotFound or FailedPrecondition saying which: missing, or
// something else there (a file in the default's place was said to be a
// --path not given). `advice` ends a missing one's message.
Status CheckBenchDirectory(const std::string& path, std::string_view flag, bool is_default,
                           std::string_view advice);

// InvalidArgument when `path` (given as `flag`) is on a filesystem in
// memory (tmpfs, ramfs), whose figures would be the RAM's, not a drive's.
Status CheckOnADrive(const std::string& path, std::string_view flag);

// A subcommand's default scratch directory: made when missing, and
// removed when this goes if it made it and it is empty, however the run
// ended (an empty ./ztier-bench-swap was left behind after each run).
class DefaultDir {
 public:
  explicit DefaultDir(std::string path);
  ~DefaultDir();
  DefaultDir(const DefaultDir&) = delete;
  DefaultDir& operator=(const DefaultDir&) = delete;

 private:
  std::string path_;
  bool made_ = false;
};

// The stop signals (SIGINT, SIGTERM, SIGHUP; SIGPIPE, a writer's own, when
// the reader of its output is gone) of a subcommand that makes
// files or runs programs: while a StopSignals lives they are blocked in the
// thread that made it, and in the threads it starts after (make it before
// any), and only recorded. The subcommand asks Stopped() between its
// steps, removes what it made and exits with ExitCode(); a program it runs
// through Run() gets each stop passed on, and is waited for.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first stop signal that came, 0 while none has (takes any pending).
  int Stopped();
  // 128 + the signal: the exit code of a stopped program.
  int ExitCode() const { return 128 + stopped_; }
  // Aborted: "stopped by <signal> (<what>)".
  Status Error(std::string_view what) const;

  // Runs argv (argv[0] looked up in PATH when it has no '/') in a process
  // group of its own (a terminal's Ctrl-C reaches only this program, which
  // passes it on once), standard output to `out` and standard error to
  // `err` (the same path: both to one file; empty: /dev/null), and waits
  // for it to end. Returns its wait status; an error if it could not start.
  Result<int> Run(const std::vector<std::string>& argv, const std::string& out,
                  const std::string& err);

 private:
  sigset_t stops_{}, before_{};
  int stopped_ = 0;
};

// Walks a subcommand's arguments: while (args.Next()) { if (args.Is("--x"))
// ZT_ASSIGN_OR_RETURN(v, args.Value()); ... }
class ArgReader {
 public:
  ArgReader(int argc, char** argv) : argc_(argc), argv_(argv) {}
  bool Next() { return ++i_ < argc_; }
  std::string_view arg() const { return argv_[i_]; }
  bool Is(std::string_view name) const { return arg() == name; }
  // The value after the current option; InvalidArgument if there is none.
  Result<std::string_view> Value() {
    if (i_ + 1 >= argc_) return Status::InvalidArgument(StrCat(arg(), " needs a value"));
    return std::string_view(argv_[++i_]);
  }
  // The value after the current option as a count (ParseCount) in [lo, hi].
  Result<uint64_t> Count(uint64_t lo, uint64_t hi) { return Number(lo, hi, ParseCount); }
  // The same as a size in bytes (ParseSize: said to be no size, not no count).
  Result<uint64_t> Size(uint64_t lo, uint64_t hi) { return Number(lo, hi, ParseSize); }
  // Count(lo, hi) or Size(lo, hi) stored in an integer option; [lo, hi]
  // must fit in T.
  template <typename T>
  Status CountInto(T* out, uint64_t lo, uint64_t hi) {
    return Store(out, Count(lo, hi));
  }
  template <typename T>
  Status SizeInto(T* out, uint64_t lo, uint64_t hi) {
    return Store(out, Size(lo, hi));
  }
  // The value after the current option as the value its name is paired with
  // in `choices`; InvalidArgument listing the names if it is none of them.
  template <typename T>
  Result<T> Choice(std::initializer_list<std::pair<std::string_view, T>> choices) {
    const std::string option(arg());
    ZT_ASSIGN_OR_RETURN(const std::string_view v, Value());
    std::string names;
    size_t i = 0;
    for (const auto& [name, value] : choices) {
      if (v == name) return value;
      names += i == 0 ? "" : (i + 1 == choices.size() ? " or " : ", ");
      names += name;
      ++i;
    }
    return Status::InvalidArgument(StrCat(option, ": '", v, "' is not ", names));
  }
  // For an option no branch took: Aborted "help" for -h and --help (see
  // UsageExit), else InvalidArgument naming the option.
  Status Unrecognized() const;

 private:
  Result<uint64_t> Number(uint64_t lo, uint64_t hi, Result<uint64_t> (*parse)(std::string_view));
  template <typename T>
  static Status Store(T* out, const Result<uint64_t>& n) {
    if (!n.ok()) return n.status();
    *out = static_cast<T>(*n);
    return Status::Ok();
  }
  int argc_;
  char** argv_;
  int i_ = -1;
};

// Builds one JSON object; values are numbers, strings, bools or raw JSON.
class JsonObject {
 public:
  JsonObject& Add(std::string_view key, double value);
  JsonObject& Add(std::string_view key, int64_t value);
  JsonObject& Add(std::string_view key, uint64_t value) {
    return Add(key, static_cast<int64_t>(value));
  }
  JsonObject& Add(std::string_view key, int value) { return Add(key, static_cast<int64_t>(value)); }
  JsonObject& Add(std::string_view key, std::string_view value);
  JsonObject& Add(std::string_view key, const char* value) {
    return Add(key, std::string_view(value));
  }
  JsonObject& Add(std::string_view key, bool value);
  JsonObject& AddRaw(std::string_view key, std::string_view json);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void Key(std::string_view key);
  std::string body_;
};

// A JSON string literal with quotes and escapes.
std::string JsonQuote(std::string_view s);
// A JSON number, 6 significant digits; null for NaN and infinities.
std::string JsonNumber(double value);

// JSON array of already-rendered values.
std::string JsonArray(const std::vector<std::string>& items);

// The median of `v` (the mean of the middle two for an even count); v not
// empty.
double Median(std::vector<double> v);
// The `q` quantile of `v` (0 < q < 1) by nearest rank: the smallest sample
// that at least q of them are at or below; v not empty.
double Quantile(std::vector<double> v, double q);

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Which of a loop's per-iteration lines to print on `out`: every one when
// `out` is a terminal; otherwise (a log file, CI) the first and the last,
// and in between at most one every `every_seconds`, so that a long run
// leaves a readable log.
class LinePacer {
 public:
  explicit LinePacer(std::FILE* out, double every_seconds = 5.0);
  // Whether to print the line of iteration `i` of `count` (0-based).
  bool Due(int64_t i, int64_t count);
  // Lines Due() has held back so far.
  int64_t held_back() const { return held_back_; }
  bool terminal() const { return terminal_; }

 private:
  bool terminal_;
  double every_seconds_;
  double last_printed_ = 0;
  int64_t held_back_ = 0;
};

}  // namespace ztier::bench

#endif  // ZTIER_BENCHMARKS_BENCH_UTIL_H_
