// The event log's part of the coordinator (server/control/job_events.h) on
// an in-memory store: a watcher wakes on an append, times out empty, ends on
// shutdown or when its client goes; a failed write stops new work, an
// answer does not.

#include "server/control/job_events.h"

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/io/message_file.h"
#include "tests/server/control/fake_clock.h"

namespace muonmesh::coordinator {
namespace {

class JobEventsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = JobStore::Open(":memory:");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    events_ = std::make_unique<JobEvents>(store_.get(), &clock_,
                                          [this](const std::string& line) { log_.push_back(line); });
    v1::JobSpec spec;
    ASSERT_TRUE(protoio::ParseMessageText("name: w\nworld_size: 1\nmodel: {mlp: {dims: [2, 2]}}\n"
                                          "training: {steps: 3, global_batch_size: 2}\n"
                                          "output: {dir: /tmp/job_events_test}\n",
                                          "job", &spec)
                    .ok());
    absl::StatusOr<JobStore::Submitted> s =
        store_->Submit("r", spec, "waiting", events_->NowMs(), "");
    ASSERT_TRUE(s.ok()) << s.status();
    id_ = s->job.id();
    first_ = *store_->LastEventIndex(id_) + 1;
  }

  FakeClock clock_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobEvents> events_;
  std::string id_;
  int64_t first_ = 0;  // the index the next event gets
  std::vector<std::string> log_;  // the operator's log lines
};

// The coordinator's log says what happened to a job (issue: only `watch`
// and the event log did): one line per state change, with its reason.
TEST_F(JobEventsTest, EveryStateChangeIsALogLineWithItsReason) {
  ASSERT_TRUE(events_->ChangeState(id_, v1::JOB_STATE_RUNNING, "on 1 worker", 0).ok());
  ASSERT_TRUE(events_->ChangeState(id_, v1::JOB_STATE_RESTARTING,
                                   "rank 0 (worker w0): the worker was lost (no heartbeat)", 1)
                  .ok());
  ASSERT_TRUE(events_->ChangeState(id_, v1::JOB_STATE_FAILED, "", 1).ok());
  EXPECT_EQ(log_, (std::vector<std::string>{
                      "job " + id_ + " RUNNING (attempt 0): on 1 worker",
                      "job " + id_ +
                          " RESTARTING (attempt 1): rank 0 (worker w0): the worker was lost (no "
                          "heartbeat)",
                      "job " + id_ + " FAILED (attempt 1)"}));
}

TEST_F(JobEventsTest, AStateChangeSetsTheJobAndItsTimes) {
  clock_.Advance(absl::Seconds(3));
  ASSERT_TRUE(events_->ChangeState(id_, v1::JOB_STATE_RUNNING, "on 1 worker", 0).ok());
  v1::Job job = *store_->Get(id_);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.reason(), "on 1 worker");
  EXPECT_EQ(job.started_unix_ms(), absl::ToUnixMillis(clock_.Now()));
  clock_.Advance(absl::Seconds(5));
  ASSERT_TRUE(events_->ChangeState(id_, v1::JOB_STATE_SUCCEEDED, "done", 0, [](v1::Job& j) {
                       j.set_steps_done(3);
                     }).ok());
  job = *store_->Get(id_);
  EXPECT_EQ(job.finished_unix_ms(), absl::ToUnixMillis(clock_.Now()));
  EXPECT_EQ(job.started_unix_ms(), absl::ToUnixMillis(clock_.Now() - absl::Seconds(5)));
  EXPECT_EQ(job.steps_done(), 3);
  EXPECT_EQ(job.eta_seconds(), 0);
}

TEST_F(JobEventsTest, AWatcherWakesOnTheNextEvent) {
  auto waiter = std::async(std::launch::async, [&] {
    return events_->Wait(id_, first_, absl::Seconds(60), nullptr);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(events_->ChangeState(id_, v1::JOB_STATE_RUNNING, "go", 0).ok());
  ASSERT_EQ(waiter.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  absl::StatusOr<std::vector<v1::JobEvent>> got = waiter.get();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].state_change().reason(), "go");
}

TEST_F(JobEventsTest, AWaitWithoutNewsEndsEmptyAndAnUnknownJobIsNotFound) {
  absl::StatusOr<std::vector<v1::JobEvent>> got =
      events_->Wait(id_, first_, absl::Milliseconds(120), nullptr);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->empty());
  EXPECT_EQ(events_->Wait("no-such-job", 0, absl::Milliseconds(10), nullptr).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(JobEventsTest, AGoneClientAndAShutdownEndTheWait) {
  EXPECT_EQ(events_->Wait(id_, first_, absl::Seconds(60), [] { return true; }).status().code(),
            absl::StatusCode::kCancelled);
  auto waiter = std::async(std::launch::async, [&] {
    return events_->Wait(id_, first_, absl::Hours(1), nullptr);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  events_->Shutdown();
  ASSERT_EQ(waiter.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_EQ(waiter.get().status().code(), absl::StatusCode::kCancelled);
}

TEST_F(JobEventsTest, AFailedWriteStopsNewWorkAndAnAnswerDoesNot) {
  for (const absl::Status& answer :
       {absl::NotFoundError("x"), absl::InvalidArgumentError("x"), absl::AlreadyExistsError("x"),
        absl::FailedPreconditionError("folder in use"), absl::ResourceExhaustedError("x")}) {
    EXPECT_EQ(events_->NoteWrite(answer), answer);
  }
  EXPECT_TRUE(events_->state_error().ok());
  EXPECT_EQ(events_->NoteWrite(absl::InternalError("disk I/O error")).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(events_->state_error().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(events_->state_error().message()), ::testing::HasSubstr("disk I/O"));
  // The first failure is the one kept.
  (void)events_->NoteWrite(absl::DataLossError("later"));
  EXPECT_THAT(std::string(events_->state_error().message()), ::testing::HasSubstr("disk I/O"));
}

}  // namespace
}  // namespace muonmesh::coordinator
