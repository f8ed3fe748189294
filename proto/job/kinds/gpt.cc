// model: {gpt: {vocab_size, block_size, n_layer, n_head, n_embd, seq_len}}:
// the GPT-2 decoder on a token corpus (worker/model/gpt.h).

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/model/gpt_spec.h"
#include "proto/job/kinds/kinds.h"

namespace muonmesh::job::kinds {
namespace {

model::GptDims DimsOf(const v1::GptModel& g) {
  return {g.vocab_size(), g.block_size(), g.n_layer(), g.n_head(), g.n_embd(), g.seq_len()};
}

// Each field required and in range, then the rules between them
// (model::GptDimsViolation), and what text data asks of the vocabulary.
void Validate(const v1::JobSpec& job, plan::Violations& v) {
  const v1::GptModel& g = job.model().gpt();
  const std::pair<const char*, int64_t> fields[] = {
      {"vocab_size", g.vocab_size()}, {"block_size", g.block_size()}, {"n_layer", g.n_layer()},
      {"n_head", g.n_head()},         {"n_embd", g.n_embd()},         {"seq_len", g.seq_len()}};
  bool given = true;
  for (const auto& [name, value] : fields) {
    if (value < 1) {
      v.Add(absl::StrCat("model.gpt.", name), value == 0 ? std::string("required: must be >= 1")
                                                         : absl::StrCat("must be >= 1, got ", value));
      given = false;
    }
  }
  if (given) {
    if (std::optional<FieldViolation> f = model::GptDimsViolation(DimsOf(g))) {
      v.Add(absl::StrCat("model.gpt.", f->field), f->description);
    }
  }
  if (job.data().source_case() == v1::DataConfig::kText && g.vocab_size() >= 1 &&
      g.vocab_size() < 256) {
    v.Add("model.gpt.vocab_size",
          absl::StrCat(g.vocab_size(), " is too small for text data, whose tokens are bytes "
                                       "(0..255): at least 256"));
  }
}

ModelForm Resolve(const v1::ModelConfig& model, const std::string& /*job_dir*/) {
  return GptModel{DimsOf(model.gpt())};
}

absl::StatusOr<plan::ModelSpec> Spec(const ModelForm& form, int64_t /*ep*/) {
  return model::GptSpec(std::get<GptModel>(form).dims);
}

// c_attn.weight [3C, C] holds q, k and v: split, three [C, C] blocks; per
// head, 3H blocks of [C/H, C].
void AttentionBlocks(const ModelForm& form, bool split_qkv, bool per_head,
                     plan::ModelSpec* spec) {
  const model::GptDims& d = std::get<GptModel>(form).dims;
  const int64_t rows = per_head ? d.n_embd / d.n_head : split_qkv ? d.n_embd : 0;
  for (plan::UnitSpec& unit : spec->units) {
    for (plan::ParamSpec& p : unit.params) {
      if (absl::EndsWith(p.name, ".attn.c_attn.weight")) p.muon_block_rows = rows;
    }
  }
}

}  // namespace

const ModelKind kGpt = {
    .name = "gpt",
    .proto_case = v1::ModelConfig::kGpt,
    .data = DataUse::kCorpus,
    .size_field = "model.gpt",
    .validate = &Validate,
    .resolve = &Resolve,
    .spec = &Spec,
    .attention_blocks = &AttentionBlocks,
    .vocab_size = [](const ModelForm& form) { return std::get<GptModel>(form).dims.vocab_size; },
};

}  // namespace muonmesh::job::kinds
