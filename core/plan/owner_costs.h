#pragma once

// What owning a Muon matrix costs a position of its domain, as the owner
// assignment (owners.cc) and its lower bounds (owner_bounds.cc) both price
// it: the Newton-Schulz FLOPs plus `w` per byte of the gather and scatter.
// Internal to core/plan/.

#include <algorithm>
#include <cstdint>

#include "core/plan/types.h"

namespace muonmesh::plan::internal {

// Rows of matrix `m` held by `position` (0 if it is not a holder).
inline int64_t HeldRows(const MatrixPlan& m, int32_t position) {
  auto it = std::lower_bound(m.holders.begin(), m.holders.end(), position,
                             [](const Holder& h, int32_t p) { return h.position < p; });
  return (it != m.holders.end() && it->position == position) ? it->row_count : 0;
}

inline int64_t GatherBytesAt(const MatrixPlan& m, int32_t p, int64_t bpe) {
  return 2 * (m.rows - HeldRows(m, p)) * m.cols * bpe;
}

// What owning m costs at position p; CostAway at a position that holds none
// of its rows.
inline double CostAt(const MatrixPlan& m, int32_t p, double w, int64_t bpe) {
  return m.cost_flops + w * static_cast<double>(GatherBytesAt(m, p, bpe));
}
inline double CostAway(const MatrixPlan& m, double w, int64_t bpe) {
  return m.cost_flops + w * 2.0 * static_cast<double>(m.rows * m.cols * bpe);
}

}  // namespace muonmesh::plan::internal
