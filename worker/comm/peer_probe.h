#pragma once

// Reachability before a rendezvous. Gloo's own connect waits the whole
// connect timeout (the collective timeout: a minute by default) for a peer
// it cannot reach and then says only that it timed out. ProbePeers makes
// every rank open a TCP connection to every other rank's host first, with a
// short timeout, so that a rank cut off from a peer (a partition, a
// firewall, an address its peers cannot route to) fails within seconds
// naming both ends.

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// A worker's answer to its peers' checks (HeartbeatResponse.check_peers):
// listens on `host` (a port the system picks) and sends back the byte each
// connection sends, on its own thread, for as long as it lives, serving
// every open connection at once (a slow one delays no other). A process
// that is alive and reachable answers; a dead host, a cut-off one or a
// frozen process does not (the kernel may accept its connections, but
// nothing answers them).
class EchoListener {
 public:
  static absl::StatusOr<std::unique_ptr<EchoListener>> Start(const std::string& host);
  ~EchoListener();
  EchoListener(const EchoListener&) = delete;
  EchoListener& operator=(const EchoListener&) = delete;
  int port() const { return port_; }

 private:
  EchoListener() = default;
  void Serve();  // the thread's loop
  static constexpr size_t kMaxOpen = 256;  // connections served at once
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Connects to host:port, sends a byte and waits for it back, all within
// `timeout`. NotFound when the host refuses the connection (it is up and
// reachable, but nothing listens: the process is gone); DeadlineExceeded
// when the connection was made but the byte did not come back in time (the
// process frozen, or the link too congested); Unavailable naming the
// address and what failed otherwise (no route, no connection: the host is
// down or cut off).
absl::Status EchoCheck(const std::string& host, int port, absl::Duration timeout);

}  // namespace muonmesh::comm
