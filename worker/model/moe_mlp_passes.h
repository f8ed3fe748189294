#pragma once

// The moe_mlp workload's passes (worker/model/moe_mlp.h documents the model
// and its expert parallelism) split from the one walk that streams its
// units and its token exchanges through them: the host form (MoeMlp,
// OpenBLAS) and the GPU form (CudaMoeMlp, cuBLAS and kernels) implement
// MoeMlpPasses, and RunMoeMlpPasses makes the runtime's UnitAccess calls
// (acquires, exchanges, commits), in the order MoeMlp::ForwardBackwardByUnit
// documents, for both. As gpt_passes.h for the gpt; docs/architecture.md,
// "Adding a model kind".

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model/moe_mlp_spec.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

// One device's arithmetic for one call on n tokens (this rank's samples)
// with `ep` expert-parallel groups of `local` experts each. Pointers are in
// the device's memory (the workload's memory_space()); each method reads
// what the ones before it left, in RunMoeMlpPasses's order. The exchange
// buffers are the passes' own: the walk hands them to
// UnitAccess::ExchangeTokens.
class MoeMlpPasses {
 public:
  virtual ~MoeMlpPasses() = default;

  // Readies the scratch for the samples' n tokens and gathers their inputs.
  virtual absl::Status Gather(absl::Span<const int64_t> samples, int ep) = 0;
  // h = tanh(x W_in^T + b_in).
  virtual absl::Status InputForward(int64_t n, const float* weight, const float* bias) = 0;
  // The router's softmax and each token's expert (RouteTokens, the same on
  // every device); returns how many tokens go to each group and leaves
  // those counts, as floats, in counts_send().
  virtual absl::StatusOr<std::vector<int64_t>> Route(int64_t n, int ep,
                                                     const float* w_router) = 0;
  // The counts the groups sent into counts_recv(), on the host.
  virtual absl::StatusOr<std::vector<float>> ReceivedCounts(int ep) = 0;
  // Readies the expert side for `received` tokens and packs this rank's n
  // tokens into send(), in expert order: each its local expert id, then h.
  virtual absl::Status PackTokens(int64_t n, int64_t received) = 0;
  // The received tokens (recv(), d + 1 floats each) through their local
  // experts; the outputs W2 tanh(W1 h) (d floats each) into recv(), in the
  // order received.
  virtual absl::Status ExpertsForward(int64_t received, int64_t local, const float* w1,
                                      const float* w2) = 0;
  // o from send() (the outputs home again, in expert order); z = h + gate o.
  virtual absl::Status Combine(int64_t n) = 0;
  // y = z W_out^T + b_out.
  virtual absl::Status OutputLayer(int64_t n, const float* weight, const float* bias) = 0;
  // The squared error summed (not averaged) over the samples' outputs, with
  // dL/dy for the mean loss kept.
  virtual absl::StatusOr<double> OutputLoss(absl::Span<const int64_t> samples) = 0;
  // The output layer's gradients (overwritten) and dL/dz.
  virtual absl::Status OutputBackward(int64_t n, const float* weight, float* dw, float* db) = 0;
  // dL/dgate per token, kept, and send() = gate dL/dz, in expert order.
  virtual absl::Status PackGateGradients(int64_t n) = 0;
  // From the received tokens' dL/do (recv(), d floats each): the experts'
  // gradients (overwritten, scaled by 1/ep: the mean loss of the EP ranks)
  // and each token's dL/dh into recv(), in the order received.
  virtual absl::Status ExpertsBackward(int64_t received, int64_t local, int ep, const float* w1,
                                       const float* w2, float* gw1, float* gw2) = 0;
  // dL/dh = dL/dz + the experts' part (send(), in expert order) + the
  // router's; the router's gradient (overwritten).
  virtual absl::Status RouterBackward(int64_t n, const float* w_router, float* gw_router) = 0;
  // dL/dh through tanh, then the input layer's gradients (overwritten).
  virtual absl::Status InputBackward(int64_t n, float* dw, float* db) = 0;

  // The exchange buffers: counts (one float per group) after Route, tokens
  // after PackTokens.
  virtual float* counts_send() = 0;
  virtual float* counts_recv() = 0;
  virtual float* send() = 0;
  virtual float* recv() = 0;
};

// The mean loss over `samples` (of a dataset of `num_samples`) and, with
// `gradients`, every unit's gradients committed, through `passes`: the calls
// to `units` MoeMlp::ForwardBackwardByUnit documents. Without gradients it
// stops after the output layer (unit 2 released) and returns 0: the outputs
// are the passes'. Every EP rank makes the same exchanges in the same order,
// whatever its tokens. Errors: the sample list's and an expert count that
// does not split over the EP groups (before any call to `units`), the
// units' (wrong tensor counts named by unit), a group announcing an
// impossible token count, the passes' own; on an error what is held is
// released.
absl::StatusOr<double> RunMoeMlpPasses(const model::MoeMlpDims& dims, int64_t num_samples,
                                       MoeMlpPasses& passes, UnitAccess& units,
                                       absl::Span<const int64_t> samples, bool gradients);

}  // namespace muonmesh::worker
