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
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// `spec` with each parameter's optimizer replaced by that of the first rule
// (pattern, optimizer) whose pattern matches its whole name. The patterns
// must compile (ValidateJob checks them); InvalidArgument naming the rule
// otherwise.
absl::StatusOr<plan::ModelSpec> ApplyOptimizerRules(
    plan::ModelSpec spec, const std::vector<std::pair<std::string, std::string>>& rules);

}  // namespace muonmesh::job
