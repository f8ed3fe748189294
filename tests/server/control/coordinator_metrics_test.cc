// The coordinator's planned-critical-path gauge through the real job
// manager, job store and fleet (no worker processes: attempts start and end
// by calling the manager as the Fleet service would). The expected values
// are Newton-Schulz FLOP counts worked out by hand from the matrix shapes,
// not taken from the planner.

#include "server/control/coordinator_metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "proto/io/message_file.h"
#include "server/control/job_manager.h"
#include "tests/server/control/fake_clock.h"
#include "muonmesh/config.h"

namespace muonmesh::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

constexpr char kGauge[] = "muonmesh_job_planned_critical_path_flops";

// One mlp layer's weight [rows, cols] under Newton-Schulz, by hand: every
// iteration forms A = X X^T (2 m m n), B = b A + c A A (2 m^3) and
// X = a X + B X (2 m m n) on the short side m and the long side n. The jobs
// ask for the standard form (the Gram form's counts: tests/core/plan/ns_cost_test.cc).
double NsFlops(double rows, double cols, double steps) {
  const double m = std::min(rows, cols);
  const double n = std::max(rows, cols);
  return steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n);
}

class CoordinatorMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = JobStore::Open(":memory:");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    fleet_ = std::make_unique<Fleet>(&clock_, absl::Seconds(60), absl::Seconds(5));
    metrics_ = std::make_unique<CoordinatorMetrics>(store_.get(), fleet_.get());
    JobManagerOptions options;
    CoordinatorMetrics* m = metrics_.get();
    options.on_attempt_planned = [m](const std::string& job, double flops) {
      m->OnAttemptPlanned(job, flops);
    };
    options.on_attempt_done = [m](const std::string& job) { m->OnAttemptDone(job); };
    options.on_recovered = [m](const std::string&, double s) { m->OnRecovered(s); };
    options.on_step_done = [m](const std::string& job, double s) { m->OnStep(job, s); };
    options.on_refused_step = [m](const std::string& job) { m->OnRefusedStep(job); };
    manager_ = std::make_unique<JobManager>(store_.get(), fleet_.get(), &rendezvous_, &clock_,
                                            options);
  }

  prometheus::ClientMetric::Histogram Recovery() {
    for (const prometheus::MetricFamily& f : metrics_->registry()->Collect()) {
      if (f.name == "muonmesh_job_recovery_seconds") return f.metric.at(0).histogram;
    }
    ADD_FAILURE() << "no muonmesh_job_recovery_seconds";
    return prometheus::ClientMetric::Histogram{};
  }

  void AddWorker(const std::string& id) {
    v1::WorkerInfo info;
    info.set_worker_id(id);
    info.set_device("cpu");
    info.set_address("127.0.0.1");
    info.set_memory_bytes(int64_t{1} << 30);
    info.set_version("test");
    absl::StatusOr<Fleet::Lease> lease = fleet_->Register(info);
    ASSERT_TRUE(lease.ok()) << lease.status();
    leases_[id] = lease->lease_id;
    manager_->Schedule();
  }

  std::string Submit(const std::string& name, int world, const std::string& dims,
                     int max_restarts = 0, int64_t muon_buffer_bytes = 0) {
    const std::string yaml = absl::StrCat(
        "name: ", name, "\nworld_size: ", world,
        "\nparallelism: {data_parallel_sharding_strategy: optim_grads_params}\n"
        "model: {mlp: {dims: [", dims, "]}}\ninit: {seed: 5}\n"
        "data: {teacher: {seed: 21, samples: 64}}\n"
        "optimizer: {muon: {ns_steps: 3, ns_algorithm: standard}, muon_buffer_bytes: ",
        muon_buffer_bytes, "}\n"
        "training: {steps: 4, global_batch_size: 8, max_restarts: ", max_restarts, "}\n",
        "output: {dir: /tmp/coordinator_metrics_test/", name, "}\n");
    v1::JobSpec spec;
    absl::Status parsed = protoio::ParseMessageText(yaml, "job", &spec);
    EXPECT_TRUE(parsed.ok()) << parsed;
    std::vector<plan::FieldViolation> violations;
    absl::StatusOr<JobStore::Submitted> s = manager_->Submit(name, spec, &violations);
    for (const plan::FieldViolation& v : violations) {
      ADD_FAILURE() << name << ": " << v.field << ": " << v.description;
    }
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->job.id() : "";
  }

  void EndRank(const std::string& worker, const std::string& job, int32_t attempt, int32_t rank,
               v1::AttemptOutcome outcome, const std::string& message = "test",
               bool refused_step = false) {
    v1::ReportAttemptRequest end;
    end.set_worker_id(worker);
    end.set_job_id(job);
    end.set_attempt(attempt);
    end.set_rank(rank);
    end.set_outcome(outcome);
    end.set_message(message);
    end.set_refused_step(refused_step);
    ASSERT_TRUE(manager_->OnAttemptEnd(worker, end).ok());
  }

  v1::JobState State(const std::string& job) {
    absl::StatusOr<v1::Job> j = store_->Get(job);
    return j.ok() ? j->state() : v1::JOB_STATE_UNSPECIFIED;
  }

  // The gauge's samples by job, as a scrape would see them.
  std::map<std::string, double> Planned(const std::string& gauge = kGauge) {
    std::map<std::string, double> out;
    for (const prometheus::MetricFamily& f : metrics_->Collect()) {
      if (f.name != gauge) continue;
      EXPECT_EQ(f.type, prometheus::MetricType::Gauge);
      for (const prometheus::ClientMetric& m : f.metric) {
        EXPECT_EQ(m.label.size(), 1u);
        if (m.label.size() == 1 && m.label[0].name == "job_id") {
          out[m.label[0].value] = m.gauge.value;
        }
      }
    }
    return out;
  }

  FakeClock clock_;
  std::map<std::string, std::string> leases_;  // worker -> its lease id
  Rendezvous rendezvous_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<Fleet> fleet_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<JobManager> manager_;
};

TEST_F(CoordinatorMetricsTest, PlannedCriticalPathWhileEachJobRuns) {
  AddWorker("w0");
  // One rank owns both weights of mlp 6-16-3 ([16, 6] and [3, 16]).
  const std::string one = Submit("one", 1, "6, 16, 3");
  ASSERT_EQ(State(one), v1::JOB_STATE_RUNNING);
  const double one_path = NsFlops(16, 6, 3) + NsFlops(3, 16, 3);
  EXPECT_EQ(one_path, 3 * (4 * 36 * 16 + 2 * 216) + 3 * (4 * 9 * 16 + 2 * 27));
  EXPECT_THAT(Planned(), UnorderedElementsAre(Pair(one, one_path)));

  // A job waiting for workers has no planned path.
  const std::string two = Submit("two", 2, "16, 16, 16");
  ASSERT_EQ(State(two), v1::JOB_STATE_PENDING);
  EXPECT_THAT(Planned(), UnorderedElementsAre(Pair(one, one_path)));

  // Two equal [16, 16] weights on two ranks: the busiest rank owns one.
  AddWorker("w1");
  AddWorker("w2");
  ASSERT_EQ(State(two), v1::JOB_STATE_RUNNING);
  const double two_path = NsFlops(16, 16, 3);
  EXPECT_EQ(two_path, 3 * 6 * 4096);
  EXPECT_THAT(Planned(), UnorderedElementsAre(Pair(one, one_path), Pair(two, two_path)));

  // Its series goes when the job ends.
  EndRank("w0", one, 0, 0, v1::ATTEMPT_OUTCOME_SUCCEEDED);
  ASSERT_EQ(State(one), v1::JOB_STATE_SUCCEEDED);
  EXPECT_THAT(Planned(), UnorderedElementsAre(Pair(two, two_path)));

  // And when it is cancelled, at once (its ranks have not ended yet).
  ASSERT_TRUE(manager_->Cancel(two, "test").ok());
  EXPECT_THAT(Planned(), UnorderedElementsAre());
  EndRank("w1", two, 0, 0, v1::ATTEMPT_OUTCOME_STOPPED);
  EndRank("w2", two, 0, 1, v1::ATTEMPT_OUTCOME_STOPPED);
  EXPECT_THAT(Planned(), UnorderedElementsAre());
}

// muonmesh_job_world_size: the ranks of each running job's attempt (an
// elastic job's shrunk size: job_manager_test's ElasticTest sets it).
TEST_F(CoordinatorMetricsTest, WorldSizeShowsEachRunningJobsRanks) {
  for (const char* w : {"w0", "w1", "w2"}) AddWorker(w);
  const std::string one = Submit("one", 1, "6, 16, 3");
  const std::string two = Submit("two", 2, "6, 16, 3");
  const std::string big = Submit("big", 4, "6, 16, 3");
  ASSERT_EQ(State(big), v1::JOB_STATE_PENDING);
  EXPECT_THAT(Planned("muonmesh_job_world_size"),
              UnorderedElementsAre(Pair(one, 1.0), Pair(two, 2.0)));
  EndRank("w0", one, 0, 0, v1::ATTEMPT_OUTCOME_SUCCEEDED);
  EXPECT_THAT(Planned("muonmesh_job_world_size"), UnorderedElementsAre(Pair(two, 2.0)));
}

// With optimizer.muon_buffer_bytes the workers run the Muon phase in waves
// (a unit over the budget alone is a wave), and the planned path is the sum
// over waves of each wave's busiest rank: the two [16, 16] weights, one a
// wave, are two matrices' work where one wave takes one.
TEST_F(CoordinatorMetricsTest, PlannedCriticalPathAddsUpTheWaves) {
  AddWorker("w0");
  AddWorker("w1");
  const std::string job = Submit("waves", 2, "16, 16, 16", 0, /*muon_buffer_bytes=*/1);
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Planned(), UnorderedElementsAre(Pair(job, 2 * NsFlops(16, 16, 3))));
}

TEST_F(CoordinatorMetricsTest, ARestartedJobIsPlannedAgainAndAFailedOneDropped) {
  // One worker: a failed attempt waits (RESTARTING) until it is idle again.
  AddWorker("w0");
  const std::string job = Submit("again", 1, "6, 16, 3", /*max_restarts=*/1);
  const double path = NsFlops(16, 6, 3) + NsFlops(3, 16, 3);
  EXPECT_THAT(Planned(), UnorderedElementsAre(Pair(job, path)));
  // Attempt 0 fails; the worker is released and attempt 1 starts on it.
  EndRank("w0", job, 0, 0, v1::ATTEMPT_OUTCOME_FAILED);
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(store_->Get(job)->attempt(), 1);
  EXPECT_THAT(Planned(), UnorderedElementsAre(Pair(job, path)));
  // Attempt 1 fails too; no restarts remain.
  EndRank("w0", job, 1, 0, v1::ATTEMPT_OUTCOME_FAILED);
  ASSERT_EQ(State(job), v1::JOB_STATE_FAILED);
  EXPECT_THAT(Planned(), UnorderedElementsAre());
}

// A rank's failure message becomes the other ranks' stop reason and the
// job's: cut to 4 KiB, at the start of a UTF-8 sequence ("a" and 3000
// two-byte characters: byte 4096 is the second byte of one, so the cut
// comes one byte earlier).
TEST_F(CoordinatorMetricsTest, AFailureMessageIsCutToAReason) {
  AddWorker("w0");
  AddWorker("w1");
  const std::string job = Submit("cut", 2, "6, 16, 3");
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  const v1::Job running = *store_->Get(job);
  ASSERT_EQ(running.worker_ids_size(), 2);
  std::string message = "a";
  for (int i = 0; i < 3000; ++i) message += "\xc3\xa9";
  EndRank(running.worker_ids(0), job, 0, 0, v1::ATTEMPT_OUTCOME_FAILED, message);
  const std::string other = running.worker_ids(1);
  std::string reason;
  for (int i = 0; i < 3 && reason.empty(); ++i) {
    absl::StatusOr<std::optional<v1::Assignment>> a =
        fleet_->Next(other, leases_[other], absl::ZeroDuration(), [] { return false; });
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(a->has_value());
    if ((*a)->has_stop()) reason = (*a)->stop().reason();
  }
  const std::string prefix = absl::StrCat("rank 0 (worker ", running.worker_ids(0), "): ");
  ASSERT_TRUE(absl::StartsWith(reason, prefix)) << reason.substr(0, 80);
  ASSERT_TRUE(absl::EndsWith(reason, " [cut]"));
  const size_t kept = reason.size() - prefix.size() - 6;
  EXPECT_EQ(kept, 4095u);
  EXPECT_EQ(reason.substr(prefix.size(), kept), message.substr(0, kept));
}

// A step report is kept only for a step of the job (its 4 steps here) and
// with a bounded traffic map; anything else is refused, naming the field.
TEST_F(CoordinatorMetricsTest, StepReportsOutsideTheJobAreRefused) {
  AddWorker("w0");
  const std::string job = Submit("bounded", 1, "6, 16, 3");
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  v1::StepRecord record;
  record.set_rank(0);
  record.set_attempt(0);
  bool stop = false;
  for (int64_t step : {int64_t{-1}, int64_t{4}, int64_t{1} << 40}) {
    record.set_step(step);
    const absl::Status st = manager_->OnStep("w0", job, record, &stop);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << step;
    EXPECT_THAT(std::string(st.message()), HasSubstr("record.step")) << st;
  }
  record.set_step(3);
  for (int i = 0; i < 65; ++i) (*record.mutable_bytes_sent())[absl::StrCat("kind", i)] = 1;
  const absl::Status many = manager_->OnStep("w0", job, record, &stop);
  EXPECT_EQ(many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(many.message()), HasSubstr("record.bytes_sent"));
  record.mutable_bytes_sent()->clear();
  (*record.mutable_bytes_sent())["param_allgather"] = 1000;
  EXPECT_TRUE(manager_->OnStep("w0", job, record, &stop).ok());
}

// Every rank's record of `step` of the job's attempt.
void ReportStep(JobManager& manager, const std::vector<std::string>& workers,
                const std::string& job, int32_t attempt, int64_t step) {
  for (size_t r = 0; r < workers.size(); ++r) {
    v1::StepRecord record;
    record.set_rank(static_cast<int32_t>(r));
    record.set_attempt(attempt);
    record.set_step(step);
    record.set_loss(1.0);
    record.set_step_seconds(0.01);
    bool stop = false;
    ASSERT_TRUE(manager.OnStep(workers[r], job, record, &stop).ok());
  }
}

TEST_F(CoordinatorMetricsTest, RecoveryTimeRunsFromTheFaultToTheFirstStepAfterIt) {
  const auto recovery = [&] { return Recovery(); };
  AddWorker("w0");
  const std::string job = Submit("recovers", 1, "6, 16, 3", /*max_restarts=*/1);
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  // Steps without a fault are no recovery.
  ReportStep(*manager_, {"w0"}, job, 0, 0);
  EXPECT_EQ(recovery().sample_count, 0u);
  // The rank fails 2 s later; attempt 1 starts at once on the same worker
  // and finishes its first step 7.5 s after the failure.
  clock_.Advance(absl::Seconds(2));
  EndRank("w0", job, 0, 0, v1::ATTEMPT_OUTCOME_FAILED);
  ASSERT_EQ(store_->Get(job)->attempt(), 1);
  clock_.Advance(absl::Milliseconds(7500));
  ReportStep(*manager_, {"w0"}, job, 1, 0);
  EXPECT_EQ(recovery().sample_count, 1u);
  EXPECT_DOUBLE_EQ(recovery().sample_sum, 7.5);
  // Only the first step after the fault counts.
  clock_.Advance(absl::Seconds(1));
  ReportStep(*manager_, {"w0"}, job, 1, 1);
  EXPECT_EQ(recovery().sample_count, 1u);
}

// A recovery that takes several attempts is measured from its first fault:
// attempt 0 fails, attempt 1 fails 3 s later, attempt 2 finishes its first
// step 4 s after that: 7 s, not the last attempt's 4 s.
TEST_F(CoordinatorMetricsTest, RecoveryRunsFromTheFirstFaultAcrossFailedAttempts) {
  AddWorker("w0");
  const std::string job = Submit("recovers-late", 1, "6, 16, 3", /*max_restarts=*/2);
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  ReportStep(*manager_, {"w0"}, job, 0, 0);
  EndRank("w0", job, 0, 0, v1::ATTEMPT_OUTCOME_FAILED);
  ASSERT_EQ(store_->Get(job)->attempt(), 1);
  clock_.Advance(absl::Seconds(3));
  EndRank("w0", job, 1, 0, v1::ATTEMPT_OUTCOME_FAILED);
  ASSERT_EQ(store_->Get(job)->attempt(), 2);
  clock_.Advance(absl::Seconds(4));
  ReportStep(*manager_, {"w0"}, job, 2, 0);
  EXPECT_EQ(Recovery().sample_count, 1u);
  EXPECT_DOUBLE_EQ(Recovery().sample_sum, 7.0);
}

// A lost worker's fault dates from when the coordinator last heard from it,
// not from when its lease ran out (60 s later here) or its partition grace
// (30 s more): w0 heartbeats, goes silent, is found silent at +61 s and
// lost at +92 s, and the job's next attempt (on w1) finishes a step 2 s
// after that: 94 s.
TEST_F(CoordinatorMetricsTest, ALostWorkersFaultDatesFromItsLastHeartbeat) {
  AddWorker("w0");
  const std::string job = Submit("loses-a-worker", 1, "6, 16, 3", /*max_restarts=*/1);
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  AddWorker("w1");
  ReportStep(*manager_, {"w0"}, job, 0, 0);
  ASSERT_TRUE(fleet_->Heartbeat("w0", leases_["w0"]).ok());
  clock_.Advance(absl::Seconds(59));
  ASSERT_TRUE(fleet_->Heartbeat("w1", leases_["w1"]).ok());  // w1 stays live
  clock_.Advance(absl::Seconds(2));
  const std::vector<Fleet::Lost> lost = fleet_->Expire();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].worker_id, "w0");
  manager_->OnWorkersLost(lost);
  EXPECT_EQ(store_->Get(job)->attempt(), 0) << "failed at the lease, not after the grace";
  clock_.Advance(absl::Seconds(31));
  ASSERT_TRUE(fleet_->Heartbeat("w1", leases_["w1"]).ok());
  manager_->CheckAdoptions();
  ASSERT_EQ(store_->Get(job)->attempt(), 1) << store_->Get(job)->reason();
  clock_.Advance(absl::Seconds(2));
  ReportStep(*manager_, {"w1"}, job, 1, 0);
  EXPECT_EQ(Recovery().sample_count, 1u);
  EXPECT_DOUBLE_EQ(Recovery().sample_sum, 94.0);
}

// A refused step (every rank refuses it together) counts once per attempt,
// in the job's counter; while the job runs its median step time and the
// time since its last step are shown, and both go when the attempt ends.
TEST_F(CoordinatorMetricsTest, RefusedStepsCountOncePerAttemptAndProgressIsShown) {
  const auto refused = [&](const std::string& job) {
    for (const prometheus::MetricFamily& f : metrics_->registry()->Collect()) {
      if (f.name != "muonmesh_job_refused_steps_total") continue;
      for (const prometheus::ClientMetric& m : f.metric) {
        if (m.label.size() == 1 && m.label[0].value == job) return m.counter.value;
      }
    }
    return 0.0;
  };
  AddWorker("w0");
  AddWorker("w1");
  const std::string job = Submit("diverges", 2, "6, 16, 3", /*max_restarts=*/1);
  ASSERT_EQ(State(job), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Planned("muonmesh_job_step_seconds").count(job), 0u);  // no step yet
  ASSERT_EQ(Planned("muonmesh_job_seconds_since_progress").count(job), 1u);
  const auto ranks_of = [&] {
    const v1::Job j = *store_->Get(job);
    return std::vector<std::string>(j.worker_ids().begin(), j.worker_ids().end());
  };
  std::vector<std::string> by_rank = ranks_of();
  ReportStep(*manager_, by_rank, job, 0, 0);
  EXPECT_DOUBLE_EQ(Planned("muonmesh_job_step_seconds")[job], 0.01);
  const double since = Planned("muonmesh_job_seconds_since_progress")[job];
  EXPECT_GE(since, 0.0);
  EXPECT_LT(since, 5.0);
  for (int32_t attempt : {0, 1}) {
    by_rank = ranks_of();
    for (int32_t r : {0, 1}) {
      EndRank(by_rank[r], job, attempt, r, v1::ATTEMPT_OUTCOME_FAILED,
              "step 1 refused: a reduced gradient is NaN or infinite", /*refused_step=*/true);
    }
    EXPECT_EQ(refused(job), attempt + 1.0);
  }
  EXPECT_EQ(State(job), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Planned("muonmesh_job_seconds_since_progress").count(job), 0u);
  // Another failure is not a refused step.
  const std::string other = Submit("crashes", 1, "6, 16, 3");
  const std::string worker = store_->Get(other)->worker_ids(0);
  EndRank(worker, other, 0, 0, v1::ATTEMPT_OUTCOME_FAILED, "killed");
  EXPECT_EQ(refused(other), 0.0);
}

// Which release serves the metrics: muonmesh_build_info, in the registry
// the Exposer serves beside the state gauges.
TEST_F(CoordinatorMetricsTest, TheBuildInfoNamesTheRelease) {
  const std::string text = prometheus::TextSerializer().Serialize(metrics_->registry()->Collect());
  EXPECT_THAT(text, HasSubstr(absl::StrCat("muonmesh_build_info{binary=\"coordinator\",version=\"",
                                           MUONMESH_VERSION, "\"} 1")));
}

// Latency is for unary calls: a stream's life (a watch of a day) would
// swamp the percentiles, so streams are counted by how they ended instead.
TEST_F(CoordinatorMetricsTest, StreamsAreCountedApartFromUnaryLatencies) {
  metrics_->OnRpc("/muonmesh.v1.Jobs/GetJob", 0, 0.002);
  metrics_->OnRpc("/muonmesh.v1.Jobs/WatchJob", 1, 3600.0, /*stream=*/true);
  metrics_->OnRpc("/muonmesh.v1.Jobs/WatchJob", 1, 60.0, /*stream=*/true);
  const std::string text = prometheus::TextSerializer().Serialize(metrics_->registry()->Collect());
  EXPECT_THAT(text, HasSubstr("muonmesh_rpc_duration_seconds_count{code=\"OK\","
                              "method=\"/muonmesh.v1.Jobs/GetJob\"} 1"));
  EXPECT_THAT(text, HasSubstr("muonmesh_rpc_streams_total{code=\"CANCELLED\","
                              "method=\"/muonmesh.v1.Jobs/WatchJob\"} 2"));
  EXPECT_THAT(text, ::testing::Not(
                        HasSubstr("muonmesh_rpc_duration_seconds_count{code=\"CANCELLED\"")));
}

TEST_F(CoordinatorMetricsTest, TheScrapePassesPromtool) {
  AddWorker("w0");
  const std::string job = Submit("scraped", 1, "6, 16, 3");
  const std::string text = prometheus::TextSerializer().Serialize(metrics_->Collect());
  EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", kGauge, " gauge")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(kGauge, "{job_id=\"", job, "\"} ")));
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed";
  }
  const std::string file = ::testing::TempDir() + "/coordinator_metrics.txt";
  std::ofstream(file) << text;
  FILE* pipe = ::popen(("promtool check metrics < " + file + " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  EXPECT_EQ(::pclose(pipe), 0) << out << "\n" << text;
}

}  // namespace
}  // namespace muonmesh::coordinator
