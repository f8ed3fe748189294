// CPU stand-in for NCCL (include/nccl.h, README.md): the ranks of a
// communicator are threads of this process. Each call is enqueued on its
// stream (cuda_cpu::AddPendingWork, so cudaStreamQuery reports it pending)
// and runs, in the thread of the last rank to arrive, once every rank has
// made it: collectives in each rank's call order, sends and receives as
// first-in first-out pairs per (sender, receiver).

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace {

enum class Kind { kAllGather, kReduceScatter, kAllReduce, kBroadcast };

// One rank's part of a collective.
struct Part {
  Kind kind;
  const float* send;
  float* recv;
  size_t count;
  ncclRedOp_t op;
  int root;
  cudaStream_t stream;
};

struct Transfer {
  const float* send = nullptr;  // a send's buffer
  float* recv = nullptr;        // a receive's buffer
  size_t count = 0;
  cudaStream_t stream = nullptr;
};

// The ranks sharing one unique id.
struct Clique {
  int nranks = 0;
  int joined = 0;
  std::vector<bool> ranks;  // which have joined
  int left = 0;
  ncclResult_t error = ncclSuccess;
  std::map<uint64_t, std::map<int, Part>> collectives;  // sequence -> rank -> part
  std::map<std::pair<int, int>, std::deque<Transfer>> sends, recvs;  // (from, to)
};

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}

std::map<uint64_t, std::shared_ptr<Clique>>& Cliques() {
  static std::map<uint64_t, std::shared_ptr<Clique>> cliques;
  return cliques;
}

}  // namespace

struct ncclComm {
  std::shared_ptr<Clique> clique;
  uint64_t key = 0;
  int rank = 0;
  uint64_t next = 0;  // sequence number of this rank's next collective
};

namespace {

// Runs collective `seq` once all ranks have their part in (Mu() held): reads
// every input before writing any output, so in-place calls are fine.
void RunCollective(Clique& c, std::map<int, Part>& parts) {
  const Part& first = parts.begin()->second;
  const int n = c.nranks;
  for (const auto& [r, p] : parts) {
    if (p.kind != first.kind || p.count != first.count || p.op != first.op ||
        p.root != first.root) {
      c.error = ncclInvalidUsage;  // mismatched calls: NCCL would hang or corrupt
    }
  }
  const size_t count = first.count;
  // Inputs (for a broadcast only the root's buffer: the others may be null).
  std::vector<std::vector<float>> in(n);
  for (const auto& [r, p] : parts) {
    if (p.kind == Kind::kBroadcast && r != p.root) continue;
    const size_t size = p.kind == Kind::kReduceScatter ? count * n : count;
    in[r].assign(p.send, p.send + size);
  }
  for (auto& [r, p] : parts) {
    if (c.error != ncclSuccess) break;
    switch (p.kind) {
      case Kind::kAllGather:
        for (int q = 0; q < n; ++q) std::memcpy(p.recv + q * count, in[q].data(), count * 4);
        break;
      case Kind::kBroadcast:
        std::memcpy(p.recv, in[p.root].data(), count * 4);
        break;
      case Kind::kAllReduce:
      case Kind::kReduceScatter: {
        const size_t offset = p.kind == Kind::kReduceScatter ? static_cast<size_t>(r) * count : 0;
        // NCCL's float average multiplies each input by float(1 / n) and
        // sums; the sum here is in rank order (NCCL's follows its ring).
        const float scale = p.op == ncclAvg ? static_cast<float>(1.0 / n) : 1.0f;
        for (size_t i = 0; i < count && p.op == ncclMax; ++i) {
          float max = in[0][offset + i];
          for (int q = 1; q < n; ++q) max = std::max(max, in[q][offset + i]);
          p.recv[i] = max;
        }
        for (size_t i = 0; i < count && p.op != ncclMax; ++i) {
          float sum = 0.0f;
          for (int q = 0; q < n; ++q) {
            sum += p.op == ncclAvg ? in[q][offset + i] * scale : in[q][offset + i];
          }
          p.recv[i] = sum;
        }
        break;
      }
    }
  }
  for (const auto& [r, p] : parts) cuda_cpu::AddPendingWork(p.stream, -1);
}

ncclResult_t Enqueue(ncclComm_t comm, Part part, size_t send_count, size_t recv_count) {
  if (comm == nullptr) return ncclInvalidArgument;
  if (!cuda_cpu::Fits(part.send, static_cast<long long>(send_count)) ||
      !cuda_cpu::Fits(part.recv, static_cast<long long>(recv_count))) {
    return ncclInvalidArgument;
  }
  std::lock_guard<std::mutex> lock(Mu());
  Clique& c = *comm->clique;
  if (c.joined < c.nranks) return ncclInvalidUsage;
  cuda_cpu::AddPendingWork(part.stream, 1);
  const uint64_t seq = comm->next++;
  std::map<int, Part>& parts = c.collectives[seq];
  parts[comm->rank] = part;
  if (static_cast<int>(parts.size()) == c.nranks) {
    RunCollective(c, parts);
    c.collectives.erase(seq);
  }
  return ncclSuccess;
}

// Matches the heads of the (from, to) queues while both have one.
void MatchTransfers(Clique& c, std::pair<int, int> link) {
  std::deque<Transfer>& sends = c.sends[link];
  std::deque<Transfer>& recvs = c.recvs[link];
  while (!sends.empty() && !recvs.empty()) {
    if (sends.front().count != recvs.front().count) {
      c.error = ncclInvalidUsage;
      return;
    }
    std::memcpy(recvs.front().recv, sends.front().send, sends.front().count * sizeof(float));
    cuda_cpu::AddPendingWork(sends.front().stream, -1);
    cuda_cpu::AddPendingWork(recvs.front().stream, -1);
    sends.pop_front();
    recvs.pop_front();
  }
}

// Sends and receives posted since ncclGroupStart, taking effect at
// ncclGroupEnd (NCCL matches them there too).
struct Posted {
  ncclComm_t comm;
  int peer;
  bool is_send;
  Transfer transfer;
};

struct Group {
  int depth = 0;
  std::vector<Posted> posted;
};

Group& ThreadGroup() {
  thread_local Group group;
  return group;
}

// Queues this thread's posted sends and receives and matches what it can.
void FlushGroup() {
  std::vector<Posted> posted;
  posted.swap(ThreadGroup().posted);
  std::lock_guard<std::mutex> lock(Mu());
  for (const Posted& p : posted) {
    Clique& c = *p.comm->clique;
    const std::pair<int, int> link =
        p.is_send ? std::make_pair(p.comm->rank, p.peer) : std::make_pair(p.peer, p.comm->rank);
    cuda_cpu::AddPendingWork(p.transfer.stream, 1);
    (p.is_send ? c.sends : c.recvs)[link].push_back(p.transfer);
    MatchTransfers(c, link);
  }
}

ncclResult_t Post(Posted p) {
  Group& g = ThreadGroup();
  const Clique* c = p.comm == nullptr ? nullptr : p.comm->clique.get();
  if (c == nullptr || p.peer < 0 || p.peer >= c->nranks ||
      !(p.is_send ? cuda_cpu::Fits(p.transfer.send, static_cast<long long>(p.transfer.count))
                  : cuda_cpu::Fits(p.transfer.recv, static_cast<long long>(p.transfer.count)))) {
    return ncclInvalidArgument;
  }
  g.posted.push_back(p);
  if (g.depth == 0) FlushGroup();  // outside a group: a group of one
  return ncclSuccess;
}

}  // namespace

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unhandled error";
  }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::atomic<uint64_t> next{1};
  std::memset(id->internal, 0, sizeof id->internal);
  const uint64_t key = next++;
  std::memcpy(id->internal, &key, sizeof key);
  return ncclSuccess;
}

// Non-blocking (the host code asks for it): the communicator is ready, as
// ncclCommGetAsyncError reports, once every rank has called this.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t*) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  uint64_t key;
  std::memcpy(&key, id.internal, sizeof key);
  std::lock_guard<std::mutex> lock(Mu());
  std::shared_ptr<Clique>& c = Cliques()[key];
  if (c == nullptr) {
    c = std::make_shared<Clique>();
    c->nranks = nranks;
    c->ranks.assign(nranks, false);
  }
  if (c->nranks != nranks || c->ranks[rank]) return ncclInvalidUsage;
  c->ranks[rank] = true;
  ++c->joined;
  *comm = new ncclComm{c, key, rank, 0};
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(Mu());
  const Clique& c = *comm->clique;
  *state = c.error != ncclSuccess ? c.error : c.joined < c.nranks ? ncclInProgress : ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  return comm == nullptr ? ncclInvalidArgument : ncclSuccess;
}

// Leaves the clique; this rank's operations still waiting for peers are
// dropped (their streams no longer pending), as an abort frees them.
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(Mu());
    Clique& c = *comm->clique;
    for (auto& [seq, parts] : c.collectives) {
      auto it = parts.find(comm->rank);
      if (it == parts.end()) continue;
      cuda_cpu::AddPendingWork(it->second.stream, -1);
      parts.erase(it);
    }
    for (auto* links : {&c.sends, &c.recvs}) {
      for (auto& [link, queue] : *links) {
        if (link.first != comm->rank && link.second != comm->rank) continue;
        for (const Transfer& t : queue) cuda_cpu::AddPendingWork(t.stream, -1);
        queue.clear();
      }
    }
    if (++c.left == c.nranks) Cliques().erase(comm->key);
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat || comm == nullptr) return ncclInvalidArgument;
  const size_t n = static_cast<size_t>(comm->clique->nranks);
  return Enqueue(comm,
                 {Kind::kAllGather, static_cast<const float*>(send), static_cast<float*>(recv),
                  count, ncclSum, 0, stream},
                 count, count * n);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat || comm == nullptr) return ncclInvalidArgument;
  const size_t n = static_cast<size_t>(comm->clique->nranks);
  return Enqueue(comm,
                 {Kind::kReduceScatter, static_cast<const float*>(send), static_cast<float*>(recv),
                  count, op, 0, stream},
                 count * n, count);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat) return ncclInvalidArgument;
  return Enqueue(comm,
                 {Kind::kAllReduce, static_cast<const float*>(send), static_cast<float*>(recv),
                  count, op, 0, stream},
                 count, count);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat || comm == nullptr || root < 0 || root >= comm->clique->nranks) {
    return ncclInvalidArgument;
  }
  // Only the root's send buffer is read.
  const bool is_root = comm->rank == root;
  return Enqueue(comm,
                 {Kind::kBroadcast, static_cast<const float*>(send), static_cast<float*>(recv),
                  count, ncclSum, root, stream},
                 is_root ? count : 0, count);
}

ncclResult_t ncclGroupStart() {
  ++ThreadGroup().depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  Group& g = ThreadGroup();
  if (g.depth == 0) return ncclInvalidUsage;
  if (--g.depth == 0) FlushGroup();
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat) return ncclInvalidArgument;
  return Post({comm, peer, true, {static_cast<const float*>(send), nullptr, count, stream}});
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (type != ncclFloat) return ncclInvalidArgument;
  return Post({comm, peer, false, {nullptr, static_cast<float*>(recv), count, stream}});
}
