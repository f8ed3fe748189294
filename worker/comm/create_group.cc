// CreateGroup: argument checks shared by every backend, then the backend's
// own factory. Its own file so a build without Gloo (the self-contained GPU
// test binary) can compile it with MUONMESH_COMM_WITH_GLOO=0.

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "muonmesh/config.h"
#include "worker/comm/communicator.h"
#include "worker/comm/inprocess_communicator.h"

#ifndef MUONMESH_COMM_WITH_GLOO
#define MUONMESH_COMM_WITH_GLOO 1
#endif
#if MUONMESH_COMM_WITH_GLOO
#include "worker/comm/gloo_communicator.h"
#endif
#if MUONMESH_HAVE_CUDA
#include "worker/comm/nccl_communicator.h"
#include "worker/comm/staging_communicator.h"
#endif

namespace muonmesh::comm {
namespace {

absl::StatusOr<std::unique_ptr<Communicator>> CreateBackend(Backend backend, Store& store,
                                                            std::string group_name,
                                                            int rank_in_group, int group_size,
                                                            const GroupOptions& options) {
  switch (backend) {
    case Backend::kInProcess:
      return CreateInProcessCommunicator(std::move(group_name), rank_in_group, group_size,
                                         options);
    case Backend::kGloo:
#if MUONMESH_COMM_WITH_GLOO
      return CreateGlooCommunicator(store, std::move(group_name), rank_in_group, group_size,
                                    options);
#else
      return absl::UnimplementedError("this build has no Gloo backend");
#endif
    case Backend::kNccl:
#if MUONMESH_HAVE_CUDA
      return CreateNcclCommunicator(store, std::move(group_name), rank_in_group, group_size,
                                    options);
#else
      return absl::UnimplementedError(
          "this build has no NCCL backend (configure with MUONMESH_ENABLE_CUDA=ON)");
#endif
  }
  return absl::InvalidArgumentError("CreateGroup: unknown backend");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGroup(Backend backend, Store& store,
                                                          std::string group_name,
                                                          int rank_in_group, int group_size,
                                                          const GroupOptions& options) {
  if (group_name.empty()) return absl::InvalidArgumentError("CreateGroup: empty group name");
  if (group_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateGroup '", group_name, "': group size ", group_size, " < 1"));
  }
  if (rank_in_group < 0 || rank_in_group >= group_size) {
    return absl::InvalidArgumentError(absl::StrCat("CreateGroup '", group_name, "': rank ",
                                                   rank_in_group, " not in [0, ", group_size,
                                                   ")"));
  }
  if (options.connect_timeout <= absl::ZeroDuration() ||
      options.connect_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateGroup '", group_name, "': connect_timeout must be positive and finite"));
  }
  if (options.abort != nullptr) {
    if (std::optional<std::string> reason = options.abort->reason()) {
      return absl::CancelledError(
          absl::StrCat("CreateGroup '", group_name, "': aborted: ", *reason));
    }
  }
  const bool stage = options.buffers == MemorySpace::kCudaDevice && backend != Backend::kNccl;
#if MUONMESH_HAVE_CUDA
  if (stage) {
    // Before meeting the peers: a rank without the device fails alone.
    absl::StatusOr<int> device = StagingDevice(options.cuda_device);
    if (!device.ok()) return AnnotateStatus(device.status(), absl::StrCat("CreateGroup '", group_name, "'"));
  }
#else
  if (stage) {
    return absl::UnimplementedError(absl::StrCat(
        "CreateGroup '", group_name, "': ", BackendName(backend),
        " on CUDA device buffers needs a build with CUDA (MUONMESH_ENABLE_CUDA=ON)"));
  }
#endif
  absl::StatusOr<std::unique_ptr<Communicator>> made = CreateBackend(
      backend, store, std::move(group_name), rank_in_group, group_size, options);
#if MUONMESH_HAVE_CUDA
  if (stage && made.ok()) made = StageThroughHost(*std::move(made), options.cuda_device);
#endif
  // Aborted at once when the signal fired while it met its peers.
  if (made.ok()) (*made)->AbortWith(options.abort);
  return made;
}

}  // namespace muonmesh::comm
