#include "plan/owners.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <unordered_map>
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
  // The lowest load of a position other than `p` (+inf in a domain of one).
  double LeastLoadExcept(int32_t p) const {
    for (auto it = by_load_.begin(); it != by_load_.end(); ++it) {
      if (it->second != p) return it->first;
    }
    return std::numeric_limits<double>::infinity();
  }
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

// Counts refinement work against its budget (see RefineWorkBudget) and
// passes it on to the cancel token.
class WorkMeter {
 public:
  WorkMeter(int64_t budget, CancelToken* cancel) : budget_(budget), cancel_(cancel) {}

  // Spends `n` units; false, spending nothing, when that would exceed the
  // budget or the plan is cancelled: the search must stop.
  bool Spend(int64_t n) {
    if (stopped()) return false;
    if (spent_ + n > budget_) {
      exhausted_ = true;
      return false;
    }
    spent_ += n;
    return !(cancel_ != nullptr && cancel_->Tick(n));
  }
  bool stopped() const { return exhausted_ || cancelled(); }
  bool exhausted() const { return exhausted_; }
  bool cancelled() const { return cancel_ != nullptr && cancel_->cancelled(); }
  int64_t spent() const { return spent_; }

 private:
  int64_t budget_;
  CancelToken* cancel_;
  int64_t spent_ = 0;
  bool exhausted_ = false;
};

// Longest processing time first, onto the position that completes earliest.
// False when cancelled.
bool Lpt(Assignment& a, const DomainPlan& d, CancelToken* cancel) {
  std::vector<int32_t> order(d.matrices.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    return d.matrices[x].min_cost > d.matrices[y].min_cost;
  });
  for (int32_t j : order) {
    int32_t best = -1;
    double best_finish = 0;
    int64_t candidates = 0;
    a.ForEachCandidate(j, [&](int32_t p) {
      ++candidates;
      const double finish = a.load(p) + a.Cost(d.matrices[j], p);
      if (best < 0 || finish < best_finish || (finish == best_finish && p < best)) {
        best = p;
        best_finish = finish;
      }
    });
    a.Assign(j, best);
    if (cancel != nullptr && cancel->Tick(candidates)) return false;
  }
  return true;
}

// The matrices of position `top`, largest first (ties: lower index).
std::vector<int32_t> LargestFirst(const Assignment& a, const DomainPlan& d, int32_t top) {
  std::vector<int32_t> mine = a.owned(top);
  std::sort(mine.begin(), mine.end(), [&](int32_t x, int32_t y) {
    if (d.matrices[x].cost_flops != d.matrices[y].cost_flops)
      return d.matrices[x].cost_flops > d.matrices[y].cost_flops;
    return x < y;
  });
  return mine;
}

// Moves the first matrix of `mine` (largest first) that some other position
// finishes below `limit` to the position that finishes it earliest. True
// when one moved.
bool TryMove(Assignment& a, const DomainPlan& d, int32_t top, double limit,
             const std::vector<int32_t>& mine, WorkMeter& meter) {
  // No position finishes j before the least loaded one does at j's lowest
  // cost (rounding is monotonic), so most matrices are ruled out without
  // evaluating a single candidate.
  const double least = a.LeastLoadExcept(top);
  for (int32_t j : mine) {
    if (least + d.matrices[j].min_cost >= limit) continue;
    int32_t target = -1;
    double target_finish = limit;
    a.ForEachCandidate(j, [&](int32_t p) {
      if (p == top || !meter.Spend(1)) return;
      const double finish = a.load(p) + a.Cost(d.matrices[j], p);
      if (finish < target_finish) {
        target = p;
        target_finish = finish;
      }
    });
    if (meter.stopped()) return false;
    if (target >= 0) {
      a.Assign(j, target);
      return true;
    }
  }
  return false;
}

// The matrices of one swap partner b of the busiest position t, to tell in
// O(log k) whether any of them could take the place of a matrix leaving t:
// their costs on t ascending, with the running maximum of their costs on b.
// A swap of j (on t) with i (on b) needs Cost(i, t) below what t can take
// and Cost(i, b) above what b must shed.
class SwapIndex {
 public:
  SwapIndex(const Assignment& a, const DomainPlan& d, int32_t top, int32_t b) {
    std::vector<std::pair<double, double>> costs;
    costs.reserve(a.owned(b).size());
    for (int32_t i : a.owned(b)) {
      costs.push_back({a.Cost(d.matrices[i], top), a.Cost(d.matrices[i], b)});
    }
    std::sort(costs.begin(), costs.end());
    double best = -std::numeric_limits<double>::infinity();
    for (const auto& [on_top, on_b] : costs) {
      on_top_.push_back(on_top);
      best = std::max(best, on_b);
      best_on_b_.push_back(best);
    }
  }

  // False only when no matrix i of b has Cost(i, t) < max_on_top and
  // Cost(i, b) > min_on_b. The bounds come from differences of loads of
  // magnitude `scale`; a margin far above their rounding error lets every
  // doubtful case through to the caller's exact test.
  bool MayHave(double max_on_top, double min_on_b, double scale) const {
    const double margin = 1e-12 * scale;
    const size_t below = static_cast<size_t>(
        std::lower_bound(on_top_.begin(), on_top_.end(), max_on_top + margin) - on_top_.begin());
    return below > 0 && best_on_b_[below - 1] > min_on_b - margin;
  }

 private:
  std::vector<double> on_top_;
  std::vector<double> best_on_b_;
};

// Swaps a matrix of `mine` with one of a position it may go to (its
// candidates) when both loads end below `limit`; the first such pair in
// scan order (matrices of `mine`, then candidates, then the partner's
// matrices in the order it got them). A SwapIndex per partner skips the
// partners where no pair can work, which is nearly all of them. True when
// one swapped.
bool TrySwap(Assignment& a, const DomainPlan& d, int32_t top, double limit,
             const std::vector<int32_t>& mine, WorkMeter& meter) {
  std::unordered_map<int32_t, SwapIndex> index;  // partners seen this step
  for (int32_t j : mine) {
    std::vector<int32_t> partners;
    a.ForEachCandidate(j, [&](int32_t p) { partners.push_back(p); });
    for (const int32_t b : partners) {
      if (b == top) continue;
      auto it = index.find(b);
      if (it == index.end()) {
        if (!meter.Spend(static_cast<int64_t>(a.owned(b).size()) + 1)) return false;
        it = index.try_emplace(b, a, d, top, b).first;
      }
      if (!meter.Spend(1)) return false;
      const double j_off = a.load(top) - a.Cost(d.matrices[j], top);
      const double j_on = a.load(b) + a.Cost(d.matrices[j], b);
      const double scale = std::abs(limit) + std::abs(j_off) + std::abs(j_on);
      if (!it->second.MayHave(limit - j_off, j_on - limit, scale)) continue;
      for (int32_t i : a.owned(b)) {
        if (!meter.Spend(1)) return false;
        const double new_top = j_off + a.Cost(d.matrices[i], top);
        const double new_b = j_on - a.Cost(d.matrices[i], b);
        if (std::max(new_top, new_b) < limit) {
          // Returns at once: Assign changes the list being iterated.
          a.Assign(j, b);
          a.Assign(i, top);
          return true;
        }
      }
    }
  }
  return false;
}

// Moves or swaps matrices off the busiest position while that strictly lowers
// its load below the current makespan. Each accepted step lowers the sorted
// load vector lexicographically, so the loop ends; the step cap and the work
// budget bound the time.
void Refine(Assignment& a, const DomainPlan& d, WorkMeter& meter) {
  const double kEps = 1e-9;
  const size_t max_steps = 20 * d.matrices.size() + 100;
  for (size_t step = 0; step < max_steps; ++step) {
    const int32_t top = a.MostLoaded();
    const double limit = a.load(top) * (1 - kEps);
    if (!meter.Spend(static_cast<int64_t>(a.owned(top).size()))) return;
    const std::vector<int32_t> mine = LargestFirst(a, d, top);
    if (TryMove(a, d, top, limit, mine, meter)) continue;
    if (meter.stopped()) return;
    if (!TrySwap(a, d, top, limit, mine, meter)) return;
  }
}

// Each matrix's cost at its best holder, the domain's makespan lower bound
// and the exchange with every owner at its best holder.
void SetLowerBounds(double w, int64_t bpe, DomainPlan& d) {
  std::vector<double> min_costs;
  min_costs.reserve(d.matrices.size());
  d.exchange_lower_bound_bytes = 0;
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
}

// Everyone gathers every matrix (no scatter: each keeps its own rows), in
// O(matrices x holders + positions) rather than matrices x positions: a
// position receives all rows of all matrices less the rows it holds.
void AllGather(double w, int64_t bpe, DomainPlan& d) {
  double ns_flops = 0;
  int64_t all_rows_bytes = 0;
  for (MatrixPlan& m : d.matrices) {
    const int64_t row_bytes = m.cols * bpe;
    for (const Holder& h : m.holders) d.gather_bytes[h.position] -= h.row_count * row_bytes;
    all_rows_bytes += m.rows * row_bytes;
    // Holders tile the rows: together they hold each row once.
    m.gather_bytes = (d.size - 1) * m.rows * row_bytes;
    m.owner_cost = m.cost_flops;
    d.exchange_bytes += m.gather_bytes;
    ns_flops += m.cost_flops;
  }
  for (int32_t p = 0; p < d.size; ++p) {
    d.gather_bytes[p] += all_rows_bytes;
    d.ns_flops[p] = ns_flops;
    d.load[p] = ns_flops + w * static_cast<double>(d.gather_bytes[p]);
    d.owned[p] = static_cast<int32_t>(d.matrices.size());
  }
}

// Runs an owner rule other than allgather. False when cancelled.
bool AssignByRule(OwnerRule rule, Assignment& a, DomainPlan& d, CancelToken* cancel) {
  const int64_t n = static_cast<int64_t>(d.matrices.size());
  switch (rule) {
    case OwnerRule::kLpt: {
      if (!Lpt(a, d, cancel)) return false;
      WorkMeter meter(RefineWorkBudget(n), cancel);
      Refine(a, d, meter);
      d.refine_work = meter.spent();
      d.refine_budget_spent = meter.exhausted();
      return !meter.cancelled();
    }
    case OwnerRule::kRoundRobin:
      for (int64_t j = 0; j < n; ++j) a.Assign(static_cast<int32_t>(j), j % d.size);
      return true;
    case OwnerRule::kGreedyInOrder:
      for (int64_t j = 0; j < n; ++j) {
        int32_t best = -1;
        for (const Holder& h : d.matrices[j].holders) {
          if (best < 0 || a.load(h.position) < a.load(best)) best = h.position;
        }
        a.Assign(static_cast<int32_t>(j), best);
      }
      return true;
    case OwnerRule::kAllGather:
      break;
  }
  return true;
}

}  // namespace

double NewtonSchulzFlops(int64_t rows, int64_t cols, int64_t ns_steps) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(ns_steps) * (4 * m * m * n + 2 * m * m * m);
}

int64_t RefineWorkBudget(int64_t matrices) {
  if (matrices <= kRefineFullMatrices) return kRefineWorkMax;
  return std::max(kRefineWorkMin, kRefineWorkMax / matrices * kRefineFullMatrices);
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

absl::Status AssignOwners(OwnerRule rule, double w, int64_t bpe, DomainPlan* domain,
                          CancelToken* cancel) {
  DomainPlan& d = *domain;
  d.load.assign(d.size, 0.0);
  d.ns_flops.assign(d.size, 0.0);
  d.gather_bytes.assign(d.size, 0);
  d.owned.assign(d.size, 0);
  d.exchange_bytes = 0;
  d.refine_work = 0;
  d.refine_budget_spent = false;
  SetLowerBounds(w, bpe, d);
  if (rule == OwnerRule::kAllGather) {
    AllGather(w, bpe, d);
  } else {
    Assignment a(&d, w, bpe);
    if (!AssignByRule(rule, a, d, cancel)) return CancelToken::Status();
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
  return absl::OkStatus();
}

}  // namespace muonmesh::plan
