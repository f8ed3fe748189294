// muonmesh-worker: one rank of a job. For now only --standalone (ranks meet
// through a shared folder, no coordinator); the control plane adds the
// daemon mode that registers with a coordinator.

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "worker/job/memory_budget.h"
#include "worker/standalone.h"

namespace {

constexpr const char* kUsage =
    "usage: muonmesh-worker --standalone --job FILE --rank R --world-size W --store DIR\n"
    "                       [--hostname 127.0.0.1] [--timeout-seconds 60] [--attempt 0]\n"
    "                       [--resume] [--fail-at-step S] [--cuda-device N]\n"
    "                       [--create-store] [--memory-budget SIZE]\n"
    "       muonmesh-worker --describe --job FILE\n"
    "\n"
    "--standalone runs rank R of the job file (a JobSpec in YAML or JSON) to completion.\n"
    "All W ranks share --store (an existing folder, or one --create-store makes; use a\n"
    "fresh one per attempt) to find each other and talk over Gloo/TCP. Before it\n"
    "allocates the job's data and shards, each rank estimates its peak host memory and\n"
    "refuses the job (RESOURCE_EXHAUSTED, naming the job fields) above --memory-budget\n"
    "(e.g. 8GiB; default 80% of this machine's memory, cgroup limit or rlimit, shared by\n"
    "the job's ranks when --hostname is a loopback address). Rank 0 prints the loss of\n"
    "every step and writes\n"
    "output.export. With training.checkpoint_every N, every N steps each rank saves its\n"
    "shards under <output.dir>/checkpoints/step-NNNNNNNN/ and rank 0 marks the folder\n"
    "COMPLETE; --resume continues from the newest complete checkpoint (give every rank\n"
    "of the new attempt --resume, a new --attempt and a fresh --store).\n"
    "Jobs with device: cuda run on GPU N (default: rank modulo the GPUs of the machine)\n"
    "with NCCL; every built-in workload (mlp, moe_mlp, synthetic) runs there. They need\n"
    "muonmesh-worker-cuda, this program built with CUDA; muonmesh-worker runs cpu jobs.\n"
    "--fail-at-step S makes this rank fail just before step S in attempt 0 only (to test\n"
    "restarts: the next attempt gets past it).\n"
    "\n"
    "--describe prints the job's name, world_size, steps, checkpoint_every,\n"
    "max_restarts, output_dir and export as key=value lines (for launch scripts).\n"
    "\n"
    "Exit codes: 0 done, 1 the job is invalid or failed (out of memory included), 2 usage\n"
    "error.\n";

int Usage(const std::string& problem) {
  std::cerr << "muonmesh-worker: " << problem << "\n" << kUsage;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  muonmesh::worker::StandaloneOptions options;
  bool standalone = false;
  bool describe = false;
  bool have_rank = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (arg == "--standalone") {
      standalone = true;
      continue;
    }
    if (arg == "--describe") {
      describe = true;
      continue;
    }
    if (arg == "--resume") {
      options.resume = true;
      continue;
    }
    if (arg == "--create-store") {
      options.create_store = true;
      continue;
    }
    if (i + 1 >= argc) return Usage(absl::StrCat(arg, " needs a value"));
    const std::string value = argv[++i];
    int64_t number = 0;
    const bool numeric = absl::SimpleAtoi(value, &number);
    if (arg == "--job") {
      options.job_path = value;
    } else if (arg == "--store") {
      options.store_dir = value;
    } else if (arg == "--hostname") {
      options.hostname = value;
    } else if (arg == "--rank") {
      if (!numeric) return Usage(absl::StrCat("--rank: not an integer: '", value, "'"));
      options.rank = static_cast<int32_t>(number);
      have_rank = true;
    } else if (arg == "--world-size") {
      if (!numeric) return Usage(absl::StrCat("--world-size: not an integer: '", value, "'"));
      options.world_size = number;
    } else if (arg == "--timeout-seconds") {
      if (!numeric || number < 1) {
        return Usage(absl::StrCat("--timeout-seconds: not a positive integer: '", value, "'"));
      }
      options.timeout = absl::Seconds(number);
    } else if (arg == "--cuda-device") {
      if (!numeric || number < 0) {
        return Usage(absl::StrCat("--cuda-device: not a GPU number: '", value, "'"));
      }
      options.cuda_device = static_cast<int>(number);
    } else if (arg == "--fail-at-step") {
      if (!numeric || number < 0) {
        return Usage(absl::StrCat("--fail-at-step: not a step number: '", value, "'"));
      }
      options.fail_at_step = number;
    } else if (arg == "--memory-budget") {
      absl::StatusOr<int64_t> bytes = muonmesh::worker::ParseByteSize(value);
      if (!bytes.ok()) return Usage(absl::StrCat("--memory-budget: ", bytes.status().message()));
      options.memory_budget_bytes = *bytes;
    } else if (arg == "--attempt") {
      if (!numeric || number < 0) return Usage(absl::StrCat("--attempt: bad value '", value, "'"));
      options.attempt = static_cast<int>(number);
    } else {
      return Usage(absl::StrCat("unknown flag ", arg));
    }
  }
  if (describe) {
    if (standalone) return Usage("give one of --standalone and --describe");
    if (options.job_path.empty()) return Usage("--job is required");
    absl::Status st = muonmesh::worker::DescribeJob(
        options.job_path, [](const std::string& line) { std::cout << line << "\n"; });
    if (!st.ok()) {
      std::cerr << "muonmesh-worker: " << absl::StatusCodeToString(st.code()) << ": "
                << st.message() << std::endl;
      return 1;
    }
    return 0;
  }
  if (!standalone) return Usage("give --standalone (or --describe)");
  if (options.job_path.empty()) return Usage("--job is required");
  if (options.store_dir.empty()) return Usage("--store is required");
  if (!have_rank) return Usage("--rank is required");
  if (options.world_size < 1) return Usage("--world-size is required (>= 1)");

  absl::Status st;
  // The memory check refuses what it can foresee; anything else that runs
  // out of memory ends here with a message, not in std::terminate.
  try {
    st = muonmesh::worker::RunStandalone(
        options, [](const std::string& line) { std::cout << line << std::endl; });
  } catch (const std::bad_alloc&) {
    st = absl::ResourceExhaustedError(
        "out of memory (an allocation failed; lower --memory-budget or the job's sizes)");
  } catch (const std::length_error& e) {
    st = absl::ResourceExhaustedError(absl::StrCat("out of memory: ", e.what()));
  }
  if (!st.ok()) {
    std::cerr << "muonmesh-worker rank " << options.rank << ": "
              << absl::StatusCodeToString(st.code()) << ": " << st.message() << std::endl;
    return 1;
  }
  return 0;
}
