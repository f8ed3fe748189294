#pragma once

// The communicator interface the worker runtime uses for every byte it moves
// between ranks: one object per process group (one group per mesh axis, per
// domain; create each with CreateGroup under its own name). Only the
// collectives the training step needs, on fp32 buffers:
//
//   AllGather      out = concat over ranks of in            (param gather)
//   ReduceScatter  out = chunk `rank` of sum/avg of in      (grad reduce)
//   AllReduce      inout = sum/avg of inout                 (replicated grads)
//   Broadcast      inout = root's inout                     (initial weights)
//   AllToAllV      variable-size exchange                   (Muon owner gather/scatter, EP)
//   Barrier
//
// Buffers live in the backend's memory space (memory_space()): host memory
// for Gloo and the in-process backend, device memory of this rank's GPU for
// NCCL. Every call is blocking: when it returns OK the output is complete and
// the inputs may be reused (NCCL: the work on the communicator's stream has
// finished).
//
// Collective contract. Every rank of the group calls the same collectives in
// the same order, with the same count (and root); AllToAllV counts must be
// consistent (my send_counts[q] == rank q's recv_counts[my rank]). A rank
// that breaks the contract makes the others time out (the in-process backend
// detects mismatches and reports InvalidArgument instead).
//
// Numerics. The CPU backends (Gloo, in-process) reduce in rank order:
// out[i] = ((in_0[i] + in_1[i]) + in_2[i]) + ..., then one division by size()
// for kAvg, so AllReduce, ReduceScatter, both backends and any count give
// results bit-identical to that sequential sum on every rank. NCCL's order is
// its own (still identical across ranks for AllReduce).
//
// Errors. Each call returns:
//   InvalidArgument    bad arguments (negative count, null buffer with a
//                      non-zero count, spans of the wrong size, root out of
//                      range, a non-positive timeout). Checked before any
//                      communication; the communicator stays usable, but the
//                      peers, which did call, will time out.
//   DeadlineExceeded   the call did not complete within options.timeout
//                      (typically a peer that never made the call).
//   Unavailable        a peer is gone (connection closed or reset) or the
//                      group was aborted by another rank's failure.
//   Internal           anything else the backend reported.
//   Cancelled          the group was aborted (Abort, GroupOptions::abort):
//                      a call in progress ends at once, later ones are
//                      refused; the message carries the reason.
//   FailedPrecondition the group is broken (below).
// Messages name the collective, the group, this rank and the backend.
// After any error other than InvalidArgument-from-validation the group is
// broken: transport state is undefined (Gloo closes its pairs, NCCL aborts
// the communicator), so every later call returns FailedPrecondition carrying
// the first error, without communicating. Recover by destroying it and
// creating a new group under a new name.
//
// Byte counters (stats()). bytes_sent counts what this rank puts on the wire,
// by the bandwidth-optimal model of each collective, the same formula for
// every backend (n = size(), r = rank(), 4 bytes per float):
//   AllGather(count)      (n-1) * count * 4
//   ReduceScatter(count)  (n-1) * count * 4           (count = output floats)
//   AllReduce(count)      (count - c_r + (n-1) * c_r) * 4, with count cut into
//                         n chunks c_q = count/n + (q < count%n): the
//                         reduce-scatter then all-gather of chunks;
//                         2 (n-1)/n count * 4 when n divides count
//   Broadcast(count)      count * 4 unless r is the last rank of the chain
//                         root, root+1, ..., root+n-1 (mod n); (n-1) count * 4
//                         over the group
//   AllToAllV             sum of send_counts[q] * 4 over q != r (actual)
//   Barrier               0
// Counters are updated for failed calls too (calls, failures, time) but
// bytes only for successful ones. The model is not always the algorithm:
// Gloo's all-reduces of at most 64 KiB send the whole buffer to every peer
// (one round trip instead of two, gloo_communicator.cc), (n-1) * count * 4
// bytes, more than the model counts.
//
// Threads: a Communicator is driven by one thread at a time (calls must not
// overlap, as the collective order must be the same on every rank).
// stats(), health(), Abort() and the accessors may be called from any thread.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/comm/abort.h"
#include "worker/comm/store.h"
#include "worker/comm/types.h"

namespace muonmesh::comm {

class Communicator : public Abortable {
 public:
  ~Communicator() override;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& group_name() const { return group_name_; }
  virtual Backend backend() const = 0;
  virtual MemorySpace memory_space() const = 0;

  // out[q * count + i] = rank q's in[i], for i < count. `out` holds
  // size() * count floats. In place when in == out + rank() * count; any
  // other overlap of in and out is undefined.
  absl::Status AllGather(const float* in, int64_t count, float* out,
                         const CollectiveOptions& options = {});

  // out[i] = op over ranks q of rank q's in[rank() * count + i], for
  // i < count: `in` holds size() * count floats (chunk q for rank q).
  // In place when out == in + rank() * count; other overlap undefined.
  absl::Status ReduceScatter(const float* in, float* out, int64_t count, ReduceOp op,
                             const CollectiveOptions& options = {});

  // inout[i] = op over ranks q of rank q's inout[i], for i < count.
  absl::Status AllReduce(float* inout, int64_t count, ReduceOp op,
                         const CollectiveOptions& options = {});

  // Every rank's inout[0..count) becomes the root's.
  absl::Status Broadcast(float* inout, int64_t count, int root,
                         const CollectiveOptions& options = {});

  // Variable-size exchange. `send` is the concatenation, in rank order, of
  // send_counts[q] floats for rank q; `recv` receives, in rank order,
  // recv_counts[q] floats from rank q. Both spans have size() entries, all
  // >= 0, and send_counts[rank()] == recv_counts[rank()] (the part a rank
  // keeps is copied locally). Zero counts, including all of them, are fine.
  // send and recv must not overlap.
  absl::Status AllToAllV(const float* send, absl::Span<const int64_t> send_counts, float* recv,
                         absl::Span<const int64_t> recv_counts,
                         const CollectiveOptions& options = {});

  // Returns once every rank of the group has entered the barrier.
  absl::Status Barrier(const CollectiveOptions& options = {});

  // Counters since creation; see the model above.
  CommStats stats() const;

  // OK while the group is usable; otherwise the error that broke it.
  absl::Status health() const;

  // Ends a call in progress (the Gloo backend wakes it through its
  // connections, which also fails the peers waiting on this rank; the
  // others end it at their next call) and refuses later ones: Cancelled,
  // naming `reason`. Any thread.
  void Abort(const std::string& reason) override;

  // Aborted when `signal` fires (now, if it has); until destruction.
  // CreateGroup calls it with GroupOptions::abort.
  void AbortWith(AbortSignal* signal);

 protected:
  Communicator(std::string group_name, int rank, int size);

  // Backend hooks, called by the public methods with validated arguments
  // (counts >= 0, buffers non-null where count > 0, spans of size() entries,
  // root in range), never after the group broke, and with count > 0 for the
  // uniform collectives (count 0 returns OK without communicating: every rank
  // knows every other rank skips too). Return plain errors with the codes
  // listed above; the caller adds the context, counts, and marks the group
  // broken on any error.
  virtual absl::Status DoAllGather(const float* in, int64_t count, float* out,
                                   absl::Time deadline) = 0;
  virtual absl::Status DoReduceScatter(const float* in, float* out, int64_t count, ReduceOp op,
                                       absl::Time deadline) = 0;
  virtual absl::Status DoAllReduce(float* inout, int64_t count, ReduceOp op,
                                   absl::Time deadline) = 0;
  virtual absl::Status DoBroadcast(float* inout, int64_t count, int root,
                                   absl::Time deadline) = 0;
  virtual absl::Status DoAllToAllV(const float* send, absl::Span<const int64_t> send_counts,
                                   float* recv, absl::Span<const int64_t> recv_counts,
                                   absl::Time deadline) = 0;
  virtual absl::Status DoBarrier(absl::Time deadline) = 0;

  // Called once, right after a hook failed and the group became broken, so a
  // backend can release or abort transport state (NCCL: ncclCommAbort).
  virtual void OnBroken() {}

  // Called once, from any thread, by Abort: wakes a call in progress if the
  // backend can. Default: nothing (the call ends at its timeout or when a
  // peer's abort breaks it; later calls are refused either way).
  virtual void DoAbort(const std::string& /*reason*/) {}

  // Leaves the abort signal: a backend with DoAbort calls it first in its
  // destructor, so that no abort reaches a half-destroyed object.
  void LeaveAbortSignal();

  // How error messages name the transport: BackendName(backend()) unless a
  // backend says more ("gloo via host copies").
  virtual std::string label() const { return std::string(BackendName(backend())); }

 private:
  // Runs one hook: refuses when broken, times it, updates the counters,
  // wraps errors with context and marks the group broken on failure.
  template <typename Hook>
  absl::Status Run(Collective collective, int64_t bytes_sent, const CollectiveOptions& options,
                   Hook&& hook);

  const std::string group_name_;
  const int rank_;
  const int size_;
  mutable absl::Mutex mu_;
  CommStats stats_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::optional<std::string> aborted_ ABSL_GUARDED_BY(mu_);
  // Set once by AbortWith, before any abort can come.
  AbortSignal* abort_signal_ = nullptr;
};

// Creates this rank's member of the process group `group_name` (ranks
// 0..group_size-1) and returns once every member has joined and connected,
// or fails after options.connect_timeout.
//   backend  kInProcess needs options.hub (ranks are threads of this
//            process; the store is not used); kGloo and kNccl rendezvous
//            through `store` under keys prefixed with "<group_name>/".
//   store    must outlive the call (not the communicator).
//   options.buffers  kCudaDevice with kGloo or kInProcess: the group works on
//            device buffers through host copies (staging_communicator.h).
// Errors: InvalidArgument (rank out of range, group_size < 1, empty name,
// missing hub, a non-positive connect_timeout), Unimplemented (kNccl, or
// device buffers, in a build without CUDA), FailedPrecondition (no usable
// CUDA device),
// DeadlineExceeded (peers did not all show up in time), AlreadyExists (the
// name was used before in this store or hub: names are write-once),
// Unavailable (network or store failure).
absl::StatusOr<std::unique_ptr<Communicator>> CreateGroup(Backend backend, Store& store,
                                                          std::string group_name,
                                                          int rank_in_group, int group_size,
                                                          const GroupOptions& options = {});

}  // namespace muonmesh::comm
