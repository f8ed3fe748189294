// Trainer's setup: the communicator groups of its meshes, the index of its
// parameters and their shards, the initial values and the Muon waves.
#include "worker/runtime/trainer_impl.h"

namespace muonmesh::worker {
namespace {

using CommPtr = std::unique_ptr<comm::Communicator>;

// Joins every group of one mesh (GroupsFor order).
absl::Status JoinMesh(const plan::MeshGeometry& geometry, int32_t rank,
                      const TrainerOptions& options, MeshState* mesh) {
  auto join = [&](const GroupSpec& g) {
    return comm::CreateGroup(options.backend, *options.store, g.name, g.rank_in_group, g.size(),
                             options.group_options);
  };
  const MeshGroups groups = GroupsFor(geometry, rank, options.group_prefix);
  for (auto [spec, slot] : {std::pair{&groups.domain, &mesh->domain_comm},
                            std::pair{&groups.param_gather, &mesh->gather_comm},
                            std::pair{&groups.param_group, &mesh->group_comm}}) {
    MUONMESH_ASSIGN_OR_RETURN(CommPtr c, join(*spec));
    *slot = std::move(c);
  }
  for (const GroupSpec& g : groups.reduce_scatter) {
    MUONMESH_ASSIGN_OR_RETURN(CommPtr c, join(g));
    mesh->reduce_scatter_comms.push_back(std::move(c));
  }
  for (const GroupSpec& g : groups.all_reduce) {
    MUONMESH_ASSIGN_OR_RETURN(CommPtr c, join(g));
    mesh->all_reduce_comms.push_back(std::move(c));
  }
  mesh->kind = geometry.kind();
  mesh->domain_size = geometry.domain_size();
  mesh->k = geometry.domain_size() / geometry.param_shards();
  mesh->position = geometry.PositionOf(rank);
  mesh->bytes_prefix = geometry.kind() == plan::MeshKind::kExpert ? "expert/" : "";
  return absl::OkStatus();
}

// The ranks that exchange tokens with `rank`: one per EP group, sharing its
// expert_dp coordinate (r / EP), in group order.
GroupSpec TokenGroup(int64_t ep, int32_t rank, const std::string& prefix) {
  GroupSpec g;
  const int32_t first = static_cast<int32_t>(rank / ep * ep);
  g.name = absl::StrCat(prefix, "/expert/dispatch/", first);
  for (int32_t q = 0; q < ep; ++q) g.ranks.push_back(first + q);
  g.rank_in_group = static_cast<int>(rank - first);
  return g;
}

}  // namespace

namespace trainer_internal {

absl::Status CheckCreateArguments(const plan::Plan& plan, const Workload& workload, int32_t rank,
                                  const TrainerOptions& options) {
  if (options.store == nullptr) return absl::InvalidArgumentError("TrainerOptions.store is null");
  if (options.device == nullptr) {
    return absl::InvalidArgumentError("TrainerOptions.device is null");
  }
  const plan::ModelSpec& spec = workload.spec();
  if (spec.units.size() != plan.units.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan has ", plan.units.size(),
                                                   " units but the workload has ",
                                                   spec.units.size()));
  }
  for (size_t u = 0; u < spec.units.size(); ++u) {
    if (spec.units[u].params.size() != plan.units[u].dense.tensors.size() +
                                           plan.units[u].expert.tensors.size()) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", spec.units[u].name,
                                                     ": the plan and the workload disagree"));
    }
  }
  size_t params = 0;
  for (const plan::UnitSpec& u : spec.units) params += u.params.size();
  if (!options.param_rates.empty() && options.param_rates.size() != params) {
    return absl::InvalidArgumentError(absl::StrCat("TrainerOptions.param_rates: ",
                                                   options.param_rates.size(),
                                                   " entries for a model of ", params,
                                                   " parameters"));
  }
  const int64_t world = plan.config.world_size;
  const int64_t ep = std::max<int64_t>(1, plan.config.ep);
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside [0, ", world, ")"));
  }
  if (options.global_batch_size < 1 || options.global_batch_size % world != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("training.global_batch_size ", options.global_batch_size,
                     " does not split evenly over ", world, " data-parallel ranks"));
  }
  const int64_t local = options.global_batch_size / world;
  if (options.micro_batch_size < 0 ||
      (options.micro_batch_size > 0 && local % options.micro_batch_size != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("training.micro_batch_size ", options.micro_batch_size,
                     " does not divide the local batch of ", local, " samples"));
  }
  for (const plan::UnitSpec& u : spec.units) {
    for (const plan::ParamSpec& p : u.params) {
      if (p.expert && (p.shape.empty() || p.shape[0] % ep != 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            p.name, ": an expert stack's first dimension must split over ", ep, " EP groups"));
      }
    }
  }
  if (workload.memory_space() != options.device->memory_space()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the workload ", spec.name, " computes in ",
        comm::MemorySpaceName(workload.memory_space()), " memory, the device ",
        options.device->name(), " holds ",
        comm::MemorySpaceName(options.device->memory_space()), " memory"));
  }
  return absl::OkStatus();
}

namespace {
// The runs of the shards at positions [first, first + count) of the unit's
// mesh, laid one after the other.
std::vector<ShardRun> RunsOf(const UnitState& u, int64_t first, int64_t count) {
  const plan::UnitLayout& l = *u.layout;
  std::vector<ShardRun> runs;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t shard = l.ShardAt(first + j);
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      const int64_t len = l.tensors[seg.tensor].row_len;
      runs.push_back({u.flat[seg.tensor], u.whole_offset[seg.tensor] + seg.row_start * len,
                      j * l.shard_elements + seg.offset, seg.row_count * len});
    }
  }
  return runs;
}
}  // namespace

std::vector<ShardRun> ParamRuns(const UnitState& u) {
  return RunsOf(u, (u.mesh->position / u.mesh->k) * u.mesh->k, u.mesh->k);
}

std::vector<ShardRun> StateRuns(const UnitState& u) { return RunsOf(u, u.mesh->position, 1); }

MatrixIndex IndexMatrices(const plan::DomainPlan& d) {
  MatrixIndex of;
  for (size_t j = 0; j < d.matrices.size(); ++j) {
    of[{d.matrices[j].unit, d.matrices[j].param}].push_back(static_cast<int32_t>(j));
  }
  return of;
}

}  // namespace trainer_internal

absl::Status Trainer::Impl::JoinGroups() {
  // The world, the dense mesh, and with experts the expert mesh and the
  // token exchange.
  absl::StatusOr<CommPtr> c = comm::CreateGroup(
      options.backend, *options.store, WorldGroup(world, rank, options.group_prefix).name, rank,
      static_cast<int>(world), options.group_options);
  MUONMESH_RETURN_IF_ERROR(c.status());
  world_comm = *std::move(c);
  if (world_comm->memory_space() != dev->memory_space()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend ", comm::BackendName(options.backend), " works on ",
        comm::MemorySpaceName(world_comm->memory_space()), " memory, the device ", dev->name(),
        " holds ", comm::MemorySpaceName(dev->memory_space()), " memory"));
  }
  MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer three, dev->Allocate(3));
  scalar = std::move(three);
  MUONMESH_RETURN_IF_ERROR(
      JoinMesh(plan::MeshGeometry::Dense(plan->config), rank, options, &dense));
  MUONMESH_RETURN_IF_ERROR(JoinReplicas());
  if (!plan->has_experts) return absl::OkStatus();
  MUONMESH_RETURN_IF_ERROR(
      JoinMesh(plan::MeshGeometry::Expert(plan->config), rank, options, &expert));
  if (ep > 1) {
    const GroupSpec g = TokenGroup(ep, rank, options.group_prefix);
    c = comm::CreateGroup(options.backend, *options.store, g.name, g.rank_in_group, g.size(),
                          options.group_options);
    MUONMESH_RETURN_IF_ERROR(c.status());
    ep_comm = *std::move(c);
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::IndexParameters() {
  for (const plan::UnitSpec& u : workload->spec().units) {
    unit_base.push_back(static_cast<int32_t>(param_sizes.size()));
    unit_count.push_back(static_cast<int32_t>(u.params.size()));
    for (const plan::ParamSpec& p : u.params) {
      param_sizes.push_back(Elements(p));
      local_sizes.push_back(p.expert ? Elements(p) / ep : Elements(p));
      is_expert.push_back(p.expert);
    }
  }
  if (options.initial_parameters == nullptr) return absl::OkStatus();
  const auto& init = *options.initial_parameters;
  if (init.size() != param_sizes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("initial parameters: ", init.size(),
                                                   " tensors for a model of ",
                                                   param_sizes.size()));
  }
  for (size_t i = 0; i < init.size(); ++i) {
    if (static_cast<int64_t>(init[i].size()) != param_sizes[i]) {
      return absl::InvalidArgumentError(absl::StrCat("initial parameters: tensor ", i, " has ",
                                                     init[i].size(), " elements, expected ",
                                                     param_sizes[i]));
    }
  }
  return absl::OkStatus();
}

// One unit's whole initial tensors at a time (never the whole model).
absl::Status Trainer::Impl::InitialUnit(size_t u, std::vector<std::vector<float>>& whole) const {
  whole.assign(unit_count[u], {});
  std::vector<float*> ptrs;
  for (int32_t j = 0; j < unit_count[u]; ++j) {
    const size_t flat = static_cast<size_t>(unit_base[u] + j);
    if (options.initial_parameters != nullptr) {
      whole[j] = (*options.initial_parameters)[flat];
    } else {
      whole[j].assign(param_sizes[flat], 0.0f);
    }
    ptrs.push_back(whole[j].data());
  }
  if (options.initial_parameters != nullptr) return absl::OkStatus();
  return workload->InitializeUnit(options.init_seed, static_cast<int>(u), absl::MakeSpan(ptrs));
}

absl::Status Trainer::Impl::AddUnitState(size_t u, MeshState* mesh, const MatrixIndex& matrices,
                                         const std::vector<std::vector<float>>& whole) {
  UnitState st;
  st.unit = static_cast<int32_t>(u);
  st.mesh = mesh;
  st.layout = mesh == &dense ? &plan_copy.units[u].dense : &plan_copy.units[u].expert;
  for (const plan::LayoutTensor& t : st.layout->tensors) {
    const size_t flat = static_cast<size_t>(unit_base[u] + t.param);
    st.flat.push_back(static_cast<int32_t>(flat));
    st.local.push_back(t.param);
    st.whole_offset.push_back(is_expert[flat] ? ep_index * local_sizes[flat] : 0);
    // The plan decides (job rules may override the spec's optimizer).
    auto it = matrices.find({static_cast<int32_t>(u), t.param});
    st.muon.push_back(it != matrices.end());
    if (it != matrices.end()) {
      st.matrices.insert(st.matrices.end(), it->second.begin(), it->second.end());
    }
  }
  const int64_t s = st.layout->shard_elements;
  for (auto [buffer, count] : {std::pair{&st.param, mesh->k * s}, std::pair{&st.grad, s},
                               std::pair{&st.state1, s}, std::pair{&st.state2, s}}) {
    MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer b, dev->AllocateZeroed(count));
    *buffer = std::move(b);
  }
  // My parameter shard: the shards at positions of my parameter group.
  for (const ShardRun& run : ParamRuns(st)) {
    MUONMESH_RETURN_IF_ERROR(
        dev->CopyFromHost(st.param.data() + run.offset,
                          whole[run.flat - unit_base[u]].data() + run.whole_start, run.count));
  }
  PlanMuon(st);
  states_of[u].push_back(static_cast<int32_t>(units.size()));
  units.push_back(std::move(st));
  return absl::OkStatus();
}

void Trainer::Impl::PlanWaves() {
  waves = PlanMuonWaves(*plan, WaveBudget(options.muon_buffer_bytes, Overlaps()));
  for (const std::vector<double>& per_rank : PlannedWaveNsFlops(*plan, waves)) {
    planned_ns.push_back({per_rank[rank], *std::max_element(per_rank.begin(), per_rank.end())});
  }
  for (const MuonWave& w : waves) {
    std::vector<int32_t>& ids = wave_states.emplace_back();
    for (int32_t u = w.first_unit; u < w.end_unit; ++u) {
      for (int32_t id : states_of[u]) ids.push_back(id);
    }
  }
}

}  // namespace muonmesh::worker
