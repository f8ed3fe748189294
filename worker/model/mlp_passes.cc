#include "worker/model/mlp_passes.h"

#include <climits>

#include "core/base/status_macros.h"
#include "worker/model/checks.h"

namespace muonmesh::worker {
namespace {

// Unit i's parameters (W_i, b_i), checked; released on an error.
absl::StatusOr<absl::Span<const float* const>> AcquireLayer(UnitAccess& units, int64_t i) {
  const int unit = static_cast<int>(i);
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, units.Acquire(unit));
  HeldUnit held(units, unit);
  MUONMESH_RETURN_IF_ERROR(internal::CheckUnitTensors("mlp", p, 2, "parameters", unit));
  held.Keep();
  return p;
}

}  // namespace

absl::StatusOr<double> RunMlpPasses(absl::Span<const int64_t> dims, int64_t num_samples,
                                    MlpPasses& passes, UnitAccess& units,
                                    absl::Span<const int64_t> samples) {
  MUONMESH_RETURN_IF_ERROR(internal::CheckSampleList("mlp", samples, num_samples, INT_MAX));
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t layers = static_cast<int64_t>(dims.size()) - 1;
  MUONMESH_RETURN_IF_ERROR(passes.Gather(samples));

  // Forward, one unit at a time; the last stays acquired into the backward pass.
  absl::Span<const float* const> last;
  for (int64_t i = 0; i < layers; ++i) {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, AcquireLayer(units, i));
    HeldUnit held(units, static_cast<int>(i));  // released on an error
    MUONMESH_RETURN_IF_ERROR(passes.ForwardLayer(i, n, p[0], p[1]));
    if (i + 1 == layers) {
      held.Keep();
      last = p;
    }
  }
  double sum = 0.0;
  {
    HeldUnit held(units, static_cast<int>(layers - 1));  // released if the loss fails
    MUONMESH_ASSIGN_OR_RETURN(sum, passes.OutputLoss(samples));
    held.Keep();
  }

  // Backward, units in reverse: each unit's gradients committed as soon as
  // they are written.
  for (int64_t i = layers - 1; i >= 0; --i) {
    const int unit = static_cast<int>(i);
    absl::Span<const float* const> p = last;
    if (i + 1 < layers) {
      MUONMESH_ASSIGN_OR_RETURN(p, AcquireLayer(units, i));
    }
    HeldUnit held(units, unit);  // released after its commit, or on an error
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, units.GradientBuffers(unit));
    MUONMESH_RETURN_IF_ERROR(internal::CheckUnitTensors("mlp", g, 2, "gradient buffers", unit));
    MUONMESH_RETURN_IF_ERROR(passes.BackwardLayer(i, n, p[0], g[0], g[1]));
    MUONMESH_RETURN_IF_ERROR(units.Commit(unit));
  }
  const double denom = static_cast<double>(n) * static_cast<double>(dims.back());
  return sum / denom;
}

}  // namespace muonmesh::worker
