#pragma once

// Loads the real model specs of specs/ for tests and benchmarks.

#include <string>

#include "absl/status/statusor.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/io/message_file.h"
#include "core/plan/types.h"
#include "proto/convert/plan_convert.h"

namespace muonmesh::testing {

inline std::string SpecPath(const std::string& name) {
  return std::string(MUONMESH_SPECS_DIR) + "/" + name + ".json";
}

inline absl::StatusOr<plan::ModelSpec> LoadSpec(const std::string& name) {
  v1::ModelSpec spec;
  absl::Status st = protoio::LoadMessageFile(SpecPath(name), &spec);
  if (!st.ok()) return st;
  return convert::ModelFromProto(spec);
}

}  // namespace muonmesh::testing
