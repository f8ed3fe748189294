#include "worker/math/muon.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/optim/ns_coefficients.h"
#include "worker/math/elementwise.h"

namespace muonmesh::math {
namespace {

// All ones when `flag`, else zero (a SelectBits mask).
inline uint32_t MaskOf(bool flag) { return flag ? ~0u : 0u; }

// torch's lerp: s + w (e - s) for |w| < 0.5, else e - (e - s)(1 - w);
// `small` is MaskOf(|w| < 0.5), decided once per step, so the loops stay
// branch-free.
inline float Lerp(float s, float e, float w, uint32_t small) {
  return SelectBits(small, s + w * (e - s), e - (e - s) * (1.0f - w));
}

// The per-element scalars of one step, rounded to float once.
struct MuonScalars {
  float one_minus_beta;  // momentum lerp weight
  float beta;            // Nesterov lerp weight
  uint32_t one_minus_beta_small, beta_small, nesterov;  // masks
};

MuonScalars ScalarsOf(const optim::MuonOptions& o) {
  const float one_minus_beta = static_cast<float>(1.0 - o.momentum);
  const float beta = static_cast<float>(o.momentum);
  return {one_minus_beta, beta, MaskOf(std::fabs(one_minus_beta) < 0.5f),
          MaskOf(std::fabs(beta) < 0.5f), MaskOf(o.nesterov)};
}

inline float NewMomentum(const MuonScalars& s, float g, float m) {
  return Lerp(m, g, s.one_minus_beta, s.one_minus_beta_small);
}

inline float UpdateInput(const MuonScalars& s, float g, float m_new) {
  return SelectBits(s.nesterov, Lerp(g, m_new, s.beta, s.beta_small), m_new);
}

MUONMESH_VECTOR_CLONES bool AllFinite(const float* v, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= NonFiniteBit(v[i]);
  return bad == 0;
}

bool AllFinite(absl::Span<const float> v) { return AllFinite(v.data(), v.size()); }

// u = UpdateInput(g, NewMomentum(g, m)) over n elements; false when some u
// is non-finite.
MUONMESH_VECTOR_CLONES bool PrepareInto(const MuonScalars& s, size_t n, const float* g,
                                        const float* m, float* u) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    u[i] = UpdateInput(s, g[i], NewMomentum(s, g[i], m[i]));
    bad |= NonFiniteBit(u[i]);
  }
  return bad == 0;
}

// The step MuonApply commits, element i: p (1 - lr wd) - lr scale O and m'.
struct ApplyScalars {
  MuonScalars s;
  float decay;
  float step;
};

// Whether every committed value would be finite (reads only).
MUONMESH_VECTOR_CLONES bool ApplyStaysFinite(const ApplyScalars& k, size_t n, const float* g,
                                             const float* o, const float* m, const float* p) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    bad |= NonFiniteBit(p[i] * k.decay + k.step * o[i]);
    bad |= NonFiniteBit(NewMomentum(k.s, g[i], m[i]));
  }
  return bad == 0;
}

// The four buffers are distinct (MuonApply's spans).
MUONMESH_VECTOR_CLONES void ApplyInto(const ApplyScalars& k, size_t n, const float* __restrict g,
                                      const float* __restrict o, float* __restrict m,
                                      float* __restrict p) {
  for (size_t i = 0; i < n; ++i) {
    p[i] = p[i] * k.decay + k.step * o[i];
    m[i] = NewMomentum(k.s, g[i], m[i]);
  }
}

absl::Status CheckSizes(const char* what, std::initializer_list<size_t> sizes) {
  const size_t first = *sizes.begin();
  for (size_t s : sizes) {
    if (s != first) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": buffer sizes differ"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MuonPrepare(const optim::MuonOptions& options, absl::Span<const float> grad,
                         absl::Span<const float> momentum, absl::Span<float> update) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateMuonOptions(options));
  if (absl::Status s = CheckSizes("MuonPrepare", {grad.size(), momentum.size(), update.size()});
      !s.ok()) {
    return s;
  }
  if (!AllFinite(grad)) return absl::InvalidArgumentError("MuonPrepare: NaN or infinity in grad");
  if (!AllFinite(momentum)) {
    return absl::InvalidArgumentError("MuonPrepare: NaN or infinity in the momentum buffer");
  }
  // Finite g and m give a finite convex combination; this is a last guard.
  if (!PrepareInto(ScalarsOf(options), grad.size(), grad.data(), momentum.data(), update.data())) {
    return absl::InternalError("MuonPrepare: non-finite update input");
  }
  return absl::OkStatus();
}

absl::Status MuonApply(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                       absl::Span<const float> grad, absl::Span<const float> orthogonalized,
                       absl::Span<float> momentum, absl::Span<float> param) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateMuonOptions(options));
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MuonApply: matrix shape ", rows, " x ", cols, " is not positive"));
  }
  if (absl::Status s = CheckSizes("MuonApply", {grad.size(), orthogonalized.size(),
                                                momentum.size(), param.size()});
      !s.ok()) {
    return s;
  }
  if (param.size() % static_cast<size_t>(cols) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MuonApply: shard of ", param.size(), " values is not whole rows of ", cols));
  }
  if (!AllFinite(orthogonalized)) {
    return absl::InvalidArgumentError("MuonApply: NaN or infinity in the orthogonalised update");
  }
  const ApplyScalars k{
      ScalarsOf(options), static_cast<float>(1.0 - options.lr * options.weight_decay),
      static_cast<float>(-(options.lr * optim::MuonUpdateScale(options.scale, rows, cols)))};
  // Check everything before writing anything; the element named only when
  // the check fails.
  if (!ApplyStaysFinite(k, param.size(), grad.data(), orthogonalized.data(), momentum.data(),
                        param.data())) {
    size_t i = 0;
    while (i + 1 < param.size() &&
           ApplyStaysFinite(k, 1, &grad[i], &orthogonalized[i], &momentum[i], &param[i])) {
      ++i;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("MuonApply: step refused, element ", i, " would become non-finite"));
  }
  ApplyInto(k, param.size(), grad.data(), orthogonalized.data(), momentum.data(), param.data());
  return absl::OkStatus();
}

}  // namespace muonmesh::math
