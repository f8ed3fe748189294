#pragma once

// A training workload as the worker runtime sees it: a model spec (units of
// parameters, which the planner lays out) and a function from full parameter
// tensors and a set of sample indices to a loss and full gradients.
//
// The runtime gathers each unit's parameters into whole tensors, calls
// ForwardBackward on this rank's slice of the global batch, and reduces the
// gradients over the data-parallel ranks with an average. So that the math
// does not depend on the layout, the loss is the mean over this call's
// samples (every data-parallel rank gets an equal slice; the average of the
// slice means is the global mean).
//
// Parameters are addressed by their flat index: units in order, parameters
// in order within each unit (the order of spec()). Tensors are row-major
// fp32 in host memory.
//
// Thread-compatible: one instance per rank; ForwardBackward may keep scratch
// buffers between calls.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/plan/types.h"

namespace muonmesh::worker {

class Workload {
 public:
  virtual ~Workload() = default;

  // The parameters, as units; stable for the workload's lifetime.
  virtual const plan::ModelSpec& spec() const = 0;

  // Number of samples in the dataset (N); the batch of step s is samples
  // (s * B + j) mod N for j < B.
  virtual int64_t num_samples() const = 0;

  // Writes the deterministic initial value of every parameter (params[i]
  // has the size of parameter i). Same seed, same values, on every rank.
  virtual absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const = 0;

  // Loss (mean over `samples`) and its gradient with respect to every
  // parameter, written to grads[i] (overwritten, not accumulated). `step`
  // is the 0-based step (synthetic workloads derive gradients from it).
  // InvalidArgument for an empty or out-of-range sample list.
  virtual absl::StatusOr<double> ForwardBackward(int64_t step,
                                                 absl::Span<const float* const> params,
                                                 absl::Span<const int64_t> samples,
                                                 absl::Span<float* const> grads) = 0;
};

}  // namespace muonmesh::worker
