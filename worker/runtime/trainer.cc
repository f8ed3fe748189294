#include "worker/runtime/trainer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "plan/mesh.h"
#include "plan/owners.h"
#include "plan/validate.h"
#include "proto/support/status_macros.h"
#include "worker/io/safetensors.h"
#include "worker/math/ns_coefficients.h"
#include "worker/runtime/groups.h"
#include "worker/runtime/muon_schedule.h"

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

int64_t Elements(const plan::ParamSpec& p) { return plan::NumElements(p); }

}  // namespace

// A mesh's Muon matrices by (unit, parameter), as indices into its plan.
using MatrixIndex = std::map<std::pair<int32_t, int32_t>, std::vector<int32_t>>;

struct Trainer::Impl {
  const plan::Plan* plan = nullptr;  // copied below; points into `plan_copy`
  plan::Plan plan_copy;
  Workload* workload = nullptr;
  TrainerOptions options;
  Device* dev = nullptr;  // TrainerOptions::device
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
  DeviceBuffer scalar;  // two floats: the loss and the non-finite flag, all-reduced

  // The Muon phase's waves (muon_schedule.h) and, per wave, the indices
  // into `units` of its units' states, dense before expert for each unit.
  std::vector<MuonWave> waves;
  std::vector<std::vector<int32_t>> wave_states;
  // Per wave: the plan's Newton-Schulz FLOPs for this rank and the busiest.
  std::vector<std::pair<double, double>> planned_ns;


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
  // expert's matrix is a block of rows of its stack), or row_count 0.
  static LocalRows Mine(const UnitState& u, const plan::MatrixPlan& m) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t shard = MyShard(u);
    const int64_t lo = m.expert >= 0 ? m.expert * m.rows : 0;
    const int64_t hi = lo + m.rows;
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      if (l.tensors[seg.tensor].param != m.param) continue;
      const plan::RowRange r = plan::IntersectRows(lo, hi, seg.row_start, seg.row_count);
      if (r.count == 0) continue;
      return {seg.offset + (r.start - seg.row_start) * l.tensors[seg.tensor].row_len,
              r.start - lo, r.count};
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
  // every tensor's rows into `dst` (the unit's whole tensors, spec order).
  absl::Status GatherUnit(UnitState& u, StepReport* report, float* const* dst,
                          const char* name = "param_allgather") {
    const plan::UnitLayout& l = *u.layout;
    MeshState& mesh = *u.mesh;
    const int64_t s = l.shard_elements;
    const int64_t n = l.num_shards * s;
    MUONMESH_RETURN_IF_ERROR(Reserve(full, n));
    if (mesh.k == mesh.domain_size) {
      MUONMESH_RETURN_IF_ERROR(dev->Copy(full.data(), u.param.data(), u.param.size()));
    } else {
      absl::Status st = Counted(*mesh.gather_comm, mesh.bytes_prefix + name, report,
                                [&] {
        return mesh.gather_comm->AllGather(u.param.data(), mesh.k * s, full.data(),
                                           options.collective);
      });
      MUONMESH_RETURN_IF_ERROR(st);
    }
    for (int64_t q = 0; q < l.num_shards; ++q) {
      const int64_t shard = l.ShardAt(q);
      for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
        const plan::Segment& seg = l.segments[i];
        const int64_t len = l.tensors[seg.tensor].row_len;
        absl::Status st = dev->Copy(dst[u.local[seg.tensor]] + seg.row_start * len,
                                    full.data() + q * s + seg.offset, seg.row_count * len);
        MUONMESH_RETURN_IF_ERROR(st);
      }
    }
    return absl::OkStatus();
  }

  // Packs unit `u`'s whole gradients `src` (spec order) into `full` and
  // reduces them into u.grad.
  absl::Status ReduceUnit(UnitState& u, StepReport* report, const float* const* src) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t s = l.shard_elements;
    int64_t m = l.num_shards * s;
    MUONMESH_RETURN_IF_ERROR(Reserve(full, m));
    MUONMESH_RETURN_IF_ERROR(dev->Fill(full.data(), m, 0.0f));
    for (int64_t q = 0; q < l.num_shards; ++q) {
      const int64_t shard = l.ShardAt(q);
      for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
        const plan::Segment& seg = l.segments[i];
        const int64_t len = l.tensors[seg.tensor].row_len;
        absl::Status st = dev->Copy(full.data() + q * s + seg.offset,
                                    src[u.local[seg.tensor]] + seg.row_start * len,
                                    seg.row_count * len);
        MUONMESH_RETURN_IF_ERROR(st);
      }
    }
    // Reduce-scatters in place (each level's output is my chunk of its
    // input), so `full` is the only unit-sized buffer.
    float* cur = full.data();
    MeshState& mesh = *u.mesh;
    for (auto& c : mesh.reduce_scatter_comms) {
      const int64_t out = m / c->size();
      float* const mine = cur + c->rank() * out;
      absl::Status st = Counted(*c, mesh.bytes_prefix + "grad_reduce_scatter", report, [&] {
        return c->ReduceScatter(cur, mine, out, comm::ReduceOp::kAvg, options.collective);
      });
      MUONMESH_RETURN_IF_ERROR(st);
      cur = mine;
      m = out;
    }
    for (auto& c : mesh.all_reduce_comms) {
      absl::Status st = Counted(*c, mesh.bytes_prefix + "grad_allreduce", report, [&] {
        return c->AllReduce(cur, m, comm::ReduceOp::kAvg, options.collective);
      });
      MUONMESH_RETURN_IF_ERROR(st);
    }
    return dev->Copy(u.grad.data(), cur, s);
  }

  absl::Status AdamW(UnitState& u, int64_t step) {
    const plan::UnitLayout& l = *u.layout;
    const int64_t shard = MyShard(u);
    float* p = u.param.data() + (u.mesh->position % u.mesh->k) * l.shard_elements;
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      if (u.muon[seg.tensor]) continue;
      const int64_t n = seg.row_count * l.tensors[seg.tensor].row_len;
      MUONMESH_RETURN_IF_ERROR(dev->AdamWStep(options.adamw, step + 1, u.grad.data() + seg.offset,
                                              u.state1.data() + seg.offset,
                                              u.state2.data() + seg.offset, p + seg.offset, n),
                               "AdamW on ", plan->units[u.unit].name);
    }
    return absl::OkStatus();
  }

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
  struct WaveRun;
  absl::Status Optimize(int64_t step, StepReport* report);
  // Whether a wave's gather runs beside the previous wave's Newton-Schulz:
  // asked for, and the device's calls are safe from two threads (the
  // CPU's are; the same on every rank of a job, which share a device kind).
  bool Overlaps() const {
    return options.muon_overlap && dev->memory_space() == comm::MemorySpace::kHost;
  }
};

namespace {

// Copies between an exchange buffer and per-matrix storage, run by run, on
// `dev`: `to_buffer` packs, otherwise unpacks; advances `*buffer` past the
// runs. `at(i, row)` is the matrix side.
template <typename At>
absl::Status Walk(Device& dev, const Run* first, const Run* last,
                  const std::vector<int32_t>& matrices, const std::vector<plan::MatrixPlan>& all,
                  float** buffer, bool to_buffer, At at) {
  for (const Run* r = first; r != last; ++r) {
    const int64_t n = r->rows * all[matrices[r->matrix]].cols;
    float* other = at(r->matrix, r->row_start);
    absl::Status st = to_buffer ? dev.Copy(*buffer, other, n) : dev.Copy(other, *buffer, n);
    MUONMESH_RETURN_IF_ERROR(st);
    *buffer += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Trainer::Impl::JoinReplicas() {
  const int64_t replicas = plan->dense.replicas;
  if (replicas <= 1) return absl::OkStatus();
  // The outer axis replicates the optimizer state, so its group is the
  // first all-reduce group (groups.h: one per replicated axis, in axis
  // order), ordered by dp_outer coordinate.
  const int32_t replica = plan::MeshGeometry::Dense(plan->config).Coords(rank)[0];
  if (dense.all_reduce_comms.empty() || dense.all_reduce_comms[0]->size() != replicas ||
      dense.all_reduce_comms[0]->rank() != replica) {
    return absl::InternalError(
        absl::StrCat("the plan splits the Muon work over ", replicas, " replicas, but rank ", rank,
                     " has no dp_outer group of that size at place ", replica));
  }
  dense.replica = replica;
  dense.replica_comm = dense.all_reduce_comms[0].get();
  return absl::OkStatus();
}

void Trainer::Impl::PlanMuon(UnitState& u) const {
  const std::vector<plan::MatrixPlan>& all = u.mesh->domain->matrices;
  const bool everyone = plan->config.owner_rule == plan::OwnerRule::kAllGather;
  // Under the replica split my domain orthogonalizes only my replica's
  // matrices (the others' results arrive over dp_outer).
  const int32_t replica = u.mesh->replica;
  auto ours = [replica](const plan::MatrixPlan& m) {
    return m.replica < 0 || m.replica == replica;
  };
  const int64_t domain_size = u.mesh->domain_size;
  const int32_t position = u.mesh->position;
  const size_t n = u.matrices.size();
  u.mine.resize(n);
  u.rows_offset.resize(n);
  u.holds.assign(n, false);
  u.whole.clear();
  u.whole.resize(n);
  u.rows_total = 0;
  for (size_t i = 0; i < n; ++i) {
    const plan::MatrixPlan& m = all[u.matrices[i]];
    u.mine[i] = Mine(u, m);
    u.rows_offset[i] = u.rows_total;
    u.rows_total += u.mine[i].row_count * m.cols;
    u.holds[i] = everyone || (m.owner == position && ours(m));
  }
  Exchange& ex = u.exchange;
  ex = Exchange{};
  ex.send_counts.assign(domain_size, 0);
  ex.recv_counts.assign(domain_size, 0);
  for (int32_t q = 0; q < domain_size; ++q) {
    ex.send_first.push_back(ex.send.size());
    ex.recv_first.push_back(ex.recv.size());
    for (size_t i = 0; i < n; ++i) {
      const plan::MatrixPlan& m = all[u.matrices[i]];
      if (u.mine[i].row_count > 0 && (everyone || (m.owner == q && ours(m)))) {
        ex.send.push_back({static_cast<int32_t>(i), u.mine[i].row_start, u.mine[i].row_count});
        ex.send_counts[q] += u.mine[i].row_count * m.cols;
      }
      if (!u.holds[i]) continue;
      for (const plan::Holder& h : m.holders) {
        if (h.position != q) continue;
        ex.recv.push_back({static_cast<int32_t>(i), h.row_start, h.row_count});
        ex.recv_counts[q] += h.row_count * m.cols;
      }
    }
    ex.send_total += ex.send_counts[q];
    ex.recv_total += ex.recv_counts[q];
  }
  ex.send_first.push_back(ex.send.size());
  ex.recv_first.push_back(ex.recv.size());
}

// One wave of the Muon phase in flight: its units, its own scratch, what it
// has done so far. Owns the whole matrices of its units until destroyed.
struct Trainer::Impl::WaveRun {
  Impl& m;
  int32_t wave = 0;
  std::vector<int32_t> ids;
  MuonRound round;
  // The wave's units on each mesh, in wave order, and their part of the send
  // and receive buffers (the dense mesh's first).
  struct MeshPart {
    MeshState* mesh = nullptr;
    std::vector<int32_t> ids;
    std::vector<int64_t> send_counts, recv_counts;
    int64_t send_base = 0, recv_base = 0, send_total = 0, recv_total = 0;
  };
  std::vector<MeshPart> parts;
  DeviceBuffer rows;  // u rows, then O rows, of my shard's matrices in the wave
  DeviceBuffer send;
  DeviceBuffer recv;
  // What the gather stage adds to the step's report; merged by Finish (the
  // gather may run on another thread than the step's).
  StepReport gathered;

  WaveRun(Impl& impl, int32_t w) : m(impl), wave(w), ids(impl.wave_states[w]) {
    round.wave = w;
    round.first_unit = impl.waves[w].first_unit;
    round.end_unit = impl.waves[w].end_unit;
    round.planned_ns_flops = impl.planned_ns[w].first;
    round.planned_critical_ns_flops = impl.planned_ns[w].second;
  }
  ~WaveRun() {
    for (int32_t id : ids) {
      for (DeviceBuffer& b : m.units[id].whole) b.Reset();
    }
  }
  WaveRun(const WaveRun&) = delete;
  WaveRun& operator=(const WaveRun&) = delete;

  static const std::vector<plan::MatrixPlan>& MatricesOf(const UnitState& u) {
    return u.mesh->domain->matrices;
  }
  // Matrix i's u / O rows from matrix row `row` (within my rows).
  auto MyRows(const UnitState& u) {
    return [this, &u](int32_t i, int64_t row) {
      return rows.data() + u.rows_base + u.rows_offset[i] +
             (row - u.mine[i].row_start) * MatricesOf(u)[u.matrices[i]].cols;
    };
  }
  static auto WholeRows(UnitState& u) {
    return [&u](int32_t i, int64_t row) {
      return u.whole[i].data() + row * MatricesOf(u)[u.matrices[i]].cols;
    };
  }

  // Packs (or unpacks) one mesh's buffer: for each position, every unit's
  // runs for it in wave order. `send_side`: my rows; otherwise whole rows.
  absl::Status Walk(const MeshPart& part, float* buffer, bool send_side, bool to_buffer) {
    for (int64_t q = 0; q < part.mesh->domain_size; ++q) {
      for (int32_t id : part.ids) {
        UnitState& u = m.units[id];
        const Exchange& ex = u.exchange;
        const std::vector<Run>& runs = send_side ? ex.send : ex.recv;
        const std::vector<size_t>& first = send_side ? ex.send_first : ex.recv_first;
        absl::Status st =
            send_side ? worker::Walk(*m.dev, runs.data() + first[q], runs.data() + first[q + 1],
                                     u.matrices, MatricesOf(u), &buffer, to_buffer, MyRows(u))
                      : worker::Walk(*m.dev, runs.data() + first[q], runs.data() + first[q + 1],
                                     u.matrices, MatricesOf(u), &buffer, to_buffer, WholeRows(u));
        MUONMESH_RETURN_IF_ERROR(st);
      }
    }
    return absl::OkStatus();
  }

  // One exchange on the part's domain, counted in `report` and the round.
  absl::Status AllToAll(const MeshPart& part, const std::string& name, const float* from,
                        const std::vector<int64_t>& from_counts, float* to,
                        const std::vector<int64_t>& to_counts, int64_t to_total,
                        StepReport* report) {
    comm::Communicator& c = *part.mesh->domain_comm;
    const int64_t before = c.stats().total_bytes_sent();
    const absl::Time start = absl::Now();
    absl::Status st = m.Counted(c, part.mesh->bytes_prefix + name, report, [&] {
      return c.AllToAllV(from, from_counts, to, to_counts, m.options.collective);
    });
    round.wait += absl::Now() - start;
    round.sent_bytes += c.stats().total_bytes_sent() - before;
    round.recv_bytes += to_total * static_cast<int64_t>(sizeof(float));
    ++report->muon_exchange_calls;
    return st;
  }

  // Stage 1: momentum and the Nesterov input on my rows, the whole matrices
  // I orthogonalize, and the gathers (one exchange per mesh) that fill them.
  absl::Status Gather();
  // Stage 2: Newton-Schulz on everything I own in the wave, then (after
  // `before_scatter`, which joins the next wave's gather: the exchanges
  // share the domain groups) the scatters, the replica exchange (under the
  // HSDP replica split) and the updates.
  absl::Status Finish(StepReport* report, const std::function<void()>& before_scatter);
  // Under the HSDP replica split, after the scatters: my O rows of my
  // replica's matrices to the rank holding my shards in each other replica,
  // and theirs of the other matrices back, in one exchange over dp_outer
  // (ReplicaExchangeBytes, server/plan/owners.h), counted in `report` as
  // muon_replica_exchange and in `replica_round`.
  absl::Status ExchangeReplicas(const MeshPart& part, StepReport* report, MuonRound* replica_round);
  // Finish's stages: Newton-Schulz on the whole matrices I hold (up to the
  // first error), the scatters back, the updates.
  absl::Status OrthogonalizeHeld(StepReport* report);
  absl::Status Scatter(StepReport* report);
  absl::Status ApplyUpdates();
};

absl::Status Trainer::Impl::WaveRun::Gather() {
  const bool everyone = m.plan->config.owner_rule == plan::OwnerRule::kAllGather;
  StepReport* report = &gathered;
  absl::Time t0 = absl::Now();
  int64_t rows_needed = 0;
  for (int32_t id : ids) {
    m.units[id].rows_base = rows_needed;
    rows_needed += m.units[id].rows_total;
  }
  MUONMESH_RETURN_IF_ERROR(m.Reserve(rows, rows_needed));
  for (int32_t id : ids) {
    UnitState& u = m.units[id];
    for (size_t i = 0; i < u.matrices.size(); ++i) {
      const int64_t n = u.mine[i].row_count * MatricesOf(u)[u.matrices[i]].cols;
      if (n == 0) continue;
      absl::Status st = m.dev->MuonPrepare(m.options.muon, u.grad.data() + u.mine[i].offset,
                                           u.state1.data() + u.mine[i].offset,
                                           rows.data() + u.rows_base + u.rows_offset[i], n);
      MUONMESH_RETURN_IF_ERROR(st);
    }
  }
  for (int32_t id : ids) {
    UnitState& u = m.units[id];
    for (size_t i = 0; i < u.matrices.size(); ++i) {
      if (!u.holds[i]) continue;
      const plan::MatrixPlan& mp = MatricesOf(u)[u.matrices[i]];
      absl::StatusOr<DeviceBuffer> b = m.dev->AllocateZeroed(mp.rows * mp.cols);
      MUONMESH_RETURN_IF_ERROR(b.status());
      u.whole[i] = *std::move(b);
    }
  }
  report->times.muon_prepare += absl::Now() - t0;

  int64_t send_needed = 0, recv_needed = 0;
  for (MeshState* mesh : {&m.dense, &m.expert}) {
    MeshPart part;
    part.mesh = mesh;
    for (int32_t id : ids) {
      if (m.units[id].mesh == mesh && !m.units[id].matrices.empty()) part.ids.push_back(id);
    }
    if (part.ids.empty()) continue;
    part.send_counts.assign(mesh->domain_size, 0);
    part.recv_counts.assign(mesh->domain_size, 0);
    for (int32_t id : part.ids) {
      const Exchange& ex = m.units[id].exchange;
      for (int64_t q = 0; q < mesh->domain_size; ++q) {
        part.send_counts[q] += ex.send_counts[q];
        part.recv_counts[q] += ex.recv_counts[q];
      }
      part.send_total += ex.send_total;
      part.recv_total += ex.recv_total;
    }
    part.send_base = send_needed;
    part.recv_base = recv_needed;
    send_needed += part.send_total;
    recv_needed += part.recv_total;
    round.domain += absl::StrCat(round.domain.empty() ? "" : "+",
                                 mesh->kind == plan::MeshKind::kDense ? "dense" : "expert");
    parts.push_back(std::move(part));
  }
  MUONMESH_RETURN_IF_ERROR(m.Reserve(send, send_needed));
  MUONMESH_RETURN_IF_ERROR(m.Reserve(recv, recv_needed));

  // My rows to each matrix's owner (to everyone for the allgather
  // baseline), one exchange per mesh, assembled into whole matrices there.
  t0 = absl::Now();
  for (const MeshPart& part : parts) {
    float* out = send.data() + part.send_base;
    float* in = recv.data() + part.recv_base;
    absl::Status st = Walk(part, out, /*send_side=*/true, /*to_buffer=*/true);
    if (st.ok()) {
      st = AllToAll(part, everyone ? "muon_allgather" : "muon_gather", out, part.send_counts, in,
                    part.recv_counts, part.recv_total, report);
    }
    if (st.ok()) st = Walk(part, in, /*send_side=*/false, /*to_buffer=*/false);
    MUONMESH_RETURN_IF_ERROR(st);
  }
  report->times.muon_gather += absl::Now() - t0;
  return absl::OkStatus();
}

absl::Status Trainer::Impl::WaveRun::Finish(StepReport* report,
                                            const std::function<void()>& before_scatter) {
  // What the gather stage counted.
  report->times.muon_prepare += gathered.times.muon_prepare;
  report->times.muon_gather += gathered.times.muon_gather;
  report->muon_exchange_calls += gathered.muon_exchange_calls;
  for (const auto& [name, bytes] : gathered.bytes_sent) report->bytes_sent[name] += bytes;

  const absl::Status orthogonalized = OrthogonalizeHeld(report);
  before_scatter();
  MUONMESH_RETURN_IF_ERROR(orthogonalized);

  absl::Time t0 = absl::Now();
  MUONMESH_RETURN_IF_ERROR(Scatter(report));
  std::optional<MuonRound> replica_round;
  for (const MeshPart& part : parts) {
    if (part.mesh->replica_comm == nullptr) continue;
    replica_round.emplace();
    MUONMESH_RETURN_IF_ERROR(ExchangeReplicas(part, report, &*replica_round));
  }
  report->times.muon_scatter += absl::Now() - t0;

  t0 = absl::Now();
  MUONMESH_RETURN_IF_ERROR(ApplyUpdates());
  report->times.muon_apply += absl::Now() - t0;
  report->muon_rounds.push_back(std::move(round));
  if (replica_round.has_value()) report->muon_rounds.push_back(*std::move(replica_round));
  return absl::OkStatus();
}

absl::Status Trainer::Impl::WaveRun::OrthogonalizeHeld(StepReport* report) {
  // Newton-Schulz on every whole matrix I hold, on both meshes.
  const absl::Time t0 = absl::Now();
  absl::Status st;
  for (size_t k = 0; k < ids.size() && st.ok(); ++k) {
    UnitState& u = m.units[ids[k]];
    for (size_t i = 0; i < u.matrices.size() && st.ok(); ++i) {
      if (!u.holds[i]) continue;
      const plan::MatrixPlan& mp = MatricesOf(u)[u.matrices[i]];
      st = m.dev->NewtonSchulz(u.whole[i].data(), mp.rows, mp.cols, m.options.muon.ns);
      if (!st.ok()) {
        st = AnnotateStatus(st, absl::StrCat("Newton-Schulz on ", m.plan->units[u.unit].name));
      }
      round.ns_flops += math::NsFlopsFor(m.options.muon.ns, mp.rows, mp.cols);
    }
  }
  report->ns_flops += round.ns_flops;
  report->times.newton_schulz += absl::Now() - t0;
  return st;
}

absl::Status Trainer::Impl::WaveRun::Scatter(StepReport* report) {
  const bool everyone = m.plan->config.owner_rule == plan::OwnerRule::kAllGather;
  absl::Status st;
  // Back: the reverse exchange carries O rows to their holders; the
  // allgather baseline takes its rows from its own result.
  for (const MeshPart& part : parts) {
    if (everyone) {
      for (int32_t id : part.ids) {
        UnitState& u = m.units[id];
        for (size_t i = 0; i < u.matrices.size(); ++i) {
          const int64_t n = u.mine[i].row_count * MatricesOf(u)[u.matrices[i]].cols;
          if (n == 0) continue;
          const int32_t j = static_cast<int32_t>(i);
          st = m.dev->Copy(MyRows(u)(j, u.mine[i].row_start),
                           WholeRows(u)(j, u.mine[i].row_start), n);
          MUONMESH_RETURN_IF_ERROR(st);
        }
      }
      continue;
    }
    float* out = send.data() + part.send_base;
    float* in = recv.data() + part.recv_base;
    st = Walk(part, in, /*send_side=*/false, /*to_buffer=*/true);
    if (st.ok()) {
      st = AllToAll(part, "muon_scatter", in, part.recv_counts, out, part.send_counts,
                    part.send_total, report);
    }
    if (st.ok()) st = Walk(part, out, /*send_side=*/true, /*to_buffer=*/false);
    MUONMESH_RETURN_IF_ERROR(st);
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::WaveRun::ApplyUpdates() {
  absl::Status st;
  // Momentum, weight decay and the update on my rows.
  for (int32_t id : ids) {
    UnitState& u = m.units[id];
    const plan::UnitLayout& l = *u.layout;
    float* p = u.param.data() + (u.mesh->position % u.mesh->k) * l.shard_elements;
    for (size_t i = 0; i < u.matrices.size(); ++i) {
      const plan::MatrixPlan& mp = MatricesOf(u)[u.matrices[i]];
      const int64_t n = u.mine[i].row_count * mp.cols;
      if (n == 0) continue;
      st = m.dev->MuonApply(m.options.muon, mp.rows, mp.cols, u.grad.data() + u.mine[i].offset,
                            rows.data() + u.rows_base + u.rows_offset[i],
                            u.state1.data() + u.mine[i].offset, p + u.mine[i].offset, n);
      MUONMESH_RETURN_IF_ERROR(st, "Muon update of ", m.plan->units[u.unit].name);
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::WaveRun::ExchangeReplicas(const MeshPart& part, StepReport* report,
                                                      MuonRound* replica_round) {
  comm::Communicator& c = *part.mesh->replica_comm;
  const int32_t me = part.mesh->replica;
  const int replicas = c.size();
  // My rows of every matrix of the wave on this mesh, by the replica that
  // orthogonalized it, in wave and matrix order (the same on every replica:
  // the ranks of the group hold the same rows).
  struct Rows {
    float* at;
    int64_t n;
  };
  std::vector<std::vector<Rows>> by_replica(replicas);
  std::vector<int64_t> totals(replicas, 0);
  for (int32_t id : part.ids) {
    UnitState& u = m.units[id];
    for (size_t i = 0; i < u.matrices.size(); ++i) {
      const plan::MatrixPlan& mp = MatricesOf(u)[u.matrices[i]];
      const int64_t n = u.mine[i].row_count * mp.cols;
      if (n == 0) continue;
      if (mp.replica < 0 || mp.replica >= replicas) {
        return absl::InternalError(absl::StrCat("matrix of ", m.plan->units[u.unit].name,
                                                " has no replica under the replica split"));
      }
      by_replica[mp.replica].push_back({rows.data() + u.rows_base + u.rows_offset[i], n});
      totals[mp.replica] += n;
    }
  }
  std::vector<int64_t> send_counts(replicas, 0), recv_counts(replicas, 0);
  int64_t recv_total = 0;
  for (int q = 0; q < replicas; ++q) {
    if (q == me) continue;
    send_counts[q] = totals[me];
    recv_counts[q] = totals[q];
    recv_total += totals[q];
  }
  MUONMESH_RETURN_IF_ERROR(m.Reserve(send, totals[me] * (replicas - 1)));
  MUONMESH_RETURN_IF_ERROR(m.Reserve(recv, recv_total));
  // The same rows to every other replica.
  float* out = send.data();
  for (int q = 0; q < replicas; ++q) {
    if (q == me) continue;
    for (const Rows& r : by_replica[me]) {
      MUONMESH_RETURN_IF_ERROR(m.dev->Copy(out, r.at, r.n));
      out += r.n;
    }
  }
  replica_round->wave = wave;
  replica_round->first_unit = round.first_unit;
  replica_round->end_unit = round.end_unit;
  replica_round->domain = "dp_outer";
  const int64_t before = c.stats().total_bytes_sent();
  const absl::Time start = absl::Now();
  absl::Status st = m.Counted(c, part.mesh->bytes_prefix + "muon_replica_exchange", report, [&] {
    return c.AllToAllV(send.data(), send_counts, recv.data(), recv_counts, m.options.collective);
  });
  replica_round->wait += absl::Now() - start;
  replica_round->sent_bytes += c.stats().total_bytes_sent() - before;
  replica_round->recv_bytes += recv_total * static_cast<int64_t>(sizeof(float));
  ++report->muon_exchange_calls;
  MUONMESH_RETURN_IF_ERROR(st, "the replica exchange over dp_outer");
  const float* in = recv.data();
  for (int q = 0; q < replicas; ++q) {
    if (q == me) continue;
    for (const Rows& r : by_replica[q]) {
      MUONMESH_RETURN_IF_ERROR(m.dev->Copy(r.at, in, r.n));
      in += r.n;
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::Optimize(int64_t step, StepReport* report) {
  // A wave's gather may run on a helper thread while this thread works on
  // the previous wave's Newton-Schulz (or, for the first wave, on AdamW):
  // the device's calls must be safe from two threads, which the CPU's are.
  const bool overlap = Overlaps() && !waves.empty();
  std::unique_ptr<WaveRun> next;
  absl::Status next_status;
  std::thread gatherer;
  auto start = [&](int32_t w) {
    next = std::make_unique<WaveRun>(*this, w);
    if (overlap) {
      gatherer = std::thread([&, run = next.get()] { next_status = run->Gather(); });
    } else {
      next_status = next->Gather();
    }
  };
  auto join = [&] {
    if (gatherer.joinable()) gatherer.join();
  };
  // Joins the helper thread on every path out of here.
  struct Joiner {
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{gatherer};

  if (overlap) start(0);
  absl::Time t0 = absl::Now();
  absl::Status st;
  for (UnitState& u : units) {
    st = AdamW(u, step);
    if (!st.ok()) break;
  }
  report->times.adamw += absl::Now() - t0;
  if (!overlap && !waves.empty() && st.ok()) start(0);
  join();
  MUONMESH_RETURN_IF_ERROR(st);
  for (int32_t w = 0; w < static_cast<int32_t>(waves.size()); ++w) {
    MUONMESH_RETURN_IF_ERROR(next_status);
    std::unique_ptr<WaveRun> run = std::move(next);
    const bool more = w + 1 < static_cast<int32_t>(waves.size());
    if (more && overlap) start(w + 1);
    st = run->Finish(report, join);
    MUONMESH_RETURN_IF_ERROR(st);
    run.reset();  // frees its whole matrices and scratch before the next wave's are used
    if (more && !overlap) start(w + 1);
  }
  return absl::OkStatus();
}

// The runtime's side of Workload::ForwardBackwardByUnit over this rank's
// shards: Acquire gathers one unit into whole tensors allocated for it (freed
// on Release), Commit packs and reduces one unit's whole gradients (freed
// right after). So a step holds only what the workload has acquired and the
// gradient buffers it has not committed yet, never the whole model.
class Trainer::UnitStream final : public UnitAccess {
 public:
  UnitStream(Impl& m, StepReport* report)
      : m_(m), report_(report), slots_(m.states_of.size()) {}

  absl::StatusOr<absl::Span<const float* const>> Acquire(int unit) override {
    MUONMESH_RETURN_IF_ERROR(CheckUnit(unit, "Acquire"));
    Slot& slot = slots_[unit];
    if (slot.acquired) {
      return absl::FailedPreconditionError(
          absl::StrCat("Acquire(", unit, "): the unit is already acquired"));
    }
    const absl::Time t0 = absl::Now();
    MUONMESH_RETURN_IF_ERROR(Allocate(unit, slot.params, slot.param_ptrs));
    slot.const_ptrs.assign(slot.param_ptrs.begin(), slot.param_ptrs.end());
    if (m_.states_of[unit].empty()) {
      for (int32_t j = 0; j < m_.unit_count[unit]; ++j) {
        absl::Status st = m_.dev->CopyFromHost(slot.param_ptrs[j], m_.frozen[unit][j].data(),
                                               m_.frozen[unit][j].size());
        if (!st.ok()) {
          Free(slot.params, slot.param_ptrs);
          slot.const_ptrs.clear();
          return st;
        }
      }
    }
    // The first gather of a step is the forward pass's; later ones re-gather
    // for the backward pass (counted apart, as the plan counts them).
    const char* name = slot.gathers++ == 0 ? "param_allgather" : "param_allgather_backward";
    for (int32_t state : m_.states_of[unit]) {
      absl::Status st = m_.GatherUnit(m_.units[state], report_, slot.param_ptrs.data(), name);
      if (!st.ok()) {
        Free(slot.params, slot.param_ptrs);
        slot.const_ptrs.clear();
        return st;
      }
    }
    slot.acquired = true;
    report_->times.param_gather += absl::Now() - t0;
    return absl::MakeConstSpan(slot.const_ptrs);
  }

  void Release(int unit) override {
    if (unit < 0 || unit >= static_cast<int>(slots_.size())) return;
    Slot& slot = slots_[unit];
    Free(slot.params, slot.param_ptrs);
    slot.const_ptrs.clear();
    slot.const_ptrs.shrink_to_fit();
    slot.acquired = false;
  }

  absl::StatusOr<absl::Span<float* const>> GradientBuffers(int unit) override {
    MUONMESH_RETURN_IF_ERROR(CheckUnit(unit, "GradientBuffers"));
    Slot& slot = slots_[unit];
    if (slot.committed) {
      return absl::FailedPreconditionError(
          absl::StrCat("GradientBuffers(", unit, "): the unit is already committed"));
    }
    if (slot.grads.empty()) {
      MUONMESH_RETURN_IF_ERROR(Allocate(unit, slot.grads, slot.grad_ptrs));
    }
    return absl::MakeConstSpan(slot.grad_ptrs);
  }

  absl::Status Commit(int unit) override {
    MUONMESH_RETURN_IF_ERROR(CheckUnit(unit, "Commit"));
    Slot& slot = slots_[unit];
    if (slot.committed) {
      return absl::FailedPreconditionError(
          absl::StrCat("Commit(", unit, "): the unit is already committed"));
    }
    if (slot.grads.empty() && m_.unit_count[unit] > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("Commit(", unit, "): no gradient buffers were taken"));
    }
    const absl::Time t0 = absl::Now();
    std::vector<const float*> src(slot.grad_ptrs.begin(), slot.grad_ptrs.end());
    for (int32_t state : m_.states_of[unit]) {
      absl::Status st = m_.ReduceUnit(m_.units[state], report_, src.data());
      MUONMESH_RETURN_IF_ERROR(st);
    }
    Free(slot.grads, slot.grad_ptrs);
    slot.committed = true;
    report_->times.grad_reduce += absl::Now() - t0;
    return absl::OkStatus();
  }

  int expert_parallel_size() const override { return static_cast<int>(m_.ep); }
  int expert_parallel_index() const override { return m_.ep_index; }

  absl::Status ExchangeTokens(const float* send, absl::Span<const int64_t> send_counts,
                              float* recv, absl::Span<const int64_t> recv_counts) override {
    if (m_.ep_comm == nullptr) {
      if (send_counts.size() != 1 || recv_counts.size() != 1 ||
          send_counts[0] != recv_counts[0] || send_counts[0] < 0) {
        return absl::InvalidArgumentError(
            "ExchangeTokens: with one expert-parallel group the counts must be one equal "
            "entry each");
      }
      return m_.dev->Copy(recv, send, send_counts[0]);
    }
    const absl::Time t0 = absl::Now();
    absl::Status st = m_.Counted(*m_.ep_comm, "expert_dispatch", report_, [&] {
      return m_.ep_comm->AllToAllV(send, send_counts, recv, recv_counts, m_.options.collective);
    });
    report_->times.expert_dispatch += absl::Now() - t0;
    return st;
  }

  // Frees whatever the workload left acquired or uncommitted.
  void ReleaseAll() {
    for (size_t u = 0; u < slots_.size(); ++u) {
      Release(static_cast<int>(u));
      Free(slots_[u].grads, slots_[u].grad_ptrs);
    }
  }

  // Every trained unit must have been committed (else its gradient shard
  // would be stale).
  absl::Status CheckAllCommitted() const {
    for (size_t u = 0; u < slots_.size(); ++u) {
      if (!m_.states_of[u].empty() && !slots_[u].committed) {
        return absl::InternalError(absl::StrCat(
            "the workload returned without committing the gradients of unit ", u));
      }
    }
    return absl::OkStatus();
  }

 private:
  struct Slot {
    // Uninitialised storage: the gather / the workload overwrites it all.
    std::vector<DeviceBuffer> params;
    std::vector<float*> param_ptrs;
    std::vector<const float*> const_ptrs;
    std::vector<DeviceBuffer> grads;
    std::vector<float*> grad_ptrs;
    bool acquired = false;
    bool committed = false;
    int gathers = 0;  // this step
  };

  absl::Status CheckUnit(int unit, const char* what) const {
    if (unit < 0 || unit >= static_cast<int>(slots_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "(", unit, "): not a unit in [0, ", slots_.size(), ")"));
    }
    return absl::OkStatus();
  }

  absl::Status Allocate(int unit, std::vector<DeviceBuffer>& bufs,
                        std::vector<float*>& ptrs) const {
    bufs.clear();
    ptrs.clear();
    for (int32_t j = 0; j < m_.unit_count[unit]; ++j) {
      absl::StatusOr<DeviceBuffer> b = m_.dev->Allocate(m_.local_sizes[m_.unit_base[unit] + j]);
      if (!b.ok()) {
        Free(bufs, ptrs);
        return b.status();
      }
      bufs.push_back(*std::move(b));
      ptrs.push_back(bufs.back().data());
    }
    return absl::OkStatus();
  }

  static void Free(std::vector<DeviceBuffer>& bufs, std::vector<float*>& ptrs) {
    std::vector<DeviceBuffer>().swap(bufs);
    std::vector<float*>().swap(ptrs);
  }

  Impl& m_;
  StepReport* report_;
  std::vector<Slot> slots_;
};

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

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
    absl::StatusOr<CommPtr> c = join(*spec);
    MUONMESH_RETURN_IF_ERROR(c.status());
    *slot = *std::move(c);
  }
  for (const GroupSpec& g : groups.reduce_scatter) {
    absl::StatusOr<CommPtr> c = join(g);
    MUONMESH_RETURN_IF_ERROR(c.status());
    mesh->reduce_scatter_comms.push_back(*std::move(c));
  }
  for (const GroupSpec& g : groups.all_reduce) {
    absl::StatusOr<CommPtr> c = join(g);
    MUONMESH_RETURN_IF_ERROR(c.status());
    mesh->all_reduce_comms.push_back(*std::move(c));
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

namespace {

// What Trainer::Create checks before it builds anything.
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

// Each mesh's Muon matrices by (unit, parameter): an expert stack has one
// per local expert, in expert order.
MatrixIndex IndexMatrices(const plan::DomainPlan& d) {
  MatrixIndex of;
  for (size_t j = 0; j < d.matrices.size(); ++j) {
    of[{d.matrices[j].unit, d.matrices[j].param}].push_back(static_cast<int32_t>(j));
  }
  return of;
}

}  // namespace

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
  absl::StatusOr<DeviceBuffer> two = dev->Allocate(2);
  MUONMESH_RETURN_IF_ERROR(two.status());
  scalar = *std::move(two);
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
    absl::StatusOr<DeviceBuffer> b = dev->AllocateZeroed(count);
    MUONMESH_RETURN_IF_ERROR(b.status());
    *buffer = *std::move(b);
  }
  // My parameter shard: the shards at positions of my parameter group.
  const int64_t first = (mesh->position / mesh->k) * mesh->k;
  const plan::UnitLayout& l = *st.layout;
  for (int64_t j = 0; j < mesh->k; ++j) {
    const int64_t shard = l.ShardAt(first + j);
    for (int64_t i = l.shard_begin[shard]; i < l.shard_begin[shard + 1]; ++i) {
      const plan::Segment& seg = l.segments[i];
      const int64_t len = l.tensors[seg.tensor].row_len;
      MUONMESH_RETURN_IF_ERROR(dev->CopyFromHost(
          st.param.data() + j * s + seg.offset,
          whole[st.local[seg.tensor]].data() + st.whole_offset[seg.tensor] + seg.row_start * len,
          seg.row_count * len));
    }
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

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const plan::Plan& plan,
                                                         Workload* workload, int32_t rank,
                                                         const TrainerOptions& options) {
  MUONMESH_RETURN_IF_ERROR(CheckCreateArguments(plan, *workload, rank, options));
  auto impl = std::make_unique<Impl>();
  impl->plan_copy = plan;
  impl->plan = &impl->plan_copy;
  impl->workload = workload;
  impl->options = options;
  // The Newton-Schulz form the planner charged the owners for runs.
  impl->options.muon.ns.algorithm = plan.config.ns_algorithm;
  impl->options.muon.ns.threads = plan.config.threads_per_rank;
  impl->rank = rank;
  impl->world = plan.config.world_size;
  impl->ep = std::max<int64_t>(1, plan.config.ep);
  impl->ep_index = static_cast<int32_t>(rank % impl->ep);
  impl->dense.domain = &impl->plan_copy.dense;
  impl->expert.domain = &impl->plan_copy.expert;
  impl->dev = options.device;
  MUONMESH_RETURN_IF_ERROR(impl->JoinGroups());
  MUONMESH_RETURN_IF_ERROR(impl->IndexParameters());

  impl->states_of.assign(plan.units.size(), {});
  impl->frozen.resize(plan.units.size());
  const MatrixIndex dense_matrices = IndexMatrices(impl->plan_copy.dense);
  const MatrixIndex expert_matrices = IndexMatrices(impl->plan_copy.expert);
  for (size_t u = 0; u < plan.units.size(); ++u) {
    std::vector<std::vector<float>> whole;
    MUONMESH_RETURN_IF_ERROR(impl->InitialUnit(u, whole));
    if (!plan.units[u].has_dense && !plan.units[u].has_expert) {
      impl->frozen[u] = std::move(whole);
      continue;
    }
    if (plan.units[u].has_dense) {
      MUONMESH_RETURN_IF_ERROR(impl->AddUnitState(u, &impl->dense, dense_matrices, whole));
    }
    if (plan.units[u].has_expert) {
      MUONMESH_RETURN_IF_ERROR(impl->AddUnitState(u, &impl->expert, expert_matrices, whole));
    }
  }
  impl->PlanWaves();
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

absl::StatusOr<StepReport> Trainer::Step() {
  Impl& m = *impl_;
  StepReport report;
  report.step = step_;

  // My slice of the global batch: samples (s B + j) mod N.
  absl::Time t0 = absl::Now();
  const int64_t b = m.options.global_batch_size / m.world;
  const int64_t n = m.workload->num_samples();
  std::vector<int64_t> samples(b);
  for (int64_t j = 0; j < b; ++j) {
    samples[j] = (step_ * m.options.global_batch_size + m.rank * b + j) % n;
  }
  // Forward and backward, unit by unit: the gathers, the reductions and the
  // token exchanges run inside (timed into param_gather, grad_reduce and
  // expert_dispatch, which are then taken out of forward_backward).
  UnitStream stream(m, &report);
  absl::StatusOr<double> loss = m.workload->ForwardBackwardByUnit(step_, stream, samples);
  stream.ReleaseAll();
  MUONMESH_RETURN_IF_ERROR(loss.status());
  MUONMESH_RETURN_IF_ERROR(stream.CheckAllCommitted());
  report.times.forward_backward = (absl::Now() - t0) - report.times.param_gather -
                                  report.times.grad_reduce - report.times.expert_dispatch;

  t0 = absl::Now();
  // The loss, and whether any rank holds a non-finite gradient, in one
  // all-reduce: then every rank refuses the step together, before any
  // update, instead of one rank refusing while the others wait for it.
  float pair[2] = {static_cast<float>(*loss), 0.0f};
  for (const UnitState& u : m.units) {
    absl::StatusOr<bool> finite = m.dev->AllFinite(u.grad.data(), u.grad.size());
    MUONMESH_RETURN_IF_ERROR(finite.status());
    if (!*finite) pair[1] = 1.0f;
  }
  absl::Status st = m.dev->CopyFromHost(m.scalar.data(), pair, 2);
  if (st.ok()) {
    st = m.world_comm->AllReduce(m.scalar.data(), 2, comm::ReduceOp::kAvg, m.options.collective);
  }
  if (st.ok()) st = m.dev->CopyToHost(pair, m.scalar.data(), 2);
  MUONMESH_RETURN_IF_ERROR(st);
  if (pair[1] != 0.0f) {
    // FailedPrecondition, not InvalidArgument (kept for bad configuration):
    // the training state cannot take this step until someone changes it
    // (a lower learning rate, an earlier checkpoint).
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step_, " refused: a reduced gradient is NaN or infinite (on ",
        pair[1] * static_cast<float>(m.world), " of ", m.world,
        " ranks); weights and optimizer state are unchanged"));
  }
  report.loss = pair[0];
  report.times.grad_reduce += absl::Now() - t0;

  st = m.Optimize(step_, &report);
  MUONMESH_RETURN_IF_ERROR(st);

  t0 = absl::Now();
  for (UnitState& u : m.units) {
    MeshState& mesh = *u.mesh;
    if (mesh.k == 1) continue;
    const int64_t s = u.layout->shard_elements;
    st = m.Counted(*mesh.group_comm, mesh.bytes_prefix + "param_allgather_after_step", &report,
                   [&] {
      return mesh.group_comm->AllGather(u.param.data() + (mesh.position % mesh.k) * s, s,
                                        u.param.data(), m.options.collective);
    });
    MUONMESH_RETURN_IF_ERROR(st);
  }
  report.times.param_allgather_after_step = absl::Now() - t0;
  ++step_;
  return report;
}

absl::StatusOr<std::vector<std::vector<float>>> Trainer::GatherParameters() {
  std::vector<std::vector<float>> all(impl_->param_sizes.size());
  absl::Status st = GatherParameters([&](int flat, std::vector<float>&& tensor) {
    all[flat] = std::move(tensor);
    return absl::OkStatus();
  });
  MUONMESH_RETURN_IF_ERROR(st);
  return all;
}

absl::Status Trainer::GatherParameters(const ParameterSink& sink) {
  Impl& m = *impl_;
  Device& dev = *m.dev;
  for (size_t u = 0; u < m.states_of.size(); ++u) {
    // This unit's tensors only (indexed by flat index; the others stay empty).
    std::vector<std::vector<float>> out(m.param_sizes.size());
    auto hand_over = [&]() -> absl::Status {
      for (int32_t j = 0; j < m.unit_count[u]; ++j) {
        const int flat = m.unit_base[u] + j;
        absl::Status st = sink(flat, std::move(out[flat]));
        MUONMESH_RETURN_IF_ERROR(st);
      }
      return absl::OkStatus();
    };
    if (m.states_of[u].empty()) {
      for (int32_t j = 0; j < m.unit_count[u]; ++j) out[m.unit_base[u] + j] = m.frozen[u][j];
      MUONMESH_RETURN_IF_ERROR(hand_over());
      continue;
    }
    // My part of each tensor (the whole of a dense one, my EP group's
    // experts of a stack), then the stacks from every EP group. On the host
    // the parts are gathered straight into the output (no second copy of
    // the unit); on a GPU into device buffers first.
    const bool host = dev.memory_space() == comm::MemorySpace::kHost;
    std::vector<DeviceBuffer> mine;
    std::vector<float*> ptrs;
    std::vector<bool> in_place;
    for (int32_t j = 0; j < m.unit_count[u]; ++j) {
      const size_t flat = static_cast<size_t>(m.unit_base[u] + j);
      in_place.push_back(host && !(m.is_expert[flat] && m.ep_comm != nullptr));
      if (in_place.back()) {
        out[flat].assign(m.param_sizes[flat], 0.0f);
        mine.emplace_back();
        ptrs.push_back(out[flat].data());
        continue;
      }
      absl::StatusOr<DeviceBuffer> b = dev.Allocate(m.local_sizes[flat]);
      MUONMESH_RETURN_IF_ERROR(b.status());
      mine.push_back(*std::move(b));
      ptrs.push_back(mine.back().data());
    }
    for (int32_t state : m.states_of[u]) {
      absl::Status st = m.GatherUnit(m.units[state], nullptr, ptrs.data());
      MUONMESH_RETURN_IF_ERROR(st);
    }
    for (int32_t j = 0; j < m.unit_count[u]; ++j) {
      const size_t flat = static_cast<size_t>(m.unit_base[u] + j);
      if (in_place[j]) continue;
      out[flat].assign(m.param_sizes[flat], 0.0f);
      const float* from = mine[j].data();
      DeviceBuffer stack;
      if (m.is_expert[flat] && m.ep_comm != nullptr) {
        absl::StatusOr<DeviceBuffer> b = dev.Allocate(m.param_sizes[flat]);
        MUONMESH_RETURN_IF_ERROR(b.status());
        stack = *std::move(b);
        absl::Status st = m.ep_comm->AllGather(mine[j].data(), m.local_sizes[flat], stack.data(),
                                               m.options.collective);
        MUONMESH_RETURN_IF_ERROR(st);
        from = stack.data();
      }
      absl::Status st = dev.CopyToHost(out[flat].data(), from, m.param_sizes[flat]);
      MUONMESH_RETURN_IF_ERROR(st);
    }
    MUONMESH_RETURN_IF_ERROR(hand_over());
  }
  return absl::OkStatus();
}

absl::Status Trainer::Barrier() { return impl_->world_comm->Barrier(impl_->options.collective); }

std::string Trainer::LayoutFingerprint() const {
  // FNV-1a (64 bit) over every number that decides what a shard holds.
  uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xFF;
      h *= 0x100000001b3ULL;
    }
  };
  const plan::ResolvedConfig& c = impl_->plan->config;
  for (int64_t v : {c.world_size, c.instances, c.ep, static_cast<int64_t>(c.inner),
                    static_cast<int64_t>(c.outer)}) {
    mix(v);
  }
  for (const UnitState& u : impl_->units) {
    const plan::UnitLayout& l = *u.layout;
    for (int64_t v : {static_cast<int64_t>(u.unit), static_cast<int64_t>(u.mesh->kind),
                      l.num_shards, l.shard_elements, l.rotation}) {
      mix(v);
    }
    for (const plan::LayoutTensor& t : l.tensors) {
      mix(t.param);
      mix(t.rows);
      mix(t.row_len);
    }
    for (const plan::Segment& seg : l.segments) {
      mix(seg.tensor);
      mix(seg.row_start);
      mix(seg.row_count);
      mix(seg.offset);
    }
  }
  return absl::StrFormat("%016x", h);
}

namespace {
constexpr char kShardsFormat[] = "muonmesh.shards.v1";

std::string ShardTensorName(const UnitState& u, const char* what) {
  return absl::StrCat("units.", u.unit, ".",
                      u.mesh->kind == plan::MeshKind::kExpert ? "expert" : "dense", ".", what);
}
}  // namespace

absl::Status Trainer::SaveShards(const std::string& path) const {
  std::vector<io::TensorView> views;
  // Host copies of device shards (host shards are written as they are).
  std::vector<std::vector<float>> host;
  const bool on_host = impl_->dev->memory_space() == comm::MemorySpace::kHost;
  for (const UnitState& u : impl_->units) {
    for (const auto& [what, v] : {std::pair{"param", &u.param}, std::pair{"state1", &u.state1},
                                  std::pair{"state2", &u.state2}}) {
      const float* data = v->data();
      if (!on_host) {
        host.emplace_back(static_cast<size_t>(v->size()));
        absl::Status st = impl_->dev->CopyToHost(host.back().data(), v->data(), v->size());
        MUONMESH_RETURN_IF_ERROR(st);
        data = host.back().data();
      }
      views.push_back({ShardTensorName(u, what), {v->size()}, data});
    }
  }
  const std::map<std::string, std::string> metadata = {
      {"format", kShardsFormat},
      {"rank", absl::StrCat(impl_->rank)},
      {"world_size", absl::StrCat(impl_->world)},
      {"step", absl::StrCat(step_)},
      {"layout", LayoutFingerprint()}};
  return io::WriteSafetensors(path, views, metadata);
}

absl::Status Trainer::LoadShards(const std::string& path) {
  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::vector<io::Tensor>> tensors = io::ReadSafetensors(path, &metadata);
  MUONMESH_RETURN_IF_ERROR(tensors.status());
  auto expect = [&](const std::string& key, const std::string& want) -> absl::Status {
    auto it = metadata.find(key);
    if (it == metadata.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not a muonmesh shard file (no metadata '", key, "')"));
    }
    if (it->second != want) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " is '", it->second,
                                                     "', this run needs '", want, "'"));
    }
    return absl::OkStatus();
  };
  for (const auto& [key, want] :
       {std::pair<std::string, std::string>{"format", kShardsFormat},
        {"world_size", absl::StrCat(impl_->world)},
        {"rank", absl::StrCat(impl_->rank)},
        {"layout", LayoutFingerprint()}}) {
    MUONMESH_RETURN_IF_ERROR(expect(key, want));
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(metadata["step"], &step) || step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata step '", metadata["step"], "' is not a step count"));
  }
  std::map<std::string, io::Tensor*> by_name;
  for (io::Tensor& t : *tensors) by_name[t.name] = &t;
  // Check everything before changing anything.
  std::vector<std::pair<io::Tensor*, DeviceBuffer*>> copies;
  for (UnitState& u : impl_->units) {
    for (const auto& [what, v] : {std::pair{"param", &u.param}, std::pair{"state1", &u.state1},
                                  std::pair{"state2", &u.state2}}) {
      const std::string name = ShardTensorName(u, what);
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": no tensor '", name, "'"));
      }
      if (static_cast<int64_t>(it->second->data.size()) != v->size()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "' has ",
                                                       it->second->data.size(),
                                                       " elements, the shard has ", v->size()));
      }
      copies.push_back({it->second, v});
    }
  }
  if (copies.size() != tensors->size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", tensors->size(),
                                                   " tensors, this rank holds ", copies.size()));
  }
  for (auto& [from, to] : copies) {
    absl::Status st = impl_->dev->CopyFromHost(to->data(), from->data.data(), to->size());
    MUONMESH_RETURN_IF_ERROR(st);
  }
  step_ = step;
  return absl::OkStatus();
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
