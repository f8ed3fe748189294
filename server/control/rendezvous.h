#pragma once

// The coordinator's rendezvous store: write-once keys per job attempt, with
// waits, that the ranks of an attempt use to connect their communicators
// (the Store service is its gRPC edge). Semantics match comm::Store, which
// the worker implements over it: a key set twice with the same value is
// fine, with another value AlreadyExists; Get and Wait block until the keys
// exist or the timeout passes. Add keeps counters for barriers.
//
// Bounded: keys of at most kMaxKeyBytes, values of at most kMaxValueBytes,
// and at most kMaxTotalBytes in all (ResourceExhausted beyond), each key
// counted with what holding it costs beyond its bytes (kEntryOverheadBytes,
// and kScopeOverheadBytes for its attempt's first), so a client cannot grow
// the coordinator without limit, not even with one-byte keys; a failed call
// leaves nothing behind, and a finished attempt's keys are dropped with
// DropJob.
//
// Thread-safe; waits run on the caller's thread (a gRPC handler).

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muonmesh::coordinator {

inline constexpr size_t kMaxKeyBytes = 512;
inline constexpr size_t kMaxValueBytes = size_t{1} << 20;
inline constexpr size_t kMaxTotalBytes = size_t{256} << 20;
// A key's map node and string headers; an attempt's map and its node.
inline constexpr size_t kEntryOverheadBytes = 96;
inline constexpr size_t kScopeOverheadBytes = 128;

struct RendezvousScope {
  std::string job_id;
  int32_t attempt = 0;
  bool operator<(const RendezvousScope& o) const {
    return std::tie(job_id, attempt) < std::tie(o.job_id, o.attempt);
  }
};

class Rendezvous {
 public:
  // Called while waiting, every few tens of milliseconds: true stops the
  // wait with Cancelled (the client went away, or the server stops).
  using Cancelled = std::function<bool()>;

  absl::Status Set(const RendezvousScope& scope, const std::string& key, std::string value);
  absl::StatusOr<std::string> Get(const RendezvousScope& scope, const std::string& key,
                                  absl::Duration timeout, const Cancelled& cancelled);
  absl::Status Wait(const RendezvousScope& scope, const std::vector<std::string>& keys,
                    absl::Duration timeout, const Cancelled& cancelled);
  absl::StatusOr<int64_t> Add(const RendezvousScope& scope, const std::string& key,
                              int64_t delta);

  // Forgets every key of the job's attempts and wakes their waiters (which
  // then fail with NotFound... or find their key).
  void DropJob(const std::string& job_id);

  // Wakes every waiter, which then ends with Cancelled (server shutdown).
  void Shutdown();

  size_t total_bytes() const;

 private:
  absl::Status CheckKey(const std::string& key) const;
  // The key's value, or null when the key (or its whole scope) is absent.
  std::string* FindLocked(const RendezvousScope& scope, const std::string& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a key known to be absent, within kMaxTotalBytes (its overheads
  // counted, the scope's too when this is its first key).
  absl::Status InsertLocked(const RendezvousScope& scope, const std::string& key,
                            std::string value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until `ready` holds (true), the timeout passes or `cancelled`.
  absl::Status WaitUntil(const std::function<bool()>& ready, absl::Duration timeout,
                         const Cancelled& cancelled, const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<RendezvousScope, std::map<std::string, std::string>> keys_ ABSL_GUARDED_BY(mu_);
  size_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace muonmesh::coordinator
