#pragma once

// The GPU form of each model kind's workload (device: cuda jobs), registered
// beside the CUDA workloads so that only the build with CUDA links them. The
// host side of a kind is worker/model_kinds.h, the job-file side
// proto/job/model_kind.h; the three are found by the kind's name.
//
// kGpuFormNames lists the kinds that have a GPU form, here in a header with
// no CUDA in it: gpu_forms.cc fails to compile unless its table registers
// exactly these, and tests/worker/model_kinds_test.cc fails unless every kind
// of the job file is among them.
//
// An immutable table: any thread may read it.

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

inline constexpr std::string_view kGpuFormNames[] = {"mlp", "moe_mlp", "synthetic", "gpt"};

struct GpuForm {
  std::string_view kind;  // the model kind's name ("gpt")
  // The workload moved to the current GPU; `host` is the kind's host
  // workload (InternalError otherwise).
  absl::StatusOr<std::unique_ptr<Workload>> (*to_gpu)(std::unique_ptr<Workload> host);
};

absl::Span<const GpuForm> GpuForms();

// nullptr when the kind has no GPU form.
const GpuForm* FindGpuForm(std::string_view kind);

}  // namespace muonmesh::worker
