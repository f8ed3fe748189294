#pragma once

// What every muonmeshctl command shares: the connection flags (coordinator,
// deadline, TLS, token) and the config flags of validate and plan, their
// checks, and how a usage error or an RPC error is printed and becomes an
// exit code (ExitCode in client/job_commands.h).

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/flag_parser.h"
#include "proto/credentials/credentials.h"

namespace muonmesh::client {

inline constexpr const char* kDefaultCoordinator = "127.0.0.1:50051";
inline constexpr const char* kCoordinatorEnv = "MUONMESH_COORDINATOR";

// Every command's --help ends with these.
inline constexpr const char* kExitCodes =
    "Exit codes:\n"
    "  0  ok\n"
    "  1  invalid config (every violation on stderr, one per line)\n"
    "  2  usage error, or a spec file that does not load\n"
    "  3  coordinator unreachable (down, refused, shutting down)\n"
    "  4  deadline (--timeout) expired before the answer\n"
    "  5  refused or failed by the coordinator (no or unknown token, role not allowed, plan\n"
    "     too large, server busy, internal error)\n";


// Flags shared by `validate` and `plan` (the connection flags are every
// command's).
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
  credentials::ClientSecurityOptions security;
};

void AddConfigFlags(FlagParser& parser, ConfigFlags* f);
// The coordinator, deadline and TLS flags; `with_json`: --json too (only
// where the command prints its answer as JSON).
void AddConnectionFlags(FlagParser& parser, ConfigFlags* f, bool with_json = true);

// The connection's TLS and token from the flags and the environment; an
// InvalidArgument naming the flag or file is a usage error.
absl::StatusOr<credentials::ChannelSecurity> Security(const ConfigFlags& f);

// InvalidArgument naming `flag` when it was given as 0 (proto3 cannot tell 0
// from unset, so 0 would silently mean `fallback`).
absl::Status CheckNotZero(const FlagParser& parser, const char* flag, int64_t value,
                          int64_t fallback);

// Checks what the parser cannot: required flags and local ranges; fills the
// coordinator from $MUONMESH_COORDINATOR or the default when not given.
absl::Status CheckConfigFlags(const FlagParser& parser, ConfigFlags* f);

// Prints "muonmeshctl COMMAND: problem" and where to find the usage;
// returns kExitUsage.
int UsageError(const std::string& command, const absl::Status& status);

// Prints an RPC error and returns its exit code; violations
// (InvalidArgument) are the user's to fix.
int ReportError(const std::string& command, const absl::Status& status);

}  // namespace muonmesh::client
