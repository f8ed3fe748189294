#pragma once

// The `gpt` model's parameters (worker/model/gpt.h defines the model): the
// GPT-2 decoder with the names and shapes of GPT-2 as Hugging Face and
// nanoGPT store it (specs/gpt2-124m.json at GPT-2 size):
//
//   unit embed  wte.weight [V, C], wpe.weight [block_size, C]      adamw
//   unit h.{l}  h.{l}.ln_1.weight [C], h.{l}.ln_1.bias [C]           adamw
//   (l < L)     h.{l}.attn.c_attn.weight [3C, C]                     muon
//               h.{l}.attn.c_attn.bias [3C]                          adamw
//               h.{l}.attn.c_proj.weight [C, C]                      muon
//               h.{l}.attn.c_proj.bias [C]                           adamw
//               h.{l}.ln_2.weight [C], h.{l}.ln_2.bias [C]           adamw
//               h.{l}.mlp.c_fc.weight [4C, C]                        muon
//               h.{l}.mlp.c_fc.bias [4C]                             adamw
//               h.{l}.mlp.c_proj.weight [C, 4C]                      muon
//               h.{l}.mlp.c_proj.bias [C]                            adamw
//   unit head   ln_f.weight [C], ln_f.bias [C]                       adamw
//
// Weights are [out, in] (torch.nn.Linear), so a layer computes x W^T + b.
// The head is tied to wte: `embed` is gathered twice a step (the lookup,
// then the logits), each block twice (forward, then again for the
// backward pass), `head` once. Pure: the coordinator plans from it.

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/field_violation.h"
#include "core/plan/types.h"

namespace muonmesh::model {

struct GptDims {
  int64_t vocab_size = 0;  // V
  int64_t block_size = 0;  // positions wpe holds
  int64_t n_layer = 0;     // L
  int64_t n_head = 0;      // H
  int64_t n_embd = 0;      // C, a multiple of H
  int64_t seq_len = 0;     // T <= block_size: the tokens of one sample

  bool operator==(const GptDims&) const = default;
};

// Limits that keep every size representable and cblas's int arguments in
// range: V, block_size and 4C at most these, and T * max(V, 4C) floats per
// sample below kGptMaxSampleElements.
inline constexpr int64_t kGptMaxVocab = int64_t{1} << 20;
inline constexpr int64_t kGptMaxBlockSize = int64_t{1} << 16;
inline constexpr int64_t kGptMaxEmbd = int64_t{1} << 14;
inline constexpr int64_t kGptMaxLayers = 1024;
inline constexpr int64_t kGptMaxSampleElements = int64_t{1} << 31;

// OK, or InvalidArgument naming the field ("vocab_size", "n_embd", ...):
// every field >= 1 and within its limit, n_embd divisible by n_head,
// seq_len <= block_size.
absl::Status ValidateGptDims(const GptDims& dims);
// The same check as the first problem found, its field named as in GptDims
// ("n_embd"), or nothing.
std::optional<FieldViolation> GptDimsViolation(const GptDims& dims);

// The spec above (named "gpt"). InvalidArgument as ValidateGptDims.
absl::StatusOr<plan::ModelSpec> GptSpec(const GptDims& dims);

// Flat parameter indices: embed holds 0 (wte) and 1 (wpe); block l's
// parameters start at 2 + 12 l in the order above; head's at 2 + 12 L.
inline constexpr int kGptParamsPerBlock = 12;
inline constexpr int GptBlockParam(int64_t layer) {
  return static_cast<int>(2 + kGptParamsPerBlock * layer);
}

}  // namespace muonmesh::model
