#pragma once

// A language model's corpus on disk as one worker::TokenStream
// (worker/model/token_windows.h): files memory-mapped (never read whole into
// memory) and concatenated in the order given.
//
//   text    every byte is a token (0..255)
//   tokens  llm.c / modded-nanogpt shards (.bin): a header of 256
//           little-endian int32 (magic 20240520, version 1, token count,
//           the rest unused), then that many little-endian uint16 tokens
//
// A stream is immutable once opened: Read may run on any thread at once.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job/corpus.h"
#include "worker/model/token_windows.h"

namespace muonmesh::io {

// The shard format is read in one place (proto/job/corpus.h).
using job::kTokenShardHeaderBytes;
using job::kTokenShardMagic;
using job::kTokenShardVersion;

enum class TokenFormat { kText, kShards };

// Opens `files` (at least one) as one stream. InvalidArgument naming the
// file for an empty text file, a shard with a wrong magic or version, or
// a shard whose size is not the header plus its token count; NotFound or
// the OS's error for a file that cannot be opened or mapped.
absl::StatusOr<std::shared_ptr<const worker::TokenStream>> OpenTokenFiles(
    const std::vector<std::string>& files, TokenFormat format);

// Tokens [begin, end) of `stream` as a stream of their own (the training
// and validation parts of one corpus). InvalidArgument unless
// 0 <= begin < end <= N.
absl::StatusOr<std::shared_ptr<const worker::TokenStream>> SliceTokens(
    std::shared_ptr<const worker::TokenStream> stream, int64_t begin, int64_t end);

}  // namespace muonmesh::io
