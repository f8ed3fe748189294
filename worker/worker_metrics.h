#pragma once

// The worker's Prometheus metrics (docs/architecture.md §8), served at /metrics by the
// daemon (--metrics-listen). Base units, _total counters, histograms for
// durations, low-cardinality labels (a phase, a collective, and the job the
// worker runs: one at a time, and a job's series are dropped when its rank
// ends, so a worker exports one job's series at most). The job's label is
// job_id, not job: Prometheus's own `job` (the scrape job) would take that
// name over (exported_job) unless every scrape honored labels:
//   muonmesh_worker_step_duration_seconds{job_id, phase}  histogram; phase
//                                                 "step" is the whole step
//   muonmesh_worker_steps_total{job_id}             counter
//   muonmesh_worker_loss{job_id}                    gauge, the last step's
//   muonmesh_worker_val_loss{job_id}                gauge, the last validation loss
//   muonmesh_worker_grad_norm{job_id}               gauge, the last step's global gradient
//                                                   norm before clipping
//   muonmesh_worker_lr_scale{job_id}                gauge, the last step's learning-rate
//                                                   multiplier (training.lr_schedule)
//   muonmesh_worker_collective_bytes_total{job_id, collective}  counter, bytes sent
//   muonmesh_worker_newton_schulz_flops_total{job_id} counter
//   muonmesh_worker_optimizer_seconds_total{job_id} counter, the optimizer
//                                                 phase's time (its phase
//                                                 timers summed: adamw, muon_*,
//                                                 newton_schulz,
//                                                 param_allgather_after_step)
//   muonmesh_worker_muon_exchange_wait_seconds_total{job_id}  counter, time the
//                                                 Muon rounds spent in their
//                                                 exchange calls (waiting for
//                                                 peers included)
//   muonmesh_worker_max_attn_logit{job_id, layer}   gauge, the last step's largest
//                                                   pre-softmax logit per layer
//   muonmesh_worker_qk_clip{job_id}                 gauge, optimizer.muon.qk_clip (set
//                                                   only when the job clips)
//   muonmesh_worker_muon_matrices{job_id}           gauge, Muon matrices the last step
//   muonmesh_worker_muon_planned_matrices{job_id}     updated, and what the plan holds
//   muonmesh_worker_muon_elements{job_id}           gauge, the same in elements
//   muonmesh_worker_muon_planned_elements{job_id}
//   muonmesh_worker_muon_update_rms{job_id}         gauge, RMS of the last Muon update
//   muonmesh_worker_muon_ortho_error{job_id, stat}  gauge, stat max | median of the last
//                                                   health step (docs/architecture.md,
//                                                   "Muon health")
//   muonmesh_worker_expert_load{job_id, layer, stat}  gauge, stat min | max: the
//                                                   last step's tokens routed to the
//                                                   layer's least or most loaded
//                                                   expert over the mean (layer: the
//                                                   model's, layers.N)
//   muonmesh_worker_expert_tokens_dropped{job_id, layer}  gauge, 0 (no capacity
//                                                   limit)
//   muonmesh_worker_busy                           gauge, 1 while a rank runs
//   muonmesh_worker_attempts_total{outcome}        counter
//   muonmesh_tls_certificate_expiry_timestamp_seconds{certificate}  gauge,
//                                                 the worker's "client"
//                                                 certificate and its "ca"
//                                                 (credentials::CertificateExpiry)
//
// Thread-safe (prometheus-cpp's metrics are).

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "proto/credentials/certificate_expiry.h"
#include "proto/http/metrics_http.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {

class WorkerMetrics {
 public:
  // Metrics without an endpoint (tests; a worker without --metrics-listen).
  WorkerMetrics();
  // Also serves them over HTTP on `listen` ("HOST:PORT"; port 0 picks one).
  // Unavailable naming the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<WorkerMetrics>> Serve(const std::string& listen);

  // `qk_clip`: the job's optimizer.muon.qk_clip (0: none).
  void OnStep(const std::string& job, const StepReport& report, absl::Duration step_time,
              double qk_clip = 0);
  void SetBusy(bool busy);
  // Exports the expiry of `files` (label value -> PEM file) on the
  // endpoint; nothing without one. Call once, before any scrape matters.
  void ExportCertificateExpiry(std::map<std::string, std::string> files);
  // "succeeded", "failed" or "stopped"; drops the job's series.
  void OnAttemptEnd(const std::string& job, const std::string& outcome);

  // The bound port (0 without an endpoint).
  int port() const;
  // The endpoint's /healthz and /readyz (nullptr without an endpoint).
  http::MetricsHttp* http() { return http_.get(); }
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>& step_duration_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Gauge>& loss_;
  prometheus::Family<prometheus::Gauge>& val_loss_;
  prometheus::Family<prometheus::Gauge>& grad_norm_;
  prometheus::Family<prometheus::Gauge>& lr_scale_;
  prometheus::Family<prometheus::Counter>& collective_bytes_;
  prometheus::Family<prometheus::Counter>& ns_flops_;
  prometheus::Family<prometheus::Counter>& optimizer_seconds_;
  prometheus::Family<prometheus::Counter>& exchange_wait_;
  // The recipe's and Muon health's gauges, in the order of kHealthGauges
  // (worker_metrics.cc).
  std::vector<prometheus::Family<prometheus::Gauge>*> health_;
  prometheus::Gauge& busy_;
  prometheus::Family<prometheus::Counter>& attempts_;
  // The series of each job, to drop when its rank ends.
  struct JobSeries {
    std::set<prometheus::Histogram*> histograms;
    std::set<prometheus::Counter*> bytes;
    prometheus::Counter* steps = nullptr;
    prometheus::Gauge* loss = nullptr;
    prometheus::Gauge* val_loss = nullptr;
    prometheus::Gauge* grad_norm = nullptr;
    prometheus::Gauge* lr_scale = nullptr;
    prometheus::Counter* flops = nullptr;
    prometheus::Counter* optimizer = nullptr;
    prometheus::Counter* exchange_wait = nullptr;
    std::set<std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>> gauges;
  };
  // OnStep's part for the recipe and Muon health.
  void OnHealth(const std::string& job, const StepReport& r, double qk_clip, JobSeries& series);
  absl::Mutex mu_;
  std::map<std::string, JobSeries> series_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<http::MetricsHttp> http_;
  std::shared_ptr<credentials::CertificateExpiry> certificates_;
};

}  // namespace muonmesh::worker
