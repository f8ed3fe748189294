// A rank's memory estimate (worker/job/memory_estimate.h) with gradient
// accumulation: the step holds one micro-batch's activations, named by
// training.micro_batch_size, and the rest of the estimate does not change.

#include "worker/job/memory_estimate.h"

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/plan/planner.h"
#include "gtest/gtest.h"
#include "proto/job/model_specs.h"

namespace muonmesh::worker {
namespace {

// The training phase's activation item, and the phase's total.
struct Activations {
  MemoryItem item;
  double phase_bytes = 0;
};

Activations TrainingActivations(int64_t micro) {
  const std::string dir = ::testing::TempDir() + "/memory_estimate_" + std::to_string(micro);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/job.yaml") << absl::StrCat(
      "name: m\nworld_size: 2\nmodel: {mlp: {dims: [6, 5, 3]}}\n",
      "data: {teacher: {samples: 64}}\n",
      "training: {steps: 1, global_batch_size: 16, micro_batch_size: ", micro, "}\n",
      "output: {dir: ", dir, "/out}\n");
  absl::StatusOr<job::ResolvedJob> job = job::LoadResolvedJob(dir + "/job.yaml");
  EXPECT_TRUE(job.ok()) << job.status();
  absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(*job);
  EXPECT_TRUE(input.ok()) << input.status();
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(*input);
  EXPECT_TRUE(plan.ok()) << plan.status();
  const MemoryEstimate estimate = EstimateRankMemory(*job, *plan, 0, {});
  Activations out;
  for (const MemoryPhase& phase : estimate.phases) {
    for (const MemoryItem& item : phase.items) {
      if (item.what.find("activations") == std::string::npos) continue;
      out.item = item;
      out.phase_bytes = phase.bytes();
    }
  }
  return out;
}

TEST(MemoryEstimateTest, AccumulationHoldsOneMicroBatchOfActivations) {
  const Activations whole = TrainingActivations(0);  // the local batch of 8
  const Activations micro = TrainingActivations(2);
  EXPECT_EQ(whole.item.field, "training.global_batch_size");
  EXPECT_EQ(micro.item.field, "training.micro_batch_size");
  EXPECT_NE(micro.item.what.find("one micro-batch"), std::string::npos) << micro.item.what;
  // The mlp's activations are linear in the samples: 8 -> 2 is a quarter.
  ASSERT_GT(whole.item.bytes, 0);
  EXPECT_DOUBLE_EQ(micro.item.bytes, whole.item.bytes / 4);
  EXPECT_DOUBLE_EQ(whole.phase_bytes - micro.phase_bytes, whole.item.bytes - micro.item.bytes);
}

// The training phase's communication.backend item of a device cuda mlp
// [64, 32, 8] job on 2 ranks with `backend` ("" for unset), or nullopt; and
// the phase's total without it.
struct Staging {
  std::optional<MemoryItem> item;
  double phase_bytes = 0;
};

Staging StagingItem(const std::string& backend) {
  const std::string dir = ::testing::TempDir() + "/memory_staging_" + backend;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/job.yaml") << absl::StrCat(
      "name: m\nworld_size: 2\ndevice: cuda\nmodel: {mlp: {dims: [64, 32, 8]}}\n",
      "data: {teacher: {samples: 64}}\n", "training: {steps: 1, global_batch_size: 16}\n",
      backend.empty() ? "" : absl::StrCat("communication: {backend: ", backend, "}\n"),
      "output: {dir: ", dir, "/out}\n");
  absl::StatusOr<job::ResolvedJob> job = job::LoadResolvedJob(dir + "/job.yaml");
  EXPECT_TRUE(job.ok()) << job.status();
  if (!job.ok()) return {};
  absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(*job);
  EXPECT_TRUE(input.ok()) << input.status();
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(*input);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  Staging out;
  for (const MemoryPhase& phase : EstimateRankMemory(*job, *plan, 0, {}).phases) {
    if (phase.name != "training") continue;
    out.phase_bytes = phase.bytes();
    for (const MemoryItem& item : phase.items) {
      if (item.field == "communication.backend") out.item = item;
    }
  }
  return out;
}

// Gloo on a CUDA job stages collectives through pinned host memory: the
// estimate counts a buffer at least as large as the whole model's fp32
// weights (the after-step gather of this small model is one bucket), and
// only then.
TEST(MemoryEstimateTest, GlooOnCudaCountsTheHostStagingBuffer) {
  const Staging nccl = StagingItem("");
  const Staging explicit_nccl = StagingItem("nccl");
  const Staging gloo = StagingItem("gloo");
  EXPECT_FALSE(nccl.item.has_value());
  EXPECT_FALSE(explicit_nccl.item.has_value());
  ASSERT_TRUE(gloo.item.has_value());
  const double model_bytes = 4.0 * (64 * 32 + 32 + 32 * 8 + 8);
  EXPECT_GE(gloo.item->bytes, model_bytes);
  EXPECT_NE(gloo.item->what.find("pinned host"), std::string::npos) << gloo.item->what;
  EXPECT_DOUBLE_EQ(gloo.phase_bytes - nccl.phase_bytes, gloo.item->bytes);
}

}  // namespace
}  // namespace muonmesh::worker
