#pragma once

// How the coordinator's gRPC port is protected (README "Security"), from
// its flags or their environment variables:
//   --tls-cert / --tls-key  (MUONMESH_TLS_CERT / _KEY)  TLS with this
//                           certificate chain and key
//   --tls-ca   (MUONMESH_TLS_CA)      mutual TLS: clients may present a
//                           certificate signed by this CA, and Fleet and
//                           Store (worker traffic) require one
//   --tokens-file (MUONMESH_TOKENS_FILE)  bearer tokens and their roles
//                           (TokenTable); needs TLS
//   --insecure              serve a non-loopback address without TLS and
//                           tokens anyway (logged as a warning)
// Without TLS and tokens the coordinator serves loopback only.
//
// Load reads and checks every file at start; the credentials it builds own
// the AuthProcessor. The tokens file is read again when it changes
// (kTokensCheckEvery), the certificate files every tls_refresh.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"
#include "server/auth/auth_processor.h"

namespace muonmesh::auth {

inline constexpr char kTlsCertEnv[] = "MUONMESH_TLS_CERT";
inline constexpr char kTlsKeyEnv[] = "MUONMESH_TLS_KEY";
inline constexpr char kTlsCaEnv[] = "MUONMESH_TLS_CA";
inline constexpr char kTokensFileEnv[] = "MUONMESH_TOKENS_FILE";
// How often the tokens file is looked at for changes (TokenFile): a token
// added or revoked there takes effect within this long, no restart needed.
inline constexpr absl::Duration kTokensCheckEvery = absl::Seconds(5);

struct ServerSecurityOptions {
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  std::string tokens_file;
  bool insecure = false;
  // How often the certificate, key and CA files are looked at for changes
  // (gRPC's FileWatcherCertificateProvider): a renewed certificate is
  // served, and a new CA trusted, without a restart.
  absl::Duration tls_refresh = absl::Minutes(1);
};

// `options` with each empty path taken from its environment variable.
ServerSecurityOptions WithEnvironment(ServerSecurityOptions options);

class ServerSecurity {
 public:
  // Reads and checks the files for serving `listen` (HOST:PORT). Errors:
  // InvalidArgument naming the flag and file for an unreadable or mismatched
  // certificate, key or tokens file, or for a combination that cannot work
  // (a key without a certificate, a CA or tokens without TLS);
  // FailedPrecondition for a non-loopback `listen` without TLS and tokens
  // unless options.insecure. `log` receives the AuthProcessor's denials.
  static absl::StatusOr<std::unique_ptr<ServerSecurity>> Load(const ServerSecurityOptions& options,
                                                             absl::string_view listen,
                                                             LineSink log);

  // TLS credentials (with the AuthProcessor when there are tokens or a CA),
  // or insecure ones.
  std::shared_ptr<grpc::ServerCredentials> credentials() const { return credentials_; }
  // What the coordinator should log at start: what is on, what is not, and
  // warnings (file modes, --insecure). Never a token or key.
  const std::vector<std::string>& notes() const { return notes_; }

  // The certificate files it serves with, by name: "server" (--tls-cert)
  // and, with mutual TLS, "client_ca" (--tls-ca). Empty without TLS. They
  // may change on disk (ServerSecurityOptions::tls_refresh).
  const std::map<std::string, std::string>& certificate_files() const { return certificate_files_; }

  bool tls() const { return tls_; }
  bool tokens() const { return tokens_; }
  bool client_ca() const { return client_ca_; }

 private:
  ServerSecurity() = default;

  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::vector<std::string> notes_;
  std::map<std::string, std::string> certificate_files_;
  bool tls_ = false;
  bool tokens_ = false;
  bool client_ca_ = false;
};

}  // namespace muonmesh::auth
