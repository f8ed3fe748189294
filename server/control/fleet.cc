#include "server/control/fleet.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace muonmesh::coordinator {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(50);

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == ':' || c == '/' || c == '-';
}

int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

}  // namespace

Fleet::Fleet(Clock* clock, absl::Duration lease_ttl, absl::Duration heartbeat_interval)
    : clock_(*clock), lease_ttl_(lease_ttl), heartbeat_interval_(heartbeat_interval) {}

bool Fleet::Live(const Entry& e) const {
  return e.state != v1::WORKER_STATE_LOST && clock_.Now() - e.last_heartbeat <= lease_ttl_;
}

absl::StatusOr<Fleet::Lease> Fleet::Register(const v1::WorkerInfo& info,
                                             const std::string& lease_id,
                                             const v1::RunningRank* running) {
  const std::string& id = info.worker_id();
  if (id.empty() || id.size() > kMaxWorkerIdBytes ||
      !std::all_of(id.begin(), id.end(), IsIdChar)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "info.worker_id: must match [A-Za-z0-9._:/-]+ and have at most ", kMaxWorkerIdBytes,
        " bytes, got '", id.substr(0, 64), id.size() > 64 ? "...'" : "'"));
  }
  if (info.device() != "cpu" && info.device() != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("info.device: '", info.device().substr(0, 32),
                                                   "' is not cpu or cuda"));
  }
  if (info.address().empty() || info.address().size() > 255) {
    return absl::InvalidArgumentError("info.address: required, at most 255 bytes");
  }
  if (info.memory_bytes() < 0 || info.version().size() > 128) {
    return absl::InvalidArgumentError("info: negative memory_bytes or a version over 128 bytes");
  }
  if (info.locality().size() > kMaxWorkerIdBytes ||
      !std::all_of(info.locality().begin(), info.locality().end(), IsIdChar)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "info.locality: must match [A-Za-z0-9._:/-]* and have at most ", kMaxWorkerIdBytes,
        " bytes, got '", info.locality().substr(0, 64), info.locality().size() > 64 ? "...'" : "'"));
  }
  if (info.peer_port() < 0 || info.peer_port() > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("info.peer_port: ", info.peer_port(), " is not a TCP port (0 for none)"));
  }
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(id);
  if (it != workers_.end() && Live(it->second) && !lease_id.empty() &&
      it->second.lease_id == lease_id) {
    // The same process again (its stream broke): the lease goes on, and so
    // does its rank.
    it->second.last_heartbeat = clock_.Now();
    if (running != nullptr && it->second.state == v1::WORKER_STATE_IDLE) {
      it->second.state = v1::WORKER_STATE_BUSY;
      it->second.job_id = running->job_id().substr(0, 256);
      it->second.rank = running->rank();
    }
    changed_.SignalAll();
    return Lease{it->second.lease_id, lease_ttl_, heartbeat_interval_};
  }
  // One told to leave (drained, idle) gives its id up at once: the pod
  // that replaces it in a rollout registers without waiting for the lease.
  if (it != workers_.end() && Live(it->second) && !it->second.left) {
    return absl::AlreadyExistsError(absl::StrCat(
        "worker '", id, "' is registered and its lease is live (another process with the same "
        "id?); give each worker its own --worker-id, or wait ",
        absl::FormatDuration(lease_ttl_), " for the old lease to expire"));
  }
  if (it == workers_.end() && workers_.size() >= kMaxWorkers && !EvictLostLocked()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the fleet has ", kMaxWorkers, " workers, none of them lost"));
  }
  // A new process under the id of one whose lease ran out: the old one is
  // gone, and so is the rank it ran, even if Expire has not looked yet.
  if (it != workers_.end() && it->second.state != v1::WORKER_STATE_LOST &&
      !it->second.job_id.empty()) {
    lost_on_register_.push_back({id, it->second.job_id, it->second.last_heartbeat});
  }
  Entry& e = workers_[id];
  e = Entry();
  e.info = info;
  // Not guessable: a lease id is what lets a caller with the worker role
  // act for that worker (fail its rank, take its assignments) when ids do
  // not come from certificates. 128 random bits, and a serial for logs.
  e.lease_id = absl::StrCat("lease-", next_lease_++, "-");
  for (int i = 0; i < 4; ++i) absl::StrAppend(&e.lease_id, absl::Hex(random_(), absl::kZeroPad8));
  e.order = next_order_++;
  e.registered = e.last_heartbeat = clock_.Now();
  if (running != nullptr) {
    e.state = v1::WORKER_STATE_BUSY;
    e.job_id = running->job_id().substr(0, 256);
    e.rank = running->rank();
  }
  changed_.SignalAll();
  return Lease{e.lease_id, lease_ttl_, heartbeat_interval_};
}

bool Fleet::EvictLostLocked() {
  auto oldest = workers_.end();
  for (auto it = workers_.begin(); it != workers_.end(); ++it) {
    if (it->second.state != v1::WORKER_STATE_LOST) continue;
    if (oldest == workers_.end() || it->second.last_heartbeat < oldest->second.last_heartbeat) {
      oldest = it;
    }
  }
  if (oldest == workers_.end()) return false;
  workers_.erase(oldest);
  return true;
}

absl::Status Fleet::CheckLease(const std::string& worker_id, const std::string& lease_id) const {
  absl::MutexLock lock(&mu_);
  return CheckLeaseLocked(worker_id, lease_id);
}

absl::Status Fleet::CheckLeaseLocked(const std::string& worker_id,
                                     const std::string& lease_id) const {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no worker '", worker_id.substr(0, 64), "'"));
  }
  if (it->second.lease_id != lease_id || !Live(it->second)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", worker_id, "': lease '", lease_id.substr(0, 64),
        "' is stale (expired or replaced); register again"));
  }
  return absl::OkStatus();
}

absl::Status Fleet::Heartbeat(const std::string& worker_id, const std::string& lease_id,
                              bool* leave) {
  absl::MutexLock lock(&mu_);
  MUONMESH_RETURN_IF_ERROR(CheckLeaseLocked(worker_id, lease_id));
  Entry& e = workers_[worker_id];
  e.last_heartbeat = clock_.Now();
  if (leave != nullptr) {
    *leave = e.draining && e.state == v1::WORKER_STATE_IDLE;
    e.left = e.left || *leave;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Worker> Fleet::Drain(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no worker '", worker_id.substr(0, 64), "'"));
  }
  if (it->second.state == v1::WORKER_STATE_LOST || !Live(it->second)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker '", worker_id, "' is lost: nothing to drain"));
  }
  it->second.draining = true;
  changed_.SignalAll();
  return View(it->second);
}

absl::Status Fleet::Remove(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no worker '", worker_id.substr(0, 64), "'"));
  }
  const Entry& e = it->second;
  if (e.state != v1::WORKER_STATE_LOST) {
    if (Live(e)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker '", worker_id, "' is ",
          v1::WorkerState_Name(View(e).state()).substr(std::string("WORKER_STATE_").size()),
          ": only a LOST worker is removed (drain it, stop it, and remove it once it is LOST)"));
    }
    // Its lease ran out and Expire has not seen it yet: the next Expire
    // still reports its job lost.
    if (!e.job_id.empty()) lost_on_register_.push_back({worker_id, e.job_id, e.last_heartbeat});
  }
  workers_.erase(it);
  changed_.SignalAll();
  return absl::OkStatus();
}

void Fleet::ForgetLostAfter(absl::Duration after) {
  absl::MutexLock lock(&mu_);
  forget_lost_after_ = after;
}

std::vector<Fleet::Lost> Fleet::Expire() {
  absl::MutexLock lock(&mu_);
  std::vector<Lost> lost;
  lost.swap(lost_on_register_);
  const absl::Time now = clock_.Now();
  const absl::Duration after = forget_lost_after_;
  std::erase_if(workers_, [&](const auto& entry) {
    const Entry& e = entry.second;
    // Told to leave (drained, idle) and gone: it left, it is not lost (a
    // scale-down pages no one).
    if (e.left && e.state != v1::WORKER_STATE_LOST && !Live(e)) return true;
    return after > absl::ZeroDuration() && e.state == v1::WORKER_STATE_LOST &&
           now - e.lost_at >= after;
  });
  for (auto& [id, e] : workers_) {
    if (e.state == v1::WORKER_STATE_LOST || Live(e)) continue;
    lost.push_back({id, e.job_id, e.last_heartbeat});
    e.state = v1::WORKER_STATE_LOST;
    e.lost_at = now;
    e.job_id.clear();
    e.rank = -1;
    e.outbox.clear();
  }
  if (!lost.empty()) changed_.SignalAll();
  return lost;
}

int64_t Fleet::IdleCount(const std::string& device) const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [id, e] : workers_) {
    n += Available(e, device) ? 1 : 0;
  }
  return n;
}

bool Fleet::Available(const Entry& e, const std::string& device) const {
  return e.state == v1::WORKER_STATE_IDLE && !e.draining && e.info.device() == device &&
         Live(e) && clock_.Now() >= e.quarantined_until;
}

bool Fleet::Blame(const std::string& worker_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  Entry& e = it->second;
  const absl::Time now = clock_.Now();
  while (!e.blamed.empty() && now - e.blamed.front() > kBlameWindow) e.blamed.pop_front();
  e.blamed.push_back(now);
  if (e.blamed.size() < 2 || quarantine_ <= absl::ZeroDuration()) return false;
  e.blamed.clear();
  e.quarantined_until = now + quarantine_;
  e.quarantine_reason = why.substr(0, 1024);
  return true;
}

void Fleet::QuarantineFor(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  quarantine_ = d;
}

int64_t Fleet::QuarantinedCount() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [id, e] : workers_) n += clock_.Now() < e.quarantined_until ? 1 : 0;
  return n;
}

std::optional<std::vector<std::string>> Fleet::Take(const std::string& device, int64_t n,
                                                    const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  std::vector<Entry*> idle;
  for (auto& [id, e] : workers_) {
    if (Available(e, device)) idle.push_back(&e);
  }
  if (static_cast<int64_t>(idle.size()) < n) return std::nullopt;
  // Spares first: a worker blamed lately (once; twice is quarantine) after
  // the others, each group in registration order.
  const absl::Time now = clock_.Now();
  auto suspect = [now](const Entry* e) {
    return !e->blamed.empty() && now - e->blamed.back() <= kBlameWindow;
  };
  std::sort(idle.begin(), idle.end(), [&](const Entry* a, const Entry* b) {
    return std::make_pair(suspect(a), a->order) < std::make_pair(suspect(b), b->order);
  });
  // Ranks in locality order among the workers taken, so that consecutive
  // ranks share the narrowest level of the network they can.
  idle.resize(static_cast<size_t>(n));
  std::stable_sort(idle.begin(), idle.end(), [](const Entry* a, const Entry* b) {
    return a->info.locality() < b->info.locality();
  });
  std::vector<std::string> taken;
  for (int64_t r = 0; r < n; ++r) {
    Entry& e = *idle[r];
    e.state = v1::WORKER_STATE_BUSY;
    e.job_id = job_id;
    e.rank = static_cast<int32_t>(r);
    taken.push_back(e.info.worker_id());
  }
  return taken;
}

void Fleet::Release(const std::string& worker_id, const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.job_id != job_id ||
      it->second.state != v1::WORKER_STATE_BUSY) {
    return;
  }
  it->second.state = v1::WORKER_STATE_IDLE;
  it->second.job_id.clear();
  it->second.rank = -1;
  changed_.SignalAll();
}

void Fleet::Push(const std::string& worker_id, v1::Assignment assignment,
                 std::shared_ptr<const v1::StartRank> shared) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.state == v1::WORKER_STATE_LOST) return;
  it->second.outbox.emplace_back(std::move(assignment), std::move(shared));
  changed_.SignalAll();
}

absl::StatusOr<std::optional<v1::Assignment>> Fleet::Next(
    const std::string& worker_id, const std::string& lease_id, absl::Duration wait,
    const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(wait);
  while (true) {
    if (shutdown_) return absl::CancelledError("the coordinator is shutting down");
    MUONMESH_RETURN_IF_ERROR(CheckLeaseLocked(worker_id, lease_id));
    Entry& e = workers_[worker_id];
    if (!e.outbox.empty()) {
      auto [a, shared] = std::move(e.outbox.front());
      e.outbox.pop_front();
      if (shared != nullptr) {
        v1::StartRank start = *shared;
        start.MergeFrom(a.start());
        *a.mutable_start() = std::move(start);
      }
      return std::optional<v1::Assignment>(std::move(a));
    }
    if (cancelled && cancelled()) return absl::CancelledError("the stream was cancelled");
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return std::optional<v1::Assignment>();
    changed_.WaitWithTimeout(
        &mu_, absl::FromChrono(std::min<std::chrono::steady_clock::duration>(deadline - now,
                                                                             kPollInterval)));
  }
}

std::optional<v1::WorkerInfo> Fleet::InfoOf(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return std::nullopt;
  return it->second.info;
}

std::string Fleet::JobOf(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? std::string() : it->second.job_id;
}

std::vector<v1::Worker> Fleet::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Worker> out;
  for (const auto& [id, e] : workers_) out.push_back(View(e));
  return out;
}

v1::Worker Fleet::View(const Entry& e) const {
  v1::Worker w;
  *w.mutable_info() = e.info;
  // A worker that left shows DRAINING until the sweep forgets it.
  const bool lost = e.state == v1::WORKER_STATE_LOST || (!Live(e) && !e.left);
  w.set_state(lost ? v1::WORKER_STATE_LOST : e.draining ? v1::WORKER_STATE_DRAINING : e.state);
  w.set_job_id(e.job_id);
  w.set_rank(e.rank);
  w.set_registered_unix_ms(UnixMs(e.registered));
  w.set_last_heartbeat_unix_ms(UnixMs(e.last_heartbeat));
  if (clock_.Now() < e.quarantined_until) {
    w.set_quarantined_until_unix_ms(UnixMs(e.quarantined_until));
    w.set_quarantine_reason(e.quarantine_reason);
  }
  return w;
}

void Fleet::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  changed_.SignalAll();
}

}  // namespace muonmesh::coordinator
