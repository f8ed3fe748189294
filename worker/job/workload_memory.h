#pragma once

// What a workload holds in host memory, as its model kind estimates it
// (worker/model_kinds.h) for the rank's estimate (memory_estimate.h).

#include <cstdint>
#include <string>
#include <vector>

namespace muonmesh::worker {

struct MemoryItem {
  std::string field;  // the job field its size comes from, e.g. "model.mlp.dims"
  std::string what;   // e.g. "teacher weights"
  double bytes = 0;
};

// Sizes of the job's input files, which the job file does not give.
struct InputFileBytes {
  int64_t data = 0;  // data.safetensors, if any
  int64_t init = 0;  // init.safetensors, if any
};

// While the workload builds its dataset (`setup`, which includes the
// dataset), for the whole run (`resident`), and per step for a local batch
// (`step`).
struct WorkloadMemory {
  std::vector<MemoryItem> setup;
  std::vector<MemoryItem> resident;
  std::vector<MemoryItem> step;
};

}  // namespace muonmesh::worker
