#include "worker/daemon.h"

#include <unistd.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/base/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "proto/convert/exec_plan_convert.h"
#include "proto/job/allowed_dirs.h"
#include "proto/job/job.h"
#include "worker/comm/grpc_store.h"
#include "worker/comm/peer_probe.h"
#include "worker/job/memory_budget.h"
#include "proto/rpc/rpc_status.h"
#include "proto/rpc/version.h"
#include "worker/local_address.h"
#include "worker/worker_metrics.h"

namespace muonmesh::worker {
namespace {

// The rank being run, and how to stop it.
struct RankTask {
  std::string job_id;
  int32_t attempt = 0;
  int32_t rank = 0;
  std::string plan_fingerprint;
  std::atomic<bool> stop{false};
  // The coordinator asked for a checkpoint of the last step, then a stop
  // (a drain).
  std::atomic<bool> checkpoint_stop{false};
  // Set once the coordinator has the rank's end (or refused to keep the
  // rank): a registration no longer names it.
  std::atomic<bool> settled{false};
  std::thread thread;
  // The rank's rendezvous store while it runs: set again when the worker
  // registers anew (a restarted coordinator's store is empty).
  absl::Mutex store_mu;
  comm::GrpcStore* store ABSL_GUARDED_BY(store_mu) = nullptr;
  // Ends the rank's collectives and rendezvous at once (comm/abort.h).
  comm::AbortSignal abort;
  // Every rank's worker and check port (StartRank.peers).
  std::vector<v1::PeerCheck> peers;

  // Told to stop by the coordinator (its attempt is over): the rank leaves
  // whatever collective it waits in instead of waiting out its timeout.
  void StopNow(const std::string& reason) {
    stop = true;
    abort.Abort(absl::StrCat("the coordinator stopped this rank: ", reason));
  }
};

// Step records the coordinator has not acknowledged, oldest first: while it
// is away (restarting) the rank trains on and they wait here. Bounded: when
// full the oldest is dropped and counted. Used by the rank's thread only.
class StepOutbox {
 public:
  static constexpr size_t kCapacity = 10000;
  void Push(v1::StepRecord r) {
    if (records_.size() == kCapacity) {
      records_.pop_front();
      ++dropped_;
    }
    records_.push_back(std::move(r));
  }
  bool empty() const { return records_.empty(); }
  size_t size() const { return records_.size(); }
  const v1::StepRecord& front() const { return records_.front(); }
  void Pop() { records_.pop_front(); }
  int64_t dropped() const { return dropped_; }

 private:
  std::deque<v1::StepRecord> records_;
  int64_t dropped_ = 0;
};

// Errors of a report that mean the coordinator is away or does not know
// this worker's lease yet (it restarted; the serving thread registers
// again): keep the report and retry. Anything else is its answer.
bool Transient(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::NOT_FOUND:            // no such worker: registering again
    case grpc::StatusCode::FAILED_PRECONDITION:  // a stale lease: registering again
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return true;
    default:
      return false;
  }
}

// The largest assignment a worker takes: a job spec (the coordinator takes
// requests up to 64 MiB) and its execution plan (the coordinator sends up to
// 1 GiB). gRPC's default of 4 MiB broke the stream on a large plan.
constexpr int kMaxAssignmentBytes = 1 << 30;

grpc::ChannelArguments WorkerChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxAssignmentBytes);
  // Reconnect within half a second of the coordinator coming back: gRPC's default
  // backoff grows to 2 minutes while it is away, and a restarted
  // coordinator keeps a running attempt only for the workers that return
  // within its lease.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  return args;
}

// How long a peer check waits for the peer's answer: a live peer answers
// in milliseconds, even across hosts.
constexpr absl::Duration kPeerCheckTimeout = absl::Seconds(2);

// A rank that has made no progress (started, or finished a step) for this
// long, or two heartbeats if longer, has its peers checked, and checked
// again as often while it stays stalled: a peer cut off from it (while
// still reaching the coordinator) blocks its collectives until their
// timeout, and the coordinator fails the attempt when most of the cut-off
// worker's peers report it (docs/architecture.md §7, "Peer checks"). The
// checks cost a byte each way per peer, so a long step only costs that.
constexpr absl::Duration kStallCheckAfter = absl::Seconds(5);
// A stalled rank's checks wait longer than the coordinator's: a step stalled
// on a congested link is just when a check's SYN may be dropped, and TCP
// sends it again at 1 s and 3 s; a cut link never answers.
constexpr absl::Duration kStallProbeTimeout = absl::Seconds(5);

class Daemon {
 public:
  Daemon(DaemonOptions options, const credentials::ChannelSecurity& security, LineSink log,
         std::unique_ptr<WorkerMetrics> metrics)
      : options_(std::move(options)), log_(std::move(log)), metrics_(std::move(metrics)) {
    channel_ = credentials::CreateChannel(options_.coordinator, security, WorkerChannelArgs());
    stub_ = v1::Fleet::NewStub(channel_);
    // Where peers check that this worker is alive when the coordinator
    // loses it (docs/architecture.md §7); without it the coordinator waits
    // out the partition grace.
    absl::StatusOr<std::unique_ptr<comm::EchoListener>> echo =
        comm::EchoListener::Start(options_.address);
    if (echo.ok()) {
      echo_ = *std::move(echo);
    } else {
      log_(absl::StrCat("no peer checks: ", echo.status().message()));
    }
    if (metrics_->http() != nullptr) {
      metrics_->http()->SetChecks(nullptr, [this] { return Ready(); });
    }
  }
  ~Daemon() {
    if (metrics_->http() != nullptr) metrics_->http()->ClearChecks();
  }

  absl::Status Run();

 private:
  // Stop now: asked to (SIGINT), told to leave after a drain, or a drain
  // that has not ended within drain_timeout.
  bool Stopping() const {
    if ((options_.stop != nullptr && options_.stop->load()) || leave_.load()) return true;
    // Draining with no rank in progress: nothing to hand over.
    if (Draining() && !busy_.load()) return true;
    const int64_t deadline = drain_deadline_ms_.load();
    return deadline > 0 && absl::ToUnixMillis(absl::Now()) > deadline;
  }
  bool Draining() const { return options_.drain != nullptr && options_.drain->load(); }
  absl::Status Register();
  void Heartbeats();
  std::string Lease() {
    absl::MutexLock lock(&mu_);
    return lease_id_;
  }
  // /readyz: registered, and the coordinator answered within three
  // heartbeats (at least 5 s): the lease is live.
  absl::Status Ready() {
    absl::MutexLock lock(&mu_);
    if (lease_id_.empty()) return absl::UnavailableError("not registered with the coordinator");
    const absl::Duration since = absl::Now() - last_answer_;
    if (since > std::max(3 * heartbeat_interval_, absl::Seconds(5))) {
      return absl::UnavailableError(
          absl::StrCat("no answer from the coordinator for ",
                       absl::FormatDuration(absl::Trunc(since, absl::Seconds(1)))));
    }
    return absl::OkStatus();
  }
  // Sends the outbox's records in order; `*stop` when the coordinator says
  // the rank should stop. While the coordinator is away the records stay
  // (OK); an answer that refuses the rank is an error. `patient`: the first
  // send may take the full RPC deadline (else a short one, so that a rank
  // whose coordinator is away loses little time a step).
  absl::Status FlushSteps(RankTask& task, StepOutbox& outbox, bool patient, bool* stop,
                          bool* checkpoint = nullptr);
  // Reads assignments until the stream ends; its status says why.
  absl::Status Serve();
  void Start(const v1::Assignment& a);
  void RunAssigned(RankTask* task, v1::StartRank start);
  void Report(RankTask& task, StepOutbox& outbox, const absl::Status& result);
  // Has the running rank's rendezvous store set its keys again (logged when
  // that fails; the rank's own store calls retry them too).
  void SetRendezvousAgain(RankTask& task);
  absl::Status OnRankStep(RankTask& task, StepOutbox& outbox, const job::ResolvedJob& job,
                          const std::string& tag, bool& buffering, const StepReport& r,
                          absl::Duration took);
  void JoinRank();

  // Answers a peer's check once Fleet.Heartbeat asks it; the answers to
  // the checks asked of this worker go in its next heartbeat.
  void CheckPeers(const v1::HeartbeatResponse& response);
  // The running rank made progress now (`peers`: it starts with them);
  // Idle(): no rank runs.
  void Progress(const std::vector<v1::PeerCheck>* peers = nullptr);
  void Idle();
  // On the heartbeat thread: when the running rank has stalled for
  // kStallCheckAfter, checks its peers on a thread of its own; the peers it
  // cannot reach go in the next heartbeat (TakeStallResults).
  void StallChecks();
  std::vector<v1::PeerCheckResult> TakeStallResults();

  const DaemonOptions options_;
  const LineSink log_;
  std::unique_ptr<comm::EchoListener> echo_;
  // Used by the heartbeat thread only.
  std::vector<v1::PeerCheckResult> peer_results_;
  std::unique_ptr<WorkerMetrics> metrics_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Fleet::Stub> stub_;
  // The lease, shared with the heartbeat thread.
  absl::Mutex mu_;
  std::string lease_id_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(2);
  absl::Time last_answer_ ABSL_GUARDED_BY(mu_);  // of Register or Heartbeat
  // The running rank's peers and when it last made progress
  // (InfiniteFuture: no rank runs), the last stall check, and what the
  // checks found unreachable, not yet sent.
  std::vector<v1::PeerCheck> stall_peers_ ABSL_GUARDED_BY(mu_);
  absl::Time progress_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time stall_checked_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::vector<v1::PeerCheckResult> stall_results_ ABSL_GUARDED_BY(mu_);
  // Runs one round of stall checks; used by the heartbeat thread only.
  std::thread stall_thread_;
  std::atomic<bool> stall_checking_{false};
  // The rank running now: only the serving thread (Run, Start) touches it.
  std::unique_ptr<RankTask> task_;
  std::atomic<bool> leave_{false};             // drained: the coordinator says go
  std::atomic<bool> busy_{false};              // a rank runs or has not settled
  std::atomic<int64_t> drain_deadline_ms_{0};  // 0: not draining
};

absl::Status Daemon::Register() {
  v1::RegisterRequest request;
  v1::WorkerInfo* info = request.mutable_info();
  info->set_worker_id(options_.worker_id);
  info->set_device(absl::StartsWith(options_.device, "cuda") ? "cuda" : "cpu");
  info->set_memory_bytes(options_.memory_budget_bytes > 0 ? options_.memory_budget_bytes
                                                          : DefaultMemoryBudgetBytes(1));
  info->set_address(options_.address);
  info->set_locality(options_.locality);
  info->set_version(absl::StrCat("muonmesh-worker ", rpc::Version()));
  if (echo_ != nullptr) info->set_peer_port(echo_->port());
  absl::Duration backoff = absl::Milliseconds(100);
  int tries = 0;
  while (!Stopping()) {
    // The lease this process holds (renewed if still live) and the rank it
    // runs, so that a restarted coordinator keeps the attempt.
    request.set_lease_id(Lease());
    const bool running = task_ != nullptr && !task_->settled.load();
    if (running) {
      v1::RunningRank* r = request.mutable_running();
      r->set_job_id(task_->job_id);
      r->set_attempt(task_->attempt);
      r->set_rank(task_->rank);
      r->set_plan_fingerprint(task_->plan_fingerprint);
    } else {
      request.clear_running();
    }
    v1::RegisterResponse response;
    grpc::ClientContext context;
    // Waits for the connection (up to a second) rather than failing at
    // once while the channel backs off: a restarted coordinator is found as
    // soon as it listens.
    context.set_wait_for_ready(true);
    context.set_deadline(
        std::chrono::system_clock::now() +
        absl::ToChronoMilliseconds(std::min(options_.rpc_timeout, absl::Seconds(1))));
    const grpc::Status s = stub_->Register(&context, request, &response);
    if (s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        lease_id_ = response.lease_id();
        last_answer_ = absl::Now();
        heartbeat_interval_ =
            absl::Milliseconds(std::max<int64_t>(100, response.heartbeat_interval_ms()));
      }
      log_(absl::StrCat("registered as ", options_.worker_id, " with ", options_.coordinator, " (",
                        response.lease_id(), ")"));
      if (running && !response.stop_running().empty()) {
        log_(absl::StrCat("[", task_->job_id, "] the coordinator does not keep rank ", task_->rank,
                          ": ", response.stop_running(), "; stopping it"));
        task_->StopNow(response.stop_running());
        task_->settled = true;
      } else if (running) {
        log_(absl::StrCat("[", task_->job_id, "] rank ", task_->rank, " of attempt ",
                          task_->attempt, " goes on under this coordinator"));
        SetRendezvousAgain(*task_);
      }
      return absl::OkStatus();
    }
    // Bad input and refused credentials will not get better; anything else
    // (a coordinator not up yet, an old lease not expired yet) may.
    if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
        s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
        s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      return rpc::FromGrpcStatus(s, "registering");
    }
    if (++tries == 1 || tries % 10 == 0) {
      log_(absl::StrCat("cannot register yet (", s.error_message(), "); retrying"));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
  return absl::CancelledError("stopped");
}

void Daemon::Heartbeats() {
  while (!Stopping()) {
    std::string lease;
    absl::Duration interval;
    {
      absl::MutexLock lock(&mu_);
      lease = lease_id_;
      interval = heartbeat_interval_;
    }
    // Sleep in short slices so that a stop is seen quickly; peer checks to
    // report go at once.
    for (absl::Duration slept; slept < interval && !Stopping() && peer_results_.empty();
         slept += absl::Milliseconds(50)) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    if (lease.empty()) continue;  // between leases (Run registers again)
    v1::HeartbeatRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_lease_id(lease);
    if (Draining()) {
      request.set_draining(true);
      if (drain_deadline_ms_.load() == 0) {
        log_(
            absl::StrCat("stopping: asking the coordinator to drain this worker (its rank, if "
                         "any, checkpoints and moves; at most ",
                         absl::FormatDuration(options_.drain_timeout), ")"));
        drain_deadline_ms_ = absl::ToUnixMillis(absl::Now() + options_.drain_timeout);
      }
    }
    StallChecks();
    for (v1::PeerCheckResult& r : peer_results_) *request.add_peer_checks() = std::move(r);
    peer_results_.clear();
    for (v1::PeerCheckResult& r : TakeStallResults()) *request.add_peer_checks() = std::move(r);
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    rpc::SetDeadline(context, options_.rpc_timeout);
    // (The stream notices a stale lease.)
    const bool answered = stub_->Heartbeat(&context, request, &response).ok();
    if (answered) {
      absl::MutexLock lock(&mu_);
      last_answer_ = absl::Now();
    }
    if (answered) CheckPeers(response);
    if (answered && response.leave()) {
      log_("drained: this worker runs nothing and leaves");
      leave_ = true;
    }
  }
  if (stall_thread_.joinable()) stall_thread_.join();
}

// Checks every peer but `self`, kParallelChecks at a time (each within
// `timeout`).
std::vector<v1::PeerCheckResult> CheckAll(const std::vector<v1::PeerCheck>& peers,
                                          const std::string& self,
                                          absl::Duration timeout = kPeerCheckTimeout) {
  constexpr size_t kParallelChecks = 64;
  std::vector<v1::PeerCheckResult> out(peers.size());
  std::vector<std::thread> checks;
  for (size_t i = 0; i < peers.size(); ++i) {
    out[i].set_worker_id(peers[i].worker_id());
    if (peers[i].worker_id() == self || peers[i].port() == 0) {
      out[i].set_reachable(true);  // itself, or a peer with nothing to check
      continue;
    }
    checks.emplace_back([&peers, &out, i, timeout] {
      const absl::Status s = comm::EchoCheck(peers[i].address(), peers[i].port(), timeout);
      out[i].set_reachable(s.ok());
      out[i].set_refused(absl::IsNotFound(s));
      out[i].set_connected(absl::IsDeadlineExceeded(s));
      if (!s.ok()) out[i].set_detail(std::string(s.message()));
    });
    if (checks.size() == kParallelChecks) {
      for (std::thread& t : checks) t.join();
      checks.clear();
    }
  }
  for (std::thread& t : checks) t.join();
  return out;
}

void Daemon::Progress(const std::vector<v1::PeerCheck>* peers) {
  absl::MutexLock lock(&mu_);
  progress_ = absl::Now();
  if (peers != nullptr) {
    stall_peers_ = *peers;
    stall_checked_ = absl::InfinitePast();
  }
}

void Daemon::Idle() {
  absl::MutexLock lock(&mu_);
  progress_ = absl::InfiniteFuture();
}

void Daemon::StallChecks() {
  if (stall_checking_.load()) return;  // the last round is still out
  if (stall_thread_.joinable()) stall_thread_.join();
  std::vector<v1::PeerCheck> peers;
  absl::Duration stalled;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    const absl::Duration after = std::max(kStallCheckAfter, 2 * heartbeat_interval_);
    if (now - progress_ < after || now - stall_checked_ < after) return;
    stall_checked_ = now;
    peers = stall_peers_;
    stalled = now - progress_;
  }
  stall_checking_ = true;
  stall_thread_ = std::thread([this, peers = std::move(peers), stalled] {
    std::vector<v1::PeerCheckResult> cut;
    for (v1::PeerCheckResult& r : CheckAll(peers, options_.worker_id, kStallProbeTimeout)) {
      // A refused connection is a crashed peer, which its lease catches; a
      // connection made whose echo came late is a frozen peer (its lease
      // again) or a congested link, not a cut one.
      if (r.reachable() || r.refused() || r.connected()) continue;
      log_(absl::StrCat("peer ", r.worker_id(), " is unreachable from here while the rank has "
                        "made no progress for ",
                        absl::FormatDuration(absl::Trunc(stalled, absl::Seconds(1))), ": ",
                        r.detail()));
      cut.push_back(std::move(r));
    }
    absl::MutexLock lock(&mu_);
    for (v1::PeerCheckResult& r : cut) stall_results_.push_back(std::move(r));
    stall_checking_ = false;
  });
}

std::vector<v1::PeerCheckResult> Daemon::TakeStallResults() {
  absl::MutexLock lock(&mu_);
  return std::exchange(stall_results_, {});
}

void Daemon::CheckPeers(const v1::HeartbeatResponse& response) {
  if (response.check_peers().empty()) return;
  const std::vector<v1::PeerCheck> asked(response.check_peers().begin(),
                                         response.check_peers().end());
  for (v1::PeerCheckResult& r : CheckAll(asked, options_.worker_id)) {
    if (!r.reachable()) {
      log_(absl::StrCat("peer ", r.worker_id(), " the coordinator lost is unreachable from here: ",
                        r.detail()));
    }
    peer_results_.push_back(std::move(r));
  }
}

void Daemon::SetRendezvousAgain(RankTask& task) {
  absl::MutexLock lock(&task.store_mu);
  if (task.store == nullptr) return;
  if (absl::Status st = task.store->SetAgain(options_.rpc_timeout); !st.ok()) {
    log_(absl::StrCat("[", task.job_id,
                      "] could not set the rank's rendezvous keys again: ", st.message()));
  }
}

absl::Status Daemon::FlushSteps(RankTask& task, StepOutbox& outbox, bool patient, bool* stop,
                                bool* checkpoint) {
  *stop = false;
  if (checkpoint != nullptr) *checkpoint = false;
  while (!outbox.empty()) {
    v1::ReportStepRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_lease_id(Lease());
    request.set_job_id(task.job_id);
    *request.mutable_record() = outbox.front();
    v1::ReportStepResponse response;
    grpc::ClientContext context;
    context.set_deadline(
        std::chrono::system_clock::now() +
        absl::ToChronoMilliseconds(patient ? options_.rpc_timeout : absl::Milliseconds(300)));
    const grpc::Status s = stub_->ReportStep(&context, request, &response);
    if (!s.ok()) {
      if (Transient(s)) return absl::OkStatus();  // kept for the next try
      if (s.error_code() == grpc::StatusCode::ABORTED) {
        // The coordinator runs no such rank any more (the attempt ended).
        task.stop = true;
        return absl::CancelledError(
            absl::StrCat("the coordinator stopped this rank: ", s.error_message()));
      }
      return rpc::FromGrpcStatus(s, "report a step");
    }
    outbox.Pop();
    patient = true;
    if (response.stop()) {
      *stop = true;
      if (checkpoint != nullptr) *checkpoint = response.checkpoint();
      return absl::OkStatus();
    }
  }
  return absl::OkStatus();
}

void Daemon::Report(RankTask& task, StepOutbox& outbox, const absl::Status& result) {
  Idle();
  v1::ReportAttemptRequest request;
  request.set_worker_id(options_.worker_id);
  request.set_job_id(task.job_id);
  request.set_attempt(task.attempt);
  request.set_rank(task.rank);
  // Told to stop (not to checkpoint first), a rank whose collectives broke
  // was stopped: a peer's abort may reset its connections before its own
  // stop reaches it.
  const bool broke = absl::IsUnavailable(result) || absl::IsDeadlineExceeded(result);
  if (result.ok()) {
    request.set_outcome(v1::ATTEMPT_OUTCOME_SUCCEEDED);
  } else if (task.stop.load() && (absl::IsCancelled(result) ||
                                  (broke && !task.checkpoint_stop.load()))) {
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
  request.set_refused_step(result.GetPayload(kRefusedStepPayload).has_value());
  request.set_job_error(result.GetPayload(kJobErrorPayload).has_value());
  if (request.outcome() == v1::ATTEMPT_OUTCOME_FAILED && broke) {
    // Its collectives broke: which peers can it reach now? (The coordinator
    // blames the worker the others cannot.)
    for (v1::PeerCheckResult& r : CheckAll(task.peers, options_.worker_id)) {
      *request.add_peer_checks() = std::move(r);
    }
  }
  // The steps first, then the end; while the coordinator is away (it
  // restarts, and the serving thread registers again naming this rank),
  // retry until it answers, it refuses the rank, or the worker stops.
  absl::Duration backoff = absl::Milliseconds(100);
  bool told = false;
  while (!task.settled.load() && !Stopping()) {
    // Every kept record, stop answers or not (the rank has ended).
    bool stop = true;
    absl::Status flushed = absl::OkStatus();
    const size_t before = outbox.size();
    while (flushed.ok() && stop && !outbox.empty()) {
      flushed = FlushSteps(task, outbox, /*patient=*/true, &stop);
    }
    if (flushed.ok() && outbox.empty()) {
      request.set_lease_id(Lease());
      v1::ReportAttemptResponse response;
      grpc::ClientContext context;
      rpc::SetDeadline(context, options_.rpc_timeout);
      const grpc::Status s = stub_->ReportAttempt(&context, request, &response);
      if (s.ok() || !Transient(s)) {
        if (!s.ok()) {
          log_(absl::StrCat("cannot report the end of ", task.job_id, ": ", s.error_message()));
        }
        break;
      }
    } else if (!flushed.ok()) {
      break;  // the coordinator refused the rank: nothing to report to it
    }
    if (outbox.size() < before) continue;  // progress: no wait
    if (!told) {
      log_(absl::StrCat("[", task.job_id, "] the coordinator is away; the end of rank ", task.rank,
                        " waits for it (", outbox.size(), " step reports too)"));
      told = true;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
  if (outbox.dropped() > 0) {
    log_(absl::StrCat("[", task.job_id, "] ", outbox.dropped(),
                      " step reports were dropped while the coordinator was away (the oldest; "
                      "at most ",
                      StepOutbox::kCapacity, " are kept)"));
  }
  task.settled = true;
}

// The coordinator's record of a rank's step.
v1::StepRecord StepRecordOf(const StepReport& r, int32_t rank, int32_t attempt,
                            absl::Duration took) {
  v1::StepRecord rec;
  rec.set_step(r.step);
  rec.set_rank(rank);
  rec.set_attempt(attempt);
  rec.set_loss(r.loss);
  rec.set_grad_norm(r.grad_norm);
  rec.set_lr_scale(r.lr_scale);
  for (float v : r.max_attn_logit) rec.add_max_attn_logit(v);
  if (r.aux_loss.has_value()) rec.set_aux_loss(*r.aux_loss);
  for (const ExpertLoad& e : r.expert_load) {
    v1::ExpertLoad* load = rec.add_expert_load();
    load->set_layer(static_cast<int32_t>(e.layer));
    load->set_min_over_mean(e.min_over_mean);
    load->set_max_over_mean(e.max_over_mean);
    load->set_dropped(e.dropped);
  }
  v1::MuonHealth* h = rec.mutable_muon();
  h->set_matrices(r.muon.matrices);
  h->set_planned_matrices(r.muon.planned_matrices);
  h->set_elements(r.muon.elements);
  h->set_planned_elements(r.muon.planned_elements);
  h->set_update_rms(r.muon.update_rms);
  if (r.muon.ortho_error_max.has_value()) h->set_ortho_error_max(*r.muon.ortho_error_max);
  if (r.muon.ortho_error_median.has_value()) h->set_ortho_error_median(*r.muon.ortho_error_median);
  if (r.val_loss.has_value()) rec.set_val_loss(*r.val_loss);
  rec.set_step_seconds(absl::ToDoubleSeconds(took));
  rec.set_ns_flops(r.ns_flops);
  rec.set_collective_calls(r.collective_calls);
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
  p->set_grad_reduce_hidden(absl::ToDoubleSeconds(r.times.grad_reduce_hidden));
  p->set_param_gather_hidden(absl::ToDoubleSeconds(r.times.param_gather_hidden));
  p->set_muon_gather_hidden(absl::ToDoubleSeconds(r.times.muon_gather_hidden));
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
  o.gloo_interface = options.gloo_interface;
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

// The daemon's side of a rank's step: report it (or keep it while the
// coordinator is away), wait for the coordinator before a checkpoint or the
// export, and act on its answer (cancel, drain) or this worker's stop.
absl::Status Daemon::OnRankStep(RankTask& task, StepOutbox& outbox, const job::ResolvedJob& job,
                                const std::string& tag, bool& buffering, const StepReport& r,
                                absl::Duration took) {
  metrics_->OnStep(task.job_id, r, took, job.qk_clip);
  Progress();
  outbox.Push(StepRecordOf(r, task.rank, task.attempt, took));
  bool stop = false;
  bool checkpoint = false;
  MUONMESH_RETURN_IF_ERROR(
      FlushSteps(task, outbox, /*patient=*/outbox.size() == 1, &stop, &checkpoint));
  // A checkpoint or the export follows this step: write it only for an
  // attempt the coordinator still keeps, so wait until it has taken
  // every report (a coordinator that declared this worker lost may have
  // started the job elsewhere, writing the same folder).
  const bool writes_next = (job.checkpoint_every > 0 && (r.step + 1) % job.checkpoint_every == 0) ||
                           r.step + 1 >= job.steps;
  absl::Duration backoff = absl::Milliseconds(100);
  while (writes_next && !stop && !outbox.empty() && !Stopping() && !task.stop.load()) {
    if (!buffering) {
      log_(tag + "the coordinator is away: training on, keeping step reports until it is back");
      buffering = true;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(250));
    MUONMESH_RETURN_IF_ERROR(FlushSteps(task, outbox, /*patient=*/true, &stop, &checkpoint));
  }
  if (!outbox.empty() && !buffering) {
    log_(tag + "the coordinator is away: training on, keeping step reports until it is back");
  } else if (outbox.empty() && buffering) {
    log_(tag + "the coordinator is back: every kept step report sent");
  }
  buffering = !outbox.empty();
  if (stop && checkpoint) {
    // A drain or a cancel with a checkpoint: this step's checkpoint, then
    // stop (RunRank asks below).
    log_(tag + absl::StrCat("the coordinator asks for a checkpoint of step ", r.step + 1,
                            ", then a stop (a drain, or a cancel --checkpoint)"));
    task.checkpoint_stop = true;
    task.stop = true;
    return absl::OkStatus();
  }
  if (stop) {
    task.stop = true;
    return absl::CancelledError(absl::StrCat("stopped by the coordinator after step ", r.step));
  }
  if (task.stop.load() && !task.checkpoint_stop.load()) {
    return absl::CancelledError("stopped: the coordinator no longer keeps this rank");
  }
  if (Stopping()) {
    task.stop = true;
    return absl::CancelledError("the worker is stopping");
  }
  return absl::OkStatus();
}

void Daemon::RunAssigned(RankTask* task, v1::StartRank start) {
  const int32_t rank = start.rank();
  const std::string tag = absl::StrCat("[", task->job_id, " rank ", rank, "] ");
  StepOutbox outbox;
  auto run = [&]() -> absl::Status {
    // The job came from whoever may submit: its paths stay in the folders
    // the operator allows, checked before job::ResolveJob looks at them and again
    // with the defaults it fills in.
    MUONMESH_RETURN_IF_ERROR(job::CheckJobPathsAllowed(start.spec(), options_.allowed_dirs));
    MUONMESH_ASSIGN_OR_RETURN(job::ResolvedJob job, job::ResolveJob(start.spec(), ""));
    MUONMESH_RETURN_IF_ERROR(job::CheckJobPathsAllowed(job, options_.allowed_dirs));
    if (convert::PlanFingerprint(start.plan()) != start.plan_fingerprint()) {
      return absl::InvalidArgumentError(
          "the assignment's plan does not match its fingerprint; refusing to run it");
    }
    MUONMESH_ASSIGN_OR_RETURN(plan::Plan plan, convert::PlanFromExec(start.plan()));
    comm::GrpcStore store(channel_, task->job_id, task->attempt);
    {
      absl::MutexLock lock(&task->store_mu);
      task->store = &store;
    }
    task->abort.Add(&store);
    struct Forget {
      RankTask* task;
      comm::GrpcStore* store;
      ~Forget() {
        task->abort.Remove(store);
        absl::MutexLock lock(&task->store_mu);
        task->store = nullptr;
      }
    } forget{task, &store};
    RankOptions o = RankOptionsFor(start, task->attempt, options_);
    o.abort = &task->abort;
    RankHooks hooks;
    hooks.out = [&](const std::string& line) { log_(tag + line); };
    bool buffering = false;
    hooks.on_step = [&](const StepReport& r, absl::Duration took) -> absl::Status {
      return OnRankStep(*task, outbox, job, tag, buffering, r, took);
    };
    hooks.stop_after_checkpoint = [task] { return task->checkpoint_stop.load(); };
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
  Report(*task, outbox, result);
  busy_ = false;
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
      task_->StopNow(a.stop().reason());
    }
    return;
  }
  JoinRank();  // the coordinator assigns a worker one rank at a time
  busy_ = true;
  task_ = std::make_unique<RankTask>();
  task_->job_id = a.job_id();
  task_->attempt = a.attempt();
  task_->rank = a.start().rank();
  task_->plan_fingerprint = a.start().plan_fingerprint();
  task_->peers.assign(a.start().peers().begin(), a.start().peers().end());
  Progress(&task_->peers);
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
    while (!done.load() && !Stopping()) absl::SleepFor(absl::Milliseconds(50));
    if (!done.load()) context.TryCancel();
  });
  v1::Assignment a;
  while (reader->Read(&a)) Start(a);
  done = true;
  watcher.join();
  return rpc::FromGrpcStatus(reader->Finish(), "assignments");
}

absl::Status Daemon::Run() {
  if (absl::Status s = Register(); !s.ok()) {
    return Stopping() ? absl::OkStatus() : s;
  }
  std::thread heartbeats(&Daemon::Heartbeats, this);
  absl::Status result;
  while (!Stopping()) {
    absl::Status s = Serve();
    if (Stopping()) break;
    log_(absl::StrCat("assignment stream ended (", s.message(), "); registering again"));
    // A rank in progress goes on: the registration names it, and the
    // coordinator (restarted, or the same one after a broken stream) keeps
    // it or says to stop it. The lease goes with it, so a coordinator that
    // kept running renews it rather than refusing a second registration.
    if (absl::Status r = Register(); !r.ok()) {
      result = Stopping() ? absl::OkStatus() : r;
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
  if (o.address.empty()) {
    // What its peers on other hosts can dial: the address this host reaches
    // the coordinator from (127.0.0.1 when the coordinator is local).
    MUONMESH_ASSIGN_OR_RETURN(o.address, LocalAddressToward(o.coordinator),
                              "--address (not given: the address toward --coordinator)");
    log(absl::StrCat("advertising ", o.address,
                     " to peers (the address this host reaches the coordinator from; "
                     "--address overrides)"));
  }
  MUONMESH_ASSIGN_OR_RETURN(credentials::ChannelSecurity security, credentials::LoadChannelSecurity(o.security));
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
  if (security.tls) {
    std::map<std::string, std::string> certificate_files;
    certificate_files["ca"] = o.security.tls_ca;
    if (security.client_certificate) certificate_files["client"] = o.security.tls_cert;
    metrics->ExportCertificateExpiry(std::move(certificate_files));
  }
  Daemon daemon(std::move(o), security, log, std::move(metrics));
  return daemon.Run();
}

}  // namespace muonmesh::worker
