// Garbage sent to a rank's Gloo ports (a port scanner, a confused service, a
// hostile peer on the pod network). Gloo (the Debian snapshot) gives each
// pair of a group its own listening socket, published in the rendezvous
// Store, takes the first connection on it for the peer and closes it. So:
// once a group is connected nothing of it listens and garbage is refused;
// garbage that wins the race at the rendezvous fails the group within its
// connect timeout, naming the group (the attempt fails and restarts); the
// rank neither hangs past its timeouts nor crashes. The NetworkPolicy of
// deploy/k8s keeps these ports to worker pods.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/test_util.h"
#include "worker/comm/communicator.h"
#include "worker/comm/file_store.h"

namespace muonmesh::comm {
namespace {

using testing::RunOnThreads;
using testing::ScopedTempDir;

// The TCP port of rank `rank`'s Gloo device, from the addresses it published
// for its pairs (each a sockaddr_storage and a sequence number).
int GlooPort(Store& store, const std::string& group, int rank) {
  absl::StatusOr<std::string> bytes =
      store.Get(absl::StrCat(group, "/gloo/", rank), absl::Seconds(10));
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (!bytes.ok() || bytes->size() < sizeof(sockaddr_in)) return -1;
  sockaddr_in in{};
  std::memcpy(&in, bytes->data(), sizeof(in));
  EXPECT_EQ(in.sin_family, AF_INET);
  return ntohs(in.sin_port);
}

// Connects to 127.0.0.1:port and writes `bytes`; false if the connection was
// refused. Leaves the connection open (its descriptor in *open) or closes it
// at once (open null).
bool SendGarbage(int port, const std::string& bytes, std::vector<int>* open) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return false;
  }
  (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  if (open != nullptr) {
    open->push_back(fd);
  } else {
    ::close(fd);
  }
  return true;
}

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng() & 0xff);
  return out;
}

TEST(GlooGarbageTest, AConnectedGroupListensOnNothingAndItsCollectivesStayRight) {
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string group = "garbage/connected";
  absl::Barrier connected(3), attacked(3);
  RunOnThreads(3, [&](int who) {
    if (who == 2) {  // the attacker
      const int port = GlooPort(**store, group, 0);
      connected.Block();
      ASSERT_GT(port, 0);
      std::mt19937_64 rng(7);
      std::vector<int> open;
      int accepted = 0;
      // Short and long garbage, sequence numbers of real pairs (0, 1), half
      // the connections left open.
      for (int i = 0; i < 200; ++i) {
        std::string bytes = RandomBytes(rng, i % 3 == 0 ? 8 : (i % 3 == 1 ? 3 : 4096));
        if (i % 10 == 0) {
          const int64_t seq = i % 20 == 0 ? 0 : 1;
          bytes.replace(0, std::min<size_t>(8, bytes.size()),
                        std::string(reinterpret_cast<const char*>(&seq), 8));
        }
        accepted += SendGarbage(port, bytes, i % 2 == 0 ? &open : nullptr) ? 1 : 0;
      }
      EXPECT_EQ(accepted, 0) << "a connected group still listens on its pair's port";
      attacked.Block();
      for (int fd : open) ::close(fd);
      return;
    }
    GroupOptions options;
    options.connect_timeout = absl::Seconds(20);
    auto comm = CreateGroup(Backend::kGloo, **store, group, who, 2, options);
    connected.Block();
    attacked.Block();
    ASSERT_TRUE(comm.ok()) << comm.status();
    for (int round = 0; round < 20; ++round) {
      std::vector<float> values(1024, static_cast<float>(who + 1));
      const absl::Status st = (*comm)->AllReduce(values.data(), values.size(), ReduceOp::kSum,
                                                 CollectiveOptions{absl::Seconds(20)});
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_EQ(values[0], 3.0f);
      ASSERT_EQ(values[1023], 3.0f);
    }
  });
}

// A rank's view of the store: it reads the other rank's Gloo address only
// after `gate` opens, so that the attacker reaches that rank's port first
// (both ranks pass the reachability probe, peer_probe.h, before publishing
// it).
class GatedStore final : public Store {
 public:
  GatedStore(Store& inner, std::string gated_key, absl::Barrier* gate)
      : inner_(inner), gated_key_(std::move(gated_key)), gate_(gate) {}
  absl::Status Set(absl::string_view key, absl::string_view value) override {
    return inner_.Set(key, value);
  }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override {
    Pass(key);
    return inner_.Get(key, timeout);
  }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override {
    for (const std::string& k : keys) Pass(k);
    return inner_.Wait(keys, timeout);
  }

 private:
  void Pass(absl::string_view key) {
    if (key != gated_key_ || gate_ == nullptr) return;
    gate_->Block();
    gate_ = nullptr;
  }
  Store& inner_;
  const std::string gated_key_;
  absl::Barrier* gate_;
};

// The attacker connects first, naming the sequence number of the pair a rank
// waits on, and sends garbage: Gloo takes its connection for the peer's.
// The group then fails within its connect timeout (or connects, if the real
// peer won the race); it never hangs past it or takes the process down.
TEST(GlooGarbageTest, GarbageThatWinsTheRendezvousFailsTheGroupInItsTimeout) {
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string group = "garbage/rendezvous";
  // Each rank reads the other's address only once the attacker has tried
  // that other's port, so neither can connect (and stop listening) first,
  // however the threads are scheduled; and both keep their groups until the
  // attacker is done.
  absl::Barrier first_attacked(2), second_attacked(2);
  absl::Notification garbage_sent;
  std::vector<absl::Status> result(2);
  std::vector<absl::Duration> took(2);
  constexpr absl::Duration kConnect = absl::Seconds(5);
  RunOnThreads(3, [&](int who) {
    if (who == 2) {
      std::mt19937_64 rng(11);
      std::vector<int> open;
      int reached = 0;
      for (int rank : {0, 1}) {
        const int port = GlooPort(**store, group, rank);
        for (int64_t seq = 0; seq < 4 && port > 0; ++seq) {
          std::string bytes(reinterpret_cast<const char*>(&seq), 8);
          bytes += RandomBytes(rng, 256);
          reached += SendGarbage(port, bytes, &open) ? 1 : 0;
        }
        (rank == 0 ? first_attacked : second_attacked).Block();
      }
      garbage_sent.Notify();
      EXPECT_GT(reached, 0) << "the garbage reached no port of the group";
      absl::SleepFor(kConnect + absl::Seconds(2));
      for (int fd : open) ::close(fd);
      return;
    }
    GatedStore gated(**store, absl::StrCat(group, "/gloo/", 1 - who),
                     who == 1 ? &first_attacked : &second_attacked);
    GroupOptions options;
    options.connect_timeout = kConnect;
    const absl::Time start = absl::Now();
    auto comm = CreateGroup(Backend::kGloo, gated, group, who, 2, options);
    took[who] = absl::Now() - start;
    result[who] = comm.status();
    if (comm.ok()) {
      std::vector<float> values(16, 1.0f);
      result[who] = (*comm)->AllReduce(values.data(), values.size(), ReduceOp::kSum,
                                       CollectiveOptions{kConnect});
    }
    garbage_sent.WaitForNotificationWithTimeout(absl::Seconds(30));
  });
  for (int r : {0, 1}) {
    EXPECT_LT(took[r], kConnect + absl::Seconds(3)) << "rank " << r << ": " << result[r];
    if (!result[r].ok()) {
      EXPECT_NE(result[r].message().find(group), std::string::npos) << result[r];
    }
  }
}

}  // namespace
}  // namespace muonmesh::comm
