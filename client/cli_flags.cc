#include "client/cli_flags.h"

#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "client/job_commands.h"
#include "core/base/status_macros.h"

namespace muonmesh::client {

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

void AddConnectionFlags(FlagParser& parser, ConfigFlags* f, bool with_json) {
  parser.String("--coordinator", "ADDR",
                absl::StrCat("coordinator HOST:PORT (default $", kCoordinatorEnv, ", else ",
                             kDefaultCoordinator, ")"),
                &f->coordinator);
  parser.Int("--timeout", "SECONDS", "deadline of the call (default 60)", &f->timeout_seconds);
  if (with_json) parser.Bool("--json", "print the answer as JSON on stdout", &f->json);
  parser.String("--tls-ca", "FILE",
                absl::StrCat("talk TLS, trusting the coordinator's certificate if this CA "
                             "signed it (default $", credentials::kTlsCaEnv, ")"),
                &f->security.tls_ca);
  parser.String("--tls-cert", "FILE",
                absl::StrCat("client certificate for mutual TLS (default $", credentials::kTlsCertEnv,
                             ")"),
                &f->security.tls_cert);
  parser.String("--tls-key", "FILE",
                absl::StrCat("its private key (default $", credentials::kTlsKeyEnv, ")"),
                &f->security.tls_key);
  parser.String("--tls-server-name", "NAME",
                absl::StrCat("the name the coordinator's certificate must carry, when not the "
                             "address's host (default $", credentials::kTlsServerNameEnv, ")"),
                &f->security.tls_server_name);
  parser.String("--token-file", "FILE",
                absl::StrCat("file whose first line is the bearer token (default $",
                             credentials::kTokenFileEnv, ", else the token in $", credentials::kTokenEnv, ")"),
                &f->security.token_file);
}

// The connection's TLS and token from the flags and the environment; an
// InvalidArgument naming the flag or file is a usage error.
absl::StatusOr<credentials::ChannelSecurity> Security(const ConfigFlags& f) {
  return credentials::LoadChannelSecurity(credentials::WithEnvironment(f.security));
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

// Prints an RPC error and returns its exit code; violations
// (InvalidArgument) are the user's to fix.
int ReportError(const std::string& command, const absl::Status& status) {
  if (status.code() == absl::StatusCode::kInvalidArgument) {
    std::cerr << status.message() << "\n";
    return kExitInvalid;
  }
  std::cerr << "muonmeshctl " << command << ": " << status.message() << "\n";
  return ExitCode(status);
}

}  // namespace muonmesh::client
