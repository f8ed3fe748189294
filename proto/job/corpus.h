#pragma once

// A language model's corpus as a job names it (data.text or data.tokens):
// a file or a glob pattern for training, optionally one for validation, and
// the fraction of the training tokens held out when there is none. Patterns
// are expanded where the files are: on the worker that reads them.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

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

}  // namespace muonmesh::job
