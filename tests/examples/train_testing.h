// Test support for the tests that run the ztier-train binary
// (ZTIER_TRAIN_BINARY) as a user would: a child process with its output in a
// file and a deadline, the loss log's columns, and a text corpus that is the
// same on every machine. Header-only; not thread-safe (one test thread).
#ifndef ZTIER_TESTS_EXAMPLES_TRAIN_TESTING_H_
#define ZTIER_TESTS_EXAMPLES_TRAIN_TESTING_H_

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace ztier::testing {

inline std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Splits on whitespace; '' stands for an empty argument.
inline std::vector<std::string> SplitArgs(const std::string& args) {
  std::istringstream in(args);
  std::vector<std::string> out;
  for (std::string a; in >> a;) out.push_back(a == "''" ? "" : a);
  return out;
}

// A ztier-train process (--no-progress added) with its output in a file.
class TrainProcess {
 public:
  TrainProcess(const std::string& args, const std::string& log) : log_(log) {
    std::vector<std::string> argv_s = {ZTIER_TRAIN_BINARY, "--no-progress"};
    for (std::string& a : SplitArgs(args)) argv_s.push_back(std::move(a));
    std::vector<char*> argv;
    for (std::string& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  TrainProcess(const TrainProcess&) = delete;
  TrainProcess& operator=(const TrainProcess&) = delete;
  ~TrainProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // The exit code, or 128 + the signal that killed it. A run still going
  // after `limit` has hung: it is killed and the test fails saying so,
  // rather than at ctest's timeout.
  int Wait(std::chrono::seconds limit = std::chrono::minutes(5)) {
    if (reaped_) return status_;
    int st = 0;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (::waitpid(pid_, &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        reaped_ = true;
        ADD_FAILURE() << "ztier-train ran past " << limit.count()
                      << " s and was killed; its output:\n"
                      << output();
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    reaped_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return status_;
  }
  // Non-blocking: the exit code (as Wait) once the process has ended.
  std::optional<int> TryWait() {
    if (reaped_) return status_;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) != pid_) return std::nullopt;
    reaped_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return status_;
  }
  std::string output() const { return Slurp(log_); }

 private:
  int status_ = -1;
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string log_;
};

// Runs ztier-train to the end: {exit code, output}; the output goes to `log`.
inline std::pair<int, std::string> RunTrain(const std::string& args, const std::string& log) {
  TrainProcess p(args, log);
  const int rc = p.Wait();
  return {rc, p.output()};
}

// RunTrain with the waits on the engine bounded (ZTIER_WAIT_TIMEOUT 60 s)
// and the command and its output printed; the exit code.
inline int TrainPrinted(const std::string& args, const std::string& log) {
  ::setenv("ZTIER_WAIT_TIMEOUT", "60", 1);
  const auto [rc, output] = RunTrain(args, log);
  std::printf("$ ztier-train%s\n%s(exit %d)\n", args.c_str(), output.c_str(), rc);
  return rc;
}

// Column `column` (0: step) of every row of a train_log.tsv, as text.
inline std::vector<std::string> LogColumn(const std::string& log, int column) {
  std::istringstream in(Slurp(log));
  std::string line;
  std::getline(in, line);  // header
  std::vector<std::string> out;
  while (std::getline(in, line)) {
    std::istringstream row(line);
    std::string cell;
    for (int c = 0; c <= column && std::getline(row, cell, '\t'); ++c) {
    }
    out.push_back(cell);
  }
  return out;
}

// The loss of every step in a train_log.tsv.
inline std::vector<double> Losses(const std::string& log) {
  std::vector<double> out;
  for (const std::string& cell : LogColumn(log, 1)) out.push_back(std::stod(cell));
  return out;
}

// Pseudo-English text that is the same on every machine: sentences of
// words drawn from a fixed list by std::mt19937 (whose output the standard
// fixes), so results do not depend on an installed corpus.
inline void WriteWordSalad(const std::string& path, size_t bytes) {
  static const char* const kWords[] = {
      "the",   "of",    "and",  "to",    "in",    "is",    "that",  "it",    "was",
      "for",   "on",    "are",  "with",  "as",    "they",  "be",    "at",    "one",
      "have",  "this",  "from", "by",    "hot",   "word",  "but",   "what",  "some",
      "we",    "can",   "out",  "other", "were",  "all",   "there", "when",  "up",
      "use",   "your",  "how",  "said",  "an",    "each",  "she",   "which", "do",
      "their", "time",  "if",   "will",  "way",   "about", "many",  "then",  "them",
      "write", "would", "like", "so",    "these", "her",   "long",  "make",  "thing",
      "see",   "him",   "two",  "has",   "look",  "more",  "day",   "could", "go"};
  constexpr uint32_t kCount = sizeof(kWords) / sizeof(kWords[0]);
  std::mt19937 rng(20261130);
  std::string text;
  while (text.size() < bytes) {
    const uint32_t words = 4 + rng() % 9;
    for (uint32_t w = 0; w < words; ++w) {
      std::string word = kWords[rng() % kCount];
      if (w == 0) word[0] = static_cast<char>(word[0] - 'a' + 'A');
      text += word;
      text += w + 1 < words ? " " : ". ";
    }
  }
  std::ofstream(path) << text;
}

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_EXAMPLES_TRAIN_TESTING_H_
