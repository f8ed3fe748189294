// CPU stand-in for NCCL, one rank (include/nccl.h, README.md).

#include <nccl.h>

#include <cstring>
#include <vector>

struct ncclComm {
  bool finalized = false;
};

namespace {

struct PendingTransfer {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
};

// The sends and receives posted since ncclGroupStart (one rank: all to
// itself), matched in order at ncclGroupEnd.
struct Group {
  int depth = 0;
  std::vector<PendingTransfer> sends, recvs;
};

Group& CurrentGroup() {
  thread_local Group group;
  return group;
}

// recv = send for `count` floats in device memory (the same buffer is fine).
ncclResult_t Copy(const void* send, void* recv, size_t count, ncclDataType_t type,
                  ncclComm_t comm) {
  if (comm == nullptr || type != ncclFloat) return ncclInvalidArgument;
  const size_t bytes = count * sizeof(float);
  if (bytes == 0) return ncclSuccess;
  if (!cuda_cpu::InDevice(send, bytes) || !cuda_cpu::InDevice(recv, bytes)) {
    return ncclInvalidArgument;
  }
  if (send != recv) std::memmove(recv, send, bytes);
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
      return "invalid usage (the CPU stand-in for NCCL runs one rank only)";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unhandled error";
  }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0, sizeof id->internal);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId, int rank,
                                    ncclConfig_t*) {
  if (nranks != 1 || rank != 0) return ncclInvalidUsage;
  *comm = new ncclComm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr) return ncclInvalidArgument;
  *state = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  comm->finalized = true;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t) {
  return Copy(send, recv, count, type, comm);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t, ncclComm_t comm, cudaStream_t) {
  return Copy(send, recv, count, type, comm);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t, ncclComm_t comm, cudaStream_t) {
  return Copy(send, recv, count, type, comm);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t) {
  if (root != 0) return ncclInvalidArgument;
  return Copy(send, recv, count, type, comm);
}

ncclResult_t ncclGroupStart() {
  ++CurrentGroup().depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  Group& g = CurrentGroup();
  if (g.depth == 0) return ncclInvalidUsage;
  if (--g.depth > 0) return ncclSuccess;
  ncclResult_t result = g.sends.size() == g.recvs.size() ? ncclSuccess : ncclInvalidUsage;
  for (size_t i = 0; i < g.sends.size() && i < g.recvs.size() && result == ncclSuccess; ++i) {
    if (g.sends[i].count != g.recvs[i].count) {
      result = ncclInvalidUsage;
      break;
    }
    const size_t bytes = g.sends[i].count * sizeof(float);
    if (bytes > 0) std::memmove(g.recvs[i].recv, g.sends[i].send, bytes);
  }
  g.sends.clear();
  g.recvs.clear();
  return result;
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t) {
  if (comm == nullptr || type != ncclFloat || peer != 0 || CurrentGroup().depth == 0 ||
      (count > 0 && !cuda_cpu::InDevice(send, count * sizeof(float)))) {
    return ncclInvalidArgument;
  }
  CurrentGroup().sends.push_back({send, nullptr, count});
  return ncclSuccess;
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t) {
  if (comm == nullptr || type != ncclFloat || peer != 0 || CurrentGroup().depth == 0 ||
      (count > 0 && !cuda_cpu::InDevice(recv, count * sizeof(float)))) {
    return ncclInvalidArgument;
  }
  CurrentGroup().recvs.push_back({nullptr, recv, count});
  return ncclSuccess;
}
