#pragma once

// The Jobs gRPC service (muonmesh.v1.Jobs): a thin edge over the JobManager
// and the JobStore. Invalid jobs are INVALID_ARGUMENT with every violation as
// google.rpc.BadRequest field violations.
//
// Keeps only the count of open watches per client (a client is the caller's
// address without its port: ClientOf); gRPC calls it from many threads.

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "muonmesh/v1/jobs.grpc.pb.h"
#include "server/control/job_manager.h"
#include "server/state/job_store.h"

namespace muonmesh::coordinator {

// The client a call comes from: its peer address without the port
// ("ipv4:10.0.0.5", "ipv6:[::1]"), or the peer as gRPC names it when it has
// no port (a Unix socket).
std::string ClientOf(const std::string& peer);

class JobsService final : public v1::Jobs::Service {
 public:
  // `max_watches_per_client`: WatchJob streams one client may hold open at
  // once (RESOURCE_EXHAUSTED beyond); 0: no bound.
  JobsService(JobManager* manager, JobStore* store, int64_t max_watches_per_client = 0)
      : manager_(*manager), store_(*store), max_watches_per_client_(max_watches_per_client) {}

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
  grpc::Status ParseJobFile(grpc::ServerContext* context, const v1::ParseJobFileRequest* request,
                            v1::ParseJobFileResponse* response) override;
  grpc::Status GetJobMetrics(grpc::ServerContext* context,
                             const v1::GetJobMetricsRequest* request,
                             v1::GetJobMetricsResponse* response) override;

 private:
  // Counts a watch of `client` in (false when it would pass the bound) and
  // out.
  bool EnterWatch(const std::string& client);
  void LeaveWatch(const std::string& client);

  JobManager& manager_;
  JobStore& store_;
  const int64_t max_watches_per_client_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, int64_t> watches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muonmesh::coordinator
