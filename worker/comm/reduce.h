#pragma once

// Host-side helpers shared by the CPU backends (Gloo, in-process): the
// rank-order reduction that makes their results bit-identical to each other
// and to a sequential sum, and the chunking of AllReduce.

#include <cstdint>

#include "absl/types/span.h"
#include "worker/comm/types.h"

namespace muonmesh::comm::internal {

// out[i] = ((parts[0][i] + parts[1][i]) + parts[2][i]) + ... for i < count,
// then divided by parts.size() for kAvg; for kMax the elementwise maximum
// (NaN where parts[0] is NaN, as std::max keeps its first argument). `out` may equal parts[0]; it must
// not overlap any other part.
void ReduceInRankOrder(absl::Span<const float* const> parts, int64_t count, ReduceOp op,
                       float* out);

// AllReduce cuts `count` floats into `size` contiguous chunks, the first
// count % size of them one float longer: the length and offset of chunk q.
inline int64_t ChunkLength(int64_t count, int size, int q) {
  return count / size + (q < count % size ? 1 : 0);
}
inline int64_t ChunkOffset(int64_t count, int size, int q) {
  const int64_t rem = count % size;
  return q * (count / size) + (q < rem ? q : rem);
}

}  // namespace muonmesh::comm::internal
