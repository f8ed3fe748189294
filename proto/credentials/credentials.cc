#include "proto/credentials/credentials.h"

#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/base/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace muonmesh::credentials {
namespace {

// A certificate bundle or key is a few KiB; more is the wrong file.
constexpr std::size_t kMaxPemBytes = 1 << 20;
constexpr std::size_t kMaxTokenFileBytes = 64 << 10;

constexpr char kCaName[] = "--tls-ca (MUONMESH_TLS_CA)";
constexpr char kCertName[] = "--tls-cert (MUONMESH_TLS_CERT)";
constexpr char kKeyName[] = "--tls-key (MUONMESH_TLS_KEY)";
constexpr char kTokenFileName[] = "--token-file (MUONMESH_TOKEN_FILE)";

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : std::string();
}

// At most `limit` bytes of `path`; NotFound / InvalidArgument naming `flag`.
absl::StatusOr<std::string> ReadSmallFile(absl::string_view flag, const std::string& path,
                                          std::size_t limit) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, " ", path, ": cannot open the file"));
  std::string text;
  text.resize(limit + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read"));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": larger than ", limit, " bytes; not the right file?"));
  }
  return text;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioFree> MemoryBio(const std::string& text) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// OpenSSL would prompt on the terminal for an encrypted key's passphrase;
// a server or a daemon has no one to answer.
int NoPassphrase(char*, int, int, void*) { return 0; }

std::string FormatTime(const ASN1_TIME* t) {
  std::tm tm{};
  if (t == nullptr || ASN1_TIME_to_tm(t, &tm) != 1) return "an unreadable time";
  return absl::StrFormat("%04d-%02d-%02d %02d:%02d:%02d UTC", tm.tm_year + 1900, tm.tm_mon + 1,
                         tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
}

std::string Subject(X509* cert) {
  std::unique_ptr<BIO, BioFree> out(BIO_new(BIO_s_mem()));
  if (out == nullptr) return "?";
  X509_NAME_print_ex(out.get(), X509_get_subject_name(cert), 0, XN_FLAG_RFC2253);
  char* data = nullptr;
  const long n = BIO_get_mem_data(out.get(), &data);
  return n > 0 ? std::string(data, static_cast<std::size_t>(n)) : std::string("(empty)");
}

}  // namespace

ClientSecurityOptions WithEnvironment(ClientSecurityOptions options) {
  if (options.tls_ca.empty()) options.tls_ca = Env(kTlsCaEnv);
  if (options.tls_cert.empty()) options.tls_cert = Env(kTlsCertEnv);
  if (options.tls_key.empty()) options.tls_key = Env(kTlsKeyEnv);
  if (options.tls_server_name.empty()) options.tls_server_name = Env(kTlsServerNameEnv);
  if (options.token_file.empty()) options.token_file = Env(kTokenFileEnv);
  if (options.token_file.empty() && options.token.empty()) options.token = Env(kTokenEnv);
  return options;
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path) {
  MUONMESH_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(flag, path, kMaxPemBytes));
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": not a PEM file (no '-----BEGIN' line)"));
  }
  return text;
}

absl::StatusOr<PemFile> LoadPemFile(absl::string_view flag, const std::string& path) {
  MUONMESH_ASSIGN_OR_RETURN(std::string text, ReadPemFile(flag, path));
  return PemFile{std::string(flag), path, std::move(text)};
}

absl::StatusOr<std::string> CheckCertificate(const PemFile& cert, const PemFile& key) {
  std::unique_ptr<BIO, BioFree> cert_bio = MemoryBio(cert.text);
  std::unique_ptr<X509, X509Free> x509(
      cert_bio != nullptr ? PEM_read_bio_X509(cert_bio.get(), nullptr, NoPassphrase, nullptr)
                          : nullptr);
  if (x509 == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(cert.flag, " ", cert.path, ": holds no readable PEM certificate"));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(x509.get())) < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(cert.flag, " ", cert.path, ": the certificate expired on ",
                     FormatTime(X509_get0_notAfter(x509.get()))));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(x509.get())) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(cert.flag, " ", cert.path, ": the certificate is not valid before ",
                     FormatTime(X509_get0_notBefore(x509.get()))));
  }
  if (!key.text.empty()) {
    std::unique_ptr<BIO, BioFree> key_bio = MemoryBio(key.text);
    std::unique_ptr<EVP_PKEY, KeyFree> pkey(
        key_bio != nullptr
            ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, NoPassphrase, nullptr)
            : nullptr);
    if (pkey == nullptr) {
      ERR_clear_error();
      return absl::InvalidArgumentError(absl::StrCat(
          key.flag, " ", key.path,
          ": holds no readable private key (PEM, not encrypted with a passphrase)"));
    }
    if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError(absl::StrCat(key.flag, " ", key.path,
                                                     ": is not the key of the certificate in ",
                                                     cert.flag, " ", cert.path));
    }
  }
  return absl::StrCat("subject ", Subject(x509.get()), ", expires ",
                      FormatTime(X509_get0_notAfter(x509.get())));
}

absl::StatusOr<absl::Time> CertificateNotAfter(const PemFile& cert) {
  std::unique_ptr<BIO, BioFree> bio = MemoryBio(cert.text);
  std::unique_ptr<X509, X509Free> x509(
      bio != nullptr ? PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr) : nullptr);
  std::tm tm{};
  if (x509 == nullptr || ASN1_TIME_to_tm(X509_get0_notAfter(x509.get()), &tm) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(cert.flag, " ", cert.path, ": holds no readable PEM certificate"));
  }
  return absl::FromTM(tm, absl::UTCTimeZone());
}

absl::Status CheckToken(absl::string_view token) {
  if (token.size() < kMinTokenLength || token.size() > kMaxTokenLength) {
    return absl::InvalidArgumentError(absl::StrCat("a token must have ", kMinTokenLength, " to ",
                                                   kMaxTokenLength, " characters, this one has ",
                                                   token.size()));
  }
  for (const char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          "a token may hold only visible ASCII characters (no spaces or control characters)");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTokenFile(absl::string_view flag, const std::string& path) {
  MUONMESH_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(flag, path, kMaxTokenFileBytes));
  absl::string_view first(text);
  first = first.substr(0, first.find('\n'));
  const std::string token(absl::StripAsciiWhitespace(first));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": the first line is empty (it must hold the token)"));
  }
  if (token.find_first_of(" \t") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", path,
        ": the first line holds more than one word; a client's token file holds the token "
        "alone (the coordinator's --tokens-file, 'ROLE TOKEN' per line, is another format)"));
  }
  MUONMESH_RETURN_IF_ERROR(CheckToken(token), flag, " ", path);
  return token;
}

namespace {

// A file's modification time (ns) and size; {-1, -1} when it cannot be
// stat'ed.
std::pair<int64_t, int64_t> FileStamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {-1, -1};
  return {int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec,
          static_cast<int64_t>(st.st_size)};
}

}  // namespace

FileChangeCheck::FileChangeCheck(std::string path, absl::Duration every)
    : path_(std::move(path)),
      every_(every),
      stamp_(FileStamp(path_)),
      next_check_(absl::Now() + every) {}

bool FileChangeCheck::Changed() {
  const absl::Time now = absl::Now();
  if (now < next_check_) return false;
  next_check_ = now + every_;
  const std::pair<int64_t, int64_t> stamp = FileStamp(path_);
  if (stamp == stamp_) return false;
  stamp_ = stamp;
  return true;
}

std::shared_ptr<grpc::experimental::CertificateProviderInterface> WatchTlsFiles(
    const std::string& key, const std::string& cert, const std::string& ca,
    absl::Duration refresh) {
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      key, cert, ca,
      static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(refresh))));
}

namespace {

// "authorization: Bearer TOKEN" on every call, the token read again from
// its file when the file changes (looked at once per `refresh`); a version
// that does not read keeps the token in use.
class TokenFilePlugin final : public grpc::MetadataCredentialsPlugin {
 public:
  TokenFilePlugin(std::string path, std::string token, absl::Duration refresh)
      : file_(std::move(path), refresh), token_(std::move(token)) {}

  grpc::Status GetMetadata(grpc::string_ref, grpc::string_ref, const grpc::AuthContext&,
                           std::multimap<grpc::string, grpc::string>* metadata) override {
    metadata->insert({"authorization", absl::StrCat("Bearer ", Current())});
    return grpc::Status::OK;
  }

 private:
  std::string Current() {
    absl::MutexLock lock(&mu_);
    if (file_.Changed()) {
      absl::StatusOr<std::string> token = ReadTokenFile(kTokenFileName, file_.path());
      if (token.ok()) token_ = *std::move(token);
    }
    return token_;
  }

  absl::Mutex mu_;
  FileChangeCheck file_ ABSL_GUARDED_BY(mu_);
  std::string token_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void InitOpenSslWithoutExitHandler() {
  // Only the first initialisation decides whether the handler is
  // registered; later calls with the flag change nothing.
  OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
}

absl::StatusOr<ChannelSecurity> LoadChannelSecurity(const ClientSecurityOptions& options) {
  InitOpenSslWithoutExitHandler();
  ChannelSecurity out;
  const bool has_token = !options.token_file.empty() || !options.token.empty();
  if (options.tls_ca.empty()) {
    if (!options.tls_cert.empty() || !options.tls_key.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          kCertName, " and ", kKeyName, " need ", kCaName,
          ": a client certificate is only presented over TLS"));
    }
    if (has_token) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a token (--token-file, MUONMESH_TOKEN_FILE or MUONMESH_TOKEN) needs TLS: give ",
          kCaName, ", the CA of the coordinator's certificate; tokens are never sent in "
          "plaintext"));
    }
    return out;
  }
  // Checked here; the credentials read the files themselves (below).
  MUONMESH_RETURN_IF_ERROR(ReadPemFile(kCaName, options.tls_ca).status());
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("give both ", kCertName, " and ", kKeyName,
                                                   " (a client certificate and its key), or "
                                                   "neither"));
  }
  if (!options.tls_cert.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(PemFile cert, LoadPemFile(kCertName, options.tls_cert));
    MUONMESH_ASSIGN_OR_RETURN(PemFile key, LoadPemFile(kKeyName, options.tls_key));
    MUONMESH_RETURN_IF_ERROR(CheckCertificate(cert, key).status());
    out.client_certificate = true;
  }
  // Checked above; used from the files themselves, read again every
  // `refresh`, so a renewed certificate or CA needs no restart.
  grpc::experimental::TlsChannelCredentialsOptions tls;
  tls.set_certificate_provider(
      WatchTlsFiles(options.tls_key, options.tls_cert, options.tls_ca, options.refresh));
  tls.watch_root_certs();
  if (out.client_certificate) tls.watch_identity_key_cert_pairs();
  out.credentials = grpc::experimental::TlsCredentials(tls);
  out.tls = true;
  out.tls_server_name = options.tls_server_name;
  if (has_token) {
    std::string token = options.token;
    // "authorization: Bearer TOKEN" on every call; gRPC sends call
    // credentials only over a channel with privacy and integrity.
    std::shared_ptr<grpc::CallCredentials> call;
    if (!options.token_file.empty()) {
      MUONMESH_ASSIGN_OR_RETURN(std::string read,
                                ReadTokenFile(kTokenFileName, options.token_file));
      call = grpc::MetadataCredentialsFromPlugin(
          std::make_unique<TokenFilePlugin>(options.token_file, std::move(read), options.refresh));
    } else {
      MUONMESH_RETURN_IF_ERROR(CheckToken(token), kTokenEnv);
      call = grpc::AccessTokenCredentials(token);
    }
    out.credentials = grpc::CompositeChannelCredentials(out.credentials, call);
    out.token = true;
  }
  return out;
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelSecurity& security,
                                             grpc::ChannelArguments args) {
  if (!security.tls_server_name.empty()) args.SetSslTargetNameOverride(security.tls_server_name);
  // Set only what the caller did not (grpc_channel_args takes the first of
  // a duplicated key, so an override must not be appended after).
  const auto has = [&args](const char* key) {
    // Taken afresh each time: SetInt may move the arguments.
    const grpc_channel_args given = args.c_channel_args();
    for (size_t i = 0; i < given.num_args; ++i) {
      if (std::string_view(given.args[i].key) == key) return true;
    }
    return false;
  };
  const std::pair<const char*, int> keepalive[] = {
      {GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs},
      {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs},
      {GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1},
      // Pings keep going while no data flows (the default stops after 2).
      {GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0}};
  for (const auto& [key, value] : keepalive) {
    if (!has(key)) args.SetInt(key, value);
  }
  return grpc::CreateCustomChannel(
      address,
      security.credentials != nullptr ? security.credentials : grpc::InsecureChannelCredentials(),
      args);
}

void AddServerKeepalive(grpc::ServerBuilder& builder) {
  // Clients' pings are welcome with or without a call open, down to
  // kMinPingIntervalMs apart, and a ping sooner is never a reason to close
  // (no strikes limit): a late timer on a loaded machine must not cost a
  // worker its connection.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kMinPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

}  // namespace muonmesh::credentials
