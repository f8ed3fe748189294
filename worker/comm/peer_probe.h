#pragma once

// Reachability before a rendezvous. Gloo's own connect waits the whole
// connect timeout (the collective timeout: a minute by default) for a peer
// it cannot reach and then says only that it timed out. ProbePeers makes
// every rank open a TCP connection to every other rank's host first, with a
// short timeout, so that a rank cut off from a peer (a partition, a
// firewall, an address its peers cannot route to) fails within seconds
// naming both ends.

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/comm/store.h"

namespace muonmesh::comm {

// Every rank of a group of `size` calls this with the same `prefix` (the
// group's, unique per attempt): it listens on `host` (port chosen by the
// system), publishes "host:port" under prefix/probe/<rank>, connects to
// every other rank's published address within `connect_timeout` each, and
// waits, up to `rendezvous_timeout`, for the others to finish theirs before
// it stops listening. Unavailable "rank R (HOST) cannot reach rank Q at
// HOST:PORT: reason" for the first peer it cannot connect to; the store's
// error if a peer never publishes; InvalidArgument for a host it cannot
// listen on.
absl::Status ProbePeers(Store& store, const std::string& prefix, int rank, int size,
                        const std::string& host, absl::Duration connect_timeout,
                        absl::Duration rendezvous_timeout);

}  // namespace muonmesh::comm
