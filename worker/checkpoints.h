#pragma once

// Checkpoints of a job on disk. They live in
// `<output.dir>/checkpoints/step-NNNNNNNN/`: one shard file per rank
// (`rank-RRRRR.safetensors`, Trainer::SaveShards, written to a temporary file,
// synced and renamed) and a `COMPLETE` manifest that rank 0 writes (the same
// way) once every rank has saved: the step, the world size, the layout's
// fingerprint and every rank file's size and CRC-32. A resume takes the newest
// checkpoint whose manifest is there and whose files all match it; one that
// is partial or damaged is skipped for the one before, with the reason.
// Rank 0 then keeps the training.keep_checkpoints newest complete ones (2 by
// default) and removes older folders (PruneCheckpoints), so a failed write
// (a full or read-only disk)
// leaves the previous checkpoint as it was.
//
// Free functions; a Trainer is driven by one thread, so is SaveCheckpoint.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {

std::string CheckpointDir(const std::string& output_dir, int64_t step);

// The newest complete checkpoint's step under `output_dir`, if any (the
// marker alone: NewestValidCheckpoint also checks the files).
std::optional<int64_t> NewestCheckpoint(const std::string& output_dir);

// A complete checkpoint's manifest (the COMPLETE file), every file it lists
// checked against its size and CRC-32: NotFound without a COMPLETE marker,
// DataLoss for a malformed manifest or a file that does not match it (the
// message says which), the read's error for a missing file.
struct CheckpointManifest {
  int64_t step = -1;
  int64_t world_size = -1;
  std::string layout;              // Trainer::LayoutFingerprint of the writers
  std::vector<std::string> files;  // RankFile(r) for r in [0, world_size)
};
absl::StatusOr<CheckpointManifest> ReadCheckpointManifest(const std::string& dir);

// The newest checkpoint a job of `world_size` ranks (kAnyWorldSize: of any
// size, resharding when it differs) can resume from: its manifest exists
// and lists every rank's file with the size and CRC-32 the file has now.
// `skipped` says why each newer one was passed over.
inline constexpr int64_t kAnyWorldSize = -1;
struct CheckpointChoice {
  std::optional<int64_t> step;
  std::string dir;              // its folder, when there is one
  CheckpointManifest manifest;  // its manifest, when there is one
  std::vector<std::string> skipped;
};
CheckpointChoice NewestValidCheckpoint(const std::string& output_dir, int64_t world_size);
// The same in a folder of `step-N` folders (a job's `checkpoints/`, moved
// or not).
CheckpointChoice NewestValidCheckpointIn(const std::string& checkpoints_dir, int64_t world_size);

// A file's size and CRC-32 (zlib's).
struct Digest {
  int64_t size = 0;
  uint32_t crc32 = 0;
};
absl::StatusOr<Digest> DigestOf(const std::string& path);

// "rank-RRRRR.safetensors".
std::string RankFile(int64_t rank);

// A collective: every rank saves its shards at the trainer's current step;
// after a barrier rank 0 marks the checkpoint complete. Errors name the file
// or the phase (saving, waiting for the others).
absl::Status SaveCheckpoint(Trainer& trainer, const std::string& output_dir, int64_t world_size,
                            int32_t rank);

// Rank 0, after SaveCheckpoint: removes the checkpoint folders older than the
// `keep`-th newest complete one (training.keep_checkpoints, >= 1). A folder
// it cannot remove is named in the error (the new checkpoint stays valid;
// the caller warns and trains on).
absl::Status PruneCheckpoints(const std::string& output_dir, int64_t keep = 2);

// Writes `text` to `path` atomically and durably: a temporary file, synced,
// renamed over `path`, then the folder synced. FailedPrecondition, writing
// nothing, if `path` exists and is not a regular file.
absl::Status WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace muonmesh::worker
