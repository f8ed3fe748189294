// The control plane end to end in one process: a real gRPC server with the
// Jobs, Fleet and Store services on 127.0.0.1:0, real worker daemons (on
// threads) that register, take assignments and train over Gloo, and clients
// through the generated stubs. The final weights of a job run through the
// coordinator are byte-identical to the standalone launcher's.

#include "server/control/control_plane.h"

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "muonmesh/v1/jobs.grpc.pb.h"
#include "muonmesh/v1/store.grpc.pb.h"
#include "proto/io/message_file.h"
#include "proto/job/allowed_dirs.h"
#include "tests/testing/http_get.h"
#include "worker/daemon.h"
#include "worker/standalone.h"

namespace muonmesh::coordinator {
namespace {

using ::testing::HasSubstr;

std::string Fresh(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/control_plane_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// An mlp job; paths absolute under `dir`.
std::string JobYaml(const std::string& dir, const std::string& name, int world, int steps,
                    const std::string& strategy = "optim_grads_params") {
  return absl::StrCat("name: ", name, "\nworld_size: ", world,
                      "\nparallelism: {data_parallel_sharding_strategy: ", strategy, "}\n",
                      "model: {mlp: {dims: [6, 16, 16, 3]}}\ninit: {seed: 5}\n"
                      "data: {teacher: {seed: 21, samples: 256}}\n"
                      "optimizer: {adamw: {eps: 0.05}}\n"
                      "training: {steps: ", steps, ", global_batch_size: 24}\n",
                      "output: {dir: ", dir, "/", name, ", export: ", dir, "/", name,
                      "/final.safetensors}\n");
}

v1::JobSpec Spec(const std::string& yaml) {
  v1::JobSpec spec;
  absl::Status st = protoio::ParseMessageText(yaml, "job", &spec);
  EXPECT_TRUE(st.ok()) << st;
  return spec;
}

class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = Fresh(::testing::UnitTest::GetInstance()->current_test_info()->name());
    ControlPlaneOptions options;
    options.data_dir = dir_ + "/state";
    options.collective_timeout = absl::Seconds(20);
    options.metrics_listen = "127.0.0.1:0";
    Configure(options);
    absl::StatusOr<std::unique_ptr<ControlPlane>> plane = ControlPlane::Start(options);
    ASSERT_TRUE(plane.ok()) << plane.status();
    plane_ = *std::move(plane);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    for (grpc::Service* s : plane_->services()) builder.RegisterService(s);
    builder.experimental().SetInterceptorCreators(plane_->interceptor_factories());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port_);
    auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    jobs_ = v1::Jobs::NewStub(channel);
    fleet_ = v1::Fleet::NewStub(channel);
  }
  // Changes the options before the control plane starts.
  virtual void Configure(ControlPlaneOptions&) {}

  void TearDown() override {
    stop_ = true;
    for (std::thread& t : daemons_) t.join();
    plane_->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    server_.reset();
    plane_.reset();
  }

  void StartWorkers(int n) {
    for (int i = 0; i < n; ++i) {
      const int id = static_cast<int>(daemons_.size());
      daemons_.emplace_back([this, id] {
        worker::DaemonOptions o;
        o.coordinator = address_;
        o.worker_id = absl::StrCat("w", id);
        o.memory_budget_bytes = int64_t{1} << 30;
        o.stop = &stop_;
        absl::Status st = worker::RunDaemon(o, [](const std::string&) {});
        EXPECT_TRUE(st.ok()) << st;
      });
    }
  }

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, const std::string& request_id = "") {
    v1::SubmitJobRequest request;
    request.set_request_id(request_id);
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status s = jobs_->SubmitJob(&context, request, &response);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return response.job();
  }

  // Every event of the job from `from`, until it ends or `seconds` pass.
  std::vector<v1::JobEvent> Watch(const std::string& id, int64_t from, int seconds = 120) {
    v1::WatchJobRequest request;
    request.set_job_id(id);
    request.set_from_index(from);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
    auto reader = jobs_->WatchJob(&context, request);
    std::vector<v1::JobEvent> events;
    v1::JobEvent e;
    while (reader->Read(&e)) events.push_back(e);
    reader->Finish();
    return events;
  }

  v1::Job Get(const std::string& id) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    grpc::ClientContext context;
    EXPECT_TRUE(jobs_->GetJob(&context, request, &job).ok());
    return job;
  }

  std::vector<v1::Worker> Workers() {
    v1::ListWorkersResponse response;
    grpc::ClientContext context;
    EXPECT_TRUE(fleet_->ListWorkers(&context, {}, &response).ok());
    return {response.workers().begin(), response.workers().end()};
  }

  std::string dir_;
  std::unique_ptr<ControlPlane> plane_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<v1::Jobs::Stub> jobs_;
  std::unique_ptr<v1::Fleet::Stub> fleet_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> daemons_;
};

TEST_F(ControlPlaneTest, AJobRunsToTheStandaloneLaunchersExactWeights) {
  StartWorkers(2);
  absl::StatusOr<v1::Job> job = Submit(Spec(JobYaml(dir_, "hfsdp", 2, 6)), "req-1");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::vector<v1::JobEvent> events = Watch(job->id(), 0);
  ASSERT_FALSE(events.empty());
  std::vector<v1::JobState> states;
  int steps = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].index(), static_cast<int64_t>(i + 1)) << "gapless from 1";
    if (events[i].has_state_change()) states.push_back(events[i].state_change().state());
    if (events[i].has_step()) {
      EXPECT_EQ(events[i].step().step(), steps++);
      EXPECT_TRUE(std::isfinite(events[i].step().loss()));
    }
  }
  EXPECT_EQ(steps, 6);
  EXPECT_THAT(states, ::testing::ElementsAre(v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING,
                                             v1::JOB_STATE_SUCCEEDED));
  const v1::Job done = Get(job->id());
  EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(done.steps_done(), 6);

  // Watching again from the middle resumes without gaps or duplicates.
  const std::vector<v1::JobEvent> tail = Watch(job->id(), 4);
  ASSERT_EQ(tail.size(), events.size() - 3);
  EXPECT_EQ(tail.front().index(), 4);
  // From past its end, the watch of the ended job ends by itself, empty (it
  // used to run into the client's deadline).
  {
    v1::WatchJobRequest request;
    request.set_job_id(job->id());
    request.set_from_index(events.back().index() + 10);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = jobs_->WatchJob(&context, request);
    v1::JobEvent e;
    EXPECT_FALSE(reader->Read(&e));
    const grpc::Status end = reader->Finish();
    EXPECT_TRUE(end.ok()) << end.error_code() << ": " << end.error_message();
  }

  // The same job through the standalone launcher, two ranks on threads.
  const std::string alone = Fresh("standalone_twin");
  const std::string file = alone + "/job.yaml";
  std::ofstream(file) << JobYaml(alone, "hfsdp", 2, 6);
  std::filesystem::create_directories(alone + "/store");
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      worker::StandaloneOptions o;
      o.job_path = file;
      o.rank = r;
      o.world_size = 2;
      o.store_dir = alone + "/store";
      o.memory_budget_bytes = int64_t{1} << 30;
      absl::Status st = worker::RunStandalone(o, [](const std::string&) {});
      EXPECT_TRUE(st.ok()) << st;
    });
  }
  for (std::thread& t : ranks) t.join();
  const std::string served = ReadAll(dir_ + "/hfsdp/final.safetensors");
  ASSERT_FALSE(served.empty());
  EXPECT_EQ(served, ReadAll(alone + "/hfsdp/final.safetensors"));

  // The coordinator's metrics saw all of it.
  const std::string text = testing::HttpGet(plane_->metrics_port(), "/metrics");
  EXPECT_THAT(text, HasSubstr("muonmesh_jobs{state=\"SUCCEEDED\"} 1"));
  EXPECT_THAT(text, HasSubstr("muonmesh_jobs{state=\"PENDING\"} 0"));
  EXPECT_THAT(text, HasSubstr("muonmesh_workers{device=\"cpu\",state=\"IDLE\"} 2"));
  EXPECT_THAT(text, HasSubstr("muonmesh_workers_quarantined 0"));
  EXPECT_THAT(text, HasSubstr("muonmesh_job_steps_total 6"));
  EXPECT_THAT(text, HasSubstr("muonmesh_job_step_duration_seconds_count 6"));
  EXPECT_THAT(text, HasSubstr("muonmesh_rpc_duration_seconds_count{code=\"OK\","
                              "method=\"/muonmesh.v1.Jobs/SubmitJob\"} 1"));
  // 6 steps of 2 ranks.
  EXPECT_THAT(text, HasSubstr("muonmesh_rpc_duration_seconds_count{code=\"OK\","
                              "method=\"/muonmesh.v1.Fleet/ReportStep\"} 12"));
}

TEST_F(ControlPlaneTest, ARepeatedRequestIdMakesOneJob) {
  const v1::JobSpec spec = Spec(JobYaml(dir_, "once", 2, 2));
  absl::StatusOr<v1::Job> a = Submit(spec, "same");
  absl::StatusOr<v1::Job> b = Submit(spec, "same");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->id(), b->id());
  v1::JobSpec other = spec;
  other.mutable_training()->set_steps(3);
  EXPECT_EQ(Submit(other, "same").status().code(), absl::StatusCode::kAlreadyExists);
}

// A list leaves the specs out unless asked (a spec may carry a whole model
// inline); GetJob has it.
TEST_F(ControlPlaneTest, ListJobsLeavesTheSpecsOutUnlessAsked) {
  const v1::JobSpec spec = Spec(JobYaml(dir_, "listed", 2, 2));
  ASSERT_TRUE(Submit(spec).ok());
  for (const bool full : {false, true}) {
    v1::ListJobsRequest request;
    request.set_full_spec(full);
    v1::ListJobsResponse list;
    grpc::ClientContext context;
    ASSERT_TRUE(jobs_->ListJobs(&context, request, &list).ok());
    ASSERT_EQ(list.jobs_size(), 1);
    EXPECT_EQ(list.jobs(0).name(), "listed");
    EXPECT_EQ(list.jobs(0).has_spec(), full);
    if (full) {
      EXPECT_EQ(list.jobs(0).spec().training().steps(), spec.training().steps());
    }
  }
}

TEST_F(ControlPlaneTest, InvalidJobsGetEveryViolationAndCreateNothing) {
  v1::JobSpec spec = Spec(JobYaml(dir_, "bad", 4, 2));
  spec.mutable_parallelism()->set_num_distributed_optimizer_instances(3);
  spec.mutable_training()->set_global_batch_size(10);
  spec.mutable_output()->set_dir("relative/out");
  absl::StatusOr<v1::Job> job = Submit(spec);
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(job.status().message()),
              HasSubstr("spec.parallelism.num_distributed_optimizer_instances"));
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("spec.training.global_batch_size"));
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("spec.output.dir"));
  v1::ListJobsResponse list;
  grpc::ClientContext context;
  ASSERT_TRUE(jobs_->ListJobs(&context, {}, &list).ok());
  EXPECT_EQ(list.jobs_size(), 0);
  v1::GetJobRequest unknown;
  unknown.set_job_id("j-404");
  v1::Job nothing;
  grpc::ClientContext c2;
  EXPECT_EQ(jobs_->GetJob(&c2, unknown, &nothing).error_code(), grpc::StatusCode::NOT_FOUND);
}

// A job that passes every field check but would take the planner more than
// its memory limit (plan_size_test's thousand [2^20, 2^20] layers on 16384
// ranks) is refused at submit, as PlanLayout refuses it, and nothing is
// created: the coordinator plans each attempt itself while scheduling.
TEST_F(ControlPlaneTest, AJobTooBigToPlanIsRefusedAtSubmit) {
  std::string units;
  for (int u = 0; u < 1000; ++u) {
    absl::StrAppend(&units, u == 0 ? "" : ", ", "{name: u", u, ", params: [{name: u", u,
                    ".w, shape: [1048576, 1048576], optimizer: muon}]}");
  }
  const v1::JobSpec spec = Spec(absl::StrCat(
      "name: huge\nworld_size: 16384\nmodel: {synthetic: {model: {name: huge, units: [", units,
      "]}}}\ntraining: {steps: 1, global_batch_size: 16384}\noutput: {dir: ", dir_, "/huge}\n"));
  absl::StatusOr<v1::Job> job = Submit(spec);
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << job.status();
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("planning would take about"));
  v1::ListJobsResponse list;
  grpc::ClientContext context;
  ASSERT_TRUE(jobs_->ListJobs(&context, {}, &list).ok());
  EXPECT_EQ(list.jobs_size(), 0);
}

// The coordinator's own allowed folders: a job file naming a path outside
// them is refused at submit, naming the field, and nothing is created.
class AllowedDirsTest : public ControlPlaneTest {
 protected:
  void Configure(ControlPlaneOptions& options) override {
    std::filesystem::create_directories(dir_ + "/ok");
    absl::StatusOr<std::vector<std::string>> allowed = job::ResolveAllowedDirs({dir_ + "/ok"});
    ASSERT_TRUE(allowed.ok()) << allowed.status();
    options.allowed_dirs = *allowed;
  }
};

TEST_F(AllowedDirsTest, AJobOutsideTheAllowedFoldersIsRefusedAndNothingIsCreated) {
  absl::StatusOr<v1::Job> inside = Submit(Spec(JobYaml(dir_ + "/ok", "in", 1, 2)));
  ASSERT_TRUE(inside.ok()) << inside.status();
  absl::StatusOr<v1::Job> outside = Submit(Spec(JobYaml(dir_ + "/elsewhere", "out", 1, 2)));
  ASSERT_EQ(outside.status().code(), absl::StatusCode::kPermissionDenied) << outside.status();
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("output.dir"));
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr(dir_ + "/elsewhere/out"));
  // ".." does not get out either.
  absl::StatusOr<v1::Job> dotdot = Submit(Spec(JobYaml(dir_ + "/ok/..", "up", 1, 2)));
  EXPECT_EQ(dotdot.status().code(), absl::StatusCode::kPermissionDenied) << dotdot.status();
  v1::ListJobsResponse list;
  grpc::ClientContext context;
  ASSERT_TRUE(jobs_->ListJobs(&context, {}, &list).ok());
  EXPECT_EQ(list.jobs_size(), 1);
}

// A client's bounds over real gRPC: with no workers its jobs stay PENDING,
// so the third submit from this address passes --max-jobs-per-client 2
// (RESOURCE_EXHAUSTED naming the client) and nothing of it is kept; a
// cancel frees a place. The third watch held open at once passes
// --max-watches-per-client 2; a closed watch frees its place.
class ClientBoundsTest : public ControlPlaneTest {
 protected:
  void Configure(ControlPlaneOptions& options) override {
    options.max_unfinished_jobs_per_client = 2;
    options.max_watches_per_client = 2;
  }
};

TEST_F(ClientBoundsTest, SubmitsAndWatchesOfOneClientAreBounded) {
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<v1::Job> job = Submit(Spec(JobYaml(dir_, absl::StrCat("b", i), 1, 2)));
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->submitted_by(), "ipv4:127.0.0.1");
    ids.push_back(job->id());
  }
  absl::StatusOr<v1::Job> refused = Submit(Spec(JobYaml(dir_, "b2", 1, 2)), "b2-request");
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("client ipv4:127.0.0.1 has 2"));
  // At the bound a job is refused before it is validated (a flood costs a
  // lookup): even an invalid one gets the bound, not its violations.
  v1::JobSpec invalid = Spec(JobYaml(dir_, "b3", 1, 2));
  invalid.set_world_size(0);
  EXPECT_EQ(Submit(invalid).status().code(), absl::StatusCode::kResourceExhausted);
  v1::CancelJobRequest cancel;
  cancel.set_job_id(ids[0]);
  v1::Job cancelled;
  grpc::ClientContext cancel_context;
  ASSERT_TRUE(jobs_->CancelJob(&cancel_context, cancel, &cancelled).ok());
  absl::StatusOr<v1::Job> third = Submit(Spec(JobYaml(dir_, "b2", 1, 2)), "b2-request");
  ASSERT_TRUE(third.ok()) << third.status();
  ids.push_back(third->id());

  // Two watches of pending jobs stay open; a third is refused at once.
  struct Open {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader;
  };
  std::vector<std::unique_ptr<Open>> open;
  for (int i = 0; i < 2; ++i) {
    open.push_back(std::make_unique<Open>());
    v1::WatchJobRequest request;
    request.set_job_id(ids[1 + i]);
    open.back()->reader = jobs_->WatchJob(&open.back()->context, request);
    v1::JobEvent first;  // the PENDING event: the stream is open
    ASSERT_TRUE(open.back()->reader->Read(&first));
  }
  auto third_watch = [&] {
    v1::WatchJobRequest request;
    request.set_job_id(ids[1]);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    auto reader = jobs_->WatchJob(&context, request);
    v1::JobEvent e;
    while (reader->Read(&e)) {
    }
    return reader->Finish();
  };
  const grpc::Status over = third_watch();
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << over.error_message();
  EXPECT_THAT(over.error_message(), HasSubstr("2 open watches"));
  open[0]->context.TryCancel();
  (void)open[0]->reader->Finish();
  // Its place is free once the server has seen it go (within a watch slice).
  grpc::Status again = third_watch();
  for (int i = 0; i < 50 && again.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    again = third_watch();
  }
  EXPECT_EQ(again.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << again.error_message();
  open[1]->context.TryCancel();
  (void)open[1]->reader->Finish();
}

TEST_F(ControlPlaneTest, TwoJobsRunSideBySideAndABigOneWaitsForWorkers) {
  StartWorkers(2);
  absl::StatusOr<v1::Job> big = Submit(Spec(JobYaml(dir_, "big", 3, 2)));
  absl::StatusOr<v1::Job> a = Submit(Spec(JobYaml(dir_, "a", 1, 3)));
  absl::StatusOr<v1::Job> b = Submit(Spec(JobYaml(dir_, "b", 1, 3)));
  ASSERT_TRUE(big.ok() && a.ok() && b.ok());
  // The two small jobs do not wait behind the big one, and run at once.
  std::vector<v1::JobEvent> ea = Watch(a->id(), 0);
  std::vector<v1::JobEvent> eb = Watch(b->id(), 0);
  EXPECT_EQ(Get(a->id()).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(Get(b->id()).state(), v1::JOB_STATE_SUCCEEDED);
  const v1::Job ja = Get(a->id());
  const v1::Job jb = Get(b->id());
  ASSERT_EQ(ja.worker_ids_size(), 1);
  ASSERT_EQ(jb.worker_ids_size(), 1);
  EXPECT_NE(ja.worker_ids(0), jb.worker_ids(0));
  EXPECT_EQ(Get(big->id()).state(), v1::JOB_STATE_PENDING);
  // A third worker joins: the big job starts and ends.
  StartWorkers(1);
  Watch(big->id(), 0);
  EXPECT_EQ(Get(big->id()).state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(ControlPlaneTest, CancelStopsTheRanksAndFreesTheWorkers) {
  StartWorkers(2);
  absl::StatusOr<v1::Job> job = Submit(Spec(JobYaml(dir_, "long", 2, 100000)));
  ASSERT_TRUE(job.ok());
  // Wait for the first step, then cancel.
  for (int i = 0; i < 600 && Get(job->id()).steps_done() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_GT(Get(job->id()).steps_done(), 0);
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job->id());
  cancel.set_reason("test");
  v1::Job cancelled;
  grpc::ClientContext context;
  ASSERT_TRUE(jobs_->CancelJob(&context, cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED);
  const absl::Time start = absl::Now();
  bool idle = false;
  while (!idle && absl::Now() - start < absl::Seconds(10)) {
    idle = true;
    for (const v1::Worker& w : Workers()) idle = idle && w.state() == v1::WORKER_STATE_IDLE;
    if (!idle) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(idle) << "workers still busy after 10 s";
  std::printf("workers idle %.2f s after the cancel\n", absl::ToDoubleSeconds(absl::Now() - start));
  // The freed workers take the next job.
  absl::StatusOr<v1::Job> next = Submit(Spec(JobYaml(dir_, "next", 2, 2)));
  ASSERT_TRUE(next.ok());
  Watch(next->id(), 0);
  EXPECT_EQ(Get(next->id()).state(), v1::JOB_STATE_SUCCEEDED);
  // Cancelling a finished job is refused; cancelling twice answers the same.
  grpc::ClientContext c2;
  cancel.set_job_id(next->id());
  EXPECT_EQ(jobs_->CancelJob(&c2, cancel, &cancelled).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// Delete and prune take finished jobs only, with their records; a job
// that has not finished is refused (cancel it first).
TEST_F(ControlPlaneTest, DeleteAndPruneRemoveOnlyFinishedJobs) {
  StartWorkers(2);
  absl::StatusOr<v1::Job> done = Submit(Spec(JobYaml(dir_, "done", 2, 2)));
  ASSERT_TRUE(done.ok());
  Watch(done->id(), 0);
  ASSERT_EQ(Get(done->id()).state(), v1::JOB_STATE_SUCCEEDED);
  absl::StatusOr<v1::Job> waiting = Submit(Spec(JobYaml(dir_, "waiting", 4, 2)));
  ASSERT_TRUE(waiting.ok());
  ASSERT_EQ(Get(waiting->id()).state(), v1::JOB_STATE_PENDING);
  auto remove = [&](const std::string& id) {
    v1::DeleteJobRequest request;
    request.set_job_id(id);
    v1::DeleteJobResponse response;
    grpc::ClientContext context;
    return jobs_->DeleteJob(&context, request, &response).error_code();
  };
  auto prune = [&](int64_t before, v1::PruneJobsResponse* response) {
    v1::PruneJobsRequest request;
    request.set_finished_before_unix_ms(before);
    grpc::ClientContext context;
    return jobs_->PruneJobs(&context, request, response).error_code();
  };
  EXPECT_EQ(remove(waiting->id()), grpc::StatusCode::FAILED_PRECONDITION);
  v1::PruneJobsResponse pruned;
  EXPECT_EQ(prune(0, &pruned), grpc::StatusCode::INVALID_ARGUMENT);
  // Before the job finished: nothing; after: the finished job only.
  ASSERT_EQ(prune(Get(done->id()).finished_unix_ms(), &pruned), grpc::StatusCode::OK);
  EXPECT_EQ(pruned.job_ids_size(), 0);
  ASSERT_EQ(prune(absl::ToUnixMillis(absl::Now() + absl::Minutes(1)), &pruned),
            grpc::StatusCode::OK);
  EXPECT_THAT(pruned.job_ids(), ::testing::ElementsAre(done->id()));
  v1::GetJobRequest get;
  get.set_job_id(done->id());
  v1::Job nothing;
  grpc::ClientContext context;
  EXPECT_EQ(jobs_->GetJob(&context, get, &nothing).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(remove(done->id()), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Get(waiting->id()).state(), v1::JOB_STATE_PENDING);
}

// The restart protocol with scripted workers (raw Fleet calls, no
// training): a coordinator stopped mid-attempt and started again on the same
// state keeps the attempt for the workers that come back naming it, counts
// the steps they had reported before and re-send after exactly once, and
// tells a worker naming another attempt or plan to stop its rank.
class RestartTest : public ControlPlaneTest {
 protected:
  void Configure(ControlPlaneOptions& o) override {
    o.lease_ttl = absl::Seconds(30);
    o.adopt_grace = grace_;
  }

  // A coordinator again on the same state (the first one stopped without
  // writing anything more, as after a crash).
  void Restart() {
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    plane_->Shutdown();
    plane_.reset();
    ControlPlaneOptions options;
    options.data_dir = dir_ + "/state";
    Configure(options);
    absl::StatusOr<std::unique_ptr<ControlPlane>> plane = ControlPlane::Start(options);
    ASSERT_TRUE(plane.ok()) << plane.status();
    plane_ = *std::move(plane);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    for (grpc::Service* svc : plane_->services()) builder.RegisterService(svc);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials());
    jobs_ = v1::Jobs::NewStub(channel);
    fleet_ = v1::Fleet::NewStub(channel);
  }

  v1::RegisterResponse Register(const std::string& id, const v1::RunningRank* running,
                                const std::string& lease = "") {
    v1::RegisterRequest request;
    request.mutable_info()->set_worker_id(id);
    request.mutable_info()->set_device("cpu");
    request.mutable_info()->set_address("127.0.0.1");
    request.set_lease_id(lease);
    if (running != nullptr) *request.mutable_running() = *running;
    v1::RegisterResponse response;
    grpc::ClientContext context;
    const grpc::Status st = fleet_->Register(&context, request, &response);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return response;
  }

  // The first assignment on the worker's stream.
  v1::Assignment Assignment(const std::string& id, const std::string& lease) {
    v1::AssignmentsRequest request;
    request.set_worker_id(id);
    request.set_lease_id(lease);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto reader = fleet_->Assignments(&context, request);
    v1::Assignment a;
    EXPECT_TRUE(reader->Read(&a));
    context.TryCancel();
    return a;
  }

  grpc::Status Step(const std::string& id, const std::string& lease, const std::string& job,
                    int32_t rank, int64_t step, v1::ReportStepResponse* answer = nullptr) {
    v1::ReportStepRequest request;
    request.set_worker_id(id);
    request.set_lease_id(lease);
    request.set_job_id(job);
    request.mutable_record()->set_step(step);
    request.mutable_record()->set_rank(rank);
    request.mutable_record()->set_loss(1.0 / static_cast<double>(step + 1));
    v1::ReportStepResponse response;
    grpc::ClientContext context;
    return fleet_->ReportStep(&context, request, answer != nullptr ? answer : &response);
  }

  grpc::Status End(const std::string& id, const std::string& lease, const std::string& job,
                   int32_t rank, v1::AttemptOutcome outcome = v1::ATTEMPT_OUTCOME_SUCCEEDED) {
    v1::ReportAttemptRequest request;
    request.set_worker_id(id);
    request.set_lease_id(lease);
    request.set_job_id(job);
    request.set_attempt(0);
    request.set_rank(rank);
    request.set_outcome(outcome);
    v1::ReportAttemptResponse response;
    grpc::ClientContext context;
    return fleet_->ReportAttempt(&context, request, &response);
  }

  // Step events of the job, by step.
  std::map<int64_t, int> StepEvents(const std::string& job) {
    std::map<int64_t, int> out;
    v1::WatchJobRequest request;
    request.set_job_id(job);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    auto reader = jobs_->WatchJob(&context, request);
    v1::JobEvent e;
    while (reader->Read(&e)) {
      if (e.has_step()) out[e.step().step()] += 1;
    }
    return out;
  }

  // Two scripted workers and a 2-rank job on them: the job, the workers'
  // leases, and the RunningRank w0 would name for its rank.
  struct Started {
    v1::Job job;
    std::string l0, l1;
    v1::RunningRank r0;
    // By rank: the RunningRank its worker names, the worker and its lease.
    v1::RunningRank running[2];
    std::string worker[2], lease[2];
  };
  Started StartJob(const std::string& name) {
    Started st;
    st.l0 = Register("w0", nullptr).lease_id();
    st.l1 = Register("w1", nullptr).lease_id();
    absl::StatusOr<v1::Job> job = Submit(Spec(JobYaml(dir_, name, 2, 100)));
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return st;
    st.job = *job;
    const v1::Assignment a0 = Assignment("w0", st.l0);
    EXPECT_TRUE(a0.has_start());
    st.r0.set_job_id(job->id());
    st.r0.set_attempt(a0.attempt());
    st.r0.set_rank(a0.start().rank());
    st.r0.set_plan_fingerprint(a0.start().plan_fingerprint());
    const int32_t r0 = st.r0.rank();
    st.running[r0] = st.running[1 - r0] = st.r0;
    st.running[1 - r0].set_rank(1 - r0);
    st.worker[r0] = "w0";
    st.worker[1 - r0] = "w1";
    st.lease[r0] = st.l0;
    st.lease[1 - r0] = st.l1;
    return st;
  }

  absl::Duration grace_ = absl::Seconds(30);
};

TEST_F(RestartTest, ARunningAttemptIsKeptAndItsStepsCountedOnce) {
  const Started st = StartJob("kept");
  const v1::Job* job = &st.job;
  const std::string& l0 = st.l0;
  const std::string& l1 = st.l1;
  v1::RunningRank r0 = st.r0;
  v1::RunningRank r1 = r0;
  r1.set_rank(1 - r0.rank());
  const std::string w_of[2] = {r0.rank() == 0 ? "w0" : "w1", r0.rank() == 0 ? "w1" : "w0"};
  const std::string l_of[2] = {r0.rank() == 0 ? l0 : l1, r0.rank() == 0 ? l1 : l0};
  // Step 0 by both ranks, step 1 by rank 0 only; then the coordinator goes.
  ASSERT_TRUE(Step(w_of[0], l_of[0], job->id(), 0, 0).ok());
  ASSERT_TRUE(Step(w_of[1], l_of[1], job->id(), 1, 0).ok());
  ASSERT_TRUE(Step(w_of[0], l_of[0], job->id(), 0, 1).ok());
  EXPECT_EQ(Get(job->id()).steps_done(), 1);
  Restart();

  v1::Job kept = Get(job->id());
  EXPECT_EQ(kept.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(kept.reason(), HasSubstr("keeping attempt 0"));
  // Another attempt, or another plan: not kept (the worker is registered,
  // idle, and renews its lease by naming it).
  v1::RunningRank stale = r1;
  stale.set_attempt(3);
  const v1::RegisterResponse refused = Register(w_of[1], &stale);
  EXPECT_THAT(refused.stop_running(), HasSubstr("does not run rank"));
  v1::RunningRank other_plan = r1;
  other_plan.set_plan_fingerprint("something else");
  EXPECT_THAT(Register(w_of[1], &other_plan, refused.lease_id()).stop_running(),
              HasSubstr("another plan"));
  // The right ones are kept; once both are back the attempt goes on.
  const v1::RegisterResponse back0 = Register(w_of[0], &r0);
  EXPECT_EQ(back0.stop_running(), "");
  EXPECT_THAT(Get(job->id()).reason(), HasSubstr("keeping attempt 0"));
  const v1::RegisterResponse back1 = Register(w_of[1], &r1, refused.lease_id());
  EXPECT_EQ(back1.stop_running(), "");
  EXPECT_EQ(back1.lease_id(), refused.lease_id());
  kept = Get(job->id());
  EXPECT_EQ(kept.attempt(), 0);
  EXPECT_THAT(kept.reason(), HasSubstr("every worker of attempt 0 came back"));
  for (const v1::Worker& w : Workers()) EXPECT_EQ(w.state(), v1::WORKER_STATE_BUSY);
  // Rank 1's step 1 completes the step rank 0 reported before the restart;
  // rank 0 re-sends what it kept (steps 0 and 1: counted already), then 2.
  EXPECT_TRUE(Step(w_of[1], back1.lease_id(), job->id(), 1, 1).ok());
  EXPECT_EQ(Get(job->id()).steps_done(), 2);
  EXPECT_TRUE(Step(w_of[0], back0.lease_id(), job->id(), 0, 0).ok());
  EXPECT_TRUE(Step(w_of[0], back0.lease_id(), job->id(), 0, 1).ok());
  EXPECT_TRUE(Step(w_of[0], back0.lease_id(), job->id(), 0, 2).ok());
  EXPECT_TRUE(Step(w_of[0], back0.lease_id(), job->id(), 0, 2).ok());
  EXPECT_EQ(Get(job->id()).steps_done(), 2);
  EXPECT_TRUE(Step(w_of[1], back1.lease_id(), job->id(), 1, 2).ok());
  EXPECT_EQ(Get(job->id()).steps_done(), 3);
  EXPECT_EQ(StepEvents(job->id()), (std::map<int64_t, int>{{0, 1}, {1, 1}, {2, 1}}));
  // A rank of no running attempt is told so (Aborted: the worker stops it).
  EXPECT_EQ(Step(w_of[0], back0.lease_id(), "j-999", 0, 3).error_code(), grpc::StatusCode::ABORTED);
}

// A rank whose end the coordinator took before it restarted is not waited
// for: its worker, which has forgotten the rank, registers naming none, and
// the attempt goes on with the other rank (it failed the attempt before).
TEST_F(RestartTest, ARankThatEndedBeforeTheRestartIsNotWaitedFor) {
  const Started st = StartJob("half");
  const v1::Job* job = &st.job;
  const v1::RunningRank& r0 = st.r0;
  const int32_t other = 1 - r0.rank();
  ASSERT_TRUE(End("w1", st.l1, job->id(), other).ok());
  Restart();
  EXPECT_EQ(Register("w1", nullptr).stop_running(), "");  // back without a rank
  EXPECT_EQ(Get(job->id()).state(), v1::JOB_STATE_RUNNING) << Get(job->id()).reason();
  const v1::RegisterResponse back = Register("w0", &r0);
  EXPECT_EQ(back.stop_running(), "");
  EXPECT_THAT(Get(job->id()).reason(), HasSubstr("every worker of attempt 0 came back"));
  ASSERT_TRUE(End("w0", back.lease_id(), job->id(), r0.rank()).ok());
  EXPECT_EQ(Get(job->id()).state(), v1::JOB_STATE_SUCCEEDED) << Get(job->id()).reason();
}

// A drain whose ranks' reports straddle a restart: rank 0 was told before it
// to stop after step 1 with a checkpoint; rank 1, reporting step 1 to the
// restarted coordinator, is told the same (not to go on into a step whose
// collectives rank 0 never joins). The attempt ends as a drain: no restart
// spent.
TEST_F(RestartTest, ADrainDecidedBeforeTheRestartStopsEveryRankAtTheSameStep) {
  const Started st = StartJob("drained");
  const std::string& id = st.job.id();
  const v1::RunningRank* r = st.running;
  const std::string* w_of = st.worker;
  const std::string* l_of = st.lease;
  for (int32_t rank : {0, 1}) ASSERT_TRUE(Step(w_of[rank], l_of[rank], id, rank, 0).ok());
  {
    v1::DrainWorkerRequest request;
    request.set_worker_id(w_of[0]);
    request.set_reason("kernel update");
    v1::Worker w;
    grpc::ClientContext context;
    const grpc::Status drained = fleet_->DrainWorker(&context, request, &w);
    ASSERT_TRUE(drained.ok()) << drained.error_message();
  }
  v1::ReportStepResponse answer;
  ASSERT_TRUE(Step(w_of[0], l_of[0], id, 0, 1, &answer).ok());
  EXPECT_TRUE(answer.stop() && answer.checkpoint());
  ASSERT_TRUE(End(w_of[0], l_of[0], id, 0, v1::ATTEMPT_OUTCOME_STOPPED).ok());
  Restart();

  const v1::RegisterResponse back = Register(w_of[1], &r[1]);
  ASSERT_EQ(back.stop_running(), "");
  answer.Clear();
  ASSERT_TRUE(Step(w_of[1], back.lease_id(), id, 1, 1, &answer).ok());
  EXPECT_TRUE(answer.stop()) << "rank 1 would go on into step 2 alone";
  EXPECT_TRUE(answer.checkpoint());
  ASSERT_TRUE(End(w_of[1], back.lease_id(), id, 1, v1::ATTEMPT_OUTCOME_STOPPED).ok());
  const v1::Job moved = Get(id);
  EXPECT_EQ(moved.state(), v1::JOB_STATE_RESTARTING) << moved.reason();
  EXPECT_THAT(moved.reason(), HasSubstr("worker " + w_of[0] + " drained: kernel update"));
  EXPECT_EQ(moved.drained_attempts(), 1);
}

// A state write that fails (a read-only or full disk; SQLite's query_only
// here) stops new work for good: even once the disk works again, a submit is
// refused saying why, until the coordinator restarts; what is stored stays
// readable.
TEST_F(RestartTest, AFailedStateWriteRefusesNewWorkUntilRestart) {
  const Started st = StartJob("kept");
  const v1::Job* job = &st.job;
  const std::string w0_rank0 = st.r0.rank() == 0 ? "w0" : "w1";
  const std::string l_rank0 = st.r0.rank() == 0 ? st.l0 : st.l1;
  ASSERT_TRUE(Step(w0_rank0, l_rank0, job->id(), 0, 0).ok());
  // /readyz: not before the gRPC server says it serves, then ready; live
  // throughout.
  std::string status;
  EXPECT_THAT(testing::HttpGet(plane_->metrics_port(), "/readyz", &status),
              HasSubstr("not serving gRPC"));
  EXPECT_THAT(status, HasSubstr("503"));
  plane_->SetServing(true);
  EXPECT_EQ(testing::HttpGet(plane_->metrics_port(), "/readyz", &status), "ok\n");
  ASSERT_TRUE(plane_->job_store_for_test().SetReadOnlyForTest(true).ok());
  EXPECT_FALSE(Step(w0_rank0, l_rank0, job->id(), 0, 1).ok());
  ASSERT_TRUE(plane_->job_store_for_test().SetReadOnlyForTest(false).ok());
  // Not ready once a write failed (even with the disk back), still live.
  EXPECT_THAT(testing::HttpGet(plane_->metrics_port(), "/readyz", &status),
              HasSubstr("a state write failed"));
  EXPECT_THAT(status, HasSubstr("503"));
  EXPECT_EQ(testing::HttpGet(plane_->metrics_port(), "/healthz", &status), "ok\n");
  absl::StatusOr<v1::Job> refused = Submit(Spec(JobYaml(dir_, "after", 2, 5)));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("could not write its state"));
  EXPECT_EQ(Get(job->id()).state(), v1::JOB_STATE_RUNNING);
  // A restart (on a working disk) takes work again.
  Restart();
  EXPECT_TRUE(Submit(Spec(JobYaml(dir_, "again", 2, 5))).ok());
}

// Rendezvous keys live only with their attempt: a scope of a made-up job or
// of another attempt is refused, the running attempt's is served, and once
// the attempt is gone its scope is refused too.
TEST_F(RestartTest, StoreScopesAreThoseOfRunningAttempts) {
  const Started st = StartJob("scoped");
  auto store =
      v1::Store::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  auto set = [&](const std::string& job, int32_t attempt) {
    v1::StoreSetRequest request;
    request.mutable_scope()->set_job_id(job);
    request.mutable_scope()->set_attempt(attempt);
    request.set_key("k");
    request.set_value("v");
    v1::StoreSetResponse response;
    grpc::ClientContext context;
    return store->Set(&context, request, &response);
  };
  const grpc::Status made_up = set("j-999", 0);
  EXPECT_EQ(made_up.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(made_up.error_message(), HasSubstr("is not running"));
  EXPECT_EQ(set(st.job.id(), st.r0.attempt() + 1).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(set(st.job.id(), st.r0.attempt()).ok());
  v1::CancelJobRequest cancel;
  cancel.set_job_id(st.job.id());
  v1::Job cancelled;
  grpc::ClientContext context;
  ASSERT_TRUE(jobs_->CancelJob(&context, cancel, &cancelled).ok());
  for (const auto& [worker, lease, rank] :
       {std::tuple{"w0", st.l0, st.r0.rank()}, std::tuple{"w1", st.l1, 1 - st.r0.rank()}}) {
    v1::ReportAttemptRequest end;
    end.set_worker_id(worker);
    end.set_lease_id(lease);
    end.set_job_id(st.job.id());
    end.set_attempt(st.r0.attempt());
    end.set_rank(rank);
    end.set_outcome(v1::ATTEMPT_OUTCOME_STOPPED);
    v1::ReportAttemptResponse response;
    grpc::ClientContext c;
    ASSERT_TRUE(fleet_->ReportAttempt(&c, end, &response).ok());
  }
  EXPECT_EQ(set(st.job.id(), st.r0.attempt()).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

// Workers that do not come back within the grace fail the attempt as lost
// ones do: it restarts (max_restarts allowing) rather than waiting for good.
// With sparse step records (at most 10 of the job's 100 kept, every 10th): a
// rank told before the restart to go on from step 13, which left no record,
// stops at the same step as the other rank after a drain decided after the
// restart.
class SparseRestartTest : public RestartTest {
 protected:
  void Configure(ControlPlaneOptions& o) override {
    RestartTest::Configure(o);
    o.max_recorded_steps = 10;
  }
};

TEST_F(SparseRestartTest, ADrainAfterTheRestartStopsEveryRankAtTheSameStep) {
  const Started st = StartJob("sparse");
  const std::string& id = st.job.id();
  const v1::RunningRank* r = st.running;
  const std::string* w_of = st.worker;
  std::string l_of[2] = {st.lease[0], st.lease[1]};
  for (int64_t step = 0; step <= 12; ++step) {
    for (int32_t rank : {0, 1}) ASSERT_TRUE(Step(w_of[rank], l_of[rank], id, rank, step).ok());
  }
  ASSERT_TRUE(Step(w_of[0], l_of[0], id, 0, 13).ok());  // ahead, not recorded
  Restart();
  for (int32_t rank : {0, 1}) {
    const v1::RegisterResponse back = Register(w_of[rank], &r[rank]);
    ASSERT_EQ(back.stop_running(), "");
    l_of[rank] = back.lease_id();
  }
  v1::DrainWorkerRequest request;
  request.set_worker_id(w_of[1]);
  v1::Worker w;
  grpc::ClientContext context;
  ASSERT_TRUE(fleet_->DrainWorker(&context, request, &w).ok());
  // Each rank reports until it is told to stop (rank 1 one step behind).
  int64_t stopped_at[2] = {-1, -1};
  int64_t next[2] = {14, 13};
  while ((stopped_at[0] < 0 || stopped_at[1] < 0) && next[0] < 100 && next[1] < 100) {
    for (int32_t rank : {1, 0}) {
      if (stopped_at[rank] >= 0) continue;
      v1::ReportStepResponse answer;
      ASSERT_TRUE(Step(w_of[rank], l_of[rank], id, rank, next[rank], &answer).ok());
      if (answer.stop()) stopped_at[rank] = next[rank];
      ++next[rank];
    }
  }
  EXPECT_GE(stopped_at[0], 14);
  EXPECT_EQ(stopped_at[0], stopped_at[1]);
}

class LateRestartTest : public RestartTest {
 protected:
  LateRestartTest() { grace_ = absl::Seconds(1); }
};

TEST_F(LateRestartTest, WorkersThatDoNotComeBackFailTheAttempt) {
  const Started st = StartJob("late");
  const v1::Job* job = &st.job;
  Restart();
  const absl::Time start = absl::Now();
  while (Get(job->id()).state() == v1::JOB_STATE_RUNNING &&
         absl::Now() - start < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  const v1::Job failed = Get(job->id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);  // max_restarts 0
  EXPECT_THAT(failed.reason(),
              HasSubstr("did not come back within 1s of the coordinator's restart"));
}

}  // namespace
}  // namespace muonmesh::coordinator
