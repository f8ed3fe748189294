#include "proto/credentials/certificate_expiry.h"

#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"
#include "proto/credentials/credentials.h"

namespace muonmesh::credentials {

prometheus::MetricFamily CertificateExpiryFamily(const std::map<std::string, std::string>& files) {
  prometheus::MetricFamily expiry{
      "muonmesh_tls_certificate_expiry_timestamp_seconds",
      "When each TLS certificate this process uses expires (Unix seconds), read from its file "
      "at each scrape",
      prometheus::MetricType::Gauge,
      {}};
  for (const auto& [name, file] : files) {
    absl::StatusOr<PemFile> pem = LoadPemFile("certificate", file);
    absl::StatusOr<absl::Time> at =
        pem.ok() ? CertificateNotAfter(*pem) : absl::StatusOr<absl::Time>(pem.status());
    if (!at.ok()) continue;
    prometheus::ClientMetric m;
    m.gauge.value = absl::ToDoubleSeconds(*at - absl::UnixEpoch());
    m.label = {{"certificate", name}};
    expiry.metric.push_back(std::move(m));
  }
  return expiry;
}

}  // namespace muonmesh::credentials
