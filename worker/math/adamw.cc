#include "worker/math/adamw.h"

#include <cmath>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace muonmesh::math {
namespace {

struct Moments {
  float param;
  float exp_avg;
  float exp_avg_sq;
};

inline float Lerp(float s, float e, float w) {
  return std::fabs(w) < 0.5f ? s + w * (e - s) : e - (e - s) * (1.0f - w);
}

inline Moments Update(const optim::AdamWScalars& k, float g, float p, float m, float v) {
  const float p_decayed = p * k.decay;
  const float m_new = Lerp(m, g, k.one_minus_beta1);
  const float v_new = v * k.beta2 + k.one_minus_beta2 * g * g;
  const float denom = std::sqrt(v_new) / k.bias_correction2_sqrt + k.eps;
  return {p_decayed + k.neg_step_size * m_new / denom, m_new, v_new};
}

bool Finite(const Moments& r) {
  return std::isfinite(r.param) && std::isfinite(r.exp_avg) && std::isfinite(r.exp_avg_sq);
}

}  // namespace

absl::Status AdamWStep(const optim::AdamWOptions& options, int64_t step, absl::Span<const float> grad,
                       absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq,
                       absl::Span<float> param) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateAdamWOptions(options));
  if (step < 1) {
    return absl::InvalidArgumentError(absl::StrCat("adamw: step ", step, " < 1 (t is 1-based)"));
  }
  const size_t n = param.size();
  if (grad.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n) {
    return absl::InvalidArgumentError("AdamWStep: buffer sizes differ");
  }
  const optim::AdamWScalars k = optim::AdamWScalarsFor(options, step);
  // Check every result before writing any (the step is all or nothing).
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(grad[i])) {
      return absl::InvalidArgumentError(absl::StrCat("AdamWStep: grad[", i, "] is non-finite"));
    }
    if (!Finite(Update(k, grad[i], param[i], exp_avg[i], exp_avg_sq[i]))) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamWStep: step refused, element ", i, " would become non-finite"));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const Moments r = Update(k, grad[i], param[i], exp_avg[i], exp_avg_sq[i]);
    param[i] = r.param;
    exp_avg[i] = r.exp_avg;
    exp_avg_sq[i] = r.exp_avg_sq;
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::math
