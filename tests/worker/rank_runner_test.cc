// RunRank in-process, on a plan that did not come from its job (as a
// coordinator of another version, or a forged one, could send): a plan for
// another geometry, or priced for another thread count than the job's
// training.threads_per_rank, is refused naming what differs, before
// OpenBLAS's thread count or any output changes; the job's own plan runs on
// the job's threads.

#include "worker/rank_runner.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/file_store.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"
#include "worker/math/blas_threads.h"
#include "worker/runtime/trainer.h"
#include "worker/standalone.h"
#include "worker/workload_factory.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class RankRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/rank_runner_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A one-rank MLP job on `threads` OpenBLAS threads, its outputs in out/.
  // `extra`: more of the job file (an init section, say).
  job::ResolvedJob Job(int threads, const std::string& extra = "") {
    const std::string path = dir_ + "/job.yaml";
    std::ofstream(path) << "name: threads\nworld_size: 1\nmodel: {mlp: {dims: [4, 2]}}\n"
                        << "training: {steps: 1, global_batch_size: 2, threads_per_rank: "
                        << threads << "}\noutput: {dir: " << dir_ << "/out}\n"
                        << extra;
    absl::StatusOr<job::ResolvedJob> job = job::LoadResolvedJob(path);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *std::move(job) : job::ResolvedJob{};
  }

  plan::Plan PlanOf(const job::ResolvedJob& job) {
    absl::StatusOr<plan::Plan> plan = PlanJob(job);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *std::move(plan) : plan::Plan{};
  }

  // Runs rank 0 of `job` with `plan` through a fresh store; the lines it
  // printed go to lines_.
  absl::Status Run(const job::ResolvedJob& job, const plan::Plan& plan, const std::string& store,
                   bool resume = false) {
    absl::StatusOr<std::unique_ptr<comm::FileStore>> s = comm::FileStore::Open(dir_ + "/" + store);
    if (!s.ok()) return s.status();
    RankOptions options;
    options.resume = resume;
    options.group_prefix = "threads/" + store;
    RankHooks hooks;
    hooks.out = [this](const std::string& line) { lines_.push_back(line); };
    return RunRank(job, plan, **s, options, hooks);
  }

  std::string dir_;
  std::vector<std::string> lines_;
};

TEST_F(RankRunnerTest, APlanPricedForOtherThreadsIsRefusedBeforeAnythingChanges) {
  const job::ResolvedJob job = Job(2);
  plan::Plan plan = PlanOf(job);
  ASSERT_EQ(plan.config.threads_per_rank, 2);
  plan.config.threads_per_rank = 3;
  math::SetBlasThreads(1);
  const absl::Status st = Run(job, plan, "store");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("priced for 3 threads"));
  EXPECT_THAT(st.message(), HasSubstr("training.threads_per_rank is 2"));
  EXPECT_EQ(math::BlasThreads(), 1);
  EXPECT_FALSE(fs::exists(dir_ + "/out"));
  EXPECT_TRUE(lines_.empty());
}

// A plan made for another job's geometry (another world size, a domain of
// another size) is refused naming what differs, before anything is sized
// by it.
TEST_F(RankRunnerTest, APlanForAnotherGeometryIsRefused) {
  const job::ResolvedJob job = Job(1);
  plan::Plan plan = PlanOf(job);
  plan::Plan other = plan;
  other.config.world_size = 2;
  absl::Status st = Run(job, other, "store");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("the plan was not made for this job: world_size 2 (the "
                                      "job's: 1)"));
  other = plan;
  other.dense.size = 0;
  st = Run(job, other, "store");
  EXPECT_THAT(st.message(), HasSubstr("dense domain size 0 (the job's: 1)"));
  other = plan;
  other.config.ns_steps = 7;
  st = Run(job, other, "store");
  EXPECT_THAT(st.message(), HasSubstr("ns_steps 7 (the job's: 5)"));
  // A plan that re-gathers the units for the backward pass where the job
  // holds them (its small model fits one bucket: communication.
  // reshard_after_forward unset) counts bytes the runtime would not send.
  ASSERT_FALSE(job.reshard_after_forward);
  other = plan;
  other.config.reshard_after_forward = true;
  st = Run(job, other, "store");
  EXPECT_THAT(st.message(), HasSubstr("reshard_after_forward 1 (the job's: 0)"));
  EXPECT_FALSE(fs::exists(dir_ + "/out"));
}

TEST_F(RankRunnerTest, TheJobsOwnPlanRunsOnTheJobsThreads) {
  const job::ResolvedJob job = Job(2);
  math::SetBlasThreads(2);
  if (math::BlasThreads() < 2) GTEST_SKIP() << "this OpenBLAS runs one thread only";
  math::SetBlasThreads(1);
  const absl::Status st = Run(job, PlanOf(job), "store");
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(math::BlasThreads(), 2);
  EXPECT_THAT(::testing::PrintToString(lines_), HasSubstr("2 threads a rank"));
  math::SetBlasThreads(1);
}

// The summary's optimizer median: the steps after the first (a first step
// slowed by page faults does not count), the middle two averaged.
TEST(MedianAfterFirstTest, LeavesTheFirstStepOut) {
  EXPECT_EQ(internal::MedianAfterFirst({}), 0.0);
  EXPECT_EQ(internal::MedianAfterFirst({7.0}), 7.0);
  EXPECT_EQ(internal::MedianAfterFirst({7000.0, 3.0}), 3.0);
  EXPECT_EQ(internal::MedianAfterFirst({7000.0, 5.0, 1.0, 3.0}), 3.0);
  EXPECT_EQ(internal::MedianAfterFirst({7000.0, 5.0, 1.0, 3.0, 4.0}), 3.5);
}

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A first attempt over the outputs an earlier run left (its metrics and
// export) overwrites none of them: it is refused naming the folder, as an
// error of the job (no restart may resume that earlier run); a resume goes
// on; init.fresh moves them, byte for byte, into out/earlier-<time>/.
// The regression: a resubmit deleted the earlier run's checkpoints.
TEST_F(RankRunnerTest, AFreshStartNeverOverwritesAnEarlierRun) {
  const job::ResolvedJob job = Job(1);
  ASSERT_TRUE(Run(job, PlanOf(job), "first").ok());
  const std::string metrics = dir_ + "/out/metrics/rank-0.jsonl";
  const std::string weights = dir_ + "/out/final.safetensors";
  const std::string first_metrics = Contents(metrics);
  const std::string first_weights = Contents(weights);
  ASSERT_FALSE(first_metrics.empty());
  ASSERT_FALSE(first_weights.empty());

  const absl::Status refused = Run(job, PlanOf(job), "second");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("output.dir: " + dir_ + "/out holds an earlier run"));
  EXPECT_THAT(refused.message(), HasSubstr(weights));
  EXPECT_THAT(refused.message(), HasSubstr("init: {fresh: true}"));
  EXPECT_TRUE(refused.GetPayload(kJobErrorPayload).has_value());
  EXPECT_EQ(Contents(metrics), first_metrics);
  EXPECT_EQ(Contents(weights), first_weights);

  // A resume (a restart of the same job) is not a fresh start.
  EXPECT_TRUE(Run(job, PlanOf(job), "resumed", /*resume=*/true).ok());

  const std::string resumed_metrics = Contents(metrics);
  const job::ResolvedJob fresh = Job(1, "init: {fresh: true}\n");
  ASSERT_TRUE(fresh.fresh_start);
  ASSERT_TRUE(Run(fresh, PlanOf(fresh), "fresh").ok());
  std::vector<fs::path> aside;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_ + "/out")) {
    if (e.path().filename().string().rfind("earlier-", 0) == 0) aside.push_back(e.path());
  }
  ASSERT_EQ(aside.size(), 1u);
  EXPECT_EQ(Contents((aside[0] / "metrics" / "rank-0.jsonl").string()), resumed_metrics);
  EXPECT_TRUE(fs::exists(aside[0] / "final.safetensors"));
  // The fresh run's own outputs, from step 0.
  EXPECT_THAT(Contents(metrics), HasSubstr("\"step\": 0"));
  EXPECT_TRUE(fs::exists(weights));
}

}  // namespace
}  // namespace muonmesh::worker
