#pragma once

// The HTTP port of both binaries (--metrics-listen): /metrics (Prometheus's
// text format, prometheus-cpp's Exposer), and /healthz and /readyz for
// Kubernetes probes, which unlike the kubelet's gRPC probe work whatever
// TLS the gRPC port uses (docs/architecture.md §8). Each answers 200 "ok"
// or 503 with the reason, as text:
//   /healthz  the process answers and its check passes (the coordinator:
//             its job manager is not stuck);
//   /readyz   it can do its work (the coordinator: its state database
//             answers, no state write failed, it serves gRPC; a worker: it
//             has registered and its lease is live).
// Until SetChecks, /healthz answers 200 and /readyz 503 "starting".

#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace muonmesh::http {

// muonmesh_build_info{binary, version} 1 in `registry`: which release each
// process serving metrics runs (a rollout's progress, a mixed fleet).
void RegisterBuildInfo(prometheus::Registry& registry, const std::string& binary);

class MetricsHttp {
 public:
  using Check = std::function<absl::Status()>;

  // Serves on `listen` ("HOST:PORT"; port 0 picks one). Unavailable naming
  // the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttp>> Serve(const std::string& listen);
  ~MetricsHttp();
  MetricsHttp(const MetricsHttp&) = delete;
  MetricsHttp& operator=(const MetricsHttp&) = delete;

  prometheus::Exposer& exposer() { return *exposer_; }
  int port() const { return port_; }

  // The checks behind /healthz and /readyz, called on the HTTP server's
  // threads (quick and thread-safe).
  void SetChecks(Check live, Check ready);
  // Drops them, waiting for any check running now: call it before what
  // they read goes away.
  void ClearChecks();

  // For the HTTP server: the answer to `path` on the server of `port`;
  // false when the path is not one of these.
  static bool Answer(int port, const std::string& path, int* code, std::string* body);

 private:
  MetricsHttp() = default;
  bool AnswerHere(const std::string& path, int* code, std::string* body);

  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  absl::Mutex mu_;
  Check live_ ABSL_GUARDED_BY(mu_);
  Check ready_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muonmesh::http
