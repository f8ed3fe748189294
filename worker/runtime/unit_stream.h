#pragma once

// Internal to worker/runtime/: Trainer::UnitStream, the UnitAccess a step
// hands its workload (included by trainer.cc only).

#include "worker/runtime/trainer_impl.h"

namespace muonmesh::worker {

// The runtime's side of Workload::ForwardBackwardByUnit over this rank's
// shards: Acquire gathers one unit into whole tensors taken for it from the
// trainer's BufferPool (given back on Release), Commit packs and reduces one
// unit's whole gradients (given back right after). So a step holds only what
// the workload has acquired and the gradient buffers it has not committed
// yet, never the whole model (and the pool keeps no more than that peak).
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

  Impl& m_;
  StepReport* report_;
  std::vector<Slot> slots_;
};

}  // namespace muonmesh::worker
