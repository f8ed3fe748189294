#include "core/optim/optimizer_options.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "core/optim/ns_coefficients.h"

namespace muonmesh::optim {

absl::Status ValidateAdamWOptions(const AdamWOptions& o) {
  auto nonneg = [](double v) { return std::isfinite(v) && v >= 0.0; };
  if (!nonneg(o.lr)) return absl::InvalidArgumentError("adamw.lr: must be finite and >= 0");
  if (!nonneg(o.eps)) return absl::InvalidArgumentError("adamw.eps: must be finite and >= 0");
  if (!nonneg(o.weight_decay)) {
    return absl::InvalidArgumentError("adamw.weight_decay: must be finite and >= 0");
  }
  if (o.lr * o.weight_decay > 1.0) {
    return absl::InvalidArgumentError("adamw: lr * weight_decay > 1 flips the sign of weights");
  }
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) {
    return absl::InvalidArgumentError("adamw.beta1: must be in [0, 1)");
  }
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) {
    return absl::InvalidArgumentError("adamw.beta2: must be in [0, 1)");
  }
  return absl::OkStatus();
}

absl::Status ValidateMuonOptions(const MuonOptions& options) {
  if (!std::isfinite(options.lr) || options.lr < 0.0) {
    return absl::InvalidArgumentError("muon.lr: must be finite and >= 0");
  }
  if (!std::isfinite(options.weight_decay) || options.weight_decay < 0.0) {
    return absl::InvalidArgumentError("muon.weight_decay: must be finite and >= 0");
  }
  if (options.lr * options.weight_decay > 1.0) {
    return absl::InvalidArgumentError("muon: lr * weight_decay > 1 flips the sign of weights");
  }
  if (!(options.momentum >= 0.0 && options.momentum < 1.0)) {
    return absl::InvalidArgumentError("muon.momentum: must be in [0, 1)");
  }
  return ValidateNsOptions(options.ns);
}

AdamWScalars AdamWScalarsFor(const AdamWOptions& options, int64_t step) {
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(options.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(options.beta2, t);
  return AdamWScalars{
      static_cast<float>(1.0 - options.lr * options.weight_decay),
      static_cast<float>(1.0 - options.beta1),
      static_cast<float>(options.beta2),
      static_cast<float>(1.0 - options.beta2),
      static_cast<float>(std::sqrt(bias_correction2)),
      static_cast<float>(options.eps),
      static_cast<float>(-(options.lr / bias_correction1)),
  };
}

double MuonUpdateScale(MuonScale scale, int64_t rows, int64_t cols) {
  const double r = static_cast<double>(rows);
  const double c = static_cast<double>(cols);
  switch (scale) {
    case MuonScale::kOriginal:
      return std::sqrt(std::max(1.0, r / c));
    case MuonScale::kMatchRmsAdamW:
      return 0.2 * std::sqrt(std::max(r, c));
  }
  return 1.0;
}

}  // namespace muonmesh::optim
