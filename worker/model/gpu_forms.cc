#include "worker/model/gpu_forms.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/model/gpt_cuda.h"
#include "worker/model/mlp_cuda.h"
#include "worker/model/moe_mlp_cuda.h"
#include "worker/model/synthetic_cuda.h"

namespace muonmesh::worker {
namespace {

// `host` as the host workload `Host` that `Gpu::Create` moves to the GPU.
template <typename Host, typename Gpu>
absl::StatusOr<std::unique_ptr<Workload>> Move(std::unique_ptr<Workload> host) {
  auto* typed = dynamic_cast<Host*>(host.get());
  if (typed == nullptr) {
    return absl::InternalError("the GPU form was given another kind's host workload");
  }
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<Gpu> gpu, Gpu::Create(std::move(*typed)));
  return std::unique_ptr<Workload>(std::move(gpu));
}

constexpr GpuForm kForms[] = {
    {"mlp", &Move<Mlp, CudaMlp>},
    {"moe_mlp", &Move<MoeMlp, CudaMoeMlp>},
    {"synthetic", &Move<Synthetic, CudaSynthetic>},
    {"gpt", &Move<Gpt, CudaGpt>},
};

constexpr bool TableMatchesNames() {
  if (std::size(kForms) != std::size(kGpuFormNames)) return false;
  for (size_t i = 0; i < std::size(kForms); ++i) {
    if (kForms[i].kind != kGpuFormNames[i]) return false;
  }
  return true;
}
static_assert(TableMatchesNames(), "kGpuFormNames (gpu_forms.h) must list kForms' kinds in order");

}  // namespace

absl::Span<const GpuForm> GpuForms() { return kForms; }

const GpuForm* FindGpuForm(std::string_view kind) {
  for (const GpuForm& form : kForms) {
    if (form.kind == kind) return &form;
  }
  return nullptr;
}

}  // namespace muonmesh::worker
