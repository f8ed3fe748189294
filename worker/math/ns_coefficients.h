#pragma once

// Newton-Schulz coefficient tables and option validation, shared by the CPU
// (newton_schulz.h) and CUDA (worker/cuda/newton_schulz_cuda.h) kernels so
// both run the same iteration.

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "worker/math/types.h"

namespace muonmesh::math {

inline constexpr NsCoefficientSet kQuinticCoefficients{3.4445, -4.7750, 2.0315};

inline constexpr std::array<NsCoefficientSet, 8> kPolarExpressCoefficients{{
    {8.2051, -22.9019, 16.4607},
    {4.0664, -2.8612, 0.5184},
    {3.9096, -2.8234, 0.5250},
    {3.2856, -2.4153, 0.4853},
    {2.2779, -1.6198, 0.3985},
    {1.8726, -1.2307, 0.3585},
    {1.8564, -1.2132, 0.3568},
    {1.8750, -1.2500, 0.3750},
}};

// OK, or InvalidArgument naming the field: steps outside [1, 100], eps not
// positive and finite, an empty table with kTable, non-finite coefficients.
absl::Status ValidateNsOptions(const NsOptions& options);

// Coefficients of iteration `step` (0-based). Expects validated options.
NsCoefficientSet NsCoefficientsForStep(const NsOptions& options, int step);

// T (4 m^2 n + 2 m^3) with m = min(rows, cols), n = max(rows, cols): the
// FLOPs of T iterations counted as dense products (DESIGN.md section 4).
double NewtonSchulzFlops(int64_t rows, int64_t cols, int steps);

}  // namespace muonmesh::math
