#pragma once

// The Jobs gRPC service (muonmesh.v1.Jobs): a thin edge over the JobManager
// and the JobStore. Invalid jobs are INVALID_ARGUMENT with every violation as
// google.rpc.BadRequest field violations.
//
// Stateless over what it is given; gRPC calls it from many threads.

#include "grpcpp/server_context.h"
#include "muonmesh/v1/jobs.grpc.pb.h"
#include "server/control/job_manager.h"
#include "server/state/job_store.h"

namespace muonmesh::coordinator {

class JobsService final : public v1::Jobs::Service {
 public:
  JobsService(JobManager* manager, JobStore* store) : manager_(*manager), store_(*store) {}

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::SubmitJobResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* response) override;
  grpc::Status DeleteJob(grpc::ServerContext* context, const v1::DeleteJobRequest* request,
                         v1::DeleteJobResponse* response) override;
  grpc::Status PruneJobs(grpc::ServerContext* context, const v1::PruneJobsRequest* request,
                         v1::PruneJobsResponse* response) override;
  grpc::Status GetJobMetrics(grpc::ServerContext* context,
                             const v1::GetJobMetricsRequest* request,
                             v1::GetJobMetricsResponse* response) override;

 private:
  JobManager& manager_;
  JobStore& store_;
};

}  // namespace muonmesh::coordinator
