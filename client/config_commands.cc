#include "client/config_commands.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli_flags.h"
#include "client/job_commands.h"
#include "client/json_writer.h"
#include "client/plan_table.h"
#include "client/planner_client.h"
#include "core/base/status_macros.h"
#include "muonmesh/v1/planner.pb.h"
#include "proto/convert/plan_convert.h"
#include "proto/io/message_file.h"
#include "core/plan/mesh.h"
#include "core/plan/validate.h"
#include "proto/job/corpus.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"
#include "proto/job/optimizer_rules.h"

namespace muonmesh::client {
namespace {

constexpr int kExitInvalidConfig = kExitInvalid;

// Loads the spec, or prints the loader's "FILE:LINE:COL: field: reason".
bool LoadSpec(const std::string& path, v1::ModelSpec* spec) {
  const absl::Status status = protoio::LoadMessageFile(path, spec);
  if (status.ok()) return true;
  // The message starts with the location so that editors can jump to it.
  std::cerr << status.message() << "\n";
  return false;
}

void FillParallelism(const ConfigFlags& f, v1::ParallelismConfig* p) {
  p->set_data_parallel_sharding_strategy(f.strategy);
  p->set_num_distributed_optimizer_instances(f.instances);
  p->set_outer_dp_sharding_strategy(f.outer_strategy);
  p->set_expert_model_parallel_size(f.ep);
}

constexpr const char* kValidateSynopsis =
    "(--spec FILE --world-size W [--instances I] [--strategy S] [--outer-strategy S] [--ep E] "
    "[--coordinator ADDR] [--timeout SECONDS] | --job JOB.yaml [--no-scan]) [--json]\n\n"
    "With --spec: asks the coordinator whether the parallelism config fits the model.\n"
    "With --job: checks a job file here, before it is submitted, without a coordinator:\n"
    "its fields, the planner's rules for its model and parallelism, its input files\n"
    "(paths and globs, token shards' headers and every token against the vocabulary;\n"
    "--no-scan reads the headers only) and its outputs; then prints the job with every\n"
    "default filled in and every path resolved (--json: that job alone, as JSON). Files\n"
    "are read where this runs: a coordinator or workers on other hosts see their own.\n"
    "Prints every violation as 'field: description' on stderr and exits 1 when invalid.";


constexpr const char* kPlanSynopsis =
    "(--spec FILE --world-size W [--instances I] [--strategy S] [--outer-strategy S] [--ep E] "
    "| --job JOB.yaml) "
    "[--owner-rule R] [--ns-steps T] [--ns-algorithm A] [--ns-coefficients C] "
    "[--device cpu|cuda] [--muon-wave-budget-bytes B] [--include-shards] "
    "[--coordinator ADDR] [--timeout SECONDS] [--json]\n\n"
    "Asks the coordinator for the mesh, shard layout and Muon owners, and prints them as\n"
    "tables, or with --json as the Plan message (byte-stable for the same input). --job plans\n"
    "a job file's model (optimizer rules applied), world size, parallelism and optimizer\n"
    "options as its workers will; plan flags given beside it override the job's.";

// A flag value that must fit the request's int32 field.
absl::Status CheckInt32(const char* flag, int64_t value) {
  if (value >= std::numeric_limits<int32_t>::min() &&
      value <= std::numeric_limits<int32_t>::max()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(flag, ": ", value, " is out of range"));
}

// The plan command's cost-model flags, as PlanOptions carries them.
struct PlanOptionFlags {
  std::string owner_rule;
  int64_t ns_steps = 0;
  std::string ns_algorithm;
  std::string ns_coefficients;
  std::string device;
  int64_t wave_budget = 0;
  int64_t threads = 0;
  bool held_for_backward = false;
  bool regathered_for_backward = false;
};

void AddPlanOptionFlags(FlagParser& parser, PlanOptionFlags* o) {
  parser.String("--owner-rule", "R", "owner assignment: lpt (default) | round_robin | allgather",
                &o->owner_rule);
  parser.Int("--ns-steps", "T", "Newton-Schulz steps in the cost model, 1 to 100 (default 5)",
             &o->ns_steps);
  parser.String("--ns-algorithm", "A",
                "Newton-Schulz form the cost model charges: auto (default: per matrix, the "
                "cheapest) | standard | gram (cpu only) | spectral (cpu only)",
                &o->ns_algorithm);
  parser.String("--ns-coefficients", "C",
                "Newton-Schulz coefficients: quintic (default) | polar_express (they set where "
                "the Gram form restarts and whether the spectral form may run)",
                &o->ns_coefficients);
  parser.String("--device", "cpu|cuda", "device whose cost model to use (default cuda)",
                &o->device);
  parser.Int("--muon-wave-budget-bytes", "BYTES",
             "plan the Muon phase in waves of at most this many bytes of owner buffers, as a "
             "job's workers do with optimizer.muon_buffer_bytes (halved on cpu, where two waves "
             "overlap); owners are then balanced wave by wave (default 0: one wave)",
             &o->wave_budget);
  parser.Int("--threads-per-rank", "N",
             "OpenBLAS threads each rank runs, as a job's training.threads_per_rank (cpu; "
             "default 1): the spectral form's eigensolver barely speeds up with threads, so "
             "auto picks it less often on more",
             &o->threads);
  parser.Bool("--no-reshard-after-forward",
              "plan each unit gathered once a step, held from the forward pass to the backward "
              "one, as a job's communication.reshard_after_forward: false does (no "
              "param_allgather_backward)",
              &o->held_for_backward);
  parser.Bool("--reshard-after-forward",
              "plan each unit gathered again for each use, as a job's "
              "communication.reshard_after_forward: true does (a job leaving it unset holds a "
              "model that fits one bucket)",
              &o->regathered_for_backward);
}

// The plan option flags' own rules, beyond each flag's type.
absl::Status CheckPlanOptionFlags(const FlagParser& parser, const PlanOptionFlags& o) {
  MUONMESH_RETURN_IF_ERROR(CheckNotZero(parser, "--ns-steps", o.ns_steps, 5));
  for (const auto& [flag, value] : {std::pair<const char*, int64_t>{"--ns-steps", o.ns_steps},
                                    {"--threads-per-rank", o.threads}}) {
    MUONMESH_RETURN_IF_ERROR(CheckInt32(flag, value));
  }
  if (o.held_for_backward && o.regathered_for_backward) {
    return absl::InvalidArgumentError(
        "--reshard-after-forward and --no-reshard-after-forward: give one of them");
  }
  return absl::OkStatus();
}

void FillPlanOptions(const PlanOptionFlags& o, v1::PlanOptions* out) {
  out->set_owner_assignment(o.owner_rule);
  out->set_ns_steps(static_cast<int32_t>(o.ns_steps));
  out->set_ns_algorithm(o.ns_algorithm);
  out->set_ns_coefficients(o.ns_coefficients);
  out->set_device(o.device);
  out->set_muon_wave_budget_bytes(o.wave_budget);
  out->set_threads_per_rank(static_cast<int32_t>(o.threads));
  if (o.held_for_backward) out->set_reshard_after_forward(false);
  if (o.regathered_for_backward) out->set_reshard_after_forward(true);
}

// The request a job's workers will plan: its model's spec (the optimizer
// rules applied), world size and parallelism config; the plan options the
// job sets, unless a flag gave them.
absl::Status FillFromJob(const std::string& path, v1::PlanLayoutRequest* request,
                         v1::JobSpec* loaded) {
  MUONMESH_ASSIGN_OR_RETURN(v1::JobSpec job, job::LoadJobFile(path));
  const std::string dir = std::filesystem::absolute(path).parent_path().string();
  // The job file's own rules first, its files included: a plan of a job
  // that cannot run would say nothing true.
  if (const std::vector<plan::FieldViolation> v = job::JobViolations(job, dir); !v.empty()) {
    std::string all;
    for (const plan::FieldViolation& f : v) absl::StrAppend(&all, "\n  ", f.field, ": ", f.description);
    return absl::InvalidArgumentError(absl::StrCat(path, ": invalid job", all));
  }
  *loaded = job;
  MUONMESH_ASSIGN_OR_RETURN(plan::PlanInput input, job::PlanInputOf(job, dir), path);
  *request->mutable_model() = convert::ModelToProto(input.model);
  request->set_world_size(input.world_size);
  *request->mutable_parallelism() = job.parallelism();
  *request->mutable_options() = convert::OptionsToProto(input.options);
  return absl::OkStatus();
}

// Flags given on the command line override what the job set.
void FillPlanOptionsOver(const FlagParser& parser, const PlanOptionFlags& o,
                         v1::PlanOptions* out) {
  v1::PlanOptions flags;
  FillPlanOptions(o, &flags);
  if (parser.Seen("--owner-rule")) out->set_owner_assignment(flags.owner_assignment());
  if (parser.Seen("--ns-steps")) out->set_ns_steps(flags.ns_steps());
  if (parser.Seen("--ns-algorithm")) out->set_ns_algorithm(flags.ns_algorithm());
  if (parser.Seen("--ns-coefficients")) out->set_ns_coefficients(flags.ns_coefficients());
  if (parser.Seen("--device")) out->set_device(flags.device());
  if (parser.Seen("--muon-wave-budget-bytes")) {
    out->set_muon_wave_budget_bytes(flags.muon_wave_budget_bytes());
  }
  if (parser.Seen("--threads-per-rank")) out->set_threads_per_rank(flags.threads_per_rank());
  if (parser.Seen("--no-reshard-after-forward")) out->set_reshard_after_forward(false);
  if (parser.Seen("--reshard-after-forward")) out->set_reshard_after_forward(true);
}

// Prints the violations ("field: description", one a line) of a status
// whose message is job::JoinViolations's, prefixed with nothing.
int PrintInvalid(const absl::Status& status) {
  std::cerr << status.message() << "\n";
  return status.code() == absl::StatusCode::kInvalidArgument ? kExitInvalidConfig : kExitUsage;
}

// `validate --job`: everything a worker would refuse, found here first.
int ValidateJobFile(const std::string& path, bool scan, bool json) {
  absl::StatusOr<v1::JobSpec> spec = job::LoadJobFile(path);
  if (!spec.ok()) return PrintInvalid(spec.status());
  const std::string dir = std::filesystem::absolute(path).parent_path().string();
  std::vector<plan::FieldViolation> violations = job::JobViolations(*spec, dir);
  absl::StatusOr<plan::PlanInput> input = job::PlanInputOf(*spec, dir);
  if (violations.empty() && !input.ok()) return PrintInvalid(input.status());
  if (input.ok()) {
    for (plan::FieldViolation& v : plan::Validate(*input)) {
      // The job's own checks ran the planner's model-independent ones already.
      const bool seen = std::any_of(violations.begin(), violations.end(), [&v](const auto& w) {
        return w.field == v.field && w.description == v.description;
      });
      if (!seen) violations.push_back(std::move(v));
    }
  }
  if (!violations.empty()) {
    for (const plan::FieldViolation& v : violations) {
      std::cerr << v.field << ": " << v.description << "\n";
    }
    return kExitInvalidConfig;
  }
  absl::StatusOr<job::ResolvedJob> r = job::ResolveJob(*spec, dir);
  if (!r.ok()) return PrintInvalid(r.status());
  absl::StatusOr<plan::ResolvedConfig> config = plan::Resolve(*input);
  if (!config.ok()) return PrintInvalid(config.status());
  std::string data;
  if (r->kind->data == job::DataUse::kCorpus) {
    const int64_t vocab = r->kind->vocab_size(r->model_form);
    absl::StatusOr<job::CorpusReport> report = job::CheckCorpus(r->corpus, vocab, scan);
    if (!report.ok()) return PrintInvalid(report.status());
    data = absl::StrCat("data: ", report->train.tokens, " training tokens in ",
                        report->train.files, " files");
    if (report->val.files > 0) {
      absl::StrAppend(&data, ", ", report->val.tokens, " validation tokens in ",
                      report->val.files, " files");
    }
    absl::StrAppend(&data, scan ? absl::StrCat(", every token below the vocabulary (", vocab, ")")
                                : " (headers only: --no-scan)");
  }
  v1::JobSpec filled = job::FilledSpec(*r);
  // The planner's defaults for the parallelism config too.
  v1::ParallelismConfig& par = *filled.mutable_parallelism();
  par.set_data_parallel_sharding_strategy(plan::StrategyName(config->inner));
  par.set_num_distributed_optimizer_instances(config->instances);
  if (config->instances > 1) par.set_outer_dp_sharding_strategy(plan::StrategyName(config->outer));
  par.set_expert_model_parallel_size(config->ep);
  if (json) {
    std::cout << ToJson(filled) << "\n";
    return kExitOk;
  }
  std::cout << "valid: " << r->name << ", " << r->kind->name << " on " << r->world_size << " "
            << r->device << " ranks\n";
  if (!data.empty()) std::cout << data << "\n";
  std::cout << "\nthe job as it runs (every default filled in, paths resolved):\n"
            << ToJson(filled) << "\n";
  return kExitOk;
}

}  // namespace

int RunValidate(const std::vector<std::string>& args) {
  ConfigFlags f;
  FlagParser parser("muonmeshctl validate");
  AddConfigFlags(parser, &f);
  parser.String("--job", "FILE",
                "check this job file here instead (its fields, plan, input files and outputs)",
                &f.job);
  bool no_scan = false;
  parser.Bool("--no-scan",
              "with --job: read the corpus's headers only, not every token (large corpora)",
              &no_scan);
  AddConnectionFlags(parser, &f);
  bool help = false;
  if (absl::Status st = parser.Parse(args, &help); !st.ok()) return UsageError("validate", st);
  if (help) {
    std::cout << parser.Usage(kValidateSynopsis) << "\n" << kExitCodes;
    return kExitOk;
  }
  if (absl::Status st = CheckConfigFlags(parser, &f); !st.ok()) return UsageError("validate", st);
  if (!f.job.empty()) return ValidateJobFile(f.job, !no_scan, f.json);
  if (no_scan) return UsageError("validate", absl::InvalidArgumentError("--no-scan needs --job"));

  v1::ValidateConfigRequest request;
  if (!LoadSpec(f.spec, request.mutable_model())) return kExitUsage;
  request.set_world_size(f.world_size);
  FillParallelism(f, request.mutable_parallelism());

  absl::StatusOr<credentials::ChannelSecurity> security = Security(f);
  if (!security.ok()) return UsageError("validate", security.status());
  PlannerClient client(f.coordinator,
                       {.timeout = absl::Seconds(f.timeout_seconds), .security = *security});
  absl::StatusOr<v1::ValidateConfigResponse> response = client.Validate(request);
  if (!response.ok()) return ReportError("validate", response.status());
  if (f.json) std::cout << ToJson(*response) << "\n";
  for (const v1::FieldViolation& v : response->violations()) {
    std::cerr << v.field() << ": " << v.description() << "\n";
  }
  if (response->violations_size() > 0) return kExitInvalidConfig;
  if (!f.json) {
    std::cout << "valid: " << request.model().name() << " on " << f.world_size << " ranks\n";
  }
  return kExitOk;
}

int RunPlan(const std::vector<std::string>& args) {
  ConfigFlags f;
  PlanOptionFlags o;
  bool include_shards = false;
  FlagParser parser("muonmeshctl plan");
  AddConfigFlags(parser, &f);
  parser.String("--job", "FILE",
                "plan this job file's model, world size and parallelism (instead of --spec "
                "and the config flags)",
                &f.job);
  AddPlanOptionFlags(parser, &o);
  parser.Bool("--include-shards", "also return every shard's segments (JSON only; large)",
              &include_shards);
  bool omit_holders = false;
  parser.Bool("--omit-holders",
              "leave each matrix's holders out of the JSON (most of a large plan; the table "
              "never asks for them)",
              &omit_holders);
  AddConnectionFlags(parser, &f);
  bool help = false;
  if (absl::Status st = parser.Parse(args, &help); !st.ok()) return UsageError("plan", st);
  if (help) {
    std::cout << parser.Usage(kPlanSynopsis) << "\n" << kExitCodes;
    return kExitOk;
  }
  if (absl::Status st = CheckConfigFlags(parser, &f); !st.ok()) return UsageError("plan", st);
  if (absl::Status st = CheckPlanOptionFlags(parser, o); !st.ok()) return UsageError("plan", st);

  v1::PlanLayoutRequest request;
  v1::JobSpec job;
  if (!f.job.empty()) {
    if (absl::Status st = FillFromJob(f.job, &request, &job); !st.ok()) {
      std::cerr << st.message() << "\n";
      return st.code() == absl::StatusCode::kInvalidArgument ? kExitInvalidConfig : kExitUsage;
    }
  } else {
    if (!LoadSpec(f.spec, request.mutable_model())) return kExitUsage;
    request.set_world_size(f.world_size);
    FillParallelism(f, request.mutable_parallelism());
  }
  if (f.job.empty()) {
    FillPlanOptions(o, request.mutable_options());
  } else {
    FillPlanOptionsOver(parser, o, request.mutable_options());
  }
  request.set_include_shards(include_shards);
  // The table shows no holders: not asked for, the answer of a plan at
  // thousands of ranks is a tenth of the size.
  request.set_omit_holders(omit_holders || !f.json);

  absl::StatusOr<credentials::ChannelSecurity> security = Security(f);
  if (!security.ok()) return UsageError("plan", security.status());
  PlannerClient client(f.coordinator,
                       {.timeout = absl::Seconds(f.timeout_seconds), .security = *security});
  absl::StatusOr<v1::PlanLayoutResponse> response = client.Plan(request);
  if (!response.ok()) return ReportError("plan", response.status());
  v1::Plan* plan = response->mutable_plan();
  if (f.json) {
    // A timing, different on every run: the JSON must be byte-identical for
    // the same input, so the field is left out rather than zeroed.
    plan->mutable_summary()->clear_plan_seconds();
    std::cout << ToJson(*plan, {.omit_fields = {"muonmesh.v1.PlanSummary.plan_seconds"}}) << "\n";
  } else {
    std::cout << FormatPlanTable(request.model().name(), *plan);
    std::cout << absl::StrFormat("\nplanned in %.1f ms by %s\n",
                                 1e3 * plan->summary().plan_seconds(), client.address());
    if (!f.job.empty()) std::cout << "\n" << job::DescribeRecipe(job);
  }
  return kExitOk;
}

}  // namespace muonmesh::client
