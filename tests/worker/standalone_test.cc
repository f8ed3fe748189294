// Real muonmesh-worker processes on loopback (Gloo), with bounded time:
// every parallelism config gives the 1-rank losses, the final weights match
// the plain-loop reference trainer, and bad jobs or a dying peer end with a
// clear error and a non-zero exit, never a hang.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"
#include "tests/worker/model/reference_trainer.h"
#include "tests/worker/model/transformer_reference.h"
#include "worker/io/safetensors.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;
using muonmesh::testing::ProcessResult;

constexpr auto kTimeout = std::chrono::seconds(60);

std::string Fresh(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/standalone_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

struct Job {
  std::string name = "t";
  int world = 1;
  std::string device = "cpu";
  std::string strategy = "optim_grads_params";
  int instances = 1;
  std::string outer;
  std::string owner = "lpt";
  std::string init = "{seed: 5}";
  std::string data = "{teacher: {seed: 21, samples: 256}}";
  std::string dims = "[6, 16, 16, 3]";
  std::string model;  // overrides dims: the whole `model:` value
  std::string optimizer;  // overrides the default optimizer section's muon and adamw lines
  int ep = 1;
  int steps = 5;
  int batch = 24;
  int checkpoint_every = 0;
  int threads_per_rank = 0;  // 0: not written
  std::string training_extra;  // more training fields, ", key: value" each
  std::string output_dir;
  std::string export_path;
  std::string export_format;  // "": not written
  std::string communication;  // the communication: value ("": not written)
};

std::string WriteJob(const std::string& dir, const Job& j) {
  std::ostringstream y;
  y << "name: " << j.name << "\nworld_size: " << j.world << "\ndevice: " << j.device << "\n"
    << "parallelism:\n  data_parallel_sharding_strategy: " << j.strategy
    << "\n  num_distributed_optimizer_instances: " << j.instances
    << "\n  expert_model_parallel_size: " << j.ep << "\n";
  if (!j.outer.empty()) y << "  outer_dp_sharding_strategy: " << j.outer << "\n";
  y << "model: " << (j.model.empty() ? "{mlp: {dims: " + j.dims + "}}" : j.model)
    << "\ninit: " << j.init << "\ndata: " << j.data << "\n"
    << "optimizer:\n"
    << (j.optimizer.empty()
            ? "  muon: {lr: 0.02, momentum: 0.95, nesterov: true, weight_decay: 0.01}\n"
              "  adamw: {lr: 0.001, eps: 0.05}\n"
            : j.optimizer)
    << "  owner_assignment: " << j.owner << "\n"
    << "training: {steps: " << j.steps << ", global_batch_size: " << j.batch
    << ", checkpoint_every: " << j.checkpoint_every;
  if (j.threads_per_rank > 0) y << ", threads_per_rank: " << j.threads_per_rank;
  y << j.training_extra << "}\n";
  std::vector<std::string> output;
  if (!j.output_dir.empty()) output.push_back("dir: " + j.output_dir);
  if (!j.export_path.empty()) output.push_back("export: " + j.export_path);
  if (!j.export_format.empty()) output.push_back("export_format: " + j.export_format);
  y << "output: {" << absl::StrJoin(output, ", ") << "}\n";
  if (!j.communication.empty()) y << "communication: " << j.communication << "\n";
  const std::string path = dir + "/job.yaml";
  std::ofstream(path) << y.str();
  return path;
}

struct JobRun {
  std::vector<ProcessResult> ranks;
  std::vector<double> losses;  // parsed from rank 0
};

// Starts every rank, optionally killing `victim` once rank 0 has begun.
// `extra` goes to every rank, `only` to rank only.first.
JobRun RunRanks(const std::string& dir, const std::string& job, int world,
                std::vector<std::string> extra = {},
                std::pair<int, std::vector<std::string>> only = {-1, {}}) {
  JobRun run;
  run.ranks.resize(world);
  const std::string store = dir + "/store";
  std::filesystem::remove_all(store);
  std::filesystem::create_directories(store);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::string> argv = {MUONMESH_WORKER_BINARY, "--standalone", "--job", job,
                                       "--rank", std::to_string(r), "--world-size",
                                       std::to_string(world), "--store", store};
      argv.insert(argv.end(), extra.begin(), extra.end());
      if (r == only.first) argv.insert(argv.end(), only.second.begin(), only.second.end());
      run.ranks[r] = muonmesh::testing::Run(argv, kTimeout);
    });
  }
  for (auto& t : threads) t.join();
  std::istringstream out(run.ranks[0].out);
  std::string line;
  while (std::getline(out, line)) {
    int step = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %d loss %lf", &step, &loss) == 2) run.losses.push_back(loss);
  }
  return run;
}

// The weights in safetensors file `actual` against those in `expected`:
// the same tensors (names, shapes) in the same order, every value within
// `tolerance` (0: bit for bit the same).
void ExpectWeightsNear(const std::string& expected, const std::string& actual, double tolerance) {
  absl::StatusOr<std::vector<io::Tensor>> a = io::ReadSafetensors(expected);
  absl::StatusOr<std::vector<io::Tensor>> b = io::ReadSafetensors(actual);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  ASSERT_EQ(a->size(), b->size());
  for (size_t p = 0; p < a->size(); ++p) {
    EXPECT_EQ((*a)[p].name, (*b)[p].name);
    EXPECT_EQ((*a)[p].shape, (*b)[p].shape);
    ASSERT_EQ((*a)[p].data.size(), (*b)[p].data.size()) << (*a)[p].name;
    if (tolerance == 0) {
      EXPECT_EQ((*a)[p].data, (*b)[p].data) << (*a)[p].name;
      continue;
    }
    for (size_t i = 0; i < (*a)[p].data.size(); ++i) {
      ASSERT_NEAR((*b)[p].data[i], (*a)[p].data[i], tolerance) << (*a)[p].name << "[" << i << "]";
    }
  }
}

void ExpectAllOk(const JobRun& run) {
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    EXPECT_EQ(run.ranks[r].exit_code, 0) << "rank " << r << " stderr: " << run.ranks[r].err;
  }
}

// `one` on 1 rank and on 3 (uneven shards): the same losses within
// `tolerance` (relative).
void ExpectThreeRanksGiveTheOneRankLosses(const std::string& dir, const Job& one,
                                          double tolerance) {
  const JobRun single = RunRanks(dir, WriteJob(dir, one), 1);
  ExpectAllOk(single);
  Job three = one;
  three.name = one.name + "_three";
  three.world = 3;
  const JobRun many = RunRanks(dir, WriteJob(dir, three), 3);
  ExpectAllOk(many);
  ASSERT_EQ(many.losses.size(), single.losses.size());
  for (size_t s = 0; s < single.losses.size(); ++s) {
    EXPECT_NEAR(many.losses[s], single.losses[s], tolerance * std::abs(single.losses[s])) << s;
  }
}

struct Config {
  const char* name;
  const char* strategy;
  int instances;
  const char* outer;
};
void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

class StandaloneConfigTest : public ::testing::TestWithParam<Config> {};

TEST_P(StandaloneConfigTest, FourRanksGiveTheOneRankLosses) {
  const std::string dir = Fresh(GetParam().name);
  Job one;
  one.name = std::string("one_") + GetParam().name;
  const JobRun single = RunRanks(dir, WriteJob(dir, one), 1);
  ExpectAllOk(single);
  ASSERT_EQ(single.losses.size(), 5u) << single.ranks[0].out;

  Job four = one;
  four.name = std::string("four_") + GetParam().name;
  four.world = 4;
  four.strategy = GetParam().strategy;
  four.instances = GetParam().instances;
  four.outer = GetParam().outer;
  const JobRun many = RunRanks(dir, WriteJob(dir, four), 4);
  ExpectAllOk(many);
  ASSERT_EQ(many.losses.size(), 5u) << many.ranks[0].out;
  for (size_t s = 0; s < 5; ++s) {
    EXPECT_NEAR(many.losses[s], single.losses[s], 1e-5 * std::abs(single.losses[s])) << "step " << s;
  }
  EXPECT_LT(single.losses.back(), single.losses.front());
}

INSTANTIATE_TEST_SUITE_P(Configs, StandaloneConfigTest,
                         ::testing::Values(Config{"ddp", "no_shard", 1, ""},
                                           Config{"zero1", "optim", 1, ""},
                                           Config{"zero2", "optim_grads", 1, ""},
                                           Config{"zero3", "optim_grads_params", 1, ""},
                                           Config{"hsdp", "optim_grads_params", 2, "no_shard"},
                                           Config{"hfsdp", "optim_grads_params", 2, "optim"}),
                         [](const auto& info) { return std::string(info.param.name); });

// A byte-level GPT on a text corpus: every parallelism config gives the
// 1-rank losses (to float reduction order), the validation loss is measured
// at eval_every and after the last step, and the loss falls.
std::vector<double> ValLosses(const ProcessResult& rank0) {
  std::vector<double> out;
  std::istringstream in(rank0.out);
  std::string line;
  while (std::getline(in, line)) {
    int step = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %d val_loss %lf", &step, &loss) == 2) out.push_back(loss);
  }
  return out;
}

Job GptJob(const std::string& dir, const std::string& name) {
  // Real text: 40 lines of varied English, ~2.4 KB, the last 10% held out.
  std::ofstream text(dir + "/corpus.txt");
  for (int i = 0; i < 40; ++i) {
    text << "Line " << i << ": the quick brown fox jumps over the lazy dog; "
         << (i % 3 == 0 ? "Muon orthogonalizes momentum.\n" : "sharded optimizers save memory.\n");
  }
  Job j;
  j.name = name;
  j.model = "{gpt: {vocab_size: 256, block_size: 16, n_layer: 2, n_head: 2, n_embd: 16, "
            "seq_len: 16}}";
  j.data = "{text: {train: corpus.txt}}";
  j.optimizer = "  muon: {lr: 0.02, momentum: 0.95}\n  adamw: {lr: 0.01, beta2: 0.95}\n";
  j.steps = 12;
  j.batch = 8;
  return j;
}

// A DeepSeek-V3-style transformer at toy size: MLA with q_lora, layer 0
// dense, layer 1 four routed experts (top 2, sigmoid scores, renormalized,
// scaled) and a shared one, the balancing bias moving fast enough to change
// choices within a few steps, and a small balance loss.
constexpr char kDeepSeekProxy[] =
    "{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 16, n_head: 4, "
    "ffn_hidden: 40, attention: mla, mla: {q_lora_rank: 12, kv_lora_rank: 8, "
    "qk_nope_head_dim: 4, qk_rope_head_dim: 2, v_head_dim: 4}, moe: {n_routed_experts: 4, "
    "top_k: 2, moe_ffn_hidden: 8, n_shared_experts: 1, first_k_dense: 1, score: sigmoid, "
    "route_scale: 2.5, bias_update_rate: 0.01, aux_loss_coef: 0.001}}}";

TEST_P(StandaloneConfigTest, GptFourRanksGiveTheOneRankLosses) {
  const std::string dir = Fresh(std::string("gpt_") + GetParam().name);
  Job one = GptJob(dir, std::string("gpt_one_") + GetParam().name);
  // eval every 4 steps: after steps 3, 7 and 11 (the last); the recipe on.
  one.training_extra =
      ", eval_every: 4, eval_batches: 2, clip_grad_norm: 0.5, "
      "lr_schedule: {warmup_steps: 2, decay: cosine, min_lr_ratio: 0.2}";
  const std::string one_path = WriteJob(dir, one);
  const JobRun single = RunRanks(dir, one_path, 1);
  ExpectAllOk(single);
  ASSERT_EQ(single.losses.size(), 12u) << single.ranks[0].out;
  const std::vector<double> single_val = ValLosses(single.ranks[0]);
  ASSERT_EQ(single_val.size(), 3u) << single.ranks[0].out;

  Job four = one;
  four.name = std::string("gpt_four_") + GetParam().name;
  four.world = 4;
  four.strategy = GetParam().strategy;
  four.instances = GetParam().instances;
  four.outer = GetParam().outer;
  // And with gradient accumulation: the local batch of 2 one sample at a time.
  four.training_extra += ", micro_batch_size: 1";
  const std::string four_path = WriteJob(dir, four);
  const JobRun many = RunRanks(dir, four_path, 4);
  ExpectAllOk(many);
  ASSERT_EQ(many.losses.size(), 12u) << many.ranks[0].out;
  // fp32 sums in another order (each rank's slice mean, then the average)
  // differ from the 1-rank sum by a few ulps a step, compounding over the
  // steps through the optimizer.
  for (size_t s = 0; s < single.losses.size(); ++s) {
    EXPECT_NEAR(many.losses[s], single.losses[s], 1e-4 * std::abs(single.losses[s]))
        << "step " << s;
  }
  const std::vector<double> many_val = ValLosses(many.ranks[0]);
  ASSERT_EQ(many_val.size(), 3u) << many.ranks[0].out;
  for (size_t e = 0; e < 3; ++e) {
    EXPECT_NEAR(many_val[e], single_val[e], 1e-4 * std::abs(single_val[e])) << "eval " << e;
  }
  // From about ln 256 = 5.55 at the start.
  EXPECT_NEAR(single.losses.front(), std::log(256.0), 0.3);
  EXPECT_LT(single.losses.back(), single.losses.front() - 0.5);
}

// A Llama-style transformer (grouped-query attention, RoPE, RMSNorm,
// SwiGLU, QK-clip on) on the same corpus: every parallelism config gives the
// 1-rank losses and validation losses, the logits each step records
// included, and the loss falls. The sharded configs (ZeRO-3, HSDP, HFSDP)
// run it with DeepSeek's multi-head latent attention (q_lora and per_head
// on HSDP, split_qkv on ZeRO-3) instead, so each attention meets a sharded
// layout.
TEST_P(StandaloneConfigTest, TransformerFourRanksGiveTheOneRankLosses) {
  const std::string dir = Fresh(std::string("transformer_") + GetParam().name);
  Job one = GptJob(dir, std::string("tr_one_") + GetParam().name);
  const std::string name = GetParam().name;
  const std::string attention =
      name == "zero3"  ? "attention: mla, mla: {kv_lora_rank: 8, qk_nope_head_dim: 4, "
                         "qk_rope_head_dim: 2, v_head_dim: 4}"
      : name == "hsdp" ? "attention: mla, mla: {q_lora_rank: 8, kv_lora_rank: 8, "
                         "qk_nope_head_dim: 4, qk_rope_head_dim: 2, v_head_dim: 4}"
      : name == "hfsdp" ? "attention: mla, mla: {q_lora_rank: 12, kv_lora_rank: 6, "
                          "qk_nope_head_dim: 2, qk_rope_head_dim: 4, v_head_dim: 6}"
                        : "n_kv_head: 2";
  one.model = "{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 16, n_head: 4, " +
              attention + ", ffn_hidden: 40}}";
  // HSDP's MLA orthogonalizes per head (q_b_proj's heads, kv_b_proj's
  // k_nope and v blocks in turn), ZeRO-3's splits kv_b_proj into its k_nope
  // and its v rows (split_qkv: two stacked matrices).
  one.optimizer = std::string("  muon: {lr: 0.02, momentum: 0.95, qk_clip: 30") +
                  (name == "hsdp" ? ", per_head: true" : name == "zero3" ? ", split_qkv: true" : "") +
                  "}\n  adamw: {lr: 0.01, beta2: 0.95}\n";
  one.training_extra = ", eval_every: 6, eval_batches: 2, clip_grad_norm: 1.0";
  one.output_dir = dir + "/one";
  const JobRun single = RunRanks(dir, WriteJob(dir, one), 1);
  ExpectAllOk(single);
  ASSERT_EQ(single.losses.size(), 12u) << single.ranks[0].out;
  Job four = one;
  four.name = std::string("tr_four_") + GetParam().name;
  four.world = 4;
  four.strategy = GetParam().strategy;
  four.instances = GetParam().instances;
  four.outer = GetParam().outer;
  four.output_dir = dir + "/four";
  const JobRun many = RunRanks(dir, WriteJob(dir, four), 4);
  ExpectAllOk(many);
  ASSERT_EQ(many.losses.size(), 12u) << many.ranks[0].out;
  for (size_t st = 0; st < single.losses.size(); ++st) {
    EXPECT_NEAR(many.losses[st], single.losses[st], 1e-4 * std::abs(single.losses[st]))
        << "step " << st;
  }
  const std::vector<double> one_val = ValLosses(single.ranks[0]);
  const std::vector<double> four_val = ValLosses(many.ranks[0]);
  ASSERT_EQ(one_val.size(), 2u);
  ASSERT_EQ(four_val.size(), 2u);
  for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(four_val[e], one_val[e], 1e-4 * one_val[e]);
  EXPECT_NEAR(single.losses.front(), std::log(256.0), 0.3);
  EXPECT_LT(single.losses.back(), single.losses.front() - 0.5);
  std::ifstream records(dir + "/four/metrics/rank-0.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(records, line));
  EXPECT_THAT(line, HasSubstr("\"max_attn_logit\": ["));
}

// The DeepSeek-style transformer (kDeepSeekProxy: MLA, routed experts with
// a shared one, the bias, the balance loss) under every parallelism config
// with its 4 experts over 4, 2 and 1 EP groups in turn, against one rank:
// the same losses. The routers keep the documented N(0, 0.02) init: at this
// size the top-2 gaps stay far above the layouts' rounding differences
// over 8 steps (a flip would show as a loss jump, not a drift).
TEST_P(StandaloneConfigTest, DeepSeekProxyFourRanksGiveTheOneRankLosses) {
  const std::string dir = Fresh(std::string("ds_config_") + GetParam().name);
  Job one = GptJob(dir, std::string("ds_one_") + GetParam().name);
  one.model = kDeepSeekProxy;
  one.steps = 8;
  one.training_extra = ", clip_grad_norm: 1.0";
  const JobRun single = RunRanks(dir, WriteJob(dir, one), 1);
  ExpectAllOk(single);
  ASSERT_EQ(single.losses.size(), 8u) << single.ranks[0].out;
  Job four = one;
  four.name = std::string("ds_four_") + GetParam().name;
  four.world = 4;
  four.strategy = GetParam().strategy;
  four.instances = GetParam().instances;
  four.outer = GetParam().outer;
  const std::string name = GetParam().name;
  four.ep = name == "ddp" || name == "zero3" ? 4 : name == "zero2" ? 1 : 2;
  const JobRun many = RunRanks(dir, WriteJob(dir, four), 4);
  ExpectAllOk(many);
  ASSERT_EQ(many.losses.size(), 8u) << many.ranks[0].out;
  for (size_t st = 0; st < single.losses.size(); ++st) {
    EXPECT_NEAR(many.losses[st], single.losses[st], 1e-4 * std::abs(single.losses[st]))
        << "step " << st << ", EP " << four.ep;
  }
}

// Three ranks (W = 3, the batch of 6 in slices of 2): the dense GQA model,
// MLA and the MoE (6 experts over 3 EP groups) give the one-rank losses.
TEST(StandaloneTest, TransformersOnThreeRanksGiveTheOneRankLosses) {
  const std::string dir = Fresh("transformer_w3");
  const std::pair<std::string, int> models[] = {
      {"{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 16, n_head: 4, "
       "n_kv_head: 2, ffn_hidden: 40}}", 1},
      {"{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 16, n_head: 4, "
       "ffn_hidden: 40, attention: mla, mla: {kv_lora_rank: 8, qk_nope_head_dim: 4, "
       "qk_rope_head_dim: 2, v_head_dim: 4}, moe: {n_routed_experts: 6, top_k: 2, "
       "moe_ffn_hidden: 8, n_shared_experts: 1, first_k_dense: 1}}}", 3},
  };
  int i = 0;
  for (const auto& [model, ep] : models) {
    SCOPED_TRACE(model);
    Job one = GptJob(dir, "w3_one_" + std::to_string(i));
    one.model = model;
    one.steps = 6;
    one.batch = 6;
    const JobRun single = RunRanks(dir, WriteJob(dir, one), 1);
    ExpectAllOk(single);
    Job three = one;
    three.name = "w3_three_" + std::to_string(i++);
    three.world = 3;
    three.ep = ep;
    const JobRun many = RunRanks(dir, WriteJob(dir, three), 3);
    ExpectAllOk(many);
    ASSERT_EQ(many.losses.size(), 6u) << many.ranks[0].out;
    ASSERT_EQ(single.losses.size(), 6u) << single.ranks[0].out;
    for (size_t st = 0; st < 6; ++st) {
      EXPECT_NEAR(many.losses[st], single.losses[st], 1e-4 * std::abs(single.losses[st])) << st;
    }
  }
}

// moe_mlp with its experts split over two EP groups (and ZeRO-3 over the
// expert data-parallel pairs): the 1-rank losses, and final weights (whole
// expert stacks gathered from both groups) close to the 1-rank run's.
// --gloo-interface binds the ranks' collectives to a named interface: "lo"
// trains as the default does; an interface this host lacks fails every rank
// naming it.
TEST(StandaloneTest, TheGlooInterfaceFlagBindsTheCollectives) {
  const std::string dir = Fresh("gloo_interface");
  Job two;
  two.name = "iface";
  two.world = 2;
  const JobRun lo = RunRanks(dir, WriteJob(dir, two), 2, {"--gloo-interface", "lo"});
  ExpectAllOk(lo);
  EXPECT_EQ(lo.losses.size(), 5u) << lo.ranks[0].out;
  two.name = "iface_missing";
  const JobRun missing = RunRanks(dir, WriteJob(dir, two), 2, {"--gloo-interface", "nosuch9"});
  for (const ProcessResult& r : missing.ranks) {
    EXPECT_NE(r.exit_code, 0);
    EXPECT_THAT(r.err, HasSubstr("interface nosuch9")) << r.err;
  }
}

TEST(StandaloneTest, MoeWithExpertParallelismGivesTheOneRankRun) {
  const std::string dir = Fresh("moe");
  Job one;
  one.name = "moe_one";
  one.model = "{moe_mlp: {d_in: 6, d_model: 12, d_expert: 8, num_experts: 4, d_out: 3}}";
  one.export_path = dir + "/one.safetensors";
  const JobRun single = RunRanks(dir, WriteJob(dir, one), 1);
  ExpectAllOk(single);
  ASSERT_EQ(single.losses.size(), 5u) << single.ranks[0].out;

  Job four = one;
  four.name = "moe_four";
  four.world = 4;
  four.ep = 2;
  four.export_path = dir + "/four.safetensors";
  const JobRun many = RunRanks(dir, WriteJob(dir, four), 4);
  ExpectAllOk(many);
  ASSERT_EQ(many.losses.size(), 5u) << many.ranks[0].out;
  for (size_t s = 0; s < 5; ++s) {
    EXPECT_NEAR(many.losses[s], single.losses[s], 1e-5 * std::abs(single.losses[s])) << "step " << s;
  }
  EXPECT_LT(single.losses.back(), single.losses.front());

  absl::StatusOr<std::vector<io::Tensor>> a = io::ReadSafetensors(one.export_path);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 7u);
  ExpectWeightsNear(one.export_path, four.export_path, 1e-4);
}

// The seed's validation at toy size: a DeepSeek-V3-style transformer
// (kDeepSeekProxy) under HFSDP on 4 ranks with its experts over 2 EP groups
// and clip_grad_norm 1.0 trains as one data-parallel instance does: the
// same losses and final weights (the balancing bias included), loss falling.
TEST(StandaloneTest, DeepSeekProxyUnderHfsdpWithExpertParallelismGivesTheOneRankRun) {
  const std::string dir = Fresh("deepseek_proxy");
  Job one = GptJob(dir, "ds_one");
  one.model = kDeepSeekProxy;
  one.training_extra = ", clip_grad_norm: 1.0";
  one.export_path = dir + "/one.safetensors";
  const JobRun single = RunRanks(dir, WriteJob(dir, one), 1);
  ExpectAllOk(single);
  ASSERT_EQ(single.losses.size(), 12u) << single.ranks[0].out;
  Job four = one;
  four.name = "ds_four";
  four.world = 4;
  four.strategy = "optim_grads_params";
  four.instances = 2;
  four.outer = "optim";
  four.ep = 2;
  four.export_path = dir + "/four.safetensors";
  four.output_dir = dir + "/four";
  const JobRun many = RunRanks(dir, WriteJob(dir, four), 4);
  ExpectAllOk(many);
  ASSERT_EQ(many.losses.size(), 12u) << many.ranks[0].out;
  for (size_t s = 0; s < single.losses.size(); ++s) {
    EXPECT_NEAR(many.losses[s], single.losses[s], 1e-4 * std::abs(single.losses[s])) << "step " << s;
  }
  EXPECT_LT(single.losses.back(), single.losses.front() - 0.5);
  ExpectWeightsNear(one.export_path, four.export_path, 1e-4);
  // Every record has the MoE layer's load and the balance loss's part.
  std::ifstream records(dir + "/four/metrics/rank-0.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(records, line));
  EXPECT_THAT(line, HasSubstr("\"expert_load\": [{\"layer\": 1, \"min_over_mean\": "));
  EXPECT_THAT(line, HasSubstr("\"dropped\": 0}]"));
  EXPECT_THAT(line, HasSubstr("\"aux_loss\": "));
}

// output.export_format: hf writes the final weights under the names of
// Hugging Face's LlamaForCausalLM (model.embed_tokens, model.layers.N.
// self_attn.q_proj, ..., model.norm, lm_head), with the metadata format "pt"
// their loader asks for, and config.json beside them. Read back by those
// names alone, with the sizes config.json gives, the independent reference
// computes the run's last validation loss from them.
TEST(StandaloneTest, HuggingFaceExportGivesTheRunsValidationLoss) {
  const std::string dir = Fresh("hf_export");
  Job job = GptJob(dir, "hf");
  const std::string val = "The lazy dog sleeps while Muon orthogonalizes the momentum.\n";
  std::ofstream(dir + "/val.txt") << val;
  job.model = "{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, d_model: 16, n_head: 4, "
              "n_kv_head: 2, ffn_hidden: 40, rope_theta: 500}}";
  job.data = "{text: {train: corpus.txt, val: val.txt}}";
  job.training_extra = ", eval_every: 12, eval_batches: 2";
  job.output_dir = dir + "/out";
  job.export_format = "hf";
  job.world = 2;
  const JobRun run = RunRanks(dir, WriteJob(dir, job), 2);
  ExpectAllOk(run);
  std::map<std::string, std::string> meta;
  absl::StatusOr<std::vector<io::Tensor>> tensors =
      io::ReadSafetensors(dir + "/out/hf/model.safetensors", &meta);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ(meta["format"], "pt");
  std::map<std::string, std::vector<float>> by_name;
  for (io::Tensor& t : *tensors) by_name[t.name] = std::move(t.data);
  std::ifstream config_file(dir + "/out/hf/config.json");
  const std::string config_text((std::istreambuf_iterator<char>(config_file)),
                                std::istreambuf_iterator<char>());
  google::protobuf::Struct config;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(config_text, &config).ok())
      << config_text;
  auto number = [&](const char* key) { return config.fields().at(key).number_value(); };
  EXPECT_EQ(config.fields().at("architectures").list_value().values(0).string_value(),
            "LlamaForCausalLM");
  EXPECT_EQ(config.fields().at("hidden_act").string_value(), "silu");
  EXPECT_FALSE(config.fields().at("tie_word_embeddings").bool_value());
  reference::RefTransformerDims d;
  d.vocab = static_cast<int64_t>(number("vocab_size"));
  d.seq = static_cast<int64_t>(number("max_position_embeddings"));
  d.layers = static_cast<int64_t>(number("num_hidden_layers"));
  d.embd = static_cast<int64_t>(number("hidden_size"));
  d.heads = static_cast<int64_t>(number("num_attention_heads"));
  d.kv_heads = static_cast<int64_t>(number("num_key_value_heads"));
  d.head_dim = static_cast<int64_t>(number("head_dim"));
  d.ffn = static_cast<int64_t>(number("intermediate_size"));
  d.eps = number("rms_norm_eps");
  d.theta = number("rope_theta");
  EXPECT_EQ(d.theta, 500.0);
  // The reference's order from Hugging Face's names.
  std::vector<std::string> names = {"model.embed_tokens.weight"};
  for (int l = 0; l < d.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* n : {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                          "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
      names.push_back(p + n + ".weight");
    }
  }
  names.push_back("model.norm.weight");
  names.push_back("lm_head.weight");
  ASSERT_EQ(by_name.size(), names.size());
  reference::TransformerTensors params;
  for (const std::string& n : names) {
    ASSERT_EQ(by_name.count(n), 1u) << n;
    params.emplace_back(by_name[n].begin(), by_name[n].end());
  }
  const std::vector<int32_t> tokens(val.begin(), val.end());
  std::vector<int64_t> samples;
  for (int64_t j = 0; j < job.batch * 2; ++j) samples.push_back(j);
  const double want = reference::TransformerRefLossAndGrad(d, params, tokens, samples, nullptr);
  std::ifstream records(dir + "/out/metrics/rank-0.jsonl");
  std::string line, last;
  while (std::getline(records, line)) last = line;
  const size_t at = last.find("\"val_loss\": ");
  ASSERT_NE(at, std::string::npos) << last;
  const double got = std::stod(last.substr(at + 12));
  EXPECT_NEAR(got, want, 1e-5 * want);
}

// The documented checkpoint folder (worker/standalone.h).
std::string Checkpoint(const std::string& output_dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return output_dir + "/checkpoints/" + name;
}

// A rank fails mid-run; the job restarts from its newest complete
// checkpoint (new attempt, fresh store, --resume) and ends with the same
// weights, bit for bit, as a run that never failed.
TEST(StandaloneTest, RestartFromACheckpointEndsBitIdentical) {
  const std::string dir = Fresh("restart");
  Job job;
  job.name = "restart";
  job.world = 4;
  job.strategy = "optim_grads_params";
  job.instances = 2;
  job.outer = "optim";
  job.steps = 7;
  job.checkpoint_every = 2;
  job.output_dir = dir + "/straight";
  job.export_path = dir + "/straight.safetensors";
  const JobRun straight = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(straight);
  ASSERT_EQ(straight.losses.size(), 7u);

  job.output_dir = dir + "/faulty";
  job.export_path = dir + "/faulty.safetensors";
  const std::string path = WriteJob(dir, job);
  // Rank 2 fails before step 5 (0-based): five steps are done, and the
  // newest complete checkpoint is the one after four.
  const JobRun failed = RunRanks(dir, path, 4, {"--timeout-seconds", "10"},
                                 {2, {"--fail-at-step", "5"}});
  for (int r = 0; r < 4; ++r) EXPECT_NE(failed.ranks[r].exit_code, 0) << "rank " << r;
  EXPECT_THAT(failed.ranks[2].err, HasSubstr("--fail-at-step 5"));
  EXPECT_TRUE(std::filesystem::exists(Checkpoint(job.output_dir, 4) + "/COMPLETE"));
  EXPECT_FALSE(std::filesystem::exists(Checkpoint(job.output_dir, 6)));
  EXPECT_FALSE(std::filesystem::exists(job.export_path));

  const JobRun resumed = RunRanks(dir, path, 4, {"--resume", "--attempt", "1"});
  ExpectAllOk(resumed);
  EXPECT_THAT(resumed.ranks[0].out, HasSubstr("resume: from the checkpoint at step 4"));
  ASSERT_EQ(resumed.losses.size(), 3u) << resumed.ranks[0].out;  // steps 4, 5 and 6
  for (int s = 0; s < 3; ++s) EXPECT_EQ(resumed.losses[s], straight.losses[4 + s]) << s;
  // Two complete checkpoints are kept (steps 4 and 6).
  EXPECT_TRUE(std::filesystem::exists(Checkpoint(job.output_dir, 6) + "/COMPLETE"));
  EXPECT_TRUE(std::filesystem::exists(Checkpoint(job.output_dir, 4) + "/COMPLETE"));
  EXPECT_FALSE(std::filesystem::exists(Checkpoint(job.output_dir, 2)));
  for (int r = 0; r < 4; ++r) {
    char file[64];
    std::snprintf(file, sizeof file, "/rank-%05d.safetensors", r);
    EXPECT_TRUE(std::filesystem::exists(Checkpoint(job.output_dir, 6) + file)) << file;
  }

  ExpectWeightsNear(dir + "/straight.safetensors", job.export_path, 0);

  // Damage one byte of rank 2's file in the newest checkpoint: a resume
  // skips it, naming the file, for the one before, and still ends with the
  // same weights.
  const std::string victim = Checkpoint(job.output_dir, 6) + "/rank-00002.safetensors";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    const char c = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(-3, std::ios::end);
    f.put(c);
  }
  const JobRun again = RunRanks(dir, path, 4, {"--resume", "--attempt", "2"});
  ExpectAllOk(again);
  EXPECT_THAT(again.ranks[0].out,
              HasSubstr("resume: skipping step 6: rank-00002.safetensors: CRC-32"));
  EXPECT_THAT(again.ranks[0].out, HasSubstr("resume: from the checkpoint at step 4"));
  ASSERT_EQ(again.losses.size(), 3u);
  for (int s = 0; s < 3; ++s) EXPECT_EQ(again.losses[s], straight.losses[4 + s]) << s;
  ExpectWeightsNear(dir + "/straight.safetensors", job.export_path, 0);
}

// The gpt through a failure: resumed from its checkpoint on a new attempt,
// it continues at the same data windows with the same optimizer state, so
// its losses and final weights are the uninterrupted run's, bit for bit;
// and at world size 3 (uneven shards) it gives the 1-rank losses.
TEST(StandaloneTest, GptRestartEndsBitIdenticalAndThreeRanksMatchOne) {
  const std::string dir = Fresh("gpt_restart");
  Job job = GptJob(dir, "gpt_restart");
  job.world = 2;
  job.steps = 6;
  job.checkpoint_every = 3;
  job.output_dir = dir + "/straight";
  job.export_path = dir + "/straight.safetensors";
  const JobRun straight = RunRanks(dir, WriteJob(dir, job), 2);
  ExpectAllOk(straight);
  ASSERT_EQ(straight.losses.size(), 6u) << straight.ranks[0].out;

  job.output_dir = dir + "/faulty";
  job.export_path = dir + "/faulty.safetensors";
  const std::string path = WriteJob(dir, job);
  const JobRun failed = RunRanks(dir, path, 2, {"--timeout-seconds", "10"},
                                 {1, {"--fail-at-step", "4"}});
  for (int r = 0; r < 2; ++r) EXPECT_NE(failed.ranks[r].exit_code, 0) << "rank " << r;
  const JobRun resumed = RunRanks(dir, path, 2, {"--resume", "--attempt", "1"});
  ExpectAllOk(resumed);
  ASSERT_EQ(resumed.losses.size(), 3u) << resumed.ranks[0].out;  // steps 3, 4 and 5
  for (int s = 0; s < 3; ++s) EXPECT_EQ(resumed.losses[s], straight.losses[3 + s]) << s;
  ExpectWeightsNear(dir + "/straight.safetensors", job.export_path, 0);

  Job one = GptJob(dir, "gpt_w1");
  one.batch = 6;
  ExpectThreeRanksGiveTheOneRankLosses(dir, one, 1e-4);
}

// A small gpt (`layers` blocks, 64 wide) on 4 ranks under HFSDP (the
// optimizer state sharded over 2 instances), 4 steps.
Job HfsdpGptJob(const std::string& dir, const std::string& name, int layers) {
  Job job = GptJob(dir, name);
  job.model = absl::StrCat("{gpt: {vocab_size: 256, block_size: 16, n_layer: ", layers,
                           ", n_head: 2, n_embd: 64, seq_len: 16}}");
  job.world = 4;
  job.instances = 2;
  job.outer = "optim";
  job.steps = 4;
  return job;
}

// communication.window_bytes through the job file: a gpt of 4 ranks under
// HFSDP whose exchanges (reduce-scatters of ~100 KB a peer and more, the
// after-step gathers, the Muon exchanges) go in 64 KiB chunks ends with the
// losses and weights of the same job without a window, bit for bit.
TEST(StandaloneTest, AWindowOnTheExchangesEndsBitIdentical) {
  const std::string dir = Fresh("gpt_window");
  Job job = HfsdpGptJob(dir, "gpt_window", 2);
  job.output_dir = dir + "/plain";
  job.export_path = dir + "/plain.safetensors";
  const JobRun plain = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(plain);
  ASSERT_EQ(plain.losses.size(), 4u) << plain.ranks[0].out;

  job.communication = "{window_bytes: 131072}";
  job.output_dir = dir + "/windowed";
  job.export_path = dir + "/windowed.safetensors";
  const JobRun windowed = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(windowed);
  EXPECT_EQ(windowed.losses, plain.losses);
  ExpectWeightsNear(dir + "/plain.safetensors", job.export_path, 0);
}

// communication.muon_in_backward through the job file, over Gloo: a gpt of
// 4 ranks under HFSDP with a Muon wave per block (optimizer.muon_buffer_bytes
// 1) and a bucket per unit, whose last wave's gather runs on its own thread
// beside the reductions and the backward pass (the worker says so), ends
// with the losses and weights of the same job with it off, bit for bit.
TEST(StandaloneTest, MuonInsideTheBackwardEndsBitIdenticalOverGloo) {
  const std::string dir = Fresh("gpt_muon_in_backward");
  Job job = HfsdpGptJob(dir, "gpt_muon_in_backward", 3);
  job.optimizer =
      "  muon: {lr: 0.02, momentum: 0.95, nesterov: true, weight_decay: 0.01}\n"
      "  adamw: {lr: 0.001, eps: 0.05}\n"
      "  muon_buffer_bytes: 1\n";
  job.communication = "{bucket_bytes: 0, muon_in_backward: false}";
  job.output_dir = dir + "/after";
  job.export_path = dir + "/after.safetensors";
  const JobRun after = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(after);
  ASSERT_EQ(after.losses.size(), 4u) << after.ranks[0].out;
  EXPECT_EQ(after.ranks[0].out.find("inside the backward pass"), std::string::npos);

  job.communication = "{bucket_bytes: 0}";
  job.output_dir = dir + "/inside";
  job.export_path = dir + "/inside.safetensors";
  const JobRun inside = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(inside);
  EXPECT_NE(inside.ranks[0].out.find("the last wave's gather inside the backward pass"),
            std::string::npos)
      << inside.ranks[0].out;
  EXPECT_EQ(inside.losses, after.losses);
  ExpectWeightsNear(dir + "/after.safetensors", job.export_path, 0);
}

// communication.overlap_param_gather through the job file, over Gloo: a gpt
// of 4 ranks under HFSDP (the optimizer state sharded over 2 instances, so
// the updated parameters are gathered after each step) in a bucket per
// unit, checkpointed every other step, ends with the losses, weights and
// checkpoint shards of the same job with the gathers waited for within the
// step, bit for bit; each run says where its gathers go.
TEST(StandaloneTest, AfterStepGathersBesideTheNextStepEndBitIdenticalOverGloo) {
  const std::string dir = Fresh("gpt_overlap_param_gather");
  Job job = HfsdpGptJob(dir, "gpt_overlap_param_gather", 3);
  job.checkpoint_every = 2;
  job.communication = "{bucket_bytes: 0, overlap_param_gather: false}";
  job.output_dir = dir + "/within";
  job.export_path = dir + "/within.safetensors";
  const JobRun within = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(within);
  ASSERT_EQ(within.losses.size(), 4u) << within.ranks[0].out;
  EXPECT_NE(within.ranks[0].out.find("gathered after each step within the step"),
            std::string::npos)
      << within.ranks[0].out;

  job.communication = "{bucket_bytes: 0}";
  job.output_dir = dir + "/beside";
  job.export_path = dir + "/beside.safetensors";
  const JobRun beside = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(beside);
  EXPECT_NE(beside.ranks[0].out.find(
                "gathered after each step beside the next step "
                "(communication.overlap_param_gather)"),
            std::string::npos)
      << beside.ranks[0].out;
  EXPECT_EQ(beside.losses, within.losses);
  ExpectWeightsNear(dir + "/within.safetensors", job.export_path, 0);
  int shards = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir + "/within")) {
    if (entry.path().extension() != ".safetensors") continue;
    const std::string rel = std::filesystem::relative(entry.path(), dir + "/within").string();
    absl::StatusOr<std::vector<io::Tensor>> want = io::ReadSafetensors(entry.path().string());
    absl::StatusOr<std::vector<io::Tensor>> got = io::ReadSafetensors(dir + "/beside/" + rel);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), want->size()) << rel;
    for (size_t t = 0; t < want->size(); ++t) {
      EXPECT_EQ((*got)[t].name, (*want)[t].name) << rel;
      EXPECT_EQ((*got)[t].data, (*want)[t].data) << rel << " " << (*want)[t].name;
    }
    ++shards;
  }
  EXPECT_GE(shards, 8) << "2 checkpoints of 4 ranks' shards";
}

// Resharding through the job file: a gpt trained 3 steps on 2 ranks under
// ZeRO-3 resumes bit for bit under the same layout, and goes on from its
// checkpoint on 3 ranks under DDP (init.checkpoint
// naming the job's checkpoints/ folder), and from the checkpoint
// consolidated into one file (--consolidate) on 1 rank: both end where 6
// steps on 2 ranks end, within the reduction order's 1e-4 (documented in
// BENCHMARKS.md), and a checkpoint with nothing left to run is refused.
// gpt, the Llama-style transformer on the same corpus, and a DeepSeek-style
// one (MLA, a dense first layer, routed and shared experts with the
// balancing bias, a buffer the checkpoint carries) whose first run splits
// its experts over 2 EP groups and goes on with 1.
struct LanguageModel {
  const char* name;
  const char* model;  // the job's model: value; "" keeps GptJob's
  int ep = 1;         // the first runs' expert_model_parallel_size
};

class LanguageModelTest : public ::testing::TestWithParam<LanguageModel> {};

TEST_P(LanguageModelTest, ACheckpointGoesOnUnderAnotherLayoutAndFromItsConsolidation) {
  const std::string dir = Fresh(std::string(GetParam().name) + "_reshard");
  Job job = GptJob(dir, std::string(GetParam().name) + "_reshard");
  if (*GetParam().model != '\0') job.model = GetParam().model;
  job.world = 2;
  job.ep = GetParam().ep;
  job.steps = 6;
  job.batch = 6;
  job.output_dir = dir + "/straight";
  job.export_path = dir + "/straight.safetensors";
  const JobRun straight = RunRanks(dir, WriteJob(dir, job), 2);
  ExpectAllOk(straight);
  ASSERT_EQ(straight.losses.size(), 6u) << straight.ranks[0].out;

  job.steps = 3;
  job.checkpoint_every = 3;
  job.output_dir = dir + "/first";
  job.export_path = "";
  ExpectAllOk(RunRanks(dir, WriteJob(dir, job), 2));
  ASSERT_TRUE(std::filesystem::exists(Checkpoint(dir + "/first", 3) + "/COMPLETE"));

  // A resume under the layout that wrote it (its own shard files, the
  // buffers included) ends bit for bit where the straight run does.
  std::filesystem::copy(dir + "/first", dir + "/again", std::filesystem::copy_options::recursive);
  Job again = job;
  again.steps = 6;
  again.output_dir = dir + "/again";
  again.export_path = dir + "/again.safetensors";
  const JobRun resumed = RunRanks(dir, WriteJob(dir, again), 2, {"--resume", "--attempt", "1"});
  ExpectAllOk(resumed);
  EXPECT_THAT(resumed.ranks[0].out, HasSubstr("resume: from the checkpoint at step 3"));
  ASSERT_EQ(resumed.losses.size(), 3u) << resumed.ranks[0].out;
  for (int s = 0; s < 3; ++s) EXPECT_EQ(resumed.losses[s], straight.losses[3 + s]) << s;
  ExpectWeightsNear(dir + "/straight.safetensors", again.export_path, 0);

  auto expect_goes_on = [&](const JobRun& run, const std::string& weights) {
    ExpectAllOk(run);
    ASSERT_EQ(run.losses.size(), 3u) << run.ranks[0].out;  // steps 3, 4 and 5
    for (int s = 0; s < 3; ++s) {
      EXPECT_NEAR(run.losses[s], straight.losses[3 + s], 1e-4 * straight.losses[3 + s]) << s;
    }
    ExpectWeightsNear(dir + "/straight.safetensors", weights, 1e-4);
  };
  Job ddp = job;
  ddp.name = std::string(GetParam().name) + "_reshard_ddp";
  ddp.world = 3;
  ddp.ep = 1;
  ddp.strategy = "no_shard";
  ddp.steps = 6;
  ddp.checkpoint_every = 0;
  ddp.init = "{checkpoint: first/checkpoints}";
  ddp.output_dir = dir + "/ddp";
  ddp.export_path = dir + "/ddp.safetensors";
  const JobRun on_ddp = RunRanks(dir, WriteJob(dir, ddp), 3);
  expect_goes_on(on_ddp, ddp.export_path);
  EXPECT_THAT(on_ddp.ranks[0].out,
              HasSubstr("first/checkpoints/step-00000003 at step 3, resharded to 3 ranks"));

  const ProcessResult consolidated = muonmesh::testing::Run(
      {MUONMESH_WORKER_BINARY, "--consolidate", dir + "/first", "--out", dir + "/state.st"},
      kTimeout);
  ASSERT_EQ(consolidated.exit_code, 0) << consolidated.err;
  EXPECT_THAT(consolidated.out, HasSubstr("with their optimizer state at step 3"));
  Job one = ddp;
  one.name = std::string(GetParam().name) + "_reshard_one";
  one.world = 1;
  one.init = "{checkpoint: state.st}";
  one.output_dir = dir + "/one";
  one.export_path = dir + "/one.safetensors";
  expect_goes_on(RunRanks(dir, WriteJob(dir, one), 1), one.export_path);

  // Nothing left to run: refused, naming the field, the checkpoint kept
  // (in a folder of its own: "one" holds the run above).
  one.steps = 3;
  one.output_dir = dir + "/one-done";
  one.export_path = dir + "/one-done.safetensors";
  const JobRun done = RunRanks(dir, WriteJob(dir, one), 1);
  EXPECT_NE(done.ranks[0].exit_code, 0);
  EXPECT_THAT(done.ranks[0].err, HasSubstr("init.checkpoint"));
  EXPECT_THAT(done.ranks[0].err, HasSubstr("not below training.steps 3"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/state.st"));
}

INSTANTIATE_TEST_SUITE_P(
    Models, LanguageModelTest,
    ::testing::Values(LanguageModel{"gpt", ""},
                      LanguageModel{"transformer",
                                    "{transformer: {vocab_size: 256, seq_len: 16, n_layer: 2, "
                                    "d_model: 16, n_head: 4, n_kv_head: 2, ffn_hidden: 40}}"},
                      LanguageModel{"moe", kDeepSeekProxy, 2}),
    [](const auto& info) { return std::string(info.param.name); });

// A resume that finds a checkpoint of another world size puts the whole
// state back together on every rank: its memory is checked for that before
// it is loaded. Four 1024-wide matrices (on AdamW, so the whole state
// outweighs a step's buffers) trained on 2 ranks resume on 1:
// with room it reshards and exports; with a budget that fits the rank's
// training (its own estimate, and 10% more) but not the whole state as
// well, it is refused naming the checkpoint, before anything is loaded.
TEST(StandaloneTest, AResumeThatReshardsIsCheckedForTheWholeState) {
  const std::string dir = Fresh("reshard_budget");
  Job job;
  job.name = "reshard_budget";
  job.dims = "[512, 1024, 1024, 1024, 1024, 512]";
  job.optimizer =
      "  muon: {lr: 0.02}\n  adamw: {lr: 0.001}\n"
      "  rules: [{pattern: '.*', optimizer: adamw}]\n";
  job.data = "{teacher: {seed: 3, samples: 64}}";
  job.batch = 8;
  job.world = 2;
  job.steps = 2;
  job.checkpoint_every = 2;
  job.output_dir = dir + "/out";
  ExpectAllOk(RunRanks(dir, WriteJob(dir, job), 2));
  ASSERT_TRUE(std::filesystem::exists(Checkpoint(dir + "/out", 2) + "/COMPLETE"));

  job.world = 1;
  const std::string path = WriteJob(dir, job);
  const JobRun roomy = RunRanks(dir, path, 1, {"--resume", "--attempt", "1"});
  ExpectAllOk(roomy);
  EXPECT_THAT(roomy.ranks[0].out, HasSubstr("resharded to 1 ranks"));
  const size_t at = roomy.ranks[0].out.find("estimated_peak_bytes=");
  ASSERT_NE(at, std::string::npos) << roomy.ranks[0].out;
  const double training_peak =
      std::stod(roomy.ranks[0].out.substr(at + std::strlen("estimated_peak_bytes=")));
  const std::string budget =
      absl::StrCat(static_cast<int64_t>(std::ceil(1.1 * training_peak / (1 << 20))), "MiB");
  const JobRun tight =
      RunRanks(dir, path, 1, {"--resume", "--attempt", "2", "--memory-budget", budget});
  EXPECT_NE(tight.ranks[0].exit_code, 0) << "budget " << budget << ": " << tight.ranks[0].out;
  EXPECT_THAT(tight.ranks[0].err,
              HasSubstr("resume: resharding the checkpoint at step 2 (written by 2 ranks)"));
  EXPECT_THAT(tight.ranks[0].err, HasSubstr("RESOURCE_EXHAUSTED"));
  EXPECT_THAT(tight.ranks[0].err, HasSubstr("output.dir"));
}

// optimizer.rules on the gpt's parameter names, through the job file: two
// one-step runs from the same weights that differ only in Muon's lr end
// with every AdamW tensor bit for bit the same and every Muon one apart,
// so the final weights show which optimizer each name got. Rules: block 1 entirely on AdamW (its
// matrices included), wpe on Muon; the rest as the spec says (the blocks'
// four matrices on Muon, everything else on AdamW).
TEST(StandaloneTest, GptOptimizerRulesPlaceParametersByName) {
  const std::string dir = Fresh("gpt_rules");
  auto run = [&](const std::string& name, double muon_lr) {
    Job job = GptJob(dir, name);
    job.steps = 1;
    job.optimizer = absl::StrCat("  muon: {lr: ", muon_lr, "}\n  adamw: {lr: 0.001}\n",
                                 "  rules: [{pattern: 'h\\.1\\..*', optimizer: adamw}, "
                                 "{pattern: 'wpe\\.weight', optimizer: muon}]\n");
    job.export_path = dir + "/" + name + ".safetensors";
    const JobRun r = RunRanks(dir, WriteJob(dir, job), 1);
    ExpectAllOk(r);
    absl::StatusOr<std::vector<io::Tensor>> w = io::ReadSafetensors(job.export_path);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.value_or(std::vector<io::Tensor>{});
  };
  const std::vector<io::Tensor> still = run("slow", 0.01);
  const std::vector<io::Tensor> moved = run("fast", 0.03);
  ASSERT_EQ(still.size(), moved.size());
  ASSERT_EQ(still.size(), 2u + 2 * 12 + 2);
  const std::vector<std::string> on_muon = {"wpe.weight", "h.0.attn.c_attn.weight",
                                            "h.0.attn.c_proj.weight", "h.0.mlp.c_fc.weight",
                                            "h.0.mlp.c_proj.weight"};
  for (size_t p = 0; p < still.size(); ++p) {
    const bool muon = std::find(on_muon.begin(), on_muon.end(), still[p].name) != on_muon.end();
    if (muon) {
      EXPECT_NE(still[p].data, moved[p].data) << still[p].name << " should be on Muon";
    } else {
      EXPECT_EQ(still[p].data, moved[p].data) << still[p].name << " should be on AdamW";
    }
  }
}

// A checkpoint folder made read-only: the job fails at its next checkpoint
// naming the folder and why (PERMISSION_DENIED), the checkpoint before stays
// complete, and once the folder is writable again a resume from it ends
// with the weights of a run that never failed. As root a folder's mode
// stops no write, so there the worker runs as nobody (setpriv), as a
// worker on a read-only disk would meet it.
TEST(StandaloneTest, AReadOnlyCheckpointFolderFailsTheJobAndKeepsTheLastCheckpoint) {
  std::vector<std::string> as_user;
  if (geteuid() == 0) {
    if (!std::filesystem::exists("/usr/bin/setpriv")) {
      GTEST_SKIP() << "root without /usr/bin/setpriv: no unprivileged user to run the worker as";
    }
    as_user = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"};
  }
  namespace fs = std::filesystem;
  const std::string dir = Fresh("read_only");
  fs::permissions(dir, fs::perms::all);
  // A copy nobody can run wherever the build lies (its libraries are the
  // system's).
  std::string worker = MUONMESH_WORKER_BINARY;
  if (!as_user.empty()) {
    worker = dir + "/muonmesh-worker";
    fs::copy_file(MUONMESH_WORKER_BINARY, worker);
    fs::permissions(worker, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                fs::perms::others_read | fs::perms::others_exec);
  }
  int runs = 0;
  auto run = [&](const std::string& job, std::vector<std::string> extra) {
    const std::string store = dir + "/store-" + std::to_string(runs++);
    fs::create_directories(store);
    fs::permissions(store, fs::perms::all);
    fs::permissions(job, fs::perms::owner_read | fs::perms::owner_write |
                             fs::perms::group_read | fs::perms::others_read);
    std::vector<std::string> argv = as_user;
    for (const std::string& a : {worker, std::string("--standalone"),
                                 std::string("--job"), job, std::string("--rank"),
                                 std::string("0"), std::string("--world-size"), std::string("1"),
                                 std::string("--store"), store}) {
      argv.push_back(a);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    return muonmesh::testing::Run(argv, kTimeout);
  };
  Job job;
  job.name = "read-only";
  job.steps = 4;
  job.checkpoint_every = 2;
  job.output_dir = dir + "/out";
  job.export_path = dir + "/out/final.safetensors";
  const ProcessResult first = run(WriteJob(dir, job), {});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_TRUE(fs::exists(Checkpoint(job.output_dir, 4) + "/COMPLETE"));

  const std::string checkpoints = job.output_dir + "/checkpoints";
  fs::permissions(checkpoints, fs::perms::owner_read | fs::perms::owner_exec |
                                   fs::perms::group_read | fs::perms::group_exec |
                                   fs::perms::others_read | fs::perms::others_exec);
  job.steps = 6;
  const std::string path = WriteJob(dir, job);
  const ProcessResult failed = run(path, {"--resume"});
  EXPECT_NE(failed.exit_code, 0);
  EXPECT_THAT(failed.out, HasSubstr("resume: from the checkpoint at step 4"));
  EXPECT_THAT(failed.err, HasSubstr("PERMISSION_DENIED")) << failed.err;
  EXPECT_THAT(failed.err, HasSubstr(Checkpoint(job.output_dir, 6) + ": cannot create"));
  EXPECT_FALSE(fs::exists(Checkpoint(job.output_dir, 6)));
  EXPECT_TRUE(fs::exists(Checkpoint(job.output_dir, 4) + "/COMPLETE"));
  EXPECT_FALSE(fs::exists(job.export_path + ".tmp"));

  fs::permissions(checkpoints, fs::perms::owner_write, fs::perm_options::add);
  const ProcessResult resumed = run(path, {"--resume", "--attempt", "1"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("resume: from the checkpoint at step 4"));

  Job straight = job;
  straight.output_dir = dir + "/straight";
  straight.export_path = dir + "/straight/final.safetensors";
  const ProcessResult once = run(WriteJob(dir, straight), {});
  ASSERT_EQ(once.exit_code, 0) << once.err;
  ExpectWeightsNear(straight.export_path, job.export_path, 0);
}

// device: cuda jobs need muonmesh-worker-cuda (the CPU worker does not load
// cuBLAS) and a GPU: each missing piece gets a clear error.
TEST(StandaloneTest, CudaJobsSayWhatCannotRunHere) {
  const std::string dir = Fresh("cuda");
  Job moe;
  moe.name = "cuda_moe";
  moe.device = "cuda";
  moe.model = "{moe_mlp: {d_in: 4, d_model: 8, d_expert: 4, num_experts: 2, d_out: 2}}";
  const std::string path = WriteJob(dir, moe);
  const JobRun run = RunRanks(dir, path, 1);
  EXPECT_EQ(run.ranks[0].exit_code, 1);
  EXPECT_THAT(run.ranks[0].err, HasSubstr("runs cpu jobs only; run cuda jobs with "
                                          "muonmesh-worker-cuda"));
#ifdef MUONMESH_WORKER_CUDA_BINARY
  // The CUDA worker runs it where there is a GPU, and says so where there is none.
  const ProcessResult gpu = muonmesh::testing::Run(
      {MUONMESH_WORKER_CUDA_BINARY, "--standalone", "--job", path, "--rank", "0",
       "--world-size", "1", "--store", dir + "/store-cuda", "--create-store"},
      kTimeout);
  if (gpu.exit_code != 0) {
    EXPECT_EQ(gpu.exit_code, 1);
    EXPECT_THAT(gpu.err, HasSubstr("rank 0: no CUDA device"));
  }
#endif
}

// Usage errors exit 2 and name the flag, before anything runs.
TEST(StandaloneTest, UsageErrorsNameTheFlagAndExit2) {
  const struct {
    std::vector<std::string> args;
    std::string says;
  } cases[] = {
      {{"--stanalone"}, "unknown flag --stanalone"},
      {{"--standalone", "--rank", "one"}, "--rank: 'one' is not an integer"},
      {{"--standalone", "--job"}, "--job needs a value"},
      {{"--standalone", "--resume=yes"}, "--resume takes no value"},
      {{"--standalone", "--describe"},
       "give one of --coordinator, --standalone, --describe, --sample and --consolidate"},
      {{"--sample", "--job", "j.yaml"}, "--weights is required"},
      {{"--sample", "--temperature", "warm"}, "--temperature: not a number: warm"},
      {{"--coordinator", "127.0.0.1:1", "--standalone"},
       "give one of --coordinator, --standalone, --describe, --sample and --consolidate"},
      {{"--standalone", "--timeout-seconds", "0"}, "--timeout-seconds: not a positive integer"},
      {{"--standalone", "--memory-budget", "lots"}, "--memory-budget:"},
      {{"--standalone", "--job", "j.yaml", "--store", "s", "--world-size", "2"},
       "--rank is required"},
      {{}, "give --coordinator, --standalone, --describe, --sample or --consolidate"},
      {{"--consolidate", "ckpt"}, "--out is required with --consolidate"},
      // Accepted and ignored before: the daemon's peers reach it at --address.
      {{"--coordinator", "127.0.0.1:1", "--hostname", "10.0.0.7"},
       "--hostname is a --standalone flag"},
      {{"--consolidate", "ckpt", "--sample"},
       "give one of --coordinator, --standalone, --describe, --sample and --consolidate"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {MUONMESH_WORKER_BINARY};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const ProcessResult r = muonmesh::testing::Run(argv, kTimeout);
    EXPECT_EQ(r.exit_code, 2) << c.says << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says));
    EXPECT_THAT(r.err, HasSubstr("usage: muonmesh-worker"));
  }
  // --help is no error.
  const ProcessResult help = muonmesh::testing::Run({MUONMESH_WORKER_BINARY, "--help"}, kTimeout);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("--allowed-dirs"));
}

TEST(StandaloneTest, WorldSizeThreeWithEmptyShards) {
  // Tiny layers on 3 ranks: uneven shards and matrices straddling ranks; the
  // 2-row output layer leaves some shards empty.
  const std::string dir = Fresh("w3");
  Job one;
  one.name = "w3one";
  one.dims = "[5, 7, 2]";
  ExpectThreeRanksGiveTheOneRankLosses(dir, one, 1e-5);
}

// Final weights from given init and data files against the reference
// trainer (plain double loops, no code shared with the runtime).
TEST(StandaloneTest, FinalWeightsMatchTheIndependentReference) {
  const std::string dir = Fresh("reference");
  const std::vector<int64_t> dims = {4, 8, 3};
  const int64_t n = 32;
  std::vector<float> x(n * dims[0]), y(n * dims[2]);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.31 * i));
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>(0.5 * std::cos(0.17 * i));
  std::vector<std::vector<float>> init;
  std::vector<io::TensorView> views;
  std::vector<std::string> names;
  for (size_t l = 0; l + 1 < dims.size(); ++l) {
    std::vector<float> w(dims[l + 1] * dims[l]), b(dims[l + 1]);
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(0.3 * std::sin(1.7 * i + l));
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(0.1 * std::cos(0.9 * i + l));
    init.push_back(w);
    init.push_back(b);
  }
  for (size_t l = 0; l + 1 < dims.size(); ++l) {
    views.push_back({"layers." + std::to_string(l) + ".weight", {dims[l + 1], dims[l]},
                     init[2 * l].data()});
    views.push_back({"layers." + std::to_string(l) + ".bias", {dims[l + 1]}, init[2 * l + 1].data()});
  }
  ASSERT_TRUE(io::WriteSafetensors(dir + "/init.safetensors", views).ok());
  const std::vector<io::TensorView> data = {{"x", {n, dims[0]}, x.data()},
                                            {"y", {n, dims[2]}, y.data()}};
  ASSERT_TRUE(io::WriteSafetensors(dir + "/data.safetensors", data).ok());

  Job job;
  job.name = "reference";
  job.world = 4;
  job.dims = "[4, 8, 3]";
  job.init = "{safetensors: init.safetensors}";
  job.data = "{safetensors: data.safetensors}";
  job.steps = 6;
  job.batch = 8;
  job.export_path = dir + "/final.safetensors";
  const JobRun run = RunRanks(dir, WriteJob(dir, job), 4);
  ExpectAllOk(run);
  absl::StatusOr<std::vector<io::Tensor>> final_weights = io::ReadSafetensors(job.export_path);
  ASSERT_TRUE(final_weights.ok()) << final_weights.status();

  std::vector<std::vector<double>> init_d;
  for (const auto& t : init) init_d.emplace_back(t.begin(), t.end());
  reference::RefMuonOptions muon;
  muon.lr = 0.02;
  muon.momentum = 0.95;
  muon.nesterov = true;
  muon.weight_decay = 0.01;
  reference::RefAdamWOptions adamw;
  adamw.lr = 0.001;
  adamw.eps = 0.05;
  const std::vector<double> xd(x.begin(), x.end()), yd(y.begin(), y.end());
  const auto ref = reference::ReferenceTrain(dims, init_d, xd, yd, n, job.steps, job.batch, muon, adamw);
  ASSERT_EQ(final_weights->size(), ref.params.size());
  for (size_t p = 0; p < ref.params.size(); ++p) {
    const io::Tensor& got = (*final_weights)[p];
    ASSERT_EQ(got.data.size(), ref.params[p].size()) << got.name;
    for (size_t i = 0; i < got.data.size(); ++i) {
      EXPECT_NEAR(got.data[i], ref.params[p][i], 1e-4) << got.name << "[" << i << "]";
    }
  }
}

// Every rank appends its step records to <output.dir>/metrics/rank-R.jsonl:
// one line per step, with the loss rank 0 printed.
// Each rank runs OpenBLAS on the job's training.threads_per_rank (the count
// printed is OpenBLAS's own after the rank set it; default one), and the
// losses are those of the one-thread run.
TEST(StandaloneTest, RanksRunTheJobsThreadsPerRank) {
  const std::string dir = Fresh("threads");
  Job job;
  job.world = 2;
  const JobRun one = RunRanks(dir, WriteJob(dir, job), 2);
  ExpectAllOk(one);
  EXPECT_THAT(one.ranks[0].out, HasSubstr("global batch 24, 1 thread a rank\n"));
  job.threads_per_rank = 3;
  job.output_dir = dir + "/three";  // not over the first run's outputs
  const JobRun three = RunRanks(dir, WriteJob(dir, job), 2);
  ExpectAllOk(three);
  if (three.ranks[0].out.find("threads: OpenBLAS runs ") != std::string::npos) {
    GTEST_SKIP() << "this OpenBLAS runs fewer than 3 threads: " << three.ranks[0].out;
  }
  EXPECT_THAT(three.ranks[0].out, HasSubstr("global batch 24, 3 threads a rank\n"));
  // Two ranks on this host at three threads each: a note where that is more
  // than its cores.
  const bool oversubscribed = 2 * 3 > static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(three.ranks[0].out.find("2 ranks on this host at 3 OpenBLAS threads each "
                                    "(training.threads_per_rank) oversubscribe its") !=
                std::string::npos,
            oversubscribed)
      << three.ranks[0].out;
  ASSERT_EQ(three.losses.size(), one.losses.size());
  ASSERT_EQ(one.losses.size(), 5u);
  for (size_t s = 0; s < one.losses.size(); ++s) {
    EXPECT_NEAR(three.losses[s], one.losses[s], 1e-5 * std::abs(one.losses[s])) << "step " << s;
  }
}

TEST(StandaloneTest, EveryRankWritesItsStepRecords) {
  const std::string dir = Fresh("steplog");
  Job job;
  job.world = 2;
  job.output_dir = dir + "/out";
  const JobRun run = RunRanks(dir, WriteJob(dir, job), 2);
  ExpectAllOk(run);
  ASSERT_EQ(run.losses.size(), 5u);
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(dir + "/out/metrics/rank-" + std::to_string(r) + ".jsonl");
    ASSERT_TRUE(in.good()) << "rank " << r;
    std::string line;
    int step = 0;
    while (std::getline(in, line)) {
      EXPECT_EQ(line.rfind("{\"step\": " + std::to_string(step) + ", ", 0), 0u) << line;
      EXPECT_THAT(line, HasSubstr("\"rank\": " + std::to_string(r)));
      EXPECT_THAT(line, HasSubstr("\"newton_schulz\": "));
      EXPECT_THAT(line, HasSubstr("\"bytes_sent\": {\"grad_reduce_scatter\": "));
      const size_t at = line.find("\"loss\": ");
      ASSERT_NE(at, std::string::npos);
      const double loss = std::stod(line.substr(at + 8));
      EXPECT_NEAR(loss, run.losses[step], 1e-6 * std::abs(run.losses[step]) + 1e-12);
      ++step;
    }
    EXPECT_EQ(step, 5) << "rank " << r;
  }
}

// A gpt with QK-clip and health every 2 steps: each step's record carries
// both layers' largest logit and Muon's counts against the plan (counted
// here from gpt_spec.h: 4 matrices a layer, [3C, C], [C, C], [4C, C],
// [C, 4C] at C = 16), the orthogonality error on steps 0 and 2 only.
TEST(StandaloneTest, StepRecordsCarryTheLogitsAndMuonsHealth) {
  const std::string dir = Fresh("health");
  Job job = GptJob(dir, "health");
  job.world = 2;
  job.steps = 4;
  job.optimizer =
      "  muon: {lr: 0.02, momentum: 0.95, qk_clip: 5, health_every: 2}\n"
      "  adamw: {lr: 0.01, beta2: 0.95}\n";
  job.output_dir = dir + "/out";
  const JobRun run = RunRanks(dir, WriteJob(dir, job), 2);
  ExpectAllOk(run);
  std::ifstream in(dir + "/out/metrics/rank-0.jsonl");
  ASSERT_TRUE(in.good());
  constexpr int64_t kC = 16;
  const int64_t elements = 2 * (3 * kC * kC + kC * kC + 4 * kC * kC + 4 * kC * kC);
  const std::string counts = absl::StrCat("\"muon\": {\"matrices\": 8, \"planned_matrices\": 8, ",
                                          "\"elements\": ", elements,
                                          ", \"planned_elements\": ", elements, ", ");
  std::string line;
  int step = 0;
  while (std::getline(in, line)) {
    EXPECT_THAT(line, HasSubstr(counts)) << line;
    const size_t at = line.find("\"max_attn_logit\": [");
    ASSERT_NE(at, std::string::npos) << line;
    const std::string list = line.substr(at + 19, line.find(']', at) - at - 19);
    EXPECT_EQ(std::count(list.begin(), list.end(), ','), 1) << list;  // two layers
    EXPECT_GT(std::stod(list), 0.0) << list;
    EXPECT_EQ(line.find("\"ortho_error_max\": ") != std::string::npos, step % 2 == 0) << line;
    ++step;
  }
  EXPECT_EQ(step, 4);
}

TEST(StandaloneTest, DataFileWithTheWrongShapeIsAClearError) {
  const std::string dir = Fresh("badshape");
  std::vector<float> x(10 * 3), y(10 * 3);
  const std::vector<io::TensorView> data = {{"x", {10, 3}, x.data()}, {"y", {10, 3}, y.data()}};
  ASSERT_TRUE(io::WriteSafetensors(dir + "/data.safetensors", data).ok());
  Job job;
  job.data = "{safetensors: data.safetensors}";
  const JobRun run = RunRanks(dir, WriteJob(dir, job), 1);
  EXPECT_EQ(run.ranks[0].exit_code, 1);
  EXPECT_THAT(run.ranks[0].err, HasSubstr("data.safetensors"));
  EXPECT_THAT(run.ranks[0].err, HasSubstr("'x'"));
}

TEST(StandaloneTest, MissingFileIsAClearError) {
  const std::string dir = Fresh("missing");
  Job job;
  job.init = "{safetensors: nowhere.safetensors}";
  const JobRun run = RunRanks(dir, WriteJob(dir, job), 1);
  EXPECT_EQ(run.ranks[0].exit_code, 1);
  EXPECT_THAT(run.ranks[0].err, HasSubstr("nowhere.safetensors"));
}

TEST(StandaloneTest, ConfigThePlannerRejectsIsAClearError) {
  const std::string dir = Fresh("rejected");
  Job job;
  job.world = 4;
  job.instances = 3;
  const JobRun run = RunRanks(dir, WriteJob(dir, job), 1, {});
  // --world-size 1 differs from the job; ask with the right size instead.
  const JobRun run4 = RunRanks(dir, WriteJob(dir, job), 4);
  for (const ProcessResult& r : run4.ranks) {
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_THAT(r.err, HasSubstr("num_distributed_optimizer_instances"));
  }
  EXPECT_EQ(run.ranks[0].exit_code, 1);
}

TEST(StandaloneTest, APeerThatNeverComesEndsTheOthersWithinTheTimeout) {
  // Rank 1 of 2 is never started: rank 0 must give up after its timeout.
  const std::string dir = Fresh("absent");
  Job job;
  job.world = 2;
  const std::string path = WriteJob(dir, job);
  const ProcessResult r = muonmesh::testing::Run(
      {MUONMESH_WORKER_BINARY, "--standalone", "--job", path, "--rank", "0", "--world-size", "2",
       "--store", dir + "/store", "--create-store", "--timeout-seconds", "3"},
      kTimeout);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_LT(r.seconds, 30);
}

TEST(StandaloneTest, APeerThatDiesMidRunEndsTheOthersWithAnError) {
  // Rank 1 runs far fewer steps than rank 0 (its own job file says so), then
  // exits: rank 0 is left waiting in a collective and must fail promptly.
  const std::string dir = Fresh("dies");
  Job job;
  job.world = 2;
  job.steps = 200;
  const std::string long_job = WriteJob(dir, job);
  std::filesystem::rename(long_job, dir + "/long.yaml");
  job.steps = 2;
  const std::string short_job = WriteJob(dir, job);
  ProcessResult r0, r1;
  std::thread t0([&] {
    r0 = muonmesh::testing::Run({MUONMESH_WORKER_BINARY, "--standalone", "--job", dir + "/long.yaml",
                                 "--rank", "0", "--world-size", "2", "--store", dir + "/store",
                                 "--create-store", "--timeout-seconds", "5"},
                                kTimeout);
  });
  std::thread t1([&] {
    r1 = muonmesh::testing::Run({MUONMESH_WORKER_BINARY, "--standalone", "--job", short_job,
                                 "--rank", "1", "--world-size", "2", "--store", dir + "/store",
                                 "--timeout-seconds", "5"},
                                kTimeout);
  });
  t0.join();
  t1.join();
  EXPECT_FALSE(r0.timed_out);
  EXPECT_EQ(r0.exit_code, 1) << r0.err;
  EXPECT_THAT(r0.err, ::testing::AnyOf(HasSubstr("UNAVAILABLE"), HasSubstr("DEADLINE_EXCEEDED"),
                                       HasSubstr("FAILED_PRECONDITION")));
}

}  // namespace
}  // namespace muonmesh::worker
