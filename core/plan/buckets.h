#pragma once

// Communication buckets (docs/architecture.md §5, "Buckets"): consecutive
// units of one mesh whose gradient reductions, and whose parameter gathers
// after the step, go out as one collective instead of one per unit. Every
// rank cuts the same buckets from the plan and the job's
// communication.bucket_bytes, so every rank issues the same collectives.
// The values reduced or gathered are the same element for element: the CPU
// backends reduce each element in rank order whatever the count, so
// weights are bit-identical with and without buckets.

#include <cstdint>
#include <vector>

#include "core/plan/types.h"

namespace muonmesh::plan {

// communication.bucket_bytes when unset: PyTorch DDP's 25 MiB.
inline constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;

struct Bucket {
  MeshKind mesh = MeshKind::kDense;
  // Spec unit indices, ascending, each with a layout on `mesh`.
  std::vector<int32_t> units;
  // The units' padded buffers (num_shards * shard_elements) summed: what
  // the bucket's first reduce-scatter takes.
  int64_t elements = 0;
};

// The dense mesh's buckets, then the expert mesh's: each mesh's units in
// order, a bucket closed when the next unit would take it past
// `bucket_bytes` (4 bytes an element), a unit larger than that alone.
// bucket_bytes <= 0: one unit a bucket.
std::vector<Bucket> PlanBuckets(const Plan& plan, int64_t bucket_bytes);

// Whether every parameter of `model` (4 bytes an element) fits in one bucket
// of `bucket_bytes` (> 0). Then a pass gathers the whole model in one
// all-gather, and the backward pass would gather it whole again at its
// start, beside every saved activation: holding the units gathered between
// the two (reshard_after_forward false) raises no peak and saves that
// gather. What communication.reshard_after_forward means when unset
// (docs/architecture.md §5, "Held for the backward pass").
bool ModelFitsOneBucket(const ModelSpec& model, int64_t bucket_bytes);

// A unit's padded buffer on a mesh: the elements its reduce-scatter takes.
inline int64_t PaddedElements(const UnitLayout& l) { return l.num_shards * l.shard_elements; }

}  // namespace muonmesh::plan
