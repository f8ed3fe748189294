#include "core/plan/owners.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <set>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/owner_costs.h"

namespace muonmesh::plan {
namespace {

using internal::CostAt;
using internal::CostAway;
using internal::GatherBytesAt;
using internal::HeldRows;

// State of one joint assignment over classes of domains (see
// AssignOwnersJointly): each rank's joint load, an ordered index of them for
// the busiest rank, and per class, each position's finish (the joint load of
// its busiest rank, what a matrix placed there adds to), an ordered index of
// finishes for the least loaded position, and the matrices each position
// owns. With one class of one rank a position, a position's finish is its
// load, and this is the plain single-domain assignment.
class JointAssignment {
 public:
  static constexpr int64_t kScanAllPositions = 64;

  // `base` (null: none): per rank, load outside the classes that it
  // carries whatever the assignment (AssignOwnersJointly).
  JointAssignment(const std::vector<DomainClass>& classes, int64_t world, double w, int64_t bpe,
                  const std::vector<double>* base = nullptr)
      : classes_(classes), w_(w), bpe_(bpe), load_(world, 0.0) {
    if (base != nullptr) load_ = *base;
    const size_t n = classes_.size();
    position_.assign(n, std::vector<int32_t>(world, -1));
    finish_.resize(n);
    by_finish_.resize(n);
    owned_.resize(n);
    mark_.resize(n);
    for (size_t c = 0; c < n; ++c) {
      const int64_t size = classes_[c].plan->size;
      finish_[c].assign(size, 0.0);
      owned_[c].resize(size);
      mark_[c].assign(size, -1);
      for (int32_t p = 0; p < size; ++p) {
        for (int32_t r : classes_[c].ranks[p]) {
          position_[c][r] = p;
          finish_[c][p] = std::max(finish_[c][p], load_[r]);
        }
        by_finish_[c].insert({finish_[c][p], p});
      }
    }
    for (int32_t r = 0; r < world; ++r) by_load_.insert({load_[r], r});
  }

  int num_classes() const { return static_cast<int>(classes_.size()); }
  // Domains of class c (ranks at each of its positions).
  int64_t copies(int c) const {
    return classes_[c].ranks.empty() ? 0 : static_cast<int64_t>(classes_[c].ranks[0].size());
  }
  DomainPlan& plan(int c) const { return *classes_[c].plan; }
  int64_t size(int c) const { return classes_[c].plan->size; }
  double Cost(const MatrixPlan& m, int32_t p) const { return CostAt(m, p, w_, bpe_); }
  // The holder where m costs least (its matrix's min_cost), the first
  // among equals; -1 when m has no holder.
  int32_t BestHolder(const MatrixPlan& m) const {
    int32_t best = -1;
    for (const Holder& h : m.holders) {
      if (best < 0 || Cost(m, h.position) < Cost(m, best)) best = h.position;
    }
    return best;
  }
  double finish(int c, int32_t p) const { return finish_[c][p]; }
  double rank_load(int32_t r) const { return load_[r]; }
  int32_t PositionOf(int c, int32_t r) const { return position_[c][r]; }
  // The rank at position p of class c in its first domain.
  int32_t RankAt(int c, int32_t p) const { return classes_[c].ranks[p][0]; }
  int32_t LeastLoaded(int c) const { return by_finish_[c].begin()->second; }
  // The lowest finish of a position of class c other than `p` (+inf in a
  // domain of one).
  double LeastLoadExcept(int c, int32_t p) const {
    for (auto it = by_finish_[c].begin(); it != by_finish_[c].end(); ++it) {
      if (it->second != p) return it->first;
    }
    return std::numeric_limits<double>::infinity();
  }
  // The rank with the highest joint load; the lowest rank among equals.
  int32_t MostLoadedRank() const {
    const double top = by_load_.rbegin()->first;
    return by_load_.lower_bound({top, -1})->second;
  }
  const std::vector<int32_t>& owned(int c, int32_t p) const { return owned_[c][p]; }

  // How far adding `cost` to position p of class c would raise the finishes
  // of the other classes' positions its ranks sit at (summed; 0 when each
  // such rank stays under its busiest peer there).
  double RaiseElsewhere(int c, int32_t p, double cost) const {
    double raise = 0;
    for (int32_t r : classes_[c].ranks[p]) {
      for (int c2 = 0; c2 < num_classes(); ++c2) {
        if (c2 != c) raise += std::max(0.0, load_[r] + cost - finish_[c2][position_[c2][r]]);
      }
    }
    return raise;
  }

  // How much room taking `cost` off position p of class c would free in the
  // other classes whose positions are run by several ranks (groups): for
  // each of p's ranks that is the busiest of its group, how far the group's
  // finish drops, times the group's ranks (each of them may then take that
  // much more of the group's work). 0 when none of p's ranks tops a group.
  // Expects one rank a position in class c.
  double FreedInGroups(int c, int32_t p, double cost) const {
    double freed = 0;
    for (int32_t r : classes_[c].ranks[p]) {
      for (int c2 = 0; c2 < num_classes(); ++c2) {
        if (c2 == c || copies(c2) < 2) continue;
        const int32_t q = position_[c2][r];
        if (load_[r] < finish_[c2][q]) continue;
        double next = load_[r] - cost;
        for (int32_t s : classes_[c2].ranks[q]) {
          if (s != r) next = std::max(next, load_[s]);
        }
        freed += (finish_[c2][q] - next) * static_cast<double>(copies(c2));
      }
    }
    return freed;
  }

  void Assign(int c, int32_t j, int32_t p) {
    MatrixPlan& m = plan(c).matrices[j];
    if (m.owner >= 0) Unassign(c, j);
    m.owner = p;
    Shift(c, p, Cost(m, p));
    owned_[c][p].push_back(j);
  }

  // Candidate owners of matrix j of class c: its holders and the least
  // loaded position (every position in small domains, where the scan is
  // cheap).
  template <typename Fn>
  void ForEachCandidate(int c, int32_t j, Fn fn) const {
    const MatrixPlan& m = plan(c).matrices[j];
    if (size(c) <= kScanAllPositions) {
      for (int32_t p = 0; p < size(c); ++p) fn(p);
      return;
    }
    for (const Holder& h : m.holders) fn(h.position);
    const int32_t least = LeastLoaded(c);
    if (HeldRows(m, least) == 0) fn(least);
  }

 private:
  void Unassign(int c, int32_t j) {
    MatrixPlan& m = plan(c).matrices[j];
    const int32_t p = m.owner;
    Shift(c, p, -Cost(m, p));
    auto& list = owned_[c][p];
    list.erase(std::find(list.begin(), list.end(), j));
    m.owner = -1;
  }

  // Adds `delta` to every rank of position p of class c, then recomputes the
  // finish of every position (of every class) that holds one of them.
  void Shift(int c, int32_t p, double delta) {
    const std::vector<int32_t>& ranks = classes_[c].ranks[p];
    for (int32_t r : ranks) {
      by_load_.erase({load_[r], r});
      load_[r] += delta;
      by_load_.insert({load_[r], r});
    }
    ++stamp_;
    for (int c2 = 0; c2 < num_classes(); ++c2) {
      for (int32_t r : ranks) {
        const int32_t q = position_[c2][r];
        if (mark_[c2][q] == stamp_) continue;
        mark_[c2][q] = stamp_;
        double top = -std::numeric_limits<double>::infinity();
        for (int32_t s : classes_[c2].ranks[q]) top = std::max(top, load_[s]);
        by_finish_[c2].erase({finish_[c2][q], q});
        finish_[c2][q] = top;
        by_finish_[c2].insert({top, q});
      }
    }
  }

  const std::vector<DomainClass>& classes_;
  double w_;
  int64_t bpe_;
  std::vector<double> load_;  // per rank
  std::set<std::pair<double, int32_t>> by_load_;
  std::vector<std::vector<int32_t>> position_;  // [class][rank]
  std::vector<std::vector<double>> finish_;     // [class][position]
  std::vector<std::set<std::pair<double, int32_t>>> by_finish_;
  std::vector<std::vector<std::vector<int32_t>>> owned_;  // [class][position]
  std::vector<std::vector<int64_t>> mark_;  // [class][position]: last Shift that saw it
  int64_t stamp_ = 0;
};

// One class of a JointAssignment seen as a single domain whose position
// loads are their finishes: what the move and swap searches work on.
class ClassView {
 public:
  ClassView(JointAssignment& a, int c) : a_(a), c_(c) {}

  const DomainPlan& plan() const { return a_.plan(c_); }
  double Cost(const MatrixPlan& m, int32_t p) const { return a_.Cost(m, p); }
  double load(int32_t p) const { return a_.finish(c_, p); }
  double LeastLoadExcept(int32_t p) const { return a_.LeastLoadExcept(c_, p); }
  const std::vector<int32_t>& owned(int32_t p) const { return a_.owned(c_, p); }
  void Assign(int32_t j, int32_t p) { a_.Assign(c_, j, p); }
  template <typename Fn>
  void ForEachCandidate(int32_t j, Fn fn) const {
    a_.ForEachCandidate(c_, j, fn);
  }

 private:
  JointAssignment& a_;
  int c_;
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

// One matrix of one class, by its cost at its best holder.
struct Item {
  int c;
  int32_t j;
  double cost;
};

// Every matrix of every class, longest first (stable: ties keep class, then
// matrix order).
std::vector<Item> LongestFirst(const JointAssignment& a) {
  std::vector<Item> order;
  for (int c = 0; c < a.num_classes(); ++c) {
    const std::vector<MatrixPlan>& ms = a.plan(c).matrices;
    for (size_t j = 0; j < ms.size(); ++j) {
      order.push_back({c, static_cast<int32_t>(j), ms[j].min_cost});
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return order;
}

enum class Placed { kAll, kOverCap, kCancelled };

// Places the matrices of `order` on empty positions. With cap = +inf, each
// onto the position of its class whose busiest rank completes it earliest
// (longest processing time first). With a finite cap, each onto the
// cheapest position whose busiest rank completes it within the cap (ties:
// earliest, or with `best_fit` the latest, then lowest position), so that
// matrices stay with their holders while the cap allows; kOverCap, at once,
// when one fits nowhere.
// Ties break by lower position; `work` counts the candidates evaluated.
enum class Fit { kEarliest, kBest, kGrouped };

Placed Place(JointAssignment& a, const std::vector<Item>& order, double cap, Fit fit,
             CancelToken* cancel, int64_t* work) {
  const bool lpt = std::isinf(cap);
  const bool best_fit = fit == Fit::kBest;
  for (const Item& item : order) {
    ClassView v(a, item.c);
    const MatrixPlan& m = v.plan().matrices[item.j];
    int32_t best = -1;
    double best_finish = 0;
    double best_cost = 0;
    bool best_raises = false;
    int64_t candidates = 0;
    v.ForEachCandidate(item.j, [&](int32_t p) {
      ++candidates;
      const double cost = v.Cost(m, p);
      const double finish = v.load(p) + cost;
      if (!lpt && finish > cap) return;
      // Grouped: first the positions that leave the other classes'
      // finishes where they are.
      const bool raises = fit == Fit::kGrouped && a.RaiseElsewhere(item.c, p, cost) > 0;
      if (best >= 0 && raises != best_raises) {
        if (raises) return;
        best = -1;
      }
      const bool fits_better = best_fit ? finish > best_finish : finish < best_finish;
      const bool better =
          best < 0 || (lpt ? finish < best_finish
                           : (cost < best_cost || (cost == best_cost && fits_better))) ||
          (finish == best_finish && (lpt || cost == best_cost) && p < best);
      if (better) {
        best = p;
        best_finish = finish;
        best_cost = cost;
        best_raises = raises;
      }
    });
    // The candidates, and the ranks whose loads and finishes Assign moves.
    *work += candidates + a.copies(item.c) * a.num_classes();
    if (best < 0) return Placed::kOverCap;
    v.Assign(item.j, best);
    if (cancel != nullptr && cancel->Tick(candidates)) return Placed::kCancelled;
  }
  return Placed::kAll;
}

// The matrices of position `top`, largest first (ties: lower index).
std::vector<int32_t> LargestFirst(const ClassView& a, int32_t top) {
  const DomainPlan& d = a.plan();
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
bool TryMove(ClassView& a, int32_t top, double limit, const std::vector<int32_t>& mine,
             WorkMeter& meter) {
  const DomainPlan& d = a.plan();
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
  SwapIndex(const ClassView& a, int32_t top, int32_t b) {
    const DomainPlan& d = a.plan();
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
bool TrySwap(ClassView& a, int32_t top, double limit, const std::vector<int32_t>& mine,
             WorkMeter& meter) {
  const DomainPlan& d = a.plan();
  std::unordered_map<int32_t, SwapIndex> index;  // partners seen this step
  for (int32_t j : mine) {
    std::vector<int32_t> partners;
    a.ForEachCandidate(j, [&](int32_t p) { partners.push_back(p); });
    for (const int32_t b : partners) {
      if (b == top) continue;
      auto it = index.find(b);
      if (it == index.end()) {
        if (!meter.Spend(static_cast<int64_t>(a.owned(b).size()) + 1)) return false;
        it = index.try_emplace(b, a, top, b).first;
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

// Moves or swaps matrices off the positions of the busiest rank (in any
// class) while that strictly lowers its joint load below the current
// makespan: a move or swap in class c shifts every rank of the positions it
// touches by the same amount, so a position's finish (its busiest rank) is
// its load as the single-domain search sees it. Each accepted step lowers
// the sorted vector of rank loads lexicographically (the busiest rank drops,
// every rank it raises stays below the old maximum), so the loop ends; the
// step cap and the work budget bound the time.
void Refine(JointAssignment& a, size_t matrices, WorkMeter& meter) {
  const double kEps = 1e-9;
  const size_t max_steps = 20 * matrices + 100;
  const int classes = a.num_classes();
  std::vector<ClassView> views;
  for (int c = 0; c < classes; ++c) views.emplace_back(a, c);
  for (size_t step = 0; step < max_steps; ++step) {
    const int32_t rank = a.MostLoadedRank();
    const double limit = a.rank_load(rank) * (1 - kEps);
    std::vector<int32_t> top(classes);
    std::vector<std::vector<int32_t>> mine(classes);
    for (int c = 0; c < classes; ++c) {
      top[c] = a.PositionOf(c, rank);
      if (!meter.Spend(static_cast<int64_t>(a.owned(c, top[c]).size()))) return;
      mine[c] = LargestFirst(views[c], top[c]);
    }
    bool improved = false;
    for (int c = 0; c < classes && !improved; ++c) {
      improved = TryMove(views[c], top[c], limit, mine[c], meter);
      if (meter.stopped()) return;
    }
    for (int c = 0; c < classes && !improved; ++c) {
      improved = TrySwap(views[c], top[c], limit, mine[c], meter);
      if (meter.stopped()) return;
    }
    if (!improved) return;
  }
}

// Levels the groups of the classes whose positions are run by several
// ranks (expert positions, one rank per EP group): a group's finish is its
// busiest rank's, so a rank that tops its group because of its share of a
// one-rank-a-position class (dense) holds the whole group back. Moves such a
// matrix to a position where it raises no group's finish (each of that
// position's ranks stays at or below its group's busiest), when the room it
// frees (FreedInGroups) exceeds what it costs more there; candidates as the
// refinement's. The makespan never rises; the room lets a refinement after it
// move the groups' own work where it was stuck. True when one moved.
bool Level(JointAssignment& a, WorkMeter& meter) {
  const double kEps = 1e-9;
  bool moved = false;
  for (int c = 0; c < a.num_classes(); ++c) {
    if (a.copies(c) != 1) continue;
    bool grouped = false;
    for (int c2 = 0; c2 < a.num_classes(); ++c2) grouped |= c2 != c && a.copies(c2) > 1;
    if (!grouped) continue;
    ClassView v(a, c);
    const DomainPlan& d = v.plan();
    for (int32_t p = 0; p < a.size(c); ++p) {
      if (!meter.Spend(static_cast<int64_t>(a.owned(c, p).size()) + 1)) return moved;
      for (int32_t j : LargestFirst(v, p)) {
        const MatrixPlan& m = d.matrices[j];
        const double here = v.Cost(m, p);
        const double freed = a.FreedInGroups(c, p, here);
        if (freed <= kEps * here) continue;
        int32_t best = -1;
        double best_extra = freed;
        int64_t candidates = 0;
        v.ForEachCandidate(j, [&](int32_t q) {
          ++candidates;
          if (q == p) return;
          const double cost = v.Cost(m, q);
          const double extra = cost - here;
          if (extra >= best_extra) return;
          if (a.RaiseElsewhere(c, q, cost) > kEps * cost) return;
          best = q;
          best_extra = extra;
        });
        if (!meter.Spend(candidates)) return moved;
        if (best >= 0) {
          v.Assign(j, best);
          moved = true;
          break;  // p's matrices changed; its next ones wait for the next pass
        }
      }
    }
  }
  return moved;
}

// A start that packs the one-rank-a-position classes (dense) into as few
// groups of the grouped classes (expert positions) as it can, each rank up
// to `level`: a group's ranks all carry the group's work, so dense work
// spread thinly over many groups costs every one of them its busiest rank's
// dense load, while dense work packed level in a few leaves the others free.
// Groups are filled in order of the dense work whose best holders they hold
// (largest first), matrices largest first, each to the cheapest rank of the
// first group where it fits (ties: the fullest rank, then the lowest); one
// that fits nowhere goes where it finishes earliest. The other classes are
// then placed longest first onto the positions that finish them earliest.
// False when there is no such pair of classes or `cancel` says stop.
bool GroupPackedStart(JointAssignment& a, double level, double cap, CancelToken* cancel,
                      int64_t* work) {
  int dense = -1, grouped = -1;
  for (int c = 0; c < a.num_classes(); ++c) {
    if (a.copies(c) == 1 && dense < 0) dense = c;
    if (a.copies(c) > 1 && grouped < 0) grouped = c;
  }
  if (dense < 0 || grouped < 0) return false;
  const DomainPlan& d = a.plan(dense);
  // Group of each position of the dense class (its one rank's position in
  // the grouped class), and the order to fill the groups in.
  std::vector<int32_t> group_of(a.size(dense));
  for (int32_t p = 0; p < a.size(dense); ++p) {
    group_of[p] = a.PositionOf(grouped, a.RankAt(dense, p));
  }
  std::vector<double> held(a.size(grouped), 0.0);
  for (const MatrixPlan& m : d.matrices) {
    if (const int32_t best = a.BestHolder(m); best >= 0) held[group_of[best]] += m.min_cost;
  }
  std::vector<int32_t> rank_of_group(a.size(grouped));
  {
    std::vector<int32_t> order(a.size(grouped));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t x, int32_t y) { return held[x] > held[y]; });
    for (size_t i = 0; i < order.size(); ++i) rank_of_group[order[i]] = static_cast<int32_t>(i);
  }
  std::vector<int32_t> items(d.matrices.size());
  std::iota(items.begin(), items.end(), 0);
  std::stable_sort(items.begin(), items.end(), [&](int32_t x, int32_t y) {
    return d.matrices[x].min_cost > d.matrices[y].min_cost;
  });
  for (int32_t j : items) {
    const MatrixPlan& m = d.matrices[j];
    int32_t best = -1;
    double best_cost = 0, best_load = 0;
    int32_t fallback = -1;
    double fallback_finish = 0;
    for (int32_t p = 0; p < a.size(dense); ++p) {
      const double cost = a.Cost(m, p);
      const double load = a.finish(dense, p);
      if (fallback < 0 || load + cost < fallback_finish) {
        fallback = p;
        fallback_finish = load + cost;
      }
      if (load + cost > level) continue;
      const bool better =
          best < 0 || rank_of_group[group_of[p]] < rank_of_group[group_of[best]] ||
          (group_of[p] == group_of[best] &&
           (cost < best_cost || (cost == best_cost && load > best_load)));
      if (better) {
        best = p;
        best_cost = cost;
        best_load = load;
      }
    }
    a.Assign(dense, j, best >= 0 ? best : fallback);
    *work += a.size(dense);
    if (cancel != nullptr && cancel->Tick(a.size(dense))) return false;
  }
  std::vector<Item> rest;
  for (const Item& item : LongestFirst(a)) {
    if (item.c != dense) rest.push_back(item);
  }
  return Place(a, rest, cap, Fit::kEarliest, cancel, work) == Placed::kAll;
}

// A start for matrices that are dear to move: every matrix of the grouped
// classes (expert) on its best holder, then the one-rank-a-position classes
// (dense), longest first, each onto the position whose rank finishes it
// earliest, so that the dense work fills what each group's own work leaves.
// False when there is no grouped class or `cancel` says stop.
bool HoldersFirstStart(JointAssignment& a, CancelToken* cancel) {
  bool grouped = false;
  for (int c = 0; c < a.num_classes(); ++c) {
    if (a.copies(c) < 2) continue;
    grouped = true;
    const DomainPlan& d = a.plan(c);
    for (size_t j = 0; j < d.matrices.size(); ++j) {
      const MatrixPlan& m = d.matrices[j];
      const int32_t best = a.BestHolder(m);
      a.Assign(c, static_cast<int32_t>(j), best >= 0 ? best : a.LeastLoaded(c));
    }
    if (cancel != nullptr && cancel->Tick(static_cast<int64_t>(d.matrices.size()))) return false;
  }
  if (!grouped) return false;
  std::vector<Item> rest;
  for (const Item& item : LongestFirst(a)) {
    if (a.copies(item.c) < 2) rest.push_back(item);
  }
  int64_t work = 0;
  return Place(a, rest, std::numeric_limits<double>::infinity(), Fit::kEarliest, cancel, &work) ==
         Placed::kAll;
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

// round_robin or greedy_in_order on one class on its own (its own loads,
// one rank a position, as Megatron-LM #6425 balances a domain).
void AssignOneClassByRule(OwnerRule rule, double w, int64_t bpe, DomainPlan& d) {
  std::vector<DomainClass> alone(1);
  alone[0].plan = &d;
  alone[0].ranks.resize(d.size);
  for (int32_t p = 0; p < d.size; ++p) alone[0].ranks[p] = {p};
  JointAssignment a(alone, d.size, w, bpe);
  const int64_t n = static_cast<int64_t>(d.matrices.size());
  for (int64_t j = 0; j < n; ++j) {
    int32_t best = static_cast<int32_t>(j % d.size);  // round_robin
    if (rule == OwnerRule::kGreedyInOrder) {
      best = -1;
      for (const Holder& h : d.matrices[j].holders) {
        if (best < 0 || a.finish(0, h.position) < a.finish(0, best)) best = h.position;
      }
    }
    a.Assign(0, static_cast<int32_t>(j), best);
  }
}

// Joint lpt with its refinement; sets every class's refinement work. False
// when cancelled.
// Candidate evaluations the capped placements of one assignment may spend
// (and, apart, its group-packed starts).
constexpr int64_t kPackWork = int64_t{1} << 23;

// The owners of every class's matrices, to keep the best of several tries.
using Owners = std::vector<std::vector<int32_t>>;

Owners SaveOwners(const std::vector<DomainClass>& classes) {
  Owners out;
  for (const DomainClass& c : classes) {
    out.emplace_back();
    for (const MatrixPlan& m : c.plan->matrices) out.back().push_back(m.owner);
  }
  return out;
}

void ClearOwners(const std::vector<DomainClass>& classes) {
  for (const DomainClass& c : classes) {
    for (MatrixPlan& m : c.plan->matrices) m.owner = -1;
  }
}

double Busiest(const JointAssignment& a, int64_t world) {
  double top = 0;
  for (int32_t r = 0; r < world; ++r) top = std::max(top, a.rank_load(r));
  return top;
}

// The group-packed starts (GroupPackedStart) at levels 1 to kGroupLevels
// times the largest dense matrix, halfway to `best` and at `best`, each with
// the rest capped at `best` or up to 1.4 x it, and the holders-first start;
// appended to `starts` when new. They share a quarter of kPackWork of
// placement work (`per_pack`: what one placement of everything costs).
// False when cancelled.
bool AddGroupStarts(double w, int64_t bpe, int64_t world, const std::vector<DomainClass>& classes,
                    const std::vector<double>* base, double best, int64_t per_pack,
                    CancelToken* cancel, std::vector<Owners>* starts) {
  constexpr int kGroupLevels = 4;
  auto keep = [&] {
    Owners start = SaveOwners(classes);
    if (std::find(starts->begin(), starts->end(), start) == starts->end()) {
      starts->push_back(std::move(start));
    }
  };
  double largest = 0;
  for (const DomainClass& c : classes) {
    if (c.ranks.empty() || c.ranks[0].size() != 1) continue;
    for (const MatrixPlan& m : c.plan->matrices) largest = std::max(largest, m.min_cost);
  }
  std::vector<double> levels;
  for (int k = 1; k <= kGroupLevels && k * largest < best; ++k) {
    levels.push_back(k * largest * (1 + 1e-9));
  }
  levels.push_back(0.5 * (largest + best));
  levels.push_back(best);
  int64_t work = 0;
  for (const double level : levels) {
    if (largest <= 0) break;
    for (const double over : {1.0, 1.05, 1.1, 1.2, 1.4}) {
      if (work + per_pack > kPackWork / 4) break;
      ClearOwners(classes);
      JointAssignment a(classes, world, w, bpe, base);
      if (GroupPackedStart(a, level, best * over, cancel, &work)) {
        keep();
        break;
      }
      if (cancel != nullptr && cancel->cancelled()) return false;
    }
  }
  ClearOwners(classes);
  JointAssignment a(classes, world, w, bpe, base);
  if (HoldersFirstStart(a, cancel)) keep();
  return !(cancel != nullptr && cancel->cancelled());
}

// Assigns `start` on the empty assignment `a`, then refines it and levels
// the groups in turns (levelling never raises the makespan and may let a
// further refinement lower it) within `meter`'s budget; `n` matrices in all.
void RefineFrom(const Owners& start, size_t n, JointAssignment& a, WorkMeter& meter) {
  constexpr int kLevelRounds = 8;
  for (size_t c = 0; c < start.size(); ++c) {
    for (size_t j = 0; j < start[c].size(); ++j) {
      a.Assign(static_cast<int>(c), static_cast<int32_t>(j), start[c][j]);
    }
  }
  Refine(a, n, meter);
  for (int round = 0; round < kLevelRounds && !meter.stopped(); ++round) {
    if (!Level(a, meter)) break;
    Refine(a, n, meter);
  }
}

// The capped placements of AssignLpt: bisection on a cap between the joint
// lower bound and `*best`, each placement of `order` (earliest, grouped,
// then best fit) within the cap; a placement that fits lowers `*best` and
// sets `*best_owners`. `*work` counts candidate evaluations, at most
// kPackWork (`per_pack` a placement). False when cancelled.
bool CappedPlacements(double w, int64_t bpe, int64_t world, const std::vector<DomainClass>& classes,
                      const std::vector<double>* base, const std::vector<Item>& order,
                      int64_t per_pack, CancelToken* cancel, int64_t* work, double* best,
                      Owners* best_owners) {
  constexpr int kMaxPacks = 14;
  double lo = JointLowerBound(world, classes, base);
  for (int i = 0; i < kMaxPacks && *work + per_pack <= kPackWork && *best > lo * (1 + 1e-3); ++i) {
    const double cap = 0.5 * (lo + *best);
    Placed placed = Placed::kOverCap;
    std::unique_ptr<JointAssignment> a;
    // Earliest fit spreads the work; best fit keeps whole positions free
    // for what comes later; grouped fit keeps a rank's other domains free.
    for (const Fit fit : {Fit::kEarliest, Fit::kGrouped, Fit::kBest}) {
      if (placed != Placed::kOverCap || (fit != Fit::kEarliest && *work + per_pack > kPackWork)) {
        break;
      }
      ClearOwners(classes);
      a = std::make_unique<JointAssignment>(classes, world, w, bpe, base);
      placed = Place(*a, order, cap, fit, cancel, work);
    }
    if (placed == Placed::kCancelled) return false;
    if (placed == Placed::kOverCap) {
      lo = cap;
      continue;
    }
    *best = Busiest(*a, world);
    *best_owners = SaveOwners(classes);
  }
  return true;
}

// Joint lpt, then capped placements by bisection on the cap between the
// joint lower bound and the best makespan so far (within kPackWork
// candidate evaluations), then the refinement of the best. Sets every
// class's refinement work. False when cancelled.
bool AssignLpt(double w, int64_t bpe, int64_t world, const std::vector<DomainClass>& classes,
               const std::vector<double>* base, CancelToken* cancel) {
  constexpr double kTryMoreStartsAbove = 1.05;
  auto a = std::make_unique<JointAssignment>(classes, world, w, bpe, base);
  const std::vector<Item> order = LongestFirst(*a);
  int64_t work = 0;
  if (Place(*a, order, std::numeric_limits<double>::infinity(), Fit::kEarliest, cancel, &work) !=
      Placed::kAll) {
    return false;
  }
  const int64_t per_pack = std::max<int64_t>(work, 1);
  double best = Busiest(*a, world);
  Owners best_owners = SaveOwners(classes);
  const Owners lpt_owners = best_owners;
  if (!CappedPlacements(w, bpe, world, classes, base, order, per_pack, cancel, &work, &best,
                        &best_owners)) {
    return false;
  }
  // Refine the best capped placement and, when that is not lpt's, lpt's
  // too (a worse start can refine to a better end), then, where both end
  // over kTryMoreStartsAbove x the joint bound, the group-packed and
  // holders-first starts; keep the best.
  std::vector<Owners> starts = {best_owners};
  const bool has_lpt_start = best_owners != lpt_owners;
  if (has_lpt_start) starts.push_back(lpt_owners);
  size_t n = 0;
  for (const DomainClass& c : classes) n += c.plan->matrices.size();
  Owners kept;
  double kept_makespan = 0;
  int64_t spent = 0;
  bool exhausted = false;
  const size_t first_starts = starts.size();
  const double bound = JointLowerBound(world, classes, base);
  for (size_t i = 0;; ++i) {
    // The other starts only where the first ones miss 1.05 x the bound.
    if (i == first_starts && kept_makespan > bound * kTryMoreStartsAbove &&
        !AddGroupStarts(w, bpe, world, classes, base, best, per_pack, cancel, &starts)) {
      return false;
    }
    if (i >= starts.size()) break;
    const Owners start = starts[i];
    ClearOwners(classes);
    a = std::make_unique<JointAssignment>(classes, world, w, bpe, base);
    // lpt's start, the second chance, gets a quarter of the budget, the
    // group-packed and holders-first ones a thirty-second each.
    const int64_t share = i == 0 ? 1 : (i == 1 && has_lpt_start ? 4 : 32);
    WorkMeter meter(RefineWorkBudget(static_cast<int64_t>(n)) / share, cancel);
    RefineFrom(start, n, *a, meter);
    if (meter.cancelled()) return false;
    const double makespan = Busiest(*a, world);
    if (kept.empty() || makespan < kept_makespan) {
      kept = SaveOwners(classes);
      kept_makespan = makespan;
      spent = meter.spent();
      exhausted = meter.exhausted();
    }
  }
  for (size_t c = 0; c < classes.size(); ++c) {
    for (size_t j = 0; j < kept[c].size(); ++j) classes[c].plan->matrices[j].owner = kept[c][j];
  }
  for (const DomainClass& c : classes) {
    c.plan->refine_work = spent;
    c.plan->refine_budget_spent = exhausted;
  }
  return true;
}

// Per-position loads, makespan and exchange of a domain from its owners.
void SumOwnedCosts(double w, int64_t bpe, DomainPlan& d) {
  for (MatrixPlan& m : d.matrices) {
    m.gather_bytes = GatherBytesAt(m, m.owner, bpe);
    m.owner_cost = m.cost_flops + w * static_cast<double>(m.gather_bytes);
    d.load[m.owner] += m.owner_cost;
    d.ns_flops[m.owner] += m.cost_flops;
    d.gather_bytes[m.owner] += m.gather_bytes;
    d.owned[m.owner] += 1;
    d.exchange_bytes += m.gather_bytes;
  }
}

// Zeroes the per-position sums SumOwnedCosts adds to.
void ClearLoads(DomainPlan& d) {
  d.load.assign(d.size, 0.0);
  d.ns_flops.assign(d.size, 0.0);
  d.gather_bytes.assign(d.size, 0);
  d.owned.assign(d.size, 0);
  d.exchange_bytes = 0;
}

void ResetDomain(double w, int64_t bpe, DomainPlan& d) {
  ClearLoads(d);
  d.refine_work = 0;
  d.refine_budget_spent = false;
  SetLowerBounds(w, bpe, d);
}

// InvalidArgument unless every class puts every rank of the world at exactly
// one of its positions, the same number of ranks at each.
absl::Status CheckClasses(int64_t world, const std::vector<DomainClass>& classes) {
  for (size_t c = 0; c < classes.size(); ++c) {
    const DomainClass& cl = classes[c];
    if (cl.plan == nullptr || static_cast<int64_t>(cl.ranks.size()) != cl.plan->size ||
        cl.plan->size < 1) {
      return absl::InvalidArgumentError(absl::StrCat("class ", c, ": one rank list a position"));
    }
    std::vector<int> seen(world, 0);
    for (const std::vector<int32_t>& ranks : cl.ranks) {
      if (ranks.size() != cl.ranks[0].size()) {
        return absl::InvalidArgumentError(absl::StrCat("class ", c, ": uneven positions"));
      }
      for (int32_t r : ranks) {
        if (r < 0 || r >= world || seen[r]++ > 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("class ", c, ": rank ", r, " missing from the world or repeated"));
        }
      }
    }
    if (static_cast<int64_t>(cl.ranks.size() * cl.ranks[0].size()) != world) {
      return absl::InvalidArgumentError(absl::StrCat("class ", c, ": does not cover the world"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

double NewtonSchulzFlops(int64_t rows, int64_t cols, int64_t ns_steps) {
  return StandardNsFlops(rows, cols, ns_steps);
}

int64_t RefineWorkBudget(int64_t matrices) {
  if (matrices <= kRefineFullMatrices) return kRefineWorkMax;
  return std::max(kRefineWorkMin, kRefineWorkMax / matrices * kRefineFullMatrices);
}


absl::Status AssignOwners(OwnerRule rule, double w, int64_t bpe, DomainPlan* domain,
                          CancelToken* cancel) {
  std::vector<DomainClass> alone(1);
  alone[0].plan = domain;
  alone[0].ranks.resize(std::max<int64_t>(domain->size, 0));
  for (int32_t p = 0; p < domain->size; ++p) alone[0].ranks[p] = {p};
  return AssignOwnersJointly(rule, w, bpe, domain->size, alone, cancel).status();
}

absl::StatusOr<std::vector<double>> AssignOwnersJointly(OwnerRule rule, double w, int64_t bpe,
                                                        int64_t world,
                                                        const std::vector<DomainClass>& classes,
                                                        CancelToken* cancel,
                                                        const std::vector<double>* base_load) {
  MUONMESH_RETURN_IF_ERROR(CheckClasses(world, classes));
  if (base_load != nullptr && static_cast<int64_t>(base_load->size()) != world) {
    return absl::InvalidArgumentError("base load: one entry a rank");
  }
  for (const DomainClass& c : classes) ResetDomain(w, bpe, *c.plan);
  if (rule == OwnerRule::kLpt) {
    if (!AssignLpt(w, bpe, world, classes, base_load, cancel)) return CancelToken::Status();
  }
  for (const DomainClass& c : classes) {
    DomainPlan& d = *c.plan;
    if (rule == OwnerRule::kAllGather) {
      AllGather(w, bpe, d);
    } else {
      if (rule != OwnerRule::kLpt) AssignOneClassByRule(rule, w, bpe, d);
      SumOwnedCosts(w, bpe, d);
    }
    d.makespan = d.load.empty() ? 0 : *std::max_element(d.load.begin(), d.load.end());
  }
  // Each rank's joint load, summed afresh from the final loads.
  std::vector<double> rank_load =
      base_load != nullptr ? *base_load : std::vector<double>(world, 0.0);
  for (const DomainClass& c : classes) {
    for (size_t p = 0; p < c.ranks.size(); ++p) {
      for (int32_t r : c.ranks[p]) rank_load[r] += c.plan->load[p];
    }
  }
  return rank_load;
}

void SumOwnerLoads(double w, int64_t bpe, DomainPlan* domain) {
  ClearLoads(*domain);
  SumOwnedCosts(w, bpe, *domain);
  domain->makespan =
      domain->load.empty() ? 0 : *std::max_element(domain->load.begin(), domain->load.end());
}

ReplicaExchange ReplicaExchangeBytes(const DomainPlan& d, int64_t bpe) {
  ReplicaExchange out;
  if (d.replicas <= 1) return out;
  const int64_t n = d.replicas * d.size;
  std::vector<int64_t> mine(n, 0);       // rows of one's own replica's matrices
  std::vector<int64_t> held(d.size, 0);  // rows of every matrix, per position
  for (const MatrixPlan& m : d.matrices) {
    for (const Holder& h : m.holders) {
      const int64_t bytes = h.row_count * m.cols * bpe;
      held[h.position] += bytes;
      if (m.replica >= 0) mine[m.replica * d.size + h.position] += bytes;
    }
  }
  out.sent.resize(n);
  out.recv.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    out.sent[i] = (d.replicas - 1) * mine[i];
    out.recv[i] = held[i % d.size] - mine[i];
  }
  return out;
}

}  // namespace muonmesh::plan
