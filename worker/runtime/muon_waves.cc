// The Muon phase of a step (docs/architecture.md §5): AdamW on the
// non-Muon shards, then the Muon waves, each gathering its matrices' rows to
// their owners, orthogonalizing there and scattering the updates back, with
// the next wave's gather posted while Newton-Schulz runs.
#include "core/optim/optimizer_options.h"
#include "worker/runtime/trainer_impl.h"

namespace muonmesh::worker {
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
    if (Kept()) {
      rows = std::move(m.muon_kept[0]);
      send = std::move(m.muon_kept[1]);
      recv = std::move(m.muon_kept[2]);
    }
  }
  // One wave (no optimizer.muon_buffer_bytes): its buffers and whole
  // matrices stay from step to step (the memory estimate counts them all
  // along), so that steady steps allocate, and page-fault, nothing. With a
  // budget they are freed after each wave, as the budget asks.
  ~WaveRun() {
    if (Kept()) {
      m.muon_kept[0] = std::move(rows);
      m.muon_kept[1] = std::move(send);
      m.muon_kept[2] = std::move(recv);
      return;
    }
    for (int32_t id : ids) {
      for (DeviceBuffer& b : m.units[id].whole) b.Reset();
    }
  }
  bool Kept() const { return m.waves.size() == 1; }
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
  // Gather's first part: momentum and the Nesterov input on my rows of
  // every matrix of the wave, into `rows`.
  absl::Status PrepareRows();
  // Stage 2: Newton-Schulz on everything I own in the wave, then (after
  // `before_scatter`, which joins the next wave's gather: the exchanges
  // share the domain groups) the scatters, the replica exchange (under the
  // HSDP replica split) and the updates.
  absl::Status Finish(StepReport* report, const std::function<void()>& before_scatter);
  // Under the HSDP replica split, after the scatters: my O rows of my
  // replica's matrices to the rank holding my shards in each other replica,
  // and theirs of the other matrices back, in one exchange over dp_outer
  // (ReplicaExchangeBytes, core/plan/owners.h), counted in `report` as
  // muon_replica_exchange and in `replica_round`.
  absl::Status ExchangeReplicas(const MeshPart& part, StepReport* report, MuonRound* replica_round);
  // Finish's stages: Newton-Schulz on the whole matrices I hold (up to the
  // first error), the scatters back, the updates.
  absl::Status OrthogonalizeHeld(StepReport* report);
  absl::Status Scatter(StepReport* report);
  absl::Status ApplyUpdates();
};

absl::Status Trainer::Impl::WaveRun::PrepareRows() {
  for (int32_t id : ids) {
    UnitState& u = m.units[id];
    for (size_t i = 0; i < u.matrices.size(); ++i) {
      const plan::MatrixPlan& mp = MatricesOf(u)[u.matrices[i]];
      const LocalRows& mine = u.mine[i];
      float* out = rows.data() + u.rows_base + u.rows_offset[i];
      absl::Status st = ForEachRun(mp, mine, [&](int64_t at, int64_t row, int64_t count) {
        return m.dev->MuonPrepare(m.step_muon, u.grad.data() + at, u.state1.data() + at,
                                  out + (row - mine.row_start) * mp.cols, count * mp.cols);
      });
      MUONMESH_RETURN_IF_ERROR(st);
    }
  }
  return absl::OkStatus();
}

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
  MUONMESH_RETURN_IF_ERROR(PrepareRows());
  for (int32_t id : ids) {
    UnitState& u = m.units[id];
    for (size_t i = 0; i < u.matrices.size(); ++i) {
      if (!u.holds[i] || !u.whole[i].empty()) continue;  // kept from the last step
      const plan::MatrixPlan& mp = MatricesOf(u)[u.matrices[i]];
      MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer b, m.dev->AllocateZeroed(mp.rows * mp.cols));
      u.whole[i] = std::move(b);
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
      if (st.ok() && m.health_step) {
        absl::StatusOr<double> err = m.dev->OrthogonalityError(u.whole[i].data(), mp.rows, mp.cols);
        st = err.status();
        if (st.ok()) m.ortho_errors[m.HealthIndex(u, u.matrices[i])] = static_cast<float>(*err);
      }
      round.ns_flops += optim::NsFlopsFor(m.options.muon.ns, mp.rows, mp.cols);
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
      const optim::MuonOptions opt = m.MuonFor(m.unit_base[mp.unit] + mp.param);
      const float* o = rows.data() + u.rows_base + u.rows_offset[i];
      const LocalRows& mine = u.mine[i];
      st = ForEachRun(mp, mine, [&](int64_t at, int64_t row, int64_t count) {
        return m.dev->MuonApply(opt, mp.rows, mp.cols, u.grad.data() + at,
                                o + (row - mine.row_start) * mp.cols, u.state1.data() + at,
                                p + at, count * mp.cols);
      });
      MUONMESH_RETURN_IF_ERROR(st, "Muon update of ", m.plan->units[u.unit].name);
      // Health: what this update moved (lr * scale * O on my rows).
      MUONMESH_ASSIGN_OR_RETURN(const double o_sq, m.dev->SumOfSquares(o, n));
      const double step = opt.lr * optim::MuonUpdateScale(opt.scale, mp.rows, mp.cols);
      const int mesh = u.mesh->kind == plan::MeshKind::kExpert ? 1 : 0;
      m.muon_tally.elements[mesh] += static_cast<double>(n);
      m.muon_tally.matrices[mesh] += u.mine[i].row_start == 0 ? 1.0 : 0.0;
      m.muon_tally.sum_sq[mesh] += step * step * o_sq;
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

int32_t Trainer::Impl::EarlyWave() const {
  // One wave would wait for the whole backward pass.
  if (!options.muon_in_backward || !Overlaps() || !OverlapsReduce() || waves.size() < 2 ||
      last_step_clipped) {
    return -1;
  }
  return static_cast<int32_t>(waves.size()) - 1;
}

absl::Status Trainer::Impl::GatherEarly(int32_t wave) {
  // With micro-batches, the wave's sums become their mean here (the same
  // multiplication ForwardBackward does for the other states after the
  // pass).
  if (grad_mean != 1.0f) {
    for (int32_t id : wave_states[wave]) {
      UnitState& u = units[id];
      MUONMESH_RETURN_IF_ERROR(dev->Scale(u.grad.data(), u.grad.size(), grad_mean));
      grad_scaled[id] = true;
    }
  }
  // The gather reads the momentum (MuonPrepare) and writes only the wave's
  // own buffers: the momentum changes in ApplyUpdates, so dropping the run
  // is all an undo needs.
  early_run = std::make_shared<WaveRun>(*this, wave);
  absl::Status st = early_run->Gather();
  // Its thread times it (muon_gather_hidden, and muon_gather for what the
  // pass waited): not again in the Muon phase.
  early_run->gathered.times.muon_prepare = absl::ZeroDuration();
  early_run->gathered.times.muon_gather = absl::ZeroDuration();
  if (!st.ok()) early_run.reset();
  return st;
}

void Trainer::Impl::UndoEarlyGather(StepReport* report) {
  if (early_run == nullptr) return;
  for (const auto& [name, n] : early_run->gathered.bytes_sent) {
    report->bytes_sent[name + "_redone"] += n;
  }
  early_run.reset();  // its whole matrices and buffers
}

absl::Status Trainer::Impl::Optimize(int64_t step, StepReport* report) {
  // A wave's gather may run on a helper thread while this thread works on
  // the previous wave's Newton-Schulz (or, for the first wave, on AdamW):
  // the device's calls must be safe from two threads, which the CPU's are.
  const bool overlap = Overlaps() && !waves.empty();
  // A wave gathered inside the backward pass goes first, then the others
  // in order (each matrix's update is its own: the order changes no bits).
  std::shared_ptr<WaveRun> next = std::move(early_run);
  std::vector<int32_t> order;
  if (next != nullptr) order.push_back(next->wave);
  for (int32_t w = 0; w < static_cast<int32_t>(waves.size()); ++w) {
    if (order.empty() || w != order[0]) order.push_back(w);
  }
  const bool early = next != nullptr;
  absl::Status next_status;
  std::thread gatherer;
  auto start = [&](int32_t w) {
    next = std::make_shared<WaveRun>(*this, w);
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

  if (overlap && !early) start(order[0]);
  absl::Time t0 = absl::Now();
  absl::Status st;
  for (UnitState& u : units) {
    st = AdamW(u, step);
    if (!st.ok()) break;
  }
  report->times.adamw += absl::Now() - t0;
  if (!overlap && !early && !waves.empty() && st.ok()) start(order[0]);
  join();
  MUONMESH_RETURN_IF_ERROR(st);
  for (size_t i = 0; i < order.size(); ++i) {
    MUONMESH_RETURN_IF_ERROR(next_status);
    std::shared_ptr<WaveRun> run = std::move(next);
    const bool more = i + 1 < order.size();
    if (more && overlap) start(order[i + 1]);
    st = run->Finish(report, join);
    MUONMESH_RETURN_IF_ERROR(st);
    run.reset();  // frees its whole matrices and scratch before the next wave's are used
    if (more && !overlap) start(order[i + 1]);
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker
