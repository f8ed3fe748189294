#pragma once

// Optimizer rules of a job file (optimizer.rules): regular expressions over
// parameter names that override the optimizer a model spec gives a tensor.
//
// Patterns use RE2 syntax (https://github.com/google/re2/wiki/Syntax) and
// must match the whole name. RE2 runs in time linear in the name's length
// whatever the pattern, so no job file can make a worker hang in
// backtracking (std::regex can: "(.*.*)*X" takes exponential time); in
// exchange there are no back-references or look-arounds. Each compiled
// pattern may use at most kMaxRuleProgramBytes of memory.
//
// Free functions with no shared state: any thread may call them.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/optim/types.h"
#include "core/plan/types.h"

namespace re2 {
class RE2;
}  // namespace re2

namespace muonmesh::job {

// Memory one compiled pattern may take (RE2's max_mem: its program and
// its lazily built DFA caches). Real patterns need a few KiB.
inline constexpr int64_t kMaxRuleProgramBytes = int64_t{1} << 20;

// `pattern` compiled for full matches of parameter names. InvalidArgument
// with RE2's reason (including "pattern too large") otherwise.
absl::StatusOr<std::unique_ptr<re2::RE2>> CompileRulePattern(const std::string& pattern);

// One optimizer.rules entry, as the job file gives it.
struct OptimizerRule {
  std::string pattern;
  std::string optimizer = "";  // "muon" | "adamw"; empty: the spec's
  std::optional<double> lr_scale = std::nullopt;
  std::optional<double> weight_decay = std::nullopt;
  bool operator==(const OptimizerRule&) const = default;
};

// `spec` with each parameter's optimizer replaced by that of the first rule
// whose pattern matches its whole name (when that rule names one). The
// patterns must compile (ValidateJob checks them); InvalidArgument naming
// the rule otherwise.
absl::StatusOr<plan::ModelSpec> ApplyOptimizerRules(plan::ModelSpec spec,
                                                    const std::vector<OptimizerRule>& rules);

// Per parameter of `spec` (flat spec order), the rates of the first rule
// matching its whole name (the defaults where none does). Errors as
// ApplyOptimizerRules.
absl::StatusOr<std::vector<optim::ParamRates>> ParamRatesOf(const plan::ModelSpec& spec,
                                                           const std::vector<OptimizerRule>& rules);

}  // namespace muonmesh::job
