// model: {moe_mlp: {d_in, d_model, d_expert, num_experts, d_out}}: a one-layer
// top-1 mixture of experts on (x, y) examples (worker/model/moe_mlp.h).

#include "absl/strings/str_cat.h"
#include "core/model/moe_mlp_spec.h"
#include "proto/job/job.h"
#include "proto/job/kinds/kinds.h"

namespace muonmesh::job::kinds {
namespace {

void Validate(const v1::JobSpec& job, plan::Violations& v) {
  const v1::MoeMlpModel& moe = job.model().moe_mlp();
  CheckDim("model.moe_mlp.d_in", moe.d_in(), /*list_entry=*/false, v);
  CheckDim("model.moe_mlp.d_model", moe.d_model(), /*list_entry=*/false, v);
  CheckDim("model.moe_mlp.d_expert", moe.d_expert(), /*list_entry=*/false, v);
  CheckDim("model.moe_mlp.num_experts", moe.num_experts(), /*list_entry=*/false, v);
  CheckDim("model.moe_mlp.d_out", moe.d_out(), /*list_entry=*/false, v);
  const int64_t ep = ExpertParallelSize(job);
  if (ep >= 1 && moe.num_experts() >= 1 && moe.num_experts() % ep != 0) {
    v.Add("model.moe_mlp.num_experts",
          absl::StrCat(moe.num_experts(),
                       " experts do not divide over expert_model_parallel_size ", ep));
  }
}

ModelForm Resolve(const v1::ModelConfig& model, const std::string& /*job_dir*/) {
  const v1::MoeMlpModel& m = model.moe_mlp();
  return MoeMlpModel{{m.d_in(), m.d_model(), m.d_expert(), m.num_experts(), m.d_out()}};
}

absl::StatusOr<plan::ModelSpec> Spec(const ModelForm& form, int64_t /*ep*/) {
  return model::MoeMlpSpec(std::get<MoeMlpModel>(form).dims);
}

}  // namespace

const ModelKind kMoeMlp = {
    .name = "moe_mlp",
    .proto_case = v1::ModelConfig::kMoeMlp,
    .data = DataUse::kExamples,
    .size_field = "model.moe_mlp",
    .validate = &Validate,
    .resolve = &Resolve,
    .spec = &Spec,
};

}  // namespace muonmesh::job::kinds
