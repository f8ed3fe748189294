// GrpcStore against the coordinator's real Store service on 127.0.0.1:0:
// the comm::Store contract (write-once keys, bounded waits), attempt scopes,
// the service's limits, real Gloo groups that rendezvous through it, and an
// unreachable coordinator.

#include "worker/comm/grpc_store.h"

#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/rendezvous.h"
#include "server/control/store_service.h"
#include "tests/worker/comm/test_util.h"
#include "worker/comm/communicator.h"

namespace muonmesh::comm {
namespace {

using ::testing::HasSubstr;

class GrpcStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                                   grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    rendezvous_.Shutdown();
    server_->Shutdown();
  }

  coordinator::Rendezvous rendezvous_;
  coordinator::StoreService service_{&rendezvous_};
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(GrpcStoreTest, KeysAreWriteOnceAndWaitsAreBounded) {
  GrpcStore store(channel_, "j-1", 0);
  const std::string value("a\0b\xff", 4);
  ASSERT_TRUE(store.Set("k", value).ok());
  EXPECT_TRUE(store.Set("k", value).ok()) << "the same value again is a retry";
  EXPECT_EQ(store.Set("k", "other").code(), absl::StatusCode::kAlreadyExists);
  absl::StatusOr<std::string> got = store.Get("k", absl::Seconds(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, value);

  const absl::Time start = absl::Now();
  got = store.Get("missing", absl::Milliseconds(300));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(got.status().message().find("missing"), std::string::npos);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  EXPECT_EQ(store.Wait({"k", "missing"}, absl::Milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(store.Set("", "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Set(std::string(coordinator::kMaxKeyBytes + 1, 'k'), "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Set("big", std::string(coordinator::kMaxValueBytes + 1, 'v')).code(),
            absl::StatusCode::kInvalidArgument);
}

// A counter past int64's range is refused, not wrapped, and keeps its value.
TEST_F(GrpcStoreTest, ACounterThatWouldOverflowIsRefused) {
  const coordinator::RendezvousScope scope{"j-1", 0};
  const int64_t top = std::numeric_limits<int64_t>::max();
  ASSERT_EQ(rendezvous_.Add(scope, "c", top).value_or(0), top);
  const absl::StatusOr<int64_t> over = rendezvous_.Add(scope, "c", 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(over.status().message().find("overflows"), std::string::npos);
  EXPECT_EQ(rendezvous_.Add(scope, "c", 0).value_or(0), top);
  EXPECT_EQ(rendezvous_.Add(scope, "c", -top).value_or(-1), 0);
}

// A key costs its bytes and what holding it costs (its attempt's first key
// the attempt's map too); a failed call costs nothing; dropping the job
// gives it all back.
TEST_F(GrpcStoreTest, KeysAreCountedWithWhatHoldingThemCosts) {
  using coordinator::kEntryOverheadBytes;
  using coordinator::kScopeOverheadBytes;
  const coordinator::RendezvousScope scope{"j-9", 0};
  ASSERT_TRUE(rendezvous_.Set(scope, "k", "v").ok());
  const size_t one = 2 + kEntryOverheadBytes + kScopeOverheadBytes;
  EXPECT_EQ(rendezvous_.total_bytes(), one);
  ASSERT_EQ(rendezvous_.Add(scope, "n", 17).value_or(0), 17);  // "n" and "17"
  EXPECT_EQ(rendezvous_.total_bytes(), one + 3 + kEntryOverheadBytes);
  EXPECT_EQ(rendezvous_.Add(scope, "k", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rendezvous_.Set(scope, "k", "other").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(rendezvous_.total_bytes(), one + 3 + kEntryOverheadBytes);
  rendezvous_.DropJob("j-9");
  EXPECT_EQ(rendezvous_.total_bytes(), 0u);
}

TEST_F(GrpcStoreTest, AGetWaitsForALaterSet) {
  GrpcStore reader(channel_, "j-1", 0);
  GrpcStore writer(channel_, "j-1", 0);
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_TRUE(writer.Set("late", "v").ok());
  });
  absl::StatusOr<std::string> got = reader.Get("late", absl::Seconds(10));
  later.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "v");
  EXPECT_TRUE(reader.Wait({"late"}, absl::Seconds(1)).ok());
}

// A rank told to stop while it waits for a peer that will not come: the
// abort ends the wait at once (not at its 30 s timeout) with Cancelled and
// the reason, a rendezvous through the aborted store fails the same way,
// and every later call is refused without waiting.
TEST_F(GrpcStoreTest, AnAbortEndsAWaitAtOnceAndRefusesLaterCalls) {
  GrpcStore store(channel_, "j-1", 0);
  AbortSignal signal;
  signal.Add(&store);
  absl::Time aborted_at = absl::InfiniteFuture();
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(300));
    aborted_at = absl::Now();
    signal.Abort("attempt 0 failed");
  });
  const absl::Time start = absl::Now();
  const absl::Status waited = store.Wait({"never"}, absl::Seconds(30));
  const absl::Time ended = absl::Now();
  stopper.join();
  EXPECT_TRUE(absl::IsCancelled(waited)) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("attempt 0 failed"));
  EXPECT_GE(ended - start, absl::Milliseconds(250));
  EXPECT_LT(ended - aborted_at, absl::Seconds(2));
  const absl::Time again = absl::Now();
  EXPECT_TRUE(absl::IsCancelled(store.Get("never", absl::Seconds(30)).status()));
  EXPECT_TRUE(absl::IsCancelled(store.Set("k", "v")));
  GroupOptions options;
  options.connect_timeout = absl::Seconds(30);
  EXPECT_TRUE(absl::IsCancelled(
      CreateGroup(Backend::kGloo, store, "after-abort", 0, 2, options).status()));
  EXPECT_LT(absl::Now() - again, absl::Seconds(2));
  signal.Remove(&store);
}

TEST_F(GrpcStoreTest, AttemptsAndJobsDoNotSeeEachOthersKeys) {
  GrpcStore first(channel_, "j-1", 0);
  GrpcStore second(channel_, "j-1", 1);
  GrpcStore other_job(channel_, "j-2", 0);
  ASSERT_TRUE(first.Set("addr", "one").ok());
  ASSERT_TRUE(second.Set("addr", "two").ok());
  EXPECT_EQ(*second.Get("addr", absl::Seconds(1)), "two");
  EXPECT_EQ(other_job.Get("addr", absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // A finished job's keys are dropped.
  rendezvous_.DropJob("j-1");
  EXPECT_EQ(first.Get("addr", absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(rendezvous_.total_bytes(), 0u);
}

// Three Gloo ranks meet through the coordinator and all-reduce.
TEST_F(GrpcStoreTest, GlooGroupsRendezvousThroughTheCoordinator) {
  constexpr int kRanks = 3;
  std::vector<std::vector<float>> data(kRanks);
  std::vector<absl::Status> status(kRanks);
  testing::RunOnThreads(kRanks, [&](int r) {
    GrpcStore store(channel_, "j-7", 2);
    GroupOptions options;
    options.connect_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Communicator>> group =
        CreateGroup(Backend::kGloo, store, "j-7/attempt-2/world", r, kRanks, options);
    if (!group.ok()) {
      status[r] = group.status();
      return;
    }
    data[r] = {static_cast<float>(r + 1), 10.0f * static_cast<float>(r)};
    status[r] = (*group)->AllReduce(data[r].data(), 2, ReduceOp::kSum);
  });
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(data[r], (std::vector<float>{1 + 2 + 3, 0 + 10 + 20}));
  }
}

TEST(GrpcStoreUnreachableTest, NoCoordinatorIsUnavailable) {
  // A port nothing listens on: bind one, then let it go.
  int port = 0;
  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    coordinator::Rendezvous r;
    coordinator::StoreService s(&r);
    builder.RegisterService(&s);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    server->Shutdown();
  }
  GrpcStore store(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()),
      "j-1", 0, /*outage=*/absl::Seconds(1));
  const absl::Time start = absl::Now();
  const absl::Status s = store.Set("k", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // It waited for the coordinator about `outage`, no longer.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

// A coordinator's Store service on loopback that can be restarted on its
// port: the new one starts empty, as a restarted coordinator's does.
class RestartingStore {
 public:
  RestartingStore() { Serve(); }
  ~RestartingStore() { Stop(); }
  std::shared_ptr<grpc::Channel> Channel() const {
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                               grpc::InsecureChannelCredentials());
  }
  // Kills it (keys lost); with `again`, serves anew on the same port.
  void Restart(bool again = true) {
    Stop();
    if (again) Serve();
  }
  bool serving() const { return server_ != nullptr; }

 private:
  void Serve() {
    rendezvous_ = std::make_unique<coordinator::Rendezvous>();
    service_ = std::make_unique<coordinator::StoreService>(rendezvous_.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port_), grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
  }
  void Stop() {
    if (server_ == nullptr) return;
    rendezvous_->Shutdown();
    server_->Shutdown();
    server_.reset();
  }
  int port_ = 0;
  std::unique_ptr<coordinator::Rendezvous> rendezvous_;
  std::unique_ptr<coordinator::StoreService> service_;
  std::unique_ptr<grpc::Server> server_;
};

// Ranks meeting while the coordinator restarts: its store comes back
// empty, and each rank's store sets its keys again once it answers, so
// every Get of a key set before the restart still finds it.
TEST(GrpcStoreRestartTest, KeysSetBeforeARestartAreFoundAfterIt) {
  RestartingStore coordinator;
  ASSERT_TRUE(coordinator.serving());
  auto channel = coordinator.Channel();
  GrpcStore a(channel, "j-1", 0), b(channel, "j-1", 0);
  ASSERT_TRUE(a.Set("from-a", "1").ok());
  ASSERT_TRUE(b.Set("from-b", "2").ok());
  coordinator.Restart(/*again=*/false);
  absl::StatusOr<std::string> a_got, b_got;
  std::thread ta([&] { a_got = a.Get("from-b", absl::Seconds(20)); });
  std::thread tb([&] { b_got = b.Get("from-a", absl::Seconds(20)); });
  absl::SleepFor(absl::Seconds(1));  // both find no coordinator for a while
  coordinator.Restart();
  ASSERT_TRUE(coordinator.serving());
  ta.join();
  tb.join();
  ASSERT_TRUE(a_got.ok()) << a_got.status();
  ASSERT_TRUE(b_got.ok()) << b_got.status();
  EXPECT_EQ(*a_got, "2");
  EXPECT_EQ(*b_got, "1");
}

// A rank that made no store call while the coordinator restarted never saw
// it come back empty: its key is missing until its worker, registering
// again, has the store set what it set (SetAgain); then a peer finds it.
TEST(GrpcStoreRestartTest, SetAgainRestoresTheKeysOfARankThatSawNoOutage) {
  RestartingStore coordinator;
  ASSERT_TRUE(coordinator.serving());
  auto channel = coordinator.Channel();
  GrpcStore quiet(channel, "j-1", 0), peer(channel, "j-1", 0);
  ASSERT_TRUE(quiet.Set("from-quiet", "1").ok());
  coordinator.Restart();
  ASSERT_TRUE(coordinator.serving());
  // The peer asks the new coordinator: nothing there (the quiet rank made
  // no call, so it set nothing again).
  EXPECT_EQ(peer.Get("from-quiet", absl::Milliseconds(300)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(quiet.SetAgain(absl::Seconds(10)).ok());
  absl::StatusOr<std::string> got = peer.Get("from-quiet", absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "1");
  // Again on a coordinator that kept it: no change, no error.
  EXPECT_TRUE(quiet.SetAgain(absl::Seconds(10)).ok());
}

}  // namespace
}  // namespace muonmesh::comm
