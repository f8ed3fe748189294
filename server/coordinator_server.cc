#include "server/coordinator_server.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace muonmesh::coordinator {

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorServerOptions& options) {
  const std::string& listen = options.listen;
  const std::size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", listen, "' is not HOST:PORT"));
  }

  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<auth::ServerSecurity> security,
                            auth::ServerSecurity::Load(options.security, listen, options.log));

  // Both are process-wide switches read when a server is built, so they must
  // be set before the builder exists. The health service needs at least one
  // sync service, which the Planner is.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<CoordinatorServer> self(new CoordinatorServer(options.planner));
  self->security_ = std::move(security);
  if (!options.control.data_dir.empty()) {
    coordinator::ControlPlaneOptions control_options = options.control;
    control_options.certificate_files = self->security_->certificate_files();
    if (!control_options.log) control_options.log = options.log;
    MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::ControlPlane> control,
                              coordinator::ControlPlane::Start(control_options));
    self->control_ = std::move(control);
  }
  grpc::ServerBuilder builder;
  // TLS (and the AuthProcessor that checks every call) or plaintext on
  // loopback (docs/architecture.md §7).
  builder.AddListeningPort(listen, self->security_->credentials(), &self->port_);
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  grpc::ResourceQuota quota("muonmesh-coordinator");
  quota.SetMaxThreads(std::max(16, options.max_rpc_threads));
  builder.SetResourceQuota(quota);
  builder.SetMaxSendMessageSize(kMaxResponseBytes);
  // gRPC sets SO_REUSEPORT by default on Linux, which lets a second
  // coordinator bind the same port and silently take half the calls.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  credentials::AddServerKeepalive(builder);
  builder.RegisterService(&self->planner_);
  if (self->control_ != nullptr) {
    for (grpc::Service* service : self->control_->services()) builder.RegisterService(service);
    builder.experimental().SetInterceptorCreators(self->control_->interceptor_factories());
  }
  self->server_ = builder.BuildAndStart();
  if (self->server_ == nullptr || self->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen, " (address in use or not local?)"));
  }
  self->address_ = absl::StrCat(listen.substr(0, colon), ":", self->port_);
  if (self->control_ != nullptr) self->control_->SetServing(true);
  // The empty service name ("the server") is SERVING by default; name ours
  // too so that probes can ask for the Planner specifically.
  if (grpc::HealthCheckServiceInterface* health = self->server_->GetHealthCheckService()) {
    health->SetServingStatus(v1::Planner::service_full_name(), true);
    if (self->control_ != nullptr) {
      health->SetServingStatus(v1::Jobs::service_full_name(), true);
      health->SetServingStatus(v1::Fleet::service_full_name(), true);
      health->SetServingStatus(v1::Store::service_full_name(), true);
      // A state it cannot write: it takes no new work until restarted, so
      // probes see the server, and its control services, NOT_SERVING (the
      // Planner, stateless, serves on).
      const auth::LineSink log = options.log;
      self->control_->OnStateError([health, log](const absl::Status& error) {
        for (const std::string& service :
             {std::string(), std::string(v1::Jobs::service_full_name()),
              std::string(v1::Fleet::service_full_name()),
              std::string(v1::Store::service_full_name())}) {
          health->SetServingStatus(service, false);
        }
        if (log) log(absl::StrCat("health: NOT_SERVING: ", error.message()));
      });
    }
  }
  return self;
}

CoordinatorServer::~CoordinatorServer() {
  if (server_ != nullptr) {
    Shutdown(absl::ZeroDuration());
    server_->Wait();
  }
}

void CoordinatorServer::Shutdown(absl::Duration grace) {
  // Health first, so that load balancers stop routing here while calls in
  // flight drain.
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->Shutdown();
  }
  if (control_ != nullptr) control_->SetServing(false);
  planner_.CancelAll();
  // Wakes the streams waiting for events and assignments, so that they end
  // now rather than at the grace deadline.
  if (control_ != nullptr) control_->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(grace));
}

void CoordinatorServer::Wait() { server_->Wait(); }

}  // namespace muonmesh::coordinator
