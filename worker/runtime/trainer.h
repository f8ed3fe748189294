#pragma once

// One rank's training engine: holds its parameter, gradient and optimizer
// shards as the plan lays them out and runs the step of docs/architecture.md §5:
//
//   1. gather each unit's parameters over the axes where they are sharded;
//   2. forward/backward on this rank's slice of the global batch;
//   3. reduce gradients per axis (reduce-scatter down the shard order,
//      all-reduce over replicas, averaging) into this rank's optimizer shard;
//   4. AdamW on element-wise tensors; Muon on matrices, in waves of units
//      whose owner buffers fit a budget (muon_schedule.h): momentum and the
//      Nesterov input on the local rows, one exchange per mesh domain for
//      the whole wave to the owners, Newton-Schulz on everything this rank
//      owns in the wave (dense and expert), one exchange back per domain,
//      update; or the allgather baseline (everyone gathers and
//      orthogonalizes every matrix and keeps its rows). Under the HSDP
//      replica split (plan.dense.replicas > 1) my domain orthogonalizes
//      only my replica's dense matrices, and after the scatters one
//      exchange over dp_outer per wave swaps the results with the ranks
//      holding my shards in the other replicas;
//   5. gather the updated optimizer shards back into the parameter shard
//      where parameters are replicated but the optimizer state is sharded.
//
// Expert parameters live on the expert mesh (their own domains, groups and
// owners, docs/architecture.md §3); this rank holds the experts of its EP group
// (Workload's UnitAccess documents which) and exchanges tokens with the
// other groups through the workload.
//
// All tensor work goes through a Device (worker/runtime/device.h): the CPU
// with Gloo or in-process groups, or a CUDA GPU with NCCL groups and a
// workload that computes on the GPU.
//
// Not thread-safe: one Trainer per rank, driven by one thread. Every rank of
// the job must call Step() the same number of times; a rank that fails
// leaves the others to time out in their next collective (each has the
// configured timeout).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/optim/schedule.h"
#include "core/optim/types.h"
#include "core/plan/buckets.h"
#include "core/plan/types.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"
#include "worker/math/newton_schulz.h"
#include "worker/model/workload.h"
#include "worker/runtime/device.h"
#include "worker/runtime/whole_state.h"

namespace muonmesh::worker {

// The "format" a rank's checkpoint file names in its metadata
// (Trainer::SaveShards; read back by worker/reshard.h too).
inline constexpr char kShardsFormat[] = "muonmesh.shards.v1";

// The payload (absl::Status::SetPayload) of the error Trainer::Step returns
// for a refused step: a reduced gradient was NaN or infinite on some rank,
// and no rank updated anything. The daemon reports it
// (ReportAttemptRequest.refused_step).
inline constexpr char kRefusedStepPayload[] = "type.muonmesh.dev/refused-step";

// The payload of an error that is the job's own, which no restart can mend
// (ReportAttemptRequest.job_error): the coordinator fails the job at once.
inline constexpr char kJobErrorPayload[] = "type.muonmesh.dev/job-error";

struct TrainerOptions {
  // Where shards live and the optimizer runs (required; not owned, must
  // outlive the Trainer): MakeCpuDevice(), or a CUDA device. The workload
  // must work on the device's memory.
  Device* device = nullptr;
  // Any backend with a CUDA device: Gloo and the in-process one then copy
  // every collective's buffers through host memory (comm::GroupOptions::
  // buffers, set from the device), so several ranks may share one GPU.
  comm::Backend backend = comm::Backend::kGloo;
  comm::Store* store = nullptr;  // rendezvous; must outlive Create()
  comm::GroupOptions group_options;  // its `buffers` is the device's memory
  // Prefix of every group name: unique per job attempt.
  std::string group_prefix = "job";
  comm::CollectiveOptions collective;
  optim::MuonOptions muon;  // its ns.algorithm is ignored: the plan's (config.ns_algorithm) runs
  optim::AdamWOptions adamw;
  int64_t global_batch_size = 1;
  // The recipe (core/optim/schedule.h, docs/architecture.md §5): both learning rates,
  // and the decoupled weight decay with them, times m(s) of `lr_schedule`
  // over `total_steps` (the job's training.steps; 0 with a constant
  // schedule); Muon's momentum warmup; and, when clip_grad_norm > 0, every
  // gradient times min(1, clip_grad_norm / (norm + 1e-6)) before the
  // optimizers run. The norm is computed every step (StepReport::grad_norm).
  optim::LrSchedule lr_schedule;
  int64_t total_steps = 0;
  std::optional<optim::MomentumWarmup> momentum_warmup;
  double clip_grad_norm = 0;
  // MuonClip (optimizer.muon.qk_clip; docs/architecture.md, "QK-clip"):
  // after both optimizers, the rows Workload::QkClipRows names for the
  // heads whose largest logit over the global batch exceeded it are
  // rescaled. 0: no clipping; the logits are recorded either way.
  double qk_clip = 0;
  // Muon health (StepReport::muon): the orthogonality error of every
  // orthogonalized matrix on steps s with s % health_every == 0; 0: never.
  // The counts and the update RMS come every step.
  int64_t health_every = 0;
  // Per parameter (flat spec order), what optimizer.rules give it: its
  // learning rate times lr_scale, its own weight decay (a torch param
  // group). Empty: every tensor at its optimizer's rates.
  std::vector<optim::ParamRates> param_rates;
  // Gradient accumulation (training.micro_batch_size): the local batch in
  // micro-batches of this many samples, each reduced as it is produced and
  // added up; the step's gradient and loss are their means. 0: the whole
  // local batch at once. Must divide the local batch.
  int64_t micro_batch_size = 0;
  // data.shuffle: global sample k reads sample model::SampleOf(k, N, true,
  // seed) (core/model/sample_order.h), a seeded permutation per epoch;
  // unset: sample k mod N.
  std::optional<uint64_t> shuffle_seed;
  uint64_t init_seed = 0;
  // When set, initial parameters (flat spec order) instead of the seed.
  const std::vector<std::vector<float>>* initial_parameters = nullptr;
  // Bytes the Muon phase may hold for the owners' buffers (muon_schedule.h):
  // the units are cut into waves that fit. 0, the default: no budget, one
  // wave for the whole model (the shortest critical path).
  int64_t muon_buffer_bytes = 0;
  // Run each Muon wave's gather exchange beside the previous wave's
  // Newton-Schulz (and the first wave's beside AdamW), on a second thread;
  // two waves are then in flight, so each gets half the budget. Host
  // devices only (ignored elsewhere).
  bool muon_overlap = true;
  // Bytes of one communication bucket (core/plan/buckets.h): consecutive
  // units' gradient reductions and after-step gathers as one collective.
  // <= 0: one unit a bucket. Job wide (every rank cuts the same buckets).
  int64_t bucket_bytes = plan::kDefaultBucketBytes;
  // Reduce each complete bucket on a thread of its own while the backward
  // pass goes on (the weights are the same bits either way). Host devices
  // only (ignored elsewhere).
  bool overlap_reduce = true;
  // Gather the next units a pass will acquire on a thread of its own while
  // it computes the ones it holds (one gather ahead; the weights are the
  // same bits either way). Host devices only (ignored elsewhere).
  bool prefetch_gathers = true;
  // Run the step records' all-gather (attention logits, Muon health, expert
  // statistics) on a thread of its own beside the after-step parameter
  // gather, unless QK-clip (qk_clip > 0) rescales the shards that gather
  // hands round (the same bits either way). Host devices only (ignored
  // elsewhere).
  bool overlap_records = true;
  // Gather the updated parameters after the optimizer step (where the
  // optimizer state is sharded over more ranks than the parameters) on a
  // thread of its own, one bucket at a time in the forward pass's order,
  // and let the step return: whatever reads a unit's parameters next waits
  // for its bucket only (the next forward pass), or for all of them (every
  // other entry but Barrier). docs/architecture.md §5, "The after-step
  // gather beside the next step". The step's report counts the gathers'
  // bytes and calls as before; the next step's param_allgather_after_step
  // is what it waited for them and its param_gather_hidden has the rest.
  // Not with QK-clip (qk_clip > 0); host devices only (ignored elsewhere).
  // The same bits either way.
  bool overlap_param_gather = true;
  // Muon inside the backward pass (docs/architecture.md §5): with several
  // Muon waves, the last wave's gather to the owners runs on a thread of
  // its own as soon as its units' gradients are reduced (in the last
  // micro-batch's pass; it reads the momentum, changes no state); a step
  // whose totals clip the gradients drops it and gathers again (and the
  // next step does not start early). The last wave then goes first in the
  // Muon phase. Needs overlap_reduce and muon_overlap; host devices only
  // (ignored elsewhere). Weights are the same bits.
  bool muon_in_backward = true;
};

// Wall time of each phase of one step on this rank. The parameter gathers
// and gradient reductions run unit by unit inside the forward and backward
// passes (Workload::ForwardBackwardByUnit): param_gather and grad_reduce sum
// them, and forward_backward is the rest of that time (the compute).
struct PhaseTimes {
  absl::Duration param_gather;       // every unit's all-gather (backward re-gathers included)
  absl::Duration forward_backward;   // compute only
  absl::Duration expert_dispatch;    // token exchanges with the other EP groups
  absl::Duration grad_reduce;        // every unit's reduction, and the loss's
  absl::Duration adamw;
  absl::Duration muon_prepare;
  absl::Duration muon_gather;        // exchange to the owners (an early one: what the pass waited)
  absl::Duration newton_schulz;
  absl::Duration muon_scatter;       // exchange back, and the HSDP replica split's
  absl::Duration muon_apply;
  // The updated parameters' gather after the optimizer step; with
  // TrainerOptions::overlap_param_gather, the step records' all-gather and
  // what this step waited for the last step's gathers.
  absl::Duration param_allgather_after_step;
  // Reductions that ran beside the backward pass while it computed
  // (TrainerOptions::overlap_reduce): not part of the step's time; what the
  // pass waited for is in grad_reduce.
  absl::Duration grad_reduce_hidden;
  // Parameter gathers that ran ahead of the pass while it computed
  // (TrainerOptions::prefetch_gathers): not part of the step's time; what
  // the pass waited for is in param_gather. With overlap_param_gather, also
  // the time of the last step's after-step gathers that the step did not
  // wait for.
  absl::Duration param_gather_hidden;
  // A Muon gather that ran inside the backward pass
  // (TrainerOptions::muon_in_backward): its preparation and exchange, not
  // part of the step's time (nor in muon_prepare or muon_gather).
  absl::Duration muon_gather_hidden;
};

// One round of the Muon phase: the exchanges, Newton-Schulz and updates of
// one wave of units (muon_schedule.h), as this rank ran it; under the HSDP
// replica split, a wave with dense matrices is followed by a round on
// "dp_outer" (its replica exchange: no Newton-Schulz, its bytes and wait).
struct MuonRound {
  int32_t wave = 0;
  int32_t first_unit = 0;  // spec units [first_unit, end_unit)
  int32_t end_unit = 0;
  // The meshes whose domains exchanged: "dense", "expert", "dense+expert";
  // or "dp_outer" for the replica split's exchange.
  std::string domain;
  double ns_flops = 0;     // Newton-Schulz FLOPs this rank ran in the round
  // What the plan says: this rank's share, and the busiest rank's (the
  // round's part of the planned critical path; PlannedWaveNsFlops).
  double planned_ns_flops = 0;
  double planned_critical_ns_flops = 0;
  int64_t sent_bytes = 0;  // by this rank in the round's exchanges
  int64_t recv_bytes = 0;
  absl::Duration wait;     // in the round's exchange calls (waiting for peers included)
};

// Whether Muon did its job in a step (docs/architecture.md, "Muon health"),
// over the whole model, each element once whatever the layout: the Muon
// matrices (blocks, one per expert) and elements updated, against what the
// plan holds; the RMS of the update lr * scale * O over those elements; and
// on health steps each orthogonalized matrix's math::OrthogonalityError, the
// largest and the median. The same on every rank.
struct MuonHealth {
  int64_t matrices = 0;
  int64_t planned_matrices = 0;
  int64_t elements = 0;
  int64_t planned_elements = 0;
  double update_rms = 0;
  std::optional<double> ortho_error_max;
  std::optional<double> ortho_error_median;
};

struct StepReport {
  int64_t step = 0;           // 0-based
  double loss = 0;            // global-batch mean, the same on every rank
  // The global gradient norm before clipping (every parameter, dense and
  // expert, each element once), and the learning-rate multiplier m(s) the
  // step ran at; the same on every rank.
  double grad_norm = 0;
  double lr_scale = 1;
  // Models with attention: per layer, the largest pre-softmax logit of any
  // head over the step's global batch (before QK-clip rescales); empty
  // otherwise. The same on every rank.
  std::vector<float> max_attn_logit;
  // Mixtures of experts: per MoE layer, the global batch's expert load
  // (Workload::expert_load); empty otherwise. The same on every rank.
  std::vector<ExpertLoad> expert_load;
  // The balance loss's part of `loss` (moe.aux_loss_coef > 0), averaged
  // over the global batch; nothing otherwise.
  std::optional<double> aux_loss;
  MuonHealth muon;
  PhaseTimes times;
  // Bytes this rank sent per collective name during the step: the names of
  // plan::CollectiveBytes (param_allgather, grad_reduce_scatter, ...) for the
  // dense mesh, the same with "expert/" in front for the expert mesh, and
  // expert_dispatch for the token exchanges of expert parallelism.
  std::map<std::string, int64_t> bytes_sent;
  double ns_flops = 0;        // Newton-Schulz FLOPs run on this rank
  // The Muon phase, round by round in execution order, and the number of
  // exchange calls it made (at most two per mesh per wave, and one per
  // dp_outer round).
  std::vector<MuonRound> muon_rounds;
  int32_t muon_exchange_calls = 0;
  // Whether the Muon phase began inside the backward pass: a wave gathered
  // there went first (TrainerOptions::muon_in_backward; not on a step that
  // clipped its gradients, whose gather was redone after the pass).
  bool muon_in_backward = false;
  // Collective calls this rank made during the step, on every group (the
  // communicators' counts; an exchange with size-1 groups counts too): with
  // each call a few network round trips one after another, what a link's
  // delay multiplies.
  int64_t collective_calls = 0;
  // The mean validation loss after this step, when the step was evaluated
  // (Trainer::Evaluate; the rank runner fills it).
  std::optional<double> val_loss;
};

class Trainer {
 public:
  // Creates the process groups (blocking until every member joined or the
  // connect timeout passes) and initialises this rank's shards. Errors:
  // InvalidArgument when the global
  // batch does not split evenly over the data-parallel ranks or the plan does
  // not match the workload; Unavailable/DeadlineExceeded from rendezvous.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const plan::Plan& plan,
                                                         Workload* workload, int32_t rank,
                                                         const TrainerOptions& options);
  ~Trainer();

  // Runs the next step. On error the job cannot continue on this rank.
  absl::StatusOr<StepReport> Step();

  // Every parameter as a whole tensor (flat spec order), on every rank.
  // A collective: all ranks must call it.
  absl::StatusOr<std::vector<std::vector<float>>> GatherParameters();
  // The same, handed to `sink` one tensor at a time in flat order as each
  // unit is gathered, so a rank holds at most one unit's whole tensors (for
  // exports of models that do not fit twice). A collective; a sink error
  // stops this rank (the others then fail in their next gather).
  using ParameterSink = std::function<absl::Status(int flat, std::vector<float>&& tensor)>;
  absl::Status GatherParameters(const ParameterSink& sink);

  int64_t steps_done() const { return step_; }

  // Returns once every rank of the job has called it (or the collective
  // timeout passed): a collective on the world group.
  absl::Status Barrier();

  // The mean validation loss of the current weights over `batches` global
  // batches of the workload's validation samples: validation sample j
  // (j < batches * global_batch_size) is j mod num_validation_samples(),
  // and this rank takes its slice of each batch as Step does. Every rank
  // must call it together (the parameters are gathered unit by unit and the
  // loss averaged over the ranks). FailedPrecondition when the workload has
  // no validation data.
  absl::StatusOr<double> Evaluate(int64_t batches);

  // Checkpoints. SaveShards writes what this rank holds that a later step
  // needs: its parameter shards and optimizer state (gradients are
  // recomputed every step) and the number of steps done, as a safetensors
  // file (tensors "units.{u}.{dense|expert}.{param|state1|state2}") whose
  // metadata names the format, the rank, the world size, the step, a
  // fingerprint of the layout, the model's tensors ("tensors": name, shape,
  // optimizer) and where each buffer's runs sit in the whole tensors
  // ("runs.units.{u}.{dense|expert}.{param|state}"), so that the shards of
  // all ranks consolidate without the plan (worker/reshard.h). Not a
  // collective: every rank saves its own.
  absl::Status SaveShards(const std::string& path) const;
  // Restores what SaveShards wrote, so that the next Step() continues the
  // run exactly (bit for bit). Refuses, changing nothing, a file of another
  // format, rank, world size or layout (InvalidArgument naming the file and
  // what differs); errors from reading the file as ReadSafetensors'.
  absl::Status LoadShards(const std::string& path);
  // Resharding: puts whole tensors (any layout's checkpoint, consolidated:
  // worker/reshard.h) into this rank's shards, the optimizer state with them
  // (zero when `fresh_optimizer_state`), and the step count. Refuses,
  // changing nothing, a state of another model (tensor names and shapes),
  // or, unless `fresh_optimizer_state`, one whose optimizer state is missing
  // or belongs to another optimizer than this plan gives a tensor
  // (InvalidArgument naming the tensor). Not a collective. Under the layout
  // that wrote the state, the next Step() continues the run bit for bit.
  absl::Status LoadState(const WholeState& state, bool fresh_optimizer_state);
  // The layout fingerprint SaveShards writes (the same on every rank of a
  // job; it changes with anything that moves a shard's contents).
  std::string LayoutFingerprint() const;

  // Bytes of the shards this rank holds: parameters, gradients (the reduced
  // optimizer shard) and optimizer state.
  int64_t shard_bytes() const;

 private:
  struct Impl;
  class UnitStream;  // the UnitAccess a step hands the workload
  class CommThread;  // its reductions, and its next gather, beside the pass
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int64_t step_ = 0;
  // Steps done before the optimizer state began: 0, or the step of a load
  // with fresh optimizer state (LoadState); checkpoints keep it.
  int64_t adamw_origin_ = 0;
};

}  // namespace muonmesh::worker
