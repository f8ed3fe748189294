#pragma once

// Each rank's per-step records on disk (docs/architecture.md §8):
// <output.dir>/metrics/rank-<R>.jsonl, one JSON object per line and step:
//   {"step": 3, "attempt": 0, "rank": 1, "loss": 0.0123, "val_loss": 0.02 (evaluated
//    steps only), "step_seconds": 0.041,
//    "phases": {"param_gather": ..., ...}, "bytes_sent": {"param_allgather": ...},
//    "ns_flops": 1.2e9, "muon_exchange_calls": 2, "muon_rounds": [{"wave": 0,
//    "units": [0, 3], "domain": "dense", "ns_flops": 1.2e9, "planned_ns_flops": 1.2e9,
//    "planned_critical_ns_flops": 1.3e9, "sent_bytes": ...,
//    "recv_bytes": ..., "wait_ms": 0.4}]}   (rounds in execution order)
// A fresh run truncates the file; a resumed run appends to it, so a step a
// failed attempt ran before its last checkpoint may appear twice (the later
// line is the one the run kept). Lines are written whole and flushed.
//
// Not thread-safe: the rank's training thread owns it.

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {

class StepLog {
 public:
  // Creates <output_dir>/metrics/ if needed. `append` keeps what is there.
  static absl::StatusOr<std::unique_ptr<StepLog>> Open(const std::string& output_dir,
                                                       int32_t rank, int attempt, bool append);
  ~StepLog();

  absl::Status Write(const StepReport& report, absl::Duration step_time);
  const std::string& path() const { return path_; }

 private:
  StepLog(std::string path, std::FILE* file, int32_t rank, int attempt)
      : path_(std::move(path)), file_(file), rank_(rank), attempt_(attempt) {}

  std::string path_;
  std::FILE* file_;
  int32_t rank_;
  int attempt_;
};

// A step's phases in the order it runs them, under the names the JSON lines
// and the workers' metrics use.
std::vector<std::pair<const char*, absl::Duration>> NamedPhases(const PhaseTimes& t);

// The optimizer step: AdamW, Muon (all phases) and the after-step gather.
absl::Duration OptimizerTime(const PhaseTimes& t);

// The JSON object of one step, without the newline (for tests and other
// sinks).
std::string StepJson(const StepReport& report, absl::Duration step_time, int32_t rank,
                     int attempt);

}  // namespace muonmesh::worker
