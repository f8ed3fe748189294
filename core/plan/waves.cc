#include "core/plan/waves.h"

#include <algorithm>

namespace muonmesh::plan {
namespace {

// Adds, per unit, the busiest position's bytes on one mesh's domain. Under
// the replica split (domain.replicas > 1) each (replica, position) counts
// apart: whole matrices only for its replica's matrices, and the replica
// exchange's send and receive buffers ((I - 1) x its rows of its replica's
// matrices, and its rows of the others').
void AddDomain(const DomainPlan& domain, bool everyone, std::vector<int64_t>* bytes) {
  const size_t units = bytes->size();
  const int64_t replicas = std::max<int64_t>(domain.replicas, 1);
  const int64_t n = replicas * domain.size;
  // elements[u][i]: 2 x owned + 2 x held (+ the replica exchange) by entry
  // i (replica-major) in unit u.
  std::vector<std::vector<int64_t>> elements(units, std::vector<int64_t>(n, 0));
  for (const MatrixPlan& m : domain.matrices) {
    std::vector<int64_t>& e = elements[m.unit];
    const int64_t whole = m.rows * m.cols;
    if (everyone) {
      for (int64_t& p : e) p += 2 * whole;
    } else if (m.owner >= 0) {
      e[std::max(m.replica, 0) * domain.size + m.owner] += 2 * whole;
    }
    for (const Holder& h : m.holders) {
      for (int64_t o = 0; o < replicas; ++o) {
        const int64_t rows = h.row_count * m.cols;
        e[o * domain.size + h.position] += 2 * rows;
        if (replicas > 1) {
          e[o * domain.size + h.position] += m.replica == o ? (replicas - 1) * rows : rows;
        }
      }
    }
  }
  for (size_t u = 0; u < units; ++u) {
    const auto busiest = std::max_element(elements[u].begin(), elements[u].end());
    if (busiest != elements[u].end()) (*bytes)[u] += *busiest * static_cast<int64_t>(sizeof(float));
  }
}

}  // namespace

std::vector<int64_t> MuonUnitBytes(const Plan& plan) {
  std::vector<int64_t> bytes(plan.units.size(), 0);
  const bool everyone = plan.config.owner_rule == OwnerRule::kAllGather;
  AddDomain(plan.dense, everyone, &bytes);
  if (plan.has_experts) AddDomain(plan.expert, everyone, &bytes);
  return bytes;
}

std::vector<MuonWave> PlanMuonWaves(const Plan& plan, int64_t budget_bytes) {
  std::vector<bool> has_muon(plan.units.size(), false);
  for (const DomainPlan* d : {&plan.dense, &plan.expert}) {
    for (const MatrixPlan& m : d->matrices) has_muon[m.unit] = true;
  }
  const std::vector<int64_t> bytes = MuonUnitBytes(plan);
  std::vector<MuonWave> waves;
  for (int32_t u = 0; u < static_cast<int32_t>(plan.units.size()); ++u) {
    if (!has_muon[u]) continue;
    const bool fits = !waves.empty() &&
                      (budget_bytes <= 0 || waves.back().bytes + bytes[u] <= budget_bytes);
    if (fits) {
      waves.back().end_unit = u + 1;
      waves.back().bytes += bytes[u];
    } else {
      waves.push_back({u, u + 1, bytes[u]});
    }
  }
  return waves;
}

int64_t BackwardPeakMuonBufferBytes(const Plan& plan) {
  int64_t largest = 0;
  for (const UnitPlan& u : plan.units) {
    if (u.has_dense) largest = std::max(largest, u.dense.num_shards * u.dense.shard_elements);
    if (u.has_expert) largest = std::max(largest, u.expert.num_shards * u.expert.shard_elements);
  }
  return largest * static_cast<int64_t>(sizeof(float));
}

std::vector<std::vector<double>> PlannedWaveNsFlops(const Plan& plan,
                                                    const std::vector<MuonWave>& waves) {
  int64_t world = 0;
  for (const Domain& d : plan.domains) {
    for (int32_t r : d.ranks) world = std::max<int64_t>(world, r + 1);
  }
  std::vector<int32_t> wave_of(plan.units.size(), -1);
  for (size_t w = 0; w < waves.size(); ++w) {
    for (int32_t u = waves[w].first_unit; u < waves[w].end_unit; ++u) {
      wave_of[u] = static_cast<int32_t>(w);
    }
  }
  std::vector<std::vector<double>> out(waves.size(), std::vector<double>(world, 0.0));
  const bool everyone = plan.config.owner_rule == OwnerRule::kAllGather;
  // Ranks per dp_outer coordinate: a dense domain's replica is its ranks'.
  const int64_t inner = plan.config.world_size / std::max<int64_t>(plan.config.instances, 1);
  for (const Domain& d : plan.domains) {
    const DomainPlan& owners = d.mesh == MeshKind::kDense ? plan.dense : plan.expert;
    const int32_t replica =
        owners.replicas > 1 && !d.ranks.empty() ? static_cast<int32_t>(d.ranks[0] / inner) : -1;
    for (const MatrixPlan& m : owners.matrices) {
      const int32_t w = wave_of[m.unit];
      if (w < 0) continue;
      if (everyone) {
        for (int32_t r : d.ranks) out[w][r] += m.cost_flops;
      } else if (m.replica != replica) {
        continue;  // another replica orthogonalizes it (the replica split)
      } else if (m.owner >= 0 && m.owner < static_cast<int32_t>(d.ranks.size())) {
        out[w][d.ranks[m.owner]] += m.cost_flops;
      }
    }
  }
  return out;
}

int64_t WaveBudget(int64_t requested, bool overlap) {
  if (requested <= 0) return 0;
  return overlap && requested > 1 ? requested / 2 : requested;
}

int64_t JobWaveBudget(int64_t muon_buffer_bytes, std::string_view device) {
  return WaveBudget(muon_buffer_bytes, device != "cuda");
}

double WaveCriticalPathNsFlops(const Plan& plan, const std::vector<MuonWave>& waves) {
  double path = 0;
  for (const std::vector<double>& ranks : PlannedWaveNsFlops(plan, waves)) {
    if (!ranks.empty()) path += *std::max_element(ranks.begin(), ranks.end());
  }
  return path;
}

}  // namespace muonmesh::plan
