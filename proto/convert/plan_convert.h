#pragma once

// Translation between the API messages (muonmesh.v1) and the planner's value
// types, kept at the edge so that the planner (core/plan/) stays free of protobuf.

#include "muonmesh/v1/planner.pb.h"
#include "core/plan/types.h"

namespace muonmesh::convert {

plan::ModelSpec ModelFromProto(const v1::ModelSpec& model);
v1::ModelSpec ModelToProto(const plan::ModelSpec& model);
plan::ParallelismConfig ParallelismFromProto(const v1::ParallelismConfig& par);
v1::PlanOptions OptionsToProto(const plan::PlanOptions& options);
plan::PlanInput PlanInputFromProto(const v1::PlanLayoutRequest& request);
plan::PlanInput PlanInputFromProto(const v1::ValidateConfigRequest& request);

// `include_shards` adds every shard's segments to each unit layout;
// `include_holders` false leaves out each matrix's holders (most of a large
// plan: 1.9 million of them for DeepSeek-V3 at 16384 ranks).
void PlanToProto(const plan::PlanInput& input, const plan::Plan& plan, bool include_shards,
                 v1::Plan* out, bool include_holders = true);

}  // namespace muonmesh::convert
