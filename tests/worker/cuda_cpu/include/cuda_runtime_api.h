#pragma once

// CPU stand-in for the part of the CUDA runtime API that the Newton-Schulz
// host code and its test use (tests/worker/cuda_cpu/README.md). "Device"
// memory is host memory that the stand-in tracks, so every copy, kernel and
// cuBLAS call can check that it stays inside device allocations.

#include <cstddef>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};

struct CUstream_st;
using cudaStream_t = CUstream_st*;

inline constexpr unsigned cudaStreamNonBlocking = 1;

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMallocHost(void** ptr, size_t bytes);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
// height rows of width bytes, rows dpitch / spitch bytes apart.
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
// Work is done when issued, except NCCL operations waiting for peers.
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaGetLastError();
const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);

// Not CUDA: for the stand-in's own checks and tests.
namespace cuda_cpu {
// Devices the stand-in reports (cudaGetDeviceCount): enough for the NCCL
// stand-in's multi-rank groups, one rank a device.
inline constexpr int kDevices = 4;
// Work enqueued on `stream` that has not run yet (NCCL operations waiting for
// their peers): cudaStreamQuery says cudaErrorNotReady and
// cudaStreamSynchronize waits while it is positive.
void AddPendingWork(cudaStream_t stream, int delta);
// True when [p, p + bytes) lies inside one live cudaMalloc allocation.
bool InDevice(const void* p, size_t bytes);
// Live cudaMalloc allocations.
size_t LiveAllocations();
// True when [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes);
// count elements of T at p, all inside one device allocation (or none asked).
template <typename T>
bool Fits(const T* p, long long count) {
  return count <= 0 || InDevice(p, static_cast<size_t>(count) * sizeof(T));
}
}  // namespace cuda_cpu
