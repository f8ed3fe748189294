#include "worker/job/memory_estimate.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/plan/buckets.h"
#include "core/plan/mesh.h"
#include "worker/job/memory_budget.h"
#include "worker/math/newton_schulz.h"
#include "worker/model_kinds.h"
#include "worker/runtime/muon_schedule.h"

namespace muonmesh::worker {
namespace {

constexpr double kFloat = 4;    // bytes of an fp32 element
constexpr double kIndex = 8;    // bytes of a sample index
constexpr size_t kItemsShown = 4;

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

// The communication buckets' peak (core/plan/buckets.h): a gradient
// bucket's buffer and, where its mesh reduces over two levels or more and
// it holds several units, the regrouping of its first level's output; or a
// shared parameter gather (UnitStream): up to bucket_bytes of padded unit
// buffers gathered at once, then held as whole tensors until acquired, and
// (communication.prefetch) the next such gather in flight beside it.
double BucketBytes(const plan::Plan& plan, int64_t bucket_bytes) {
  double peak = 0;
  double padded[2] = {0, 0};
  for (const plan::Bucket& b : plan::PlanBuckets(plan, bucket_bytes)) {
    const plan::MeshGeometry g = b.mesh == plan::MeshKind::kDense
                                     ? plan::MeshGeometry::Dense(plan.config)
                                     : plan::MeshGeometry::Expert(plan.config);
    const std::vector<int>& order = g.shard_order();
    double floats = static_cast<double>(b.elements);
    padded[b.mesh == plan::MeshKind::kExpert] += floats;
    if (order.size() > 1 && b.units.size() > 1) {
      floats += floats / static_cast<double>(g.axes()[order[0]].size);
    }
    peak = std::max(peak, kFloat * floats);
  }
  for (double mesh : padded) {
    peak = std::max(peak, 2 * std::min(static_cast<double>(std::max<int64_t>(bucket_bytes, 0)),
                                       kFloat * mesh));
  }
  return peak;
}

// Elements of a unit's dense tensors and of its local experts' tensors.
std::pair<double, double> UnitElements(const plan::UnitPlan& unit) {
  auto elements = [](const plan::UnitLayout& layout) {
    double n = 0;
    for (const plan::LayoutTensor& t : layout.tensors) {
      n += static_cast<double>(t.rows) * static_cast<double>(t.row_len);
    }
    return n;
  };
  return {unit.has_dense ? elements(unit.dense) : 0, unit.has_expert ? elements(unit.expert) : 0};
}

// Elements of one unit's tensors: as this rank holds them (local experts),
// and whole (every expert).
std::pair<double, double> LargestUnit(const plan::Plan& plan) {
  double local = 0;
  double whole = 0;
  const double ep = static_cast<double>(std::max<int64_t>(1, plan.config.ep));
  for (const plan::UnitPlan& unit : plan.units) {
    const auto [dense, expert] = UnitElements(unit);
    local = std::max(local, dense + expert);
    whole = std::max(whole, dense + ep * expert);
  }
  return {local, whole};
}

// Elements of every unit's tensors as this rank holds them gathered: what
// holding each unit from its first use to its last takes
// (communication.reshard_after_forward false), at most.
double GatheredModel(const plan::Plan& plan) {
  double total = 0;
  for (const plan::UnitPlan& unit : plan.units) {
    const auto [dense, expert] = UnitElements(unit);
    total += dense + expert;
  }
  return total;
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

// What the job's workload holds; a step's activations are one
// micro-batch's with gradient accumulation (named by its field).
WorkloadMemory WorkloadMemoryOf(const job::ResolvedJob& job, double local_batch,
                                const InputFileBytes& files) {
  const WorkerModelKind* kind = FindWorkerModelKind(job.model.kind_case());
  const double micro = job.micro_batch_size > 0 ? static_cast<double>(job.micro_batch_size)
                                                 : local_batch;
  WorkloadMemory w = kind == nullptr ? WorkloadMemory{} : kind->memory(job, micro, files);
  if (job.micro_batch_size <= 0) return w;
  for (MemoryItem& item : w.step) {
    if (item.field != "training.global_batch_size") continue;
    item.field = "training.micro_batch_size";
    if (const size_t at = item.what.find("the local batch"); at != std::string::npos) {
      item.what.replace(at, 15, "one micro-batch");
    }
  }
  return w;
}

// The rank's part of both meshes.
MeshMemory RankMeshMemory(const plan::Plan& plan, int32_t rank, math::NsWorkspaceBound& ns) {
  MeshMemory total = MeshPart(plan, plan::MeshGeometry::Dense(plan.config), plan.dense,
                              /*dense=*/true, rank, ns);
  if (plan.has_experts) {
    const MeshMemory e = MeshPart(plan, plan::MeshGeometry::Expert(plan.config), plan.expert,
                                  /*dense=*/false, rank, ns);
    total.shards += e.shards;
    total.largest_gather = std::max(total.largest_gather, e.largest_gather);
    for (size_t u = 0; u < total.muon.size(); ++u) total.muon[u] += e.muon[u];
  }
  return total;
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
  WorkloadMemory w = WorkloadMemoryOf(job, local_batch, files);
  w.step.push_back({"training.global_batch_size", "sample indices of the local batch",
                    kIndex * local_batch});

  const std::string model(job.kind == nullptr ? "model" : job.kind->size_field);
  const auto [unit_local, unit_whole] = LargestUnit(plan);
  std::vector<MemoryItem> shards;
  std::vector<MemoryItem> step;
  math::NsWorkspaceBound ns;
  const MeshMemory total = RankMeshMemory(plan, rank, ns);
  if (job.device == "cuda" && job.comm_backend == "gloo") {
    // The staging buffer (worker/comm/staging_communicator.h) grows to the
    // largest collective: a gathered unit or bucket, or a wave's exchange.
    step.push_back({"communication.backend",
                    "pinned host copy of the largest collective (gloo on device cuda)",
                    std::max({total.largest_gather, BucketBytes(plan, job.bucket_bytes),
                              MuonPhaseBytes(plan, job.muon_buffer_bytes, total.muon)})});
  }
  if (job.device == "cpu") {
    shards.push_back(
        {model, "this rank's shards: parameters, gradient, two optimizer states", total.shards});
    step = {{model, "one unit's gathered buffer", total.largest_gather},
            {model, "one unit's parameters and gradients", 2 * kFloat * unit_local},
            {"communication.bucket_bytes", "communication buckets: gradients, or gathered parameters",
             BucketBytes(plan, job.bucket_bytes)},
            {"optimizer.muon_buffer_bytes",
             "Muon exchange and the whole matrices this rank orthogonalizes, per wave",
             MuonPhaseBytes(plan, job.muon_buffer_bytes, total.muon)},
            {model, "Newton-Schulz workspace of the matrices this rank orthogonalizes",
             static_cast<double>(ns.bytes())}};
  }
  if (!plan.config.reshard_after_forward) {
    step.push_back({"communication.reshard_after_forward",
                    "units held gathered from their first use in a pass to their last",
                    kFloat * GatheredModel(plan)});
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
