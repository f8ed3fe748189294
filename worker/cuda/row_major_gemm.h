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

}  // namespace muonmesh::cuda
