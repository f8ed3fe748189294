#pragma once

// The worker daemon: `muonmesh-worker --coordinator HOST:PORT`. It registers
// with the coordinator, keeps its lease alive, takes assignments from the
// Fleet stream, runs each assigned rank with the coordinator's plan (checking
// its fingerprint) and the coordinator's rendezvous store, reports every
// step and the end of every attempt, and stops a rank at the step the
// coordinator names when its job is cancelled.
//
// One rank at a time, on its own thread; the main thread reads the stream,
// another sends heartbeats. A lost coordinator is retried every half second;
// a broken stream or a stale lease (the coordinator restarted, or forgot this
// worker) means registering again, naming the current lease (renewed if it
// still lives) and the rank in progress, which keeps training meanwhile: its
// step reports wait in a bounded queue, and it writes a checkpoint or the
// export only once the coordinator has taken them. The coordinator keeps the
// rank (docs/architecture.md §7) or says to stop it.

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/credentials/credentials.h"
#include "worker/rank_runner.h"

namespace muonmesh::worker {

struct DaemonOptions {
  std::string coordinator;  // HOST:PORT
  // Unique in the fleet; default "<hostname>/<device>".
  std::string worker_id;
  std::string device = "cpu";  // "cpu" or "cuda:N"
  // Where peers reach this worker for collectives (Gloo TCP); empty: the
  // local address this host reaches the coordinator from
  // (worker/local_address.h).
  std::string address;
  // The network interface the ranks' Gloo binds (--gloo-interface); empty:
  // the address above.
  std::string gloo_interface;
  // Where this worker sits in the network, widest level first
  // ("zone-a/rack-3/node12"; WorkerInfo.locality): a job's ranks follow it.
  std::string locality;
  // Host memory a rank may plan to use; 0: the machine's default.
  int64_t memory_budget_bytes = 0;
  // HOST:PORT to serve Prometheus metrics on (/metrics); empty: none.
  std::string metrics_listen;
  // TLS, client certificate and token for the coordinator
  // (proto/credentials/credentials.h; flags already merged with the environment).
  // Empty: plaintext.
  credentials::ClientSecurityOptions security;
  // The only folders job files may make this worker read or write
  // (proto/job/allowed_dirs.h); empty: no restriction.
  std::vector<std::string> allowed_dirs;
  // Deadline of every unary call to the coordinator.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Set to stop: the daemon stops its rank (as a cancel would) and returns.
  const std::atomic<bool>* stop = nullptr;
  // Set to leave gracefully (SIGTERM): the daemon asks the coordinator to
  // drain it (its job checkpoints, stops and goes on elsewhere), and returns
  // once told to leave, or after drain_timeout as if stopped.
  const std::atomic<bool>* drain = nullptr;
  absl::Duration drain_timeout = absl::Minutes(5);
};

// Returns when `stop` is set (OK), or InvalidArgument for bad options
// (naming the flag: a security file that cannot be read, an allowed folder
// that does not exist), or a registration refused for good (an id in use,
// credentials the coordinator does not accept).
absl::Status RunDaemon(const DaemonOptions& options, const LineSink& log);

}  // namespace muonmesh::worker
