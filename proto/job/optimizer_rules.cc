#include "proto/job/optimizer_rules.h"

#include <re2/re2.h>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace muonmesh::job {

absl::StatusOr<std::unique_ptr<re2::RE2>> CompileRulePattern(const std::string& pattern) {
  re2::RE2::Options options;
  options.set_log_errors(false);  // the error goes into the Status instead
  options.set_max_mem(kMaxRuleProgramBytes);
  auto re = std::make_unique<re2::RE2>(pattern, options);
  if (!re->ok()) return absl::InvalidArgumentError(re->error());
  return re;
}

namespace {

absl::StatusOr<std::vector<std::unique_ptr<re2::RE2>>> CompileAll(
    const std::vector<OptimizerRule>& rules) {
  std::vector<std::unique_ptr<re2::RE2>> compiled;
  compiled.reserve(rules.size());
  for (size_t i = 0; i < rules.size(); ++i) {
    absl::StatusOr<std::unique_ptr<re2::RE2>> re = CompileRulePattern(rules[i].pattern);
    if (!re.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.rules[", i, "].pattern: ", re.status().message()));
    }
    compiled.push_back(*std::move(re));
  }
  return compiled;
}

// The first rule matching `name` in full, or -1.
int FirstMatch(const std::string& name, const std::vector<std::unique_ptr<re2::RE2>>& compiled) {
  for (size_t i = 0; i < compiled.size(); ++i) {
    if (re2::RE2::FullMatch(name, *compiled[i])) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

absl::StatusOr<plan::ModelSpec> ApplyOptimizerRules(plan::ModelSpec spec,
                                                    const std::vector<OptimizerRule>& rules) {
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<re2::RE2>> compiled, CompileAll(rules));
  for (plan::UnitSpec& unit : spec.units) {
    for (plan::ParamSpec& p : unit.params) {
      const int i = FirstMatch(p.name, compiled);
      if (i >= 0 && !rules[i].optimizer.empty()) p.optimizer = rules[i].optimizer;
    }
  }
  return spec;
}

absl::StatusOr<std::vector<optim::ParamRates>> ParamRatesOf(const plan::ModelSpec& spec,
                                                           const std::vector<OptimizerRule>& rules) {
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<re2::RE2>> compiled, CompileAll(rules));
  std::vector<optim::ParamRates> rates;
  for (const plan::UnitSpec& unit : spec.units) {
    for (const plan::ParamSpec& p : unit.params) {
      optim::ParamRates r;
      if (const int i = FirstMatch(p.name, compiled); i >= 0) {
        r.lr_scale = rules[i].lr_scale.value_or(1.0);
        r.weight_decay = rules[i].weight_decay;
      }
      rates.push_back(r);
    }
  }
  return rates;
}

}  // namespace muonmesh::job
