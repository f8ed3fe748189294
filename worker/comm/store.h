#pragma once

// The rendezvous store: a small key-value space the ranks of a job use to
// find each other before they can talk directly (Gloo publishes its listening
// addresses there, NCCL its unique id). FileStore implements it over a shared
// folder; the coordinator's gRPC store (control-plane issue) implements the
// same interface, so communicators never know which one they use.
//
// Keys are write-once: a key, once set, keeps its value for the life of the
// store. Whoever creates groups must therefore make names unique per job
// attempt (e.g. "job-17/attempt-2/dp_shard/0"); a group created twice under
// one name finds the first one's keys and fails with AlreadyExists.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace muonmesh::comm {

// Implementations must be safe to call from several threads at once (the
// ranks of a test share one store, and Gloo may call it from its own
// threads). Every blocking call takes a finite timeout.
class Store {
 public:
  virtual ~Store() = default;

  // Publishes `value` under `key`. Setting a key again with the same value
  // is OK (a retried publish); with a different value it is AlreadyExists and
  // the stored value stays. InvalidArgument for a key the store cannot hold;
  // Unavailable when the store itself cannot be reached.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;

  // The value of `key`, waiting up to `timeout` for someone to set it.
  // DeadlineExceeded (naming the key) when it is still missing then.
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;

  // Waits up to `timeout` (in all) until every key exists. DeadlineExceeded
  // naming the missing keys otherwise.
  virtual absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) = 0;
};

}  // namespace muonmesh::comm
