// The soak run of the faults issue (not a test of the suite: run it with
// tests/server/control/soak.sh). On loopback it starts a coordinator and W
// worker daemons, submits J jobs, and while they run kills a busy worker
// every few seconds (SIGKILL; the same id comes back a moment later; as
// many kills as jobs) and the coordinator three times (SIGKILL; it comes back
// 2 s later on the same address and data folder). Then it checks that every
// acknowledged job is still there and SUCCEEDED, that no attempt running at
// a coordinator kill was restarted for it (the restarted coordinator keeps
// running attempts), and prints the counts and the time from each fault to
// the job's first step after it (as the job's event log stamps it), median
// and worst, worker kills and coordinator kills apart.
//
//   soak COORDINATOR_BIN WORKER_BIN WORK_DIR [--jobs J] [--workers W]
//        [--seconds LIMIT] [--seed S]
//
// Exits 0 when nothing was lost and every job ended in time, 1 otherwise.

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "tests/testing/background.h"

namespace muonmesh {
namespace {

using testing::Background;

struct Options {
  std::string coordinator_bin, worker_bin, work;
  int jobs = 20;
  int workers = 6;
  int seconds = 600;
  uint32_t seed = 1;
};

// A fault and the jobs it hit: (job id, the attempt that was running).
struct Fault {
  std::string what;
  absl::Time at;
  std::vector<std::pair<std::string, int32_t>> hit;
};

bool IsFinal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

class Soak {
 public:
  explicit Soak(Options o) : o_(std::move(o)), rng_(o_.seed) {}

  int Run() {
    std::filesystem::remove_all(o_.work);
    std::filesystem::create_directories(o_.work);
    if (!StartCoordinator("127.0.0.1:0")) return 1;
    client_ = std::make_unique<client::CoordinatorClient>(address_);
    for (int i = 0; i < o_.workers; ++i) StartWorker(i);
    if (!SubmitAll()) return 1;

    const absl::Time end = absl::Now() + absl::Seconds(o_.seconds);
    int coordinator_kills = 0;
    std::map<int, absl::Time> comes_back;  // killed worker -> when to restart it
    while (absl::Now() < end && !AllFinal()) {
      absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(1000, 3000)(rng_)));
      for (auto it = comes_back.begin(); it != comes_back.end();) {
        if (absl::Now() < it->second) {
          ++it;
          continue;
        }
        StartWorker(it->first);
        it = comes_back.erase(it);
      }
      // The coordinator at a quarter, half and three quarters of the jobs
      // finished (each time some are running).
      const int finished = Finished();
      if (coordinator_kills < 3 && finished >= o_.jobs * (coordinator_kills + 1) / 4 &&
          !Hits("", "").hit.empty()) {
        KillCoordinator();
        ++coordinator_kills;
        continue;
      }
      // At most one worker kill per job, so that the run ends (every fault
      // costs its job a restart, and the jobs have max_restarts 6).
      if (std::optional<int> w = BusyWorker();
          w && comes_back.count(*w) == 0 && worker_kills_ < o_.jobs) {
        ++worker_kills_;
        KillWorker(*w);
        comes_back[*w] = absl::Now() + absl::Seconds(1);
      }
    }
    for (const auto& [w, when] : comes_back) StartWorker(w);
    while (absl::Now() < end && !AllFinal()) absl::SleepFor(absl::Milliseconds(200));
    return Report(coordinator_kills);
  }

 private:
  bool StartCoordinator(const std::string& listen) {
    coordinator_ = std::make_unique<Background>(
        std::vector<std::string>{o_.coordinator_bin, "--listen", listen, "--data-dir",
                                 o_.work + "/state", "--lease-ttl", "3s",
                                 "--collective-timeout", "10s"},
        absl::StrCat(o_.work, "/coordinator-", starts_++, ".log"));
    address_ = coordinator_->ListeningAddress(std::chrono::seconds(30));
    if (address_.empty()) {
      std::cerr << "soak: the coordinator did not start:\n" << coordinator_->Log();
      return false;
    }
    return true;
  }

  void StartWorker(int i) {
    workers_[i] = std::make_unique<Background>(
        std::vector<std::string>{o_.worker_bin, "--coordinator", address_, "--worker-id",
                                 absl::StrCat("w", i), "--memory-budget", "512MiB"},
        absl::StrCat(o_.work, "/w", i, "-", worker_starts_++, ".log"));
  }

  bool SubmitAll() {
    std::uniform_int_distribution<int> steps(30, 90);
    for (int i = 0; i < o_.jobs; ++i) {
      const int world = i % 4 == 3 ? 3 : 2;
      const std::string dir = absl::StrCat(o_.work, "/jobs/", i);
      std::filesystem::create_directories(dir);
      const std::string file = dir + "/job.yaml";
      std::ofstream(file) << "name: soak-" << i << "\nworld_size: " << world
                          << "\nparallelism: {data_parallel_sharding_strategy: optim_grads_params}"
                          << "\nmodel: {mlp: {dims: [16, 64, 64, 8]}}\ninit: {seed: " << i
                          << "}\ndata: {teacher: {seed: 7, samples: 192}}\n"
                          << "training: {steps: " << steps(rng_)
                          << ", global_batch_size: 24, checkpoint_every: 5, max_restarts: 6}\n"
                          << "output: {dir: " << dir << "/out}\n";
      absl::StatusOr<v1::JobSpec> spec = client::LoadJobForSubmit(file);
      if (!spec.ok()) {
        std::cerr << "soak: " << spec.status() << "\n";
        return false;
      }
      absl::StatusOr<v1::SubmitJobResponse> r = client_->Submit(*spec, absl::StrCat("soak-", i));
      if (!r.ok()) {
        std::cerr << "soak: submit " << i << ": " << r.status() << "\n";
        return false;
      }
      ids_.push_back(r->job().id());
    }
    std::cout << "soak: " << ids_.size() << " jobs submitted and acknowledged\n";
    return true;
  }

  std::vector<v1::Job> Jobs() {
    std::vector<v1::Job> jobs;
    for (const std::string& id : ids_) {
      absl::StatusOr<v1::Job> j = client_->Get(id);
      if (j.ok()) jobs.push_back(*j);
    }
    return jobs;
  }

  int Finished() {
    int n = 0;
    for (const v1::Job& j : Jobs()) n += IsFinal(j.state()) ? 1 : 0;
    return n;
  }

  bool AllFinal() {
    const std::vector<v1::Job> jobs = Jobs();
    return jobs.size() == ids_.size() &&
           std::all_of(jobs.begin(), jobs.end(), [](const v1::Job& j) { return IsFinal(j.state()); });
  }

  // A worker that runs a rank of a running job, picked at random.
  std::optional<int> BusyWorker() {
    std::vector<int> busy;
    for (const v1::Job& j : Jobs()) {
      if (j.state() != v1::JOB_STATE_RUNNING) continue;
      for (const std::string& w : j.worker_ids()) {
        int i = 0;
        if (absl::SimpleAtoi(w.substr(1), &i) && workers_[i] != nullptr) busy.push_back(i);
      }
    }
    if (busy.empty()) return std::nullopt;
    return busy[std::uniform_int_distribution<size_t>(0, busy.size() - 1)(rng_)];
  }

  Fault Hits(const std::string& what, const std::string& worker) {
    Fault f{what, absl::Now(), {}};
    for (const v1::Job& j : Jobs()) {
      if (j.state() != v1::JOB_STATE_RUNNING) continue;
      const bool on_it = worker.empty() || std::find(j.worker_ids().begin(), j.worker_ids().end(),
                                                     worker) != j.worker_ids().end();
      if (on_it) f.hit.push_back({j.id(), j.attempt()});
    }
    return f;
  }

  void KillWorker(int i) {
    Fault f = Hits(absl::StrCat("worker w", i, " killed"), absl::StrCat("w", i));
    workers_[i]->Signal(SIGKILL);
    workers_[i]->Wait(std::chrono::seconds(10));
    f.at = absl::Now();
    faults_.push_back(std::move(f));
  }

  void KillCoordinator() {
    Fault f = Hits("coordinator killed", "");
    coordinator_->Signal(SIGKILL);
    coordinator_->Wait(std::chrono::seconds(10));
    f.at = absl::Now();
    faults_.push_back(std::move(f));
    absl::SleepFor(absl::Seconds(2));
    if (!StartCoordinator(address_)) std::cerr << "soak: the coordinator did not come back\n";
    client_ = std::make_unique<client::CoordinatorClient>(address_);
  }

  // When the job's first step after the fault was recorded: of an attempt
  // after `attempt` (a worker kill), or any step after `at` (a coordinator
  // kill: the attempt goes on). `restarted` tells whether the attempt running
  // at a coordinator kill was restarted for it.
  std::optional<absl::Time> FirstStepAfter(const std::string& id, int32_t attempt, bool by_time,
                                           absl::Time at, bool* restarted) {
    std::optional<absl::Time> first;
    (void)client_->Watch(id, 0, absl::Seconds(30), [&](const v1::JobEvent& e) {
      const absl::Time when = absl::FromUnixMillis(e.unix_ms());
      if (by_time && e.has_state_change() && when > at &&
          e.state_change().state() == v1::JOB_STATE_RESTARTING &&
          e.state_change().attempt() == attempt &&
          e.state_change().reason().find("of the coordinator's restart") != std::string::npos) {
        *restarted = true;
      }
      if (first.has_value() || !e.has_step()) return true;
      if (by_time ? when > at : e.step().attempt() > attempt) first = when;
      return true;
    });
    return first;
  }

  int Report(int coordinator_kills) {
    int status = 0;
    const std::vector<v1::Job> jobs = Jobs();
    std::map<std::string, int> by_state;
    for (const v1::Job& j : jobs) {
      by_state[v1::JobState_Name(j.state())] += 1;
      if (j.state() != v1::JOB_STATE_SUCCEEDED) {
        std::cout << "soak: " << j.id() << " " << v1::JobState_Name(j.state()) << ": "
                  << j.reason() << "\n";
        status = 1;
      }
    }
    std::cout << "soak: " << jobs.size() << " of " << ids_.size() << " acknowledged jobs found";
    for (const auto& [state, n] : by_state) std::cout << ", " << n << " " << state;
    std::cout << "\n";
    if (jobs.size() != ids_.size()) status = 1;

    std::vector<double> worker_recovery, coordinator_recovery;
    int hits = 0, no_step = 0, coordinator_hits = 0, restarted_by_coordinator = 0;
    for (const Fault& f : faults_) {
      const bool coordinator = f.what == "coordinator killed";
      for (const auto& [id, attempt] : f.hit) {
        ++hits;
        coordinator_hits += coordinator ? 1 : 0;
        bool restarted = false;
        std::optional<absl::Time> t = FirstStepAfter(id, attempt, coordinator, f.at, &restarted);
        if (restarted) {
          ++restarted_by_coordinator;
          std::cout << "soak: " << id << " attempt " << attempt
                    << " was restarted after a coordinator kill\n";
        }
        if (t.has_value()) {
          (coordinator ? coordinator_recovery : worker_recovery)
              .push_back(absl::ToDoubleSeconds(*t - f.at));
        } else {
          ++no_step;  // it had finished its last step, or failed for good
        }
      }
    }
    if (restarted_by_coordinator > 0) status = 1;
    std::cout << "soak: faults: " << faults_.size() - coordinator_kills
              << " workers killed, coordinator killed " << coordinator_kills << " times; " << hits
              << " running attempts hit (" << coordinator_hits << " by coordinator kills, "
              << restarted_by_coordinator << " of them restarted), " << no_step
              << " without a later step\n";
    for (auto [name, recovery] : {std::pair{"worker kill", worker_recovery},
                                  std::pair{"coordinator kill", coordinator_recovery}}) {
      if (recovery.empty()) continue;
      std::sort(recovery.begin(), recovery.end());
      std::cout << absl::StrFormat(
          "soak: %s to the job's first step after it: median %.1f s, worst %.1f s (%d jobs)\n",
          name, recovery[recovery.size() / 2], recovery.back(), static_cast<int>(recovery.size()));
    }
    std::cout << "soak: " << (status == 0 ? "OK" : "FAILED") << "\n";
    return status;
  }

  Options o_;
  std::mt19937 rng_;
  std::unique_ptr<Background> coordinator_;
  std::map<int, std::unique_ptr<Background>> workers_;
  std::unique_ptr<client::CoordinatorClient> client_;
  std::string address_;
  std::vector<std::string> ids_;
  std::vector<Fault> faults_;
  int starts_ = 0;
  int worker_kills_ = 0;
  int worker_starts_ = 0;
};

}  // namespace
}  // namespace muonmesh

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: soak COORDINATOR_BIN WORKER_BIN WORK_DIR [--jobs J] [--workers W] "
                 "[--seconds LIMIT] [--seed S]\n";
    return 2;
  }
  muonmesh::Options o{argv[1], argv[2], argv[3]};
  for (int i = 4; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    int value = 0;
    if (!absl::SimpleAtoi(argv[i + 1], &value) || value < 1) {
      std::cerr << "soak: " << flag << " takes a positive whole number\n";
      return 2;
    }
    if (flag == "--jobs") {
      o.jobs = value;
    } else if (flag == "--workers") {
      o.workers = value;
    } else if (flag == "--seconds") {
      o.seconds = value;
    } else if (flag == "--seed") {
      o.seed = static_cast<uint32_t>(value);
    } else {
      std::cerr << "soak: unknown flag " << flag << "\n";
      return 2;
    }
  }
  return muonmesh::Soak(o).Run();
}
