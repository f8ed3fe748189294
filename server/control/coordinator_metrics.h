#pragma once

// The coordinator's Prometheus metrics (DESIGN.md §8), served at /metrics:
//   muonmesh_jobs{state}                         gauge, jobs in each state
//   muonmesh_workers{state, device}              gauge, registered workers
//   muonmesh_job_loss{job}                       gauge, last loss of each
//                                                running job
//   muonmesh_job_steps_total                     counter, steps every rank of
//                                                a job finished
//   muonmesh_job_step_duration_seconds           histogram, a step's slowest
//                                                rank
//   muonmesh_rpc_duration_seconds{method, code}  histogram, every RPC served
// The gauges are computed when scraped, from the job store and the fleet;
// the RPC histogram is fed by a server interceptor (InterceptorFactory).
//
// Thread-safe.

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/support/server_interceptor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/control/fleet.h"
#include "server/state/job_store.h"

namespace muonmesh::coordinator {

class CoordinatorMetrics final : public prometheus::Collectable {
 public:
  // Not owned; must outlive the metrics.
  CoordinatorMetrics(const JobStore* store, const Fleet* fleet);

  // The state gauges (prometheus::Collectable).
  std::vector<prometheus::MetricFamily> Collect() const override;

  void OnRpc(const std::string& method, int code, double seconds);
  void OnStep(double slowest_rank_seconds);

  // What an Exposer registers: this and the registry of counters.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Times every RPC of the server it is installed in.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

 private:
  const JobStore& store_;
  const Fleet& fleet_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Counter& steps_;
  prometheus::Histogram& step_duration_;
};

}  // namespace muonmesh::coordinator
