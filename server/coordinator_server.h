#pragma once

// The coordinator's gRPC server: owns the services (the Planner and, with a
// data folder, the control plane's Jobs, Fleet and Store) and the
// grpc::Server that serves them, with the settings every coordinator shares
// (message size limits, grpc.health.v1, reflection, RPC metrics, and the
// port's protection: TLS, mutual TLS, bearer tokens, loopback only without
// them; server/auth/). muonmesh-coordinator is a flag-parsing
// shell around it; tests start it in-process on 127.0.0.1:0.
//
// Thread-safe: Shutdown() may be called from any thread (typically a signal
// thread) while another blocks in Wait().

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/auth/server_security.h"
#include "server/control/control_plane.h"
#include "server/planner_service.h"

namespace muonmesh::coordinator {

struct CoordinatorServerOptions {
  // HOST:PORT (IPv6 hosts in brackets). Port 0 picks a free port; port()
  // tells which.
  std::string listen = "127.0.0.1:50051";
  // Limits of the Planner's plan calls (concurrency, memory).
  PlannerServiceOptions planner;
  // The control plane (Jobs, Fleet, Store; durable state, leases, metrics).
  // Without a data_dir the coordinator serves the Planner only.
  coordinator::ControlPlaneOptions control;
  // TLS, mutual TLS and tokens (server/auth/server_security.h). Left empty:
  // plaintext, and `listen` must be a loopback address unless
  // security.insecure.
  auth::ServerSecurityOptions security;
  // Threads the server may run calls on at once (a grpc::ResourceQuota):
  // every open stream (a watch, a worker's assignments) holds one, so this
  // bounds what clients that open streams and never close them can take;
  // calls beyond it are refused with RESOURCE_EXHAUSTED rather than given a
  // new thread. At least 16.
  int max_rpc_threads = 1024;
  // Where refused calls are reported (method, code, role; never a token).
  // Null: nowhere.
  auth::LineSink log;
};

class CoordinatorServer {
 public:
  // Binds and starts serving. InvalidArgument if `listen` is not HOST:PORT
  // or a security file is unreadable, mismatched or missing its pair;
  // FailedPrecondition for a non-loopback `listen` without TLS and tokens
  // (unless security.insecure); Unavailable if the address cannot be bound
  // (in use, no such interface). The security files are checked before the
  // data folder is touched.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      const CoordinatorServerOptions& options);

  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;
  // Shuts down at once (no grace) if Shutdown() was not called.
  ~CoordinatorServer();

  int port() const { return port_; }
  // HOST:PORT with the bound port, e.g. "127.0.0.1:41234".
  const std::string& address() const { return address_; }
  // What to log at start about the port's protection (never a secret).
  const std::vector<std::string>& security_notes() const { return security_->notes(); }

  // Stops accepting calls, reports NOT_SERVING to health checks, stops the
  // plans being computed at once (PlannerService::CancelAll: they are pure
  // computations, and a big one would otherwise hold the server), and lets
  // other calls in flight finish for up to `grace` before cancelling them.
  // Returns when every call has ended. Idempotent.
  void Shutdown(absl::Duration grace);
  // Blocks until the server has shut down.
  void Wait();

  const PlannerService& planner() const { return planner_; }
  // The control plane, or null when it was not asked for.
  coordinator::ControlPlane* control() const { return control_.get(); }

 private:
  explicit CoordinatorServer(const PlannerServiceOptions& planner) : planner_(planner) {}

  PlannerService planner_;
  std::unique_ptr<auth::ServerSecurity> security_;
  std::unique_ptr<coordinator::ControlPlane> control_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
};

}  // namespace muonmesh::coordinator
