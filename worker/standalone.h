#pragma once

// Runs one rank of a job file to completion without a coordinator:
// `muonmesh-worker --standalone`. Ranks meet through a file store in a
// shared folder and talk over Gloo (TCP). The control plane replaces this
// with scheduling later; it stays for debugging.

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace muonmesh::worker {

struct StandaloneOptions {
  std::string job_path;
  int32_t rank = 0;
  int64_t world_size = 0;  // must equal the job's world_size
  std::string store_dir;   // shared by all ranks; one per job attempt
  std::string hostname = "127.0.0.1";  // this rank's address for Gloo
  absl::Duration timeout = absl::Seconds(60);  // rendezvous and every collective
  int attempt = 0;  // part of every group name
};

// One line per event for people (rank 0 prints per-step loss and phases).
using LineSink = std::function<void(const std::string&)>;

// InvalidArgument for a bad job file, data or config (message names the
// field or file); Unavailable / DeadlineExceeded when a peer is lost or
// late; Unimplemented for what the runtime does not do yet (experts).
absl::Status RunStandalone(const StandaloneOptions& options, const LineSink& out);

}  // namespace muonmesh::worker
