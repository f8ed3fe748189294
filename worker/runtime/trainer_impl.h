#pragma once

// Internal to worker/runtime/: the state behind Trainer (trainer.h), which
// trainer.cc (creation, the step, gathers), trainer_setup.cc (groups and
// shards), muon_waves.cc (the Muon phase), unit_stream.h (what a step hands
// the workload) and trainer_shards.cc (checkpoint shards) share. Not a
// public interface: only those files include it.

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/status_macros.h"
#include "core/optim/ns_coefficients.h"
#include "core/plan/mesh.h"
#include "core/plan/owners.h"
#include "core/plan/validate.h"
#include "worker/io/safetensors.h"
#include "worker/runtime/buffer_pool.h"
#include "worker/runtime/comm_thread.h"
#include "worker/runtime/groups.h"
#include "worker/runtime/muon_schedule.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {
namespace trainer_internal {

// My rows of one matrix: where they sit in my optimizer shard.
struct LocalRows {
  int64_t offset = 0;  // in the shard
  int64_t row_start = 0;
  int64_t row_count = 0;
};

// Rows [row_start, row_start + rows) of the unit's matrix `matrix` (an index
// into UnitState::matrices), as one run of an exchange buffer.
struct Run {
  int32_t matrix = 0;
  int64_t row_start = 0;
  int64_t rows = 0;
};

// The unit's part of its wave's Muon exchange, fixed by the plan: runs are
// grouped by peer position, then in matrix order, so both sides agree
// without talking. A wave's exchange buffer holds, for each position, the
// runs of every unit of the wave in unit order.
struct Exchange {
  std::vector<int64_t> send_counts;  // floats to each position (the gather)
  std::vector<int64_t> recv_counts;  // floats from each position
  std::vector<Run> send;             // my rows, grouped by position
  std::vector<Run> recv;             // rows I receive, grouped by position
  std::vector<size_t> send_first;    // per position + 1: its first run in `send`
  std::vector<size_t> recv_first;    // per position + 1: its first run in `recv`
  int64_t send_total = 0;
  int64_t recv_total = 0;
};

// This rank's place on one mesh (dense, or expert) and its process groups.
struct MeshState {
  plan::MeshKind kind = plan::MeshKind::kDense;
  const plan::DomainPlan* domain = nullptr;  // the owners of this mesh's matrices
  int64_t domain_size = 1;                   // D
  int64_t k = 1;                             // optimizer shards per parameter shard
  int32_t position = 0;
  // Under the HSDP replica split (the dense mesh, domain->replicas > 1): my
  // replica (dp_outer coordinate) and the group of the ranks that hold my
  // shards in every replica, ordered by replica (one of all_reduce_comms);
  // -1 and null otherwise.
  int32_t replica = -1;
  comm::Communicator* replica_comm = nullptr;
  std::string bytes_prefix;                  // "" dense, "expert/" expert
  std::unique_ptr<comm::Communicator> domain_comm;
  std::unique_ptr<comm::Communicator> gather_comm;
  std::unique_ptr<comm::Communicator> group_comm;
  std::vector<std::unique_ptr<comm::Communicator>> reduce_scatter_comms;
  std::vector<std::unique_ptr<comm::Communicator>> all_reduce_comms;
};

// This rank's view of one unit's tensors on one mesh (a unit with dense and
// expert tensors has two).
struct UnitState {
  int32_t unit = 0;
  MeshState* mesh = nullptr;
  const plan::UnitLayout* layout = nullptr;
  std::vector<int32_t> flat;      // per layout tensor: flat parameter index
  std::vector<int32_t> local;     // per layout tensor: its index within the unit
  // Per layout tensor: where my part starts in the whole tensor (elements):
  // 0 for dense tensors, my EP group's first expert for expert stacks.
  std::vector<int64_t> whole_offset;
  std::vector<bool> muon;         // per layout tensor
  std::vector<int32_t> matrices;  // this unit's Muon matrices (indices into mesh->domain)
  DeviceBuffer param;             // my parameter shard: k * S floats
  DeviceBuffer grad;              // my reduced optimizer shard: S floats
  DeviceBuffer state1;            // Muon momentum / AdamW exp_avg
  DeviceBuffer state2;            // AdamW exp_avg_sq
  // Muon, per entry of `matrices`: my rows, where their u / O rows sit in
  // Impl::rows, whether I orthogonalize the matrix, and then (during Muon()
  // only: allocated there and freed at its end) the whole matrix.
  std::vector<LocalRows> mine;
  std::vector<int64_t> rows_offset;  // within this unit's part of Impl::rows
  int64_t rows_total = 0;
  int64_t rows_base = 0;             // where this unit's part starts, during its wave
  std::vector<bool> holds;
  std::vector<DeviceBuffer> whole;
  Exchange exchange;
};

inline int64_t Elements(const plan::ParamSpec& p) { return plan::NumElements(p); }

// One run of a unit state's buffer: `count` elements of flat tensor `flat`,
// from element `whole_start` of the whole tensor, at `offset` in the buffer.
// What a shard holds, as checkpoints record it (resharding reads them back).
struct ShardRun {
  int32_t flat = 0;
  int64_t whole_start = 0;
  int64_t offset = 0;
  int64_t count = 0;
};
// The runs of u.param (the k shards of my parameter group, in order) and of
// u.grad / u.state1 / u.state2 (my optimizer shard).
std::vector<ShardRun> ParamRuns(const UnitState& u);
std::vector<ShardRun> StateRuns(const UnitState& u);

}  // namespace trainer_internal

using namespace trainer_internal;  // NOLINT: the internal types read as the Impl's own

// A mesh's Muon matrices by (unit, parameter), as indices into its plan.
using MatrixIndex = std::map<std::pair<int32_t, int32_t>, std::vector<int32_t>>;

namespace trainer_internal {

// What Trainer::Create checks before it builds anything (trainer_setup.cc).
absl::Status CheckCreateArguments(const plan::Plan& plan, const Workload& workload, int32_t rank,
                                  const TrainerOptions& options);

// Each mesh's Muon matrices by (unit, parameter): an expert stack has one
// per local expert, in expert order.
MatrixIndex IndexMatrices(const plan::DomainPlan& d);

}  // namespace trainer_internal

namespace trainer_internal {

struct StepTotals {
  double loss = 0;
  int64_t nonfinite_ranks = 0;
  double grad_norm = 0;
};

}  // namespace trainer_internal

struct Trainer::Impl {
  const plan::Plan* plan = nullptr;  // copied below; points into `plan_copy`
  plan::Plan plan_copy;
  Workload* workload = nullptr;
  TrainerOptions options;
  Device* dev = nullptr;  // TrainerOptions::device
  // Whole-unit gather and gradient buffers between acquires (UnitStream).
  BufferPool unit_buffers{nullptr};
  int32_t rank = 0;
  int64_t world = 1;
  MeshState dense;
  MeshState expert;
  // Expert parallelism: EP groups, mine, and the ranks that exchange tokens
  // (one per group, sharing my expert_dp coordinate; null when EP = 1).
  int64_t ep = 1;
  int32_t ep_index = 0;
  std::unique_ptr<comm::Communicator> ep_comm;

  std::unique_ptr<comm::Communicator> world_comm;

  std::vector<UnitState> units;
  std::vector<int64_t> param_sizes;          // flat spec order, whole tensors
  std::vector<int64_t> local_sizes;          // flat spec order, what this rank holds
  std::vector<bool> is_expert;               // flat spec order
  std::vector<int32_t> unit_base;            // per spec unit: flat index of its first parameter
  std::vector<int32_t> unit_count;           // per spec unit: its number of parameters
  std::vector<std::vector<int32_t>> states_of;  // per spec unit: indices into `units`
  // Whole tensors of spec units without a layout (never trained):
  // their initial values, handed out by Acquire as they are.
  std::vector<std::vector<std::vector<float>>> frozen;
  DeviceBuffer full;                         // one unit-mesh padded buffer, D * S
  DeviceBuffer scalar;  // ReduceStepTotals' three floats
  // ReduceStepRecords' gather, allocated at its first step and kept, so
  // steady steps allocate nothing for it.
  DeviceBuffer records_buf;
  // A buffer of at least `count` floats in `buf`, allocated once.
  absl::StatusOr<float*> Scratch(DeviceBuffer& buf, int64_t count);
  // Set after a step's first micro-batch: ReduceUnit adds to the gradient
  // shards instead of overwriting them.
  bool accumulating = false;
  // Muon health of this step: per mesh (0 dense, 1 expert), the elements
  // and matrices whose update I applied and the update's sum of squares
  // (ApplyUpdates); on health steps, every matrix's orthogonality error as
  // its owner measured it (dense matrices, then each EP group's expert
  // matrices; -1 where I measured none).
  struct MuonTally {
    double elements[2] = {0, 0};
    double matrices[2] = {0, 0};
    double sum_sq[2] = {0, 0};
  } muon_tally;
  bool health_step = false;
  std::vector<float> ortho_errors;
  // This step's optimizer options: the job's with the schedule applied.
  optim::MuonOptions step_muon;
  optim::AdamWOptions step_adamw;

  // The Muon phase's waves (muon_schedule.h) and, per wave, the indices
  // into `units` of its units' states, dense before expert for each unit.
  std::vector<MuonWave> waves;
  std::vector<std::vector<int32_t>> wave_states;
  // Per wave: the plan's Newton-Schulz FLOPs for this rank and the busiest.
  std::vector<std::pair<double, double>> planned_ns;
  // With one wave, its rows, send and receive buffers between steps.
  DeviceBuffer muon_kept[3];
  // Muon inside the backward pass (TrainerOptions::muon_in_backward;
  // muon_waves.cc): the wave gathered there this step, ready for Optimize
  // (null: none).
  struct WaveRun;  // muon_waves.cc
  std::shared_ptr<WaveRun> early_run;
  // The wave a step may gather inside its (last micro-batch's) backward
  // pass (the last wave: its gradients are reduced first), or -1: also
  // while the last step clipped its gradients (the next one likely clips
  // too, and a clipped step gathers again), which every rank knows alike.
  int32_t EarlyWave() const;
  bool last_step_clipped = false;
  // With micro-batches, during the last one: 1 / their count, by which the
  // summed gradient shards become their mean (1 otherwise); per state,
  // whether GatherEarly has done so already (ForwardBackward does the rest).
  float grad_mean = 1.0f;
  std::vector<bool> grad_scaled;
  // On a thread of its own, once the wave's gradients are reduced: scales
  // them by grad_mean, then runs its gather into early_run (which reads the
  // momentum and changes no state).
  absl::Status GatherEarly(int32_t wave);
  // Drops early_run (a step that refuses or clips its gradients, or fails);
  // the bytes its gather sent go into report->bytes_sent as
  // "<name>_redone". Nothing when there is none.
  void UndoEarlyGather(StepReport* report);


  // Makes `b` hold at least `count` floats (contents are not kept).
  absl::Status Reserve(DeviceBuffer& b, int64_t count) {
    if (b.size() >= count && !b.empty()) return absl::OkStatus();
    b.Reset();
    absl::StatusOr<DeviceBuffer> fresh = dev->Allocate(std::max<int64_t>(count, 1));
    MUONMESH_RETURN_IF_ERROR(fresh.status());
    b = *std::move(fresh);
    return absl::OkStatus();
  }

  static int64_t MyShard(const UnitState& u) {
    const plan::UnitLayout& l = *u.layout;
    return l.ShardAt(u.mesh->position);
  }

  // Rows of matrix `m` in my shard (row_start relative to the matrix: an
  // expert's matrix is a block of rows of its stack), or row_count 0. The
  // offset is the first row's; a stacked block's rows lie in pieces
  // (ForEachRun).
  static LocalRows Mine(const UnitState& u, const plan::MatrixPlan& m) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t shard = MyShard(u);
    const plan::MatrixRows rows = m.TensorRows();
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      if (l.tensors[seg.tensor].param != m.param) continue;
      const plan::RowRange r = rows.Among(seg.row_start, seg.row_start + seg.row_count);
      if (r.count == 0) continue;
      return {seg.offset + (rows.TensorRow(r.start) - seg.row_start) * l.tensors[seg.tensor].row_len,
              r.start, r.count};
    }
    return {};
  }

  // Calls fn(shard offset, first row, rows) for each run of `mine`'s rows
  // that lies in one piece of the shard (one call unless `m` is a stacked
  // block); rows count within the matrix, as LocalRows's.
  template <typename Fn>
  static absl::Status ForEachRun(const plan::MatrixPlan& m, const LocalRows& mine, Fn fn) {
    const plan::MatrixRows rows = m.TensorRows();
    const int64_t first = rows.TensorRow(mine.row_start);
    const int64_t end = mine.row_start + mine.row_count;
    for (int64_t r = mine.row_start; r < end;) {
      const int64_t next = rows.Strided() ? std::min(end, (r / rows.piece + 1) * rows.piece) : end;
      MUONMESH_RETURN_IF_ERROR(fn(mine.offset + (rows.TensorRow(r) - first) * m.cols, r, next - r));
      r = next;
    }
    return absl::OkStatus();
  }

  // Runs `fn` on `c` and adds its bytes to `report->bytes_sent[name]`.
  template <typename Fn>
  absl::Status Counted(comm::Communicator& c, const std::string& name, StepReport* report,
                       Fn fn) {
    const int64_t before = c.stats().total_bytes_sent();
    absl::Status st = fn();
    if (report != nullptr) report->bytes_sent[name] += c.stats().total_bytes_sent() - before;
    return st;
  }

  // Calls fn(q, segment, its tensor's row length) for every segment of a
  // unit layout, shard by shard in domain-position order q (where its
  // elements start at q * shard_elements + segment.offset of a gathered
  // buffer); stops at the first error.
  template <typename Fn>
  static absl::Status ForEachSegment(const plan::UnitLayout& l, Fn fn) {
    for (int64_t q = 0; q < l.num_shards; ++q) {
      const int64_t shard = l.ShardAt(q);
      for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
        const plan::Segment& seg = l.segments[i];
        MUONMESH_RETURN_IF_ERROR(fn(q, seg, l.tensors[seg.tensor].row_len));
      }
    }
    return absl::OkStatus();
  }

  // Gathers unit `u`'s parameters into `full` (position order) and copies
  // every tensor's rows into `dst` (the unit's whole tensors, spec order).
  absl::Status GatherUnit(UnitState& u, StepReport* report, float* const* dst,
                          const char* name = "param_allgather") {
    const plan::UnitLayout& l = *u.layout;
    MeshState& mesh = *u.mesh;
    const int64_t s = l.shard_elements;
    const int64_t n = l.num_shards * s;
    // Replicated parameters: u.param is the whole padded buffer already.
    const float* from = u.param.data();
    if (mesh.k != mesh.domain_size) {
      MUONMESH_RETURN_IF_ERROR(Reserve(full, n));
      from = full.data();
      absl::Status st = Counted(*mesh.gather_comm, mesh.bytes_prefix + name, report,
                                [&] {
        return mesh.gather_comm->AllGather(u.param.data(), mesh.k * s, full.data(),
                                           options.collective);
      });
      MUONMESH_RETURN_IF_ERROR(st);
    }
    return ForEachSegment(l, [&](int64_t q, const plan::Segment& seg, int64_t len) {
      return dev->Copy(dst[u.local[seg.tensor]] + seg.row_start * len, from + q * s + seg.offset,
                       seg.row_count * len);
    });
  }

  // Buckets (buckets.cc; core/plan/buckets.h): per bucket its mesh, the
  // indices into `units` of its states, each state's part of the bucket's
  // buffer at every reduce level (level 0: the padded unit buffers side by
  // side in each first-level chunk; level l + 1: my chunk of level l) and
  // of its parameter shards (the after-step gather).
  struct BucketState {
    MeshState* mesh = nullptr;
    std::vector<int32_t> states;
    std::vector<std::vector<int64_t>> size;    // [level][i]
    std::vector<std::vector<int64_t>> prefix;  // [level][i]
    std::vector<int64_t> total;                // [level]
    std::vector<int64_t> shard_prefix;         // [i]
    int64_t shard_total = 0;
  };
  std::vector<BucketState> buckets;
  std::vector<std::pair<int32_t, int32_t>> bucket_of;  // per state: bucket, index in it
  void PlanBuckets();
  // Collective calls made so far on every group of this rank.
  int64_t CollectiveCalls() const;
  // Packs state `state`'s whole gradients `src` (spec order) into its place
  // in its bucket's buffer `buf` (bucket.total[0] floats); `alone`: into
  // `buf` as the unit's own padded buffer (its shards in position order).
  absl::Status PackGradients(int32_t state, float* buf, const float* const* src,
                             bool alone = false);
  // Whether reducing on `mesh` changes nothing (every group of one rank, no
  // replicas: one rank, or experts alone on theirs): the gradients are then
  // packed straight into the shards.
  static bool ReducesNothing(const MeshState& mesh);
  // Reduces a packed bucket down its mesh's levels into each state's u.grad.
  absl::Status ReduceBucket(int32_t bucket, float* buf, StepReport* report);
  // Gathers several units' states of one mesh (parameters sharded: k <
  // domain size) in one all-gather into their whole tensors dst[i] (spec
  // order, as GatherUnit's); one state is GatherUnit.
  absl::Status GatherStates(absl::Span<const int32_t> states,
                            absl::Span<float* const* const> dst, StepReport* report,
                            const char* name);
  // The after-step gather of every bucket whose mesh replicates parameters
  // over optimizer shards (k > 1), in after_step_order; of one bucket.
  absl::Status GatherAfterStep(StepReport* report);
  absl::Status GatherBucketAfterStep(int32_t bucket, StepReport* report);
  // TrainerOptions::overlap_param_gather (docs/architecture.md §5, "The
  // after-step gather beside the next step"): whether it holds (asked for,
  // no QK-clip, a host device); pushes the after-step gathers onto
  // after_step, counting their bytes and calls into `report` as the
  // synchronous gather would; waits for the gather of `state`'s bucket
  // (adding the wait to `report`, when not null); waits for all of them
  // (their waits and hidden time into `report`). Await and Drain return
  // the gathers' first error.
  bool DefersGatherAfterStep() const {
    return options.overlap_param_gather && options.qk_clip <= 0 &&
           dev->memory_space() == comm::MemorySpace::kHost;
  }
  void StartGatherAfterStep(StepReport* report);
  absl::Status AwaitGatherAfterStep(int32_t state, StepReport* report);
  absl::Status DrainGatherAfterStep(StepReport* report);

  absl::Status AdamW(UnitState& u, int64_t step) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t shard = MyShard(u);
    float* p = u.param.data() + (u.mesh->position % u.mesh->k) * l.shard_elements;
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      if (u.muon[seg.tensor]) continue;
      const int64_t n = seg.row_count * l.tensors[seg.tensor].row_len;
      MUONMESH_RETURN_IF_ERROR(dev->AdamWStep(AdamWFor(u.flat[seg.tensor]), step + 1, u.grad.data() + seg.offset,
                                              u.state1.data() + seg.offset,
                                              u.state2.data() + seg.offset, p + seg.offset, n),
                               "AdamW on ", plan->units[u.unit].name);
    }
    return absl::OkStatus();
  }

  // This step's options for flat parameter `flat`: its optimizer.rules rates
  // (TrainerOptions::param_rates) applied.
  optim::AdamWOptions AdamWFor(int32_t flat) const { return WithRates(step_adamw, flat); }
  optim::MuonOptions MuonFor(int32_t flat) const { return WithRates(step_muon, flat); }
  template <typename Options>
  Options WithRates(Options o, int32_t flat) const {
    if (static_cast<size_t>(flat) < options.param_rates.size()) {
      const optim::ParamRates& r = options.param_rates[flat];
      o.lr *= r.lr_scale;
      if (r.weight_decay.has_value()) o.weight_decay = *r.weight_decay;
    }
    return o;
  }

  // This step's rates (the same on every rank: a function of the step):
  // step_muon, step_adamw, report->lr_scale; and its Muon health set-up
  // (muon_tally, health_step, ortho_errors).
  void SetStepRates(int64_t step, StepReport* report);

  // Forward and backward over this rank's `samples` of `step` (in
  // micro-batches with options.micro_batch_size), the gradients reduced into
  // the shards (their mean over the micro-batches); the local loss.
  absl::StatusOr<double> ForwardBackward(int64_t step, const std::vector<int64_t>& samples,
                                         StepReport* report);

  // The step's totals over every rank (one all-reduce of three floats):
  // the global-batch loss from this rank's `local_loss`, how many ranks hold
  // a non-finite gradient, and the global gradient norm (every element
  // once: each rank counts its optimizer shards divided by the ranks that
  // hold the same shard).
  absl::StatusOr<StepTotals> ReduceStepTotals(double local_loss);
  // Multiplies every gradient shard by min(1, clip / (norm + 1e-6)) when
  // options.clip_grad_norm is set (> 0); whether it did (a factor < 1).
  absl::StatusOr<bool> ClipGradients(double grad_norm);
  // The step's records over the world in one all-gather (one round trip
  // instead of one per record; docs/architecture.md §5, "Buckets and round
  // trips"): each rank's attention logits, buffer statistics and balance
  // loss, Muon tallies and, on health steps, orthogonality errors; then each
  // column reduced in rank order as the host backends reduce (max of the
  // logits and errors, sums of the statistics), the same bits an all-reduce
  // of each gave. Nothing when the model has none of them.
  absl::Status ReduceStepRecords(StepReport* report);
  // The step's end: ReduceStepRecords, then GatherAfterStep; or, when the
  // gather does not wait for the records (no QK-clip rescaling the shards
  // it hands round) and options.overlap_records holds on a host device, the
  // records' all-gather (the world group) on a second thread beside the
  // gather (its mesh groups): one round trip less on the step's path. The
  // two write apart: the records the report's records, the gather its
  // bytes. The records' status first.
  absl::Status FinishStep(StepReport* report);
  // The logits' max over the world (layers x heads) into
  // report->max_attn_logit (per layer) and, with options.qk_clip, the
  // QK-clip rescaling of my parameter shards.
  absl::Status ApplyAttentionLogits(const std::vector<float>& global, StepReport* report);
  // The buffer statistics summed over the world (a transformer's tokens per
  // expert; with `aux`, the balance loss last) handed back to the workload
  // (Workload::UpdateBuffers), its experts' load into report->expert_load.
  absl::Status UpdateBufferStats(std::vector<float> global, bool aux, StepReport* report);
  // Muon health (StepReport::muon): the planned counts (true when the plan
  // has Muon matrices), my tallies for the gather, and from every rank's
  // tallies (at tally_at of each `stride`-float slice of `all`) and the
  // reduced ortho_errors, the step's figures.
  bool MuonPlanned(StepReport* report) const;
  void AppendMuonTally(std::vector<float>& out) const;
  void MuonHealthFrom(const std::vector<float>& all, int64_t stride, size_t tally_at,
                      StepReport* report) const;
  // The workload's buffers from a whole state (absent ones 0), or
  // InvalidArgument naming a buffer the model does not have.
  absl::StatusOr<std::vector<std::vector<float>>> CheckBuffers(const WholeState& state) const;
  // Every Muon matrix of the model: the dense mesh's and every EP group's.
  size_t MuonMatrixCount() const;
  // Where matrix `matrix` of a unit state's mesh sits among ortho_errors.
  size_t HealthIndex(const UnitState& u, int32_t matrix) const;

  // Trainer::Create's phases, in order: the process groups (world, meshes,
  // replicas, tokens) and the loss buffer; each parameter's size and the
  // initial parameters' shapes; each unit's shard state on each mesh, from
  // its whole initial tensors; the Muon waves and their planned figures.
  absl::Status JoinGroups();
  absl::Status IndexParameters();
  absl::Status InitialUnit(size_t u, std::vector<std::vector<float>>& whole) const;
  absl::Status AddUnitState(size_t u, MeshState* mesh, const MatrixIndex& matrices,
                            const std::vector<std::vector<float>>& whole);
  void PlanWaves();

  // Checkpoints (trainer_shards.cc): each flat tensor's optimizer under this
  // plan; the model's tensors as shard files record them ("name\tshape\t
  // optimizer" lines); whether `state` fits this model (Trainer::LoadState).
  std::vector<TensorOptimizer> Optimizers() const;
  std::string TensorsText() const;
  absl::Status CheckWholeState(const WholeState& state, bool fresh_state) const;

  // Finds the dense mesh's replica group under the HSDP replica split
  // (MeshState::replica_comm); nothing to do without the split. Internal
  // when the groups do not match the plan.
  absl::Status JoinReplicas();
  // Fixes the unit's Muon exchange from the plan (once, at creation).
  void PlanMuon(UnitState& u) const;
  // The optimizer phase: AdamW, then the Muon waves (muon_schedule.h), each
  // a WaveRun: momentum, one gather exchange per mesh, Newton-Schulz on all
  // I own, one scatter exchange per mesh, the update; with
  // TrainerOptions::muon_overlap the next wave's gather runs while this
  // one's Newton-Schulz does. Appends each wave's round to the report.
  // (WaveRun is declared above, with early_run.)
  absl::Status Optimize(int64_t step, StepReport* report);
  // Whether a wave's gather runs beside the previous wave's Newton-Schulz:
  // asked for, and the device's calls are safe from two threads (the
  // CPU's are; the same on every rank of a job, which share a device kind).
  bool Overlaps() const {
    return options.muon_overlap && dev->memory_space() == comm::MemorySpace::kHost;
  }
  // Whether a bucket's reduction runs beside the backward pass (a CommThread):
  // asked for, on a host device (the same condition as Overlaps).
  bool OverlapsReduce() const {
    return options.overlap_reduce && dev->memory_space() == comm::MemorySpace::kHost;
  }
  // Whether a pass's next parameter gather runs ahead of it (a CommThread):
  // asked for, on a host device.
  bool PrefetchesGathers() const {
    return options.prefetch_gathers && dev->memory_space() == comm::MemorySpace::kHost;
  }

  // The after-step gathers (DefersGatherAfterStep): the buckets in the order
  // the forward pass first needs them (by their first unit: PlanBuckets
  // lists the dense mesh's before the expert mesh's); per bucket, the ticket
  // of its gather pushed at the last step's end (0: none pending); the
  // calls of those gathers, counted when made or pushed (CollectiveCalls
  // leaves the parameter groups' own counters out: the thread's calls land
  // when they run). The thread last, so that it is destroyed first (it
  // runs the gathers still queued) while everything its jobs use lives.
  std::vector<int32_t> after_step_order;
  std::vector<uint64_t> after_step_ticket;
  int64_t after_step_calls = 0;
  absl::Status after_step_failed;  // a drained gather's error, for good
  std::unique_ptr<CommThread> after_step;
};

}  // namespace muonmesh::worker
