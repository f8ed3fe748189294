#pragma once

// A process started in the background for end-to-end tests, its stdout and
// stderr going to a file; killed (SIGKILL) and reaped on destruction unless
// it was waited for. POSIX only.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "tests/testing/subprocess.h"

namespace muonmesh::testing {

class Background {
 public:
  Background(std::vector<std::string> argv, std::string log) : log_(std::move(log)) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<std::string> env = Environment({});
    if (posix_spawn(&pid_, argv[0].c_str(), &actions, nullptr, CStrings(argv).data(),
                    CStrings(env).data()) != 0) {
      pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&actions);
  }
  ~Background() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  pid_t pid() const { return pid_; }
  std::string Log() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  // Waits until the log holds `text`, up to `timeout`; false if it never does.
  bool WaitForLog(const std::string& text, std::chrono::milliseconds timeout) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      if (Log().find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // The address a coordinator started with `--listen HOST:0` serves, from
  // its "listening on HOST:PORT" line, once it logs it within `timeout`;
  // empty if it never does.
  std::string ListeningAddress(std::chrono::milliseconds timeout) const {
    if (!WaitForLog("listening on ", timeout)) return "";
    const std::string log = Log();
    const size_t at = log.find("listening on ") + 13;
    return log.substr(at, log.find('\n', at) - at);
  }
  void Signal(int sig) { kill(pid_, sig); }
  // The exit code, or -1 if it died of a signal or outlived `timeout` (then
  // it is killed).
  int Wait(std::chrono::milliseconds timeout) {
    bool timed_out = false;
    const int code = WaitOrKill(pid_, std::chrono::steady_clock::now() + timeout, &timed_out);
    reaped_ = true;
    return code;
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

}  // namespace muonmesh::testing
