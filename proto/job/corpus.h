#pragma once

// A language model's corpus as a job names it (data.text or data.tokens):
// a file or a glob pattern for training, optionally one for validation, and
// the fraction of the training tokens held out when there is none. Patterns
// are expanded where the files are: on the worker that reads them.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace muonmesh::job {

struct Corpus {
  bool tokens = false;  // llm.c .bin shards; false: raw text, a token per byte
  std::string train;    // a file or a pattern, resolved against the job's folder
  std::string val;      // "" when validation comes from the training tokens
  double val_fraction = 0.1;
};

// Whether `pattern` has glob characters (*, ? or [) in its last component.
bool IsPattern(const std::string& pattern);

// The regular files `pattern` names, in sorted (byte) order: the file
// itself when it is not a pattern, else every match of the glob.
// InvalidArgument naming `field` when nothing matches, a match is not a
// regular file, or more than kMaxCorpusFiles match.
inline constexpr size_t kMaxCorpusFiles = 65536;
absl::StatusOr<std::vector<std::string>> ExpandCorpus(const std::string& field,
                                                      const std::string& pattern);

// llm.c's token shard (.bin): a header of 256 little-endian int32 (magic,
// version, token count, the rest unused), then the tokens as little-endian
// uint16. The one reading of the format: the worker's token files
// (worker/io/token_files.h) and the pre-flight below both use it.
inline constexpr int32_t kTokenShardMagic = 20240520;
inline constexpr int32_t kTokenShardVersion = 1;
inline constexpr int64_t kTokenShardHeaderBytes = 256 * 4;

// The token count of the shard at `path`, of `file_bytes` bytes, whose
// first bytes (up to kTokenShardHeaderBytes) are `head`. InvalidArgument
// naming `path` for a file shorter than the header, a wrong magic or
// version, or a size that is not the header plus its count's tokens.
absl::StatusOr<int64_t> ShardTokenCount(const std::string& path, absl::string_view head,
                                        int64_t file_bytes);

// What a corpus pre-flight found.
struct CorpusSummary {
  int64_t files = 0;
  int64_t tokens = 0;
  int64_t bytes = 0;  // read to scan the tokens (0 without a scan)
};

// Pre-flight of one corpus pattern (`field` names it, e.g. data.tokens.train):
// every file it expands to is readable and well formed (shards: header and
// size; text: not empty) and, with `scan`, every token is below
// `vocab_size` (text files are a token per byte). InvalidArgument naming the
// field, the file and, for a token out of range, its index in the file and
// its value; the OS's error for a file that cannot be read.
absl::StatusOr<CorpusSummary> CheckCorpusFiles(const std::string& field,
                                               const std::string& pattern, bool tokens,
                                               int64_t vocab_size, bool scan);

// The pre-flight of a job's corpus: its training pattern and, when given,
// its validation pattern, through CheckCorpusFiles under the fields
// data.tokens.* or data.text.*.
struct CorpusReport {
  CorpusSummary train, val;
};
absl::StatusOr<CorpusReport> CheckCorpus(const Corpus& corpus, int64_t vocab_size, bool scan);

}  // namespace muonmesh::job
