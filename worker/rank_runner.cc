#include "worker/rank_runner.h"

#include <sys/resource.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "core/base/status_macros.h"
#include "core/optim/ns_coefficients.h"
#include "core/plan/mesh.h"
#include "core/plan/validate.h"
#include "core/plan/waves.h"
#include "proto/job/model_specs.h"
#include "worker/checkpoints.h"
#include "worker/io/safetensors.h"
#include "worker/job/memory_budget.h"
#include "worker/job/memory_estimate.h"
#include "worker/math/blas_threads.h"
#include "worker/reshard.h"
#include "worker/runtime/muon_schedule.h"
#include "worker/runtime/trainer.h"
#include "worker/step_log.h"
#include "worker/workload_factory.h"

namespace muonmesh::worker {

namespace {

// A plan from elsewhere (the coordinator's, perhaps of another version) must
// be one made for this job: the runtime indexes and divides by its geometry.
// Its config against the config of the job's own planner input (the one
// translation both sides use, job::PlanInputOf), its domains against the
// geometry that config gives. The thread count is SetRankThreads's check.
absl::Status CheckPlanFitsJob(const job::ResolvedJob& job, const plan::Plan& plan) {
  MUONMESH_ASSIGN_OR_RETURN(const plan::PlanInput input, job::PlanInputOf(job));
  MUONMESH_ASSIGN_OR_RETURN(const plan::ResolvedConfig want, plan::Resolve(input),
                            "the job's own planner input");
  const plan::ResolvedConfig& got = plan.config;
  std::vector<std::string> wrong;
  auto compare = [&](const char* what, int64_t planned, int64_t expected) {
    if (planned != expected) {
      wrong.push_back(absl::StrCat(what, " ", planned, " (the job's: ", expected, ")"));
    }
  };
  compare("world_size", got.world_size, want.world_size);
  compare("optimizer instances", got.instances, want.instances);
  compare("expert parallel size", got.ep, want.ep);
  compare("inner strategy", static_cast<int64_t>(got.inner), static_cast<int64_t>(want.inner));
  compare("outer strategy", static_cast<int64_t>(got.outer), static_cast<int64_t>(want.outer));
  compare("ns_steps", got.ns_steps, want.ns_steps);
  compare("ns_algorithm", static_cast<int64_t>(got.ns_algorithm),
          static_cast<int64_t>(want.ns_algorithm));
  compare("ns table", static_cast<int64_t>(got.ns_table), static_cast<int64_t>(want.ns_table));
  compare("reshard_after_forward", got.reshard_after_forward, want.reshard_after_forward);
  if (wrong.empty()) {
    compare("dense domain size", plan.dense.size,
            plan::MeshGeometry::Dense(got).domain_size());
    if (plan.dense.replicas != 1 && plan.dense.replicas != got.instances) {
      wrong.push_back(absl::StrCat("dense replicas ", plan.dense.replicas, " (1 or the ",
                                   got.instances, " optimizer instances)"));
    }
    if (plan.has_experts) {
      compare("expert domain size", plan.expert.size,
              plan::MeshGeometry::Expert(got).domain_size());
    }
  }
  if (wrong.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("the plan was not made for this job: ",
                                                 absl::StrJoin(wrong, "; ")));
}

std::string Ms(absl::Duration d) { return absl::StrFormat("%.1f", absl::ToDoubleMilliseconds(d)); }

int64_t PeakRssBytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

int64_t FileBytes(const std::string& path) {
  std::error_code ec;
  const std::uintmax_t size = path.empty() ? 0 : std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(size);
}

// Refuses, before anything whose size comes from the job is allocated, a
// job whose estimated peak exceeds this rank's memory budget; returns the
// estimated peak otherwise.
absl::StatusOr<double> CheckMemory(const RankOptions& options, const job::ResolvedJob& job,
                                   const plan::Plan& plan, bool resharding = false) {
  const int64_t budget = options.memory_budget_bytes > 0
                             ? options.memory_budget_bytes
                             : DefaultMemoryBudgetBytes(options.ranks_on_this_host);
  const MemoryEstimate estimate = EstimateRankMemory(
      job, plan, options.rank, {FileBytes(job.data_safetensors), FileBytes(job.init_safetensors)},
      resharding);
  MUONMESH_RETURN_IF_ERROR(CheckMemoryBudget(estimate, budget, options.rank));
  return estimate.peak_bytes;
}

// Runs this process's OpenBLAS on the threads the plan priced the
// Newton-Schulz forms for (the job's training.threads_per_rank).
absl::Status SetRankThreads(const RankOptions& options, const job::ResolvedJob& job,
                            const plan::Plan& plan, const LineSink& out) {
  if (plan.config.threads_per_rank != job.threads_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the plan was priced for ", plan.config.threads_per_rank,
        " threads a rank but the job's training.threads_per_rank is ", job.threads_per_rank));
  }
  math::SetBlasThreads(static_cast<int>(job.threads_per_rank));
  if (options.rank != 0) return absl::OkStatus();  // the notes once per job
  if (const int running = math::BlasThreads(); running != job.threads_per_rank) {
    out(absl::StrCat("threads: OpenBLAS runs ", running, " threads, not the ",
                     job.threads_per_rank, " of training.threads_per_rank (its build's limit)"));
  }
  const int64_t cores = std::thread::hardware_concurrency();
  if (cores > 0 && job.threads_per_rank * options.ranks_on_this_host > cores) {
    out(absl::StrCat("threads: ", options.ranks_on_this_host, " ranks on this host at ",
                     job.threads_per_rank, " OpenBLAS threads each (training.threads_per_rank) "
                     "oversubscribe its ", cores, " cores"));
  }
  return absl::OkStatus();
}

// Every sample of a global batch is distinct only if the data set has at
// least that many (the batch formula wraps around otherwise).
absl::Status CheckBatchFitsData(const job::ResolvedJob& job, const Workload& workload) {
  if (job.kind->data == job::DataUse::kNone) return absl::OkStatus();
  if (job.global_batch_size <= workload.num_samples()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "training.global_batch_size: ", job.global_batch_size, " exceeds the ",
      workload.num_samples(), " samples of the data set",
      job.data_safetensors.empty() ? "" : absl::StrCat(" in ", job.data_safetensors)));
}

void PrintPlan(const job::ResolvedJob& job, const plan::Plan& plan, const LineSink& out) {
  int64_t planned = 0;
  for (const plan::CollectiveBytes& c : plan.collectives) planned += c.bytes_per_step;
  // Every domain of a mesh moves the same bytes; under the HSDP replica
  // split, every set of replica domains.
  const int64_t dense_sets = job.world_size / plan.dense.size / plan.dense.replicas;
  int64_t exchange = plan.dense.exchange_bytes * dense_sets;
  int64_t bound = plan.dense.exchange_lower_bound_bytes * dense_sets;
  if (plan.has_experts) {
    exchange += plan.expert.exchange_bytes * (job.world_size / plan.expert.size);
    bound += plan.expert.exchange_lower_bound_bytes * (job.world_size / plan.expert.size);
  }
  out(absl::StrFormat("plan: %d bytes per step in all collectives, Muon exchange %d bytes "
                      "(lower bound %d)",
                      planned, exchange, bound));
  out(absl::StrFormat("plan: Muon critical path %.4g flop-equivalents (rank %d), joint lower "
                      "bound %.4g (%.4fx)%s",
                      plan.joint_makespan, plan.joint_critical_rank, plan.joint_lower_bound,
                      plan.joint_lower_bound > 0 ? plan.joint_makespan / plan.joint_lower_bound : 1.0,
                      plan.joint_strong_lower_bound > plan.joint_lower_bound
                          ? absl::StrFormat(", certified bound %.4g (%.4fx)",
                                            plan.joint_strong_lower_bound,
                                            plan.joint_makespan / plan.joint_strong_lower_bound)
                          : ""));
  if (plan.joint_makespan_split > 0) {
    out(absl::StrFormat(
        "plan: HSDP replica split %s (optimizer.muon_replica_split %s): Muon critical path "
        "%.4g split%s",
        plan.dense.replicas > 1 ? "on" : "off", job.muon_replica_split, plan.joint_makespan_split,
        plan.joint_makespan_unsplit > 0
            ? absl::StrFormat(", %.4g unsplit", plan.joint_makespan_unsplit)
            : ""));
  }
  const int64_t waves =
      static_cast<int64_t>(PlanMuonWaves(plan, plan::JobWaveBudget(job.muon_buffer_bytes,
                                                                  job.device))
                               .size());
  out(absl::StrFormat("plan: Muon phase in %d wave(s) (optimizer.muon_buffer_bytes %d; %d keeps "
                      "it within the backward pass's memory peak)%s",
                      waves, job.muon_buffer_bytes, BackwardPeakMuonBufferBytes(plan),
                      waves > 1 && job.muon_in_backward && job.device == "cpu"
                          ? "; the last wave's gather inside the backward pass "
                            "(communication.muon_in_backward)"
                          : ""));
  // The after-step gathers, where the plan has them (parameters replicated
  // over optimizer shards): beside the next step, or within the step.
  const bool after_step =
      std::any_of(plan.collectives.begin(), plan.collectives.end(), [](const auto& c) {
        return c.name == "param_allgather_after_step" && c.bytes_per_step > 0;
      });
  if (after_step) {
    const bool beside = job.overlap_param_gather && job.device == "cpu" && job.qk_clip <= 0;
    out(absl::StrCat("plan: the updated parameters gathered after each step ",
                     beside ? "beside the next step (communication.overlap_param_gather)"
                            : "within the step",
                     !beside && job.overlap_param_gather
                         ? (job.qk_clip > 0 ? " (QK-clip rescales what it hands round)"
                                            : " (device cuda)")
                         : ""));
  }
  // OpenBLAS's own count, as SetRankThreads left it.
  const int threads = math::BlasThreads();
  out(absl::StrFormat("job %s: %d ranks, %s, %d steps, global batch %d, %d thread%s a rank",
                      job.name, job.world_size, job.owner_assignment, job.steps,
                      job.global_batch_size, threads, threads == 1 ? "" : "s"));
  if (job.device == "cuda" && job.comm_backend == "gloo") {
    out("collectives: gloo via host copies of the GPU's buffers (communication.backend gloo: "
        "ranks may share a GPU; a test and development mode, slower than nccl)");
  }
}

// The device and the workload on it, with its data.
struct Engine {
  std::unique_ptr<Device> device;
  std::unique_ptr<Workload> workload;
};

absl::StatusOr<Engine> MakeEngine(const job::ResolvedJob& job, const RankOptions& options) {
  Engine e;
  // The device first: a GPU workload generates on the GPU made current here.
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<Device> device,
                            MakeDevice(job, options.rank, options.cuda_device));
  e.device = std::move(device);
  absl::StatusOr<std::unique_ptr<Workload>> workload = MakeWorkload(job);
  MUONMESH_RETURN_IF_ERROR(workload.status());
  MUONMESH_RETURN_IF_ERROR(CheckBatchFitsData(job, **workload));
  if (job.device == "cuda") {
    workload = OnGpu(job, *std::move(workload));
    MUONMESH_RETURN_IF_ERROR(workload.status());
  }
  e.workload = *std::move(workload);
  return e;
}

absl::StatusOr<std::unique_ptr<Trainer>> MakeTrainer(const job::ResolvedJob& job,
                                                     const plan::Plan& plan, Engine& engine,
                                                     comm::Store& store,
                                                     const RankOptions& options) {
  std::vector<std::vector<float>> initial;
  TrainerOptions topts;
  topts.device = engine.device.get();
  if (!job.init_safetensors.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(std::vector<std::vector<float>> init,
                              InitialFromFile(engine.workload->spec(), job.init_safetensors));
    initial = std::move(init);
    topts.initial_parameters = &initial;
    MUONMESH_ASSIGN_OR_RETURN(std::vector<std::vector<float>> buffers,
                              BuffersFromFile(engine.workload->buffers(), job.init_safetensors));
    MUONMESH_RETURN_IF_ERROR(engine.workload->SetBuffers(buffers));
  }
  // Gloo with device cuda copies through host memory (the trainer sets the
  // groups' buffers from the device).
  topts.backend = job.comm_backend == "nccl" ? comm::Backend::kNccl : comm::Backend::kGloo;
  topts.store = &store;
  topts.group_options.gloo_hostname = options.hostname;
  topts.group_options.gloo_interface = options.gloo_interface;
  topts.group_options.connect_timeout = options.timeout;
  topts.group_options.abort = options.abort;
  topts.group_options.gloo_window_bytes = job.window_bytes;
  topts.collective.timeout = options.timeout;
  topts.group_prefix = options.group_prefix;
  topts.muon = job.muon;
  topts.muon_buffer_bytes = job.muon_buffer_bytes;
  topts.bucket_bytes = job.bucket_bytes;
  topts.prefetch_gathers = job.prefetch_gathers;
  topts.muon_in_backward = job.muon_in_backward;
  topts.overlap_param_gather = job.overlap_param_gather;
  topts.adamw = job.adamw;
  topts.global_batch_size = job.global_batch_size;
  topts.lr_schedule = job.lr_schedule;
  topts.total_steps = job.steps;
  topts.momentum_warmup = job.momentum_warmup;
  topts.clip_grad_norm = job.clip_grad_norm.value_or(0.0);
  topts.qk_clip = job.qk_clip;
  topts.health_every = job.muon_health_every;
  topts.micro_batch_size = job.micro_batch_size;
  topts.shuffle_seed = job.shuffle_seed;
  MUONMESH_ASSIGN_OR_RETURN(topts.param_rates,
                            job::ParamRatesOf(engine.workload->spec(), job.optimizer_rules));
  topts.init_seed = job.init_seed.value_or(0);
  // `initial` goes out of scope on return: the trainer holds its shards.
  return Trainer::Create(plan, engine.workload.get(), options.rank, topts);
}

// Whether `path` is `dir` or lies under it (both as the file system
// resolves them).
bool Within(const std::string& path, const std::string& dir) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  const std::filesystem::path d = std::filesystem::weakly_canonical(dir, ec);
  auto [end, unused] = std::mismatch(d.begin(), d.end(), p.begin(), p.end());
  return !ec && end == d.end();
}

// Whether the job continues the series of its own output folder's
// checkpoints: init.checkpoint lies among them (or holds them).
bool ContinuesOwnSeries(const job::ResolvedJob& job) {
  const std::string own = job.output_dir + "/checkpoints";
  return !job.init_checkpoint.empty() &&
         (Within(job.init_checkpoint, own) || Within(own, job.init_checkpoint));
}

// What an earlier run left in the job's output folder that a fresh start
// would overwrite: its checkpoints (any entry of checkpoints/), its metrics
// files and its export. Paths, for the message.
std::vector<std::string> EarlierOutputs(const job::ResolvedJob& job) {
  namespace fs = std::filesystem;
  std::vector<std::string> found;
  std::error_code ec;
  const fs::path dir(job.output_dir);
  if (const fs::path sub = dir / "checkpoints"; fs::is_directory(sub, ec) && !fs::is_empty(sub, ec)) {
    const std::optional<int64_t> newest = NewestCheckpoint(job.output_dir);
    found.push_back(newest.has_value() ? absl::StrCat(sub.string(), "/ (up to step ", *newest, ")")
                                       : sub.string() + "/");
  }
  if (const fs::path sub = dir / "metrics"; fs::is_directory(sub, ec) && !fs::is_empty(sub, ec)) {
    found.push_back(sub.string() + "/");
  }
  if (!job.export_path.empty() && fs::exists(fs::symlink_status(job.export_path, ec))) {
    found.push_back(job.export_path);
  }
  return found;
}

// Rank 0 under init.fresh: the earlier run's outputs into
// <output.dir>/earlier-<UTC time>/ (renamed, never copied or deleted).
absl::Status MoveEarlierRunAside(const job::ResolvedJob& job, const LineSink& out) {
  namespace fs = std::filesystem;
  const fs::path dir(job.output_dir);
  const std::string stamp = absl::FormatTime("%Y%m%dT%H%M%SZ", absl::Now(), absl::UTCTimeZone());
  fs::path aside = dir / ("earlier-" + stamp);
  std::error_code ec;
  for (int n = 2; fs::exists(fs::symlink_status(aside, ec)); ++n) {
    aside = dir / absl::StrCat("earlier-", stamp, "-", n);
  }
  fs::create_directories(aside, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat(aside.string(), ": cannot create: ", ec.message()));
  }
  std::vector<std::pair<fs::path, fs::path>> moves = {{dir / "checkpoints", aside / "checkpoints"},
                                                      {dir / "metrics", aside / "metrics"}};
  if (!job.export_path.empty()) {
    moves.emplace_back(job.export_path, aside / fs::path(job.export_path).filename());
  }
  for (const auto& [from, to] : moves) {
    if (!fs::exists(fs::symlink_status(from, ec))) continue;
    fs::rename(from, to, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("init.fresh: cannot move ", from.string(), " to ",
                                              to.string(), ": ", ec.message()));
    }
  }
  out(absl::StrCat("init.fresh: the earlier run's outputs are now in ", aside.string()));
  return absl::OkStatus();
}

// An error of the job that no restart can mend (kJobErrorPayload).
absl::Status JobError(absl::Status status) {
  status.SetPayload(kJobErrorPayload, absl::Cord());
  return status;
}

// A first attempt that starts over (no resume, not continuing its folder's
// own checkpoints) must not overwrite what an earlier run left in its
// output folder: refused, as an error of the job (a restart would resume
// that earlier run), unless init.fresh says to move those outputs aside.
// Every rank checks before it writes anything; under init.fresh rank 0
// moves them before the group's rendezvous, which every rank passes before
// it opens its metrics file.
absl::Status GuardEarlierRun(const job::ResolvedJob& job, const RankOptions& options,
                             const LineSink& out) {
  if (options.resume) return absl::OkStatus();
  const bool continues = ContinuesOwnSeries(job);
  if (continues && job.fresh_start) {
    return JobError(absl::InvalidArgumentError(absl::StrCat(
        "init.fresh: init.checkpoint ", job.init_checkpoint, " lies in the job's own ",
        job.output_dir, "/checkpoints, which init.fresh would move aside: continue the run "
        "(drop init.fresh) or start over (drop init.checkpoint)")));
  }
  if (continues) return absl::OkStatus();
  const std::vector<std::string> earlier = EarlierOutputs(job);
  if (earlier.empty()) return absl::OkStatus();
  if (job.fresh_start) return options.rank == 0 ? MoveEarlierRunAside(job, out) : absl::OkStatus();
  return JobError(absl::FailedPreconditionError(absl::StrCat(
      "output.dir: ", job.output_dir, " holds an earlier run's outputs (",
      absl::StrJoin(earlier, ", "),
      ") that this job, starting at step 0, would overwrite. Continue that run (init: "
      "{checkpoint: ", job.output_dir, "}), give this job another output.dir, or set "
      "init: {fresh: true} to start over with them moved to ", job.output_dir,
      "/earlier-<time>/")));
}

// Puts the state `source` holds (worker/reshard.h) into the trainer: the
// job's own newest checkpoint on a resume (which may be its last step: the
// job then only exports), else init.checkpoint, which must leave steps to
// run and, when it lies among the job's own checkpoints, be the newest of
// them (the run continues their series).
enum class StateSource { kResume, kInit };

absl::Status LoadResharded(const job::ResolvedJob& job, const std::string& source, bool fresh_state,
                           Trainer& trainer, bool talk, const LineSink& out, StateSource kind,
                           bool in_own_series = false) {
  const bool resume = kind == StateSource::kResume;
  const std::string what = resume ? "resume" : "init.checkpoint";
  std::string from;
  std::vector<std::string> notes;
  absl::StatusOr<WholeState> state = LoadWholeState(source, &from, &notes);
  if (talk) {
    for (const std::string& n : notes) out(absl::StrCat(what, ": ", n));
  }
  MUONMESH_RETURN_IF_ERROR(state.status(), what);
  if (const std::optional<int64_t> newest = NewestCheckpoint(job.output_dir);
      in_own_series && newest.has_value() && *newest > state->step) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", from, " is at step ", state->step,
        ", but the job's own output folder holds a newer checkpoint (step ", *newest,
        ") that this run would mix with: name the newest, or give the job another output.dir"));
  }
  if (state->step > job.steps || (!resume && state->step == job.steps)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", from, " is at step ", state->step,
                                                   ", not below training.steps ", job.steps,
                                                   " (the total: nothing is left to run)"));
  }
  MUONMESH_RETURN_IF_ERROR(trainer.LoadState(*state, fresh_state), what, ": ", from);
  if (talk) {
    out(absl::StrCat(what, ": from ", from, " at step ", state->step,
                     fresh_state ? " (fresh optimizer state)" : "", ", resharded to ",
                     job.world_size, " ranks"));
  }
  return absl::OkStatus();
}

// Where the run starts. A resume takes the newest complete checkpoint of
// the job, written by any number of ranks under any layout (one of another
// layout is resharded; docs/architecture.md §7); without one, or on a fresh
// start, init.checkpoint when the job names one, else step 0 (GuardEarlierRun
// has made sure that a fresh start overwrites nothing an earlier run wrote).
absl::Status StartFromCheckpoints(const job::ResolvedJob& job, const plan::Plan& plan,
                                  Trainer& trainer, const RankOptions& options,
                                  const LineSink& out) {
  const bool talk = options.rank == 0;
  const std::string old = job.output_dir + "/checkpoints";
  if (options.resume) {
    const CheckpointChoice choice = NewestValidCheckpoint(job.output_dir, kAnyWorldSize);
    if (talk) {
      for (const std::string& why : choice.skipped) out(absl::StrCat("resume: skipping ", why));
    }
    if (choice.step.has_value()) {
      if (choice.manifest.world_size != job.world_size ||
          choice.manifest.layout != trainer.LayoutFingerprint()) {
        // Checked again with the whole state it is about to hold.
        MUONMESH_RETURN_IF_ERROR(CheckMemory(options, job, plan, /*resharding=*/true).status(),
                                 "resume: resharding the checkpoint at step ", *choice.step,
                                 " (written by ", choice.manifest.world_size, " ranks)");
        return LoadResharded(job, choice.dir, false, trainer, talk, out, StateSource::kResume);
      }
      const std::string file = absl::StrCat(choice.dir, "/", RankFile(options.rank));
      MUONMESH_RETURN_IF_ERROR(trainer.LoadShards(file), "resuming");
      if (talk) out(absl::StrCat("resume: from the checkpoint at step ", *choice.step));
      return absl::OkStatus();
    }
    if (talk && job.init_checkpoint.empty()) {
      out("resume: no complete checkpoint yet; starting at step 0");
    }
  }
  if (job.init_checkpoint.empty()) return absl::OkStatus();
  const bool in_own_series = Within(job.init_checkpoint, old) || Within(old, job.init_checkpoint);
  return LoadResharded(job, job.init_checkpoint, job.fresh_optimizer_state, trainer, talk, out,
                       StateSource::kInit, in_own_series);
}

std::string StepLine(int64_t s, const StepReport& r) {
  int64_t bytes = 0;
  for (const auto& [name, b] : r.bytes_sent) bytes += b;
  const PhaseTimes& t = r.times;
  return absl::StrFormat(
      "step %4d  loss %.6e  grad_norm %.3e  lr x%.3f  | ms: gather %s fwd/bwd %s dispatch %s "
      "reduce %s adamw %s muon %s/%s/%s/%s after %s | sent %d B",
      s, r.loss, r.grad_norm, r.lr_scale, Ms(t.param_gather), Ms(t.forward_backward), Ms(t.expert_dispatch),
      Ms(t.grad_reduce), Ms(t.adamw), Ms(t.muon_gather), Ms(t.newton_schulz),
      Ms(t.muon_scatter), Ms(t.muon_apply), Ms(t.param_allgather_after_step), bytes);
}

// What the summary line reports.
struct RunTotals {
  std::vector<double> optimizer_ms;
  int64_t bytes = 0;
  int64_t muon_bytes = 0;
};

// Whether the validation loss is measured after step s: every eval_every
// steps and after the last, when the workload has validation data.
bool EvaluatesAfter(const job::ResolvedJob& job, int64_t s, bool validation) {
  if (!validation) return false;
  return s + 1 == job.steps || (job.eval_every > 0 && (s + 1) % job.eval_every == 0);
}

absl::Status TrainSteps(const job::ResolvedJob& job, Trainer& trainer, const RankOptions& options,
                        const RankHooks& hooks, RunTotals& totals, bool validation) {
  const bool talk = options.rank == 0;
  MUONMESH_ASSIGN_OR_RETURN(
      std::unique_ptr<StepLog> log,
      StepLog::Open(job.output_dir, options.rank, options.attempt,
                    /*append=*/options.resume || ContinuesOwnSeries(job)));
  for (int64_t s = trainer.steps_done(); s < job.steps; ++s) {
    if (s == options.fail_at_step && options.attempt == 0) {
      return absl::AbortedError(absl::StrCat("--fail-at-step ", s, ": failing on purpose"));
    }
    const absl::Time start = absl::Now();
    MUONMESH_ASSIGN_OR_RETURN(StepReport r, trainer.Step(), absl::StrCat("step ", s));
    const absl::Duration took = absl::Now() - start;
    if (EvaluatesAfter(job, s, validation)) {
      MUONMESH_ASSIGN_OR_RETURN(r.val_loss, trainer.Evaluate(job.eval_batches),
                                absl::StrCat("step ", s));
    }
    totals.optimizer_ms.push_back(absl::ToDoubleMilliseconds(OptimizerTime(r.times)));
    for (const auto& [name, b] : r.bytes_sent) {
      totals.bytes += b;
      if (absl::StrContains(name, "muon_")) totals.muon_bytes += b;
    }
    if (talk) hooks.out(StepLine(s, r));
    if (talk && r.val_loss.has_value()) {
      hooks.out(absl::StrFormat("step %4d  val_loss %.6e", s, *r.val_loss));
    }
    MUONMESH_RETURN_IF_ERROR((log)->Write(r, took));
    if (hooks.on_step) {
      MUONMESH_RETURN_IF_ERROR(hooks.on_step(r, took));
    }
    const bool drain = hooks.stop_after_checkpoint && hooks.stop_after_checkpoint();
    if (drain || (job.checkpoint_every > 0 && (s + 1) % job.checkpoint_every == 0)) {
      MUONMESH_RETURN_IF_ERROR(
          SaveCheckpoint(trainer, job.output_dir, job.world_size, options.rank));
      if (options.rank == 0) {
        if (absl::Status pruned = PruneCheckpoints(job.output_dir, job.keep_checkpoints);
            !pruned.ok()) {
          hooks.out(absl::StrCat("warning: pruning old checkpoints: ", pruned.message()));
        }
      }
      if (talk) {
        hooks.out(absl::StrCat("checkpoint: step ", s + 1, " in ",
                               CheckpointDir(job.output_dir, s + 1)));
      }
    }
    if (drain) {
      return absl::CancelledError(
          absl::StrCat("stopped after the checkpoint of step ", s + 1, " (a worker is drained)"));
    }
  }
  return absl::OkStatus();
}

// The export file's tensors and metadata: the spec's names and the buffers
// after them (listed in metadata "buffers", whole_state.h), or with
// output.export_format hf the Hugging Face names (model_kind.h's HfExport)
// and the metadata transformers' loader asks for.
absl::StatusOr<std::vector<io::SafetensorsWriter::Entry>> ExportEntries(
    const Workload& workload, const job::HfExport* hf, std::map<std::string, std::string>* metadata) {
  std::vector<io::SafetensorsWriter::Entry> entries;
  for (const plan::UnitSpec& u : workload.spec().units) {
    for (const plan::ParamSpec& p : u.params) {
      if (hf == nullptr) {
        entries.push_back({p.name, p.shape});
        continue;
      }
      auto it = hf->names.find(p.name);
      if (it == hf->names.end()) {
        return absl::InternalError(absl::StrCat("output.export_format hf: no name for ", p.name));
      }
      entries.push_back({it->second, p.shape});
    }
  }
  if (hf != nullptr) {
    (*metadata)["format"] = "pt";
    return entries;
  }
  std::string buffers;
  for (const BufferSpec& b : workload.buffers()) {
    entries.push_back({b.name, b.shape});
    absl::StrAppend(&buffers, b.name, "\n");
  }
  (*metadata)["buffers"] = buffers;
  return entries;
}

// The final weights, gathered a unit at a time; rank 0 streams them into the
// export file as they come (no rank holds the whole model), then, for a
// Hugging Face export, writes config.json beside it.
absl::Status ExportWeights(const job::ResolvedJob& job, Trainer& trainer, const Workload& workload,
                           const RankOptions& options, const LineSink& out) {
  std::unique_ptr<io::SafetensorsWriter> writer;
  std::optional<job::HfExport> hf;
  if (options.rank == 0 && !job.export_path.empty()) {
    if (job.export_format == "hf") {
      if (job.kind->hf_export == nullptr) {
        return absl::InvalidArgumentError("output.export_format: hf: the model has no such form");
      }
      MUONMESH_ASSIGN_OR_RETURN(hf, job.kind->hf_export(job.model_form), "output.export_format");
    }
    std::map<std::string, std::string> metadata;
    MUONMESH_ASSIGN_OR_RETURN(std::vector<io::SafetensorsWriter::Entry> entries,
                              ExportEntries(workload, hf ? &*hf : nullptr, &metadata));
    std::error_code ec;
    const std::filesystem::path parent = std::filesystem::path(job.export_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    MUONMESH_ASSIGN_OR_RETURN(
        std::unique_ptr<io::SafetensorsWriter> w,
        io::SafetensorsWriter::Create(job.export_path, std::move(entries), metadata));
    writer = std::move(w);
  }
  absl::Status gathered = trainer.GatherParameters(
      [&](int /*flat*/, std::vector<float>&& tensor) -> absl::Status {
        return writer == nullptr ? absl::OkStatus() : writer->Append(tensor);
      });
  MUONMESH_RETURN_IF_ERROR(gathered, "gathering the final weights");
  if (writer == nullptr) return absl::OkStatus();
  if (!hf.has_value()) {
    for (const std::vector<float>& values : workload.BufferValues()) {
      MUONMESH_RETURN_IF_ERROR(writer->Append(values));
    }
  }
  MUONMESH_RETURN_IF_ERROR(writer->Finish());
  out(absl::StrCat("wrote ", job.export_path));
  if (hf.has_value()) {
    const std::string config =
        (std::filesystem::path(job.export_path).parent_path() / "config.json").string();
    MUONMESH_RETURN_IF_ERROR(WriteFileAtomically(config, hf->config_json), "output.export_format hf");
    out(absl::StrCat("wrote ", config, " (Hugging Face LlamaForCausalLM)"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

double MedianAfterFirst(const std::vector<double>& values) {
  if (values.empty()) return 0.0;
  std::vector<double> sorted(values.begin() + (values.size() > 1 ? 1 : 0), values.end());
  std::sort(sorted.begin(), sorted.end());
  const size_t mid = sorted.size() / 2;
  return sorted.size() % 2 == 1 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

}  // namespace internal

absl::Status RunRank(const job::ResolvedJob& job, const plan::Plan& plan, comm::Store& store,
                     const RankOptions& options, const RankHooks& hooks) {
  const LineSink out = hooks.out ? hooks.out : [](const std::string&) {};
  RankHooks h = hooks;
  h.out = out;
  MUONMESH_RETURN_IF_ERROR(CheckPlanFitsJob(job, plan));
  MUONMESH_ASSIGN_OR_RETURN(double estimated_peak, CheckMemory(options, job, plan));
  MUONMESH_RETURN_IF_ERROR(GuardEarlierRun(job, options, out));
  MUONMESH_RETURN_IF_ERROR(SetRankThreads(options, job, plan, out));
  MUONMESH_ASSIGN_OR_RETURN(Engine engine, MakeEngine(job, options));
  if (options.rank == 0) PrintPlan(job, plan, out);
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                            MakeTrainer(job, plan, engine, store, options));
  MUONMESH_RETURN_IF_ERROR(StartFromCheckpoints(job, plan, *trainer, options, out));

  const int64_t first_step = (trainer)->steps_done();
  RunTotals totals;
  const bool validation = engine.workload->num_validation_samples() > 0;
  MUONMESH_RETURN_IF_ERROR(TrainSteps(job, *trainer, options, h, totals, validation));

  // One machine-readable line per rank (benchmarks aggregate them): the
  // optimizer step's median leaves the run's first step out when there are
  // more (it touches every page of the state for the first time), as the
  // peer benchmark's PyTorch side does (tests/worker/muon_peer.py).
  const double median = internal::MedianAfterFirst(totals.optimizer_ms);
  const int64_t steps = std::max<int64_t>(1, job.steps - first_step);
  out(absl::StrFormat(
      "summary rank=%d steps=%d optimizer_ms_median=%.3f bytes_per_step=%d "
      "muon_bytes_per_step=%d peak_rss_bytes=%d estimated_peak_bytes=%.0f shard_bytes=%d",
      options.rank, job.steps - first_step, median, totals.bytes / steps, totals.muon_bytes / steps,
      PeakRssBytes(), estimated_peak, (trainer)->shard_bytes()));
  return ExportWeights(job, *trainer, *engine.workload, options, out);
}

}  // namespace muonmesh::worker
