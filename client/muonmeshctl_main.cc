// muonmeshctl: the command-line client of the coordinator (DESIGN.md §1).
//
// Exit codes, which scripts rely on:
//   0  success
//   1  the config is invalid (violations on stderr, one per line)
//   2  usage error, or a spec file that does not load
//   3  the coordinator cannot be reached or the RPC failed

#include <cstdint>
#include <cstdlib>
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
#include "client/json_writer.h"
#include "client/plan_table.h"
#include "client/planner_client.h"
#include "muonmesh/v1/planner.pb.h"
#include "proto/io/message_file.h"

namespace muonmesh {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitInvalidConfig = 1;
constexpr int kExitUsage = 2;
constexpr int kExitRpc = 3;

constexpr const char* kDefaultCoordinator = "127.0.0.1:50051";
constexpr const char* kCoordinatorEnv = "MUONMESH_COORDINATOR";

// ---------------------------------------------------------------- argv

// A deliberately small parser: `--name value` or `--name=value`, booleans
// take no value, no positional arguments. Each subcommand declares its
// flags; errors name the offending flag.
class FlagParser {
 public:
  explicit FlagParser(std::string command) : command_(std::move(command)) {}

  void String(std::string name, std::string value_name, std::string help, std::string* out) {
    flags_.push_back({std::move(name), std::move(value_name), std::move(help), out});
  }
  void Int(std::string name, std::string value_name, std::string help, int64_t* out) {
    flags_.push_back({std::move(name), std::move(value_name), std::move(help), out});
  }
  void Bool(std::string name, std::string help, bool* out) {
    flags_.push_back({std::move(name), "", std::move(help), out});
  }

  // Parses args; sets *help when --help/-h is among them (then nothing else
  // is checked). InvalidArgument naming the flag on any error.
  absl::Status Parse(const std::vector<std::string>& args, bool* help) {
    *help = false;
    for (const std::string& a : args) {
      if (a == "--help" || a == "-h") {
        *help = true;
        return absl::OkStatus();
      }
    }
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& arg = args[i];
      if (!absl::StartsWith(arg, "--")) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
      }
      std::string name = arg;
      std::string value;
      bool has_value = false;
      if (const size_t eq = arg.find('='); eq != std::string::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
        has_value = true;
      }
      Flag* flag = Find(name);
      if (flag == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag ", name));
      }
      if (std::holds_alternative<bool*>(flag->target)) {
        if (has_value) {
          return absl::InvalidArgumentError(absl::StrCat(name, " takes no value"));
        }
        *std::get<bool*>(flag->target) = true;
        flag->seen = true;
        continue;
      }
      if (!has_value) {
        // "--spec --json" is a forgotten value, not a file named "--json".
        if (i + 1 >= args.size() || absl::StartsWith(args[i + 1], "--")) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, " needs a value (", name, " ", flag->value_name, ")"));
        }
        value = args[++i];
      }
      if (auto* s = std::get_if<std::string*>(&flag->target)) {
        **s = value;
      } else if (auto* n = std::get_if<int64_t*>(&flag->target)) {
        if (!absl::SimpleAtoi(value, *n)) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, ": '", value, "' is not an integer"));
        }
      }
      flag->seen = true;
    }
    return absl::OkStatus();
  }

  bool Seen(const std::string& name) const {
    for (const Flag& f : flags_) {
      if (f.name == name) return f.seen;
    }
    return false;
  }

  std::string Usage(const std::string& synopsis) const {
    std::string out = absl::StrCat("Usage: muonmeshctl ", command_, " ", synopsis, "\n\nFlags:\n");
    size_t width = 0;
    for (const Flag& f : flags_) width = std::max(width, Left(f).size());
    for (const Flag& f : flags_) {
      const std::string left = Left(f);
      absl::StrAppend(&out, "  ", left, std::string(width - left.size() + 2, ' '), f.help, "\n");
    }
    absl::StrAppend(&out, "  --help", std::string(width > 4 ? width - 4 : 2, ' '),
                    "show this help\n");
    return out;
  }

 private:
  struct Flag {
    std::string name;
    std::string value_name;
    std::string help;
    std::variant<std::string*, int64_t*, bool*> target;
    bool seen = false;
  };

  static std::string Left(const Flag& f) {
    return f.value_name.empty() ? f.name : absl::StrCat(f.name, " ", f.value_name);
  }

  Flag* Find(const std::string& name) {
    for (Flag& f : flags_) {
      if (f.name == name) return &f;
    }
    return nullptr;
  }

  std::string command_;
  std::vector<Flag> flags_;
};

// ---------------------------------------------------------------- commands

// Flags shared by `validate` and `plan`.
struct ConfigFlags {
  std::string spec;
  int64_t world_size = 0;
  int64_t instances = 0;
  std::string strategy;
  std::string outer_strategy;
  int64_t ep = 0;
  std::string coordinator;
  int64_t timeout_seconds = 60;
  bool json = false;
};

void AddConfigFlags(FlagParser& parser, ConfigFlags* f) {
  parser.String("--spec", "FILE", "model spec (ModelSpec as YAML or JSON); required", &f->spec);
  parser.Int("--world-size", "W", "number of ranks; required", &f->world_size);
  parser.Int("--instances", "I",
             "num_distributed_optimizer_instances (>1 adds the dp_outer axis; default 1)",
             &f->instances);
  parser.String("--strategy", "S",
                "data_parallel_sharding_strategy: no_shard | optim | optim_grads | "
                "optim_grads_params (default)",
                &f->strategy);
  parser.String("--outer-strategy", "S",
                "outer_dp_sharding_strategy (only with --instances > 1; default optim)",
                &f->outer_strategy);
  parser.Int("--ep", "E", "expert_model_parallel_size (default 1)", &f->ep);
}

void AddConnectionFlags(FlagParser& parser, ConfigFlags* f) {
  parser.String("--coordinator", "ADDR",
                absl::StrCat("coordinator HOST:PORT (default $", kCoordinatorEnv, ", else ",
                             kDefaultCoordinator, ")"),
                &f->coordinator);
  parser.Int("--timeout", "SECONDS", "deadline of the call (default 60)", &f->timeout_seconds);
  parser.Bool("--json", "print the answer as JSON on stdout", &f->json);
}

// Checks what the parser cannot: required flags and local ranges. The
// config itself is the coordinator's to validate.
absl::Status CheckConfigFlags(const FlagParser& parser, ConfigFlags* f) {
  if (!parser.Seen("--spec")) return absl::InvalidArgumentError("missing required flag --spec");
  if (!parser.Seen("--world-size")) {
    return absl::InvalidArgumentError("missing required flag --world-size");
  }
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

// Prints an RPC error; violations (InvalidArgument) are the user's to fix.
int ReportError(const std::string& command, const absl::Status& status) {
  if (status.code() == absl::StatusCode::kInvalidArgument) {
    std::cerr << status.message() << "\n";
    return kExitInvalidConfig;
  }
  std::cerr << "muonmeshctl " << command << ": " << status.message() << "\n";
  return kExitRpc;
}

constexpr const char* kValidateSynopsis =
    "--spec FILE --world-size W [--instances I] [--strategy S] [--outer-strategy S] [--ep E] "
    "[--coordinator ADDR] [--timeout SECONDS] [--json]\n\n"
    "Asks the coordinator whether the parallelism config fits the model. Prints every\n"
    "violation as 'field: description' on stderr and exits 1 when it does not.";

int RunValidate(const std::vector<std::string>& args) {
  ConfigFlags f;
  FlagParser parser("validate");
  AddConfigFlags(parser, &f);
  AddConnectionFlags(parser, &f);
  bool help = false;
  if (absl::Status st = parser.Parse(args, &help); !st.ok()) return UsageError("validate", st);
  if (help) {
    std::cout << parser.Usage(kValidateSynopsis);
    return kExitOk;
  }
  if (absl::Status st = CheckConfigFlags(parser, &f); !st.ok()) return UsageError("validate", st);

  v1::ValidateConfigRequest request;
  if (!LoadSpec(f.spec, request.mutable_model())) return kExitUsage;
  request.set_world_size(f.world_size);
  FillParallelism(f, request.mutable_parallelism());

  PlannerClient client(f.coordinator, {.timeout = absl::Seconds(f.timeout_seconds)});
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
    "--spec FILE --world-size W [--instances I] [--strategy S] [--outer-strategy S] [--ep E] "
    "[--owner-rule R] [--ns-steps T] [--device cpu|cuda] [--include-shards] "
    "[--coordinator ADDR] [--timeout SECONDS] [--json]\n\n"
    "Asks the coordinator for the mesh, shard layout and Muon owners, and prints them as\n"
    "tables, or with --json as the Plan message (byte-stable for the same input).";

int RunPlan(const std::vector<std::string>& args) {
  ConfigFlags f;
  std::string owner_rule;
  int64_t ns_steps = 0;
  std::string device;
  bool include_shards = false;
  FlagParser parser("plan");
  AddConfigFlags(parser, &f);
  parser.String("--owner-rule", "R", "owner assignment: lpt (default) | round_robin | allgather",
                &owner_rule);
  parser.Int("--ns-steps", "T", "Newton-Schulz steps in the cost model (default 5)", &ns_steps);
  parser.String("--device", "cpu|cuda", "device whose cost model to use (default cuda)", &device);
  parser.Bool("--include-shards", "also return every shard's segments (JSON only; large)",
              &include_shards);
  AddConnectionFlags(parser, &f);
  bool help = false;
  if (absl::Status st = parser.Parse(args, &help); !st.ok()) return UsageError("plan", st);
  if (help) {
    std::cout << parser.Usage(kPlanSynopsis);
    return kExitOk;
  }
  if (absl::Status st = CheckConfigFlags(parser, &f); !st.ok()) return UsageError("plan", st);
  if (ns_steps < std::numeric_limits<int32_t>::min() ||
      ns_steps > std::numeric_limits<int32_t>::max()) {
    return UsageError("plan", absl::InvalidArgumentError(
                                  absl::StrCat("--ns-steps: ", ns_steps, " is out of range")));
  }

  v1::PlanLayoutRequest request;
  if (!LoadSpec(f.spec, request.mutable_model())) return kExitUsage;
  request.set_world_size(f.world_size);
  FillParallelism(f, request.mutable_parallelism());
  request.mutable_options()->set_owner_assignment(owner_rule);
  request.mutable_options()->set_ns_steps(static_cast<int32_t>(ns_steps));
  request.mutable_options()->set_device(device);
  request.set_include_shards(include_shards);

  PlannerClient client(f.coordinator, {.timeout = absl::Seconds(f.timeout_seconds)});
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

constexpr const char* kHelp =
    "muonmeshctl: command-line client of the muonmesh coordinator.\n"
    "\n"
    "Usage: muonmeshctl <command> [flags]\n"
    "\n"
    "Commands:\n"
    "  validate   check a parallelism config against a model spec\n"
    "  plan       compute the mesh, shard layout and Muon owner ranks\n"
    "  help       show this help\n"
    "\n"
    "Run 'muonmeshctl <command> --help' for a command's flags.\n"
    "Exit codes: 0 ok, 1 invalid config, 2 usage error or bad spec file,\n"
    "3 coordinator unreachable or RPC error.\n";

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kHelp;
    return kExitUsage;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  if (command == "help" || command == "--help" || command == "-h") {
    std::cout << kHelp;
    return kExitOk;
  }
  if (command == "validate") return RunValidate(args);
  if (command == "plan") return RunPlan(args);
  std::cerr << "muonmeshctl: unknown command '" << command << "'\n"
            << "Run 'muonmeshctl help' for the list of commands.\n";
  return kExitUsage;
}

}  // namespace
}  // namespace muonmesh

int main(int argc, char** argv) { return muonmesh::Main(argc, argv); }
