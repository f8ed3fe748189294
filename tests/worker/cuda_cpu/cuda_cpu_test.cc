// The CPU stand-in for CUDA (README.md in this folder) against products
// worked out by hand, so that newton_schulz_cuda_cpu_test checks the CUDA
// host code against cuBLAS's semantics and not against the stand-in's.

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "worker/cuda/mlp_kernels.h"
#include "worker/cuda/ns_kernels.h"

namespace {

// A device copy of host floats, freed on scope exit.
struct Device {
  explicit Device(const std::vector<float>& host) : size(host.size()) {
    EXPECT_EQ(cudaMalloc(&data, size * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host.data(), size * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~Device() { cudaFree(data); }
  std::vector<float> Host() const {
    std::vector<float> out(size);
    EXPECT_EQ(cudaMemcpy(out.data(), data, size * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }
  float* data = nullptr;
  size_t size;
};

class CudaCpuTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS); }
  void TearDown() override { cublasDestroy(handle_); }
  cublasHandle_t handle_ = nullptr;
  const float one_ = 1.0f, zero_ = 0.0f;
};

// Column-major A (2 x 3) = [1 2 3; 4 5 6] is stored 1 4 2 5 3 6; B (3 x 2) =
// [1 0; 0 1; 1 1] is stored 1 0 1 0 1 1. A B = [4 5; 10 11], stored 4 10 5 11.
TEST_F(CudaCpuTest, SgemmIsColumnMajor) {
  Device a({1, 4, 2, 5, 3, 6}), b({1, 0, 1, 0, 1, 1}), c({0, 0, 0, 0});
  ASSERT_EQ(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one_, a.data, 2, b.data, 3,
                        &zero_, c.data, 2),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(c.Host(), (std::vector<float>{4, 10, 5, 11}));
  // A^T A (3 x 3) from the same storage: [17 22 27; 22 29 36; 27 36 45].
  Device d(std::vector<float>(9, -1.0f));
  ASSERT_EQ(cublasSgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, 3, 3, 2, &one_, a.data, 2, a.data, 2,
                        &zero_, d.data, 3),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(d.Host(), (std::vector<float>{17, 22, 27, 22, 29, 36, 27, 36, 45}));
}

// A leading dimension larger than the rows skips the padding; beta
// accumulates; a leading dimension smaller than op(A)'s rows is refused.
TEST_F(CudaCpuTest, LeadingDimensionsAndBeta) {
  // A (2 x 2) = [1 2; 3 4] with lda 3 (one padding element per column).
  Device a({1, 3, 99, 2, 4, 99}), b({1, 0, 0, 1}), c({10, 20, 30, 40});
  const float two = 2.0f;
  ASSERT_EQ(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one_, a.data, 3, b.data, 2,
                        &two, c.data, 2),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(c.Host(), (std::vector<float>{21, 43, 62, 84}));
  EXPECT_EQ(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one_, a.data, 1, b.data, 2,
                        &zero_, c.data, 2),
            CUBLAS_STATUS_INVALID_VALUE);
}

// A strided batch is that many products, each operand offset by its
// stride: here two 1 x 1 products with k = 2 whose A and B rows interleave
// in one buffer (stride 1, leading dimension 2), as the attention reads
// heads. Batch 0: [1 3] [5 7]^T = 26; batch 1: [2 4] [6 8]^T = 44.
TEST_F(CudaCpuTest, StridedBatchOffsetsEachProduct) {
  Device a({1, 2, 3, 4}), b({5, 6, 7, 8}), c({-1, -1});
  // A (m x k = 1 x 2) at a + i, ld 2: elements a[i], a[i + 2]; B^T stored
  // as n x k = 1 x 2 the same way.
  ASSERT_EQ(cublasSgemmStridedBatched(handle_, CUBLAS_OP_N, CUBLAS_OP_T, 1, 1, 2, &one_, a.data, 2,
                                      1, b.data, 2, 1, &zero_, c.data, 1, 1, 2),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(c.Host(), (std::vector<float>{26, 44}));
  // A batch whose last product reads past the buffer is refused.
  EXPECT_EQ(cublasSgemmStridedBatched(handle_, CUBLAS_OP_N, CUBLAS_OP_T, 1, 1, 2, &one_, a.data, 2,
                                      1, b.data, 2, 1, &zero_, c.data, 1, 1, 3),
            CUBLAS_STATUS_INVALID_VALUE);
}

// Operands must lie inside device allocations, and a product's output may
// not overlap its inputs.
TEST_F(CudaCpuTest, BoundsAndOverlapRefused) {
  Device a({1, 2, 3, 4}), c({0, 0, 0, 0});
  std::vector<float> host = {1, 2, 3, 4};
  EXPECT_EQ(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one_, host.data(), 2, a.data,
                        2, &zero_, c.data, 2),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 3, 2, &one_, a.data, 2, a.data, 2,
                        &zero_, c.data, 2),  // B would be 2 x 3: past a's end
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one_, a.data, 2, c.data, 2,
                        &zero_, a.data, 2),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cudaMemcpy(host.data(), a.data, 4 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);  // the kind says the other way round
}

// geam in place as cuBLAS allows it (C = A, same ld, no transpose), and
// not otherwise.
TEST_F(CudaCpuTest, GeamInPlace) {
  Device a({1, 2, 3, 4}), b({10, 20, 30, 40});
  const float half = 0.5f;
  ASSERT_EQ(cublasSgeam(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, &one_, a.data, 2, &half, b.data,
                        2, a.data, 2),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(a.Host(), (std::vector<float>{6, 12, 18, 24}));
  EXPECT_EQ(cublasSgeam(handle_, CUBLAS_OP_T, CUBLAS_OP_N, 2, 2, &one_, a.data, 2, &half, b.data,
                        2, a.data, 2),
            CUBLAS_STATUS_INVALID_VALUE);
}

// bf16 rounds to nearest, ties to even: 1 + 2^-8 is a tie between 1 and
// 1 + 2^-7 and goes to 1; 1 + 3 * 2^-8 goes to 1 + 2^-6. GemmEx with bf16
// inputs and a bf16 output rounds the fp32 result once.
TEST_F(CudaCpuTest, Bf16RoundingAndGemmEx) {
  EXPECT_EQ(__bfloat162float(__float2bfloat16_rn(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(__bfloat162float(__float2bfloat16_rn(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);
  EXPECT_EQ(__bfloat162float(__float2bfloat16_rn(-2.5f)), -2.5f);
  // [1 1] . [1; 2^-8] = 1 + 2^-8: kept in an fp32 output, rounded to 1 in a
  // bf16 one.
  std::vector<__nv_bfloat16> host = {__float2bfloat16_rn(1.0f), __float2bfloat16_rn(1.0f),
                                     __float2bfloat16_rn(1.0f), __float2bfloat16_rn(1.0f / 256)};
  void* in = nullptr;
  void* out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, 4 * sizeof(__nv_bfloat16)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(in, host.data(), 4 * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice),
            cudaSuccess);
  const auto* x = static_cast<const __nv_bfloat16*>(in);
  for (cudaDataType_t type : {CUDA_R_32F, CUDA_R_16BF}) {
    ASSERT_EQ(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 2, &one_, x, CUDA_R_16BF, 1,
                           x + 2, CUDA_R_16BF, 2, &zero_, out, type, 1, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
    float result = 0;
    if (type == CUDA_R_32F) {
      ASSERT_EQ(cudaMemcpy(&result, out, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(result, 1.0f + 1.0f / 256);
    } else {
      __nv_bfloat16 b;
      ASSERT_EQ(cudaMemcpy(&b, out, sizeof b, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(__bfloat162float(b), 1.0f);
    }
  }
  cudaFree(in);
  cudaFree(out);
  EXPECT_EQ(cuda_cpu::LiveAllocations(), 0u);
}

// NaN stays NaN (CUDA's canonical 0x7fff), and a float past bf16's largest
// finite value (about 3.39e38) rounds to infinity.
TEST_F(CudaCpuTest, Bf16NanAndOverflow) {
  EXPECT_EQ(__float2bfloat16_rn(std::nanf("")).bits, 0x7fff);
  EXPECT_EQ(__bfloat162float(__float2bfloat16_rn(3.4e38f)), INFINITY);
}

// beta == 0: C is not read, so a NaN there (fresh cudaMalloc memory holds
// NaNs in the stand-in) does not reach the result; A^T B^T with both
// transposed.
TEST_F(CudaCpuTest, BetaZeroIgnoresCAndBothTransposed) {
  Device a({1, 2, 3, 4}), b({5, 6, 7, 8});  // A = [1 3; 2 4], B = [5 7; 6 8]
  float* c = nullptr;
  ASSERT_EQ(cudaMalloc(&c, 4 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cublasSgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_T, 2, 2, 2, &one_, a.data, 2, b.data, 2,
                        &zero_, c, 2),
            CUBLAS_STATUS_SUCCESS);
  std::vector<float> got(4);
  ASSERT_EQ(cudaMemcpy(got.data(), c, 4 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  // A^T = [1 2; 3 4], B^T = [5 6; 7 8]: A^T B^T = [19 22; 43 50], stored 19 43 22 50.
  EXPECT_EQ(got, (std::vector<float>{19, 43, 22, 50}));
  cudaFree(c);
}

// The kernels refuse what would read or write outside memory, race, or
// fail to launch on a GPU.
TEST_F(CudaCpuTest, KernelsRefuseBadRowsAndGrids) {
  namespace k = muonmesh::cuda::internal;
  Device src({1, 2, 3, 4}), dst({0, 0, 0, 0});
  int64_t* rows = nullptr;
  ASSERT_EQ(cudaMalloc(&rows, 2 * sizeof(int64_t)), cudaSuccess);
  const int64_t negative[2] = {0, -1}, repeated[2] = {1, 1}, fine[2] = {1, 0};
  ASSERT_EQ(cudaMemcpy(rows, negative, sizeof negative, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(k::LaunchGatherRows(src.data, rows, 2, 2, dst.data, nullptr), cudaErrorIllegalAddress);
  ASSERT_EQ(cudaMemcpy(rows, repeated, sizeof repeated, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(k::LaunchScatterAddRows(src.data, rows, 2, 2, dst.data, nullptr),
            cudaErrorInvalidValue);
  ASSERT_EQ(cudaMemcpy(rows, fine, sizeof fine, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(k::LaunchGatherRows(src.data, rows, 2, 2, dst.data, nullptr), cudaSuccess);
  EXPECT_EQ(dst.Host(), (std::vector<float>{3, 4, 1, 2}));
  EXPECT_EQ(k::LaunchTranspose(src.data, 0, 4, dst.data, nullptr), cudaErrorInvalidConfiguration);
  cudaFree(rows);
}

}  // namespace
