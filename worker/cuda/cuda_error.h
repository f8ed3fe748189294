#pragma once

// A CUDA runtime error as absl::Status, with the failing expression and its
// file:line: the one conversion both the CUDA math (cuda_checks.h) and the
// NCCL communicator (comm/nccl_checks.h) use. Header-only, so the
// communicator needs the CUDA runtime and not cuBLAS.
//
// Codes: out of memory -> ResourceExhausted; no device / driver too old / no
// kernel for this architecture / a bad device index -> FailedPrecondition;
// anything else -> Internal. It clears the runtime's last error (non-sticky
// ones), so that a handled failure is not reported again by the next
// launch's cudaGetLastError.

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace muonmesh::cuda {

inline absl::Status CudaErrorToStatus(cudaError_t error, const char* expr, const char* file,
                                      int line) {
  cudaGetLastError();
  const std::string message = absl::StrCat(file, ":", line, ": ", expr, ": ",
                                           cudaGetErrorName(error), " (",
                                           cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

// The number of CUDA devices this process sees, at least 1, or
// FailedPrecondition "<what>: no CUDA device" when there is none or the
// driver cannot say (the error is cleared, so it does not resurface at the
// next launch). `what` names who needed the device ("mlp on cuda").
inline absl::StatusOr<int> CudaDeviceCount(absl::string_view what) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(what, ": no CUDA device"));
  }
  return count;
}

}  // namespace muonmesh::cuda
