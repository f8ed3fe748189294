#pragma once

// The `transformer` workload on the host (docs/architecture.md §6;
// core/model/transformer_spec.h lists its parameters): a pre-norm decoder
// with RMSNorm, rotate-half RoPE, grouped-query attention (mha) or
// multi-head latent attention (mla) and a SwiGLU MLP, an untied or tied
// head, trained on token windows exactly as `gpt` is (token_windows.h;
// sample k of N tokens reads the window at p = (k T) mod (N - T)), and
// from layer first_k_dense on with `moe`, a mixture of routed and shared
// experts (transformer_moe.h: routing, the balancing bias, the balance
// loss, expert parallelism). The loss is the mean cross-entropy plus the
// balance term's mean over the windows.
//
// Per layer l, rows = n T for n windows:
//   h  = x + o_proj(Attn(RMSNorm(x; attn_norm)))
//   x' = h + down_proj(silu(gate_proj(m)) * up_proj(m)),  m = RMSNorm(h; mlp_norm)
// with RMSNorm y = x / sqrt(mean(x^2) + eps) * w (the mean and the inverse
// root in double, rounded once per row); RoPE on each head of q and k at the
// window position t (angles t theta^(-2i/D) in double, their cos and sin
// rounded to float); head h attends with kv head h / (H / Hkv), causal
// softmax of q k^T / sqrt(D) (host_ops.h). MLA: q = q_b_proj(RMSNorm(
// q_a_proj(n1); q_a_norm)) (or q_proj(n1)), per head [q_nope dn | q_pe dr];
// kv_a_proj(n1) = [c_kv | k_pe]; kv_b_proj(RMSNorm(c_kv; kv_a_norm)) per head
// [k_nope dn | v dv]; RoPE (R = dr) on each q_pe and on the one k_pe, which
// every head's key shares: k = [k_nope | k_pe], softmax of q k^T /
// sqrt(dn + dr), o_proj from H dv. logits = RMSNorm(x_L; final_norm)
// lm_head^T (embed.weight^T when tied); the loss is the mean cross-entropy
// over every position.
//
// Streaming: ForwardBackwardByUnit acquires embed (the lookup; released
// unless the head is tied), each layer in order, head (and embed again when
// tied) for the logits, then each layer again in reverse for its backward
// pass; embed's gradient is committed last. Activations of every layer are
// kept from the forward pass (n T rows of each).
//
// Initialisation (seeded): every matrix N(0, 0.02) from GptStandardNormal's
// stream of its flat index, except o_proj and down_proj N(0, 0.02 /
// sqrt(2 L)); norms 1.
//
// Thread-compatible, like every workload.

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model/transformer_spec.h"
#include "worker/model/token_windows.h"
#include "worker/model/transformer_moe.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

class Transformer final : public Workload {
 public:
  // InvalidArgument naming the field for bad dims (TransformerDimsViolation)
  // or a stream of N <= T tokens.
  static absl::StatusOr<Transformer> Create(model::TransformerDims dims,
                                            std::shared_ptr<const TokenStream> train);

  const plan::ModelSpec& spec() const override { return spec_; }
  int64_t num_samples() const override { return num_samples_; }
  absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const override;
  absl::Status InitializeUnit(uint64_t seed, int unit,
                              absl::Span<float* const> params) const override;
  absl::StatusOr<double> ForwardBackward(int64_t step, absl::Span<const float* const> params,
                                         absl::Span<const int64_t> samples,
                                         absl::Span<float* const> grads) override;
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

  // The logits [V] after `context` (exactly seq_len tokens) with whole
  // parameters `params` (flat order) and this model's buffers: the last
  // position's of a forward pass.
  absl::StatusOr<std::vector<float>> NextTokenLogits(absl::Span<const float* const> params,
                                                     absl::Span<const int32_t> context);

  // The mean cross-entropy over `samples` of `tokens` (no balance term:
  // what validation measures) with nothing committed.
  absl::StatusOr<double> LossByUnit(UnitAccess& units, const TokenStream& tokens,
                                    absl::Span<const int64_t> samples);
  absl::Status SetValidation(std::shared_ptr<const TokenStream> val);
  int64_t num_validation_samples() const override { return num_val_samples_; }
  absl::StatusOr<double> ValidationLossByUnit(UnitAccess& units,
                                              absl::Span<const int64_t> samples) override;

  // QK-clip (workload.h). MHA (n_kv_head = H): head h's rows [h D, (h + 1) D)
  // of q_proj and k_proj, each by sqrt(tau / S_h); GQA: its q_proj rows alone
  // by tau / S_h (the key rows are shared by the group). MLA: head h's
  // q_nope rows (q_b_proj or q_proj) and k_nope rows (kv_b_proj) by
  // sqrt(tau / S_h), its q_pe rows by tau / S_h (k_pe is shared).
  int64_t attention_layers() const override { return dims_.n_layer; }
  int64_t attention_heads() const override { return dims_.n_head; }
  void ResetAttentionLogits() override;
  absl::Span<const float> attention_logits() const override { return logit_max_; }
  std::vector<RowScale> QkClipRows(absl::Span<const float> logits, double tau) const override;

  // Buffers: each MoE layer's balancing bias layers.N.mlp.router.bias [E]
  // (0 at first); the stats are the tokens each MoE layer routed to each
  // expert ([MoE layers, E]); UpdateBuffers moves each bias by
  // bias_update_rate sign(mean - count) and keeps the layers' load.
  std::vector<BufferSpec> buffers() const override;
  std::vector<std::vector<float>> BufferValues() const override;
  absl::Status SetBuffers(absl::Span<const std::vector<float>> values) override;
  void ResetBufferStats() override;
  absl::Span<const float> buffer_stats() const override;
  absl::Status UpdateBuffers(absl::Span<const float> global) override;
  std::vector<ExpertLoad> expert_load() const override { return load_; }
  // With moe.aux_loss_coef > 0: the balance term (its mean over the
  // windows) averaged over the training passes since ResetBufferStats.
  std::optional<double> aux_loss() const override;

  const model::TransformerDims& dims() const { return dims_; }
  const TokenStream& train_stream() const { return *train_; }

 private:
  // A layer's parameters: their positions in its unit (-1: absent).
  struct Slots {
    int attn_norm = -1, q = -1, q_a = -1, q_a_norm = -1, q_b = -1, k = -1, v = -1;
    int kv_a = -1, kv_a_norm = -1, kv_b = -1, o = -1;
    int mlp_norm = -1, gate = -1, up = -1, down = -1;
    int router = -1, ex_gate = -1, ex_up = -1, ex_down = -1;
    int sh_gate = -1, sh_up = -1, sh_down = -1;
    int count = 0;
    int first = 0;  // the flat index of the layer's first parameter
  };
  // What a layer's backward pass needs from its forward pass (rows = n T).
  // Attention geometry: heads of qk_ (query and key) and vd_ (value) over
  // kvh_ kv heads (mha: D, D, Hkv; mla: dn + dr, dv, H).
  struct LayerActs {
    std::vector<float> x;     // [rows, C] the layer's input
    std::vector<float> n1;    // [rows, C] RMSNorm(x; attn_norm)
    std::vector<float> r1;    // [rows] its inverse root
    std::vector<float> qa, qn, rqa;    // mla q_lora: [rows, rq] twice, [rows]
    std::vector<float> ckv, cn, rckv;  // mla: [rows, rkv] twice, [rows]
    std::vector<float> q;     // [rows, H qk] after RoPE
    std::vector<float> k;     // [rows, kvh qk] after RoPE
    std::vector<float> v;     // [rows, kvh vd]
    std::vector<float> att;   // [n, H, T, T] probabilities, 0 above the diagonal
    std::vector<float> a;     // [rows, H vd] attention output
    std::vector<float> h;     // [rows, C] after the attention residual
    std::vector<float> n2;    // [rows, C] RMSNorm(h; mlp_norm)
    std::vector<float> r2;    // [rows]
    std::vector<float> gate;  // [rows, F]
    std::vector<float> up;    // [rows, F]
    std::vector<float> m;     // [rows, F] silu(gate) * up
  };

  Transformer(model::TransformerDims dims, std::shared_ptr<const TokenStream> train,
              plan::ModelSpec spec);

  int head_unit() const { return static_cast<int>(dims_.n_layer) + 1; }
  void MapSlots();
  absl::StatusOr<double> Run(UnitAccess& units, const TokenStream& tokens,
                             absl::Span<const int64_t> samples, bool gradients);
  absl::Status Forward(UnitAccess& units, int64_t n);
  // The layers' backward passes in reverse, then the lookup's rows into
  // `dembed` (the tied head's gradient already there), or, when it is null,
  // into embed's gradient buffers taken then and zeroed.
  absl::Status Backward(UnitAccess& units, int64_t n, float* dembed);
  void Reserve(int64_t n);
  absl::Status LayerForward(UnitAccess& units, int64_t layer, int64_t n,
                            absl::Span<const float* const> p);
  // q, k, v (after RoPE) from a.n1, and back: dq_, dk_, dv_ to dn_
  // (overwritten) and the projections' gradients.
  void Project(const Slots& s, LayerActs& a, int64_t rows, absl::Span<const float* const> p);
  void ProjectBackward(const Slots& s, const LayerActs& a, int64_t rows,
                       absl::Span<const float* const> p, absl::Span<float* const> g);
  // MLA's widths: C, H, H (dn + dr), dn, dr, the kv rank, H (dn + dv).
  struct MlaShape {
    int64_t c, h, qw, dn, dr, rkv, kvb;
  };
  MlaShape MlaSizes() const;
  void MlaProject(const Slots& s, LayerActs& a, int64_t rows, absl::Span<const float* const> p);
  void MlaProjectBackward(const Slots& s, const LayerActs& a, int64_t rows,
                          absl::Span<const float* const> p, absl::Span<float* const> g);
  void AttentionForward(LayerActs& a, int64_t n, float* head_max);
  absl::Status LayerBackward(UnitAccess& units, int64_t layer, int64_t n,
                             absl::Span<const float* const> p, absl::Span<float* const> g);
  // The dense MLP's backward pass: dL/d RMSNorm(h; mlp_norm) into dn_.
  void DenseMlpBackward(const Slots& s, const LayerActs& a, int64_t rows,
                        absl::Span<const float* const> p, absl::Span<float* const> g);
  MoeWeights MoeTensors(const Slots& s, absl::Span<const float* const> p) const;
  void AttentionBackward(const LayerActs& a, int64_t n, const float* da, float* dq, float* dk,
                         float* dv);
  // RoPE (R = rope_) on the vector at x + r row_stride + h head_stride of
  // each row r (position r mod T) and head h < heads; sign -1: backward.
  void Rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_stride,
            float sign) const;
  // The head's logits and loss, and with gradients dL/dx of the last layer's
  // output in dx_ and the head's gradients (final_norm, and lm_head or the
  // tied embedding's part).
  double Head(int64_t n, const float* final_norm, const float* head_w, bool gradients,
              float* dfinal_norm, float* dhead_w);

  model::TransformerDims dims_;
  std::shared_ptr<const TokenStream> train_;
  plan::ModelSpec spec_;
  int64_t num_samples_ = 0;
  std::shared_ptr<const TokenStream> val_;
  int64_t num_val_samples_ = 0;
  std::vector<Slots> slots_;      // per layer
  std::vector<std::optional<MoeLayer>> moe_;  // per layer: set for MoE layers
  MoeExchange exchange_;
  double aux_ = 0;                 // the balance term summed over the call's windows
  double aux_passes_sum_ = 0;      // training passes' balance terms (means) since the reset
  int64_t aux_passes_ = 0;
  mutable std::vector<float> stats_;  // buffer_stats()
  std::vector<ExpertLoad> load_;
  int64_t qk_ = 0, vd_ = 0, kvh_ = 0, rope_ = 0;
  std::vector<float> logit_max_;  // [L H]
  bool record_logits_ = false;
  std::vector<float> cos_, sin_;  // [T, rope_ / 2]

  int64_t capacity_ = 0;
  std::vector<int32_t> tokens_;  // [n, T + 1]
  std::vector<LayerActs> layers_;
  std::vector<float> x_out_;   // [rows, C] the last layer's output
  std::vector<float> nf_;      // [rows, C]
  std::vector<float> rf_;      // [rows]
  std::vector<float> logits_;  // [rows, V]; dL/dlogits after the loss
  std::vector<float> dx_;      // [rows, C] dL/dx of the residual stream
  std::vector<float> dn_;      // [rows, C] dL/d(a norm's output)
  std::vector<float> da_;      // [rows, H vd]
  std::vector<float> dq_;      // [rows, H qk]
  std::vector<float> dk_;      // [rows, kvh qk]
  std::vector<float> dv_;      // [rows, kvh vd]
  std::vector<float> dgate_, dup_;  // [rows, F]
  // mla: kv_a_proj's output and its gradient [rows, rkv + dr], kv_b_proj's
  // output or gradient [rows, H (dn + dv)], k_pe or its gradient [rows, dr],
  // gradients of the latent [rows, rkv] and q_lora's [rows, rq].
  std::vector<float> kva_, kvb_, pe_, dc_, dckv_, dqn_, dqa_;
  std::vector<float> exp_;     // [max(V, T)]
  std::vector<float> datt_;    // [T, T]
  std::vector<double> acc_;    // [max(C, rq, rkv)] norm weight gradients in double
};

}  // namespace muonmesh::worker
