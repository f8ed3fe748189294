#pragma once

// Resharding (docs/architecture.md §7, "Resharding"): a checkpoint written
// under one layout (world size, strategy, instances, EP, owners) put back
// together as whole tensors with their optimizer state (WholeState), which a
// Trainer of any other layout of the same model loads (Trainer::LoadState).
// The shard files say where each of their runs sits in the whole tensors
// (Trainer::SaveShards), so no plan is needed to consolidate them.
//
// The consolidated file, one safetensors file: every parameter under its own
// name (so the file is also an init.safetensors or --sample weights file),
// each tensor's optimizer state as "optimizer/<name>/momentum" (Muon) or
// "optimizer/<name>/exp_avg" and ".../exp_avg_sq" (AdamW); metadata: format
// "muonmesh.state.v1", the step, and the tensors in order with their
// optimizers.
//
// Free functions; they hold the whole model's state in memory (parameters
// and two optimizer buffers: 12 bytes a parameter) plus one rank's file.

#include <string>

#include "absl/status/statusor.h"
#include "worker/runtime/whole_state.h"

namespace muonmesh::worker {

// Puts the checkpoint in `step_dir` back together: its manifest and every
// rank's file, each checked against the manifest's size and CRC-32, and
// every element of every tensor (and of its optimizer state) found in some
// rank's shard. Errors name the folder or the file and what is wrong;
// FailedPrecondition for a checkpoint written before shard files recorded
// their runs.
absl::StatusOr<WholeState> ConsolidateCheckpoint(const std::string& step_dir);

// Writes `state` as the consolidated file (atomically, as WriteSafetensors).
absl::Status WriteConsolidated(const WholeState& state, const std::string& path);

// Reads a consolidated file; a plain safetensors file of parameters (an
// export, init weights) reads as parameters without optimizer state, in the
// file's order, at step 0.
absl::StatusOr<WholeState> ReadConsolidated(const std::string& path);

// What init.checkpoint names, as a WholeState: a file (ReadConsolidated), a
// `step-N` folder (ConsolidateCheckpoint), a `checkpoints/` folder or a
// job's output folder (its newest complete checkpoint; those that are not
// are skipped with the reason in `notes`). `*from` says what was read.
absl::StatusOr<WholeState> LoadWholeState(const std::string& source, std::string* from,
                                          std::vector<std::string>* notes);

}  // namespace muonmesh::worker
