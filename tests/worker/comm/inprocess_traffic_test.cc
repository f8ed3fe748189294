// The in-process transport's traffic counter (InProcessHub::TrafficBytes):
// what the ranks of a group copied out of the other ranks' buffers, per
// collective, against sizes written out by hand for each call. The runtime's
// wire test (tests/worker/runtime/trainer_test.cc) compares the plan with it.

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/comm/test_util.h"
#include "worker/comm/communicator.h"
#include "worker/comm/inprocess_communicator.h"
#include "worker/comm/types.h"

namespace muonmesh::comm {
namespace {

using testing::RunOnThreads;

constexpr CollectiveOptions kOpts{.timeout = absl::Seconds(20)};

std::unique_ptr<Communicator> Join(const std::shared_ptr<InProcessHub>& hub,
                                   const std::string& name, int rank, int size) {
  GroupOptions options;
  options.hub = hub;
  options.connect_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      CreateInProcessCommunicator(name, rank, size, options);
  if (!c.ok()) {
    ADD_FAILURE() << c.status();
    return nullptr;
  }
  return *std::move(c);
}

int64_t At(const std::map<std::string, std::array<int64_t, kNumCollectives>>& traffic,
           const std::string& group, Collective c) {
  const auto it = traffic.find(group);
  return it == traffic.end() ? 0 : it->second[static_cast<int>(c)];
}

TEST(InProcessTrafficTest, CountsWhatEachRankReadsFromTheOthers) {
  constexpr int kN = 3;
  constexpr int64_t kCount = 5;
  auto hub = std::make_shared<InProcessHub>();
  RunOnThreads(kN, [&](int r) {
    std::unique_ptr<Communicator> c = Join(hub, "g", r, kN);
    ASSERT_NE(c, nullptr);
    std::vector<float> in(kN * kCount, 1.0f), out(kN * kCount);
    ASSERT_TRUE(c->AllGather(in.data(), kCount, out.data(), kOpts).ok());
    ASSERT_TRUE(c->ReduceScatter(in.data(), out.data(), kCount, ReduceOp::kSum, kOpts).ok());
    ASSERT_TRUE(c->AllReduce(in.data(), kCount, ReduceOp::kAvg, kOpts).ok());
    ASSERT_TRUE(c->Broadcast(in.data(), kCount, /*root=*/1, kOpts).ok());
    // Rank r sends q + r + 1 floats to rank q (itself included).
    std::vector<int64_t> send(kN), recv(kN);
    for (int q = 0; q < kN; ++q) {
      send[q] = q + r + 1;
      recv[q] = r + q + 1;
    }
    std::vector<float> a2a_in(64, 2.0f), a2a_out(64);
    ASSERT_TRUE(c->AllToAllV(a2a_in.data(), send, a2a_out.data(), recv, kOpts).ok());
    ASSERT_TRUE(c->Barrier(kOpts).ok());
  });
  const auto traffic = hub->TrafficBytes();
  // Each of 3 ranks reads 2 other ranks' 5 floats.
  EXPECT_EQ(At(traffic, "g", Collective::kAllGather), 3 * 2 * 5 * 4);
  EXPECT_EQ(At(traffic, "g", Collective::kReduceScatter), 3 * 2 * 5 * 4);
  EXPECT_EQ(At(traffic, "g", Collective::kAllReduce), 3 * 2 * 5 * 4);
  // Two receivers read the root's 5 floats.
  EXPECT_EQ(At(traffic, "g", Collective::kBroadcast), 2 * 5 * 4);
  // Rank q receives q + r + 1 floats from each r != q: 0 gets 2 + 3,
  // 1 gets 2 + 4, 2 gets 3 + 4.
  EXPECT_EQ(At(traffic, "g", Collective::kAllToAllV), (5 + 6 + 7) * 4);
  EXPECT_EQ(At(traffic, "g", Collective::kBarrier), 0);
}

TEST(InProcessTrafficTest, GroupsAreCountedApartAndAFailedCallCountsNothing) {
  auto hub = std::make_shared<InProcessHub>();
  RunOnThreads(2, [&](int r) {
    std::unique_ptr<Communicator> a = Join(hub, "a", r, 2);
    std::unique_ptr<Communicator> b = Join(hub, "b", r, 2);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    std::vector<float> in(8, 1.0f), out(16);
    ASSERT_TRUE(a->AllGather(in.data(), 4, out.data(), kOpts).ok());
    ASSERT_TRUE(b->AllGather(in.data(), 8, out.data(), kOpts).ok());
    // Mismatched counts: refused on both ranks, nothing read.
    EXPECT_FALSE(a->AllReduce(in.data(), r == 0 ? 2 : 3, ReduceOp::kSum, kOpts).ok());
  });
  const auto traffic = hub->TrafficBytes();
  EXPECT_EQ(At(traffic, "a", Collective::kAllGather), 2 * 4 * 4);
  EXPECT_EQ(At(traffic, "b", Collective::kAllGather), 2 * 8 * 4);
  EXPECT_EQ(At(traffic, "a", Collective::kAllReduce), 0);
}

}  // namespace
}  // namespace muonmesh::comm
