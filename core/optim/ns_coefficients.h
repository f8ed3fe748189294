#pragma once

// Newton-Schulz coefficient tables and option validation, shared by the CPU
// (newton_schulz.h) and CUDA (worker/cuda/newton_schulz_cuda.h) kernels so
// both run the same iteration.

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "core/optim/types.h"

namespace muonmesh::optim {

// The tables live with the cost model, which needs their leading
// coefficients (plan/ns_cost.h).
using plan::kPolarExpressCoefficients;
using plan::kQuinticCoefficients;

// OK, or InvalidArgument naming the field: steps outside [1, 100], eps not
// positive and finite, an empty table with kTable, non-finite coefficients.
absl::Status ValidateNsOptions(const NsOptions& options);

// Coefficients of iteration `step` (0-based). Expects validated options.
NsCoefficientSet NsCoefficientsForStep(const NsOptions& options, int step);

// The form options.algorithm runs on a rows x cols matrix (plan::ChooseNsForm
// with these options' coefficients), and its FLOPs as the planner counts
// them. Expects validated options.
plan::NsAlgorithm NsFormFor(const NsOptions& options, int64_t rows, int64_t cols);
double NsFlopsFor(const NsOptions& options, int64_t rows, int64_t cols);

// T (4 m^2 n + 2 m^3) with m = min(rows, cols), n = max(rows, cols): the
// FLOPs of T iterations counted as dense products (docs/architecture.md §4).
double NewtonSchulzFlops(int64_t rows, int64_t cols, int steps);

}  // namespace muonmesh::optim
