// JobManager with an in-memory store, a real Fleet and a planner that the
// test holds: an attempt is planned outside the manager's lock, so every
// other call goes on while a large job's plan is computed, and a job
// cancelled meanwhile gets no attempt and gives its workers back.

#include "server/control/job_manager.h"

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/plan/planner.h"
#include "gtest/gtest.h"
#include "proto/io/message_file.h"

namespace muonmesh::coordinator {
namespace {

class HeldPlannerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = JobStore::Open(":memory:");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    fleet_ = std::make_unique<Fleet>(&clock_, absl::Seconds(60), absl::Seconds(5));
    JobManagerOptions options;
    options.plan = [this](const plan::PlanInput& input) {
      if (!entered_.HasBeenNotified()) entered_.Notify();
      release_.WaitForNotification();
      return plan::ComputePlan(input);
    };
    manager_ =
        std::make_unique<JobManager>(store_.get(), fleet_.get(), &rendezvous_, &clock_, options);
    for (const char* id : {"w0", "w1"}) {
      v1::WorkerInfo info;
      info.set_worker_id(id);
      info.set_device("cpu");
      info.set_address("127.0.0.1");
      ASSERT_TRUE(fleet_->Register(info).ok());
    }
  }
  void TearDown() override {
    if (!release_.HasBeenNotified()) release_.Notify();
  }

  v1::JobSpec Spec(const std::string& name) {
    v1::JobSpec spec;
    EXPECT_TRUE(
        protoio::ParseMessageText(absl::StrCat("name: ", name,
                                               "\nworld_size: 2\nmodel: {mlp: {dims: [6, 16, 3]}}\n"
                                               "data: {teacher: {seed: 1, samples: 64}}\n"
                                               "training: {steps: 4, global_batch_size: 8}\n"
                                               "output: {dir: /tmp/job_manager_test/",
                                               name, "}\n"),
                                  "job", &spec)
            .ok());
    return spec;
  }

  // `call` finishes within a minute (it would block for good on a lock held
  // while planning); the test ends at once if it does not.
  template <typename F>
  auto Finishes(F call) {
    auto f = std::async(std::launch::async, call);
    if (f.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      ADD_FAILURE() << "blocked while an attempt was being planned";
      std::_Exit(1);
    }
    return f.get();
  }

  SystemClock clock_;
  Rendezvous rendezvous_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<Fleet> fleet_;
  std::unique_ptr<JobManager> manager_;
  absl::Notification entered_, release_;
};

TEST_F(HeldPlannerTest, CallsGoOnWhileAnAttemptIsPlannedAndACancelWins) {
  // The submit plans the job's attempt (on this thread, held by the test).
  std::string id;
  std::thread submitter([&] {
    std::vector<plan::FieldViolation> violations;
    absl::StatusOr<JobStore::Submitted> s = manager_->Submit("r-1", Spec("held"), &violations);
    ASSERT_TRUE(s.ok()) << s.status();
    id = s->job.id();
  });
  entered_.WaitForNotification();
  // Meanwhile: another submit, a status and a cancel of the job being planned.
  const std::vector<v1::Job> unfinished = Finishes([&] { return store_->Unfinished(); });
  ASSERT_EQ(unfinished.size(), 1u);
  const std::string held = unfinished[0].id();
  absl::StatusOr<v1::Job> cancelled = Finishes([&] { return manager_->Cancel(held, "test"); });
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  std::vector<plan::FieldViolation> violations;
  const bool second =
      Finishes([&] { return manager_->Submit("r-2", Spec("second"), &violations).ok(); });
  EXPECT_TRUE(second);
  release_.Notify();
  submitter.join();
  // The cancelled job got no attempt: its gang went back, and the second
  // job (planned once the test let go) runs on it.
  EXPECT_EQ(store_->Get(held)->state(), v1::JOB_STATE_CANCELLED);
  int busy_with_second = 0;
  for (const v1::Worker& w : fleet_->List()) {
    EXPECT_NE(w.job_id(), held);
    busy_with_second += w.state() == v1::WORKER_STATE_BUSY ? 1 : 0;
  }
  EXPECT_EQ(busy_with_second, 2);
}

}  // namespace
}  // namespace muonmesh::coordinator
