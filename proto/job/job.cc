#include "proto/job/job.h"

#include <re2/re2.h>

#include <cmath>
#include <exception>
#include <filesystem>
#include <set>
#include <string_view>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "proto/io/message_file.h"
#include "core/plan/buckets.h"
#include "core/plan/validate.h"
#include "proto/convert/plan_convert.h"
#include "core/base/status_macros.h"
#include "proto/job/model_specs.h"
#include "proto/job/optimizer_rules.h"
#include "core/optim/optimizer_options.h"

namespace muonmesh::job {
namespace {

namespace fs = std::filesystem;

// Defaults (see job.h).
constexpr double kMuonLr = 0.02;
constexpr double kMuonMomentum = 0.95;
constexpr double kAdamWLr = 1e-3;
constexpr double kAdamWBeta1 = 0.9;
constexpr double kAdamWBeta2 = 0.999;
constexpr double kAdamWEps = 1e-8;

using plan::Violations;

template <typename T>
T Or(T value, T fallback) {
  return value == T{} ? fallback : value;
}

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

void CheckName(const std::string& name, Violations& v) {
  if (name.empty()) {
    v.Add("name", "required: letters, digits, '.', '_' and '-' (it names the output folder)");
    return;
  }
  if (name.size() > kMaxJobNameLength) {
    v.Add("name", absl::StrCat("a name of ", name.size(), " bytes exceeds the limit of ",
                               kMaxJobNameLength));
    return;
  }
  for (char c : name) {
    if (!IsNameChar(c)) {
      v.Add("name", absl::StrCat("must match [A-Za-z0-9._-]+ (it names the output folder), got ",
                                 plan::Quote(name)));
      return;
    }
  }
  if (name == "." || name == "..") {
    v.Add("name", absl::StrCat(plan::Quote(name), " cannot name a folder"));
  }
}

// A finite value >= 0 (0 meaning the default).
void CheckNonNegative(const std::string& field, double value, Violations& v) {
  if (!std::isfinite(value) || value < 0) {
    v.Add(field, absl::StrCat("must be a finite number >= 0, got ", value));
  }
}

// A momentum coefficient in [0, 1).
void CheckBeta(const std::string& field, double value, Violations& v) {
  if (!std::isfinite(value) || value < 0 || value >= 1) {
    v.Add(field, absl::StrCat("must be in [0, 1), got ", value));
  }
}

void CheckDecayProduct(const std::string& field, double lr, double weight_decay, Violations& v) {
  if (std::isfinite(lr) && std::isfinite(weight_decay) && lr >= 0 && weight_decay >= 0 &&
      lr * weight_decay > 1) {
    v.Add(field, absl::StrCat("lr * weight_decay = ", lr * weight_decay,
                              " > 1 would flip the sign of every weight"));
  }
}

optim::MuonOptions MuonFromProto(const v1::MuonConfig& m) {
  optim::MuonOptions o;
  o.lr = Or(m.lr(), kMuonLr);
  o.momentum = Or(m.momentum(), kMuonMomentum);
  o.nesterov = m.has_nesterov() ? m.nesterov() : true;
  o.weight_decay = m.weight_decay();
  o.scale =
      m.scale() == "match_rms_adamw" ? optim::MuonScale::kMatchRmsAdamW : optim::MuonScale::kOriginal;
  o.ns.steps = static_cast<int>(Or<int64_t>(m.ns_steps(), plan::kDefaultNsSteps));
  plan::NsTable table = plan::NsTable::kQuintic;
  plan::ParseNsTable(m.coefficients(), &table);  // checked by PlannerViolations
  o.ns.coefficients = optim::NsCoefficientsOf(table);
  plan::ParseNsAlgorithm(m.ns_algorithm(), &o.ns.algorithm);  // checked by PlannerViolations
  return o;
}

optim::LrSchedule ScheduleFromProto(const v1::LrSchedule& s) {
  optim::LrSchedule o;
  o.warmup_steps = s.warmup_steps();
  o.decay = optim::ParseLrDecay(s.decay()).value_or(optim::LrDecay::kConstant);  // checked
  o.decay_steps = s.decay_steps();
  o.min_lr_ratio = s.min_lr_ratio();
  return o;
}

optim::AdamWOptions AdamWFromProto(const v1::AdamWConfig& a) {
  optim::AdamWOptions o;
  o.lr = Or(a.lr(), kAdamWLr);
  o.beta1 = Or(a.beta1(), kAdamWBeta1);
  o.beta2 = Or(a.beta2(), kAdamWBeta2);
  o.eps = a.has_eps() ? a.eps() : kAdamWEps;
  o.weight_decay = a.weight_decay();
  return o;
}

// The Newton-Schulz settings (ns_steps, coefficients, ns_algorithm) are the
// planner's options: plan::Validate checks them (PlannerViolations).
// `planner_flagged`: it found one of them wrong.
void CheckMuon(const v1::MuonConfig& m, bool planner_flagged, Violations& v) {
  const size_t before = v.size();
  CheckNonNegative("optimizer.muon.lr", m.lr(), v);
  CheckBeta("optimizer.muon.momentum", m.momentum(), v);
  CheckNonNegative("optimizer.muon.weight_decay", m.weight_decay(), v);
  CheckDecayProduct("optimizer.muon.weight_decay", Or(m.lr(), kMuonLr), m.weight_decay(), v);
  if (!m.scale().empty() && m.scale() != "original" && m.scale() != "match_rms_adamw") {
    v.Add("optimizer.muon.scale", absl::StrCat("unknown scale ", plan::Quote(m.scale()),
                                               " (expected original or match_rms_adamw)"));
  }
  if (m.has_momentum_warmup()) {
    CheckBeta("optimizer.muon.momentum_warmup.start", m.momentum_warmup().start(), v);
    if (m.momentum_warmup().steps() < 1) {
      v.Add("optimizer.muon.momentum_warmup.steps",
            absl::StrCat("must be >= 1 (the steps over which momentum rises from start), got ",
                         m.momentum_warmup().steps()));
    }
  }
  if (m.has_qk_clip() && !(std::isfinite(m.qk_clip()) && m.qk_clip() > 0)) {
    v.Add("optimizer.muon.qk_clip",
          absl::StrCat("must be > 0 (the largest attention logit kept, tau; Kimi K2 used 100), "
                       "got ", m.qk_clip()));
  }
  if (m.has_health_every() && m.health_every() < 0) {
    v.Add("optimizer.muon.health_every",
          absl::StrCat("must be >= 0 (steps between orthogonality checks; 0: never), got ",
                       m.health_every()));
  }
  // The numerics' own check, as a safety net: anything it refuses that the
  // checks above let through is reported too, rather than failing at step 1.
  if (v.size() == before && !planner_flagged) {
    if (absl::Status s = optim::ValidateMuonOptions(MuonFromProto(m)); !s.ok()) {
      v.Add("optimizer.muon", std::string(s.message()));
    }
  }
}

void CheckAdamW(const v1::AdamWConfig& a, Violations& v) {
  const size_t before = v.size();
  CheckNonNegative("optimizer.adamw.lr", a.lr(), v);
  CheckBeta("optimizer.adamw.beta1", a.beta1(), v);
  CheckBeta("optimizer.adamw.beta2", a.beta2(), v);
  if (a.has_eps() && (!std::isfinite(a.eps()) || a.eps() <= 0)) {
    v.Add("optimizer.adamw.eps", absl::StrCat("must be a finite number > 0, got ", a.eps()));
  }
  CheckNonNegative("optimizer.adamw.weight_decay", a.weight_decay(), v);
  CheckDecayProduct("optimizer.adamw.weight_decay", Or(a.lr(), kAdamWLr), a.weight_decay(), v);
  if (v.size() == before) {
    if (absl::Status s = optim::ValidateAdamWOptions(AdamWFromProto(a)); !s.ok()) {
      v.Add("optimizer.adamw", std::string(s.message()));
    }
  }
}

// A rule's optimizer and rates: at least one given; a rate > 0, a decay
// >= 0 whose product with the rate it runs at stays <= 1.
void CheckRuleRates(const v1::OptimizerConfig& opt, const v1::OptimizerRule& r,
                    const std::string& path, Violations& v) {
  if (!r.optimizer().empty() && r.optimizer() != "muon" && r.optimizer() != "adamw") {
    v.Add(path + ".optimizer", absl::StrCat("unknown optimizer ", plan::Quote(r.optimizer()),
                                            " (expected muon or adamw)"));
  }
  if (r.optimizer().empty() && !r.has_lr_scale() && !r.has_weight_decay()) {
    v.Add(path, "sets nothing: give optimizer (muon or adamw), lr_scale or weight_decay");
  }
  if (r.has_lr_scale() && !(std::isfinite(r.lr_scale()) && r.lr_scale() > 0)) {
    v.Add(path + ".lr_scale", absl::StrCat("must be a finite number > 0, got ", r.lr_scale()));
  }
  if (!r.has_weight_decay()) return;
  CheckNonNegative(path + ".weight_decay", r.weight_decay(), v);
  // The largest rate the matched tensors may run at: their optimizer's, or
  // either one's when the rule keeps the spec's choice.
  const double muon_lr = Or(opt.muon().lr(), kMuonLr);
  const double adamw_lr = Or(opt.adamw().lr(), kAdamWLr);
  const double lr = r.optimizer() == "muon"    ? muon_lr
                    : r.optimizer() == "adamw" ? adamw_lr
                                               : std::max(muon_lr, adamw_lr);
  CheckDecayProduct(path + ".weight_decay", lr * (r.has_lr_scale() ? r.lr_scale() : 1.0),
                    r.weight_decay(), v);
}

// owner_assignment and muon_replica_split are the planner's options, checked
// by PlannerViolations.
void CheckOptimizer(const v1::OptimizerConfig& opt, bool planner_flagged_muon, Violations& v) {
  CheckMuon(opt.muon(), planner_flagged_muon, v);
  CheckAdamW(opt.adamw(), v);
  if (opt.muon_buffer_bytes() < 0) {
    v.Add("optimizer.muon_buffer_bytes",
          absl::StrCat("must be >= 0 (0, the default: one wave for the whole model), got ",
                       opt.muon_buffer_bytes()));
  }
  if (static_cast<size_t>(opt.rules_size()) > kMaxOptimizerRules) {
    v.Add("optimizer.rules",
          absl::StrCat(opt.rules_size(), " rules exceed the limit of ", kMaxOptimizerRules));
    return;
  }
  for (int i = 0; i < opt.rules_size(); ++i) {
    const v1::OptimizerRule& r = opt.rules(i);
    const std::string path = absl::StrCat("optimizer.rules[", i, "]");
    if (r.pattern().empty()) {
      v.Add(path + ".pattern", "empty pattern (it must match whole parameter names)");
    } else if (r.pattern().size() > kMaxRulePatternLength) {
      v.Add(path + ".pattern", absl::StrCat("a pattern of ", r.pattern().size(),
                                            " bytes exceeds the limit of ", kMaxRulePatternLength));
    } else if (absl::StatusOr<std::unique_ptr<re2::RE2>> re = CompileRulePattern(r.pattern());
               !re.ok()) {
      v.Add(path + ".pattern", absl::StrCat("invalid regular expression ", plan::Quote(r.pattern()),
                                            " (RE2 syntax): ", re.status().message()));
    }
    CheckRuleRates(opt, r, path, v);
  }
}

// data.text or data.tokens: a training path, and a validation path or a
// held-out fraction.
template <typename CorpusConfig>
void CheckCorpus(const char* field, const CorpusConfig& c, Violations& v) {
  if (c.train().empty()) {
    v.Add(absl::StrCat(field, ".train"), "required: a file or a glob pattern");
  }
  if (c.has_val_fraction()) {
    if (!c.val().empty()) {
      v.Add(absl::StrCat(field, ".val_fraction"), "give val or val_fraction, not both");
    } else if (!std::isfinite(c.val_fraction()) || c.val_fraction() < 0 ||
               c.val_fraction() >= 1) {
      v.Add(absl::StrCat(field, ".val_fraction"),
            absl::StrCat("must be in [0, 1) (0: no validation), got ", c.val_fraction()));
    }
  }
}

// "only the gpt model <one>", or with several kinds on a corpus "only the
// gpt and transformer models <many>".
std::string OnlyTheCorpusModels(const char* one, const char* many) {
  const std::string names = KindNamesUsing(DataUse::kCorpus);
  const bool single = names.find(' ') == std::string::npos;
  return absl::StrCat("only the ", names, single ? " model " : " models ", single ? one : many);
}

// The model section through its kind, and whether the data section is one
// the kind trains on.
// output.export_format: muonmesh (or empty) for any model; hf for a kind
// with a Hugging Face form, and only forms it can write (asked once the
// model section is valid).
void CheckExportFormat(const v1::JobSpec& job, const ModelKind& kind, bool model_valid,
                       Violations& v) {
  const std::string& format = job.output().export_format();
  if (format.empty() || format == "muonmesh") return;
  if (format != "hf") {
    v.Add("output.export_format",
          absl::StrCat("unknown format ", plan::Quote(format), " (expected muonmesh or hf)"));
    return;
  }
  if (kind.hf_export == nullptr) {
    std::vector<std::string> with;
    for (const ModelKind* k : ModelKinds()) {
      if (k->hf_export != nullptr) with.push_back(k->name);
    }
    v.Add("output.export_format",
          absl::StrCat("hf: the ", kind.name, " model has no Hugging Face form (models with one: ",
                       absl::StrJoin(with, ", "), ")"));
    return;
  }
  if (!model_valid) return;
  absl::StatusOr<HfExport> hf = kind.hf_export(kind.resolve(job.model(), ""));
  if (!hf.ok()) v.Add("output.export_format", std::string(hf.status().message()));
}

void CheckModel(const v1::JobSpec& job, Violations& v) {
  const ModelKind* kind = FindModelKind(job.model().kind_case());
  const v1::DataConfig::SourceCase source = job.data().source_case();
  const bool corpus = source == v1::DataConfig::kText || source == v1::DataConfig::kTokens;
  const DataUse data = kind == nullptr ? DataUse::kExamples : kind->data;
  if (corpus && data != DataUse::kCorpus) {
    v.Add(source == v1::DataConfig::kText ? "data.text" : "data.tokens",
          OnlyTheCorpusModels("reads a text corpus", "read a text corpus"));
  }
  if (kind == nullptr) {
    v.Add("model", absl::StrCat("required: give one of ", AllKindNames()));
    return;
  }
  if (data == DataUse::kCorpus && !corpus) {
    v.Add("data", absl::StrCat("required for the ", kind->name,
                               " model: text {train: FILE} (every byte a token) or "
                               "tokens {train: FILE_OR_GLOB} (llm.c .bin shards)"));
  }
  if (data == DataUse::kNone && source != v1::DataConfig::SOURCE_NOT_SET) {
    v.Add("data", absl::StrCat("the ", kind->name,
                               " workload reads no data (its gradients are generated): "
                               "remove data"));
  }
  if (data == DataUse::kNone && job.data().has_shuffle()) {
    v.Add("data.shuffle", absl::StrCat("the ", kind->name,
                                       " workload reads no samples: nothing to shuffle"));
  }
  const size_t before = v.size();
  kind->validate(job, v);
  CheckExportFormat(job, *kind, /*model_valid=*/v.size() == before, v);
  const v1::MuonConfig& muon = job.optimizer().muon();
  // (A qk_clip <= 0 is CheckMuon's: one violation for one mistake.)
  const bool qk_clip = muon.has_qk_clip() && muon.qk_clip() > 0;
  if (qk_clip && kind->attention_blocks != nullptr && job.device() == "cuda") {
    v.Add("optimizer.muon.qk_clip",
          "not on device cuda yet: the GPU forms do not record attention logits (use device cpu)");
  }
  if ((muon.split_qkv() || muon.per_head() || qk_clip) && kind->attention_blocks == nullptr) {
    std::vector<std::string> with;
    for (const ModelKind* k : ModelKinds()) {
      if (k->attention_blocks != nullptr) with.push_back(k->name);
    }
    v.Add(muon.per_head()    ? "optimizer.muon.per_head"
          : muon.split_qkv() ? "optimizer.muon.split_qkv"
                             : "optimizer.muon.qk_clip",
          absl::StrCat("the ", kind->name, " model has no attention (models with attention: ",
                       absl::StrJoin(with, ", "), ")"));
  }
}

void CheckInitAndData(const v1::JobSpec& job, Violations& v) {
  if (job.init().source_case() == v1::InitConfig::kSafetensors &&
      job.init().safetensors().empty()) {
    v.Add("init.safetensors", "empty path");
  }
  if (job.init().source_case() == v1::InitConfig::kCheckpoint && job.init().checkpoint().empty()) {
    v.Add("init.checkpoint", "empty path");
  }
  if (job.init().fresh_optimizer_state() &&
      job.init().source_case() != v1::InitConfig::kCheckpoint) {
    v.Add("init.fresh_optimizer_state", "only means something with init.checkpoint");
  }
  const v1::DataConfig& data = job.data();
  if (data.source_case() == v1::DataConfig::kSafetensors && data.safetensors().empty()) {
    v.Add("data.safetensors", "empty path");
  }
  if (data.source_case() == v1::DataConfig::kText) CheckCorpus("data.text", data.text(), v);
  if (data.source_case() == v1::DataConfig::kTokens) {
    CheckCorpus("data.tokens", data.tokens(), v);
  }
  if (data.source_case() == v1::DataConfig::kTeacher) {
    const int64_t samples = data.teacher().samples();
    if (samples < 0) {
      v.Add("data.teacher.samples", absl::StrCat("must be >= 1, got ", samples));
    } else if (samples > kMaxTeacherSamples) {
      v.Add("data.teacher.samples",
            absl::StrCat(samples, " exceeds the limit of ", kMaxTeacherSamples));
    }
  }
}

// The schedule and clipping (docs/architecture.md §5, "The recipe").
void CheckRecipe(const v1::TrainingConfig& t, Violations& v) {
  if (t.has_lr_schedule()) {
    if (!optim::ParseLrDecay(t.lr_schedule().decay()).has_value()) {
      v.Add("training.lr_schedule.decay",
            absl::StrCat("unknown decay ", plan::Quote(t.lr_schedule().decay()),
                         " (expected constant, cosine, linear or wsd)"));
    } else {
      std::string field;
      const std::string why = optim::ScheduleError(ScheduleFromProto(t.lr_schedule()), t.steps(),
                                                  "training.lr_schedule", &field);
      if (!why.empty()) v.Add(field, why);
    }
  }
  if (t.micro_batch_size() < 0) {
    v.Add("training.micro_batch_size",
          absl::StrCat("must be >= 0 (0 or unset: the whole local batch), got ",
                       t.micro_batch_size()));
  }
  if (t.has_clip_grad_norm() && !(std::isfinite(t.clip_grad_norm()) && t.clip_grad_norm() > 0)) {
    v.Add("training.clip_grad_norm",
          absl::StrCat("must be a finite number > 0 (leave it out for no clipping), got ",
                       t.clip_grad_norm()));
  }
}

void CheckTraining(const v1::JobSpec& job, Violations& v) {
  const v1::TrainingConfig& t = job.training();
  if (t.steps() < 1) {
    v.Add("training.steps", t.steps() == 0 ? std::string("required: must be >= 1")
                                           : absl::StrCat("must be >= 1, got ", t.steps()));
  } else if (t.steps() > kMaxTrainingSteps) {
    v.Add("training.steps", absl::StrCat(t.steps(), " exceeds the limit of ", kMaxTrainingSteps));
  }
  const int64_t batch = t.global_batch_size();
  const int64_t w = job.world_size();
  if (batch < 1) {
    v.Add("training.global_batch_size", batch == 0 ? std::string("required: must be >= 1")
                                                   : absl::StrCat("must be >= 1, got ", batch));
  } else if (batch > kMaxGlobalBatchSize) {
    v.Add("training.global_batch_size",
          absl::StrCat(batch, " exceeds the limit of ", kMaxGlobalBatchSize));
  } else if (w >= 1 && w <= kMaxJobWorldSize && batch % w != 0) {
    // Every rank is data-parallel (no tensor or pipeline parallelism), so
    // the batch splits over all world_size ranks.
    v.Add("training.global_batch_size", absl::StrCat(batch, " does not split evenly over the ", w,
                                                     " data-parallel ranks (world_size)"));
  } else if (const int64_t micro = t.micro_batch_size();
             w >= 1 && w <= kMaxJobWorldSize && micro > 0 && (batch / w) % micro != 0) {
    v.Add("training.micro_batch_size",
          absl::StrCat(micro, " does not divide the local batch of ", batch / w,
                       " samples (global_batch_size ", batch, " over ", w, " ranks)"));
  }
  // A batch larger than the data set would repeat samples within a batch.
  const ModelKind* kind = FindModelKind(job.model().kind_case());
  const bool teacher = (job.data().source_case() == v1::DataConfig::kTeacher ||
                        job.data().source_case() == v1::DataConfig::SOURCE_NOT_SET) &&
                       kind != nullptr && kind->data == DataUse::kExamples;
  const int64_t samples = Or(job.data().teacher().samples(), kDefaultTeacherSamples);
  if (teacher && batch > samples && samples > 0 && batch <= kMaxGlobalBatchSize) {
    v.Add("training.global_batch_size",
          absl::StrCat(batch, " exceeds the ", samples, " samples of the teacher data set (",
                       job.data().teacher().samples() == 0 ? "the default of "
                                                           : "data.teacher.samples ",
                       samples, ")"));
  }
  if (t.keep_checkpoints() < 0 || t.keep_checkpoints() > kMaxKeepCheckpoints) {
    v.Add("training.keep_checkpoints",
          absl::StrCat("must be in [0, ", kMaxKeepCheckpoints, "] (0 or unset: ",
                       kDefaultKeepCheckpoints, "), got ", t.keep_checkpoints()));
  }
  if (t.checkpoint_every() < 0) {
    v.Add("training.checkpoint_every",
          absl::StrCat("must be >= 0 (0: no checkpoints), got ", t.checkpoint_every()));
  }
  if (t.max_restarts() < 0 || t.max_restarts() > kMaxRestarts) {
    v.Add("training.max_restarts",
          absl::StrCat("must be in [0, ", kMaxRestarts, "], got ", t.max_restarts()));
  }
  if (t.eval_every() < 0) {
    v.Add("training.eval_every",
          absl::StrCat("must be >= 0 (0: after the last step only), got ", t.eval_every()));
  }
  if (t.eval_batches() < 0 || t.eval_batches() > kMaxEvalBatches) {
    v.Add("training.eval_batches", absl::StrCat("must be in [0, ", kMaxEvalBatches,
                                                "] (0 or unset: ", kDefaultEvalBatches, "), got ",
                                                t.eval_batches()));
  }
  CheckRecipe(t, v);
  if ((t.eval_every() != 0 || t.eval_batches() != 0) &&
      (kind == nullptr || kind->data != DataUse::kCorpus)) {
    v.Add(t.eval_every() != 0 ? "training.eval_every" : "training.eval_batches",
          OnlyTheCorpusModels("has validation data", "have validation data"));
  }
}

// The planner's checks of what the job hands it that do not depend on the
// model, run on a one-parameter placeholder model at `world_size`, under the
// job file's field names: the parallelism config and, with `options`, the
// planner options (PlanOptionsOf: Newton-Schulz settings, owner rule,
// replica split, threads). One set of checks and defaults for the planner
// and the job file. The device and the Muon buffer keep their own checks
// here (the planner reads an empty device as cuda; a job file, as cpu).
std::vector<plan::FieldViolation> PlannerViolations(const v1::JobSpec& job, int64_t world_size,
                                                    bool options) {
  static constexpr std::pair<std::string_view, std::string_view> kOptionFields[] = {
      {"options.owner_assignment", "optimizer.owner_assignment"},
      {"options.muon_replica_split", "optimizer.muon_replica_split"},
      {"options.ns_steps", "optimizer.muon.ns_steps"},
      {"options.ns_coefficients", "optimizer.muon.coefficients"},
      {"options.ns_algorithm", "optimizer.muon.ns_algorithm"},
      {"options.threads_per_rank", "training.threads_per_rank"},
  };
  plan::PlanInput input;
  input.world_size = world_size;
  input.parallelism = convert::ParallelismFromProto(job.parallelism());
  if (options) input.options = PlanOptionsOf(job);
  input.model.name = "placeholder";
  input.model.units.push_back({"unit", {{"param", {1}, "adamw", false}}});
  std::vector<plan::FieldViolation> out;
  for (plan::FieldViolation& f : plan::Validate(input)) {
    if (f.field.rfind("parallelism.", 0) == 0) {
      out.push_back(std::move(f));
      continue;
    }
    if (!options) continue;
    for (const auto& [planner, file] : kOptionFields) {
      if (f.field == planner) {
        out.push_back({std::string(file), std::move(f.description)});
        break;
      }
    }
  }
  return out;
}

void CheckElastic(const v1::JobSpec& job, Violations& v) {
  if (!job.training().has_elastic()) return;
  const v1::ElasticConfig& e = job.training().elastic();
  const int64_t w = job.world_size();
  absl::Duration wait;
  if (!e.wait().empty() && (!absl::ParseDuration(e.wait(), &wait) || wait < absl::ZeroDuration() ||
                            wait > kMaxElasticWait)) {
    v.Add("training.elastic.wait",
          absl::StrCat("'", e.wait().substr(0, 40), "' is not a duration in [0s, ",
                       absl::FormatDuration(kMaxElasticWait), "] such as 30s or 2m"));
  }
  if (job.training().max_restarts() < 1) {
    v.Add("training.elastic",
          "needs training.max_restarts >= 1: the attempt that loses a worker fails as any does, "
          "and the job goes on shrunk as its restart");
  }
  if (e.min_world_size() < 1 || e.min_world_size() >= w) {
    v.Add("training.elastic.min_world_size",
          absl::StrCat("must be in [1, world_size ", w, "), got ", e.min_world_size()));
  } else if (w <= kMaxJobWorldSize && ElasticWorldSizes(job).empty()) {
    v.Add("training.elastic.min_world_size",
          absl::StrCat("no world size in [", e.min_world_size(), ", ", w,
                       ") splits training.global_batch_size ", job.training().global_batch_size(),
                       " evenly and fits the parallelism config: the job could never shrink"));
  }
}

// Adds a violation unless `path` is an existing regular file.
void CheckInputFile(const std::string& field, const std::string& path, Violations& v) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) {
    v.Add(field, absl::StrCat(path, ": no such file"));
  } else if (ec) {
    v.Add(field, absl::StrCat(path, ": ", ec.message()));
  } else if (st.type() != fs::file_type::regular) {
    v.Add(field, absl::StrCat(path, ": not a regular file"));
  }
}

// Outputs are written to a temporary file and renamed over their path, which
// would replace whatever is there: refuse, before anything runs, a path that
// exists and is not what the job writes (a device such as /dev/full, a FIFO,
// a socket, a folder, or a symbolic link, whose target the rename would not
// write but unlink).
void CheckOutputFile(const std::string& field, const std::string& path, Violations& v) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (st.type() == fs::file_type::not_found) return;
  if (ec) {
    v.Add(field, absl::StrCat(path, ": ", ec.message()));
  } else if (st.type() == fs::file_type::symlink) {
    v.Add(field, absl::StrCat(path, ": is a symbolic link; outputs are replaced by rename, "
                                    "so give the link's target instead"));
  } else if (st.type() != fs::file_type::regular) {
    v.Add(field, absl::StrCat(path, ": exists and is not a regular file (a device, FIFO, socket "
                                    "or folder); refusing to replace it"));
  }
}

// A folder the job writes into: absent, or a folder (links to folders are
// fine: nothing replaces the folder itself).
// communication.backend: nccl or gloo, nccl only where there is a GPU.
void CheckCommBackend(const v1::JobSpec& job, Violations& v) {
  const std::string& backend = job.communication().backend();
  if (!backend.empty() && backend != "nccl" && backend != "gloo") {
    v.Add("communication.backend",
          absl::StrCat("unknown backend ", plan::Quote(backend),
                       " (expected nccl or gloo; unset: nccl on device cuda, gloo on cpu)"));
  } else if (backend == "nccl" && DeviceOf(job) != "cuda") {
    v.Add("communication.backend",
          absl::StrCat("nccl needs device cuda (this job's device is ", DeviceOf(job),
                       "): use gloo, or leave it unset"));
  }
}

void CheckOutputFolder(const std::string& field, const std::string& path, Violations& v) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) return;
  if (ec) {
    v.Add(field, absl::StrCat(path, ": ", ec.message()));
  } else if (st.type() != fs::file_type::directory) {
    v.Add(field, absl::StrCat(path, ": exists and is not a folder"));
  }
}

}  // namespace

std::vector<plan::FieldViolation> CheckOutputPaths(const std::string& output_dir,
                                                   const std::string& export_path) {
  Violations v;
  CheckOutputFolder("output.dir", output_dir, v);
  CheckOutputFolder("output.dir", (fs::path(output_dir) / "checkpoints").string(), v);
  CheckOutputFolder("output.dir", (fs::path(output_dir) / "metrics").string(), v);
  if (!export_path.empty()) {
    const fs::path parent = fs::path(export_path).parent_path();
    if (!parent.empty()) CheckOutputFolder("output.export", parent.string(), v);
    CheckOutputFile("output.export", export_path, v);
  }
  return v.Take();
}

std::string DeviceOf(const v1::JobSpec& job) {
  return job.device().empty() ? "cpu" : job.device();
}

std::string CommBackendOf(const v1::JobSpec& job) {
  if (!job.communication().backend().empty()) return job.communication().backend();
  return DeviceOf(job) == "cuda" ? "nccl" : "gloo";
}

std::string JoinViolations(const std::vector<plan::FieldViolation>& violations) {
  std::vector<std::string> parts;
  parts.reserve(violations.size());
  for (const plan::FieldViolation& f : violations) parts.push_back(f.field + ": " + f.description);
  return absl::StrJoin(parts, "; ");
}

absl::StatusOr<v1::JobSpec> LoadJobFile(const std::string& path) {
  v1::JobSpec job;
  MUONMESH_RETURN_IF_ERROR(protoio::LoadMessageFile(path, &job));
  return job;
}

std::vector<plan::FieldViolation> ValidateJob(const v1::JobSpec& job) {
  Violations v;
  CheckName(job.name(), v);
  if (job.world_size() < 1) {
    v.Add("world_size", job.world_size() == 0
                            ? std::string("required: must be >= 1")
                            : absl::StrCat("must be >= 1, got ", job.world_size()));
  } else if (job.world_size() > kMaxJobWorldSize) {
    v.Add("world_size",
          absl::StrCat(job.world_size(), " exceeds the limit of ", kMaxJobWorldSize, " ranks"));
  }
  if (!job.device().empty() && job.device() != "cpu" && job.device() != "cuda") {
    v.Add("device",
          absl::StrCat("unknown device ", plan::Quote(job.device()), " (expected cpu or cuda)"));
  }
  bool planner_flagged_muon = false;
  for (plan::FieldViolation& f : PlannerViolations(job, job.world_size(), /*options=*/true)) {
    planner_flagged_muon |= f.field.rfind("optimizer.muon.", 0) == 0;
    v.Add(std::move(f.field), std::move(f.description));
  }
  CheckModel(job, v);
  CheckInitAndData(job, v);
  CheckOptimizer(job.optimizer(), planner_flagged_muon, v);
  CheckTraining(job, v);
  CheckElastic(job, v);
  if (job.communication().has_bucket_bytes() && job.communication().bucket_bytes() < 0) {
    v.Add("communication.bucket_bytes",
          absl::StrCat("must be >= 0 (0: one unit a collective; unset: ",
                       plan::kDefaultBucketBytes, "), got ", job.communication().bucket_bytes()));
  }
  if (job.communication().window_bytes() < 0) {
    v.Add("communication.window_bytes",
          absl::StrCat("must be >= 0 (0 or unset: no limit; across slow links about the "
                       "bandwidth-delay product), got ", job.communication().window_bytes()));
  }
  CheckCommBackend(job, v);
  return v.Take();
}

namespace {

// A job's paths, resolved against its file's folder ("" when not used).
struct JobPaths {
  std::string init, init_checkpoint, data, output_dir, export_path;
  std::string corpus_field;            // "data.text" | "data.tokens" | ""
  std::string corpus_train, corpus_val;  // files or patterns
  std::optional<ModelFile> model_file;  // the file the model section names, path resolved
};

JobPaths ResolveJobPaths(const v1::JobSpec& job, const std::string& job_dir) {
  JobPaths p;
  if (job.init().source_case() == v1::InitConfig::kSafetensors) {
    p.init = ResolveJobPath(job_dir, job.init().safetensors());
  }
  if (job.init().source_case() == v1::InitConfig::kCheckpoint) {
    p.init_checkpoint = ResolveJobPath(job_dir, job.init().checkpoint());
  }
  if (job.data().source_case() == v1::DataConfig::kSafetensors) {
    p.data = ResolveJobPath(job_dir, job.data().safetensors());
  }
  if (job.data().source_case() == v1::DataConfig::kText) {
    p.corpus_field = "data.text";
    p.corpus_train = ResolveJobPath(job_dir, job.data().text().train());
    p.corpus_val = ResolveJobPath(job_dir, job.data().text().val());
  } else if (job.data().source_case() == v1::DataConfig::kTokens) {
    p.corpus_field = "data.tokens";
    p.corpus_train = ResolveJobPath(job_dir, job.data().tokens().train());
    p.corpus_val = ResolveJobPath(job_dir, job.data().tokens().val());
  }
  p.model_file = ModelFileOf(job.model());
  if (p.model_file.has_value()) p.model_file->path = ResolveJobPath(job_dir, p.model_file->path);
  p.output_dir = ResolveJobPath(
      job_dir, job.output().dir().empty() ? absl::StrCat("runs/", job.name()) : job.output().dir());
  const bool hf = job.output().export_format() == "hf";
  p.export_path = job.output().export_().empty()
                      ? (fs::path(p.output_dir) / (hf ? "hf/model.safetensors" : "final.safetensors"))
                            .string()
                      : ResolveJobPath(job_dir, job.output().export_());
  return p;
}

// Inputs that must be readable files, outputs that must be writable.
void CheckJobPaths(const JobPaths& p, std::vector<plan::FieldViolation>& violations) {
  Violations files;
  if (!p.init.empty()) CheckInputFile("init.safetensors", p.init, files);
  if (!p.init_checkpoint.empty()) {
    std::error_code ec;
    if (!fs::is_directory(p.init_checkpoint, ec)) {
      CheckInputFile("init.checkpoint", p.init_checkpoint, files);
    }
  }
  if (!p.data.empty()) CheckInputFile("data.safetensors", p.data, files);
  if (p.model_file.has_value() && !p.model_file->given_inline) {
    CheckInputFile(p.model_file->field, p.model_file->path, files);
  }
  for (const auto& [suffix, path] : {std::pair{".train", &p.corpus_train},
                                     std::pair{".val", &p.corpus_val}}) {
    if (p.corpus_field.empty() || path->empty()) continue;
    const std::string field = p.corpus_field + suffix;
    // The message names the field already ("data.text.train: ...").
    if (absl::StatusOr<std::vector<std::string>> f = ExpandCorpus(field, *path); !f.ok()) {
      const std::string message(f.status().message());
      files.Add(field, message.substr(std::min(message.size(), field.size() + 2)));
    }
  }
  for (plan::FieldViolation& f : files.Take()) violations.push_back(std::move(f));
  for (plan::FieldViolation& f : CheckOutputPaths(p.output_dir, p.export_path)) {
    violations.push_back(std::move(f));
  }
}

// The corpus of a validated job (data.text or data.tokens), paths resolved.
Corpus ResolveCorpus(const v1::JobSpec& job, const JobPaths& paths) {
  Corpus c;
  const bool tokens = job.data().source_case() == v1::DataConfig::kTokens;
  const bool has_fraction =
      tokens ? job.data().tokens().has_val_fraction() : job.data().text().has_val_fraction();
  const double fraction =
      tokens ? job.data().tokens().val_fraction() : job.data().text().val_fraction();
  c.tokens = tokens;
  c.train = paths.corpus_train;
  c.val = paths.corpus_val;
  c.val_fraction = !paths.corpus_val.empty() ? 0
                   : has_fraction           ? fraction
                                            : kDefaultValFraction;
  return c;
}

}  // namespace

std::vector<int64_t> ElasticWorldSizes(const v1::JobSpec& job) {
  std::vector<int64_t> sizes;
  if (!job.training().has_elastic()) return sizes;
  const int64_t batch = job.training().global_batch_size();
  for (int64_t w = job.world_size() - 1;
       w >= std::max<int64_t>(1, job.training().elastic().min_world_size()); --w) {
    const int64_t micro = job.training().micro_batch_size();
    if (batch % w == 0 && (micro <= 0 || (batch / w) % micro == 0) &&
        PlannerViolations(job, w, /*options=*/false).empty()) {
      sizes.push_back(w);
    }
  }
  return sizes;
}

absl::Duration ElasticWait(const v1::JobSpec& job) {
  absl::Duration wait = kDefaultElasticWait;
  const std::string& text = job.training().elastic().wait();
  if (!text.empty() && !absl::ParseDuration(text, &wait)) return kDefaultElasticWait;
  return wait;
}

std::vector<plan::FieldViolation> JobViolations(const v1::JobSpec& job,
                                                const std::string& job_dir) {
  std::vector<plan::FieldViolation> violations = ValidateJob(job);
  CheckJobPaths(ResolveJobPaths(job, job_dir), violations);
  return violations;
}

namespace {

// The communication section, its defaults applied.
void ResolveCommunication(const v1::JobSpec& job, ResolvedJob& r) {
  const v1::CommunicationConfig& c = job.communication();
  r.bucket_bytes = c.has_bucket_bytes() ? c.bucket_bytes() : plan::kDefaultBucketBytes;
  r.comm_backend = CommBackendOf(job);
  r.prefetch_gathers = !c.has_prefetch() || c.prefetch();
  r.window_bytes = c.window_bytes();
  r.muon_in_backward = !c.has_muon_in_backward() || c.muon_in_backward();
  r.reshard_after_forward = !c.has_reshard_after_forward() || c.reshard_after_forward();
  r.overlap_param_gather = !c.has_overlap_param_gather() || c.overlap_param_gather();
}

}  // namespace

absl::StatusOr<ResolvedJob> ResolveJob(const v1::JobSpec& job, const std::string& job_dir) {
  if (const std::vector<plan::FieldViolation> v = JobViolations(job, job_dir); !v.empty()) {
    return absl::InvalidArgumentError(JoinViolations(v));
  }
  const JobPaths paths = ResolveJobPaths(job, job_dir);

  ResolvedJob r;
  r.name = job.name();
  r.world_size = job.world_size();
  r.spec = job;
  r.fresh_start = job.init().fresh();
  r.device = DeviceOf(job);
  r.parallelism = convert::ParallelismFromProto(job.parallelism());
  r.owner_assignment =
      job.optimizer().owner_assignment().empty() ? "lpt" : job.optimizer().owner_assignment();
  r.muon_buffer_bytes = job.optimizer().muon_buffer_bytes();
  ResolveCommunication(job, r);
  r.muon_replica_split =
      job.optimizer().muon_replica_split().empty() ? "auto" : job.optimizer().muon_replica_split();
  r.muon = MuonFromProto(job.optimizer().muon());
  r.adamw = AdamWFromProto(job.optimizer().adamw());
  if (job.optimizer().muon().has_momentum_warmup()) {
    r.momentum_warmup = optim::MomentumWarmup{job.optimizer().muon().momentum_warmup().start(),
                                             job.optimizer().muon().momentum_warmup().steps()};
  }
  if (job.optimizer().muon().has_qk_clip()) r.qk_clip = job.optimizer().muon().qk_clip();
  if (job.optimizer().muon().has_health_every()) {
    r.muon_health_every = job.optimizer().muon().health_every();
  }
  r.optimizer_rules = OptimizerRulesOf(job);

  r.kind = FindModelKind(job.model().kind_case());
  if (r.kind == nullptr) {
    return absl::InternalError("ResolveJob: a job without a model passed validation");
  }
  r.model = job.model();
  r.model_form = r.kind->resolve(job.model(), job_dir);
  if (!job.communication().has_reshard_after_forward()) {
    // Unset: by the model's size (the planner's input says the same). A
    // model without a spec fails where the job is planned.
    absl::StatusOr<plan::ModelSpec> spec = ModelSpecOf(r);
    if (spec.ok()) r.reshard_after_forward = ReshardsAfterForward(job, *spec);
  }
  r.model_file = paths.model_file;
  if (!paths.corpus_field.empty()) r.corpus = ResolveCorpus(job, paths);

  if (job.init().source_case() == v1::InitConfig::kSafetensors) {
    r.init_safetensors = paths.init;
  } else if (job.init().source_case() == v1::InitConfig::kCheckpoint) {
    r.init_checkpoint = paths.init_checkpoint;
    r.fresh_optimizer_state = job.init().fresh_optimizer_state();
  } else {
    r.init_seed = job.init().seed();  // 0 when init is not given
  }
  if (job.data().has_shuffle()) r.shuffle_seed = job.data().shuffle().seed();
  if (job.data().source_case() == v1::DataConfig::kSafetensors) {
    r.data_safetensors = paths.data;
  } else {
    r.teacher_seed = job.data().teacher().seed();  // 0 when data is not given
    r.teacher_samples = Or(job.data().teacher().samples(), kDefaultTeacherSamples);
  }

  r.steps = job.training().steps();
  r.global_batch_size = job.training().global_batch_size();
  r.checkpoint_every = job.training().checkpoint_every();
  r.keep_checkpoints = Or(job.training().keep_checkpoints(), kDefaultKeepCheckpoints);
  r.max_restarts = job.training().max_restarts();
  r.threads_per_rank = std::max(1, job.training().threads_per_rank());
  r.eval_every = job.training().eval_every();
  r.eval_batches = Or(job.training().eval_batches(), kDefaultEvalBatches);
  r.lr_schedule = ScheduleFromProto(job.training().lr_schedule());
  if (job.training().has_clip_grad_norm()) r.clip_grad_norm = job.training().clip_grad_norm();
  r.micro_batch_size = job.training().micro_batch_size();

  r.output_dir = paths.output_dir;
  r.export_path = paths.export_path;
  r.export_format = job.output().export_format().empty() ? "muonmesh" : job.output().export_format();
  return r;
}

v1::JobSpec FilledSpec(const ResolvedJob& r) {
  v1::JobSpec out = r.spec;
  out.set_device(r.device);
  v1::OptimizerConfig& opt = *out.mutable_optimizer();
  opt.set_owner_assignment(r.owner_assignment);
  opt.set_muon_replica_split(r.muon_replica_split);
  out.mutable_communication()->set_bucket_bytes(r.bucket_bytes);
  out.mutable_communication()->set_backend(r.comm_backend);
  out.mutable_communication()->set_prefetch(r.prefetch_gathers);
  out.mutable_communication()->set_window_bytes(r.window_bytes);
  out.mutable_communication()->set_muon_in_backward(r.muon_in_backward);
  out.mutable_communication()->set_reshard_after_forward(r.reshard_after_forward);
  out.mutable_communication()->set_overlap_param_gather(r.overlap_param_gather);
  v1::MuonConfig& muon = *opt.mutable_muon();
  muon.set_lr(r.muon.lr);
  muon.set_momentum(r.muon.momentum);
  muon.set_nesterov(r.muon.nesterov);
  muon.set_ns_steps(r.muon.ns.steps);
  muon.set_weight_decay(r.muon.weight_decay);
  muon.set_scale(r.muon.scale == optim::MuonScale::kMatchRmsAdamW ? "match_rms_adamw"
                                                                   : "original");
  muon.set_coefficients(plan::NsTableName(*optim::NsTableOf(r.muon.ns.coefficients)));
  muon.set_ns_algorithm(plan::NsAlgorithmName(r.muon.ns.algorithm));
  muon.set_health_every(r.muon_health_every);
  v1::AdamWConfig& adamw = *opt.mutable_adamw();
  adamw.set_lr(r.adamw.lr);
  adamw.set_beta1(r.adamw.beta1);
  adamw.set_beta2(r.adamw.beta2);
  adamw.set_eps(r.adamw.eps);
  adamw.set_weight_decay(r.adamw.weight_decay);

  v1::InitConfig& init = *out.mutable_init();
  if (r.init_seed.has_value()) init.set_seed(*r.init_seed);
  if (!r.init_safetensors.empty()) init.set_safetensors(r.init_safetensors);
  if (!r.init_checkpoint.empty()) init.set_checkpoint(r.init_checkpoint);
  init.set_fresh(r.fresh_start);
  v1::DataConfig& data = *out.mutable_data();
  if (!r.data_safetensors.empty()) data.set_safetensors(r.data_safetensors);
  if (r.kind->data == DataUse::kExamples && r.teacher_seed.has_value()) {
    data.mutable_teacher()->set_seed(*r.teacher_seed);
    data.mutable_teacher()->set_samples(r.teacher_samples);
  }
  if (r.kind->data == DataUse::kCorpus) {
    auto fill = [&r](auto* corpus) {
      corpus->set_train(r.corpus.train);
      corpus->set_val(r.corpus.val);
      if (r.corpus.val.empty()) corpus->set_val_fraction(r.corpus.val_fraction);
    };
    if (r.corpus.tokens) fill(data.mutable_tokens());
    if (!r.corpus.tokens) fill(data.mutable_text());
  }

  if (const auto* tr = std::get_if<TransformerModel>(&r.model_form)) {
    v1::TransformerModel& m = *out.mutable_model()->mutable_transformer();
    m.set_n_kv_head(tr->dims.n_kv_head);
    m.set_head_dim(tr->dims.head_dim);
    m.set_norm_eps(tr->dims.norm_eps);
    m.set_rope_theta(tr->dims.rope_theta);
    if (m.attention().empty()) m.set_attention("mha");
  }
  v1::TrainingConfig& t = *out.mutable_training();
  t.set_keep_checkpoints(r.keep_checkpoints);
  t.set_threads_per_rank(static_cast<int32_t>(r.threads_per_rank));
  t.set_eval_batches(r.eval_batches);
  t.mutable_lr_schedule()->set_decay(optim::LrDecayName(r.lr_schedule.decay));
  out.mutable_output()->set_dir(r.output_dir);
  out.mutable_output()->set_export_(r.export_path);
  out.mutable_output()->set_export_format(r.export_format);
  return out;
}

std::vector<OptimizerRule> OptimizerRulesOf(const v1::JobSpec& job) {
  std::vector<OptimizerRule> rules;
  for (const v1::OptimizerRule& r : job.optimizer().rules()) {
    OptimizerRule rule{r.pattern(), r.optimizer(), std::nullopt, std::nullopt};
    if (r.has_lr_scale()) rule.lr_scale = r.lr_scale();
    if (r.has_weight_decay()) rule.weight_decay = r.weight_decay();
    rules.push_back(std::move(rule));
  }
  return rules;
}

std::string DescribeRecipe(const v1::JobSpec& job) {
  const optim::LrSchedule s = ScheduleFromProto(job.training().lr_schedule());
  const int64_t steps = job.training().steps();
  const optim::MuonOptions muon = MuonFromProto(job.optimizer().muon());
  const optim::AdamWOptions adamw = AdamWFromProto(job.optimizer().adamw());
  std::optional<optim::MomentumWarmup> warmup;
  if (job.optimizer().muon().has_momentum_warmup()) {
    warmup = optim::MomentumWarmup{job.optimizer().muon().momentum_warmup().start(),
                                  job.optimizer().muon().momentum_warmup().steps()};
  }
  std::string out = "learning rate: ";
  if (s.warmup_steps > 0) absl::StrAppend(&out, "warmup over ", s.warmup_steps, " steps, then ");
  const int64_t decay_from = s.decay == optim::LrDecay::kWsd ? steps - s.decay_steps
                                                            : std::min(s.warmup_steps, steps);
  if (s.decay == optim::LrDecay::kConstant) {
    absl::StrAppend(&out, "constant");
  } else {
    absl::StrAppend(&out, optim::LrDecayName(s.decay), " decay to ",
                    s.min_lr_ratio == 0 ? std::string("0")
                                        : absl::StrCat(s.min_lr_ratio, " of the peak"),
                    " over steps ", decay_from, "-", steps - 1);
  }
  absl::StrAppend(&out, "; gradient clipping: ",
                  job.training().has_clip_grad_norm()
                      ? absl::StrCat("global norm ", job.training().clip_grad_norm())
                      : std::string("none"),
                  "; Muon momentum: ",
                  warmup.has_value() ? absl::StrCat(warmup->start, " -> ", muon.momentum,
                                                    " over ", warmup->steps, " steps")
                                     : absl::StrCat(muon.momentum),
                  job.optimizer().muon().has_qk_clip()
                      ? absl::StrCat("; QK-clip at ", job.optimizer().muon().qk_clip())
                      : std::string(),
                  "\n");
  std::set<int64_t> at = {0, steps - 1, s.warmup_steps - 1, s.warmup_steps, decay_from,
                          decay_from + (steps - decay_from) / 2};
  std::string line_step = absl::StrFormat("%-10s", "step");
  std::string line_muon = absl::StrFormat("%-10s", "muon lr");
  std::string line_adamw = absl::StrFormat("%-10s", "adamw lr");
  std::string line_beta = absl::StrFormat("%-10s", "momentum");
  for (int64_t step : at) {
    if (step < 0 || step >= steps) continue;
    const double m = optim::LrMultiplier(s, step, steps);
    absl::StrAppend(&line_step, absl::StrFormat(" %10d", step));
    absl::StrAppend(&line_muon, absl::StrFormat(" %10.4g", muon.lr * m));
    absl::StrAppend(&line_adamw, absl::StrFormat(" %10.4g", adamw.lr * m));
    absl::StrAppend(&line_beta, absl::StrFormat(" %10.4g", optim::MomentumAt(muon.momentum, warmup,
                                                                            step)));
  }
  absl::StrAppend(&out, line_step, "\n", line_muon, "\n", line_adamw, "\n", line_beta, "\n");
  return out;
}

absl::StatusOr<ResolvedJob> LoadResolvedJob(const std::string& path) {
  MUONMESH_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobFile(path));
  MUONMESH_ASSIGN_OR_RETURN(ResolvedJob resolved,
                            ResolveJob(job, fs::path(path).parent_path().string()), path);
  return resolved;
}

}  // namespace muonmesh::job
