// model: {synthetic: {spec: FILE | model: {...}, scale}}: any model's shapes
// (a ModelSpec file, such as specs/llama3-8b.json, or the spec inline),
// scaled, with generated gradients (worker/model/synthetic.h).

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/model/synthetic_spec.h"
#include "proto/convert/plan_convert.h"
#include "proto/io/message_file.h"
#include "proto/job/kinds/kinds.h"

namespace muonmesh::job::kinds {
namespace {

void Validate(const v1::JobSpec& job, plan::Violations& v) {
  const v1::SyntheticModel& s = job.model().synthetic();
  if (s.spec().empty() && !s.has_model()) {
    v.Add("model.synthetic.spec",
          "required: the path of a model spec file (JSON or YAML), or the spec inline in "
          "model.synthetic.model");
  }
  if (!std::isfinite(s.scale()) || s.scale() < 0 || s.scale() > 1) {
    v.Add("model.synthetic.scale",
          absl::StrCat("must be in (0, 1] (0 or unset: 1), got ", s.scale()));
  }
}

ModelForm Resolve(const v1::ModelConfig& model, const std::string& job_dir) {
  const v1::SyntheticModel& s = model.synthetic();
  SyntheticModel out;
  if (s.has_model()) {
    out.inline_spec = s.model();
  } else {
    out.spec_path = ResolveJobPath(job_dir, s.spec());
  }
  out.scale = s.scale() == 0 ? 1.0 : s.scale();
  return out;
}

absl::StatusOr<plan::ModelSpec> Spec(const ModelForm& form, int64_t ep) {
  const SyntheticModel& s = std::get<SyntheticModel>(form);
  if (s.inline_spec.has_value()) {
    return model::ScaleModelSpec(convert::ModelFromProto(*s.inline_spec), s.scale, ep);
  }
  if (s.spec_path.empty()) {
    return absl::InvalidArgumentError(
        "model.synthetic: neither an inline spec (model) nor a spec file (spec) is given");
  }
  v1::ModelSpec proto;
  MUONMESH_RETURN_IF_ERROR(protoio::LoadMessageFile(s.spec_path, &proto));
  absl::StatusOr<plan::ModelSpec> scaled = model::ScaleModelSpec(convert::ModelFromProto(proto), s.scale, ep);
  if (!scaled.ok()) {
    return absl::Status(scaled.status().code(),
                        absl::StrCat(s.spec_path, ": ", scaled.status().message()));
  }
  return scaled;
}

std::optional<ModelFile> File(const v1::ModelConfig& model) {
  const v1::SyntheticModel& s = model.synthetic();
  if (s.spec().empty() && !s.has_model()) return std::nullopt;
  return ModelFile{"model.synthetic.spec", s.spec(), s.has_model()};
}

absl::Status Embed(v1::ModelConfig* model, const std::string& path) {
  v1::SyntheticModel* s = model->mutable_synthetic();
  s->set_spec(path);
  return protoio::LoadMessageFile(path, s->mutable_model());
}

}  // namespace

const ModelKind kSynthetic = {
    .name = "synthetic",
    .proto_case = v1::ModelConfig::kSynthetic,
    .data = DataUse::kNone,
    .size_field = "model.synthetic.spec",
    .validate = &Validate,
    .resolve = &Resolve,
    .spec = &Spec,
    .model_file = &File,
    .embed_model_file = &Embed,
};

}  // namespace muonmesh::job::kinds
