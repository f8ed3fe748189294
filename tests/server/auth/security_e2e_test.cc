// Access control end to end with real processes on loopback: a
// muonmesh-coordinator serving TLS, asking workers for client certificates
// (mutual TLS) and checking bearer tokens with roles; muonmesh-worker daemons
// and muonmeshctl as users run them; certificates made by openssl for each
// run (make_test_certs.sh). Calls that must fail are made both through the
// generated stubs (to see the exact code) and through the binaries (to see
// what a user sees).

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "muonmesh/v1/jobs.grpc.pb.h"
#include "proto/credentials/credentials.h"
#include "server/auth/token_table.h"
#include "tests/testing/background.h"
#include "tests/testing/http_get.h"
#include "tests/testing/subprocess.h"
#if MUONMESH_HAVE_HEALTH_PROTO
#include "grpc/health/v1/health.grpc.pb.h"
#endif

namespace muonmesh {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::Background;
using testing::ProcessResult;

namespace fs = std::filesystem;
constexpr auto kStart = std::chrono::seconds(20);

// The tokens of the coordinator's --tokens-file; the worker's is listed by
// its SHA-256 only.
constexpr char kViewerToken[] = "viewer-token-5b1e0c9d4f";
constexpr char kSubmitterToken[] = "submitter-token-8a7f3e2c11";
constexpr char kWorkerToken[] = "worker-token-c4d2a9e07b";
constexpr char kAdminToken[] = "admin-token-1f0e9d8c7b";
constexpr char kWrongToken[] = "not-a-real-token-3141592653";

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

class SecurityTest : public ::testing::Test {
 protected:
  // Certificates and token files, once for all tests.
  static void SetUpTestSuite() {
    certs_ = new std::string(absl::StrCat(::testing::TempDir(), "/security_e2e_certs_", getpid()));
    fs::remove_all(*certs_);
    const ProcessResult made =
        testing::Run({"/bin/bash", MUONMESH_MAKE_TEST_CERTS, *certs_}, std::chrono::seconds(60));
    ASSERT_EQ(made.exit_code, 0) << made.out << made.err;
    std::ofstream(Cert("tokens")) << "# roles and tokens\n"
                                  << "viewer " << kViewerToken << "\n"
                                  << "submitter " << kSubmitterToken << "\n"
                                  << "worker sha256:"
                                  << absl::BytesToHexString(auth::Sha256(kWorkerToken)) << "\n"
                                  << "admin " << kAdminToken << "\n";
    fs::permissions(Cert("tokens"), fs::perms::owner_read | fs::perms::owner_write);
    for (const auto& [role, token] :
         {std::pair{"viewer", kViewerToken}, std::pair{"submitter", kSubmitterToken},
          std::pair{"worker", kWorkerToken}, std::pair{"admin", kAdminToken},
          std::pair{"wrong", kWrongToken}}) {
      std::ofstream(Cert(absl::StrCat(role, ".token"))) << token << "\n";
    }
  }
  static void TearDownTestSuite() {
    fs::remove_all(*certs_);
    delete certs_;
  }
  static std::string Cert(const std::string& name) { return absl::StrCat(*certs_, "/", name); }

  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/security_e2e_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ + "/runs");
    // As the worker will see it (no "//", no link on the way), so that the
    // paths in its messages are the ones written here.
    dir_ = fs::canonical(dir_).string();
    std::vector<std::string> argv = {
        MUONMESH_COORDINATOR_BIN, "--listen",     "127.0.0.1:0",      "--data-dir",
        dir_ + "/state",          "--lease-ttl",  "3s",               "--collective-timeout",
        "20s",                    "--tls-cert",   Cert("server.pem"), "--tls-key",
        Cert("server.key"),       "--tls-ca",     Cert("ca.pem"),     "--tokens-file",
        Cert("tokens")};
    const std::vector<std::string> extra = ExtraCoordinatorFlags();
    argv.insert(argv.end(), extra.begin(), extra.end());
    coordinator_ = std::make_unique<Background>(argv, dir_ + "/coordinator.log");
    address_ = coordinator_->ListeningAddress(kStart);
    ASSERT_FALSE(address_.empty()) << coordinator_->Log();
  }

  // Flags the coordinator starts with beyond the fixture's.
  virtual std::vector<std::string> ExtraCoordinatorFlags() const { return {}; }

  // A channel to the coordinator over TLS (plaintext when `tls` is false)
  // with `token` (none when empty) and the worker's client certificate when
  // `certificate` names one ("worker", "rogue-worker").
  std::shared_ptr<grpc::Channel> Channel(const std::string& token,
                                         const std::string& certificate = "", bool tls = true) {
    credentials::ClientSecurityOptions o;
    if (tls) o.tls_ca = Cert("ca.pem");
    o.token = token;
    if (!certificate.empty()) {
      o.tls_cert = Cert(certificate + ".pem");
      o.tls_key = Cert(certificate + ".key");
    }
    absl::StatusOr<credentials::ChannelSecurity> security = credentials::LoadChannelSecurity(o);
    EXPECT_TRUE(security.ok()) << security.status();
    return credentials::CreateChannel(address_, security.ok() ? *security : credentials::ChannelSecurity{});
  }

  static grpc::Status ListJobs(const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ListJobsResponse response;
    return v1::Jobs::NewStub(channel)->ListJobs(&context, {}, &response);
  }

  static grpc::Status Register(const std::shared_ptr<grpc::Channel>& channel,
                               const std::string& worker_id = "intruder") {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::RegisterRequest request;
    request.mutable_info()->set_worker_id(worker_id);
    request.mutable_info()->set_device("cpu");
    request.mutable_info()->set_address("127.0.0.1");
    v1::RegisterResponse response;
    return v1::Fleet::NewStub(channel)->Register(&context, request, &response);
  }

  // muonmeshctl with the CA and `role`'s token file (none when empty).
  ProcessResult Ctl(std::vector<std::string> args, const std::string& role,
                    const std::vector<std::string>& env = {}) {
    args.insert(args.begin(), MUONMESHCTL_BIN);
    args.insert(args.end(), {"--coordinator", address_, "--tls-ca", Cert("ca.pem")});
    if (!role.empty()) args.insert(args.end(), {"--token-file", Cert(role + ".token")});
    return testing::Run(std::move(args), std::chrono::seconds(120), env);
  }

  // A worker daemon over mutual TLS with the worker token, allowed to use
  // dir_/runs; `extra` replaces nothing, it is appended.
  Background& StartWorker(const std::string& id, std::vector<std::string> extra = {},
                          bool wait_registered = true) {
    std::vector<std::string> argv = {MUONMESH_WORKER_BIN, "--coordinator", address_,
                                     "--worker-id", id, "--memory-budget", "1GiB",
                                     "--tls-ca", Cert("ca.pem")};
    if (extra.empty()) {
      extra = {"--tls-cert", Cert("worker.pem"), "--tls-key", Cert("worker.key"), "--token-file",
               Cert("worker.token"), "--allowed-dirs", dir_ + "/runs"};
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    workers_.push_back(std::make_unique<Background>(argv, absl::StrCat(dir_, "/", id, ".log")));
    if (wait_registered) {
      EXPECT_TRUE(workers_.back()->WaitForLog("registered as", kStart)) << workers_.back()->Log();
    }
    return *workers_.back();
  }

  // A small job (world `world`) with its outputs in `out`.
  std::string WriteJob(const std::string& name, int world, const std::string& out) {
    const std::string path = absl::StrCat(dir_, "/", name, ".yaml");
    std::ofstream(path) << "name: " << name << "\nworld_size: " << world
                        << "\nmodel: {mlp: {dims: [6, 16, 3]}}\ninit: {seed: 5}\n"
                        << "data: {teacher: {seed: 21, samples: 256}}\n"
                        << "training: {steps: 4, global_batch_size: 24}\n"
                        << "output: {dir: " << out << ", export: " << out
                        << "/final.safetensors}\n";
    return path;
  }

  std::string Logs() const {
    std::string out = "coordinator:\n" + coordinator_->Log();
    for (const auto& w : workers_) out += "\nworker:\n" + w->Log();
    return out;
  }

  // No process printed a token or a key.
  void ExpectNoSecretsInLogs() const {
    const std::string logs = Logs();
    for (const char* secret :
         {kViewerToken, kSubmitterToken, kWorkerToken, kAdminToken, kWrongToken}) {
      EXPECT_THAT(logs, Not(HasSubstr(secret)));
    }
    EXPECT_THAT(logs, Not(HasSubstr("PRIVATE KEY")));
  }

  static std::string* certs_;
  std::string dir_;
  std::string address_;
  std::unique_ptr<Background> coordinator_;
  std::vector<std::unique_ptr<Background>> workers_;
};

std::string* SecurityTest::certs_ = nullptr;

TEST_F(SecurityTest, NoTokenAWrongTokenAndAViewerSubmittingAreRefused) {
  grpc::Status s = ListJobs(Channel(""));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("needs a bearer token"));
  s = ListJobs(Channel(kWrongToken));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("not one of the coordinator's tokens"));
  EXPECT_THAT(s.error_message(), Not(HasSubstr(kWrongToken)));
  // A viewer reads but may not submit or cancel; a worker does not read jobs.
  EXPECT_TRUE(ListJobs(Channel(kViewerToken)).ok());
  {
    grpc::ClientContext context;
    v1::SubmitJobRequest request;
    request.mutable_spec()->set_name("x");
    v1::SubmitJobResponse response;
    s = v1::Jobs::NewStub(Channel(kViewerToken))->SubmitJob(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(),
                HasSubstr("role viewer may not call /muonmesh.v1.Jobs/SubmitJob"));
  }
  {
    grpc::ClientContext context;
    v1::CancelJobRequest request;
    request.set_job_id("j-1");
    v1::Job response;
    s = v1::Jobs::NewStub(Channel(kViewerToken))->CancelJob(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  s = ListJobs(Channel(kWorkerToken, "worker"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();

  // What a user of muonmeshctl sees: the reason, and exit code 5 (refused).
  const std::string job = WriteJob("viewer-job", 1, dir_ + "/runs/viewer-job");
  ProcessResult r = Ctl({"list"}, "");
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_THAT(r.err, HasSubstr("needs a bearer token"));
  r = Ctl({"list"}, "wrong");
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_THAT(r.err, HasSubstr("not one of the coordinator's tokens"));
  r = Ctl({"submit", job}, "viewer");
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_THAT(r.err, HasSubstr("role viewer may not call /muonmesh.v1.Jobs/SubmitJob"));
  r = Ctl({"list"}, "viewer");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  // Nothing was submitted; the coordinator logged each denial, without tokens.
  EXPECT_EQ(Lines(r.out).size(), 1u) << r.out;
  EXPECT_THAT(coordinator_->Log(),
              HasSubstr("denied /muonmesh.v1.Jobs/SubmitJob: PERMISSION_DENIED (role viewer)"));
  EXPECT_THAT(coordinator_->Log(), HasSubstr("denied /muonmesh.v1.Jobs/ListJobs: "
                                             "UNAUTHENTICATED (unknown token)"));
  ExpectNoSecretsInLogs();
}

TEST_F(SecurityTest, ASubmitterSubmitsAndCancels) {
  const std::string job = WriteJob("wait", 2, dir_ + "/runs/wait");
  // The token from the environment this time.
  const std::vector<std::string> env = {absl::StrCat(credentials::kTokenEnv, "=", kSubmitterToken)};
  ProcessResult r = Ctl({"submit", job}, "", env);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string id = Lines(r.out).back();
  r = Ctl({"status", id}, "viewer");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("PENDING"));
  r = Ctl({"cancel", id, "--reason", "changed my mind"}, "viewer");
  EXPECT_EQ(r.exit_code, 5) << r.err;
  r = Ctl({"cancel", id, "--reason", "changed my mind"}, "", env);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"status", id}, "admin");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("CANCELLED"));
  ExpectNoSecretsInLogs();
}

TEST_F(SecurityTest, AWorkerWithoutAClientCertificateCannotRegister) {
  // Through the stub: the worker token alone is not enough, nor a viewer's
  // token with a certificate; a certificate from another CA fails the
  // handshake.
  grpc::Status s = Register(Channel(kWorkerToken));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("needs a client certificate signed by the "
                                           "coordinator's CA"));
  s = Register(Channel(kViewerToken, "worker"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  s = Register(Channel(kWorkerToken, "rogue-worker"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();

  // The daemon without a certificate stops at once, saying why.
  Background& bare = StartWorker("bare", {"--token-file", Cert("worker.token")}, false);
  EXPECT_EQ(bare.Wait(std::chrono::seconds(30)), 1) << bare.Log();
  EXPECT_THAT(bare.Log(), HasSubstr("client certificate"));
  // With someone else's certificate it never gets in (the handshake fails;
  // it keeps retrying, as for a coordinator that is down).
  Background& rogue = StartWorker("rogue",
                                  {"--tls-cert", Cert("rogue-worker.pem"), "--tls-key",
                                   Cert("rogue-worker.key"), "--token-file", Cert("worker.token")},
                                  false);
  EXPECT_TRUE(rogue.WaitForLog("cannot register yet", kStart)) << rogue.Log();
  // The one with the right certificate does get in, and is the only one.
  StartWorker("w0");
  ProcessResult r = Ctl({"workers"}, "viewer");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("w0"));
  EXPECT_THAT(r.out, Not(HasSubstr("rogue")));
  EXPECT_THAT(r.out, Not(HasSubstr("bare")));
  EXPECT_THAT(r.out, Not(HasSubstr("intruder")));
  ExpectNoSecretsInLogs();
}

TEST_F(SecurityTest, APlaintextClientCannotTalkToTheTlsServer) {
  const grpc::Status s = ListJobs(Channel("", "", /*tls=*/false));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  // muonmeshctl without --tls-ca: unreachable (3).
  const ProcessResult r = testing::Run({MUONMESHCTL_BIN, "list", "--coordinator", address_},
                                       std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  // A token is never sent in plaintext: the client refuses to try.
  const ProcessResult t = testing::Run(
      {MUONMESHCTL_BIN, "list", "--coordinator", address_, "--token-file", Cert("admin.token")},
      std::chrono::seconds(60));
  EXPECT_EQ(t.exit_code, 2) << t.err;
  EXPECT_THAT(t.err, HasSubstr("needs TLS"));
}

TEST_F(SecurityTest, HealthChecksNeedNoTokenOrCertificate) {
#if MUONMESH_HAVE_HEALTH_PROTO
  auto health = grpc::health::v1::Health::NewStub(Channel(""));
  for (const char* service : {"", "muonmesh.v1.Jobs", "muonmesh.v1.Fleet"}) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s = health->Check(&context, request, &response);
    ASSERT_TRUE(s.ok()) << service << ": " << s.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
#else
  GTEST_SKIP() << "grpc/health/v1/health.proto (package grpc-proto) not found at build time";
#endif
}

TEST_F(SecurityTest, AJobRunsEndToEndOverMutualTlsWithTokens) {
  StartWorker("w0");
  StartWorker("w1");
  const std::string out = dir_ + "/runs/e2e";
  ProcessResult r = Ctl({"submit", WriteJob("e2e", 2, out)}, "submitter");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string id = Lines(r.out).back();
  r = Ctl({"watch", id}, "viewer");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err << Logs();
  EXPECT_THAT(Lines(r.out).back(), HasSubstr("SUCCEEDED"));
  EXPECT_TRUE(fs::is_regular_file(out + "/final.safetensors"));
  r = Ctl({"metrics", id, "--format", "csv"}, "viewer");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Lines(r.out).size(), 5u) << r.out;
  // What the coordinator said about its security at start.
  const std::string log = coordinator_->Log();
  EXPECT_THAT(log, HasSubstr("TLS on 127.0.0.1:0: certificate subject CN=muonmesh-coordinator"));
  EXPECT_THAT(log, HasSubstr("mutual TLS: Fleet and Store need a client certificate"));
  EXPECT_THAT(log, HasSubstr("tokens: 4 from"));
  EXPECT_THAT(log, HasSubstr("viewer 1, submitter 1, worker 1, admin 1"));
  ExpectNoSecretsInLogs();
}

// A client over TLS ends cleanly: OpenSSL's exit handler, which freed its
// state under gRPC's threads (muonmeshctl aborted with "double free" about
// once in a hundred runs, after its work was done), is never registered.
TEST_F(SecurityTest, AClientOverTlsExitsWithOpenSslStillUp) {
  const ProcessResult r =
      testing::Run({OPENSSL_EXIT_PROBE_BIN, address_, Cert("ca.pem"), Cert("viewer.token")},
                   std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("connected over TLS"));
}

TEST_F(SecurityTest, AJobOutsideTheAllowedFoldersIsRefused) {
  StartWorker("w0");
  fs::create_directories(dir_ + "/elsewhere");
  fs::create_directory_symlink(dir_ + "/elsewhere", dir_ + "/runs/link");
  struct Case {
    std::string name;
    std::string out;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"outside", dir_ + "/elsewhere/outside",
       absl::StrCat("output.dir: ", dir_, "/elsewhere/outside is outside the allowed folders")},
      {"through-a-link", dir_ + "/runs/link/escape",
       absl::StrCat("output.dir: ", dir_, "/runs/link/escape (which leads to ")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ProcessResult r = Ctl({"submit", WriteJob(c.name, 1, c.out)}, "submitter");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const std::string id = Lines(r.out).back();
    r = Ctl({"watch", id}, "viewer");
    EXPECT_EQ(r.exit_code, 6) << r.out << r.err << Logs();
    r = Ctl({"status", id}, "viewer");
    EXPECT_THAT(r.out, HasSubstr("FAILED"));
    EXPECT_THAT(r.out, HasSubstr(c.expected)) << r.out;
    EXPECT_THAT(r.out, HasSubstr("--allowed-dirs")) << r.out;
    EXPECT_FALSE(fs::exists(c.out)) << c.out;
  }
  EXPECT_TRUE(fs::is_empty(dir_ + "/elsewhere"));
}

// With --worker-ids-from-certificates a worker's id must be named by its
// own client certificate (worker-w7.pem: CN w7, subjectAltName
// w7.workers.test); the shared certificate (CN muonmesh-worker) names no
// worker id of these.
// The coordinator exports when its certificates expire, as openssl reads
// them from the files, and answers /readyz and /healthz on its plain HTTP
// port although its gRPC port speaks only TLS.
class MetricsPortTest : public SecurityTest {
 protected:
  std::vector<std::string> ExtraCoordinatorFlags() const override {
    return {"--metrics-listen", "127.0.0.1:0"};
  }
};

// The port a process's log says it serves metrics on ("... metrics on port N").
int MetricsPortIn(const std::string& log) {
  const size_t at = log.find("metrics on port ");
  return at == std::string::npos ? -1 : std::stoi(log.substr(at + 16));
}

// The exposition text at `port` holds, for each label value, the expiry
// openssl reads from its file.
void ExpectExpiryExported(int port, const std::map<std::string, std::string>& files) {
  const std::string text = testing::HttpGet(port, "/metrics");
  for (const auto& [name, file] : files) {
    // "notAfter=Dec  7 21:05:21 2026 GMT"
    const ProcessResult end = testing::Run(
        {"/usr/bin/openssl", "x509", "-enddate", "-noout", "-in", file}, std::chrono::seconds(20));
    ASSERT_EQ(end.exit_code, 0) << end.err;
    absl::Time expected;
    std::string error;
    const std::string when(absl::StripAsciiWhitespace(end.out.substr(end.out.find('=') + 1)));
    ASSERT_TRUE(
        absl::ParseTime("%b %e %H:%M:%S %Y GMT", when, absl::UTCTimeZone(), &expected, &error))
        << when << ": " << error;
    const std::string series = absl::StrCat(
        "muonmesh_tls_certificate_expiry_timestamp_seconds{certificate=\"", name, "\"} ");
    const size_t found = text.find(series);
    ASSERT_NE(found, std::string::npos) << name << "\n" << text;
    EXPECT_DOUBLE_EQ(std::stod(text.substr(found + series.size())),
                     absl::ToDoubleSeconds(expected - absl::UnixEpoch()))
        << name;
  }
}

TEST_F(MetricsPortTest, CertificateExpiryIsExportedAndProbesNeedNoTls) {
  const int port = MetricsPortIn(coordinator_->Log());
  ASSERT_GT(port, 0) << coordinator_->Log();
  ExpectExpiryExported(port, {{"server", Cert("server.pem")}, {"client_ca", Cert("ca.pem")}});
  std::string status;
  EXPECT_EQ(testing::HttpGet(port, "/readyz", &status), "ok\n") << status;
  EXPECT_EQ(testing::HttpGet(port, "/healthz", &status), "ok\n") << status;
}

// A worker exports the expiry of its client certificate and of the CA it
// checks the coordinator against (a different file from the coordinator's
// certificate, so a mix-up shows).
TEST_F(MetricsPortTest, AWorkerExportsWhenItsCertificatesExpire) {
  Background& worker =
      StartWorker("w0", {"--tls-cert", Cert("worker.pem"), "--tls-key", Cert("worker.key"),
                         "--token-file", Cert("worker.token"), "--metrics-listen", "127.0.0.1:0"});
  const int port = MetricsPortIn(worker.Log());
  ASSERT_GT(port, 0) << worker.Log();
  ExpectExpiryExported(port, {{"client", Cert("worker.pem")}, {"ca", Cert("ca.pem")}});
  std::string status;
  EXPECT_EQ(testing::HttpGet(port, "/readyz", &status), "ok\n") << status;
}

// The notAfter line of the certificate `address` serves ("notAfter=..."),
// as openssl's own TLS client reads it.
std::string ServedCertificateEnd(const std::string& address) {
  const ProcessResult r =
      testing::Run({"/bin/bash", "-c",
                    absl::StrCat("/usr/bin/openssl s_client -connect ", address,
                                 " -alpn h2 -servername localhost </dev/null 2>/dev/null | "
                                 "/usr/bin/openssl x509 -noout -enddate")},
                   std::chrono::seconds(20));
  return std::string(absl::StripAsciiWhitespace(r.out));
}

// A certificate renewed on disk is served, and its expiry exported, within
// --tls-refresh, without a restart; clients that trust the CA go on.
TEST_F(MetricsPortTest, ARenewedCertificateIsServedWithoutARestart) {
  const std::string tls = dir_ + "/tls";
  fs::create_directories(tls);
  for (const char* name : {"server.pem", "server.key", "ca.pem", "tokens"}) {
    fs::copy_file(Cert(name), absl::StrCat(tls, "/", name));
  }
  Background coordinator(
      {MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--data-dir", dir_ + "/renewed-state",
       "--tls-cert", tls + "/server.pem", "--tls-key", tls + "/server.key", "--tls-ca",
       tls + "/ca.pem", "--tokens-file", tls + "/tokens", "--tls-refresh", "1s", "--metrics-listen",
       "127.0.0.1:0"},
      dir_ + "/renewed.log");
  const std::string address = coordinator.ListeningAddress(kStart);
  ASSERT_FALSE(address.empty()) << coordinator.Log();
  const std::string before = ServedCertificateEnd(address);
  ASSERT_THAT(before, HasSubstr("notAfter=")) << coordinator.Log();
  // A new key and a certificate for 5 days (the first: 2), from the same CA.
  const ProcessResult made = testing::Run(
      {"/bin/bash", "-c",
       absl::StrCat("set -e; cd ", tls,
                    "; openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "
                    "new.key 2>/dev/null; openssl req -new -key new.key -subj "
                    "/CN=muonmesh-coordinator -out new.csr 2>/dev/null; printf "
                    "'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > new.ext; openssl x509 -req "
                    "-in new.csr -CA ",
                    Cert("ca.pem"), " -CAkey ", Cert("ca.key"),
                    " -set_serial 4242 -days 5 -extfile new.ext -out new.pem 2>/dev/null; "
                    "openssl x509 -noout -enddate -in new.pem; mv new.key server.key; mv new.pem "
                    "server.pem")},
      std::chrono::seconds(30));
  ASSERT_EQ(made.exit_code, 0) << made.out << made.err;
  const std::string renewed(absl::StripAsciiWhitespace(made.out));
  ASSERT_NE(renewed, before);
  std::string served;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (absl::Now() < give_up && (served = ServedCertificateEnd(address)) != renewed) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(served, renewed) << coordinator.Log();
  // Clients that trust the CA go on, with their tokens.
  credentials::ClientSecurityOptions o;
  o.tls_ca = Cert("ca.pem");
  o.token = kViewerToken;
  absl::StatusOr<credentials::ChannelSecurity> security = credentials::LoadChannelSecurity(o);
  ASSERT_TRUE(security.ok()) << security.status();
  EXPECT_TRUE(ListJobs(credentials::CreateChannel(address, *security)).ok());
}

// Tokens rotated on disk, on both sides, without a restart: the coordinator
// stops accepting a token removed from its tokens file (looked at every
// 5 s), and a client whose token file is rewritten (refresh 1 s) sends the
// new token on its next calls over the same channel.
TEST_F(MetricsPortTest, TokensRotateOnBothSidesWithoutARestart) {
  const std::string dir = dir_ + "/rotate";
  fs::create_directories(dir);
  const std::string old_token = "rotated-out-token-1234567890";
  const std::string new_token = "rotated-in-token-0987654321";
  const auto write = [](const std::string& path, const std::string& text, int generation) {
    std::ofstream(path, std::ios::trunc) << text;
    fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write);
    fs::last_write_time(path, fs::file_time_type::clock::now() + std::chrono::seconds(generation));
  };
  write(dir + "/tokens", absl::StrCat("viewer ", old_token, "\nviewer ", new_token, "\n"), 1);
  write(dir + "/client.token", old_token + "\n", 1);
  Background coordinator({MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--data-dir",
                          dir + "/state", "--tls-cert", Cert("server.pem"), "--tls-key",
                          Cert("server.key"), "--tokens-file", dir + "/tokens"},
                         dir + "/coordinator.log");
  const std::string address = coordinator.ListeningAddress(kStart);
  ASSERT_FALSE(address.empty()) << coordinator.Log();
  credentials::ClientSecurityOptions o;
  o.tls_ca = Cert("ca.pem");
  o.token_file = dir + "/client.token";
  o.refresh = absl::Seconds(1);
  absl::StatusOr<credentials::ChannelSecurity> security = credentials::LoadChannelSecurity(o);
  ASSERT_TRUE(security.ok()) << security.status();
  const std::shared_ptr<grpc::Channel> channel = credentials::CreateChannel(address, *security);
  ASSERT_TRUE(ListJobs(channel).ok());

  write(dir + "/tokens", absl::StrCat("viewer ", new_token, "\n"), 2);  // revoke the old
  const auto until = [](const std::function<bool()>& done) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (!done() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(200));
    return done();
  };
  EXPECT_TRUE(until([&] {
    return ListJobs(channel).error_code() == grpc::StatusCode::UNAUTHENTICATED;
  })) << coordinator.Log();
  EXPECT_THAT(coordinator.Log(), HasSubstr("tokens: reloaded 1 from"));

  write(dir + "/client.token", new_token + "\n", 2);  // the client takes up the new one
  EXPECT_TRUE(until([&] { return ListJobs(channel).ok(); }));
  EXPECT_THAT(coordinator.Log(), Not(HasSubstr(old_token)));
  EXPECT_THAT(coordinator.Log(), Not(HasSubstr(new_token)));
}

class WorkerIdentityTest : public SecurityTest {
 protected:
  std::vector<std::string> ExtraCoordinatorFlags() const override {
    return {"--worker-ids-from-certificates"};
  }
};

TEST_F(WorkerIdentityTest, AWorkerRegistersOnlyUnderANameItsCertificateHolds) {
  EXPECT_TRUE(Register(Channel(kWorkerToken, "worker-w7"), "w7").ok());
  EXPECT_TRUE(Register(Channel(kWorkerToken, "worker-w7"), "w7.workers.test").ok());
  grpc::Status s = Register(Channel(kWorkerToken, "worker-w7"), "w8");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("worker id 'w8' is not named by the client "
                                           "certificate it came with (w7, w7.workers.test)"));
  s = Register(Channel(kWorkerToken, "worker"), "w7");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("(muonmesh-worker)"));
  // Later calls are held to the same name: another worker's heartbeat with
  // w7's certificate is refused before its lease is looked at.
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::HeartbeatRequest request;
    request.set_worker_id("w8");
    request.set_lease_id("any");
    v1::HeartbeatResponse response;
    s = v1::Fleet::NewStub(Channel(kWorkerToken, "worker-w7"))
            ->Heartbeat(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  // The daemons: w7 with its certificate gets in; w8 with w7's does not
  // and says why.
  StartWorker("w7", {"--tls-cert", Cert("worker-w7.pem"), "--tls-key", Cert("worker-w7.key"),
                     "--token-file", Cert("worker.token")});
  Background& impostor =
      StartWorker("w8",
                  {"--tls-cert", Cert("worker-w7.pem"), "--tls-key", Cert("worker-w7.key"),
                   "--token-file", Cert("worker.token")},
                  false);
  EXPECT_TRUE(impostor.WaitForLog("is not named by the client certificate", kStart))
      << impostor.Log();
  ProcessResult r = Ctl({"workers"}, "viewer");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("w7"));
  EXPECT_THAT(r.out, Not(HasSubstr("w8")));
  ExpectNoSecretsInLogs();
}

// Without the fixture's coordinator: what the coordinator accepts to serve.
TEST(CoordinatorExposureTest, NonLoopbackWithoutCredentialsIsRefused) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/security_e2e_exposure");
  fs::remove_all(dir);
  fs::create_directories(dir);
  ProcessResult r = testing::Run(
      {MUONMESH_COORDINATOR_BIN, "--listen", "0.0.0.0:0", "--data-dir", "none"},
      std::chrono::seconds(30));
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--listen 0.0.0.0:0 is not a loopback address"));
  EXPECT_THAT(r.out, Not(HasSubstr("listening on")));
  // Tokens without TLS are refused too, on any address.
  std::ofstream(dir + "/tokens") << "admin admin-token-1f0e9d8c7b\n";
  r = testing::Run({MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--data-dir", "none",
                    "--tokens-file", dir + "/tokens"},
                   std::chrono::seconds(30));
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("bearer tokens are never accepted in plaintext"));
  // Worker ids from certificates need certificates.
  r = testing::Run({MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--data-dir", "none",
                    "--worker-ids-from-certificates"},
                   std::chrono::seconds(30));
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--worker-ids-from-certificates needs --tls-ca"));
  // --insecure serves it, with a loud warning.
  Background insecure({MUONMESH_COORDINATOR_BIN, "--listen", "0.0.0.0:0", "--data-dir", "none",
                       "--insecure"},
                      dir + "/insecure.log");
  ASSERT_TRUE(insecure.WaitForLog("listening on", kStart)) << insecure.Log();
  EXPECT_THAT(insecure.Log(), HasSubstr("WARNING: --insecure: serving 0.0.0.0:0 WITHOUT TLS"));
  // Loopback without credentials serves, and says it is loopback only.
  Background loopback({MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--data-dir", "none"},
                      dir + "/loopback.log");
  ASSERT_TRUE(loopback.WaitForLog("listening on", kStart)) << loopback.Log();
  EXPECT_THAT(loopback.Log(), HasSubstr("loopback only"));
}

}  // namespace
}  // namespace muonmesh
