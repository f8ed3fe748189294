#pragma once

// What a gRPC client of the coordinator (muonmeshctl, the client library,
// the worker daemon) needs to reach a coordinator that serves TLS and checks
// bearer tokens (README "Security"): the files and variables that name the
// CA, the client certificate and the token, loaded into channel credentials.
// The PEM and token helpers are shared with the coordinator's side
// (server/auth/), which may include proto/ but not the other way round.
//
// Nothing here logs, and no error message quotes a key or a token: errors
// name the flag (or variable) and the file.
//
// Stateless free functions; any thread may call them.

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/support/channel_arguments.h"

namespace muonmesh::credentials {

// Environment variables read when the matching flag is not given.
inline constexpr char kTlsCaEnv[] = "MUONMESH_TLS_CA";
inline constexpr char kTlsCertEnv[] = "MUONMESH_TLS_CERT";
inline constexpr char kTlsKeyEnv[] = "MUONMESH_TLS_KEY";
inline constexpr char kTlsServerNameEnv[] = "MUONMESH_TLS_SERVER_NAME";
inline constexpr char kTokenEnv[] = "MUONMESH_TOKEN";
inline constexpr char kTokenFileEnv[] = "MUONMESH_TOKEN_FILE";

// A bearer token is 16 to 4096 visible ASCII characters (0x21-0x7e): it
// travels in an HTTP/2 header, and a short one can be guessed.
inline constexpr std::size_t kMinTokenLength = 16;
inline constexpr std::size_t kMaxTokenLength = 4096;

// The client's security settings, as flags give them; empty means "not
// given" (then WithEnvironment may fill them).
struct ClientSecurityOptions {
  // PEM file of the CA that signed the coordinator's certificate. Given:
  // the channel uses TLS and checks the server against it. Empty: plaintext.
  std::string tls_ca;
  // PEM client certificate and its key, presented for mutual TLS (workers:
  // the coordinator requires one for Fleet and Store when it has a CA).
  std::string tls_cert;
  std::string tls_key;
  // The name the server's certificate must carry, when it differs from the
  // host of the address (e.g. an IP address or a port-forward).
  std::string tls_server_name;
  // File whose first line is the bearer token.
  std::string token_file;
  // The token itself: only from MUONMESH_TOKEN (a token on a command line
  // would show in `ps`).
  std::string token;
  // How often the certificate, key and CA files and the token file are
  // looked at for changes: a renewed certificate or a new token is used
  // without a restart (a long-running worker's channel).
  absl::Duration refresh = absl::Minutes(1);
};

// `options` with each empty field taken from its environment variable
// (MUONMESH_TLS_CA, _CERT, _KEY, _SERVER_NAME, MUONMESH_TOKEN_FILE, and
// MUONMESH_TOKEN when no token file is named anywhere).
ClientSecurityOptions WithEnvironment(ClientSecurityOptions options);

// Loaded credentials for a channel: plaintext when `credentials` is null.
struct ChannelSecurity {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string tls_server_name;
  bool tls = false;
  bool client_certificate = false;
  bool token = false;
};

// Initialises OpenSSL without its exit handler. gRPC's threads outlive
// main() and still free TLS objects while exit() runs; OpenSSL's handler
// (registered by its first initialisation unless told otherwise) frees the
// library's global state under them, a double free or a crash after the
// work is done, about one exit in a hundred for muonmeshctl over TLS. The
// OS reclaims that state instead. Idempotent; every binary calls it first
// in main(), and the functions here and ServerSecurity::Load call it
// before they touch OpenSSL, so a test binary is covered too.
void InitOpenSslWithoutExitHandler();

// Reads the files and builds the credentials: TLS with the CA, the client
// certificate when given, and the token as a per-call "authorization:
// Bearer" header. InvalidArgument naming the flag and file when one cannot
// be read or is not PEM, when a certificate comes without its key (or the
// reverse), or when a token is given without TLS (tokens never travel in
// plaintext).
absl::StatusOr<ChannelSecurity> LoadChannelSecurity(const ClientSecurityOptions& options);

// Keepalive on every channel and stream between the project's processes
// (docs/architecture.md §7, "Keepalive"): a client pings its server after
// kKeepaliveTimeMs without traffic, with or without a call open, and drops
// the connection when no answer comes within kKeepaliveTimeoutMs, so a
// worker whose link to the coordinator went silent (a partition, a dead
// host: no reset, no FIN) sees its stream fail within about 15 s and
// reconnects, instead of waiting for TCP's retransmission timeout (minutes;
// after a 30 s partition, 27 s more before the first retransmission got
// through). The timeout leaves a loaded machine room to answer. The
// coordinator accepts its clients' pings down to kMinPingIntervalMs apart
// and never answers pings with GOAWAY; it does not ping them itself (a
// worker's lease tells it when one is gone): with both sides pinging, a
// loaded CI machine saw a client's connection dropped under a call.
inline constexpr int kKeepaliveTimeMs = 5000;
inline constexpr int kKeepaliveTimeoutMs = 10000;
inline constexpr int kMinPingIntervalMs = 1000;

// A channel to `address` with `security` (plaintext when it has no
// credentials), keepalive as above, and `args` (the target name override
// is added to them; keepalive settings in `args` win).
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelSecurity& security,
                                             grpc::ChannelArguments args = {});

// The server side of the keepalive above, for a server that project
// clients talk to.
void AddServerKeepalive(grpc::ServerBuilder& builder);

// The text of a PEM file. `flag` names where the path came from
// ("--tls-cert") for the error: NotFound / InvalidArgument naming the flag
// and the path, never the contents.
absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path);

// The first line of a token file, trimmed. InvalidArgument naming `flag` and
// the path when the file cannot be read, is empty, or the token is not a
// valid token (CheckToken); the message never contains the token.
absl::StatusOr<std::string> ReadTokenFile(absl::string_view flag, const std::string& path);

// Says whether a file changed (its modification time or size; a file that
// cannot be stat'ed counts as one more version), looking at most once per
// `every`: what the credential reloaders (the coordinator's tokens file, a
// client's token file) ask before reading a file again. Not thread-safe:
// its owner's lock guards it.
class FileChangeCheck {
 public:
  FileChangeCheck(std::string path, absl::Duration every);
  const std::string& path() const { return path_; }
  // True when the file differs from the version last seen (at
  // construction, or by the last call that returned true).
  bool Changed();

 private:
  const std::string path_;
  const absl::Duration every_;
  std::pair<int64_t, int64_t> stamp_;
  absl::Time next_check_;
};

// gRPC's provider of the PEM files `key`, `cert` (either may be empty: no
// identity) and `ca`, read again every `refresh` (at least 1 s), so a
// renewed certificate or CA needs no restart. Both sides' TLS credentials
// are built on it.
std::shared_ptr<grpc::experimental::CertificateProviderInterface> WatchTlsFiles(
    const std::string& key, const std::string& cert, const std::string& ca, absl::Duration refresh);

// A PEM file as read: where its path came from (a flag or a variable), the
// path, and its text.
struct PemFile {
  std::string flag;
  std::string path;
  std::string text;
};

// Reads `path` for `flag` (ReadPemFile).
absl::StatusOr<PemFile> LoadPemFile(absl::string_view flag, const std::string& path);

// Checks a certificate (the first one of `cert`, a chain may follow) and,
// when `key` has text, that the key is the certificate's. Returns a line
// for the log: "subject CN=..., expires 2027-01-01 00:00:00 UTC" (a
// certificate is public; the key is never described). InvalidArgument
// naming the flags and files when the certificate or key does not parse or
// they do not belong together; FailedPrecondition when the certificate has
// expired or is not valid yet.
absl::StatusOr<std::string> CheckCertificate(const PemFile& cert, const PemFile& key);

// When the first certificate of `cert` expires (its notAfter), for the
// certificate-expiry gauges. InvalidArgument naming the flag and file when
// it does not parse.
absl::StatusOr<absl::Time> CertificateNotAfter(const PemFile& cert);

// OK when `token` has kMinTokenLength..kMaxTokenLength visible ASCII
// characters; InvalidArgument saying which rule it breaks (not quoting it).
absl::Status CheckToken(absl::string_view token);

}  // namespace muonmesh::credentials
