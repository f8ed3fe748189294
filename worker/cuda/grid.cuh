#pragma once

// Launch shapes shared by the elementwise kernels: 256 threads a block, at
// most 4096 blocks, each thread striding over the elements (so any count
// fits a capped grid).

#include <cstdint>

namespace muonmesh::cuda::internal {

inline constexpr int kThreads = 256;
inline constexpr int kMaxBlocks = 4096;

inline int Blocks(int64_t count) {
  const int64_t b = (count + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b < kMaxBlocks ? b : kMaxBlocks));
}

}  // namespace muonmesh::cuda::internal

// for (i = this thread's first element; i < count; i += every thread of the grid)
#define MUONMESH_GRID_STRIDE_LOOP(i, count)                                             \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (count); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
