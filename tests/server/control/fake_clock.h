#pragma once

// A Clock (server/control/fleet.h) that moves only when a test advances it,
// for the control plane's unit tests (leases, waits, recovery times).

#include "absl/time/time.h"
#include "server/control/fleet.h"

namespace muonmesh::coordinator {

class FakeClock final : public Clock {
 public:
  absl::Time Now() override { return now_; }
  void Advance(absl::Duration d) { now_ += d; }

 private:
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

}  // namespace muonmesh::coordinator
