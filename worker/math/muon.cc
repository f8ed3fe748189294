#include "worker/math/muon.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/optim/ns_coefficients.h"

namespace muonmesh::math {
namespace {

// torch's lerp: s + w (e - s) for |w| < 0.5, else e - (e - s)(1 - w).
inline float Lerp(float s, float e, float w) {
  return std::fabs(w) < 0.5f ? s + w * (e - s) : e - (e - s) * (1.0f - w);
}

// The per-element scalars of one step, rounded to float once.
struct MuonScalars {
  float one_minus_beta;  // momentum lerp weight
  float beta;            // Nesterov lerp weight
  bool nesterov;
};

MuonScalars ScalarsOf(const optim::MuonOptions& o) {
  return {static_cast<float>(1.0 - o.momentum), static_cast<float>(o.momentum), o.nesterov};
}

inline float NewMomentum(const MuonScalars& s, float g, float m) {
  return Lerp(m, g, s.one_minus_beta);
}

inline float UpdateInput(const MuonScalars& s, float g, float m_new) {
  return s.nesterov ? Lerp(g, m_new, s.beta) : m_new;
}

bool AllFinite(absl::Span<const float> v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
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
  const MuonScalars s = ScalarsOf(options);
  for (size_t i = 0; i < grad.size(); ++i) {
    update[i] = UpdateInput(s, grad[i], NewMomentum(s, grad[i], momentum[i]));
  }
  // Finite g and m give a finite convex combination; this is a last guard.
  if (!AllFinite(update)) return absl::InternalError("MuonPrepare: non-finite update input");
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
  const MuonScalars s = ScalarsOf(options);
  const float decay = static_cast<float>(1.0 - options.lr * options.weight_decay);
  const float step =
      static_cast<float>(-(options.lr * optim::MuonUpdateScale(options.scale, rows, cols)));
  auto new_param = [&](size_t i) { return param[i] * decay + step * orthogonalized[i]; };
  // Check everything before writing anything.
  for (size_t i = 0; i < param.size(); ++i) {
    if (!std::isfinite(new_param(i)) || !std::isfinite(NewMomentum(s, grad[i], momentum[i]))) {
      return absl::InvalidArgumentError(
          absl::StrCat("MuonApply: step refused, element ", i, " would become non-finite"));
    }
  }
  for (size_t i = 0; i < param.size(); ++i) {
    param[i] = new_param(i);
    momentum[i] = NewMomentum(s, grad[i], momentum[i]);
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::math
