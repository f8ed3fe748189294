#pragma once

// The Fleet gRPC service (muonmesh.v1.Fleet): the edge workers talk to.
// Every call but Register and ListWorkers carries the worker's lease; a
// stale one is FAILED_PRECONDITION and the worker registers again. With
// worker_ids_from_certificates every call that names a worker must come
// over a client certificate that names it too (its subject CN or a
// subjectAltName), so that one worker's certificate cannot register, beat
// or report as another: PERMISSION_DENIED otherwise.
//
// Stateless over the Fleet and JobManager it is given.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "server/control/fleet.h"
#include "server/control/job_manager.h"

namespace muonmesh::coordinator {

struct FleetServiceOptions {
  bool worker_ids_from_certificates = false;
};

// OK when `names` (a client certificate's subject CN and subjectAltNames)
// hold `worker_id`; PERMISSION_DENIED naming both otherwise.
absl::Status CheckWorkerNamedBy(const std::string& worker_id,
                                const std::vector<std::string>& names);

// OK unless a worker advertises a loopback `advertised` address while it
// reaches the coordinator from a `peer` (gRPC's peer string) on another
// host: its peers would dial themselves and the gang would hang until the
// collective timeout. FAILED_PRECONDITION naming both addresses and the
// --address to give otherwise.
absl::Status CheckAdvertisedAddress(const std::string& worker_id, const std::string& advertised,
                                    const std::string& peer);

class FleetService final : public v1::Fleet::Service {
 public:
  FleetService(Fleet* fleet, JobManager* manager, FleetServiceOptions options = {})
      : fleet_(*fleet), manager_(*manager), options_(options) {}

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
  grpc::Status DrainWorker(grpc::ServerContext* context, const v1::DrainWorkerRequest* request,
                           v1::Worker* response) override;
  grpc::Status RemoveWorker(grpc::ServerContext* context, const v1::RemoveWorkerRequest* request,
                            v1::RemoveWorkerResponse* response) override;

 private:
  // OK unless worker_ids_from_certificates and the caller's certificate
  // does not name `worker_id` (CheckWorkerNamedBy).
  absl::Status CheckIdentity(const grpc::ServerContext* context,
                             const std::string& worker_id) const;

  Fleet& fleet_;
  JobManager& manager_;
  FleetServiceOptions options_;
};

}  // namespace muonmesh::coordinator
