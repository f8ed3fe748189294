// Synthetic::FromSpecFile on its own: the only part of the workload that
// reads protobuf (the spec file), so GPU binaries can leave it out.

#include "absl/strings/str_cat.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/io/message_file.h"
#include "proto/convert/plan_convert.h"
#include "core/base/status_macros.h"
#include "worker/model/synthetic.h"

namespace muonmesh::worker {

absl::StatusOr<Synthetic> Synthetic::FromSpecFile(const std::string& path, double scale,
                                                  int64_t expert_divisor, uint64_t gradient_seed) {
  v1::ModelSpec proto;
  MUONMESH_RETURN_IF_ERROR(protoio::LoadMessageFile(path, &proto));
  absl::StatusOr<Synthetic> out =
      Create(convert::ModelFromProto(proto), scale, expert_divisor, gradient_seed);
  if (!out.ok()) {
    return absl::Status(out.status().code(), absl::StrCat(path, ": ", out.status().message()));
  }
  return out;
}

}  // namespace muonmesh::worker
