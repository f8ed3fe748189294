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
#include "absl/status/statusor.h"
#include "core/plan/cancel.h"
#include "core/plan/types.h"

namespace muonmesh::plan {

// The standard form's FLOPs, T (4 m^2 n + 2 m^3) with m = min(rows, cols),
// n = max(rows, cols) (plan::StandardNsFlops); matrices are charged NsFlops
// of the form that runs (ns_cost.h).
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
// The same as AssignOwnersJointly with this one class, one rank a position.
absl::Status AssignOwners(OwnerRule rule, double comm_flops_per_byte, int64_t bytes_per_element,
                          DomainPlan* domain, CancelToken* cancel = nullptr);

// One class of identical domains in a joint assignment (all dense domains,
// or all expert domains): its plan, by position, and for each position the
// ranks that run that position's share (one rank per domain of the class).
// Every rank of the world sits at exactly one position of every class.
struct DomainClass {
  DomainPlan* plan = nullptr;
  std::vector<std::vector<int32_t>> ranks;  // per position
};

// Owner assignment of several classes at once, for the runtime's one Muon
// schedule over all units and both meshes: a rank does the Newton-Schulz
// work of every position it holds in every class in the same step, so the
// critical path is
//     max over ranks r of  sum over classes c of  load_c(position of r in c)
// (the joint makespan; with one wave of units, as the runtime runs by
// default; with several waves it is the sum over waves of that maximum).
// lpt balances exactly that: all matrices of all classes, longest first,
// each restricted to the positions of its own class, to the position whose
// busiest rank finishes it earliest; then capped placements, by bisection on
// a cap between the joint lower bound and the best makespan so far (each
// matrix, longest first, to the cheapest position within the cap, so that
// owners stay with their rows while balance allows; within a fixed work
// budget); then the refinement, which moves or swaps matrices off the
// positions of the busiest rank, in whichever class helps, run from the best
// capped placement and (with a quarter of the work budget) from lpt's; where
// both end over 1.05 x the joint bound, also (with a thirty-second each)
// from group-packed starts (the one-rank-a-position class, dense, packed
// level into as few groups of the other class's positions as it fits, then
// the rest capped) and a holders-first start (every expert matrix on its
// best holder, then the dense ones longest first where they finish
// earliest: for expert matrices that are dear to move); the best is kept.
// Each refinement alternates with levelling the groups: a dense matrix that
// alone holds its group's busiest rank up moves where it raises no group,
// when the room that frees exceeds its extra cost, so that the next
// refinement can move the group's own work.
// The other rules assign each class on its own, as AssignOwners does.
//
// `base_load` (null: none) is per rank work outside the classes that the
// assignment balances around (the HSDP replica split's exchange, planner.cc
// SplitBaseLoad): lpt starts each rank's load from it, and the returned
// loads include it. JointLowerBound counts its sum and its largest entry,
// so those must bound what every plan carries.
//
// Fills every class's plan as AssignOwners does (its per-position loads are
// its own share; refine_work and refine_budget_spent are those of the kept
// refinement, the same in every class) and returns the joint load of every
// rank.
// Cancelled as AssignOwners; InvalidArgument when a class's rank lists do
// not cover the world once, or base_load has not one entry a rank.
absl::StatusOr<std::vector<double>> AssignOwnersJointly(
    OwnerRule rule, double comm_flops_per_byte, int64_t bytes_per_element, int64_t world_size,
    const std::vector<DomainClass>& classes, CancelToken* cancel = nullptr,
    const std::vector<double>* base_load = nullptr);

// Refills a domain's per-position loads, Newton-Schulz FLOPs, gather bytes,
// owned counts, makespan and exchange bytes, and each matrix's owner cost
// and gather bytes, from its matrices' owners (set elsewhere: the planner's
// wave-by-wave balancing); its lower bounds and refinement work stay. Not
// for the allgather rule (no owners).
void SumOwnerLoads(double comm_flops_per_byte, int64_t bytes_per_element, DomainPlan* domain);

// The joint lower bound of docs/architecture.md §4: max(each class's lower bound,
// sum over classes of (domains of the class x its best-holder costs) /
// world size). With a base load (AssignOwnersJointly), also the largest
// base, and the bases' sum joins the total. Expects the classes' lower
// bounds and min costs filled (by AssignOwnersJointly).
double JointLowerBound(int64_t world_size, const std::vector<DomainClass>& classes,
                       const std::vector<double>* base_load = nullptr);

// A stronger certified lower bound on the joint makespan, for when the plan
// is far from JointLowerBound and a user must know whether the plan or the
// bound is loose: the largest of
//  - JointLowerBound;
//  - a Lagrangian (LP dual) bound: for any weights y >= 0 over the ranks
//    summing to 1, every plan has
//        makespan >= sum_r y_r load_r >= sum over matrix copies j of
//                    min over the ranks r that may own j of y_r cost(j, r),
//    since each copy lands on one rank at its cost there (dropping the rule
//    that a class's domains share positions only lowers the right side).
//    The weights come from a fixed number of exponentiated-gradient steps
//    (the loads of the relaxed choice are a supergradient); any y is valid;
//  - a bin-packing bound (Martello and Toth's L2) on the copies' best-holder
//    costs, over all ranks and over each class's positions: if L2 says more
//    than `ranks` bins of capacity C are needed, no plan finishes by C;
//    likewise a count of two sizes k1 > k2: a bin with u copies of at least
//    k1 has room for at most floor((C - u k1) / k2) of [k2, k1), so with
//    the u adding up to the copies of at least k1, the bins hold too few
//    of [k2, k1) (the best mix of u over the bins, relaxed to fractions);
//  - PigeonholeLowerBound, over each class's positions and over all ranks;
//  - across two classes i, j: a position of class i carries at least its
//    class bound B_i, and each of its ranks also carries a position of class
//    j, which is left at least class j's total less what its other D_j - 1
//    positions take (T each): T >= (B_i + total_j) / D_j;
//  - groups: where class a's positions are each run by R > 1 ranks (expert
//    positions, one rank per EP group), a position's load lands on all R.
//    Take class b's copies of at least theta (n of them): a group whose
//    ranks hold x of them has a rank holding ceil(x / R) of them, so its
//    a-load is at most T - ceil(x / R) theta, and the levels
//    l_q = ceil(x_q / R) of the groups add up to at least ceil(n / R). T is
//    infeasible when, for every such choice of levels, a's matrices do not
//    fit: by area (their best-holder costs exceed Q T - theta ceil(n / R))
//    or by count (more of them of at least k than the most
//    sum_q floor((T - l_q theta) / k) over the choices, a small knapsack);
//    and by the price of shedding: each of a's matrices is native to its
//    cheapest position and costs rho >= 1 times as much elsewhere, so a
//    group at level l_q moves native work M_q >= H_q - (T - l_q theta) away
//    at a surcharge f_q(M_q) (cheapest rho first), and the groups' room
//    sum_q (T - l_q theta) (and, where they cover every rank, Q T less b's
//    area over R) must hold sum_q (H_q + f_q(M_q)); a min-plus knapsack;
// Deterministic; its work is bounded by `max_work` cost evaluations (at
// least a few passes); ticks `cancel` and returns what it has when that
// says stop. Expects the classes assigned (AssignOwnersJointly).
double StrongJointLowerBound(double comm_flops_per_byte, int64_t bytes_per_element,
                             int64_t world_size, const std::vector<DomainClass>& classes,
                             int64_t max_work = int64_t{1} << 25, CancelToken* cancel = nullptr);

// The replica split's exchange over dp_outer, for a domain plan with
// replicas > 1 (types.h, DomainPlan): after the owners' scatters, the rank
// at (replica o, position q) holds the orthogonalized rows of its shard for
// the matrices replica o orthogonalized, and sends them to each of the
// other I - 1 replicas' rank at q; it receives its rows of every other
// matrix from the replica that orthogonalized it. Per (replica, position),
// replica-major: sent = (I - 1) x its rows of its replica's matrices,
// received = its rows of the others', in bytes. Empty for replicas <= 1.
struct ReplicaExchange {
  std::vector<int64_t> sent;
  std::vector<int64_t> recv;
};
ReplicaExchange ReplicaExchangeBytes(const DomainPlan& domain, int64_t bytes_per_element);

// For costs sorted descending p_1 >= p_2 >= ... on `ranks` positions: the
// top k ranks + 1 costs put k + 1 of them on one position, so the makespan
// is at least the sum of the k + 1 smallest of them, for every k >= 1
// (k = 1 is p_m + p_{m+1}); and at least the largest cost.
double PigeonholeLowerBound(std::vector<double> costs, int64_t ranks);

// Martello-Toth L2 for bin packing, with a count form (no bin holds more
// than floor(C / K) sizes >= K): a lower bound on the bins of capacity
// `capacity` that `sizes` need. Sizes above the capacity count one bin each.
int64_t BinPackingLowerBound(std::vector<double> sizes, double capacity);

}  // namespace muonmesh::plan
