// The service end to end with real processes on loopback: a
// muonmesh-coordinator, muonmesh-worker daemons, and a client through the
// client library. A job run through the coordinator ends with final weights
// byte-identical to the standalone launcher's for the same job (ZeRO-3,
// HFSDP, moe_mlp with EP 2); a worker killed mid-job makes the coordinator
// restart the job from its newest checkpoint on the workers that are left,
// with the same final weights.

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/background.h"
#include "tests/testing/subprocess.h"

namespace muonmesh {
namespace {

using ::testing::HasSubstr;
using testing::Background;

constexpr auto kStart = std::chrono::seconds(20);

std::string Fresh(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/service_e2e_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct JobText {
  std::string name;
  int world = 2;
  std::string parallelism = "{data_parallel_sharding_strategy: optim_grads_params}";
  std::string model = "{mlp: {dims: [6, 16, 16, 3]}}";
  int steps = 6;
  int checkpoint_every = 0;
  int max_restarts = 0;
};

// The job file, with outputs under `out`.
std::string WriteJob(const std::string& dir, const JobText& j, const std::string& out) {
  const std::string path = absl::StrCat(dir, "/", j.name, "-", std::filesystem::path(out).filename().string(), ".yaml");
  std::ofstream(path) << "name: " << j.name << "\nworld_size: " << j.world
                      << "\nparallelism: " << j.parallelism << "\nmodel: " << j.model
                      << "\ninit: {seed: 5}\ndata: {teacher: {seed: 21, samples: 256}}\n"
                      << "optimizer: {adamw: {eps: 0.05}}\n"
                      << "training: {steps: " << j.steps << ", global_batch_size: 24"
                      << ", checkpoint_every: " << j.checkpoint_every
                      << ", max_restarts: " << j.max_restarts << "}\n"
                      << "output: {dir: " << out << ", export: " << out << "/final.safetensors}\n";
  return path;
}

// The same job through the standalone launcher: W processes, one store.
void RunStandalone(const std::string& job, int world, const std::string& store) {
  std::filesystem::create_directories(store);
  std::vector<std::thread> ranks;
  std::vector<muonmesh::testing::ProcessResult> results(world);
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      results[r] = muonmesh::testing::Run(
          {MUONMESH_WORKER_BIN, "--standalone", "--job", job, "--rank", std::to_string(r),
           "--world-size", std::to_string(world), "--store", store, "--memory-budget", "1GiB"},
          std::chrono::seconds(120));
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "standalone rank " << r << ": " << results[r].err;
  }
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = Fresh(::testing::UnitTest::GetInstance()->current_test_info()->name());
    coordinator_ = std::make_unique<Background>(
        std::vector<std::string>{MUONMESH_COORDINATOR_BIN, "--listen", "127.0.0.1:0",
                                 "--data-dir", dir_ + "/state", "--lease-ttl", "3s",
                                 "--collective-timeout", "20s"},
        dir_ + "/coordinator.log");
    ASSERT_TRUE(coordinator_->WaitForLog("listening on", kStart)) << coordinator_->Log();
    const std::string log = coordinator_->Log();
    const size_t at = log.find("listening on ") + 13;
    address_ = log.substr(at, log.find('\n', at) - at);
    client_ = std::make_unique<CoordinatorClient>(address_);
  }

  void StartWorker(const std::string& id) {
    workers_.push_back(std::make_unique<Background>(
        std::vector<std::string>{MUONMESH_WORKER_BIN, "--coordinator", address_, "--worker-id", id,
                                 "--memory-budget", "1GiB"},
        absl::StrCat(dir_, "/", id, ".log")));
    ASSERT_TRUE(workers_.back()->WaitForLog("registered as", kStart)) << workers_.back()->Log();
  }

  // Submits the job file and follows it to its end; returns the job.
  v1::Job SubmitAndWatch(const std::string& file) {
    absl::StatusOr<v1::JobSpec> spec = LoadJobForSubmit(file);
    EXPECT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<v1::SubmitJobResponse> r = client_->Submit(*spec, "");
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return v1::Job();
    absl::Status watched = client_->Watch(r->job().id(), 0, absl::Minutes(3),
                                          [](const v1::JobEvent&) { return true; });
    EXPECT_TRUE(watched.ok()) << watched;
    absl::StatusOr<v1::Job> job = client_->Get(r->job().id());
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  std::string Logs() {
    std::string out = "coordinator:\n" + coordinator_->Log();
    for (auto& w : workers_) out += "\nworker:\n" + w->Log();
    return out;
  }

  std::string dir_;
  std::string address_;
  std::unique_ptr<Background> coordinator_;
  std::vector<std::unique_ptr<Background>> workers_;
  std::unique_ptr<CoordinatorClient> client_;
};

TEST_F(ServiceTest, ServedJobsEndWithTheStandaloneLaunchersExactWeights) {
  for (int i = 0; i < 4; ++i) StartWorker(absl::StrCat("w", i));
  std::vector<JobText> jobs = {
      {"zero3", 2},
      {"hfsdp", 4,
       "{data_parallel_sharding_strategy: optim_grads_params, "
       "num_distributed_optimizer_instances: 2, outer_dp_sharding_strategy: optim}"},
      {"moe-ep2", 2,
       "{data_parallel_sharding_strategy: optim_grads_params, expert_model_parallel_size: 2}",
       "{moe_mlp: {d_in: 6, d_model: 8, d_expert: 4, num_experts: 4, d_out: 3}}"}};
  for (const JobText& j : jobs) {
    SCOPED_TRACE(j.name);
    const v1::Job served = SubmitAndWatch(WriteJob(dir_, j, dir_ + "/served-" + j.name));
    ASSERT_EQ(served.state(), v1::JOB_STATE_SUCCEEDED) << served.reason() << "\n" << Logs();
    EXPECT_EQ(served.steps_done(), j.steps);
    RunStandalone(WriteJob(dir_, j, dir_ + "/alone-" + j.name), j.world,
                  dir_ + "/store-" + j.name);
    const std::string a = ReadAll(dir_ + "/served-" + j.name + "/final.safetensors");
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(a, ReadAll(dir_ + "/alone-" + j.name + "/final.safetensors"));
  }
}

TEST_F(ServiceTest, AKilledWorkerRestartsTheJobFromItsCheckpoint) {
  for (int i = 0; i < 3; ++i) StartWorker(absl::StrCat("w", i));
  JobText j{"restart", 2};
  j.steps = 60;
  j.checkpoint_every = 5;
  j.max_restarts = 1;
  absl::StatusOr<v1::JobSpec> spec = LoadJobForSubmit(WriteJob(dir_, j, dir_ + "/served"));
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<v1::SubmitJobResponse> r = client_->Submit(*spec, "");
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string id = r->job().id();
  // After the first checkpoint, kill one of the job's workers.
  std::string victim;
  for (int i = 0; i < 3000 && victim.empty(); ++i) {
    absl::StatusOr<v1::Job> job = client_->Get(id);
    if (job.ok() && job->steps_done() >= 7 && job->worker_ids_size() == 2) {
      victim = job->worker_ids(1);
    } else {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  ASSERT_FALSE(victim.empty()) << Logs();
  workers_[victim.back() - '0']->Signal(SIGKILL);
  absl::Status watched =
      client_->Watch(id, 0, absl::Minutes(3), [](const v1::JobEvent&) { return true; });
  ASSERT_TRUE(watched.ok()) << watched;
  absl::StatusOr<v1::Job> done = client_->Get(id);
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_EQ(done->attempt(), 1);
  EXPECT_THAT(done->worker_ids(), ::testing::Not(::testing::Contains(victim)));
  // Resumed bit for bit: the same weights as a run that never failed.
  RunStandalone(WriteJob(dir_, j, dir_ + "/alone"), 2, dir_ + "/store");
  EXPECT_EQ(ReadAll(dir_ + "/served/final.safetensors"), ReadAll(dir_ + "/alone/final.safetensors"));
}

TEST_F(ServiceTest, SigtermStopsTheCoordinatorAndWorkersCleanly) {
  StartWorker("w0");
  workers_[0]->Signal(SIGTERM);
  EXPECT_EQ(workers_[0]->Wait(std::chrono::seconds(10)), 0) << workers_[0]->Log();
  coordinator_->Signal(SIGTERM);
  EXPECT_EQ(coordinator_->Wait(std::chrono::seconds(10)), 0) << coordinator_->Log();
}

}  // namespace
}  // namespace muonmesh
