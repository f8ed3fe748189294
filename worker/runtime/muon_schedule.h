#pragma once

// The Muon phase's waves, as the runtime runs them: plan/waves.h (pure
// functions of the plan, which the planner also uses to balance the owners
// wave by wave).

#include "core/plan/waves.h"

namespace muonmesh::worker {

using plan::BackwardPeakMuonBufferBytes;
using plan::MuonUnitBytes;
using plan::MuonWave;
using plan::PlanMuonWaves;
using plan::PlannedWaveNsFlops;
using plan::WaveBudget;

}  // namespace muonmesh::worker
