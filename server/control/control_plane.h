#pragma once

// Everything the coordinator serves beyond the Planner: the durable job
// store, the fleet, the rendezvous store, the job manager, their gRPC
// services, and the thread that expires leases. coordinator::CoordinatorServer owns one
// and registers its services.
//
// Thread-safe; Shutdown() wakes every waiting stream and stops the lease
// thread.

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/impl/service_type.h"
#include "prometheus/exposer.h"
#include "proto/credentials/certificate_expiry.h"
#include "proto/http/metrics_http.h"
#include "server/control/coordinator_metrics.h"
#include "server/control/fleet.h"
#include "server/control/fleet_service.h"
#include "server/control/job_manager.h"
#include "server/control/jobs_service.h"
#include "server/control/rendezvous.h"
#include "server/control/store_service.h"
#include "server/state/data_dir_lock.h"
#include "server/state/job_store.h"

namespace muonmesh::coordinator {

struct ControlPlaneOptions {
  // Folder of the durable state (state.db); created if missing.
  std::string data_dir;
  // Lines for the operator's log (job state changes with their reasons,
  // lost workers); may be empty.
  std::function<void(const std::string& line)> log;
  absl::Duration lease_ttl = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  // After a restart, how long a running attempt waits for its workers to
  // come back before it fails over; zero: the lease TTL, at least 10 s.
  absl::Duration adopt_grace = absl::ZeroDuration();
  // How long a worker silent past its lease keeps its rank (JobManagerOptions).
  absl::Duration partition_grace = absl::Seconds(30);
  // How long a worker blamed for two failed attempts gets no new rank
  // (Fleet::Blame); zero: never quarantined.
  absl::Duration quarantine = kDefaultQuarantine;
  absl::Duration collective_timeout = absl::Seconds(60);
  // HOST:PORT for Prometheus metrics (/metrics); empty: none.
  std::string metrics_listen;
  // Resolved folders (job::ResolveAllowedDirs) the paths a submitted job
  // names must lie in (JobManagerOptions::allowed_dirs); empty: any.
  std::vector<std::string> allowed_dirs;
  // A worker's id must be named by its client certificate (its CN or a
  // subjectAltName): FleetService. Needs mutual TLS.
  bool worker_ids_from_certificates = false;
  // Finished jobs older than this (by their end) are removed with their
  // events and step records, checked every minute; zero: kept for ever.
  absl::Duration retain_finished = absl::Hours(24 * 30);
  // Bounds on what clients can make the coordinator keep (0: none): jobs
  // not finished, in all and per client (JobStore::Limits), open watches per
  // client (JobsService), steps recorded per job
  // (JobManagerOptions::max_recorded_steps).
  int64_t max_unfinished_jobs = 10000;
  int64_t max_unfinished_jobs_per_client = 1000;
  int64_t max_watches_per_client = 64;
  int64_t max_recorded_steps = 1'000'000;
  // A LOST worker is forgotten this long after its lease ran out
  // (Fleet::ForgetLostAfter); zero: kept until a full fleet needs room.
  absl::Duration forget_lost_after = absl::Hours(1);
  // The certificate files the gRPC port serves with, by name
  // (auth::ServerSecurity::certificate_files): their expiry, read at each
  // scrape, is muonmesh_tls_certificate_expiry_timestamp_seconds{certificate}.
  std::map<std::string, std::string> certificate_files;
};

class ControlPlane {
 public:
  // Locks data_dir (one coordinator per folder: FailedPrecondition naming
  // the other's pid), opens the state under it and recovers jobs a previous
  // life left running. InvalidArgument naming the folder or file when it
  // cannot.
  static absl::StatusOr<std::unique_ptr<ControlPlane>> Start(const ControlPlaneOptions& options);
  ~ControlPlane();

  // The services to register with the gRPC server.
  std::vector<grpc::Service*> services();
  // Interceptors to install in the server (RPC metrics).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
  interceptor_factories();
  // The metrics port (0 without --metrics-listen).
  int metrics_port() const;
  // Whether the gRPC server serves the control plane's services now: part
  // of /readyz (with the state database answering and no failed write).
  void SetServing(bool serving) { serving_ = serving; }
  void Shutdown();
  // `listener` is called once, from the lease thread, when the state first
  // fails to be written (JobManager::state_error; at once, on the next tick,
  // if it already has): the server then reports its control services
  // NOT_SERVING to health checks.
  void OnStateError(std::function<void(const absl::Status&)> listener);
  // Tests: the durable state, to make its writes fail.
  JobStore& job_store_for_test() { return *store_; }

 private:
  ControlPlane(const ControlPlaneOptions& options, std::unique_ptr<DataDirLock> lock,
               std::unique_ptr<JobStore> store);
  void ExpireLeases();
  // The lease thread's check for OnStateError.
  void ReportStateError();
  // /readyz (see SetServing).
  absl::Status Ready();

  // First member: taken before the store opens, released after it closes.
  std::unique_ptr<DataDirLock> lock_;
  SystemClock clock_;
  std::unique_ptr<JobStore> store_;
  Fleet fleet_;
  Rendezvous rendezvous_;
  std::shared_ptr<CoordinatorMetrics> metrics_;
  JobManager manager_;
  JobsService jobs_service_;
  FleetService fleet_service_;
  StoreService store_service_;
  std::unique_ptr<http::MetricsHttp> http_;  // /metrics, /healthz, /readyz
  std::shared_ptr<credentials::CertificateExpiry> certificates_;  // exported on http_
  std::atomic<bool> serving_{false};
  std::atomic<bool> stopping_{false};
  absl::Mutex listener_mu_;
  std::function<void(const absl::Status&)> state_error_listener_ ABSL_GUARDED_BY(listener_mu_);
  bool state_error_reported_ = false;  // lease thread only
  absl::Duration retain_finished_;
  absl::Time next_prune_ = absl::InfinitePast();  // lease thread only
  std::thread lease_thread_;
};

}  // namespace muonmesh::coordinator
