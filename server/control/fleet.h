#pragma once

// The coordinator's view of its workers: registrations and their leases,
// which worker is idle or busy with which job and rank, and each worker's
// queue of assignments (the Fleet service streams them out).
//
// Leases: a worker registers and gets a lease id; every heartbeat renews
// it; a lease not renewed for `lease_ttl` expires at the next Expire() call,
// the worker becomes LOST and its job attempt, if any, fails. A second
// registration of a worker id is ALREADY_EXISTS while its lease lives (two
// processes must not share an id) and replaces it once expired.
//
// Thread-safe; Next() blocks its caller (a gRPC stream handler). Time comes
// from an injected clock so that tests control expiry.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muonmesh/v1/fleet.pb.h"

namespace muonmesh::coordinator {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
};

// The real clock.
class SystemClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
};

inline constexpr size_t kMaxWorkerIdBytes = 128;
inline constexpr size_t kMaxWorkers = 65536;
// A worker blamed for two failed attempts within this window is quarantined
// (Fleet::Blame), by default for kDefaultQuarantine (--quarantine).
inline constexpr absl::Duration kBlameWindow = absl::Hours(1);
inline constexpr absl::Duration kDefaultQuarantine = absl::Minutes(10);

class Fleet {
 public:
  // `clock` must outlive the fleet.
  Fleet(Clock* clock, absl::Duration lease_ttl, absl::Duration heartbeat_interval);

  struct Lease {
    std::string lease_id;
    absl::Duration ttl;
    absl::Duration heartbeat_interval;
  };
  // InvalidArgument naming the field for a bad worker id, device or
  // address; AlreadyExists while another registration of the id lives
  // (but not one told to leave: its id is free at once)
  // (unless `lease_id` is that registration's: then it is renewed, the
  // worker keeping its state and job); ResourceExhausted beyond kMaxWorkers
  // when none of them is lost (else the one lost longest ago is forgotten
  // to make room). With `running`, a new registration starts BUSY with that
  // job and rank (a worker that kept its rank through a coordinator
  // restart; the JobManager decides whether it keeps it).
  absl::StatusOr<Lease> Register(const v1::WorkerInfo& info, const std::string& lease_id = "",
                                 const v1::RunningRank* running = nullptr);

  // NotFound for an unknown worker; FailedPrecondition for a lease that is
  // not the worker's current live one. `*leave` (if given): the worker is
  // drained and idle.
  absl::Status Heartbeat(const std::string& worker_id, const std::string& lease_id,
                         bool* leave = nullptr);

  // Takes the worker out of service: Take skips it from now on, List shows
  // it DRAINING. Returns it as List would (its job, if busy). NotFound for
  // an unknown worker, FailedPrecondition for a lost one.
  absl::StatusOr<v1::Worker> Drain(const std::string& worker_id);
  // Forgets a LOST worker, one whose lease ran out (its job, if any, is
  // reported lost by Expire as if it were still listed). NotFound for an
  // unknown worker, FailedPrecondition for a live one.
  absl::Status Remove(const std::string& worker_id);
  absl::Status CheckLease(const std::string& worker_id, const std::string& lease_id) const;

  // How long a LOST worker stays listed before Expire forgets it (a scaled
  // down fleet, fake or crash-looping registrations); zero: until a full
  // fleet needs its place.
  void ForgetLostAfter(absl::Duration after);

  // Marks every worker whose lease ran out LOST and returns them (with the
  // job and rank they held, if any), and those that registered again after
  // their lease ran out but before this call (their old job is lost too);
  // forgets the workers LOST longer than ForgetLostAfter, and those told to
  // leave (drained; Heartbeat's `leave`) whose lease ran out: they left,
  // and are never LOST.
  struct Lost {
    std::string worker_id;
    std::string job_id;
    absl::Time last_heard;  // its last registration or heartbeat: the fault came after
  };
  std::vector<Lost> Expire();

  // Idle workers of `device` available now.
  int64_t IdleCount(const std::string& device) const;
  // Takes `n` idle workers of `device` for `job_id`, or none if fewer are
  // idle: those not blamed lately first, in registration order; rank i is
  // the i-th of them by locality (WorkerInfo.locality), then that order.
  std::optional<std::vector<std::string>> Take(const std::string& device, int64_t n,
                                               const std::string& job_id);
  // The worker is idle again (its attempt ended); no-op unless it is busy
  // with `job_id`.
  void Release(const std::string& worker_id, const std::string& job_id);

  // Queues an assignment for the worker (dropped if it is not registered);
  // `shared`, when given, is merged into its start as it is sent.
  void Push(const std::string& worker_id, v1::Assignment assignment,
            std::shared_ptr<const v1::StartRank> shared = nullptr);
  // The worker's next assignment, waiting up to `wait`. Nullopt on timeout;
  // FailedPrecondition when the lease is no longer live (the stream ends);
  // Cancelled when `cancelled` says so or the fleet shuts down.
  absl::StatusOr<std::optional<v1::Assignment>> Next(const std::string& worker_id,
                                                     const std::string& lease_id,
                                                     absl::Duration wait,
                                                     const std::function<bool()>& cancelled);

  // A failed attempt is blamed on the worker (its peers could not reach
  // it; `why` says so). Blamed twice within kBlameWindow, it is quarantined
  // for QuarantineFor's time (default kDefaultQuarantine): Take skips it,
  // List shows until when and why. Returns true when this blame quarantines
  // it. Take prefers workers with no blame in the window.
  bool Blame(const std::string& worker_id, const std::string& why);
  void QuarantineFor(absl::Duration d);
  // Workers quarantined now (the muonmesh_workers_quarantined gauge).
  int64_t QuarantinedCount() const;

  std::vector<v1::Worker> List() const;
  // What a listed worker registered with (lost ones too); nullopt if unknown.
  std::optional<v1::WorkerInfo> InfoOf(const std::string& worker_id) const;
  // The job a busy worker runs a rank of; empty when none (or unknown).
  std::string JobOf(const std::string& worker_id) const;
  void Shutdown();

 private:
  struct Entry {
    v1::WorkerInfo info;
    std::string lease_id;
    v1::WorkerState state = v1::WORKER_STATE_IDLE;
    std::string job_id;
    int32_t rank = -1;
    int64_t order = 0;  // registration order, for rank assignment
    bool draining = false;
    bool left = false;  // told to leave (drained and idle)
    absl::Time registered;
    absl::Time last_heartbeat;
    absl::Time lost_at;  // when Expire marked it LOST
    // Blame (Fleet::Blame): when it was blamed within kBlameWindow, and
    // until when it gets no new rank.
    std::deque<absl::Time> blamed;
    absl::Time quarantined_until = absl::InfinitePast();
    std::string quarantine_reason;
    // With what the assignment's start shares with the attempt's other
    // ranks (the spec and the plan, held once): merged in as it is sent.
    std::deque<std::pair<v1::Assignment, std::shared_ptr<const v1::StartRank>>> outbox;
  };
  bool Live(const Entry& e) const;
  // Idle, live, not draining nor quarantined, on `device`: may take a rank.
  bool Available(const Entry& e, const std::string& device) const;
  v1::Worker View(const Entry& e) const;
  absl::Status CheckLeaseLocked(const std::string& worker_id, const std::string& lease_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock& clock_;
  const absl::Duration lease_ttl_;
  const absl::Duration heartbeat_interval_;
  mutable absl::Mutex mu_;
  absl::Duration forget_lost_after_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Duration quarantine_ ABSL_GUARDED_BY(mu_) = kDefaultQuarantine;
  absl::CondVar changed_;
  std::map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);
  // Workers whose lease ran out while they held a job and who registered
  // again before Expire noticed: lost all the same, reported by the next
  // Expire.
  std::vector<Lost> lost_on_register_ ABSL_GUARDED_BY(mu_);
  int64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
  // Makes room for a registration in a full fleet: forgets the worker lost
  // longest ago (ids of crash-looping workers change with their pid, and
  // would otherwise fill the fleet for good). False if none is lost.
  bool EvictLostLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  int64_t next_lease_ = 1;
  std::random_device random_;  // the OS's generator (getrandom on Linux)
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace muonmesh::coordinator
