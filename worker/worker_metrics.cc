#include "worker/worker_metrics.h"

#include <exception>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/step_log.h"
#include "proto/http/metrics_http.h"

namespace muonmesh::worker {
namespace {

// 1 ms to ~65 s, doubling: steps of small tests and of large models.
prometheus::Histogram::BucketBoundaries DurationBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 0.001; v < 100; v *= 2) b.push_back(v);
  return b;
}

// The recipe's and Muon health's gauges (WorkerMetrics::health_, in order).
enum HealthGauge {
  kMaxAttnLogit,
  kQkClip,
  kMuonMatrices,
  kMuonPlannedMatrices,
  kMuonElements,
  kMuonPlannedElements,
  kMuonUpdateRms,
  kMuonOrthoError,
  kExpertLoad,
  kExpertTokensDropped,
};
// The families of HealthGauge, in its order.
std::vector<prometheus::Family<prometheus::Gauge>*> HealthFamilies(prometheus::Registry& r) {
  return {
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_max_attn_logit")
           .Help("Largest pre-softmax attention logit of any head of each layer over the "
                 "last step's global batch (before QK-clip)")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_qk_clip")
           .Help("The job's optimizer.muon.qk_clip (tau), when it clips")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_muon_matrices")
           .Help("Muon matrices (blocks, experts) the last step updated")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_muon_planned_matrices")
           .Help("Muon matrices the job's plan holds")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_muon_elements")
           .Help("Elements Muon updated in the last step, each once")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_muon_planned_elements")
           .Help("Elements of the job's Muon matrices")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_muon_update_rms")
           .Help("Root mean square of the last step's Muon update")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_muon_ortho_error")
           .Help("||O O^T - I||_F / sqrt(min(rows, cols)) of the orthogonalized matrices at "
                 "the last health step (optimizer.muon.health_every): stat=max or median")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_expert_load")
           .Help("Tokens of the last step's global batch routed to a mixture-of-experts "
                 "layer's least (stat=min) or most (stat=max) loaded expert, over the mean "
                 "per expert")
           .Register(r),
      &prometheus::BuildGauge()
           .Name("muonmesh_worker_expert_tokens_dropped")
           .Help("Tokens a mixture-of-experts layer dropped in the last step (0: no capacity "
                 "limit)")
           .Register(r),
  };
}

}  // namespace

WorkerMetrics::WorkerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      step_duration_(prometheus::BuildHistogram()
                         .Name("muonmesh_worker_step_duration_seconds")
                         .Help("Wall time of each phase of a training step on this worker; "
                               "phase=\"step\" is the whole step")
                         .Register(*registry_)),
      steps_(prometheus::BuildCounter()
                 .Name("muonmesh_worker_steps_total")
                 .Help("Training steps this worker finished")
                 .Register(*registry_)),
      loss_(prometheus::BuildGauge()
                .Name("muonmesh_worker_loss")
                .Help("Global-batch loss of the last step this worker finished")
                .Register(*registry_)),
      val_loss_(prometheus::BuildGauge()
                    .Name("muonmesh_worker_val_loss")
                    .Help("Mean validation loss of the last evaluated step of this worker's job "
                          "(language models: training.eval_every and the last step)")
                    .Register(*registry_)),
      grad_norm_(prometheus::BuildGauge()
                     .Name("muonmesh_worker_grad_norm")
                     .Help("Global gradient norm of the last step this worker finished, before "
                           "clipping (every parameter, dense and expert, each element once)")
                     .Register(*registry_)),
      lr_scale_(prometheus::BuildGauge()
                    .Name("muonmesh_worker_lr_scale")
                    .Help("Learning-rate multiplier m(s) of the last step this worker finished "
                          "(training.lr_schedule; 1 without one)")
                    .Register(*registry_)),
      collective_bytes_(prometheus::BuildCounter()
                            .Name("muonmesh_worker_collective_bytes_total")
                            .Help("Bytes this worker sent, per collective of the plan")
                            .Register(*registry_)),
      ns_flops_(prometheus::BuildCounter()
                    .Name("muonmesh_worker_newton_schulz_flops_total")
                    .Help("Newton-Schulz floating-point operations this worker ran")
                    .Register(*registry_)),
      optimizer_seconds_(
          prometheus::BuildCounter()
              .Name("muonmesh_worker_optimizer_seconds_total")
              .Help("Time of the optimizer phase of this worker's steps: its phase timers "
                    "summed (adamw, muon_prepare, muon_gather, newton_schulz, muon_scatter, "
                    "muon_apply, param_allgather_after_step)")
              .Register(*registry_)),
      exchange_wait_(
          prometheus::BuildCounter()
              .Name("muonmesh_worker_muon_exchange_wait_seconds_total")
              .Help("Time the Muon rounds of this worker's steps spent in their exchange "
                    "calls, waiting for peers included")
              .Register(*registry_)),
      busy_(prometheus::BuildGauge()
                .Name("muonmesh_worker_busy")
                .Help("1 while this worker runs a rank of a job, else 0")
                .Register(*registry_)
                .Add({})),
      attempts_(prometheus::BuildCounter()
                    .Name("muonmesh_worker_attempts_total")
                    .Help("Ranks this worker ran to their end, by outcome")
                    .Register(*registry_)) {
  health_ = HealthFamilies(*registry_);
  http::RegisterBuildInfo(*registry_, "worker");
}

absl::StatusOr<std::unique_ptr<WorkerMetrics>> WorkerMetrics::Serve(const std::string& listen) {
  auto metrics = std::make_unique<WorkerMetrics>();
  MUONMESH_ASSIGN_OR_RETURN(metrics->http_, http::MetricsHttp::Serve(listen));
  metrics->http_->exposer().RegisterCollectable(metrics->registry_);
  return metrics;
}

void WorkerMetrics::ExportCertificateExpiry(std::map<std::string, std::string> files) {
  if (http_ == nullptr || certificates_ != nullptr) return;
  certificates_ = std::make_shared<credentials::CertificateExpiry>(std::move(files));
  http_->exposer().RegisterCollectable(certificates_);
}

void WorkerMetrics::OnHealth(const std::string& job, const StepReport& r, double qk_clip,
                             JobSeries& series) {
  auto set = [&](HealthGauge which, prometheus::Labels labels, double value) {
    labels["job_id"] = job;
    prometheus::Gauge& g = health_[which]->Add(labels);
    g.Set(value);
    series.gauges.insert({health_[which], &g});
  };
  for (size_t l = 0; l < r.max_attn_logit.size(); ++l) {
    set(kMaxAttnLogit, {{"layer", std::to_string(l)}}, r.max_attn_logit[l]);
  }
  if (qk_clip > 0) set(kQkClip, {}, qk_clip);
  for (const ExpertLoad& e : r.expert_load) {
    const std::string layer = std::to_string(e.layer);
    set(kExpertLoad, {{"layer", layer}, {"stat", "min"}}, e.min_over_mean);
    set(kExpertLoad, {{"layer", layer}, {"stat", "max"}}, e.max_over_mean);
    set(kExpertTokensDropped, {{"layer", layer}}, static_cast<double>(e.dropped));
  }
  const MuonHealth& h = r.muon;
  if (h.planned_matrices == 0) return;  // no Muon in this job
  set(kMuonMatrices, {}, static_cast<double>(h.matrices));
  set(kMuonPlannedMatrices, {}, static_cast<double>(h.planned_matrices));
  set(kMuonElements, {}, static_cast<double>(h.elements));
  set(kMuonPlannedElements, {}, static_cast<double>(h.planned_elements));
  set(kMuonUpdateRms, {}, h.update_rms);
  if (h.ortho_error_max.has_value()) set(kMuonOrthoError, {{"stat", "max"}}, *h.ortho_error_max);
  if (h.ortho_error_median.has_value()) {
    set(kMuonOrthoError, {{"stat", "median"}}, *h.ortho_error_median);
  }
}

void WorkerMetrics::OnStep(const std::string& job, const StepReport& r, absl::Duration step_time,
                           double qk_clip) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = DurationBuckets();
  std::vector<std::pair<const char*, absl::Duration>> phases = NamedPhases(r.times);
  phases.insert(phases.begin(), {"step", step_time});
  absl::MutexLock lock(&mu_);
  JobSeries& series = series_[job];
  for (const auto& [phase, d] : phases) {
    prometheus::Histogram& h = step_duration_.Add({{"job_id", job}, {"phase", phase}}, kBuckets);
    h.Observe(absl::ToDoubleSeconds(d));
    series.histograms.insert(&h);
  }
  prometheus::Counter& steps = steps_.Add({{"job_id", job}});
  steps.Increment();
  prometheus::Gauge& loss = loss_.Add({{"job_id", job}});
  loss.Set(r.loss);
  prometheus::Counter& flops = ns_flops_.Add({{"job_id", job}});
  flops.Increment(r.ns_flops);
  series.steps = &steps;
  series.loss = &loss;
  prometheus::Gauge& grad_norm = grad_norm_.Add({{"job_id", job}});
  grad_norm.Set(r.grad_norm);
  series.grad_norm = &grad_norm;
  prometheus::Gauge& lr_scale = lr_scale_.Add({{"job_id", job}});
  lr_scale.Set(r.lr_scale);
  series.lr_scale = &lr_scale;
  if (r.val_loss.has_value()) {
    prometheus::Gauge& val_loss = val_loss_.Add({{"job_id", job}});
    val_loss.Set(*r.val_loss);
    series.val_loss = &val_loss;
  }
  series.flops = &flops;
  const absl::Duration optimizer = OptimizerTime(r.times);
  prometheus::Counter& optimizer_seconds = optimizer_seconds_.Add({{"job_id", job}});
  optimizer_seconds.Increment(absl::ToDoubleSeconds(optimizer));
  series.optimizer = &optimizer_seconds;
  absl::Duration wait;
  for (const MuonRound& round : r.muon_rounds) wait += round.wait;
  prometheus::Counter& exchange_wait = exchange_wait_.Add({{"job_id", job}});
  exchange_wait.Increment(absl::ToDoubleSeconds(wait));
  series.exchange_wait = &exchange_wait;
  for (const auto& [name, bytes] : r.bytes_sent) {
    prometheus::Counter& c = collective_bytes_.Add({{"job_id", job}, {"collective", name}});
    c.Increment(static_cast<double>(bytes));
    series.bytes.insert(&c);
  }
  OnHealth(job, r, qk_clip, series);
}

void WorkerMetrics::SetBusy(bool busy) { busy_.Set(busy ? 1 : 0); }

void WorkerMetrics::OnAttemptEnd(const std::string& job, const std::string& outcome) {
  attempts_.Add({{"outcome", outcome}}).Increment();
  absl::MutexLock lock(&mu_);
  auto it = series_.find(job);
  if (it == series_.end()) return;
  JobSeries& s = it->second;
  for (prometheus::Histogram* h : s.histograms) step_duration_.Remove(h);
  for (prometheus::Counter* c : s.bytes) collective_bytes_.Remove(c);
  if (s.steps != nullptr) steps_.Remove(s.steps);
  if (s.loss != nullptr) loss_.Remove(s.loss);
  if (s.val_loss != nullptr) val_loss_.Remove(s.val_loss);
  if (s.grad_norm != nullptr) grad_norm_.Remove(s.grad_norm);
  if (s.lr_scale != nullptr) lr_scale_.Remove(s.lr_scale);
  if (s.flops != nullptr) ns_flops_.Remove(s.flops);
  if (s.optimizer != nullptr) optimizer_seconds_.Remove(s.optimizer);
  if (s.exchange_wait != nullptr) exchange_wait_.Remove(s.exchange_wait);
  for (const auto& [family, gauge] : s.gauges) family->Remove(gauge);
  series_.erase(it);
}

int WorkerMetrics::port() const { return http_ == nullptr ? 0 : http_->port(); }

}  // namespace muonmesh::worker
