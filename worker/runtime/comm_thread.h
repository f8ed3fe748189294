#pragma once

// Internal to worker/runtime/: Trainer::CommThread, the thread a step's
// communication runs on beside its compute (included by trainer_impl.h).

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {

// Communication on a thread of its own, while the caller computes
// (docs/architecture.md §5, "Overlap", "Prefetch" and "The after-step
// gather beside the next step"): jobs run one after another in the order
// they were pushed, the same on every rank. A job's collectives use groups
// the caller's thread leaves alone until the job is waited for (the reduce
// groups for the bucket reductions; the gather groups for the gather ahead,
// which the step's thread waits for before it gathers; the Muon domain
// groups for the early Muon gather, "Muon inside the backward pass"; the
// parameter groups for the after-step gathers).
class Trainer::CommThread {
 public:
  // Runs the job with `bytes` to count into; `failed` when a job before it
  // failed since the last Drain (a job then only hands its buffers back).
  using Job = std::function<absl::Status(StepReport* bytes, bool failed)>;

  // At most `capacity` jobs wait (Push blocks beyond). Await and Drain add
  // their waits to the report's `waited` phase; Drain adds the rest of the
  // jobs' time, spent beside the caller's work, to its `hidden` phase.
  CommThread(size_t capacity, absl::Duration PhaseTimes::*waited,
             absl::Duration PhaseTimes::*hidden)
      : capacity_(capacity), waited_(waited), hidden_(hidden), thread_([this] { Loop(); }) {}
  // Runs the jobs still queued, then stops.
  ~CommThread() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // Queues `job`; its ticket (1 for the first job pushed, then 2, ...), for
  // Await.
  uint64_t Push(Job job) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &CommThread::HasRoom));
    queue_.push_back(std::move(job));
    return ++pushed_;
  }

  // Waits until the job of `ticket` and those before it ran; adds the wait
  // to `report` (any thread; null: counted nowhere). The first error of the
  // jobs since the last Drain, which keeps it.
  absl::Status Await(uint64_t ticket, StepReport* report) {
    const absl::Time t0 = absl::Now();
    absl::MutexLock lock(&mu_);
    if (done_ >= ticket) return status_;
    Awaiting awaiting{this, ticket};
    mu_.Await(absl::Condition(&CommThread::Reached, &awaiting));
    const absl::Duration waited = absl::Now() - t0;
    if (report != nullptr) report->times.*waited_ += waited;
    awaited_ += waited;
    return status_;
  }

  // Waits until every pushed job ran; adds their bytes and times to
  // `report` (see the constructor). Their first error, then forgotten.
  absl::Status Drain(StepReport* report) {
    const absl::Time t0 = absl::Now();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &CommThread::Idle));
    const absl::Duration waited = absl::Now() - t0;
    report->times.*waited_ += waited;
    report->times.*hidden_ += std::max(absl::ZeroDuration(), busy_ - waited - awaited_);
    busy_ = absl::ZeroDuration();
    awaited_ = absl::ZeroDuration();
    for (const auto& [name, bytes] : local_.bytes_sent) report->bytes_sent[name] += bytes;
    local_.bytes_sent.clear();
    return std::exchange(status_, absl::OkStatus());
  }

 private:
  bool HasRoom() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.size() < capacity_; }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !running_; }
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }
  struct Awaiting {
    const CommThread* thread;
    uint64_t ticket;
  };
  // (Called with mu_ held, by Await's condition.)
  static bool Reached(Awaiting* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return a->thread->done_ >= a->ticket;
  }

  void Loop() {
    while (true) {
      Job job;
      bool failed = false;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &CommThread::Woken));
        if (queue_.empty()) return;  // stopped
        job = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
        failed = !status_.ok();
      }
      const absl::Time t0 = absl::Now();
      StepReport bytes;
      absl::Status st = job(&bytes, failed);
      absl::MutexLock lock(&mu_);
      running_ = false;
      ++done_;
      busy_ += absl::Now() - t0;
      for (const auto& [name, n] : bytes.bytes_sent) local_.bytes_sent[name] += n;
      if (status_.ok()) status_ = std::move(st);
    }
  }

  const size_t capacity_;
  absl::Duration PhaseTimes::*const waited_;
  absl::Duration PhaseTimes::*const hidden_;
  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t pushed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Duration busy_ ABSL_GUARDED_BY(mu_);
  absl::Duration awaited_ ABSL_GUARDED_BY(mu_);  // by Await since the last Drain
  StepReport local_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace muonmesh::worker
