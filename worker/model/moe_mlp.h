#pragma once

// The built-in `moe_mlp` workload (design §6): teacher-student regression
// through a top-1 mixture of experts, to exercise the expert mesh and
// expert parallelism. Exact definition, so that anyone can reproduce it.
//
// Sizes. d_in, d (d_model), d_e (d_expert), E (num_experts), d_out.
//
// Parameters (flat order p = 0..6) and units:
//   unit 0 `input`:  p0 input.weight  [d, d_in]      muon
//                    p1 input.bias    [d]            adamw
//   unit 1 `moe`:    p2 router.weight [E, d]         adamw
//                    p3 experts.w1    [E, d_e, d]    muon, expert stack
//                    p4 experts.w2    [E, d, d_e]    muon, expert stack
//   unit 2 `output`: p5 output.weight [d_out, d]     muon
//                    p6 output.bias   [d_out]        adamw
//
// Model, for one sample x [d_in]:
//   h = tanh(x W_in^T + b_in)                        [d]
//   g = softmax(h W_router^T)                        [E]
//   e = argmax g (the lowest index on ties)
//   a = tanh(h W1[e]^T)                              [d_e]
//   z = h + g_e * (a W2[e]^T)                        [d]
//   y = z W_out^T + b_out                            [d_out]
// Loss of a call on samples S (|S| = n): 1/(n d_out) * sum (y - t)^2 over
// every element, as for `mlp`. The routing choice e is not differentiated;
// the gate g_e is (through the softmax into the router).
//
// Initialisation from seed `seed` (UniformAt from worker/model/rng.h): element
// k (row-major over the whole tensor, experts included) of parameter p is
//   float(double(UniformAt(seed, p, k)) / sqrt(double(fan_in_p)))
// with fan_in = d_in for p0 and p1, d for p2, p3, p5 and p6, d_e for p4.
//
// Teacher data (FromTeacher(dims, teacher_seed, N)), as for `mlp`:
//   x[n, j] = UniformAt(teacher_seed, 1'000'000, n * d_in + j)
//   y       = the model above with the initialisation of seed teacher_seed + 1
// computed by the student's forward code, so a student holding the teacher's
// weights has loss 0 on it.
//
// Arithmetic. Row-major fp32, products through cblas_sgemm with the tokens of
// one expert gathered into contiguous rows (in dispatch order: by expert, then
// by sample position); the softmax, the loss, the bias gradients and the gate
// gradient are computed in double and rounded once. dL/dy as for `mlp`.
//
// Expert parallelism. With EP groups (UnitAccess::expert_parallel_size), a
// rank holds E/EP experts and computes the expert part of the tokens routed
// to them: each rank sends every token's h (with its local expert id) to the
// group holding its expert and gets a W2[e] a back (forward), then sends
// g_e * dL/dz and gets dL/dh back (backward), each as one ExchangeTokens call
// (plus one for the token counts). Expert gradients are scaled by 1/EP, as
// UnitAccess documents. With EP = 1 every exchange is a copy and the
// arithmetic is ForwardBackward's, bit for bit.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/plan/types.h"
#include "core/model/moe_mlp_spec.h"
#include "worker/model/moe_mlp_passes.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

using model::kMoeMaxDim;
using model::kMoeMaxElements;
using model::kMoeMaxExperts;
using model::kMoeMaxSamplesPerCall;
using model::MoeMlpDims;
using model::MoeMlpSpec;
using model::ValidateMoeMlpDims;

// The documented initialisation, one vector per parameter in flat order.
absl::StatusOr<std::vector<std::vector<float>>> MoeMlpInitialParams(const MoeMlpDims& dims,
                                                                    uint64_t seed);

// The routing of n tokens (shared by the CPU and GPU workloads, so they route
// alike). RouteTokens turns probs [n, E] from router logits into the softmax
// (each row in double, rounded to float once) and fills: expert[s] = argmax
// (the lowest index on ties), gate[s] = probs[s, expert[s]], order = token
// indices sorted by expert (stable), per_expert = E + 1 offsets into order.
struct MoeRouting {
  std::vector<int32_t> expert;
  std::vector<float> gate;
  std::vector<int64_t> order;
  std::vector<int64_t> per_expert;
};
void RouteTokens(float* probs, int64_t n, int64_t num_experts, MoeRouting* routing);

// dlogits[s, j] = float(g_e (delta_je - g_j) dgate[s]) in double, with
// g = probs and e = routing.expert[s]: the router's gradient through the gate.
void RouterLogitGradient(const float* probs, const MoeRouting& routing, const double* dgate,
                         int64_t n, int64_t num_experts, float* dlogits);

class MoeMlp final : public Workload, private MoeMlpPasses {
 public:
  // Takes the dataset x [N, d_in], y [N, d_out] (row-major, N >= 1, finite).
  static absl::StatusOr<MoeMlp> Create(const MoeMlpDims& dims, std::vector<float> x,
                                       std::vector<float> y);
  // The teacher dataset documented above.
  static absl::StatusOr<MoeMlp> FromTeacher(const MoeMlpDims& dims, uint64_t teacher_seed,
                                            int64_t samples);

  const plan::ModelSpec& spec() const override { return spec_; }
  int64_t num_samples() const override { return num_samples_; }

  absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const override;
  absl::Status InitializeUnit(uint64_t seed, int unit,
                              absl::Span<float* const> params) const override;

  // Loss and gradients on `samples` with whole tensors (one expert-parallel
  // group). InvalidArgument, grads untouched, for an empty or out-of-range
  // sample list, more than kMoeMaxSamplesPerCall samples, or params/grads
  // that do not hold 7 non-null pointers.
  absl::StatusOr<double> ForwardBackward(int64_t step, absl::Span<const float* const> params,
                                         absl::Span<const int64_t> samples,
                                         absl::Span<float* const> grads) override;

  // The same, unit by unit and with expert parallelism. The calls, in order:
  //   forward:  Acquire(0), Release(0), Acquire(1), [exchanges], Release(1),
  //             Acquire(2) (held into the backward pass);
  //   backward: GradientBuffers(2), Commit(2), Release(2), Acquire(1),
  //             [exchanges], GradientBuffers(1), Commit(1), Release(1),
  //             GradientBuffers(0), Commit(0) (the input layer's gradients
  //             do not need its parameters).
  // At most one unit is acquired at a time. Every EP rank makes the same
  // exchanges in the same order, whatever its tokens. On an error it
  // releases what it holds and returns (the other EP ranks then fail in
  // their next exchange, within the collective timeout).
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

  const MoeMlpDims& dims() const { return dims_; }
  const std::vector<float>& x() const { return x_; }
  const std::vector<float>& y() const { return y_; }

  // The outputs y [n, d_out] of the forward pass on samples 0..n-1 of this
  // workload's x with whole `params` (flat order): the teacher's y.
  absl::StatusOr<std::vector<float>> Forward(absl::Span<const float* const> params, int64_t n);

 private:
  MoeMlp(const MoeMlpDims& dims, std::vector<float> x, std::vector<float> y,
         plan::ModelSpec spec);

  // The host's passes (moe_mlp_passes.h), which RunMoeMlpPasses drives.
  absl::Status Gather(absl::Span<const int64_t> samples, int ep) override;
  absl::Status InputForward(int64_t n, const float* weight, const float* bias) override;
  absl::StatusOr<std::vector<int64_t>> Route(int64_t n, int ep, const float* w_router) override;
  absl::StatusOr<std::vector<float>> ReceivedCounts(int ep) override;
  absl::Status PackTokens(int64_t n, int64_t received) override;
  absl::Status ExpertsForward(int64_t received, int64_t local, const float* w1,
                              const float* w2) override;
  absl::Status Combine(int64_t n) override;
  absl::Status OutputLayer(int64_t n, const float* weight, const float* bias) override;
  absl::StatusOr<double> OutputLoss(absl::Span<const int64_t> samples) override;
  absl::Status OutputBackward(int64_t n, const float* weight, float* dw, float* db) override;
  absl::Status PackGateGradients(int64_t n) override;
  absl::Status ExpertsBackward(int64_t received, int64_t local, int ep, const float* w1,
                               const float* w2, float* gw1, float* gw2) override;
  absl::Status RouterBackward(int64_t n, const float* w_router, float* gw_router) override;
  absl::Status InputBackward(int64_t n, float* dw, float* db) override;
  float* counts_send() override { return count_send_.data(); }
  float* counts_recv() override { return count_recv_.data(); }
  float* send() override { return send_.data(); }
  float* recv() override { return recv_.data(); }
  // The experts on the received tokens, grouped by local expert (outputs
  // into recv_ in the order received); their gradients from dL/do in recv_
  // (dL/dh of the tokens back into recv_).
  void RunExperts(const float* w1, const float* w2);
  void ExpertGradients(int ep, const float* w1, const float* w2, float* gw1, float* gw2);

  MoeMlpDims dims_;
  std::vector<float> x_;
  std::vector<float> y_;
  int64_t num_samples_ = 0;
  plan::ModelSpec spec_;

  // Scratch of one call (grown, never shrunk). Origin side, per sample s:
  // xs (gathered inputs), h, router probabilities g [n, E], chosen expert,
  // gate, the expert output o (ungated) and z, y. Dispatch: `order` (token
  // indices by expert), counts per group. Expert side, per received token in
  // expert order: its inputs, activations a, and where it came from.
  std::vector<float> xs_, h_, g_, o_, z_, y_out_;
  MoeRouting routing_;
  std::vector<int64_t> send_tokens_, recv_tokens_;
  std::vector<int32_t> ex_local_;   // per received token: local expert
  std::vector<int32_t> ex_order_;   // received token indices, by local expert
  std::vector<int64_t> ex_begin_;   // per local expert + 1: offsets into ex_order_
  std::vector<float> ex_h_, ex_a_;
  std::vector<float> send_, recv_;
  std::vector<float> count_send_, count_recv_;  // tokens per EP group, as floats
  int64_t local_experts_ = 0;                   // experts per EP group
  // Backward: dL/dy, dL/dz, dL/dh per sample, dL/dgate per sample.
  std::vector<float> dy_, dz_, dh_;
  std::vector<double> dgate_;
};

}  // namespace muonmesh::worker
