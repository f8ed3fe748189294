#include "proto/http/metrics_http.h"

#include <CivetServer.h>
#include <civetweb.h>

#include <cstring>
#include <exception>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "prometheus/gauge.h"
#include "proto/rpc/version.h"

namespace muonmesh::http {
namespace {

// The servers of this process by port: civetweb's callbacks carry no
// pointer of ours (CivetServer keeps its context's user data).
absl::Mutex registry_mu(absl::kConstInit);
// Readers (Answer) hold registry_mu shared; Serve and the destructor, exclusively.
absl::flat_hash_map<int, MetricsHttp*>& Registry() ABSL_SHARED_LOCKS_REQUIRED(registry_mu) {
  static auto* servers = new absl::flat_hash_map<int, MetricsHttp*>();
  return *servers;
}

// Answers /healthz and /readyz before civetweb looks for a handler (the
// Exposer's own handlers serve /metrics).
int BeginRequest(mg_connection* connection) {
  const mg_request_info* info = mg_get_request_info(connection);
  if (info == nullptr || info->local_uri == nullptr) return 0;
  int code = 0;
  std::string body;
  if (!MetricsHttp::Answer(info->server_port, info->local_uri, &code, &body)) return 0;
  mg_printf(connection,
            "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
            "Content-Length: %zu\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
            code, code == 200 ? "OK" : "Service Unavailable", body.size());
  if (std::strcmp(info->request_method, "HEAD") != 0) {
    mg_write(connection, body.data(), body.size());
  }
  return code;
}

const CivetCallbacks& Callbacks() {
  static const CivetCallbacks* callbacks = [] {
    auto* c = new CivetCallbacks();  // all unset
    c->begin_request = BeginRequest;
    return c;
  }();
  return *callbacks;
}

}  // namespace

void RegisterBuildInfo(prometheus::Registry& registry, const std::string& binary) {
  prometheus::BuildGauge()
      .Name("muonmesh_build_info")
      .Help("The muonmesh release this process runs (always 1)")
      .Register(registry)
      .Add({{"binary", binary}, {"version", rpc::Version()}})
      .Set(1);
}

absl::StatusOr<std::unique_ptr<MetricsHttp>> MetricsHttp::Serve(const std::string& listen) {
  std::unique_ptr<MetricsHttp> http(new MetricsHttp());
  try {
    http->exposer_ = std::make_unique<prometheus::Exposer>(listen, 1, &Callbacks());
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen ", listen, ": cannot serve metrics: ", e.what()));
  }
  const std::vector<int> ports = http->exposer_->GetListeningPorts();
  http->port_ = ports.empty() ? 0 : ports.front();
  absl::MutexLock lock(&registry_mu);
  Registry()[http->port_] = http.get();
  return http;
}

MetricsHttp::~MetricsHttp() {
  {
    absl::MutexLock lock(&registry_mu);
    auto it = Registry().find(port_);
    if (it != Registry().end() && it->second == this) Registry().erase(it);
  }
  ClearChecks();
  exposer_.reset();  // stops the server's threads
}

void MetricsHttp::SetChecks(Check live, Check ready) {
  absl::MutexLock lock(&mu_);
  live_ = std::move(live);
  ready_ = std::move(ready);
}

void MetricsHttp::ClearChecks() { SetChecks(nullptr, nullptr); }

bool MetricsHttp::Answer(int port, const std::string& path, int* code, std::string* body) {
  if (path != "/healthz" && path != "/readyz") return false;
  // Held while the check runs: a server being destroyed waits for it.
  absl::ReaderMutexLock lock(&registry_mu);
  auto it = Registry().find(port);
  if (it == Registry().end()) {
    *code = 503;
    *body = "starting\n";
    return true;
  }
  return it->second->AnswerHere(path, code, body);
}

bool MetricsHttp::AnswerHere(const std::string& path, int* code, std::string* body) {
  absl::ReaderMutexLock lock(&mu_);
  const Check& check = path == "/healthz" ? live_ : ready_;
  absl::Status status = absl::OkStatus();
  if (check) {
    status = check();
  } else if (path == "/readyz") {
    status = absl::UnavailableError("starting");
  }
  *code = status.ok() ? 200 : 503;
  *body = status.ok() ? std::string("ok\n") : absl::StrCat(status.message(), "\n");
  return true;
}

}  // namespace muonmesh::http
