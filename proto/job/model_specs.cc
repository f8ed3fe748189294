#include "proto/job/model_specs.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/model/gpt_spec.h"
#include "core/model/mlp_spec.h"
#include "core/model/moe_mlp_spec.h"
#include "core/model/synthetic_spec.h"
#include "proto/convert/plan_convert.h"
#include "proto/io/message_file.h"

namespace muonmesh::job {
namespace {

absl::StatusOr<plan::ModelSpec> SyntheticSpecOf(const v1::SyntheticModel& synthetic,
                                                int64_t ep, const std::string& path) {
  const double scale = synthetic.scale() == 0 ? 1.0 : synthetic.scale();
  if (synthetic.has_model()) {
    return model::ScaleModelSpec(ModelFromProto(synthetic.model()), scale, ep);
  }
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "model.synthetic: neither an inline spec (model) nor a spec file (spec) is given");
  }
  v1::ModelSpec proto;
  MUONMESH_RETURN_IF_ERROR(protoio::LoadMessageFile(path, &proto));
  absl::StatusOr<plan::ModelSpec> scaled = model::ScaleModelSpec(ModelFromProto(proto), scale, ep);
  if (!scaled.ok()) {
    return absl::Status(scaled.status().code(),
                        absl::StrCat(path, ": ", scaled.status().message()));
  }
  return scaled;
}

}  // namespace

absl::StatusOr<plan::ModelSpec> ModelSpecOf(const v1::ModelConfig& model,
                                            int64_t expert_parallel_size,
                                            const std::string& synthetic_spec_path) {
  const int64_t ep = std::max<int64_t>(1, expert_parallel_size);
  switch (model.kind_case()) {
    case v1::ModelConfig::kMlp:
      return model::MlpSpec(
          std::vector<int64_t>(model.mlp().dims().begin(), model.mlp().dims().end()));
    case v1::ModelConfig::kMoeMlp: {
      const v1::MoeMlpModel& m = model.moe_mlp();
      return model::MoeMlpSpec(
          {m.d_in(), m.d_model(), m.d_expert(), m.num_experts(), m.d_out()});
    }
    case v1::ModelConfig::kSynthetic:
      return SyntheticSpecOf(model.synthetic(), ep, synthetic_spec_path);
    case v1::ModelConfig::kGpt: {
      const v1::GptModel& g = model.gpt();
      return model::GptSpec(
          {g.vocab_size(), g.block_size(), g.n_layer(), g.n_head(), g.n_embd(), g.seq_len()});
    }
    case v1::ModelConfig::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("model: required (mlp, moe_mlp, synthetic or gpt)");
}

absl::StatusOr<plan::ModelSpec> ModelSpecOf(const ResolvedJob& job) {
  return ModelSpecOf(job.model, job.parallelism.expert_model_parallel_size,
                     job.synthetic_spec_path);
}

}  // namespace muonmesh::job
