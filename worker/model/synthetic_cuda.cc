#include "worker/model/synthetic_cuda.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/cuda/cuda_checks.h"
#include "worker/cuda/ns_kernels.h"
#include "worker/cuda/uniform_kernels.h"
#include "worker/model/rng.h"

namespace muonmesh::worker {
namespace {
// Floats of the scratch for the other groups' expert slices (the loss sums
// whole stacks), generated a chunk at a time.
constexpr int64_t kScratch = int64_t{1} << 22;
}  // namespace

absl::StatusOr<std::unique_ptr<CudaSynthetic>> CudaSynthetic::Create(Synthetic synthetic) {
  MUONMESH_RETURN_IF_ERROR(cuda::CudaDeviceCount("synthetic on cuda").status());
  cudaStream_t stream = nullptr;
  MUONMESH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* partial = nullptr;
  void* sums = nullptr;
  void* scratch = nullptr;
  cudaError_t e = cudaMalloc(&partial, sizeof(double) * cuda::internal::kReduceBlocks);
  if (e == cudaSuccess) e = cudaMalloc(&sums, sizeof(double));
  if (e == cudaSuccess) e = cudaMalloc(&scratch, sizeof(float) * kScratch);
  if (e != cudaSuccess) {
    cudaFree(partial);
    cudaFree(sums);
    cudaFree(scratch);
    cudaStreamDestroy(stream);
    return cuda::CudaErrorToStatus(e, "cudaMalloc (synthetic scratch)", __FILE__, __LINE__);
  }
  return std::unique_ptr<CudaSynthetic>(
      new CudaSynthetic(std::move(synthetic), stream, static_cast<double*>(partial),
                        static_cast<double*>(sums), static_cast<float*>(scratch)));
}

CudaSynthetic::CudaSynthetic(Synthetic cpu, cudaStream_t stream, double* partial, double* sums,
                             float* scratch)
    : CudaWorkload(std::move(cpu)),
      stream_(stream),
      partial_(partial),
      sums_(sums),
      scratch_(scratch) {}

CudaSynthetic::~CudaSynthetic() {
  cudaFree(partial_);
  cudaFree(sums_);
  cudaFree(scratch_);
  cudaStreamDestroy(stream_);
}

absl::StatusOr<double> CudaSynthetic::SumSquares(const float* x, int64_t count) {
  if (count <= 0) return 0.0;
  MUONMESH_CUDA_CHECK(cuda::internal::LaunchSumSquares(x, count, partial_, sums_, 0, 0.0,
                                                       nullptr, stream_));
  double sum = 0;
  MUONMESH_CUDA_CHECK(
      cudaMemcpyAsync(&sum, sums_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return sum;
}

absl::StatusOr<double> CudaSynthetic::ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                                            absl::Span<const int64_t> samples) {
  const plan::ModelSpec& spec = cpu_.spec();
  const int64_t ep = units.expert_parallel_size();
  MUONMESH_RETURN_IF_ERROR(cpu_.CheckByUnitCall(step, samples, ep));
  const std::vector<int64_t>& elements = cpu_.param_elements();
  const uint64_t seed =
      cpu_.gradient_seed() ^ (static_cast<uint64_t>(step) * kSplitMix64Gamma);
  double sum = 0.0;
  size_t p = 0;
  for (size_t u = 0; u < spec.units.size(); ++u) {
    const size_t count = spec.units[u].params.size();
    MUONMESH_RETURN_IF_ERROR(units.Acquire(static_cast<int>(u)).status());
    units.Release(static_cast<int>(u));
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> grads,
                              units.GradientBuffers(static_cast<int>(u)));
    if (grads.size() != count) {
      return absl::InvalidArgumentError(absl::StrCat("synthetic: unit ", u, " has ", grads.size(),
                                                     " gradient buffers, expected ", count));
    }
    for (size_t j = 0; j < count; ++j, ++p) {
      const uint64_t key = UniformStream(seed, p).key();
      const bool split = spec.units[u].params[j].expert && ep > 1;
      const int64_t local = split ? elements[p] / ep : elements[p];
      const int64_t first = split ? local * units.expert_parallel_index() : 0;
      MUONMESH_CUDA_CHECK(cuda::internal::LaunchUniformFill(
          key, static_cast<uint64_t>(first), local, kSyntheticGradientScale, grads[j], stream_));
      if (!split) {
        MUONMESH_ASSIGN_OR_RETURN(double s, SumSquares(grads[j], local));
        sum += s;
        continue;
      }
      // The loss covers the whole stack: the other groups' slices too.
      for (int64_t k = 0; k < elements[p]; k += kScratch) {
        const int64_t n = std::min(kScratch, elements[p] - k);
        MUONMESH_CUDA_CHECK(cuda::internal::LaunchUniformFill(
            key, static_cast<uint64_t>(k), n, kSyntheticGradientScale, scratch_, stream_));
        MUONMESH_ASSIGN_OR_RETURN(double s, SumSquares(scratch_, n));
        sum += s;
      }
    }
    MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    MUONMESH_RETURN_IF_ERROR(units.Commit(static_cast<int>(u)));
  }
  return 0.5 * sum / static_cast<double>(cpu_.total_elements());
}

}  // namespace muonmesh::worker
