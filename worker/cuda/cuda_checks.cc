#include "worker/cuda/cuda_checks.h"

#include <string>

namespace muonmesh::cuda {
namespace {

std::string Where(const char* expr, const char* file, int line) {
  return std::string(file) + ":" + std::to_string(line) + ": " + expr + ": ";
}

}  // namespace

absl::Status CublasErrorToStatus(cublasStatus_t error, const char* expr, const char* file,
                                 int line) {
  const std::string message = Where(expr, file, line) + cublasGetStatusName(error) + " (" +
                              cublasGetStatusString(error) + ")";
  switch (error) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace muonmesh::cuda
