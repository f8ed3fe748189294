#include "core/model/moe_mlp_spec.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace muonmesh::model {

std::vector<std::vector<int64_t>> MoeMlpShapes(const MoeMlpDims& d) {
  return {{d.d_model, d.d_in},
          {d.d_model},
          {d.num_experts, d.d_model},
          {d.num_experts, d.d_expert, d.d_model},
          {d.num_experts, d.d_model, d.d_expert},
          {d.d_out, d.d_model},
          {d.d_out}};
}

absl::Status ValidateMoeMlpDims(const MoeMlpDims& d) {
  const std::pair<const char*, int64_t> fields[] = {
      {"d_in", d.d_in}, {"d_model", d.d_model}, {"d_expert", d.d_expert}, {"d_out", d.d_out}};
  for (const auto& [name, v] : fields) {
    if (v < 1 || v > kMoeMaxDim) {
      return absl::InvalidArgumentError(
          absl::StrCat("moe_mlp ", name, ": ", v, " is not in [1, ", kMoeMaxDim, "]"));
    }
  }
  if (d.num_experts < 1 || d.num_experts > kMoeMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp num_experts: ", d.num_experts,
                                                   " is not in [1, ", kMoeMaxExperts, "]"));
  }
  for (const std::vector<int64_t>& shape : MoeMlpShapes(d)) {
    int64_t n = 1;
    for (int64_t v : shape) {
      n *= v;
      if (n > kMoeMaxElements) {
        return absl::InvalidArgumentError(absl::StrCat(
            "moe_mlp: a tensor of these dims exceeds ", kMoeMaxElements, " elements"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<plan::ModelSpec> MoeMlpSpec(const MoeMlpDims& d) {
  MUONMESH_RETURN_IF_ERROR(ValidateMoeMlpDims(d));
  const std::vector<std::vector<int64_t>> shapes = MoeMlpShapes(d);
  plan::ModelSpec spec;
  spec.name = "moe_mlp";
  spec.units = {
      {"input",
       {{"input.weight", shapes[0], "muon", false}, {"input.bias", shapes[1], "adamw", false}},
       1},
      {"moe",
       {{"router.weight", shapes[2], "adamw", false},
        {"experts.w1", shapes[3], "muon", true},
        {"experts.w2", shapes[4], "muon", true}},
       2},  // gathered again for the backward pass
      {"output",
       {{"output.weight", shapes[5], "muon", false}, {"output.bias", shapes[6], "adamw", false}},
       1},
  };
  return spec;
}

}  // namespace muonmesh::model
