#include "proto/job/job.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/config.pb.h"
#include "worker/math/adamw.h"
#include "worker/math/muon.h"
#include "proto/job/optimizer_rules.h"
#include "proto/job/model_kind.h"
#include "proto/job/model_specs.h"
#include "core/plan/planner.h"
#include "core/plan/validate.h"
#include "proto/io/message_file.h"

namespace muonmesh::worker {
namespace {

namespace fs = std::filesystem;
using ::testing::Contains;
using ::testing::DoubleNear;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;
using ::testing::UnorderedElementsAreArray;

// The job file of docs/architecture.md §2, verbatim.
constexpr char kDesignJob[] = R"(name: mlp-hfsdp
world_size: 4
device: cpu                      # or cuda
parallelism:
  data_parallel_sharding_strategy: optim_grads_params
  num_distributed_optimizer_instances: 2
  outer_dp_sharding_strategy: optim
  expert_model_parallel_size: 1
model:
  mlp: {dims: [32, 64, 64, 8]}   # or moe_mlp: {...}, or synthetic: {spec: FILE, scale: 0.125}
init: {seed: 7}                  # or {safetensors: FILE}
data: {teacher: {seed: 11, samples: 4096}}   # or {safetensors: FILE} with tensors x, y
optimizer:
  muon: {lr: 0.02, momentum: 0.95, nesterov: true, ns_steps: 5, weight_decay: 0.0, scale: original}
  adamw: {lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1.0e-8, weight_decay: 0.0}
  owner_assignment: lpt          # or round_robin, allgather
training: {steps: 20, global_batch_size: 64, checkpoint_every: 5, max_restarts: 1}
output: {dir: runs/mlp-hfsdp, export: runs/mlp-hfsdp/final.safetensors}
)";

class TempDir {
 public:
  explicit TempDir(const std::string& suffix = "") {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::path(::testing::TempDir()) / absl::StrCat("job_test_", ::getpid(), "_",
                                                          info->test_suite_name(), "_",
                                                          info->name(), suffix);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string Write(const std::string& name, const std::string& text) const {
    const std::string p = (path_ / name).string();
    std::ofstream(p) << text;
    return p;
  }
  std::string dir() const { return path_.string(); }

 private:
  fs::path path_;
};

v1::JobSpec DesignJob() {
  TempDir dir("_design");
  absl::StatusOr<v1::JobSpec> job = job::LoadJobFile(dir.Write("job.yaml", kDesignJob));
  EXPECT_TRUE(job.ok()) << job.status();
  return job.ok() ? *job : v1::JobSpec();
}

std::vector<std::string> Fields(const std::vector<plan::FieldViolation>& violations) {
  std::vector<std::string> fields;
  for (const plan::FieldViolation& f : violations) fields.push_back(f.field);
  return fields;
}

// ---------------------------------------------------------------- resolving

TEST(JobTest, DesignExampleResolvesWithTheValuesWritten) {
  TempDir dir;
  const std::string path = dir.Write("job.yaml", kDesignJob);
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name, "mlp-hfsdp");
  EXPECT_EQ(r->world_size, 4);
  EXPECT_EQ(r->device, "cpu");
  EXPECT_EQ(r->parallelism.data_parallel_sharding_strategy, "optim_grads_params");
  EXPECT_EQ(r->parallelism.num_distributed_optimizer_instances, 2);
  EXPECT_EQ(r->parallelism.outer_dp_sharding_strategy, "optim");
  EXPECT_EQ(r->parallelism.expert_model_parallel_size, 1);
  ASSERT_NE(r->kind, nullptr);
  EXPECT_STREQ(r->kind->name, "mlp");
  EXPECT_THAT(std::get<job::MlpModel>(r->model_form).dims, ElementsAre(32, 64, 64, 8));
  ASSERT_TRUE(r->init_seed.has_value());
  EXPECT_EQ(*r->init_seed, 7u);
  EXPECT_EQ(r->init_safetensors, "");
  ASSERT_TRUE(r->teacher_seed.has_value());
  EXPECT_EQ(*r->teacher_seed, 11u);
  EXPECT_EQ(r->teacher_samples, 4096);
  EXPECT_EQ(r->data_safetensors, "");
  EXPECT_EQ(r->muon.lr, 0.02);
  EXPECT_EQ(r->muon.momentum, 0.95);
  EXPECT_TRUE(r->muon.nesterov);
  EXPECT_EQ(r->muon.ns.steps, 5);
  EXPECT_EQ(r->muon.weight_decay, 0.0);
  EXPECT_EQ(r->muon.scale, optim::MuonScale::kOriginal);
  EXPECT_EQ(r->muon.ns.coefficients, optim::NsCoefficients::kQuintic);
  EXPECT_EQ(r->adamw.lr, 0.001);
  EXPECT_EQ(r->adamw.beta1, 0.9);
  EXPECT_EQ(r->adamw.beta2, 0.999);
  EXPECT_EQ(r->adamw.eps, 1.0e-8);
  EXPECT_EQ(r->adamw.weight_decay, 0.0);
  EXPECT_EQ(r->owner_assignment, "lpt");
  EXPECT_THAT(r->optimizer_rules, IsEmpty());
  EXPECT_EQ(r->steps, 20);
  EXPECT_EQ(r->global_batch_size, 64);
  EXPECT_EQ(r->checkpoint_every, 5);
  EXPECT_EQ(r->max_restarts, 1);
  // Outputs are relative to the job file's folder.
  EXPECT_EQ(r->output_dir, dir.dir() + "/runs/mlp-hfsdp");
  EXPECT_EQ(r->export_path, dir.dir() + "/runs/mlp-hfsdp/final.safetensors");
}

TEST(JobTest, JsonFileResolvesLikeYaml) {
  TempDir dir;
  const std::string json = R"({
    "name": "mlp-hfsdp", "world_size": 4, "device": "cpu",
    "parallelism": {"data_parallel_sharding_strategy": "optim_grads_params",
                    "num_distributed_optimizer_instances": 2,
                    "outer_dp_sharding_strategy": "optim", "expert_model_parallel_size": 1},
    "model": {"mlp": {"dims": [32, 64, 64, 8]}},
    "init": {"seed": 7}, "data": {"teacher": {"seed": 11, "samples": 4096}},
    "optimizer": {"muon": {"lr": 0.02, "momentum": 0.95, "nesterov": true, "ns_steps": 5,
                           "weight_decay": 0.0, "scale": "original"},
                  "adamw": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1.0e-8,
                            "weight_decay": 0.0},
                  "owner_assignment": "lpt"},
    "training": {"steps": 20, "global_batch_size": 64, "checkpoint_every": 5, "max_restarts": 1},
    "output": {"dir": "runs/mlp-hfsdp", "export": "runs/mlp-hfsdp/final.safetensors"}})";
  absl::StatusOr<v1::JobSpec> from_json = job::LoadJobFile(dir.Write("job.json", json));
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  EXPECT_EQ(from_json->SerializeAsString(), DesignJob().SerializeAsString());
}

constexpr char kMinimalJob[] = R"(
name: tiny
world_size: 2
model: {mlp: {dims: [4, 2]}}
training: {steps: 1, global_batch_size: 2}
)";

TEST(JobTest, ThreadsPerRankIsRead) {
  TempDir dir;
  std::string text = kMinimalJob;
  const std::string batch = "global_batch_size: 2";
  text.insert(text.find(batch) + batch.size(), ", threads_per_rank: 4");
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(dir.Write("threads.yaml", text));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->threads_per_rank, 4);
}

TEST(JobTest, MinimalJobGetsTheDocumentedDefaults) {
  TempDir dir;
  const std::string path = dir.Write("minimal.yaml", kMinimalJob);
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->device, "cpu");
  EXPECT_EQ(r->parallelism.data_parallel_sharding_strategy, "");
  EXPECT_EQ(r->parallelism.num_distributed_optimizer_instances, 0);
  EXPECT_EQ(r->owner_assignment, "lpt");
  // Muon: lr 0.02, momentum 0.95, nesterov, 5 quintic steps, no weight decay
  // (optim::MuonOptions' own defaults differ: lr 1e-3, weight_decay 0.1).
  EXPECT_EQ(r->muon.lr, 0.02);
  EXPECT_EQ(r->muon.momentum, 0.95);
  EXPECT_TRUE(r->muon.nesterov);
  EXPECT_EQ(r->muon.ns.steps, 5);
  EXPECT_EQ(r->muon.ns.coefficients, optim::NsCoefficients::kQuintic);
  EXPECT_EQ(r->muon.weight_decay, 0.0);
  EXPECT_EQ(r->muon.scale, optim::MuonScale::kOriginal);
  // AdamW: torch's defaults except weight_decay 0 (torch: 1e-2).
  EXPECT_EQ(r->adamw.lr, 1e-3);
  EXPECT_EQ(r->adamw.beta1, 0.9);
  EXPECT_EQ(r->adamw.beta2, 0.999);
  EXPECT_EQ(r->adamw.eps, 1e-8);
  EXPECT_EQ(r->adamw.weight_decay, 0.0);
  ASSERT_TRUE(r->init_seed.has_value());
  EXPECT_EQ(*r->init_seed, 0u);
  ASSERT_TRUE(r->teacher_seed.has_value());
  EXPECT_EQ(*r->teacher_seed, 0u);
  EXPECT_EQ(r->teacher_samples, 4096);
  EXPECT_EQ(r->checkpoint_every, 0);
  EXPECT_EQ(r->max_restarts, 0);
  EXPECT_EQ(r->threads_per_rank, 1);
  EXPECT_EQ(r->keep_checkpoints, 2);
  EXPECT_FALSE(r->fresh_start);
  EXPECT_EQ(r->output_dir, dir.dir() + "/runs/tiny");
  EXPECT_EQ(r->export_path, dir.dir() + "/runs/tiny/final.safetensors");
  // The resolved options pass the numerics' own validation.
  EXPECT_TRUE(optim::ValidateMuonOptions(r->muon).ok());
  EXPECT_TRUE(optim::ValidateAdamWOptions(r->adamw).ok());
}

TEST(JobTest, ResolvesEveryNonDefaultChoice) {
  TempDir dir;
  dir.Write("spec.json", "{}");
  const std::string abs_init = dir.Write("init.safetensors", "");
  v1::JobSpec job = DesignJob();
  job.set_device("cuda");
  job.mutable_model()->mutable_synthetic()->set_spec("spec.json");
  job.mutable_model()->mutable_synthetic()->set_scale(0.125);
  job.clear_data();
  job.mutable_init()->set_safetensors(abs_init);
  auto* muon = job.mutable_optimizer()->mutable_muon();
  muon->set_nesterov(false);
  muon->set_scale("match_rms_adamw");
  muon->set_coefficients("polar_express");
  muon->set_ns_steps(8);
  muon->set_weight_decay(0.1);
  job.mutable_optimizer()->set_owner_assignment("allgather");
  auto* rule = job.mutable_optimizer()->add_rules();
  rule->set_pattern(".*\\.bias");
  rule->set_optimizer("adamw");
  rule = job.mutable_optimizer()->add_rules();
  rule->set_pattern("embed.*");
  rule->set_optimizer("muon");
  job.mutable_output()->set_dir("/abs/out");
  job.mutable_output()->clear_export_();

  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, dir.dir());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->device, "cuda");
  ASSERT_NE(r->kind, nullptr);
  EXPECT_STREQ(r->kind->name, "synthetic");
  EXPECT_EQ(std::get<job::SyntheticModel>(r->model_form).spec_path, dir.dir() + "/spec.json");
  EXPECT_EQ(std::get<job::SyntheticModel>(r->model_form).scale, 0.125);
  ASSERT_TRUE(r->model_file.has_value());
  EXPECT_EQ(r->model_file->path, dir.dir() + "/spec.json");
  EXPECT_FALSE(r->init_seed.has_value());
  EXPECT_EQ(r->init_safetensors, abs_init);  // absolute paths are kept
  EXPECT_FALSE(r->muon.nesterov);
  EXPECT_EQ(r->muon.scale, optim::MuonScale::kMatchRmsAdamW);
  EXPECT_EQ(r->muon.ns.coefficients, optim::NsCoefficients::kPolarExpress);
  EXPECT_EQ(r->muon.ns.steps, 8);
  EXPECT_EQ(r->muon.weight_decay, 0.1);
  EXPECT_EQ(r->owner_assignment, "allgather");
  using Rule = job::OptimizerRule;
  EXPECT_THAT(r->optimizer_rules, ElementsAre(Rule{".*\\.bias", "adamw"}, Rule{"embed.*", "muon"}));
  EXPECT_EQ(r->output_dir, "/abs/out");
  EXPECT_EQ(r->export_path, "/abs/out/final.safetensors");
}

// communication.bucket_bytes: unset is 25 MiB, 0 stays 0 (one unit a
// collective), a value is taken as given.
TEST(JobTest, BucketBytesDefaultTo25MiBAndZeroMeansOneUnit) {
  absl::StatusOr<job::ResolvedJob> plain = job::ResolveJob(DesignJob(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->bucket_bytes, 25 * 1024 * 1024);
  // The job as it will run says so.
  EXPECT_EQ(job::FilledSpec(*plain).communication().bucket_bytes(), 25 * 1024 * 1024);
  for (int64_t bytes : {int64_t{0}, int64_t{4096}}) {
    v1::JobSpec job = DesignJob();
    job.mutable_communication()->set_bucket_bytes(bytes);
    absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->bucket_bytes, bytes);
  }
}

// communication.backend: unset is nccl on cuda and gloo on cpu; gloo on
// cuda is taken as given (ranks that share a GPU).
TEST(JobTest, CommBackendDefaultsByDevice) {
  for (const auto& [device, given, expected] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"cpu", "", "gloo"}, {"", "", "gloo"}, {"cuda", "", "nccl"}, {"cpu", "gloo", "gloo"},
           {"cuda", "gloo", "gloo"}, {"cuda", "nccl", "nccl"}}) {
    SCOPED_TRACE(device + " " + given);
    v1::JobSpec job = DesignJob();
    job.set_device(device);
    job.mutable_communication()->set_backend(given);
    absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->comm_backend, expected);
    EXPECT_EQ(job::FilledSpec(*r).communication().backend(), expected);
  }
}

// communication.prefetch: unset is on; false is kept.
TEST(JobTest, PrefetchIsOnUnlessTurnedOff) {
  absl::StatusOr<job::ResolvedJob> plain = job::ResolveJob(DesignJob(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->prefetch_gathers);
  EXPECT_TRUE(job::FilledSpec(*plain).communication().prefetch());
  v1::JobSpec job = DesignJob();
  job.mutable_communication()->set_prefetch(false);
  absl::StatusOr<job::ResolvedJob> off = job::ResolveJob(job, "");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->prefetch_gathers);
  EXPECT_FALSE(job::FilledSpec(*off).communication().prefetch());
}

// communication.muon_in_backward and overlap_param_gather: unset is on;
// false is kept and shown in the job as it will run.
TEST(JobTest, CommunicationOverlapsAreOnUnlessTurnedOff) {
  struct Switch {
    const char* field;
    void (v1::CommunicationConfig::*set)(bool);
    bool (v1::CommunicationConfig::*shown)() const;
    bool job::ResolvedJob::*resolved;
  };
  const Switch switches[] = {
      {"muon_in_backward", &v1::CommunicationConfig::set_muon_in_backward,
       &v1::CommunicationConfig::muon_in_backward, &job::ResolvedJob::muon_in_backward},
      {"overlap_param_gather", &v1::CommunicationConfig::set_overlap_param_gather,
       &v1::CommunicationConfig::overlap_param_gather, &job::ResolvedJob::overlap_param_gather},
  };
  absl::StatusOr<job::ResolvedJob> plain = job::ResolveJob(DesignJob(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (const Switch& s : switches) {
    SCOPED_TRACE(s.field);
    EXPECT_TRUE((*plain).*s.resolved);
    EXPECT_TRUE((job::FilledSpec(*plain).communication().*s.shown)());
    v1::JobSpec job = DesignJob();
    (job.mutable_communication()->*s.set)(false);
    absl::StatusOr<job::ResolvedJob> off = job::ResolveJob(job, "");
    ASSERT_TRUE(off.ok()) << off.status();
    EXPECT_FALSE((*off).*s.resolved);
    EXPECT_FALSE((job::FilledSpec(*off).communication().*s.shown)());
    // Only this switch turned off.
    for (const Switch& other : switches) {
      if (&other == &s) continue;
      EXPECT_TRUE((*off).*other.resolved) << other.field;
    }
  }
}

// communication.reshard_after_forward: unset, held (false) exactly when the
// model's parameters fit one bucket; a value given is kept. The job as it
// will run, and the planner's input, say the same.
TEST(JobTest, ReshardAfterForwardByTheModelsSizeUnlessGiven) {
  // The design job's MLP 32-64-64-8: weights 64x32, 64x64, 8x64 and their
  // biases, 4 bytes an element.
  constexpr int64_t kModelBytes = 4 * (64 * 32 + 64 + 64 * 64 + 64 + 8 * 64 + 8);
  struct Case {
    std::optional<int64_t> bucket_bytes;
    std::optional<bool> given;
    bool reshards;
  };
  for (const Case& c : std::vector<Case>{{std::nullopt, std::nullopt, false},
                                         {kModelBytes, std::nullopt, false},
                                         {kModelBytes - 4, std::nullopt, true},
                                         {0, std::nullopt, true},
                                         {std::nullopt, true, true},
                                         {kModelBytes - 4, false, false}}) {
    SCOPED_TRACE(absl::StrCat("bucket ", c.bucket_bytes.value_or(-1), " given ",
                              c.given.has_value() ? int{*c.given} : -1));
    v1::JobSpec job = DesignJob();
    if (c.bucket_bytes) job.mutable_communication()->set_bucket_bytes(*c.bucket_bytes);
    if (c.given) job.mutable_communication()->set_reshard_after_forward(*c.given);
    absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->reshard_after_forward, c.reshards);
    EXPECT_EQ(job::FilledSpec(*r).communication().reshard_after_forward(), c.reshards);
    absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(job);
    ASSERT_TRUE(input.ok()) << input.status();
    EXPECT_EQ(input->options.reshard_after_forward, c.reshards);
    absl::StatusOr<plan::PlanInput> from_resolved = job::PlanInputOf(*r);
    ASSERT_TRUE(from_resolved.ok()) << from_resolved.status();
    EXPECT_EQ(from_resolved->options.reshard_after_forward, c.reshards);
  }
}

// communication.window_bytes: unset is 0 (no limit); a value is kept and
// shown in the job as it will run.
TEST(JobTest, WindowBytesIsNoLimitUnlessGiven) {
  absl::StatusOr<job::ResolvedJob> plain = job::ResolveJob(DesignJob(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->window_bytes, 0);
  v1::JobSpec job = DesignJob();
  job.mutable_communication()->set_window_bytes(524288);
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->window_bytes, 524288);
  EXPECT_EQ(job::FilledSpec(*r).communication().window_bytes(), 524288);
}

TEST(JobTest, TheRecipeResolvesAndIsOffByDefault) {
  absl::StatusOr<job::ResolvedJob> plain = job::ResolveJob(DesignJob(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->lr_schedule.decay, optim::LrDecay::kConstant);
  EXPECT_EQ(plain->lr_schedule.warmup_steps, 0);
  EXPECT_FALSE(plain->clip_grad_norm.has_value());
  EXPECT_FALSE(plain->momentum_warmup.has_value());

  TempDir dir;
  const std::string path = dir.Write("job.yaml", R"(name: recipe
world_size: 2
model: {mlp: {dims: [4, 2]}}
optimizer: {muon: {momentum_warmup: {start: 0.85, steps: 300}}}
training:
  steps: 20
  global_batch_size: 2
  clip_grad_norm: 1.0
  lr_schedule: {warmup_steps: 4, decay: wsd, decay_steps: 6, min_lr_ratio: 0.1}
)");
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->lr_schedule.decay, optim::LrDecay::kWsd);
  EXPECT_EQ(r->lr_schedule.warmup_steps, 4);
  EXPECT_EQ(r->lr_schedule.decay_steps, 6);
  EXPECT_DOUBLE_EQ(r->lr_schedule.min_lr_ratio, 0.1);
  ASSERT_TRUE(r->clip_grad_norm.has_value());
  EXPECT_DOUBLE_EQ(*r->clip_grad_norm, 1.0);
  ASSERT_TRUE(r->momentum_warmup.has_value());
  EXPECT_DOUBLE_EQ(r->momentum_warmup->start, 0.85);
  EXPECT_EQ(r->momentum_warmup->steps, 300);
}

// What plan --job prints of the recipe: the schedule in words, then both
// rates and the momentum at the steps where the schedule turns, each worked
// out here from the formulas (S = 20, W = 4, cosine to 0.1).
TEST(JobTest, DescribeRecipeGivesTheRatesWhereTheScheduleTurns) {
  v1::JobSpec job = DesignJob();  // muon lr 0.02, adamw lr 0.001, 20 steps
  auto* s = job.mutable_training()->mutable_lr_schedule();
  s->set_warmup_steps(4);
  s->set_decay("cosine");
  s->set_min_lr_ratio(0.1);
  job.mutable_training()->set_clip_grad_norm(1.0);
  auto* w = job.mutable_optimizer()->mutable_muon()->mutable_momentum_warmup();
  w->set_start(0.85);
  w->set_steps(10);
  ASSERT_THAT(job::ValidateJob(job), IsEmpty());
  const std::string text = job::DescribeRecipe(job);
  EXPECT_THAT(text, HasSubstr("warmup over 4 steps, then cosine decay to 0.1 of the peak over "
                              "steps 4-19"));
  EXPECT_THAT(text, HasSubstr("gradient clipping: global norm 1"));
  EXPECT_THAT(text, HasSubstr("Muon momentum: 0.85 -> 0.95 over 10 steps"));
  // Rows: step, muon lr, adamw lr, momentum; columns: the first step, the
  // warmup's last, the decay's first, its middle (4 + 16 / 2) and the last;
  // values to the 4 significant digits printed.
  std::map<std::string, std::vector<double>> rows;
  std::istringstream lines(text);
  std::string line;
  std::getline(lines, line);  // the words
  while (std::getline(lines, line)) {
    const size_t label_end = line.find_first_of("0123456789");
    const std::string label(absl::StripAsciiWhitespace(line.substr(0, label_end)));
    std::istringstream values(line.substr(label_end));
    for (double v; values >> v;) rows[label].push_back(v);
  }
  EXPECT_THAT(rows["step"], ElementsAre(0, 3, 4, 12, 19));
  const std::vector<double> m = {0.25, 1.0, 1.0, 0.55,  // q = 8/16: cos = 0
                                 0.1 + 0.45 * (1 + std::cos(M_PI * 15.0 / 16))};
  ASSERT_EQ(rows["muon lr"].size(), m.size());
  ASSERT_EQ(rows["adamw lr"].size(), m.size());
  for (size_t i = 0; i < m.size(); ++i) {
    EXPECT_NEAR(rows["muon lr"][i], 0.02 * m[i], 6e-4 * 0.02 * m[i]) << i;
    EXPECT_NEAR(rows["adamw lr"][i], 0.001 * m[i], 6e-4 * 0.001 * m[i]) << i;
  }
  EXPECT_THAT(rows["momentum"], ElementsAre(DoubleNear(0.85, 1e-9), DoubleNear(0.88, 1e-9),
                                            DoubleNear(0.89, 1e-9), DoubleNear(0.95, 1e-9),
                                            DoubleNear(0.95, 1e-9)));
}

TEST(JobTest, MoeModelAndDataFileResolve) {
  TempDir dir;
  dir.Write("data.safetensors", "");
  v1::JobSpec job = DesignJob();
  auto* moe = job.mutable_model()->mutable_moe_mlp();
  moe->set_d_in(16);
  moe->set_d_model(32);
  moe->set_d_expert(8);
  moe->set_num_experts(4);
  moe->set_d_out(2);
  job.mutable_parallelism()->set_expert_model_parallel_size(2);
  job.mutable_data()->set_safetensors("data.safetensors");
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, dir.dir());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_NE(r->kind, nullptr);
  EXPECT_STREQ(r->kind->name, "moe_mlp");
  EXPECT_EQ(std::get<job::MoeMlpModel>(r->model_form).dims.num_experts, 4);
  EXPECT_EQ(std::get<job::MoeMlpModel>(r->model_form).dims.d_expert, 8);
  EXPECT_EQ(r->parallelism.expert_model_parallel_size, 2);
  EXPECT_FALSE(r->teacher_seed.has_value());
  EXPECT_EQ(r->data_safetensors, dir.dir() + "/data.safetensors");
}

// ---------------------------------------------------------------- one violation each

struct BrokenJob {
  std::string name;
  std::function<void(v1::JobSpec&)> mutate;
  std::string field;
  std::string reason;
};

void PrintTo(const BrokenJob& c, std::ostream* os) { *os << c.name; }

void SetMoe(v1::JobSpec& j) {
  auto* moe = j.mutable_model()->mutable_moe_mlp();
  moe->set_d_in(16);
  moe->set_d_model(32);
  moe->set_d_expert(8);
  moe->set_num_experts(4);
  moe->set_d_out(2);
}

// A valid gpt job on a text corpus (the data path is checked only when
// resolved).
void SetGpt(v1::JobSpec& j) {
  auto* g = j.mutable_model()->mutable_gpt();
  g->set_vocab_size(256);
  g->set_block_size(32);
  g->set_n_layer(2);
  g->set_n_head(4);
  g->set_n_embd(16);
  g->set_seq_len(32);
  j.mutable_data()->mutable_text()->set_train("corpus.txt");
}

std::vector<BrokenJob> BrokenJobs() {
  using J = v1::JobSpec;
  return {
      {"GptNoData",
       [](J& j) {
         SetGpt(j);
         j.clear_data();
       },
       "data", "required for the gpt"},
      {"GptFieldMissing",
       [](J& j) {
         SetGpt(j);
         j.mutable_model()->mutable_gpt()->clear_n_head();
       },
       "model.gpt.n_head", "required"},
      {"GptHeadsDoNotDivide",
       [](J& j) {
         SetGpt(j);
         j.mutable_model()->mutable_gpt()->set_n_head(3);
       },
       "model.gpt.n_embd", "not divisible by n_head 3"},
      {"GptSeqLenPastBlock",
       [](J& j) {
         SetGpt(j);
         j.mutable_model()->mutable_gpt()->set_seq_len(33);
       },
       "model.gpt.seq_len", "33 is not in [1, 32]"},
      {"GptTextNeedsBytes",
       [](J& j) {
         SetGpt(j);
         j.mutable_model()->mutable_gpt()->set_vocab_size(100);
       },
       "model.gpt.vocab_size", "at least 256"},
      {"GptTrainMissing",
       [](J& j) {
         SetGpt(j);
         j.mutable_data()->mutable_text()->clear_train();
       },
       "data.text.train", "required"},
      {"GptValAndFraction",
       [](J& j) {
         SetGpt(j);
         j.mutable_data()->mutable_text()->set_val("val.txt");
         j.mutable_data()->mutable_text()->set_val_fraction(0.2);
       },
       "data.text.val_fraction", "not both"},
      {"GptFractionOne",
       [](J& j) {
         SetGpt(j);
         j.mutable_data()->mutable_tokens()->set_train("a.bin");
         j.mutable_data()->mutable_tokens()->set_val_fraction(1.0);
       },
       "data.tokens.val_fraction", "[0, 1)"},
      {"TextForMlp", [](J& j) { j.mutable_data()->mutable_text()->set_train("a.txt"); },
       "data.text", "only the gpt and transformer models read a text corpus"},
      {"EvalForMlp", [](J& j) { j.mutable_training()->set_eval_every(5); }, "training.eval_every",
       "only the gpt and transformer models have validation data"},
      {"EvalBatchesNegative",
       [](J& j) {
         SetGpt(j);
         j.mutable_training()->set_eval_batches(-1);
       },
       "training.eval_batches", "got -1"},
      {"EmptyName", [](J& j) { j.clear_name(); }, "name", "required"},
      {"NameWithSpace", [](J& j) { j.set_name("my job"); }, "name", "[A-Za-z0-9._-]+"},
      {"NameWithSlash", [](J& j) { j.set_name("../etc"); }, "name", "[A-Za-z0-9._-]+"},
      {"NameDotDot", [](J& j) { j.set_name(".."); }, "name", "cannot name a folder"},
      {"NameTooLong", [](J& j) { j.set_name(std::string(201, 'a')); }, "name", "exceeds the limit"},
      {"WorldSizeMissing", [](J& j) { j.clear_world_size(); }, "world_size", "required"},
      {"WorldSizeNegative", [](J& j) { j.set_world_size(-4); }, "world_size", "must be >= 1"},
      {"WorldSizeHuge", [](J& j) { j.set_world_size((int64_t{1} << 20) + 1); }, "world_size",
       "exceeds the limit"},
      {"UnknownDevice", [](J& j) { j.set_device("tpu"); }, "device", "'tpu'"},
      {"UnknownStrategy",
       [](J& j) { j.mutable_parallelism()->set_data_parallel_sharding_strategy("zero3"); },
       "parallelism.data_parallel_sharding_strategy", "unknown strategy 'zero3'"},
      {"InstancesDoNotDivide",
       [](J& j) { j.mutable_parallelism()->set_num_distributed_optimizer_instances(3); },
       "parallelism.num_distributed_optimizer_instances", "3 does not divide world_size 4"},
      {"TensorParallel", [](J& j) { j.mutable_parallelism()->set_tensor_model_parallel_size(2); },
       "parallelism.tensor_model_parallel_size", "not supported yet"},
      {"EpDoesNotDivide", [](J& j) { j.mutable_parallelism()->set_expert_model_parallel_size(3); },
       "parallelism.expert_model_parallel_size", "3 does not divide world_size 4"},
      {"MuonLrNegative", [](J& j) { j.mutable_optimizer()->mutable_muon()->set_lr(-0.1); },
       "optimizer.muon.lr", ">= 0"},
      {"MuonMomentumOne", [](J& j) { j.mutable_optimizer()->mutable_muon()->set_momentum(1.0); },
       "optimizer.muon.momentum", "[0, 1)"},
      {"MuonMomentumNegative",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_momentum(-0.5); },
       "optimizer.muon.momentum", "[0, 1)"},
      {"NsStepsTooMany", [](J& j) { j.mutable_optimizer()->mutable_muon()->set_ns_steps(101); },
       "optimizer.muon.ns_steps", "[1, 100]"},
      {"NsStepsNegative", [](J& j) { j.mutable_optimizer()->mutable_muon()->set_ns_steps(-1); },
       "optimizer.muon.ns_steps", "[1, 100]"},
      {"MuonDecayNegative",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_weight_decay(-1); },
       "optimizer.muon.weight_decay", ">= 0"},
      {"MuonDecayFlipsSign",
       [](J& j) {
         j.mutable_optimizer()->mutable_muon()->set_lr(0.5);
         j.mutable_optimizer()->mutable_muon()->set_weight_decay(3);
       },
       "optimizer.muon.weight_decay", "flip the sign"},
      {"MuonScaleUnknown", [](J& j) { j.mutable_optimizer()->mutable_muon()->set_scale("big"); },
       "optimizer.muon.scale", "unknown scale 'big'"},
      {"MuonCoefficientsUnknown",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_coefficients("cubic"); },
       "optimizer.muon.coefficients", "unknown coefficients 'cubic'"},
      {"MuonNsAlgorithmUnknown",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_ns_algorithm("fast"); },
       "optimizer.muon.ns_algorithm", "unknown form 'fast'"},
      {"MuonGramOnCuda",
       [](J& j) {
         j.set_device("cuda");
         j.mutable_optimizer()->mutable_muon()->set_ns_algorithm("gram");
       },
       "optimizer.muon.ns_algorithm", "CPU only"},
      {"MuonSpectralOnCuda",
       [](J& j) {
         j.set_device("cuda");
         j.mutable_optimizer()->mutable_muon()->set_ns_algorithm("spectral");
       },
       "optimizer.muon.ns_algorithm", "spectral runs on the CPU only"},
      {"MuonSpectralPastItsGainLimit",
       [](J& j) {
         j.mutable_optimizer()->mutable_muon()->set_ns_algorithm("spectral");
         j.mutable_optimizer()->mutable_muon()->set_coefficients("polar_express");
         j.mutable_optimizer()->mutable_muon()->set_ns_steps(7);
       },
       "optimizer.muon.ns_algorithm", "polar_express with 7 iterations gives 3394"},
      // Only the steps: the gain (a loop over them) is not computed.
      {"MuonSpectralStepsOutOfRange",
       [](J& j) {
         j.mutable_optimizer()->mutable_muon()->set_ns_algorithm("spectral");
         j.mutable_optimizer()->mutable_muon()->set_ns_steps(2147483647);
       },
       "optimizer.muon.ns_steps", "got 2147483647"},
      {"AdamWLrNegative", [](J& j) { j.mutable_optimizer()->mutable_adamw()->set_lr(-1); },
       "optimizer.adamw.lr", ">= 0"},
      {"AdamWBeta1One", [](J& j) { j.mutable_optimizer()->mutable_adamw()->set_beta1(1.0); },
       "optimizer.adamw.beta1", "[0, 1)"},
      {"AdamWBeta2Big", [](J& j) { j.mutable_optimizer()->mutable_adamw()->set_beta2(1.5); },
       "optimizer.adamw.beta2", "[0, 1)"},
      {"AdamWEpsNegative", [](J& j) { j.mutable_optimizer()->mutable_adamw()->set_eps(-1e-8); },
       "optimizer.adamw.eps", "> 0"},
      {"AdamWEpsZero", [](J& j) { j.mutable_optimizer()->mutable_adamw()->set_eps(0); },
       "optimizer.adamw.eps", "> 0, got 0"},
      {"NsStepsSaysWhatZeroMeans",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_ns_steps(500); },
       "optimizer.muon.ns_steps", "(0 or unset: 5)"},
      {"RuleBackReferenceIsNotRe2",
       [](J& j) {
         auto* r = j.mutable_optimizer()->add_rules();
         r->set_pattern("(layers)\\1");
         r->set_optimizer("adamw");
       },
       "optimizer.rules[0].pattern", "RE2 syntax"},
      {"BatchLargerThanTeacherSamples",
       [](J& j) {
         j.mutable_data()->mutable_teacher()->set_samples(32);
         j.mutable_training()->set_global_batch_size(64);
       },
       "training.global_batch_size", "64 exceeds the 32 samples"},
      {"BatchLargerThanDefaultSamples",
       [](J& j) {
         j.clear_data();
         j.mutable_training()->set_global_batch_size(8192);
       },
       "training.global_batch_size", "the default of 4096"},
      {"AdamWDecayNegative",
       [](J& j) { j.mutable_optimizer()->mutable_adamw()->set_weight_decay(-0.1); },
       "optimizer.adamw.weight_decay", ">= 0"},
      {"OwnerRuleUnknown", [](J& j) { j.mutable_optimizer()->set_owner_assignment("random"); },
       "optimizer.owner_assignment", "unknown rule 'random'"},
      {"KeepCheckpointsNegative",
       [](J& j) { j.mutable_training()->set_keep_checkpoints(-1); },
       "training.keep_checkpoints", "must be in [0, 1000000000] (0 or unset: 2), got -1"},
      {"MuonBufferBelowMinusOne", [](J& j) { j.mutable_optimizer()->set_muon_buffer_bytes(-1); },
       "optimizer.muon_buffer_bytes", "must be >= 0 (0, the default: one wave"},
      {"BucketBytesNegative",
       [](J& j) { j.mutable_communication()->set_bucket_bytes(-1); },
       "communication.bucket_bytes", "must be >= 0 (0: one unit a collective; unset: 26214400)"},
      {"WindowBytesNegative",
       [](J& j) { j.mutable_communication()->set_window_bytes(-4096); },
       "communication.window_bytes", "must be >= 0 (0 or unset: no limit; across slow links"},
      {"CommBackendUnknown", [](J& j) { j.mutable_communication()->set_backend("mpi"); },
       "communication.backend", "unknown backend 'mpi' (expected nccl or gloo; unset: nccl"},
      {"CommBackendNcclOnCpu",
       [](J& j) {
         j.set_device("cpu");
         j.mutable_communication()->set_backend("nccl");
       },
       "communication.backend", "nccl needs device cuda (this job's device is cpu)"},
      {"MuonReplicaSplitUnknown",
       [](J& j) { j.mutable_optimizer()->set_muon_replica_split("always"); },
       "optimizer.muon_replica_split", "unknown value 'always' (expected auto, on or off"},
      {"RuleBadRegex",
       [](J& j) {
         auto* r = j.mutable_optimizer()->add_rules();
         r->set_pattern("layers.(");
         r->set_optimizer("adamw");
       },
       "optimizer.rules[0].pattern", "invalid regular expression 'layers.('"},
      {"RuleEmptyPattern",
       [](J& j) {
         auto* r = j.mutable_optimizer()->add_rules();
         r->set_pattern(".*");
         r->set_optimizer("adamw");
         r = j.mutable_optimizer()->add_rules();
         r->set_optimizer("muon");
       },
       "optimizer.rules[1].pattern", "empty pattern"},
      {"RuleUnknownOptimizer",
       [](J& j) {
         auto* r = j.mutable_optimizer()->add_rules();
         r->set_pattern(".*");
         r->set_optimizer("sgd");
       },
       "optimizer.rules[0].optimizer", "unknown optimizer 'sgd'"},
      {"ModelMissing", [](J& j) { j.clear_model(); }, "model", "required"},
      {"MlpOneDim",
       [](J& j) {
         j.mutable_model()->mutable_mlp()->clear_dims();
         j.mutable_model()->mutable_mlp()->add_dims(32);
       },
       "model.mlp.dims", "at least 2"},
      {"MlpZeroDim", [](J& j) { j.mutable_model()->mutable_mlp()->set_dims(2, 0); },
       "model.mlp.dims[2]", "must be >= 1, got 0"},
      {"MlpNegativeDim", [](J& j) { j.mutable_model()->mutable_mlp()->set_dims(1, -64); },
       "model.mlp.dims[1]", "must be >= 1, got -64"},
      {"MlpHugeDim", [](J& j) { j.mutable_model()->mutable_mlp()->set_dims(3, int64_t{1} << 21); },
       "model.mlp.dims[3]", "exceeds the limit"},
      {"MoeDExpertMissing",
       [](J& j) {
         SetMoe(j);
         j.mutable_model()->mutable_moe_mlp()->clear_d_expert();
       },
       "model.moe_mlp.d_expert", "required"},
      {"MoeExpertsDoNotDivide",
       [](J& j) {
         SetMoe(j);
         j.mutable_model()->mutable_moe_mlp()->set_num_experts(3);
         j.mutable_parallelism()->set_expert_model_parallel_size(2);
       },
       "model.moe_mlp.num_experts", "3 experts do not divide over expert_model_parallel_size 2"},
      {"SyntheticNoSpec",
       [](J& j) {
         j.clear_data();
         j.mutable_model()->mutable_synthetic()->set_scale(0.5);
       },
       "model.synthetic.spec", "required"},
      {"SyntheticScaleTooBig",
       [](J& j) {
         j.clear_data();
         j.mutable_model()->mutable_synthetic()->set_spec("spec.json");
         j.mutable_model()->mutable_synthetic()->set_scale(1.5);
       },
       "model.synthetic.scale", "(0, 1]"},
      {"SyntheticScaleNegative",
       [](J& j) {
         j.clear_data();
         j.mutable_model()->mutable_synthetic()->set_spec("spec.json");
         j.mutable_model()->mutable_synthetic()->set_scale(-0.25);
       },
       "model.synthetic.scale", "(0, 1]"},
      {"SyntheticWithData",
       [](J& j) { j.mutable_model()->mutable_synthetic()->set_spec("spec.json"); }, "data",
       "reads no data"},
      {"SyntheticShuffled",
       [](J& j) {
         j.mutable_model()->mutable_synthetic()->set_spec("spec.json");
         j.clear_data();
         j.mutable_data()->mutable_shuffle()->set_seed(1);
       },
       "data.shuffle", "nothing to shuffle"},
      {"InitEmptyPath", [](J& j) { j.mutable_init()->set_safetensors(""); }, "init.safetensors",
       "empty path"},
      {"DataEmptyPath", [](J& j) { j.mutable_data()->set_safetensors(""); }, "data.safetensors",
       "empty path"},
      {"ElasticWithoutRestarts",
       [](J& j) {
         j.mutable_training()->mutable_elastic()->set_min_world_size(2);
         j.mutable_training()->set_max_restarts(0);
       },
       "training.elastic", "needs training.max_restarts >= 1"},
      {"ElasticMinAtWorldSize",
       [](J& j) { j.mutable_training()->mutable_elastic()->set_min_world_size(4); },
       "training.elastic.min_world_size", "must be in [1, world_size 4), got 4"},
      {"ElasticMinUnset", [](J& j) { j.mutable_training()->mutable_elastic()->set_wait("5s"); },
       "training.elastic.min_world_size", "must be in [1, world_size 4), got 0"},
      {"ElasticNoSizeSplitsTheBatch",
       [](J& j) { j.mutable_training()->mutable_elastic()->set_min_world_size(3); },
       "training.elastic.min_world_size",
       "no world size in [3, 4) splits training.global_batch_size 64 evenly"},
      {"ElasticWaitNotADuration",
       [](J& j) {
         j.mutable_training()->mutable_elastic()->set_min_world_size(2);
         j.mutable_training()->mutable_elastic()->set_wait("soon");
       },
       "training.elastic.wait", "'soon' is not a duration"},
      {"InitCheckpointEmptyPath", [](J& j) { j.mutable_init()->set_checkpoint(""); },
       "init.checkpoint", "empty path"},
      {"FreshOptimizerStateWithoutCheckpoint",
       [](J& j) { j.mutable_init()->set_fresh_optimizer_state(true); },
       "init.fresh_optimizer_state", "only means something with init.checkpoint"},
      {"TeacherSamplesNegative", [](J& j) { j.mutable_data()->mutable_teacher()->set_samples(-1); },
       "data.teacher.samples", ">= 1"},
      {"StepsMissing", [](J& j) { j.mutable_training()->clear_steps(); }, "training.steps",
       "required"},
      {"StepsNegative", [](J& j) { j.mutable_training()->set_steps(-5); }, "training.steps",
       "must be >= 1, got -5"},
      {"StepsHuge", [](J& j) { j.mutable_training()->set_steps(2'000'000'000); }, "training.steps",
       "exceeds the limit"},
      {"BatchMissing", [](J& j) { j.mutable_training()->clear_global_batch_size(); },
       "training.global_batch_size", "required"},
      {"BatchDoesNotSplit", [](J& j) { j.mutable_training()->set_global_batch_size(62); },
       "training.global_batch_size", "62 does not split evenly over the 4 data-parallel ranks"},
      {"CheckpointNegative", [](J& j) { j.mutable_training()->set_checkpoint_every(-1); },
       "training.checkpoint_every", ">= 0"},
      {"RestartsNegative", [](J& j) { j.mutable_training()->set_max_restarts(-1); },
       "training.max_restarts", "[0, 1000]"},
      {"ThreadsNegative", [](J& j) { j.mutable_training()->set_threads_per_rank(-1); },
       "training.threads_per_rank", "must be in [0, 256] (0 or unset: 1), got -1"},
      {"ThreadsTooMany", [](J& j) { j.mutable_training()->set_threads_per_rank(257); },
       "training.threads_per_rank", "got 257"},
      {"RuleSetsNothing",
       [](J& j) { j.mutable_optimizer()->add_rules()->set_pattern("head.*"); },
       "optimizer.rules[0]", "sets nothing"},
      {"RuleLrScaleZero",
       [](J& j) {
         auto* r = j.mutable_optimizer()->add_rules();
         r->set_pattern("head.*");
         r->set_lr_scale(0);
       },
       "optimizer.rules[0].lr_scale", "> 0"},
      {"RuleWeightDecayNegative",
       [](J& j) {
         auto* r = j.mutable_optimizer()->add_rules();
         r->set_pattern("head.*");
         r->set_weight_decay(-0.1);
       },
       "optimizer.rules[0].weight_decay", ">= 0"},
      {"RuleDecayFlipsWeights",
       [](J& j) {
         auto* r = j.mutable_optimizer()->add_rules();
         r->set_pattern("head.*");
         r->set_optimizer("muon");
         r->set_lr_scale(10);
         r->set_weight_decay(6);  // 0.02 * 10 * 6 = 1.2
       },
       "optimizer.rules[0].weight_decay", "would flip the sign"},
      {"PerHeadWithoutAttention",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_per_head(true); },
       "optimizer.muon.per_head", "the mlp model has no attention (models with attention: gpt"},
      {"QkClipWithoutAttention",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_qk_clip(50); },
       "optimizer.muon.qk_clip", "the mlp model has no attention"},
      {"QkClipZero", [](J& j) { j.mutable_optimizer()->mutable_muon()->set_qk_clip(0); },
       "optimizer.muon.qk_clip", "must be > 0"},
      {"QkClipNegative", [](J& j) { j.mutable_optimizer()->mutable_muon()->set_qk_clip(-3); },
       "optimizer.muon.qk_clip", "got -3"},
      {"HealthEveryNegative",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_health_every(-1); },
       "optimizer.muon.health_every", "got -1"},
      {"SplitQkvWithoutAttention",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->set_split_qkv(true); },
       "optimizer.muon.split_qkv", "the mlp model has no attention"},
      {"MicroBatchNegative", [](J& j) { j.mutable_training()->set_micro_batch_size(-2); },
       "training.micro_batch_size", ">= 0"},
      {"MicroBatchDoesNotDivide", [](J& j) { j.mutable_training()->set_micro_batch_size(5); },
       "training.micro_batch_size",
       "5 does not divide the local batch of 16 samples (global_batch_size 64 over 4 ranks)"},
      // The recipe (training.steps is 20).
      {"ScheduleUnknownDecay",
       [](J& j) { j.mutable_training()->mutable_lr_schedule()->set_decay("exponential"); },
       "training.lr_schedule.decay", "unknown decay 'exponential'"},
      {"ScheduleWarmupFillsTheRun",
       [](J& j) {
         j.mutable_training()->mutable_lr_schedule()->set_decay("cosine");
         j.mutable_training()->mutable_lr_schedule()->set_warmup_steps(20);
       },
       "training.lr_schedule.warmup_steps", "at most 19"},
      {"ScheduleWarmupNegative",
       [](J& j) { j.mutable_training()->mutable_lr_schedule()->set_warmup_steps(-1); },
       "training.lr_schedule.warmup_steps", ">= 0"},
      {"ScheduleMinRatioAboveOne",
       [](J& j) { j.mutable_training()->mutable_lr_schedule()->set_min_lr_ratio(1.5); },
       "training.lr_schedule.min_lr_ratio", "outside [0, 1]"},
      {"WsdWithoutDecaySteps",
       [](J& j) { j.mutable_training()->mutable_lr_schedule()->set_decay("wsd"); },
       "training.lr_schedule.decay_steps", ">= 1 with decay: wsd"},
      {"WsdDecayLongerThanTheRun",
       [](J& j) {
         auto* s = j.mutable_training()->mutable_lr_schedule();
         s->set_decay("wsd");
         s->set_warmup_steps(5);
         s->set_decay_steps(16);
       },
       "training.lr_schedule.decay_steps", "more than the 15 steps after the warmup"},
      {"DecayStepsWithoutWsd",
       [](J& j) {
         j.mutable_training()->mutable_lr_schedule()->set_decay("cosine");
         j.mutable_training()->mutable_lr_schedule()->set_decay_steps(4);
       },
       "training.lr_schedule.decay_steps", "only for decay: wsd"},
      {"ClipZero", [](J& j) { j.mutable_training()->set_clip_grad_norm(0); },
       "training.clip_grad_norm", "> 0"},
      {"ClipNegative", [](J& j) { j.mutable_training()->set_clip_grad_norm(-1); },
       "training.clip_grad_norm", "got -1"},
      {"MomentumWarmupStartAtOne",
       [](J& j) {
         auto* w = j.mutable_optimizer()->mutable_muon()->mutable_momentum_warmup();
         w->set_start(1.0);
         w->set_steps(10);
       },
       "optimizer.muon.momentum_warmup.start", "[0, 1)"},
      {"MomentumWarmupWithoutSteps",
       [](J& j) { j.mutable_optimizer()->mutable_muon()->mutable_momentum_warmup()->set_start(0.85); },
       "optimizer.muon.momentum_warmup.steps", ">= 1"},
  };
}

class BrokenJobTest : public ::testing::TestWithParam<BrokenJob> {};

TEST_P(BrokenJobTest, ReportsExactlyThatField) {
  const BrokenJob& c = GetParam();
  v1::JobSpec job = DesignJob();
  ASSERT_THAT(job::ValidateJob(job), IsEmpty());
  c.mutate(job);
  const std::vector<plan::FieldViolation> violations = job::ValidateJob(job);
  ASSERT_THAT(Fields(violations), ElementsAre(c.field));
  EXPECT_THAT(violations[0].description, HasSubstr(c.reason));
  // job::ResolveJob refuses it with the same field and reason.
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.field + ": "));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.reason));
}

INSTANTIATE_TEST_SUITE_P(Cases, BrokenJobTest, ::testing::ValuesIn(BrokenJobs()),
                         [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------- many at once

TEST(JobTest, ReportsEveryViolationAtOnce) {
  TempDir dir;
  const std::string path = dir.Write("bad.yaml", R"(
name: "bad name"
world_size: 4
device: gpu
parallelism: {data_parallel_sharding_strategy: zero9, num_distributed_optimizer_instances: 3}
model: {mlp: {dims: [32, 0, 8, -1]}}
init: {safetensors: missing-init.safetensors}
data: {safetensors: missing-data.safetensors}
optimizer:
  muon: {lr: -1, momentum: 1.5, ns_steps: 200, scale: huge}
  adamw: {beta1: 2, eps: -1}
  owner_assignment: best
  rules: [{pattern: "(", optimizer: lion}]
training: {steps: 0, global_batch_size: 10, checkpoint_every: -2}
)");
  absl::StatusOr<v1::JobSpec> job = job::LoadJobFile(path);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::vector<std::string> expected = {
      "name",
      "device",
      "parallelism.data_parallel_sharding_strategy",
      "parallelism.num_distributed_optimizer_instances",
      "model.mlp.dims[1]",
      "model.mlp.dims[3]",
      "optimizer.muon.lr",
      "optimizer.muon.momentum",
      "optimizer.muon.ns_steps",
      "optimizer.muon.scale",
      "optimizer.adamw.beta1",
      "optimizer.adamw.eps",
      "optimizer.owner_assignment",
      "optimizer.rules[0].pattern",
      "optimizer.rules[0].optimizer",
      "training.steps",
      "training.global_batch_size",
      "training.checkpoint_every",
  };
  EXPECT_THAT(Fields(job::ValidateJob(*job)), UnorderedElementsAreArray(expected));

  // Resolving adds the missing input files, named by their resolved paths,
  // and the message starts with the job file.
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(path);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(r.status().message());
  EXPECT_THAT(message, StartsWith(path + ": "));
  for (const std::string& field : expected) EXPECT_THAT(message, HasSubstr(field + ": "));
  EXPECT_THAT(message, HasSubstr("init.safetensors: " + dir.dir() +
                                 "/missing-init.safetensors: no such file"));
  EXPECT_THAT(message, HasSubstr("data.safetensors: " + dir.dir() +
                                 "/missing-data.safetensors: no such file"));
}

// ---------------------------------------------------------------- input files

// The sizes an elastic job may shrink to: below world_size, from
// min_world_size, splitting the batch (64: not 3) and fitting the
// parallelism config (2 optimizer instances: not 1), largest first.
TEST(JobTest, ElasticSizesSplitTheBatchAndFitTheParallelism) {
  v1::JobSpec job = DesignJob();
  EXPECT_TRUE(job::ElasticWorldSizes(job).empty());
  job.mutable_training()->mutable_elastic()->set_min_world_size(1);
  EXPECT_EQ(job::ElasticWorldSizes(job), std::vector<int64_t>({2}));
  EXPECT_THAT(Fields(job::ValidateJob(job)), ::testing::IsEmpty());
  EXPECT_EQ(job::ElasticWait(job), absl::Seconds(30));
  job.mutable_parallelism()->set_num_distributed_optimizer_instances(1);
  job.mutable_parallelism()->clear_outer_dp_sharding_strategy();
  job.set_world_size(8);
  job.mutable_training()->mutable_elastic()->set_wait("2m");
  EXPECT_EQ(job::ElasticWorldSizes(job), std::vector<int64_t>({4, 2, 1}));
  EXPECT_EQ(job::ElasticWait(job), absl::Minutes(2));
  // Micro-batches must divide the local batch at every size: of 8 at 4 ranks
  // (16 each), sizes 2 (32) and 1 (64); of 32 at 2 ranks, size 1.
  job.set_world_size(4);
  job.mutable_training()->set_micro_batch_size(8);
  EXPECT_EQ(job::ElasticWorldSizes(job), std::vector<int64_t>({2, 1}));
  job.mutable_training()->set_micro_batch_size(32);
  job.set_world_size(2);
  EXPECT_EQ(job::ElasticWorldSizes(job), std::vector<int64_t>({1}));
  job.set_world_size(4);  // 16 each: 32 does not divide it
  EXPECT_THAT(Fields(job::ValidateJob(job)), ElementsAre("training.micro_batch_size"));
}

TEST(JobTest, InitCheckpointIsAFileOrAFolderThatExists) {
  TempDir dir;
  fs::create_directories(dir.dir() + "/run/checkpoints");
  v1::JobSpec job = DesignJob();
  job.mutable_init()->set_checkpoint("run/missing");
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, dir.dir());
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("init.checkpoint: " + dir.dir() + "/run/missing: no such file"));
  job.mutable_init()->set_checkpoint("run/checkpoints");
  job.mutable_init()->set_fresh_optimizer_state(true);
  r = job::ResolveJob(job, dir.dir());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->init_checkpoint, dir.dir() + "/run/checkpoints");
  EXPECT_TRUE(r->fresh_optimizer_state);
  EXPECT_TRUE(r->init_safetensors.empty());
}

TEST(JobTest, InputFilesMustExistAsRegularFiles) {
  TempDir dir;
  fs::create_directories(dir.dir() + "/adir");
  v1::JobSpec job = DesignJob();
  job.mutable_init()->set_safetensors("weights/init.safetensors");
  job.mutable_data()->set_safetensors("adir");

  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, dir.dir());
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(r.status().message()),
      HasSubstr("init.safetensors: " + dir.dir() + "/weights/init.safetensors: no such file"));
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("data.safetensors: " + dir.dir() + "/adir: not a regular file"));

  fs::create_directories(dir.dir() + "/weights");
  dir.Write("weights/init.safetensors", "");
  dir.Write("data.safetensors", "");
  job.mutable_data()->set_safetensors("./data.safetensors");
  r = job::ResolveJob(job, dir.dir());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->init_safetensors, dir.dir() + "/weights/init.safetensors");
  EXPECT_EQ(r->data_safetensors, dir.dir() + "/data.safetensors");
}

TEST(JobTest, MissingSyntheticSpecIsReported) {
  TempDir dir;
  v1::JobSpec job = DesignJob();
  job.clear_data();
  job.mutable_model()->mutable_synthetic()->set_spec("specs/gpt2.json");
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, dir.dir());
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("model.synthetic.spec: " + dir.dir() + "/specs/gpt2.json: no such file"));
}

// ---------------------------------------------------------------- parse errors

TEST(JobTest, MisspeltFieldIsLocatedWithASuggestion) {
  TempDir dir;
  const std::string path = dir.Write("job.yaml", R"(name: x
world_size: 1
model: {mlp: {dims: [2, 2]}}
optimiser:
  muon: {lr: 0.02}
training: {steps: 1, global_batch_size: 1}
)");
  absl::StatusOr<v1::JobSpec> job = job::LoadJobFile(path);
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(job.status().message());
  EXPECT_THAT(message, StartsWith(path + ":4:1: "));
  EXPECT_THAT(message, HasSubstr("\"optimiser\""));
  EXPECT_THAT(message, HasSubstr("did you mean \"optimizer\"?"));
  // The one-call path gives the same error.
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(path);
  EXPECT_EQ(r.status(), job.status());
}

TEST(JobTest, WrongTypeIsLocatedWithItsFieldPath) {
  TempDir dir;
  const std::string path = dir.Write("job.yaml", R"(name: x
world_size: 1
model: {mlp: {dims: [2, two]}}
)");
  absl::StatusOr<v1::JobSpec> job = job::LoadJobFile(path);
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(job.status().message()), StartsWith(path + ":3:"));
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("model.mlp.dims[1]"));
}

TEST(JobTest, UnsetEpsTakesTheDefaultAndAnExplicitOneIsKept) {
  v1::JobSpec job = DesignJob();
  job.mutable_optimizer()->mutable_adamw()->clear_eps();
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->adamw.eps, 1e-8);
  job.mutable_optimizer()->mutable_adamw()->set_eps(1e-3);
  r = job::ResolveJob(job, "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->adamw.eps, 1e-3);
}

// RE2 matches in time linear in the name whatever the pattern: this one
// takes exponential time in a backtracking engine on a name it cannot match.
TEST(JobTest, OptimizerRulesMatchWholeNamesFirstRuleFirstInLinearTime) {
  plan::ModelSpec spec;
  spec.units.push_back({"u", {{"layers.0.weight", {4, 4}, "muon", false},
                              {"layers.0.bias", {4}, "adamw", false},
                              {std::string(5000, 'a'), {4, 4}, "muon", false}}});
  const std::vector<job::OptimizerRule> rules = {
      {"(.*.*)*(.*.*)*(.*.*)*(.*.*)*X", "adamw"},
      {"layers\\.\\d+\\.weight", "adamw"},
      {"layers.*", "muon"},
      {"weight", "adamw"}};  // a substring of a name: no full match
  absl::StatusOr<plan::ModelSpec> out = job::ApplyOptimizerRules(spec, rules);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->units[0].params[0].optimizer, "adamw");  // second rule, not the third
  EXPECT_EQ(out->units[0].params[1].optimizer, "muon");   // third rule
  EXPECT_EQ(out->units[0].params[2].optimizer, "muon");   // no rule: as in the spec
  EXPECT_EQ(job::ApplyOptimizerRules(spec, {{"(a", "adamw", {}, {}}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The first rule matching a whole name gives its rates; a rule without an
// optimizer keeps the spec's; names no rule matches keep the defaults.
TEST(JobTest, OptimizerRulesGiveRatesByFirstMatch) {
  plan::ModelSpec spec;
  spec.units.push_back({"u", {{"head.weight", {4, 4}, "muon", false},
                              {"head.bias", {4}, "adamw", false},
                              {"ln.weight", {4}, "adamw", false}}});
  const std::vector<job::OptimizerRule> rules = {
      {.pattern = "head\\.weight", .lr_scale = 0.5},
      {.pattern = ".*\\.bias", .optimizer = "muon", .weight_decay = 0.0},
      {.pattern = "head.*", .lr_scale = 3.0, .weight_decay = 0.2}};  // after the first: never
  absl::StatusOr<std::vector<optim::ParamRates>> rates = job::ParamRatesOf(spec, rules);
  ASSERT_TRUE(rates.ok()) << rates.status();
  EXPECT_THAT(*rates, ElementsAre(optim::ParamRates{0.5, std::nullopt},
                                  optim::ParamRates{1.0, 0.0}, optim::ParamRates{}));
  absl::StatusOr<plan::ModelSpec> out = job::ApplyOptimizerRules(spec, rules);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->units[0].params[0].optimizer, "muon");  // its rule names none
  EXPECT_EQ(out->units[0].params[1].optimizer, "muon");
  EXPECT_EQ(out->units[0].params[2].optimizer, "adamw");

  // From a job file.
  v1::JobSpec job = DesignJob();
  auto* r = job.mutable_optimizer()->add_rules();
  r->set_pattern("layers\\.0\\..*");
  r->set_lr_scale(0.25);
  r->set_weight_decay(0.01);
  ASSERT_THAT(job::ValidateJob(job), IsEmpty());
  EXPECT_THAT(job::OptimizerRulesOf(job),
              ElementsAre(job::OptimizerRule{"layers\\.0\\..*", "", 0.25, 0.01}));
}

// The transformer's section: a Llama-style job is valid with its defaults
// filled in (n_kv_head = n_head, head_dim = d_model / n_head, eps, theta);
// each mistake is named by its field; MLA, experts and cuda are refused as
// not trained yet.
TEST(JobTest, TransformerSectionsAreCheckedFieldByField) {
  const std::string base =
      "name: t\nworld_size: 2\ndata: {text: {train: /x.txt}}\n"
      "training: {steps: 1, global_batch_size: 2}\nmodel: {transformer: {";
  auto job_of = [&](const std::string& section) {
    v1::JobSpec job;
    EXPECT_TRUE(protoio::ParseMessageText(base + section + "}}\n", "job", &job).ok()) << section;
    return job;
  };
  const std::string llama =
      "vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 32, n_head: 4, ffn_hidden: 64";
  v1::JobSpec ok = job_of(llama);
  EXPECT_THAT(job::ValidateJob(ok), IsEmpty());
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(ok, "");
  ASSERT_TRUE(r.ok() || absl::StrContains(r.status().message(), "x.txt")) << r.status();
  const job::ModelKind* kind = job::FindModelKind(v1::ModelConfig::kTransformer);
  ASSERT_NE(kind, nullptr);
  const model::TransformerDims d =
      std::get<job::TransformerModel>(kind->resolve(ok.model(), "")).dims;
  EXPECT_EQ(d.n_kv_head, 4);
  EXPECT_EQ(d.head_dim, 8);
  EXPECT_EQ(d.norm_eps, 1e-5);
  EXPECT_EQ(d.rope_theta, 10000.0);
  const struct {
    std::string section;
    const char* field;
    const char* says;
  } bad[] = {
      {llama + ", n_kv_head: 3", "model.transformer.n_kv_head", "does not divide n_head 4"},
      {"vocab_size: 256, seq_len: 16, n_layer: 2, n_head: 4, ffn_hidden: 64",
       "model.transformer.d_model", "required"},
      {llama + ", attention: gqa", "model.transformer.attention", "expected mha or mla"},
      {llama + ", attention: mla, mla: {kv_lora_rank: 16, qk_nope_head_dim: 8, "
               "qk_rope_head_dim: 3, v_head_dim: 8}",
       "model.transformer.mla.qk_rope_head_dim", "odd"},
      {llama + ", moe: {n_routed_experts: 4, top_k: 2, moe_ffn_hidden: 16, first_k_dense: 3}",
       "model.transformer.moe.first_k_dense", "not in [0, 2]"},
      {llama + ", moe: {n_routed_experts: 4, top_k: 5, moe_ffn_hidden: 16}",
       "model.transformer.moe.top_k", "not in [1, 4]"},
      {"vocab_size: 100, seq_len: 16, n_layer: 2, d_model: 32, n_head: 4, ffn_hidden: 64",
       "model.transformer.vocab_size", "at least 256"},
  };
  for (const auto& b : bad) {
    std::vector<std::string> fields;
    std::string all;
    for (const plan::FieldViolation& f : job::ValidateJob(job_of(b.section))) {
      fields.push_back(f.field);
      if (f.field == b.field) all += f.description;
    }
    EXPECT_THAT(fields, Contains(b.field)) << b.section;
    EXPECT_THAT(all, HasSubstr(b.says)) << b.section;
  }
  v1::JobSpec cuda = ok;
  cuda.set_device("cuda");
  std::vector<std::string> fields;
  for (const plan::FieldViolation& f : job::ValidateJob(cuda)) fields.push_back(f.field);
  EXPECT_THAT(fields, ElementsAre("model.transformer"));
  // MLA trains, with per_head and with split_qkv.
  v1::JobSpec mla = job_of(llama + ", attention: mla, mla: {q_lora_rank: 8, kv_lora_rank: 16, "
                                   "qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8}");
  EXPECT_THAT(job::ValidateJob(mla), IsEmpty());
  mla.mutable_optimizer()->mutable_muon()->set_per_head(true);
  EXPECT_THAT(job::ValidateJob(mla), IsEmpty());
  mla.mutable_optimizer()->mutable_muon()->set_per_head(false);
  mla.mutable_optimizer()->mutable_muon()->set_split_qkv(true);
  EXPECT_THAT(job::ValidateJob(mla), IsEmpty());
}

// split_qkv on MLA makes each layer's kv_b_proj [H (dn + dv), r] two Muon
// matrices: every head's k_nope rows [H dn, r] and every head's v rows
// [H dv, r], in pieces one head apart; nothing else is cut, and per_head
// (which cuts per head) wins when both are on.
TEST(JobTest, SplitQkvOnMlaStacksKNopeRowsAndVRows) {
  v1::JobSpec job;
  ASSERT_TRUE(protoio::ParseMessageText(
                  "name: t\nworld_size: 2\nmodel: {transformer: {vocab_size: 256, seq_len: 16, "
                  "n_layer: 2, d_model: 32, n_head: 4, ffn_hidden: 64, attention: mla, "
                  "mla: {kv_lora_rank: 16, qk_nope_head_dim: 6, qk_rope_head_dim: 4, "
                  "v_head_dim: 10}}}\ndata: {text: {train: /x.txt}}\n"
                  "training: {steps: 1, global_batch_size: 2}\n"
                  "optimizer: {muon: {split_qkv: true}}\n",
                  "job", &job)
                  .ok());
  ASSERT_THAT(job::ValidateJob(job), IsEmpty());
  absl::StatusOr<plan::PlanInput> in = job::PlanInputOf(job, "");
  ASSERT_TRUE(in.ok()) << in.status();
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(*in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Per Muon tensor, its matrices' (rows, first row, piece, stride).
  std::map<std::string, std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>>> matrices;
  for (const plan::MatrixPlan& m : plan->dense.matrices) {
    const plan::ParamSpec& p = in->model.units[m.unit].params[m.param];
    matrices[p.name].insert({m.rows, m.row_offset, m.row_piece, m.row_stride});
  }
  using Set = std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>>;
  EXPECT_EQ(matrices["layers.0.attn.kv_b_proj.weight"], (Set{{24, 0, 6, 16}, {40, 6, 10, 16}}));
  EXPECT_EQ(matrices["layers.1.attn.kv_b_proj.weight"], (Set{{24, 0, 6, 16}, {40, 6, 10, 16}}));
  EXPECT_EQ(matrices["layers.0.attn.q_proj.weight"], (Set{{40, 0, 0, 0}}));
  EXPECT_EQ(matrices["layers.0.attn.o_proj.weight"], (Set{{32, 0, 0, 0}}));
  job.mutable_optimizer()->mutable_muon()->set_per_head(true);
  in = job::PlanInputOf(job, "");
  ASSERT_TRUE(in.ok()) << in.status();
  for (const plan::UnitSpec& u : in->model.units) {
    for (const plan::ParamSpec& p : u.params) EXPECT_FALSE(p.muon_stack_blocks) << p.name;
  }
}

// output.export_format: muonmesh or hf; hf only for a dense Llama-style
// transformer, whose every parameter gets a distinct Hugging Face name and
// whose config.json states its sizes; the default file moves to hf/.
TEST(JobTest, HuggingFaceExportIsForDenseLlamaStyleTransformers) {
  const std::string head =
      "name: t\nworld_size: 1\ndata: {text: {train: /x.txt}}\n"
      "training: {steps: 1, global_batch_size: 1}\noutput: {dir: /tmp/out, export_format: ";
  auto fields = [&](const std::string& format, const std::string& model) {
    v1::JobSpec job;
    EXPECT_TRUE(
        protoio::ParseMessageText(head + format + "}\nmodel: " + model + "\n", "job", &job).ok());
    std::vector<std::string> out;
    std::string said;
    for (const plan::FieldViolation& f : job::ValidateJob(job)) {
      out.push_back(f.field);
      said += f.description;
    }
    return std::pair{out, said};
  };
  const std::string llama =
      "{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 32, n_head: 8, "
      "n_kv_head: 4, ffn_hidden: 64}}";
  EXPECT_THAT(fields("hf", llama).first, IsEmpty());
  EXPECT_THAT(fields("muonmesh", llama).first, IsEmpty());
  auto [f, said] = fields("onnx", llama);
  EXPECT_THAT(f, ElementsAre("output.export_format"));
  EXPECT_THAT(said, HasSubstr("expected muonmesh or hf"));
  std::tie(f, said) = fields("hf", "{gpt: {vocab_size: 256, block_size: 16, n_layer: 1, "
                                   "n_head: 2, n_embd: 8, seq_len: 16}}");
  EXPECT_THAT(f, ElementsAre("output.export_format"));
  EXPECT_THAT(said, HasSubstr("models with one: transformer"));
  std::tie(f, said) = fields(
      "hf", "{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 32, n_head: 4, "
            "ffn_hidden: 64, moe: {n_routed_experts: 4, top_k: 2, moe_ffn_hidden: 16}}}");
  EXPECT_THAT(f, ElementsAre("output.export_format"));
  EXPECT_THAT(said, HasSubstr("no MLA or experts"));

  v1::JobSpec job;
  ASSERT_TRUE(protoio::ParseMessageText(head + "hf}\nmodel: " + llama + "\n", "job", &job).ok());
  const job::ModelKind* kind = job::FindModelKind(v1::ModelConfig::kTransformer);
  const job::ModelForm form = kind->resolve(job.model(), "");
  absl::StatusOr<job::HfExport> hf = kind->hf_export(form);
  ASSERT_TRUE(hf.ok()) << hf.status();
  absl::StatusOr<plan::ModelSpec> spec = kind->spec(form, 1);
  ASSERT_TRUE(spec.ok());
  std::set<std::string> theirs;
  for (const plan::UnitSpec& u : spec->units) {
    for (const plan::ParamSpec& p : u.params) {
      ASSERT_EQ(hf->names.count(p.name), 1u) << p.name;
      theirs.insert(hf->names.at(p.name));
    }
  }
  EXPECT_EQ(theirs.size(), hf->names.size());
  EXPECT_EQ(theirs.count("model.layers.1.self_attn.k_proj.weight"), 1u);
  EXPECT_EQ(hf->names.at("layers.0.mlp_norm.weight"),
            "model.layers.0.post_attention_layernorm.weight");
  for (const char* want : {"\"num_key_value_heads\": 4", "\"head_dim\": 4",
                           "\"intermediate_size\": 64", "\"rms_norm_eps\": 1.0000000000000001e-05",
                           "\"rope_theta\": 10000", "\"tie_word_embeddings\": false"}) {
    EXPECT_THAT(hf->config_json, HasSubstr(want));
  }
  const std::string dir = ::testing::TempDir() + "/hf_export_job";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/train.txt") << "some text to train on\n";
  job.mutable_data()->mutable_text()->set_train(dir + "/train.txt");
  job.mutable_output()->set_dir(dir + "/out");
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->export_path, dir + "/out/hf/model.safetensors");
  EXPECT_EQ(r->export_format, "hf");
}

// per_head on MLA: q_b_proj in [dn + dr] blocks per head, kv_b_proj in [dn]
// and [dv] blocks per head in turn (k_nope, then v), the rest whole; the
// plan orthogonalizes each block as the matrix it is, 2 ranks under ZeRO-3.
TEST(JobTest, PerHeadCutsMlaIntoBlocksOfTwoSizes) {
  v1::JobSpec job;
  ASSERT_TRUE(protoio::ParseMessageText(
                  "name: m\nworld_size: 2\nmodel: {transformer: {vocab_size: 256, seq_len: 16, "
                  "n_layer: 1, d_model: 32, n_head: 4, ffn_hidden: 64, attention: mla, "
                  "mla: {q_lora_rank: 16, kv_lora_rank: 12, qk_nope_head_dim: 6, "
                  "qk_rope_head_dim: 2, v_head_dim: 5}}}\n"
                  "data: {text: {train: /x.txt}}\ntraining: {steps: 1, global_batch_size: 2}\n"
                  "optimizer: {muon: {per_head: true}}\n",
                  "job", &job)
                  .ok());
  EXPECT_THAT(job::ValidateJob(job), IsEmpty());
  absl::StatusOr<plan::PlanInput> in = job::PlanInputOf(job, "");
  ASSERT_TRUE(in.ok()) << in.status();
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(*in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> blocks;  // offset, rows
  for (const plan::MatrixPlan& m : plan->dense.matrices) {
    const plan::ParamSpec& p = in->model.units[m.unit].params[m.param];
    blocks[p.name].push_back({m.row_offset, m.rows});
    EXPECT_EQ(m.cols, plan::AsMatrix(p).cols) << p.name;
  }
  for (auto& [name, list] : blocks) std::sort(list.begin(), list.end());
  using Rows = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(blocks["layers.0.attn.q_b_proj.weight"], (Rows{{0, 8}, {8, 8}, {16, 8}, {24, 8}}));
  EXPECT_EQ(blocks["layers.0.attn.kv_b_proj.weight"],
            (Rows{{0, 6}, {6, 5}, {11, 6}, {17, 5}, {22, 6}, {28, 5}, {33, 6}, {39, 5}}));
  EXPECT_EQ(blocks["layers.0.attn.q_a_proj.weight"], (Rows{{0, 16}}));
  EXPECT_EQ(blocks["layers.0.attn.o_proj.weight"], (Rows{{0, 32}}));
}

// QK-clip on a model with attention: valid on the CPU, refused on CUDA
// (whose forms record no logits yet), naming the field.
TEST(JobTest, QkClipIsRefusedOnCudaOnly) {
  v1::JobSpec job;
  ASSERT_TRUE(protoio::ParseMessageText(
                  "name: g\nworld_size: 1\nmodel: {gpt: {vocab_size: 256, block_size: 16, "
                  "n_layer: 1, n_head: 2, n_embd: 8, seq_len: 16}}\n"
                  "data: {text: {train: /x.txt}}\ntraining: {steps: 1, global_batch_size: 1}\n"
                  "optimizer: {muon: {qk_clip: 100, health_every: 0}}\n",
                  "job", &job)
                  .ok());
  EXPECT_THAT(job::ValidateJob(job), IsEmpty());
  job.set_device("cuda");
  const std::vector<plan::FieldViolation> v = job::ValidateJob(job);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].field, "optimizer.muon.qk_clip");
  EXPECT_THAT(v[0].description, HasSubstr("not on device cuda"));
}

// split_qkv and per_head cut gpt's c_attn.weight [3C, C] into blocks the
// planner sees as matrices: 3 of [C, C], or 3H of [C/H, C]; nothing else.
TEST(JobTest, AttentionOptionsCutTheFusedProjectionIntoBlocks) {
  v1::JobSpec job;
  ASSERT_TRUE(protoio::ParseMessageText(
                  "name: g\nworld_size: 2\nmodel: {gpt: {vocab_size: 256, block_size: 16, "
                  "n_layer: 2, n_head: 4, n_embd: 32, seq_len: 16}}\n"
                  "data: {text: {train: /x.txt}}\ntraining: {steps: 1, global_batch_size: 2}\n",
                  "job", &job)
                  .ok());
  const auto blocks = [&](bool split, bool per_head) {
    job.mutable_optimizer()->mutable_muon()->set_split_qkv(split);
    job.mutable_optimizer()->mutable_muon()->set_per_head(per_head);
    EXPECT_THAT(job::ValidateJob(job), IsEmpty());
    absl::StatusOr<plan::PlanInput> in = job::PlanInputOf(job, "");
    EXPECT_TRUE(in.ok()) << in.status();
    std::map<std::string, int64_t> out;
    for (const plan::UnitSpec& u : in->model.units) {
      for (const plan::ParamSpec& p : u.params) {
        if (p.muon_block_rows != 0) out[p.name] = p.muon_block_rows;
      }
    }
    return out;
  };
  using Blocks = std::map<std::string, int64_t>;
  EXPECT_THAT(blocks(false, false), IsEmpty());
  EXPECT_EQ(blocks(true, false),
            (Blocks{{"h.0.attn.c_attn.weight", 32}, {"h.1.attn.c_attn.weight", 32}}));
  EXPECT_EQ(blocks(false, true),
            (Blocks{{"h.0.attn.c_attn.weight", 8}, {"h.1.attn.c_attn.weight", 8}}));
  EXPECT_EQ(blocks(true, true),
            (Blocks{{"h.0.attn.c_attn.weight", 8}, {"h.1.attn.c_attn.weight", 8}}));
  // The plan: per layer 3H = 12 blocks of [8, 32] in place of one [96, 32].
  absl::StatusOr<plan::PlanInput> in = job::PlanInputOf(job, "");
  ASSERT_TRUE(in.ok());
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(*in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::set<int64_t> offsets;
  for (const plan::MatrixPlan& m : plan->dense.matrices) {
    const plan::ParamSpec& p = in->model.units[m.unit].params[m.param];
    if (p.name != "h.0.attn.c_attn.weight") continue;
    EXPECT_EQ(m.rows, 8);
    EXPECT_EQ(m.cols, 32);
    offsets.insert(m.row_offset);
  }
  std::set<int64_t> expected;
  for (int64_t b = 0; b < 12; ++b) expected.insert(8 * b);
  EXPECT_EQ(offsets, expected);
}

TEST(JobTest, OutputPathsMustBeFoldersAndRegularFiles) {
  TempDir dir;
  const std::string d = dir.dir();
  dir.Write("file", "x");
  fs::create_directories(d + "/out/checkpoints");
  EXPECT_THAT(job::CheckOutputPaths(d + "/out", d + "/out/final.safetensors"), IsEmpty());
  EXPECT_THAT(job::CheckOutputPaths(d + "/new", d + "/new/final.safetensors"), IsEmpty());
  EXPECT_THAT(Fields(job::CheckOutputPaths(d + "/file", d + "/x.safetensors")),
              ElementsAre("output.dir"));
  EXPECT_THAT(Fields(job::CheckOutputPaths(d + "/out", "/dev/null")), ElementsAre("output.export"));
  EXPECT_THAT(Fields(job::CheckOutputPaths(d + "/out", d + "/out")), ElementsAre("output.export"));
  EXPECT_THAT(Fields(job::CheckOutputPaths(d + "/out", d + "/file/x")), ElementsAre("output.export"));
  fs::create_symlink(d + "/file", d + "/link");
  EXPECT_THAT(Fields(job::CheckOutputPaths(d + "/out", d + "/link")), ElementsAre("output.export"));
  // A link to a folder is a fine output folder: nothing replaces it.
  fs::create_directory_symlink(d + "/out", d + "/outlink");
  EXPECT_THAT(job::CheckOutputPaths(d + "/outlink", d + "/outlink/final.safetensors"), IsEmpty());
}

// A spec carried inline (as jobs submitted to a coordinator carry it) is
// used instead of the file, which need not exist.
TEST(JobTest, InlineSyntheticSpecNeedsNoFile) {
  v1::JobSpec job = DesignJob();
  job.clear_data();
  job.mutable_model()->mutable_synthetic()->set_spec("/nowhere/spec.json");
  v1::ModelSpec* model = job.mutable_model()->mutable_synthetic()->mutable_model();
  model->set_name("m");
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(job, "");
  ASSERT_TRUE(r.ok()) << r.status();
  const auto& synthetic = std::get<job::SyntheticModel>(r->model_form);
  ASSERT_TRUE(synthetic.inline_spec.has_value());
  EXPECT_EQ(synthetic.inline_spec->name(), "m");
  job.mutable_model()->mutable_synthetic()->clear_model();
  EXPECT_THAT(std::string(job::ResolveJob(job, "").status().message()),
              HasSubstr("model.synthetic.spec: /nowhere/spec.json: no such file"));
}

// Every example under deploy/local/examples is a job that resolves, or a
// model spec that loads.
// A gpt job's corpus: paths resolved against the job's folder, globs
// expanded where the files are (the worker), the held-out fraction's
// default, and a pattern that matches nothing refused naming the field;
// on either device (gpt has a CUDA form).
TEST(JobTest, GptCorpusResolves) {
  TempDir dir;
  dir.Write("shard_b.bin", "x");
  dir.Write("shard_a.bin", "x");
  const std::string path = dir.Write("gpt.yaml", R"(
name: lm
world_size: 2
device: cuda
model: {gpt: {vocab_size: 50257, block_size: 64, n_layer: 2, n_head: 2, n_embd: 8, seq_len: 64}}
data: {tokens: {train: "shard_*.bin"}}
training: {steps: 3, global_batch_size: 4, eval_every: 2}
)");
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(path);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_NE(r->kind, nullptr);
  EXPECT_STREQ(r->kind->name, "gpt");
  EXPECT_EQ(r->device, "cuda");
  EXPECT_EQ(std::get<job::GptModel>(r->model_form).dims, (model::GptDims{50257, 64, 2, 2, 8, 64}));
  EXPECT_TRUE(r->corpus.tokens);
  EXPECT_EQ(r->corpus.train, dir.dir() + "/shard_*.bin");
  EXPECT_EQ(r->corpus.val_fraction, 0.1);  // the default
  EXPECT_EQ(r->eval_every, 2);
  EXPECT_EQ(r->eval_batches, 4);  // the default
  absl::StatusOr<std::vector<std::string>> files = job::ExpandCorpus("data.tokens.train",
                                                                    r->corpus.train);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(dir.dir() + "/shard_a.bin", dir.dir() + "/shard_b.bin"));

  const std::string none = dir.Write("none.yaml", R"(
name: lm
world_size: 1
model: {gpt: {vocab_size: 256, block_size: 8, n_layer: 1, n_head: 1, n_embd: 8, seq_len: 8}}
data: {text: {train: "missing_*.txt", val_fraction: 0}}
training: {steps: 1, global_batch_size: 1}
)");
  absl::StatusOr<job::ResolvedJob> bad = job::LoadResolvedJob(none);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("data.text.train: no file matches"));
}

// What `muonmeshctl validate --job` prints: the minimal job with the table
// of job.h filled in (the values written out here from that table), every
// path resolved; resolved again, from any folder, it is the same job.
TEST(JobTest, FilledSpecWritesEveryDefaultAndResolvesToItself) {
  TempDir dir;
  dir.Write("a.txt", "hello world");
  const std::string path = dir.Write("lm.yaml", R"(
name: lm
world_size: 2
model: {gpt: {vocab_size: 256, block_size: 8, n_layer: 1, n_head: 1, n_embd: 8, seq_len: 8}}
data: {text: {train: a.txt}}
training: {steps: 3, global_batch_size: 2}
)");
  absl::StatusOr<job::ResolvedJob> r = job::LoadResolvedJob(path);
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::JobSpec f = job::FilledSpec(*r);
  EXPECT_EQ(f.device(), "cpu");
  EXPECT_EQ(f.optimizer().owner_assignment(), "lpt");
  EXPECT_EQ(f.optimizer().muon_replica_split(), "auto");
  const v1::MuonConfig& m = f.optimizer().muon();
  EXPECT_EQ(m.lr(), 0.02);
  EXPECT_EQ(m.momentum(), 0.95);
  EXPECT_TRUE(m.has_nesterov() && m.nesterov());
  EXPECT_EQ(m.ns_steps(), 5);
  EXPECT_EQ(m.weight_decay(), 0.0);
  EXPECT_EQ(m.scale(), "original");
  EXPECT_EQ(m.coefficients(), "quintic");
  EXPECT_EQ(m.ns_algorithm(), "auto");
  const v1::AdamWConfig& a = f.optimizer().adamw();
  EXPECT_EQ(a.lr(), 1e-3);
  EXPECT_EQ(a.beta1(), 0.9);
  EXPECT_EQ(a.beta2(), 0.999);
  EXPECT_TRUE(a.has_eps());
  EXPECT_EQ(a.eps(), 1e-8);
  EXPECT_EQ(f.init().seed(), 0u);
  EXPECT_FALSE(f.init().fresh());
  EXPECT_EQ(f.data().text().train(), dir.dir() + "/a.txt");
  EXPECT_EQ(f.data().text().val_fraction(), 0.1);
  EXPECT_FALSE(f.data().has_teacher());  // a language model reads its corpus only
  EXPECT_EQ(f.training().keep_checkpoints(), 2);
  EXPECT_EQ(f.training().threads_per_rank(), 1);
  EXPECT_EQ(f.training().eval_batches(), 4);
  EXPECT_EQ(f.training().lr_schedule().decay(), "constant");
  EXPECT_EQ(f.output().dir(), dir.dir() + "/runs/lm");
  EXPECT_EQ(f.output().export_(), dir.dir() + "/runs/lm/final.safetensors");

  absl::StatusOr<job::ResolvedJob> again = job::ResolveJob(f, "/");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(job::FilledSpec(*again).SerializeAsString(), f.SerializeAsString());
  EXPECT_EQ(again->output_dir, r->output_dir);
  EXPECT_EQ(again->corpus.train, r->corpus.train);

  // A transformer's section gets its defaults written too, and resolves to
  // the same dims.
  const std::string tpath = dir.Write("tr.yaml", R"(
name: tr
world_size: 1
model: {transformer: {vocab_size: 256, seq_len: 8, n_layer: 1, d_model: 16, n_head: 4,
                      ffn_hidden: 32}}
data: {text: {train: a.txt}}
training: {steps: 1, global_batch_size: 1}
)");
  absl::StatusOr<job::ResolvedJob> rt = job::LoadResolvedJob(tpath);
  ASSERT_TRUE(rt.ok()) << rt.status();
  const v1::JobSpec ft = job::FilledSpec(*rt);
  EXPECT_EQ(ft.model().transformer().n_kv_head(), 4);
  EXPECT_EQ(ft.model().transformer().head_dim(), 4);
  EXPECT_EQ(ft.model().transformer().norm_eps(), 1e-5);
  EXPECT_EQ(ft.model().transformer().rope_theta(), 10000.0);
  EXPECT_EQ(ft.model().transformer().attention(), "mha");
  absl::StatusOr<job::ResolvedJob> rt2 = job::ResolveJob(ft, "/");
  ASSERT_TRUE(rt2.ok()) << rt2.status();
  EXPECT_EQ(std::get<job::TransformerModel>(rt2->model_form).dims,
            std::get<job::TransformerModel>(rt->model_form).dims);
  EXPECT_EQ(job::FilledSpec(*rt2).SerializeAsString(), ft.SerializeAsString());

  // data.shuffle's seed is read, and kept.
  v1::JobSpec shuffled = f;
  shuffled.mutable_data()->mutable_shuffle()->set_seed(5);
  absl::StatusOr<job::ResolvedJob> rs = job::ResolveJob(shuffled, "/");
  ASSERT_TRUE(rs.ok()) << rs.status();
  EXPECT_EQ(rs->shuffle_seed, std::optional<uint64_t>(5));
  EXPECT_EQ(job::FilledSpec(*rs).data().shuffle().seed(), 5u);
  EXPECT_FALSE(r->shuffle_seed.has_value());  // in order by default

  // An mlp keeps its teacher, with the default samples written out.
  const std::string mlp = dir.Write("mlp.yaml", kMinimalJob);
  absl::StatusOr<job::ResolvedJob> rm = job::LoadResolvedJob(mlp);
  ASSERT_TRUE(rm.ok()) << rm.status();
  EXPECT_EQ(job::FilledSpec(*rm).data().teacher().samples(), 4096);
}

TEST(JobTest, EveryExampleIsAValidJobOrSpec) {
  int jobs = 0;
  for (const auto& entry : fs::directory_iterator(MUONMESH_EXAMPLES_DIR)) {
    if (entry.path().extension() != ".yaml" && entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    absl::StatusOr<v1::JobSpec> job = job::LoadJobFile(entry.path().string());
    if (!job.ok()) {
      v1::ModelSpec spec;
      EXPECT_TRUE(protoio::LoadMessageFile(entry.path().string(), &spec).ok()) << job.status();
      continue;
    }
    ++jobs;
    EXPECT_THAT(job::ValidateJob(*job), IsEmpty());
  }
  EXPECT_GE(jobs, 7);
}

TEST(JobTest, MissingJobFileIsNotFound) {
  TempDir dir;
  absl::StatusOr<v1::JobSpec> job = job::LoadJobFile(dir.dir() + "/nope.yaml");
  EXPECT_EQ(job.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("nope.yaml"));
}

}  // namespace
}  // namespace muonmesh::worker
