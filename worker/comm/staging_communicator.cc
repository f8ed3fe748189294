#include "worker/comm/staging_communicator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/comm/nccl_checks.h"

namespace muonmesh::comm {
namespace {

class StagingCommunicator final : public Communicator {
 public:
  StagingCommunicator(std::unique_ptr<Communicator> host, int device)
      : Communicator(host->group_name(), host->rank(), host->size()),
        host_(std::move(host)),
        device_(device),
        label_(absl::StrCat(BackendName(host_->backend()), " via host copies")) {}

  ~StagingCommunicator() override {
    LeaveAbortSignal();
    cudaSetDevice(device_);
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Backend backend() const override { return host_->backend(); }
  MemorySpace memory_space() const override { return MemorySpace::kCudaDevice; }

  absl::Status Init() {
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }

 private:
  std::string label() const override { return label_; }

  // A pinned host buffer of at least `floats` floats (grown, never shrunk).
  absl::StatusOr<float*> Staging(int64_t floats) {
    if (floats <= capacity_) return pinned_;
    if (pinned_ != nullptr) {
      MUONMESH_COMM_CUDA_CHECK(cudaFreeHost(pinned_));
      pinned_ = nullptr;
      capacity_ = 0;
    }
    MUONMESH_COMM_CUDA_CHECK(
        cudaMallocHost(reinterpret_cast<void**>(&pinned_), static_cast<size_t>(floats) * 4));
    capacity_ = floats;
    return pinned_;
  }

  // One copy on the stream, waited for: device to host or host to device.
  absl::Status Copy(float* dst, const float* src, int64_t count, cudaMemcpyKind kind) {
    if (count == 0) return absl::OkStatus();
    MUONMESH_COMM_CUDA_CHECK(cudaSetDevice(device_));
    MUONMESH_COMM_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * 4, kind, stream_));
    MUONMESH_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status ToHost(float* host, const float* device, int64_t count) {
    return Copy(host, device, count, cudaMemcpyDeviceToHost);
  }
  absl::Status ToDevice(float* device, const float* host, int64_t count) {
    return Copy(device, host, count, cudaMemcpyHostToDevice);
  }

  // The host group's options for what is left of this call's time.
  static absl::StatusOr<CollectiveOptions> Remaining(absl::Time deadline) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("the copies to host memory used up the call's time");
    }
    return CollectiveOptions{left};
  }

  absl::Status DoAllGather(const float* in, int64_t count, float* out,
                           absl::Time deadline) override {
    MUONMESH_ASSIGN_OR_RETURN(float* all, Staging(size() * count));
    float* mine = all + rank() * count;
    MUONMESH_RETURN_IF_ERROR(ToHost(mine, in, count));
    MUONMESH_ASSIGN_OR_RETURN(CollectiveOptions options, Remaining(deadline));
    MUONMESH_RETURN_IF_ERROR(host_->AllGather(mine, count, all, options));
    return ToDevice(out, all, size() * count);
  }

  absl::Status DoReduceScatter(const float* in, float* out, int64_t count, ReduceOp op,
                               absl::Time deadline) override {
    MUONMESH_ASSIGN_OR_RETURN(float* all, Staging(size() * count));
    float* mine = all + rank() * count;
    MUONMESH_RETURN_IF_ERROR(ToHost(all, in, size() * count));
    MUONMESH_ASSIGN_OR_RETURN(CollectiveOptions options, Remaining(deadline));
    MUONMESH_RETURN_IF_ERROR(host_->ReduceScatter(all, mine, count, op, options));
    return ToDevice(out, mine, count);
  }

  absl::Status DoAllReduce(float* inout, int64_t count, ReduceOp op,
                           absl::Time deadline) override {
    MUONMESH_ASSIGN_OR_RETURN(float* buf, Staging(count));
    MUONMESH_RETURN_IF_ERROR(ToHost(buf, inout, count));
    MUONMESH_ASSIGN_OR_RETURN(CollectiveOptions options, Remaining(deadline));
    MUONMESH_RETURN_IF_ERROR(host_->AllReduce(buf, count, op, options));
    return ToDevice(inout, buf, count);
  }

  absl::Status DoBroadcast(float* inout, int64_t count, int root, absl::Time deadline) override {
    MUONMESH_ASSIGN_OR_RETURN(float* buf, Staging(count));
    if (rank() == root) {
      MUONMESH_RETURN_IF_ERROR(ToHost(buf, inout, count));
    }
    MUONMESH_ASSIGN_OR_RETURN(CollectiveOptions options, Remaining(deadline));
    MUONMESH_RETURN_IF_ERROR(host_->Broadcast(buf, count, root, options));
    return rank() == root ? absl::OkStatus() : ToDevice(inout, buf, count);
  }

  absl::Status DoAllToAllV(const float* send, absl::Span<const int64_t> send_counts, float* recv,
                           absl::Span<const int64_t> recv_counts, absl::Time deadline) override {
    int64_t send_total = 0, recv_total = 0;
    for (int q = 0; q < size(); ++q) {
      send_total += send_counts[q];
      recv_total += recv_counts[q];
    }
    MUONMESH_ASSIGN_OR_RETURN(float* buf, Staging(send_total + recv_total));
    float* host_recv = buf + send_total;
    MUONMESH_RETURN_IF_ERROR(ToHost(buf, send, send_total));
    MUONMESH_ASSIGN_OR_RETURN(CollectiveOptions options, Remaining(deadline));
    MUONMESH_RETURN_IF_ERROR(
        host_->AllToAllV(buf, send_counts, host_recv, recv_counts, options));
    return ToDevice(recv, host_recv, recv_total);
  }

  absl::Status DoBarrier(absl::Time deadline) override {
    MUONMESH_ASSIGN_OR_RETURN(CollectiveOptions options, Remaining(deadline));
    return host_->Barrier(options);
  }

  // The host group ends a call in progress (Gloo wakes it through its
  // connections); the failed call then breaks this group too.
  void DoAbort(const std::string& reason) override { host_->Abort(reason); }

  const std::unique_ptr<Communicator> host_;
  const int device_;
  const std::string label_;
  cudaStream_t stream_ = nullptr;
  float* pinned_ = nullptr;
  int64_t capacity_ = 0;  // floats at pinned_
};

}  // namespace

absl::StatusOr<int> StagingDevice(int cuda_device) {
  MUONMESH_ASSIGN_OR_RETURN(int devices, cuda::CudaDeviceCount("collectives via host copies"));
  int device = cuda_device;
  if (device < 0) {
    MUONMESH_COMM_CUDA_CHECK(cudaGetDevice(&device));
  }
  if (device >= devices) {
    return absl::FailedPreconditionError(absl::StrCat(
        "collectives via host copies: CUDA device ", device, " but ", devices, " visible"));
  }
  return device;
}

absl::StatusOr<std::unique_ptr<Communicator>> StageThroughHost(
    std::unique_ptr<Communicator> host, int cuda_device) {
  if (host == nullptr) return absl::InvalidArgumentError("StageThroughHost: no host group");
  if (host->memory_space() != MemorySpace::kHost) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StageThroughHost: group '", host->group_name(), "' (", BackendName(host->backend()),
        ") already works in ", MemorySpaceName(host->memory_space()), " memory"));
  }
  MUONMESH_ASSIGN_OR_RETURN(int device, StagingDevice(cuda_device));
  auto staged = std::make_unique<StagingCommunicator>(std::move(host), device);
  MUONMESH_RETURN_IF_ERROR(staged->Init());
  return std::unique_ptr<Communicator>(std::move(staged));
}

}  // namespace muonmesh::comm
