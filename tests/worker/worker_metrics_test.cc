// The worker's /metrics over real HTTP on loopback: the documented names,
// values that follow the steps reported, and text that promtool accepts.

#include "worker/worker_metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <cblas.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/http_get.h"
#include "muonmesh/config.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;

// Every phase timer set, to distinct values (the optimizer phase's in
// whole milliseconds, the others far larger so that counting one of them
// would show); two Muon rounds with their exchange waits.
StepReport Report(double loss) {
  StepReport r;
  r.loss = loss;
  r.times.param_gather = absl::Seconds(100);
  r.times.forward_backward = absl::Seconds(200);
  r.times.expert_dispatch = absl::Seconds(300);
  r.times.grad_reduce = absl::Seconds(400);
  r.times.adamw = absl::Milliseconds(1);
  r.times.muon_prepare = absl::Milliseconds(2);
  r.times.muon_gather = absl::Milliseconds(4);
  r.times.newton_schulz = absl::Milliseconds(8);
  r.times.muon_scatter = absl::Milliseconds(16);
  r.times.muon_apply = absl::Milliseconds(32);
  r.times.param_allgather_after_step = absl::Milliseconds(64);
  r.bytes_sent["param_allgather"] = 1000;
  r.bytes_sent["expert/muon_gather"] = 24;
  r.ns_flops = 5e6;
  MuonRound dense;
  dense.domain = "dense";
  dense.wait = absl::Milliseconds(3);
  MuonRound both;
  both.wave = 1;
  both.domain = "dense+expert";
  both.wait = absl::Milliseconds(5);
  r.muon_rounds = {dense, both};
  r.muon_exchange_calls = 6;
  return r;
}

// The value of the sample `series` (name and labels, as exposed) in `text`;
// NaN if absent.
double Sample(const std::string& text, const std::string& series) {
  const std::string prefix = "\n" + series + " ";
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(text.c_str() + at + prefix.size(), nullptr);
}

TEST(WorkerMetricsTest, ServesTheDocumentedMetrics) {
  // Load OpenBLAS, as a worker does: its 60 KiB of static TLS is what made
  // the metrics server's 100 KiB thread stacks overflow before
  // core/base/thread_stack.cc raised them.
  float one = 1.0f;
  EXPECT_EQ(cblas_sdot(1, &one, 1, &one, 1), 1.0f);
  absl::StatusOr<std::unique_ptr<WorkerMetrics>> m = WorkerMetrics::Serve("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_GT((*m)->port(), 0);
  (*m)->SetBusy(true);
  (*m)->OnStep("j-1", Report(0.5), absl::Milliseconds(20));
  (*m)->OnStep("j-1", Report(0.25), absl::Milliseconds(30));
  (*m)->OnAttemptEnd("j-0", "succeeded");
  std::string status;
  const std::string text = testing::HttpGet((*m)->port(), "/metrics", &status);
  EXPECT_THAT(status, HasSubstr("200"));
  EXPECT_THAT(text, HasSubstr("muonmesh_worker_steps_total{job_id=\"j-1\"} 2"));
  EXPECT_THAT(text, HasSubstr("muonmesh_worker_loss{job_id=\"j-1\"} 0.25"));
  EXPECT_THAT(text,
              HasSubstr("muonmesh_worker_collective_bytes_total{collective=\"param_allgather\""
                        ",job_id=\"j-1\"} 2000"));
  EXPECT_THAT(text,
              HasSubstr("muonmesh_worker_newton_schulz_flops_total{job_id=\"j-1\"} 10000000"));
  // The optimizer phase: adamw .. param_allgather_after_step, 1+2+...+64 ms
  // a step, twice; the Muon rounds' exchange waits: 3+5 ms a step, twice.
  EXPECT_NEAR(Sample(text, "muonmesh_worker_optimizer_seconds_total{job_id=\"j-1\"}"), 2 * 0.127,
              1e-12);
  EXPECT_NEAR(Sample(text, "muonmesh_worker_muon_exchange_wait_seconds_total{job_id=\"j-1\"}"),
              2 * 0.008, 1e-12);
  EXPECT_THAT(text, HasSubstr("muonmesh_worker_busy 1"));
  EXPECT_THAT(text, HasSubstr(std::string("muonmesh_build_info{binary=\"worker\",version=\"") +
                              MUONMESH_VERSION + "\"} 1"));
  EXPECT_THAT(text, HasSubstr("muonmesh_worker_attempts_total{outcome=\"succeeded\"} 1"));
  EXPECT_THAT(
      text,
      HasSubstr("muonmesh_worker_step_duration_seconds_count{job_id=\"j-1\",phase=\"step\"} 2"));
  EXPECT_THAT(
      text,
      HasSubstr("muonmesh_worker_step_duration_seconds_sum{job_id=\"j-1\",phase=\"step\"} 0.05"));

  // A job's series go when its rank ends.
  (*m)->OnAttemptEnd("j-1", "stopped");
  EXPECT_THAT(testing::HttpGet((*m)->port(), "/metrics"),
              ::testing::Not(HasSubstr("job_id=\"j-1\"")));

  // promtool (Debian's prometheus package, installed by the test setup)
  // checks the exposition format and naming conventions.
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed";
  }
  const std::string file = ::testing::TempDir() + "/worker_metrics.txt";
  std::ofstream(file) << text;
  const std::string command = "promtool check metrics < " + file + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int rc = ::pclose(pipe);
  EXPECT_EQ(rc, 0) << out;
}

TEST(WorkerMetricsTest, ABoundPortIsAClearError) {
  absl::StatusOr<std::unique_ptr<WorkerMetrics>> first = WorkerMetrics::Serve("127.0.0.1:0");
  ASSERT_TRUE(first.ok());
  const std::string taken = "127.0.0.1:" + std::to_string((*first)->port());
  absl::StatusOr<std::unique_ptr<WorkerMetrics>> second = WorkerMetrics::Serve(taken);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(taken));
}

}  // namespace
}  // namespace muonmesh::worker
