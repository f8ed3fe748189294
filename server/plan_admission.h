#pragma once

// Admission control for plan calls: how many a server computes at once and
// how much memory they may hold together, by each call's estimate
// (plan::EstimatePlanSize). A call beyond either limit is refused at once
// with RESOURCE_EXHAUSTED rather than queued: a plan is pure computation,
// its client can retry, and a queue would only hide an overloaded server
// behind deadlines.
//
// Owned by the PlannerService; thread-safe (gRPC calls it from many
// threads).

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace muonmesh::coordinator {

struct PlanAdmissionLimits {
  // Plan calls computed at once (>= 1).
  int64_t max_calls = 4;
  // Estimated bytes of all calls computed at once (>= 1).
  int64_t max_bytes = int64_t{4} << 30;
};

class PlanAdmission {
 public:
  // Holds a call's share until destroyed. Movable, not copyable.
  class Ticket {
   public:
    Ticket(Ticket&& other) noexcept : owner_(other.owner_), bytes_(other.bytes_) {
      other.owner_ = nullptr;
    }
    Ticket& operator=(Ticket&&) = delete;
    Ticket(const Ticket&) = delete;
    ~Ticket() {
      if (owner_ != nullptr) owner_->Release(bytes_);
    }

   private:
    friend class PlanAdmission;
    Ticket(PlanAdmission* owner, int64_t bytes) : owner_(owner), bytes_(bytes) {}
    PlanAdmission* owner_;
    int64_t bytes_;
  };

  explicit PlanAdmission(PlanAdmissionLimits limits);

  // A ticket for a call estimated to need `bytes`. ResourceExhausted, with a
  // message naming the limit, when max_calls calls hold tickets, or when
  // `bytes` and theirs would pass max_bytes (a call alone above max_bytes is
  // always refused).
  absl::StatusOr<Ticket> Admit(int64_t bytes);

  // Calls holding tickets, and their bytes.
  int64_t calls() const;
  int64_t bytes() const;
  const PlanAdmissionLimits& limits() const { return limits_; }

 private:
  void Release(int64_t bytes);

  const PlanAdmissionLimits limits_;
  mutable absl::Mutex mu_;
  int64_t calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muonmesh::coordinator
