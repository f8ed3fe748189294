// The coordinator's access rules as pure functions: every method against
// every role (the table below is written from the roles as README
// "Security" and issue 12 state them, not from access_policy.cc), the
// client certificate rule, the tokens file and the loopback test.

#include "server/auth/access_policy.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/fleet.pb.h"
#include "muonmesh/v1/jobs.pb.h"
#include "muonmesh/v1/planner.pb.h"
#include "muonmesh/v1/store.pb.h"
#include "server/auth/server_security.h"
#include "server/auth/token_table.h"

namespace muonmesh::auth {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr auto kOk = absl::StatusCode::kOk;
constexpr auto kDenied = absl::StatusCode::kPermissionDenied;

struct Row {
  std::string method;
  // viewer, submitter, worker, admin
  absl::StatusCode expected[4];
};

// "viewer reads (Get/List/Watch/Metrics, Planner), submitter also submits
// and cancels, worker uses Fleet and Store, admin all"; listing the fleet
// is a read that workers may do too.
const std::vector<Row> kMatrix = {
    {"/muonmesh.v1.Planner/ValidateConfig", {kOk, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Planner/PlanLayout", {kOk, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/GetJob", {kOk, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/ListJobs", {kOk, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/WatchJob", {kOk, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/GetJobMetrics", {kOk, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/SubmitJob", {kDenied, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/CancelJob", {kDenied, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/DeleteJob", {kDenied, kOk, kDenied, kOk}},
    // Removing everyone's old jobs is the operator's.
    {"/muonmesh.v1.Jobs/PruneJobs", {kDenied, kDenied, kDenied, kOk}},
    {"/muonmesh.v1.Jobs/ParseJobFile", {kOk, kOk, kDenied, kOk}},
    {"/muonmesh.v1.Fleet/ListWorkers", {kOk, kOk, kOk, kOk}},
    // Taking a worker out of service is the operator's (a worker drains
    // itself through its heartbeat).
    {"/muonmesh.v1.Fleet/DrainWorker", {kDenied, kDenied, kDenied, kOk}},
    // So is forgetting a lost one.
    {"/muonmesh.v1.Fleet/RemoveWorker", {kDenied, kDenied, kDenied, kOk}},
    {"/muonmesh.v1.Fleet/Register", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Fleet/Heartbeat", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Fleet/Assignments", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Fleet/ReportStep", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Fleet/ReportAttempt", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Store/Set", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Store/Get", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Store/Wait", {kDenied, kDenied, kOk, kOk}},
    {"/muonmesh.v1.Store/Add", {kDenied, kDenied, kOk, kOk}},
    {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", {kOk, kOk, kOk, kOk}},
    // Not a method of ours: only an admin gets as far as UNIMPLEMENTED.
    {"/muonmesh.v1.Jobs/DeleteEverything", {kDenied, kDenied, kDenied, kOk}},
    {"/muonmesh.v1.Secret/Get", {kDenied, kDenied, kDenied, kOk}},
    {"/muonmesh.v1.Planner/a/b", {kDenied, kDenied, kDenied, kOk}},
    {"", {kDenied, kDenied, kDenied, kOk}},
};

const AccessPolicyOptions kTokensAndCa = {.tokens = true, .client_ca = true};

// A caller that sent a token (known when `role` is set).
Caller WithToken(std::optional<Role> role, bool client_certificate = false) {
  Caller c;
  c.token_given = true;
  c.role = role;
  c.client_certificate = client_certificate;
  return c;
}

Caller CertificateOnly() {
  Caller c;
  c.client_certificate = true;
  return c;
}

TEST(AuthorizeTest, EveryMethodAgainstEveryRole) {
  const Role roles[] = {Role::kViewer, Role::kSubmitter, Role::kWorker, Role::kAdmin};
  for (const Row& row : kMatrix) {
    for (int i = 0; i < 4; ++i) {
      SCOPED_TRACE(row.method + " as " + std::string(RoleName(roles[i])));
      const Caller caller{.token_given = true, .role = roles[i], .client_certificate = true};
      const absl::Status s = Authorize(row.method, caller, kTokensAndCa);
      EXPECT_EQ(s.code(), row.expected[i]) << s;
      if (!s.ok()) {
        EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("role ", RoleName(roles[i]))));
        EXPECT_THAT(s.message(), HasSubstr(row.method));
      }
    }
  }
}

TEST(AuthorizeTest, NoTokenOrAnUnknownOneIsUnauthenticated) {
  for (const Row& row : kMatrix) {
    SCOPED_TRACE(row.method);
    absl::Status s = Authorize(row.method, Caller{}, kTokensAndCa);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
    EXPECT_THAT(s.message(), HasSubstr("needs a bearer token"));
    s = Authorize(row.method, WithToken(std::nullopt), kTokensAndCa);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
    EXPECT_THAT(s.message(), HasSubstr("not one of the coordinator's tokens"));
  }
}

// Every RPC the coordinator's services declare, from their descriptors: each
// must be placed in the policy (not left to the admin-only fallback) and in
// this test's matrix above, so a new RPC fails here until both say who may
// call it.
TEST(AuthorizeTest, EveryRpcOfEveryServiceIsPlaced) {
  const google::protobuf::DescriptorPool* pool =
      google::protobuf::DescriptorPool::generated_pool();
  // Referencing the generated files links their descriptors in.
  (void)v1::SubmitJobRequest::descriptor();
  (void)v1::RegisterRequest::descriptor();
  (void)v1::PlanLayoutRequest::descriptor();
  (void)v1::StoreSetRequest::descriptor();
  std::map<std::string, const Row*> matrix;
  for (const Row& row : kMatrix) matrix[row.method] = &row;
  int methods = 0;
  for (const char* name :
       {"muonmesh.v1.Planner", "muonmesh.v1.Jobs", "muonmesh.v1.Fleet", "muonmesh.v1.Store"}) {
    const google::protobuf::ServiceDescriptor* service = pool->FindServiceByName(name);
    ASSERT_NE(service, nullptr) << name;
    for (int m = 0; m < service->method_count(); ++m) {
      const std::string path = absl::StrCat("/", service->full_name(), "/",
                                            service->method(m)->name());
      ++methods;
      EXPECT_TRUE(IsPlaced(path)) << path << " has no rule in access_policy.cc";
      EXPECT_TRUE(matrix.count(path)) << path << " is missing from this test's matrix";
    }
  }
  EXPECT_EQ(methods, 23);  // the rpc lines of proto/muonmesh/v1/*.proto
}

TEST(AuthorizeTest, UnknownMethodsAreNotPlaced) {
  EXPECT_FALSE(IsPlaced("/muonmesh.v1.Jobs/DeleteEverything"));
  EXPECT_FALSE(IsPlaced("/muonmesh.v1.Store/"));
  EXPECT_TRUE(IsPlaced("/grpc.health.v1.Health/Check"));
}

TEST(AuthorizeTest, HealthChecksAreOpenToAnyone) {
  for (const char* method : {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}) {
    EXPECT_TRUE(Authorize(method, Caller{}, kTokensAndCa).ok());
    EXPECT_TRUE(Authorize(method, WithToken(std::nullopt), kTokensAndCa).ok());
  }
}

TEST(AuthorizeTest, WorkerTrafficNeedsAClientCertificateWhenThereIsACa) {
  for (const Role role : {Role::kWorker, Role::kAdmin}) {
    const Caller no_cert = WithToken(role);
    absl::Status s = Authorize("/muonmesh.v1.Fleet/Register", no_cert, kTokensAndCa);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
    EXPECT_THAT(s.message(), HasSubstr("client certificate"));
    EXPECT_EQ(Authorize("/muonmesh.v1.Store/Get", no_cert, kTokensAndCa).code(),
              absl::StatusCode::kUnauthenticated);
    // Without a CA there is nothing to check a certificate against.
    EXPECT_TRUE(
        Authorize("/muonmesh.v1.Fleet/Register", no_cert, {.tokens = true, .client_ca = false})
            .ok());
  }
  // Reads need none.
  EXPECT_TRUE(Authorize("/muonmesh.v1.Fleet/ListWorkers",
                        WithToken(Role::kViewer), kTokensAndCa)
                  .ok());
  // A CA without tokens: the certificate is the whole check.
  const AccessPolicyOptions ca_only = {.tokens = false, .client_ca = true};
  EXPECT_EQ(Authorize("/muonmesh.v1.Fleet/Register", Caller{}, ca_only).code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(Authorize("/muonmesh.v1.Fleet/Register", CertificateOnly(), ca_only)
                  .ok());
  EXPECT_TRUE(Authorize("/muonmesh.v1.Jobs/SubmitJob", Caller{}, ca_only).ok());
}

TEST(DescribeRolesTest, ReadsAsAList) {
  EXPECT_EQ(DescribeRoles({Role::kSubmitter, Role::kAdmin}), "submitter or admin");
  EXPECT_EQ(DescribeRoles({Role::kViewer, Role::kSubmitter, Role::kAdmin}),
            "viewer, submitter or admin");
  EXPECT_EQ(DescribeRoles({Role::kAdmin}), "admin");
}

// sha256("abc"), from FIPS 180-2 appendix B.1.
constexpr char kAbcDigest[] =
    "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

TEST(TokenTableTest, Sha256MatchesTheStandardsExample) {
  EXPECT_EQ(absl::BytesToHexString(Sha256("abc")), kAbcDigest);
}

TEST(TokenTableTest, TokensAndDigestsMapToTheirRoles) {
  const std::string text = absl::StrCat(
      "# muonmesh tokens\n"
      "\n"
      "viewer    viewer-token-0123456789\n"
      "  submitter\tsubmitter-token-0123456789  \n"
      "worker sha256:", absl::AsciiStrToUpper(absl::BytesToHexString(Sha256("worker-token-0123456789"))),
      "\n"
      "admin admin-token-0123456789\n");
  absl::StatusOr<TokenTable> table = TokenTable::Parse(text, "tokens");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->size(), 4u);
  EXPECT_EQ(table->Find("viewer-token-0123456789"), Role::kViewer);
  EXPECT_EQ(table->Find("submitter-token-0123456789"), Role::kSubmitter);
  EXPECT_EQ(table->Find("worker-token-0123456789"), Role::kWorker);
  EXPECT_EQ(table->Find("admin-token-0123456789"), Role::kAdmin);
  EXPECT_EQ(table->Find("viewer-token-012345678"), std::nullopt);
  EXPECT_EQ(table->Find(""), std::nullopt);
  EXPECT_EQ(table->Summary(), "viewer 1, submitter 1, worker 1, admin 1");
}

TEST(TokenTableTest, BadFilesNameTheLineAndNeverTheToken) {
  const std::string secret = "a-secret-token-never-to-be-printed";
  const std::map<std::string, std::string> cases = {
      {"viewer\n", "tokens:1: expected 'ROLE TOKEN'"},
      {"viewer " + secret + " extra\n", "tokens:1: expected 'ROLE TOKEN'"},
      {"# x\nroot " + secret + "\n", "tokens:2: unknown role"},
      {"viewer short\n", "tokens:1: a token must have 16"},
      {"viewer sha256:1234\n", "tokens:1: after 'sha256:' come the 64 hex digits"},
      {"viewer " + secret + "\nadmin " + secret + "\n", "tokens:2: the same token as line 1"},
      {"# nothing\n\n", "tokens: holds no token"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    absl::StatusOr<TokenTable> table = TokenTable::Parse(text, "tokens");
    ASSERT_FALSE(table.ok());
    EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(table.status().message(), HasSubstr(expected));
    EXPECT_THAT(table.status().message(), Not(HasSubstr(secret)));
  }
}

// A tokens file edited while the coordinator runs: a token added there is
// taken, one removed is refused, and a version that does not load keeps the
// tokens in force (saying so once) until a good one replaces it.
TEST(TokenFileTest, ChangesOnDiskTakeEffectAndABadVersionKeepsTheOld) {
  const std::string path = ::testing::TempDir() + "/token_file_test.tokens";
  const auto write = [&](const std::string& text, int generation) {
    std::ofstream(path, std::ios::trunc) << text;
    // A distinct modification time per version, however fast this runs.
    std::filesystem::last_write_time(
        path, std::filesystem::file_time_type::clock::now() + std::chrono::seconds(generation));
  };
  constexpr char kA[] = "first-token-0123456789";
  constexpr char kB[] = "second-token-0123456789";
  write(absl::StrCat("viewer ", kA, "\n"), 1);
  std::vector<std::string> lines;
  absl::StatusOr<std::shared_ptr<TokenFile>> file = TokenFile::Load(
      path, absl::ZeroDuration(), [&](const std::string& line) { lines.push_back(line); });
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->Current()->Find(kA), Role::kViewer);
  EXPECT_EQ((*file)->Current()->Find(kB), std::nullopt);

  write(absl::StrCat("admin ", kB, "\n"), 2);
  EXPECT_EQ((*file)->Current()->Find(kB), Role::kAdmin);
  EXPECT_EQ((*file)->Current()->Find(kA), std::nullopt);  // revoked
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("tokens: reloaded 1 from"));

  write("admin\n", 3);  // not "ROLE TOKEN"
  EXPECT_EQ((*file)->Current()->Find(kB), Role::kAdmin);
  EXPECT_EQ((*file)->Current()->Find(kB), Role::kAdmin);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[1], HasSubstr("cannot be used"));
  EXPECT_THAT(lines[1], HasSubstr("keeping the 1 tokens in force"));
  for (const std::string& line : lines) {
    EXPECT_THAT(line, Not(HasSubstr(kA)));
    EXPECT_THAT(line, Not(HasSubstr(kB)));
  }

  write(absl::StrCat("submitter ", kA, "\n"), 4);
  EXPECT_EQ((*file)->Current()->Find(kA), Role::kSubmitter);

  // Looked at no more than once per check_every.
  absl::StatusOr<std::shared_ptr<TokenFile>> slow = TokenFile::Load(path, absl::Hours(1));
  ASSERT_TRUE(slow.ok());
  write(absl::StrCat("viewer ", kB, "\n"), 5);
  EXPECT_EQ((*slow)->Current()->Find(kA), Role::kSubmitter);
}

template <typename Set>
ServerSecurityOptions Options(Set set) {
  ServerSecurityOptions o;
  set(o);
  return o;
}

TEST(ServerSecurityTest, NonLoopbackWithoutTlsAndTokensIsRefusedUnlessInsecure) {
  absl::StatusOr<std::unique_ptr<ServerSecurity>> s =
      ServerSecurity::Load(ServerSecurityOptions{}, "0.0.0.0:50051", nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("--listen 0.0.0.0:50051 is not a loopback address"));
  EXPECT_THAT(s.status().message(), HasSubstr("--insecure"));
  s = ServerSecurity::Load(Options([](ServerSecurityOptions& o) { o.insecure = true; }),
                           "0.0.0.0:50051", nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_FALSE((*s)->notes().empty());
  EXPECT_THAT((*s)->notes()[0], HasSubstr("WARNING: --insecure"));
  s = ServerSecurity::Load(ServerSecurityOptions{}, "127.0.0.1:0", nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT((*s)->notes()[0], HasSubstr("loopback only"));
  EXPECT_FALSE((*s)->tls());
}

TEST(ServerSecurityTest, CombinationsThatCannotWorkAreRefused) {
  const std::vector<std::pair<std::string, ServerSecurityOptions>> cases = {
      {"give both --tls-cert and --tls-key",
       Options([](ServerSecurityOptions& o) { o.tls_cert = "c.pem"; })},
      {"give both --tls-cert and --tls-key",
       Options([](ServerSecurityOptions& o) { o.tls_key = "k.pem"; })},
      {"--tls-ca (client certificates) needs --tls-cert",
       Options([](ServerSecurityOptions& o) { o.tls_ca = "ca.pem"; })},
      {"--tokens-file needs --tls-cert",
       Options([](ServerSecurityOptions& o) { o.tokens_file = "tokens"; })},
  };
  for (const auto& [expected, options] : cases) {
    absl::StatusOr<std::unique_ptr<ServerSecurity>> s =
        ServerSecurity::Load(options, "127.0.0.1:0", nullptr);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << expected;
    EXPECT_THAT(s.status().message(), HasSubstr(expected));
  }
}

}  // namespace
}  // namespace muonmesh::auth
