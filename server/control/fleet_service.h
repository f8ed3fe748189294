#pragma once

// The Fleet gRPC service (muonmesh.v1.Fleet): the edge workers talk to.
// Every call but Register and ListWorkers carries the worker's lease; a
// stale one is FAILED_PRECONDITION and the worker registers again.
//
// Stateless over the Fleet and JobManager it is given.

#include "grpcpp/server_context.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "server/control/fleet.h"
#include "server/control/job_manager.h"

namespace muonmesh::coordinator {

class FleetService final : public v1::Fleet::Service {
 public:
  FleetService(Fleet* fleet, JobManager* manager) : fleet_(*fleet), manager_(*manager) {}

  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status Assignments(grpc::ServerContext* context, const v1::AssignmentsRequest* request,
                           grpc::ServerWriter<v1::Assignment>* writer) override;
  grpc::Status ReportStep(grpc::ServerContext* context, const v1::ReportStepRequest* request,
                          v1::ReportStepResponse* response) override;
  grpc::Status ReportAttempt(grpc::ServerContext* context,
                             const v1::ReportAttemptRequest* request,
                             v1::ReportAttemptResponse* response) override;
  grpc::Status ListWorkers(grpc::ServerContext* context, const v1::ListWorkersRequest* request,
                           v1::ListWorkersResponse* response) override;

 private:
  Fleet& fleet_;
  JobManager& manager_;
};

}  // namespace muonmesh::coordinator
