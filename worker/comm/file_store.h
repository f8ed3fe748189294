#pragma once

// A rendezvous Store over a folder that every rank can see: a local folder
// for ranks on one host (tests, the standalone launcher), a shared file
// system across hosts. One file per key.
//
// Writes are atomic and write-once: the value goes to a private temporary
// file that is then hard-linked under the key's name, which fails if the
// name exists, so readers never see a partial value and two writers never
// both win. Reads poll with exponential backoff (1 ms doubling to 25 ms).
//
// Thread-safe; several FileStore objects (in one or many processes) may use
// one folder. The store never deletes keys: use a fresh folder, or fresh key
// prefixes, per job attempt.

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/comm/store.h"

namespace muonmesh::comm {

class FileStore final : public Store {
 public:
  // Opens the store in `dir`, creating the folder (and its parents) if
  // needed. InvalidArgument for an empty path; Unavailable if the folder
  // cannot be created or is not a writable folder.
  static absl::StatusOr<std::unique_ptr<FileStore>> Open(std::string dir);

  const std::string& dir() const { return dir_; }

  // Keys may hold any bytes except NUL, up to 200 bytes; characters other
  // than [A-Za-z0-9_.-] are escaped in the file name (so "a/b" is one file).
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;

 private:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}

  // The file that holds `key`; InvalidArgument for a key it cannot map.
  absl::StatusOr<std::string> PathFor(absl::string_view key) const;
  // The value at `path`, nullopt if absent; Unavailable on an I/O error.
  absl::StatusOr<std::optional<std::string>> TryRead(const std::string& path) const;

  const std::string dir_;
};

}  // namespace muonmesh::comm
