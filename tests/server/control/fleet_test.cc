// The fleet's leases and gang allocation, with a clock the test moves.

#include "server/control/fleet.h"

#include <map>
#include <memory>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/fleet_service.h"
#include "tests/server/control/fake_clock.h"

namespace muonmesh::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::WorkerInfo Info(const std::string& id, const std::string& device = "cpu") {
  v1::WorkerInfo info;
  info.set_worker_id(id);
  info.set_device(device);
  info.set_address("127.0.0.1");
  info.set_memory_bytes(1 << 30);
  info.set_version("test");
  return info;
}

class FleetTest : public ::testing::Test {
 protected:
  FakeClock clock_;
  Fleet fleet_{&clock_, absl::Seconds(10), absl::Seconds(2)};
};

// A full fleet of live workers refuses a new id; once some are lost, a new
// id takes the place of the one lost longest ago (crash-looping workers
// register under new ids and would otherwise fill the fleet for good).
TEST_F(FleetTest, AFullFleetMakesRoomByForgettingTheLongestLost) {
  for (size_t i = 0; i < kMaxWorkers; ++i) {
    ASSERT_TRUE(fleet_.Register(Info(absl::StrCat("w", i))).ok()) << i;
    if (i == 0) clock_.Advance(absl::Seconds(1));  // w0 goes silent first
  }
  EXPECT_EQ(fleet_.Register(Info("new")).status().code(), absl::StatusCode::kResourceExhausted);
  clock_.Advance(absl::Seconds(11));  // every lease has run out
  EXPECT_EQ(fleet_.Expire().size(), kMaxWorkers);
  ASSERT_TRUE(fleet_.Register(Info("new")).ok());
  EXPECT_EQ(fleet_.List().size(), kMaxWorkers);
  bool w0 = false, w1 = false;
  for (const v1::Worker& w : fleet_.List()) {
    w0 = w0 || w.info().worker_id() == "w0";
    w1 = w1 || w.info().worker_id() == "w1";
  }
  EXPECT_FALSE(w0);  // lost longest ago
  EXPECT_TRUE(w1);
}

// A LOST worker stays listed for ForgetLostAfter from the moment Expire
// marked it, then goes; live ones stay, however long they live.
TEST_F(FleetTest, LostWorkersAreForgottenAfterTheirTime) {
  fleet_.ForgetLostAfter(absl::Minutes(5));
  auto a = fleet_.Register(Info("a"));
  auto b = fleet_.Register(Info("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  // a heartbeats every 5 s; b is silent: LOST at the Expire of t = 15 s,
  // listed until t = 15 s + 5 min.
  for (int t = 5; t <= 400; t += 5) {
    clock_.Advance(absl::Seconds(5));
    ASSERT_TRUE(fleet_.Heartbeat("a", a->lease_id).ok()) << t;
    (void)fleet_.Expire();
    std::map<std::string, v1::WorkerState> listed;
    for (const v1::Worker& w : fleet_.List()) listed[w.info().worker_id()] = w.state();
    ASSERT_EQ(listed.count("a"), 1u) << t;
    if (t < 15) {
      EXPECT_NE(listed["b"], v1::WORKER_STATE_LOST) << t;
    } else if (t < 15 + 300) {
      EXPECT_EQ(listed["b"], v1::WORKER_STATE_LOST) << t;
    } else {
      EXPECT_EQ(listed.count("b"), 0u) << "t = " << t << ": b should be forgotten";
    }
  }
  // Its id is free: b registers anew.
  EXPECT_TRUE(fleet_.Register(Info("b")).ok());
}

TEST_F(FleetTest, RegistrationIsCheckedAndUniqueWhileItsLeaseLives) {
  EXPECT_THAT(std::string(fleet_.Register(Info("")).status().message()),
              HasSubstr("info.worker_id"));
  EXPECT_THAT(std::string(fleet_.Register(Info("a b")).status().message()),
              HasSubstr("info.worker_id"));
  EXPECT_THAT(std::string(fleet_.Register(Info("w", "tpu")).status().message()),
              HasSubstr("info.device"));
  v1::WorkerInfo no_address = Info("w");
  no_address.clear_address();
  EXPECT_EQ(fleet_.Register(no_address).status().code(), absl::StatusCode::kInvalidArgument);
  v1::WorkerInfo bad_port = Info("w");
  bad_port.set_peer_port(70000);
  EXPECT_THAT(std::string(fleet_.Register(bad_port).status().message()),
              HasSubstr("info.peer_port: 70000"));
  v1::WorkerInfo bad_locality = Info("w");
  bad_locality.set_locality("rack a");
  EXPECT_THAT(std::string(fleet_.Register(bad_locality).status().message()),
              HasSubstr("info.locality: must match"));
  bad_locality.set_locality(std::string(129, 'r'));
  EXPECT_THAT(std::string(fleet_.Register(bad_locality).status().message()),
              HasSubstr("info.locality"));

  auto first = fleet_.Register(Info("node1/cpu:0"));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->ttl, absl::Seconds(10));
  EXPECT_EQ(fleet_.Register(Info("node1/cpu:0")).status().code(),
            absl::StatusCode::kAlreadyExists);
  // Once the lease expired, the id may register again, with a new lease;
  // the old lease is stale.
  clock_.Advance(absl::Seconds(11));
  auto second = fleet_.Register(Info("node1/cpu:0"));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->lease_id, first->lease_id);
  // A serial and 128 random bits: no two alike, none derived from the last.
  EXPECT_EQ(first->lease_id.size(), second->lease_id.size());
  EXPECT_NE(first->lease_id.substr(first->lease_id.size() - 32),
            second->lease_id.substr(second->lease_id.size() - 32));
  EXPECT_EQ(fleet_.Heartbeat("node1/cpu:0", first->lease_id).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fleet_.Heartbeat("node1/cpu:0", second->lease_id).ok());
  EXPECT_EQ(fleet_.Heartbeat("nobody", second->lease_id).code(), absl::StatusCode::kNotFound);
}

TEST_F(FleetTest, HeartbeatsKeepALeaseAndSilenceLosesTheWorkerWithItsJob) {
  auto a = fleet_.Register(Info("a"));
  auto b = fleet_.Register(Info("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(fleet_.Take("cpu", 2, "j-1").has_value());
  std::vector<Fleet::Lost> lost;
  for (int i = 0; i < 10; ++i) {
    clock_.Advance(absl::Seconds(6));
    ASSERT_TRUE(fleet_.Heartbeat("a", a->lease_id).ok());
    for (Fleet::Lost& l : fleet_.Expire()) lost.push_back(l);
  }
  // b fell silent: lost once, with its job; a heartbeat every 6 s and lives.
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].worker_id, "b");
  EXPECT_EQ(lost[0].job_id, "j-1");
  std::vector<v1::Worker> workers = fleet_.List();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0].state(), v1::WORKER_STATE_BUSY);
  EXPECT_EQ(workers[1].state(), v1::WORKER_STATE_LOST);
  EXPECT_EQ(fleet_.Heartbeat("b", b->lease_id).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(FleetTest, ExpireReportsEachLostWorkerOnceWithItsJob) {
  auto a = fleet_.Register(Info("a"));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(fleet_.Take("cpu", 1, "j-3").has_value());
  clock_.Advance(absl::Seconds(10));
  EXPECT_TRUE(fleet_.Expire().empty()) << "exactly at the TTL the lease still lives";
  clock_.Advance(absl::Milliseconds(1));
  std::vector<Fleet::Lost> lost = fleet_.Expire();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].worker_id, "a");
  EXPECT_EQ(lost[0].job_id, "j-3");
  EXPECT_TRUE(fleet_.Expire().empty());
}

TEST_F(FleetTest, AWorkerBackBeforeExpireLooksStillLosesItsOldJob) {
  ASSERT_TRUE(fleet_.Register(Info("a")).ok());
  ASSERT_TRUE(fleet_.Take("cpu", 1, "j-3").has_value());
  // Killed; a new process under the same id registers as soon as the old
  // lease has run out, before the sweep that would have seen it.
  clock_.Advance(absl::Seconds(11));
  ASSERT_TRUE(fleet_.Register(Info("a")).ok());
  std::vector<Fleet::Lost> lost = fleet_.Expire();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].worker_id, "a");
  EXPECT_EQ(lost[0].job_id, "j-3");
  EXPECT_TRUE(fleet_.Expire().empty());
  // The new process is idle and can be taken again.
  EXPECT_TRUE(fleet_.Take("cpu", 1, "j-4").has_value());
}

// Remove forgets a worker whose lease ran out, and only such a one; one
// removed before the sweep that would have seen it still has its job
// reported lost, once.
TEST_F(FleetTest, RemoveForgetsOnlyALostWorkerAndItsJobIsStillReported) {
  ASSERT_TRUE(fleet_.Register(Info("a")).ok());
  ASSERT_TRUE(fleet_.Register(Info("b")).ok());
  ASSERT_TRUE(fleet_.Take("cpu", 1, "j-3").has_value());  // a, the first registered
  EXPECT_EQ(fleet_.Remove("c").code(), absl::StatusCode::kNotFound);
  const absl::Status busy = fleet_.Remove("a");
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(busy.message()), HasSubstr("worker 'a' is BUSY"));
  clock_.Advance(absl::Seconds(11));  // both leases ran out; no sweep yet
  ASSERT_TRUE(fleet_.Remove("a").ok());
  // The sweep reports a's job, and marks b LOST.
  std::map<std::string, std::string> lost;
  for (const Fleet::Lost& l : fleet_.Expire()) lost[l.worker_id] = l.job_id;
  EXPECT_EQ(lost, (std::map<std::string, std::string>{{"a", "j-3"}, {"b", ""}}));
  ASSERT_EQ(fleet_.List().size(), 1u);
  EXPECT_EQ(fleet_.List()[0].state(), v1::WORKER_STATE_LOST);
  ASSERT_TRUE(fleet_.Remove("b").ok());
  EXPECT_TRUE(fleet_.List().empty());
  clock_.Advance(absl::Seconds(1));
  EXPECT_TRUE(fleet_.Expire().empty()) << "each loss is reported once";
  EXPECT_EQ(fleet_.Remove("a").code(), absl::StatusCode::kNotFound);
}

// A drained worker told to leave is forgotten when its lease runs out,
// never LOST (a scale-down pages no one); a silent one is LOST as ever.
TEST_F(FleetTest, AWorkerToldToLeaveIsForgottenNotLost) {
  auto a = fleet_.Register(Info("a"));
  ASSERT_TRUE(a.ok() && fleet_.Register(Info("b")).ok());
  ASSERT_TRUE(fleet_.Drain("a").ok());
  bool leave = false;
  ASSERT_TRUE(fleet_.Heartbeat("a", a->lease_id, &leave).ok());
  ASSERT_TRUE(leave);
  clock_.Advance(absl::Seconds(11));  // both leases ran out; no sweep yet
  std::map<std::string, v1::WorkerState> listed;
  for (const v1::Worker& w : fleet_.List()) listed[w.info().worker_id()] = w.state();
  EXPECT_EQ(listed, (std::map<std::string, v1::WorkerState>{{"a", v1::WORKER_STATE_DRAINING},
                                                            {"b", v1::WORKER_STATE_LOST}}));
  std::vector<Fleet::Lost> lost = fleet_.Expire();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].worker_id, "b");
  ASSERT_EQ(fleet_.List().size(), 1u);
  EXPECT_EQ(fleet_.List()[0].info().worker_id(), "b");
  // Its id is free for the next pod of that name.
  EXPECT_TRUE(fleet_.Register(Info("a")).ok());
}

// The pod that replaces a drained one (a rollout) registers under its id
// at once, without waiting for the old lease; a live worker's id stays
// taken.
TEST_F(FleetTest, TheIdOfAWorkerThatLeftIsFreeAtOnce) {
  auto a = fleet_.Register(Info("a"));
  ASSERT_TRUE(a.ok() && fleet_.Register(Info("b")).ok());
  ASSERT_TRUE(fleet_.Drain("a").ok());
  EXPECT_EQ(fleet_.Register(Info("a")).status().code(), absl::StatusCode::kAlreadyExists)
      << "draining, not yet told to leave";
  bool leave = false;
  ASSERT_TRUE(fleet_.Heartbeat("a", a->lease_id, &leave).ok() && leave);
  auto again = fleet_.Register(Info("a"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->lease_id, a->lease_id);
  EXPECT_EQ(fleet_.Heartbeat("a", a->lease_id).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fleet_.Register(Info("b")).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(fleet_.Take("cpu", 2, "j-1").has_value()) << "the new a is idle and takeable";
}

TEST_F(FleetTest, GangsAreAllOrNothingOfOneDeviceInRegistrationOrder) {
  for (const char* id : {"c1", "g1", "c2", "c3"}) {
    ASSERT_TRUE(fleet_.Register(Info(id, id[0] == 'g' ? "cuda" : "cpu")).ok());
  }
  EXPECT_EQ(fleet_.IdleCount("cpu"), 3);
  EXPECT_FALSE(fleet_.Take("cpu", 4, "j-1").has_value());
  EXPECT_EQ(fleet_.IdleCount("cpu"), 3) << "a failed take takes nothing";
  auto gang = fleet_.Take("cpu", 2, "j-1");
  ASSERT_TRUE(gang.has_value());
  EXPECT_THAT(*gang, ElementsAre("c1", "c2"));
  EXPECT_FALSE(fleet_.Take("cpu", 2, "j-2").has_value());
  auto cuda = fleet_.Take("cuda", 1, "j-2");
  ASSERT_TRUE(cuda.has_value());
  fleet_.Release("c1", "j-other");  // not its job: no-op
  EXPECT_EQ(fleet_.IdleCount("cpu"), 1);
  fleet_.Release("c1", "j-1");
  fleet_.Release("c2", "j-1");
  auto next = fleet_.Take("cpu", 3, "j-3");
  ASSERT_TRUE(next.has_value());
  EXPECT_THAT(*next, ElementsAre("c1", "c2", "c3"));
}

// Workers that say where they sit (WorkerInfo.locality) get a job's ranks
// in the order of their labels, each label's workers in registration order,
// so consecutive ranks share a rack: registered across two racks in
// alternation, a job of four gets rack a's two as ranks 0 and 1. Which
// workers are taken does not change (the first registered of the idle
// ones); workers without a label come first, in registration order.
TEST_F(FleetTest, RanksFollowTheWorkersLocality) {
  for (const auto& [id, locality] : {std::pair{"w1", "rack-b/n1"}, std::pair{"w2", "rack-a/n1"},
                                     std::pair{"w3", "rack-b/n2"}, std::pair{"w4", "rack-a/n2"},
                                     std::pair{"w5", "rack-a/n3"}, std::pair{"w6", ""}}) {
    v1::WorkerInfo info = Info(id);
    info.set_locality(locality);
    ASSERT_TRUE(fleet_.Register(info).ok()) << id;
  }
  auto gang = fleet_.Take("cpu", 4, "j-1");
  ASSERT_TRUE(gang.has_value());
  EXPECT_THAT(*gang, ElementsAre("w2", "w4", "w1", "w3"));
  for (const std::string& id : *gang) fleet_.Release(id, "j-1");
  auto all = fleet_.Take("cpu", 6, "j-2");
  ASSERT_TRUE(all.has_value());
  EXPECT_THAT(*all, ElementsAre("w6", "w2", "w4", "w5", "w1", "w3"));
}

// An attempt's shared start (spec and plan) is held once by every rank's
// queue and merged into each rank's own start as it is sent: each worker
// gets the whole start with its own rank; the shared part is dropped with
// the queue of a worker that is lost.
TEST_F(FleetTest, ASharedStartIsMergedIntoEachRanksAssignmentAsSent) {
  auto a = fleet_.Register(Info("a"));
  auto b = fleet_.Register(Info("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  auto shared = std::make_shared<v1::StartRank>();
  shared->mutable_spec()->set_name("big");
  shared->mutable_plan()->set_parameters(1234);
  for (int r = 0; r < 2; ++r) {
    v1::Assignment x;
    x.set_job_id("j-1");
    x.mutable_start()->set_rank(r);
    x.mutable_start()->set_store_prefix("j-1/attempt-0");
    fleet_.Push(r == 0 ? "a" : "b", x, shared);
  }
  EXPECT_EQ(shared.use_count(), 3);  // one pointer a queue, no copies
  for (const auto& [id, lease, rank] :
       {std::tuple{"a", a->lease_id, 0}, std::tuple{"b", b->lease_id, 1}}) {
    auto got = fleet_.Next(id, lease, absl::Seconds(1), nullptr);
    ASSERT_TRUE(got.ok() && got->has_value()) << id;
    const v1::StartRank& start = (*got)->start();
    EXPECT_EQ(start.rank(), rank);
    EXPECT_EQ(start.store_prefix(), "j-1/attempt-0");
    EXPECT_EQ(start.spec().name(), "big");
    EXPECT_EQ(start.plan().parameters(), 1234);
  }
  EXPECT_EQ(shared.use_count(), 1);
  v1::Assignment x;
  x.set_job_id("j-2");
  fleet_.Push("a", x, shared);
  clock_.Advance(absl::Seconds(11));
  (void)fleet_.Expire();  // a and b lost: their queues go
  EXPECT_EQ(shared.use_count(), 1);
}

TEST_F(FleetTest, AssignmentsAreDeliveredInOrderAndWaitsEnd) {
  auto a = fleet_.Register(Info("a"));
  ASSERT_TRUE(a.ok());
  auto none = fleet_.Next("a", a->lease_id, absl::Milliseconds(20), nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  std::thread pusher([&] {
    for (int i = 0; i < 3; ++i) {
      v1::Assignment x;
      x.set_job_id(absl::StrCat("j-", i));
      fleet_.Push("a", x);
    }
  });
  for (int i = 0; i < 3; ++i) {
    auto got = fleet_.Next("a", a->lease_id, absl::Seconds(5), nullptr);
    ASSERT_TRUE(got.ok() && got->has_value());
    EXPECT_EQ((*got)->job_id(), absl::StrCat("j-", i));
  }
  pusher.join();
  EXPECT_EQ(fleet_.Next("a", "lease-bogus", absl::Seconds(1), nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fleet_.Next("a", a->lease_id, absl::Seconds(5), [] { return true; }).status().code(),
            absl::StatusCode::kCancelled);
  fleet_.Shutdown();
  EXPECT_EQ(fleet_.Next("a", a->lease_id, absl::Seconds(5), nullptr).status().code(),
            absl::StatusCode::kCancelled);
}

// A worker that advertises a loopback address but reaches the coordinator
// from another host would leave its peers dialling themselves: refused at
// registration, naming both addresses and the flag. The regression: workers
// in their own network namespaces advertised 127.0.0.1 and a 4-rank job
// failed only after 302 s of Gloo timeouts.
TEST(AdvertisedAddressTest, ALoopbackAddressFromAnotherHostIsRefused) {
  const absl::Status refused = CheckAdvertisedAddress("w1", "127.0.0.1", "ipv4:10.0.0.5:41234");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("info.address: worker w1 advertises 127.0.0.1"));
  EXPECT_THAT(refused.message(), HasSubstr("reaches the coordinator from 10.0.0.5"));
  EXPECT_THAT(refused.message(), HasSubstr("--address 10.0.0.5"));
  EXPECT_FALSE(CheckAdvertisedAddress("w1", "localhost", "ipv6:[2001:db8::7]:9").ok());
  // On one host, or with a reachable address, or over a socket file: fine.
  EXPECT_TRUE(CheckAdvertisedAddress("w1", "127.0.0.1", "ipv4:127.0.0.1:41234").ok());
  EXPECT_TRUE(CheckAdvertisedAddress("w1", "::1", "ipv6:[::1]:41234").ok());
  EXPECT_TRUE(CheckAdvertisedAddress("w1", "10.0.0.5", "ipv4:10.0.0.5:41234").ok());
  EXPECT_TRUE(CheckAdvertisedAddress("w1", "127.0.0.1", "unix:/run/coordinator.sock").ok());
}

}  // namespace
}  // namespace muonmesh::coordinator

namespace muonmesh::coordinator {
namespace {

// Blame (Fleet::Blame): once, a worker is taken after the others (a spare
// is preferred); twice within the hour, it is quarantined for the set time:
// Take and IdleCount skip it, List shows until when and why; then it takes
// ranks again. Blames an hour apart do not add up.
TEST(FleetBlameTest, TwiceBlamedWorkersAreQuarantinedAndSparesPreferred) {
  FakeClock clock;
  Fleet fleet{&clock, absl::Hours(100), absl::Seconds(2)};
  fleet.QuarantineFor(absl::Minutes(10));
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(fleet.Register(Info(id)).ok());
  EXPECT_FALSE(fleet.Blame("a", "unreachable from 2 of its peers"));
  // a registered first, but b and c come before it now.
  std::optional<std::vector<std::string>> taken = fleet.Take("cpu", 2, "j");
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(*taken, (std::vector<std::string>{"b", "c"}));
  fleet.Release("b", "j");
  fleet.Release("c", "j");
  EXPECT_EQ(fleet.IdleCount("cpu"), 3);

  clock.Advance(absl::Minutes(5));
  EXPECT_TRUE(fleet.Blame("a", "unreachable from 3 of its peers"));
  EXPECT_EQ(fleet.IdleCount("cpu"), 2);
  EXPECT_EQ(fleet.QuarantinedCount(), 1);
  EXPECT_FALSE(fleet.Take("cpu", 3, "j").has_value());
  for (const v1::Worker& w : fleet.List()) {
    if (w.info().worker_id() != "a") {
      EXPECT_EQ(w.quarantined_until_unix_ms(), 0) << w.info().worker_id();
      continue;
    }
    EXPECT_EQ(w.quarantined_until_unix_ms(), absl::ToUnixMillis(clock.Now() + absl::Minutes(10)));
    EXPECT_EQ(w.quarantine_reason(), "unreachable from 3 of its peers");
  }
  clock.Advance(absl::Minutes(10));
  EXPECT_EQ(fleet.QuarantinedCount(), 0);
  EXPECT_EQ(fleet.IdleCount("cpu"), 3);

  // Two blames more than an hour apart are one each.
  EXPECT_FALSE(fleet.Blame("b", "x"));
  clock.Advance(absl::Minutes(61));
  EXPECT_FALSE(fleet.Blame("b", "x"));
  // And with no quarantine set, never.
  fleet.QuarantineFor(absl::ZeroDuration());
  EXPECT_FALSE(fleet.Blame("c", "x"));
  EXPECT_FALSE(fleet.Blame("c", "x"));
  EXPECT_EQ(fleet.IdleCount("cpu"), 3);
}

}  // namespace
}  // namespace muonmesh::coordinator
