#pragma once

// A transformer's mixture-of-experts MLP on the host (worker/model/
// transformer.h; docs/architecture.md, "Language models: transformer"),
// for one layer and one call on n windows of T tokens (rows = n T), m =
// RMSNorm(h; mlp_norm):
//
//   s = m router^T [rows, E]; p = softmax(s) per row (max, exps and sum in
//   double, rounded once) or sigmoid(s); the K experts of the largest
//   p_e + b_e (b the balancing bias; ties: the lowest index); gates
//   g_k = route_scale p_k / S (S the chosen scores' sum, when
//   norm_topk_prob) or route_scale p_k, in double, rounded once;
//   out += shared(m) + sum_k g_k expert_k(m), each expert and the shared
//   block a SwiGLU (down(silu(gate m) * up m)); the chosen experts' outputs
//   are added in k order.
//   With aux_loss_coef alpha > 0, each window adds alpha sum_e f_e P_e to
//   the loss, f_e = E / (K T) #{t : e chosen at t}, P_e the window's mean of
//   p_e / sum_j p_j (f is a count: no gradient flows through it).
//
// Expert parallelism (workload.h, UnitAccess): with EP groups of E / EP
// experts, each (token, k) assignment travels to the group holding its
// expert as [local expert id | m row] (C + 1 floats), in dispatch order
// (by expert, then token, then k), after one exchange of the token counts;
// the expert outputs (C floats) come back in the same order. The backward
// pass sends g_k dL/dout the same way and gets dL/dm back. Every EP rank
// makes the same exchanges per layer, whatever its tokens: three forward
// (counts, tokens, outputs) and two backward. The experts' gradients are
// scaled by 1 / EP (UnitAccess). With EP = 1 every exchange is a copy.
//
// Thread-compatible: one per MoE layer of a Transformer.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model/transformer_spec.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

// One MoE layer's tensors as its unit hands them out: the router [E, C],
// this rank's experts' stacks gate, up [E/EP, Fe, C] and down [E/EP, C, Fe],
// and the shared block's (S > 0; null otherwise).
struct MoeWeights {
  const float* router = nullptr;
  const float* gate = nullptr;
  const float* up = nullptr;
  const float* down = nullptr;
  const float* shared_gate = nullptr;
  const float* shared_up = nullptr;
  const float* shared_down = nullptr;
};
struct MoeGrads {
  float* router = nullptr;
  float* gate = nullptr;
  float* up = nullptr;
  float* down = nullptr;
  float* shared_gate = nullptr;
  float* shared_up = nullptr;
  float* shared_down = nullptr;
};

// The exchange buffers and the scratch every MoE layer of a model shares
// (grown, never shrunk; nothing in them outlives a Forward or Backward
// call).
struct MoeExchange {
  std::vector<float> send, recv, counts_send, counts_recv;
  std::vector<float> tmp, tmp2, tmp3, dx;
  std::vector<double> dgate;
};

class MoeLayer {
 public:
  // dims.moe must be set.
  explicit MoeLayer(const model::TransformerDims& dims);

  // out [rows, C] += this layer's output on m [rows, C]; returns the
  // balance term summed over the call's n windows (0 when alpha = 0). With
  // `record` (a training pass) the tokens routed to each expert are added
  // to counts(). The exchanges: the counts (one float per group), then the
  // tokens, then the outputs back.
  absl::StatusOr<double> Forward(UnitAccess& units, MoeExchange& ex, int64_t n, const float* m,
                                 const MoeWeights& w, bool record, float* out);
  // From dout [rows, C] = dL/d(the layer's output): dm [rows, C] = dL/dm
  // (overwritten) and every gradient of g (overwritten; the experts' scaled
  // by 1 / EP); aux_weight is the balance term's weight in the loss (1 / n
  // for a mean over the windows). The exchanges: g_k dout out, dL/dm back.
  // Uses what the last Forward on this layer kept.
  absl::Status Backward(UnitAccess& units, MoeExchange& ex, const float* m,
                        const MoeWeights& w, const float* dout, double aux_weight,
                        const MoeGrads& g, float* dm);

  // The balancing bias b [E] (a buffer: the same on every rank).
  std::vector<float>& bias() { return bias_; }
  const std::vector<float>& bias() const { return bias_; }
  // Tokens routed to each expert [E] by the training passes since
  // ResetCounts.
  const std::vector<float>& counts() const { return counts_; }
  void ResetCounts();
  // b_e += rate sign(mean(c) - c_e) for the global batch's counts c [E].
  void UpdateBias(absl::Span<const float> global);

 private:
  // Scores, choices, gates and the windows' f for rows tokens; the balance
  // term summed over the windows.
  double Route(int64_t n, const float* m, const float* router, bool record);
  // The assignments in dispatch order and the token counts per group.
  absl::Status Dispatch(UnitAccess& units, MoeExchange& ex, int ep, int64_t local);
  void ExpertsForward(MoeExchange& ex, int64_t local, const MoeWeights& w);
  void ExpertsBackward(MoeExchange& ex, int64_t local, int ep, const MoeWeights& w,
                       const MoeGrads& g);
  // dL/ds [rows, E] from the gates' gradients (and the balance term's).
  void ScoreGradients(const double* dgate, double aux_weight);

  model::TransformerDims dims_;
  int64_t e_ = 0, k_ = 0, fe_ = 0, fs_ = 0, c_ = 0;
  std::vector<float> bias_;
  std::vector<float> counts_;
  int64_t rows_ = 0;
  // Origin side: probs [rows, E] (then dL/ds), chosen [rows K], gates
  // [rows K], the chosen scores' sums [rows], f [n, E], the experts'
  // outputs per assignment [rows K, C], assignments in dispatch order, and
  // the tokens sent to and received from each group.
  std::vector<float> probs_;
  std::vector<int32_t> chosen_;
  std::vector<float> gates_;
  std::vector<double> sums_;
  std::vector<double> f_;
  std::vector<float> y_;
  std::vector<int64_t> order_;
  std::vector<int64_t> send_tokens_, recv_tokens_;
  // Expert side, the received tokens grouped by local expert: their local
  // expert, the group offsets, the grouped order, inputs [R, C] and
  // activations [R, Fe].
  int64_t received_ = 0;
  std::vector<int32_t> ex_local_;
  std::vector<int64_t> ex_begin_;
  std::vector<int64_t> ex_order_;
  std::vector<float> ex_x_, ex_gate_, ex_up_, ex_m_;
  // The shared block's activations [rows, S Fe].
  std::vector<float> sh_gate_, sh_up_, sh_m_;
};

}  // namespace muonmesh::worker
