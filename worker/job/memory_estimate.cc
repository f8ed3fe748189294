#include "worker/job/memory_estimate.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/plan/mesh.h"
#include "worker/job/memory_budget.h"
#include "worker/math/newton_schulz.h"
#include "worker/runtime/muon_schedule.h"

namespace muonmesh::worker {
namespace {

constexpr double kFloat = 4;    // bytes of an fp32 element
constexpr double kIndex = 8;    // bytes of a sample index
constexpr size_t kItemsShown = 4;

// What the workload holds: while it builds its dataset (`setup`, which
// includes the dataset), for the whole run (`resident`), and per step for a
// local batch (`step`).
struct WorkloadMemory {
  std::vector<MemoryItem> setup;
  std::vector<MemoryItem> resident;
  std::vector<MemoryItem> step;
};

double Sum(const std::vector<int64_t>& v) {
  double s = 0;
  for (int64_t x : v) s += static_cast<double>(x);
  return s;
}

// The dataset: from data.safetensors (read, then kept), or the teacher's
// x [N, d_in] and y [N, d_out].
void AddDataset(const job::ResolvedJob& job, const InputFileBytes& files, double d_in, double d_out,
                WorkloadMemory& w) {
  if (!job.data_safetensors.empty()) {
    // Up to twice the file: 16-bit tensors are widened to fp32.
    w.resident.push_back(
        {"data.safetensors", "dataset x, y", 2 * static_cast<double>(files.data)});
    w.setup = w.resident;
    return;
  }
  const double n = static_cast<double>(job.teacher_samples);
  w.resident.push_back({"data.teacher.samples", "dataset x, y", kFloat * n * (d_in + d_out)});
  w.setup = w.resident;
}

WorkloadMemory MlpMemory(const job::ResolvedJob& job, double local_batch, const InputFileBytes& files) {
  const std::vector<int64_t>& d = job.mlp_dims;
  double weights = 0;
  for (size_t i = 0; i + 1 < d.size(); ++i) {
    weights += static_cast<double>(d[i] + 1) * static_cast<double>(d[i + 1]);
  }
  const double max_d = static_cast<double>(*std::max_element(d.begin(), d.end()));
  WorkloadMemory w;
  AddDataset(job, files, static_cast<double>(d.front()), static_cast<double>(d.back()), w);
  if (job.data_safetensors.empty()) {
    const double n = static_cast<double>(job.teacher_samples);
    w.setup.push_back({"model.mlp.dims", "teacher weights", kFloat * weights});
    w.setup.push_back(
        {"data.teacher.samples", "teacher forward pass over every sample", kFloat * n * Sum(d)});
  }
  // Activations of every layer, and two back-propagated deltas.
  w.step.push_back({"training.global_batch_size", "activations of the local batch",
                    kFloat * local_batch * (Sum(d) + 2 * max_d)});
  return w;
}

WorkloadMemory MoeMemory(const job::ResolvedJob& job, double local_batch, const InputFileBytes& files) {
  const auto& m = job.moe;
  const double d_in = static_cast<double>(m.d_in());
  const double d = static_cast<double>(m.d_model());
  const double de = static_cast<double>(m.d_expert());
  const double e = static_cast<double>(m.num_experts());
  const double d_out = static_cast<double>(m.d_out());
  const double weights = (d_in + 1) * d + d * e + 2 * e * de * d + (d + 1) * d_out;
  // Per sample: input, hidden, gates, expert input/output/activation, the
  // mixed output and the prediction, plus routing indices.
  const double per_sample = kFloat * (d_in + 6 * d + 2 * de + e + 2 * d_out) + 4 * kIndex;
  WorkloadMemory w;
  AddDataset(job, files, d_in, d_out, w);
  if (job.data_safetensors.empty()) {
    const double n = static_cast<double>(job.teacher_samples);
    w.setup.push_back({"model.moe_mlp", "teacher weights", kFloat * weights});
    w.setup.push_back({"data.teacher.samples", "teacher forward pass over every sample",
                       kFloat * n * (d_in + d_out) + n * per_sample});
  }
  w.step.push_back({"training.global_batch_size", "activations of the local batch (x2 with "
                                                  "the backward pass)",
                    2 * local_batch * per_sample});
  return w;
}

// The gpt keeps every block's activations for the backward pass
// (worker/model/gpt.h): L T (16 C + H T) floats a sample, plus the logits
// and their gradient (2 T V) and the head's and the backward pass's own
// rows (12 T C: the final LayerNorm, the residual gradient, the attention
// and MLP gradients). Validation runs a local batch at a time, so it needs
// no more. The corpus is memory-mapped: the page cache holds it, not the
// rank.
WorkloadMemory GptMemory(const job::ResolvedJob& job, double local_batch) {
  const model::GptDims& d = job.gpt;
  const double t = static_cast<double>(d.seq_len);
  const double c = static_cast<double>(d.n_embd);
  const double per_sample =
      static_cast<double>(d.n_layer) * t * (16.0 * c + static_cast<double>(d.n_head) * t) +
      2.0 * t * static_cast<double>(d.vocab_size) + 12.0 * t * c;
  WorkloadMemory w;
  if (job.device == "cuda") {
    // The activations live on the GPU (worker/model/gpt_cuda.h); the host
    // keeps the windows read and the per-position losses copied back.
    w.step.push_back({"training.global_batch_size",
                      "the local batch's token windows and per-position losses",
                      local_batch * (4.0 * (t + 1.0) + 8.0 * t)});
    return w;
  }
  w.step.push_back({"training.global_batch_size",
                    "activations of the local batch kept for the backward pass",
                    kFloat * local_batch * per_sample});
  return w;
}

std::string ModelField(const job::ResolvedJob& job) {
  switch (job.model_kind) {
    case job::ResolvedJob::ModelKind::kMlp:
      return "model.mlp.dims";
    case job::ResolvedJob::ModelKind::kMoeMlp:
      return "model.moe_mlp";
    case job::ResolvedJob::ModelKind::kSynthetic:
      return "model.synthetic.spec";
    case job::ResolvedJob::ModelKind::kGpt:
      return "model.gpt";
  }
  return "model";
}

// This rank's shards and the Muon work of one mesh, per unit.
struct MeshMemory {
  double shards = 0;           // (k + 3) S summed over units
  double largest_gather = 0;   // max D S: one unit's gathered buffer
  std::vector<double> muon;    // per unit: 2 S + 3 * owned whole matrices
};

// The rank's shards and Muon work on one mesh; the matrices it owns there
// are added to `ns` (the rank's one Newton-Schulz workspace serves both
// meshes).
MeshMemory MeshPart(const plan::Plan& plan, const plan::MeshGeometry& g,
                    const plan::DomainPlan& domain, bool dense, int32_t rank,
                    math::NsWorkspaceBound& ns) {
  MeshMemory out;
  out.muon.assign(plan.units.size(), 0.0);
  const int32_t position = g.PositionOf(rank);
  const bool everyone = plan.config.owner_rule == plan::OwnerRule::kAllGather;
  std::map<int32_t, double> owned;  // unit -> elements of the whole matrices owned
  for (const plan::MatrixPlan& m : domain.matrices) {
    if (!everyone && m.owner != position) continue;
    const double rows = static_cast<double>(m.rows);
    const double cols = static_cast<double>(m.cols);
    owned[m.unit] += rows * cols;
    ns.Add(m.rows, m.cols, m.ns_form);
  }
  const double k = static_cast<double>(g.domain_size() / g.param_shards());
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const plan::UnitPlan& unit = plan.units[u];
    if (!(dense ? unit.has_dense : unit.has_expert)) continue;
    const plan::UnitLayout& l = dense ? unit.dense : unit.expert;
    const double s = static_cast<double>(l.shard_elements);
    out.shards += kFloat * (k + 3) * s;
    out.largest_gather =
        std::max(out.largest_gather, kFloat * static_cast<double>(l.num_shards) * s);
    auto it = owned.find(static_cast<int32_t>(u));
    const double whole = it == owned.end() ? 0 : it->second;
    out.muon[u] = kFloat * (2 * s + 3 * whole);
  }
  return out;
}

// The Muon phase's peak on this rank: the waves the trainer cuts (two in
// flight on the CPU, where each wave's gather overlaps the previous one's
// Newton-Schulz), each holding its units' per-unit bytes.
double MuonPhaseBytes(const plan::Plan& plan, int64_t requested, const std::vector<double>& muon) {
  const std::vector<MuonWave> waves =
      PlanMuonWaves(plan, WaveBudget(requested, /*overlap=*/true));
  std::vector<double> per_wave;
  for (const MuonWave& w : waves) {
    double bytes = 0;
    for (int32_t u = w.first_unit; u < w.end_unit; ++u) bytes += muon[u];
    per_wave.push_back(bytes);
  }
  double peak = 0;
  for (size_t w = 0; w < per_wave.size(); ++w) {
    peak = std::max(peak, per_wave[w] + (w + 1 < per_wave.size() ? per_wave[w + 1] : 0.0));
  }
  return peak;
}

// Elements of one unit's tensors: as this rank holds them (local experts),
// and whole (every expert).
std::pair<double, double> LargestUnit(const plan::Plan& plan) {
  double local = 0;
  double whole = 0;
  const double ep = static_cast<double>(std::max<int64_t>(1, plan.config.ep));
  for (const plan::UnitPlan& unit : plan.units) {
    double dense = 0;
    double expert = 0;
    for (const plan::LayoutTensor& t : unit.dense.tensors) {
      dense += static_cast<double>(t.rows) * static_cast<double>(t.row_len);
    }
    for (const plan::LayoutTensor& t : unit.expert.tensors) {
      expert += static_cast<double>(t.rows) * static_cast<double>(t.row_len);
    }
    if (!unit.has_dense) dense = 0;
    if (!unit.has_expert) expert = 0;
    local = std::max(local, dense + expert);
    whole = std::max(whole, dense + ep * expert);
  }
  return {local, whole};
}

MemoryPhase Phase(std::string name, std::vector<std::vector<MemoryItem>> parts) {
  MemoryPhase phase;
  phase.name = std::move(name);
  phase.items.push_back({"", "runtime (libraries, OpenBLAS and Gloo buffers)",
                         static_cast<double>(kRuntimeBaseBytes)});
  for (std::vector<MemoryItem>& part : parts) {
    for (MemoryItem& item : part) {
      if (item.bytes > 0) phase.items.push_back(std::move(item));
    }
  }
  return phase;
}

}  // namespace

double MemoryPhase::bytes() const {
  double total = 0;
  for (const MemoryItem& item : items) total += item.bytes;
  return total;
}

MemoryEstimate EstimateRankMemory(const job::ResolvedJob& job, const plan::Plan& plan, int32_t rank,
                                  const InputFileBytes& files, bool resharding) {
  const double local_batch = static_cast<double>(job.global_batch_size) /
                             static_cast<double>(std::max<int64_t>(1, job.world_size));
  WorkloadMemory w;
  if (job.model_kind == job::ResolvedJob::ModelKind::kMlp) w = MlpMemory(job, local_batch, files);
  if (job.model_kind == job::ResolvedJob::ModelKind::kMoeMlp) w = MoeMemory(job, local_batch, files);
  if (job.model_kind == job::ResolvedJob::ModelKind::kGpt) w = GptMemory(job, local_batch);
  w.step.push_back({"training.global_batch_size", "sample indices of the local batch",
                    kIndex * local_batch});

  const std::string model = ModelField(job);
  const auto [unit_local, unit_whole] = LargestUnit(plan);
  std::vector<MemoryItem> shards;
  std::vector<MemoryItem> step;
  if (job.device == "cpu") {
    math::NsWorkspaceBound ns;
    MeshMemory total = MeshPart(plan, plan::MeshGeometry::Dense(plan.config), plan.dense,
                                /*dense=*/true, rank, ns);
    if (plan.has_experts) {
      const MeshMemory e = MeshPart(plan, plan::MeshGeometry::Expert(plan.config), plan.expert,
                                    /*dense=*/false, rank, ns);
      total.shards += e.shards;
      total.largest_gather = std::max(total.largest_gather, e.largest_gather);
      for (size_t u = 0; u < total.muon.size(); ++u) total.muon[u] += e.muon[u];
    }
    shards.push_back(
        {model, "this rank's shards: parameters, gradient, two optimizer states", total.shards});
    step = {{model, "one unit's gathered buffer", total.largest_gather},
            {model, "one unit's parameters and gradients", 2 * kFloat * unit_local},
            {"optimizer.muon_buffer_bytes",
             "Muon exchange and the whole matrices this rank orthogonalizes, per wave",
             MuonPhaseBytes(plan, job.muon_buffer_bytes, total.muon)},
            {model, "Newton-Schulz workspace of the matrices this rank orthogonalizes",
             static_cast<double>(ns.bytes())}};
  }
  std::vector<MemoryItem> init;
  if (!job.init_checkpoint.empty() || resharding) {
    // Resharding holds the whole state and one rank's file (at most the
    // whole state again).
    double params = 0;
    for (const plan::UnitPlan& u : plan.units) {
      for (const plan::LayoutTensor& t : u.dense.tensors) params += double(t.rows) * t.row_len;
      for (const plan::LayoutTensor& t : u.expert.tensors) params += double(t.rows) * t.row_len;
    }
    init.push_back({job.init_checkpoint.empty() ? "output.dir" : "init.checkpoint",
                    "the checkpoint put back together: parameters and two optimizer states, "
                    "whole, and one rank's file",
                    2 * 3 * kFloat * params});
  } else if (!job.init_safetensors.empty()) {
    init.push_back({"init.safetensors", "initial weights (the whole model, as fp32)",
                    2 * static_cast<double>(files.init)});
  } else {
    init.push_back({model, "one unit's initial weights", kFloat * unit_whole});
  }
  step.insert(step.end(), w.step.begin(), w.step.end());

  MemoryEstimate e;
  std::vector<MemoryItem> runtime;
  if (job.device == "cuda") {
    runtime.push_back(
        {"device", "CUDA runtime, cuBLAS and NCCL", static_cast<double>(kCudaRuntimeBytes)});
  }
  e.phases.push_back(Phase("preparing data", {runtime, w.setup}));
  e.phases.push_back(Phase("initialising shards", {runtime, w.resident, shards, init}));
  e.phases.push_back(Phase("training", {runtime, w.resident, shards, step}));
  e.phases.push_back(Phase("exporting the weights",
                           {runtime, w.resident, shards,
                            {{model, "one whole unit, gathered", 2 * kFloat * unit_whole}}}));
  for (size_t i = 0; i < e.phases.size(); ++i) {
    if (e.phases[i].bytes() > e.peak_bytes) {
      e.peak_bytes = e.phases[i].bytes();
      e.peak_phase = i;
    }
  }
  return e;
}

absl::Status CheckMemoryBudget(const MemoryEstimate& estimate, int64_t budget_bytes,
                               int32_t rank) {
  if (estimate.peak_bytes <= static_cast<double>(budget_bytes)) return absl::OkStatus();
  const MemoryPhase& phase = estimate.phases[estimate.peak_phase];
  std::vector<MemoryItem> items = phase.items;
  std::stable_sort(items.begin(), items.end(),
                   [](const MemoryItem& a, const MemoryItem& b) { return a.bytes > b.bytes; });
  std::vector<std::string> parts;
  for (size_t i = 0; i < items.size() && i < kItemsShown; ++i) {
    parts.push_back(absl::StrCat(items[i].field.empty() ? "" : items[i].field + ": ",
                                 items[i].what, " ", FormatBytes(items[i].bytes)));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "rank ", rank, " would need about ", FormatBytes(estimate.peak_bytes), " of memory while ",
      phase.name, ", more than its budget of ", FormatBytes(static_cast<double>(budget_bytes)),
      " (--memory-budget): ", absl::StrJoin(parts, "; "),
      "; make the model, data or batch smaller, or use more ranks"));
}

}  // namespace muonmesh::worker
