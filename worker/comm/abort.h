#pragma once

// A rank's way out of a blocked collective or rendezvous
// (docs/architecture.md §7, "Stopping a blocked rank"). A collective waits
// for its peers up to its timeout (a minute by default), and a rank told to
// stop (its attempt failed: a peer was lost, the job was cancelled) must not
// wait that long. The worker gives every group and the rendezvous store of a
// rank one AbortSignal; firing it ends what they are blocked in at once and
// refuses what comes after, with Cancelled and the reason.

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace muonmesh::comm {

// Something a signal can end: a communicator, a store.
class Abortable {
 public:
  virtual ~Abortable() = default;
  // Ends the calls in progress and refuses later ones, naming `reason`.
  // Thread-safe; called at most once per signal, never from inside a call of
  // this object's own.
  virtual void Abort(const std::string& reason) = 0;
};

// Thread-safe. Members are held by pointer: Remove one before destroying
// it (Remove waits for an Abort in progress to finish with it).
class AbortSignal {
 public:
  // Aborts every member, and every member added later, with `reason`; the
  // first reason stays.
  void Abort(const std::string& reason) {
    absl::MutexLock lock(&mu_);
    if (reason_.has_value()) return;
    reason_ = reason;
    for (Abortable* a : members_) a->Abort(reason);
  }

  // The reason once fired.
  std::optional<std::string> reason() const {
    absl::MutexLock lock(&mu_);
    return reason_;
  }

  // Adds `a`, aborted at once when the signal has fired.
  void Add(Abortable* a) {
    absl::MutexLock lock(&mu_);
    members_.push_back(a);
    if (reason_.has_value()) a->Abort(*reason_);
  }

  void Remove(Abortable* a) {
    absl::MutexLock lock(&mu_);
    members_.erase(std::remove(members_.begin(), members_.end(), a), members_.end());
  }

 private:
  mutable absl::Mutex mu_;
  std::optional<std::string> reason_ ABSL_GUARDED_BY(mu_);
  std::vector<Abortable*> members_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muonmesh::comm
