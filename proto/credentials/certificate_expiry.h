#pragma once

// muonmesh_tls_certificate_expiry_timestamp_seconds{certificate}: when each
// TLS certificate a process uses expires, in Unix seconds, read from its
// file at each scrape so that a renewed file shows at once (both binaries
// reload their certificates without a restart). The coordinator names its
// files "server" and "client_ca", a worker "client" and "ca"
// (docs/architecture.md §8); MuonmeshCertificateExpiring fires on either.

#include <map>
#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace muonmesh::credentials {

// The family for `files` (label value -> PEM file). A file that does not
// read as a certificate (being replaced, say) is left out of this scrape
// rather than reported wrong.
prometheus::MetricFamily CertificateExpiryFamily(const std::map<std::string, std::string>& files);

// The family as a collectable for an exposer. Immutable; any thread.
class CertificateExpiry final : public prometheus::Collectable {
 public:
  explicit CertificateExpiry(std::map<std::string, std::string> files) : files_(std::move(files)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    return {CertificateExpiryFamily(files_)};
  }

 private:
  const std::map<std::string, std::string> files_;
};

}  // namespace muonmesh::credentials
