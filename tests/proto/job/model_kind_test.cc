// The model-kind registry (proto/job/model_kind.h): every kind of the job
// file's oneof is registered with every part, and the planner's input is one
// translation whether the coordinator makes it from a submitted JobSpec or a
// worker from the resolved job file.

#include "proto/job/model_kind.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "proto/io/message_file.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"

namespace muonmesh::job {
namespace {

namespace fs = std::filesystem;

// The fields of ModelConfig's `kind` oneof, read from the descriptor: what
// a job file may write under model:.
std::set<std::pair<std::string, int>> OneofKinds() {
  const google::protobuf::OneofDescriptor* oneof =
      v1::ModelConfig::descriptor()->FindOneofByName("kind");
  std::set<std::pair<std::string, int>> out;
  for (int i = 0; oneof != nullptr && i < oneof->field_count(); ++i) {
    out.insert({oneof->field(i)->name(), oneof->field(i)->number()});
  }
  return out;
}

TEST(ModelKindTest, EveryKindOfTheJobFileIsRegisteredOnceByItsName) {
  const std::set<std::pair<std::string, int>> oneof = OneofKinds();
  ASSERT_FALSE(oneof.empty());
  std::set<std::pair<std::string, int>> registered;
  for (const ModelKind* kind : ModelKinds()) {
    registered.insert({kind->name, static_cast<int>(kind->proto_case)});
  }
  EXPECT_EQ(registered, oneof);
  EXPECT_EQ(ModelKinds().size(), oneof.size()) << "a kind registered twice";
  for (const auto& [name, number] : oneof) {
    const ModelKind* kind = FindModelKind(static_cast<v1::ModelConfig::KindCase>(number));
    ASSERT_NE(kind, nullptr) << name;
    EXPECT_EQ(kind->name, name);
  }
  EXPECT_EQ(FindModelKind(v1::ModelConfig::KIND_NOT_SET), nullptr);
}

TEST(ModelKindTest, EveryRegistrationHasEveryPart) {
  for (const ModelKind* kind : ModelKinds()) {
    SCOPED_TRACE(kind->name);
    EXPECT_NE(kind->validate, nullptr);
    EXPECT_NE(kind->resolve, nullptr);
    EXPECT_NE(kind->spec, nullptr);
    ASSERT_NE(kind->size_field, nullptr);
    EXPECT_TRUE(absl::StartsWith(kind->size_field, absl::StrCat("model.", kind->name)))
        << kind->size_field;
    // A section that names a file must be able to carry it inline.
    EXPECT_EQ(kind->model_file == nullptr, kind->embed_model_file == nullptr);
    // A kind that reads a corpus says which tokens it takes (the pre-flight).
    EXPECT_EQ(kind->data == DataUse::kCorpus, kind->vocab_size != nullptr);
  }
}

TEST(ModelKindTest, KindListsInMessagesNameEveryKind) {
  const std::string all = AllKindNames();
  for (const ModelKind* kind : ModelKinds()) {
    EXPECT_TRUE(absl::StrContains(all, kind->name)) << all;
    EXPECT_TRUE(absl::StrContains(KindNamesUsing(kind->data), kind->name));
  }
}

// A small valid job of each kind, as a job file would give it.
class PlanInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::path(::testing::TempDir()) /
            ::testing::UnitTest::GetInstance()->current_test_info()->name())
               .string();
    fs::create_directories(dir_);
    std::ofstream(dir_ + "/corpus.txt") << std::string(4096, 'a');
  }

  v1::JobSpec Job(const std::string& model, const std::string& data) {
    v1::JobSpec job;
    const std::string text = absl::StrCat(
        "name: j\nworld_size: 4\nparallelism: {expert_model_parallel_size: 2, "
        "num_distributed_optimizer_instances: 2, outer_dp_sharding_strategy: optim}\n"
        "optimizer: {muon: {ns_steps: 7, coefficients: polar_express}, "
        "owner_assignment: round_robin, muon_buffer_bytes: 4096, "
        "rules: [{pattern: '.*bias.*', optimizer: adamw}]}\n"
        "model: ", model, "\n", data,
        "training: {steps: 1, global_batch_size: 8, threads_per_rank: 1}\n"
        "output: {dir: ", dir_, "/out}\n");
    const std::string path = dir_ + "/job.yaml";
    std::ofstream(path) << text;
    absl::StatusOr<v1::JobSpec> loaded = LoadJobFile(path);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return loaded.ok() ? *loaded : job;
  }

  std::string dir_;
};

void ExpectSameInput(const plan::PlanInput& a, const plan::PlanInput& b) {
  ASSERT_EQ(a.model.units.size(), b.model.units.size());
  for (size_t u = 0; u < a.model.units.size(); ++u) {
    ASSERT_EQ(a.model.units[u].params.size(), b.model.units[u].params.size());
    for (size_t p = 0; p < a.model.units[u].params.size(); ++p) {
      const plan::ParamSpec& x = a.model.units[u].params[p];
      const plan::ParamSpec& y = b.model.units[u].params[p];
      EXPECT_EQ(x.name, y.name);
      EXPECT_EQ(x.shape, y.shape) << x.name;
      EXPECT_EQ(x.optimizer, y.optimizer) << x.name;
      EXPECT_EQ(x.expert, y.expert) << x.name;
    }
  }
  EXPECT_EQ(a.world_size, b.world_size);
  EXPECT_EQ(a.parallelism.expert_model_parallel_size, b.parallelism.expert_model_parallel_size);
  EXPECT_EQ(a.options.owner_assignment, b.options.owner_assignment);
  EXPECT_EQ(a.options.ns_steps, b.options.ns_steps);
  EXPECT_EQ(a.options.ns_algorithm, b.options.ns_algorithm);
  EXPECT_EQ(a.options.ns_coefficients, b.options.ns_coefficients);
  EXPECT_EQ(a.options.device, b.options.device);
  EXPECT_EQ(a.options.muon_wave_budget_bytes, b.options.muon_wave_budget_bytes);
  EXPECT_EQ(a.options.threads_per_rank, b.options.threads_per_rank);
}

// The coordinator plans a submitted JobSpec; each worker resolves the same
// spec and checks the plan against its own input: for every kind the two
// are one.
TEST_F(PlanInputTest, CoordinatorAndWorkerMakeOneInputForEveryKind) {
  const std::pair<const char*, const char*> jobs[] = {
      {"{mlp: {dims: [8, 16, 4]}}", ""},
      {"{moe_mlp: {d_in: 4, d_model: 8, d_expert: 6, num_experts: 4, d_out: 2}}", ""},
      {"{synthetic: {scale: 0.5, model: {name: s, units: [{name: u, params: ["
       "{name: w, shape: [8, 4], optimizer: muon}, "
       "{name: e, shape: [4, 6, 8], optimizer: muon, expert: true}]}]}}}",
       ""},
      {"{gpt: {vocab_size: 256, block_size: 16, n_layer: 1, n_head: 2, n_embd: 8, seq_len: 16}}",
       "data: {text: {train: corpus.txt}}\n"},
      {"{transformer: {vocab_size: 256, seq_len: 16, n_layer: 1, d_model: 16, n_head: 4, "
       "n_kv_head: 2, ffn_hidden: 24}}",
       "data: {text: {train: corpus.txt}}\n"},
  };
  std::set<std::string> covered;
  for (const auto& [model, data] : jobs) {
    SCOPED_TRACE(model);
    const v1::JobSpec spec = Job(model, data);
    absl::StatusOr<ResolvedJob> resolved = ResolveJob(spec, dir_);
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    covered.insert(resolved->kind->name);
    absl::StatusOr<plan::PlanInput> coordinator = PlanInputOf(spec);
    absl::StatusOr<plan::PlanInput> worker = PlanInputOf(*resolved);
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    ASSERT_TRUE(worker.ok()) << worker.status();
    ExpectSameInput(*coordinator, *worker);
    // The job file's settings, not the planner's defaults.
    EXPECT_EQ(worker->options.ns_steps, 7);
    EXPECT_EQ(worker->options.device, "cpu");
    EXPECT_EQ(worker->options.owner_assignment, "round_robin");
    EXPECT_GT(worker->options.muon_wave_budget_bytes, 0);
    // The kind's own spec, with the rules applied on top.
    absl::StatusOr<plan::ModelSpec> spec_only = ModelSpecOf(*resolved);
    ASSERT_TRUE(spec_only.ok()) << spec_only.status();
    EXPECT_EQ(spec_only->units.size(), worker->model.units.size());
  }
  EXPECT_EQ(covered.size(), ModelKinds().size()) << "a kind without a case here";
}

TEST_F(PlanInputTest, AnEmptyDeviceIsTheCpuEverywhere) {
  v1::JobSpec spec = Job("{mlp: {dims: [8, 4]}}", "");
  spec.clear_device();
  EXPECT_EQ(DeviceOf(spec), "cpu");
  absl::StatusOr<ResolvedJob> resolved = ResolveJob(spec, dir_);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->device, "cpu");
  absl::StatusOr<plan::PlanInput> input = PlanInputOf(spec);
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ(input->options.device, "cpu");
}

}  // namespace
}  // namespace muonmesh::job
