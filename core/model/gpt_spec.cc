#include "core/model/gpt_spec.h"

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muonmesh::model {
namespace {

std::optional<FieldViolation> InRange(const char* field, int64_t value, int64_t limit) {
  if (value < 1 || value > limit) {
    return FieldViolation{field, absl::StrCat(value, " is not in [1, ", limit, "]")};
  }
  return std::nullopt;
}

plan::ParamSpec Param(std::string name, std::vector<int64_t> shape, const char* optimizer) {
  return plan::ParamSpec{std::move(name), std::move(shape), optimizer, false};
}

plan::UnitSpec Block(int64_t l, int64_t c) {
  const std::string p = absl::StrCat("h.", l, ".");
  plan::UnitSpec unit;
  unit.name = absl::StrCat("h.", l);
  unit.params = {
      Param(p + "ln_1.weight", {c}, "adamw"),
      Param(p + "ln_1.bias", {c}, "adamw"),
      Param(p + "attn.c_attn.weight", {3 * c, c}, "muon"),
      Param(p + "attn.c_attn.bias", {3 * c}, "adamw"),
      Param(p + "attn.c_proj.weight", {c, c}, "muon"),
      Param(p + "attn.c_proj.bias", {c}, "adamw"),
      Param(p + "ln_2.weight", {c}, "adamw"),
      Param(p + "ln_2.bias", {c}, "adamw"),
      Param(p + "mlp.c_fc.weight", {4 * c, c}, "muon"),
      Param(p + "mlp.c_fc.bias", {4 * c}, "adamw"),
      Param(p + "mlp.c_proj.weight", {c, 4 * c}, "muon"),
      Param(p + "mlp.c_proj.bias", {c}, "adamw"),
  };
  unit.gathers_per_step = 2;  // forward, then again for the backward pass
  return unit;
}

}  // namespace

std::optional<FieldViolation> GptDimsViolation(const GptDims& d) {
  for (const auto& [field, value, limit] :
       {std::tuple{"vocab_size", d.vocab_size, kGptMaxVocab},
        std::tuple{"block_size", d.block_size, kGptMaxBlockSize},
        std::tuple{"n_layer", d.n_layer, kGptMaxLayers},
        std::tuple{"n_embd", d.n_embd, kGptMaxEmbd}, std::tuple{"n_head", d.n_head, d.n_embd},
        std::tuple{"seq_len", d.seq_len, d.block_size}}) {
    if (std::optional<FieldViolation> v = InRange(field, value, limit)) return v;
  }
  if (d.n_embd % d.n_head != 0) {
    return FieldViolation{"n_embd",
                          absl::StrCat(d.n_embd, " is not divisible by n_head ", d.n_head)};
  }
  const int64_t widest = std::max(d.vocab_size, 4 * d.n_embd);
  if (d.seq_len * widest >= kGptMaxSampleElements) {
    return FieldViolation{
        "seq_len", absl::StrCat(d.seq_len, " positions of ", widest, " floats exceed the limit of ",
                                kGptMaxSampleElements, " per sample")};
  }
  return std::nullopt;
}

absl::Status ValidateGptDims(const GptDims& d) {
  if (std::optional<FieldViolation> v = GptDimsViolation(d)) {
    return absl::InvalidArgumentError(absl::StrCat(v->field, ": ", v->description));
  }
  return absl::OkStatus();
}

absl::StatusOr<plan::ModelSpec> GptSpec(const GptDims& d) {
  if (absl::Status s = ValidateGptDims(d); !s.ok()) return s;
  plan::ModelSpec spec;
  spec.name = "gpt";
  plan::UnitSpec embed;
  embed.name = "embed";
  embed.params = {Param("wte.weight", {d.vocab_size, d.n_embd}, "adamw"),
                  Param("wpe.weight", {d.block_size, d.n_embd}, "adamw")};
  embed.gathers_per_step = 2;  // the lookup, then the tied head's logits
  spec.units.push_back(std::move(embed));
  for (int64_t l = 0; l < d.n_layer; ++l) spec.units.push_back(Block(l, d.n_embd));
  plan::UnitSpec head;
  head.name = "head";
  head.params = {Param("ln_f.weight", {d.n_embd}, "adamw"),
                 Param("ln_f.bias", {d.n_embd}, "adamw")};
  head.gathers_per_step = 1;
  spec.units.push_back(std::move(head));
  return spec;
}

}  // namespace muonmesh::model
