#pragma once

// CUDA and cuBLAS errors as absl::Status, with the failing expression and
// its file:line (the idea of NCCL's src/include/checks.h, written for Status).
//
//   MUONMESH_CUDA_CHECK(cudaMalloc(&p, bytes));   // returns the Status on error
//   MUONMESH_CUBLAS_CHECK(cublasGemmEx(...));
//
// Usable in any function returning absl::Status or absl::StatusOr<T>. Codes:
// out of memory -> ResourceExhausted; no device / driver too old / no kernel
// for this architecture -> FailedPrecondition; anything else -> Internal.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "worker/cuda/cuda_error.h"

namespace muonmesh::cuda {

absl::Status CublasErrorToStatus(cublasStatus_t error, const char* expr, const char* file,
                                 int line);

}  // namespace muonmesh::cuda

#define MUONMESH_CUDA_CHECK(expr)                                                    \
  do {                                                                               \
    const cudaError_t muonmesh_cuda_error_ = (expr);                                 \
    if (muonmesh_cuda_error_ != cudaSuccess) {                                       \
      return ::muonmesh::cuda::CudaErrorToStatus(muonmesh_cuda_error_, #expr, __FILE__, \
                                                 __LINE__);                          \
    }                                                                                \
  } while (0)

#define MUONMESH_CUBLAS_CHECK(expr)                                                      \
  do {                                                                                   \
    const cublasStatus_t muonmesh_cublas_error_ = (expr);                                \
    if (muonmesh_cublas_error_ != CUBLAS_STATUS_SUCCESS) {                               \
      return ::muonmesh::cuda::CublasErrorToStatus(muonmesh_cublas_error_, #expr, __FILE__, \
                                                   __LINE__);                            \
    }                                                                                    \
  } while (0)
