#include "worker/runtime/device.h"

namespace muonmesh::worker {

absl::StatusOr<DeviceBuffer> Device::AllocateZeroed(int64_t count) {
  absl::StatusOr<DeviceBuffer> b = Allocate(count);
  if (!b.ok()) return b.status();
  if (absl::Status st = Fill(b->data(), count, 0.0f); !st.ok()) return st;
  return b;
}

}  // namespace muonmesh::worker
