#include "worker/runtime/device.h"
#include "core/base/status_macros.h"

namespace muonmesh::worker {

absl::StatusOr<DeviceBuffer> Device::AllocateZeroed(int64_t count) {
  MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer b, Allocate(count));
  MUONMESH_RETURN_IF_ERROR(Fill(b.data(), count, 0.0f));
  return b;
}

}  // namespace muonmesh::worker
