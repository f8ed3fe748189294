// muonmesh-coordinator: the gRPC control plane (docs/architecture.md §1): the Planner,
// Jobs, Fleet and Store services, health, reflection and Prometheus metrics.

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "core/base/flag_parser.h"
#include "core/base/status_macros.h"
#include "proto/job/allowed_dirs.h"
#include "proto/credentials/credentials.h"
#include "proto/rpc/version.h"
#include "server/coordinator_server.h"

namespace {

constexpr char kSynopsis[] =
    "[--listen HOST:PORT] [--data-dir DIR] [--metrics-listen HOST:PORT]\n"
    "       [--lease-ttl 10s] [--partition-grace 30s] [--collective-timeout 60s]\n"
    "       [--quarantine 10m] [--shutdown-grace 5s]\n"
    "       [--retain-finished 720h] [--max-jobs 10000] [--max-jobs-per-client 1000]\n"
    "       [--max-watches-per-client 64] [--max-recorded-steps 1000000]\n"
    "       [--forget-lost-after 1h]\n"
    "       [--max-concurrent-plans 4] [--plan-memory-mib 4096] [--max-rpc-threads 1024]\n"
    "       [--tls-cert FILE --tls-key FILE [--tls-ca FILE] --tokens-file FILE]\n"
    "       [--tls-refresh 1m] [--insecure]\n"
    "       [--allowed-dirs DIR[,DIR...]]\n"
    "\n"
    "The muonmesh control plane (gRPC: muonmesh.v1.Planner, Jobs, Fleet, Store,\n"
    "grpc.health.v1, reflection; Prometheus metrics over HTTP). Flag names may be written\n"
    "with '-' or '_' (--data-dir or --data_dir). Prints 'muonmesh-coordinator listening on\n"
    "HOST:PORT' when ready; stops on SIGINT or SIGTERM (exit code 0), at once on a second\n"
    "one (exit code 1). Exit code 2: a usage error.";

// The command line, with its defaults.
struct Flags {
  std::string listen = "127.0.0.1:50051";
  absl::Duration shutdown_grace = absl::Seconds(5);
  std::string data_dir;
  std::string metrics_listen;
  absl::Duration lease_ttl = absl::Seconds(10);
  absl::Duration partition_grace = absl::Seconds(30);
  absl::Duration quarantine = absl::Minutes(10);
  absl::Duration collective_timeout = absl::Seconds(60);
  absl::Duration retain_finished = absl::Hours(24 * 30);
  absl::Duration forget_lost_after = absl::Hours(1);
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  absl::Duration tls_refresh = absl::Minutes(1);
  std::string tokens_file;
  bool insecure = false;
  int64_t max_concurrent_plans = 4;
  int64_t max_rpc_threads = 1024;
  int64_t plan_memory_mib = 4096;
  int64_t max_jobs = 10000;
  int64_t max_jobs_per_client = 1000;
  int64_t max_watches_per_client = 64;
  int64_t max_recorded_steps = 1'000'000;
  std::string allowed_dirs;
  bool worker_ids_from_certificates = false;
};

// The bounds on what callers may make the coordinator hold.
void DeclareBoundFlags(muonmesh::FlagParser& parser, Flags* f) {
  parser.Int("--max-rpc-threads", "N",
             "threads serving calls at once; every open stream (a watch, a worker's "
             "assignments) holds one, and calls beyond are refused with RESOURCE_EXHAUSTED "
             "(>= 16, default 1024)",
             &f->max_rpc_threads);
  parser.Int("--max-jobs", "N",
             "jobs not yet finished (pending, running, restarting) the coordinator holds; a "
             "submit beyond is refused with RESOURCE_EXHAUSTED (0: no bound, default 10000)",
             &f->max_jobs);
  parser.Int("--max-jobs-per-client", "N",
             "jobs not yet finished that one client (an address) may have; a submit beyond is "
             "refused with RESOURCE_EXHAUSTED naming the client (0: no bound, default 1000)",
             &f->max_jobs_per_client);
  parser.Int("--max-watches-per-client", "N",
             "job watches one client (an address) may hold open at once; more are refused with "
             "RESOURCE_EXHAUSTED (0: no bound, default 64)",
             &f->max_watches_per_client);
  parser.Int("--max-recorded-steps", "N",
             "steps of one job whose step events and records are kept; a longer job keeps every "
             "k-th step (k = ceil(steps / N)), its last and those with a validation loss (0: "
             "every step, default 1000000)",
             &f->max_recorded_steps);
  parser.Duration("--forget-lost-after", "D",
                  "how long a LOST worker stays listed before it is forgotten (its id is free "
                  "either way); 0: until a full fleet needs its place. Default 1h",
                  &f->forget_lost_after);
  parser.Int("--max-concurrent-plans", "N",
             "PlanLayout calls computed at once; more are refused with RESOURCE_EXHAUSTED "
             "(>= 1, default 4)",
             &f->max_concurrent_plans);
  parser.Int("--plan-memory-mib", "MIB",
             "memory that the PlanLayout calls computed at once may hold together, by each "
             "call's estimate from its spec; a call that would pass it is refused with "
             "RESOURCE_EXHAUSTED (>= 1, default 4096)",
             &f->plan_memory_mib);
}

void DeclareFlags(muonmesh::FlagParser& parser, Flags* f) {
  DeclareBoundFlags(parser, f);
  parser.String("--listen", "HOST:PORT",
                "to serve on; port 0 picks a free port (printed when ready). Default "
                "127.0.0.1:50051",
                &f->listen);
  parser.String("--data-dir", "DIR",
                "folder of the durable state (state.db: jobs, events, step records); created if "
                "missing. Default $HOME/.local/state/muonmesh (./muonmesh-state without HOME); "
                "'none' serves the Planner only (no Jobs, Fleet or Store)",
                &f->data_dir);
  parser.String("--metrics-listen", "HOST:PORT",
                "to serve Prometheus metrics on (http://HOST:PORT/metrics); port 0 picks one "
                "(printed when ready). Default: no metrics endpoint",
                &f->metrics_listen);
  parser.Duration("--lease-ttl", "D",
                  "how long a worker may go without a heartbeat before it counts as lost (an "
                  "idle one at once; one running a rank after --partition-grace more); workers "
                  "heartbeat every lease-ttl / 5. In [500ms, 1h], default 10s",
                  &f->lease_ttl);
  parser.Duration("--partition-grace", "D",
                  "how long a worker silent past its lease keeps its rank while its peers train "
                  "on: it registers again within it (a partition healed) and its attempt goes "
                  "on, or it counts as lost then and the attempt fails over. 0: lost at the "
                  "lease. In [0, 1h], default 30s",
                  &f->partition_grace);
  parser.Duration("--quarantine", "D",
                  "how long a worker blamed for two failed attempts within an hour (its peers "
                  "could not reach it) gets no new rank; shown in muonmeshctl workers. 0: never "
                  "quarantined. In [0, 24h], default 10m",
                  &f->quarantine);
  parser.Duration("--collective-timeout", "D",
                  "the timeout of every collective in the workers of a job (a stalled peer is "
                  "caught after at most this long). In [1s, 24h], default 60s",
                  &f->collective_timeout);
  parser.Duration("--retain-finished", "D",
                  "how long a finished job is kept with its events and step records before it "
                  "is removed (muonmeshctl delete and prune remove them sooner); 0: for ever. "
                  "Default 720h (30 days)",
                  &f->retain_finished);
  parser.Duration("--shutdown-grace", "D",
                  "on SIGINT/SIGTERM, how long calls in flight may finish before they are "
                  "cancelled (plans being computed are cancelled at once). Default 5s",
                  &f->shutdown_grace);
  parser.String("--tls-cert", "FILE",
                "PEM certificate (chain) to serve TLS with; needs --tls-key. Default "
                "$MUONMESH_TLS_CERT. Without TLS and tokens only a loopback --listen is served",
                &f->tls_cert);
  parser.String("--tls-key", "FILE",
                "PEM private key of --tls-cert (unencrypted; keep it mode 600). Default "
                "$MUONMESH_TLS_KEY",
                &f->tls_key);
  parser.String("--tls-ca", "FILE",
                "PEM CA for mutual TLS: clients may present a certificate it signed, and Fleet "
                "and Store (worker traffic) require one. Default $MUONMESH_TLS_CA",
                &f->tls_ca);
  parser.Duration("--tls-refresh", "D",
                  "how often the --tls-cert, --tls-key and --tls-ca files are looked at for "
                  "changes: a renewed certificate is served without a restart (the tokens file "
                  "is looked at every 5s). In [1s, 1h], default 1m",
                  &f->tls_refresh);
  parser.String("--tokens-file", "FILE",
                "bearer tokens and their roles (viewer, submitter, worker, admin), one 'ROLE "
                "TOKEN' or 'ROLE sha256:HEX' per line; needs TLS. Default $MUONMESH_TOKENS_FILE",
                &f->tokens_file);
  parser.String("--allowed-dirs", "DIR[,DIR...]",
                "existing folders that every path a submitted job file names (init, data, "
                "spec, output, export) must lie in; others are refused with PERMISSION_DENIED. "
                "Default: any (the workers' own --allowed-dirs still apply)",
                &f->allowed_dirs);
  parser.Bool("--worker-ids-from-certificates",
              "a worker's --worker-id must be the subject CN or a subjectAltName of its client "
              "certificate, on every Fleet call (one certificate per worker); needs --tls-ca",
              &f->worker_ids_from_certificates);
  parser.Bool("--insecure",
              "serve a non-loopback --listen without TLS and tokens anyway (logged as a "
              "warning); without it such an address is refused",
              &f->insecure);
}

// The flags as server options. InvalidArgument naming a flag out of range.
// The bound flags, checked, into `options`.
absl::Status BoundOptions(const Flags& f, muonmesh::coordinator::CoordinatorServerOptions* options) {
  if (f.max_concurrent_plans < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-concurrent-plans must be >= 1, got ", f.max_concurrent_plans));
  }
  // 2^40 MiB is a petabyte: more is a typo, and would overflow bytes.
  if (f.plan_memory_mib < 1 || f.plan_memory_mib > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--plan-memory-mib must be in [1, 2^40], got ", f.plan_memory_mib));
  }
  if (f.max_rpc_threads < 16 || f.max_rpc_threads > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-rpc-threads must be in [16, 65536], got ", f.max_rpc_threads));
  }
  options->max_rpc_threads = static_cast<int>(f.max_rpc_threads);
  for (const auto& [name, value] : {std::pair{"--max-jobs", f.max_jobs},
                                    {"--max-jobs-per-client", f.max_jobs_per_client},
                                    {"--max-watches-per-client", f.max_watches_per_client},
                                    {"--max-recorded-steps", f.max_recorded_steps}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be >= 0, got ", value));
    }
  }
  options->control.max_unfinished_jobs = f.max_jobs;
  options->control.max_unfinished_jobs_per_client = f.max_jobs_per_client;
  options->control.max_watches_per_client = f.max_watches_per_client;
  options->control.max_recorded_steps = f.max_recorded_steps;
  if (f.forget_lost_after < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--forget-lost-after must be >= 0, got ",
                                                   absl::FormatDuration(f.forget_lost_after)));
  }
  options->control.forget_lost_after = f.forget_lost_after;
  options->planner.admission = {.max_calls = f.max_concurrent_plans,
                                .max_bytes = f.plan_memory_mib << 20};
  return absl::OkStatus();
}

absl::Status OptionsFromFlags(const Flags& f, muonmesh::coordinator::CoordinatorServerOptions* options) {
  options->listen = f.listen;
  options->security = muonmesh::auth::WithEnvironment({
      .tls_cert = f.tls_cert,
      .tls_key = f.tls_key,
      .tls_ca = f.tls_ca,
      .tokens_file = f.tokens_file,
      .insecure = f.insecure,
      .tls_refresh = f.tls_refresh,
  });
  if (f.tls_refresh < absl::Seconds(1) || f.tls_refresh > absl::Hours(1)) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-refresh must be in [1s, 1h], got ",
                                                   absl::FormatDuration(f.tls_refresh)));
  }
  options->log = [](const std::string& line) {
    std::cerr << "muonmesh-coordinator: " << line << std::endl;
  };
  MUONMESH_RETURN_IF_ERROR(BoundOptions(f, options));
  std::string data_dir = f.data_dir;
  if (data_dir.empty()) {
    const char* home = std::getenv("HOME");
    data_dir = home != nullptr && *home != '\0' ? absl::StrCat(home, "/.local/state/muonmesh")
                                                : std::string("muonmesh-state");
  }
  if (data_dir != "none") options->control.data_dir = data_dir;
  options->control.metrics_listen = f.metrics_listen;
  if (f.retain_finished < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--retain-finished must be >= 0, got ",
                                                   absl::FormatDuration(f.retain_finished)));
  }
  options->control.retain_finished = f.retain_finished;
  if (f.quarantine < absl::ZeroDuration() || f.quarantine > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat("--quarantine must be in [0, 24h], got ",
                                                   absl::FormatDuration(f.quarantine)));
  }
  options->control.quarantine = f.quarantine;
  if (f.partition_grace < absl::ZeroDuration() || f.partition_grace > absl::Hours(1)) {
    return absl::InvalidArgumentError(absl::StrCat("--partition-grace must be in [0, 1h], got ",
                                                   absl::FormatDuration(f.partition_grace)));
  }
  if (f.lease_ttl < absl::Milliseconds(500) || f.lease_ttl > absl::Hours(1)) {
    return absl::InvalidArgumentError(absl::StrCat("--lease-ttl must be in [500ms, 1h], got ",
                                                   absl::FormatDuration(f.lease_ttl)));
  }
  if (f.collective_timeout < absl::Seconds(1) || f.collective_timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--collective-timeout must be in [1s, 24h], got ",
                     absl::FormatDuration(f.collective_timeout)));
  }
  if (f.shutdown_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--shutdown-grace must be >= 0, got ",
                                                   absl::FormatDuration(f.shutdown_grace)));
  }
  if (!f.allowed_dirs.empty()) {
    const std::vector<std::string> dirs = absl::StrSplit(f.allowed_dirs, ',', absl::SkipEmpty());
    MUONMESH_ASSIGN_OR_RETURN(std::vector<std::string> allowed,
                              muonmesh::job::ResolveAllowedDirs(dirs));
    options->control.allowed_dirs = std::move(allowed);
  }
  if (f.worker_ids_from_certificates && options->security.tls_ca.empty()) {
    return absl::InvalidArgumentError(
        "--worker-ids-from-certificates needs --tls-ca (mutual TLS: the certificates name the "
        "workers)");
  }
  options->control.worker_ids_from_certificates = f.worker_ids_from_certificates;
  options->control.lease_ttl = f.lease_ttl;
  options->control.partition_grace = f.partition_grace;
  options->control.heartbeat_interval = f.lease_ttl / 5;
  options->control.collective_timeout = f.collective_timeout;
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
                   muonmesh::coordinator::CoordinatorServer& server, const std::atomic<bool>& done) {
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

// Parses the command line into `flags` and `options`: nullopt to go on,
// else the exit code (0 after --help, 2 on a usage error, which it has
// printed).
std::optional<int> ParseFlags(int argc, char** argv, Flags* flags,
                              muonmesh::coordinator::CoordinatorServerOptions* options) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--version") {
      std::cout << "muonmesh-coordinator " << muonmesh::rpc::Version() << "\n";
      return 0;
    }
  }
  muonmesh::FlagParser parser("muonmesh-coordinator");
  DeclareFlags(parser, flags);
  bool help = false;
  absl::Status st = parser.Parse(std::vector<std::string>(argv + 1, argv + argc), &help);
  if (help) {
    std::cout << parser.Usage(kSynopsis);
    return 0;
  }
  if (st.ok()) st = OptionsFromFlags(*flags, options);
  if (!st.ok()) {
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
  muonmesh::credentials::InitOpenSslWithoutExitHandler();
  Flags flags;
  muonmesh::coordinator::CoordinatorServerOptions options;
  if (std::optional<int> exit_code = ParseFlags(argc, argv, &flags, &options)) return *exit_code;
  sigset_t stop_signals;
  if (!SetUpSignals(&stop_signals)) return 1;

  absl::StatusOr<std::unique_ptr<muonmesh::coordinator::CoordinatorServer>> server =
      muonmesh::coordinator::CoordinatorServer::Start(options);
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

  const absl::Duration grace = flags.shutdown_grace;
  std::atomic<bool> done{false};
  std::thread stopper([&] { StopOnSignals(stop_signals, grace, **server, done); });
  // Returns only after Shutdown, which only the stopper calls.
  (*server)->Wait();
  done.store(true);
  stopper.join();
  return 0;
}
