#pragma once

// The coordinator's bearer tokens and the role each grants, from
// --tokens-file (MUONMESH_TOKENS_FILE). One token per line:
//
//   # comments and blank lines are ignored
//   viewer     sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//   submitter  a-long-random-token-of-16-or-more-characters
//
// A token is written as itself or as "sha256:" and the hex SHA-256 of it
// (`printf %s "$TOKEN" | sha256sum`), so the file need not hold the secret.
// Only digests are kept in memory, and nothing here logs or returns a token.
//
// Immutable after Load/Parse; any thread may call Find.

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/credentials/credentials.h"
#include "server/auth/types.h"

namespace muonmesh::auth {

// The SHA-256 of `data` (raw, 32 bytes).
std::string Sha256(absl::string_view data);

class TokenTable {
 public:
  // Reads and parses `path`. NotFound / InvalidArgument naming the file (and
  // line) when it cannot be read, a line is not "ROLE TOKEN" or "ROLE
  // sha256:HEX", a role is unknown, a token breaks credentials::CheckToken, a token
  // appears twice, or there is no token at all. Messages never quote a token.
  static absl::StatusOr<TokenTable> Load(const std::string& path);
  // The same for text already read; `origin` names it in messages.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view origin);

  // The role of `token`, or nullopt when it is not in the table.
  std::optional<Role> Find(absl::string_view token) const;

  std::size_t size() const { return by_digest_.size(); }
  // How many tokens each role has: "viewer 1, submitter 2, worker 1, admin 0".
  std::string Summary() const;

 private:
  absl::flat_hash_map<std::string, Role> by_digest_;
};

// --tokens-file kept current without a restart: Current() returns the
// table, read again when the file's modification time or size changed
// (looked at most once per `check_every`, a stat). A file that no longer
// loads keeps the tokens that were in force, and `log` says why (once per
// change of the file); the next good version is taken up. Thread-safe.
class TokenFile {
 public:
  static absl::StatusOr<std::shared_ptr<TokenFile>> Load(
      std::string path, absl::Duration check_every,
      std::function<void(const std::string&)> log = nullptr);

  std::shared_ptr<const TokenTable> Current();

 private:
  TokenFile(std::string path, absl::Duration check_every,
            std::function<void(const std::string&)> log)
      : log_(std::move(log)), file_(std::move(path), check_every) {}

  const std::function<void(const std::string&)> log_;
  absl::Mutex mu_;
  credentials::FileChangeCheck file_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muonmesh::auth
