#pragma once

// The `transformer` model's parameters: one pre-norm decoder covering
// Llama-style dense models (grouped-query attention, RoPE, RMSNorm, SwiGLU)
// and DeepSeek-style mixtures of experts (multi-head latent attention,
// routed and shared experts), with the names and shapes of
// specs/llama3-8b.json and specs/deepseek-v3.json (docs/architecture.md §6):
//
//   unit embed     embed.weight [V, C]                                    adamw
//   unit layers.N  layers.N.attn_norm.weight [C]                          adamw
//                  attention, mha:
//                    attn.q_proj.weight [H D, C]                          muon
//                    attn.k_proj.weight [Hkv D, C], v_proj likewise       muon
//                    attn.o_proj.weight [C, H D]                          muon
//                  attention, mla (dn, dr, dv head dims; ranks rq, rkv):
//                    attn.q_a_proj.weight [rq, C], attn.q_a_norm.weight [rq]
//                    attn.q_b_proj.weight [H (dn + dr), rq]
//                      (rq = 0: attn.q_proj.weight [H (dn + dr), C])
//                    attn.kv_a_proj.weight [rkv + dr, C], attn.kv_a_norm.weight [rkv]
//                    attn.kv_b_proj.weight [H (dn + dv), rkv]
//                    attn.o_proj.weight [C, H dv]                         muon (norms adamw)
//                  layers.N.mlp_norm.weight [C]                           adamw
//                  dense (N < first_k_dense, or no moe):
//                    mlp.gate_proj.weight [F, C], mlp.up_proj.weight [F, C],
//                    mlp.down_proj.weight [C, F]                          muon
//                  moe: mlp.router.weight [E, C]                          adamw
//                    mlp.experts.gate_proj [E, Fe, C], experts.up_proj [E, Fe, C],
//                    mlp.experts.down_proj [E, C, Fe]                     muon, expert stacks
//                    mlp.shared.{gate,up}_proj.weight [S Fe, C],
//                    mlp.shared.down_proj.weight [C, S Fe]                muon (S > 0)
//   unit head      final_norm.weight [C], lm_head.weight [V, C]           adamw
//                  (tie_embeddings: no lm_head; the logits use embed.weight)
//
// Weights are [out, in] (torch.nn.Linear). Pure: the coordinator plans from
// it.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "core/base/field_violation.h"
#include "core/plan/types.h"

namespace muonmesh::model {

enum class Attention { kMha, kMla };
enum class RouterScore { kSoftmax, kSigmoid };

// Multi-head latent attention (DeepSeek-V2/V3).
struct MlaDims {
  int64_t q_lora_rank = 0;  // 0: q_proj straight from the input
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;  // dn
  int64_t qk_rope_head_dim = 0;  // dr, even
  int64_t v_head_dim = 0;        // dv

  bool operator==(const MlaDims&) const = default;
};

// Mixture of experts in the layers from first_k_dense on.
struct MoeDims {
  int64_t n_routed_experts = 0;  // E
  int64_t top_k = 0;             // K <= E
  int64_t moe_ffn_hidden = 0;    // Fe
  int64_t n_shared_experts = 0;  // S: a shared SwiGLU of width S Fe
  int64_t first_k_dense = 0;     // layers before it are dense
  RouterScore score = RouterScore::kSoftmax;
  bool norm_topk_prob = true;
  double route_scale = 1.0;
  double bias_update_rate = 0.001;  // gamma; 0: no balancing bias updates
  double aux_loss_coef = 0.0;       // alpha; 0: no balance loss

  bool operator==(const MoeDims&) const = default;
};

struct TransformerDims {
  int64_t vocab_size = 0;  // V
  int64_t seq_len = 0;     // T
  int64_t n_layer = 0;     // L
  int64_t d_model = 0;     // C
  int64_t n_head = 0;      // H
  int64_t n_kv_head = 0;   // Hkv, divides H (mha)
  int64_t head_dim = 0;    // D, even (mha: RoPE rotates it)
  int64_t ffn_hidden = 0;  // F (dense layers)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_embeddings = false;
  Attention attention = Attention::kMha;
  MlaDims mla;                 // attention == kMla
  std::optional<MoeDims> moe;  // absent: every layer dense

  bool operator==(const TransformerDims&) const = default;
};

// Limits that keep every size representable and cblas's int arguments in
// range.
inline constexpr int64_t kTransformerMaxVocab = int64_t{1} << 20;
inline constexpr int64_t kTransformerMaxSeqLen = int64_t{1} << 16;
inline constexpr int64_t kTransformerMaxWidth = int64_t{1} << 17;  // C, F, H D, ranks
inline constexpr int64_t kTransformerMaxLayers = 1024;
inline constexpr int64_t kTransformerMaxHeads = 1024;
inline constexpr int64_t kTransformerMaxExperts = 4096;

// The first problem found, its field named as in the job file's
// model.transformer section ("n_kv_head", "mla.qk_rope_head_dim",
// "moe.top_k"), or nothing. Every size >= 1 (ranks and S >= 0) and within
// its limit; H divisible by Hkv; D and dr even; K <= E; first_k_dense <= L;
// norm_eps and rope_theta > 0, route_scale > 0, the rates >= 0.
std::optional<FieldViolation> TransformerDimsViolation(const TransformerDims& dims);

// The spec above (named "transformer"). InvalidArgument naming the field as
// TransformerDimsViolation does.
absl::StatusOr<plan::ModelSpec> TransformerSpec(const TransformerDims& dims);

// Whether layer `layer` is a mixture of experts.
inline bool IsMoeLayer(const TransformerDims& dims, int64_t layer) {
  return dims.moe.has_value() && layer >= dims.moe->first_k_dense;
}

}  // namespace muonmesh::model
