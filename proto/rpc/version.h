#pragma once

// The release every binary reports: --version, the muonmesh_build_info
// gauge (metrics_http.h) and a worker's registration. CMake's
// project(VERSION), through the generated muonmesh/config.h (link
// muonmesh::config).

#include "muonmesh/config.h"

namespace muonmesh::rpc {

inline const char* Version() { return MUONMESH_VERSION; }

}  // namespace muonmesh::rpc
