#include "worker/runtime/trainer.h"

#include <cmath>
#include <thread>

#include "absl/strings/cord.h"
#include "core/model/sample_order.h"
#include "worker/comm/reduce.h"
#include "worker/runtime/unit_stream.h"

namespace muonmesh::worker {


Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

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
  // The groups work on the device's buffers: a host backend (Gloo) with a
  // CUDA device copies them through host memory (several ranks on one GPU).
  impl->options.group_options.buffers = options.device->memory_space();
  impl->rank = rank;
  impl->world = plan.config.world_size;
  impl->ep = std::max<int64_t>(1, plan.config.ep);
  impl->ep_index = static_cast<int32_t>(rank % impl->ep);
  impl->dense.domain = &impl->plan_copy.dense;
  impl->expert.domain = &impl->plan_copy.expert;
  impl->dev = options.device;
  impl->unit_buffers.SetDevice(options.device);
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
  impl->PlanBuckets();
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

absl::StatusOr<double> Trainer::Impl::ForwardBackward(int64_t step,
                                                      const std::vector<int64_t>& samples,
                                                      StepReport* report) {
  const int64_t b = static_cast<int64_t>(samples.size());
  // Unit by unit, one micro-batch after another: the
  // gathers, the reductions and the token exchanges run inside (timed into
  // param_gather, grad_reduce and expert_dispatch, which are then taken out
  // of forward_backward). Every micro-batch's gradients are reduced into the
  // shards and added up; their mean is the local batch's.
  const int64_t micro = options.micro_batch_size > 0 ? options.micro_batch_size : b;
  const int64_t micro_batches = b / micro;
  double loss_sum = 0;
  accumulating = false;
  grad_mean = 1.0f;
  grad_scaled.assign(units.size(), false);
  for (int64_t k = 0; k < micro_batches; ++k) {
    const std::vector<int64_t> slice(samples.begin() + k * micro,
                                     samples.begin() + (k + 1) * micro);
    // The last micro-batch completes the gradients: the Muon phase may
    // begin inside its backward pass.
    const bool last = k + 1 == micro_batches;
    if (last && micro_batches > 1) grad_mean = 1.0f / static_cast<float>(micro_batches);
    UnitStream stream(*this, report, last ? EarlyWave() : -1);
    absl::StatusOr<double> loss = workload->ForwardBackwardByUnit(step, stream, slice);
    const absl::Status reduced = stream.Finish();
    stream.ReleaseAll();
    MUONMESH_RETURN_IF_ERROR(loss.status());
    MUONMESH_RETURN_IF_ERROR(reduced);
    MUONMESH_RETURN_IF_ERROR(stream.CheckAllCommitted());
    loss_sum += *loss;
    accumulating = true;
  }
  accumulating = false;
  if (micro_batches > 1) {
    for (size_t i = 0; i < units.size(); ++i) {
      if (grad_scaled[i]) continue;  // by GatherEarly
      MUONMESH_RETURN_IF_ERROR(dev->Scale(units[i].grad.data(), units[i].grad.size(), grad_mean));
    }
  }
  return loss_sum / static_cast<double>(micro_batches);
}

absl::StatusOr<StepReport> Trainer::Step() {
  Impl& m = *impl_;
  StepReport report;
  report.step = step_;
  const int64_t calls_before = m.CollectiveCalls();

  // My slice of the global batch: global samples k = s B + r b + j, each
  // reading sample k mod N, or its shuffled place (core/model/sample_order.h).
  absl::Time t0 = absl::Now();
  const int64_t b = m.options.global_batch_size / m.world;
  const int64_t n = m.workload->num_samples();
  const std::optional<uint64_t>& shuffle = m.options.shuffle_seed;
  std::vector<int64_t> samples(b);
  for (int64_t j = 0; j < b; ++j) {
    const int64_t k = step_ * m.options.global_batch_size + m.rank * b + j;
    samples[j] = model::SampleOf(k, n, shuffle.has_value(), shuffle.value_or(0));
  }
  m.workload->ResetAttentionLogits();
  m.workload->ResetBufferStats();
  // Before the backward pass, which may start the Muon phase.
  m.SetStepRates(step_, &report);
  // A Muon gather started inside the backward pass that the step does not
  // go on to use (refused, or failed on the way) is dropped.
  struct UndoEarly {
    Impl& m;
    StepReport& report;
    ~UndoEarly() { m.UndoEarlyGather(&report); }
  } undo_early{m, report};
  MUONMESH_ASSIGN_OR_RETURN(const double local_loss, m.ForwardBackward(step_, samples, &report));
  // The last step's after-step gathers, all of them (the pass waited for
  // those of the units it acquired) before the optimizer writes the shards.
  MUONMESH_RETURN_IF_ERROR(m.DrainGatherAfterStep(&report));
  // (muon_gather so far: what the pass waited for an early Muon gather;
  // param_allgather_after_step: for the last step's after-step gathers.)
  report.times.forward_backward = (absl::Now() - t0) - report.times.param_gather -
                                  report.times.grad_reduce - report.times.expert_dispatch -
                                  report.times.muon_gather -
                                  report.times.param_allgather_after_step;

  t0 = absl::Now();
  // The loss, whether any rank holds a non-finite gradient, and the squared
  // gradient norm, in one all-reduce: then every rank refuses the step
  // together, before any update, instead of one rank refusing while the
  // others wait for it; and every rank clips by the same factor.
  MUONMESH_ASSIGN_OR_RETURN(const StepTotals totals, m.ReduceStepTotals(local_loss));
  if (totals.nonfinite_ranks > 0) {
    // FailedPrecondition, not InvalidArgument (kept for bad configuration):
    // the training state cannot take this step until someone changes it
    // (a lower learning rate, an earlier checkpoint).
    absl::Status refused = absl::FailedPreconditionError(
        absl::StrCat("step ", step_, " refused: a reduced gradient is NaN or infinite (on ",
                     totals.nonfinite_ranks, " of ", m.world,
                     " ranks); weights and optimizer state are unchanged"));
    refused.SetPayload(kRefusedStepPayload, absl::Cord("1"));
    return refused;
  }
  report.loss = totals.loss;
  report.grad_norm = totals.grad_norm;
  MUONMESH_ASSIGN_OR_RETURN(const bool clipped, m.ClipGradients(totals.grad_norm));
  report.times.grad_reduce += absl::Now() - t0;
  // The early gather carried the unclipped gradient: gathered again.
  if (clipped) m.UndoEarlyGather(&report);
  m.last_step_clipped = clipped;
  report.muon_in_backward = m.early_run != nullptr;

  // AdamW's bias correction counts the steps of its own state.
  absl::Status st = m.Optimize(step_ - adamw_origin_, &report);
  MUONMESH_RETURN_IF_ERROR(st);

  t0 = absl::Now();
  MUONMESH_RETURN_IF_ERROR(m.FinishStep(&report));
  report.times.param_allgather_after_step += absl::Now() - t0;
  report.collective_calls = m.CollectiveCalls() - calls_before;
  ++step_;
  return report;
}

void Trainer::Impl::SetStepRates(int64_t step, StepReport* report) {
  report->lr_scale = optim::LrMultiplier(options.lr_schedule, step, options.total_steps);
  step_muon = options.muon;
  step_muon.lr *= report->lr_scale;
  step_muon.momentum = optim::MomentumAt(options.muon.momentum, options.momentum_warmup, step);
  step_adamw = options.adamw;
  step_adamw.lr *= report->lr_scale;
  muon_tally = {};
  health_step = options.health_every > 0 && step % options.health_every == 0;
  if (health_step) ortho_errors.assign(MuonMatrixCount(), -1.0f);
}

absl::StatusOr<StepTotals> Trainer::Impl::ReduceStepTotals(double local_loss) {
  // Ranks holding the same optimizer shard: the dense mesh's domains, and
  // the expert mesh's domains of one EP group.
  const double dense_copies = static_cast<double>(world / dense.domain_size);
  const double expert_copies =
      plan->has_experts ? static_cast<double>(world / (ep * expert.domain_size)) : 1.0;
  double sum_sq = 0;
  float flag = 0.0f;
  for (const UnitState& u : units) {
    MUONMESH_ASSIGN_OR_RETURN(bool finite, dev->AllFinite(u.grad.data(), u.grad.size()));
    if (!finite) flag = 1.0f;
    MUONMESH_ASSIGN_OR_RETURN(double sq, dev->SumOfSquares(u.grad.data(), u.grad.size()));
    sum_sq += sq / (u.mesh->kind == plan::MeshKind::kExpert ? expert_copies : dense_copies);
  }
  // Averaged over the ranks: the sum comes back as its mean times the world.
  const float w = static_cast<float>(world);
  float three[3] = {static_cast<float>(local_loss), flag, static_cast<float>(sum_sq) * w};
  if (!std::isfinite(three[2])) three[2] = 0.0f;  // refused by the flag anyway
  MUONMESH_RETURN_IF_ERROR(dev->CopyFromHost(scalar.data(), three, 3));
  MUONMESH_RETURN_IF_ERROR(
      world_comm->AllReduce(scalar.data(), 3, comm::ReduceOp::kAvg, options.collective));
  MUONMESH_RETURN_IF_ERROR(dev->CopyToHost(three, scalar.data(), 3));
  StepTotals totals;
  totals.loss = three[0];
  totals.nonfinite_ranks = std::llround(three[1] * w);
  totals.grad_norm = std::sqrt(std::max(0.0, static_cast<double>(three[2])));
  return totals;
}

absl::StatusOr<bool> Trainer::Impl::ClipGradients(double grad_norm) {
  if (options.clip_grad_norm <= 0) return false;
  const double factor = options.clip_grad_norm / (grad_norm + 1e-6);
  if (factor >= 1.0) return false;
  for (UnitState& u : units) {
    MUONMESH_RETURN_IF_ERROR(dev->Scale(u.grad.data(), u.grad.size(), static_cast<float>(factor)));
  }
  return true;
}

absl::Status Trainer::Impl::FinishStep(StepReport* report) {
  if (DefersGatherAfterStep()) {
    StartGatherAfterStep(report);
    return ReduceStepRecords(report);
  }
  if (options.qk_clip > 0 || !options.overlap_records ||
      dev->memory_space() != comm::MemorySpace::kHost) {
    // QK-clip rescales my shards before the gather hands them round.
    MUONMESH_RETURN_IF_ERROR(ReduceStepRecords(report));
    return GatherAfterStep(report);
  }
  absl::Status records;
  std::thread recorder([this, report, &records] { records = ReduceStepRecords(report); });
  const absl::Status gathered = GatherAfterStep(report);
  recorder.join();
  MUONMESH_RETURN_IF_ERROR(records);
  return gathered;
}

absl::Status Trainer::Impl::ReduceStepRecords(StepReport* report) {
  const int64_t layers = workload->attention_layers();
  const int64_t heads = workload->attention_heads();
  const absl::Span<const float> logits = workload->attention_logits();
  const bool attention = layers > 0 && heads > 0;
  if (attention && static_cast<int64_t>(logits.size()) != layers * heads) {
    return absl::InternalError(absl::StrCat("the workload records ", logits.size(),
                                            " attention logits for ", layers, " layers of ",
                                            heads, " heads"));
  }
  const absl::Span<const float> stats = workload->buffer_stats();
  const std::optional<double> aux = workload->aux_loss();
  const bool muon = MuonPlanned(report);
  // My slice: [logits][buffer statistics, balance loss][Muon tally][errors].
  std::vector<float> mine(logits.begin(), attention ? logits.end() : logits.begin());
  const size_t stats_at = mine.size();
  mine.insert(mine.end(), stats.begin(), stats.end());
  if (aux.has_value()) mine.push_back(static_cast<float>(*aux));
  const size_t tally_at = mine.size();
  if (muon) AppendMuonTally(mine);
  const size_t errors_at = mine.size();
  if (muon && health_step) mine.insert(mine.end(), ortho_errors.begin(), ortho_errors.end());
  if (mine.empty()) return absl::OkStatus();

  const auto n = static_cast<int64_t>(mine.size());
  std::vector<float> all(static_cast<size_t>(n * world));
  MUONMESH_ASSIGN_OR_RETURN(float* buf, Scratch(records_buf, n * (world + 1)));
  MUONMESH_RETURN_IF_ERROR(dev->CopyFromHost(buf, mine.data(), n));
  MUONMESH_RETURN_IF_ERROR(world_comm->AllGather(buf, n, buf + n, options.collective));
  MUONMESH_RETURN_IF_ERROR(dev->CopyToHost(all.data(), buf + n, n * world));
  // Columns [at, end) over the ranks, in rank order, as the host backends
  // reduce: the same bits an all-reduce of them gave.
  auto over_ranks = [&](size_t at, size_t end, comm::ReduceOp op) {
    std::vector<const float*> parts;
    for (int64_t r = 0; r < world; ++r) parts.push_back(all.data() + r * n + at);
    std::vector<float> out(end - at);
    comm::internal::ReduceInRankOrder(parts, static_cast<int64_t>(out.size()), op, out.data());
    return out;
  };
  if (stats_at < tally_at) {
    MUONMESH_RETURN_IF_ERROR(
        UpdateBufferStats(over_ranks(stats_at, tally_at, comm::ReduceOp::kSum), aux.has_value(),
                          report));
  }
  if (muon) {
    if (health_step) ortho_errors = over_ranks(errors_at, mine.size(), comm::ReduceOp::kMax);
    MuonHealthFrom(all, n, tally_at, report);
  }
  if (!attention) return absl::OkStatus();
  return ApplyAttentionLogits(over_ranks(0, stats_at, comm::ReduceOp::kMax), report);
}

absl::Status Trainer::Impl::UpdateBufferStats(std::vector<float> global, bool aux,
                                              StepReport* report) {
  // Counts below 2^24 sum exactly in float, in any order: every rank gets
  // the same totals and so updates its buffers alike. The balance term
  // rides along (its mean over the ranks: equal slices of the batch).
  if (aux) {
    report->aux_loss = global.back() / static_cast<double>(world);
    global.pop_back();
  }
  MUONMESH_RETURN_IF_ERROR(workload->UpdateBuffers(global));
  report->expert_load = workload->expert_load();
  return absl::OkStatus();
}

absl::Status Trainer::Impl::ApplyAttentionLogits(const std::vector<float>& global,
                                                 StepReport* report) {
  const int64_t layers = workload->attention_layers();
  const int64_t heads = workload->attention_heads();
  report->max_attn_logit.clear();
  for (int64_t l = 0; l < layers; ++l) {
    report->max_attn_logit.push_back(
        *std::max_element(global.begin() + l * heads, global.begin() + (l + 1) * heads));
  }
  if (options.qk_clip <= 0) return absl::OkStatus();
  const std::vector<RowScale> rows = workload->QkClipRows(global, options.qk_clip);
  if (rows.empty()) return absl::OkStatus();
  // Every copy of a row is scaled where it sits in u.param (all k shards
  // of my group: the gather after the step then hands round values that
  // are already the same on every rank).
  std::vector<int64_t> first_dim;  // flat spec order
  for (const plan::UnitSpec& unit : workload->spec().units) {
    for (const plan::ParamSpec& p : unit.params) {
      first_dim.push_back(p.shape.empty() ? 1 : std::max<int64_t>(1, p.shape[0]));
    }
  }
  for (UnitState& u : units) {
    for (const ShardRun& run : ParamRuns(u)) {
      const int64_t row_len = param_sizes[run.flat] / first_dim[run.flat];
      for (const RowScale& r : rows) {
        if (r.flat != run.flat) continue;
        const int64_t lo = std::max(run.whole_start, r.row_start * row_len);
        const int64_t hi = std::min(run.whole_start + run.count, (r.row_start + r.rows) * row_len);
        if (lo >= hi) continue;
        float* at = u.param.data() + run.offset + (lo - run.whole_start);
        MUONMESH_RETURN_IF_ERROR(dev->Scale(at, hi - lo, r.factor));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<float*> Trainer::Impl::Scratch(DeviceBuffer& buf, int64_t count) {
  if (buf.size() < count) {
    MUONMESH_ASSIGN_OR_RETURN(buf, dev->Allocate(count));
  }
  return buf.data();
}

size_t Trainer::Impl::MuonMatrixCount() const {
  const size_t dense_count = dense.domain == nullptr ? 0 : dense.domain->matrices.size();
  const size_t expert_count =
      plan->has_experts && expert.domain != nullptr ? expert.domain->matrices.size() : 0;
  return dense_count + static_cast<size_t>(ep) * expert_count;
}

size_t Trainer::Impl::HealthIndex(const UnitState& u, int32_t matrix) const {
  if (u.mesh->kind != plan::MeshKind::kExpert) return static_cast<size_t>(matrix);
  const size_t dense_count = dense.domain == nullptr ? 0 : dense.domain->matrices.size();
  return dense_count + static_cast<size_t>(ep_index) * expert.domain->matrices.size() +
         static_cast<size_t>(matrix);
}

bool Trainer::Impl::MuonPlanned(StepReport* report) const {
  MuonHealth& h = report->muon;
  h.planned_matrices = static_cast<int64_t>(MuonMatrixCount());
  auto planned_elements = [](const MeshState& mesh) {
    int64_t n = 0;
    if (mesh.domain == nullptr) return n;
    for (const plan::MatrixPlan& mp : mesh.domain->matrices) n += mp.rows * mp.cols;
    return n;
  };
  h.planned_elements = planned_elements(dense) + (plan->has_experts ? ep * planned_elements(expert)
                                                                    : int64_t{0});
  return h.planned_matrices > 0;
}

// Per mesh: elements as two exact halves (n = hi 2^22 + lo), matrices, the
// update's sum of squares.
constexpr double kHalf = 4194304.0;  // 2^22

void Trainer::Impl::AppendMuonTally(std::vector<float>& out) const {
  for (int mesh = 0; mesh < 2; ++mesh) {
    const double hi = std::floor(muon_tally.elements[mesh] / kHalf);
    out.push_back(static_cast<float>(hi));
    out.push_back(static_cast<float>(muon_tally.elements[mesh] - hi * kHalf));
    out.push_back(static_cast<float>(muon_tally.matrices[mesh]));
    out.push_back(static_cast<float>(muon_tally.sum_sq[mesh]));
  }
}

void Trainer::Impl::MuonHealthFrom(const std::vector<float>& all, int64_t stride, size_t tally_at,
                                   StepReport* report) const {
  // Summed over the ranks in double, then over the copies of each optimizer
  // shard (as the gradient norm).
  MuonHealth& h = report->muon;
  const double copies[2] = {
      static_cast<double>(world / dense.domain_size),
      plan->has_experts ? static_cast<double>(world / (ep * expert.domain_size)) : 1.0};
  double elements = 0, matrices = 0, sum_sq = 0;
  for (int mesh = 0; mesh < 2; ++mesh) {
    double e = 0, mats = 0, sq = 0;
    for (int64_t r = 0; r < world; ++r) {
      const float* f = all.data() + r * stride + tally_at + 4 * mesh;
      e += static_cast<double>(f[0]) * kHalf + f[1];
      mats += f[2];
      sq += f[3];
    }
    elements += e / copies[mesh];
    matrices += mats / copies[mesh];
    sum_sq += sq / copies[mesh];
  }
  h.elements = std::llround(elements);
  h.matrices = std::llround(matrices);
  h.update_rms = elements > 0 ? std::sqrt(sum_sq / elements) : 0.0;
  if (!health_step) return;
  std::vector<float> measured;
  for (float e : ortho_errors) {
    if (e >= 0) measured.push_back(e);
  }
  if (measured.empty()) return;
  std::sort(measured.begin(), measured.end());
  h.ortho_error_max = measured.back();
  const size_t mid = measured.size() / 2;
  h.ortho_error_median = measured.size() % 2 == 1
                             ? static_cast<double>(measured[mid])
                             : 0.5 * (static_cast<double>(measured[mid - 1]) + measured[mid]);
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
  StepReport scratch;
  MUONMESH_RETURN_IF_ERROR(m.DrainGatherAfterStep(&scratch));
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
      MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer b, dev.Allocate(m.local_sizes[flat]));
      mine.push_back(std::move(b));
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
        MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer b, dev.Allocate(m.param_sizes[flat]));
        stack = std::move(b);
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

absl::StatusOr<double> Trainer::Evaluate(int64_t batches) {
  Impl& m = *impl_;
  const int64_t n = m.workload->num_validation_samples();
  if (n <= 0) return absl::FailedPreconditionError("the workload has no validation data");
  if (batches < 1) return absl::InvalidArgumentError("Evaluate: batches must be >= 1");
  StepReport drained;
  MUONMESH_RETURN_IF_ERROR(m.DrainGatherAfterStep(&drained));
  const int64_t g = m.options.global_batch_size;
  const int64_t b = g / m.world;
  // One micro-batch at a time (the local batch without micro-batches), so
  // that validation holds no more activations than a step; the pieces are
  // the same size, so the mean of their means is the mean over all of them.
  const int64_t micro = m.options.micro_batch_size > 0 ? m.options.micro_batch_size : b;
  double sum = 0;
  std::vector<int64_t> samples(static_cast<size_t>(micro));
  for (int64_t k = 0; k < batches; ++k) {
    for (int64_t first = 0; first < b; first += micro) {
      for (int64_t j = 0; j < micro; ++j) samples[j] = (k * g + m.rank * b + first + j) % n;
      // The gathers count into a report of their own: validation is not a step.
      StepReport scratch;
      UnitStream stream(m, &scratch);
      absl::StatusOr<double> loss = m.workload->ValidationLossByUnit(stream, samples);
      stream.ReleaseAll();
      MUONMESH_RETURN_IF_ERROR(loss.status(), "validation");
      sum += *loss;
    }
  }
  float mean = static_cast<float>(sum / static_cast<double>(batches * (b / micro)));
  MUONMESH_RETURN_IF_ERROR(m.dev->CopyFromHost(m.scalar.data(), &mean, 1));
  MUONMESH_RETURN_IF_ERROR(
      m.world_comm->AllReduce(m.scalar.data(), 1, comm::ReduceOp::kAvg, m.options.collective));
  MUONMESH_RETURN_IF_ERROR(m.dev->CopyToHost(&mean, m.scalar.data(), 1));
  return static_cast<double>(mean);
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

}  // namespace muonmesh::worker
