#include "server/plan/owners.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

namespace muonmesh::plan {
namespace {

// Rows of matrix `m` held by `position` (0 if it is not a holder).
int64_t HeldRows(const MatrixPlan& m, int32_t position) {
  auto it = std::lower_bound(m.holders.begin(), m.holders.end(), position,
                             [](const Holder& h, int32_t p) { return h.position < p; });
  return (it != m.holders.end() && it->position == position) ? it->row_count : 0;
}

// State of one assignment: loads per position, an ordered index of loads for
// the least and most loaded positions, and the matrices each position owns.
class Assignment {
 public:
  static constexpr int64_t kScanAllPositions = 64;

  Assignment(DomainPlan* domain, double w, int64_t bpe)
      : d_(*domain), w_(w), bpe_(bpe), load_(d_.size, 0.0), owned_(d_.size) {
    for (int32_t p = 0; p < d_.size; ++p) by_load_.insert({0.0, p});
  }

  int64_t GatherBytes(const MatrixPlan& m, int32_t p) const {
    return 2 * (m.rows - HeldRows(m, p)) * m.cols * bpe_;
  }
  double Cost(const MatrixPlan& m, int32_t p) const {
    return m.cost_flops + w_ * static_cast<double>(GatherBytes(m, p));
  }
  double load(int32_t p) const { return load_[p]; }
  int32_t LeastLoaded() const { return by_load_.begin()->second; }
  // Highest load; the lowest position among equals.
  int32_t MostLoaded() const {
    const double top = by_load_.rbegin()->first;
    return by_load_.lower_bound({top, -1})->second;
  }
  const std::vector<int32_t>& owned(int32_t p) const { return owned_[p]; }

  void Assign(int32_t j, int32_t p) {
    MatrixPlan& m = d_.matrices[j];
    if (m.owner >= 0) Unassign(j);
    m.owner = p;
    SetLoad(p, load_[p] + Cost(m, p));
    owned_[p].push_back(j);
  }

  // Candidate owners of matrix j: its holders and the least loaded position
  // (every position in small domains, where the scan is cheap).
  template <typename Fn>
  void ForEachCandidate(int32_t j, Fn fn) const {
    const MatrixPlan& m = d_.matrices[j];
    if (d_.size <= kScanAllPositions) {
      for (int32_t p = 0; p < d_.size; ++p) fn(p);
      return;
    }
    for (const Holder& h : m.holders) fn(h.position);
    const int32_t least = LeastLoaded();
    if (HeldRows(m, least) == 0) fn(least);
  }

 private:
  void Unassign(int32_t j) {
    MatrixPlan& m = d_.matrices[j];
    const int32_t p = m.owner;
    SetLoad(p, load_[p] - Cost(m, p));
    auto& list = owned_[p];
    list.erase(std::find(list.begin(), list.end(), j));
    m.owner = -1;
  }
  void SetLoad(int32_t p, double value) {
    by_load_.erase({load_[p], p});
    load_[p] = value;
    by_load_.insert({value, p});
  }

  DomainPlan& d_;
  double w_;
  int64_t bpe_;
  std::vector<double> load_;
  std::set<std::pair<double, int32_t>> by_load_;
  std::vector<std::vector<int32_t>> owned_;
};

// Longest processing time first, onto the position that completes earliest.
void Lpt(Assignment& a, const DomainPlan& d) {
  std::vector<int32_t> order(d.matrices.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    return d.matrices[x].min_cost > d.matrices[y].min_cost;
  });
  for (int32_t j : order) {
    int32_t best = -1;
    double best_finish = 0;
    a.ForEachCandidate(j, [&](int32_t p) {
      const double finish = a.load(p) + a.Cost(d.matrices[j], p);
      if (best < 0 || finish < best_finish || (finish == best_finish && p < best)) {
        best = p;
        best_finish = finish;
      }
    });
    a.Assign(j, best);
  }
}

// Moves or swaps matrices off the busiest position while that strictly lowers
// its load below the current makespan. Each accepted step lowers the sorted
// load vector lexicographically, so the loop ends; the cap bounds the time.
void Refine(Assignment& a, const DomainPlan& d) {
  const double kEps = 1e-9;
  const size_t max_steps = 20 * d.matrices.size() + 100;
  for (size_t step = 0; step < max_steps; ++step) {
    const int32_t top = a.MostLoaded();
    const double makespan = a.load(top);
    const double limit = makespan * (1 - kEps);
    bool moved = false;
    // Moves, largest matrices first.
    std::vector<int32_t> mine = a.owned(top);
    std::sort(mine.begin(), mine.end(), [&](int32_t x, int32_t y) {
      if (d.matrices[x].cost_flops != d.matrices[y].cost_flops)
        return d.matrices[x].cost_flops > d.matrices[y].cost_flops;
      return x < y;
    });
    for (int32_t j : mine) {
      int32_t target = -1;
      double target_finish = limit;
      a.ForEachCandidate(j, [&](int32_t p) {
        if (p == top) return;
        const double finish = a.load(p) + a.Cost(d.matrices[j], p);
        if (finish < target_finish) {
          target = p;
          target_finish = finish;
        }
      });
      if (target >= 0) {
        a.Assign(j, target);
        moved = true;
        break;
      }
    }
    if (moved) continue;
    // Swaps with the positions a matrix leaving `top` may go to (its
    // holders; every position in small domains).
    for (int32_t j : mine) {
      std::vector<int32_t> partners;
      a.ForEachCandidate(j, [&](int32_t p) { partners.push_back(p); });
      for (const int32_t b : partners) {
        if (b == top) continue;
        const double j_off = a.load(top) - a.Cost(d.matrices[j], top);
        const double j_on = a.load(b) + a.Cost(d.matrices[j], b);
        for (int32_t i : a.owned(b)) {
          const double new_top = j_off + a.Cost(d.matrices[i], top);
          const double new_b = j_on - a.Cost(d.matrices[i], b);
          if (std::max(new_top, new_b) < limit) {
            a.Assign(j, b);
            a.Assign(i, top);
            moved = true;
            break;
          }
        }
        if (moved) break;
      }
      if (moved) break;
    }
    if (!moved) return;
  }
}

}  // namespace

double NewtonSchulzFlops(int64_t rows, int64_t cols, int64_t ns_steps) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(ns_steps) * (4 * m * m * n + 2 * m * m * m);
}

double MakespanLowerBound(std::vector<double> costs, int64_t ranks) {
  if (costs.empty()) return 0;
  std::sort(costs.begin(), costs.end(), std::greater<>());
  double total = 0;
  for (double c : costs) total += c;
  double bound = std::max(costs[0], total / static_cast<double>(ranks));
  if (static_cast<int64_t>(costs.size()) > ranks) {
    bound = std::max(bound, costs[ranks - 1] + costs[ranks]);
  }
  return bound;
}

void AssignOwners(OwnerRule rule, double w, int64_t bpe, DomainPlan* domain) {
  DomainPlan& d = *domain;
  const int64_t n = static_cast<int64_t>(d.matrices.size());
  d.load.assign(d.size, 0.0);
  d.ns_flops.assign(d.size, 0.0);
  d.gather_bytes.assign(d.size, 0);
  d.owned.assign(d.size, 0);
  d.exchange_bytes = 0;
  d.exchange_lower_bound_bytes = 0;

  std::vector<double> min_costs;
  min_costs.reserve(n);
  for (MatrixPlan& m : d.matrices) {
    int64_t best_rows = 0;
    for (const Holder& h : m.holders) best_rows = std::max(best_rows, h.row_count);
    const int64_t min_bytes = 2 * (m.rows - best_rows) * m.cols * bpe;
    m.min_cost = m.cost_flops + w * static_cast<double>(min_bytes);
    m.owner = -1;
    min_costs.push_back(m.min_cost);
    d.exchange_lower_bound_bytes += min_bytes;
  }
  d.lower_bound = MakespanLowerBound(min_costs, d.size);

  if (rule == OwnerRule::kAllGather) {
    // Everyone gathers every matrix (no scatter: each keeps its own rows).
    for (MatrixPlan& m : d.matrices) {
      m.gather_bytes = 0;
      for (int32_t p = 0; p < d.size; ++p) {
        const int64_t bytes = (m.rows - HeldRows(m, p)) * m.cols * bpe;
        d.load[p] += m.cost_flops + w * static_cast<double>(bytes);
        d.ns_flops[p] += m.cost_flops;
        d.gather_bytes[p] += bytes;
        m.gather_bytes += bytes;
      }
      m.owner_cost = m.cost_flops;
      d.exchange_bytes += m.gather_bytes;
    }
    for (int32_t p = 0; p < d.size; ++p) d.owned[p] = static_cast<int32_t>(n);
  } else {
    Assignment a(&d, w, bpe);
    switch (rule) {
      case OwnerRule::kLpt:
        Lpt(a, d);
        Refine(a, d);
        break;
      case OwnerRule::kRoundRobin:
        for (int64_t j = 0; j < n; ++j) a.Assign(static_cast<int32_t>(j), j % d.size);
        break;
      case OwnerRule::kGreedyInOrder:
        for (int64_t j = 0; j < n; ++j) {
          int32_t best = -1;
          for (const Holder& h : d.matrices[j].holders) {
            if (best < 0 || a.load(h.position) < a.load(best)) best = h.position;
          }
          a.Assign(static_cast<int32_t>(j), best);
        }
        break;
      case OwnerRule::kAllGather:
        break;
    }
    for (MatrixPlan& m : d.matrices) {
      m.gather_bytes = a.GatherBytes(m, m.owner);
      m.owner_cost = a.Cost(m, m.owner);
      d.load[m.owner] += m.owner_cost;
      d.ns_flops[m.owner] += m.cost_flops;
      d.gather_bytes[m.owner] += m.gather_bytes;
      d.owned[m.owner] += 1;
      d.exchange_bytes += m.gather_bytes;
    }
  }
  d.makespan = d.load.empty() ? 0 : *std::max_element(d.load.begin(), d.load.end());
}

}  // namespace muonmesh::plan
