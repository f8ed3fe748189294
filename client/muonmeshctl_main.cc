// muonmeshctl: the command-line client of the coordinator (docs/architecture.md §1).
//
// Exit codes, which scripts rely on (kExitCodes, shown by every --help):
//   0  success
//   1  the config is invalid (violations on stderr, one per line)
//   2  usage error, or a spec file that does not load
//   3  the coordinator cannot be reached (UNAVAILABLE: down, refused, stopping)
//   4  the deadline (--timeout) expired before the answer came
//   5  the coordinator refused or failed the call (RESOURCE_EXHAUSTED: too big
//      or too busy; INTERNAL; any other error)

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "client/job_commands.h"
#include "client/json_writer.h"
#include "client/plan_table.h"
#include "client/planner_client.h"
#include "muonmesh/v1/planner.pb.h"
#include "proto/io/message_file.h"
#include "core/base/flag_parser.h"
#include "core/base/status_macros.h"
#include "proto/convert/plan_convert.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"
#include "proto/job/optimizer_rules.h"

namespace muonmesh {
namespace {

// The exit codes of every command (client/job_commands.h).
using cli::kExitDeadline;
using cli::kExitOk;
using cli::kExitRefused;
using cli::kExitUnreachable;
using cli::kExitUsage;
constexpr int kExitInvalidConfig = cli::kExitInvalid;

constexpr const char* kDefaultCoordinator = "127.0.0.1:50051";
constexpr const char* kCoordinatorEnv = "MUONMESH_COORDINATOR";

// ---------------------------------------------------------------- argv

// ---------------------------------------------------------------- commands

// Flags shared by `validate` and `plan`.
struct ConfigFlags {
  std::string spec;
  std::string job;  // plan: the model, world size and parallelism of a job file
  int64_t world_size = 0;
  int64_t instances = 0;
  std::string strategy;
  std::string outer_strategy;
  int64_t ep = 0;
  std::string coordinator;
  int64_t timeout_seconds = 60;
  bool json = false;
  rpc::ClientSecurityOptions security;
};

void AddConfigFlags(FlagParser& parser, ConfigFlags* f) {
  parser.String("--spec", "FILE", "model spec (ModelSpec as YAML or JSON); required", &f->spec);
  parser.Int("--world-size", "W", "number of ranks; required", &f->world_size);
  parser.Int("--instances", "I",
             "num_distributed_optimizer_instances, >= 1 (>1 adds the dp_outer axis; default 1)",
             &f->instances);
  parser.String("--strategy", "S",
                "data_parallel_sharding_strategy: no_shard | optim | optim_grads | "
                "optim_grads_params (default)",
                &f->strategy);
  parser.String("--outer-strategy", "S",
                "outer_dp_sharding_strategy (only with --instances > 1; default optim)",
                &f->outer_strategy);
  parser.Int("--ep", "E", "expert_model_parallel_size, >= 1 (default 1)", &f->ep);
}

void AddConnectionFlags(FlagParser& parser, ConfigFlags* f) {
  parser.String("--coordinator", "ADDR",
                absl::StrCat("coordinator HOST:PORT (default $", kCoordinatorEnv, ", else ",
                             kDefaultCoordinator, ")"),
                &f->coordinator);
  parser.Int("--timeout", "SECONDS", "deadline of the call (default 60)", &f->timeout_seconds);
  parser.Bool("--json", "print the answer as JSON on stdout", &f->json);
  parser.String("--tls-ca", "FILE",
                absl::StrCat("talk TLS, trusting the coordinator's certificate if this CA "
                             "signed it (default $", rpc::kTlsCaEnv, ")"),
                &f->security.tls_ca);
  parser.String("--tls-cert", "FILE",
                absl::StrCat("client certificate for mutual TLS (default $", rpc::kTlsCertEnv,
                             ")"),
                &f->security.tls_cert);
  parser.String("--tls-key", "FILE",
                absl::StrCat("its private key (default $", rpc::kTlsKeyEnv, ")"),
                &f->security.tls_key);
  parser.String("--tls-server-name", "NAME",
                absl::StrCat("the name the coordinator's certificate must carry, when not the "
                             "address's host (default $", rpc::kTlsServerNameEnv, ")"),
                &f->security.tls_server_name);
  parser.String("--token-file", "FILE",
                absl::StrCat("file whose first line is the bearer token (default $",
                             rpc::kTokenFileEnv, ", else the token in $", rpc::kTokenEnv, ")"),
                &f->security.token_file);
}

// The connection's TLS and token from the flags and the environment; an
// InvalidArgument naming the flag or file is a usage error.
absl::StatusOr<rpc::ChannelSecurity> Security(const ConfigFlags& f) {
  return rpc::LoadChannelSecurity(rpc::WithEnvironment(f.security));
}

// The API cannot tell 0 from unset (proto3), so 0 would silently mean the
// default; an explicit 0 is refused here, naming the flag. Other values,
// negative ones included, are the coordinator's to validate.
absl::Status CheckNotZero(const FlagParser& parser, const char* flag, int64_t value,
                          int64_t fallback) {
  if (!parser.Seen(flag) || value != 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, ": must be >= 1, got 0 (omit ", flag,
                                                 " for the default, ", fallback, ")"));
}

// Checks what the parser cannot: required flags and local ranges. The
// config itself is the coordinator's to validate.
absl::Status CheckConfigFlags(const FlagParser& parser, ConfigFlags* f) {
  if (parser.Seen("--job")) {
    for (const char* flag : {"--spec", "--world-size", "--instances", "--strategy",
                             "--outer-strategy", "--ep"}) {
      if (parser.Seen(flag)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--job gives the model and the parallelism config: drop ", flag));
      }
    }
  } else {
    if (!parser.Seen("--spec")) {
      return absl::InvalidArgumentError("missing required flag --spec (or --job)");
    }
    if (!parser.Seen("--world-size")) {
      return absl::InvalidArgumentError("missing required flag --world-size");
    }
  }
  MUONMESH_RETURN_IF_ERROR(CheckNotZero(parser, "--instances", f->instances, 1));
  MUONMESH_RETURN_IF_ERROR(CheckNotZero(parser, "--ep", f->ep, 1));
  if (f->timeout_seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout: must be a positive number of seconds, got ", f->timeout_seconds));
  }
  if (f->coordinator.empty()) {
    const char* env = std::getenv(kCoordinatorEnv);
    f->coordinator = env != nullptr && *env != '\0' ? env : kDefaultCoordinator;
  }
  return absl::OkStatus();
}

int UsageError(const std::string& command, const absl::Status& status) {
  std::cerr << "muonmeshctl " << command << ": " << status.message() << "\n"
            << "Run 'muonmeshctl " << command << " --help' for usage.\n";
  return kExitUsage;
}

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

// Prints an RPC error and returns its exit code; violations
// (InvalidArgument) are the user's to fix.
int ReportError(const std::string& command, const absl::Status& status) {
  if (status.code() == absl::StatusCode::kInvalidArgument) {
    std::cerr << status.message() << "\n";
    return kExitInvalidConfig;
  }
  std::cerr << "muonmeshctl " << command << ": " << status.message() << "\n";
  return cli::ExitCode(status);
}

constexpr const char* kExitCodes =
    "Exit codes:\n"
    "  0  ok\n"
    "  1  invalid config (every violation on stderr, one per line)\n"
    "  2  usage error, or a spec file that does not load\n"
    "  3  coordinator unreachable (down, refused, shutting down)\n"
    "  4  deadline (--timeout) expired before the answer\n"
    "  5  refused or failed by the coordinator (no or unknown token, role not allowed, plan\n"
    "     too large, server busy, internal error)\n";

constexpr const char* kValidateSynopsis =
    "--spec FILE --world-size W [--instances I] [--strategy S] [--outer-strategy S] [--ep E] "
    "[--coordinator ADDR] [--timeout SECONDS] [--json]\n\n"
    "Asks the coordinator whether the parallelism config fits the model. Prints every\n"
    "violation as 'field: description' on stderr and exits 1 when it does not.";

int RunValidate(const std::vector<std::string>& args) {
  ConfigFlags f;
  FlagParser parser("muonmeshctl validate");
  AddConfigFlags(parser, &f);
  AddConnectionFlags(parser, &f);
  bool help = false;
  if (absl::Status st = parser.Parse(args, &help); !st.ok()) return UsageError("validate", st);
  if (help) {
    std::cout << parser.Usage(kValidateSynopsis) << "\n" << kExitCodes;
    return kExitOk;
  }
  if (absl::Status st = CheckConfigFlags(parser, &f); !st.ok()) return UsageError("validate", st);

  v1::ValidateConfigRequest request;
  if (!LoadSpec(f.spec, request.mutable_model())) return kExitUsage;
  request.set_world_size(f.world_size);
  FillParallelism(f, request.mutable_parallelism());

  absl::StatusOr<rpc::ChannelSecurity> security = Security(f);
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
}

void FillPlanOptions(const PlanOptionFlags& o, v1::PlanOptions* out) {
  out->set_owner_assignment(o.owner_rule);
  out->set_ns_steps(static_cast<int32_t>(o.ns_steps));
  out->set_ns_algorithm(o.ns_algorithm);
  out->set_ns_coefficients(o.ns_coefficients);
  out->set_device(o.device);
  out->set_muon_wave_budget_bytes(o.wave_budget);
  out->set_threads_per_rank(static_cast<int32_t>(o.threads));
}

// The request a job's workers will plan: its model's spec (the optimizer
// rules applied), world size and parallelism config; the plan options the
// job sets, unless a flag gave them.
absl::Status FillFromJob(const std::string& path, v1::PlanLayoutRequest* request) {
  MUONMESH_ASSIGN_OR_RETURN(v1::JobSpec job, job::LoadJobFile(path));
  const std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
  std::string spec_path = job.model().synthetic().spec();
  if (!spec_path.empty() && std::filesystem::path(spec_path).is_relative()) {
    spec_path = (dir / spec_path).string();
  }
  MUONMESH_ASSIGN_OR_RETURN(
      plan::ModelSpec model,
      job::ModelSpecOf(job.model(), job.parallelism().expert_model_parallel_size(), spec_path),
      path);
  std::vector<std::pair<std::string, std::string>> rules;
  for (const v1::OptimizerRule& r : job.optimizer().rules()) {
    rules.emplace_back(r.pattern(), r.optimizer());
  }
  MUONMESH_ASSIGN_OR_RETURN(model, job::ApplyOptimizerRules(std::move(model), rules), path);
  *request->mutable_model() = ModelToProto(model);
  request->set_world_size(job.world_size());
  *request->mutable_parallelism() = job.parallelism();
  v1::PlanOptions* o = request->mutable_options();
  o->set_owner_assignment(job.optimizer().owner_assignment());
  o->set_ns_steps(job.optimizer().muon().ns_steps());
  o->set_ns_algorithm(job.optimizer().muon().ns_algorithm());
  o->set_ns_coefficients(job.optimizer().muon().coefficients());
  o->set_device(job.device().empty() ? "cpu" : job.device());
  o->set_threads_per_rank(job.training().threads_per_rank());
  o->set_muon_replica_split(job.optimizer().muon_replica_split());
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
  AddConnectionFlags(parser, &f);
  bool help = false;
  if (absl::Status st = parser.Parse(args, &help); !st.ok()) return UsageError("plan", st);
  if (help) {
    std::cout << parser.Usage(kPlanSynopsis) << "\n" << kExitCodes;
    return kExitOk;
  }
  if (absl::Status st = CheckConfigFlags(parser, &f); !st.ok()) return UsageError("plan", st);
  if (absl::Status st = CheckNotZero(parser, "--ns-steps", o.ns_steps, 5); !st.ok()) {
    return UsageError("plan", st);
  }
  for (const auto& [flag, value] : {std::pair<const char*, int64_t>{"--ns-steps", o.ns_steps},
                                    {"--threads-per-rank", o.threads}}) {
    if (absl::Status st = CheckInt32(flag, value); !st.ok()) return UsageError("plan", st);
  }

  v1::PlanLayoutRequest request;
  if (!f.job.empty()) {
    if (absl::Status st = FillFromJob(f.job, &request); !st.ok()) {
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

  absl::StatusOr<rpc::ChannelSecurity> security = Security(f);
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
  }
  return kExitOk;
}

// ---------------------------------------------------------------- jobs

// A job command: one positional argument (the job file or job id) and the
// connection flags plus `extra`.
struct JobCommand {
  const char* name;
  const char* positional;  // "FILE", "JOB", or nullptr for none
  const char* synopsis;
  bool positional_optional = false;
};

// Parses `args` for `command`: the positional first (when the command takes
// one), then flags. Returns kExitOk to go on, or the exit code to return.
int ParseJobCommand(const JobCommand& command, const std::vector<std::string>& args,
                    FlagParser& parser, ConfigFlags* f, std::string* positional) {
  AddConnectionFlags(parser, f);
  std::vector<std::string> flags = args;
  if (command.positional != nullptr && !flags.empty() && !absl::StartsWith(flags[0], "-")) {
    *positional = flags[0];
    flags.erase(flags.begin());
  }
  bool help = false;
  if (absl::Status st = parser.Parse(flags, &help); !st.ok()) {
    return UsageError(command.name, st);
  }
  if (help) {
    std::cout << parser.Usage(command.synopsis) << "\n" << kExitCodes
              << "  6  watch: the job ended FAILED or CANCELLED\n";
    return -1;
  }
  if (command.positional != nullptr && !command.positional_optional && positional->empty()) {
    return UsageError(command.name, absl::InvalidArgumentError(absl::StrCat(
                                        "missing ", command.positional)));
  }
  if (f->timeout_seconds <= 0) {
    return UsageError(command.name,
                      absl::InvalidArgumentError("--timeout: must be a positive number"));
  }
  if (f->coordinator.empty()) {
    const char* env = std::getenv(kCoordinatorEnv);
    f->coordinator = env != nullptr && *env != '\0' ? env : kDefaultCoordinator;
  }
  return kExitOk;
}

int RunJobCommand(const std::string& name, const std::vector<std::string>& args) {
  static const JobCommand kCommands[] = {
      {"submit", "FILE",
       "FILE [--request-id ID] [--coordinator ADDR] [--timeout SECONDS]\n\n"
       "Submits the job file (YAML or JSON). Relative paths in it are made absolute against\n"
       "its folder, output.dir defaults to <its folder>/runs/<name>, and a synthetic model's\n"
       "spec file is sent inline. Prints the job id alone on the last line of stdout.\n"
       "Repeating a submit with the same --request-id makes one job."},
      {"status", "JOB",
       "[JOB] [--json] [--coordinator ADDR]\n\n"
       "The job's state, progress and timing; without JOB, how many jobs are in each state\n"
       "and how many workers of each device are idle, busy or lost.",
       /*positional_optional=*/true},
      {"list", nullptr,
       "[--state S[,S...]] [--name NAME] [--json] [--coordinator ADDR]\n\n"
       "Jobs, newest first (states: pending, running, restarting, succeeded, failed, "
       "cancelled)."},
      {"watch", "JOB",
       "JOB [--from INDEX] [--coordinator ADDR]\n\n"
       "Follows the job to its end: every state change, and every step's loss, time and ETA\n"
       "(a live progress bar on a terminal). Resumes from event INDEX (default: the first)."},
      {"metrics", "JOB",
       "JOB [--format table|json|csv] [--summary] [--all-ranks] [--coordinator ADDR]\n\n"
       "The job's per-step records: loss, step time and every phase, bytes sent, Newton-Schulz\n"
       "FLOPs (rank 0's, or every rank's with --all-ranks); --summary adds medians and totals."},
      {"cancel", "JOB", "JOB [--reason TEXT] [--coordinator ADDR]\n\nStops the job; its workers are freed."},
      {"workers", nullptr, "[--json] [--coordinator ADDR]\n\nThe registered workers."}};
  const JobCommand* command = nullptr;
  for (const JobCommand& c : kCommands) {
    if (name == c.name) command = &c;
  }
  if (command == nullptr) return -2;
  ConfigFlags f;
  FlagParser parser(absl::StrCat("muonmeshctl ", name));
  std::string positional, request_id, states, job_name, reason, format = "table";
  int64_t from = 0;
  bool summary = false, all_ranks = false;
  if (name == "submit") parser.String("--request-id", "ID", "idempotency key (<= 128 bytes)", &request_id);
  if (name == "list") {
    parser.String("--state", "S", "only jobs in these states (comma-separated)", &states);
    parser.String("--name", "NAME", "only jobs of this name", &job_name);
  }
  if (name == "watch") parser.Int("--from", "INDEX", "first event to show (default 1)", &from);
  if (name == "metrics") {
    parser.String("--format", "F", "table (default), json or csv", &format);
    parser.Bool("--summary", "add medians and totals", &summary);
    parser.Bool("--all-ranks", "every rank's records, not rank 0's", &all_ranks);
  }
  if (name == "cancel") parser.String("--reason", "TEXT", "recorded with the cancel", &reason);
  if (const int code = ParseJobCommand(*command, args, parser, &f, &positional); code != kExitOk) {
    return code < 0 ? kExitOk : code;
  }
  absl::StatusOr<rpc::ChannelSecurity> security = Security(f);
  if (!security.ok()) return UsageError(name, security.status());
  CoordinatorClient client(f.coordinator, {absl::Seconds(f.timeout_seconds), *security});
  cli::Streams io{std::cout, std::cerr, isatty(STDOUT_FILENO) != 0};
  if (name == "submit") return cli::Submit(client, positional, request_id, io);
  if (name == "status") return cli::Status(client, positional, f.json, io);
  if (name == "list") return cli::List(client, states, job_name, f.json, io);
  if (name == "watch") return cli::Watch(client, positional, from, io);
  if (name == "metrics") return cli::Metrics(client, positional, format, summary, all_ranks, io);
  if (name == "cancel") return cli::Cancel(client, positional, reason, io);
  return cli::Workers(client, f.json, io);
}

constexpr const char* kHelpHead =
    "muonmeshctl: command-line client of the muonmesh coordinator.\n"
    "\n"
    "Usage: muonmeshctl <command> [flags]\n"
    "\n"
    "Commands:\n"
    "  submit     submit a job file; prints the job id\n"
    "  status     a job's state, progress and timing (no JOB: jobs and workers by state)\n"
    "  list       jobs, newest first\n"
    "  watch      follow a job to its end (steps, loss, ETA)\n"
    "  metrics    a job's per-step records (table, JSON or CSV)\n"
    "  cancel     stop a job\n"
    "  workers    the registered workers\n"
    "  validate   check a parallelism config against a model spec\n"
    "  plan       compute the mesh, shard layout and Muon owner ranks\n"
    "  help       show this help\n"
    "\n"
    "Run 'muonmeshctl <command> --help' for a command's flags. The connection flags\n"
    "(--coordinator, --timeout, --tls-ca, --tls-cert, --tls-key, --tls-server-name,\n"
    "--token-file) may also come before the command name. A coordinator with TLS and\n"
    "tokens needs --tls-ca and a token (README \"Security\"): set MUONMESH_TLS_CA and\n"
    "MUONMESH_TOKEN_FILE once instead of repeating them.\n"
    "\n";

std::string Help() { return absl::StrCat(kHelpHead, kExitCodes); }

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << Help();
    return kExitUsage;
  }
  // Shared flags may come before the command (as kubectl and docker take
  // theirs): move them after it.
  std::vector<std::string> all(argv + 1, argv + argc);
  std::vector<std::string> leading;
  static const char* const kShared[] = {"--coordinator", "--timeout",  "--tls-ca",
                                        "--tls-cert",    "--tls-key",  "--tls-server-name",
                                        "--token-file"};
  auto shared = [](const std::string& arg, bool with_value) {
    for (const char* flag : kShared) {
      if (with_value ? absl::StartsWith(arg, absl::StrCat(flag, "=")) : arg == flag) return true;
    }
    return false;
  };
  while (!all.empty()) {
    if (shared(all[0], false) && all.size() >= 2) {
      leading.insert(leading.end(), all.begin(), all.begin() + 2);
      all.erase(all.begin(), all.begin() + 2);
    } else if (shared(all[0], true)) {
      leading.push_back(all[0]);
      all.erase(all.begin());
    } else {
      break;
    }
  }
  if (all.empty()) {
    std::cerr << Help();
    return kExitUsage;
  }
  const std::string command = all[0];
  std::vector<std::string> args(all.begin() + 1, all.end());
  args.insert(args.end(), leading.begin(), leading.end());
  if (command == "help" || command == "--help" || command == "-h") {
    std::cout << Help();
    return kExitOk;
  }
  if (command == "validate") return RunValidate(args);
  if (command == "plan") return RunPlan(args);
  if (const int code = RunJobCommand(command, args); code != -2) return code;
  std::cerr << "muonmeshctl: unknown command '" << command << "'\n"
            << "Run 'muonmeshctl help' for the list of commands.\n";
  return kExitUsage;
}

}  // namespace
}  // namespace muonmesh

int main(int argc, char** argv) { return muonmesh::Main(argc, argv); }
