#pragma once

// Who may call which method of the coordinator: the rule of every gRPC
// method, and the decision for one call from what its transport and
// metadata say about the caller. Pure (no gRPC): AuthProcessor feeds it.
//
//   grpc.health.v1.Health/*                  anyone (probes carry no token)
//   grpc.reflection.v1alpha.ServerReflection any role
//   muonmesh.v1.Planner/*                    viewer, submitter, admin
//   muonmesh.v1.Jobs/{Get,List,Watch}Job,
//     GetJobMetrics                          viewer, submitter, admin
//   muonmesh.v1.Jobs/{Submit,Cancel}Job      submitter, admin
//   muonmesh.v1.Fleet/ListWorkers            viewer, submitter, worker, admin
//   muonmesh.v1.Fleet/{Register,Heartbeat,Assignments,ReportStep,
//     ReportAttempt}                         worker, admin; client certificate
//   muonmesh.v1.Store/{Set,Get,Wait,Add}     worker, admin; client certificate
//   anything else                            admin
// muonmesh methods are placed one by one (never by service prefix), so a
// new RPC is admin-only until it is given its roles here.
// Roles apply when the coordinator has tokens; the client certificate
// (mutual TLS) when it has a CA to check them against.
//
// Free functions over constant tables; any thread may call them.

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/auth/types.h"

namespace muonmesh::auth {

struct MethodRule {
  // Reachable without a token (health checks).
  bool open = false;
  // The roles that may call it.
  RoleSet roles;
  // A verified client certificate is required as well (worker traffic).
  bool needs_client_certificate = false;
};

// The rule of `method`, a full gRPC path ("/muonmesh.v1.Jobs/SubmitJob").
// Unknown methods are admin-only.
MethodRule RuleFor(absl::string_view method);

// Whether `method` has a rule of its own (or its gRPC service's), rather
// than the admin-only fallback of methods nobody placed.
bool IsPlaced(absl::string_view method);

// What the coordinator checks.
struct AccessPolicyOptions {
  bool tokens = false;         // --tokens-file given
  bool client_ca = false;      // --tls-ca given (mutual TLS)
};

// What a call showed.
struct Caller {
  bool token_given = false;          // an authorization header was sent
  std::optional<Role> role;          // the token's role, when known
  bool client_certificate = false;   // a certificate verified against the CA
};

// OK when `caller` may call `method`. Otherwise Unauthenticated (no token, an
// unknown token, no client certificate where one is needed) or
// PermissionDenied (the role may not call the method), with a message that
// names the method, the role and what would be needed, never the token.
absl::Status Authorize(absl::string_view method, const Caller& caller,
                       const AccessPolicyOptions& options);

// "viewer, submitter or admin".
std::string DescribeRoles(RoleSet roles);

}  // namespace muonmesh::auth
