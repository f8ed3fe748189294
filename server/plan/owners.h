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
//    that lowers the makespan, within a work budget (RefineWorkBudget).
//  - round_robin: matrix i (in spec order) to position i mod D.
//  - greedy_in_order: in spec order, each to its least loaded holder (the
//    rule of Megatron-LM #6425).
//  - allgather: no owner; every position gathers every matrix and runs
//    Newton-Schulz on all of them (the numerics and performance baseline).
// All deterministic: ties break by lower index / position.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "plan/cancel.h"
#include "plan/types.h"

namespace muonmesh::plan {

// T (4 m^2 n + 2 m^3) with m = min(rows, cols), n = max(rows, cols).
double NewtonSchulzFlops(int64_t rows, int64_t cols, int64_t ns_steps);

// max(largest cost, total / ranks, p_k + p_{k+1}) for costs sorted
// descending and k = ranks (the last term only when there are more matrices
// than ranks).
double MakespanLowerBound(std::vector<double> costs, int64_t ranks);

// The refinement's work budget for a domain of `matrices` matrices, in work
// units: one unit is one matrix's cost evaluated on one position (a move's
// candidate, a swap partner's matrix indexed or scanned), or one matrix
// listed when a step sorts the busiest position's matrices. A step can cost
// O(n) units (swap partners are indexed by their matrices), and big domains
// can take as many steps as matrices, so without a budget they take hours.
// The budget is a count, not a clock: the same input stops at the same
// point on every machine, and the plan stays deterministic. When it runs
// out the search keeps the assignment it has (each accepted step lowered the
// busiest load).
//
// kRefineWorkMax units for up to kRefineFullMatrices matrices, shrinking in
// proportion beyond (kRefineWorkMax * kRefineFullMatrices / matrices, at
// least kRefineWorkMin): each unit is slower in big domains, whose data no
// longer fits in caches (~15 ns a unit at 5k matrices, ~200 ns at 400k),
// and refinement has least to gain there, LPT being within one matrix of
// the best load per position. Every public spec (GPT-2, Llama-3-8B,
// DeepSeek-V3 at 8 to 2048 ranks) needs at most half of kRefineWorkMax and
// is planned exactly as without a budget.
inline constexpr int64_t kRefineWorkMax = int64_t{1} << 26;  // ~67M units
inline constexpr int64_t kRefineFullMatrices = int64_t{1} << 14;
inline constexpr int64_t kRefineWorkMin = int64_t{1} << 20;
int64_t RefineWorkBudget(int64_t matrices);

// Fills owner, owner_cost and gather_bytes of every matrix and the domain's
// per-position loads, makespan, lower bound, exchange bytes and refinement
// work. Expects domain->size, each matrix's rows, cols, cost_flops and
// holders (ascending positions, row ranges inside the matrix) to be set.
// Ticks `cancel` (may be null) as it works; returns CancelToken::Status()
// when that says stop, leaving the domain half assigned; otherwise OK.
absl::Status AssignOwners(OwnerRule rule, double comm_flops_per_byte, int64_t bytes_per_element,
                          DomainPlan* domain, CancelToken* cancel = nullptr);

}  // namespace muonmesh::plan
