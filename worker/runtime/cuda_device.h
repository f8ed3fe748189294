#pragma once

// A CUDA GPU as the runtime's Device (worker/runtime/device.h): shards in
// device memory, copies with cudaMemcpy, the elementwise optimizer steps of
// worker/cuda/optimizer_cuda.h (bit-identical to the CPU's) and the bf16
// Newton-Schulz of worker/cuda/newton_schulz_cuda.h, all on one stream of
// the chosen GPU. Every method waits for its work (Device's contract), so
// NCCL collectives on their own stream may follow at once.
//
// Built only with MUONMESH_ENABLE_CUDA. The thread that creates it keeps the
// GPU current (cudaSetDevice at creation) and must be the one that uses it.

#include <memory>

#include "absl/status/statusor.h"
#include "worker/runtime/device.h"

namespace muonmesh::worker {

// The GPU `ordinal` (made current on this thread). FailedPrecondition when
// there is no such GPU.
absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int ordinal);

}  // namespace muonmesh::worker
