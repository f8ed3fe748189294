#include "worker/math/adamw.h"

#include <cmath>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/math/elementwise.h"

namespace muonmesh::math {
namespace {

struct Moments {
  float param;
  float exp_avg;
  float exp_avg_sq;
};

// torch's lerp (see muon.cc); `small` is the SelectBits mask of |w| < 0.5,
// decided once per step so that the loops stay branch-free.
inline float Lerp(float s, float e, float w, uint32_t small) {
  return SelectBits(small, s + w * (e - s), e - (e - s) * (1.0f - w));
}

inline Moments Update(const optim::AdamWScalars& k, uint32_t small, float g, float p, float m,
                      float v) {
  const float p_decayed = p * k.decay;
  const float m_new = Lerp(m, g, k.one_minus_beta1, small);
  const float v_new = v * k.beta2 + k.one_minus_beta2 * g * g;
  const float denom = std::sqrt(v_new) / k.bias_correction2_sqrt + k.eps;
  return {p_decayed + k.neg_step_size * m_new / denom, m_new, v_new};
}

uint32_t SmallMask(const optim::AdamWScalars& k) {
  return std::fabs(k.one_minus_beta1) < 0.5f ? ~0u : 0u;
}

// 1 where the gradient is non-finite, 2 where the step would make a value
// non-finite, OR-ed over n elements (reads only).
MUONMESH_VECTOR_CLONES uint32_t StepProblems(const optim::AdamWScalars& k, size_t n,
                                             const float* g, const float* p, const float* m,
                                             const float* v) {
  const uint32_t small = SmallMask(k);
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const Moments r = Update(k, small, g[i], p[i], m[i], v[i]);
    bad |= NonFiniteBit(g[i]) |
           ((NonFiniteBit(r.param) | NonFiniteBit(r.exp_avg) | NonFiniteBit(r.exp_avg_sq)) << 1);
  }
  return bad;
}

// The four buffers are distinct (AdamWStep's spans).
MUONMESH_VECTOR_CLONES void StepInto(const optim::AdamWScalars& k, size_t n,
                                     const float* __restrict g, float* __restrict p,
                                     float* __restrict m, float* __restrict v) {
  const uint32_t small = SmallMask(k);
  const optim::AdamWScalars local = k;  // in registers: the stores cannot touch it
  for (size_t i = 0; i < n; ++i) {
    const Moments r = Update(local, small, g[i], p[i], m[i], v[i]);
    p[i] = r.param;
    m[i] = r.exp_avg;
    v[i] = r.exp_avg_sq;
  }
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
  // Check every result before writing any (the step is all or nothing); the
  // first element with a problem named only when there is one.
  if (StepProblems(k, n, grad.data(), param.data(), exp_avg.data(), exp_avg_sq.data()) != 0) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t bad =
          StepProblems(k, 1, &grad[i], &param[i], &exp_avg[i], &exp_avg_sq[i]);
      if ((bad & 1u) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("AdamWStep: grad[", i, "] is non-finite"));
      }
      if (bad != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("AdamWStep: step refused, element ", i, " would become non-finite"));
      }
    }
  }
  StepInto(k, n, grad.data(), param.data(), exp_avg.data(), exp_avg_sq.data());
  return absl::OkStatus();
}

}  // namespace muonmesh::math
