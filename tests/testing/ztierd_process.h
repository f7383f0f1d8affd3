// Test support: the ztierd program run as a child process, on a socket in a
// fresh directory every uid may reach (mode 0666 socket, 0755 directory),
// with a small engine (ZTIER_DRAM_BUDGET 128M, 4 KiB pages) and its log in a
// file. The constructor returns once the socket answers (or after 5 s).
// Not thread-safe (one owner).
#ifndef ZTIER_TESTS_TESTING_ZTIERD_PROCESS_H_
#define ZTIER_TESTS_TESTING_ZTIERD_PROCESS_H_

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/seqpacket.h"

namespace ztier::testing {

class ZtierdProcess {
 public:
  // `binary`: ztierd's path; `extra`: flags after --socket; `socket`: where
  // to listen (empty: a fresh directory's ztierd.sock).
  ZtierdProcess(const std::string& binary, const std::vector<std::string>& extra,
                const std::string& socket = "")
      : binary_(binary), extra_(extra) {
    if (socket.empty()) {
      std::string d = "/tmp/ztierd-proc-XXXXXX";
      EXPECT_NE(::mkdtemp(d.data()), nullptr);
      ::chmod(d.c_str(), 0755);
      dir_ = d;
      socket_ = dir_ + "/ztierd.sock";
    } else {
      socket_ = socket;
    }
    Start();
  }
  ~ZtierdProcess() {
    Kill();
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  ZtierdProcess(const ZtierdProcess&) = delete;
  ZtierdProcess& operator=(const ZtierdProcess&) = delete;

  const std::string& socket() const { return socket_; }
  pid_t pid() const { return pid_; }

  // Starts it again after it ended (a restart on the same socket path).
  void Start() {
    std::vector<std::string> args = {binary_, "--socket", socket_, "--socket-mode", "0666"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s = {"ZTIER_DRAM_BUDGET=128M", "ZTIER_HUGE_PAGES=none",
                                      "ZTIER_LOG=info"};
    std::vector<char*> env;
    for (std::string& e : env_s) env.push_back(e.data());
    env.push_back(nullptr);
    log_ = socket_ + ".log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), env.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
    for (int k = 0; k < 500 && !engine::SeqPacketSocket::Connect(socket_).ok(); ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // Stops it (SIGSTOP) and returns once it is stopped: the signal lands a
  // moment after kill returns, and a ztierd under load answered a call
  // meanwhile.
  void Pause() {
    ASSERT_EQ(::kill(pid_, SIGSTOP), 0);
    int st = 0;
    ASSERT_EQ(::waitpid(pid_, &st, WUNTRACED), pid_);
    ASSERT_TRUE(WIFSTOPPED(st));
  }

  // Sends `sig` and reaps it: the exit code, 128 + the signal that ended
  // it, or -1 when it is still running after 10 s.
  int SignalAndWait(int sig) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, sig);
    for (int k = 0; k < 1000; ++k) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  void Kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  std::string log() const {
    std::ifstream in(log_);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string binary_;
  std::vector<std::string> extra_;
  std::string dir_;
  std::string socket_;
  std::string log_;
  pid_t pid_ = -1;
};

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_ZTIERD_PROCESS_H_
