#include "proto/job/job.h"

#include <re2/re2.h>

#include <cmath>
#include <exception>
#include <filesystem>
#include <string_view>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/io/message_file.h"
#include "core/plan/validate.h"
#include "proto/convert/plan_convert.h"
#include "core/base/status_macros.h"
#include "proto/job/optimizer_rules.h"
#include "core/optim/optimizer_options.h"

namespace muonmesh::job {
namespace {

namespace fs = std::filesystem;

// Defaults (see job.h).
constexpr double kMuonLr = 0.02;
constexpr double kMuonMomentum = 0.95;
constexpr int kNsSteps = 5;
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

math::MuonOptions MuonFromProto(const v1::MuonConfig& m) {
  math::MuonOptions o;
  o.lr = Or(m.lr(), kMuonLr);
  o.momentum = Or(m.momentum(), kMuonMomentum);
  o.nesterov = m.has_nesterov() ? m.nesterov() : true;
  o.weight_decay = m.weight_decay();
  o.scale =
      m.scale() == "match_rms_adamw" ? math::MuonScale::kMatchRmsAdamW : math::MuonScale::kOriginal;
  o.ns.steps = Or(m.ns_steps(), kNsSteps);
  plan::NsTable table = plan::NsTable::kQuintic;
  plan::ParseNsTable(m.coefficients(), &table);  // checked by CheckMuon
  o.ns.coefficients = math::NsCoefficientsOf(table);
  plan::ParseNsAlgorithm(m.ns_algorithm(), &o.ns.algorithm);  // checked by CheckMuon
  return o;
}

math::AdamWOptions AdamWFromProto(const v1::AdamWConfig& a) {
  math::AdamWOptions o;
  o.lr = Or(a.lr(), kAdamWLr);
  o.beta1 = Or(a.beta1(), kAdamWBeta1);
  o.beta2 = Or(a.beta2(), kAdamWBeta2);
  o.eps = a.has_eps() ? a.eps() : kAdamWEps;
  o.weight_decay = a.weight_decay();
  return o;
}

void CheckMuon(const v1::MuonConfig& m, Violations& v) {
  const size_t before = v.size();
  CheckNonNegative("optimizer.muon.lr", m.lr(), v);
  CheckBeta("optimizer.muon.momentum", m.momentum(), v);
  if (m.ns_steps() < 0 || m.ns_steps() > plan::kMaxNsSteps) {
    v.Add("optimizer.muon.ns_steps",
          absl::StrCat("must be in [1, ", plan::kMaxNsSteps, "] (0 or unset: ", kNsSteps, "), got ",
                       m.ns_steps()));
  }
  CheckNonNegative("optimizer.muon.weight_decay", m.weight_decay(), v);
  CheckDecayProduct("optimizer.muon.weight_decay", Or(m.lr(), kMuonLr), m.weight_decay(), v);
  if (!m.scale().empty() && m.scale() != "original" && m.scale() != "match_rms_adamw") {
    v.Add("optimizer.muon.scale", absl::StrCat("unknown scale ", plan::Quote(m.scale()),
                                               " (expected original or match_rms_adamw)"));
  }
  if (plan::NsTable table; !plan::ParseNsTable(m.coefficients(), &table)) {
    v.Add("optimizer.muon.coefficients",
          absl::StrCat("unknown coefficients ", plan::Quote(m.coefficients()),
                       " (expected quintic or polar_express)"));
  }
  if (plan::NsAlgorithm algorithm; !plan::ParseNsAlgorithm(m.ns_algorithm(), &algorithm)) {
    v.Add("optimizer.muon.ns_algorithm",
          absl::StrCat("unknown form ", plan::Quote(m.ns_algorithm()),
                       " (expected auto, standard, gram or spectral; unset: auto)"));
  } else if (plan::NsTable table; algorithm == plan::NsAlgorithm::kSpectral &&
                                  plan::ParseNsTable(m.coefficients(), &table)) {
    const std::string why = plan::SpectralGainProblem(Or(m.ns_steps(), kNsSteps), table);
    if (!why.empty()) v.Add("optimizer.muon.ns_algorithm", why);
  }
  // The numerics' own check, as a safety net: anything it refuses that the
  // checks above let through is reported too, rather than failing at step 1.
  if (v.size() == before) {
    if (absl::Status s = math::ValidateMuonOptions(MuonFromProto(m)); !s.ok()) {
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
    if (absl::Status s = math::ValidateAdamWOptions(AdamWFromProto(a)); !s.ok()) {
      v.Add("optimizer.adamw", std::string(s.message()));
    }
  }
}

void CheckOptimizer(const v1::OptimizerConfig& opt, Violations& v) {
  CheckMuon(opt.muon(), v);
  CheckAdamW(opt.adamw(), v);
  const std::string& rule = opt.owner_assignment();
  if (!rule.empty() && rule != "lpt" && rule != "round_robin" && rule != "allgather" &&
      rule != "greedy_in_order") {
    v.Add("optimizer.owner_assignment",
          absl::StrCat("unknown rule ", plan::Quote(rule),
                       " (expected lpt, round_robin, allgather or greedy_in_order)"));
  }
  const std::string& split = opt.muon_replica_split();
  if (!split.empty() && split != "auto" && split != "on" && split != "off") {
    v.Add("optimizer.muon_replica_split",
          absl::StrCat("unknown value ", plan::Quote(split),
                       " (expected auto, on or off; empty or unset: auto)"));
  }
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
    if (r.optimizer() != "muon" && r.optimizer() != "adamw") {
      v.Add(path + ".optimizer",
            r.optimizer().empty() ? std::string("required: muon or adamw")
                                  : absl::StrCat("unknown optimizer ", plan::Quote(r.optimizer()),
                                                 " (expected muon or adamw)"));
    }
  }
}

// A model width in [1, kMaxModelDim]. For a scalar field 0 means "not given";
// a list entry of 0 is just out of range.
void CheckDim(const std::string& field, int64_t value, bool list_entry, Violations& v) {
  if (value < 1) {
    v.Add(field, value == 0 && !list_entry ? std::string("required: must be >= 1")
                                           : absl::StrCat("must be >= 1, got ", value));
  } else if (value > kMaxModelDim) {
    v.Add(field, absl::StrCat(value, " exceeds the limit of ", kMaxModelDim));
  }
}

model::GptDims GptDimsOf(const v1::GptModel& g) {
  return {g.vocab_size(), g.block_size(), g.n_layer(), g.n_head(), g.n_embd(), g.seq_len()};
}

// Each field required and in range, then the rules between them
// (model::GptDimsViolation), and the data a GPT reads.
void CheckGpt(const v1::JobSpec& job, Violations& v) {
  const v1::GptModel& g = job.model().gpt();
  const std::pair<const char*, int64_t> fields[] = {
      {"vocab_size", g.vocab_size()}, {"block_size", g.block_size()}, {"n_layer", g.n_layer()},
      {"n_head", g.n_head()},         {"n_embd", g.n_embd()},         {"seq_len", g.seq_len()}};
  bool given = true;
  for (const auto& [name, value] : fields) {
    if (value < 1) {
      v.Add(absl::StrCat("model.gpt.", name), value == 0 ? std::string("required: must be >= 1")
                                                         : absl::StrCat("must be >= 1, got ", value));
      given = false;
    }
  }
  if (given) {
    if (std::optional<FieldViolation> f = model::GptDimsViolation(GptDimsOf(g))) {
      v.Add(absl::StrCat("model.gpt.", f->field), f->description);
    }
  }
  const v1::DataConfig::SourceCase source = job.data().source_case();
  if (source != v1::DataConfig::kText && source != v1::DataConfig::kTokens) {
    v.Add("data", "required for the gpt model: text {train: FILE} (every byte a token) or "
                  "tokens {train: FILE_OR_GLOB} (llm.c .bin shards)");
  } else if (source == v1::DataConfig::kText && g.vocab_size() >= 1 && g.vocab_size() < 256) {
    v.Add("model.gpt.vocab_size",
          absl::StrCat(g.vocab_size(), " is too small for text data, whose tokens are bytes "
                                       "(0..255): at least 256"));
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

void CheckModel(const v1::JobSpec& job, Violations& v) {
  const v1::ModelConfig& model = job.model();
  const v1::DataConfig::SourceCase source = job.data().source_case();
  if (model.kind_case() != v1::ModelConfig::kGpt &&
      (source == v1::DataConfig::kText || source == v1::DataConfig::kTokens)) {
    v.Add(source == v1::DataConfig::kText ? "data.text" : "data.tokens",
          "only the gpt model reads a text corpus");
  }
  switch (model.kind_case()) {
    case v1::ModelConfig::KIND_NOT_SET:
      v.Add("model", "required: give one of mlp, moe_mlp, synthetic or gpt");
      return;
    case v1::ModelConfig::kGpt:
      CheckGpt(job, v);
      return;
    case v1::ModelConfig::kMlp: {
      const auto& dims = model.mlp().dims();
      if (dims.size() < 2) {
        v.Add("model.mlp.dims",
              absl::StrCat("needs at least 2 sizes (input and output), got ", dims.size()));
      } else if (static_cast<size_t>(dims.size()) > kMaxMlpLayers + 1) {
        v.Add("model.mlp.dims",
              absl::StrCat(dims.size() - 1, " layers exceed the limit of ", kMaxMlpLayers));
        return;
      }
      for (int i = 0; i < dims.size(); ++i) {
        CheckDim(absl::StrCat("model.mlp.dims[", i, "]"), dims[i], /*list_entry=*/true, v);
      }
      return;
    }
    case v1::ModelConfig::kMoeMlp: {
      const v1::MoeMlpModel& moe = model.moe_mlp();
      CheckDim("model.moe_mlp.d_in", moe.d_in(), /*list_entry=*/false, v);
      CheckDim("model.moe_mlp.d_model", moe.d_model(), /*list_entry=*/false, v);
      CheckDim("model.moe_mlp.d_expert", moe.d_expert(), /*list_entry=*/false, v);
      CheckDim("model.moe_mlp.num_experts", moe.num_experts(), /*list_entry=*/false, v);
      CheckDim("model.moe_mlp.d_out", moe.d_out(), /*list_entry=*/false, v);
      const int64_t ep = job.parallelism().expert_model_parallel_size() == 0
                             ? 1
                             : job.parallelism().expert_model_parallel_size();
      if (ep >= 1 && moe.num_experts() >= 1 && moe.num_experts() % ep != 0) {
        v.Add("model.moe_mlp.num_experts",
              absl::StrCat(moe.num_experts(),
                           " experts do not divide over expert_model_parallel_size ", ep));
      }
      return;
    }
    case v1::ModelConfig::kSynthetic: {
      const v1::SyntheticModel& s = model.synthetic();
      if (s.spec().empty() && !s.has_model()) {
        v.Add("model.synthetic.spec",
              "required: the path of a model spec file (JSON or YAML), or the spec inline in "
              "model.synthetic.model");
      }
      if (!std::isfinite(s.scale()) || s.scale() < 0 || s.scale() > 1) {
        v.Add("model.synthetic.scale",
              absl::StrCat("must be in (0, 1] (0 or unset: 1), got ", s.scale()));
      }
      if (job.data().source_case() != v1::DataConfig::SOURCE_NOT_SET) {
        v.Add("data",
              "the synthetic workload reads no data (its gradients are generated): "
              "remove data");
      }
      return;
    }
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
  }
  // A batch larger than the data set would repeat samples within a batch.
  const bool teacher = (job.data().source_case() == v1::DataConfig::kTeacher ||
                        job.data().source_case() == v1::DataConfig::SOURCE_NOT_SET) &&
                       (job.model().kind_case() == v1::ModelConfig::kMlp ||
                        job.model().kind_case() == v1::ModelConfig::kMoeMlp);
  const int64_t samples = Or(job.data().teacher().samples(), kDefaultTeacherSamples);
  if (teacher && batch > samples && samples > 0 && batch <= kMaxGlobalBatchSize) {
    v.Add("training.global_batch_size",
          absl::StrCat(batch, " exceeds the ", samples, " samples of the teacher data set (",
                       job.data().teacher().samples() == 0 ? "the default of "
                                                           : "data.teacher.samples ",
                       samples, ")"));
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
  if ((t.eval_every() != 0 || t.eval_batches() != 0) &&
      job.model().kind_case() != v1::ModelConfig::kGpt) {
    v.Add(t.eval_every() != 0 ? "training.eval_every" : "training.eval_batches",
          "only the gpt model has validation data");
  }
  if (t.threads_per_rank() < 0 || t.threads_per_rank() > plan::kMaxThreadsPerRank) {
    v.Add("training.threads_per_rank",
          absl::StrCat("must be in [0, ", plan::kMaxThreadsPerRank, "] (0 or unset: 1), got ",
                       t.threads_per_rank()));
  }
}

// The planner's checks of the parallelism config that do not depend on the
// model, run on a one-parameter placeholder model, at `world_size`.
std::vector<plan::FieldViolation> ParallelismViolations(const v1::JobSpec& job,
                                                        int64_t world_size) {
  plan::PlanInput input;
  input.world_size = world_size;
  input.parallelism = ParallelismFromProto(job.parallelism());
  input.model.name = "placeholder";
  input.model.units.push_back({"unit", {{"param", {1}, "adamw", false}}});
  std::vector<plan::FieldViolation> out;
  for (plan::FieldViolation& f : plan::Validate(input)) {
    if (f.field.rfind("parallelism.", 0) == 0) out.push_back(std::move(f));
  }
  return out;
}

void CheckParallelism(const v1::JobSpec& job, Violations& v) {
  for (plan::FieldViolation& f : ParallelismViolations(job, job.world_size())) {
    v.Add(std::move(f.field), std::move(f.description));
  }
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

std::string ResolvePath(const std::string& job_dir, const std::string& path) {
  if (job_dir.empty() || path.empty()) return path;
  const fs::path p(path);
  if (p.is_absolute()) return path;
  return (fs::path(job_dir) / p).lexically_normal().string();
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
  if (plan::NsAlgorithm a; job.device() == "cuda" &&
                           plan::ParseNsAlgorithm(job.optimizer().muon().ns_algorithm(), &a)) {
    if (const char* why = plan::NsFormUnavailable(a, job.device())) {
      v.Add("optimizer.muon.ns_algorithm", why);
    }
  }
  if (!job.device().empty() && job.device() != "cpu" && job.device() != "cuda") {
    v.Add("device",
          absl::StrCat("unknown device ", plan::Quote(job.device()), " (expected cpu or cuda)"));
  }
  CheckParallelism(job, v);
  CheckModel(job, v);
  CheckInitAndData(job, v);
  CheckOptimizer(job.optimizer(), v);
  CheckTraining(job, v);
  CheckElastic(job, v);
  return v.Take();
}

namespace {

// A job's paths, resolved against its file's folder ("" when not used).
struct JobPaths {
  std::string init, init_checkpoint, data, spec, output_dir, export_path;
  std::string corpus_field;            // "data.text" | "data.tokens" | ""
  std::string corpus_train, corpus_val;  // files or patterns
  bool inline_spec = false;  // model.synthetic.model given: no spec file
};

JobPaths ResolveJobPaths(const v1::JobSpec& job, const std::string& job_dir) {
  JobPaths p;
  if (job.init().source_case() == v1::InitConfig::kSafetensors) {
    p.init = ResolvePath(job_dir, job.init().safetensors());
  }
  if (job.init().source_case() == v1::InitConfig::kCheckpoint) {
    p.init_checkpoint = ResolvePath(job_dir, job.init().checkpoint());
  }
  if (job.data().source_case() == v1::DataConfig::kSafetensors) {
    p.data = ResolvePath(job_dir, job.data().safetensors());
  }
  if (job.data().source_case() == v1::DataConfig::kText) {
    p.corpus_field = "data.text";
    p.corpus_train = ResolvePath(job_dir, job.data().text().train());
    p.corpus_val = ResolvePath(job_dir, job.data().text().val());
  } else if (job.data().source_case() == v1::DataConfig::kTokens) {
    p.corpus_field = "data.tokens";
    p.corpus_train = ResolvePath(job_dir, job.data().tokens().train());
    p.corpus_val = ResolvePath(job_dir, job.data().tokens().val());
  }
  if (job.model().kind_case() == v1::ModelConfig::kSynthetic) {
    p.inline_spec = job.model().synthetic().has_model();
    p.spec = ResolvePath(job_dir, job.model().synthetic().spec());
  }
  p.output_dir = ResolvePath(
      job_dir, job.output().dir().empty() ? absl::StrCat("runs/", job.name()) : job.output().dir());
  p.export_path = job.output().export_().empty()
                      ? (fs::path(p.output_dir) / "final.safetensors").string()
                      : ResolvePath(job_dir, job.output().export_());
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
  if (!p.spec.empty() && !p.inline_spec) CheckInputFile("model.synthetic.spec", p.spec, files);
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

// The model section of a validated job.
absl::Status ResolveModel(const v1::JobSpec& job, const JobPaths& paths, ResolvedJob& r) {
  r.model = job.model();
  switch (job.model().kind_case()) {
    case v1::ModelConfig::kMlp:
      r.model_kind = ResolvedJob::ModelKind::kMlp;
      r.mlp_dims.assign(job.model().mlp().dims().begin(), job.model().mlp().dims().end());
      return absl::OkStatus();
    case v1::ModelConfig::kMoeMlp:
      r.model_kind = ResolvedJob::ModelKind::kMoeMlp;
      r.moe = job.model().moe_mlp();
      return absl::OkStatus();
    case v1::ModelConfig::kSynthetic:
      r.model_kind = ResolvedJob::ModelKind::kSynthetic;
      r.synthetic_spec_path = paths.spec;
      if (paths.inline_spec) r.synthetic_model = job.model().synthetic().model();
      r.synthetic_scale = Or(job.model().synthetic().scale(), 1.0);
      return absl::OkStatus();
    case v1::ModelConfig::kGpt: {
      r.model_kind = ResolvedJob::ModelKind::kGpt;
      r.gpt = GptDimsOf(job.model().gpt());
      const bool tokens = job.data().source_case() == v1::DataConfig::kTokens;
      const bool has_fraction = tokens ? job.data().tokens().has_val_fraction()
                                       : job.data().text().has_val_fraction();
      const double fraction =
          tokens ? job.data().tokens().val_fraction() : job.data().text().val_fraction();
      r.corpus.tokens = tokens;
      r.corpus.train = paths.corpus_train;
      r.corpus.val = paths.corpus_val;
      r.corpus.val_fraction = !paths.corpus_val.empty() ? 0
                              : has_fraction           ? fraction
                                                       : kDefaultValFraction;
      return absl::OkStatus();
    }
    case v1::ModelConfig::KIND_NOT_SET:
      break;
  }
  return absl::InternalError("ResolveJob: a job without a model passed validation");
}

}  // namespace

std::vector<int64_t> ElasticWorldSizes(const v1::JobSpec& job) {
  std::vector<int64_t> sizes;
  if (!job.training().has_elastic()) return sizes;
  const int64_t batch = job.training().global_batch_size();
  for (int64_t w = job.world_size() - 1;
       w >= std::max<int64_t>(1, job.training().elastic().min_world_size()); --w) {
    if (batch % w == 0 && ParallelismViolations(job, w).empty()) sizes.push_back(w);
  }
  return sizes;
}

absl::Duration ElasticWait(const v1::JobSpec& job) {
  absl::Duration wait = kDefaultElasticWait;
  const std::string& text = job.training().elastic().wait();
  if (!text.empty() && !absl::ParseDuration(text, &wait)) return kDefaultElasticWait;
  return wait;
}

absl::StatusOr<ResolvedJob> ResolveJob(const v1::JobSpec& job, const std::string& job_dir) {
  std::vector<plan::FieldViolation> violations = ValidateJob(job);
  const JobPaths paths = ResolveJobPaths(job, job_dir);
  CheckJobPaths(paths, violations);
  if (!violations.empty()) return absl::InvalidArgumentError(JoinViolations(violations));

  ResolvedJob r;
  r.name = job.name();
  r.world_size = job.world_size();
  r.device = job.device().empty() ? "cpu" : job.device();
  r.parallelism = ParallelismFromProto(job.parallelism());
  r.owner_assignment =
      job.optimizer().owner_assignment().empty() ? "lpt" : job.optimizer().owner_assignment();
  r.muon_buffer_bytes = job.optimizer().muon_buffer_bytes();
  r.muon_replica_split =
      job.optimizer().muon_replica_split().empty() ? "auto" : job.optimizer().muon_replica_split();
  r.muon = MuonFromProto(job.optimizer().muon());
  r.adamw = AdamWFromProto(job.optimizer().adamw());
  for (const v1::OptimizerRule& rule : job.optimizer().rules()) {
    r.optimizer_rules.emplace_back(rule.pattern(), rule.optimizer());
  }

  MUONMESH_RETURN_IF_ERROR(ResolveModel(job, paths, r));

  if (job.init().source_case() == v1::InitConfig::kSafetensors) {
    r.init_safetensors = paths.init;
  } else if (job.init().source_case() == v1::InitConfig::kCheckpoint) {
    r.init_checkpoint = paths.init_checkpoint;
    r.fresh_optimizer_state = job.init().fresh_optimizer_state();
  } else {
    r.init_seed = job.init().seed();  // 0 when init is not given
  }
  if (job.data().source_case() == v1::DataConfig::kSafetensors) {
    r.data_safetensors = paths.data;
  } else {
    r.teacher_seed = job.data().teacher().seed();  // 0 when data is not given
    r.teacher_samples = Or(job.data().teacher().samples(), kDefaultTeacherSamples);
  }

  r.steps = job.training().steps();
  r.global_batch_size = job.training().global_batch_size();
  r.checkpoint_every = job.training().checkpoint_every();
  r.max_restarts = job.training().max_restarts();
  r.threads_per_rank = std::max(1, job.training().threads_per_rank());
  r.eval_every = job.training().eval_every();
  r.eval_batches = Or(job.training().eval_batches(), kDefaultEvalBatches);

  r.output_dir = paths.output_dir;
  r.export_path = paths.export_path;
  return r;
}

absl::StatusOr<ResolvedJob> LoadResolvedJob(const std::string& path) {
  MUONMESH_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobFile(path));
  MUONMESH_ASSIGN_OR_RETURN(ResolvedJob resolved,
                            ResolveJob(job, fs::path(path).parent_path().string()), path);
  return resolved;
}

}  // namespace muonmesh::job
