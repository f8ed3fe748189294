#pragma once

// Internal to worker/runtime/: Trainer::UnitStream, the UnitAccess a step
// hands its workload (included by trainer.cc only).

#include "worker/runtime/trainer_impl.h"

namespace muonmesh::worker {

// The runtime's side of Workload::ForwardBackwardByUnit over this rank's
// shards: Acquire gathers one unit into whole tensors taken for it from the
// trainer's BufferPool (given back on Release), Commit packs one unit's whole
// gradients into its bucket's buffer (given back right after) and reduces
// the bucket once its last unit is in. So a step holds only what the
// workload has acquired, the gradient buffers it has not committed yet and
// the buckets being filled, never the whole model (and the pool keeps no
// more than that peak) — unless the plan holds each unit from its first
// use to its last (PlanOptions::reshard_after_forward false; Release).
class Trainer::UnitStream final : public UnitAccess {
 public:
  // `early_wave`: the Muon wave whose gather starts once its gradients are
  // reduced (Impl::EarlyWave), or -1.
  UnitStream(Impl& m, StepReport* report, int32_t early_wave = -1)
      : m_(m),
        report_(report),
        slots_(m.states_of.size()),
        pending_(m.buckets.size()),
        early_wave_(early_wave) {}

  absl::StatusOr<absl::Span<const float* const>> Acquire(int unit) override {
    MUONMESH_RETURN_IF_ERROR(CheckUnit(unit, "Acquire"));
    Slot& slot = slots_[unit];
    if (slot.acquired) {
      return absl::FailedPreconditionError(
          absl::StrCat("Acquire(", unit, "): the unit is already acquired"));
    }
    if (slot.in_flight) {  // being gathered ahead of the pass
      const std::vector<int32_t> batch = ahead_;
      MUONMESH_RETURN_IF_ERROR(AwaitAhead());
      PrefetchAfter(batch, ahead_gathers_);
    }
    if (slot.prefetched) {  // gathered with an earlier unit of its bucket, ahead, or kept
      slot.prefetched = false;
      slot.acquired = true;
      ++slot.acquires;
      return absl::MakeConstSpan(slot.const_ptrs);
    }
    // The gather groups have one caller at a time.
    if (Communicates(unit)) MUONMESH_RETURN_IF_ERROR(AwaitAhead());
    // What this gather reads, the last step's after-step gather may still
    // be writing (TrainerOptions::overlap_param_gather).
    MUONMESH_RETURN_IF_ERROR(AwaitAfterStep(FormBatch(unit, slot.gathers), report_));
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
    absl::Status st = Gather(unit);
    if (!st.ok()) {
      Free(slot.params, slot.param_ptrs);
      slot.const_ptrs.clear();
      return st;
    }
    slot.acquired = true;
    ++slot.acquires;
    report_->times.param_gather += absl::Now() - t0;
    return absl::MakeConstSpan(slot.const_ptrs);
  }

  // Frees the unit's gathered parameters, unless the plan holds them to
  // their last use (PlanOptions::reshard_after_forward false) and the
  // workload will acquire the unit again this step (its spec's
  // gathers_per_step): then they stay, as if gathered ahead, and the next
  // Acquire takes them without a gather (the parameters do not change
  // within a pass).
  void Release(int unit) override {
    if (unit < 0 || unit >= static_cast<int>(slots_.size())) return;
    Slot& slot = slots_[unit];
    if (slot.acquired && !m_.plan->config.reshard_after_forward &&
        slot.acquires < std::max<int32_t>(m_.workload->spec().units[unit].gathers_per_step, 1)) {
      slot.acquired = false;
      slot.prefetched = true;
      return;
    }
    Drop(unit);
  }

  // Frees the unit's gathered parameters.
  void Drop(int unit) {
    if (slots_[unit].in_flight) AwaitAhead().IgnoreError();
    Slot& slot = slots_[unit];
    Free(slot.params, slot.param_ptrs);
    slot.const_ptrs.clear();
    slot.const_ptrs.shrink_to_fit();
    slot.acquired = false;
    slot.prefetched = false;
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
    // Each state into its bucket's buffer; a bucket complete with this
    // unit is reduced at once.
    for (int32_t state : m_.states_of[unit]) {
      UnitState& u = m_.units[state];
      if (!m_.accumulating && Impl::ReducesNothing(*u.mesh)) {
        MUONMESH_RETURN_IF_ERROR(m_.PackGradients(state, u.grad.data(), src.data(), true));
        continue;
      }
      const int32_t b = m_.bucket_of[state].first;
      Pending& p = pending_[b];
      if (p.buf.empty()) {
        MUONMESH_ASSIGN_OR_RETURN(p.buf, m_.unit_buffers.Take(m_.buckets[b].total[0]));
        p.left = static_cast<int64_t>(m_.buckets[b].states.size());
      }
      MUONMESH_RETURN_IF_ERROR(m_.PackGradients(state, p.buf.data(), src.data()));
      if (--p.left > 0) continue;
      p.reduced = true;
      if (m_.OverlapsReduce()) {
        // (std::function copies its callable: the buffer rides in a shared_ptr.)
        auto buf = std::make_shared<DeviceBuffer>(std::move(p.buf));
        Reducer().Push([this, b, buf](StepReport* bytes, bool failed) {
          absl::Status st = failed ? absl::OkStatus() : m_.ReduceBucket(b, buf->data(), bytes);
          m_.unit_buffers.Give(std::move(*buf));
          return st;
        });
        continue;
      }
      absl::Status st = m_.ReduceBucket(b, p.buf.data(), report_);
      m_.unit_buffers.Give(std::move(p.buf));
      MUONMESH_RETURN_IF_ERROR(st);
    }
    Free(slot.grads, slot.grad_ptrs);
    slot.committed = true;
    StartEarlyWave();
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

  // Waits for the reductions still running beside the pass; their first
  // error. Before anything else uses the reduce groups.
  absl::Status Finish() {
    // A gather ahead that the pass did not use (it acquired fewer units
    // than it would by the pass's order): waited for, its units freed.
    absl::Status st = AwaitAhead();
    // The reductions first: their last jobs may start the early gather.
    for (CommThread* t : {reducer_.get(), early_.get()}) {
      if (t == nullptr) continue;
      absl::Status drained = t->Drain(report_);
      if (st.ok()) st = std::move(drained);
    }
    return st;
  }

  // Frees whatever the workload left acquired or uncommitted (waiting for
  // the reductions in flight first).
  void ReleaseAll() {
    AwaitAhead().IgnoreError();
    if (reducer_ != nullptr) reducer_->Drain(report_).IgnoreError();
    if (early_ != nullptr) early_->Drain(report_).IgnoreError();
    for (size_t u = 0; u < slots_.size(); ++u) {
      Drop(static_cast<int>(u));
      Free(slots_[u].grads, slots_[u].grad_ptrs);
    }
    for (Pending& p : pending_) {
      if (!p.buf.empty()) m_.unit_buffers.Give(std::move(p.buf));
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
    bool prefetched = false;  // params hold a gather the workload has not acquired yet
    bool in_flight = false;   // params are being gathered ahead (prefetcher_)
    bool committed = false;
    int gathers = 0;   // this step
    int acquires = 0;  // this step
  };

  // Gathers `unit`'s parameters into its slot, and with them, in the same
  // all-gather, the units a pass is about to acquire (FormBatch); then
  // starts the gather of the batch after them ahead of the pass.
  absl::Status Gather(int unit) {
    const int gathers = slots_[unit].gathers;
    const std::vector<int32_t> batch = FormBatch(unit, gathers);
    for (size_t i = 1; i < batch.size(); ++i) {
      Slot& other = slots_[batch[i]];
      MUONMESH_RETURN_IF_ERROR(Allocate(batch[i], other.params, other.param_ptrs));
      other.const_ptrs.assign(other.param_ptrs.begin(), other.param_ptrs.end());
      other.prefetched = true;
    }
    absl::Status st = GatherBatch(batch, gathers, report_);
    for (int32_t v : batch) ++slots_[v].gathers;
    if (!st.ok()) {
      for (size_t i = 1; i < batch.size(); ++i) Drop(batch[i]);
      return st;
    }
    PrefetchAfter(batch, gathers);
    return absl::OkStatus();
  }

  CommThread& Reducer() {
    if (reducer_ == nullptr) {
      reducer_ = std::make_unique<CommThread>(kReductionsWaiting, &PhaseTimes::grad_reduce,
                                              &PhaseTimes::grad_reduce_hidden);
    }
    return *reducer_;
  }

  // Once every state of the early wave is reduced, or queued on the
  // reduction thread, queues there a job that hands the wave's Muon gather
  // (Impl::GatherEarly) to a thread of its own: the reduction thread runs
  // its jobs in order, so the gather reads final gradients, and runs beside
  // the reductions after it (on other groups) and the backward pass. Every
  // rank commits in the same order, so every rank starts it at the same
  // place.
  void StartEarlyWave() {
    if (early_wave_ < 0 || early_queued_) return;
    for (int32_t state : m_.wave_states[early_wave_]) {
      const UnitState& u = m_.units[state];
      if (!slots_[u.unit].committed) return;
      if (!m_.accumulating && Impl::ReducesNothing(*u.mesh)) continue;  // packed at its commit
      if (!pending_[m_.bucket_of[state].first].reduced) return;
    }
    early_queued_ = true;
    if (early_ == nullptr) {
      early_ = std::make_unique<CommThread>(1, &PhaseTimes::muon_gather,
                                            &PhaseTimes::muon_gather_hidden);
    }
    Reducer().Push([this, wave = early_wave_](StepReport*, bool failed) {
      if (failed) return absl::OkStatus();
      early_->Push([this, wave](StepReport*, bool) { return m_.GatherEarly(wave); });
      return absl::OkStatus();
    });
  }

  // `unit` and the units a pass acquires after it that share its all-gather
  // while their padded buffers fit in a bucket: the next ones at a unit's
  // first gather of a step (forward), the previous ones at a later gather
  // (backward). Every rank acquires in the same order, so every rank forms
  // the same batches.
  std::vector<int32_t> FormBatch(int unit, int gathers) const {
    std::vector<int32_t> batch = {unit};
    if (!Prefetchable(unit, gathers)) return batch;
    const int step = gathers == 0 ? 1 : -1;
    const MeshState* mesh = m_.units[m_.states_of[unit][0]].mesh;
    int64_t floats = plan::PaddedElements(*m_.units[m_.states_of[unit][0]].layout);
    for (int v = unit + step; v >= 0 && v < static_cast<int>(slots_.size()); v += step) {
      if (!Prefetchable(v, gathers) || m_.units[m_.states_of[v][0]].mesh != mesh) break;
      floats += plan::PaddedElements(*m_.units[m_.states_of[v][0]].layout);
      if (floats * 4 > m_.options.bucket_bytes) break;
      batch.push_back(v);
    }
    return batch;
  }

  // The all-gather of `batch` (its slots allocated) at the pass's gather
  // `gathers`, counting into `report`; any thread (one at a time).
  absl::Status GatherBatch(const std::vector<int32_t>& batch, int gathers, StepReport* report) {
    // The first gather of a step is the forward pass's; later ones re-gather
    // for the backward pass (counted apart, as the plan counts them).
    const char* name = gathers == 0 ? "param_allgather" : "param_allgather_backward";
    if (batch.size() == 1) {
      for (int32_t state : m_.states_of[batch[0]]) {
        MUONMESH_RETURN_IF_ERROR(
            m_.GatherUnit(m_.units[state], report, slots_[batch[0]].param_ptrs.data(), name));
      }
      return absl::OkStatus();
    }
    std::vector<int32_t> states;
    std::vector<float* const*> dst;
    for (int32_t v : batch) {
      states.push_back(m_.states_of[v][0]);
      dst.push_back(slots_[v].param_ptrs.data());
    }
    return m_.GatherStates(states, dst, report, name);
  }

  // Starts, on prefetcher_, the gather of the batch that follows `batch`
  // (gathered at the pass's gather `gathers`) in the pass's order, when
  // there is one and nothing is in flight. Best effort: a batch that cannot
  // be allocated is gathered when acquired instead.
  void PrefetchAfter(const std::vector<int32_t>& batch, int gathers) {
    if (!m_.PrefetchesGathers() || !ahead_.empty()) return;
    const int next = batch.back() + (gathers == 0 ? 1 : -1);
    if (next < 0 || next >= static_cast<int>(slots_.size()) || !Prefetchable(next, gathers)) {
      return;
    }
    std::vector<int32_t> ahead = FormBatch(next, gathers);
    for (size_t i = 0; i < ahead.size(); ++i) {
      Slot& slot = slots_[ahead[i]];
      if (!Allocate(ahead[i], slot.params, slot.param_ptrs).ok()) {
        for (size_t j = 0; j < i; ++j) Free(slots_[ahead[j]].params, slots_[ahead[j]].param_ptrs);
        return;
      }
      slot.const_ptrs.assign(slot.param_ptrs.begin(), slot.param_ptrs.end());
    }
    for (int32_t v : ahead) {
      slots_[v].in_flight = true;
      ++slots_[v].gathers;
    }
    if (prefetcher_ == nullptr) {
      prefetcher_ = std::make_unique<CommThread>(1, &PhaseTimes::param_gather,
                                                 &PhaseTimes::param_gather_hidden);
    }
    ahead_ = ahead;
    ahead_gathers_ = gathers;
    prefetcher_->Push([this, ahead, gathers](StepReport* report, bool) {
      MUONMESH_RETURN_IF_ERROR(AwaitAfterStep(ahead, nullptr));
      return GatherBatch(ahead, gathers, report);
    });
  }

  // Waits for the gather ahead, if one is in flight: its units become
  // prefetched (or, when it failed, are freed). Its status.
  absl::Status AwaitAhead() {
    if (ahead_.empty()) return absl::OkStatus();
    absl::Status st = prefetcher_->Drain(report_);
    for (int32_t v : ahead_) {
      Slot& slot = slots_[v];
      slot.in_flight = false;
      slot.prefetched = st.ok();
      if (!st.ok()) {
        Free(slot.params, slot.param_ptrs);
        slot.const_ptrs.clear();
      }
    }
    ahead_.clear();
    return st;
  }

  // Waits for the last step's after-step gathers of `batch`'s units
  // (Impl::AwaitGatherAfterStep; the wait into `report` when not null).
  absl::Status AwaitAfterStep(const std::vector<int32_t>& batch, StepReport* report) {
    for (int32_t v : batch) {
      for (int32_t state : m_.states_of[v]) {
        MUONMESH_RETURN_IF_ERROR(m_.AwaitGatherAfterStep(state, report));
      }
    }
    return absl::OkStatus();
  }

  // Whether acquiring `unit` gathers over a group (some state of it sits on
  // a mesh that shards parameters).
  bool Communicates(int unit) const {
    for (int32_t state : m_.states_of[unit]) {
      const MeshState& mesh = *m_.units[state].mesh;
      if (mesh.k < mesh.domain_size) return true;
    }
    return false;
  }

  // Whether unit `v` can share a gather with others at the pass where it
  // has been gathered `gathers` times this step: one state, on a mesh that
  // shards parameters, neither held nor gathered already, and due another
  // gather this step (the spec's gathers_per_step).
  bool Prefetchable(int v, int gathers) const {
    const Slot& slot = slots_[v];
    if (m_.states_of[v].size() != 1 || slot.acquired || slot.prefetched || slot.in_flight ||
        slot.gathers != gathers) {
      return false;
    }
    const MeshState& mesh = *m_.units[m_.states_of[v][0]].mesh;
    const int32_t per_step = m_.workload->spec().units[v].gathers_per_step;
    return mesh.k < mesh.domain_size && gathers < std::max<int32_t>(per_step, 1);
  }

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
      absl::StatusOr<DeviceBuffer> b = m_.unit_buffers.Take(m_.local_sizes[m_.unit_base[unit] + j]);
      if (!b.ok()) {
        Free(bufs, ptrs);
        return b.status();
      }
      bufs.push_back(*std::move(b));
      ptrs.push_back(bufs.back().data());
    }
    return absl::OkStatus();
  }

  void Free(std::vector<DeviceBuffer>& bufs, std::vector<float*>& ptrs) const {
    for (DeviceBuffer& b : bufs) m_.unit_buffers.Give(std::move(b));
    std::vector<DeviceBuffer>().swap(bufs);
    std::vector<float*>().swap(ptrs);
  }

  // A bucket being filled: its buffer and how many states it still waits for.
  struct Pending {
    DeviceBuffer buf;
    int64_t left = 0;
    bool reduced = false;  // reduced, or queued for it, this pass
  };

  Impl& m_;
  StepReport* report_;
  std::vector<Slot> slots_;
  std::vector<Pending> pending_;
  // Complete buckets' reductions beside the backward pass, at most this many
  // waiting (each holds its bucket's buffer).
  static constexpr size_t kReductionsWaiting = 2;
  // The early Muon gather's thread (its waited time is muon_gather, the
  // rest muon_gather_hidden); declared before reducer_, whose jobs push to
  // it, so that it outlives the reduction thread.
  const int32_t early_wave_;
  bool early_queued_ = false;
  std::unique_ptr<CommThread> early_;
  std::unique_ptr<CommThread> reducer_;  // when reductions overlap the pass
  // The gather ahead of the pass: its units (empty: none in flight) and
  // the pass's gather they were taken at. Declared after slots_, so that it
  // is destroyed (its thread joined) before the slots it writes.
  std::vector<int32_t> ahead_;
  int ahead_gathers_ = 0;
  std::unique_ptr<CommThread> prefetcher_;  // runs the gather ahead
};

}  // namespace muonmesh::worker
