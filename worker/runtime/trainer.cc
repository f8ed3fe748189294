#include "worker/runtime/trainer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/plan/mesh.h"
#include "server/plan/owners.h"
#include "server/plan/validate.h"
#include "worker/math/adamw.h"
#include "worker/math/muon.h"
#include "worker/runtime/groups.h"

namespace muonmesh::worker {
namespace {

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

// The unit's Muon exchange, fixed by the plan: buffers are laid out by peer
// position, then by matrix order, so both sides agree without talking.
struct Exchange {
  std::vector<int64_t> send_counts;  // floats to each position (the gather)
  std::vector<int64_t> recv_counts;  // floats from each position
  std::vector<Run> send;             // my rows, in send-buffer order
  std::vector<Run> recv;             // rows I receive, in receive-buffer order
  int64_t send_total = 0;
  int64_t recv_total = 0;
};

// This rank's view of one unit on the dense mesh.
struct UnitState {
  int32_t unit = 0;
  const plan::UnitLayout* layout = nullptr;
  std::vector<int32_t> flat;      // per layout tensor: flat parameter index
  std::vector<bool> muon;         // per layout tensor
  std::vector<int32_t> matrices;  // this unit's Muon matrices (plan.dense indices)
  std::vector<float> param;       // my parameter shard: k * S floats
  std::vector<float> grad;        // my reduced optimizer shard: S floats
  std::vector<float> state1;      // Muon momentum / AdamW exp_avg
  std::vector<float> state2;      // AdamW exp_avg_sq
  // Muon, per entry of `matrices`: my rows, where their u / O rows sit in
  // Impl::rows, and the whole matrix when I orthogonalize it (else empty).
  std::vector<LocalRows> mine;
  std::vector<int64_t> rows_offset;
  int64_t rows_total = 0;
  std::vector<std::vector<float>> whole;
  Exchange exchange;
};

int64_t Elements(const plan::ParamSpec& p) { return plan::NumElements(p); }

}  // namespace

struct Trainer::Impl {
  const plan::Plan* plan = nullptr;  // copied below; points into `plan_copy`
  plan::Plan plan_copy;
  Workload* workload = nullptr;
  TrainerOptions options;
  int32_t rank = 0;
  int64_t world = 1;
  int64_t domain_size = 1;  // D
  int64_t k = 1;            // optimizer shards per parameter shard
  int32_t position = 0;

  std::unique_ptr<comm::Communicator> world_comm;
  std::unique_ptr<comm::Communicator> domain_comm;
  std::unique_ptr<comm::Communicator> gather_comm;
  std::unique_ptr<comm::Communicator> group_comm;
  std::vector<std::unique_ptr<comm::Communicator>> reduce_scatter_comms;
  std::vector<std::unique_ptr<comm::Communicator>> all_reduce_comms;

  std::vector<UnitState> units;
  std::vector<int64_t> param_sizes;          // flat spec order
  std::vector<std::vector<float>> params;    // whole tensors (gathered)
  std::vector<std::vector<float>> grads;     // whole tensors (local)
  std::vector<float> full;                   // one unit's padded buffer, D * S
  std::vector<float> scratch;                // reduce-scatter ping-pong
  math::NewtonSchulz ns;

  // Exchange scratch.
  std::vector<float> send;
  std::vector<float> recv;
  std::vector<float> rows;  // u rows, then O rows, of my shard's matrices

  int64_t MyShard(const plan::UnitLayout& l) const {
    return (position - l.rotation + l.num_shards) % l.num_shards;
  }

  // Rows of matrix `m` in my shard, or row_count 0.
  LocalRows Mine(const UnitState& u, const plan::MatrixPlan& m) const {
    const plan::UnitLayout& l = *u.layout;
    const int64_t shard = MyShard(l);
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      if (l.tensors[seg.tensor].param == m.param) {
        return {seg.offset, seg.row_start, seg.row_count};
      }
    }
    return {};
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

  // Gathers unit `u`'s parameters into `full` (position order) and copies
  // every tensor's rows into `params`.
  absl::Status GatherUnit(UnitState& u, StepReport* report) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t s = l.shard_elements;
    const int64_t n = l.num_shards * s;
    full.resize(n);
    if (k == domain_size) {
      std::copy(u.param.begin(), u.param.end(), full.begin());
    } else {
      absl::Status st = Counted(*gather_comm, "param_allgather", report, [&] {
        return gather_comm->AllGather(u.param.data(), k * s, full.data(), options.collective);
      });
      if (!st.ok()) return st;
    }
    for (int64_t q = 0; q < l.num_shards; ++q) {
      const int64_t shard = (q - l.rotation + l.num_shards) % l.num_shards;
      for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
        const plan::Segment& seg = l.segments[i];
        const int64_t len = l.tensors[seg.tensor].row_len;
        std::memcpy(params[u.flat[seg.tensor]].data() + seg.row_start * len,
                    full.data() + q * s + seg.offset, sizeof(float) * seg.row_count * len);
      }
    }
    return absl::OkStatus();
  }

  // Packs unit `u`'s gradients into `full` and reduces them into u.grad.
  absl::Status ReduceUnit(UnitState& u, StepReport* report) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t s = l.shard_elements;
    int64_t m = l.num_shards * s;
    full.assign(m, 0.0f);
    for (int64_t q = 0; q < l.num_shards; ++q) {
      const int64_t shard = (q - l.rotation + l.num_shards) % l.num_shards;
      for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
        const plan::Segment& seg = l.segments[i];
        const int64_t len = l.tensors[seg.tensor].row_len;
        std::memcpy(full.data() + q * s + seg.offset,
                    grads[u.flat[seg.tensor]].data() + seg.row_start * len,
                    sizeof(float) * seg.row_count * len);
      }
    }
    float* cur = full.data();
    scratch.resize(std::max<int64_t>(m, 1));
    for (auto& c : reduce_scatter_comms) {
      const int64_t out = m / c->size();
      absl::Status st = Counted(*c, "grad_reduce_scatter", report, [&] {
        return c->ReduceScatter(cur, scratch.data(), out, comm::ReduceOp::kAvg,
                                options.collective);
      });
      if (!st.ok()) return st;
      std::copy(scratch.begin(), scratch.begin() + out, full.begin());
      cur = full.data();
      m = out;
    }
    for (auto& c : all_reduce_comms) {
      absl::Status st = Counted(*c, "grad_allreduce", report, [&] {
        return c->AllReduce(cur, m, comm::ReduceOp::kAvg, options.collective);
      });
      if (!st.ok()) return st;
    }
    u.grad.assign(cur, cur + s);
    return absl::OkStatus();
  }

  absl::Status AdamW(UnitState& u, int64_t step) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t shard = MyShard(l);
    float* p = u.param.data() + (position % k) * l.shard_elements;
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      if (u.muon[seg.tensor]) continue;
      const int64_t n = seg.row_count * l.tensors[seg.tensor].row_len;
      absl::Status st = math::AdamWStep(
          options.adamw, step + 1, absl::MakeConstSpan(u.grad.data() + seg.offset, n),
          absl::MakeSpan(u.state1.data() + seg.offset, n),
          absl::MakeSpan(u.state2.data() + seg.offset, n), absl::MakeSpan(p + seg.offset, n));
      if (!st.ok()) {
        return absl::Status(st.code(),
                            absl::StrCat("AdamW on ", plan->units[u.unit].name, ": ", st.message()));
      }
    }
    return absl::OkStatus();
  }

  // Fixes the unit's Muon exchange from the plan (once, at creation).
  void PlanMuon(UnitState& u) const;
  absl::Status Muon(UnitState& u, StepReport* report);
};

namespace {

// Copies between an exchange buffer and per-matrix storage, run by run:
// `to_buffer` packs, otherwise unpacks. `at(i, row)` is the matrix side.
template <typename At>
void Walk(const std::vector<Run>& runs, const std::vector<int32_t>& matrices,
          const std::vector<plan::MatrixPlan>& all, float* buffer, bool to_buffer, At at) {
  for (const Run& r : runs) {
    const int64_t n = r.rows * all[matrices[r.matrix]].cols;
    float* other = at(r.matrix, r.row_start);
    if (to_buffer) {
      std::copy(other, other + n, buffer);
    } else {
      std::copy(buffer, buffer + n, other);
    }
    buffer += n;
  }
}

}  // namespace

void Trainer::Impl::PlanMuon(UnitState& u) const {
  const std::vector<plan::MatrixPlan>& all = plan->dense.matrices;
  const bool everyone = plan->config.owner_rule == plan::OwnerRule::kAllGather;
  const size_t n = u.matrices.size();
  u.mine.resize(n);
  u.rows_offset.resize(n);
  u.whole.assign(n, {});
  u.rows_total = 0;
  for (size_t i = 0; i < n; ++i) {
    const plan::MatrixPlan& m = all[u.matrices[i]];
    u.mine[i] = Mine(u, m);
    u.rows_offset[i] = u.rows_total;
    u.rows_total += u.mine[i].row_count * m.cols;
    if (everyone || m.owner == position) u.whole[i].assign(m.rows * m.cols, 0.0f);
  }
  Exchange& ex = u.exchange;
  ex = Exchange{};
  ex.send_counts.assign(domain_size, 0);
  ex.recv_counts.assign(domain_size, 0);
  for (int32_t q = 0; q < domain_size; ++q) {
    for (size_t i = 0; i < n; ++i) {
      const plan::MatrixPlan& m = all[u.matrices[i]];
      if (u.mine[i].row_count > 0 && (everyone || m.owner == q)) {
        ex.send.push_back({static_cast<int32_t>(i), u.mine[i].row_start, u.mine[i].row_count});
        ex.send_counts[q] += u.mine[i].row_count * m.cols;
      }
      if (u.whole[i].empty()) continue;
      for (const plan::Holder& h : m.holders) {
        if (h.position != q) continue;
        ex.recv.push_back({static_cast<int32_t>(i), h.row_start, h.row_count});
        ex.recv_counts[q] += h.row_count * m.cols;
      }
    }
    ex.send_total += ex.send_counts[q];
    ex.recv_total += ex.recv_counts[q];
  }
}

absl::Status Trainer::Impl::Muon(UnitState& u, StepReport* report) {
  if (u.matrices.empty()) return absl::OkStatus();
  const plan::UnitLayout& l = *u.layout;
  const std::vector<plan::MatrixPlan>& all = plan->dense.matrices;
  const bool everyone = plan->config.owner_rule == plan::OwnerRule::kAllGather;
  float* p = u.param.data() + (position % k) * l.shard_elements;
  const Exchange& ex = u.exchange;
  // u / O rows of matrix i starting at matrix row `row` (within my rows).
  auto my_rows = [&](int32_t i, int64_t row) {
    return rows.data() + u.rows_offset[i] + (row - u.mine[i].row_start) * all[u.matrices[i]].cols;
  };
  auto whole_rows = [&](int32_t i, int64_t row) {
    return u.whole[i].data() + row * all[u.matrices[i]].cols;
  };

  // 1. Momentum and the Nesterov input on my rows.
  absl::Time t0 = absl::Now();
  rows.resize(std::max<int64_t>(u.rows_total, 1));
  for (size_t i = 0; i < u.matrices.size(); ++i) {
    const int64_t n = u.mine[i].row_count * all[u.matrices[i]].cols;
    if (n == 0) continue;
    absl::Status st = math::MuonPrepare(
        options.muon, absl::MakeConstSpan(u.grad.data() + u.mine[i].offset, n),
        absl::MakeConstSpan(u.state1.data() + u.mine[i].offset, n),
        absl::MakeSpan(rows.data() + u.rows_offset[i], n));
    if (!st.ok()) return st;
  }
  report->times.muon_prepare += absl::Now() - t0;

  // 2. One exchange: my rows to each matrix's owner (to everyone for the
  // allgather baseline), assembled into whole matrices there.
  t0 = absl::Now();
  send.resize(std::max<int64_t>(ex.send_total, 1));
  recv.resize(std::max<int64_t>(ex.recv_total, 1));
  Walk(ex.send, u.matrices, all, send.data(), /*to_buffer=*/true, my_rows);
  absl::Status st = Counted(*domain_comm, everyone ? "muon_allgather" : "muon_gather", report, [&] {
    return domain_comm->AllToAllV(send.data(), ex.send_counts, recv.data(), ex.recv_counts,
                                  options.collective);
  });
  if (!st.ok()) return st;
  Walk(ex.recv, u.matrices, all, recv.data(), /*to_buffer=*/false, whole_rows);
  report->times.muon_gather += absl::Now() - t0;

  // 3. Newton-Schulz on every whole matrix I hold.
  t0 = absl::Now();
  for (size_t i = 0; i < u.matrices.size(); ++i) {
    if (u.whole[i].empty()) continue;
    const plan::MatrixPlan& m = all[u.matrices[i]];
    st = ns.Run(u.whole[i].data(), m.rows, m.cols, options.muon.ns);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("Newton-Schulz on ",
                                                  plan->units[u.unit].name, ": ", st.message()));
    }
    report->ns_flops += plan::NewtonSchulzFlops(m.rows, m.cols, options.muon.ns.steps);
  }
  report->times.newton_schulz += absl::Now() - t0;

  // 4. Back: the reverse exchange carries O rows to their holders; the
  // allgather baseline takes its rows from its own result.
  t0 = absl::Now();
  if (everyone) {
    for (size_t i = 0; i < u.matrices.size(); ++i) {
      const int64_t n = u.mine[i].row_count * all[u.matrices[i]].cols;
      if (n == 0) continue;
      const float* from = whole_rows(static_cast<int32_t>(i), u.mine[i].row_start);
      std::copy(from, from + n, rows.data() + u.rows_offset[i]);
    }
  } else {
    Walk(ex.recv, u.matrices, all, recv.data(), /*to_buffer=*/true, whole_rows);
    st = Counted(*domain_comm, "muon_scatter", report, [&] {
      return domain_comm->AllToAllV(recv.data(), ex.recv_counts, send.data(), ex.send_counts,
                                    options.collective);
    });
    if (!st.ok()) return st;
    Walk(ex.send, u.matrices, all, send.data(), /*to_buffer=*/false, my_rows);
  }
  report->times.muon_scatter += absl::Now() - t0;

  // 5. Momentum, weight decay and the update on my rows.
  t0 = absl::Now();
  for (size_t i = 0; i < u.matrices.size(); ++i) {
    const plan::MatrixPlan& m = all[u.matrices[i]];
    const int64_t n = u.mine[i].row_count * m.cols;
    if (n == 0) continue;
    st = math::MuonApply(options.muon, m.rows, m.cols,
                         absl::MakeConstSpan(u.grad.data() + u.mine[i].offset, n),
                         absl::MakeConstSpan(rows.data() + u.rows_offset[i], n),
                         absl::MakeSpan(u.state1.data() + u.mine[i].offset, n),
                         absl::MakeSpan(p + u.mine[i].offset, n));
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("Muon update of ", plan->units[u.unit].name,
                                                  ": ", st.message()));
    }
  }
  report->times.muon_apply += absl::Now() - t0;
  return absl::OkStatus();
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const plan::Plan& plan,
                                                         Workload* workload, int32_t rank,
                                                         const TrainerOptions& options) {
  if (options.store == nullptr) return absl::InvalidArgumentError("TrainerOptions.store is null");
  if (plan.has_experts) {
    return absl::UnimplementedError(
        "expert parameters are not supported by the worker runtime yet (dense models only)");
  }
  const plan::ModelSpec& spec = workload->spec();
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
  const int64_t world = plan.config.world_size;
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside [0, ", world, ")"));
  }
  if (options.global_batch_size < 1 || options.global_batch_size % world != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("training.global_batch_size ", options.global_batch_size,
                     " does not split evenly over ", world, " data-parallel ranks"));
  }

  auto impl = std::make_unique<Impl>();
  impl->plan_copy = plan;
  impl->plan = &impl->plan_copy;
  impl->workload = workload;
  impl->options = options;
  impl->rank = rank;
  impl->world = world;
  const plan::MeshGeometry mesh = plan::MeshGeometry::Dense(plan.config);
  impl->domain_size = mesh.domain_size();
  impl->k = mesh.domain_size() / mesh.param_shards();
  impl->position = mesh.PositionOf(rank);

  // Process groups.
  auto join = [&](const GroupSpec& g) {
    return comm::CreateGroup(options.backend, *options.store, g.name, g.rank_in_group, g.size(),
                             options.group_options);
  };
  const MeshGroups groups = GroupsFor(mesh, rank, options.group_prefix);
  absl::StatusOr<std::unique_ptr<comm::Communicator>> c =
      join(WorldGroup(world, rank, options.group_prefix));
  if (!c.ok()) return c.status();
  impl->world_comm = *std::move(c);
  for (auto [spec_ptr, slot] : {std::pair{&groups.domain, &impl->domain_comm},
                                std::pair{&groups.param_gather, &impl->gather_comm},
                                std::pair{&groups.param_group, &impl->group_comm}}) {
    c = join(*spec_ptr);
    if (!c.ok()) return c.status();
    *slot = *std::move(c);
  }
  for (const GroupSpec& g : groups.reduce_scatter) {
    c = join(g);
    if (!c.ok()) return c.status();
    impl->reduce_scatter_comms.push_back(*std::move(c));
  }
  for (const GroupSpec& g : groups.all_reduce) {
    c = join(g);
    if (!c.ok()) return c.status();
    impl->all_reduce_comms.push_back(*std::move(c));
  }

  // Whole tensors and this rank's shards.
  std::vector<int32_t> unit_base;
  for (const plan::UnitSpec& u : spec.units) {
    unit_base.push_back(static_cast<int32_t>(impl->param_sizes.size()));
    for (const plan::ParamSpec& p : u.params) impl->param_sizes.push_back(Elements(p));
  }
  impl->params.resize(impl->param_sizes.size());
  impl->grads.resize(impl->param_sizes.size());
  std::vector<float*> param_ptrs;
  for (size_t i = 0; i < impl->param_sizes.size(); ++i) {
    impl->params[i].assign(impl->param_sizes[i], 0.0f);
    impl->grads[i].assign(impl->param_sizes[i], 0.0f);
    param_ptrs.push_back(impl->params[i].data());
  }
  if (options.initial_parameters != nullptr) {
    const auto& init = *options.initial_parameters;
    if (init.size() != impl->params.size()) {
      return absl::InvalidArgumentError(absl::StrCat("initial parameters: ", init.size(),
                                                     " tensors for a model of ",
                                                     impl->params.size()));
    }
    for (size_t i = 0; i < init.size(); ++i) {
      if (init[i].size() != impl->params[i].size()) {
        return absl::InvalidArgumentError(absl::StrCat("initial parameters: tensor ", i, " has ",
                                                       init[i].size(), " elements, expected ",
                                                       impl->params[i].size()));
      }
      impl->params[i] = init[i];
    }
  } else {
    absl::Status st = workload->Initialize(options.init_seed, absl::MakeSpan(param_ptrs));
    if (!st.ok()) return st;
  }

  std::map<std::pair<int32_t, int32_t>, int32_t> matrix_of;
  for (size_t j = 0; j < plan.dense.matrices.size(); ++j) {
    matrix_of[{plan.dense.matrices[j].unit, plan.dense.matrices[j].param}] =
        static_cast<int32_t>(j);
  }
  for (size_t u = 0; u < plan.units.size(); ++u) {
    if (!plan.units[u].has_dense) continue;
    UnitState st;
    st.unit = static_cast<int32_t>(u);
    st.layout = &impl->plan_copy.units[u].dense;
    for (const plan::LayoutTensor& t : st.layout->tensors) {
      st.flat.push_back(unit_base[u] + t.param);
      // The plan decides (job rules may override the spec's optimizer).
      auto it = matrix_of.find({static_cast<int32_t>(u), t.param});
      st.muon.push_back(it != matrix_of.end());
      if (it != matrix_of.end()) st.matrices.push_back(it->second);
    }
    const int64_t s = st.layout->shard_elements;
    st.param.assign(impl->k * s, 0.0f);
    st.grad.assign(s, 0.0f);
    st.state1.assign(s, 0.0f);
    st.state2.assign(s, 0.0f);
    // My parameter shard: the shards at positions of my parameter group.
    const int64_t first = (impl->position / impl->k) * impl->k;
    const plan::UnitLayout& l = *st.layout;
    for (int64_t j = 0; j < impl->k; ++j) {
      const int64_t shard = (first + j - l.rotation + l.num_shards) % l.num_shards;
      for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
        const plan::Segment& seg = l.segments[i];
        const int64_t len = l.tensors[seg.tensor].row_len;
        std::memcpy(st.param.data() + j * s + seg.offset,
                    impl->params[st.flat[seg.tensor]].data() + seg.row_start * len,
                    sizeof(float) * seg.row_count * len);
      }
    }
    impl->PlanMuon(st);
    impl->units.push_back(std::move(st));
  }
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

absl::StatusOr<StepReport> Trainer::Step() {
  Impl& m = *impl_;
  StepReport report;
  report.step = step_;

  absl::Time t0 = absl::Now();
  for (UnitState& u : m.units) {
    absl::Status st = m.GatherUnit(u, &report);
    if (!st.ok()) return st;
  }
  report.times.param_gather = absl::Now() - t0;

  // My slice of the global batch: samples (s B + j) mod N.
  t0 = absl::Now();
  const int64_t b = m.options.global_batch_size / m.world;
  const int64_t n = m.workload->num_samples();
  std::vector<int64_t> samples(b);
  for (int64_t j = 0; j < b; ++j) {
    samples[j] = (step_ * m.options.global_batch_size + m.rank * b + j) % n;
  }
  std::vector<const float*> p;
  std::vector<float*> g;
  for (size_t i = 0; i < m.params.size(); ++i) {
    p.push_back(m.params[i].data());
    g.push_back(m.grads[i].data());
  }
  absl::StatusOr<double> loss = m.workload->ForwardBackward(step_, p, samples, absl::MakeSpan(g));
  if (!loss.ok()) return loss.status();
  report.times.forward_backward = absl::Now() - t0;

  t0 = absl::Now();
  for (UnitState& u : m.units) {
    absl::Status st = m.ReduceUnit(u, &report);
    if (!st.ok()) return st;
  }
  float global_loss = static_cast<float>(*loss);
  absl::Status st = m.world_comm->AllReduce(&global_loss, 1, comm::ReduceOp::kAvg,
                                            m.options.collective);
  if (!st.ok()) return st;
  report.loss = global_loss;
  report.times.grad_reduce = absl::Now() - t0;

  for (UnitState& u : m.units) {
    t0 = absl::Now();
    st = m.AdamW(u, step_);
    if (!st.ok()) return st;
    report.times.adamw += absl::Now() - t0;
    st = m.Muon(u, &report);
    if (!st.ok()) return st;
  }

  t0 = absl::Now();
  if (m.k > 1) {
    for (UnitState& u : m.units) {
      const int64_t s = u.layout->shard_elements;
      st = m.Counted(*m.group_comm, "param_allgather_after_step", &report, [&] {
        return m.group_comm->AllGather(u.param.data() + (m.position % m.k) * s, s,
                                       u.param.data(), m.options.collective);
      });
      if (!st.ok()) return st;
    }
  }
  report.times.param_allgather_after_step = absl::Now() - t0;
  ++step_;
  return report;
}

absl::StatusOr<std::vector<std::vector<float>>> Trainer::GatherParameters() {
  for (UnitState& u : impl_->units) {
    absl::Status st = impl_->GatherUnit(u, nullptr);
    if (!st.ok()) return st;
  }
  return impl_->params;
}

int64_t Trainer::shard_bytes() const {
  int64_t floats = 0;
  for (const UnitState& u : impl_->units) {
    floats += static_cast<int64_t>(u.param.size() + u.grad.size() + u.state1.size() +
                                   u.state2.size());
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace muonmesh::worker
