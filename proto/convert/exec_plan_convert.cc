#include "proto/convert/exec_plan_convert.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "core/plan/ns_cost.h"
#include "core/base/status_macros.h"

namespace muonmesh::convert {
namespace {

template <typename Enum>
absl::StatusOr<Enum> EnumIn(int value, int count, const std::string& field) {
  if (value < 0 || value >= count) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": value ", value, " out of range"));
  }
  return static_cast<Enum>(value);
}

// ---------------------------------------------------------------- to proto

void AxisTo(const plan::MeshAxis& a, v1::ExecAxis* out) {
  out->set_name(a.name);
  out->set_size(a.size);
  out->set_strategy(static_cast<v1::ExecStrategy>(a.strategy));
  out->set_param(static_cast<v1::ExecPlacement>(a.placements.param));
  out->set_grad(static_cast<v1::ExecPlacement>(a.placements.grad));
  out->set_optimizer(static_cast<v1::ExecPlacement>(a.placements.optimizer));
}

void LayoutTo(const plan::UnitLayout& l, v1::ExecLayout* out) {
  for (const plan::LayoutTensor& t : l.tensors) {
    out->add_tensor_param(t.param);
    out->add_tensor_rows(t.rows);
    out->add_tensor_row_len(t.row_len);
  }
  out->set_num_shards(l.num_shards);
  out->set_shard_elements(l.shard_elements);
  out->set_padding_elements(l.padding_elements);
  for (const plan::Segment& s : l.segments) {
    out->add_segment_tensor(s.tensor);
    out->add_segment_row_start(s.row_start);
    out->add_segment_row_count(s.row_count);
    out->add_segment_offset(s.offset);
  }
  for (int64_t b : l.shard_begin) out->add_shard_begin(b);
  out->set_method(l.method);
  out->set_rotation(l.rotation);
}

void DomainPlanTo(const plan::DomainPlan& d, v1::ExecDomainPlan* out) {
  out->set_mesh(static_cast<v1::ExecMesh>(d.mesh));
  out->set_size(d.size);
  for (const plan::MatrixPlan& m : d.matrices) {
    v1::ExecMatrix* x = out->add_matrices();
    x->set_unit(m.unit);
    x->set_param(m.param);
    x->set_expert(m.expert);
    x->set_row_offset(m.row_offset);
    x->set_row_piece(m.row_piece);
    x->set_row_stride(m.row_stride);
    x->set_rows(m.rows);
    x->set_cols(m.cols);
    x->set_cost_flops(m.cost_flops);
    x->set_min_cost(m.min_cost);
    for (const plan::Holder& h : m.holders) {
      x->add_holder_position(h.position);
      x->add_holder_row_start(h.row_start);
      x->add_holder_row_count(h.row_count);
    }
    x->set_owner(m.owner);
    x->set_owner_cost(m.owner_cost);
    x->set_gather_bytes(m.gather_bytes);
    x->set_replica(m.replica);
  }
  out->set_replicas(d.replicas);
  for (double v : d.load) out->add_load(v);
  for (double v : d.ns_flops) out->add_ns_flops(v);
  for (int64_t v : d.gather_bytes) out->add_gather_bytes(v);
  for (int32_t v : d.owned) out->add_owned(v);
  out->set_makespan(d.makespan);
  out->set_lower_bound(d.lower_bound);
  out->set_exchange_bytes(d.exchange_bytes);
  out->set_exchange_lower_bound_bytes(d.exchange_lower_bound_bytes);
}

// ---------------------------------------------------------------- from proto

absl::StatusOr<plan::MeshAxis> AxisFrom(const v1::ExecAxis& a, const std::string& field) {
  plan::MeshAxis out;
  out.name = a.name();
  out.size = a.size();
  absl::StatusOr<plan::Strategy> s = EnumIn<plan::Strategy>(a.strategy(), 4, field + ".strategy");
  absl::StatusOr<plan::Placement> p = EnumIn<plan::Placement>(a.param(), 3, field + ".param");
  absl::StatusOr<plan::Placement> g = EnumIn<plan::Placement>(a.grad(), 3, field + ".grad");
  absl::StatusOr<plan::Placement> o =
      EnumIn<plan::Placement>(a.optimizer(), 3, field + ".optimizer");
  for (const absl::Status& st : {s.status(), p.status(), g.status(), o.status()}) {
    MUONMESH_RETURN_IF_ERROR(st);
  }
  out.strategy = *s;
  out.placements = {*p, *g, *o};
  return out;
}

absl::StatusOr<plan::UnitLayout> LayoutFrom(const v1::ExecLayout& l, const std::string& field) {
  plan::UnitLayout out;
  const int n = l.tensor_param_size();
  if (l.tensor_rows_size() != n || l.tensor_row_len_size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": tensor arrays differ in length"));
  }
  for (int i = 0; i < n; ++i) {
    out.tensors.push_back({l.tensor_param(i), l.tensor_rows(i), l.tensor_row_len(i)});
  }
  const int segments = l.segment_tensor_size();
  if (l.segment_row_start_size() != segments || l.segment_row_count_size() != segments ||
      l.segment_offset_size() != segments) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": segment arrays differ in length"));
  }
  for (int i = 0; i < segments; ++i) {
    if (l.segment_tensor(i) < 0 || l.segment_tensor(i) >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".segment_tensor[", i, "]: no tensor ", l.segment_tensor(i)));
    }
    out.segments.push_back(
        {l.segment_tensor(i), l.segment_row_start(i), l.segment_row_count(i), l.segment_offset(i)});
  }
  out.num_shards = l.num_shards();
  if (out.num_shards < 1 || l.shard_begin_size() != out.num_shards + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shard_begin needs num_shards + 1 entries"));
  }
  for (int64_t i = 0; i <= out.num_shards; ++i) {
    const int64_t b = l.shard_begin(static_cast<int>(i));
    if (b < 0 || b > segments || (i > 0 && b < out.shard_begin.back())) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shard_begin[", i, "]: ", b,
                                                     " is not an ascending segment index"));
    }
    out.shard_begin.push_back(b);
  }
  out.shard_elements = l.shard_elements();
  out.padding_elements = l.padding_elements();
  out.method = l.method();
  out.rotation = l.rotation();
  return out;
}

// The matrices' forms are not on the wire: each is the one the runtime will
// run for the plan's config (ChooseNsForm, as the planner chose it), which is
// what the memory check must count.
absl::StatusOr<plan::DomainPlan> DomainPlanFrom(const v1::ExecDomainPlan& d,
                                                const plan::ResolvedConfig& config,
                                                const std::string& field) {
  plan::DomainPlan out;
  MUONMESH_ASSIGN_OR_RETURN(plan::MeshKind mesh,
                            EnumIn<plan::MeshKind>(d.mesh(), 2, field + ".mesh"));
  out.mesh = mesh;
  out.size = d.size();
  for (int i = 0; i < d.matrices_size(); ++i) {
    const v1::ExecMatrix& x = d.matrices(i);
    plan::MatrixPlan m;
    m.unit = x.unit();
    m.param = x.param();
    m.expert = x.expert();
    m.row_offset = x.row_offset();
    m.row_piece = x.row_piece();
    m.row_stride = x.row_stride();
    m.rows = x.rows();
    m.cols = x.cols();
    // Pieces that fit their stride and make whole rows of the matrix.
    if (m.row_piece < 0 || m.row_stride < 0 ||
        (m.row_piece > 0 && (m.row_piece > m.row_stride || m.rows <= 0 ||
                             m.rows % m.row_piece != 0))) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".matrices[", i, "]: pieces of ", m.row_piece, " rows every ", m.row_stride,
          " do not make its ", m.rows, " rows"));
    }
    m.ns_form = plan::ChooseNsForm(config.ns_algorithm, m.rows, m.cols, config.ns_steps,
                                   config.ns_table, config.threads_per_rank);
    m.cost_flops = x.cost_flops();
    m.min_cost = x.min_cost();
    const int h = x.holder_position_size();
    if (x.holder_row_start_size() != h || x.holder_row_count_size() != h) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".matrices[", i, "]: holder arrays differ in length"));
    }
    for (int k = 0; k < h; ++k) {
      m.holders.push_back({x.holder_position(k), x.holder_row_start(k), x.holder_row_count(k)});
    }
    m.owner = x.owner();
    m.owner_cost = x.owner_cost();
    m.gather_bytes = x.gather_bytes();
    m.replica = x.replica();
    // A replica only under the split (replicas > 1), and one of them.
    if (m.replica < -1 || m.replica >= (d.replicas() > 1 ? d.replicas() : 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".matrices[", i, "].replica: ", m.replica, " is not a replica"));
    }
    out.matrices.push_back(std::move(m));
  }
  out.replicas = d.replicas() == 0 ? 1 : d.replicas();
  if (out.replicas < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".replicas: must be >= 1, got ", d.replicas()));
  }
  out.load.assign(d.load().begin(), d.load().end());
  out.ns_flops.assign(d.ns_flops().begin(), d.ns_flops().end());
  out.gather_bytes.assign(d.gather_bytes().begin(), d.gather_bytes().end());
  out.owned.assign(d.owned().begin(), d.owned().end());
  out.makespan = d.makespan();
  out.lower_bound = d.lower_bound();
  out.exchange_bytes = d.exchange_bytes();
  out.exchange_lower_bound_bytes = d.exchange_lower_bound_bytes();
  return out;
}

absl::StatusOr<plan::ResolvedConfig> ConfigFrom(const v1::ExecConfig& c) {
  plan::ResolvedConfig out;
  out.world_size = c.world_size();
  out.instances = c.instances();
  out.ep = c.ep();
  absl::StatusOr<plan::Strategy> inner = EnumIn<plan::Strategy>(c.inner(), 4, "config.inner");
  absl::StatusOr<plan::Strategy> outer = EnumIn<plan::Strategy>(c.outer(), 4, "config.outer");
  absl::StatusOr<plan::OwnerRule> rule =
      EnumIn<plan::OwnerRule>(c.owner_rule(), 4, "config.owner_rule");
  absl::StatusOr<plan::ReplicaSplit> split =
      EnumIn<plan::ReplicaSplit>(c.replica_split(), 3, "config.replica_split");
  absl::StatusOr<plan::NsAlgorithm> algorithm =
      EnumIn<plan::NsAlgorithm>(c.ns_algorithm(), 4, "config.ns_algorithm");
  absl::StatusOr<plan::NsTable> table =
      EnumIn<plan::NsTable>(c.ns_coefficients(), 2, "config.ns_coefficients");
  for (const absl::Status& st : {inner.status(), outer.status(), rule.status(), split.status(),
                                 algorithm.status(), table.status()}) {
    MUONMESH_RETURN_IF_ERROR(st);
  }
  if (out.world_size < 1 || out.instances < 1 || out.ep < 1) {
    return absl::InvalidArgumentError("config: world_size, instances and ep must be >= 1");
  }
  if (c.threads_per_rank() < 0 || c.threads_per_rank() > plan::kMaxThreadsPerRank) {
    return absl::InvalidArgumentError(absl::StrCat("config.threads_per_rank: must be in [0, ",
                                                   plan::kMaxThreadsPerRank, "], got ",
                                                   c.threads_per_rank()));
  }
  out.threads_per_rank = std::max(1, c.threads_per_rank());
  out.reshard_after_forward = !c.params_held_for_backward();
  // The forms are chosen from it below (a loop over the steps).
  if (c.ns_steps() < 1 || c.ns_steps() > plan::kMaxNsSteps) {
    return absl::InvalidArgumentError(absl::StrCat("config.ns_steps: must be in [1, ",
                                                   plan::kMaxNsSteps, "], got ", c.ns_steps()));
  }
  out.inner = *inner;
  out.outer = *outer;
  out.owner_rule = *rule;
  out.replica_split = *split;
  out.ns_algorithm = *algorithm;
  out.ns_table = *table;
  out.ns_steps = c.ns_steps();
  out.comm_flops_per_byte = c.comm_flops_per_byte();
  out.bytes_per_element = c.bytes_per_element();
  return out;
}

}  // namespace

v1::ExecutionPlan PlanToExec(const plan::Plan& p) {
  v1::ExecutionPlan out;
  v1::ExecConfig* c = out.mutable_config();
  c->set_world_size(p.config.world_size);
  c->set_instances(p.config.instances);
  c->set_ep(p.config.ep);
  c->set_inner(static_cast<v1::ExecStrategy>(p.config.inner));
  c->set_outer(static_cast<v1::ExecStrategy>(p.config.outer));
  c->set_owner_rule(static_cast<v1::ExecOwnerRule>(p.config.owner_rule));
  c->set_replica_split(static_cast<int32_t>(p.config.replica_split));
  c->set_ns_steps(p.config.ns_steps);
  c->set_ns_algorithm(static_cast<int32_t>(p.config.ns_algorithm));
  c->set_ns_coefficients(static_cast<int32_t>(p.config.ns_table));
  c->set_threads_per_rank(static_cast<int32_t>(p.config.threads_per_rank));
  c->set_params_held_for_backward(!p.config.reshard_after_forward);
  c->set_comm_flops_per_byte(p.config.comm_flops_per_byte);
  c->set_bytes_per_element(p.config.bytes_per_element);
  for (const plan::MeshAxis& a : p.dense_axes) AxisTo(a, out.add_dense_axes());
  for (const plan::MeshAxis& a : p.expert_axes) AxisTo(a, out.add_expert_axes());
  out.set_has_experts(p.has_experts);
  for (const plan::UnitPlan& u : p.units) {
    v1::ExecUnit* x = out.add_units();
    x->set_name(u.name);
    if (u.has_dense) LayoutTo(u.dense, x->mutable_dense());
    if (u.has_expert) LayoutTo(u.expert, x->mutable_expert());
  }
  DomainPlanTo(p.dense, out.mutable_dense());
  DomainPlanTo(p.expert, out.mutable_expert());
  for (const plan::Domain& d : p.domains) {
    v1::ExecDomain* x = out.add_domains();
    x->set_id(d.id);
    x->set_mesh(static_cast<v1::ExecMesh>(d.mesh));
    x->set_name(d.name);
    for (int32_t r : d.ranks) x->add_ranks(r);
  }
  for (const plan::RankSummary& r : p.ranks) {
    v1::ExecRank* x = out.add_ranks();
    x->set_rank(r.rank);
    x->set_load_flops(r.load_flops);
    x->set_ns_flops(r.ns_flops);
    x->set_shard_elements(r.shard_elements);
    x->set_param_shard_elements(r.param_shard_elements);
    x->set_grad_shard_elements(r.grad_shard_elements);
    x->set_gather_bytes(r.gather_bytes);
    x->set_owned_matrices(r.owned_matrices);
    x->set_replica_exchange_bytes(r.replica_exchange_bytes);
  }
  for (const plan::CollectiveBytes& cb : p.collectives) {
    v1::ExecCollective* x = out.add_collectives();
    x->set_name(cb.name);
    x->set_mesh(static_cast<v1::ExecMesh>(cb.mesh));
    x->set_axis(cb.axis);
    x->set_bytes_per_step(cb.bytes_per_step);
    x->set_max_rank_bytes(cb.max_rank_bytes);
  }
  out.set_parameters(p.parameters);
  out.set_padding_elements(p.padding_elements);
  return out;
}

absl::StatusOr<plan::Plan> PlanFromExec(const v1::ExecutionPlan& x) {
  plan::Plan p;
  MUONMESH_ASSIGN_OR_RETURN(plan::ResolvedConfig config, ConfigFrom(x.config()));
  p.config = config;
  for (int i = 0; i < x.dense_axes_size(); ++i) {
    MUONMESH_ASSIGN_OR_RETURN(plan::MeshAxis a,
                              AxisFrom(x.dense_axes(i), absl::StrCat("dense_axes[", i, "]")));
    p.dense_axes.push_back(std::move(a));
  }
  for (int i = 0; i < x.expert_axes_size(); ++i) {
    MUONMESH_ASSIGN_OR_RETURN(plan::MeshAxis a,
                              AxisFrom(x.expert_axes(i), absl::StrCat("expert_axes[", i, "]")));
    p.expert_axes.push_back(std::move(a));
  }
  p.has_experts = x.has_experts();
  for (int i = 0; i < x.units_size(); ++i) {
    const v1::ExecUnit& u = x.units(i);
    plan::UnitPlan unit;
    unit.name = u.name();
    unit.has_dense = u.has_dense();
    unit.has_expert = u.has_expert();
    if (unit.has_dense) {
      MUONMESH_ASSIGN_OR_RETURN(plan::UnitLayout l,
                                LayoutFrom(u.dense(), absl::StrCat("units[", i, "].dense")));
      unit.dense = std::move(l);
    }
    if (unit.has_expert) {
      MUONMESH_ASSIGN_OR_RETURN(plan::UnitLayout l,
                                LayoutFrom(u.expert(), absl::StrCat("units[", i, "].expert")));
      unit.expert = std::move(l);
    }
    p.units.push_back(std::move(unit));
  }
  MUONMESH_ASSIGN_OR_RETURN(plan::DomainPlan dense, DomainPlanFrom(x.dense(), p.config, "dense"));
  p.dense = std::move(dense);
  MUONMESH_ASSIGN_OR_RETURN(plan::DomainPlan expert,
                            DomainPlanFrom(x.expert(), p.config, "expert"));
  p.expert = std::move(expert);
  for (const v1::ExecDomain& d : x.domains()) {
    MUONMESH_ASSIGN_OR_RETURN(plan::MeshKind mesh,
                              EnumIn<plan::MeshKind>(d.mesh(), 2, "domains.mesh"));
    p.domains.push_back({d.id(), mesh, d.name(), {d.ranks().begin(), d.ranks().end()}});
  }
  for (const v1::ExecRank& r : x.ranks()) {
    p.ranks.push_back({r.rank(), r.load_flops(), r.ns_flops(), r.shard_elements(),
                       r.param_shard_elements(), r.grad_shard_elements(), r.gather_bytes(),
                       r.owned_matrices(), r.replica_exchange_bytes()});
  }
  for (const v1::ExecCollective& c : x.collectives()) {
    MUONMESH_ASSIGN_OR_RETURN(plan::MeshKind mesh,
                              EnumIn<plan::MeshKind>(c.mesh(), 2, "collectives.mesh"));
    p.collectives.push_back({c.name(), mesh, c.axis(), c.bytes_per_step(), c.max_rank_bytes()});
  }
  p.parameters = x.parameters();
  p.padding_elements = x.padding_elements();
  return p;
}

std::string PlanFingerprint(const v1::ExecutionPlan& exec) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    exec.SerializeToCodedStream(&coded);
  }
  // FNV-1a, 64-bit twice (two offsets) for 128 bits: a check against
  // mismatched plans, not against an adversary.
  uint64_t a = 0xcbf29ce484222325ull;
  uint64_t b = 0x84222325cbf29ce4ull;
  for (unsigned char c : bytes) {
    a = (a ^ c) * 0x100000001b3ull;
    b = (b ^ c) * 0x100000001b3ull;
  }
  return absl::StrFormat("%016x%016x-%d", a, b, bytes.size());
}

}  // namespace muonmesh::convert
