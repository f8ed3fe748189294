#include "worker/comm/nccl_checks.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace muonmesh::comm::internal {

absl::Status NcclErrorToStatus(ncclResult_t result, const char* expr, const char* file,
                               int line) {
  const std::string message =
      absl::StrCat(file, ":", line, ": ", expr, ": ", ncclGetErrorString(result));
  switch (result) {
    case ncclSystemError:
    case ncclRemoteError:
      return absl::UnavailableError(message);
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace muonmesh::comm::internal
