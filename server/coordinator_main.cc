// muonmesh-coordinator: the gRPC control plane (DESIGN.md §1). Today it
// serves the Planner; scheduling, rendezvous and metrics come later.

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/coordinator_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "HOST:PORT to serve on; port 0 picks a free port (printed when ready)");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
          "on SIGINT/SIGTERM, how long calls in flight may finish before they are cancelled "
          "(plans being computed are cancelled at once); a second signal exits at once (code 1)");
ABSL_FLAG(std::string, data_dir, "",
          "folder of the durable state (state.db: jobs, events, step records); created if "
          "missing. Empty: $HOME/.local/state/muonmesh (./muonmesh-state without HOME). "
          "'none' serves the Planner only (no Jobs, Fleet or Store)");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT to serve Prometheus metrics on (http://HOST:PORT/metrics); port 0 picks "
          "one (printed when ready); empty: no metrics endpoint");
ABSL_FLAG(absl::Duration, lease_ttl, absl::Seconds(10),
          "how long a worker may go without a heartbeat before it counts as lost (its job "
          "attempt fails and restarts if it may); workers heartbeat every lease_ttl / 5");
ABSL_FLAG(absl::Duration, collective_timeout, absl::Seconds(60),
          "the timeout of every collective in the workers of a job (a stalled peer is caught "
          "after at most this long)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) to serve TLS with; needs --tls-key. Default "
          "$MUONMESH_TLS_CERT. Without TLS and tokens only a loopback --listen is served");
ABSL_FLAG(std::string, tls_key, "",
          "PEM private key of --tls-cert (unencrypted; keep it mode 600). Default "
          "$MUONMESH_TLS_KEY");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA for mutual TLS: clients may present a certificate it signed, and Fleet and "
          "Store (worker traffic) require one. Default $MUONMESH_TLS_CA");
ABSL_FLAG(std::string, tokens_file, "",
          "bearer tokens and their roles (viewer, submitter, worker, admin), one 'ROLE TOKEN' "
          "or 'ROLE sha256:HEX' per line; needs TLS. Default $MUONMESH_TOKENS_FILE");
ABSL_FLAG(bool, insecure, false,
          "serve a non-loopback --listen without TLS and tokens anyway (logged as a warning); "
          "without it such an address is refused");
ABSL_FLAG(int64_t, max_concurrent_plans, 4,
          "PlanLayout calls computed at once; more are refused with RESOURCE_EXHAUSTED (>= 1)");
ABSL_FLAG(int64_t, plan_memory_mib, 4096,
          "memory, in MiB, that the PlanLayout calls computed at once may hold together, by each "
          "call's estimate from its spec (request, planner working set, answer); a call that "
          "would pass it is refused with RESOURCE_EXHAUSTED (>= 1)");

namespace {

// A flag name as users write it: "data-dir" for absl's "data_dir" (the
// worker and muonmeshctl spell their flags with dashes too).
std::string Dashed(absl::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

// absl accepts only the names as declared: rewrites "--data-dir[=V]" to
// "--data_dir[=V]" so both spellings work. Stops at "--", after which
// everything is positional.
std::vector<std::string> UnderscoreFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (std::size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg[0] != '-') continue;
    const std::size_t begin = arg[1] == '-' ? 2 : 1;
    const std::size_t end = std::min(arg.find('='), arg.size());
    std::replace(arg.begin() + static_cast<std::ptrdiff_t>(begin),
                 arg.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
  }
  return args;
}

// Usage and this file's flags, sorted. absl's own --help lists flags only
// from files named after the program and exits 1; asking for help is not an
// error, and gRPC's or absl's internal flags are noise here.
void PrintHelp() {
  std::cout << "muonmesh-coordinator: " << absl::ProgramUsageMessage() << "\n\nFlags:\n";
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), "coordinator_main.cc")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  for (const absl::CommandLineFlag* flag : flags) {
    std::cout << "  --" << Dashed(flag->Name()) << " (default " << flag->DefaultValue() << ")\n      "
              << flag->Help() << "\n";
  }
}

// The flags as server options. InvalidArgument naming a flag out of range.
absl::Status OptionsFromFlags(muonmesh::CoordinatorServerOptions* options) {
  options->listen = absl::GetFlag(FLAGS_listen);
  options->security = muonmesh::auth::WithEnvironment({
      .tls_cert = absl::GetFlag(FLAGS_tls_cert),
      .tls_key = absl::GetFlag(FLAGS_tls_key),
      .tls_ca = absl::GetFlag(FLAGS_tls_ca),
      .tokens_file = absl::GetFlag(FLAGS_tokens_file),
      .insecure = absl::GetFlag(FLAGS_insecure),
  });
  options->log = [](const std::string& line) {
    std::cerr << "muonmesh-coordinator: " << line << std::endl;
  };
  const int64_t plans = absl::GetFlag(FLAGS_max_concurrent_plans);
  const int64_t mib = absl::GetFlag(FLAGS_plan_memory_mib);
  if (plans < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max-concurrent-plans must be >= 1, got ",
                                                   plans));
  }
  // 2^40 MiB is a petabyte: more is a typo, and would overflow bytes.
  if (mib < 1 || mib > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--plan-memory-mib must be in [1, 2^40], got ", mib));
  }
  options->planner.admission = {.max_calls = plans, .max_bytes = mib << 20};
  std::string data_dir = absl::GetFlag(FLAGS_data_dir);
  if (data_dir.empty()) {
    const char* home = std::getenv("HOME");
    data_dir = home != nullptr && *home != '\0' ? absl::StrCat(home, "/.local/state/muonmesh")
                                                : std::string("muonmesh-state");
  }
  if (data_dir != "none") options->control.data_dir = data_dir;
  options->control.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  const absl::Duration ttl = absl::GetFlag(FLAGS_lease_ttl);
  const absl::Duration collective = absl::GetFlag(FLAGS_collective_timeout);
  if (ttl < absl::Milliseconds(500) || ttl > absl::Hours(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lease-ttl must be in [500ms, 1h], got ", absl::FormatDuration(ttl)));
  }
  if (collective < absl::Seconds(1) || collective > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--collective-timeout must be in [1s, 24h], got ", absl::FormatDuration(collective)));
  }
  options->control.lease_ttl = ttl;
  options->control.heartbeat_interval = ttl / 5;
  options->control.collective_timeout = collective;
  return absl::OkStatus();
}

// Runs on its own thread with the stop signals blocked everywhere: the first
// SIGINT/SIGTERM shuts the server down (on a helper thread, as Shutdown
// blocks until calls end), a second one exits at once with code 1. Returns
// when `done` is set after the server has stopped.
// Stop signals that reached a thread which does not block them: libraries
// loaded with the binary (OpenBLAS) start threads before main blocks the
// signals, and without a handler the kernel would kill the process there.
// The handler only records the signal (async-signal-safe); StopOnSignals
// polls it beside sigtimedwait.
std::atomic<int> g_unblocked_signal{0};
extern "C" void RecordStopSignal(int signal_number) { g_unblocked_signal.store(signal_number); }

void StopOnSignals(const sigset_t& signals, absl::Duration grace,
                   muonmesh::CoordinatorServer& server, const std::atomic<bool>& done) {
  std::thread shutdown;
  // A short timeout, so that `done` is seen soon after a clean stop.
  const timespec poll = {0, 100'000'000};
  while (!done.load()) {
    int signal_number = sigtimedwait(&signals, nullptr, &poll);
    if (signal_number < 0) signal_number = g_unblocked_signal.exchange(0);
    if (signal_number <= 0) continue;  // timeout or EINTR
    const char* name = signal_number == SIGINT ? "SIGINT" : "SIGTERM";
    if (shutdown.joinable()) {
      std::cerr << "muonmesh-coordinator: " << name << " again, exiting now" << std::endl;
      std::_Exit(1);
    }
    std::cerr << "muonmesh-coordinator: " << name << ", shutting down (grace "
              << absl::FormatDuration(grace) << "; a second signal exits at once)" << std::endl;
    shutdown = std::thread([&server, grace] { server.Shutdown(grace); });
  }
  if (shutdown.joinable()) shutdown.join();
}

}  // namespace

// Parses the command line into `options`: 0 to go on, else the exit code
// (0 after --help, 2 on a usage error, which it has printed).
std::optional<int> ParseFlags(int argc, char** argv, muonmesh::CoordinatorServerOptions* options) {
  absl::SetProgramUsageMessage(
      "the muonmesh control plane (gRPC: muonmesh.v1.Planner, Jobs, Fleet, Store,\n"
      "grpc.health.v1, reflection; Prometheus metrics over HTTP).\n"
      "Usage: muonmesh-coordinator [--listen HOST:PORT] [--data-dir DIR] [--metrics-listen "
      "HOST:PORT]\n"
      "       [--lease-ttl 10s] [--collective-timeout 60s] [--shutdown-grace 5s]\n"
      "       [--max-concurrent-plans 4] [--plan-memory-mib 4096]\n"
      "       [--tls-cert FILE --tls-key FILE [--tls-ca FILE] --tokens-file FILE] [--insecure]\n"
      "Flag names may be written with '-' or '_' (--data-dir or --data_dir).\n"
      "Prints 'muonmesh-coordinator listening on HOST:PORT' when ready; stops on SIGINT or "
      "SIGTERM\n(exit code 0), at once on a second one (exit code 1).");
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull" || arg == "-help") {
      PrintHelp();
      return 0;
    }
  }
  std::vector<std::string> args = UnderscoreFlagNames(argc, argv);
  // absl exits 1 on an unknown flag; a usage error is 2 here, as in muonmeshctl.
  for (std::size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 2 || arg[0] != '-') continue;
    const absl::string_view name = absl::string_view(arg)
                                       .substr(arg[1] == '-' ? 2 : 1)
                                       .substr(0, arg.find('=') == std::string::npos
                                                      ? std::string::npos
                                                      : arg.find('=') - (arg[1] == '-' ? 2 : 1));
    if (absl::FindCommandLineFlag(name) == nullptr) {
      std::cerr << "muonmesh-coordinator: unknown flag --" << Dashed(name) << " (see --help)\n";
      return 2;
    }
  }
  std::vector<char*> arg_ptrs;
  for (std::string& arg : args) arg_ptrs.push_back(arg.data());
  const std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(arg_ptrs.size()), arg_ptrs.data());
  if (rest.size() > 1) {
    std::cerr << "muonmesh-coordinator: unexpected argument '" << rest[1] << "' (see --help)\n";
    return 2;
  }
  if (absl::Status st = OptionsFromFlags(options); !st.ok()) {
    std::cerr << "muonmesh-coordinator: " << st.message() << " (see --help)\n";
    return 2;
  }
  return std::nullopt;
}

// Blocks SIGINT and SIGTERM in every thread to come (StopOnSignals waits
// for them), records a second one at once, and ignores SIGPIPE; false when
// the mask cannot be set.
bool SetUpSignals(sigset_t* stop_signals) {
  // Block the stop signals before any thread exists: every thread gRPC
  // starts inherits the mask, so the signals wait for StopOnSignals' thread,
  // which runs outside signal context and may call anything (a handler could only
  // call async-signal-safe functions, and Shutdown is not one).
  sigemptyset(stop_signals);
  sigaddset(stop_signals, SIGINT);
  sigaddset(stop_signals, SIGTERM);
  if (const int err = pthread_sigmask(SIG_BLOCK, stop_signals, nullptr); err != 0) {
    std::cerr << "muonmesh-coordinator: pthread_sigmask: " << std::strerror(err) << "\n";
    return false;
  }
  struct sigaction record {};
  record.sa_handler = RecordStopSignal;
  sigemptyset(&record.sa_mask);
  sigaction(SIGINT, &record, nullptr);
  sigaction(SIGTERM, &record, nullptr);
  // A client that hangs up mid-write must not kill the server.
  signal(SIGPIPE, SIG_IGN);
  return true;
}

int main(int argc, char** argv) {
  muonmesh::CoordinatorServerOptions options;
  if (std::optional<int> exit_code = ParseFlags(argc, argv, &options)) return *exit_code;
  sigset_t stop_signals;
  if (!SetUpSignals(&stop_signals)) return 1;

  absl::StatusOr<std::unique_ptr<muonmesh::CoordinatorServer>> server =
      muonmesh::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::cerr << "muonmesh-coordinator: " << server.status().message() << "\n";
    return 1;
  }
  for (const std::string& note : (*server)->security_notes()) {
    std::cerr << "muonmesh-coordinator: " << note << std::endl;
  }
  // Scripts and tests wait for this exact line (and read the port from it).
  if ((*server)->control() != nullptr) {
    std::cerr << "muonmesh-coordinator: state in " << options.control.data_dir << std::endl;
    if (const int port = (*server)->control()->metrics_port(); port > 0) {
      std::cout << "muonmesh-coordinator metrics on port " << port << std::endl;
    }
  }
  std::cout << "muonmesh-coordinator listening on " << (*server)->address() << std::endl;

  const absl::Duration grace = absl::GetFlag(FLAGS_shutdown_grace);
  std::atomic<bool> done{false};
  std::thread stopper([&] { StopOnSignals(stop_signals, grace, **server, done); });
  // Returns only after Shutdown, which only the stopper calls.
  (*server)->Wait();
  done.store(true);
  stopper.join();
  return 0;
}
