#pragma once

// Checks every call the coordinator's TLS port receives, before any handler
// runs: reads the method (":path"), the bearer token ("authorization:
// Bearer TOKEN") and whether the TLS peer presented a certificate verified
// against the CA, and lets the call through or fails it with the status of
// Authorize (UNAUTHENTICATED / PERMISSION_DENIED). The authorization header
// is consumed, so handlers never see a token. (The AuthContext gRPC passes
// is the connection's, shared by its calls: nothing per call is added to it.)
//
// Denials are logged (method, code and role; never the token), at most
// kMaxDenialLinesPerMinute lines a minute, then a count of those left out.
//
// Installed in the server credentials by ServerSecurity, which owns it
// through them. gRPC calls Process on its own threads, several at once:
// thread-safe.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/synchronization/mutex.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "server/auth/access_policy.h"
#include "server/auth/token_table.h"

namespace muonmesh::auth {

using LineSink = std::function<void(const std::string&)>;

inline constexpr int kMaxDenialLinesPerMinute = 30;

class AuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `tokens` may be null (no tokens: only the client certificate rule
  // applies). `log` receives the denial lines.
  AuthProcessor(std::shared_ptr<TokenFile> tokens, AccessPolicyOptions options, LineSink log);

  // The check is a hash lookup: it runs on gRPC's thread, not a pool.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  void LogDenial(const std::string& line);

  const std::shared_ptr<TokenFile> tokens_;
  const AccessPolicyOptions options_;
  const LineSink log_;
  absl::Mutex mu_;
  std::chrono::steady_clock::time_point window_start_ ABSL_GUARDED_BY(mu_);
  int window_lines_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t left_out_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muonmesh::auth
