#include "client/plan_table.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace muonmesh::client {
namespace {

// Optimizer state, gradients and updates are fp32 in the planner's cost
// model (plan::ResolvedConfig::bytes_per_element); the plan counts elements.
constexpr double kBytesPerElement = 4;

// Columns of text, padded to the widest cell; numbers right-aligned.
class TextTable {
 public:
  // `align` has one letter per column: 'l'eft or 'r'ight. A header, if
  // any, is the first row added.
  explicit TextTable(std::string align) : align_(std::move(align)) {}

  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  // A line of its own between rows, not part of the columns.
  void AddNote(std::string note) { notes_[rows_.size()] = std::move(note); }

  std::string Render(int indent) const {
    std::vector<size_t> width(align_.size(), 0);
    for (const auto& row : rows_) {
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        width[c] = std::max(width[c], row[c].size());
      }
    }
    const std::string pad(static_cast<size_t>(indent), ' ');
    std::string out;
    for (size_t r = 0; r <= rows_.size(); ++r) {
      if (auto it = notes_.find(r); it != notes_.end())
        absl::StrAppend(&out, pad, it->second, "\n");
      if (r == rows_.size()) break;
      std::string line = pad;
      for (size_t c = 0; c < rows_[r].size() && c < width.size(); ++c) {
        if (c > 0) line += "  ";
        const std::string fill(width[c] - rows_[r][c].size(), ' ');
        line += align_[c] == 'r' ? fill + rows_[r][c] : rows_[r][c] + fill;
      }
      // Left-aligned last columns would leave trailing blanks.
      line.erase(line.find_last_not_of(' ') + 1);
      absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

 private:
  std::string align_;
  std::vector<std::vector<std::string>> rows_;
  std::map<size_t, std::string> notes_;  // before row index
};

std::string Nickname(const std::string& strategy) {
  if (strategy == "no_shard") return "DDP";
  if (strategy == "optim") return "ZeRO-1";
  if (strategy == "optim_grads") return "ZeRO-2";
  if (strategy == "optim_grads_params") return "ZeRO-3";
  return strategy;
}

const v1::AxisPlacement* FindAxis(const v1::Plan& plan, const std::string& mesh,
                                  const std::string& axis) {
  for (const v1::AxisPlacement& p : plan.placements()) {
    if (p.mesh() == mesh && p.axis() == axis) return &p;
  }
  return nullptr;
}

std::string MeshShape(const v1::Mesh& mesh) {
  std::vector<std::string> dims;
  for (int i = 0; i < mesh.dim_names_size() && i < mesh.shape_size(); ++i) {
    dims.push_back(absl::StrCat(mesh.dim_names(i), "=", mesh.shape(i)));
  }
  return absl::StrCat("(", absl::StrJoin(dims, ", "), ")");
}

// "HFSDP: inner optim_grads_params (ZeRO-3), outer optim (ZeRO-1) over 2
// optimizer instances" -- the names docs/architecture.md §3 uses.
std::string StrategyLine(const v1::Plan& plan) {
  const v1::AxisPlacement* inner = FindAxis(plan, "dense", "dp_shard");
  const v1::AxisPlacement* outer = FindAxis(plan, "dense", "dp_outer");
  if (inner == nullptr) return "(no dense mesh)";
  std::string line =
      absl::StrCat("inner ", inner->strategy(), " (", Nickname(inner->strategy()), ")");
  if (outer == nullptr || outer->size() <= 1) return line + ", 1 optimizer instance";
  std::string family;
  if (inner->strategy() == "optim_grads_params" && outer->strategy() == "no_shard")
    family = "HSDP: ";
  if (inner->strategy() == "optim_grads_params" && outer->strategy() == "optim") family = "HFSDP: ";
  return absl::StrCat(family, line, ", outer ", outer->strategy(), " (",
                      Nickname(outer->strategy()), ") over ", outer->size(),
                      " optimizer instances");
}

std::string Percent(double fraction) { return absl::StrFormat("%.4f %%", 100.0 * fraction); }

std::vector<std::string> RankRow(const v1::RankLoad& r) {
  return {absl::StrCat(r.rank()),
          FormatCount(r.shard_elements()),
          FormatBytes(static_cast<double>(r.shard_elements()) * kBytesPerElement),
          FormatCount(r.param_shard_elements()),
          FormatFlops(r.load_flops()),
          absl::StrCat(r.owned_matrices())};
}

void AppendRanks(const v1::Plan& plan, std::string* out) {
  const int n = plan.ranks_size();
  absl::StrAppend(out, "\nRanks (", n,
                  "; load = Newton-Schulz FLOPs of owned matrices + owner "
                  "traffic as FLOPs)\n");
  if (n == 0) return;
  // Most loaded first; ties by rank so that the view is deterministic.
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&plan](int a, int b) {
    return plan.ranks(a).load_flops() > plan.ranks(b).load_flops();
  });
  TextTable table("rrrrrr");
  table.Add({"rank", "shard elements", "shard (fp32)", "param shard", "load", "owned"});
  if (n <= kPlanTableAllRanksUpTo) {
    for (const v1::RankLoad& r : plan.ranks()) table.Add(RankRow(r));
  } else {
    for (int i = 0; i < kPlanTableTopRanks; ++i) table.Add(RankRow(plan.ranks(order[i])));
    table.AddNote(absl::StrCat("... ", n - kPlanTableTopRanks - kPlanTableBottomRanks,
                               " ranks not shown ..."));
    for (int i = n - kPlanTableBottomRanks; i < n; ++i) table.Add(RankRow(plan.ranks(order[i])));
    absl::StrAppend(out, "  showing the ", kPlanTableTopRanks, " most loaded and the ",
                    kPlanTableBottomRanks, " least loaded of ", n, " ranks\n");
  }
  absl::StrAppend(out, table.Render(2));

  const v1::RankLoad& most = plan.ranks(order.front());
  const v1::RankLoad& least = plan.ranks(order.back());
  const v1::RankLoad* largest = &plan.ranks(0);
  const v1::RankLoad* busiest_link = &plan.ranks(0);
  for (const v1::RankLoad& r : plan.ranks()) {
    if (r.shard_elements() > largest->shard_elements()) largest = &r;
    if (r.gather_bytes() > busiest_link->gather_bytes()) busiest_link = &r;
  }
  TextTable worst("ll");
  worst.Add({"most loaded", absl::StrCat("rank ", most.rank(), ": ", FormatFlops(most.load_flops()),
                                         ", ", most.owned_matrices(), " matrices")});
  worst.Add(
      {"least loaded", absl::StrCat("rank ", least.rank(), ": ", FormatFlops(least.load_flops()),
                                    ", ", least.owned_matrices(), " matrices")});
  worst.Add(
      {"largest shard",
       absl::StrCat(
           "rank ", largest->rank(), ": ", FormatCount(largest->shard_elements()), " elements (",
           FormatBytes(static_cast<double>(largest->shard_elements()) * kBytesPerElement), ")")});
  worst.Add(
      {"most Muon traffic",
       absl::StrCat("rank ", busiest_link->rank(), ": ",
                    FormatBytes(static_cast<double>(busiest_link->gather_bytes())), " per step")});
  absl::StrAppend(out, "\nWorst ranks\n", worst.Render(2));
}

}  // namespace

std::string FormatBytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int unit = 0;
  double value = bytes;
  while (std::fabs(value) >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return absl::StrFormat("%.0f B", value);
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string FormatFlops(double flops) {
  static constexpr const char* kUnits[] = {"FLOP",  "kFLOP", "MFLOP", "GFLOP",
                                           "TFLOP", "PFLOP", "EFLOP"};
  int unit = 0;
  double value = flops;
  while (std::fabs(value) >= 1000 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1000;
    ++unit;
  }
  if (unit == 0) return absl::StrFormat("%.0f FLOP", value);
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

std::string FormatCount(int64_t n) {
  // Through uint64 so that INT64_MIN negates without overflow.
  const bool negative = n < 0;
  const uint64_t magnitude = negative ? ~static_cast<uint64_t>(n) + 1 : static_cast<uint64_t>(n);
  std::string digits = absl::StrCat(magnitude);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return negative ? "-" + out : out;
}

namespace {

// Strategy, owners and the two meshes.
std::string HeadSection(const v1::Plan& plan) {
  const v1::PlanSummary& s = plan.summary();
  TextTable head("ll");
  head.Add({"strategy", StrategyLine(plan)});
  head.Add({"owners", absl::StrFormat("%s, %d Newton-Schulz steps, %s per byte of owner traffic",
                                      s.owner_assignment(), s.ns_steps(),
                                      FormatFlops(s.comm_flops_per_byte()))});
  head.Add({"dense mesh", MeshShape(plan.dense_mesh())});
  if (plan.has_expert_mesh()) {
    const int64_t expert_dp = plan.expert_mesh().shape_size() > 0 ? plan.expert_mesh().shape(0) : 1;
    head.Add({"expert mesh",
              absl::StrCat(MeshShape(plan.expert_mesh()), " in each of ",
                           expert_dp > 0 ? plan.world_size() / expert_dp : 0, " EP groups")});
  } else {
    head.Add({"expert mesh", "none (no expert parameters)"});
  }
  return head.Render(2);
}

std::string PlacementsSection(const v1::Plan& plan) {
  std::string out = "\nPer-axis placements (parameter, gradient, optimizer state)\n";
  TextTable placements("llrllll");
  placements.Add({"mesh", "axis", "size", "strategy", "param", "grad", "optimizer"});
  for (const v1::AxisPlacement& p : plan.placements()) {
    placements.Add({p.mesh(), p.axis(), absl::StrCat(p.size()), p.strategy(), p.param(), p.grad(),
                    p.optimizer()});
  }
  absl::StrAppend(&out, placements.Render(2));
  return out;
}

// The summary's Muon rows: each mesh's makespan against its bound, the
// worst, and the joint critical path against the joint bounds.
void AddMuonRows(const v1::Plan& plan, TextTable* summary_table) {
  const v1::PlanSummary& s = plan.summary();
  TextTable& summary = *summary_table;
  // Domains of one mesh share one owner assignment: report each mesh once.
  std::map<std::string, std::vector<const v1::DomainSummary*>> by_mesh;
  for (const v1::DomainSummary& d : s.domains()) {
    const std::string mesh =
        d.domain() >= 0 && d.domain() < plan.domains_size() ? plan.domains(d.domain()).mesh() : "?";
    by_mesh[mesh].push_back(&d);
  }
  bool first = true;
  for (const std::string mesh : {"dense", "expert"}) {
    auto it = by_mesh.find(mesh);
    if (it == by_mesh.end()) continue;
    const v1::DomainSummary& d = *it->second.front();
    std::string text;
    if (d.matrices() == 0 || d.lower_bound() <= 0) {
      text = absl::StrCat(mesh, ": no Muon matrices");
    } else {
      text = absl::StrFormat(
          "%s: makespan %s / lower bound %s = %.4f (%d matrices per domain, "
          "%d domain%s)",
          mesh, FormatFlops(d.makespan()), FormatFlops(d.lower_bound()),
          d.makespan() / d.lower_bound(), d.matrices(), it->second.size(),
          it->second.size() == 1 ? "" : "s");
    }
    summary.Add({first ? "Muon makespan" : "", text});
    first = false;
  }
  summary.Add({first ? "Muon makespan" : "",
               absl::StrFormat("worst: %.4f x lower bound", s.makespan_over_lower_bound())});
  if (s.joint_lower_bound() > 0) {
    // What the runtime's one Muon schedule runs: a rank's load over all its domains.
    std::string joint = absl::StrFormat(
        "%s (rank %d) / joint lower bound %s = %.4f", FormatFlops(s.joint_makespan()),
        s.joint_critical_rank(), FormatFlops(s.joint_lower_bound()),
        s.joint_makespan() / s.joint_lower_bound());
    if (s.joint_strong_lower_bound() > s.joint_lower_bound()) {
      absl::StrAppend(&joint, absl::StrFormat("; / certified bound %s = %.4f",
                                              FormatFlops(s.joint_strong_lower_bound()),
                                              s.joint_makespan() / s.joint_strong_lower_bound()));
    }
    summary.Add({"Muon critical path", joint});
  }
  if (s.muon_waves() > 1) {
    summary.Add({"Muon waves",
                 absl::StrFormat("%d (options.muon_wave_budget_bytes): critical path %s Newton-"
                                 "Schulz FLOPs, the sum over waves of the busiest rank",
                                 s.muon_waves(), FormatFlops(s.wave_critical_path_ns_flops()))});
  }
}

// The Newton-Schulz settings and how many Muon matrices run each form (a
// matrix of several domains counted once).
std::string NewtonSchulzText(const v1::Plan& plan) {
  const v1::PlanSummary& s = plan.summary();
  std::map<std::string, std::set<std::string>> by_form;
  for (const v1::Matrix& m : plan.matrices()) by_form[m.ns_form()].insert(m.name());
  std::vector<std::string> counts;
  for (const auto& [form, names] : by_form) {
    counts.push_back(absl::StrCat(form.empty() ? "?" : form, " on ", names.size(),
                                  names.size() == 1 ? " matrix" : " matrices"));
  }
  std::string text = absl::StrCat(s.ns_steps(), " ", s.ns_coefficients(), " iterations, ",
                                  s.ns_algorithm());
  if (s.threads_per_rank() > 1) {
    absl::StrAppend(&text, " (priced for ", s.threads_per_rank(), " threads a rank)");
  }
  if (!counts.empty()) absl::StrAppend(&text, ": ", absl::StrJoin(counts, ", "));
  return text;
}

std::string SummarySection(const v1::Plan& plan) {
  const v1::PlanSummary& s = plan.summary();
  std::string out = "\nSummary\n";
  TextTable summary("ll");
  summary.Add({"parameters", FormatCount(s.parameters())});
  summary.Add({"padding", absl::StrCat(FormatCount(s.padding_elements()), " elements (",
                                       Percent(s.padding_fraction()), " of parameters)")});
  summary.Add({"Newton-Schulz", NewtonSchulzText(plan)});
  AddMuonRows(plan, &summary);
  summary.Add(
      {"Muon exchange",
       absl::StrCat(FormatBytes(static_cast<double>(s.muon_exchange_bytes())),
                    " per step (lower bound ",
                    FormatBytes(static_cast<double>(s.muon_exchange_lower_bound_bytes())), ")")});
  summary.Add({"bytes per step",
               absl::StrCat(FormatBytes(static_cast<double>(s.bytes_per_step())),
                            " in all collectives (all ranks together)",
                            s.params_held_for_backward()
                                ? "; each unit gathered once, held for the backward pass "
                                  "(reshard_after_forward false)"
                                : "")});
  absl::StrAppend(&out, summary.Render(2));
  return out;
}

std::string CollectivesSection(const v1::Plan& plan) {
  TextTable collectives("lllrr");
  collectives.Add({"collective", "mesh", "axis", "per step", "max per rank"});
  for (const v1::CollectiveBytes& c : plan.collectives()) {
    collectives.Add({c.name(), c.mesh(), c.axis(),
                     FormatBytes(static_cast<double>(c.bytes_per_step())),
                     FormatBytes(static_cast<double>(c.max_rank_bytes()))});
  }
  return collectives.Render(4);
}

}  // namespace

std::string FormatPlanTable(const std::string& model_name, const v1::Plan& plan) {
  std::string out = absl::StrCat("Plan: ", model_name.empty() ? "(unnamed model)" : model_name,
                                 " on ", plan.world_size(), " ranks\n");
  absl::StrAppend(&out, HeadSection(plan), PlacementsSection(plan), SummarySection(plan),
                  CollectivesSection(plan));
  AppendRanks(plan, &out);
  return out;
}

}  // namespace muonmesh::client
