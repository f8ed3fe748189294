// JobManager with an in-memory store, a real Fleet and a planner that the
// test holds: an attempt is planned outside the manager's lock, so every
// other call goes on while a large job's plan is computed, and a job
// cancelled meanwhile gets no attempt and gives its workers back.

#include "server/control/job_manager.h"

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "core/plan/planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/io/message_file.h"
#include "proto/job/job.h"
#include "tests/server/control/fake_clock.h"

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

// Elastic jobs, driven by hand on a fake clock: a 4-rank job loses a
// worker for good; after training.elastic.wait it goes on at 3 ranks (the
// largest size the 3 idle workers cover that splits the batch of 12), and
// when a worker comes it stops at its next step with a checkpoint and goes
// on at 4. Only the lost worker's failure spends a restart.
class ElasticTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = JobStore::Open(":memory:");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    fleet_ = std::make_unique<Fleet>(&clock_, absl::Seconds(60), absl::Seconds(5));
    manager_ = std::make_unique<JobManager>(store_.get(), fleet_.get(), &rendezvous_, &clock_,
                                            JobManagerOptions());
    for (int i = 0; i < 4; ++i) Register(absl::StrCat("w", i));
  }
  void Register(const std::string& id) {
    v1::WorkerInfo info;
    info.set_worker_id(id);
    info.set_device("cpu");
    info.set_address("127.0.0.1");
    absl::StatusOr<Fleet::Lease> lease = fleet_->Register(info);
    ASSERT_TRUE(lease.ok());
    leases_[id] = lease->lease_id;
  }
  // The newest start the worker was sent (its queue drained).
  std::optional<v1::StartRank> LastStart(const std::string& worker) {
    std::optional<v1::StartRank> start;
    while (true) {
      absl::StatusOr<std::optional<v1::Assignment>> next =
          fleet_->Next(worker, leases_[worker], absl::ZeroDuration(), nullptr);
      if (!next.ok() || !next->has_value()) return start;
      if ((*next)->has_start()) start = (*next)->start();
    }
  }
  std::map<std::string, std::string> leases_;
  // Every rank of the attempt but the lost worker's ends with `outcome`,
  // after reporting `step` when it is >= 0 (the answer's stop and checkpoint
  // in `told`).
  void EndRanks(const v1::Job& job, v1::AttemptOutcome outcome, int64_t step = -1,
                std::vector<std::pair<bool, bool>>* told = nullptr) {
    for (int r = 0; r < job.worker_ids_size(); ++r) {
      if (job.worker_ids(r) == "w3") continue;
      if (step >= 0) {
        v1::StepRecord record;
        record.set_attempt(job.attempt());
        record.set_rank(r);
        record.set_step(step);
        bool stop = false, checkpoint = false;
        ASSERT_TRUE(manager_->OnStep(job.worker_ids(r), job.id(), record, &stop, &checkpoint).ok());
        if (told != nullptr) told->push_back({stop, checkpoint});
      }
      v1::ReportAttemptRequest end;
      end.set_job_id(job.id());
      end.set_attempt(job.attempt());
      end.set_rank(r);
      end.set_outcome(outcome);
      (void)manager_->OnAttemptEnd(job.worker_ids(r), end);
    }
  }
  // Submits the job `text` (a JobSpec as text) as `request`; its id, or ""
  // (a test failure) when it is refused.
  std::string SubmitText(const std::string& request, const std::string& text) {
    v1::JobSpec spec;
    EXPECT_TRUE(protoio::ParseMessageText(text, "job", &spec).ok()) << text;
    std::vector<plan::FieldViolation> violations;
    absl::StatusOr<JobStore::Submitted> s = manager_->Submit(request, spec, &violations);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->job.id() : std::string();
  }
  std::vector<std::string> Reasons(const std::string& id) {
    std::vector<std::string> out;
    absl::StatusOr<std::vector<v1::JobEvent>> events = store_->Events(id, 0, 1000);
    EXPECT_TRUE(events.ok());
    for (const v1::JobEvent& e : *events) {
      if (e.has_state_change()) out.push_back(e.state_change().reason());
    }
    return out;
  }

  FakeClock clock_;
  Rendezvous rendezvous_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<Fleet> fleet_;
  std::unique_ptr<JobManager> manager_;
};

TEST_F(ElasticTest, ShrinksAfterItsWaitAndGrowsBackWithoutSpendingRestarts) {
  v1::JobSpec spec;
  ASSERT_TRUE(
      protoio::ParseMessageText("name: elastic\nworld_size: 4\nmodel: {mlp: {dims: [6, 16, 3]}}\n"
                                "data: {teacher: {seed: 1, samples: 64}}\n"
                                "training: {steps: 50, global_batch_size: 12, checkpoint_every: 5, "
                                "max_restarts: 1, elastic: {min_world_size: 2, wait: '10s'}}\n"
                                "output: {dir: /tmp/job_manager_test/elastic}\n",
                                "job", &spec)
          .ok());
  std::vector<plan::FieldViolation> violations;
  absl::StatusOr<JobStore::Submitted> s = manager_->Submit("e-1", spec, &violations);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string id = s->job.id();
  v1::Job job = *store_->Get(id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.world_size(), 4);

  // w3 is lost for good; the others stop.
  manager_->OnWorkersLost({{"w3", id, clock_.Now()}});
  EndRanks(job, v1::ATTEMPT_OUTCOME_FAILED);
  job = *store_->Get(id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RESTARTING) << job.reason();
  // Before the wait is over it waits for a fourth worker.
  clock_.Advance(absl::Seconds(9));
  manager_->CheckElastic();
  EXPECT_EQ(store_->Get(id)->state(), v1::JOB_STATE_RESTARTING);
  clock_.Advance(absl::Seconds(2));
  manager_->CheckElastic();
  job = *store_->Get(id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  EXPECT_EQ(job.world_size(), 3);
  EXPECT_EQ(job.worker_ids_size(), 3);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_THAT(job.reason(), ::testing::HasSubstr("running on 3 of 4 ranks (training.elastic"));

  // A worker comes: nothing changes until CheckElastic, then the ranks are
  // told to stop with a checkpoint after their next step, and the job goes
  // on at 4 ranks.
  Register("w4");
  manager_->CheckElastic();
  std::vector<std::pair<bool, bool>> told;
  EndRanks(job, v1::ATTEMPT_OUTCOME_STOPPED, 12, &told);
  for (const auto& [stop, checkpoint] : told) EXPECT_TRUE(stop && checkpoint);
  job = *store_->Get(id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  EXPECT_EQ(job.world_size(), 4);
  EXPECT_EQ(job.attempt(), 2);
  EXPECT_EQ(job.drained_attempts(), 1);  // the growth spent no restart
  EXPECT_THAT(job.reason(), ::testing::HasSubstr("(grown back from 3 ranks)"));
  const std::vector<std::string> reasons = Reasons(id);
  EXPECT_THAT(reasons, ::testing::Contains(
                           ::testing::HasSubstr("training.elastic: growing from 3 to 4 ranks")));
}

// A rank's failure reported as the job's own (job_error: a fresh start
// refused over an earlier run's outputs) fails the job at once, restarts
// left or not: a restart would resume that earlier run. Any other failure
// of the same job restarts it.
TEST_F(ElasticTest, AJobErrorIsNotRestarted) {
  const auto submit = [&](const std::string& request, const std::string& dir) {
    v1::JobSpec spec;
    EXPECT_TRUE(protoio::ParseMessageText(
                    absl::StrCat("name: once\nworld_size: 2\nmodel: {mlp: {dims: [6, 3]}}\n"
                                 "training: {steps: 5, global_batch_size: 4, max_restarts: 3}\n"
                                 "output: {dir: ",
                                 dir, "}\n"),
                    "job", &spec)
                    .ok());
    std::vector<plan::FieldViolation> violations;
    absl::StatusOr<JobStore::Submitted> s = manager_->Submit(request, spec, &violations);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->job.id() : std::string();
  };
  const auto fail_rank0 = [&](const std::string& id, bool job_error) {
    const v1::Job job = *store_->Get(id);
    v1::ReportAttemptRequest end;
    end.set_job_id(id);
    end.set_attempt(job.attempt());
    end.set_rank(0);
    end.set_outcome(v1::ATTEMPT_OUTCOME_FAILED);
    end.set_message("output.dir: /runs/once holds an earlier run's outputs");
    end.set_job_error(job_error);
    ASSERT_TRUE(manager_->OnAttemptEnd(job.worker_ids(0), end).ok());
    end.set_rank(1);
    end.set_job_error(false);
    end.set_message("stopped");
    ASSERT_TRUE(manager_->OnAttemptEnd(job.worker_ids(1), end).ok());
  };
  const std::string refused = submit("a", "/tmp/job_manager_test/once-a");
  fail_rank0(refused, /*job_error=*/true);
  const v1::Job failed = *store_->Get(refused);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED) << failed.reason();
  EXPECT_EQ(failed.attempt(), 0);
  EXPECT_THAT(failed.reason(), ::testing::HasSubstr("earlier run's outputs"));
  EXPECT_THAT(failed.reason(), ::testing::HasSubstr("not restarted"));

  const std::string restarted = submit("b", "/tmp/job_manager_test/once-b");
  fail_rank0(restarted, /*job_error=*/false);
  EXPECT_EQ(store_->Get(restarted)->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(store_->Get(restarted)->attempt(), 1);
}

// Blame: a 3-rank job on 4 workers whose attempts fail with the other two
// ranks reporting one worker unreachable (ReportAttemptRequest.peer_checks):
// each failure names it, the restart takes the spare instead of it, and
// blamed twice it is quarantined (no rank, shown in the listing). A tie
// (each of two workers unreachable from one rank) blames nobody.
TEST_F(ElasticTest, TheWorkerItsPeersCannotReachIsBlamedAndQuarantined) {
  const std::string id =
      SubmitText("cut-1",
                 "name: cut\nworld_size: 3\nmodel: {mlp: {dims: [6, 3]}}\n"
                 "training: {steps: 5, global_batch_size: 6, max_restarts: 5}\n"
                 "output: {dir: /tmp/job_manager_test/cut}\n");
  ASSERT_FALSE(id.empty());
  // Every rank fails; those not on `cut` report it unreachable (and `cut`
  // reports them unreachable too: from its side the link is down as well).
  const auto fail_all = [&](const std::string& cut) {
    const v1::Job job = *store_->Get(id);
    for (int r = 0; r < job.worker_ids_size(); ++r) {
      v1::ReportAttemptRequest end;
      end.set_job_id(id);
      end.set_attempt(job.attempt());
      end.set_rank(r);
      end.set_outcome(v1::ATTEMPT_OUTCOME_FAILED);
      end.set_code(14);
      end.set_message("all_reduce: peer connection lost");
      for (const std::string& peer : job.worker_ids()) {
        if (peer == job.worker_ids(r)) continue;
        v1::PeerCheckResult* c = end.add_peer_checks();
        c->set_worker_id(peer);
        c->set_reachable(job.worker_ids(r) != cut && peer != cut);
      }
      ASSERT_TRUE(manager_->OnAttemptEnd(job.worker_ids(r), end).ok());
    }
  };
  const v1::Job first = *store_->Get(id);
  ASSERT_EQ(first.worker_ids_size(), 3);
  const std::string cut = first.worker_ids(1);
  fail_all(cut);
  const v1::Job second = *store_->Get(id);
  EXPECT_EQ(second.attempt(), 1);
  bool named = false;
  for (const std::string& r : Reasons(id)) {
    named |= absl::StrContains(r, absl::StrCat("worker ", cut, " blamed: unreachable from 2"));
  }
  EXPECT_TRUE(named) << absl::StrJoin(Reasons(id), "\n");
  // The spare (never blamed) goes in; the blamed worker stays out while
  // another is idle.
  EXPECT_THAT(second.worker_ids(), ::testing::Not(::testing::Contains(cut)));
  // Another worker blamed once; then the next gang (the two never blamed
  // first) holds one of the two blamed once, which is blamed again.
  const std::string cut2 = second.worker_ids(0);
  fail_all(cut2);
  EXPECT_EQ(store_->Get(id)->attempt(), 2);
  // cut2 blamed once and cut once: neither quarantined yet.
  EXPECT_EQ(fleet_->QuarantinedCount(), 0);
  const v1::Job third = *store_->Get(id);
  // Blame whoever of the first two is in this gang a second time.
  std::string again;
  for (const std::string& w : third.worker_ids()) {
    if (w == cut || w == cut2) again = w;
  }
  ASSERT_FALSE(again.empty()) << "4 workers, 3 ranks, 2 blamed: one of them is in the gang";
  fail_all(again);
  EXPECT_EQ(fleet_->QuarantinedCount(), 1);
  for (const v1::Worker& w : fleet_->List()) {
    EXPECT_EQ(w.quarantined_until_unix_ms() > 0, w.info().worker_id() == again)
        << w.info().worker_id();
  }
  const v1::Job fourth = *store_->Get(id);
  EXPECT_THAT(fourth.worker_ids(), ::testing::Not(::testing::Contains(again)));
  // A tie blames nobody: rank 0 reports two workers unreachable... each
  // once, and they report nothing.
  {
    v1::ReportAttemptRequest end;
    end.set_job_id(id);
    end.set_attempt(fourth.attempt());
    end.set_outcome(v1::ATTEMPT_OUTCOME_FAILED);
    for (int r = 0; r < fourth.worker_ids_size(); ++r) {
      end.set_rank(r);
      end.clear_peer_checks();
      if (r == 0) {
        for (int q = 1; q < 3; ++q) {
          v1::PeerCheckResult* c = end.add_peer_checks();
          c->set_worker_id(fourth.worker_ids(q));
          c->set_reachable(false);
        }
      }
      ASSERT_TRUE(manager_->OnAttemptEnd(fourth.worker_ids(r), end).ok());
    }
  }
  // A refused connection is a crashed process, not a cut link: two ranks
  // finding one worker refused blame nobody.
  const v1::Job fifth = *store_->Get(id);
  ASSERT_GT(fifth.attempt(), fourth.attempt());
  for (int r = 0; r < fifth.worker_ids_size(); ++r) {
    v1::ReportAttemptRequest end;
    end.set_job_id(id);
    end.set_attempt(fifth.attempt());
    end.set_rank(r);
    end.set_outcome(v1::ATTEMPT_OUTCOME_FAILED);
    if (r > 0) {
      v1::PeerCheckResult* c = end.add_peer_checks();
      c->set_worker_id(fifth.worker_ids(0));
      c->set_reachable(false);
      c->set_refused(true);
    }
    ASSERT_TRUE(manager_->OnAttemptEnd(fifth.worker_ids(r), end).ok());
  }
  for (const std::string& r : Reasons(id)) {
    if (!absl::StrContains(r, absl::StrCat("attempt ", fifth.attempt(), " failed"))) continue;
    EXPECT_THAT(r, ::testing::Not(::testing::HasSubstr("blamed"))) << r;
  }
  bool tie_seen = false;
  for (const std::string& r : Reasons(id)) {
    if (!absl::StrContains(r, absl::StrCat("attempt ", fourth.attempt(), " failed"))) continue;
    tie_seen = true;
    EXPECT_THAT(r, ::testing::Not(::testing::HasSubstr("blamed"))) << r;
  }
  EXPECT_TRUE(tie_seen) << absl::StrJoin(Reasons(id), "\n");
}

// A worker cut off from its peers but not from the coordinator: the ranks
// whose steps stalled report it unreachable through their heartbeats
// (OnPeerChecks). One report is not enough (it may be the reporter that is
// cut off), nor a refused connection (a crash, which the lease catches);
// once most of its peers report it the attempt fails at once, every rank,
// its own included, is told to stop, and when they have stopped the worker
// is blamed and the restart takes the spare instead.
TEST_F(ElasticTest, AWorkerMostStalledPeersCannotReachFailsTheAttemptAtOnceAndIsBlamed) {
  const std::string id = SubmitText(
      "stall-1",
      "name: stall\nworld_size: 3\nmodel: {mlp: {dims: [6, 3]}}\n"
      "training: {steps: 5, global_batch_size: 6, max_restarts: 5}\n"
      "output: {dir: /tmp/job_manager_test/stall}\n");
  ASSERT_FALSE(id.empty());
  const v1::Job job = *store_->Get(id);
  ASSERT_EQ(job.worker_ids_size(), 3);
  for (const std::string& w : job.worker_ids()) LastStart(w);  // the starts
  const std::string cut = job.worker_ids(1);
  const auto report = [&](const std::string& from, const std::string& about, bool refused) {
    google::protobuf::RepeatedPtrField<v1::PeerCheckResult> results;
    v1::PeerCheckResult* c = results.Add();
    c->set_worker_id(about);
    c->set_reachable(false);
    c->set_refused(refused);
    c->set_detail("no answer within 2s");
    manager_->OnPeerChecks(from, results);
  };
  report(job.worker_ids(0), cut, false);
  report(cut, job.worker_ids(0), false);  // from its side, the others are cut
  report(cut, job.worker_ids(2), false);
  report(job.worker_ids(2), cut, true);   // refused: not counted
  EXPECT_EQ(store_->Get(job.id())->state(), v1::JOB_STATE_RUNNING);
  report(job.worker_ids(0), cut, false);  // the same reporter again: not counted
  EXPECT_EQ(store_->Get(job.id())->state(), v1::JOB_STATE_RUNNING);
  report(job.worker_ids(2), cut, false);
  for (const std::string& w : job.worker_ids()) {
    bool stopped = false;
    while (true) {
      absl::StatusOr<std::optional<v1::Assignment>> next =
          fleet_->Next(w, leases_[w], absl::ZeroDuration(), nullptr);
      if (!next.ok() || !next->has_value()) break;
      stopped |= (*next)->has_stop() && (*next)->attempt() == job.attempt();
    }
    EXPECT_TRUE(stopped) << w << " was not told to stop";
  }
  for (int r = 0; r < 3; ++r) {
    v1::ReportAttemptRequest end;
    end.set_job_id(job.id());
    end.set_attempt(job.attempt());
    end.set_rank(r);
    end.set_outcome(v1::ATTEMPT_OUTCOME_STOPPED);
    ASSERT_TRUE(manager_->OnAttemptEnd(job.worker_ids(r), end).ok());
  }
  const v1::Job next = *store_->Get(job.id());
  EXPECT_EQ(next.attempt(), 1);
  EXPECT_THAT(next.worker_ids(), ::testing::Not(::testing::Contains(cut)));
  bool named = false;
  for (const std::string& r : Reasons(job.id())) {
    named |= absl::StrContains(r, absl::StrCat("worker ", cut, "): cut off from its peers")) &&
             absl::StrContains(r, absl::StrCat("worker ", cut, " blamed: unreachable from 2"));
  }
  EXPECT_TRUE(named) << absl::StrJoin(Reasons(job.id()), "\n");
}

// In a two-rank job a report of the other rank's worker cannot say which
// side of the cut it is on: it fails nothing (the collective timeout
// decides, and the ranks' reports blame as before).
TEST_F(ElasticTest, OneStalledPeersReportFailsNoTwoRankAttempt) {
  const std::string id = SubmitText("pair-1",
                                    "name: pair\nworld_size: 2\nmodel: {mlp: {dims: [6, 3]}}\n"
                                    "training: {steps: 5, global_batch_size: 4}\n"
                                    "output: {dir: /tmp/job_manager_test/pair}\n");
  ASSERT_FALSE(id.empty());
  const v1::Job job = *store_->Get(id);
  ASSERT_EQ(job.worker_ids_size(), 2);
  for (int r = 0; r < 2; ++r) {
    google::protobuf::RepeatedPtrField<v1::PeerCheckResult> results;
    v1::PeerCheckResult* c = results.Add();
    c->set_worker_id(job.worker_ids(1 - r));
    c->set_reachable(false);
    manager_->OnPeerChecks(job.worker_ids(r), results);
  }
  const v1::Job after = *store_->Get(job.id());
  EXPECT_EQ(after.state(), v1::JOB_STATE_RUNNING) << after.reason();
  EXPECT_EQ(after.attempt(), 0);
}

// A submit refused because another unfinished job owns its output folder is
// an answer to the caller, not a failed write: the coordinator keeps taking
// work. (The regression: the refusal locked the coordinator's state.)
TEST_F(ElasticTest, AnOutputFolderInUseIsRefusedAndTheCoordinatorGoesOn) {
  const auto spec_in = [](const std::string& dir) {
    v1::JobSpec spec;
    EXPECT_TRUE(protoio::ParseMessageText(
                    absl::StrCat("name: owner\nworld_size: 1\nmodel: {mlp: {dims: [6, 3]}}\n"
                                 "training: {steps: 5, global_batch_size: 4}\noutput: {dir: ",
                                 dir, "}\n"),
                    "job", &spec)
                    .ok());
    return spec;
  };
  std::vector<plan::FieldViolation> violations;
  absl::StatusOr<JobStore::Submitted> first =
      manager_->Submit("one", spec_in("/tmp/job_manager_test/owned"), &violations);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<JobStore::Submitted> clash =
      manager_->Submit("two", spec_in("/tmp/job_manager_test/owned/inner"), &violations);
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(clash.status().message()), ::testing::HasSubstr(first->job.id()));
  EXPECT_TRUE(manager_->state_error().ok()) << manager_->state_error();
  EXPECT_TRUE(manager_->Submit("three", spec_in("/tmp/job_manager_test/other"), &violations).ok());
}

TEST_F(ElasticTest, SizesTheParallelismConfigRefusesAreSkipped) {
  // world 4 with EP 2 for moe_mlp: 3 does not fit EP 2 (the parallelism
  // check keeps it out of the sizes); 2 does.
  v1::JobSpec spec;
  ASSERT_TRUE(protoio::ParseMessageText(
                  "name: moe\nworld_size: 4\nparallelism: {expert_model_parallel_size: 2}\n"
                  "model: {moe_mlp: {d_in: 5, d_model: 8, d_expert: 6, num_experts: 4, "
                  "d_out: 3}}\n"
                  "training: {steps: 50, global_batch_size: 12, max_restarts: 1, "
                  "elastic: {min_world_size: 2, wait: '1s'}}\n"
                  "output: {dir: /tmp/job_manager_test/moe}\n",
                  "job", &spec)
                  .ok());
  EXPECT_EQ(job::ElasticWorldSizes(spec), std::vector<int64_t>({2}));
  std::vector<plan::FieldViolation> violations;
  absl::StatusOr<JobStore::Submitted> s = manager_->Submit("m-1", spec, &violations);
  ASSERT_TRUE(s.ok()) << s.status() << (violations.empty() ? "" : violations[0].description);
  v1::Job job = *store_->Get(s->job.id());
  manager_->OnWorkersLost({{"w3", job.id(), clock_.Now()}});
  EndRanks(job, v1::ATTEMPT_OUTCOME_FAILED);
  clock_.Advance(absl::Seconds(2));
  manager_->CheckElastic();
  job = *store_->Get(job.id());
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  EXPECT_EQ(job.world_size(), 2);
  // Its ranks run the job at 2, min_world_size itself: the spec they get
  // has that world size and no training.elastic (which a worker would check
  // against it and refuse).
  const std::optional<v1::StartRank> start = LastStart(job.worker_ids(0));
  ASSERT_TRUE(start.has_value());
  EXPECT_EQ(start->spec().world_size(), 2);
  EXPECT_FALSE(start->spec().training().has_elastic());
  EXPECT_TRUE(job::ValidateJob(start->spec()).empty());
}

}  // namespace
}  // namespace muonmesh::coordinator

namespace muonmesh::coordinator {
namespace {

// A job longer than max_recorded_steps keeps the step events and records of
// every k-th step (k = ceil(steps / max)), of its last step and of steps
// with a validation loss, and none of the others; its progress still counts
// every step.
TEST(RecordedStepsTest, ALongJobKeepsEveryKthStepItsLastAndItsValidations) {
  auto opened = JobStore::Open(":memory:");
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<JobStore> store = *std::move(opened);
  SystemClock clock;
  Rendezvous rendezvous;
  Fleet fleet(&clock, absl::Seconds(60), absl::Seconds(5));
  JobManagerOptions options;
  options.max_recorded_steps = 10;
  JobManager manager(store.get(), &fleet, &rendezvous, &clock, options);
  for (const char* id : {"w0", "w1"}) {
    v1::WorkerInfo info;
    info.set_worker_id(id);
    info.set_device("cpu");
    info.set_address("127.0.0.1");
    ASSERT_TRUE(fleet.Register(info).ok());
  }
  v1::JobSpec spec;
  ASSERT_TRUE(
      protoio::ParseMessageText("name: long\nworld_size: 2\nmodel: {mlp: {dims: [6, 16, 3]}}\n"
                                "data: {teacher: {seed: 1, samples: 64}}\n"
                                "training: {steps: 35, global_batch_size: 8}\n"
                                "output: {dir: /tmp/job_manager_test/long}\n",
                                "job", &spec)
          .ok());
  std::vector<plan::FieldViolation> violations;
  absl::StatusOr<JobStore::Submitted> s = manager.Submit("l-1", spec, &violations);
  ASSERT_TRUE(s.ok()) << s.status();
  const v1::Job job = *store->Get(s->job.id());
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  for (int64_t step = 0; step < 35; ++step) {
    for (int r = 0; r < 2; ++r) {
      v1::StepRecord record;
      record.set_attempt(job.attempt());
      record.set_rank(r);
      record.set_step(step);
      record.set_loss(1.0);
      if (step == 13) record.set_val_loss(0.5);
      bool stop = false;
      ASSERT_TRUE(manager.OnStep(job.worker_ids(r), job.id(), record, &stop).ok());
    }
  }
  // ceil(35 / 10) = 4: steps 0, 4, ..., 32; 34 the last; 13 a validation.
  const std::vector<int64_t> kept = {0, 4, 8, 12, 13, 16, 20, 24, 28, 32, 34};
  std::vector<int64_t> events;
  absl::StatusOr<std::vector<v1::JobEvent>> log = store->Events(job.id(), 0, 1000);
  ASSERT_TRUE(log.ok()) << log.status();
  for (const v1::JobEvent& e : *log) {
    if (e.has_step()) events.push_back(e.step().step());
  }
  EXPECT_EQ(events, kept);
  std::vector<int64_t> records;
  absl::StatusOr<JobStore::StepPage> page = store->Steps(job.id(), 0, -1, 0, 1000, "");
  ASSERT_TRUE(page.ok()) << page.status();
  for (const v1::StepRecord& r : page->records) records.push_back(r.step());
  EXPECT_EQ(records, kept);
  const v1::Job after = *store->Get(job.id());
  EXPECT_EQ(after.steps_done(), 35);
  EXPECT_EQ(after.last_val_step(), 13);
}

// The rule as a property: at most max + 1 steps of any job are kept (the
// validations aside), the first and the last always, every step when the
// job is no longer than max, and kept steps never further apart than k.
TEST(RecordedStepsTest, TheRuleKeepsAtMostMaxPlusOneStepsSpreadEvenly) {
  for (const int64_t total : {1, 2, 9, 10, 11, 35, 100, 1001, 4096}) {
    for (const int64_t max : {1, 2, 3, 10, 100, 1000}) {
      const int64_t every = (total + max - 1) / max;
      int64_t count = 0, previous = -1;
      for (int64_t step = 0; step < total; ++step) {
        if (!JobManager::RecordsStep(step, total, max)) continue;
        ++count;
        EXPECT_LE(step - previous, every) << total << " steps, max " << max;
        previous = step;
      }
      EXPECT_LE(count, max + 1) << total << " steps, max " << max;
      if (total <= max) {
        EXPECT_EQ(count, total);
      }
      EXPECT_TRUE(JobManager::RecordsStep(0, total, max));
      EXPECT_TRUE(JobManager::RecordsStep(total - 1, total, max));
      EXPECT_TRUE(JobManager::RecordsStep(total - 1, total, 0));
    }
  }
}

}  // namespace
}  // namespace muonmesh::coordinator
