#pragma once

// Value types of the planner: its input (model spec, parallelism config,
// options) and its output (meshes, layouts, owners, loads, bytes). Plain
// structs with no behaviour; the planner is pure C++ and knows nothing of
// protobuf or gRPC (proto/convert/plan_convert.h translates at the edge).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/base/field_violation.h"
#include "core/plan/ns_cost.h"

namespace muonmesh::plan {

// ---------------------------------------------------------------- input

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string optimizer;  // "muon" | "adamw"
  bool expert = false;    // a stack [E, rows, cols...] of E expert tensors
  // Muon orthogonalizes each block of this many rows alone (of each expert
  // of a stack): q, k and v of a fused attention projection, or each head.
  // 0: the whole matrix. Must divide the matrix's rows.
  int64_t muon_block_rows = 0;
  // With muon_block_rows, blocks of two sizes in turn: muon_block_rows rows,
  // then this many, then muon_block_rows again (MLA's kv_b_proj per head:
  // k_nope rows, then v rows). 0: every block has muon_block_rows. The pair
  // must divide the matrix's rows.
  int64_t muon_block_rows_next = 0;
  // With muon_block_rows_next: the blocks of each size form one matrix, their
  // rows stacked in order (MLA's kv_b_proj under split_qkv: every head's
  // k_nope rows, then every head's v rows), two matrices per tensor.
  bool muon_stack_blocks = false;
};

struct UnitSpec {
  std::string name;
  std::vector<ParamSpec> params;
  // Parameter all-gathers of this unit per step (0 means 1): 2 when the
  // backward pass gathers the unit again (FSDP's reshard after forward).
  int32_t gathers_per_step = 0;
};

struct ModelSpec {
  std::string name;
  std::vector<UnitSpec> units;
};

// Megatron DistributedDataParallelConfig names. Zero / empty means default.
struct ParallelismConfig {
  std::string data_parallel_sharding_strategy;  // default optim_grads_params
  int64_t num_distributed_optimizer_instances = 0;  // default 1
  std::string outer_dp_sharding_strategy;  // default optim when I > 1
  int64_t expert_model_parallel_size = 0;  // default 1
  int64_t tensor_model_parallel_size = 0;
  int64_t pipeline_model_parallel_size = 0;
  int64_t context_parallel_size = 0;
};

struct PlanOptions {
  std::string owner_assignment;  // lpt (default) | round_robin | allgather | greedy_in_order
  int64_t ns_steps = 0;          // default kDefaultNsSteps (5)
  std::string device;            // cuda (default) | cpu
  double comm_flops_per_byte = 0;  // default by device
  // The HSDP replica split (ReplicaSplit): auto (default) | on | off.
  std::string muon_replica_split;
  // Newton-Schulz form (plan/ns_cost.h): auto (default) | standard | gram.
  std::string ns_algorithm;
  // Newton-Schulz coefficients: quintic (default) | polar_express.
  std::string ns_coefficients;
  // The bytes one wave of the Muon phase may hold for the owners' buffers,
  // as the runtime budgets it (plan/waves.h, WaveBudget of the job's
  // optimizer.muon_buffer_bytes); 0: one wave. With several waves lpt
  // balances the owners wave by wave (planner.cc, BalanceWaves).
  int64_t muon_wave_budget_bytes = 0;
  // OpenBLAS threads a rank runs (plan/ns_cost.h prices the forms for it);
  // 0: 1.
  int64_t threads_per_rank = 0;
  // Whether a unit the workload gathers more than once a step is freed after
  // each use and gathered again (true, the default: FSDP's
  // reshard_after_forward) or held gathered until its last use, so it is
  // gathered once (false): no param_allgather_backward, at the cost of
  // holding those units whole through the pass (docs/architecture.md §5).
  bool reshard_after_forward = true;
};

struct PlanInput {
  ModelSpec model;
  int64_t world_size = 0;
  ParallelismConfig parallelism;
  PlanOptions options;
};

// Field violations (core/base/field_violation.h), named here as the
// planner's own.
using FieldViolation = ::muonmesh::FieldViolation;
using Violations = ::muonmesh::Violations;

// ---------------------------------------------------------------- vocabulary

enum class Strategy { kNoShard, kOptim, kOptimGrads, kOptimGradsParams };
enum class Placement { kReplicate, kShard, kPartialAvg };
enum class OwnerRule { kLpt, kRoundRobin, kAllGather, kGreedyInOrder };
enum class MeshKind { kDense, kExpert };
// Whether the replicas of a replicated outer axis (HSDP: dp_outer with
// no_shard, I > 1) split the Muon matrices of their dense domains: each
// replica orthogonalizes its share and the replicas exchange the results
// over dp_outer (README, "Running jobs"). kAuto splits when the cost model
// says the split plan's joint makespan (the replica exchange's bytes
// counted) is shorter than the unsplit one's; kOn splits wherever a split
// can run (an owner rule, not allgather, and a replicated dp_outer axis);
// kOff never.
enum class ReplicaSplit { kAuto, kOn, kOff };

// Placements of (parameter, gradient, optimizer state) on one mesh axis.
struct AxisPlacements {
  Placement param;
  Placement grad;
  Placement optimizer;
};

struct MeshAxis {
  std::string name;  // "dp_outer", "dp_shard", "expert_dp"
  int64_t size = 1;
  Strategy strategy = Strategy::kNoShard;
  AxisPlacements placements{};
};

// The validated config with every default resolved.
struct ResolvedConfig {
  int64_t world_size = 1;
  int64_t instances = 1;  // I
  int64_t ep = 1;         // expert model parallel size
  Strategy inner = Strategy::kOptimGradsParams;
  Strategy outer = Strategy::kNoShard;  // meaningful when instances > 1
  OwnerRule owner_rule = OwnerRule::kLpt;
  ReplicaSplit replica_split = ReplicaSplit::kAuto;
  int64_t ns_steps = kDefaultNsSteps;
  // Resolved: on cuda, auto is the standard form (no Gram kernel there yet).
  NsAlgorithm ns_algorithm = NsAlgorithm::kAuto;
  NsTable ns_table = NsTable::kQuintic;
  int64_t muon_wave_budget_bytes = 0;
  int64_t threads_per_rank = 1;
  bool reshard_after_forward = true;  // PlanOptions::reshard_after_forward
  double comm_flops_per_byte = 0;
  int64_t bytes_per_element = 4;  // fp32 parameters, gradients and updates
};

// ---------------------------------------------------------------- layout

// A tensor as the layout sees it: `rows` rows of `row_len` elements. Muon
// matrices keep their rows whole; element-wise tensors have row_len 1. An
// expert stack's local experts are consecutive blocks of rows.
struct LayoutTensor {
  int32_t param = 0;  // index into the unit's params
  int64_t rows = 0;
  int64_t row_len = 1;
};

// A run of whole rows of one tensor inside one shard.
struct Segment {
  int32_t tensor = 0;  // index into UnitLayout::tensors
  int64_t row_start = 0;
  int64_t row_count = 0;
  int64_t offset = 0;  // element offset inside the shard
};

// The row-aligned flat layout of one unit on one shard domain: num_shards
// equal shards of shard_elements each, every shard a list of whole-row runs
// followed by padding.
struct UnitLayout {
  std::vector<LayoutTensor> tensors;
  int64_t num_shards = 1;
  int64_t shard_elements = 0;
  int64_t padding_elements = 0;
  std::vector<Segment> segments;      // all shards, in shard order
  std::vector<int64_t> shard_begin;   // num_shards + 1 offsets into segments
  std::string method;                 // "ordered" or "packed"
  // Shard k lives at domain position (k + rotation) % num_shards. The planner
  // rotates each unit so that repeated layers do not pile their matrices on
  // the same ranks. A rotation only relabels which shard each position holds:
  // a rank's parameter shard is still the shards of its parameter group, and
  // gathered buffers are cyclic shifts of the layout (tensors are always
  // assembled from their row runs, so a wrap costs nothing).
  int64_t rotation = 0;

  // The layout shard held at domain `position`, and the other way round
  // (both in [0, num_shards) for arguments in that range).
  int64_t ShardAt(int64_t position) const {
    return ((position - rotation) % num_shards + num_shards) % num_shards;
  }
  int64_t PositionOf(int64_t shard) const { return (shard + rotation) % num_shards; }
};

// The rows that [start, start + count) shares with [lo, hi): a start and a
// count, the count 0 when they share none.
struct RowRange {
  int64_t start = 0;
  int64_t count = 0;
};
inline RowRange IntersectRows(int64_t lo, int64_t hi, int64_t start, int64_t count) {
  const int64_t a = lo > start ? lo : start;
  const int64_t b = hi < start + count ? hi : start + count;
  return a < b ? RowRange{a, b - a} : RowRange{a, 0};
}

// The rows of one Muon matrix among its tensor's rows: `count` rows from
// `start`, in pieces of `piece` rows whose starts lie `stride` rows apart
// (a stacked block, ParamSpec::muon_stack_blocks). piece 0 (or piece ==
// count): one run of rows.
struct MatrixRows {
  int64_t start = 0;
  int64_t count = 0;
  int64_t piece = 0;
  int64_t stride = 0;

  bool Strided() const { return piece > 0 && piece < count; }
  // The tensor row of matrix row `row`.
  int64_t TensorRow(int64_t row) const {
    return Strided() ? start + (row / piece) * stride + row % piece : start + row;
  }
  // The matrix rows whose tensor rows lie in [lo, hi): one run, as
  // TensorRow increases (count 0 when none).
  RowRange Among(int64_t lo, int64_t hi) const {
    const int64_t a = FirstAtOrAfter(lo);
    const int64_t b = FirstAtOrAfter(hi);
    return b > a ? RowRange{a, b - a} : RowRange{a, 0};
  }

 private:
  // The first matrix row whose tensor row is >= `row` (count if none).
  int64_t FirstAtOrAfter(int64_t row) const {
    const int64_t d = row - start;
    if (d <= 0) return 0;
    if (!Strided()) return d < count ? d : count;
    const int64_t k = d / stride;
    const int64_t within = d % stride;
    const int64_t at = k * piece + (within < piece ? within : piece);
    return at < count ? at : count;
  }
};

// ---------------------------------------------------------------- owners

struct Holder {
  int32_t position = 0;  // position in the domain
  int64_t row_start = 0;
  int64_t row_count = 0;
};

// One Muon matrix (one expert's matrix for a stack) inside a domain.
struct MatrixPlan {
  int32_t unit = 0;
  int32_t param = 0;
  int32_t expert = -1;  // local expert index within the EP group, -1 if dense
  // Where its rows start among the tensor's local rows: the expert's first
  // row in its stack, plus the block's (ParamSpec::muon_block_rows).
  int64_t row_offset = 0;
  // A stacked block (ParamSpec::muon_stack_blocks): its rows come in pieces
  // of row_piece rows, row_stride rows apart from row_offset. 0: one run.
  int64_t row_piece = 0;
  int64_t row_stride = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  NsAlgorithm ns_form = NsAlgorithm::kStandard;  // the form that runs (auto resolved)
  double cost_flops = 0;        // NsFlops of ns_form (ns_cost.h)
  double min_cost = 0;          // cost_flops + w * bytes at the best holder
  std::vector<Holder> holders;  // ascending position
  int32_t owner = -1;           // position; -1 for the allgather rule (everyone)
  // With the replica split (DomainPlan::replicas > 1): the replica (dp_outer
  // coordinate) whose rank at `owner` orthogonalizes the matrix for every
  // replica; -1 without the split (each replica's owner does its own).
  int32_t replica = -1;
  double owner_cost = 0;
  int64_t gather_bytes = 0;     // bytes the owner receives plus sends back

  // Its rows among the tensor's local rows.
  MatrixRows TensorRows() const { return {row_offset, rows, row_piece, row_stride}; }
};

// Owner assignment of one class of identical domains (all dense domains share
// one, all expert domains share one): positions, not ranks.
//
// With the replica split (replicas > 1, dense only) the I replica domains of
// one set of replicas share the matrices: each matrix is orthogonalized once
// for the set, by the rank at its owner position in its `replica`, and the
// per-position vectors have one entry per (replica, position), replica-major
// (index replica * size + position); `load` then includes the replica
// exchange's bytes (ReplicaExchangeBytes, owners.h) times comm_flops_per_byte,
// and makespan, lower_bound and the exchange bytes describe the set's
// I x size positions.
struct DomainPlan {
  MeshKind mesh = MeshKind::kDense;
  int64_t size = 1;
  int64_t replicas = 1;
  std::vector<MatrixPlan> matrices;
  std::vector<double> load;      // per position, flop-equivalents
  std::vector<double> ns_flops;  // per position
  std::vector<int64_t> gather_bytes;  // per position
  std::vector<int32_t> owned;    // matrices per position
  double makespan = 0;
  double lower_bound = 0;
  int64_t exchange_bytes = 0;              // whole domain, one step
  int64_t exchange_lower_bound_bytes = 0;  // owners at their best holders
  // Work the lpt refinement spent (see RefineWorkBudget in owners.h), and
  // whether it stopped because the budget ran out rather than because no
  // move or swap helped any more.
  int64_t refine_work = 0;
  bool refine_budget_spent = false;
};

// ---------------------------------------------------------------- plan

struct Domain {
  int32_t id = 0;
  MeshKind mesh = MeshKind::kDense;
  std::string name;
  std::vector<int32_t> ranks;  // position -> global rank
};

struct UnitPlan {
  std::string name;
  bool has_dense = false;
  bool has_expert = false;
  UnitLayout dense;
  UnitLayout expert;
};

struct RankSummary {
  int32_t rank = 0;
  double load_flops = 0;
  double ns_flops = 0;
  int64_t shard_elements = 0;
  int64_t param_shard_elements = 0;
  int64_t grad_shard_elements = 0;
  int64_t gather_bytes = 0;
  int32_t owned_matrices = 0;
  // The replica split's exchange over dp_outer: bytes sent plus received.
  int64_t replica_exchange_bytes = 0;
};

struct CollectiveBytes {
  std::string name;  // param_allgather, param_allgather_backward (the re-gathers
                     // of UnitSpec::gathers_per_step > 1), grad_reduce_scatter,
                     // grad_allreduce, muon_gather, muon_scatter, muon_allgather,
                     // param_allgather_after_step
  MeshKind mesh = MeshKind::kDense;
  std::string axis;
  int64_t bytes_per_step = 0;  // sent by all ranks together
  int64_t max_rank_bytes = 0;
};

struct Plan {
  ResolvedConfig config;
  std::vector<MeshAxis> dense_axes;   // ("dp_outer", "dp_shard")
  std::vector<MeshAxis> expert_axes;  // ("expert_dp",); empty without experts
  bool has_experts = false;
  std::vector<UnitPlan> units;
  DomainPlan dense;
  DomainPlan expert;
  std::vector<Domain> domains;
  std::vector<RankSummary> ranks;
  std::vector<CollectiveBytes> collectives;
  int64_t parameters = 0;
  int64_t padding_elements = 0;
  // The Muon phase's critical path as the runtime executes it, one schedule
  // over all units and both meshes in one wave of units (docs/architecture.md §4-§5):
  // the largest load of a rank summed over every domain it belongs to
  // (ranks[r].load_flops), in flop-equivalents. With several waves of units
  // it would be the sum over waves of that maximum.
  double joint_makespan = 0;
  int32_t joint_critical_rank = 0;  // a rank with that load, the lowest
  // max(each mesh's lower_bound, sum of all domains' best-holder costs /
  // world size): no owner assignment has a smaller joint makespan. Under the
  // replica split it is the split family's: the dense matrices once per set
  // of replicas over its I x D positions, and the replica exchange, whose
  // total no split avoids (planner.cc, SplitBaseLoad).
  double joint_lower_bound = 0;
  // A stronger certified lower bound (owners.h, StrongJointLowerBound),
  // computed only where joint_makespan exceeds 1.05 x joint_lower_bound;
  // otherwise equal to joint_lower_bound.
  double joint_strong_lower_bound = 0;
  // The replica split (ReplicaSplit): the joint makespan of the plan without
  // it and with it, each 0 where it was not planned (the split cannot run,
  // or the config rules one out). dense.replicas > 1 says which runs.
  double joint_makespan_unsplit = 0;
  double joint_makespan_split = 0;
};

}  // namespace muonmesh::plan
