#pragma once

// Row-aligned flat layout of one unit on one shard domain.
//
// The unit's tensors are cut into num_shards equal shards of S elements. A
// shard holds runs of whole rows (Muon matrices are never cut inside a row;
// element-wise tensors have one-element rows) followed by padding, and each
// tensor's rows appear in shard order, so a rank holds one contiguous row
// range of each tensor. The padding is num_shards * S - total.
//
// Two packers compete and the smaller S wins (ties: "ordered"):
//  - "ordered": tensors in spec order, each shard filled greedily. For a
//    fixed order, greedy filling with binary search on S gives the smallest
//    feasible S, so it is never worse than Megatron's LCM rule, whose
//    layouts are also order-preserving row-aligned partitions.
//  - "packed": tensors grouped by row length (longest rows first); each
//    shard takes whole rows of the longest-row stream, then tops up from the
//    next streams, choosing among a few counts of the first stream the one
//    that wastes least. This absorbs the odd remainders that long rows leave.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/types.h"

namespace muonmesh::plan {

// The tensors of one unit as each mesh lays them out: Muon matrices as
// their rows, element-wise tensors as one-element rows; an expert stack
// contributes its E/EP local experts, one after another. Assumes a
// validated spec.
struct UnitTensors {
  std::vector<LayoutTensor> dense;
  std::vector<LayoutTensor> expert;
};
UnitTensors SplitUnit(const UnitSpec& unit, int64_t ep);

// Fails (InvalidArgument) only for num_shards < 1 or a tensor with a
// non-positive size.
absl::StatusOr<UnitLayout> LayoutUnit(std::span<const LayoutTensor> tensors,
                                      int64_t num_shards);

// Megatron-FSDP's rule, for comparison: tensors in order, each matrix start
// aligned to its row length, shards rounded up to a multiple of the LCM of
// the unit's Muon row lengths. Returns the padding in elements.
int64_t MegatronLcmPadding(std::span<const LayoutTensor> tensors, int64_t num_shards);

}  // namespace muonmesh::plan
