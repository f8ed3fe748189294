#include "worker/cuda/row_major_gemm.h"

#include "worker/cuda/cuda_checks.h"

namespace muonmesh::cuda {

absl::Status RowMajorSgemm(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n,
                           int64_t k, float alpha, const float* a, const float* b, float beta,
                           float* c) {
  if (m == 0 || n == 0) return absl::OkStatus();
  MUONMESH_CUBLAS_CHECK(cublasSgemm(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
      static_cast<int>(trans_b ? k : n), a, static_cast<int>(trans_a ? m : k), &beta, c,
      static_cast<int>(n)));
  return absl::OkStatus();
}

absl::Status RowMajorSgemmStridedBatched(cublasHandle_t handle, bool trans_a, bool trans_b,
                                         int64_t m, int64_t n, int64_t k, float alpha,
                                         const float* a, int64_t lda, int64_t stride_a,
                                         const float* b, int64_t ldb, int64_t stride_b, float beta,
                                         float* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  MUONMESH_CUBLAS_CHECK(cublasSgemmStridedBatched(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
      static_cast<int>(ldb), stride_b, a, static_cast<int>(lda), stride_a, &beta, c,
      static_cast<int>(ldc), stride_c, static_cast<int>(batch)));
  return absl::OkStatus();
}

}  // namespace muonmesh::cuda
