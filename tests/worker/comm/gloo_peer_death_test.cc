// A Gloo peer that dies (a real process: tests/worker/comm/comm_test_peer.cc)
// makes the survivors' next or current collective fail promptly with
// Unavailable, long before the call's timeout, and never hang or crash the
// survivor (e.g. by SIGPIPE on the dead socket).

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/test_util.h"
#include "worker/comm/communicator.h"
#include "worker/comm/file_store.h"

extern char** environ;

namespace muonmesh::comm {
namespace {

using testing::RunOnThreads;
using testing::ScopedTempDir;

// Long enough that only a prompt failure passes the time checks below.
const CollectiveOptions kLongTimeout{absl::Seconds(30)};
constexpr absl::Duration kPrompt = absl::Seconds(5);

// The peer process; killed (SIGKILL) and reaped on destruction if alive.
class PeerProcess {
 public:
  PeerProcess(const std::string& store_dir, const std::string& group, int rank, int size,
              const std::string& mode) {
    std::vector<std::string> args = {MUONMESH_COMM_TEST_PEER, store_dir, group,
                                     std::to_string(rank), std::to_string(size), mode};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int error = ::posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ);
    EXPECT_EQ(error, 0) << "posix_spawn " << argv[0];
    if (error != 0) pid_ = -1;
  }
  ~PeerProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      Wait(absl::Seconds(10));
    }
  }

  void Kill() { ::kill(pid_, SIGKILL); }

  // The exit status (as waitpid reports it), or -1 if still running after
  // `timeout` (then it is left for the destructor).
  int Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (pid_ > 0) {
      int status = 0;
      const pid_t done = ::waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        pid_ = -1;
        return status;
      }
      if (absl::Now() >= deadline) return -1;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

std::unique_ptr<FileStore> OpenStore(const std::string& dir) {
  auto store = FileStore::Open(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

TEST(GlooPeerDeathTest, PeerThatExitedFailsTheNextCallPromptly) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  PeerProcess peer(dir.path(), "death/exit", 1, 2, "exit");
  GroupOptions options;
  options.connect_timeout = absl::Seconds(20);
  auto comm = CreateGroup(Backend::kGloo, *store, "death/exit", 0, 2, options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> values(8, 1.0f);
  ASSERT_TRUE((*comm)->AllReduce(values.data(), 8, ReduceOp::kSum, kLongTimeout).ok());
  EXPECT_EQ(values[0], 2.0f);
  const int exit_status = peer.Wait(absl::Seconds(10));
  ASSERT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) == 0) << exit_status;

  // Several calls in a row: the first fails, the rest are refused; none
  // hangs and the process survives writing to the dead socket.
  const absl::Time start = absl::Now();
  const absl::Status status = (*comm)->AllReduce(values.data(), 8, ReduceOp::kSum, kLongTimeout);
  EXPECT_LT(absl::Now() - start, kPrompt);
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_NE(std::string(status.message()).find("death/exit"), std::string::npos) << status;
  EXPECT_TRUE(absl::IsFailedPrecondition((*comm)->Barrier(kLongTimeout)));
}

TEST(GlooPeerDeathTest, SigpipeCannotKillTheSurvivor) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  auto comm = CreateGroup(Backend::kGloo, *store, "alone", 0, 1, GroupOptions{});
  ASSERT_TRUE(comm.ok()) << comm.status();
  struct sigaction current {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &current), 0);
  EXPECT_EQ(current.sa_handler, SIG_IGN) << "a Gloo group leaves SIGPIPE at its default";
}

// A peer killed while the two survivors wait for it inside a large
// all-reduce: both fail with Unavailable within kPrompt, whichever peer
// each waits on (with a window, the exchange goes in chunks).
void KillAPeerDuringACall(int64_t window_bytes) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  constexpr int kSize = 3;
  constexpr int64_t kBigCount = int64_t{12} << 20;  // 48 MiB
  PeerProcess peer(dir.path(), "death/kill", 2, kSize, "hang");
  std::vector<absl::Status> status(2);
  std::vector<absl::Duration> after_kill(2);
  absl::Time killed_at = absl::InfiniteFuture();
  std::thread killer;
  RunOnThreads(2, [&](int r) {
    GroupOptions options;
    options.connect_timeout = absl::Seconds(20);
    options.gloo_window_bytes = window_bytes;
    auto comm = CreateGroup(Backend::kGloo, *store, "death/kill", r, kSize, options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    // Large enough that the sends to the peer, which stopped reading, fill
    // the socket buffers and are still in flight when it dies (the case in
    // which a write to the dead socket could raise SIGPIPE).
    std::vector<float> values(kBigCount, 1.0f);
    ASSERT_TRUE((*comm)->AllReduce(values.data(), 8, ReduceOp::kSum, kLongTimeout).ok());
    if (r == 0) {
      // Kill the peer while both survivors wait for it inside the call.
      killer = std::thread([&] {
        absl::SleepFor(absl::Milliseconds(300));
        killed_at = absl::Now();
        peer.Kill();
      });
    }
    status[r] = (*comm)->AllReduce(values.data(), kBigCount, ReduceOp::kSum, kLongTimeout);
    after_kill[r] = absl::Now() - killed_at;
  });
  killer.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(absl::IsUnavailable(status[r])) << "rank " << r << ": " << status[r];
    EXPECT_LT(after_kill[r], kPrompt) << "rank " << r;
  }
  const int exit_status = peer.Wait(absl::Seconds(10));
  EXPECT_TRUE(WIFSIGNALED(exit_status)) << exit_status;
}

TEST(GlooPeerDeathTest, PeerKilledDuringACallFailsEverySurvivorPromptly) {
  KillAPeerDuringACall(0);
}

TEST(GlooPeerDeathTest, PeerKilledDuringAWindowedCallFailsEverySurvivorPromptly) {
  KillAPeerDuringACall(int64_t{1} << 20);
}

// Ranks told to stop while their collective waits on a frozen peer (alive,
// its sockets open, never calling again: what a dead host looks like to
// TCP), each by its own signal as the coordinator stops each survivor: the
// abort ends each call at once with Cancelled and the reason, not at its
// 30 s timeout; later calls and new groups under the signal are refused.
TEST(GlooPeerDeathTest, AnAbortEndsACallWaitingOnAFrozenPeerAtOnce) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  constexpr int kSize = 3;
  PeerProcess peer(dir.path(), "abort/frozen", 2, kSize, "hang");
  AbortSignal signals[2];
  std::vector<absl::Status> status(2), later(2);
  std::vector<absl::Duration> after_abort(2);
  absl::Time aborted_at[2] = {absl::InfiniteFuture(), absl::InfiniteFuture()};
  std::thread stopper;
  RunOnThreads(2, [&](int r) {
    GroupOptions options;
    options.connect_timeout = absl::Seconds(20);
    options.abort = &signals[r];
    auto comm = CreateGroup(Backend::kGloo, *store, "abort/frozen", r, kSize, options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::vector<float> values(1024, 1.0f);
    ASSERT_TRUE((*comm)->AllReduce(values.data(), 8, ReduceOp::kSum, kLongTimeout).ok());
    if (r == 0) {
      // Both wait inside the call; each is told in turn.
      stopper = std::thread([&] {
        for (int told = 0; told < 2; ++told) {
          absl::SleepFor(absl::Milliseconds(300));
          aborted_at[told] = absl::Now();
          signals[told].Abort("attempt 0 failed: worker w2 was lost");
        }
      });
    }
    status[r] = (*comm)->AllReduce(values.data(), 1024, ReduceOp::kSum, kLongTimeout);
    after_abort[r] = absl::Now() - aborted_at[r];
    later[r] = (*comm)->Barrier(kLongTimeout);
  });
  stopper.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(absl::IsCancelled(status[r])) << status[r];
    EXPECT_NE(std::string(status[r].message()).find("worker w2 was lost"), std::string::npos)
        << status[r];
    EXPECT_TRUE(absl::IsCancelled(later[r])) << later[r];
    EXPECT_GE(after_abort[r], absl::ZeroDuration()) << "rank " << r << " ended before its abort";
    EXPECT_LT(after_abort[r], kPrompt) << "rank " << r;
  }
  GroupOptions options;
  options.abort = &signals[0];
  EXPECT_TRUE(absl::IsCancelled(
      CreateGroup(Backend::kGloo, *store, "abort/after", 0, 2, options).status()));
}

}  // namespace
}  // namespace muonmesh::comm
