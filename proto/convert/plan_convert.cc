#include "proto/convert/plan_convert.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/plan/mesh.h"
#include "core/plan/ns_cost.h"
#include "core/plan/validate.h"
#include "core/plan/waves.h"

namespace muonmesh::convert {
namespace {

plan::PlanOptions OptionsFromProto(const v1::PlanOptions& o) {
  plan::PlanOptions out;
  out.owner_assignment = o.owner_assignment();
  out.ns_steps = o.ns_steps();
  out.device = o.device();
  out.comm_flops_per_byte = o.comm_flops_per_byte();
  out.muon_replica_split = o.muon_replica_split();
  out.ns_algorithm = o.ns_algorithm();
  out.ns_coefficients = o.ns_coefficients();
  out.muon_wave_budget_bytes = o.muon_wave_budget_bytes();
  out.threads_per_rank = o.threads_per_rank();
  out.reshard_after_forward = !o.has_reshard_after_forward() || o.reshard_after_forward();
  return out;
}

}  // namespace

v1::PlanOptions OptionsToProto(const plan::PlanOptions& o) {
  v1::PlanOptions out;
  out.set_owner_assignment(o.owner_assignment);
  out.set_ns_steps(static_cast<int32_t>(o.ns_steps));
  out.set_device(o.device);
  out.set_comm_flops_per_byte(o.comm_flops_per_byte);
  out.set_muon_replica_split(o.muon_replica_split);
  out.set_ns_algorithm(o.ns_algorithm);
  out.set_ns_coefficients(o.ns_coefficients);
  out.set_muon_wave_budget_bytes(o.muon_wave_budget_bytes);
  out.set_threads_per_rank(static_cast<int32_t>(o.threads_per_rank));
  if (!o.reshard_after_forward) out.set_reshard_after_forward(false);
  return out;
}

namespace {

template <typename Request>
plan::PlanInput InputFrom(const Request& r) {
  plan::PlanInput in;
  in.model = ModelFromProto(r.model());
  in.world_size = r.world_size();
  in.parallelism = ParallelismFromProto(r.parallelism());
  in.options = OptionsFromProto(r.options());
  return in;
}

void MeshToProto(const std::vector<plan::MeshAxis>& axes, plan::MeshKind kind, v1::Plan* out) {
  v1::Mesh* mesh = kind == plan::MeshKind::kDense ? out->mutable_dense_mesh()
                                                  : out->mutable_expert_mesh();
  for (const plan::MeshAxis& a : axes) {
    mesh->add_dim_names(a.name);
    mesh->add_shape(a.size);
    v1::AxisPlacement* p = out->add_placements();
    p->set_mesh(plan::MeshName(kind));
    p->set_axis(a.name);
    p->set_size(a.size);
    p->set_strategy(plan::StrategyName(a.strategy));
    p->set_param(plan::PlacementName(a.placements.param));
    p->set_grad(plan::PlacementName(a.placements.grad));
    p->set_optimizer(plan::PlacementName(a.placements.optimizer));
  }
}

void LayoutToProto(const plan::UnitSpec& spec, const plan::UnitLayout& layout,
                   plan::MeshKind kind, bool include_shards, v1::UnitLayout* out) {
  out->set_unit(spec.name);
  out->set_mesh(plan::MeshName(kind));
  for (const plan::LayoutTensor& t : layout.tensors) {
    out->add_params(spec.params[t.param].name);
    out->add_rows(t.rows);
    out->add_row_len(t.row_len);
  }
  out->set_num_shards(layout.num_shards);
  out->set_shard_elements(layout.shard_elements);
  out->set_padding_elements(layout.padding_elements);
  out->set_rotation(layout.rotation);
  if (!include_shards) return;
  // In position order: position p holds layout shard (p - rotation) mod D.
  for (int64_t p = 0; p < layout.num_shards; ++p) {
    const int64_t s = layout.ShardAt(p);
    v1::ShardLayout* shard = out->add_shards();
    for (int64_t i = layout.shard_begin[s]; i < layout.shard_begin[s + 1]; ++i) {
      const plan::Segment& seg = layout.segments[i];
      v1::Segment* o = shard->add_segments();
      o->set_param(seg.tensor);
      o->set_row_start(seg.row_start);
      o->set_row_count(seg.row_count);
      o->set_offset(seg.offset);
    }
  }
}

// Expands one class of identical domains into each of its domains. With the
// replica split, a matrix's owner is the rank at its owner position in the
// replica that orthogonalizes it (the same dp_shard coordinate, since the
// outer axis replicates: rank = replica x W/I + that coordinate).
void MatricesToProto(const plan::PlanInput& input, const plan::Plan& p, const plan::DomainPlan& dp,
                     v1::Plan* out, bool include_holders) {
  const int64_t inner = p.config.world_size / std::max<int64_t>(p.config.instances, 1);
  for (const plan::Domain& dom : p.domains) {
    if (dom.mesh != dp.mesh) continue;
    // The EP group of this domain decides which experts its local ones are.
    const int64_t group = dom.mesh == plan::MeshKind::kExpert ? dom.ranks[0] % p.config.ep : 0;
    for (const plan::MatrixPlan& m : dp.matrices) {
      const plan::ParamSpec& spec = input.model.units[m.unit].params[m.param];
      v1::Matrix* o = out->add_matrices();
      std::string name = spec.name;
      if (m.expert >= 0) {
        const int64_t per_group = spec.shape[0] / p.config.ep;
        absl::StrAppend(&name, "[", group * per_group + m.expert, "]");
      }
      if (spec.muon_block_rows > 0) {
        // The block's rows within its matrix (its expert's, or the tensor).
        const int64_t first = m.row_offset % plan::AsMatrix(spec).rows;
        if (m.row_piece > 0) {
          // A stacked block: `piece` rows from `first`, again every `stride`.
          absl::StrAppend(&name, "[", first, ":", first + m.row_piece, " every ", m.row_stride,
                          "]");
        } else {
          absl::StrAppend(&name, "[", first, ":", first + m.rows, "]");
        }
      }
      o->set_name(std::move(name));
      o->set_rows(m.rows);
      o->set_cols(m.cols);
      o->set_domain(dom.id);
      int32_t owner = m.owner >= 0 ? dom.ranks[m.owner] : -1;
      if (m.replica >= 0 && owner >= 0) {
        owner = static_cast<int32_t>(m.replica * inner + owner % inner);
      }
      o->set_owner(owner);
      if (m.replica >= 0) o->set_replica(m.replica);
      o->set_cost_flops(m.cost_flops);
      o->set_ns_form(plan::NsAlgorithmName(m.ns_form));
      o->set_owner_cost(m.owner_cost);
      o->set_gather_bytes(m.gather_bytes);
      bool holder = false;
      for (const plan::Holder& h : m.holders) {
        holder = holder || h.position == m.owner;
        if (!include_holders) continue;
        v1::Holder* ho = o->add_holders();
        ho->set_rank(dom.ranks[h.position]);
        ho->set_row_start(h.row_start);
        ho->set_row_count(h.row_count);
      }
      o->set_owner_is_holder(m.owner < 0 || holder);
    }
  }
}

}  // namespace

plan::ModelSpec ModelFromProto(const v1::ModelSpec& model) {
  plan::ModelSpec out;
  out.name = model.name();
  out.units.reserve(model.units_size());
  for (const v1::UnitSpec& u : model.units()) {
    plan::UnitSpec& unit = out.units.emplace_back();
    unit.name = u.name();
    unit.gathers_per_step = u.gathers_per_step();
    unit.params.reserve(u.params_size());
    for (const v1::ParamSpec& p : u.params()) {
      plan::ParamSpec& param = unit.params.emplace_back();
      param.name = p.name();
      param.shape.assign(p.shape().begin(), p.shape().end());
      param.optimizer = p.optimizer();
      param.expert = p.expert();
      param.muon_block_rows = p.muon_block_rows();
      param.muon_block_rows_next = p.muon_block_rows_next();
      param.muon_stack_blocks = p.muon_stack_blocks();
    }
  }
  return out;
}

v1::ModelSpec ModelToProto(const plan::ModelSpec& model) {
  v1::ModelSpec out;
  out.set_name(model.name);
  for (const plan::UnitSpec& u : model.units) {
    v1::UnitSpec* unit = out.add_units();
    unit->set_name(u.name);
    unit->set_gathers_per_step(u.gathers_per_step);
    for (const plan::ParamSpec& p : u.params) {
      v1::ParamSpec* param = unit->add_params();
      param->set_name(p.name);
      for (int64_t d : p.shape) param->add_shape(d);
      param->set_optimizer(p.optimizer);
      param->set_expert(p.expert);
      param->set_muon_block_rows(p.muon_block_rows);
      param->set_muon_block_rows_next(p.muon_block_rows_next);
      param->set_muon_stack_blocks(p.muon_stack_blocks);
    }
  }
  return out;
}

plan::ParallelismConfig ParallelismFromProto(const v1::ParallelismConfig& par) {
  plan::ParallelismConfig out;
  out.data_parallel_sharding_strategy = par.data_parallel_sharding_strategy();
  out.num_distributed_optimizer_instances = par.num_distributed_optimizer_instances();
  out.outer_dp_sharding_strategy = par.outer_dp_sharding_strategy();
  out.expert_model_parallel_size = par.expert_model_parallel_size();
  out.tensor_model_parallel_size = par.tensor_model_parallel_size();
  out.pipeline_model_parallel_size = par.pipeline_model_parallel_size();
  out.context_parallel_size = par.context_parallel_size();
  return out;
}

plan::PlanInput PlanInputFromProto(const v1::PlanLayoutRequest& request) {
  return InputFrom(request);
}

plan::PlanInput PlanInputFromProto(const v1::ValidateConfigRequest& request) {
  return InputFrom(request);
}

namespace {

// The per-rank loads and the bytes of each collective.
void RanksAndCollectivesToProto(const plan::Plan& p, v1::Plan* out) {
  for (const plan::RankSummary& r : p.ranks) {
    v1::RankLoad* o = out->add_ranks();
    o->set_rank(r.rank);
    o->set_load_flops(r.load_flops);
    o->set_ns_flops(r.ns_flops);
    o->set_shard_elements(r.shard_elements);
    o->set_param_shard_elements(r.param_shard_elements);
    o->set_grad_shard_elements(r.grad_shard_elements);
    o->set_gather_bytes(r.gather_bytes);
    o->set_owned_matrices(r.owned_matrices);
    o->set_replica_exchange_bytes(r.replica_exchange_bytes);
  }
  for (const plan::CollectiveBytes& c : p.collectives) {
    v1::CollectiveBytes* o = out->add_collectives();
    o->set_name(c.name);
    o->set_mesh(plan::MeshName(c.mesh));
    o->set_axis(c.axis);
    o->set_bytes_per_step(c.bytes_per_step);
    o->set_max_rank_bytes(c.max_rank_bytes);
  }
}

// The summary: sizes, the cost model, each domain's makespan and bound,
// the joint figures and the Muon exchange.
void SummaryToProto(const plan::Plan& p, v1::PlanSummary* s) {
  int64_t total_bytes = 0;
  for (const plan::CollectiveBytes& c : p.collectives) total_bytes += c.bytes_per_step;
  s->set_parameters(p.parameters);
  s->set_padding_elements(p.padding_elements);
  s->set_padding_fraction(p.parameters > 0 ? static_cast<double>(p.padding_elements) /
                                                 static_cast<double>(p.parameters)
                                           : 0.0);
  s->set_comm_flops_per_byte(p.config.comm_flops_per_byte);
  s->set_bytes_per_step(total_bytes);
  s->set_owner_assignment(plan::OwnerRuleName(p.config.owner_rule));
  s->set_ns_steps(static_cast<int32_t>(p.config.ns_steps));
  s->set_ns_algorithm(plan::NsAlgorithmName(p.config.ns_algorithm));
  s->set_ns_coefficients(plan::NsTableName(p.config.ns_table));
  s->set_threads_per_rank(static_cast<int32_t>(p.config.threads_per_rank));
  s->set_params_held_for_backward(!p.config.reshard_after_forward);
  double worst = 1.0;
  int64_t exchange = 0;
  int64_t exchange_bound = 0;
  for (const plan::Domain& d : p.domains) {
    const plan::DomainPlan& dp = d.mesh == plan::MeshKind::kDense ? p.dense : p.expert;
    v1::DomainSummary* ds = s->add_domains();
    ds->set_domain(d.id);
    ds->set_makespan(dp.makespan);
    ds->set_lower_bound(dp.lower_bound);
    ds->set_matrices(static_cast<int32_t>(dp.matrices.size()));
    if (dp.lower_bound > 0) worst = std::max(worst, dp.makespan / dp.lower_bound);
    // Under the replica split a set of replica domains gathers each matrix
    // once: its exchange counts with the set's first domain (replica 0).
    const int64_t inner = p.config.world_size / std::max<int64_t>(p.config.instances, 1);
    if (dp.replicas <= 1 || d.ranks[0] / inner == 0) {
      exchange += dp.exchange_bytes;
      exchange_bound += dp.exchange_lower_bound_bytes;
    }
  }
  s->set_makespan_over_lower_bound(worst);
  s->set_joint_makespan(p.joint_makespan);
  s->set_joint_lower_bound(p.joint_lower_bound);
  s->set_joint_strong_lower_bound(p.joint_strong_lower_bound);
  s->set_joint_critical_rank(p.joint_critical_rank);
  s->set_muon_replica_split(p.dense.replicas > 1);
  s->set_joint_makespan_unsplit(p.joint_makespan_unsplit);
  s->set_joint_makespan_split(p.joint_makespan_split);
  s->set_muon_exchange_bytes(exchange);
  s->set_muon_exchange_lower_bound_bytes(exchange_bound);
  const std::vector<plan::MuonWave> waves =
      plan::PlanMuonWaves(p, p.config.muon_wave_budget_bytes);
  s->set_muon_waves(static_cast<int32_t>(waves.size()));
  s->set_wave_critical_path_ns_flops(plan::WaveCriticalPathNsFlops(p, waves));
}

}  // namespace

void PlanToProto(const plan::PlanInput& input, const plan::Plan& p, bool include_shards,
                 v1::Plan* out, bool include_holders) {
  out->set_world_size(p.config.world_size);
  MeshToProto(p.dense_axes, plan::MeshKind::kDense, out);
  if (p.has_experts) MeshToProto(p.expert_axes, plan::MeshKind::kExpert, out);
  for (const plan::Domain& d : p.domains) {
    v1::Domain* o = out->add_domains();
    o->set_id(d.id);
    o->set_name(d.name);
    o->set_mesh(plan::MeshName(d.mesh));
    o->mutable_ranks()->Assign(d.ranks.begin(), d.ranks.end());
  }
  for (size_t u = 0; u < p.units.size(); ++u) {
    const plan::UnitPlan& unit = p.units[u];
    if (unit.has_dense) {
      LayoutToProto(input.model.units[u], unit.dense, plan::MeshKind::kDense, include_shards,
                    out->add_units());
    }
    if (unit.has_expert) {
      LayoutToProto(input.model.units[u], unit.expert, plan::MeshKind::kExpert, include_shards,
                    out->add_units());
    }
  }
  MatricesToProto(input, p, p.dense, out, include_holders);
  if (p.has_experts) MatricesToProto(input, p, p.expert, out, include_holders);
  RanksAndCollectivesToProto(p, out);
  SummaryToProto(p, out->mutable_summary());
}

}  // namespace muonmesh::convert
