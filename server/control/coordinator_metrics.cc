#include "server/control/coordinator_metrics.h"

#include <chrono>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/support/interceptor.h"
#include "muonmesh/v1/jobs.pb.h"
#include "proto/http/metrics_http.h"

namespace muonmesh::coordinator {
namespace {

prometheus::Histogram::BucketBoundaries Buckets(double from, double to) {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = from; v < to; v *= 2) b.push_back(v);
  return b;
}

std::string StateName(v1::JobState s) {
  std::string name = v1::JobState_Name(s);
  return name.substr(std::string("JOB_STATE_").size());
}

prometheus::ClientMetric GaugeValue(double v) {
  prometheus::ClientMetric m;
  m.gauge.value = v;
  return m;
}

// Times one RPC from its arrival to its status.
class RpcTimer final : public grpc::experimental::Interceptor {
 public:
  RpcTimer(CoordinatorMetrics* metrics, std::string method, bool stream)
      : metrics_(*metrics), method_(std::move(method)), stream_(stream),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      metrics_.OnRpc(method_, static_cast<int>(methods->GetSendStatus().error_code()), seconds,
                     stream_);
    }
    methods->Proceed();
  }

 private:
  CoordinatorMetrics& metrics_;
  std::string method_;
  bool stream_;
  std::chrono::steady_clock::time_point start_;
};

class RpcTimerFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcTimerFactory(CoordinatorMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcTimer(metrics_, info->method() != nullptr ? info->method() : "unknown",
                        info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY);
  }

 private:
  CoordinatorMetrics* metrics_;
};

const char* CodeName(int code) {
  static const char* const kNames[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  return code >= 0 && code < 17 ? kNames[code] : "UNKNOWN";
}

// A gauge of `family` for one job.
void AddJobGauge(prometheus::MetricFamily& family, const std::string& job_id, double value) {
  prometheus::ClientMetric m = GaugeValue(value);
  m.label = {{"job_id", job_id}};
  family.metric.push_back(std::move(m));
}

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(const JobStore* store, const Fleet* fleet)
    : store_(*store),
      fleet_(*fleet),
      registry_(std::make_shared<prometheus::Registry>()),
      rpc_duration_(prometheus::BuildHistogram()
                        .Name("muonmesh_rpc_duration_seconds")
                        .Help("Time the coordinator took to serve a unary RPC, by method and "
                              "status code (streams are counted apart)")
                        .Register(*registry_)),
      rpc_streams_(prometheus::BuildCounter()
                       .Name("muonmesh_rpc_streams_total")
                       .Help("Streaming RPCs the coordinator served (watches, assignments), by "
                             "method and the status code they ended with")
                       .Register(*registry_)),
      steps_(prometheus::BuildCounter()
                 .Name("muonmesh_job_steps_total")
                 .Help("Training steps finished by every rank of a job")
                 .Register(*registry_)
                 .Add({})),
      step_duration_(prometheus::BuildHistogram()
                         .Name("muonmesh_job_step_duration_seconds")
                         .Help("Wall time of a training step on its slowest rank")
                         .Register(*registry_)
                         .Add({}, Buckets(0.001, 100))),
      recovery_(prometheus::BuildHistogram()
                    .Name("muonmesh_job_recovery_seconds")
                    .Help("Time from a fault (a rank failed or lost its lease, the coordinator "
                          "restarted) to the first step every rank of the restarted job "
                          "finished")
                    .Register(*registry_)
                    .Add({}, Buckets(0.1, 10000))),
      refused_steps_(prometheus::BuildCounter()
                         .Name("muonmesh_job_refused_steps_total")
                         .Help("Attempts of a job that ended refusing a step: a reduced gradient "
                               "was NaN or infinite (no rank updated anything)")
                         .Register(*registry_)) {
  http::RegisterBuildInfo(*registry_, "coordinator");
}

void CoordinatorMetrics::OnRpc(const std::string& method, int code, double seconds,
                               bool stream) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = Buckets(0.0001, 100);
  if (stream) {
    rpc_streams_.Add({{"method", method}, {"code", CodeName(code)}}).Increment();
    return;
  }
  rpc_duration_.Add({{"method", method}, {"code", CodeName(code)}}, kBuckets).Observe(seconds);
}

void CoordinatorMetrics::OnStep(const std::string& job_id, double slowest_rank_seconds) {
  steps_.Increment();
  step_duration_.Observe(slowest_rank_seconds);
  absl::MutexLock lock(&mu_);
  last_progress_[job_id] = absl::Now();
}

void CoordinatorMetrics::OnRefusedStep(const std::string& job_id) {
  refused_steps_.Add({{"job_id", job_id}}).Increment();
}

void CoordinatorMetrics::OnRecovered(double seconds) { recovery_.Observe(seconds); }

void CoordinatorMetrics::OnAttemptPlanned(const std::string& job_id, double critical_path_flops) {
  absl::MutexLock lock(&mu_);
  critical_path_[job_id] = critical_path_flops;
  last_progress_[job_id] = absl::Now();
}

void CoordinatorMetrics::OnAttemptDone(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  critical_path_.erase(job_id);
  last_progress_.erase(job_id);
}

std::vector<prometheus::MetricFamily> CoordinatorMetrics::Collect() const {
  prometheus::MetricFamily jobs{"muonmesh_jobs", "Jobs in each state",
                                prometheus::MetricType::Gauge, {}};
  std::map<v1::JobState, int64_t> by_state;
  for (int s = v1::JOB_STATE_PENDING; s <= v1::JOB_STATE_CANCELLED; ++s) {
    by_state[static_cast<v1::JobState>(s)] = 0;
  }
  for (const auto& [state, count] : store_.CountByState()) by_state[state] = count;
  for (const auto& [state, count] : by_state) {
    prometheus::ClientMetric m = GaugeValue(static_cast<double>(count));
    m.label = {{"state", StateName(state)}};
    jobs.metric.push_back(std::move(m));
  }
  std::vector<prometheus::MetricFamily> out = RunningJobFamilies();
  out.push_back(std::move(jobs));
  out.push_back(WorkerFamily());
  out.push_back(QuarantineFamily());
  return out;
}

std::vector<prometheus::MetricFamily> CoordinatorMetrics::RunningJobFamilies() const {
  prometheus::MetricFamily loss{"muonmesh_job_loss", "Last loss of each running job",
                                prometheus::MetricType::Gauge, {}};
  prometheus::MetricFamily val_loss{
      "muonmesh_job_val_loss",
      "Newest validation loss of each running job (language models; see training.eval_every)",
      prometheus::MetricType::Gauge,
      {}};
  prometheus::MetricFamily critical_path{
      "muonmesh_job_planned_critical_path_flops",
      "Planned critical path of each running job: the Newton-Schulz FLOPs per step of the "
      "busiest rank in its attempt's plan",
      prometheus::MetricType::Gauge,
      {}};
  prometheus::MetricFamily step_seconds{
      "muonmesh_job_step_seconds",
      "Median step time of each running job's recent steps (their slowest rank)",
      prometheus::MetricType::Gauge,
      {}};
  prometheus::MetricFamily since_progress{
      "muonmesh_job_seconds_since_progress",
      "Seconds since each running job last finished a step, or its attempt began",
      prometheus::MetricType::Gauge,
      {}};
  prometheus::MetricFamily world_size{
      "muonmesh_job_world_size",
      "Ranks of each running job's attempt (below its world_size while training.elastic runs "
      "it shrunk)",
      prometheus::MetricType::Gauge,
      {}};
  std::map<std::string, double> planned;
  std::map<std::string, absl::Time> progress;
  {
    absl::MutexLock lock(&mu_);
    planned = critical_path_;
    progress = last_progress_;
  }
  const absl::Time now = absl::Now();
  for (const v1::Job& job : store_.Unfinished()) {
    if (job.state() != v1::JOB_STATE_RUNNING) continue;
    const std::string& id = job.id();
    AddJobGauge(
        world_size, id,
        static_cast<double>(job.world_size() > 0 ? job.world_size() : job.worker_ids_size()));
    if (auto it = planned.find(id); it != planned.end()) AddJobGauge(critical_path, id, it->second);
    if (auto it = progress.find(id); it != progress.end()) {
      AddJobGauge(since_progress, id, absl::ToDoubleSeconds(now - it->second));
    }
    if (job.step_seconds() > 0) AddJobGauge(step_seconds, id, job.step_seconds());
    if (job.has_last_val_loss()) AddJobGauge(val_loss, id, job.last_val_loss());
    if (job.steps_done() > 0) AddJobGauge(loss, id, job.last_loss());
  }
  std::vector<prometheus::MetricFamily> out;
  for (prometheus::MetricFamily* f :
       {&loss, &val_loss, &critical_path, &world_size, &step_seconds, &since_progress}) {
    out.push_back(std::move(*f));
  }
  return out;
}

prometheus::MetricFamily CoordinatorMetrics::WorkerFamily() const {
  prometheus::MetricFamily workers{"muonmesh_workers", "Registered workers by state and device",
                                   prometheus::MetricType::Gauge, {}};
  std::map<std::pair<std::string, std::string>, int64_t> counts;
  for (const char* device : {"cpu", "cuda"}) {
    for (const char* state : {"IDLE", "BUSY", "LOST"}) counts[{state, device}] = 0;
  }
  for (const v1::Worker& w : fleet_.List()) {
    std::string state = v1::WorkerState_Name(w.state()).substr(std::string("WORKER_STATE_").size());
    counts[{state, w.info().device()}] += 1;
  }
  for (const auto& [key, count] : counts) {
    prometheus::ClientMetric m = GaugeValue(static_cast<double>(count));
    m.label = {{"device", key.second}, {"state", key.first}};
    workers.metric.push_back(std::move(m));
  }
  return workers;
}

prometheus::MetricFamily CoordinatorMetrics::QuarantineFamily() const {
  prometheus::MetricFamily quarantined{
      "muonmesh_workers_quarantined",
      "Workers given no new rank for now: blamed for two failed attempts within an hour "
      "(their peers could not reach them; coordinator --quarantine)",
      prometheus::MetricType::Gauge,
      {}};
  quarantined.metric.push_back(GaugeValue(static_cast<double>(fleet_.QuarantinedCount())));
  return quarantined;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CoordinatorMetrics::InterceptorFactory() {
  return std::make_unique<RpcTimerFactory>(this);
}

}  // namespace muonmesh::coordinator
