#pragma once

// Cooperative cancellation of the planner's long loops.
//
// A plan of a big model can take seconds; when its caller has gone (a gRPC
// deadline expired, the client hung up, the server is stopping) the work is
// wasted and holds a core. The planner calls Tick() in its loops; every
// `poll_every` ticks the token asks its owner's predicate whether to stop.
// Polling is by work done, never by clock, so a plan that is not cancelled
// is exactly the plan it would have been without a token.
//
// Owned by the caller of ComputePlan; used by the one thread that plans
// (not thread-safe). The predicate may be called from that thread only and
// may be slow-ish (a lock): it runs once per `poll_every` ticks.

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/status/status.h"

namespace muonmesh::plan {

class CancelToken {
 public:
  // About 10-50 microseconds of planner work between polls.
  static constexpr int64_t kDefaultPollEvery = 4096;

  // Never cancelled.
  CancelToken() = default;
  // Cancelled once `should_stop` returns true (then it stays cancelled).
  explicit CancelToken(std::function<bool()> should_stop,
                       int64_t poll_every = kDefaultPollEvery)
      : should_stop_(std::move(should_stop)),
        poll_every_(poll_every < 1 ? 1 : poll_every),
        until_poll_(poll_every_) {}

  // Counts `work` units; true when the planner must stop.
  bool Tick(int64_t work = 1) {
    if (cancelled_) return true;
    until_poll_ -= work;
    if (until_poll_ > 0) return false;
    until_poll_ = poll_every_;
    return Poll();
  }

  // Asks the predicate now; true when the planner must stop.
  bool Poll() {
    if (!cancelled_ && should_stop_ && should_stop_()) cancelled_ = true;
    return cancelled_;
  }

  bool cancelled() const { return cancelled_; }

  // What a cancelled planner returns.
  static absl::Status Status() { return absl::CancelledError("planning was cancelled"); }

 private:
  std::function<bool()> should_stop_;
  int64_t poll_every_ = kDefaultPollEvery;
  int64_t until_poll_ = kDefaultPollEvery;
  bool cancelled_ = false;
};

}  // namespace muonmesh::plan
