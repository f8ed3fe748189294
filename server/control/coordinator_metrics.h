#pragma once

// The coordinator's Prometheus metrics (docs/architecture.md §8), served at /metrics:
//   muonmesh_jobs{state}                         gauge, jobs in each state
//   muonmesh_workers{state, device}              gauge, registered workers
//   muonmesh_job_loss{job_id}                      gauge, last loss of each
//                                                running job
//   muonmesh_job_val_loss{job_id}                  gauge, newest validation
//                                                loss of each running job
//   muonmesh_job_steps_total                     counter, steps every rank of
//                                                a job finished
//   muonmesh_job_step_duration_seconds           histogram, a step's slowest
//                                                rank
//   muonmesh_rpc_duration_seconds{method, code}  histogram, every unary RPC
//                                                served (latency)
//   muonmesh_rpc_streams_total{method, code}     counter, streams served, by
//                                                how they ended (a stream's
//                                                life is not a latency)
//   muonmesh_job_planned_critical_path_flops{job_id} gauge, each running job's
//                                                planned critical path: the
//                                                Newton-Schulz FLOPs per step
//                                                of its plan's busiest rank
//   muonmesh_job_refused_steps_total{job_id}       counter, attempts of each job
//                                                that ended refusing a step
//                                                (a reduced gradient was NaN
//                                                or infinite)
//   muonmesh_job_step_seconds{job_id}              gauge, each running job's
//                                                median step time (its
//                                                recent steps' slowest rank)
//   muonmesh_job_seconds_since_progress{job_id}    gauge, seconds since each
//                                                running job last finished a
//                                                step (or its attempt began):
//                                                a stalled job grows it
//   muonmesh_tls_certificate_expiry_timestamp_seconds{certificate}  gauge,
//                                                "server", "client_ca": not
//                                                from here, but served beside
//                                                these (credentials::CertificateExpiry,
//                                                ControlPlane)
//   muonmesh_job_recovery_seconds                histogram, from a fault
//                                                (a rank failed, a worker
//                                                went silent: from its last
//                                                heartbeat, the coordinator
//                                                restarted) to the first step
//                                                every rank of the restarted
//                                                job finished, across every
//                                                attempt that failed between
// The gauges are computed when scraped, from the job store and the fleet
// (the planned critical path from what OnAttemptPlanned recorded, for the
// jobs the store has RUNNING);
// the RPC histogram is fed by a server interceptor (InterceptorFactory).
//
// Thread-safe.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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

  // A call ended with `code` after `seconds`: a unary one is timed, a
  // stream (`stream`) counted.
  void OnRpc(const std::string& method, int code, double seconds, bool stream = false);
  void OnStep(const std::string& job_id, double slowest_rank_seconds);
  // JobManagerOptions::on_refused_step.
  void OnRefusedStep(const std::string& job_id);
  // The plan of a job's new attempt, and the end of that attempt
  // (JobManagerOptions::on_attempt_planned, on_attempt_done).
  void OnAttemptPlanned(const std::string& job_id, double critical_path_flops);
  void OnAttemptDone(const std::string& job_id);
  // JobManagerOptions::on_recovered.
  void OnRecovered(double seconds);

  // What an Exposer registers: this and the registry of counters.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Times every RPC of the server it is installed in.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

 private:
  // The per-job gauges of the running jobs; the workers by state and
  // device.
  std::vector<prometheus::MetricFamily> RunningJobFamilies() const;
  prometheus::MetricFamily WorkerFamily() const;
  prometheus::MetricFamily QuarantineFamily() const;

  const JobStore& store_;
  const Fleet& fleet_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Family<prometheus::Counter>& rpc_streams_;
  prometheus::Counter& steps_;
  prometheus::Histogram& step_duration_;
  prometheus::Histogram& recovery_;
  mutable absl::Mutex mu_;
  prometheus::Family<prometheus::Counter>& refused_steps_;
  // job id -> its attempt's plan
  std::map<std::string, double> critical_path_ ABSL_GUARDED_BY(mu_);
  // job id -> when its running attempt began or last finished a step
  std::map<std::string, absl::Time> last_progress_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muonmesh::coordinator
