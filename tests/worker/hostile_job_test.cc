// Job files a hostile or careless user could write, run through real
// muonmesh-worker processes (the issue's probes, each under a timeout): every
// one must end with a clear error naming the field or file and a non-zero
// exit, never a signal, a hang or memory beyond the worker's budget. And the
// memory estimate behind those refusals must not undercount: on jobs that do
// run, the worker's measured peak stays below its own estimate.

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;
using muonmesh::testing::ProcessResult;

constexpr auto kTimeout = std::chrono::seconds(30);
// What a refused job may cost: the runtime alone, far below any budget.
constexpr int64_t kRefusalRssBytes = int64_t{200} << 20;

std::string Fresh(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/hostile_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// A one-rank job whose `model`, `data`, `training` and extra lines are given,
// with an output folder of its own unless `extra` names one (a job never
// starts over another run's outputs).
std::string WriteJob(const std::string& dir, const std::string& model, const std::string& data,
                     const std::string& training, const std::string& extra = "") {
  static int jobs = 0;
  std::ostringstream y;
  y << "name: hostile\nworld_size: 1\nmodel: " << model << "\n";
  if (!data.empty()) y << "data: " << data << "\n";
  y << "training: " << training << "\n" << extra;
  if (extra.find("output:") == std::string::npos) y << "output: {dir: runs/job-" << ++jobs << "}\n";
  const std::string path = dir + "/job.yaml";
  std::ofstream(path) << y.str();
  return path;
}

ProcessResult RunWorker(const std::string& dir, const std::string& job,
                        std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {MUONMESH_WORKER_BINARY, "--standalone", "--job", job,
                                   "--rank", "0", "--world-size", "1",
                                   "--store", dir + "/store", "--create-store"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return muonmesh::testing::Run(argv, kTimeout);
}

// Refused cleanly: exit 1, no signal, within the timeout, the expected
// words in the error, and no more memory than the runtime itself.
void ExpectRefused(const ProcessResult& r, const std::vector<std::string>& words) {
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.term_signal, 0) << r.err;
  EXPECT_EQ(r.exit_code, 1) << r.err;
  for (const std::string& w : words) EXPECT_THAT(r.err, HasSubstr(w));
  EXPECT_GT(r.peak_rss_bytes, 0);
  EXPECT_LT(r.peak_rss_bytes, kRefusalRssBytes) << r.err;
}

// Row 1: two 10^6-wide layers (4 TB of weights) and 64 samples.
TEST(HostileJobTest, HugeMlpIsRefusedBeforeAnyAllocation) {
  const std::string dir = Fresh("huge_mlp");
  for (const std::string& dims :
       std::vector<std::string>{"[1000000, 1000000]", "[1048576, 1048576, 1048576]"}) {
    const ProcessResult r =
        RunWorker(dir, WriteJob(dir, "{mlp: {dims: " + dims + "}}",
                                "{teacher: {seed: 1, samples: 64}}",
                                "{steps: 1, global_batch_size: 8}"));
    ExpectRefused(r, {"RESOURCE_EXHAUSTED", "model.mlp.dims", "--memory-budget"});
  }
}

// Row 2: the documented maximum batch, on the default 4096 samples and on
// 2^30 samples.
TEST(HostileJobTest, HugeBatchIsRefused) {
  const std::string dir = Fresh("huge_batch");
  ExpectRefused(RunWorker(dir, WriteJob(dir, "{mlp: {dims: [4, 8, 2]}}", "",
                                        "{steps: 1, global_batch_size: 1073741824}")),
                {"INVALID_ARGUMENT", "training.global_batch_size", "4096 samples"});
  ExpectRefused(RunWorker(dir, WriteJob(dir, "{mlp: {dims: [4, 8, 2]}}",
                                        "{teacher: {seed: 1, samples: 1073741824}}",
                                        "{steps: 1, global_batch_size: 1073741824}")),
                {"RESOURCE_EXHAUSTED", "training.global_batch_size", "data.teacher.samples"});
}

// A data file with fewer samples than one global batch.
TEST(HostileJobTest, BatchLargerThanTheDataFileIsRefused) {
  const std::string dir = Fresh("small_data");
  // safetensors by hand: x [10, 4] and y [10, 2], zeros.
  const std::string header =
      R"({"x":{"dtype":"F32","shape":[10,4],"data_offsets":[0,160]},)"
      R"("y":{"dtype":"F32","shape":[10,2],"data_offsets":[160,240]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  file += header + std::string(240, '\0');
  std::ofstream(dir + "/data.safetensors", std::ios::binary) << file;
  ExpectRefused(RunWorker(dir, WriteJob(dir, "{mlp: {dims: [4, 8, 2]}}",
                                        "{safetensors: data.safetensors}",
                                        "{steps: 1, global_batch_size: 16}")),
                {"training.global_batch_size", "10 samples", "data.safetensors"});
}

// Row 3: a synthetic spec with one 2^20 x 2^20 Muon matrix.
TEST(HostileJobTest, HugeSyntheticTensorIsRefused) {
  const std::string dir = Fresh("huge_synthetic");
  std::ofstream(dir + "/spec.json")
      << R"({"name": "s", "units": [{"name": "u", "params": [)"
      << R"({"name": "w", "shape": [1048576, 1048576], "optimizer": "muon"}]}]})";
  ExpectRefused(RunWorker(dir, WriteJob(dir, "{synthetic: {spec: spec.json}}", "",
                                        "{steps: 1, global_batch_size: 1}")),
                {"RESOURCE_EXHAUSTED", "model.synthetic.spec"});
}

// Row 4: every value within its limit, 1000 layers of 4096 x 4096 (67 GB).
TEST(HostileJobTest, ManyLayersWithinEveryLimitAreRefusedByTheBudget) {
  const std::string dir = Fresh("many_layers");
  std::vector<std::string> dims(1001, "4096");
  const ProcessResult r = RunWorker(
      dir, WriteJob(dir, "{mlp: {dims: [" + absl::StrJoin(dims, ", ") + "]}}",
                    "{teacher: {seed: 1, samples: 64}}", "{steps: 1, global_batch_size: 8}"));
  ExpectRefused(r, {"RESOURCE_EXHAUSTED", "model.mlp.dims"});
}

// A job that fits the machine but not a small explicit budget is refused
// too: the budget, not the machine, is the limit.
TEST(HostileJobTest, ExplicitBudgetIsEnforced) {
  const std::string dir = Fresh("budget");
  const std::string job = WriteJob(dir, "{mlp: {dims: [256, 1024, 256]}}",
                                   "{teacher: {seed: 1, samples: 65536}}",
                                   "{steps: 1, global_batch_size: 64}");
  ExpectRefused(RunWorker(dir, job, {"--memory-budget", "64MiB"}),
                {"RESOURCE_EXHAUSTED", "data.teacher.samples", "64.0 MiB"});
  const ProcessResult usage = RunWorker(dir, job, {"--memory-budget", "lots"});
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_THAT(usage.err, HasSubstr("--memory-budget"));
}

// A device: cuda rank also holds the CUDA runtime, cuBLAS and NCCL on the host
// (about 0.9 GB, measured on an H200): a budget the same job fits on the CPU
// refuses it on cuda, naming the device, before any GPU is touched (so this
// runs on machines without one).
TEST(HostileJobTest, CudaJobsCountTheCudaRuntime) {
  const std::string dir = Fresh("cuda_budget");
  const std::string model = "{mlp: {dims: [8, 16, 4]}}";
  const std::string data = "{teacher: {seed: 1, samples: 64}}";
  const std::string training = "{steps: 1, global_batch_size: 8}";
  const std::string cpu = WriteJob(dir, model, data, training, "device: cpu\n");
  const ProcessResult on_cpu = RunWorker(dir, cpu, {"--memory-budget", "512MiB"});
  EXPECT_EQ(on_cpu.exit_code, 0) << on_cpu.err;
  std::filesystem::remove_all(dir + "/store");
  const std::string cuda = WriteJob(dir, model, data, training, "device: cuda\n");
  ExpectRefused(RunWorker(dir, cuda, {"--memory-budget", "512MiB"}),
                {"RESOURCE_EXHAUSTED", "device: CUDA runtime, cuBLAS and NCCL 1.00 GiB"});
}

// Row 10: a pattern that sends backtracking engines into exponential time.
TEST(HostileJobTest, CatastrophicRegexRunsInLinearTime) {
  const std::string dir = Fresh("regex");
  const ProcessResult r = RunWorker(
      dir, WriteJob(dir, "{mlp: {dims: [4, 8, 2]}}", "{teacher: {seed: 1, samples: 64}}",
                    "{steps: 1, global_batch_size: 8}",
                    "optimizer: {rules: [{pattern: \"(.*.*)*(.*.*)*(.*.*)*(.*.*)*X\", "
                    "optimizer: adamw}]}\n"));
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// Row 11: an export path that is a device, a FIFO, a folder or a link is
// refused before training, and left as it was.
TEST(HostileJobTest, OutputsThatAreNotRegularFilesAreNeverReplaced) {
  const std::string dir = Fresh("outputs");
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  std::filesystem::create_directories(dir + "/folder");
  std::ofstream(dir + "/target") << "keep";
  std::filesystem::create_symlink(dir + "/target", dir + "/link");
  for (const std::string& target :
       std::vector<std::string>{"/dev/null", dir + "/fifo", dir + "/folder", dir + "/link"}) {
    SCOPED_TRACE(target);
    std::error_code ec;
    const auto before = std::filesystem::symlink_status(target, ec).type();
    const ProcessResult r = RunWorker(
        dir, WriteJob(dir, "{mlp: {dims: [4, 8, 2]}}", "{teacher: {seed: 1, samples: 64}}",
                      "{steps: 1, global_batch_size: 8}",
                      absl::StrCat("output: {dir: out, export: \"", target, "\"}\n")));
    ExpectRefused(r, {"output.export", target});
    EXPECT_EQ(std::filesystem::symlink_status(target, ec).type(), before);
    EXPECT_FALSE(std::filesystem::exists(dir + "/out/checkpoints"));
  }
  std::ifstream kept(dir + "/target");
  std::string text;
  kept >> text;
  EXPECT_EQ(text, "keep");
  // An output folder that is a file.
  std::ofstream(dir + "/file") << "x";
  ExpectRefused(RunWorker(dir, WriteJob(dir, "{mlp: {dims: [4, 8, 2]}}",
                                        "{teacher: {seed: 1, samples: 64}}",
                                        "{steps: 1, global_batch_size: 8}",
                                        "output: {dir: file}\n")),
                {"output.dir", "not a folder"});
}

TEST(HostileJobTest, MissingStoreIsNotCreatedUnlessAsked) {
  const std::string dir = Fresh("store");
  const std::string job = WriteJob(dir, "{mlp: {dims: [4, 8, 2]}}", "",
                                   "{steps: 1, global_batch_size: 8}");
  const ProcessResult r = muonmesh::testing::Run(
      {MUONMESH_WORKER_BINARY, "--standalone", "--job", job, "--rank", "0", "--world-size", "1",
       "--store", dir + "/a/b"},
      kTimeout);
  ExpectRefused(r, {"--store", "--create-store"});
  EXPECT_FALSE(std::filesystem::exists(dir + "/a"));
  // --create-store makes one level, not a tree.
  const ProcessResult deep = muonmesh::testing::Run(
      {MUONMESH_WORKER_BINARY, "--standalone", "--job", job, "--rank", "0", "--world-size", "1",
       "--store", dir + "/a/b", "--create-store"},
      kTimeout);
  ExpectRefused(deep, {"--store", "cannot create"});
  EXPECT_FALSE(std::filesystem::exists(dir + "/a"));
}

// The estimate is an upper bound: a worker that runs stays below it. Jobs
// big enough that their data, shards and Muon buffers dominate the runtime.
TEST(HostileJobTest, MeasuredPeakStaysBelowTheEstimate) {
  const std::string dir = Fresh("estimate");
  std::ofstream(dir + "/spec.json")
      << R"({"name": "s", "units": [{"name": "u", "params": [)"
      << R"({"name": "w", "shape": [2048, 4096], "optimizer": "muon"},)"
      << R"({"name": "b", "shape": [4096], "optimizer": "adamw"}]}]})";
  struct Case {
    std::string model, data, training;
  };
  const std::vector<Case> cases = {
      {"{mlp: {dims: [512, 2048, 2048, 512]}}", "{teacher: {seed: 1, samples: 16384}}",
       "{steps: 2, global_batch_size: 2048}"},
      {"{moe_mlp: {d_in: 64, d_model: 256, d_expert: 512, num_experts: 8, d_out: 32}}",
       "{teacher: {seed: 1, samples: 32768}}", "{steps: 2, global_batch_size: 4096}"},
      {"{synthetic: {spec: spec.json}}", "", "{steps: 2, global_batch_size: 1}"},
      // Activations dominate: 4 layers of 128 positions, 16 samples.
      {"{gpt: {vocab_size: 256, block_size: 128, n_layer: 4, n_head: 4, n_embd: 256, "
       "seq_len: 128}}",
       "{text: {train: corpus.txt}}", "{steps: 2, global_batch_size: 16}"},
      // The same for the Llama-style transformer, and a DeepSeek-style one
      // (MLA, routed and shared experts: the routed tokens' activations and
      // the token exchanges' buffers).
      {"{transformer: {vocab_size: 256, seq_len: 128, n_layer: 4, d_model: 256, n_head: 4, "
       "n_kv_head: 2, ffn_hidden: 688}}",
       "{text: {train: corpus.txt}}", "{steps: 2, global_batch_size: 16}"},
      {"{transformer: {vocab_size: 256, seq_len: 128, n_layer: 4, d_model: 256, n_head: 4, "
       "ffn_hidden: 688, attention: mla, mla: {q_lora_rank: 128, kv_lora_rank: 64, "
       "qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 32}, moe: {n_routed_experts: 8, "
       "top_k: 2, moe_ffn_hidden: 256, n_shared_experts: 1, first_k_dense: 1}}}",
       "{text: {train: corpus.txt}}", "{steps: 2, global_batch_size: 16}"},
  };
  {
    std::ofstream corpus(dir + "/corpus.txt");
    for (int i = 0; i < 2000; ++i) corpus << "line " << i << " of a corpus for the estimate\n";
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.model);
    const ProcessResult r = RunWorker(dir, WriteJob(dir, c.model, c.data, c.training));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    double estimate = 0;
    const size_t at = r.out.find("estimated_peak_bytes=");
    ASSERT_NE(at, std::string::npos) << r.out;
    estimate = std::stod(r.out.substr(at + std::strlen("estimated_peak_bytes=")));
    std::printf("%s: peak RSS %.1f MiB, estimate %.1f MiB\n", c.model.c_str(),
                static_cast<double>(r.peak_rss_bytes) / (1 << 20), estimate / (1 << 20));
    EXPECT_LT(static_cast<double>(r.peak_rss_bytes), estimate);
    // And not absurdly loose: within 4x of what was used.
    EXPECT_LT(estimate, 4.0 * static_cast<double>(r.peak_rss_bytes));
  }
}

}  // namespace
}  // namespace muonmesh::worker
