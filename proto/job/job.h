#pragma once

// The job file (docs/architecture.md §2): loading a JobSpec from YAML or JSON, validating it, and
// resolving it into plain values with every default filled in, for the worker runtime and the
// standalone launcher.
//
// Defaults. The job file is proto3, which cannot tell an unset number from 0, so for the fields
// below 0 (or an empty string) means "use the default":
//   device                      cpu
//   parallelism.*               left as given: plan::Validate/Resolve apply the planner's
//                               defaults (optim_grads_params, I = 1, EP = 1)
//   optimizer.muon              lr 0.02, momentum 0.95, nesterov true, ns_steps 5,
//                               weight_decay 0, scale original, coefficients quintic,
//                               ns_algorithm auto
//   optimizer.adamw             lr 1e-3, beta1 0.9, beta2 0.999, eps 1e-8 (only when unset: an
//                               explicit eps must be > 0), weight_decay 0
//   optimizer.owner_assignment  lpt
//   optimizer.muon_replica_split auto
//   model.synthetic.scale       1 (full size)
//   init                        seed 0 when neither seed nor safetensors is given;
//                               init.fresh false (a start over an earlier run's outputs
//                               in output.dir is refused)
//   data                        teacher {seed: 0, samples: 4096} when nothing is given
//   data.teacher.samples        4096
//   data.text/tokens.val_fraction 0.1 (without val; 0 means no validation)
//   data.shuffle                unset: samples in order (k mod N)
//   training.eval_every         0 (validate after the last step only)
//   training.eval_batches       4
//   training.checkpoint_every   0 (no checkpoints)
//   training.keep_checkpoints   2 (the newest complete checkpoints kept)
//   training.max_restarts       0
//   training.threads_per_rank   1 (OpenBLAS threads a rank runs its math on)
//   output.dir                  runs/<name>
//   output.export               <output dir>/final.safetensors
// Consequently momentum, beta1 and beta2 cannot be set to exactly 0 (a tiny value such as 1e-12
// does the same), and weight_decay 0 is its own default. training.steps and
// training.global_batch_size are required.
//
// Relative paths in the job (init and data safetensors, the synthetic model spec, output
// folder and export file) are relative to the folder of the job file, so a job runs the same
// from any working directory.
//
// Rules beyond plain ranges: the name must match [A-Za-z0-9._-]+ (it names the output folder);
// training.global_batch_size must split evenly over the world_size data-parallel ranks and not
// exceed the data set's samples (teacher data here; a data file's when it is loaded); the
// synthetic workload takes no data section (its gradients are generated); rule patterns must
// compile as RE2 regular expressions (proto/job/optimizer_rules.h: linear-time matching, no
// back-references).
//
// What is validated here: everything that does not need the model's parameter list, including
// the model-independent checks of the parallelism config (run through plan::Validate). What
// needs the model (Muon on a tensor that is not a matrix, expert stacks and EP, layout limits) is
// checked by plan::Validate when the runtime builds the plan.
//
// Free functions with no shared state: any thread may call them.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/model/gpt_spec.h"
#include "core/optim/schedule.h"
#include "core/optim/types.h"
#include "core/plan/types.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/job/corpus.h"
#include "proto/job/model_kind.h"
#include "proto/job/optimizer_rules.h"

namespace muonmesh::job {

// Documented limits: beyond them a job is rejected, not attempted.
inline constexpr int64_t kMaxJobWorldSize = int64_t{1} << 20;
inline constexpr size_t kMaxJobNameLength = 200;
inline constexpr int64_t kMaxTrainingSteps = 1'000'000'000;
inline constexpr int64_t kMaxGlobalBatchSize = int64_t{1} << 30;
inline constexpr int64_t kMaxTeacherSamples = int64_t{1} << 30;
inline constexpr int64_t kMaxRestarts = 1000;
// training.elastic.wait: unset, and the most it may be.
inline constexpr absl::Duration kDefaultElasticWait = absl::Seconds(30);
inline constexpr absl::Duration kMaxElasticWait = absl::Hours(24);
inline constexpr int64_t kMaxModelDim = int64_t{1} << 20;  // any mlp / moe_mlp width
inline constexpr size_t kMaxMlpLayers = 1000;              // dims has at most this + 1 entries
inline constexpr size_t kMaxOptimizerRules = 256;
inline constexpr size_t kMaxRulePatternLength = 1000;
inline constexpr int64_t kDefaultTeacherSamples = 4096;
inline constexpr int64_t kDefaultEvalBatches = 4;
inline constexpr int64_t kMaxEvalBatches = 1'000'000;
inline constexpr double kDefaultValFraction = 0.1;
inline constexpr int64_t kDefaultKeepCheckpoints = 2;
inline constexpr int64_t kMaxKeepCheckpoints = 1'000'000'000;

// optimizer.muon.health_every when unset: the orthogonality error every 100
// steps (its cost: docs/architecture.md, "Muon health").
inline constexpr int64_t kDefaultMuonHealthEvery = 100;

struct ResolvedJob {
  // The job as given (what the planner's input is made from: model_specs.h).
  v1::JobSpec spec;
  std::string name;
  int64_t world_size = 1;
  std::string device;  // "cpu" | "cuda"

  // As given in the file; plan::Resolve applies its defaults.
  plan::ParallelismConfig parallelism;
  std::string owner_assignment;  // lpt | round_robin | allgather | greedy_in_order
  int64_t muon_buffer_bytes = 0;  // optimizer.muon_buffer_bytes (TrainerOptions)
  int64_t bucket_bytes = 0;       // communication.bucket_bytes, its default applied
  std::string comm_backend;       // communication.backend: "nccl" or "gloo", default applied
  bool prefetch_gathers = true;   // communication.prefetch, default applied
  int64_t window_bytes = 0;       // communication.window_bytes (0: no limit)
  bool muon_in_backward = true;   // communication.muon_in_backward, default applied
  // communication.reshard_after_forward; unset, by the model's size
  // (ReshardsAfterForward, proto/job/model_specs.h).
  bool reshard_after_forward = true;
  bool overlap_param_gather = true;  // communication.overlap_param_gather, default applied
  std::string muon_replica_split;  // optimizer.muon_replica_split: auto | on | off

  optim::MuonOptions muon;
  optim::AdamWOptions adamw;
  // optimizer.muon.momentum_warmup; unset: muon.momentum throughout.
  std::optional<optim::MomentumWarmup> momentum_warmup;
  // optimizer.muon.qk_clip (0: no clipping) and optimizer.muon.health_every
  // (0: no orthogonality error).
  double qk_clip = 0;
  int64_t muon_health_every = kDefaultMuonHealthEvery;
  // optimizer.rules in file order: the first match wins.
  std::vector<OptimizerRule> optimizer_rules;

  // The model section: its kind (never null once resolved), as given, and
  // resolved (the kind's alternative of ModelForm; proto/job/model_kind.h).
  const ModelKind* kind = nullptr;
  v1::ModelConfig model;
  ModelForm model_form;
  // The input file the section names (synthetic's spec), path resolved.
  std::optional<ModelFile> model_file;
  // data.text or data.tokens (kinds with DataUse::kCorpus), paths resolved.
  Corpus corpus;

  // Exactly one of init_seed / init_safetensors / init_checkpoint is set
  // (the path non-empty). init_checkpoint: what worker/reshard.h's
  // LoadWholeState reads (a file or a folder, resolved); with it,
  // fresh_optimizer_state starts the optimizer state afresh.
  std::optional<uint64_t> init_seed;
  std::string init_safetensors;
  std::string init_checkpoint;
  bool fresh_optimizer_state = false;
  // init.fresh: start over in an output folder with an earlier run's
  // outputs, moving them aside (worker/rank_runner.cc, GuardEarlierRun).
  bool fresh_start = false;
  // Exactly one of teacher_seed / data_safetensors is set; teacher_samples goes with the seed.
  std::optional<uint64_t> teacher_seed;
  int64_t teacher_samples = 0;
  std::string data_safetensors;
  // data.shuffle's seed: training samples in a seeded order per epoch
  // (core/model/sample_order.h); unset: in order.
  std::optional<uint64_t> shuffle_seed;

  int64_t steps = 0;
  int64_t global_batch_size = 0;
  int64_t checkpoint_every = 0;  // 0: no checkpoints
  int64_t keep_checkpoints = kDefaultKeepCheckpoints;  // complete ones kept, >= 1
  int64_t max_restarts = 0;
  int64_t threads_per_rank = 1;  // OpenBLAS threads the rank runs (resolved: >= 1)
  // Language models: validation every eval_every steps (0: after the last
  // step only) on eval_batches global batches of validation windows.
  int64_t eval_every = 0;
  int64_t eval_batches = 4;
  // training.lr_schedule (constant without one) and training.clip_grad_norm
  // (unset: no clipping).
  optim::LrSchedule lr_schedule;
  std::optional<double> clip_grad_norm;
  // training.micro_batch_size: 0 for the whole local batch at once.
  int64_t micro_batch_size = 0;

  std::string output_dir;   // resolved
  std::string export_path;  // resolved
  // output.export_format: "muonmesh" or "hf" (config.json goes beside
  // export_path).
  std::string export_format = "muonmesh";
};

// The job as `r` runs it, as a JobSpec: the file's own values with every
// default of the table above filled in and every path resolved (what
// `muonmeshctl validate --job` prints). Resolving it again gives `r` back.
v1::JobSpec FilledSpec(const ResolvedJob& r);

// Reads a job file (YAML or JSON) through protoio. Returns NotFound if it does not exist, and
// InvalidArgument located as "FILE:LINE:COL: field.path: reason" (with a "did you mean"
// suggestion for a misspelt field) if it does not parse.
absl::StatusOr<v1::JobSpec> LoadJobFile(const std::string& path);

// Every violation of `job` at once, with field paths as written in the file
// ("optimizer.muon.momentum", "model.mlp.dims[2]", "training.global_batch_size"). Does not touch
// the file system (ResolveJob checks that input files exist). Empty when the job is valid.
std::vector<plan::FieldViolation> ValidateJob(const v1::JobSpec& job);

// The job with every default resolved and relative paths joined to `job_dir` (left as they are
// when `job_dir` is empty). Returns InvalidArgument listing every violation, from ValidateJob,
// for input files (init, data, synthetic spec) that do not exist or are not regular files, and
// from CheckOutputPaths, as "field: description; field: description".
absl::StatusOr<ResolvedJob> ResolveJob(const v1::JobSpec& job, const std::string& job_dir);
// What ResolveJob refuses, every violation: ValidateJob's and the paths'
// (inputs that must be readable files or match a glob, outputs that must be
// writable), relative paths joined to `job_dir`.
std::vector<plan::FieldViolation> JobViolations(const v1::JobSpec& job, const std::string& job_dir);

// optimizer.rules as the job file gives them, in order.
std::vector<OptimizerRule> OptimizerRulesOf(const v1::JobSpec& job);

// What the job's recipe runs, for people (muonmeshctl plan --job): the
// schedule, clipping and momentum warmup in words, then both learning rates
// (and Muon's momentum) at the steps where the schedule turns: the first,
// the warmup's last, the decay's first, its middle and the last. Lines end
// with a newline. `job` must be valid (ValidateJob).
std::string DescribeRecipe(const v1::JobSpec& job);

// training.elastic: the world sizes the job may shrink to, largest first
// (w in [min_world_size, world_size) that split the global batch evenly and
// that the parallelism config allows; the planner's model checks are the
// coordinator's), empty without it; and its wait (kDefaultElasticWait when
// unset or, not validated, unreadable).
std::vector<int64_t> ElasticWorldSizes(const v1::JobSpec& job);
absl::Duration ElasticWait(const v1::JobSpec& job);

// Violations of the output paths: `output_dir`, its checkpoints/ and metrics/ folders and the
// export file's folder must be folders if they exist; `export_path` must be a regular file if it
// exists (not a device, FIFO, socket, folder or symbolic link: outputs are replaced by rename).
// ResolveJob runs it; the runtime runs it again just before writing.
std::vector<plan::FieldViolation> CheckOutputPaths(const std::string& output_dir,
                                                   const std::string& export_path);

// LoadJobFile, then ResolveJob against the file's folder; every error message starts with
// `path`.
absl::StatusOr<ResolvedJob> LoadResolvedJob(const std::string& path);

// The job's device: device as given, "cpu" when unset (every component's
// one reading of an empty device).
std::string DeviceOf(const v1::JobSpec& job);

// communication.backend, or its default: "nccl" on device cuda, "gloo" on
// cpu.
std::string CommBackendOf(const v1::JobSpec& job);

// The violations as one message: "field: description; field: description".
std::string JoinViolations(const std::vector<plan::FieldViolation>& violations);

}  // namespace muonmesh::job
