#pragma once

// Muon owner assignment for one class of identical domains.
//
// Each matrix of the domain gets an owner position that gathers its rows,
// runs Newton-Schulz and scatters the result back. The cost of matrix j on
// position p is
//     cost_flops(j) + comm_flops_per_byte * gather_bytes(j, p),
// where gather_bytes counts the rows p does not hold, in and out. The rules:
//  - lpt: longest (by the cost at the matrix's best holder) first, each to
//    the position that finishes it earliest among its holders and the least
//    loaded position overall (an owner may be a non-holder when that shortens
//    the critical path; its extra bytes are counted), then a local-search
//    refinement that moves or swaps matrices off the busiest position while
//    that lowers the makespan.
//  - round_robin: matrix i (in spec order) to position i mod D.
//  - greedy_in_order: in spec order, each to its least loaded holder (the
//    rule of Megatron-LM #6425).
//  - allgather: no owner; every position gathers every matrix and runs
//    Newton-Schulz on all of them (the numerics and performance baseline).
// All deterministic: ties break by lower index / position.

#include <cstdint>
#include <vector>

#include "server/plan/types.h"

namespace muonmesh::plan {

// T (4 m^2 n + 2 m^3) with m = min(rows, cols), n = max(rows, cols).
double NewtonSchulzFlops(int64_t rows, int64_t cols, int64_t ns_steps);

// max(largest cost, total / ranks, p_k + p_{k+1}) for costs sorted
// descending and k = ranks (the last term only when there are more matrices
// than ranks).
double MakespanLowerBound(std::vector<double> costs, int64_t ranks);

// Fills owner, owner_cost and gather_bytes of every matrix and the domain's
// per-position loads, makespan, lower bound and exchange bytes. Expects
// domain->size, each matrix's rows, cols, cost_flops and holders (ascending
// positions, row ranges inside the matrix) to be set.
void AssignOwners(OwnerRule rule, double comm_flops_per_byte, int64_t bytes_per_element,
                  DomainPlan* domain);

}  // namespace muonmesh::plan
