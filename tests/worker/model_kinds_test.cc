// The worker side of the model-kind registry: every kind of the job file
// (proto/job/model_kind.h) has a host workload, a memory estimate and a GPU
// form (or its jobs are refused on cuda), and the host workload made for a
// job is that kind's.

#include "worker/model_kinds.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/job/job.h"
#include "proto/job/model_kind.h"
#include "tests/testing/token_shard.h"
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
    if (std::find(std::begin(kGpuFormNames), std::end(kGpuFormNames), kind->name) !=
        std::end(kGpuFormNames)) {
      continue;
    }
    // A kind without a GPU form yet: its jobs must be refused on cuda before
    // any worker sees them, naming the model.
    v1::JobSpec job;
    job.set_device("cuda");
    job.mutable_model()->CopyFrom(v1::ModelConfig());
    const google::protobuf::FieldDescriptor* field =
        v1::ModelConfig::descriptor()->FindFieldByNumber(kind->proto_case);
    ASSERT_NE(field, nullptr);
    job.mutable_model()->GetReflection()->MutableMessage(job.mutable_model(), field);
    bool refused = false;
    for (const plan::FieldViolation& f : job::ValidateJob(job)) {
      refused |= f.field == absl::StrCat("model.", kind->name) &&
                 f.description.find("cuda") != std::string::npos;
    }
    EXPECT_TRUE(refused) << "no GPU form in worker/model/gpu_forms.cc, and device cuda is not "
                            "refused for it";
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

// A token outside the vocabulary fails the workload's making (before any
// step), naming the file and the token, not the step that would read it.
TEST(WorkerModelKindTest, ACorpusTokenOutsideTheVocabularyFailsBeforeAnyStep) {
  const std::string dir = ::testing::TempDir() + "/worker_model_kinds_vocab";
  std::filesystem::create_directories(dir);
  // Token 300 at index 700, well past the first windows, in a vocabulary of 300.
  std::vector<uint16_t> tokens(1000, 7);
  tokens[700] = 300;
  testing::WriteFile(dir, "corpus.bin", testing::Shard(tokens));
  std::ofstream(dir + "/job.yaml")
      << "name: v\nworld_size: 1\n"
      << "model: {gpt: {vocab_size: 300, block_size: 8, n_layer: 1, n_head: 1, n_embd: 8, "
      << "seq_len: 8}}\ndata: {tokens: {train: corpus.bin, val_fraction: 0}}\n"
      << "training: {steps: 1, global_batch_size: 1}\noutput: {dir: " << dir << "/out}\n";
  absl::StatusOr<job::ResolvedJob> job = job::LoadResolvedJob(dir + "/job.yaml");
  ASSERT_TRUE(job.ok()) << job.status();
  absl::StatusOr<std::unique_ptr<Workload>> workload =
      FindWorkerModelKind(job->model.kind_case())->make_workload(*job);
  ASSERT_FALSE(workload.ok());
  const std::string file = (std::filesystem::path(dir) / "corpus.bin").lexically_normal().string();
  EXPECT_EQ(std::string(workload.status().message()),
            "data.tokens.train: " + file + ": token 700 is 300, outside the model's "
            "vocabulary [0, 300)");
}

}  // namespace
}  // namespace muonmesh::worker
