#pragma once

// Where a language model's samples come from (docs/architecture.md §6): a
// stream of N token ids, read in windows. Sample k is the window at
//   p(k) = (k T) mod (N - T),
// its inputs tok[p, p + T) and its targets tok[p + 1, p + T + 1), so that
// global sample i of step s (k = s G + i for a global batch G) reads the
// same tokens whatever the layout. p(k) repeats with period
// (N - T) / gcd(T, N - T) (WindowPeriod), the workload's num_samples().
//
// Implementations: worker/io/token_files.h (text and llm.c token shards on
// disk, memory-mapped) and InMemoryTokens below. Read may be called from
// any thread at once (implementations are immutable after creation).

#include <cstdint>
#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muonmesh::worker {

class TokenStream {
 public:
  virtual ~TokenStream() = default;
  // N, at least 2.
  virtual int64_t num_tokens() const = 0;
  // Copies tok[begin, begin + count) to out. OutOfRange when the range is
  // not inside [0, N); an I/O error as the file system reports it.
  virtual absl::Status Read(int64_t begin, int64_t count, int32_t* out) const = 0;
  // Where token `position` comes from, for error messages: a file and its
  // byte offset for streams read from files.
  virtual std::string Where(int64_t position) const {
    return absl::StrCat("token ", position, " of the stream");
  }
};

// The period of p(k) above: the number of distinct windows. Needs
// 1 <= seq_len < num_tokens.
inline int64_t WindowPeriod(int64_t num_tokens, int64_t seq_len) {
  const int64_t span = num_tokens - seq_len;
  return span / std::gcd(seq_len, span);
}

// p(k) for sample k in [0, WindowPeriod), without overflow for any N < 2^62.
inline int64_t WindowStart(int64_t sample, int64_t num_tokens, int64_t seq_len) {
  const int64_t span = num_tokens - seq_len;
  return static_cast<int64_t>((static_cast<__int128>(sample) * seq_len) % span);
}

// A language model's training stream: OK, or InvalidArgument (naming
// `data`) for none or one of N <= T tokens.
inline absl::Status CheckTrainingStream(const TokenStream* train, int64_t seq_len) {
  if (train == nullptr) return absl::InvalidArgumentError("data: no token stream");
  if (train->num_tokens() <= seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: ", train->num_tokens(), " tokens, need more than seq_len = ", seq_len));
  }
  return absl::OkStatus();
}

// The validation stream's number of distinct windows (0 without one), or
// InvalidArgument (naming `data`) for one of N <= T tokens.
inline absl::Status ValidationWindows(const TokenStream* val, int64_t seq_len, int64_t* windows) {
  *windows = 0;
  if (val == nullptr) return absl::OkStatus();
  if (val->num_tokens() <= seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("data: the validation data has ",
                                                   val->num_tokens(), " tokens; a window of "
                                                   "seq_len ", seq_len, " needs at least ",
                                                   seq_len + 1));
  }
  *windows = WindowPeriod(val->num_tokens(), seq_len);
  return absl::OkStatus();
}

// Tokens held in memory (tests, small corpora).
class InMemoryTokens final : public TokenStream {
 public:
  explicit InMemoryTokens(std::vector<int32_t> tokens) : tokens_(std::move(tokens)) {}
  int64_t num_tokens() const override { return static_cast<int64_t>(tokens_.size()); }
  absl::Status Read(int64_t begin, int64_t count, int32_t* out) const override {
    if (begin < 0 || count < 0 || begin + count > num_tokens()) {
      return absl::OutOfRangeError(absl::StrCat("tokens [", begin, ", ", begin + count,
                                                ") outside [0, ", num_tokens(), ")"));
    }
    std::copy(tokens_.begin() + begin, tokens_.begin() + begin + count, out);
    return absl::OkStatus();
  }

 private:
  std::vector<int32_t> tokens_;
};

}  // namespace muonmesh::worker
