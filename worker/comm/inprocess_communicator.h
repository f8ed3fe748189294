#pragma once

// The in-process backend: the ranks of a group are threads of one process
// that meet in an InProcessHub. For fast, deterministic tests of everything
// above the communicator (the training step, the owner exchange) without
// sockets; the conformance suite holds it to the same contract as Gloo.
//
// Each collective is a two-phase rendezvous on the group's mutex: every rank
// posts its buffers and waits (up to the call's timeout) for the others;
// then each rank computes its own result from the others' inputs into
// private scratch; a second barrier (bounded: it waits only for peers doing
// local copies and sums) guarantees nobody still reads a buffer before the
// results are written back. So any aliasing the interface allows is safe.
// Reductions add in rank order, bit-identical to the Gloo backend.
//
// Mismatched calls (different collectives, counts, roots, ops, or
// inconsistent AllToAllV counts across ranks) are detected and reported as
// InvalidArgument on every rank. A rank that times out aborts the group:
// ranks waiting in, or later entering, any collective of the group get
// Unavailable at once, as a real network backend's peers would.

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/communicator.h"
#include "worker/comm/types.h"

namespace muonmesh::comm {

namespace internal {
struct InProcessGroup;
}  // namespace internal

// Where the ranks (threads) of in-process groups find each other. Create one,
// share it (GroupOptions::hub) with every rank of every group that should
// meet; groups are told apart by name. A name is free again once every
// member of its group has been destroyed. Thread-safe.
class InProcessHub {
 public:
  InProcessHub() = default;
  InProcessHub(const InProcessHub&) = delete;
  InProcessHub& operator=(const InProcessHub&) = delete;

  // The transport's own traffic, for tests: per group name and collective,
  // the bytes the group's ranks copied out of *other* ranks' buffers in
  // successful calls (what a network would have carried to them; a rank's
  // own contribution never counts), summed over ranks and calls. Counted
  // where the copies happen, independently of the front end's byte model.
  std::map<std::string, std::array<int64_t, kNumCollectives>> TrafficBytes() const;
  void AddTraffic(const std::string& group, Collective collective, int64_t bytes);

 private:
  friend absl::StatusOr<std::shared_ptr<internal::InProcessGroup>> JoinInProcessGroup(
      InProcessHub& hub, const std::string& name, int rank, int size);

  absl::Mutex mu_;
  std::map<std::string, std::weak_ptr<internal::InProcessGroup>> groups_ ABSL_GUARDED_BY(mu_);
  mutable absl::Mutex traffic_mu_;
  std::map<std::string, std::array<int64_t, kNumCollectives>> traffic_
      ABSL_GUARDED_BY(traffic_mu_);
};

// Joins `group_name` in options.hub as `rank` of `size` and waits up to
// options.connect_timeout for the other members. Errors as CreateGroup; a
// member that times out waiting aborts the group for the others.
absl::StatusOr<std::unique_ptr<Communicator>> CreateInProcessCommunicator(
    std::string group_name, int rank, int size, const GroupOptions& options);

}  // namespace muonmesh::comm
