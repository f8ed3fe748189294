#pragma once

// A host backend (Gloo or the in-process one) on CUDA device buffers: each
// collective copies its device input to a pinned host buffer, runs the host
// group's collective there, and copies the result back to the device, as
// PyTorch's Gloo backend does for CUDA tensors. Built only with
// MUONMESH_HAVE_CUDA; CreateGroup makes one when GroupOptions::buffers is
// kCudaDevice and the backend works in host memory.
//
// What it is for: several ranks on one GPU (NCCL refuses two ranks of one
// communicator on one device), to develop and test the sharded CUDA runtime
// on a one-GPU machine; and jobs whose hosts have no usable NCCL transport.
// Every byte crosses PCIe twice and the host group's speed is Gloo's: a test
// and development mode, not a fast one (docs/architecture.md §5, "Host
// copies for CUDA ranks").
//
// Semantics are the host group's: CPU reductions in rank order (bit-identical
// to the host runtime's), the same counters (the bytes model of
// communicator.h), errors and timeouts. Copies run on the communicator's
// own CUDA stream, synchronously: device inputs written by other streams must
// be complete before the call (as with NCCL); outputs are complete on return.
// The pinned host buffer grows to the largest call's buffers and is kept.
// Abort reaches the host group (a Gloo call in progress ends at once).

#include <memory>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace muonmesh::comm {

// Wraps `host` (a group whose memory_space() is kHost) for buffers on CUDA
// device `cuda_device` (-1: the device current on the calling thread). The
// result has host's name, rank, size and backend(), memory space
// kCudaDevice. InvalidArgument when host is null or not a host group;
// FailedPrecondition when no CUDA device is usable.
absl::StatusOr<std::unique_ptr<Communicator>> StageThroughHost(
    std::unique_ptr<Communicator> host, int cuda_device);

// The device StageThroughHost would use (cuda_device, or the current one when
// -1), or FailedPrecondition when it is not usable: CreateGroup checks it
// before meeting the peers.
absl::StatusOr<int> StagingDevice(int cuda_device);

}  // namespace muonmesh::comm
