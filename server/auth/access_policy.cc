#include "server/auth/access_policy.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muonmesh::auth {
namespace {

constexpr RoleSet kReaders = {Role::kViewer, Role::kSubmitter, Role::kAdmin};
constexpr RoleSet kSubmitters = {Role::kSubmitter, Role::kAdmin};
constexpr RoleSet kWorkers = {Role::kWorker, Role::kAdmin};
constexpr RoleSet kAnyone = {Role::kViewer, Role::kSubmitter, Role::kWorker, Role::kAdmin};
constexpr RoleSet kAdmins = {Role::kAdmin};

constexpr MethodRule Open() { return {.open = true, .roles = {}, .needs_client_certificate = false}; }
constexpr MethodRule Roles(RoleSet roles) {
  return {.open = false, .roles = roles, .needs_client_certificate = false};
}
// Worker traffic: the roles, and a client certificate when there is a CA.
constexpr MethodRule Workers(RoleSet roles) {
  return {.open = false, .roles = roles, .needs_client_certificate = true};
}

struct Entry {
  absl::string_view method;  // a full path, or a "/service/" prefix
  MethodRule rule;
};

// Every RPC of the muonmesh services by its full name: a new RPC is
// admin-only until it is placed here (access_policy_test walks the
// services' descriptors and fails on any RPC left out). Prefixes only for
// gRPC's own services.
constexpr Entry kRules[] = {
    {"/grpc.health.v1.Health/", Open()},
    {"/grpc.reflection.v1alpha.ServerReflection/", Roles(kAnyone)},
    {"/muonmesh.v1.Planner/ValidateConfig", Roles(kReaders)},
    {"/muonmesh.v1.Planner/PlanLayout", Roles(kReaders)},
    {"/muonmesh.v1.Jobs/GetJob", Roles(kReaders)},
    {"/muonmesh.v1.Jobs/ListJobs", Roles(kReaders)},
    {"/muonmesh.v1.Jobs/WatchJob", Roles(kReaders)},
    {"/muonmesh.v1.Jobs/GetJobMetrics", Roles(kReaders)},
    {"/muonmesh.v1.Jobs/SubmitJob", Roles(kSubmitters)},
    {"/muonmesh.v1.Jobs/CancelJob", Roles(kSubmitters)},
    {"/muonmesh.v1.Jobs/DeleteJob", Roles(kSubmitters)},
    {"/muonmesh.v1.Jobs/PruneJobs", Roles(kAdmins)},
    {"/muonmesh.v1.Jobs/ParseJobFile", Roles(kReaders)},
    {"/muonmesh.v1.Fleet/ListWorkers", Roles(kAnyone)},
    {"/muonmesh.v1.Fleet/DrainWorker", Roles(kAdmins)},
    {"/muonmesh.v1.Fleet/RemoveWorker", Roles(kAdmins)},
    {"/muonmesh.v1.Fleet/Register", Workers(kWorkers)},
    {"/muonmesh.v1.Fleet/Heartbeat", Workers(kWorkers)},
    {"/muonmesh.v1.Fleet/Assignments", Workers(kWorkers)},
    {"/muonmesh.v1.Fleet/ReportStep", Workers(kWorkers)},
    {"/muonmesh.v1.Fleet/ReportAttempt", Workers(kWorkers)},
    {"/muonmesh.v1.Store/Set", Workers(kWorkers)},
    {"/muonmesh.v1.Store/Get", Workers(kWorkers)},
    {"/muonmesh.v1.Store/Wait", Workers(kWorkers)},
    {"/muonmesh.v1.Store/Add", Workers(kWorkers)},
};

const Entry* FindEntry(absl::string_view method) {
  // Exact names first, then service prefixes.
  for (const Entry& e : kRules) {
    if (e.method == method) return &e;
  }
  for (const Entry& e : kRules) {
    if (absl::EndsWith(e.method, "/") && absl::StartsWith(method, e.method) &&
        method.size() > e.method.size() &&
        method.find('/', e.method.size()) == absl::string_view::npos) {
      return &e;
    }
  }
  return nullptr;
}

}  // namespace

MethodRule RuleFor(absl::string_view method) {
  const Entry* e = FindEntry(method);
  return e != nullptr ? e->rule : Roles(kAdmins);
}

bool IsPlaced(absl::string_view method) { return FindEntry(method) != nullptr; }

std::string DescribeRoles(RoleSet roles) {
  std::vector<absl::string_view> names;
  for (const Role r : kAllRoles) {
    if (roles.Has(r)) names.push_back(RoleName(r));
  }
  if (names.empty()) return "no role";
  if (names.size() == 1) return std::string(names[0]);
  return absl::StrCat(absl::StrJoin(names.begin(), names.end() - 1, ", "), " or ", names.back());
}

absl::Status Authorize(absl::string_view method, const Caller& caller,
                       const AccessPolicyOptions& options) {
  const MethodRule rule = RuleFor(method);
  if (rule.open) return absl::OkStatus();
  if (options.tokens) {
    if (!caller.token_given) {
      return absl::UnauthenticatedError(absl::StrCat(
          method, " needs a bearer token (role ", DescribeRoles(rule.roles),
          "); muonmeshctl and muonmesh-worker read it from --token-file, MUONMESH_TOKEN_FILE or "
          "MUONMESH_TOKEN"));
    }
    if (!caller.role.has_value()) {
      return absl::UnauthenticatedError(absl::StrCat(
          "the bearer token sent with ", method,
          " is not one of the coordinator's tokens (or the authorization header is not "
          "'Bearer TOKEN')"));
    }
    if (!rule.roles.Has(*caller.role)) {
      return absl::PermissionDeniedError(absl::StrCat("role ", RoleName(*caller.role),
                                                      " may not call ", method, " (it needs ",
                                                      DescribeRoles(rule.roles), ")"));
    }
  }
  if (options.client_ca && rule.needs_client_certificate && !caller.client_certificate) {
    return absl::UnauthenticatedError(absl::StrCat(
        method,
        " needs a client certificate signed by the coordinator's CA (mutual TLS: give the "
        "worker --tls-cert and --tls-key); this connection presented none"));
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::auth
