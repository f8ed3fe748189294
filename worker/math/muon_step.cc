// Muon, the whole-matrix step (the three phases back to back), apart from
// the phases themselves: it needs the CPU Newton-Schulz (OpenBLAS), which
// the elementwise phases do not.

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/math/muon.h"

namespace muonmesh::math {

absl::Status Muon::Step(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                        absl::Span<const float> grad, absl::Span<float> momentum,
                        absl::Span<float> param) {
  return StepBatched(options, 1, rows, cols, grad, momentum, param);
}

absl::Status Muon::StepBatched(const optim::MuonOptions& options, int64_t count, int64_t rows,
                               int64_t cols, absl::Span<const float> grad,
                               absl::Span<float> momentum, absl::Span<float> param) {
  if (count < 0 || rows < 0 || cols < 0) {
    return absl::InvalidArgumentError("Muon: negative count or shape");
  }
  const size_t total =
      static_cast<size_t>(count) * static_cast<size_t>(rows) * static_cast<size_t>(cols);
  if (param.size() != total) {
    return absl::InvalidArgumentError(absl::StrCat("Muon: param holds ", param.size(),
                                                   " values, expected ", total));
  }
  if (total == 0) return optim::ValidateMuonOptions(options);
  if (!update_.Reserve(total)) {
    return absl::ResourceExhaustedError("Muon: cannot allocate the update buffer");
  }
  absl::Span<float> u(update_.data(), total);
  MUONMESH_RETURN_IF_ERROR(MuonPrepare(options, grad, momentum, u));
  MUONMESH_RETURN_IF_ERROR(ns_.RunBatched(u.data(), count, rows, cols, options.ns));
  return MuonApply(options, rows, cols, grad, u, momentum, param);
}

}  // namespace muonmesh::math
