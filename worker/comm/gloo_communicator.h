#pragma once

// The Gloo backend: CPU buffers over TCP (loopback or across hosts).
//
// Rendezvous: a gloo::transport::tcp device on GroupOptions::gloo_hostname
// (or gloo_interface), then Gloo's full-mesh connect through the Store,
// every key prefixed "<group_name>/gloo/", then a barrier, so no member
// returns (and might be destroyed) before every peer is connected.
//
// Collectives use Gloo's options API with the call's remaining time as the
// timeout: all-gather, broadcast, barrier and all-to-all-v directly.
// Reduce-scatter (Gloo has no options-API reduce-scatter) is an all-to-all of
// the chunks followed by a local sum in rank order: the same bytes per rank
// as a ring reduce-scatter. All-reduce is that reduce-scatter on near-equal
// chunks followed by an all-gather(v): bandwidth-optimal, and bit-identical
// to ReduceScatter and to the in-process backend (Gloo's own all-reduce sums
// in ring order, which differs per chunk).
//
// Gloo reports errors by throwing; they never escape: a timeout becomes
// DeadlineExceeded, a closed or reset connection Unavailable, anything else
// Internal. After either, Gloo has closed the group's connections (its
// documented behaviour after an IoException), matching the "broken group"
// rule of Communicator.
//
// Each group owns a TCP device with its own event-loop thread.
//
// Process-wide side effect: the first Gloo group sets SIGPIPE to SIG_IGN if
// it is still at its default action (a write to a dead peer's socket would
// otherwise kill the process rather than fail the call). A handler the
// program installed itself is left alone.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"
#include "worker/comm/types.h"

namespace muonmesh::comm {

// Errors as CreateGroup.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    Store& store, std::string group_name, int rank, int size, const GroupOptions& options);

}  // namespace muonmesh::comm
