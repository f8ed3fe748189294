// CUDA Newton-Schulz effective FLOP/s against cuBLAS bf16 GEMM FLOP/s, in one
// process on one GPU. Not a test and not Google Benchmark (Debian ships that
// only as a shared library, and this binary must run on a bare GPU machine).
//
//   BM_NewtonSchulz/<rows>/<cols>: CudaNewtonSchulz::Run, 5 quintic steps,
//       FLOPS = T (4 m^2 n + 2 m^3), m = min(rows, cols); wall-clock per call
//       (Run synchronises its stream, so a call is complete when it returns).
//   BM_NewtonSchulzGram/<rows>/<cols>: the same with ns_algorithm gram
//       (fp32 m x m recurrence), FLOPS counted the same standard way, so the
//       two are comparable (issue 13's target: >= 1.5x the bf16 GEMM at 1:4).
//   BM_CublasGemmBf16/<m>/<n>/<k>: cublasGemmEx, bf16 A, B and C, fp32
//       compute, FLOPS = 2 m n k, timed with CUDA events over back-to-back
//       calls, on random inputs as Newton-Schulz's are (also timed on
//       constant ones, which run faster on less power). For an m x n
//       Newton-Schulz the comparison is m/m/n (X X^T).
//   Each standard call is also split into one iteration and the rest (from
//   the same call timed with 1 and with 5 iterations).
//
// Prints one line per benchmark and a ratio table; target >= 0.8 at
// 4096 x 4096 and larger. Usage: newton_schulz_cuda_benchmark [--quick]

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "worker/cuda/newton_schulz_cuda.h"
#include "core/optim/ns_coefficients.h"

namespace {

#define BENCH_CHECK(expr)                                                              \
  do {                                                                                 \
    if (!(expr)) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s failed\n", __FILE__, __LINE__, #expr);           \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

constexpr int kSteps = 5;

// Repetitions so that each measurement covers about `target_seconds`.
int RepsFor(double seconds_per_call, double target_seconds) {
  return static_cast<int>(std::clamp(target_seconds / std::max(seconds_per_call, 1e-6), 3.0, 200.0));
}

double TimeNewtonSchulz(muonmesh::cuda::CudaNewtonSchulz& ns, int64_t rows, int64_t cols,
                        double target_seconds, muonmesh::plan::NsAlgorithm algorithm,
                        int steps = kSteps) {
  const size_t count = static_cast<size_t>(rows * cols);
  std::vector<float> host(count);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& v : host) v = dist(rng);
  float* x = nullptr;
  BENCH_CHECK(cudaMalloc(&x, count * sizeof(float)) == cudaSuccess);
  BENCH_CHECK(cudaMemcpy(x, host.data(), count * sizeof(float), cudaMemcpyHostToDevice) ==
              cudaSuccess);
  muonmesh::optim::NsOptions options;
  options.steps = steps;
  options.algorithm = algorithm;
  BENCH_CHECK(ns.Reserve(rows, cols).ok());
  // Warm-up (cuBLAS heuristics, workspace), and a first estimate.
  BENCH_CHECK(ns.Run(x, rows, cols, options).ok());
  auto t0 = std::chrono::steady_clock::now();
  BENCH_CHECK(ns.Run(x, rows, cols, options).ok());
  const double first = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int reps = RepsFor(first, target_seconds);
  // The input is re-normalised every call, so running on the previous
  // output costs exactly what a fresh input costs.
  t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) BENCH_CHECK(ns.Run(x, rows, cols, options).ok());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  cudaFree(x);
  return seconds;
}

// `count` bf16 values uniform in [-1, 1), from a xorshift generator (fast
// enough for the largest shapes), copied to the device.
void FillRandomBf16(__nv_bfloat16* device, size_t count, uint64_t seed) {
  std::vector<__nv_bfloat16> host(count);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (__nv_bfloat16& v : host) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    v = __float2bfloat16(static_cast<float>(state >> 40) / 8388608.0f - 1.0f);
  }
  BENCH_CHECK(cudaMemcpy(device, host.data(), count * sizeof(__nv_bfloat16),
                         cudaMemcpyHostToDevice) == cudaSuccess);
}

// Seconds per row-major (m x k)(k x n) bf16 GEMM. `random` fills the inputs
// with random values, as Newton-Schulz's are; else with one constant, on
// which the tensor cores draw less power and can run faster.
double TimeGemm(cublasHandle_t handle, int m, int n, int k, double target_seconds, bool random) {
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  const size_t a_count = static_cast<size_t>(m) * k, b_count = static_cast<size_t>(k) * n;
  BENCH_CHECK(cudaMalloc(&a, sizeof(__nv_bfloat16) * a_count) == cudaSuccess);
  BENCH_CHECK(cudaMalloc(&b, sizeof(__nv_bfloat16) * b_count) == cudaSuccess);
  BENCH_CHECK(cudaMalloc(&c, sizeof(__nv_bfloat16) * m * static_cast<size_t>(n)) == cudaSuccess);
  if (random) {
    FillRandomBf16(a, a_count, 1);
    FillRandomBf16(b, b_count, 2);
  } else {
    BENCH_CHECK(cudaMemset(a, 0x3c, sizeof(__nv_bfloat16) * a_count) == cudaSuccess);
    BENCH_CHECK(cudaMemset(b, 0x3c, sizeof(__nv_bfloat16) * b_count) == cudaSuccess);
  }
  const float one = 1.0f, zero = 0.0f;
  auto gemm = [&] {
    // Row-major C (m x n) = A (m x k) B (k x n), as column-major C^T = B^T A^T.
    BENCH_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, n,
                             a, CUDA_R_16BF, k, &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  };
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start) == cudaSuccess);
  BENCH_CHECK(cudaEventCreate(&stop) == cudaSuccess);
  for (int i = 0; i < 3; ++i) gemm();
  BENCH_CHECK(cudaEventRecord(start) == cudaSuccess);
  gemm();
  BENCH_CHECK(cudaEventRecord(stop) == cudaSuccess);
  BENCH_CHECK(cudaEventSynchronize(stop) == cudaSuccess);
  float ms = 0.0f;
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop) == cudaSuccess);
  const int reps = RepsFor(ms / 1e3, target_seconds);
  BENCH_CHECK(cudaEventRecord(start) == cudaSuccess);
  for (int r = 0; r < reps; ++r) gemm();
  BENCH_CHECK(cudaEventRecord(stop) == cudaSuccess);
  BENCH_CHECK(cudaEventSynchronize(stop) == cudaSuccess);
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop) == cudaSuccess);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return ms / 1e3 / reps;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("newton_schulz_cuda_benchmark: no CUDA device, nothing to measure\n");
    return 77;
  }
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0) == cudaSuccess);
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf("device: %s, %d SMs, sm_%d%d; CUDA runtime %d, driver %d\n", prop.name,
              prop.multiProcessorCount, prop.major, prop.minor, runtime, driver);

  auto created = muonmesh::cuda::CudaNewtonSchulz::Create();
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<muonmesh::cuda::CudaNewtonSchulz> ns = std::move(*created);
  cublasHandle_t handle;
  BENCH_CHECK(cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS);

  std::vector<std::pair<int64_t, int64_t>> shapes = {
      {768, 3072},   {1024, 1024},  {1024, 4096}, {4096, 4096},
      {4096, 14336}, {7168, 18432}, {4096, 16384}, {8192, 8192}};
  if (quick) shapes.resize(4);
  const double target = quick ? 0.2 : 0.5;

  struct Row {
    std::string ns_name, gemm_name;
    double ns_flops, gram_flops, gemm_flops, constant_gemm_flops;
    double step_ms, outside_ms;  // one standard iteration; the rest of a call
  };
  std::vector<Row> rows;
  std::printf("%-34s %12s %14s\n", "benchmark", "ms/call", "TFLOP/s");
  for (const auto& [r, c] : shapes) {
    const int64_t m = std::min(r, c), n = std::max(r, c);
    const std::string shape = std::to_string(r) + "/" + std::to_string(c);
    double flops[2], seconds[2];
    for (int gram = 0; gram < 2; ++gram) {
      seconds[gram] =
          TimeNewtonSchulz(*ns, r, c, target,
                           gram ? muonmesh::plan::NsAlgorithm::kGram
                                : muonmesh::plan::NsAlgorithm::kStandard);
      flops[gram] = muonmesh::optim::NewtonSchulzFlops(r, c, kSteps) / seconds[gram];
      std::printf("%-34s %12.3f %14.1f\n",
                  ((gram ? "BM_NewtonSchulzGram/" : "BM_NewtonSchulz/") + shape).c_str(),
                  seconds[gram] * 1e3, flops[gram] / 1e12);
    }
    // One iteration, and what a call spends outside its iterations
    // (normalisation, copies, the finiteness check): T5 = 5 s + o, T1 = s + o.
    const double one_step = TimeNewtonSchulz(*ns, r, c, target,
                                             muonmesh::plan::NsAlgorithm::kStandard, 1);
    const double step = (seconds[0] - one_step) / (kSteps - 1);
    const std::string ns_name = "BM_NewtonSchulz/" + shape;
    double gemm_flops[2];
    for (int random = 0; random < 2; ++random) {
      gemm_flops[random] = 2.0 * m * m * n /
                           TimeGemm(handle, static_cast<int>(m), static_cast<int>(m),
                                    static_cast<int>(n), target, random == 1);
    }
    const std::string gemm_name = "BM_CublasGemmBf16/" + std::to_string(m) + "/" +
                                  std::to_string(m) + "/" + std::to_string(n);
    std::printf("%-34s %12.3f %14.1f\n", gemm_name.c_str(), 2e3 * m * m * n / gemm_flops[1],
                gemm_flops[1] / 1e12);
    rows.push_back({ns_name, gemm_name, flops[0], flops[1], gemm_flops[1], gemm_flops[0],
                    step * 1e3, (one_step - step) * 1e3});
  }
  std::printf("\nRatios to the bf16 GEMM of X X^T's shape on random inputs (the one above);\n"
              "'constant' is that GEMM on constant inputs against random ones; 'step' is one\n"
              "standard iteration, 'outside' the rest of a standard call, in ms.\n");
  std::printf("%-28s %-32s %8s %8s %8s %8s %8s\n", "Newton-Schulz", "bf16 GEMM (X X^T shape)",
              "standard", "gram", "constant", "step", "outside");
  for (const Row& row : rows) {
    std::printf("%-28s %-32s %8.3f %8.3f %8.3f %8.4f %8.4f\n", row.ns_name.c_str(),
                row.gemm_name.c_str(), row.ns_flops / row.gemm_flops,
                row.gram_flops / row.gemm_flops, row.constant_gemm_flops / row.gemm_flops,
                row.step_ms, row.outside_ms);
  }
  cublasDestroy(handle);
  return 0;
}
