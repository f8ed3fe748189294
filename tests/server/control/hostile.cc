// The hostile-client load run of the second hardening round (not a test of
// the suite: minutes long; run it with tests/server/control/hostile_load.sh).
// On loopback it starts a coordinator and two worker daemons and trains a
// real job on them; measures its pace alone ("quiet"); then, while the job
// trains on, lets hostile peers loose on the coordinator for SECONDS:
//   - submitters flooding jobs with fresh request ids (jobs of 64 ranks,
//     which wait; every 20th with a 400-layer model inline), past the bound
//     on one client's unfinished jobs;
//   - watchers opening watches and abandoning them (cancelled at once, or
//     held unread for up to 5 s and dropped), past the bound on one client's
//     open watches;
//   - fake workers registering under fresh ids and never heard of again
//     (they go LOST; some are handed an attempt of a flooded job first);
//   - a Store writer putting keys into made-up and ended rendezvous scopes.
// Every 10 s it prints the coordinator's resident memory, the job's pace and
// the peers' counts; at the end the job's pace under load against the quiet
// one (steps per second, after the first minute), the memory after the first
// minute against the end, and whether every submit that was acknowledged is
// still there. Exits 1 when one is missing or the job stopped.
//
//   hostile COORDINATOR_BIN WORKER_BIN WORK_DIR [--seconds 180] [--quiet 30]
//           [--forget-lost-after 30s] [--peers submit,watch,fake,store] [--pin 0|1]
//
// --pin 1: the workers on the last core, and (the script starts this
// program under taskset) the coordinator and the peers on the others.

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "muonmesh/v1/jobs.grpc.pb.h"
#include "muonmesh/v1/store.grpc.pb.h"
#include "tests/testing/background.h"

namespace muonmesh {
namespace {

using testing::Background;

struct Options {
  std::string coordinator_bin, worker_bin, work;
  int seconds = 180;
  int quiet = 30;
  std::string forget_lost_after = "30s";
  // Which peers to let loose: any of "submit", "watch", "fake", "store".
  std::string peers = "submit,watch,fake,store";
  // The workers on the last core and everything else on the others
  // (taskset), as a deployment puts the coordinator on its own machine.
  bool pin = false;
};

// What the hostile peers did, by outcome.
struct Counts {
  std::atomic<int64_t> submitted{0}, submit_refused{0}, submit_failed{0};
  std::atomic<int64_t> watches{0}, watch_refused{0};
  std::atomic<int64_t> fakes{0}, fake_refused{0};
  std::atomic<int64_t> store_refused{0}, store_taken{0};
};

// Resident memory of a process, MiB (0 when unknown).
double RssMib(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    int64_t kib = 0;
    if (line.rfind("VmRSS:", 0) == 0 &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 9)), &kib)) {
      return static_cast<double>(kib) / 1024.0;
    }
  }
  return 0;
}

// A channel of its own (a distinct argument keeps gRPC from sharing one
// connection between the peers).
std::shared_ptr<grpc::Channel> OwnChannel(const std::string& address, int peer) {
  grpc::ChannelArguments args;
  args.SetInt("muonmesh.hostile_peer", peer);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

std::chrono::system_clock::time_point In(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

class Hostile {
 public:
  explicit Hostile(Options o) : o_(std::move(o)) {}

  int Run() {
    std::filesystem::remove_all(o_.work);
    std::filesystem::create_directories(o_.work);
    if (!StartCoordinator()) return 1;
    client_ = std::make_unique<client::CoordinatorClient>(address_);
    for (int i = 0; i < 2; ++i) StartWorker(i);
    if (!SubmitRealJob()) return 1;
    Sample quiet_start = Take();
    absl::SleepFor(absl::Seconds(o_.quiet));
    Sample quiet_end = Take();
    const double quiet_rate = Rate(quiet_start, quiet_end);
    std::printf("hostile: quiet: %.1f steps/s, step %.2f ms (median), coordinator %.1f MiB\n",
                quiet_rate, quiet_end.step_ms, quiet_end.rss);

    std::vector<std::thread> peers;
    const auto wanted = [&](const char* kind) { return absl::StrContains(o_.peers, kind); };
    for (int i = 0; i < 2 && wanted("submit"); ++i) {
      peers.emplace_back([this, i] { Submitter(i); });
    }
    for (int i = 0; i < 2 && wanted("watch"); ++i) {
      peers.emplace_back([this, i] { Watcher(10 + i); });
    }
    for (int i = 0; i < 2 && wanted("fake"); ++i) {
      peers.emplace_back([this, i] { FakeWorkers(20 + i); });
    }
    if (wanted("store")) peers.emplace_back([this] { StoreWriter(30); });
    const absl::Time start = absl::Now();
    std::vector<Sample> samples{Take()};
    while (absl::Now() - start < absl::Seconds(o_.seconds)) {
      absl::SleepFor(absl::Seconds(10));
      samples.push_back(Take());
      Print(samples.back(), samples[samples.size() - 2], start);
    }
    stop_ = true;
    for (std::thread& t : peers) t.join();
    return Report(quiet_rate, quiet_end, samples, start);
  }

 private:
  struct Sample {
    absl::Time at;
    int64_t steps = 0;
    double step_ms = 0;
    double rss = 0;
    bool running = false;
  };

  bool StartCoordinator() {
    coordinator_ = std::make_unique<Background>(
        std::vector<std::string>{o_.coordinator_bin, "--listen", "127.0.0.1:0", "--data-dir",
                                 o_.work + "/state", "--lease-ttl", "3s", "--collective-timeout",
                                 "20s", "--forget-lost-after", o_.forget_lost_after},
        o_.work + "/coordinator.log");
    address_ = coordinator_->ListeningAddress(std::chrono::seconds(30));
    if (address_.empty()) {
      std::cerr << "hostile: the coordinator did not start:\n" << coordinator_->Log();
      return false;
    }
    return true;
  }

  void StartWorker(int i) {
    std::vector<std::string> argv;
    if (o_.pin) {
      const unsigned last = std::thread::hardware_concurrency() - 1;
      argv = {"/usr/bin/taskset", "-c", absl::StrCat(last)};
    }
    for (std::string arg :
         {o_.worker_bin, std::string("--coordinator"), address_, std::string("--worker-id"),
          absl::StrCat("w", i), std::string("--memory-budget"), std::string("1GiB")}) {
      argv.push_back(std::move(arg));
    }
    workers_.push_back(
        std::make_unique<Background>(std::move(argv), absl::StrCat(o_.work, "/w", i, ".log")));
  }

  // The job that trains through the run: far more steps than it will take.
  bool SubmitRealJob() {
    const std::string file = o_.work + "/real.yaml";
    std::ofstream(file) << "name: real\nworld_size: 2\n"
                        << "parallelism: {data_parallel_sharding_strategy: optim_grads_params}\n"
                        << "model: {mlp: {dims: [32, 128, 128, 8]}}\ninit: {seed: 1}\n"
                        << "data: {teacher: {seed: 7, samples: 512}}\n"
                        << "training: {steps: 100000000, global_batch_size: 64}\n"
                        << "output: {dir: " << o_.work << "/real}\n";
    absl::StatusOr<v1::JobSpec> spec = client::LoadJobForSubmit(file);
    if (!spec.ok()) {
      std::cerr << "hostile: " << spec.status() << "\n";
      return false;
    }
    absl::StatusOr<v1::SubmitJobResponse> r = client_->Submit(*spec, "real");
    if (!r.ok()) {
      std::cerr << "hostile: submit: " << r.status() << "\n";
      return false;
    }
    real_ = r->job().id();
    for (int i = 0; i < 600; ++i) {
      absl::StatusOr<v1::Job> job = client_->Get(real_);
      if (job.ok() && job->steps_done() >= 100) return true;
      absl::SleepFor(absl::Milliseconds(100));
    }
    std::cerr << "hostile: the job did not train:\n" << coordinator_->Log();
    return false;
  }

  Sample Take() {
    Sample s;
    s.at = absl::Now();
    s.rss = RssMib(coordinator_->pid());
    absl::StatusOr<v1::Job> job = client_->Get(real_);
    if (job.ok()) {
      s.steps = job->steps_done();
      s.step_ms = job->step_seconds() * 1e3;
      s.running = job->state() == v1::JOB_STATE_RUNNING;
    }
    return s;
  }

  static double Rate(const Sample& a, const Sample& b) {
    const double dt = absl::ToDoubleSeconds(b.at - a.at);
    return dt > 0 ? static_cast<double>(b.steps - a.steps) / dt : 0;
  }

  void Print(const Sample& now, const Sample& before, absl::Time start) {
    std::printf(
        "hostile: t=%3.0fs coordinator %.1f MiB, job %.1f steps/s (step %.2f ms), submits %lld "
        "ok / %lld refused, watches %lld / %lld refused, fake workers %lld / %lld refused, "
        "store writes %lld refused / %lld taken\n",
        absl::ToDoubleSeconds(now.at - start), now.rss, Rate(before, now), now.step_ms,
        static_cast<long long>(counts_.submitted.load()),
        static_cast<long long>(counts_.submit_refused.load()),
        static_cast<long long>(counts_.watches.load()),
        static_cast<long long>(counts_.watch_refused.load()),
        static_cast<long long>(counts_.fakes.load()),
        static_cast<long long>(counts_.fake_refused.load()),
        static_cast<long long>(counts_.store_refused.load()),
        static_cast<long long>(counts_.store_taken.load()));
    std::fflush(stdout);
  }

  // A job that waits for 64 workers; every 20th with a 400-layer model.
  v1::JobSpec FloodSpec(int peer, int64_t n) {
    v1::JobSpec spec;
    spec.set_name(absl::StrCat("flood-", peer, "-", n));
    spec.set_world_size(64);
    auto* dims = spec.mutable_model()->mutable_mlp()->mutable_dims();
    const int layers = n % 20 == 0 ? 400 : 2;
    for (int i = 0; i <= layers; ++i) dims->Add(i == 0 ? 8 : 16);
    spec.mutable_data()->mutable_teacher()->set_seed(1);
    spec.mutable_data()->mutable_teacher()->set_samples(128);
    spec.mutable_training()->set_steps(4);
    spec.mutable_training()->set_global_batch_size(64);
    spec.mutable_output()->set_dir(absl::StrCat(o_.work, "/flood/", peer, "-", n));
    return spec;
  }

  void Submitter(int peer) {
    auto jobs = v1::Jobs::NewStub(OwnChannel(address_, peer));
    for (int64_t n = 0; !stop_; ++n) {
      v1::SubmitJobRequest request;
      request.set_request_id(absl::StrCat("flood-", peer, "-", n));
      *request.mutable_spec() = FloodSpec(peer, n);
      v1::SubmitJobResponse response;
      grpc::ClientContext context;
      context.set_deadline(In(10000));
      const grpc::Status s = jobs->SubmitJob(&context, request, &response);
      if (s.ok()) {
        ++counts_.submitted;
        std::lock_guard<std::mutex> lock(mu_);
        accepted_.push_back(response.job().id());
      } else if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++counts_.submit_refused;
      } else {
        ++counts_.submit_failed;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  std::string SomeJob(std::mt19937& rng) {
    std::lock_guard<std::mutex> lock(mu_);
    if (accepted_.empty() || rng() % 4 == 0) return real_;
    return accepted_[rng() % accepted_.size()];
  }

  void Watcher(int peer) {
    auto jobs = v1::Jobs::NewStub(OwnChannel(address_, peer));
    std::mt19937 rng(peer);
    struct Held {
      std::unique_ptr<grpc::ClientContext> context;
      std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader;
      absl::Time drop_at;
    };
    std::vector<Held> held;
    while (!stop_) {
      Held h{std::make_unique<grpc::ClientContext>(), nullptr,
             absl::Now() + absl::Milliseconds(rng() % 5000)};
      v1::WatchJobRequest request;
      request.set_job_id(SomeJob(rng));
      h.reader = jobs->WatchJob(h.context.get(), request);
      v1::JobEvent first;
      if (!h.reader->Read(&first)) {
        const grpc::Status s = h.reader->Finish();
        if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++counts_.watch_refused;
      } else {
        ++counts_.watches;
        if (rng() % 2 == 0) {
          h.context->TryCancel();  // abandoned at once
          (void)h.reader->Finish();
        } else {
          held.push_back(std::move(h));  // held unread, dropped later
        }
      }
      const absl::Time now = absl::Now();
      for (Held& x : held) {
        if (x.drop_at <= now) x.context->TryCancel();
      }
      std::erase_if(held, [&](Held& x) {
        if (x.drop_at > now) return false;
        (void)x.reader->Finish();
        return true;
      });
      absl::SleepFor(absl::Milliseconds(25));
    }
    for (Held& x : held) {
      x.context->TryCancel();
      (void)x.reader->Finish();
    }
  }

  void FakeWorkers(int peer) {
    auto fleet = v1::Fleet::NewStub(OwnChannel(address_, peer));
    for (int64_t n = 0; !stop_; ++n) {
      v1::RegisterRequest request;
      request.mutable_info()->set_worker_id(absl::StrCat("fake-", peer, "-", n));
      request.mutable_info()->set_device("cpu");
      request.mutable_info()->set_address("127.0.0.1");
      request.mutable_info()->set_memory_bytes(int64_t{1} << 30);
      v1::RegisterResponse response;
      grpc::ClientContext context;
      context.set_deadline(In(10000));
      if (fleet->Register(&context, request, &response).ok()) {
        ++counts_.fakes;
      } else {
        ++counts_.fake_refused;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  void StoreWriter(int peer) {
    auto store = v1::Store::NewStub(OwnChannel(address_, peer));
    std::mt19937 rng(peer);
    for (int64_t n = 0; !stop_; ++n) {
      v1::StoreSetRequest request;
      request.mutable_scope()->set_job_id(n % 2 == 0 ? SomeJob(rng) : absl::StrCat("j-", rng()));
      request.mutable_scope()->set_attempt(static_cast<int32_t>(rng() % 3));
      request.set_key(absl::StrCat("hostile/", n));
      request.set_value(std::string(1024, 'x'));
      v1::StoreSetResponse response;
      grpc::ClientContext context;
      context.set_deadline(In(10000));
      if (store->Set(&context, request, &response).ok()) {
        ++counts_.store_taken;
      } else {
        ++counts_.store_refused;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  int Report(double quiet_rate, const Sample& quiet, const std::vector<Sample>& samples,
             absl::Time start) {
    // The first minute (a third of a shorter run) is the warm-up: the floods
    // reach their bounds.
    const absl::Duration warm_up = std::min(absl::Seconds(60), absl::Seconds(o_.seconds) / 3);
    const Sample* minute = &samples.back();
    for (const Sample& s : samples) {
      if (s.at - start >= warm_up) {
        minute = &s;
        break;
      }
    }
    const Sample& end = samples.back();
    double peak = 0;
    for (const Sample& s : samples) {
      if (s.at >= minute->at) peak = std::max(peak, s.rss);
    }
    const double loaded_rate = Rate(*minute, end);
    std::printf(
        "hostile: under load (after the warm-up): %.1f steps/s = %.3f of quiet; step "
        "%.2f ms (median) against %.2f ms quiet\n",
        loaded_rate, quiet_rate > 0 ? loaded_rate / quiet_rate : 0, end.step_ms, quiet.step_ms);
    std::printf(
        "hostile: coordinator memory: %.1f MiB quiet, %.1f MiB after the warm-up, peak %.1f "
        "MiB after it, %.1f MiB at the end (%+.1f%% from the warm-up)\n",
        quiet.rss, minute->rss, peak, end.rss,
        minute->rss > 0 ? 100.0 * (end.rss - minute->rss) / minute->rss : 0.0);
    int missing = 0;
    for (const std::string& id : accepted_) missing += client_->Get(id).ok() ? 0 : 1;
    std::printf(
        "hostile: %zu submits acknowledged, %d of them missing; %lld refused at a bound, "
        "%lld failed otherwise\n",
        accepted_.size(), missing, static_cast<long long>(counts_.submit_refused.load()),
        static_cast<long long>(counts_.submit_failed.load()));
    absl::StatusOr<v1::Job> job = client_->Cancel(real_, "the hostile run is over");
    const bool trained = end.running && end.steps > minute->steps;
    if (!trained) std::printf("hostile: the real job stopped training\n");
    return missing == 0 && trained && job.ok() ? 0 : 1;
  }

  const Options o_;
  std::unique_ptr<Background> coordinator_;
  std::vector<std::unique_ptr<Background>> workers_;
  std::unique_ptr<client::CoordinatorClient> client_;
  std::string address_, real_;
  std::atomic<bool> stop_{false};
  Counts counts_;
  std::mutex mu_;
  std::vector<std::string> accepted_;
};

}  // namespace
}  // namespace muonmesh

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: hostile COORDINATOR_BIN WORKER_BIN WORK_DIR [--seconds 180] "
                 "[--quiet 30] [--forget-lost-after 30s] [--peers submit,watch,fake,store] "
                 "[--pin 0|1]\n";
    return 2;
  }
  muonmesh::Options o;
  o.coordinator_bin = argv[1];
  o.worker_bin = argv[2];
  o.work = argv[3];
  for (int i = 4; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    bool ok = true;
    if (flag == "--seconds") {
      ok = absl::SimpleAtoi(value, &o.seconds) && o.seconds >= 30;
    } else if (flag == "--quiet") {
      ok = absl::SimpleAtoi(value, &o.quiet) && o.quiet >= 5;
    } else if (flag == "--forget-lost-after") {
      o.forget_lost_after = value;
    } else if (flag == "--peers") {
      o.peers = value;
    } else if (flag == "--pin") {
      o.pin = value == "1";
    } else {
      ok = false;
    }
    if (!ok) {
      std::cerr << "hostile: bad flag " << flag << " " << value
                << " (--seconds >= 30, --quiet >= 5, --forget-lost-after D)\n";
      return 2;
    }
  }
  return muonmesh::Hostile(o).Run();
}
