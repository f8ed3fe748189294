#pragma once

// Builds what a job runs on from its resolved job file: the device, the
// workload (with its dataset) and the initial weights. Shared by the
// standalone launcher and, later, the worker daemon. Compiled twice, like
// the launcher: with MUONMESH_WORKER_WITH_CUDA=1 it also makes CUDA devices
// and GPU workloads; without, device: cuda is Unimplemented.
//
// Free functions; any thread may call them.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/types.h"
#include "worker/job/job.h"
#include "worker/model/workload.h"
#include "worker/runtime/device.h"

namespace muonmesh::worker {

// The job's workload on the host: mlp or moe_mlp with teacher data or the
// data file (InvalidArgument naming the file and tensor for a wrong shape),
// or synthetic from its spec file.
absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const ResolvedJob& job);

// The job's device: the CPU, or the GPU `cuda_device` (-1: rank modulo the
// GPUs of this machine). FailedPrecondition when there is no GPU for it.
absl::StatusOr<std::unique_ptr<Device>> MakeDevice(const ResolvedJob& job, int32_t rank,
                                                   int cuda_device);

// The workload's GPU form (every built-in workload has one).
absl::StatusOr<std::unique_ptr<Workload>> OnGpu(const ResolvedJob& job,
                                                std::unique_ptr<Workload> workload);

// Every parameter of `spec` (flat order) from the safetensors file at
// `path`; InvalidArgument naming the tensor when one is missing or has
// another shape.
absl::StatusOr<std::vector<std::vector<float>>> InitialFromFile(const plan::ModelSpec& spec,
                                                                const std::string& path);

// The model's spec, made cheaply: mlp and moe_mlp from their dims (no
// weights or data yet, so that a memory check can come first); synthetic by
// loading its spec file, which is all that workload holds: it is made here
// and handed back in `*synthetic`.
absl::StatusOr<plan::ModelSpec> ModelSpecOf(const ResolvedJob& job,
                                            std::unique_ptr<Workload>* synthetic);

}  // namespace muonmesh::worker
