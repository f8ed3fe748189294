// The rules of one attempt (server/control/attempt.h) on their own: step
// counting, the stop a cancel, drain or failure agrees on, adoption on the
// fake clock, and how an attempt ended. Expectations follow from the rules
// as the header states them, worked out by hand per case.

#include "server/control/attempt.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/control/fake_clock.h"

namespace muonmesh::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

v1::Job JobOf(int64_t world, int64_t steps) {
  v1::Job job;
  job.set_id("j");
  job.mutable_spec()->set_world_size(world);
  job.mutable_spec()->mutable_training()->set_steps(steps);
  return job;
}

Attempt Started(int64_t world, int64_t steps = 100) {
  std::vector<std::string> workers;
  for (int64_t r = 0; r < world; ++r) workers.push_back(absl::StrCat("w", r));
  return Attempt::Begin(0, JobOf(world, steps), workers, "fp");
}

v1::StepRecord Report(int32_t rank, int64_t step, double seconds, double loss = 0) {
  v1::StepRecord r;
  r.set_rank(rank);
  r.set_step(step);
  r.set_step_seconds(seconds);
  r.set_loss(loss);
  return r;
}

TEST(AttemptTest, AStepIsCountedOnceEveryRankReportedItOnceEach) {
  Attempt a = Started(3);
  EXPECT_FALSE(a.Count(Report(1, 0, 0.5)).has_value());
  EXPECT_FALSE(a.Count(Report(0, 0, 0.2, 2.5)).has_value());
  EXPECT_FALSE(a.Count(Report(1, 0, 9.0)).has_value());  // sent again: not counted
  const std::optional<StepAggregate> done = a.Count(Report(2, 0, 0.7));
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->ranks.size(), 3u);
  EXPECT_DOUBLE_EQ(done->slowest, 0.7);  // the resent 9.0 was not taken
  EXPECT_DOUBLE_EQ(done->rank0.loss(), 2.5);
  EXPECT_TRUE(a.steps.empty());
}

TEST(AttemptTest, AFinishedStepForgetsTheOpenStepsBelowItAndIgnoresLateOnes) {
  Attempt a = Started(2);
  EXPECT_FALSE(a.Count(Report(0, 3, 1)).has_value());  // rank 1's record of 3 is lost
  EXPECT_FALSE(a.Count(Report(0, 4, 1)).has_value());
  EXPECT_TRUE(a.Count(Report(1, 4, 1)).has_value());
  EXPECT_TRUE(a.steps.empty());
  EXPECT_DOUBLE_EQ(a.Finish(4, 1), 1);
  EXPECT_EQ(a.steps_done, 5);
  // Below steps_done: stored by the caller, never counted again.
  EXPECT_FALSE(a.Count(Report(1, 3, 1)).has_value());
  EXPECT_TRUE(a.steps.empty());
}

TEST(AttemptTest, TheStepTimeIsTheMedianOfTheNewestSixteen) {
  Attempt a = Started(1);
  double median = 0;
  for (int s = 1; s <= 20; ++s) median = a.Finish(s - 1, s);
  // The newest 16 are 5..20; the upper median of an even count is the
  // (16/2)-th from zero of the sorted ones: 5 + 8 = 13.
  EXPECT_DOUBLE_EQ(median, 13);
  EXPECT_EQ(a.steps_done, 20);
}

TEST(AttemptTest, ACancelStopsEveryRankAfterTheFirstStepNoneWentOnPast) {
  Attempt a = Started(2);
  EXPECT_FALSE(a.AnswerStep(3).stop);  // rank 0 goes on past 3
  EXPECT_FALSE(a.AnswerStep(2).stop);  // rank 1 is behind
  a.StopAll();
  EXPECT_EQ(a.stop_at_step, 4);
  EXPECT_FALSE(a.AnswerStep(3).stop);  // rank 1 reaches 3: on to 4 as rank 0
  const Attempt::Answer at4 = a.AnswerStep(4);
  EXPECT_TRUE(at4.stop);
  EXPECT_FALSE(at4.checkpoint);
  // A second stop never moves the step later.
  a.max_continued_step = 9;
  a.StopAll();
  EXPECT_EQ(a.stop_at_step, 4);
}

TEST(AttemptTest, ACancelWithACheckpointAndADrainAskForOne) {
  Attempt cancelled = Started(2);
  cancelled.AnswerStep(6);
  cancelled.StopAll();
  cancelled.cancel_checkpoint = true;
  EXPECT_TRUE(cancelled.AnswerStep(7).checkpoint);

  Attempt drained = Started(2);
  drained.AnswerStep(6);
  EXPECT_EQ(drained.DrainStopStep(), 7);
  drained.drained = "worker w1 drained";
  drained.stop_at_step = drained.DrainStopStep();
  EXPECT_FALSE(drained.AnswerStep(6).stop);
  const Attempt::Answer at7 = drained.AnswerStep(7);
  EXPECT_TRUE(at7.stop && at7.checkpoint);
  // A failure during the drain: the stop stands, without a checkpoint.
  drained.Fail(0, "gone", absl::FromUnixSeconds(1));
  EXPECT_FALSE(drained.AnswerStep(7).checkpoint);
}

// A killed worker's peers see their collectives break before its lease runs
// out: the failure they report first must not stand as the cause once the
// worker is found lost.
TEST(AttemptTest, ALostWorkerIsNamedEvenWhenItsPeersReportedFirst) {
  Attempt a = Started(3);
  const absl::Time t = absl::FromUnixSeconds(42);
  EXPECT_TRUE(a.Fail(0, "gloo: connection closed by peer", t));
  EXPECT_FALSE(a.Fail(1, "gloo: connection closed by peer", t));
  EXPECT_FALSE(a.FailLost(2, t + absl::Seconds(10)));
  EXPECT_EQ(a.failure,
            "rank 2 (worker w2): the worker was lost (no heartbeat); first reported by rank 0 "
            "(worker w0): gloo: connection closed by peer");
  EXPECT_EQ(a.failed_at, t);  // the fault's time: the first report
  EXPECT_EQ(a.Running(), 0);

  // Lost first: the plain reason, kept when a second worker is lost.
  Attempt b = Started(3);
  EXPECT_TRUE(b.FailLost(1, t));
  EXPECT_FALSE(b.FailLost(2, t));
  EXPECT_EQ(b.failure, "rank 1 (worker w1): the worker was lost (no heartbeat)");
}

TEST(AttemptTest, TheFirstFailureNamesItsRankAndWorkerAndStopsTheOthers) {
  Attempt a = Started(3);
  a.AnswerStep(5);
  const absl::Time t = absl::FromUnixSeconds(42);
  EXPECT_TRUE(a.Fail(1, "collective timed out", t));
  EXPECT_EQ(a.failure, "rank 1 (worker w1): collective timed out");
  EXPECT_EQ(a.failed_at, t);
  EXPECT_TRUE(a.cancelled);
  EXPECT_EQ(a.stop_at_step, 6);
  // A second failure is not the first: its rank fails, the reason stays.
  EXPECT_FALSE(a.Fail(2, "peer gone", t + absl::Seconds(1)));
  EXPECT_EQ(a.failure, "rank 1 (worker w1): collective timed out");
  EXPECT_EQ(a.failed_at, t);
  EXPECT_EQ(a.Running(), 1);
  EXPECT_EQ(a.RunningRankOf("w0"), 0);
  EXPECT_EQ(a.RunningRankOf("w2"), -1);
}

TEST(AttemptTest, ALongReasonIsCutAtACharacterBoundary) {
  Attempt a = Started(1);
  // 4095 ASCII bytes, then 'é' (2 bytes) across the 4096-byte bound.
  const std::string why = absl::StrCat(std::string(4095, 'x'), "\xc3\xa9", "tail");
  a.Fail(0, why, absl::FromUnixSeconds(1));
  const std::string prefix = "rank 0 (worker w0): ";
  ASSERT_THAT(a.failure, StartsWith(prefix));
  EXPECT_EQ(a.failure, absl::StrCat(prefix, std::string(4095, 'x'), " [cut]"));
}

TEST(AttemptTest, AnAdoptedAttemptWaitsForItsWorkersUntilItsGraceEnds) {
  FakeClock clock;
  Attempt a = Started(3);
  a.adopting = true;
  a.rejoined.assign(3, false);
  a.adopt_by = clock.Now() + absl::Seconds(10);
  EXPECT_FALSE(a.Rejoin(0));
  clock.Advance(absl::Seconds(10));
  EXPECT_FALSE(a.EndAdoption(clock.Now()).has_value());  // the grace includes its end
  clock.Advance(absl::Seconds(1));
  a.outcome[2] = Attempt::kSucceeded;  // its end was stored before the restart
  const std::optional<std::vector<int32_t>> late = a.EndAdoption(clock.Now());
  ASSERT_TRUE(late.has_value());
  EXPECT_THAT(*late, ElementsAre(1));
  EXPECT_FALSE(a.adopting);
  EXPECT_FALSE(a.EndAdoption(clock.Now()).has_value());  // once
}

TEST(AttemptTest, TheLastWorkerBackEndsTheAdoption) {
  Attempt a = Started(2);
  a.adopting = true;
  a.rejoined = {false, true};
  EXPECT_TRUE(a.Rejoin(0));
  EXPECT_FALSE(a.adopting);
  EXPECT_FALSE(a.Rejoin(1));  // not adopting any more
}

// A silent worker (its lease ran out while its rank ran) is waited for like
// an adopted attempt's: the others count as back, the grace runs from the
// latest silence, and it is silent until it rejoins.
TEST(AttemptTest, ASilentWorkerIsWaitedForUntilItComesBack) {
  FakeClock clock;
  Attempt a = Started(3);
  const absl::Time heard = clock.Now();
  clock.Advance(absl::Seconds(10));
  a.Silent(1, heard, clock.Now() + absl::Seconds(30));
  EXPECT_TRUE(a.adopting);
  EXPECT_TRUE(a.IsSilent(1));
  EXPECT_FALSE(a.IsSilent(0));
  EXPECT_EQ(a.silent_since[1], heard);
  clock.Advance(absl::Seconds(5));
  a.Silent(2, heard, clock.Now() + absl::Seconds(30));  // the grace now ends at +45 s
  EXPECT_FALSE(a.Rejoin(1));                            // rank 2 is still away
  EXPECT_FALSE(a.IsSilent(1));
  clock.Advance(absl::Seconds(30));
  EXPECT_FALSE(a.EndAdoption(clock.Now()).has_value());
  EXPECT_TRUE(a.Rejoin(2));  // the last one back: the attempt goes on
  EXPECT_FALSE(a.adopting);
  EXPECT_TRUE(a.failure.empty());
}

TEST(AttemptTest, ASilentWorkerNotBackByTheEndOfItsGraceIsLate) {
  FakeClock clock;
  Attempt a = Started(2);
  a.Silent(0, clock.Now(), clock.Now() + absl::Seconds(30));
  clock.Advance(absl::Seconds(31));
  const std::optional<std::vector<int32_t>> late = a.EndAdoption(clock.Now());
  ASSERT_TRUE(late.has_value());
  EXPECT_THAT(*late, ElementsAre(0));
}

TEST(AttemptTest, AdoptionTakesUpStoredReportsOfItsOwnAttemptOnly) {
  Attempt a = Started(2);
  a.attempt = 1;
  v1::StepRecord mine = Report(0, 7, 2);
  mine.set_attempt(1);
  v1::StepRecord older = Report(1, 7, 3);  // attempt 0's
  v1::StepRecord stray = Report(5, 7, 3);
  stray.set_attempt(1);
  a.Recount(mine);
  a.Recount(older);
  a.Recount(stray);
  ASSERT_EQ(a.steps.size(), 1u);
  EXPECT_THAT(a.steps[7].ranks, ElementsAre(0));
  EXPECT_EQ(a.max_continued_step, 7);
  EXPECT_FALSE(a.PopFinished().has_value());  // steps_done is 0, not 7
  a.steps_done = 7;
  EXPECT_FALSE(a.PopFinished().has_value());  // rank 1 missing
  v1::StepRecord other = Report(1, 7, 4);
  other.set_attempt(1);
  a.Recount(other);
  const auto done = a.PopFinished();
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->first, 7);
  EXPECT_DOUBLE_EQ(done->second.slowest, 4);
  EXPECT_TRUE(a.steps.empty());
}

TEST(AttemptTest, HowAnAttemptEnded) {
  Attempt a = Started(2);
  a.outcome = {Attempt::kSucceeded, Attempt::kSucceeded};
  EXPECT_EQ(a.Ended(), Attempt::Verdict::kSucceeded);
  a.outcome = {Attempt::kSucceeded, Attempt::kStopped};
  EXPECT_EQ(a.Ended(), Attempt::Verdict::kDrained);
  a.Fail(1, "x", absl::FromUnixSeconds(1));
  EXPECT_EQ(a.Ended(), Attempt::Verdict::kFailed);
}

TEST(AttemptTest, DrainsDoNotSpendRestarts) {
  v1::Job job = JobOf(2, 10);
  job.mutable_spec()->mutable_training()->set_max_restarts(2);
  EXPECT_TRUE(MayRestart(job, 1));
  EXPECT_FALSE(MayRestart(job, 2));
  job.set_drained_attempts(1);  // one of the attempts ended in a drain
  EXPECT_TRUE(MayRestart(job, 2));
  EXPECT_FALSE(MayRestart(job, 3));
}

TEST(AttemptTest, BeginTakesTheJobsSizeDeviceAndSteps) {
  const Attempt a = Started(3, 17);
  EXPECT_EQ(a.world(), 3);
  EXPECT_EQ(a.target_world, 3);
  EXPECT_EQ(a.total_steps, 17);
  EXPECT_EQ(a.device, "cpu");  // no device named
  EXPECT_EQ(a.Running(), 3);
  EXPECT_TRUE(a.Runs(2, "w2"));
  EXPECT_FALSE(a.Runs(2, "w1"));
  EXPECT_FALSE(a.Runs(3, "w2"));
  EXPECT_FALSE(a.Runs(-1, "w0"));
  EXPECT_THAT(a.plan_fingerprint, HasSubstr("fp"));
}

}  // namespace
}  // namespace muonmesh::coordinator
