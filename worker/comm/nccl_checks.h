#pragma once

// NCCL and CUDA runtime errors as absl::Status, with the failing expression
// and its file:line (the idea of NCCL's src/include/checks.h, written for
// Status). Built only with MUONMESH_HAVE_CUDA.
//
//   MUONMESH_NCCL_CHECK(ncclAllReduce(...));   // returns the Status on error
//   MUONMESH_COMM_CUDA_CHECK(cudaStreamCreate(&stream));
//
// Usable in functions returning absl::Status or absl::StatusOr<T>. ncclInProgress
// is not an error: with non-blocking communicators it means "queued; poll
// ncclCommGetAsyncError". Codes: ncclSystemError and ncclRemoteError (a peer
// or the network failed) -> Unavailable; ncclInvalidArgument and
// ncclInvalidUsage -> InvalidArgument; anything else -> Internal. CUDA errors
// go through cuda::CudaErrorToStatus (worker/cuda/cuda_error.h).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "worker/cuda/cuda_error.h"

namespace muonmesh::comm::internal {

absl::Status NcclErrorToStatus(ncclResult_t result, const char* expr, const char* file, int line);

}  // namespace muonmesh::comm::internal

#define MUONMESH_NCCL_CHECK(expr)                                                          \
  do {                                                                                     \
    const ncclResult_t muonmesh_nccl_result_ = (expr);                                     \
    if (muonmesh_nccl_result_ != ncclSuccess && muonmesh_nccl_result_ != ncclInProgress) { \
      return ::muonmesh::comm::internal::NcclErrorToStatus(muonmesh_nccl_result_, #expr,   \
                                                           __FILE__, __LINE__);            \
    }                                                                                      \
  } while (0)

#define MUONMESH_COMM_CUDA_CHECK(expr)                                                   \
  do {                                                                                   \
    const cudaError_t muonmesh_comm_cuda_error_ = (expr);                                \
    if (muonmesh_comm_cuda_error_ != cudaSuccess) {                                      \
      return ::muonmesh::cuda::CudaErrorToStatus(muonmesh_comm_cuda_error_, #expr,       \
                                                 __FILE__, __LINE__);                    \
    }                                                                                    \
  } while (0)
