// An elastic job's decisions (server/control/elastic.h) on the fake clock:
// when a RESTARTING job shrinks and to what, when a shrunk attempt grows.
// The sizes follow from the job's parallelism config (DDP at 4 ranks with
// min_world_size 2 may run at 3 or 2) and are written out per case.

#include "server/control/elastic.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/io/message_file.h"
#include "tests/server/control/fake_clock.h"

namespace muonmesh::coordinator {
namespace {

v1::Job Restarting(const std::string& elastic) {
  v1::Job job;
  job.set_id("e");
  job.set_state(v1::JOB_STATE_RESTARTING);
  EXPECT_TRUE(protoio::ParseMessageText(
                  "name: e\nworld_size: 4\nmodel: {mlp: {dims: [6, 16, 3]}}\n"
                  "training: {steps: 50, global_batch_size: 12, elastic: {" +
                      elastic + "}}\n",
                  "job", job.mutable_spec())
                  .ok());
  return job;
}

TEST(ElasticStateTest, ARestartingJobShrinksOnlyOnceItsWaitFromTheFaultIsOver) {
  FakeClock clock;
  const absl::Time fault = clock.Now();
  ElasticState state;
  const v1::Job job = Restarting("min_world_size: 2, wait: '10s'");
  clock.Advance(absl::Seconds(4));
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), fault, 3), 0);
  ASSERT_TRUE(state.waiting.has_value());
  EXPECT_EQ(state.waiting->since, fault);
  EXPECT_EQ(state.waiting->smallest, 2);
  EXPECT_FALSE(state.waiting->Ready(clock.Now(), 3));
  clock.Advance(absl::Seconds(6));  // 10 s after the fault
  EXPECT_TRUE(state.waiting->Ready(clock.Now(), 2));
  EXPECT_FALSE(state.waiting->Ready(clock.Now(), 1));
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), fault, 3), 3);  // the largest covered
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), fault, 2), 2);
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), fault, 1), 0);  // below min_world_size
}

TEST(ElasticStateTest, WithoutAKnownFaultTheWaitRunsFromTheFirstLook) {
  FakeClock clock;
  ElasticState state;
  const v1::Job job = Restarting("min_world_size: 2, wait: '10s'");
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), std::nullopt, 3), 0);
  clock.Advance(absl::Seconds(9));
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), std::nullopt, 3), 0);
  clock.Advance(absl::Seconds(1));
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), std::nullopt, 3), 3);
}

TEST(ElasticStateTest, RefusedSizesAreSkippedAndNoneLeftMeansNoShrink) {
  FakeClock clock;
  ElasticState state;
  const v1::Job job = Restarting("min_world_size: 2, wait: '1s'");
  const absl::Time fault = clock.Now();
  clock.Advance(absl::Seconds(5));
  state.refused.insert(3);
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), fault, 3), 2);
  state.refused.insert(2);
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), fault, 3), 0);
  EXPECT_EQ(state.waiting->smallest, 0);
  EXPECT_FALSE(state.waiting->Ready(clock.Now(), 3));
}

TEST(ElasticStateTest, AJobStoppedToGrowTakesThatSizeAtOnce) {
  FakeClock clock;
  ElasticState state;
  state.grow = 3;
  const v1::Job job = Restarting("min_world_size: 2, wait: '1h'");
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), clock.Now(), 3), 3);  // no wait
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), clock.Now(), 2), 0);  // its workers went
}

TEST(ElasticStateTest, OnlyARestartingElasticJobShrinks) {
  FakeClock clock;
  ElasticState state;
  v1::Job job = Restarting("min_world_size: 2, wait: '1s'");
  clock.Advance(absl::Seconds(5));
  job.set_state(v1::JOB_STATE_PENDING);
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), std::nullopt, 3), 0);
  job.set_state(v1::JOB_STATE_RESTARTING);
  job.mutable_spec()->mutable_training()->clear_elastic();
  EXPECT_EQ(state.ShrunkWorld(job, clock.Now(), std::nullopt, 3), 0);
  EXPECT_FALSE(state.waiting.has_value());
}

TEST(ElasticStateTest, AShrunkAttemptGrowsToTheLargestSizeTheWorkersCover) {
  const v1::Job job = Restarting("min_world_size: 2");
  const Attempt two = Attempt::Begin(1, job, {"w0", "w1"}, "fp");
  ElasticState state;
  EXPECT_EQ(state.GrowTarget(two, 2), 0);  // no idle worker
  EXPECT_EQ(state.GrowTarget(two, 3), 3);
  EXPECT_EQ(state.GrowTarget(two, 4), 4);  // its world_size
  EXPECT_EQ(state.GrowTarget(two, 9), 4);
  state.refused.insert(3);
  EXPECT_EQ(state.GrowTarget(two, 3), 0);
  const Attempt three = Attempt::Begin(1, job, {"w0", "w1", "w2"}, "fp");
  EXPECT_EQ(state.GrowTarget(three, 3), 0);  // not larger than its own
}

}  // namespace
}  // namespace muonmesh::coordinator
