#pragma once

// Checkpoints of a job on disk. They live in
// `<output.dir>/checkpoints/step-NNNNNNNN/`: one shard file per rank
// (`rank-RRRRR.safetensors`, Trainer::SaveShards) and a `COMPLETE` marker
// that rank 0 writes once every rank has saved. Folders without the marker
// are partial and never resumed from; rank 0 keeps the two newest complete
// checkpoints and removes older folders.
//
// Free functions; a Trainer is driven by one thread, so is SaveCheckpoint.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {

std::string CheckpointDir(const std::string& output_dir, int64_t step);

// The newest complete checkpoint's step under `output_dir`, if any.
std::optional<int64_t> NewestCheckpoint(const std::string& output_dir);

// A collective: every rank saves its shards at the trainer's current step;
// after a barrier rank 0 marks the checkpoint complete and prunes older
// ones. Errors name the file or the phase (saving, waiting for the others).
absl::Status SaveCheckpoint(Trainer& trainer, const std::string& output_dir, int64_t world_size,
                            int32_t rank);

// Writes `text` to `path` atomically and durably: a temporary file, synced,
// renamed over `path`, then the folder synced. FailedPrecondition, writing
// nothing, if `path` exists and is not a regular file.
absl::Status WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace muonmesh::worker
