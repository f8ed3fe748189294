#pragma once

// The process groups one rank joins for one mesh, derived from the plan's
// mesh geometry. Every member of a group computes the same name and the same
// member order, so groups can be created independently on each rank.
//
// Orders follow the domain positions (docs/architecture.md §3, core/plan/mesh.h): the
// parameter shard of a rank is the run of optimizer shards of its parameter
// group, and collectives over a group see their chunks in position order.

#include <cstdint>
#include <string>
#include <vector>

#include "core/plan/mesh.h"

namespace muonmesh::worker {

struct GroupSpec {
  std::string name;             // unique per job attempt, same on every member
  std::vector<int32_t> ranks;   // member order (rank_in_group indexes it)
  int rank_in_group = 0;
  int size() const { return static_cast<int>(ranks.size()); }
};

struct MeshGroups {
  // Every rank of the optimizer domain, by position (the Muon exchange).
  GroupSpec domain;
  // Forward: ranks sharing my position inside the parameter group, one per
  // parameter shard, by position (gathers whole parameters).
  GroupSpec param_gather;
  // After the step: my parameter group, by position (gathers the updated
  // optimizer shards back into my parameter shard).
  GroupSpec param_group;
  // Gradient reduce-scatter, one group per optimizer-sharded axis, major
  // first, each ordered by that axis' coordinate.
  std::vector<GroupSpec> reduce_scatter;
  // Gradient all-reduce, one group per axis (size > 1) where the optimizer
  // state is replicated.
  std::vector<GroupSpec> all_reduce;
};

// `prefix` names the job attempt (group names must be unique per store).
MeshGroups GroupsFor(const plan::MeshGeometry& mesh, int32_t rank, const std::string& prefix);

// All ranks, in order.
GroupSpec WorldGroup(int64_t world_size, int32_t rank, const std::string& prefix);

}  // namespace muonmesh::worker
