#include "worker/standalone.h"

#include <sys/resource.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/plan/planner.h"
#include "worker/checkpoints.h"
#include "worker/comm/file_store.h"
#include "worker/io/safetensors.h"
#include "worker/job/job.h"
#include "worker/job/memory_budget.h"
#include "worker/job/memory_estimate.h"
#include "worker/job/optimizer_rules.h"
#include "worker/runtime/trainer.h"
#include "worker/workload_factory.h"

namespace muonmesh::worker {
namespace {

absl::Status Annotate(const absl::Status& st, const std::string& where) {
  return absl::Status(st.code(), absl::StrCat(where, ": ", st.message()));
}

absl::StatusOr<ResolvedJob> LoadJob(const std::string& job_path) {
  absl::StatusOr<v1::JobSpec> spec = LoadJobFile(job_path);
  if (!spec.ok()) return spec.status();
  const std::string job_dir = std::filesystem::path(job_path).parent_path().string();
  return ResolveJob(*spec, job_dir.empty() ? "." : job_dir);
}

std::string Ms(absl::Duration d) { return absl::StrFormat("%.1f", absl::ToDoubleMilliseconds(d)); }

int64_t PeakRssBytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

// The optimizer step: AdamW, Muon (all phases) and the after-step gather.
absl::Duration OptimizerTime(const PhaseTimes& t) {
  return t.adamw + t.muon_prepare + t.muon_gather + t.newton_schulz + t.muon_scatter +
         t.muon_apply + t.param_allgather_after_step;
}

}  // namespace

absl::Status DescribeJob(const std::string& job_path, const LineSink& out) {
  absl::StatusOr<ResolvedJob> job = LoadJob(job_path);
  if (!job.ok()) return job.status();
  out(absl::StrCat("name=", job->name));
  out(absl::StrCat("device=", job->device));
  out(absl::StrCat("world_size=", job->world_size));
  out(absl::StrCat("steps=", job->steps));
  out(absl::StrCat("checkpoint_every=", job->checkpoint_every));
  out(absl::StrCat("max_restarts=", job->max_restarts));
  out(absl::StrCat("output_dir=", job->output_dir));
  out(absl::StrCat("export=", job->export_path));
  return absl::OkStatus();
}

namespace {

absl::Status CheckRankOptions(const StandaloneOptions& options, const ResolvedJob& job) {
  if (options.world_size != job.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--world-size ", options.world_size,
                                                   " differs from the job's world_size ",
                                                   job.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", options.rank, " is outside [0, ", options.world_size, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<plan::Plan> PlanJob(const ResolvedJob& job, plan::ModelSpec spec) {
  absl::StatusOr<plan::ModelSpec> model =
      ApplyOptimizerRules(std::move(spec), job.optimizer_rules);
  if (!model.ok()) return model.status();
  plan::PlanInput input;
  input.model = *std::move(model);
  input.world_size = job.world_size;
  input.parallelism = job.parallelism;
  input.options.owner_assignment = job.owner_assignment;
  input.options.ns_steps = job.muon.ns.steps;
  input.options.device = job.device;
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(input);
  if (!plan.ok()) return Annotate(plan.status(), "the planner rejects the job");
  return plan;
}

int64_t FileBytes(const std::string& path) {
  std::error_code ec;
  const std::uintmax_t size = path.empty() ? 0 : std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(size);
}

bool IsLoopback(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "::1";
}

// Refuses, before anything whose size comes from the job is allocated, a
// job whose estimated peak exceeds this rank's memory budget; returns the
// estimated peak otherwise.
absl::StatusOr<double> CheckMemory(const StandaloneOptions& options, const ResolvedJob& job,
                                   const plan::Plan& plan) {
  int64_t budget = options.memory_budget_bytes;
  if (budget <= 0) {
    // Ranks on loopback share this machine; elsewhere each has its own.
    budget = DefaultMemoryBudgetBytes(IsLoopback(options.hostname) ? job.world_size : 1);
  }
  const MemoryEstimate estimate = EstimateRankMemory(
      job, plan, options.rank,
      {FileBytes(job.data_safetensors), FileBytes(job.init_safetensors)});
  if (absl::Status st = CheckMemoryBudget(estimate, budget, options.rank); !st.ok()) return st;
  return estimate.peak_bytes;
}

// Every sample of a global batch is distinct only if the data set has at
// least that many (the batch formula wraps around otherwise).
absl::Status CheckBatchFitsData(const ResolvedJob& job, const Workload& workload) {
  if (job.model_kind == ResolvedJob::ModelKind::kSynthetic) return absl::OkStatus();
  if (job.global_batch_size <= workload.num_samples()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "training.global_batch_size: ", job.global_batch_size, " exceeds the ",
      workload.num_samples(), " samples of the data set",
      job.data_safetensors.empty() ? "" : absl::StrCat(" in ", job.data_safetensors)));
}

absl::StatusOr<std::unique_ptr<comm::FileStore>> OpenStore(const StandaloneOptions& options) {
  std::error_code ec;
  if (options.create_store) {
    // One level only: a mistyped parent is an error, not a new tree.
    std::filesystem::create_directory(options.store_dir, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("--store ", options.store_dir, ": cannot create: ", ec.message()));
    }
  } else if (!std::filesystem::is_directory(options.store_dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--store ", options.store_dir,
                     ": no such folder (create it, or give --create-store)"));
  }
  return comm::FileStore::Open(options.store_dir);
}

void PrintPlan(const ResolvedJob& job, const plan::Plan& plan, const LineSink& out) {
  int64_t planned = 0;
  for (const plan::CollectiveBytes& c : plan.collectives) planned += c.bytes_per_step;
  // Every domain of a mesh moves the same bytes.
  int64_t exchange = plan.dense.exchange_bytes * (job.world_size / plan.dense.size);
  int64_t bound = plan.dense.exchange_lower_bound_bytes * (job.world_size / plan.dense.size);
  if (plan.has_experts) {
    exchange += plan.expert.exchange_bytes * (job.world_size / plan.expert.size);
    bound += plan.expert.exchange_lower_bound_bytes * (job.world_size / plan.expert.size);
  }
  out(absl::StrFormat("plan: %d bytes per step in all collectives, Muon exchange %d bytes "
                      "(lower bound %d)",
                      planned, exchange, bound));
  out(absl::StrFormat("job %s: %d ranks, %s, %d steps, global batch %d", job.name,
                      job.world_size, job.owner_assignment, job.steps, job.global_batch_size));
}

}  // namespace

absl::Status RunStandalone(const StandaloneOptions& options, const LineSink& out) {
  absl::StatusOr<ResolvedJob> job = LoadJob(options.job_path);
  if (!job.ok()) return job.status();
  if (absl::Status st = CheckRankOptions(options, *job); !st.ok()) return st;
  std::unique_ptr<Workload> early;
  absl::StatusOr<plan::ModelSpec> spec = ModelSpecOf(*job, &early);
  if (!spec.ok()) return spec.status();
  absl::StatusOr<plan::Plan> plan = PlanJob(*job, *std::move(spec));
  if (!plan.ok()) return plan.status();
  absl::StatusOr<double> estimated_peak = CheckMemory(options, *job, *plan);
  if (!estimated_peak.ok()) return estimated_peak.status();

  // The device first: a GPU workload generates on the GPU made current here.
  const bool cuda = job->device == "cuda";
  absl::StatusOr<std::unique_ptr<Device>> device =
      MakeDevice(*job, options.rank, options.cuda_device);
  if (!device.ok()) return device.status();
  absl::StatusOr<std::unique_ptr<Workload>> workload =
      early != nullptr ? std::move(early) : MakeWorkload(*job);
  if (!workload.ok()) return workload.status();
  if (absl::Status st = CheckBatchFitsData(*job, **workload); !st.ok()) return st;
  if (cuda) {
    workload = OnGpu(*job, *std::move(workload));
    if (!workload.ok()) return workload.status();
  }

  std::vector<std::vector<float>> initial;
  TrainerOptions topts;
  topts.device = device->get();
  if (!job->init_safetensors.empty()) {
    absl::StatusOr<std::vector<std::vector<float>>> init =
        InitialFromFile((*workload)->spec(), job->init_safetensors);
    if (!init.ok()) return init.status();
    initial = *std::move(init);
    topts.initial_parameters = &initial;
  }
  absl::StatusOr<std::unique_ptr<comm::FileStore>> store = OpenStore(options);
  if (!store.ok()) return store.status();
  topts.backend = cuda ? comm::Backend::kNccl : comm::Backend::kGloo;
  topts.store = store->get();
  topts.group_options.gloo_hostname = options.hostname;
  topts.group_options.connect_timeout = options.timeout;
  topts.collective.timeout = options.timeout;
  topts.group_prefix = absl::StrCat(job->name, "/attempt-", options.attempt);
  topts.muon = job->muon;
  topts.adamw = job->adamw;
  topts.global_batch_size = job->global_batch_size;
  topts.init_seed = job->init_seed.value_or(0);

  const bool talk = options.rank == 0;
  if (talk) PrintPlan(*job, *plan, out);
  absl::StatusOr<std::unique_ptr<Trainer>> trainer =
      Trainer::Create(*plan, workload->get(), options.rank, topts);
  if (!trainer.ok()) return trainer.status();
  // The trainer holds its shards now: the whole initial model can go.
  std::vector<std::vector<float>>().swap(initial);
  if (!options.resume && talk) {
    // A fresh start: checkpoints of an earlier run of this job must never be
    // resumed into this one. Safe here: no rank can save before rank 0 has
    // stepped.
    std::error_code ec;
    const std::string old = job->output_dir + "/checkpoints";
    if (std::filesystem::exists(old, ec)) {
      std::filesystem::remove_all(old, ec);
      if (ec) return absl::InternalError(absl::StrCat(old, ": cannot remove: ", ec.message()));
      out(absl::StrCat("fresh start: removed the checkpoints of an earlier run in ", old));
    }
  }
  if (options.resume) {
    const std::optional<int64_t> from = NewestCheckpoint(job->output_dir);
    if (!from.has_value()) {
      if (talk) out("resume: no complete checkpoint yet; starting at step 0");
    } else {
      const std::string file = absl::StrFormat("%s/rank-%05d.safetensors",
                                               CheckpointDir(job->output_dir, *from), options.rank);
      absl::Status st = (*trainer)->LoadShards(file);
      if (!st.ok()) return Annotate(st, "resuming");
      if (talk) out(absl::StrCat("resume: from the checkpoint at step ", *from));
    }
  }

  std::vector<double> optimizer_ms;
  int64_t bytes_all_steps = 0;
  int64_t muon_bytes_all_steps = 0;
  const int64_t first_step = (*trainer)->steps_done();
  for (int64_t s = first_step; s < job->steps; ++s) {
    if (s == options.fail_at_step && options.attempt == 0) {
      return absl::AbortedError(absl::StrCat("--fail-at-step ", s, ": failing on purpose"));
    }
    absl::StatusOr<StepReport> r = (*trainer)->Step();
    if (!r.ok()) return Annotate(r.status(), absl::StrCat("step ", s));
    optimizer_ms.push_back(absl::ToDoubleMilliseconds(OptimizerTime(r->times)));
    for (const auto& [name, b] : r->bytes_sent) {
      bytes_all_steps += b;
      if (absl::StrContains(name, "muon_")) muon_bytes_all_steps += b;
    }
    if (talk) {
      int64_t bytes = 0;
      for (const auto& [name, b] : r->bytes_sent) bytes += b;
      const PhaseTimes& t = r->times;
      out(absl::StrFormat(
          "step %4d  loss %.6e  | ms: gather %s fwd/bwd %s dispatch %s reduce %s adamw %s "
          "muon %s/%s/%s/%s after %s | sent %d B",
          s, r->loss, Ms(t.param_gather), Ms(t.forward_backward), Ms(t.expert_dispatch),
          Ms(t.grad_reduce),
          Ms(t.adamw), Ms(t.muon_gather), Ms(t.newton_schulz), Ms(t.muon_scatter),
          Ms(t.muon_apply), Ms(t.param_allgather_after_step), bytes));
    }
    if (job->checkpoint_every > 0 && (s + 1) % job->checkpoint_every == 0) {
      absl::Status st =
          SaveCheckpoint(**trainer, job->output_dir, job->world_size, options.rank);
      if (!st.ok()) return st;
      if (talk) {
        out(absl::StrCat("checkpoint: step ", s + 1, " in ", CheckpointDir(job->output_dir, s + 1)));
      }
    }
  }

  // One machine-readable line per rank (benchmarks aggregate them).
  std::vector<double> sorted = optimizer_ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.empty() ? 0.0 : sorted[sorted.size() / 2];
  const int64_t steps = std::max<int64_t>(1, job->steps - first_step);
  out(absl::StrFormat(
      "summary rank=%d steps=%d optimizer_ms_median=%.3f bytes_per_step=%d "
      "muon_bytes_per_step=%d peak_rss_bytes=%d estimated_peak_bytes=%.0f shard_bytes=%d",
      options.rank, job->steps - first_step, median, bytes_all_steps / steps, muon_bytes_all_steps / steps,
      PeakRssBytes(), *estimated_peak, (*trainer)->shard_bytes()));

  // The final weights, gathered a unit at a time; rank 0 streams them into
  // the export file as they come (no rank holds the whole model).
  std::unique_ptr<io::SafetensorsWriter> writer;
  if (talk && !job->export_path.empty()) {
    std::vector<io::SafetensorsWriter::Entry> entries;
    for (const plan::UnitSpec& u : (*workload)->spec().units) {
      for (const plan::ParamSpec& p : u.params) entries.push_back({p.name, p.shape});
    }
    std::error_code ec;
    const std::filesystem::path parent = std::filesystem::path(job->export_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    absl::StatusOr<std::unique_ptr<io::SafetensorsWriter>> w =
        io::SafetensorsWriter::Create(job->export_path, std::move(entries));
    if (!w.ok()) return w.status();
    writer = *std::move(w);
  }
  absl::Status gathered = (*trainer)->GatherParameters(
      [&](int /*flat*/, std::vector<float>&& tensor) -> absl::Status {
        return writer == nullptr ? absl::OkStatus() : writer->Append(tensor);
      });
  if (!gathered.ok()) return Annotate(gathered, "gathering the final weights");
  if (writer != nullptr) {
    if (absl::Status st = writer->Finish(); !st.ok()) return st;
    out(absl::StrCat("wrote ", job->export_path));
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker
