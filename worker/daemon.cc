#include "absl/synchronization/mutex.h"
#include "worker/daemon.h"

#include <unistd.h>

#include <chrono>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "proto/convert/exec_plan_convert.h"
#include "core/base/status_macros.h"
#include "worker/comm/grpc_store.h"
#include "proto/job/allowed_dirs.h"
#include "proto/job/job.h"
#include "worker/job/memory_budget.h"
#include "worker/worker_metrics.h"

namespace muonmesh::worker {
namespace {

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

bool Stopping(const DaemonOptions& o) { return o.stop != nullptr && o.stop->load(); }

// The rank being run, and how to stop it.
struct RankTask {
  std::string job_id;
  int32_t attempt = 0;
  std::atomic<bool> stop{false};
  std::thread thread;
};

// The largest assignment a worker takes: a job spec (the coordinator takes
// requests up to 64 MiB) and its execution plan (the coordinator sends up to
// 1 GiB). gRPC's default of 4 MiB broke the stream on a large plan.
constexpr int kMaxAssignmentBytes = 1 << 30;

grpc::ChannelArguments WorkerChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxAssignmentBytes);
  return args;
}

class Daemon {
 public:
  Daemon(DaemonOptions options, const rpc::ChannelSecurity& security, LineSink log,
         std::unique_ptr<WorkerMetrics> metrics)
      : options_(std::move(options)), log_(std::move(log)), metrics_(std::move(metrics)) {
    channel_ = rpc::CreateChannel(options_.coordinator, security, WorkerChannelArgs());
    stub_ = v1::Fleet::NewStub(channel_);
  }

  absl::Status Run();

 private:
  void SetDeadline(grpc::ClientContext& c) const {
    c.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(options_.rpc_timeout));
  }
  absl::Status Register();
  void Heartbeats();
  // Reads assignments until the stream ends; its status says why.
  absl::Status Serve();
  void Start(const v1::Assignment& a);
  void RunAssigned(RankTask* task, v1::StartRank start);
  void Report(const RankTask& task, int32_t rank, const absl::Status& result);
  void JoinRank();

  const DaemonOptions options_;
  const LineSink log_;
  std::unique_ptr<WorkerMetrics> metrics_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Fleet::Stub> stub_;
  // The lease, shared with the heartbeat thread.
  absl::Mutex mu_;
  std::string lease_id_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(2);
  // The rank running now: only the serving thread (Run, Start) touches it.
  std::unique_ptr<RankTask> task_;
};

absl::Status Daemon::Register() {
  v1::RegisterRequest request;
  v1::WorkerInfo* info = request.mutable_info();
  info->set_worker_id(options_.worker_id);
  info->set_device(absl::StartsWith(options_.device, "cuda") ? "cuda" : "cpu");
  info->set_memory_bytes(options_.memory_budget_bytes > 0 ? options_.memory_budget_bytes
                                                          : DefaultMemoryBudgetBytes(1));
  info->set_address(options_.address);
  info->set_version("muonmesh-worker 0.4");
  absl::Duration backoff = absl::Milliseconds(100);
  while (!Stopping(options_)) {
    v1::RegisterResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status s = stub_->Register(&context, request, &response);
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      lease_id_ = response.lease_id();
      heartbeat_interval_ = absl::Milliseconds(std::max<int64_t>(100, response.heartbeat_interval_ms()));
      log_(absl::StrCat("registered as ", options_.worker_id, " with ", options_.coordinator,
                        " (", lease_id_, ")"));
      return absl::OkStatus();
    }
    // Bad input and refused credentials will not get better; anything else
    // (a coordinator not up yet, an old lease not expired yet) may.
    if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
        s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
        s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      return FromGrpc(s, "registering");
    }
    log_(absl::StrCat("cannot register yet (", s.error_message(), "); retrying"));
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
  return absl::CancelledError("stopped");
}

void Daemon::Heartbeats() {
  while (!Stopping(options_)) {
    std::string lease;
    absl::Duration interval;
    {
      absl::MutexLock lock(&mu_);
      lease = lease_id_;
      interval = heartbeat_interval_;
    }
    // Sleep in short slices so that a stop is seen quickly.
    for (absl::Duration slept; slept < interval && !Stopping(options_);
         slept += absl::Milliseconds(50)) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    if (lease.empty()) continue;  // between leases (Run registers again)
    v1::HeartbeatRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_lease_id(lease);
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    (void)stub_->Heartbeat(&context, request, &response);  // the stream notices a stale lease
  }
}

void Daemon::Report(const RankTask& task, int32_t rank, const absl::Status& result) {
  v1::ReportAttemptRequest request;
  request.set_worker_id(options_.worker_id);
  {
    absl::MutexLock lock(&mu_);
    request.set_lease_id(lease_id_);
  }
  request.set_job_id(task.job_id);
  request.set_attempt(task.attempt);
  request.set_rank(rank);
  if (result.ok()) {
    request.set_outcome(v1::ATTEMPT_OUTCOME_SUCCEEDED);
  } else if (task.stop.load() && result.code() == absl::StatusCode::kCancelled) {
    request.set_outcome(v1::ATTEMPT_OUTCOME_STOPPED);
  } else {
    request.set_outcome(v1::ATTEMPT_OUTCOME_FAILED);
  }
  metrics_->OnAttemptEnd(task.job_id,
                         request.outcome() == v1::ATTEMPT_OUTCOME_SUCCEEDED ? "succeeded"
                         : request.outcome() == v1::ATTEMPT_OUTCOME_STOPPED ? "stopped"
                                                                             : "failed");
  request.set_code(static_cast<int32_t>(result.code()));
  request.set_message(std::string(result.message()).substr(0, 4096));
  v1::ReportAttemptResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  if (absl::Status s = FromGrpc(stub_->ReportAttempt(&context, request, &response), "report");
      !s.ok()) {
    log_(absl::StrCat("cannot report the end of ", task.job_id, ": ", s.message()));
  }
}

// The coordinator's record of a rank's step.
v1::StepRecord StepRecordOf(const StepReport& r, int32_t rank, int32_t attempt,
                            absl::Duration took) {
  v1::StepRecord rec;
  rec.set_step(r.step);
  rec.set_rank(rank);
  rec.set_attempt(attempt);
  rec.set_loss(r.loss);
  if (r.val_loss.has_value()) rec.set_val_loss(*r.val_loss);
  rec.set_step_seconds(absl::ToDoubleSeconds(took));
  rec.set_ns_flops(r.ns_flops);
  v1::PhaseSeconds* p = rec.mutable_phases();
  p->set_param_gather(absl::ToDoubleSeconds(r.times.param_gather));
  p->set_forward_backward(absl::ToDoubleSeconds(r.times.forward_backward));
  p->set_expert_dispatch(absl::ToDoubleSeconds(r.times.expert_dispatch));
  p->set_grad_reduce(absl::ToDoubleSeconds(r.times.grad_reduce));
  p->set_adamw(absl::ToDoubleSeconds(r.times.adamw));
  p->set_muon_prepare(absl::ToDoubleSeconds(r.times.muon_prepare));
  p->set_muon_gather(absl::ToDoubleSeconds(r.times.muon_gather));
  p->set_newton_schulz(absl::ToDoubleSeconds(r.times.newton_schulz));
  p->set_muon_scatter(absl::ToDoubleSeconds(r.times.muon_scatter));
  p->set_muon_apply(absl::ToDoubleSeconds(r.times.muon_apply));
  p->set_param_allgather_after_step(absl::ToDoubleSeconds(r.times.param_allgather_after_step));
  for (const auto& [name, bytes] : r.bytes_sent) (*rec.mutable_bytes_sent())[name] = bytes;
  return rec;
}

// How this daemon runs the rank of an assignment.
RankOptions RankOptionsFor(const v1::StartRank& start, int32_t attempt,
                           const DaemonOptions& options) {
  RankOptions o;
  o.rank = start.rank();
  o.attempt = attempt;
  o.group_prefix = start.store_prefix();
  o.hostname = options.address;
  o.timeout = absl::Milliseconds(std::max<int64_t>(1000, start.collective_timeout_ms()));
  o.resume = start.resume();
  int ordinal = -1;
  if (absl::StartsWith(options.device, "cuda:")) {
    (void)absl::SimpleAtoi(options.device.substr(5), &ordinal);
  }
  o.cuda_device = ordinal;
  o.memory_budget_bytes = start.memory_budget_bytes() > 0 ? start.memory_budget_bytes()
                                                          : options.memory_budget_bytes;
  return o;
}

void Daemon::RunAssigned(RankTask* task, v1::StartRank start) {
  const int32_t rank = start.rank();
  const std::string tag = absl::StrCat("[", task->job_id, " rank ", rank, "] ");
  auto run = [&]() -> absl::Status {
    // The job came from whoever may submit: its paths stay in the folders
    // the operator allows, checked before job::ResolveJob looks at them and again
    // with the defaults it fills in.
    MUONMESH_RETURN_IF_ERROR(job::CheckJobPathsAllowed(start.spec(), options_.allowed_dirs));
    MUONMESH_ASSIGN_OR_RETURN(job::ResolvedJob job, job::ResolveJob(start.spec(), ""));
    MUONMESH_RETURN_IF_ERROR(job::CheckJobPathsAllowed(job, options_.allowed_dirs));
    if (PlanFingerprint(start.plan()) != start.plan_fingerprint()) {
      return absl::InvalidArgumentError(
          "the assignment's plan does not match its fingerprint; refusing to run it");
    }
    MUONMESH_ASSIGN_OR_RETURN(plan::Plan plan, PlanFromExec(start.plan()));
    comm::GrpcStore store(channel_, task->job_id, task->attempt);
    const RankOptions o = RankOptionsFor(start, task->attempt, options_);
    RankHooks hooks;
    hooks.out = [&](const std::string& line) { log_(tag + line); };
    hooks.on_step = [&](const StepReport& r, absl::Duration took) -> absl::Status {
      metrics_->OnStep(task->job_id, r, took);
      v1::ReportStepRequest request;
      request.set_worker_id(options_.worker_id);
      {
        absl::MutexLock lock(&mu_);
        request.set_lease_id(lease_id_);
      }
      request.set_job_id(task->job_id);
      *request.mutable_record() = StepRecordOf(r, rank, task->attempt, took);
      v1::ReportStepResponse response;
      grpc::ClientContext context;
      SetDeadline(context);
      absl::Status s = FromGrpc(stub_->ReportStep(&context, request, &response), "report a step");
      MUONMESH_RETURN_IF_ERROR(s);
      if (response.stop()) {
        task->stop = true;
        return absl::CancelledError(absl::StrCat("stopped by the coordinator after step ", r.step));
      }
      if (Stopping(options_)) {
        task->stop = true;
        return absl::CancelledError("the worker is stopping");
      }
      return absl::OkStatus();
    };
    return RunRank(job, plan, store, o, hooks);
  };
  absl::Status result;
  metrics_->SetBusy(true);
  try {
    result = run();
  } catch (const std::bad_alloc&) {
    result = absl::ResourceExhaustedError("out of memory");
  }
  log_(tag + (result.ok() ? std::string("done") : absl::StrCat("ended: ", result.ToString())));
  Report(*task, rank, result);
  metrics_->SetBusy(false);
}

void Daemon::JoinRank() {
  if (task_ != nullptr && task_->thread.joinable()) task_->thread.join();
  task_.reset();
}

void Daemon::Start(const v1::Assignment& a) {
  if (a.has_stop()) {
    if (task_ != nullptr && task_->job_id == a.job_id() && task_->attempt == a.attempt()) {
      log_(absl::StrCat("[", a.job_id(), "] stop: ", a.stop().reason()));
      task_->stop = true;
    }
    return;
  }
  JoinRank();  // the coordinator assigns a worker one rank at a time
  task_ = std::make_unique<RankTask>();
  task_->job_id = a.job_id();
  task_->attempt = a.attempt();
  log_(absl::StrCat("[", a.job_id(), "] attempt ", a.attempt(), ": rank ", a.start().rank(),
                    " of ", a.start().spec().world_size()));
  task_->thread = std::thread(&Daemon::RunAssigned, this, task_.get(), a.start());
}

absl::Status Daemon::Serve() {
  v1::AssignmentsRequest request;
  request.set_worker_id(options_.worker_id);
  {
    absl::MutexLock lock(&mu_);
    request.set_lease_id(lease_id_);
  }
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::Assignment>> reader =
      stub_->Assignments(&context, request);
  // A stop must end the blocking Read: cancel the stream from a watcher.
  std::atomic<bool> done{false};
  std::thread watcher([&] {
    while (!done.load() && !Stopping(options_)) absl::SleepFor(absl::Milliseconds(50));
    if (!done.load()) context.TryCancel();
  });
  v1::Assignment a;
  while (reader->Read(&a)) Start(a);
  done = true;
  watcher.join();
  return FromGrpc(reader->Finish(), "assignments");
}

absl::Status Daemon::Run() {
  if (absl::Status s = Register(); !s.ok()) {
    return Stopping(options_) ? absl::OkStatus() : s;
  }
  std::thread heartbeats(&Daemon::Heartbeats, this);
  absl::Status result;
  while (!Stopping(options_)) {
    absl::Status s = Serve();
    if (Stopping(options_)) break;
    log_(absl::StrCat("assignment stream ended (", s.message(), "); registering again"));
    if (task_ != nullptr) task_->stop = true;  // our lease is gone: so is our rank
    JoinRank();  // its end reported under the old lease, if that still lives
    // Stop renewing the old lease: while it lives the coordinator refuses a
    // new registration under this id, so a stream that broke with the lease
    // still live (a network blip, a proxy's GOAWAY) would otherwise keep
    // this worker out for good. It expires within the lease's TTL.
    {
      absl::MutexLock lock(&mu_);
      lease_id_.clear();
    }
    if (absl::Status r = Register(); !r.ok()) {
      result = Stopping(options_) ? absl::OkStatus() : r;
      break;
    }
  }
  if (task_ != nullptr) task_->stop = true;
  JoinRank();
  heartbeats.join();
  return result;
}

}  // namespace

absl::Status RunDaemon(const DaemonOptions& options, const LineSink& log) {
  if (options.coordinator.empty()) return absl::InvalidArgumentError("--coordinator: required");
  if (options.device != "cpu" && !absl::StartsWith(options.device, "cuda")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device: '", options.device, "' is not cpu or cuda:N"));
  }
  DaemonOptions o = options;
  if (o.worker_id.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    o.worker_id = absl::StrCat(host, "/", o.device, "/", ::getpid());
  }
  MUONMESH_ASSIGN_OR_RETURN(rpc::ChannelSecurity security, rpc::LoadChannelSecurity(o.security));
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::string> allowed,
                            job::ResolveAllowedDirs(o.allowed_dirs));
  o.allowed_dirs = std::move(allowed);
  log(o.allowed_dirs.empty()
          ? std::string("no --allowed-dirs: job files may read and write wherever this user can")
          : absl::StrCat("job files may read and write only under ",
                         absl::StrJoin(o.allowed_dirs, ", ")));
  log(security.tls ? absl::StrCat("TLS to ", o.coordinator,
                                  security.client_certificate ? ", with a client certificate"
                                                              : ", without a client certificate",
                                  security.token ? ", with a token" : ", without a token")
                   : absl::StrCat("plaintext to ", o.coordinator, " (no --tls-ca)"));
  std::unique_ptr<WorkerMetrics> metrics;
  if (o.metrics_listen.empty()) {
    metrics = std::make_unique<WorkerMetrics>();
  } else {
    MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<WorkerMetrics> served,
                              WorkerMetrics::Serve(o.metrics_listen));
    metrics = std::move(served);
    log(absl::StrCat("serving metrics on port ", metrics->port(), " (/metrics)"));
  }
  Daemon daemon(std::move(o), security, log, std::move(metrics));
  return daemon.Run();
}

}  // namespace muonmesh::worker
