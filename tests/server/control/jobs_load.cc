// Load generator for the coordinator's read path: N concurrent clients, each
// with its own channel, calling GetJob, ListJobs and GetJobMetrics (a page of
// 16 step records) in turn on one job for a fixed time: as fast as each can
// (closed loop), or each at --rate calls per second on a fixed schedule. Prints calls, calls per second
// and latency percentiles per method and overall, one `key=value` line each,
// for tests/server/control/load_benchmark.sh.
//
//   jobs_load --coordinator HOST:PORT --job J [--clients 64] [--seconds 10]
//             [--rate CALLS_PER_SECOND_PER_CLIENT (0: as fast as it can)]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "muonmesh/v1/jobs.grpc.pb.h"

namespace {

struct Samples {
  std::vector<double> ms;
  int64_t errors = 0;
};

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  std::string address;
  std::string job;
  int64_t clients = 64;
  int64_t seconds = 10;
  double rate = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--coordinator") address = value;
    else if (flag == "--job") job = value;
    else if (flag == "--clients") (void)absl::SimpleAtoi(value, &clients);
    else if (flag == "--seconds") (void)absl::SimpleAtoi(value, &seconds);
    else if (flag == "--rate") (void)absl::SimpleAtod(value, &rate);
  }
  if (address.empty() || job.empty() || clients < 1 || seconds < 1 || !(rate >= 0)) {
    std::fprintf(stderr, "usage: jobs_load --coordinator HOST:PORT --job J [--clients 64] "
                         "[--seconds 10] [--rate 0]\n");
    return 2;
  }
  const char* kMethods[] = {"GetJob", "ListJobs", "GetJobMetrics"};
  std::vector<std::map<std::string, Samples>> per_client(clients);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  std::vector<std::thread> threads;
  for (int64_t c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      grpc::ChannelArguments args;
      args.SetInt("grpc.use_local_subchannel_pool", 1);  // one connection per client
      auto stub = muonmesh::v1::Jobs::NewStub(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
      // Paced clients start spread over one period, so calls do not come in bursts.
      const auto period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(rate > 0 ? 1.0 / rate : 0.0));
      auto next = std::chrono::steady_clock::now() + period * c / clients;
      for (int64_t n = 0; std::chrono::steady_clock::now() < end; ++n) {
        if (rate > 0) {
          std::this_thread::sleep_until(next);
          next += period;
          if (std::chrono::steady_clock::now() >= end) break;
        }
        const char* method = kMethods[(n + c) % 3];
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        const auto start = std::chrono::steady_clock::now();
        grpc::Status s;
        if (method == kMethods[0]) {
          muonmesh::v1::GetJobRequest r;
          r.set_job_id(job);
          muonmesh::v1::Job out;
          s = stub->GetJob(&context, r, &out);
        } else if (method == kMethods[1]) {
          muonmesh::v1::ListJobsRequest r;
          r.set_page_size(20);
          muonmesh::v1::ListJobsResponse out;
          s = stub->ListJobs(&context, r, &out);
        } else {
          muonmesh::v1::GetJobMetricsRequest r;
          r.set_job_id(job);
          r.set_page_size(16);
          muonmesh::v1::GetJobMetricsResponse out;
          s = stub->GetJobMetrics(&context, r, &out);
        }
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count();
        Samples& samples = per_client[c][method];
        if (s.ok()) {
          samples.ms.push_back(ms);
        } else {
          ++samples.errors;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::map<std::string, Samples> all;
  for (const auto& client : per_client) {
    for (const auto& [method, s] : client) {
      for (const char* key : {method.c_str(), "all"}) {
        Samples& into = all[key];
        into.ms.insert(into.ms.end(), s.ms.begin(), s.ms.end());
        into.errors += s.errors;
      }
    }
  }
  for (auto& [method, s] : all) {
    std::printf("method=%s calls=%zu errors=%lld rps=%.0f p50_ms=%.3f p99_ms=%.3f\n",
                method.c_str(), s.ms.size(), static_cast<long long>(s.errors),
                static_cast<double>(s.ms.size()) / static_cast<double>(seconds),
                Percentile(s.ms, 0.50), Percentile(s.ms, 0.99));
  }
  return 0;
}
