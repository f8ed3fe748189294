// The worker side of the model-kind registry: every kind of the job file
// (proto/job/model_kind.h) has a host workload, a memory estimate and a GPU
// form, and the host workload made for a job is that kind's.

#include "worker/model_kinds.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "proto/job/job.h"
#include "proto/job/model_kind.h"
#include "worker/model/gpu_forms.h"

namespace muonmesh::worker {
namespace {

TEST(WorkerModelKindTest, EveryKindOfTheJobFileHasEveryWorkerPart) {
  for (const job::ModelKind* kind : job::ModelKinds()) {
    SCOPED_TRACE(kind->name);
    const WorkerModelKind* worker = FindWorkerModelKind(kind->proto_case);
    ASSERT_NE(worker, nullptr) << "no registration in worker/model_kinds.cc";
    EXPECT_NE(worker->make_workload, nullptr);
    EXPECT_NE(worker->memory, nullptr);
    EXPECT_NE(std::find(std::begin(kGpuFormNames), std::end(kGpuFormNames), kind->name),
              std::end(kGpuFormNames))
        << "no GPU form in worker/model/gpu_forms.cc";
  }
  EXPECT_EQ(WorkerModelKinds().size(), job::ModelKinds().size())
      << "a worker registration without a job-file kind";
}

// The registry's workload is the kind's: an mlp job's parameters are the
// mlp's, and its memory names the kind's size field.
TEST(WorkerModelKindTest, TheWorkloadAndMemoryFollowTheJob) {
  const std::string dir = ::testing::TempDir() + "/worker_model_kinds";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/job.yaml")
      << "name: k\nworld_size: 1\nmodel: {mlp: {dims: [6, 5, 3]}}\n"
      << "data: {teacher: {samples: 64}}\ntraining: {steps: 1, global_batch_size: 4}\n"
      << "output: {dir: " << dir << "/out}\n";
  absl::StatusOr<job::ResolvedJob> job = job::LoadResolvedJob(dir + "/job.yaml");
  ASSERT_TRUE(job.ok()) << job.status();
  const WorkerModelKind* kind = FindWorkerModelKind(job->model.kind_case());
  ASSERT_NE(kind, nullptr);
  absl::StatusOr<std::unique_ptr<Workload>> workload = kind->make_workload(*job);
  ASSERT_TRUE(workload.ok()) << workload.status();
  EXPECT_EQ((*workload)->num_samples(), 64);
  const WorkloadMemory memory = kind->memory(*job, 4, {});
  ASSERT_FALSE(memory.setup.empty());
  // The teacher's weights: (6 + 1) 5 + (5 + 1) 3 floats.
  bool teacher = false;
  for (const MemoryItem& item : memory.setup) {
    if (item.what == "teacher weights") {
      teacher = true;
      EXPECT_EQ(item.field, "model.mlp.dims");
      EXPECT_EQ(item.bytes, 4.0 * (7 * 5 + 6 * 3));
    }
  }
  EXPECT_TRUE(teacher);
}

}  // namespace
}  // namespace muonmesh::worker
