#pragma once

// Translation between the API messages (muonmesh.v1) and the planner's value
// types, kept at the edge so that the planner (core/plan/) stays free of protobuf.

#include "muonmesh/v1/planner.pb.h"
#include "core/plan/types.h"

namespace muonmesh {

plan::ModelSpec ModelFromProto(const v1::ModelSpec& model);
v1::ModelSpec ModelToProto(const plan::ModelSpec& model);
plan::ParallelismConfig ParallelismFromProto(const v1::ParallelismConfig& par);
plan::PlanInput PlanInputFromProto(const v1::PlanLayoutRequest& request);
plan::PlanInput PlanInputFromProto(const v1::ValidateConfigRequest& request);

// `include_shards` adds every shard's segments to each unit layout.
void PlanToProto(const plan::PlanInput& input, const plan::Plan& plan, bool include_shards,
                 v1::Plan* out);

}  // namespace muonmesh
