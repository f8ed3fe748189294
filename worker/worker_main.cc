// muonmesh-worker: a worker daemon that serves a coordinator
// (--coordinator), or one rank of a job file without one (--standalone, for
// debugging), or a job file's launch facts (--describe), or text from a
// trained gpt (--sample).

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <iostream>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/base/flag_parser.h"
#include "proto/credentials/credentials.h"
#include "proto/rpc/version.h"
#include "worker/daemon.h"
#include "worker/job/memory_budget.h"
#include "worker/reshard.h"
#include "worker/runtime/trainer.h"
#include "worker/sample.h"
#include "worker/standalone.h"

namespace {

constexpr const char* kUsage =
    "usage: muonmesh-worker --coordinator HOST:PORT [--device cpu|cuda:N] [--worker-id ID]\n"
    "                       [--address HOST] [--gloo-interface IFACE] [--memory-budget SIZE]\n"
    "                       [--locality ZONE/RACK/HOST] [--drain-timeout 5m]\n"
    "                       [--metrics-listen HOST:PORT] [--allowed-dirs DIR[,DIR...]]\n"
    "                       [--tls-ca FILE [--tls-cert FILE --tls-key FILE]\n"
    "                        [--token-file FILE] [--tls-server-name NAME]]\n"
    "       muonmesh-worker --standalone --job FILE --rank R --world-size W --store DIR\n"
    "                       [--hostname 127.0.0.1] [--gloo-interface IFACE]\n"
    "                       [--timeout-seconds 60] [--attempt 0]\n"
    "                       [--resume] [--fail-at-step S] [--cuda-device N]\n"
    "                       [--create-store] [--memory-budget SIZE]\n"
    "       muonmesh-worker --describe --job FILE\n"
    "       muonmesh-worker --version\n"
    "       muonmesh-worker --consolidate CHECKPOINT --out FILE\n"
    "       muonmesh-worker --sample --job FILE --weights FILE [--prompt TEXT]\n"
    "                       [--prompt-ids ID,ID...] [--tokens 200] [--temperature 1]\n"
    "                       [--top-k 0] [--seed 0] [--tokenizer gpt2_tokenizer.bin]\n"
    "\n"
    "--coordinator makes this process a worker daemon: it registers with the coordinator\n"
    "(as --worker-id, default <hostname>/<device>/<pid>; peers reach it at --address,\n"
    "default the address this host reaches the coordinator from, so 127.0.0.1 only when\n"
    "the coordinator is on this host; a coordinator refuses a worker that advertises a\n"
    "loopback address from another host; --gloo-interface IFACE makes its collectives\n"
    "bind that interface instead), keeps its lease with heartbeats, runs the ranks\n"
    "the coordinator assigns with the coordinator's plan and rendezvous, reports every\n"
    "step, and stops a rank when its job is cancelled. It runs until SIGINT (at once) or\n"
    "SIGTERM: then it\n"
    "asks the coordinator to drain it (its rank checkpoints and the job moves to other\n"
    "workers) and exits 0 once drained, or after --drain-timeout (default 5m).\n"
    "--locality names where it sits in the network, widest level first (for example\n"
    "zone-a/rack-3/node12): a job's ranks go to the workers it takes in the order of these\n"
    "labels, so consecutive ranks (an inner data-parallel group) share a rack or host and\n"
    "the outer axis crosses the wide links (default empty: registration order). With\n"
    "--metrics-listen it serves Prometheus metrics at http://HOST:PORT/metrics (port 0\n"
    "picks a free one and logs it).\n"
    "--allowed-dirs names the only folders a job's paths (init/data safetensors, the\n"
    "synthetic spec, output.dir with its checkpoints and metrics, output.export) may use,\n"
    "after symbolic links and '..' are resolved; other jobs fail naming the field and path.\n"
    "--tls-ca (default $MUONMESH_TLS_CA) makes it talk TLS to the coordinator, trusting\n"
    "certificates that CA signed; --tls-cert/--tls-key ($MUONMESH_TLS_CERT/_KEY) are its\n"
    "client certificate (mutual TLS: a coordinator with a CA requires one for Fleet and\n"
    "Store); --token-file ($MUONMESH_TOKEN_FILE, or the token in $MUONMESH_TOKEN) its\n"
    "bearer token (role worker); --tls-server-name ($MUONMESH_TLS_SERVER_NAME) the name the\n"
    "coordinator's certificate must carry when it differs from the address's host.\n"
    "\n"
    "--standalone runs rank R of the job file (a JobSpec in YAML or JSON) to completion.\n"
    "All W ranks share --store (an existing folder, or one --create-store makes; use a\n"
    "fresh one per attempt) to find each other and talk over Gloo/TCP. Rank 0 prints the\n"
    "loss of every step and writes output.export. With training.checkpoint_every N, every\n"
    "N steps each rank saves its shards under <output.dir>/checkpoints/step-NNNNNNNN/ and\n"
    "rank 0 marks the folder COMPLETE; --resume continues from the newest complete\n"
    "checkpoint (give every rank of the new attempt --resume, a new --attempt and a fresh\n"
    "--store). --fail-at-step S makes this rank fail just before step S in attempt 0 only\n"
    "(to test restarts: the next attempt gets past it). A first attempt refuses to start\n"
    "over an earlier run's outputs in output.dir (checkpoints, metrics, the export) unless\n"
    "the job sets init: {fresh: true}, which moves them to output.dir/earlier-<time>/.\n"
    "\n"
    "Memory: before it allocates a job's data and shards, each rank estimates its peak\n"
    "host memory and refuses the job (RESOURCE_EXHAUSTED, naming the job fields) above\n"
    "--memory-budget (e.g. 8GiB; default 80% of this machine's memory, cgroup limit or\n"
    "rlimit; in --standalone mode shared by the job's ranks when --hostname is a loopback\n"
    "address).\n"
    "Jobs with device: cuda run on GPU N (--cuda-device, or cuda:N; default: rank modulo\n"
    "the GPUs of the machine) with NCCL. They need muonmesh-worker-cuda, this program\n"
    "built with CUDA; muonmesh-worker runs cpu jobs.\n"
    "\n"
    "--describe prints the job's name, world_size, steps, checkpoint_every,\n"
    "max_restarts, output_dir and export as key=value lines (for launch scripts).\n"
    "\n"
    "--consolidate puts a checkpoint written under any layout (a step-N folder, or a\n"
    "job's checkpoints/ or output folder: its newest complete one) back together as one\n"
    "safetensors file at --out: every parameter whole under its own name and its optimizer\n"
    "state as optimizer/NAME/{momentum,exp_avg,exp_avg_sq}, with the step. A job starts\n"
    "from it (or from the checkpoint itself) under any layout with init: {checkpoint: ...}.\n"
    "\n"
    "--sample prints text a trained gpt writes after --prompt: --weights is the job's\n"
    "export (or any safetensors file with its parameters); --tokens new tokens are drawn\n"
    "one by one at --temperature (0: always the likeliest) from the --top-k likeliest\n"
    "(0: all), reproducibly for one --seed (exact rule: worker/sample.h). A model trained\n"
    "on data.text prints text; one trained on token shards prints token ids, or text with\n"
    "--tokenizer (llm.c's gpt2_tokenizer.bin format), and takes its prompt as --prompt-ids.\n"
    "\n"
    "Exit codes: 0 done (or stopped by a signal), 1 the job is invalid or failed (out of\n"
    "memory included) or the daemon cannot serve, 2 usage error, 3 the job's own error,\n"
    "which no restart can mend (launchers must not --resume it).\n";

// Exit code of a failure that is the job's own (kJobErrorPayload).
constexpr int kExitJobError = 3;

int Usage(const std::string& problem) {
  std::cerr << "muonmesh-worker: " << problem << "\n" << kUsage;
  return 2;
}

enum class Mode { kNone, kStandalone, kDescribe, kDaemon, kSample, kConsolidate };

struct Args {
  Mode mode = Mode::kNone;
  muonmesh::worker::SampleOptions sample;
  muonmesh::worker::StandaloneOptions standalone;
  muonmesh::worker::DaemonOptions daemon;
  bool have_rank = false;
  std::string consolidate, out;  // --consolidate CHECKPOINT --out FILE
};

// --sample's flags, as the parser takes them.
struct SampleFlags {
  bool sample = false;
  std::string prompt_ids;
  std::string temperature = "1";
  int64_t seed = 0;
};

void AddSampleFlags(muonmesh::FlagParser& p, SampleFlags& f, muonmesh::worker::SampleOptions& o) {
  p.Bool("--sample", "", &f.sample);
  p.String("--weights", "FILE", "", &o.weights_path);
  p.String("--prompt", "TEXT", "", &o.prompt);
  p.String("--prompt-ids", "ID,ID...", "", &f.prompt_ids);
  p.String("--tokenizer", "FILE", "", &o.tokenizer_path);
  p.Int("--tokens", "N", "", &o.tokens);
  p.String("--temperature", "T", "", &f.temperature);
  p.Int("--top-k", "K", "", &o.top_k);
  p.Int("--seed", "S", "", &f.seed);
}

// The sample flags the parser cannot type: "" or the usage problem.
std::string ParseSampleFlags(const std::string& ids, const std::string& temperature, int64_t seed,
                             muonmesh::worker::SampleOptions& o) {
  for (absl::string_view id : absl::StrSplit(ids, ',', absl::SkipEmpty())) {
    int32_t value = 0;
    if (!absl::SimpleAtoi(id, &value)) return absl::StrCat("--prompt-ids: not a token id: ", id);
    o.prompt_ids.push_back(value);
  }
  if (!absl::SimpleAtod(temperature, &o.temperature)) {
    return absl::StrCat("--temperature: not a number: ", temperature);
  }
  if (seed < 0) return absl::StrCat("--seed: must be >= 0, got ", seed);
  o.seed = static_cast<uint64_t>(seed);
  return "";
}

// The daemon's own flags (--allowed-dirs as given).
void AddDaemonFlags(muonmesh::FlagParser& p, muonmesh::worker::DaemonOptions& d,
                    std::string& allowed_dirs) {
  p.String("--coordinator", "HOST:PORT", "", &d.coordinator);
  p.String("--worker-id", "ID", "", &d.worker_id);
  p.String("--device", "cpu|cuda:N", "", &d.device);
  p.String("--address", "HOST", "", &d.address);
  p.String("--locality", "ZONE/RACK/HOST", "", &d.locality);
  p.String("--gloo-interface", "IFACE", "", &d.gloo_interface);
  p.String("--metrics-listen", "HOST:PORT", "", &d.metrics_listen);
  p.String("--allowed-dirs", "DIR[,DIR...]", "", &allowed_dirs);
  p.String("--tls-ca", "FILE", "", &d.security.tls_ca);
  p.String("--tls-cert", "FILE", "", &d.security.tls_cert);
  p.String("--tls-key", "FILE", "", &d.security.tls_key);
  p.String("--tls-server-name", "NAME", "", &d.security.tls_server_name);
  p.String("--token-file", "FILE", "", &d.security.token_file);
  p.Duration("--drain-timeout", "DURATION", "", &d.drain_timeout);
}

// Parses argv into `args`; returns "" or the usage problem (kUsage
// documents the flags).
std::string Parse(int argc, char** argv, Args& args) {
  muonmesh::worker::DaemonOptions& d = args.daemon;
  muonmesh::worker::StandaloneOptions& s = args.standalone;
  muonmesh::FlagParser p("muonmesh-worker");
  bool standalone = false, describe = false;
  SampleFlags sf;
  std::string allowed_dirs, memory_budget;
  int64_t rank = 0, timeout = 0, cuda_device = 0, fail_at_step = 0, attempt = 0;
  AddDaemonFlags(p, d, allowed_dirs);
  p.String("--memory-budget", "SIZE", "", &memory_budget);
  p.Bool("--standalone", "", &standalone);
  p.Bool("--describe", "", &describe);
  p.String("--consolidate", "CHECKPOINT", "", &args.consolidate);
  p.String("--out", "FILE", "", &args.out);
  p.Bool("--resume", "", &s.resume);
  p.Bool("--create-store", "", &s.create_store);
  p.String("--job", "FILE", "", &s.job_path);
  p.String("--store", "DIR", "", &s.store_dir);
  p.String("--hostname", "HOST", "", &s.hostname);
  p.Int("--rank", "R", "", &rank);
  p.Int("--world-size", "W", "", &s.world_size);
  p.Int("--timeout-seconds", "S", "", &timeout);
  p.Int("--cuda-device", "N", "", &cuda_device);
  p.Int("--fail-at-step", "S", "", &fail_at_step);
  p.Int("--attempt", "A", "", &attempt);
  AddSampleFlags(p, sf, args.sample);
  bool help = false;
  if (absl::Status st = p.Parse(std::vector<std::string>(argv + 1, argv + argc), &help);
      !st.ok()) {
    return std::string(st.message());
  }
  const std::vector<std::pair<bool, Mode>> modes = {{p.Seen("--coordinator"), Mode::kDaemon},
                                                    {standalone, Mode::kStandalone},
                                                    {describe, Mode::kDescribe},
                                                    {sf.sample, Mode::kSample},
                                                    {p.Seen("--consolidate"), Mode::kConsolidate}};
  for (const auto& [given, mode] : modes) {
    if (!given) continue;
    if (args.mode != Mode::kNone) {
      return "give one of --coordinator, --standalone, --describe, --sample and --consolidate";
    }
    args.mode = mode;
  }
  if (args.mode == Mode::kDaemon && p.Seen("--hostname")) {
    return "--hostname is a --standalone flag: a worker daemon's peers reach it at --address "
           "(default: the address this host reaches the coordinator from), and --gloo-interface "
           "names the interface its collectives bind";
  }
  s.gloo_interface = d.gloo_interface;
  if (std::string problem = ParseSampleFlags(sf.prompt_ids, sf.temperature, sf.seed, args.sample);
      !problem.empty()) {
    return problem;
  }
  args.sample.job_path = s.job_path;
  for (absl::string_view dir : absl::StrSplit(allowed_dirs, ',', absl::SkipEmpty())) {
    d.allowed_dirs.emplace_back(dir);
  }
  if (p.Seen("--memory-budget")) {
    absl::StatusOr<int64_t> bytes = muonmesh::worker::ParseByteSize(memory_budget);
    if (!bytes.ok()) return absl::StrCat("--memory-budget: ", bytes.status().message());
    s.memory_budget_bytes = d.memory_budget_bytes = *bytes;
  }
  args.have_rank = p.Seen("--rank");
  s.rank = static_cast<int32_t>(rank);
  if (p.Seen("--timeout-seconds")) {
    if (timeout < 1) return absl::StrCat("--timeout-seconds: not a positive integer: ", timeout);
    s.timeout = absl::Seconds(timeout);
  }
  if (p.Seen("--cuda-device")) {
    if (cuda_device < 0) return absl::StrCat("--cuda-device: not a GPU number: ", cuda_device);
    s.cuda_device = static_cast<int>(cuda_device);
  }
  if (p.Seen("--fail-at-step")) {
    if (fail_at_step < 0) return absl::StrCat("--fail-at-step: not a step number: ", fail_at_step);
    s.fail_at_step = fail_at_step;
  }
  if (attempt < 0) return absl::StrCat("--attempt: bad value ", attempt);
  s.attempt = static_cast<int>(attempt);
  return "";
}

int Fail(const std::string& who, const absl::Status& st) {
  std::cerr << who << ": " << absl::StatusCodeToString(st.code()) << ": " << st.message()
            << std::endl;
  return 1;
}

std::atomic<bool> g_stop{false};
std::atomic<bool> g_drain{false};

// May run on any thread: libraries such as OpenBLAS start threads before
// main, with the stop signals unblocked, so blocking them and calling
// sigwait() would leave those threads to take the default action (death).
// Setting a lock-free atomic is async-signal-safe; the daemon polls it.
// SIGINT stops at once; SIGTERM drains (a second one stops at once).
extern "C" void OnStopSignal(int) { g_stop.store(true); }
extern "C" void OnTermSignal(int) {
  if (g_drain.exchange(true)) g_stop.store(true);
}

int RunDaemonMode(const Args& args) {
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  struct sigaction term {};
  term.sa_handler = OnTermSignal;
  sigemptyset(&term.sa_mask);
  sigaction(SIGTERM, &term, nullptr);
  signal(SIGPIPE, SIG_IGN);
  static_assert(std::atomic<bool>::is_always_lock_free);
  std::atomic<bool>& stop = g_stop;
  muonmesh::worker::DaemonOptions options = args.daemon;
  options.security = muonmesh::credentials::WithEnvironment(options.security);
  options.stop = &stop;
  options.drain = &g_drain;
  std::mutex log_mu;
  absl::Status st = muonmesh::worker::RunDaemon(options, [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(log_mu);
    std::cerr << "muonmesh-worker: " << line << std::endl;
  });
  if (!st.ok()) return Fail("muonmesh-worker", st);
  return 0;
}

int RunSampleMode(const muonmesh::worker::SampleOptions& options) {
  if (options.job_path.empty()) return Usage("--job is required");
  if (options.weights_path.empty()) return Usage("--weights is required");
  bool bytes = false;
  absl::StatusOr<std::vector<int32_t>> tokens = muonmesh::worker::SampleTokens(options, &bytes);
  if (!tokens.ok()) return Fail("muonmesh-worker --sample", tokens.status());
  absl::StatusOr<std::string> text = muonmesh::worker::RenderTokens(options, *tokens, bytes);
  if (!text.ok()) return Fail("muonmesh-worker --sample", text.status());
  std::cout << *text << std::endl;
  return 0;
}

int RunConsolidateMode(const Args& args) {
  if (args.consolidate.empty()) return Usage("--consolidate: give a checkpoint");
  if (args.out.empty()) return Usage("--out is required with --consolidate");
  std::string from;
  std::vector<std::string> notes;
  absl::StatusOr<muonmesh::worker::WholeState> state =
      muonmesh::worker::LoadWholeState(args.consolidate, &from, &notes);
  for (const std::string& n : notes) std::cerr << "muonmesh-worker: " << n << "\n";
  if (!state.ok()) return Fail("muonmesh-worker --consolidate", state.status());
  absl::Status st = muonmesh::worker::WriteConsolidated(*state, args.out);
  if (!st.ok()) return Fail("muonmesh-worker --consolidate", st);
  int64_t values = 0;
  for (const muonmesh::worker::WholeTensor& t : state->tensors) values += t.param.size();
  std::cout << "wrote " << args.out << ": " << state->tensors.size() << " tensors (" << values
            << " parameters) with their optimizer state at step " << state->step << ", from "
            << from << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  muonmesh::credentials::InitOpenSslWithoutExitHandler();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (arg == "--version") {
      std::cout << "muonmesh-worker " << muonmesh::rpc::Version() << "\n";
      return 0;
    }
  }
  Args args;
  if (std::string problem = Parse(argc, argv, args); !problem.empty()) return Usage(problem);
  const muonmesh::worker::StandaloneOptions& options = args.standalone;
  switch (args.mode) {
    case Mode::kNone:
      return Usage("give --coordinator, --standalone, --describe, --sample or --consolidate");
    case Mode::kConsolidate:
      return RunConsolidateMode(args);
    case Mode::kSample:
      return RunSampleMode(args.sample);
    case Mode::kDaemon:
      return RunDaemonMode(args);
    case Mode::kDescribe: {
      if (options.job_path.empty()) return Usage("--job is required");
      absl::Status st = muonmesh::worker::DescribeJob(
          options.job_path, [](const std::string& line) { std::cout << line << "\n"; });
      return st.ok() ? 0 : Fail("muonmesh-worker", st);
    }
    case Mode::kStandalone:
      break;
  }
  if (options.job_path.empty()) return Usage("--job is required");
  if (options.store_dir.empty()) return Usage("--store is required");
  if (!args.have_rank) return Usage("--rank is required");
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
    Fail(absl::StrCat("muonmesh-worker rank ", options.rank), st);
    // The job's own error: launchers must not restart it (run-job.sh).
    return st.GetPayload(muonmesh::worker::kJobErrorPayload).has_value() ? kExitJobError : 1;
  }
  return 0;
}
