#pragma once

// How much host memory one worker process may plan to use, and sizes written
// for people ("8GiB", "512M").
//
// The budget bounds what a job file can make a worker allocate: before it
// allocates anything whose size comes from the job (weights, data, shards,
// Muon buffers), the worker estimates its peak (worker/job/memory_estimate.h)
// and refuses the job with RESOURCE_EXHAUSTED when the estimate exceeds the
// budget, instead of growing until the kernel kills it or an allocation
// throws. The default is tied to the machine: kDefaultBudgetFraction of the
// smallest of the physical memory, the cgroup's memory limit (v2
// memory.max, or v1 memory.limit_in_bytes) and the process's RLIMIT_AS and
// RLIMIT_DATA, divided by the number of workers that share the machine.
//
// Free functions; any thread may call them.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace muonmesh::worker {

inline constexpr double kDefaultBudgetFraction = 0.8;

// The smallest of the limits above, in bytes; never 0 (falls back to the
// physical memory, or to 1 GiB if even that cannot be read).
int64_t MachineMemoryBytes();

// kDefaultBudgetFraction * MachineMemoryBytes() / max(1, processes_per_host).
int64_t DefaultMemoryBudgetBytes(int64_t processes_per_host = 1);

// "8GiB", "8G" (both 2^30), "512MiB", "1.5GiB", "100000" (bytes), "auto"
// (-> 0, meaning the default). InvalidArgument naming `text` otherwise, or
// for a size of 0 or beyond 2^62 bytes.
absl::StatusOr<int64_t> ParseByteSize(const std::string& text);

// For messages: "1.50 GiB", "512.0 MiB", "812 B".
std::string FormatBytes(double bytes);

}  // namespace muonmesh::worker
