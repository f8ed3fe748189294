// CPU stand-in for the CUDA runtime, cuBLAS and the Newton-Schulz kernels of
// worker/cuda/ns_kernels.h (README.md in this folder).

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <vector>


struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace {

// What the stand-in keeps: live cudaMalloc allocations (start address ->
// bytes) and streams with work pending (-> how much), under one mutex.
struct State {
  std::mutex mu;
  std::map<uintptr_t, size_t> allocations;
  std::map<cudaStream_t, int> pending;
};

State& TheState() {
  static State state;
  return state;
}

bool InDeviceLocked(const void* p, size_t bytes) {
  const auto& reg = TheState().allocations;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = reg.upper_bound(a);
  if (it == reg.begin()) return false;
  --it;
  return a >= it->first && a - it->first <= it->second && bytes <= it->second - (a - it->first);
}


// Bytes a column-major rows x cols operand with leading dimension ld spans.
size_t Extent(int rows, int cols, int ld, size_t element) {
  if (rows <= 0 || cols <= 0) return 0;
  return (static_cast<size_t>(cols - 1) * static_cast<size_t>(ld) + static_cast<size_t>(rows)) *
         element;
}

size_t ElementSize(cudaDataType_t type) { return type == CUDA_R_16BF ? 2 : 4; }

float Load(const void* p, cudaDataType_t type, size_t i) {
  if (type == CUDA_R_16BF) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

void Store(void* p, cudaDataType_t type, size_t i, float v) {
  if (type == CUDA_R_16BF) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// op(x) as a dense column-major rows x cols float matrix.
std::vector<float> Dense(const void* x, cudaDataType_t type, int ld, cublasOperation_t op,
                         int rows, int cols) {
  std::vector<float> out(static_cast<size_t>(rows) * static_cast<size_t>(cols));
  for (int j = 0; j < cols; ++j) {
    for (int i = 0; i < rows; ++i) {
      const size_t at = op == CUBLAS_OP_N
                            ? static_cast<size_t>(i) + static_cast<size_t>(j) * ld
                            : static_cast<size_t>(j) + static_cast<size_t>(i) * ld;
      out[static_cast<size_t>(i) + static_cast<size_t>(j) * rows] = Load(x, type, at);
    }
  }
  return out;
}

// C = alpha op(A) op(B) + beta C, column-major, fp32 accumulation in order
// of the inner index; C is not read when beta is 0 (as in cuBLAS).
cublasStatus_t Gemm(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                    float alpha, const void* a, cudaDataType_t atype, int lda, const void* b,
                    cudaDataType_t btype, int ldb, float beta, void* c, cudaDataType_t ctype,
                    int ldc) {
  const int a_rows = transa == CUBLAS_OP_N ? m : k, a_cols = transa == CUBLAS_OP_N ? k : m;
  const int b_rows = transb == CUBLAS_OP_N ? k : n, b_cols = transb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) ||
      ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const size_t a_bytes = Extent(a_rows, a_cols, lda, ElementSize(atype));
  const size_t b_bytes = Extent(b_rows, b_cols, ldb, ElementSize(btype));
  const size_t c_bytes = Extent(m, n, ldc, ElementSize(ctype));
  if ((a_bytes > 0 && !cuda_cpu::InDevice(a, a_bytes)) ||
      (b_bytes > 0 && !cuda_cpu::InDevice(b, b_bytes)) ||
      (c_bytes > 0 && !cuda_cpu::InDevice(c, c_bytes))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (cuda_cpu::Overlaps(c, c_bytes, a, a_bytes) || cuda_cpu::Overlaps(c, c_bytes, b, b_bytes)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // alpha == 0: C = beta C, A and B not read (as in reference BLAS).
  const std::vector<float> da = alpha == 0.0f ? std::vector<float>(static_cast<size_t>(m) * k)
                                              : Dense(a, atype, lda, transa, m, k);
  const std::vector<float> db = alpha == 0.0f ? std::vector<float>(static_cast<size_t>(k) * n)
                                              : Dense(b, btype, ldb, transb, k, n);
  std::vector<float> acc(static_cast<size_t>(m));
  for (int j = 0; j < n; ++j) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int l = 0; l < k; ++l) {
      const float blj = db[static_cast<size_t>(l) + static_cast<size_t>(j) * k];
      const float* col = da.data() + static_cast<size_t>(l) * m;
      for (int i = 0; i < m; ++i) acc[i] = std::fma(col[i], blj, acc[i]);
    }
    for (int i = 0; i < m; ++i) {
      const size_t at = static_cast<size_t>(i) + static_cast<size_t>(j) * ldc;
      const float old = beta == 0.0f ? 0.0f : beta * Load(c, ctype, at);
      Store(c, ctype, at, alpha == 0.0f ? old : alpha * acc[i] + old);
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

namespace cuda_cpu {

bool InDevice(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(TheState().mu);
  return InDeviceLocked(p, bytes);
}

bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

size_t LiveAllocations() {
  std::lock_guard<std::mutex> lock(TheState().mu);
  return TheState().allocations.size();
}

}  // namespace cuda_cpu

cudaError_t cudaGetDeviceCount(int* count) {
  *count = cuda_cpu::kDevices;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(256), std::nothrow);
  if (p == nullptr) return cudaErrorMemoryAllocation;
  // cudaMalloc's memory is uninitialised: all ones (NaN as fp32, bf16 and
  // fp64), so that reading it before writing shows.
  std::memset(p, 0xff, bytes);
  std::lock_guard<std::mutex> lock(TheState().mu);
  TheState().allocations[reinterpret_cast<uintptr_t>(p)] = bytes;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(TheState().mu);
    if (TheState().allocations.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
      return cudaErrorInvalidValue;
    }
  }
  ::operator delete(ptr, std::align_val_t(256));
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  *ptr = ::operator new(std::max<size_t>(bytes, 1), std::nothrow);
  return *ptr == nullptr ? cudaErrorMemoryAllocation : cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  ::operator delete(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return cudaSuccess;
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  // Each side must be what the kind says: inside an allocation, or wholly
  // outside every one.
  if (cuda_cpu::InDevice(dst, bytes) != dst_device ||
      cuda_cpu::InDevice(src, bytes) != src_device ||
      (!dst_device && cuda_cpu::InDevice(dst, 1)) || (!src_device && cuda_cpu::InDevice(src, 1))) {
    return cudaErrorInvalidValue;
  }
  // Stricter than CUDA, which does not check: a partial overlap is refused.
  if (dst == src) return cudaSuccess;
  if (cuda_cpu::Overlaps(dst, bytes, src, bytes)) return cudaErrorInvalidValue;
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t) {
  if (width == 0 || height == 0) return cudaSuccess;
  if (width > dpitch || width > spitch) return cudaErrorInvalidValue;
  // Each side's whole span must be what the kind says (device or host).
  const size_t dst_span = (height - 1) * dpitch + width, src_span = (height - 1) * spitch + width;
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (cuda_cpu::InDevice(dst, dst_span) != dst_device ||
      cuda_cpu::InDevice(src, src_span) != src_device ||
      (!dst_device && cuda_cpu::InDevice(dst, 1)) || (!src_device && cuda_cpu::InDevice(src, 1)) ||
      cuda_cpu::Overlaps(dst, dst_span, src, src_span)) {
    return cudaErrorInvalidValue;
  }
  for (size_t r = 0; r < height; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                width);
  }
  return cudaSuccess;
}

cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  if (!cuda_cpu::InDevice(dst, bytes)) return cudaErrorInvalidValue;
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  return cudaMemset(dst, value, bytes);
}

namespace {
thread_local int current_device = 0;
}  // namespace

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= cuda_cpu::kDevices) return cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}

// A stream is a distinct non-null handle that the stand-in never reads.
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = reinterpret_cast<cudaStream_t>(new char);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  return cudaStreamCreate(stream);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete reinterpret_cast<char*>(stream);
  return cudaSuccess;
}

namespace {

int PendingOn(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(TheState().mu);
  auto it = TheState().pending.find(stream);
  return it == TheState().pending.end() ? 0 : it->second;
}

}  // namespace

void cuda_cpu::AddPendingWork(cudaStream_t stream, int delta) {
  std::lock_guard<std::mutex> lock(TheState().mu);
  int& n = TheState().pending[stream];
  n += delta;
  if (n <= 0) TheState().pending.erase(stream);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  return PendingOn(stream) > 0 ? cudaErrorNotReady : cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  while (PendingOn(stream) > 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNoKernelImageForDevice:
      return "cudaErrorNoKernelImageForDevice";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) { return cudaGetErrorName(error); }

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode(cublasHandle_t, cublasPointerMode_t mode) {
  return mode == CUBLAS_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) { return cublasGetStatusName(status); }

cublasStatus_t cublasSgemm(cublasHandle_t, cublasOperation_t transa, cublasOperation_t transb,
                           int m, int n, int k, const float* alpha, const float* a, int lda,
                           const float* b, int ldb, const float* beta, float* c, int ldc) {
  return Gemm(transa, transb, m, n, k, *alpha, a, CUDA_R_32F, lda, b, CUDA_R_32F, ldb, *beta, c,
              CUDA_R_32F, ldc);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const float* alpha, const float* a, int lda,
                                         long long stride_a, const float* b, int ldb,
                                         long long stride_b, const float* beta, float* c, int ldc,
                                         long long stride_c, int batch) {
  if (batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  // Each product as cublasSgemm, its own checks included (every operand
  // inside an allocation, no output overlapping its inputs).
  for (int i = 0; i < batch; ++i) {
    const cublasStatus_t st =
        Gemm(transa, transb, m, n, k, *alpha, a + i * stride_a, CUDA_R_32F, lda, b + i * stride_b,
             CUDA_R_32F, ldb, *beta, c + i * stride_c, CUDA_R_32F, ldc);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t transa, cublasOperation_t transb,
                            int m, int n, int k, const void* alpha, const void* a,
                            cudaDataType_t atype, int lda, const void* b, cudaDataType_t btype,
                            int ldb, const void* beta, void* c, cudaDataType_t ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
  // The combinations cuBLAS documents for CUBLAS_COMPUTE_32F that this code
  // uses: bf16 x bf16 -> bf16 or fp32, and fp32 throughout.
  if (compute != CUBLAS_COMPUTE_32F || atype != btype ||
      (atype == CUDA_R_32F && ctype != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return Gemm(transa, transb, m, n, k, *static_cast<const float*>(alpha), a, atype, lda, b, btype,
              ldb, *static_cast<const float*>(beta), c, ctype, ldc);
}

cublasStatus_t cublasSgeam(cublasHandle_t, cublasOperation_t transa, cublasOperation_t transb,
                           int m, int n, const float* alpha, const float* a, int lda,
                           const float* beta, const float* b, int ldb, float* c, int ldc) {
  const int a_rows = transa == CUBLAS_OP_N ? m : n, a_cols = transa == CUBLAS_OP_N ? n : m;
  const int b_rows = transb == CUBLAS_OP_N ? m : n, b_cols = transb == CUBLAS_OP_N ? n : m;
  if (m < 0 || n < 0 || lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) ||
      ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  // A is not read when alpha is 0, nor B when beta is 0 (as cuBLAS).
  const bool read_a = *alpha != 0.0f, read_b = *beta != 0.0f;
  const size_t a_bytes = read_a ? Extent(a_rows, a_cols, lda, 4) : 0;
  const size_t b_bytes = read_b ? Extent(b_rows, b_cols, ldb, 4) : 0;
  const size_t c_bytes = Extent(m, n, ldc, 4);
  if ((read_a && !cuda_cpu::InDevice(a, a_bytes)) || (read_b && !cuda_cpu::InDevice(b, b_bytes)) ||
      !cuda_cpu::InDevice(c, c_bytes)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // In place only as cuBLAS allows it: C = A (or B) with the same leading
  // dimension and no transpose; any other overlap is refused.
  const bool in_place_a = c == a && ldc == lda && transa == CUBLAS_OP_N;
  const bool in_place_b = c == b && ldc == ldb && transb == CUBLAS_OP_N;
  if ((!in_place_a && cuda_cpu::Overlaps(c, c_bytes, a, a_bytes)) ||
      (!in_place_b && cuda_cpu::Overlaps(c, c_bytes, b, b_bytes))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const size_t mn = static_cast<size_t>(m) * static_cast<size_t>(n);
  const std::vector<float> da =
      read_a ? Dense(a, CUDA_R_32F, lda, transa, m, n) : std::vector<float>(mn);
  const std::vector<float> db =
      read_b ? Dense(b, CUDA_R_32F, ldb, transb, m, n) : std::vector<float>(mn);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      const size_t d = static_cast<size_t>(i) + static_cast<size_t>(j) * m;
      const float from_a = read_a ? *alpha * da[d] : 0.0f, from_b = read_b ? *beta * db[d] : 0.0f;
      c[static_cast<size_t>(i) + static_cast<size_t>(j) * ldc] = from_a + from_b;
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}
