#pragma once

// cublasSgemm for row-major matrices: C[m, n] = alpha op(A) op(B) + beta C,
// op(A) = A [m, k] or, transposed, A [k, m]; op(B) = B [k, n] or B [n, k]
// (the arguments of cblas_sgemm with CblasRowMajor). Row-major C is
// column-major C^T = op(B)^T op(A)^T, so the operands swap places.

#include <cublas_v2.h>

#include <cstdint>

#include "absl/status/status.h"

namespace muonmesh::cuda {

absl::Status RowMajorSgemm(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n,
                           int64_t k, float alpha, const float* a, const float* b, float beta,
                           float* c);

// `batch` such products with explicit row strides (leading dimensions of
// the row-major operands) lda, ldb, ldc: product i takes a + i stride_a,
// b + i stride_b and writes c + i stride_c (cublasSgemmStridedBatched). The
// attention's per-head products read heads as column blocks of one matrix
// this way.
absl::Status RowMajorSgemmStridedBatched(cublasHandle_t handle, bool trans_a, bool trans_b,
                                         int64_t m, int64_t n, int64_t k, float alpha,
                                         const float* a, int64_t lda, int64_t stride_a,
                                         const float* b, int64_t ldb, int64_t stride_b, float beta,
                                         float* c, int64_t ldc, int64_t stride_c, int64_t batch);

}  // namespace muonmesh::cuda
