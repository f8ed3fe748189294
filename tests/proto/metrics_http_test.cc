// The HTTP port of both binaries: /healthz and /readyz answer 200 "ok" or
// 503 with the reason their checks give, over a real socket, beside
// /metrics; a port with no checks set is live but not ready; a check being
// cleared waits for one running now.

#include "proto/http/metrics_http.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "tests/testing/http_get.h"

namespace muonmesh::http {
namespace {

using muonmesh::testing::HttpGet;
using ::testing::HasSubstr;

TEST(MetricsHttpTest, HealthAndReadinessFollowTheirChecks) {
  absl::StatusOr<std::unique_ptr<MetricsHttp>> http = MetricsHttp::Serve("127.0.0.1:0");
  ASSERT_TRUE(http.ok()) << http.status();
  const int port = (*http)->port();
  ASSERT_GT(port, 0);
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("probe_test_total").Help("h").Register(*registry).Add({});
  (*http)->exposer().RegisterCollectable(registry);

  std::string status;
  EXPECT_EQ(HttpGet(port, "/healthz", &status), "ok\n");
  EXPECT_THAT(status, HasSubstr("200"));
  EXPECT_EQ(HttpGet(port, "/readyz", &status), "starting\n");
  EXPECT_THAT(status, HasSubstr("503"));

  std::atomic<bool> ready{false};
  (*http)->SetChecks([] { return absl::OkStatus(); },
                     [&] {
                       return ready ? absl::OkStatus()
                                    : absl::UnavailableError("not registered with the coordinator");
                     });
  EXPECT_EQ(HttpGet(port, "/readyz", &status), "not registered with the coordinator\n");
  EXPECT_THAT(status, HasSubstr("503"));
  ready = true;
  EXPECT_EQ(HttpGet(port, "/readyz", &status), "ok\n");
  EXPECT_THAT(status, HasSubstr("200"));
  (*http)->SetChecks([] { return absl::UnavailableError("the job manager is stuck"); }, nullptr);
  EXPECT_EQ(HttpGet(port, "/healthz", &status), "the job manager is stuck\n");
  EXPECT_THAT(status, HasSubstr("503"));
  // /metrics is still the Exposer's; other paths are not found.
  EXPECT_THAT(HttpGet(port, "/metrics", &status), HasSubstr("probe_test_total 0"));
  EXPECT_THAT(status, HasSubstr("200"));
  HttpGet(port, "/healthzz", &status);
  EXPECT_THAT(status, HasSubstr("404"));
}

TEST(MetricsHttpTest, ClearingWaitsForARunningCheck) {
  absl::StatusOr<std::unique_ptr<MetricsHttp>> http = MetricsHttp::Serve("127.0.0.1:0");
  ASSERT_TRUE(http.ok()) << http.status();
  absl::Notification entered, release;
  std::atomic<bool> finished{false};
  (*http)->SetChecks(nullptr, [&] {
    entered.Notify();
    release.WaitForNotification();
    finished = true;
    return absl::OkStatus();
  });
  std::thread probe([&] { HttpGet((*http)->port(), "/readyz"); });
  entered.WaitForNotification();
  std::thread clear([&] { (*http)->ClearChecks(); });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(finished);
  release.Notify();
  clear.join();
  EXPECT_TRUE(finished);  // ClearChecks returned only after the check did
  probe.join();
  std::string status;
  EXPECT_EQ(HttpGet((*http)->port(), "/readyz", &status), "starting\n");
}

TEST(MetricsHttpTest, AnAddressInUseIsRefusedNamingIt) {
  absl::StatusOr<std::unique_ptr<MetricsHttp>> first = MetricsHttp::Serve("127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string taken = "127.0.0.1:" + std::to_string((*first)->port());
  absl::StatusOr<std::unique_ptr<MetricsHttp>> second = MetricsHttp::Serve(taken);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("--metrics-listen " + taken));
}

}  // namespace
}  // namespace muonmesh::http
