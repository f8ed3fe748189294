#include "proto/job/optimizer_rules.h"

#include <re2/re2.h>

#include "absl/strings/str_cat.h"

namespace muonmesh::job {

absl::StatusOr<std::unique_ptr<re2::RE2>> CompileRulePattern(const std::string& pattern) {
  re2::RE2::Options options;
  options.set_log_errors(false);  // the error goes into the Status instead
  options.set_max_mem(kMaxRuleProgramBytes);
  auto re = std::make_unique<re2::RE2>(pattern, options);
  if (!re->ok()) return absl::InvalidArgumentError(re->error());
  return re;
}

absl::StatusOr<plan::ModelSpec> ApplyOptimizerRules(
    plan::ModelSpec spec, const std::vector<std::pair<std::string, std::string>>& rules) {
  std::vector<std::unique_ptr<re2::RE2>> compiled;
  compiled.reserve(rules.size());
  for (size_t i = 0; i < rules.size(); ++i) {
    absl::StatusOr<std::unique_ptr<re2::RE2>> re = CompileRulePattern(rules[i].first);
    if (!re.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.rules[", i, "].pattern: ", re.status().message()));
    }
    compiled.push_back(*std::move(re));
  }
  for (plan::UnitSpec& unit : spec.units) {
    for (plan::ParamSpec& p : unit.params) {
      for (size_t i = 0; i < compiled.size(); ++i) {
        if (re2::RE2::FullMatch(p.name, *compiled[i])) {
          p.optimizer = rules[i].second;
          break;
        }
      }
    }
  }
  return spec;
}

}  // namespace muonmesh::job
