#pragma once

// A rendezvous Store over the coordinator's Store service (muonmesh.v1.Store):
// how the ranks of a job attempt scheduled by the coordinator find each
// other. Keys live in the attempt's scope (job id and attempt), so attempts
// never see each other's keys.
//
// Each call is one RPC with a deadline: the wait's timeout plus
// kRpcSlack for Get and Wait, kRpcSlack alone for Set. A coordinator that
// cannot be reached (Unavailable: it restarts) is waited for, within the
// call's timeout (kOutage for Set); once it answers again, every key this
// store set is set again before the call is retried, since a restarted
// coordinator's store starts empty and the ranks still meeting need them.
// The server's other codes pass through.
//
// Thread-safe; the channel is shared and must outlive it.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "muonmesh/v1/store.grpc.pb.h"
#include "worker/comm/abort.h"
#include "worker/comm/store.h"

namespace muonmesh::comm {

class GrpcStore final : public Store, public Abortable {
 public:
  static constexpr absl::Duration kRpcSlack = absl::Seconds(10);
  // How long a Set waits for a coordinator that is away.
  static constexpr absl::Duration kOutage = absl::Seconds(60);

  // `outage`: how long a Set waits for an unreachable coordinator.
  GrpcStore(std::shared_ptr<grpc::Channel> channel, std::string job_id, int attempt,
            absl::Duration outage = kOutage);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;

  // Sets every key this store set again, within `within`: a rank that made
  // no store call while the coordinator was away never saw it restart
  // empty, so its worker calls this when it registers again under the new
  // coordinator (the peers still meeting need those keys). A key set again
  // with its value is no change for a coordinator that kept it.
  absl::Status SetAgain(absl::Duration within);

  // Ends the calls in progress (their RPCs cancelled) and refuses later
  // ones: Cancelled, naming `reason` (a rank told to stop while it waits
  // for peers that will not come). Any thread.
  void Abort(const std::string& reason) override;

 private:
  // Registers an RPC's context while it runs, so Abort can cancel it; false
  // (and not registered) once aborted.
  bool Enter(grpc::ClientContext* context);
  void Leave(grpc::ClientContext* context);
  bool IsAborted();
  absl::Status Aborted(absl::string_view what);

  // `call` (one RPC, given its deadline) until it answers otherwise than
  // Unavailable or `deadline` passes; after an Unavailable, the keys set so
  // far are set again first.
  absl::Status Call(absl::Time deadline, const char* what,
                    const std::function<grpc::Status(grpc::ClientContext&)>& call);
  grpc::Status SetOnce(const v1::StoreSetRequest& request, absl::Time deadline);

  std::unique_ptr<v1::Store::Stub> stub_;
  v1::StoreScope scope_;
  const absl::Duration outage_;
  absl::Mutex mu_;
  std::vector<v1::StoreSetRequest> written_ ABSL_GUARDED_BY(mu_);
  std::optional<std::string> aborted_ ABSL_GUARDED_BY(mu_);
  std::vector<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muonmesh::comm
