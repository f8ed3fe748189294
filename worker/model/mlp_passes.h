#pragma once

// The mlp workload's passes (worker/model/mlp.h documents the model) split
// from the one walk that streams its units through them: the host form
// (Mlp, OpenBLAS) and the GPU form (CudaMlp, cuBLAS and kernels) implement
// MlpPasses, and RunMlpPasses makes the runtime's UnitAccess calls, in the
// order Mlp::ForwardBackwardByUnit documents, for both. As gpt_passes.h for
// the gpt; docs/architecture.md, "Adding a model kind".

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

// One device's arithmetic for one call on the n samples Gather took.
// Pointers are in the device's memory (the workload's memory_space()).
class MlpPasses {
 public:
  virtual ~MlpPasses() = default;

  // Readies the scratch for `samples` (checked: in range, not empty) and
  // gathers their inputs as h_0.
  virtual absl::Status Gather(absl::Span<const int64_t> samples) = 0;
  // h_{i+1} = h_i W_i^T + b_i, through tanh unless i is the last layer.
  virtual absl::Status ForwardLayer(int64_t i, int64_t n, const float* weight,
                                    const float* bias) = 0;
  // The squared error summed (not averaged) over the samples' outputs, with
  // dL/dy for the mean loss kept for BackwardLayer.
  virtual absl::StatusOr<double> OutputLoss(absl::Span<const int64_t> samples) = 0;
  // Layer i's gradients into dw, db (overwritten) from the kept dL/dz_i;
  // unless i == 0, dL/dz_{i-1} (through tanh) kept in its place.
  virtual absl::Status BackwardLayer(int64_t i, int64_t n, const float* weight, float* dw,
                                     float* db) = 0;
};

// The mean loss over `samples` (of a dataset of `num_samples`) and every
// unit's gradients committed, through `passes`, for an mlp of `dims`: the
// calls to `units` that Mlp::ForwardBackwardByUnit documents. Errors: the
// sample list's (before any call to `units`), the units' (wrong tensor
// counts named by unit), the passes' own; on an error what is held is
// released and units already committed stay so.
absl::StatusOr<double> RunMlpPasses(absl::Span<const int64_t> dims, int64_t num_samples,
                                    MlpPasses& passes, UnitAccess& units,
                                    absl::Span<const int64_t> samples);

}  // namespace muonmesh::worker
