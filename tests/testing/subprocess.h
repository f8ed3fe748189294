#pragma once

// Runs real binaries from tests: captures stdout and stderr, bounds every
// wait, and kills what overstays. POSIX only (posix_spawn, poll).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace muonmesh::testing {

struct ProcessResult {
  int exit_code = -1;  // -1 if killed by a signal or timed out
  bool timed_out = false;
  std::string out;
  std::string err;
  double seconds = 0;
  int term_signal = 0;          // the signal that ended it, 0 if it exited
  int64_t peak_rss_bytes = -1;  // its peak resident memory (wait4's ru_maxrss)
};

// A null-terminated char* array over `strings` (which must outlive it).
inline std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// The current environment with `extra_env` ("NAME=value") replacing or
// adding variables.
inline std::vector<std::string> Environment(const std::vector<std::string>& extra_env) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    bool replaced = false;
    for (const std::string& x : extra_env) {
      const std::string name = x.substr(0, x.find('=') + 1);
      if (std::strncmp(*e, name.c_str(), name.size()) == 0) replaced = true;
    }
    if (!replaced) env.emplace_back(*e);
  }
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  return env;
}

// Waits for `pid` until `deadline`; kills it (SIGKILL) past the deadline.
// Returns the exit code, or -1 if it died of a signal or was killed.
// `result`, if given, also gets the signal and peak memory.
inline int WaitOrKill(pid_t pid, std::chrono::steady_clock::time_point deadline, bool* timed_out,
                      ProcessResult* result = nullptr) {
  int status = 0;
  while (true) {
    rusage usage{};
    const pid_t r = wait4(pid, &status, WNOHANG, &usage);
    if (r == pid && result != nullptr) {
      result->peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
      result->term_signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    }
    if (r == pid) break;
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      if (timed_out != nullptr) *timed_out = true;
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs `argv` to completion (or `timeout`), capturing both streams.
inline ProcessResult Run(std::vector<std::string> argv, std::chrono::milliseconds timeout,
                         const std::vector<std::string>& extra_env = {}) {
  ProcessResult result;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) return result;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  std::vector<std::string> env = Environment(extra_env);
  pid_t pid = -1;
  const int spawn_error = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr,
                                      CStrings(argv).data(), CStrings(env).data());
  posix_spawn_file_actions_destroy(&actions);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (spawn_error != 0) {
    result.err = std::string("posix_spawn: ") + std::strerror(spawn_error);
    close(out_pipe[0]);
    close(err_pipe[0]);
    return result;
  }
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    if (poll(fds, 2, static_cast<int>(left.count())) <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[65536];
      const ssize_t n = read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (const pollfd& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  result.exit_code = WaitOrKill(pid, deadline, &result.timed_out, &result);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace muonmesh::testing
