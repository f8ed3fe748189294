// The one mapping from a job's model section to its parameter list, as both
// the coordinator (a JobSpec, synthetic inline) and the workers (a resolved
// job file, synthetic by path) call it.

#include "proto/job/model_specs.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "proto/job/job.h"

namespace muonmesh::job {
namespace {

namespace fs = std::filesystem;

std::string TempDir() {
  const fs::path dir = fs::path(::testing::TempDir()) /
                       ::testing::UnitTest::GetInstance()->current_test_info()->name();
  fs::create_directories(dir);
  return dir.string();
}

TEST(ModelSpecsTest, MlpSpecFollowsTheDims) {
  v1::ModelConfig model;
  for (int64_t d : {6, 5, 3}) model.mutable_mlp()->add_dims(d);
  absl::StatusOr<plan::ModelSpec> spec = ModelSpecOf(model, 1, "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  // Layer i maps d_i to d_{i+1}: weight [d_{i+1}, d_i] on Muon, bias on AdamW.
  ASSERT_EQ(spec->units.size(), 2u);
  EXPECT_EQ(spec->units[0].params[0].shape, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(spec->units[0].params[0].optimizer, "muon");
  EXPECT_EQ(spec->units[1].params[0].shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(spec->units[1].params[1].shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(spec->units[1].params[1].optimizer, "adamw");
}

TEST(ModelSpecsTest, NoModelNamesTheField) {
  absl::StatusOr<plan::ModelSpec> spec = ModelSpecOf(v1::ModelConfig(), 1, "");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(spec.status().message().find("model"), std::string::npos);
}

// A job file read by a worker (spec by path) and the same job as the
// coordinator sees it (spec inline) give one spec, scaled and split by EP.
TEST(ModelSpecsTest, SyntheticByPathEqualsInline) {
  const std::string dir = TempDir();
  std::ofstream(dir + "/spec.yaml")
      << "name: tiny\nunits:\n"
      << "- {name: a, params: [{name: w, shape: [8, 4], optimizer: muon}]}\n"
      << "- {name: moe, params: [{name: experts.w1, shape: [4, 6, 8], optimizer: muon, "
         "expert: true}]}\n";
  std::ofstream(dir + "/job.yaml")
      << "name: synth\nworld_size: 2\nparallelism: {expert_model_parallel_size: 2}\n"
      << "model: {synthetic: {spec: spec.yaml, scale: 0.5}}\n"
      << "training: {steps: 1, global_batch_size: 2}\noutput: {dir: " << dir << "/out}\n";
  absl::StatusOr<ResolvedJob> job = LoadResolvedJob(dir + "/job.yaml");
  ASSERT_TRUE(job.ok()) << job.status();
  absl::StatusOr<plan::ModelSpec> by_path = ModelSpecOf(*job);
  ASSERT_TRUE(by_path.ok()) << by_path.status();
  // Every dim halved (rounded, at least 1); the expert stack's E is
  // scaled, too, then split over EP = 2 (synthetic.h's shapes rule).
  ASSERT_EQ(by_path->units.size(), 2u);
  EXPECT_EQ(by_path->units[0].params[0].shape, (std::vector<int64_t>{4, 2}));
  // E = 4 halves to 2, a multiple of EP already.
  EXPECT_EQ(by_path->units[1].params[0].shape, (std::vector<int64_t>{2, 3, 4}));

  v1::ModelConfig inline_model = job->model;
  v1::ModelSpec* m = inline_model.mutable_synthetic()->mutable_model();
  m->set_name("tiny");
  v1::UnitSpec* a = m->add_units();
  a->set_name("a");
  v1::ParamSpec* w = a->add_params();
  w->set_name("w");
  w->add_shape(8);
  w->add_shape(4);
  w->set_optimizer("muon");
  v1::UnitSpec* moe = m->add_units();
  moe->set_name("moe");
  v1::ParamSpec* e = moe->add_params();
  e->set_name("experts.w1");
  for (int64_t d : {4, 6, 8}) e->add_shape(d);
  e->set_optimizer("muon");
  e->set_expert(true);
  absl::StatusOr<plan::ModelSpec> inlined = ModelSpecOf(inline_model, 2, "");
  ASSERT_TRUE(inlined.ok()) << inlined.status();
  ASSERT_EQ(inlined->units.size(), by_path->units.size());
  for (size_t u = 0; u < inlined->units.size(); ++u) {
    ASSERT_EQ(inlined->units[u].params.size(), by_path->units[u].params.size());
    for (size_t p = 0; p < inlined->units[u].params.size(); ++p) {
      EXPECT_EQ(inlined->units[u].params[p].shape, by_path->units[u].params[p].shape);
      EXPECT_EQ(inlined->units[u].params[p].name, by_path->units[u].params[p].name);
    }
  }
}

TEST(ModelSpecsTest, SyntheticWithoutSpecIsRefused) {
  v1::ModelConfig model;
  model.mutable_synthetic()->set_scale(1.0);
  absl::StatusOr<plan::ModelSpec> spec = ModelSpecOf(model, 1, "");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(spec.status().message().find("model.synthetic"), std::string::npos);
}

}  // namespace
}  // namespace muonmesh::job
