// The reachability probe before a Gloo rendezvous (worker/comm/peer_probe.h):
// ranks that reach each other pass; a rank whose peer's address refuses or
// does not answer fails within the probe's timeout, naming both ends.

#include "worker/comm/peer_probe.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/file_store.h"

namespace muonmesh::comm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::unique_ptr<FileStore> FreshStore() {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/peer_probe_", ::getpid(), "_",
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Open(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(*store);
}

// A loopback port nothing listens on (bound, then closed).
int ClosedPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST(PeerProbeTest, RanksThatReachEachOtherPass) {
  std::unique_ptr<FileStore> store = FreshStore();
  constexpr int kSize = 4;
  std::vector<absl::Status> status(kSize);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kSize; ++r) {
    ranks.emplace_back([&, r] {
      status[r] = ProbePeers(*store, "g/", r, kSize, "127.0.0.1", absl::Seconds(5),
                             absl::Seconds(30));
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < kSize; ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
}

TEST(PeerProbeTest, APeerThatRefusesFailsAtOnceNamingBothEnds) {
  std::unique_ptr<FileStore> store = FreshStore();
  const std::string peer = absl::StrCat("127.0.0.1:", ClosedPort());
  ASSERT_TRUE(store->Set("g/probe/1", peer).ok());  // rank 1 published, then went away
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s =
      ProbePeers(*store, "g/", 0, 2, "127.0.0.1", absl::Seconds(5), absl::Seconds(60));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()),
              StartsWith("rank 0 (127.0.0.1) cannot reach rank 1 at " + peer + ": "));
  EXPECT_THAT(std::string(s.message()), HasSubstr("refused"));
  EXPECT_LT(seconds, 5.0);  // not the 60 s rendezvous timeout
}

TEST(PeerProbeTest, APeerThatDoesNotAnswerFailsWithinTheConnectTimeout) {
  std::unique_ptr<FileStore> store = FreshStore();
  // TEST-NET-1 (RFC 5737): routed nowhere; a connect either hangs or is
  // refused by the network at once.
  ASSERT_TRUE(store->Set("g/probe/1", "192.0.2.1:9").ok());
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s =
      ProbePeers(*store, "g/", 0, 2, "127.0.0.1", absl::Seconds(1), absl::Seconds(60));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()),
              StartsWith("rank 0 (127.0.0.1) cannot reach rank 1 at 192.0.2.1:9: "));
  EXPECT_LT(seconds, 10.0);
}

TEST(PeerProbeTest, AHostItCannotListenOnIsNamed) {
  std::unique_ptr<FileStore> store = FreshStore();
  const absl::Status s =
      ProbePeers(*store, "g/", 0, 2, "192.0.2.1", absl::Seconds(1), absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot listen on 192.0.2.1"));
}

}  // namespace
}  // namespace muonmesh::comm

namespace muonmesh::comm {
namespace {

// The check a worker answers for its peers (EchoListener, EchoCheck): a
// live listener answers at once; a port that accepts but never answers (a
// frozen process: the kernel completes the connection) fails within the
// timeout as DeadlineExceeded (connected: the path works), saying so; a
// closed port (a crashed process) fails at once as
// NotFound, naming the address.
TEST(PeerCheckTest, OnlyALiveListenerAnswers) {
  absl::StatusOr<std::unique_ptr<EchoListener>> echo = EchoListener::Start("127.0.0.1");
  ASSERT_TRUE(echo.ok()) << echo.status();
  EXPECT_TRUE(EchoCheck("127.0.0.1", (*echo)->port(), absl::Seconds(2)).ok());
  EXPECT_TRUE(EchoCheck("127.0.0.1", (*echo)->port(), absl::Seconds(2)).ok()) << "again";

  // Listening, never accepting: what a stopped process's socket does.
  const int silent = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(silent, 4), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const absl::Time start = absl::Now();
  const absl::Status frozen = EchoCheck("127.0.0.1", ntohs(addr.sin_port), absl::Milliseconds(300));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  EXPECT_TRUE(absl::IsDeadlineExceeded(frozen)) << frozen;
  EXPECT_THAT(std::string(frozen.message()), HasSubstr("no answer within"));
  ::close(silent);

  const int closed = ClosedPort();
  const absl::Status refused = EchoCheck("127.0.0.1", closed, absl::Seconds(2));
  EXPECT_TRUE(absl::IsNotFound(refused)) << refused;  // up, but nothing listens
  EXPECT_THAT(std::string(refused.message()), HasSubstr(absl::StrCat("127.0.0.1:", closed)));
}

// The listener serves every connection at once: peers that connect and
// stay silent (a congested link holding their byte back) delay no other
// peer's check, which still answers at once.
TEST(PeerCheckTest, ASilentPeerDelaysNoOtherCheck) {
  absl::StatusOr<std::unique_ptr<EchoListener>> echo = EchoListener::Start("127.0.0.1");
  ASSERT_TRUE(echo.ok()) << echo.status();
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>((*echo)->port()));
  std::vector<int> silent;
  for (int i = 0; i < 5; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    silent.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(100));  // accepted, waiting for their bytes
  const absl::Time start = absl::Now();
  EXPECT_TRUE(EchoCheck("127.0.0.1", (*echo)->port(), absl::Milliseconds(500)).ok());
  // Served one at a time, it would wait out a silent peer's second first.
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(400));
  for (int fd : silent) ::close(fd);
}

}  // namespace
}  // namespace muonmesh::comm
