// The lower bounds owners.h promises: what no assignment of the Muon
// matrices to owners can beat, to certify how close a plan is to optimal
// (docs/architecture.md §4). Apart from the assignment heuristics
// (owners.cc), which they never call.
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

using internal::CostAt;
using internal::CostAway;

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

double JointLowerBound(int64_t world, const std::vector<DomainClass>& classes,
                       const std::vector<double>* base_load) {
  double bound = 0;
  double total = 0;
  if (base_load != nullptr) {
    for (double b : *base_load) {
      bound = std::max(bound, b);
      total += b;
    }
  }
  for (const DomainClass& c : classes) {
    bound = std::max(bound, c.plan->lower_bound);
    double sum = 0;
    for (const MatrixPlan& m : c.plan->matrices) sum += m.min_cost;
    const size_t domains = c.ranks.empty() ? 0 : c.ranks[0].size();
    total += sum * static_cast<double>(domains);
  }
  return std::max(bound, total / static_cast<double>(world));
}

namespace {

// Martello-Toth L2 on sizes sorted ascending, with their prefix sums; at
// most kMaxThresholds thresholds K tried (any K gives a valid bound).
class BinPacking {
 public:
  static constexpr size_t kMaxThresholds = 256;

  explicit BinPacking(std::vector<double> sizes) : sizes_(std::move(sizes)) {
    std::sort(sizes_.begin(), sizes_.end());
    prefix_.assign(sizes_.size() + 1, 0.0);
    for (size_t i = 0; i < sizes_.size(); ++i) prefix_[i + 1] = prefix_[i] + sizes_[i];
    // Thresholds for TwoSizesInfeasible: the largest distinct sizes, and
    // others spread evenly over the rest.
    std::vector<double> distinct;
    for (double x : sizes_) {
      if (x > 0 && (distinct.empty() || x != distinct.back())) distinct.push_back(x);
    }
    const size_t n = distinct.size();
    for (size_t i = 0; i < std::min(n, kLargestThresholds); ++i) {
      thresholds_.push_back(distinct[n - 1 - i]);
    }
    if (n > kLargestThresholds) {
      const size_t rest = n - kLargestThresholds;
      const size_t step = std::max<size_t>(1, rest / kSpreadThresholds);
      for (size_t i = rest; i-- > 0;) {
        if ((rest - 1 - i) % step == 0) thresholds_.push_back(distinct[i]);
      }
    }
  }

  // True when no `bins` bins of capacity C hold the sizes, by counting two
  // kinds of them: for thresholds k1 > k2, n1 sizes of at least k1 and n2
  // in [k2, k1). A bin holding u of the first kind (u <= U = floor(C / k1))
  // has room for at most s(u) = floor((C - u k1) / k2) of the second, so the
  // bins hold at most the largest sum of s(u_b) over bins b with the u_b
  // adding up to n1; more than that many sizes in [k2, k1) cannot all fit.
  // The largest sum, over fractional numbers of bins x_u >= 0 with
  // sum x_u = bins and sum u x_u = n1 (a relaxation, so the test stays
  // sound), mixes two values of u around n1 / bins; every pair is tried.
  bool TwoSizesInfeasible(double c, int64_t bins) const {
    const double m = static_cast<double>(bins);
    for (size_t a = 0; a < thresholds_.size(); ++a) {
      const double k1 = thresholds_[a];
      const int64_t n1 = static_cast<int64_t>(sizes_.size() - AtLeast(k1));
      const int64_t most = static_cast<int64_t>(std::floor(c / k1 * (1 + 1e-12)));
      if (n1 > most * bins) return true;  // the first kind alone does not fit
      if (most > kMaxPerBin) continue;
      const double need = static_cast<double>(n1);
      for (size_t b = a + 1; b < thresholds_.size(); ++b) {
        const double k2 = thresholds_[b];
        const double n2 = static_cast<double>(AtLeast(k1) - AtLeast(k2));
        if (n2 <= 0) continue;
        auto room = [&](int64_t u) {
          return std::floor((c - static_cast<double>(u) * k1) / k2 * (1 + 1e-12));
        };
        double best = -1;
        for (int64_t lo = 0; lo <= most; ++lo) {
          for (int64_t hi = lo; hi <= most; ++hi) {
            const double ulo = static_cast<double>(lo), uhi = static_cast<double>(hi);
            if (ulo * m > need || uhi * m < need) continue;  // n1 / bins not between
            const double x_hi = hi == lo ? m : (need - ulo * m) / (uhi - ulo);
            best = std::max(best, (m - x_hi) * room(lo) + x_hi * room(hi));
          }
        }
        if (best < n2) return true;
      }
    }
    return false;
  }

  // For each threshold K in [0, C/2]: J1 = sizes > C - K (each alone in a
  // bin, and no size >= K fits beside it), J2 = sizes in (C/2, C - K] (one
  // a bin), J3 = sizes in [K, C/2], which fill what J2's bins leave and then
  // whole bins: |J1| + |J2| + ceil((sum J3 - (|J2| C - sum J2)) / C); or, by
  // count, + ceil((|J3| - |J2| floor(C / 2K)) / floor(C / K)).
  int64_t Bins(double c) const {
    if (sizes_.empty()) return 0;
    const size_t half = Above(c / 2);  // first index with size > C/2
    std::vector<double> ks = {0.0};
    const size_t step = std::max<size_t>(1, half / kMaxThresholds);
    for (size_t i = 0; i < half; i += step) {
      if (sizes_[i] != ks.back()) ks.push_back(sizes_[i]);
    }
    int64_t best = 0;
    const size_t n = sizes_.size();
    for (double k : ks) {
      const size_t j1 = Above(c - k);   // sizes > C - K from here
      const size_t j3 = AtLeast(k);     // sizes >= K from here up to half
      const double n2 = static_cast<double>(j1 - half);
      const double sum2 = prefix_[j1] - prefix_[half];
      const double sum3 = prefix_[half] - prefix_[j3];
      // Rounded down a little: the bound stays a bound despite sums' rounding.
      const double spill = (sum3 - (n2 * c - sum2)) / c - 1e-9;
      int64_t extra = spill > 0 ? static_cast<int64_t>(std::ceil(spill)) : 0;
      // By count: a bin holds at most floor(C / K) sizes >= K, a bin of J2
      // (more than C/2 taken) at most floor(C / 2K); rounded up a little.
      if (k > 0) {
        const double per_bin = std::floor(c / k * (1 + 1e-12));
        const double beside_j2 = std::floor(c / (2 * k) * (1 + 1e-12));
        const double left = static_cast<double>(half - j3) - n2 * beside_j2;
        if (left > 0 && per_bin >= 1) {
          extra = std::max(extra, static_cast<int64_t>(std::ceil(left / per_bin)));
        }
      }
      best = std::max(best, static_cast<int64_t>(n - half) + extra);
    }
    return best;
  }

 private:
  size_t Above(double x) const {
    return static_cast<size_t>(std::upper_bound(sizes_.begin(), sizes_.end(), x) -
                               sizes_.begin());
  }
  size_t AtLeast(double x) const {
    return static_cast<size_t>(std::lower_bound(sizes_.begin(), sizes_.end(), x) -
                               sizes_.begin());
  }
  static constexpr size_t kLargestThresholds = 8;
  static constexpr size_t kSpreadThresholds = 16;
  static constexpr int64_t kMaxPerBin = 32;
  std::vector<double> sizes_;
  std::vector<double> prefix_;
  std::vector<double> thresholds_;  // descending
};

// The largest C in [lo, hi] (by bisection) for which `packing` needs more
// than `bins` bins: no plan of `bins` positions finishes by C. `lo` when
// none is found.
double BinPackingBound(const BinPacking& packing, int64_t bins, double lo, double hi) {
  double found = lo;
  for (int i = 0; i < 40 && hi > lo * (1 + 1e-6); ++i) {
    const double mid = 0.5 * (lo + hi);
    if (packing.Bins(mid) > bins || packing.TwoSizesInfeasible(mid, bins)) {
      found = lo = mid;
    } else {
      hi = mid;
    }
  }
  return found;
}

// The Lagrangian bound of StrongJointLowerBound: exponentiated-gradient
// steps on the rank weights, keeping the best value.
double LagrangianBound(double w, int64_t bpe, int64_t world,
                       const std::vector<DomainClass>& classes, int64_t max_work,
                       CancelToken* cancel) {
  int64_t per_pass = 1;
  for (const DomainClass& c : classes) {
    const int64_t copies = c.ranks.empty() ? 0 : static_cast<int64_t>(c.ranks[0].size());
    per_pass += c.plan->size * copies;
    for (const MatrixPlan& m : c.plan->matrices) {
      per_pass += copies * (1 + static_cast<int64_t>(m.holders.size()));
    }
  }
  const int64_t passes = std::clamp<int64_t>(max_work / per_pass, 4, 400);
  std::vector<double> y(world, 1.0 / static_cast<double>(world));
  std::vector<double> charged(world);
  double best = 0;
  for (int64_t pass = 0; pass < passes; ++pass) {
    std::fill(charged.begin(), charged.end(), 0.0);
    double value = 0;
    for (const DomainClass& c : classes) {
      const size_t copies = c.ranks.empty() ? 0 : c.ranks[0].size();
      for (size_t k = 0; k < copies; ++k) {
        // The cheapest weight in this copy's domain, for non-holders.
        int32_t low = c.ranks[0][k];
        for (const std::vector<int32_t>& at : c.ranks) {
          if (y[at[k]] < y[low] || (y[at[k]] == y[low] && at[k] < low)) low = at[k];
        }
        for (const MatrixPlan& m : c.plan->matrices) {
          const double anywhere = CostAway(m, w, bpe);
          double v = y[low] * anywhere;
          int32_t at = low;
          double cost = anywhere;
          for (const Holder& h : m.holders) {
            const int32_t r = c.ranks[h.position][k];
            const double here = CostAt(m, h.position, w, bpe);
            if (y[r] * here < v) {
              v = y[r] * here;
              at = r;
              cost = here;
            }
          }
          value += v;
          charged[at] += cost;
        }
      }
    }
    best = std::max(best, value);
    if (cancel != nullptr && cancel->Tick(per_pass)) break;
    // Raise the weights of the ranks the relaxed choice overloads.
    double mean = 0;
    for (double l : charged) mean += l;
    mean /= static_cast<double>(world);
    if (mean <= 0) break;
    const double eta = 1.0 / std::sqrt(static_cast<double>(pass + 1));
    double sum = 0;
    for (int32_t r = 0; r < world; ++r) {
      y[r] *= std::exp(eta * std::min(charged[r] / mean, 50.0));
      sum += y[r];
    }
    for (double& v : y) v /= sum;
  }
  return best;
}

// The group bound of StrongJointLowerBound for classes a (positions run by
// several ranks each: a group) and b: T is infeasible when, for some sizes
// theta (of b's copies) and k (of a's matrices), no spreading of b's copies
// of at least theta over the groups leaves room for a's matrices.
class GroupBound {
 public:
  static constexpr size_t kCandidates = 24;
  static constexpr int64_t kMaxDp = int64_t{1} << 20;

  GroupBound(double w, int64_t bpe, int64_t world, const DomainClass& a, const DomainClass& b) {
    groups_ = a.plan->size;
    ranks_ = a.ranks.empty() ? 1 : static_cast<int64_t>(a.ranks[0].size());
    for (const MatrixPlan& m : a.plan->matrices) a_.push_back(m.min_cost);
    const size_t copies = b.ranks.empty() ? 0 : b.ranks[0].size();
    for (const MatrixPlan& m : b.plan->matrices) {
      for (size_t k = 0; k < copies; ++k) b_.push_back(m.min_cost);
    }
    std::sort(a_.begin(), a_.end());
    std::sort(b_.begin(), b_.end());
    for (double x : a_) area_ += x;
    for (double x : b_) b_area_ += x;
    covers_world_ = groups_ * ranks_ == world;
    if (a.plan->replicas <= 1) SetShiftCosts(w, bpe, *a.plan);
  }

  // True when no plan finishes by T (see StrongJointLowerBound).
  bool Infeasible(double t) const {
    if (a_.empty() || b_.empty() || ranks_ < 2) return false;
    for (double theta : Candidates(b_)) {
      if (theta <= 0) continue;
      // Copies of at least theta, and the level units they need: a group
      // at level l (its busiest rank holds l of them) takes R l of them.
      const int64_t n = AtLeast(b_, theta);
      const int64_t units = (n + ranks_ - 1) / ranks_;
      const int64_t levels = static_cast<int64_t>(std::floor(t / theta));
      if (units > groups_ * levels) return true;  // the copies alone do not fit
      // By area: the groups leave at most Q T - theta U for a's matrices.
      if (static_cast<double>(groups_) * t - theta * static_cast<double>(units) <
          area_ * (1 - 1e-12)) {
        return true;
      }
      if (ShiftInfeasible(t, theta, units, levels)) return true;
      if (groups_ * (units + 1) * (levels + 1) > kMaxDp) continue;
      for (double k : Candidates(a_)) {
        if (k > 0 && MostSlots(t, theta, k, units, levels) < AtLeast(a_, k)) return true;
      }
    }
    return false;
  }

 private:
  // Per group q, what moving a's work away from its best holder costs: each
  // matrix is native to the position where it is cheapest (its min_cost
  // there), and elsewhere costs rho >= 1 times that (rho from the second
  // cheapest position). Moving native work of min-cost M out of q adds at
  // least f_q(M) = the cheapest fractional choice of (rho - 1) min_cost
  // summing to M in min_cost: the native matrices by rho ascending.
  struct Native {
    double load = 0;              // H_q: the native matrices' min_cost
    std::vector<double> moved;    // prefix sums of min_cost, by rho ascending
    std::vector<double> extra;    // prefix sums of (rho - 1) min_cost, same order
  };

  void SetShiftCosts(double w, int64_t bpe, const DomainPlan& a) {
    std::vector<std::vector<std::pair<double, double>>> by_group(groups_);  // (rho, min)
    for (const MatrixPlan& m : a.matrices) {
      const double anywhere = CostAway(m, w, bpe);
      double best = anywhere, second = anywhere;
      int32_t at = -1;
      for (const Holder& h : m.holders) {
        const double here = CostAt(m, h.position, w, bpe);
        if (here < best) {
          second = best;
          best = here;
          at = h.position;
        } else {
          second = std::min(second, here);
        }
      }
      // With every position a holder, `anywhere` is no position's cost.
      if (static_cast<int64_t>(m.holders.size()) >= groups_ && m.holders.size() >= 2) {
        second = std::numeric_limits<double>::infinity();
        for (const Holder& h : m.holders) {
          if (h.position == at) continue;
          second = std::min(second, CostAt(m, h.position, w, bpe));
        }
      }
      if (at < 0 || best <= 0 || !std::isfinite(second)) continue;  // no native group
      by_group[at].push_back({second / best, best});
    }
    native_.resize(groups_);
    for (int64_t q = 0; q < groups_; ++q) {
      std::sort(by_group[q].begin(), by_group[q].end());
      Native& n = native_[q];
      n.moved.push_back(0);
      n.extra.push_back(0);
      for (const auto& [rho, min] : by_group[q]) {
        n.load += min;
        n.moved.push_back(n.moved.back() + min);
        n.extra.push_back(n.extra.back() + (rho - 1) * min);
      }
    }
  }

  // f_q(M) of Native, interpolated within a matrix (a relaxation).
  static double ShiftCost(const Native& n, double moved) {
    if (moved <= 0) return 0;
    const size_t i = static_cast<size_t>(
        std::lower_bound(n.moved.begin(), n.moved.end(), moved) - n.moved.begin());
    if (i >= n.moved.size()) return n.extra.back();
    const double span = n.moved[i] - n.moved[i - 1];
    const double part = span > 0 ? (moved - n.moved[i - 1]) / span : 1.0;
    return n.extra[i - 1] + part * (n.extra[i] - n.extra[i - 1]);
  }

  // The groups' a-loads, with what moving work off them costs: a group at
  // level l (a rank holding l of b's copies of at least theta) has a-load
  // L_q <= T - l theta, so at least M_q = H_q - (T - l theta) of its native
  // work went elsewhere, where it costs M_q + f_q(M_q) or more; so
  //     sum_q (T - l_q theta) >= sum_q L_q >= sum_q (H_q + f_q(M_q)),
  // and, where a's groups cover every rank, their ranks hold all of b's
  // copies beside their a-load: R sum_q (T - L_q) >= b's area. T is
  // infeasible when every choice of levels adding up to `units` breaks one
  // of these. A min-plus knapsack over the groups, on the levels' sum (kept
  // exactly up to where theta times it passes b's area over R, then capped).
  bool ShiftInfeasible(double t, double theta, int64_t units, int64_t levels) const {
    if (native_.empty()) return false;
    const double per_rank = covers_world_ ? b_area_ / static_cast<double>(ranks_) : 0.0;
    const int64_t cap = std::max<int64_t>(
        units, static_cast<int64_t>(std::ceil(per_rank / theta * (1 - 1e-12))));
    if (groups_ * (cap + 1) * (levels + 1) > kMaxDp) return false;
    constexpr double kNone = std::numeric_limits<double>::infinity();
    std::vector<double> best(cap + 1, kNone);  // least sum of f_q for a sum of levels
    best[0] = 0;
    double native = 0;
    for (int64_t q = 0; q < groups_; ++q) {
      const Native& n = native_[q];
      native += n.load;
      std::vector<double> next(cap + 1, kNone);
      for (int64_t l = 0; l <= levels; ++l) {
        const double f = ShiftCost(n, n.load - (t - static_cast<double>(l) * theta));
        for (int64_t s = 0; s <= cap; ++s) {
          if (best[s] == kNone) continue;
          const int64_t v = std::min(cap, s + l);
          next[v] = std::min(next[v], best[s] + f);
        }
      }
      best = std::move(next);
    }
    // The groups' room for a-load is Q T less the larger of theta times the
    // levels' sum and b's area over R; a-load needs the native load and f.
    const double room = static_cast<double>(groups_) * t;
    for (int64_t s = units; s <= cap; ++s) {
      if (best[s] == kNone) continue;
      const double taken = std::max(theta * static_cast<double>(s), per_rank);
      if (native + best[s] <= (room - taken) * (1 + 1e-12)) return false;
    }
    return true;
  }

  static int64_t AtLeast(const std::vector<double>& sorted, double x) {
    return static_cast<int64_t>(sorted.end() -
                                std::lower_bound(sorted.begin(), sorted.end(), x));
  }

  // Up to kCandidates of the distinct sizes, evenly spread, the extremes in.
  static std::vector<double> Candidates(const std::vector<double>& sorted) {
    std::vector<double> distinct;
    for (double x : sorted) {
      if (distinct.empty() || x != distinct.back()) distinct.push_back(x);
    }
    if (distinct.size() <= kCandidates) return distinct;
    std::vector<double> out;
    for (size_t i = 0; i < kCandidates; ++i) {
      out.push_back(distinct[i * (distinct.size() - 1) / (kCandidates - 1)]);
    }
    return out;
  }

  // The most matrices of at least k the groups can take, over every choice
  // of levels with at least `units` level units in all: a group at level l
  // takes floor((T - l theta) / k), rounded up a little. A knapsack, by DP.
  int64_t MostSlots(double t, double theta, double k, int64_t units, int64_t levels) const {
    constexpr int64_t kNone = std::numeric_limits<int64_t>::min() / 4;
    std::vector<int64_t> slots(levels + 1);
    for (int64_t l = 0; l <= levels; ++l) {
      const double room = t - static_cast<double>(l) * theta;
      slots[l] = static_cast<int64_t>(std::floor(room / k * (1 + 1e-12)));
    }
    std::vector<int64_t> best(units + 1, kNone);
    best[0] = 0;
    for (int64_t g = 0; g < groups_; ++g) {
      std::vector<int64_t> next(units + 1, kNone);
      for (int64_t u = 0; u <= units; ++u) {
        if (best[u] == kNone) continue;
        for (int64_t l = 0; l <= levels; ++l) {
          const int64_t v = std::min(units, u + l);
          next[v] = std::max(next[v], best[u] + slots[l]);
        }
      }
      best = std::move(next);
    }
    return best[units];
  }

  int64_t groups_ = 0;
  int64_t ranks_ = 1;
  std::vector<double> a_;
  std::vector<double> b_;
  double area_ = 0;
  double b_area_ = 0;
  bool covers_world_ = false;
  std::vector<Native> native_;  // per group; empty: no shift check
};

}  // namespace

int64_t BinPackingLowerBound(std::vector<double> sizes, double capacity) {
  return BinPacking(std::move(sizes)).Bins(capacity);
}

double PigeonholeLowerBound(std::vector<double> costs, int64_t ranks) {
  std::sort(costs.begin(), costs.end(), std::greater<>());
  std::vector<double> prefix(costs.size() + 1, 0.0);
  for (size_t i = 0; i < costs.size(); ++i) prefix[i + 1] = prefix[i] + costs[i];
  double bound = costs.empty() ? 0 : costs[0];
  const size_t m = static_cast<size_t>(std::max<int64_t>(ranks, 1));
  // The top k m + 1 are costs[0 .. k m]; the k + 1 smallest of them are
  // costs[k m - k .. k m].
  for (size_t k = 1; k * m + 1 <= costs.size(); ++k) {
    bound = std::max(bound, prefix[k * m + 1] - prefix[k * m - k]);
  }
  return bound;
}

double StrongJointLowerBound(double w, int64_t bpe, int64_t world,
                             const std::vector<DomainClass>& classes, int64_t max_work,
                             CancelToken* cancel) {
  double bound = JointLowerBound(world, classes);
  double makespan = 0;  // an upper end for the bisections
  std::vector<double> rank_load(world, 0.0);
  for (const DomainClass& c : classes) {
    for (size_t p = 0; p < c.ranks.size(); ++p) {
      for (int32_t r : c.ranks[p]) rank_load[r] += c.plan->load[p];
    }
  }
  for (double l : rank_load) makespan = std::max(makespan, l);
  const double hi = std::max(makespan, bound);
  // 1. Each class on its own positions: bin packing and pigeonhole.
  std::vector<double> own(classes.size());  // a bound on some position's load
  std::vector<double> total(classes.size());  // one domain's best-holder costs
  std::vector<double> all;  // every copy of every matrix
  for (size_t i = 0; i < classes.size(); ++i) {
    const DomainClass& c = classes[i];
    std::vector<double> sizes;
    for (const MatrixPlan& m : c.plan->matrices) sizes.push_back(m.min_cost);
    for (double x : sizes) total[i] += x;
    const size_t copies = c.ranks.empty() ? 0 : c.ranks[0].size();
    for (size_t k = 0; k < copies; ++k) all.insert(all.end(), sizes.begin(), sizes.end());
    own[i] = std::max(c.plan->lower_bound, PigeonholeLowerBound(sizes, c.plan->size));
    own[i] = std::max(own[i], BinPackingBound(BinPacking(std::move(sizes)), c.plan->size,
                                              own[i], std::max(hi, own[i])));
    bound = std::max(bound, own[i]);
  }
  // 2. Every copy on every rank.
  bound = std::max(bound, PigeonholeLowerBound(all, world));
  bound = std::max(bound, BinPackingBound(BinPacking(std::move(all)), world, bound, hi));
  // 3. Across classes: some position of class i has load >= own[i]; each of
  // its ranks also holds a position of class j, whose load is at least
  // total[j] less what the other D_j - 1 positions can take (T each):
  // T >= own[i] + total[j] - (D_j - 1) T.
  for (size_t i = 0; i < classes.size(); ++i) {
    for (size_t j = 0; j < classes.size(); ++j) {
      if (i == j) continue;
      bound = std::max(bound, (own[i] + total[j]) / static_cast<double>(classes[j].plan->size));
    }
  }
  // 4. Groups: positions of one class run by several ranks, and the other
  // class's copies on those ranks.
  for (size_t i = 0; i < classes.size(); ++i) {
    for (size_t j = 0; j < classes.size(); ++j) {
      if (i == j) continue;
      const GroupBound group(w, bpe, world, classes[i], classes[j]);
      double lo = bound;
      double up = std::max(hi, bound);
      for (int step = 0; step < 30 && up > lo * (1 + 1e-6); ++step) {
        const double mid = 0.5 * (lo + up);
        (group.Infeasible(mid) ? lo : up) = mid;
      }
      bound = std::max(bound, lo);
    }
  }
  if (cancel != nullptr && cancel->Tick(static_cast<int64_t>(world))) return bound;
  // 5. The Lagrangian bound.
  return std::max(bound, LagrangianBound(w, bpe, world, classes, max_work, cancel));
}

}  // namespace muonmesh::plan
