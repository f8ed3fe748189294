// muonmesh-coordinator: the gRPC control plane (DESIGN.md §1). Today it
// serves the Planner; scheduling, rendezvous and metrics come later.

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "server/coordinator_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "HOST:PORT to serve on; port 0 picks a free port (printed when ready)");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
          "on SIGINT/SIGTERM, how long calls in flight may finish before they are cancelled");

namespace {

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
    std::cout << "  --" << flag->Name() << " (default " << flag->DefaultValue() << ")\n      "
              << flag->Help() << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the muonmesh control plane (gRPC: muonmesh.v1.Planner, grpc.health.v1, reflection).\n"
      "Usage: muonmesh-coordinator [--listen HOST:PORT] [--shutdown_grace 5s]\n"
      "Prints 'muonmesh-coordinator listening on HOST:PORT' when ready; stops on SIGINT or "
      "SIGTERM.");
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull" || arg == "-help") {
      PrintHelp();
      return 0;
    }
  }
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "muonmesh-coordinator: unexpected argument '" << rest[1] << "' (see --help)\n";
    return 2;
  }

  // Block the stop signals before any thread exists: every thread gRPC
  // starts inherits the mask, so the signals wait for sigwait() below, which
  // runs outside signal context and may call anything (a handler could only
  // call async-signal-safe functions, and Shutdown is not one).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  if (const int err = pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr); err != 0) {
    std::cerr << "muonmesh-coordinator: pthread_sigmask: " << std::strerror(err) << "\n";
    return 1;
  }
  // A client that hangs up mid-write must not kill the server.
  signal(SIGPIPE, SIG_IGN);

  muonmesh::CoordinatorServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  absl::StatusOr<std::unique_ptr<muonmesh::CoordinatorServer>> server =
      muonmesh::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::cerr << "muonmesh-coordinator: " << server.status().message() << "\n";
    return 1;
  }
  // Scripts and tests wait for this exact line (and read the port from it).
  std::cout << "muonmesh-coordinator listening on " << (*server)->address() << std::endl;

  const absl::Duration grace = absl::GetFlag(FLAGS_shutdown_grace);
  std::thread stopper([&stop_signals, &server, grace] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    std::cerr << "muonmesh-coordinator: " << (signal_number == SIGINT ? "SIGINT" : "SIGTERM")
              << ", shutting down (grace " << absl::FormatDuration(grace) << ")\n";
    (*server)->Shutdown(grace);
  });
  // Returns only after Shutdown, which only the stopper calls.
  (*server)->Wait();
  stopper.join();
  return 0;
}
