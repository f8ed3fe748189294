#pragma once

// Small value types of the communicators (worker/comm/): which backend,
// which collective, per-call options, per-group options and the byte
// counters a group keeps. Plain values; copy them freely.

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace muonmesh::comm {

class AbortSignal;
class InProcessHub;

enum class Backend {
  // Ranks are threads of one process, meeting in an InProcessHub. Host memory.
  kInProcess,
  // Gloo over TCP: loopback or across hosts. Host memory.
  kGloo,
  // NCCL on CUDA devices (built only with MUONMESH_HAVE_CUDA). Device memory.
  kNccl,
};

// "inproc", "gloo", "nccl".
absl::string_view BackendName(Backend backend);
// The inverse of BackendName; InvalidArgument for any other string.
absl::StatusOr<Backend> ParseBackend(absl::string_view name);

// Where a backend's buffers live.
enum class MemorySpace { kHost, kCudaDevice };
// "host", "cuda device".
absl::string_view MemorySpaceName(MemorySpace space);

enum class ReduceOp {
  kSum,
  // The sum divided by the group size (CPU backends: the rank-order sum, then
  // one division; NCCL: ncclAvg).
  kAvg,
  // The elementwise maximum (QK-clip's per-head logits; NCCL: ncclMax).
  kMax,
};

// The collectives a Communicator offers, for counters and error messages.
enum class Collective {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kAllToAllV,
  kBarrier,
};
inline constexpr int kNumCollectives = 6;

// Snake-case names usable as metric label values: "all_gather",
// "reduce_scatter", "all_reduce", "broadcast", "all_to_all_v", "barrier".
absl::string_view CollectiveName(Collective collective);

// Per-call options. Every collective has a finite timeout: a call that has
// not completed when it expires returns DeadlineExceeded (and breaks the
// group, see Communicator).
struct CollectiveOptions {
  absl::Duration timeout = absl::Seconds(60);
};

// Options for creating one process group (CreateGroup).
struct GroupOptions {
  // Gloo: the local address to listen on and advertise to peers. Loopback by
  // default; across hosts, this host's reachable name or IP.
  std::string gloo_hostname = "127.0.0.1";
  // Gloo: a network interface name (e.g. "eth0"); when set it wins over
  // gloo_hostname.
  std::string gloo_interface;
  // Bound on rendezvous: waiting for peers in the store, connecting to them
  // and the closing handshake that proves every peer is connected.
  absl::Duration connect_timeout = absl::Seconds(60);
  // Gloo: groups of up to this many ranks all-gather by direct exchange at
  // any size; larger groups only while the gathered buffer is at most 1 MiB,
  // the ring beyond (docs/architecture.md §5, "Collective algorithms").
  int gloo_direct_max_ranks = 8;
  // Gloo: the most bytes of one exchange a rank lets its peers have on the
  // way to it at once (0: no limit, every peer sends its whole part at once).
  // Each peer's part goes in chunks of window / (2 (n - 1)) bytes (at least
  // 64 KiB), 2 (n - 1) chunks asked for at once over all peers; each arrival
  // asks for the next. Across links slower than the ranks can send, about the
  // link's bandwidth-delay product keeps a burst from overflowing the
  // routers' queues (docs/architecture.md §5, "Collective algorithms").
  int64_t gloo_window_bytes = 0;
  // kInProcess only, and required there: where the threads of one group meet.
  std::shared_ptr<InProcessHub> hub;
  // Where the caller's buffers live. kCudaDevice with a host backend (Gloo,
  // in-process) makes a group that copies each call's buffers through pinned
  // host memory (worker/comm/staging_communicator.h): several ranks can then
  // share one GPU (a test and development mode). NCCL works in device memory
  // whatever this says.
  MemorySpace buffers = MemorySpace::kHost;
  // kNccl, and host backends with buffers kCudaDevice: the CUDA device this
  // rank uses; -1 means the device current on the calling thread.
  int cuda_device = -1;
  // When set, the group is aborted when it fires (Communicator::Abort), and
  // CreateGroup refuses with Cancelled once it has. Must outlive the group.
  AbortSignal* abort = nullptr;
};

// What one rank did with one kind of collective.
struct CollectiveCounters {
  int64_t calls = 0;     // calls made, successful or not
  int64_t failures = 0;  // calls that returned an error
  // Bytes this rank sent (see Communicator for the model per collective).
  int64_t bytes_sent = 0;
  // Wall time spent inside the calls.
  absl::Duration time = absl::ZeroDuration();
};

// Counters of one group since it was created, by collective.
struct CommStats {
  std::array<CollectiveCounters, kNumCollectives> by_collective{};

  const CollectiveCounters& operator[](Collective c) const {
    return by_collective[static_cast<int>(c)];
  }
  CollectiveCounters& operator[](Collective c) { return by_collective[static_cast<int>(c)]; }

  int64_t total_bytes_sent() const {
    int64_t total = 0;
    for (const CollectiveCounters& c : by_collective) total += c.bytes_sent;
    return total;
  }
};

}  // namespace muonmesh::comm
