#include "worker/math/orthogonality.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muonmesh::math {

absl::StatusOr<double> OrthogonalityError(const float* x, int64_t rows, int64_t cols) {
  if (x == nullptr || rows <= 0 || cols <= 0 || rows > INT_MAX || cols > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("OrthogonalityError: a ", rows, " x ", cols, " matrix at ",
                     x == nullptr ? "null" : "x", " (a positive shape and data needed)"));
  }
  const int64_t m = std::min(rows, cols);
  std::vector<float> gram(static_cast<size_t>(m * m), 0.0f);
  // Upper triangle of X X^T (rows <= cols) or X^T X.
  const bool wide = rows <= cols;
  cblas_ssyrk(CblasRowMajor, CblasUpper, wide ? CblasNoTrans : CblasTrans, static_cast<int>(m),
              static_cast<int>(wide ? cols : rows), 1.0f, x, static_cast<int>(cols), 0.0f,
              gram.data(), static_cast<int>(m));
  double sum = 0;
  for (int64_t i = 0; i < m; ++i) {
    const double d = static_cast<double>(gram[i * m + i]) - 1.0;
    sum += d * d;
    for (int64_t j = i + 1; j < m; ++j) {
      const double off = gram[i * m + j];
      sum += 2.0 * off * off;
    }
  }
  return std::sqrt(sum / static_cast<double>(m));
}

}  // namespace muonmesh::math
