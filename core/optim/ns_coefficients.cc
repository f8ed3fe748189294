#include "core/optim/ns_coefficients.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace muonmesh::optim {
namespace {

bool Finite(const NsCoefficientSet& s) {
  return std::isfinite(s.a) && std::isfinite(s.b) && std::isfinite(s.c);
}

}  // namespace

absl::Status ValidateNsOptions(const NsOptions& options) {
  if (options.steps < 1 || options.steps > plan::kMaxNsSteps) {
    return absl::InvalidArgumentError("ns.steps: " + std::to_string(options.steps) +
                                      " is outside [1, " + std::to_string(plan::kMaxNsSteps) +
                                      "]");
  }
  if (!(options.eps > 0.0) || !std::isfinite(options.eps)) {
    return absl::InvalidArgumentError("ns.eps: must be positive and finite");
  }
  switch (options.coefficients) {
    case NsCoefficients::kQuintic:
    case NsCoefficients::kPolarExpress:
      return absl::OkStatus();
    case NsCoefficients::kTable:
      if (options.table.empty()) {
        return absl::InvalidArgumentError("ns.table: empty (kTable needs at least one row)");
      }
      for (size_t i = 0; i < options.table.size(); ++i) {
        if (!Finite(options.table[i])) {
          return absl::InvalidArgumentError("ns.table[" + std::to_string(i) +
                                            "]: non-finite coefficient");
        }
      }
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("ns.coefficients: unknown value");
}

NsCoefficientSet NsCoefficientsForStep(const NsOptions& options, int step) {
  switch (options.coefficients) {
    case NsCoefficients::kQuintic:
      return kQuinticCoefficients;
    case NsCoefficients::kPolarExpress:
      return kPolarExpressCoefficients[std::min<size_t>(step, kPolarExpressCoefficients.size() - 1)];
    case NsCoefficients::kTable:
      return options.table[std::min<size_t>(step, options.table.size() - 1)];
  }
  return kQuinticCoefficients;
}

plan::NsAlgorithm NsFormFor(const NsOptions& options, int64_t rows, int64_t cols) {
  return plan::ChooseNsForm(
      options.algorithm, rows, cols, options.steps,
      [&](int64_t t) { return NsCoefficientsForStep(options, static_cast<int>(t)).a; },
      options.threads);
}

double NsFlopsFor(const NsOptions& options, int64_t rows, int64_t cols) {
  return plan::NsFlops(
      options.algorithm, rows, cols, options.steps,
      [&](int64_t t) { return NsCoefficientsForStep(options, static_cast<int>(t)).a; },
      options.threads);
}

double NewtonSchulzFlops(int64_t rows, int64_t cols, int steps) {
  return plan::StandardNsFlops(rows, cols, steps);
}

}  // namespace muonmesh::optim
