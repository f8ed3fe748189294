// What a restarted coordinator does with a RUNNING job
// (server/control/recovery.h), against a real in-memory store holding what
// the previous life wrote: adopt, restart or fail, and the adopted attempt
// built from the stored row and step records.

#include "server/control/recovery.h"

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/io/message_file.h"
#include "tests/server/control/fake_clock.h"

namespace muonmesh::coordinator {
namespace {

using ::testing::ElementsAre;

class RecoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = JobStore::Open(":memory:");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    v1::JobSpec spec;
    ASSERT_TRUE(protoio::ParseMessageText("name: r\nworld_size: 3\nmodel: {mlp: {dims: [2, 2]}}\n"
                                          "training: {steps: 40, global_batch_size: 6, "
                                          "max_restarts: 2}\noutput: {dir: /tmp/recovery_test}\n",
                                          "job", &spec)
                    .ok());
    absl::StatusOr<JobStore::Submitted> s = store_->Submit("r", spec, "waiting", 0, "");
    ASSERT_TRUE(s.ok()) << s.status();
    id_ = s->job.id();
  }
  // The row as a coordinator leaves it while attempt 1 runs on w0..w2 with
  // `done` steps finished by every rank.
  v1::Job Running(int64_t done) {
    EXPECT_TRUE(store_
                    ->Update(id_,
                             [&](v1::Job& j) {
                               j.set_state(v1::JOB_STATE_RUNNING);
                               j.set_attempt(1);
                               j.set_world_size(3);
                               j.clear_worker_ids();
                               for (const char* w : {"w0", "w1", "w2"}) j.add_worker_ids(w);
                               j.set_plan_fingerprint("fp1");
                               j.set_attempt_steps_done(done);
                             })
                    .ok());
    return *store_->Get(id_);
  }
  void Put(int32_t rank, int64_t step, int32_t attempt = 1) {
    v1::StepRecord r;
    r.set_rank(rank);
    r.set_step(step);
    r.set_attempt(attempt);
    r.set_step_seconds(0.5 + rank);
    ASSERT_TRUE(store_->PutStep(id_, r).ok());
  }

  FakeClock clock_;
  std::unique_ptr<JobStore> store_;
  std::string id_;
};

TEST_F(RecoveryTest, AnAttemptStoredWithItsWorkersAndPlanIsAdopted) {
  v1::Job job = Running(5);
  EXPECT_EQ(RecoveryOf(job), Recovery::kAdopt);
  job.clear_plan_fingerprint();  // an older coordinator's row
  EXPECT_EQ(RecoveryOf(job), Recovery::kRestart);
  job.set_attempt(2);  // attempts 0 and 1 failed: max_restarts 2 spent
  EXPECT_EQ(RecoveryOf(job), Recovery::kFail);
  job.set_drained_attempts(1);  // one of them was a drain
  EXPECT_EQ(RecoveryOf(job), Recovery::kRestart);
}

TEST_F(RecoveryTest, TheAdoptedAttemptTakesUpWhatItsRanksHadReported) {
  // Step 5 reported by all three (its event cut off by the restart), step 6
  // by ranks 0 and 2; a record of attempt 0 and one of step 4 (finished)
  // are not taken.
  for (int32_t r : {0, 1, 2}) Put(r, 5);
  Put(0, 6);
  Put(2, 6);
  Put(1, 6, /*attempt=*/0);
  Put(1, 4);
  const absl::Time by = clock_.Now() + absl::Seconds(10);
  Attempt a = AdoptAttempt(Running(5), *store_, by, 1);
  EXPECT_EQ(a.attempt, 1);
  EXPECT_THAT(a.workers, ElementsAre("w0", "w1", "w2"));
  EXPECT_EQ(a.plan_fingerprint, "fp1");
  EXPECT_EQ(a.steps_done, 5);
  EXPECT_TRUE(a.adopting);
  EXPECT_EQ(a.adopt_by, by);
  EXPECT_EQ(a.max_continued_step, 6);
  ASSERT_EQ(a.steps.size(), 2u);
  EXPECT_THAT(a.steps[6].ranks, ElementsAre(0, 2));
  const auto first = a.PopFinished();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->first, 5);
  EXPECT_DOUBLE_EQ(first->second.slowest, 2.5);  // rank 2's
  EXPECT_FALSE(a.PopFinished().has_value());      // steps_done not moved by a pop
}

TEST_F(RecoveryTest, RanksThatHadEndedAndADrainAreKept) {
  Running(5);
  ASSERT_TRUE(store_
                  ->Update(id_,
                           [](v1::Job& j) {
                             j.add_finished_ranks(2);
                             j.add_stopped_ranks(7);  // no such rank: ignored
                             j.set_drain_reason("worker w1 drained");
                             j.set_drain_stop_at_step(8);
                           })
                  .ok());
  const Attempt a = AdoptAttempt(*store_->Get(id_), *store_, clock_.Now(), 1);
  EXPECT_THAT(a.outcome, ElementsAre(Attempt::kRunning, Attempt::kRunning, Attempt::kSucceeded));
  EXPECT_THAT(a.rejoined, ElementsAre(false, false, true));
  EXPECT_EQ(a.drained, "worker w1 drained");
  EXPECT_EQ(a.stop_at_step, 8);
}

TEST_F(RecoveryTest, StepsLeftOutOfTheRecordsMayHaveBeenAnswered) {
  // Every 4th step recorded: a rank told to go on from recorded step 8 may
  // have been told so for 9, 10 and 11 too, never past the last step.
  Put(0, 8);
  EXPECT_EQ(AdoptAttempt(Running(8), *store_, clock_.Now(), 4).max_continued_step, 11);
  EXPECT_EQ(AdoptAttempt(Running(8), *store_, clock_.Now(), 100).max_continued_step, 39);
}

}  // namespace
}  // namespace muonmesh::coordinator
