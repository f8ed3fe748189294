#include "server/control/fleet_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpc/grpc_security_constants.h"
#include "core/base/net_address.h"
#include "proto/rpc/rpc_status.h"

namespace muonmesh::coordinator {

absl::Status CheckWorkerNamedBy(const std::string& worker_id,
                                const std::vector<std::string>& names) {
  if (std::find(names.begin(), names.end(), worker_id) != names.end()) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "worker id '", worker_id, "' is not named by the client certificate it came with (",
      names.empty() ? std::string("no names") : absl::StrJoin(names, ", "),
      "): with --worker-ids-from-certificates a worker's --worker-id must be its "
      "certificate's subject CN or one of its subjectAltNames"));
}

absl::Status FleetService::CheckIdentity(const grpc::ServerContext* context,
                                         const std::string& worker_id) const {
  if (!options_.worker_ids_from_certificates) return absl::OkStatus();
  std::vector<std::string> names;
  if (const std::shared_ptr<const grpc::AuthContext> auth = context->auth_context()) {
    for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
      for (const grpc::string_ref& name : auth->FindPropertyValues(property)) {
        names.emplace_back(name.data(), name.size());
      }
    }
  }
  return CheckWorkerNamedBy(worker_id, names);
}

absl::Status CheckAdvertisedAddress(const std::string& worker_id, const std::string& advertised,
                                    const std::string& peer) {
  if (!IsLoopbackAddress(advertised)) return absl::OkStatus();
  const std::string from = PeerHost(peer);
  if (from.empty() || IsLoopbackAddress(from)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "info.address: worker ", worker_id.substr(0, 200), " advertises ", advertised.substr(0, 64),
      ", a loopback address, but reaches the coordinator from ", from,
      ", another host: its peers could not dial it. Start it with --address ", from,
      " (or without --address: a worker then advertises the address it reaches the "
      "coordinator from)"));
}

grpc::Status FleetService::Register(grpc::ServerContext* context,
                                    const v1::RegisterRequest* request,
                                    v1::RegisterResponse* response) {
  if (absl::Status s = CheckIdentity(context, request->info().worker_id()); !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  if (absl::Status s = CheckAdvertisedAddress(request->info().worker_id(),
                                              request->info().address(), context->peer());
      !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  const v1::RunningRank* running = request->has_running() ? &request->running() : nullptr;
  absl::StatusOr<Fleet::Lease> lease =
      fleet_.Register(request->info(), request->lease_id(), running);
  if (!lease.ok()) return rpc::ToGrpcStatus(lease.status());
  if (running == nullptr) manager_.OnRegisteredWithoutRank(request->info().worker_id());
  if (running != nullptr) {
    // Back with a rank (after this coordinator's restart, or a broken
    // stream): kept if its attempt still runs, else stopped.
    if (absl::Status kept = manager_.Rejoin(request->info().worker_id(), *running); !kept.ok()) {
      fleet_.Release(request->info().worker_id(), running->job_id());
      response->set_stop_running(std::string(kept.message()));
    }
  }
  response->set_lease_id(lease->lease_id);
  response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(lease->heartbeat_interval));
  response->set_lease_ttl_ms(absl::ToInt64Milliseconds(lease->ttl));
  manager_.Schedule();  // a new worker may complete a waiting gang
  return grpc::Status::OK;
}

grpc::Status FleetService::Heartbeat(grpc::ServerContext* context,
                                     const v1::HeartbeatRequest* request,
                                     v1::HeartbeatResponse* response) {
  if (absl::Status s = CheckIdentity(context, request->worker_id()); !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  if (request->draining()) {
    // The worker is stopping: drain it (once its lease is known good).
    if (absl::Status s = fleet_.CheckLease(request->worker_id(), request->lease_id()); !s.ok()) {
      return rpc::ToGrpcStatus(s);
    }
    if (absl::StatusOr<v1::Worker> w =
            manager_.Drain(request->worker_id(), "the worker is stopping (SIGTERM)");
        !w.ok()) {
      return rpc::ToGrpcStatus(w.status());
    }
  }
  bool leave = false;
  absl::Status s = fleet_.Heartbeat(request->worker_id(), request->lease_id(), &leave);
  response->set_leave(leave);
  if (s.ok()) {
    // Its peers' reachability, asked of it by the last answer; and whom to
    // check next (silent workers of its attempt).
    if (!request->peer_checks().empty()) {
      manager_.OnPeerChecks(request->worker_id(), request->peer_checks());
    }
    for (v1::PeerCheck& c : manager_.PeerChecksFor(request->worker_id())) {
      if (response->check_peers_size() == kMaxPeerChecks) break;
      *response->add_check_peers() = std::move(c);
    }
  }
  return rpc::ToGrpcStatus(s);
}

grpc::Status FleetService::DrainWorker(grpc::ServerContext*, const v1::DrainWorkerRequest* request,
                                       v1::Worker* response) {
  if (request->reason().size() > 1024) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "reason: at most 1024 bytes");
  }
  absl::StatusOr<v1::Worker> w = manager_.Drain(request->worker_id(), request->reason());
  if (!w.ok()) return rpc::ToGrpcStatus(w.status());
  *response = *std::move(w);
  return grpc::Status::OK;
}

grpc::Status FleetService::RemoveWorker(grpc::ServerContext*,
                                        const v1::RemoveWorkerRequest* request,
                                        v1::RemoveWorkerResponse*) {
  return rpc::ToGrpcStatus(fleet_.Remove(request->worker_id()));
}

grpc::Status FleetService::Assignments(grpc::ServerContext* context,
                                       const v1::AssignmentsRequest* request,
                                       grpc::ServerWriter<v1::Assignment>* writer) {
  if (absl::Status s = CheckIdentity(context, request->worker_id()); !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  while (true) {
    absl::StatusOr<std::optional<v1::Assignment>> next =
        fleet_.Next(request->worker_id(), request->lease_id(), absl::Seconds(1),
                    [context] { return context->IsCancelled(); });
    if (!next.ok()) return rpc::ToGrpcStatus(next.status());
    if (next->has_value() && !writer->Write(**next)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the worker left");
    }
  }
}

grpc::Status FleetService::ReportStep(grpc::ServerContext* context,
                                      const v1::ReportStepRequest* request,
                                      v1::ReportStepResponse* response) {
  if (absl::Status s = CheckIdentity(context, request->worker_id()); !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  if (absl::Status s = fleet_.Heartbeat(request->worker_id(), request->lease_id()); !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  bool stop = false;
  bool checkpoint = false;
  absl::Status s = manager_.OnStep(request->worker_id(), request->job_id(), request->record(),
                                   &stop, &checkpoint);
  response->set_stop(stop);
  response->set_checkpoint(checkpoint);
  return rpc::ToGrpcStatus(s);
}

grpc::Status FleetService::ReportAttempt(grpc::ServerContext* context,
                                         const v1::ReportAttemptRequest* request,
                                         v1::ReportAttemptResponse*) {
  if (absl::Status s = CheckIdentity(context, request->worker_id()); !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  if (absl::Status s = fleet_.CheckLease(request->worker_id(), request->lease_id()); !s.ok()) {
    // A stale worker's report still frees nothing: its rank was already
    // counted as lost.
    return rpc::ToGrpcStatus(s);
  }
  return rpc::ToGrpcStatus(manager_.OnAttemptEnd(request->worker_id(), *request));
}

grpc::Status FleetService::ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                                       v1::ListWorkersResponse* response) {
  for (v1::Worker& w : fleet_.List()) *response->add_workers() = std::move(w);
  return grpc::Status::OK;
}

}  // namespace muonmesh::coordinator
