#include "server/control/control_plane.h"

#include <malloc.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/base/status_macros.h"

namespace muonmesh::coordinator {

absl::StatusOr<std::unique_ptr<ControlPlane>> ControlPlane::Start(
    const ControlPlaneOptions& options) {
  if (options.data_dir.empty()) return absl::InvalidArgumentError("--data-dir: required");
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec || !std::filesystem::is_directory(options.data_dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-dir ", options.data_dir, ": not a folder we can create or use"));
  }
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<DataDirLock> lock,
                            DataDirLock::Acquire(options.data_dir));
  MUONMESH_ASSIGN_OR_RETURN(
      std::unique_ptr<JobStore> store,
      JobStore::Open((std::filesystem::path(options.data_dir) / "state.db").string()));
  store->SetLimits({.unfinished = options.max_unfinished_jobs,
                    .unfinished_per_client = options.max_unfinished_jobs_per_client});
  std::unique_ptr<ControlPlane> plane(new ControlPlane(options, std::move(lock), std::move(store)));
  plane->fleet_.ForgetLostAfter(options.forget_lost_after);
  plane->fleet_.QuarantineFor(options.quarantine);
  if (!options.metrics_listen.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(plane->http_, http::MetricsHttp::Serve(options.metrics_listen));
    plane->http_->exposer().RegisterCollectable(plane->metrics_);
    plane->http_->exposer().RegisterCollectable(plane->metrics_->registry());
    if (!options.certificate_files.empty()) {
      plane->certificates_ = std::make_shared<credentials::CertificateExpiry>(options.certificate_files);
      plane->http_->exposer().RegisterCollectable(plane->certificates_);
    }
    ControlPlane* p = plane.get();
    plane->http_->SetChecks([p] { return p->manager_.Responsive(absl::Seconds(5)); },
                            [p] { return p->Ready(); });
  }
  plane->manager_.Recover();
  plane->lease_thread_ = std::thread(&ControlPlane::ExpireLeases, plane.get());
  return plane;
}

ControlPlane::ControlPlane(const ControlPlaneOptions& options, std::unique_ptr<DataDirLock> lock,
                           std::unique_ptr<JobStore> store)
    : lock_(std::move(lock)),
      store_(std::move(store)),
      fleet_(&clock_, options.lease_ttl, options.heartbeat_interval),
      metrics_(std::make_shared<CoordinatorMetrics>(store_.get(), &fleet_)),
      manager_(store_.get(), &fleet_, &rendezvous_, &clock_,
               JobManagerOptions{
                   options.collective_timeout,
                   [m = metrics_.get()](const std::string& job, double s) { m->OnStep(job, s); },
                   [m = metrics_.get()](const std::string& job) { m->OnRefusedStep(job); },
                   [m = metrics_.get()](const std::string& job, double flops) {
                     m->OnAttemptPlanned(job, flops);
                   },
                   [m = metrics_.get()](const std::string& job) { m->OnAttemptDone(job); },
                   [m = metrics_.get()](const std::string&, double s) { m->OnRecovered(s); },
                   // A worker comes back within its lease, as it must to
                   // keep a job when this process is alive (and within 10 s
                   // whatever the lease: workers retry every second).
                   options.adopt_grace > absl::ZeroDuration()
                       ? options.adopt_grace
                       : std::max(options.lease_ttl, absl::Seconds(10)),
                   options.partition_grace, options.allowed_dirs, options.max_recorded_steps,
                   /*plan=*/nullptr, options.log}),
      jobs_service_(&manager_, store_.get(), options.max_watches_per_client),
      fleet_service_(&fleet_, &manager_,
                     {.worker_ids_from_certificates = options.worker_ids_from_certificates}),
      store_service_(&rendezvous_,
                     [this](const std::string& job_id, int32_t attempt) {
                       return manager_.AttemptRuns(job_id, attempt);
                     }),
      retain_finished_(options.retain_finished) {}

ControlPlane::~ControlPlane() {
  if (http_ != nullptr) http_->ClearChecks();  // they read what goes below
  Shutdown();
}

std::vector<grpc::Service*> ControlPlane::services() {
  return {&jobs_service_, &fleet_service_, &store_service_};
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
ControlPlane::interceptor_factories() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> out;
  out.push_back(metrics_->InterceptorFactory());
  return out;
}

absl::Status ControlPlane::Ready() {
  if (!serving_) return absl::UnavailableError("not serving gRPC (starting or stopping)");
  MUONMESH_RETURN_IF_ERROR(manager_.state_error(), "a state write failed");
  return store_->Ping();
}

int ControlPlane::metrics_port() const { return http_ == nullptr ? 0 : http_->port(); }

void ControlPlane::ExpireLeases() {
  while (!stopping_.load()) {
    absl::SleepFor(absl::Milliseconds(200));
    std::vector<Fleet::Lost> lost = fleet_.Expire();
    if (!lost.empty()) manager_.OnWorkersLost(lost);
    manager_.CheckAdoptions();
    manager_.CheckElastic();
    ReportStateError();
    if (clock_.Now() >= next_prune_) {
      next_prune_ = clock_.Now() + absl::Minutes(1);
      if (retain_finished_ > absl::ZeroDuration()) {
        (void)manager_.Prune(absl::ToUnixMillis(clock_.Now() - retain_finished_));
      }
      // The memory of bursts (a flood of calls, an attempt's plans) goes
      // back to the system: glibc keeps freed pages of its per-thread heaps
      // otherwise, and the process's size would be its worst minute's.
      malloc_trim(0);
    }
  }
}

void ControlPlane::OnStateError(std::function<void(const absl::Status&)> listener) {
  absl::MutexLock lock(&listener_mu_);
  state_error_listener_ = std::move(listener);
}

void ControlPlane::ReportStateError() {
  if (state_error_reported_) return;
  const absl::Status error = manager_.state_error();
  if (error.ok()) return;
  absl::MutexLock lock(&listener_mu_);
  if (!state_error_listener_) return;
  state_error_listener_(error);
  state_error_reported_ = true;
}

void ControlPlane::Shutdown() {
  if (stopping_.exchange(true)) return;
  fleet_.Shutdown();
  rendezvous_.Shutdown();
  manager_.Shutdown();
  if (lease_thread_.joinable()) lease_thread_.join();
}

}  // namespace muonmesh::coordinator
