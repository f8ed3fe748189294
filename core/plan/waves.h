#pragma once

// How the Muon phase of a step is cut into waves (docs/architecture.md §5): consecutive
// spec units whose owners' buffers fit a memory budget run as one round:
// one gather exchange per mesh domain for all of them, Newton-Schulz on
// every matrix a rank owns in the round (dense and expert alike), one
// scatter exchange per domain, then the updates. With one wave the
// critical path is the busiest rank's Newton-Schulz work over the whole
// model and all its domains; with several, the sum over waves of each
// wave's busiest rank.
//
// Pure functions of the plan, so every rank cuts the same waves without
// talking (the exchanges of a wave must hold the same units on every rank),
// and the planner, given the runtime's budget (PlanOptions::
// muon_wave_budget_bytes), balances the owners wave by wave on the same
// cut.

#include <cstdint>
#include <string_view>
#include <vector>

#include "core/plan/types.h"

namespace muonmesh::plan {

// Spec units [first_unit, end_unit) and what they need.
struct MuonWave {
  int32_t first_unit = 0;
  int32_t end_unit = 0;
  // The most buffer bytes any position needs for this wave (see
  // MuonUnitBytes), summed over the units.
  int64_t bytes = 0;
};

// Per spec unit: the most bytes a position of each mesh needs for its Muon
// exchange, dense and expert added (a rank is on both meshes): the whole
// matrices it orthogonalizes and their receive buffer (2 x owned), its own
// u rows and their send buffer (2 x held), fp32; under the HSDP replica
// split only its replica's matrices count as owned, and the replica
// exchange's buffers count too. Every matrix counts as owned under the
// allgather rule.
std::vector<int64_t> MuonUnitBytes(const Plan& plan);

// Cuts the units with Muon matrices into waves, greedily in spec order, each
// at most `budget_bytes` (a unit over the budget alone makes a wave of its
// own); budget 0 or less puts everything in one wave. Units without Muon
// matrices belong to no wave. Empty when the model has no Muon matrix.
std::vector<MuonWave> PlanMuonWaves(const Plan& plan, int64_t budget_bytes);

// A budget that keeps the Muon phase within the step's backward-pass peak:
// the size of the largest unit's whole gradients on either mesh (D x S
// floats), which the step holds during the backward pass beside the padded
// gather buffer and which is free again by the optimizer phase. Not the
// default (one wave is: cutting the model into waves makes the critical
// path the sum of each wave's busiest rank); a suggestion for jobs short of
// memory, printed by the memory check.
int64_t BackwardPeakMuonBufferBytes(const Plan& plan);

// What the plan says each rank computes in each wave: [wave][rank], the
// Newton-Schulz FLOPs of the matrices its positions own in the wave's units
// over every domain it belongs to (every matrix of its domains under the
// allgather rule; under the HSDP replica split only its replica's
// matrices). The critical path of the executed schedule is the sum over
// waves of each wave's largest entry.
std::vector<std::vector<double>> PlannedWaveNsFlops(const Plan& plan,
                                                    const std::vector<MuonWave>& waves);

// The budget each wave gets: `requested` (TrainerOptions::muon_buffer_bytes;
// 0 or less: no budget, one wave), halved when `overlap` keeps two waves in
// flight.
int64_t WaveBudget(int64_t requested, bool overlap);

// The budget a job's workers run with: WaveBudget of its
// optimizer.muon_buffer_bytes, two waves in flight except on cuda (the
// device's calls are not overlapped there; empty: the job default, cpu).
int64_t JobWaveBudget(int64_t muon_buffer_bytes, std::string_view device);

// The critical path the runtime executes for `plan` cut into `waves`: the
// sum over waves of the busiest rank's Newton-Schulz FLOPs
// (PlannedWaveNsFlops).
double WaveCriticalPathNsFlops(const Plan& plan, const std::vector<MuonWave>& waves);

}  // namespace muonmesh::plan
