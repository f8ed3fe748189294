#include "worker/comm/reduce.h"

#include <algorithm>
#include <cstring>

namespace muonmesh::comm::internal {

void ReduceInRankOrder(absl::Span<const float* const> parts, int64_t count, ReduceOp op,
                       float* out) {
  if (count <= 0 || parts.empty()) return;
  const size_t n = static_cast<size_t>(count);
  if (out != parts[0]) std::memcpy(out, parts[0], n * sizeof(float));
  // Rank-major: each pass adds one rank's values, so every element sees the
  // additions in rank order whatever the vectorisation (the build forbids
  // reassociation: no -ffast-math).
  if (op == ReduceOp::kMax) {
    for (size_t q = 1; q < parts.size(); ++q) {
      const float* part = parts[q];
      for (size_t i = 0; i < n; ++i) out[i] = std::max(out[i], part[i]);
    }
    return;
  }
  for (size_t q = 1; q < parts.size(); ++q) {
    const float* part = parts[q];
    for (size_t i = 0; i < n; ++i) out[i] += part[i];
  }
  if (op == ReduceOp::kAvg && parts.size() > 1) {
    const float divisor = static_cast<float>(parts.size());
    for (size_t i = 0; i < n; ++i) out[i] /= divisor;
  }
}

}  // namespace muonmesh::comm::internal
