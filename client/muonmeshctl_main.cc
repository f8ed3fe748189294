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

#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/cli_flags.h"
#include "client/config_commands.h"
#include "client/coordinator_client.h"
#include "client/job_commands.h"
#include "core/base/flag_parser.h"
#include "proto/credentials/credentials.h"
#include "proto/rpc/version.h"

namespace muonmesh::client {
namespace {

using client::AddConnectionFlags;
using client::ConfigFlags;
using client::kCoordinatorEnv;
using client::kDefaultCoordinator;
using client::kExitCodes;
using client::kExitOk;
using client::kExitUsage;
using client::Security;
using client::UsageError;

// ---------------------------------------------------------------- jobs

// A job command: one positional argument (the job file or job id) and the
// connection flags plus `extra`.
struct JobCommand {
  const char* name;
  const char* positional;  // "FILE", "JOB", or nullptr for none
  const char* synopsis;
  bool positional_optional = false;
};

// Parses `args` for `command`: its positional (when it takes one) anywhere
// among the flags. Returns kExitOk to go on, or the exit code to return.
int ParseJobCommand(const JobCommand& command, const std::vector<std::string>& args,
                    FlagParser& parser, ConfigFlags* f, std::string* positional) {
  std::vector<std::string> positionals;
  bool help = false;
  if (absl::Status st = parser.Parse(args, &help, &positionals); !st.ok()) {
    return UsageError(command.name, st);
  }
  const size_t takes = command.positional != nullptr ? 1 : 0;
  if (!help && positionals.size() > takes) {
    return UsageError(command.name, absl::InvalidArgumentError(absl::StrCat(
                                        "unexpected argument '", positionals[takes], "'")));
  }
  if (!positionals.empty()) *positional = positionals[0];
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

// The commands that talk to the coordinator's job and fleet services.
const JobCommand kCommands[] = {
    {"submit", "FILE",
     "FILE [--request-id ID] [--coordinator ADDR] [--timeout SECONDS]\n\n"
     "Submits the job file (YAML or JSON). Relative paths in it are made absolute against\n"
     "its folder, output.dir defaults to <its folder>/runs/<name>, and a synthetic model's\n"
     "spec file is sent inline. Prints the job id alone on the last line of stdout.\n"
     "Repeating a submit with the same --request-id makes one job."},
    {"resume", "JOB",
     "JOB [--world-size N] [--request-id ID] [--coordinator ADDR]\n\n"
     "Submits the job again, continuing from the newest complete checkpoint in its output\n"
     "folder (init: {checkpoint: <output.dir>}), at --world-size ranks (default: as before;\n"
     "a checkpoint loads under any layout). The job must have ended (cancel it first,\n"
     "with --checkpoint to keep its last step). Prints the new job's id."},
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
     "JOB [--from INDEX] [--timeout SECONDS] [--coordinator ADDR]\n\n"
     "Follows the job to its end: every state change, and every step's loss, time and ETA\n"
     "(a live progress bar on a terminal; a line per event, written as it comes, otherwise).\n"
     "Resumes from event INDEX (default: the first). With --timeout it stops after that long;\n"
     "stopped early (or by Ctrl-C) it prints the --from to go on with."},
    {"metrics", "JOB",
     "JOB [--format table|json|csv | --json] [--summary] [--all-ranks] [--coordinator ADDR]\n\n"
     "The job's per-step records: loss, step time and every phase, bytes sent, Newton-Schulz\n"
     "FLOPs (rank 0's, or every rank's with --all-ranks); --summary adds medians and totals."},
    {"cancel", "JOB",
     "JOB [--reason TEXT] [--checkpoint] [--coordinator ADDR]\n\n"
     "Stops the job; its workers are freed. With --checkpoint its ranks first finish their\n"
     "current step and checkpoint it, so that `muonmeshctl resume JOB` loses no step (cancel\n"
     "again without it to stop them at once)."},
    {"drain", "WORKER",
     "WORKER [--reason TEXT] [--coordinator ADDR]\n\n"
     "Takes a worker out of service (admin role): it gets no new rank; a job it runs writes a\n"
     "checkpoint at its next step, stops and goes on from it on other workers without\n"
     "spending a restart; then the worker exits 0."},
    {"delete", "JOB",
     "JOB [--coordinator ADDR]\n\n"
     "Removes a finished job with its events and step records (its output folder stays).\n"
     "A job that has not finished is refused: cancel it first."},
    {"prune", nullptr,
     "--older-than DURATION [--coordinator ADDR]\n\n"
     "Removes every job that finished more than DURATION ago (in h, m or s: 168h is a\n"
     "week), as delete does (admin role). The coordinator prunes by itself past its\n"
     "--retain-finished."},
    {"workers", nullptr,
     "[--json] [--coordinator ADDR]\n\n"
     "The registered workers. 'muonmeshctl workers remove WORKER' forgets a LOST one."},
    {"workers remove", "WORKER",
     "WORKER | --all-lost [--coordinator ADDR]\n\n"
     "Forgets a LOST worker now (admin role), or every LOST one with --all-lost (after a\n"
     "scale-down), as the coordinator's --forget-lost-after does after a while: they leave\n"
     "the list and the LOST count. A live worker is refused: drain it and stop it first.",
     /*positional_optional=*/true}};

// Ctrl-C during a watch: end the line the progress bar was on and say how to
// go on (the event after the last one printed), then exit 130 as a shell
// does for SIGINT. Only async-signal-safe calls.
char watched_job[160] = {};

void WriteAll(const char* text) { (void)!::write(STDERR_FILENO, text, std::strlen(text)); }

void OnWatchInterrupted(int) {
  char number[24] = {};
  int64_t n = client::WatchNextIndex();
  int at = sizeof(number) - 1;
  do {
    number[--at] = static_cast<char>('0' + n % 10);
    n /= 10;
  } while (n > 0 && at > 0);
  (void)!::write(STDOUT_FILENO, "\n", 1);
  WriteAll("muonmeshctl: watch interrupted; go on with: muonmeshctl watch ");
  WriteAll(watched_job);
  WriteAll(" --from ");
  WriteAll(number + at);
  WriteAll("\n");
  ::_exit(130);
}

void OnInterruptDuringWatch(const std::string& job_id) {
  std::strncpy(watched_job, job_id.c_str(), sizeof(watched_job) - 1);
  struct sigaction action {};
  action.sa_handler = OnWatchInterrupted;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
}

// The values of a job command's own flags.
struct JobFlags {
  std::string request_id, states, job_name, reason, format = "table";
  int64_t from = 0;
  int64_t world_size = 0;
  bool summary = false, all_ranks = false, all_lost = false, checkpoint = false;
  absl::Duration older_than = absl::ZeroDuration();
  // watch: how long to follow (--timeout when given; else to the job's end).
  absl::Duration watch_timeout = absl::InfiniteDuration();
};

// Registers the flags command `name` takes besides the connection's.
void AddJobFlags(const std::string& name, FlagParser& parser, JobFlags* j) {
  if (name == "submit" || name == "resume") {
    parser.String("--request-id", "ID", "idempotency key (<= 128 bytes)", &j->request_id);
  }
  if (name == "resume") {
    parser.Int("--world-size", "N", "ranks of the resumed job (default: as before)",
               &j->world_size);
  }
  if (name == "list") {
    parser.String("--state", "S", "only jobs in these states (comma-separated)", &j->states);
    parser.String("--name", "NAME", "only jobs of this name", &j->job_name);
  }
  if (name == "watch") parser.Int("--from", "INDEX", "first event to show (default 1)", &j->from);
  if (name == "metrics") {
    parser.String("--format", "F", "table (default), json or csv", &j->format);
    parser.Bool("--summary", "add medians and totals", &j->summary);
    parser.Bool("--all-ranks", "every rank's records, not rank 0's", &j->all_ranks);
  }
  if (name == "workers remove") parser.Bool("--all-lost", "every LOST worker", &j->all_lost);
  if (name == "cancel") {
    parser.String("--reason", "TEXT", "recorded with the cancel", &j->reason);
    parser.Bool("--checkpoint", "checkpoint the current step before stopping", &j->checkpoint);
  }
  if (name == "drain") {
    parser.String("--reason", "TEXT", "recorded in the job's events", &j->reason);
  }
  if (name == "prune") {
    parser.Duration("--older-than", "DURATION", "jobs that finished longer ago go (required)",
                    &j->older_than);
  }
}

// Runs parsed command `name` against the coordinator.
int DispatchJobCommand(const std::string& name, const std::string& positional, const JobFlags& j,
                       bool json, bool format_given, CoordinatorClient& client, client::Streams io) {
  if (name == "submit") return client::Submit(client, positional, j.request_id, io);
  if (name == "resume") {
    if (j.world_size < 0) {
      return UsageError(name, absl::InvalidArgumentError(absl::StrCat(
                                  "--world-size: must be >= 1, got ", j.world_size)));
    }
    return client::Resume(client, positional, j.world_size, j.request_id, io);
  }
  if (name == "status") return client::Status(client, positional, json, io);
  if (name == "list") return client::List(client, j.states, j.job_name, json, io);
  if (name == "watch") {
    OnInterruptDuringWatch(positional);
    return client::Watch(client, positional, j.from, j.watch_timeout, json, io);
  }
  if (name == "metrics") {
    if (json && format_given && j.format != "json") {
      return UsageError(name, absl::InvalidArgumentError(absl::StrCat(
                                  "--json and --format ", j.format, " ask for two formats")));
    }
    return client::Metrics(client, positional, json ? "json" : j.format, j.summary, j.all_ranks, io);
  }
  if (name == "cancel") return client::Cancel(client, positional, j.reason, j.checkpoint, io);
  if (name == "drain") return client::Drain(client, positional, j.reason, io);
  if (name == "delete") return client::Delete(client, positional, io);
  if (name == "prune") return client::Prune(client, j.older_than, io);
  if (name == "workers remove") {
    if (positional.empty() == !j.all_lost) {
      return UsageError(name,
                        absl::InvalidArgumentError("give a WORKER or --all-lost (one of the two)"));
    }
    return j.all_lost ? client::RemoveLostWorkers(client, io)
                      : client::RemoveWorker(client, positional, io);
  }
  return client::Workers(client, json, io);
}

int RunJobCommand(std::string name, std::vector<std::string> args) {
  // "workers remove" is a command of its own, typed as two words, the
  // second right after the first.
  if (absl::StrContains(name, ' ')) return -2;
  if (name == "workers" && !args.empty() && args[0] == "remove") {
    name = "workers remove";
    args.erase(args.begin());
  }
  const JobCommand* command = nullptr;
  for (const JobCommand& c : kCommands) {
    if (name == c.name) command = &c;
  }
  if (command == nullptr) return -2;
  ConfigFlags f;
  FlagParser parser(absl::StrCat("muonmeshctl ", name));
  JobFlags j;
  AddJobFlags(name, parser, &j);
  // --json where the command prints an answer as JSON (metrics: --format json).
  AddConnectionFlags(parser, &f,
                     name == "status" || name == "list" || name == "workers" || name == "metrics" ||
                         name == "watch");
  std::string positional;
  if (const int code = ParseJobCommand(*command, args, parser, &f, &positional); code != kExitOk) {
    return code < 0 ? kExitOk : code;
  }
  absl::StatusOr<credentials::ChannelSecurity> security = Security(f);
  if (!security.ok()) return UsageError(name, security.status());
  CoordinatorClient client(f.coordinator, {absl::Seconds(f.timeout_seconds), *security});
  if (parser.Seen("--timeout")) j.watch_timeout = absl::Seconds(f.timeout_seconds);
  return DispatchJobCommand(name, positional, j, f.json, parser.Seen("--format"), client,
                            client::Streams{std::cout, std::cerr, isatty(STDOUT_FILENO) != 0});
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
    "  drain      take a worker out of service (its job moves, losing no step)\n"
    "  delete     remove a finished job and its records\n"
    "  prune      remove the jobs that finished before a time\n"
    "  workers    the registered workers ('workers remove WORKER': forget a LOST one)\n"
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
  if (command == "version" || command == "--version") {
    std::cout << "muonmeshctl " << rpc::Version() << "\n";
    return kExitOk;
  }
  if (command == "validate") return client::RunValidate(args);
  if (command == "plan") return client::RunPlan(args);
  if (const int code = RunJobCommand(command, args); code != -2) return code;
  std::cerr << "muonmeshctl: unknown command '" << command << "'\n"
            << "Run 'muonmeshctl help' for the list of commands.\n";
  return kExitUsage;
}

}  // namespace
}  // namespace muonmesh::client

int main(int argc, char** argv) {
  muonmesh::credentials::InitOpenSslWithoutExitHandler();
  return muonmesh::client::Main(argc, argv);
}
