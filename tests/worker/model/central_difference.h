#pragma once

// The gradient check both reference trainers' tests make: each entry of
// `grads` against the central difference (L(p + h) - L(p - h)) / 2h of
// `loss` at `params`, within 1e-8 + 1e-6 |difference|, with h = 1e-6.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace muonmesh::reference {

// Returns, per tensor, the largest |difference| seen (0 where the sizes
// differ, which fails the test). `params` is stepped in place and restored.
template <typename Loss>
std::vector<double> ExpectGradientsMatchCentralDifferences(
    const Loss& loss, std::vector<std::vector<double>>& params,
    const std::vector<std::vector<double>>& grads) {
  constexpr double kH = 1e-6;
  std::vector<double> largest(params.size(), 0.0);
  if (grads.size() != params.size()) {
    ADD_FAILURE() << grads.size() << " gradients for " << params.size() << " parameters";
    return largest;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads[i].size() != params[i].size()) {
      ADD_FAILURE() << "param " << i << ": " << grads[i].size() << " gradient entries for "
                    << params[i].size();
      continue;
    }
    for (size_t k = 0; k < params[i].size(); ++k) {
      const double saved = params[i][k];
      params[i][k] = saved + kH;
      const double plus = loss(params);
      params[i][k] = saved - kH;
      const double minus = loss(params);
      params[i][k] = saved;
      const double fd = (plus - minus) / (2 * kH);
      largest[i] = std::max(largest[i], std::abs(fd));
      EXPECT_NEAR(grads[i][k], fd, 1e-8 + 1e-6 * std::abs(fd)) << "param " << i << " [" << k << "]";
    }
  }
  return largest;
}

}  // namespace muonmesh::reference
