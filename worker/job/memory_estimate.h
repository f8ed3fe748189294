#pragma once

// What one rank of a job will allocate on the host, estimated from the job
// and its plan before anything is allocated, so that a job too large for the
// machine is refused with RESOURCE_EXHAUSTED naming the job fields its size
// comes from, instead of aborting on std::bad_alloc or being killed by the
// kernel half way through.
//
// The estimate follows the worker's phases, each the sum of what is alive
// together (sizes in bytes, fp32 tensors):
//  - "preparing data": the workload's dataset and, for teacher data, the
//    teacher's weights and its forward pass over every sample;
//  - "initialising shards": the dataset, this rank's shards (parameters k*S,
//    gradient, two optimizer states, per unit and mesh) and the initial
//    weights (the whole model from init.safetensors, else one unit);
//  - "training": the dataset and the shards, plus one step's scratch: the
//    workload's activations for the local batch, the gathered unit buffer,
//    one unit's parameters and gradients, and the largest unit's Muon
//    exchange (this rank's rows, the whole matrices it owns, send and
//    receive buffers, the Newton-Schulz workspace of its largest matrix in
//    the form that runs: NewtonSchulz::WorkspaceBytes);
//  - "export": the dataset, the shards and one whole unit being gathered.
// Plus kRuntimeBaseBytes for the libraries, OpenBLAS and Gloo. The peak is
// the largest phase. It errs high on purpose (every buffer at its largest);
// tests check it against measured peak RSS.
//
// For device: cuda jobs the shards and Muon buffers live on the GPU: only the
// host part (dataset, teacher, initial weights) is counted here, plus
// kCudaRuntimeBytes for the CUDA runtime, cuBLAS and NCCL.
//
// Free functions; any thread may call them.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/plan/types.h"
#include "proto/job/job.h"
#include "worker/job/workload_memory.h"

namespace muonmesh::worker {

// Resident memory of a worker before it allocates anything for the job
// (measured ~40-60 MiB: libraries, OpenBLAS and Gloo threads); counted once.
inline constexpr int64_t kRuntimeBaseBytes = int64_t{96} << 20;

// What the CUDA runtime, cuBLAS and NCCL add to a device: cuda rank's resident
// memory once loaded and initialised: measured 0.93 GB (peak RSS of a
// one-rank mlp job on an NVIDIA H200 with CUDA 13, 951 MB, against 23 MB for
// the same job on the CPU; BENCHMARKS.md), rounded up.
inline constexpr int64_t kCudaRuntimeBytes = int64_t{1} << 30;

struct MemoryPhase {
  std::string name;
  std::vector<MemoryItem> items;
  double bytes() const;
};

struct MemoryEstimate {
  std::vector<MemoryPhase> phases;
  // The largest phase (index into phases) and its bytes.
  size_t peak_phase = 0;
  double peak_bytes = 0;
};

// The host memory of rank `rank` (in [0, world_size)) running `job` with
// `plan` (computed from the job's model with its optimizer rules applied).
// `resharding`: the rank starts from a checkpoint of another layout (a
// resume of an elastic job at another size), which it puts back together
// whole as it does init.checkpoint.
MemoryEstimate EstimateRankMemory(const job::ResolvedJob& job, const plan::Plan& plan, int32_t rank,
                                  const InputFileBytes& files, bool resharding = false);

// OK when the estimate's peak fits `budget_bytes`; otherwise
// ResourceExhausted: "rank R needs about X while <phase>, more than its
// memory budget of Y: field: what Z; ..." with the phase's largest items
// first.
absl::Status CheckMemoryBudget(const MemoryEstimate& estimate, int64_t budget_bytes,
                               int32_t rank);

}  // namespace muonmesh::worker
