// A rank in its own process, for the peer-death tests
// (gloo_peer_death_test.cc): joins a Gloo group through a FileStore, does
// one all-reduce of eight floats, then misbehaves as told:
//
//   comm_test_peer STORE_DIR GROUP RANK SIZE MODE
//     MODE exit   _exit(0) at once, like a crash (no clean shutdown)
//     MODE hang   sleep (up to 60 s) without calling anything, to be killed
//
// Exit status: 0 for "exit" after a good first call; 2 bad usage; 3 the
// group or the first call failed (the reason goes to stderr).

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "worker/comm/communicator.h"
#include "worker/comm/file_store.h"

int main(int argc, char** argv) {
  using namespace muonmesh::comm;
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s STORE_DIR GROUP RANK SIZE exit|hang\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], group = argv[2], mode = argv[5];
  const int rank = std::atoi(argv[3]), size = std::atoi(argv[4]);
  auto store = FileStore::Open(dir);
  if (!store.ok()) {
    std::fprintf(stderr, "peer: %s\n", store.status().ToString().c_str());
    return 3;
  }
  GroupOptions options;
  options.connect_timeout = absl::Seconds(20);
  auto comm = CreateGroup(Backend::kGloo, **store, group, rank, size, options);
  if (!comm.ok()) {
    std::fprintf(stderr, "peer: %s\n", comm.status().ToString().c_str());
    return 3;
  }
  std::vector<float> values(8, 1.0f);
  const absl::Status first =
      (*comm)->AllReduce(values.data(), 8, ReduceOp::kSum, CollectiveOptions{absl::Seconds(20)});
  if (!first.ok()) {
    std::fprintf(stderr, "peer: %s\n", first.ToString().c_str());
    return 3;
  }
  if (mode == "hang") {
    absl::SleepFor(absl::Seconds(60));
    return 0;
  }
  ::_exit(0);  // no destructors: the sockets close as in a crash
}
