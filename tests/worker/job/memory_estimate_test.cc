// A rank's memory estimate (worker/job/memory_estimate.h): with gradient
// accumulation the step holds one micro-batch's activations, named by
// training.micro_batch_size, and the rest of the estimate does not change;
// Gloo on CUDA stages through host memory; units held for the backward pass
// count the gathered model.

#include "worker/job/memory_estimate.h"

#include <filesystem>
#include <fstream>
#include <functional>
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

// The training phase's item for `field` of an mlp [64, 32, 8] job on 2
// ranks of `device` with the communication section `communication` ("" for
// none), or nullopt; and the phase's total.
struct TrainingItem {
  std::optional<MemoryItem> item;
  double phase_bytes = 0;
};

TrainingItem FindTrainingItem(const std::string& device, const std::string& communication,
                              const std::string& field) {
  const std::string dir = ::testing::TempDir() + "/memory_item_" + device + "_" +
                          std::to_string(std::hash<std::string>()(communication));
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/job.yaml") << absl::StrCat(
      "name: m\nworld_size: 2\ndevice: ", device, "\nmodel: {mlp: {dims: [64, 32, 8]}}\n",
      "data: {teacher: {samples: 64}}\n", "training: {steps: 1, global_batch_size: 16}\n",
      communication.empty() ? "" : absl::StrCat("communication: {", communication, "}\n"),
      "output: {dir: ", dir, "/out}\n");
  absl::StatusOr<job::ResolvedJob> job = job::LoadResolvedJob(dir + "/job.yaml");
  EXPECT_TRUE(job.ok()) << job.status();
  if (!job.ok()) return {};
  absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(*job);
  EXPECT_TRUE(input.ok()) << input.status();
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(*input);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  TrainingItem out;
  for (const MemoryPhase& phase : EstimateRankMemory(*job, *plan, 0, {}).phases) {
    if (phase.name != "training") continue;
    out.phase_bytes = phase.bytes();
    for (const MemoryItem& item : phase.items) {
      if (item.field == field) out.item = item;
    }
  }
  return out;
}

TrainingItem StagingItem(const std::string& backend) {
  return FindTrainingItem("cuda", backend.empty() ? "" : "backend: " + backend,
                          "communication.backend");
}

// The mlp's weights and biases, fp32.
constexpr double kMlpBytes = 4.0 * (64 * 32 + 32 + 32 * 8 + 8);

// Gloo on a CUDA job stages collectives through pinned host memory: the
// estimate counts a buffer at least as large as the whole model's fp32
// weights (the after-step gather of this small model is one bucket), and
// only then.
TEST(MemoryEstimateTest, GlooOnCudaCountsTheHostStagingBuffer) {
  const TrainingItem nccl = StagingItem("");
  const TrainingItem explicit_nccl = StagingItem("nccl");
  const TrainingItem gloo = StagingItem("gloo");
  EXPECT_FALSE(nccl.item.has_value());
  EXPECT_FALSE(explicit_nccl.item.has_value());
  ASSERT_TRUE(gloo.item.has_value());
  EXPECT_GE(gloo.item->bytes, kMlpBytes);
  EXPECT_NE(gloo.item->what.find("pinned host"), std::string::npos) << gloo.item->what;
  EXPECT_DOUBLE_EQ(gloo.phase_bytes - nccl.phase_bytes, gloo.item->bytes);
}

// Units held gathered from the forward pass to the backward one
// (communication.reshard_after_forward false, or unset with the model in
// one bucket): the estimate counts the whole model's tensors, gathered, on
// every rank, and only then.
TEST(MemoryEstimateTest, UnitsHeldForTheBackwardCountTheGatheredModel) {
  for (const char* device : {"cpu", "cuda"}) {
    SCOPED_TRACE(device);
    const std::string field = "communication.reshard_after_forward";
    const TrainingItem plain = FindTrainingItem(device, "", field);
    const TrainingItem again = FindTrainingItem(device, "reshard_after_forward: true", field);
    const TrainingItem held = FindTrainingItem(device, "reshard_after_forward: false", field);
    // A bucket smaller than the model: unset reshards.
    const TrainingItem split = FindTrainingItem(device, "bucket_bytes: 4096", field);
    EXPECT_FALSE(again.item.has_value());
    EXPECT_FALSE(split.item.has_value());
    ASSERT_TRUE(held.item.has_value());
    ASSERT_TRUE(plain.item.has_value());
    EXPECT_DOUBLE_EQ(held.item->bytes, kMlpBytes);
    EXPECT_DOUBLE_EQ(plain.item->bytes, kMlpBytes);
    EXPECT_DOUBLE_EQ(held.phase_bytes - again.phase_bytes, kMlpBytes);
    EXPECT_DOUBLE_EQ(plain.phase_bytes, held.phase_bytes);
  }
}

}  // namespace
}  // namespace muonmesh::worker
