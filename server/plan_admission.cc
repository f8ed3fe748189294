#include "server/plan_admission.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace muonmesh::coordinator {
namespace {

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

PlanAdmission::PlanAdmission(PlanAdmissionLimits limits)
    : limits_{std::max<int64_t>(limits.max_calls, 1), std::max<int64_t>(limits.max_bytes, 1)} {}

absl::StatusOr<PlanAdmission::Ticket> PlanAdmission::Admit(int64_t bytes) {
  bytes = std::max<int64_t>(bytes, 0);
  if (bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "this plan needs about %.0f MiB to compute and answer, more than the server allows "
        "all plans together (%.0f MiB, --plan_memory_mib): use fewer ranks per optimizer "
        "domain or fewer units",
        MiB(bytes), MiB(limits_.max_bytes)));
  }
  absl::MutexLock lock(&mu_);
  if (calls_ >= limits_.max_calls) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the coordinator is computing %d plans, its limit (--max_concurrent_plans): retry later",
        calls_));
  }
  if (bytes_ + bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "this plan needs about %.0f MiB and the %d plans in progress hold %.0f of the "
        "server's %.0f MiB (--plan_memory_mib): retry later",
        MiB(bytes), calls_, MiB(bytes_), MiB(limits_.max_bytes)));
  }
  ++calls_;
  bytes_ += bytes;
  return Ticket(this, bytes);
}

int64_t PlanAdmission::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

int64_t PlanAdmission::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

void PlanAdmission::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  --calls_;
  bytes_ -= bytes;
}

}  // namespace muonmesh::coordinator
