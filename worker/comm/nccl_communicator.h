#pragma once

// The NCCL backend: fp32 buffers in the device memory of this rank's GPU
// (GroupOptions::cuda_device). Built only with MUONMESH_HAVE_CUDA.
//
// Rendezvous: rank 0 creates the NCCL unique id and publishes it in the
// Store under "<group_name>/nccl/unique_id"; every rank reads it and calls
// ncclCommInitRankConfig on a non-blocking communicator, polled until ready
// or options.connect_timeout (then aborted: DeadlineExceeded).
//
// Each collective is enqueued on the group's own non-blocking CUDA stream
// (ncclAllGather, ncclReduceScatter, ncclAllReduce, ncclBroadcast; ncclAvg
// for kAvg; AllToAllV as grouped ncclSend/ncclRecv with the self part copied
// on the stream; Barrier as a one-float all-reduce), then the call polls
// ncclCommGetAsyncError and cudaStreamQuery until the work is done, NCCL
// reports an error (Unavailable for a lost peer or network error, Internal
// otherwise), or the deadline passes (DeadlineExceeded). Any failure aborts
// the NCCL communicator (ncclCommAbort), which is what "broken group" means
// here. Calls are synchronous: input buffers written by other streams must be
// complete before the call (synchronise them first); outputs are complete
// when it returns.
//
// One GPU per rank: NCCL refuses two ranks of one communicator on one device.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"
#include "worker/comm/types.h"

namespace muonmesh::comm {

// Errors as CreateGroup; FailedPrecondition when no CUDA device is usable.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    Store& store, std::string group_name, int rank, int size, const GroupOptions& options);

}  // namespace muonmesh::comm
