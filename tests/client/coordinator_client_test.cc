// CoordinatorClient against a scripted Jobs service on 127.0.0.1:0: its page
// loops end on a server that never stops handing out page tokens (a broken
// or hostile coordinator), with an error instead of looping for ever.

#include "client/coordinator_client.h"

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/jobs.grpc.pb.h"

namespace muonmesh::client {
namespace {

using ::testing::HasSubstr;

// Every page holds one item and names a next page: the same token each
// time (`repeat`), or always a new one.
class EndlessJobs final : public v1::Jobs::Service {
 public:
  explicit EndlessJobs(bool repeat) : repeat_(repeat) {}
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse* response) override {
    response->add_jobs()->set_id("j-1");
    response->set_next_page_token(repeat_ ? "again" : absl::StrCat("t", ++pages_));
    return grpc::Status::OK;
  }
  grpc::Status GetJobMetrics(grpc::ServerContext*, const v1::GetJobMetricsRequest*,
                             v1::GetJobMetricsResponse* response) override {
    response->add_records()->set_step(0);
    response->set_next_page_token(repeat_ ? "again" : absl::StrCat("t", ++pages_));
    return grpc::Status::OK;
  }

 private:
  const bool repeat_;
  std::atomic<int64_t> pages_{0};
};

class PageLoopTest : public ::testing::TestWithParam<bool> {};

TEST_P(PageLoopTest, AServerThatNeverEndsItsPagesIsAnError) {
  EndlessJobs service(GetParam());
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  CoordinatorClientOptions options;
  options.max_pages = 2000;
  CoordinatorClient client(absl::StrCat("127.0.0.1:", port), options);
  // On its own thread with a deadline: a client that loops for ever fails
  // the test instead of hanging it.
  auto list = std::async(std::launch::async, [&] { return client.List({}, "").status(); });
  auto metrics =
      std::async(std::launch::async, [&] { return client.Metrics("j-1", 0, -1, false).status(); });
  for (auto* f : {&list, &metrics}) {
    if (f->wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      ADD_FAILURE() << "the client is still paging after 60 s";
      std::_Exit(1);
    }
    const absl::Status s = f->get();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("page"));
  }
  server->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(Tokens, PageLoopTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Repeated" : "Endless"; });

}  // namespace
}  // namespace muonmesh::client
