// model: {mlp: {dims: [d_in, hidden..., d_out]}}: a dense MLP on (x, y)
// examples (worker/model/mlp.h).

#include <vector>

#include "absl/strings/str_cat.h"
#include "core/model/mlp_spec.h"
#include "proto/job/job.h"
#include "proto/job/kinds/kinds.h"

namespace muonmesh::job::kinds {
namespace {

void Validate(const v1::JobSpec& job, plan::Violations& v) {
  const auto& dims = job.model().mlp().dims();
  if (dims.size() < 2) {
    v.Add("model.mlp.dims",
          absl::StrCat("needs at least 2 sizes (input and output), got ", dims.size()));
  } else if (static_cast<size_t>(dims.size()) > kMaxMlpLayers + 1) {
    v.Add("model.mlp.dims",
          absl::StrCat(dims.size() - 1, " layers exceed the limit of ", kMaxMlpLayers));
    return;
  }
  for (int i = 0; i < dims.size(); ++i) {
    CheckDim(absl::StrCat("model.mlp.dims[", i, "]"), dims[i], /*list_entry=*/true, v);
  }
}

ModelForm Resolve(const v1::ModelConfig& model, const std::string& /*job_dir*/) {
  return MlpModel{{model.mlp().dims().begin(), model.mlp().dims().end()}};
}

absl::StatusOr<plan::ModelSpec> Spec(const ModelForm& form, int64_t /*ep*/) {
  return model::MlpSpec(std::get<MlpModel>(form).dims);
}

}  // namespace

const ModelKind kMlp = {
    .name = "mlp",
    .proto_case = v1::ModelConfig::kMlp,
    .data = DataUse::kExamples,
    .size_field = "model.mlp.dims",
    .validate = &Validate,
    .resolve = &Resolve,
    .spec = &Spec,
};

}  // namespace muonmesh::job::kinds
