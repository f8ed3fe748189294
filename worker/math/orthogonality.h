#pragma once

// How far a matrix is from orthogonal: what Muon's health metrics report of
// each Newton-Schulz result (worker/runtime/trainer.h, MuonHealth).

#include <cstdint>

#include "absl/status/statusor.h"

namespace muonmesh::math {

// Muon health (docs/architecture.md, "Muon health"): how far the row-major
// rows x cols matrix x is from orthogonal, ||O O^T - I||_F / sqrt(m) with
// O O^T taken on the smaller side m = min(rows, cols) (X X^T or X^T X,
// fp32 ssyrk, the norm accumulated in double). 0 for an exactly
// semi-orthogonal matrix; about 0.2-0.35 after 5 quintic Newton-Schulz
// steps (their singular values end in about [0.7, 1.2] by design).
// InvalidArgument for a non-positive shape or null x.
absl::StatusOr<double> OrthogonalityError(const float* x, int64_t rows, int64_t cols);

}  // namespace muonmesh::math
