#include "server/control/fleet_service.h"

#include "proto/rpc/rpc_status.h"

namespace muonmesh::coordinator {

grpc::Status FleetService::Register(grpc::ServerContext*, const v1::RegisterRequest* request,
                                    v1::RegisterResponse* response) {
  absl::StatusOr<Fleet::Lease> lease = fleet_.Register(request->info());
  if (!lease.ok()) return rpc::ToGrpcStatus(lease.status());
  response->set_lease_id(lease->lease_id);
  response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(lease->heartbeat_interval));
  response->set_lease_ttl_ms(absl::ToInt64Milliseconds(lease->ttl));
  manager_.Schedule();  // a new worker may complete a waiting gang
  return grpc::Status::OK;
}

grpc::Status FleetService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                                     v1::HeartbeatResponse*) {
  return rpc::ToGrpcStatus(fleet_.Heartbeat(request->worker_id(), request->lease_id()));
}

grpc::Status FleetService::Assignments(grpc::ServerContext* context,
                                       const v1::AssignmentsRequest* request,
                                       grpc::ServerWriter<v1::Assignment>* writer) {
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

grpc::Status FleetService::ReportStep(grpc::ServerContext*, const v1::ReportStepRequest* request,
                                      v1::ReportStepResponse* response) {
  if (absl::Status s = fleet_.Heartbeat(request->worker_id(), request->lease_id()); !s.ok()) {
    return rpc::ToGrpcStatus(s);
  }
  bool stop = false;
  absl::Status s = manager_.OnStep(request->worker_id(), request->job_id(), request->record(), &stop);
  response->set_stop(stop);
  return rpc::ToGrpcStatus(s);
}

grpc::Status FleetService::ReportAttempt(grpc::ServerContext*,
                                         const v1::ReportAttemptRequest* request,
                                         v1::ReportAttemptResponse*) {
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
