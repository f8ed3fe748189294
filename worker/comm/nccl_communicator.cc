#include "worker/comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/comm/nccl_checks.h"

namespace muonmesh::comm {
namespace {

using cuda::CudaDeviceCount;
using cuda::CudaErrorToStatus;
using internal::NcclErrorToStatus;

// How long the destructor lets ncclCommFinalize flush before aborting.
constexpr absl::Duration kFinalizeTimeout = absl::Seconds(10);

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kSum:
      break;
  }
  return ncclSum;
}

// Sleeps a little longer each time, up to 100 us: the wait for a collective
// stays responsive without burning a core.
void PollPause(int& round) {
  if (round < 64) {
    ++round;
    return;  // spin
  }
  absl::SleepFor(absl::Microseconds(round < 256 ? (++round, 10) : 100));
}

// Polls a non-blocking communicator until it leaves ncclInProgress.
absl::Status AwaitReady(ncclComm_t comm, absl::Time deadline, const char* what) {
  int round = 0;
  while (true) {
    ncclResult_t state = ncclSuccess;
    MUONMESH_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclErrorToStatus(state, what, __FILE__, __LINE__);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " did not finish in time"));
    }
    PollPause(round);
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::string name, int rank, int size, int device)
      : Communicator(std::move(name), rank, size), device_(device) {}

  ~NcclCommunicator() override {
    LeaveAbortSignal();
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      // Flush and tear down politely; abort if a peer makes that hang.
      const ncclResult_t result = ncclCommFinalize(comm_);
      const bool finalized =
          (result == ncclSuccess || result == ncclInProgress) &&
          AwaitReady(comm_, absl::Now() + kFinalizeTimeout, "ncclCommFinalize").ok();
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (barrier_buffer_ != nullptr) cudaFree(barrier_buffer_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Backend backend() const override { return Backend::kNccl; }
  MemorySpace memory_space() const override { return MemorySpace::kCudaDevice; }

  // Creation, after the unique id is known.
  absl::Status Init(const ncclUniqueId& id, absl::Time deadline) {
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MUONMESH_COMM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&barrier_buffer_), sizeof(float)));
    MUONMESH_COMM_CUDA_CHECK(cudaMemset(barrier_buffer_, 0, sizeof(float)));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so a missing peer cannot hang us: we poll and abort
    MUONMESH_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size(), id, rank(), &config));
    absl::Status ready = AwaitReady(comm_, deadline, "ncclCommInitRankConfig");
    if (!ready.ok()) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    return ready;
  }

 private:
  // Waits for everything enqueued on stream_ (see the header).
  absl::Status WaitForStream(absl::Time deadline);

  absl::Status DoAllGather(const float* in, int64_t count, float* out,
                           absl::Time deadline) override {
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_NCCL_CHECK(ncclAllGather(in, out, static_cast<size_t>(count), ncclFloat, comm_,
                                      stream_));
    return WaitForStream(deadline);
  }

  absl::Status DoReduceScatter(const float* in, float* out, int64_t count, ReduceOp op,
                               absl::Time deadline) override {
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_NCCL_CHECK(ncclReduceScatter(in, out, static_cast<size_t>(count), ncclFloat,
                                          ToNccl(op), comm_, stream_));
    return WaitForStream(deadline);
  }

  absl::Status DoAllReduce(float* inout, int64_t count, ReduceOp op,
                           absl::Time deadline) override {
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_NCCL_CHECK(ncclAllReduce(inout, inout, static_cast<size_t>(count), ncclFloat,
                                      ToNccl(op), comm_, stream_));
    return WaitForStream(deadline);
  }

  absl::Status DoBroadcast(float* inout, int64_t count, int root, absl::Time deadline) override {
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_NCCL_CHECK(ncclBroadcast(inout, inout, static_cast<size_t>(count), ncclFloat, root,
                                      comm_, stream_));
    return WaitForStream(deadline);
  }

  absl::Status DoAllToAllV(const float* send, absl::Span<const int64_t> send_counts, float* recv,
                           absl::Span<const int64_t> recv_counts, absl::Time deadline) override;

  absl::Status DoBarrier(absl::Time deadline) override {
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_NCCL_CHECK(
        ncclAllReduce(barrier_buffer_, barrier_buffer_, 1, ncclFloat, ncclSum, comm_, stream_));
    return WaitForStream(deadline);
  }

  // Another thread: the call in progress (WaitForStream) sees the flag at
  // its next poll and returns; the failed call then aborts the NCCL
  // communicator on its own thread (OnBroken), which ends its kernels.
  void DoAbort(const std::string& /*reason*/) override { abort_requested_ = true; }

  void OnBroken() override {
    if (comm_ == nullptr) return;
    cudaSetDevice(device_);
    ncclCommAbort(comm_);  // frees the communicator and unblocks its kernels
    comm_ = nullptr;
  }

  const int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  float* barrier_buffer_ = nullptr;
  std::atomic<bool> abort_requested_{false};
};

absl::Status NcclCommunicator::WaitForStream(absl::Time deadline) {
  int round = 0;
  while (true) {
    ncclResult_t state = ncclSuccess;
    MUONMESH_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclErrorToStatus(state, "ncclCommGetAsyncError", __FILE__, __LINE__);
    }
    if (state == ncclSuccess) {
      const cudaError_t query = cudaStreamQuery(stream_);
      if (query == cudaSuccess) return absl::OkStatus();
      if (query != cudaErrorNotReady) {
        return CudaErrorToStatus(query, "cudaStreamQuery", __FILE__, __LINE__);
      }
    }
    if (abort_requested_.load()) return absl::CancelledError("aborted while waiting");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "the NCCL operation did not complete before the deadline (communicator aborted)");
    }
    PollPause(round);
  }
}

absl::Status NcclCommunicator::DoAllToAllV(const float* send,
                                           absl::Span<const int64_t> send_counts, float* recv,
                                           absl::Span<const int64_t> recv_counts,
                                           absl::Time deadline) {
  MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
  std::vector<int64_t> send_offset(size()), recv_offset(size());
  for (int q = 1; q < size(); ++q) {
    send_offset[q] = send_offset[q - 1] + send_counts[q - 1];
    recv_offset[q] = recv_offset[q - 1] + recv_counts[q - 1];
  }
  // The part a rank keeps: a device copy on the same stream.
  if (send_counts[rank()] > 0) {
    MUONMESH_COMM_CUDA_CHECK(cudaMemcpyAsync(
        recv + recv_offset[rank()], send + send_offset[rank()],
        static_cast<size_t>(send_counts[rank()]) * sizeof(float), cudaMemcpyDeviceToDevice,
        stream_));
  }
  // Every send and receive in one group so NCCL can schedule them together
  // (no deadlock, whatever the order); the group is always closed, even when
  // a call inside it fails.
  absl::Status status = absl::OkStatus();
  const auto keep_first = [&status](ncclResult_t result, const char* expr, int line) {
    if (status.ok() && result != ncclSuccess && result != ncclInProgress) {
      status = NcclErrorToStatus(result, expr, __FILE__, line);
    }
  };
  keep_first(ncclGroupStart(), "ncclGroupStart()", __LINE__);
  for (int q = 0; q < size() && status.ok(); ++q) {
    if (q == rank()) continue;
    if (send_counts[q] > 0) {
      keep_first(ncclSend(send + send_offset[q], static_cast<size_t>(send_counts[q]), ncclFloat,
                          q, comm_, stream_),
                 "ncclSend", __LINE__);
    }
    if (recv_counts[q] > 0) {
      keep_first(ncclRecv(recv + recv_offset[q], static_cast<size_t>(recv_counts[q]), ncclFloat,
                          q, comm_, stream_),
                 "ncclRecv", __LINE__);
    }
  }
  keep_first(ncclGroupEnd(), "ncclGroupEnd()", __LINE__);
  MUONMESH_RETURN_IF_ERROR(status);
  return WaitForStream(deadline);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    Store& store, std::string group_name, int rank, int size, const GroupOptions& options) {
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  const auto where = [&] {
    return absl::StrCat("nccl group '", group_name, "' (rank ", rank, " of ", size, ")");
  };
  MUONMESH_ASSIGN_OR_RETURN(const int devices, CudaDeviceCount(where()));
  int device = options.cuda_device;
  if (device < 0) {
    MUONMESH_COMM_CUDA_CHECK(cudaGetDevice(&device));
  } else if (device >= devices) {
    return absl::FailedPreconditionError(absl::StrCat(
        where(), ": CUDA device ", device, " does not exist (", devices, " visible)"));
  }

  // The unique id travels through the store; its bytes are opaque.
  const std::string key = absl::StrCat(group_name, "/nccl/unique_id");
  ncclUniqueId id;
  if (rank == 0) {
    MUONMESH_NCCL_CHECK(ncclGetUniqueId(&id));
    MUONMESH_RETURN_IF_ERROR(
        store.Set(key, absl::string_view(reinterpret_cast<const char*>(&id), sizeof(id))),
        where(), ": publishing the unique id");
  } else {
    MUONMESH_ASSIGN_OR_RETURN(std::string value, store.Get(key, options.connect_timeout), where(),
                              ": waiting for the unique id");
    if (value.size() != sizeof(id)) {
      return absl::InternalError(absl::StrCat(where(), ": unique id of ", value.size(),
                                              " bytes in the store, expected ", sizeof(id)));
    }
    std::memcpy(&id, value.data(), sizeof(id));
  }

  auto communicator = std::make_unique<NcclCommunicator>(group_name, rank, size, device);
  MUONMESH_RETURN_IF_ERROR(communicator->Init(id, deadline), where());
  return std::unique_ptr<Communicator>(std::move(communicator));
}

}  // namespace muonmesh::comm
