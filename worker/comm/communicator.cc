#include "worker/comm/communicator.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace muonmesh::comm {
namespace {

constexpr int64_t kFloatBytes = sizeof(float);

// Floats in the largest buffer a call may touch (size * count), kept far
// from overflowing byte offsets.
constexpr int64_t kMaxTotalFloats = int64_t{1} << 56;

absl::Status CheckCount(const char* what, int64_t count, int size) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat(what, " is negative: ", count));
  if (count > kMaxTotalFloats / size) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", count, " is too large"));
  }
  return absl::OkStatus();
}

absl::Status CheckBuffer(const char* what, const void* ptr, int64_t count) {
  if (count > 0 && ptr == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is null with ", count, " floats"));
  }
  return absl::OkStatus();
}

absl::Status CheckTimeout(const CollectiveOptions& options) {
  if (options.timeout <= absl::ZeroDuration() || options.timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timeout must be positive and finite, got ", absl::FormatDuration(options.timeout)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view MemorySpaceName(MemorySpace space) {
  return space == MemorySpace::kHost ? "host" : "cuda device";
}

absl::string_view BackendName(Backend backend) {
  switch (backend) {
    case Backend::kInProcess:
      return "inproc";
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

absl::StatusOr<Backend> ParseBackend(absl::string_view name) {
  for (Backend b : {Backend::kInProcess, Backend::kGloo, Backend::kNccl}) {
    if (name == BackendName(b)) return b;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown communicator backend '", name, "' (inproc, gloo, nccl)"));
}

absl::string_view CollectiveName(Collective collective) {
  switch (collective) {
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kAllToAllV:
      return "all_to_all_v";
    case Collective::kBarrier:
      return "barrier";
  }
  return "unknown";
}

Communicator::Communicator(std::string group_name, int rank, int size)
    : group_name_(std::move(group_name)), rank_(rank), size_(size) {}

CommStats Communicator::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::Status Communicator::health() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

Communicator::~Communicator() { LeaveAbortSignal(); }

void Communicator::AbortWith(AbortSignal* signal) {
  if (signal == nullptr || abort_signal_ != nullptr) return;
  abort_signal_ = signal;
  signal->Add(this);
}

void Communicator::LeaveAbortSignal() {
  if (abort_signal_ == nullptr) return;
  abort_signal_->Remove(this);
  abort_signal_ = nullptr;
}

void Communicator::Abort(const std::string& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.has_value()) return;
    aborted_ = reason;
  }
  DoAbort(reason);
}

template <typename Hook>
absl::Status Communicator::Run(Collective collective, int64_t bytes_sent,
                               const CollectiveOptions& options, Hook&& hook) {
  const auto context = [&] {
    return absl::StrCat(CollectiveName(collective), " on group '", group_name_, "' (rank ", rank_,
                        " of ", size_, ", ", label(), ")");
  };
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.has_value() || !broken_.ok()) {
      ++stats_[collective].calls;
      ++stats_[collective].failures;
      if (aborted_.has_value()) {
        return absl::CancelledError(absl::StrCat(context(), ": aborted: ", *aborted_));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          context(), ": the group is broken by an earlier failure (create a new group): ",
          broken_.message()));
    }
  }
  const absl::Time start = absl::Now();
  absl::Status status = hook(start + options.timeout);
  const absl::Duration elapsed = absl::Now() - start;
  {
    // A call an abort overlapped fails for that reason, whatever the
    // transport said (a woken wait may even return as if done).
    absl::MutexLock lock(&mu_);
    if (aborted_.has_value()) {
      status = absl::CancelledError(absl::StrCat(context(), ": aborted: ", *aborted_));
    } else if (!status.ok()) {
      status = AnnotateStatus(status, context());
    }
  }
  bool newly_broken = false;
  {
    absl::MutexLock lock(&mu_);
    CollectiveCounters& counters = stats_[collective];
    ++counters.calls;
    counters.time += elapsed;
    if (status.ok()) {
      counters.bytes_sent += bytes_sent;
    } else {
      ++counters.failures;
      newly_broken = broken_.ok();
      if (newly_broken) broken_ = status;
    }
  }
  if (newly_broken) OnBroken();
  return status;
}

absl::Status Communicator::AllGather(const float* in, int64_t count, float* out,
                                     const CollectiveOptions& options) {
  MUONMESH_RETURN_IF_ERROR(CheckTimeout(options));
  MUONMESH_RETURN_IF_ERROR(CheckCount("all_gather count", count, size_));
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("all_gather input", in, count));
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("all_gather output", out, count));
  const int64_t bytes = (size_ - 1) * count * kFloatBytes;
  return Run(Collective::kAllGather, bytes, options, [&](absl::Time deadline) {
    return count == 0 ? absl::OkStatus() : DoAllGather(in, count, out, deadline);
  });
}

absl::Status Communicator::ReduceScatter(const float* in, float* out, int64_t count, ReduceOp op,
                                         const CollectiveOptions& options) {
  MUONMESH_RETURN_IF_ERROR(CheckTimeout(options));
  MUONMESH_RETURN_IF_ERROR(CheckCount("reduce_scatter count", count, size_));
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("reduce_scatter input", in, count));
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("reduce_scatter output", out, count));
  const int64_t bytes = (size_ - 1) * count * kFloatBytes;
  return Run(Collective::kReduceScatter, bytes, options, [&](absl::Time deadline) {
    return count == 0 ? absl::OkStatus() : DoReduceScatter(in, out, count, op, deadline);
  });
}

absl::Status Communicator::AllReduce(float* inout, int64_t count, ReduceOp op,
                                     const CollectiveOptions& options) {
  MUONMESH_RETURN_IF_ERROR(CheckTimeout(options));
  MUONMESH_RETURN_IF_ERROR(CheckCount("all_reduce count", count, size_));
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("all_reduce buffer", inout, count));
  const int64_t chunk = count / size_ + (rank_ < count % size_ ? 1 : 0);
  const int64_t bytes = (count - chunk + (size_ - 1) * chunk) * kFloatBytes;
  return Run(Collective::kAllReduce, bytes, options, [&](absl::Time deadline) {
    return count == 0 ? absl::OkStatus() : DoAllReduce(inout, count, op, deadline);
  });
}

absl::Status Communicator::Broadcast(float* inout, int64_t count, int root,
                                     const CollectiveOptions& options) {
  MUONMESH_RETURN_IF_ERROR(CheckTimeout(options));
  if (root < 0 || root >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast root ", root, " is not a rank of a group of ", size_));
  }
  MUONMESH_RETURN_IF_ERROR(CheckCount("broadcast count", count, size_));
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("broadcast buffer", inout, count));
  const bool last_in_chain = (rank_ - root + size_) % size_ == size_ - 1;
  const int64_t bytes = last_in_chain ? 0 : count * kFloatBytes;
  return Run(Collective::kBroadcast, bytes, options, [&](absl::Time deadline) {
    return count == 0 ? absl::OkStatus() : DoBroadcast(inout, count, root, deadline);
  });
}

absl::Status Communicator::AllToAllV(const float* send, absl::Span<const int64_t> send_counts,
                                     float* recv, absl::Span<const int64_t> recv_counts,
                                     const CollectiveOptions& options) {
  MUONMESH_RETURN_IF_ERROR(CheckTimeout(options));
  if (static_cast<int64_t>(send_counts.size()) != size_ ||
      static_cast<int64_t>(recv_counts.size()) != size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_to_all_v needs ", size_, " send and recv counts, got ",
                     send_counts.size(), " and ", recv_counts.size()));
  }
  int64_t send_total = 0;
  int64_t recv_total = 0;
  int64_t bytes = 0;
  for (int q = 0; q < size_; ++q) {
    if (send_counts[q] < 0 || recv_counts[q] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("all_to_all_v: negative count for rank ", q));
    }
    if (send_counts[q] > kMaxTotalFloats - send_total ||
        recv_counts[q] > kMaxTotalFloats - recv_total) {
      return absl::InvalidArgumentError("all_to_all_v: counts too large");
    }
    send_total += send_counts[q];
    recv_total += recv_counts[q];
    if (q != rank_) bytes += send_counts[q] * kFloatBytes;
  }
  if (send_counts[rank_] != recv_counts[rank_]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "all_to_all_v: rank ", rank_, " sends itself ", send_counts[rank_],
        " floats but expects ", recv_counts[rank_]));
  }
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("all_to_all_v send buffer", send, send_total));
  MUONMESH_RETURN_IF_ERROR(CheckBuffer("all_to_all_v recv buffer", recv, recv_total));
  return Run(Collective::kAllToAllV, bytes, options, [&](absl::Time deadline) {
    return DoAllToAllV(send, send_counts, recv, recv_counts, deadline);
  });
}

absl::Status Communicator::Barrier(const CollectiveOptions& options) {
  MUONMESH_RETURN_IF_ERROR(CheckTimeout(options));
  return Run(Collective::kBarrier, 0, options,
             [&](absl::Time deadline) { return DoBarrier(deadline); });
}

}  // namespace muonmesh::comm
