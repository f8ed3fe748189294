#pragma once

// A seeded generator of plausible transformer shapes for the planner's
// property test and benchmark: dense and MoE models in the planner's input
// form (the same units and params as the public specs in specs/),
// with the parallelism each is planned under. It knows nothing of the
// planner's internals; its ranges come from published architectures:
//  - hidden 1024-8192 (a few wider or odd: 2304, 3584, 5376, 12288), head
//    dim 64/128 (a few 80/96), GQA with 1 to all kv heads, some fused qkv,
//    some MLA attention (low-rank q and kv projections, as DeepSeek-V2/V3);
//  - 12-80 layers, GPT-style (4h, fc/proj) or gated (gate/up/down) MLPs;
//  - MoE: 8-256 routed experts with an expert MLP of h/8 to h, 0-2 shared
//    experts, 0-3 leading dense layers, a router (AdamW);
//  - vocab 32000-152064, embeddings and an untied head (AdamW), norms;
//  - EP a power of two 1-64 dividing the expert count and the world size,
//    ZeRO-3 mostly, HFSDP (I = 2, outer optim) and HSDP (I = 2, outer
//    no_shard) for some.
//
// Deterministic: the same seed gives the same shape on every platform (it
// draws from std::mt19937_64, whose output the standard fixes, and maps
// draws to ranges by modulo, not by the library's distributions).

#include <cstdint>
#include <string>

#include "core/plan/types.h"

namespace muonmesh::testing {

struct GeneratedShape {
  plan::ModelSpec model;
  std::string description;  // one line: hidden, layers, heads, experts, ...
  int64_t experts = 0;      // routed experts (0: dense)
  int64_t preferred_ep = 1;
  int64_t instances = 1;      // num_distributed_optimizer_instances
  std::string outer;          // outer_dp_sharding_strategy when instances > 1
};

GeneratedShape GenerateShape(uint64_t seed);

// The largest power of two <= shape.preferred_ep that divides both the
// expert count and `world` (1 for a dense model).
int64_t EpFor(const GeneratedShape& shape, int64_t world);

// The planner input of a shape on `world` ranks (lpt, cuda cost model).
plan::PlanInput InputFor(const GeneratedShape& shape, int64_t world);

}  // namespace muonmesh::testing
