#include "server/auth/server_security.h"

#include <sys/stat.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/net_address.h"
#include "core/base/status_macros.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "proto/credentials/credentials.h"

namespace muonmesh::auth {
namespace {

constexpr char kCertName[] = "--tls-cert";
constexpr char kKeyName[] = "--tls-key";
constexpr char kCaName[] = "--tls-ca";

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : std::string();
}

// A warning when a secret file can be read by every user. (Group-readable
// is normal: Kubernetes mounts Secrets 0440 for the pod's fsGroup.)
void NoteOpenMode(absl::string_view flag, const std::string& path, std::vector<std::string>* notes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  if ((st.st_mode & S_IRWXO) != 0) {
    notes->push_back(absl::StrFormat(
        "WARNING: %s %s can be read by every user (mode %04o); chmod 600 it", flag, path,
        st.st_mode & 07777));
  }
}

// The host of HOST:PORT, without IPv6 brackets.
absl::string_view HostOf(absl::string_view listen) {
  const std::size_t colon = listen.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? listen : listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

ServerSecurityOptions WithEnvironment(ServerSecurityOptions options) {
  if (options.tls_cert.empty()) options.tls_cert = Env(kTlsCertEnv);
  if (options.tls_key.empty()) options.tls_key = Env(kTlsKeyEnv);
  if (options.tls_ca.empty()) options.tls_ca = Env(kTlsCaEnv);
  if (options.tokens_file.empty()) options.tokens_file = Env(kTokensFileEnv);
  return options;
}

namespace {

// The flags that only make sense together, and a non-loopback address only
// with TLS and tokens (or --insecure).
absl::Status CheckCombination(const ServerSecurityOptions& options, absl::string_view listen,
                              bool loopback) {
  const bool has_cert = !options.tls_cert.empty();
  if (has_cert != !options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "give both --tls-cert and --tls-key (the coordinator's certificate and its key), or "
        "neither");
  }
  if (!has_cert && !options.tls_ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls-ca (client certificates) needs --tls-cert and --tls-key: mutual TLS is TLS first");
  }
  if (!has_cert && !options.tokens_file.empty()) {
    return absl::InvalidArgumentError(
        "--tokens-file needs --tls-cert and --tls-key: bearer tokens are never accepted in "
        "plaintext");
  }
  const bool protected_port = has_cert && !options.tokens_file.empty();
  if (!loopback && !protected_port && !options.insecure) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--listen ", listen,
        " is not a loopback address, and without TLS and tokens (--tls-cert, --tls-key, "
        "--tokens-file) anyone who reaches it could submit jobs, read them and join the fleet; "
        "give them, listen on 127.0.0.1, or pass --insecure to serve it unprotected anyway"));
  }
  return absl::OkStatus();
}

// Checks the certificate, its key and, with --tls-ca, the CA that client
// certificates must verify against (the credentials read the files
// themselves); notes what it found. Returns whether clients are asked for a
// certificate.
absl::StatusOr<grpc_ssl_client_certificate_request_type> CheckTlsFiles(
    const ServerSecurityOptions& options, absl::string_view listen, std::vector<std::string>& notes,
    bool* client_ca) {
  MUONMESH_ASSIGN_OR_RETURN(credentials::PemFile cert, credentials::LoadPemFile(kCertName, options.tls_cert));
  MUONMESH_ASSIGN_OR_RETURN(credentials::PemFile key, credentials::LoadPemFile(kKeyName, options.tls_key));
  MUONMESH_ASSIGN_OR_RETURN(std::string described, credentials::CheckCertificate(cert, key));
  notes.push_back(absl::StrCat("TLS on ", listen, ": certificate ", described));
  NoteOpenMode(kKeyName, options.tls_key, &notes);

  *client_ca = !options.tls_ca.empty();
  if (*client_ca) {
    MUONMESH_ASSIGN_OR_RETURN(credentials::PemFile ca, credentials::LoadPemFile(kCaName, options.tls_ca));
    MUONMESH_ASSIGN_OR_RETURN(std::string ca_described, credentials::CheckCertificate(ca, credentials::PemFile{}));
    // Requested, not required, at the handshake: viewers and submitters
    // connect without one. A certificate that is presented must verify; the
    // AuthProcessor requires one for Fleet and Store.
    notes.push_back(
        absl::StrCat("mutual TLS: Fleet and Store need a client certificate signed "
                     "by the CA in ",
                     options.tls_ca, " (", ca_described, ")"));
  } else {
    notes.push_back(
        "no --tls-ca: clients are not asked for certificates; Fleet and Store rely on worker "
        "tokens alone");
    return GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  return GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerSecurity>> ServerSecurity::Load(
    const ServerSecurityOptions& options, absl::string_view listen, LineSink log) {
  credentials::InitOpenSslWithoutExitHandler();
  const bool loopback = IsLoopbackAddress(std::string(HostOf(listen)));
  MUONMESH_RETURN_IF_ERROR(CheckCombination(options, listen, loopback));
  std::unique_ptr<ServerSecurity> self(new ServerSecurity());
  std::vector<std::string>& notes = self->notes_;
  if (options.tls_cert.empty()) {
    self->credentials_ = grpc::InsecureServerCredentials();
    if (loopback) {
      notes.push_back(absl::StrCat(
          "no TLS and no tokens: serving ", listen,
          " on loopback only, where every local user may call every method (give --tls-cert, "
          "--tls-key and --tokens-file to serve other hosts)"));
    } else {
      notes.push_back(absl::StrCat(
          "WARNING: --insecure: serving ", listen,
          " WITHOUT TLS OR TOKENS. Anyone who can reach this port can submit and cancel jobs, "
          "read every job, and register as a worker to receive jobs and rendezvous keys. Use "
          "this only on a network you fully trust."));
    }
    return self;
  }

  MUONMESH_ASSIGN_OR_RETURN(grpc_ssl_client_certificate_request_type request,
                            CheckTlsFiles(options, listen, notes, &self->client_ca_));
  // Checked above; served from the files themselves, read again every
  // tls_refresh, so a renewed certificate needs no restart.
  grpc::experimental::TlsServerCredentialsOptions tls(
      credentials::WatchTlsFiles(options.tls_key, options.tls_cert, options.tls_ca, options.tls_refresh));
  tls.watch_identity_key_cert_pairs();
  if (self->client_ca_) tls.watch_root_certs();
  tls.set_cert_request_type(request);
  self->credentials_ = grpc::experimental::TlsServerCredentials(tls);
  self->tls_ = true;
  notes.push_back(absl::StrCat("TLS files are read again every ",
                               absl::FormatDuration(options.tls_refresh),
                               " (--tls-refresh): renewed certificates need no restart"));
  self->certificate_files_["server"] = options.tls_cert;
  if (self->client_ca_) self->certificate_files_["client_ca"] = options.tls_ca;

  std::shared_ptr<TokenFile> tokens;
  if (!options.tokens_file.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(tokens, TokenFile::Load(options.tokens_file, kTokensCheckEvery, log));
    const std::shared_ptr<const TokenTable> table = tokens->Current();
    notes.push_back(absl::StrCat("tokens: ", table->size(), " from ", options.tokens_file, " (",
                                 table->Summary(),
                                 "; read again when it changes); "
                                 "grpc.health.v1 needs none"));
    NoteOpenMode("--tokens-file", options.tokens_file, &notes);
    self->tokens_ = true;
  } else {
    notes.push_back(absl::StrCat("no --tokens-file: whoever reaches ", listen,
                                 " may call every method",
                                 self->client_ca_ ? " but Fleet and Store" : ""));
    if (!loopback) {
      notes.push_back(absl::StrCat("WARNING: --insecure: serving ", listen,
                                   " without tokens; anyone who can reach it can submit and "
                                   "cancel jobs"));
    }
  }
  if (self->tokens_ || self->client_ca_) {
    self->credentials_->SetAuthMetadataProcessor(std::make_shared<AuthProcessor>(
        std::move(tokens),
        AccessPolicyOptions{.tokens = self->tokens_, .client_ca = self->client_ca_},
        std::move(log)));
  }
  return self;
}

}  // namespace muonmesh::auth
