#pragma once

// Builds what a job runs on from its resolved job file: the device, the
// workload (with its dataset) and the initial weights. Shared by the
// standalone launcher and the worker daemon. Compiled twice, like
// the launcher: with MUONMESH_WORKER_WITH_CUDA=1 it also makes CUDA devices
// and GPU workloads; without, device: cuda is Unimplemented.
//
// Free functions; any thread may call them.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/types.h"
#include "proto/job/job.h"
#include "worker/model/workload.h"
#include "worker/runtime/device.h"

namespace muonmesh::worker {

// The job's workload on the host, made by its kind's registration
// (worker/model_kinds.h) with its data.
absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const job::ResolvedJob& job);

// The job's device: the CPU, or the GPU `cuda_device` (-1: rank modulo the
// GPUs of this machine). FailedPrecondition when there is no GPU for it.
absl::StatusOr<std::unique_ptr<Device>> MakeDevice(const job::ResolvedJob& job, int32_t rank,
                                                   int cuda_device);

// The workload's GPU form (its kind's, worker/model/gpu_forms.h);
// Unimplemented in the build without CUDA or for a kind without one.
absl::StatusOr<std::unique_ptr<Workload>> OnGpu(const job::ResolvedJob& job,
                                                std::unique_ptr<Workload> workload);

// Every parameter of `spec` (flat order) from the safetensors file at
// `path`; InvalidArgument naming the tensor when one is missing or has
// another shape.
absl::StatusOr<std::vector<std::vector<float>>> InitialFromFile(const plan::ModelSpec& spec,
                                                                const std::string& path);
// The workload's buffers (in `buffers` order) from the same file, by name; a
// buffer the file lacks is 0 (an init file need not carry them);
// InvalidArgument naming it for another shape.
absl::StatusOr<std::vector<std::vector<float>>> BuffersFromFile(
    const std::vector<BufferSpec>& buffers, const std::string& path);

}  // namespace muonmesh::worker
