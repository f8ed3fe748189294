// The engine under every parallelism config, ranks as threads on the
// in-process backend: every config must end where the independent
// double-precision reference trainers (tests/worker/model/*reference_trainer.h,
// no code shared with worker/) end, and give the 1-rank losses and weights;
// owner-based and allgather runs must end bit-identical. Dense configs train
// a two-layer linear model written here (the mlp workload for the reference
// comparison); expert configs the moe_mlp workload (tested on its own in
// tests/worker/model) with its experts on the expert mesh.

#include "worker/runtime/trainer.h"

#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/plan/buckets.h"
#include "core/plan/mesh.h"
#include "core/plan/owners.h"
#include "core/plan/planner.h"
#include "gtest/gtest.h"
#include "tests/worker/model/gpt_reference.h"
#include "tests/worker/model/moe_reference_trainer.h"
#include "tests/worker/model/reference_trainer.h"
#include "worker/checkpoints.h"
#include "worker/comm/file_store.h"
#include "worker/comm/inprocess_communicator.h"
#include "worker/io/safetensors.h"
#include "worker/model/token_windows.h"
#include "worker/model/gpt.h"
#include "worker/model/mlp.h"
#include "worker/model/moe_mlp.h"
#include "worker/reshard.h"
#include "worker/runtime/muon_schedule.h"

namespace muonmesh::worker {
namespace {

// A two-layer linear regression written here, independent of worker/model:
// y = W1 (W0 x + b0) + b1, loss = mean over samples and outputs of (y - t)^2.
class TwoLayerLinear : public Workload {
 public:
  static constexpr int64_t kIn = 6, kHidden = 12, kOut = 5, kSamples = 64;

  TwoLayerLinear() {
    spec_.name = "two-layer-linear";
    spec_.units.push_back({"layer0",
                           {{"w0", {kHidden, kIn}, "muon", false}, {"b0", {kHidden}, "adamw", false}}});
    spec_.units.push_back({"layer1",
                           {{"w1", {kOut, kHidden}, "muon", false}, {"b1", {kOut}, "adamw", false}}});
  }
  const plan::ModelSpec& spec() const override { return spec_; }
  int64_t num_samples() const override { return kSamples; }

  absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const override {
    const int64_t sizes[] = {kHidden * kIn, kHidden, kOut * kHidden, kOut};
    for (int p = 0; p < 4; ++p) {
      for (int64_t i = 0; i < sizes[p]; ++i) {
        params[p][i] = 0.5f * static_cast<float>(std::sin(0.7 * i + 1.3 * p + seed));
      }
    }
    return absl::OkStatus();
  }

  static float X(int64_t n, int64_t j) { return static_cast<float>(std::sin(0.37 * n + 1.1 * j)); }
  static float T(int64_t n, int64_t o) { return static_cast<float>(std::cos(0.23 * n - 0.9 * o)); }

  absl::StatusOr<double> ForwardBackward(int64_t, absl::Span<const float* const> p,
                                         absl::Span<const int64_t> samples,
                                         absl::Span<float* const> g) override {
    const float* w0 = p[0];
    const float* b0 = p[1];
    const float* w1 = p[2];
    const float* b1 = p[3];
    std::memset(g[0], 0, sizeof(float) * kHidden * kIn);
    std::memset(g[1], 0, sizeof(float) * kHidden);
    std::memset(g[2], 0, sizeof(float) * kOut * kHidden);
    std::memset(g[3], 0, sizeof(float) * kOut);
    const double scale = 2.0 / (static_cast<double>(samples.size()) * kOut);
    double loss = 0;
    for (int64_t n : samples) {
      double h[kHidden], dy[kOut], dh[kHidden] = {};
      for (int64_t r = 0; r < kHidden; ++r) {
        h[r] = b0[r];
        for (int64_t c = 0; c < kIn; ++c) h[r] += w0[r * kIn + c] * X(n, c);
      }
      for (int64_t o = 0; o < kOut; ++o) {
        double y = b1[o];
        for (int64_t r = 0; r < kHidden; ++r) y += w1[o * kHidden + r] * h[r];
        loss += (y - T(n, o)) * (y - T(n, o));
        dy[o] = scale * (y - T(n, o));
      }
      for (int64_t o = 0; o < kOut; ++o) {
        g[3][o] += static_cast<float>(dy[o]);
        for (int64_t r = 0; r < kHidden; ++r) {
          g[2][o * kHidden + r] += static_cast<float>(dy[o] * h[r]);
          dh[r] += w1[o * kHidden + r] * dy[o];
        }
      }
      for (int64_t r = 0; r < kHidden; ++r) {
        g[1][r] += static_cast<float>(dh[r]);
        for (int64_t c = 0; c < kIn; ++c) g[0][r * kIn + c] += static_cast<float>(dh[r] * X(n, c));
      }
    }
    return loss / (static_cast<double>(samples.size()) * kOut);
  }

 private:
  plan::ModelSpec spec_;
};

struct Config {
  const char* name;
  int64_t world;
  const char* inner;
  int64_t instances;
  const char* outer;
  int64_t ep = 1;
  bool moe = false;
  bool mlp = false;  // dense configs: the mlp workload instead of TwoLayerLinear
  bool gpt = false;  // dense configs: a tiny gpt (QK-clip)
};

constexpr int64_t kTeacherSamples = 64;
const std::vector<int64_t> kMlpDims = {6, 12, 5};
constexpr MoeMlpDims kMoeDims = {5, 8, 6, 4, 3};

// Dense: TwoLayerLinear, or the mlp workload [6, 12, 5] on 64 teacher
// samples; expert: d_in 5, d_model 8, d_expert 6, 4 experts, d_out 3 on 64
// teacher samples.
// The gpt of the QK-clip tests: V 11, block 8, 2 layers, 2 heads, C 8, T 5,
// on 23 tokens (18 windows).
constexpr model::GptDims kGptDims = {11, 8, 2, 2, 8, 5};
std::vector<int32_t> GptTokens() {
  std::vector<int32_t> t;
  for (int32_t i = 0; i < 23; ++i) t.push_back((7 * i * i + 3 * i) % 11);
  return t;
}

std::unique_ptr<Workload> MakeWorkload(bool moe, bool mlp = false, bool gpt = false) {
  if (gpt) {
    absl::StatusOr<Gpt> g = Gpt::Create(kGptDims, std::make_shared<InMemoryTokens>(GptTokens()));
    EXPECT_TRUE(g.ok()) << g.status();
    return std::make_unique<Gpt>(*std::move(g));
  }
  if (!moe && mlp) {
    absl::StatusOr<Mlp> m = Mlp::FromTeacher(kMlpDims, 21, kTeacherSamples);
    EXPECT_TRUE(m.ok()) << m.status();
    return std::make_unique<Mlp>(*std::move(m));
  }
  if (!moe) return std::make_unique<TwoLayerLinear>();
  absl::StatusOr<MoeMlp> m = MoeMlp::FromTeacher(kMoeDims, 21, kTeacherSamples);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::make_unique<MoeMlp>(*std::move(m));
}

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;   // rank 0's, one per step
  std::vector<double> lr_scales;
  std::vector<std::vector<float>> weights;       // as rank 0 gathers them
  std::vector<std::vector<float>> last_weights;  // as the last rank does (its own replica)
  std::map<std::string, int64_t> bytes;  // summed over ranks and steps
  // What the in-process transport copied between ranks, per group and
  // collective (InProcessHub::TrafficBytes), over the whole run.
  std::map<std::string, std::array<int64_t, comm::kNumCollectives>> wire;
  plan::Plan plan;
  // Per rank, its last step's Muon rounds, exchange calls and NS FLOPs.
  std::vector<std::vector<MuonRound>> rounds;
  std::vector<int32_t> exchange_calls;
  std::vector<double> ns_flops;
  std::vector<int64_t> collective_calls;  // per rank, its last step's
  std::vector<std::vector<float>> max_attn_logits;  // rank 0's, per step
  std::vector<MuonHealth> health;                    // rank 0's, per step
  std::vector<bool> muon_in_backward;                // rank 0's, per step
};

// Checkpoint hooks of a run: ranks load their shards from `load_dir` before
// the first step and save them to `save_dir` after the last. With
// `reshard`, the save is a job's checkpoint (SaveCheckpoint, under
// `save_dir` as the output folder) and the load puts the checkpoint at
// `load_dir` back together (worker/reshard.h) for whatever layout this run
// has (Trainer::LoadState).
std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct Checkpoints {
  std::string load_dir;
  std::string save_dir;
  bool reshard = false;
};

// The recipe's options of a run (TrainerOptions), none by default.
struct RunRecipe {
  optim::LrSchedule schedule;
  int64_t total_steps = 0;
  std::optional<optim::MomentumWarmup> momentum_warmup;
  double clip_grad_norm = 0;
  std::vector<optim::ParamRates> param_rates;
  int64_t micro_batch_size = 0;
  // Per flat parameter, ParamSpec::muon_block_rows, muon_block_rows_next
  // and muon_stack_blocks for the plan (empty: none).
  std::vector<int64_t> block_rows;
  std::vector<int64_t> block_rows_next;
  std::vector<bool> stack_blocks;
  std::optional<uint64_t> shuffle_seed;
  double qk_clip = 0;
  int64_t health_every = 0;
  int64_t bucket_bytes = plan::kDefaultBucketBytes;
  bool overlap_reduce = true;
  bool prefetch_gathers = true;
  bool muon_in_backward = true;
  bool reshard_after_forward = true;
  bool overlap_records = true;
  bool overlap_param_gather = true;
};

RunResult RunJob(const Config& c, const char* rule, int steps = 5, const Checkpoints& ck = {},
                 int64_t muon_buffer_bytes = 0, bool muon_overlap = true,
                 const char* replica_split = "", const RunRecipe& recipe = {}) {
  const std::unique_ptr<Workload> model = MakeWorkload(c.moe, c.mlp, c.gpt);
  plan::PlanInput in;
  in.model = model->spec();
  for (size_t u = 0, flat = 0; u < in.model.units.size(); ++u) {
    for (plan::ParamSpec& p : in.model.units[u].params) {
      if (flat < recipe.block_rows.size()) p.muon_block_rows = recipe.block_rows[flat];
      if (flat < recipe.block_rows_next.size()) {
        p.muon_block_rows_next = recipe.block_rows_next[flat];
      }
      if (flat < recipe.stack_blocks.size()) p.muon_stack_blocks = recipe.stack_blocks[flat];
      ++flat;
    }
  }
  in.world_size = c.world;
  in.parallelism.expert_model_parallel_size = c.ep;
  in.parallelism.data_parallel_sharding_strategy = c.inner;
  in.parallelism.num_distributed_optimizer_instances = c.instances;
  in.parallelism.outer_dp_sharding_strategy = c.outer;
  in.options.owner_assignment = rule;
  in.options.device = "cpu";
  in.options.muon_replica_split = replica_split;
  // As the worker and the coordinator plan a job: owners balanced wave by
  // wave under the budget the runtime cuts with.
  in.options.muon_wave_budget_bytes = plan::JobWaveBudget(muon_buffer_bytes, "cpu");
  in.options.reshard_after_forward = recipe.reshard_after_forward;
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(in);
  RunResult result;
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return result;
  result.plan = *plan;

  const std::string dir = ::testing::TempDir() + "/trainer_store_" + c.name + "_" + rule +
                          (ck.load_dir.empty() ? "" : "_resumed") + "_" +
                          std::to_string(muon_buffer_bytes) + (muon_overlap ? "" : "_serial") +
                          (*replica_split != '\0' ? std::string("_split_") + replica_split : "");
  std::filesystem::remove_all(dir);
  absl::StatusOr<std::unique_ptr<comm::FileStore>> store = comm::FileStore::Open(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  auto hub = std::make_shared<comm::InProcessHub>();
  std::vector<std::thread> threads;
  std::vector<std::vector<double>> losses(c.world);
  std::vector<std::vector<double>> norms(c.world);
  std::vector<std::vector<std::vector<float>>> logits(c.world);
  std::vector<std::vector<MuonHealth>> health(c.world);
  std::vector<double> lr_scales;
  std::vector<std::map<std::string, int64_t>> bytes(c.world);
  std::vector<absl::Status> status(c.world);
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<float>> last_weights;
  result.rounds.resize(c.world);
  result.exchange_calls.resize(c.world);
  result.ns_flops.resize(c.world);
  result.collective_calls.resize(c.world);
  for (int32_t r = 0; r < c.world; ++r) {
    threads.emplace_back([&, r] {
      const std::unique_ptr<Workload> local = MakeWorkload(c.moe, c.mlp, c.gpt);
      const std::unique_ptr<Device> cpu = MakeCpuDevice();
      TrainerOptions o;
      o.device = cpu.get();
      o.backend = comm::Backend::kInProcess;
      o.store = store->get();
      o.group_options.hub = hub;
      o.group_options.connect_timeout = absl::Seconds(20);
      o.collective.timeout = absl::Seconds(20);
      o.muon.lr = 0.02;
      o.muon.momentum = 0.95;
      o.muon.weight_decay = 0.01;
      o.adamw.lr = 1e-3;
      o.adamw.weight_decay = 0.0;
      // Muon and AdamW with a tiny eps are blind to the gradient scale; a
      // large eps makes a wrong average (a sum, say) visible in the loss.
      o.adamw.eps = 0.05;
      o.global_batch_size = 24;
      o.init_seed = 3;
      o.muon_buffer_bytes = muon_buffer_bytes;
      o.muon_overlap = muon_overlap;
      o.lr_schedule = recipe.schedule;
      o.total_steps = recipe.total_steps;
      o.momentum_warmup = recipe.momentum_warmup;
      o.clip_grad_norm = recipe.clip_grad_norm;
      o.param_rates = recipe.param_rates;
      o.micro_batch_size = recipe.micro_batch_size;
      o.shuffle_seed = recipe.shuffle_seed;
      o.qk_clip = recipe.qk_clip;
      o.health_every = recipe.health_every;
      o.bucket_bytes = recipe.bucket_bytes;
      o.overlap_reduce = recipe.overlap_reduce;
      o.prefetch_gathers = recipe.prefetch_gathers;
      o.muon_in_backward = recipe.muon_in_backward;
      o.overlap_records = recipe.overlap_records;
      o.overlap_param_gather = recipe.overlap_param_gather;
      absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(*plan, local.get(), r, o);
      if (!t.ok()) {
        status[r] = t.status();
        return;
      }
      const std::string file = "/rank-" + std::to_string(r) + ".safetensors";
      if (!ck.load_dir.empty() && ck.reshard) {
        std::string from;
        std::vector<std::string> notes;
        absl::StatusOr<WholeState> whole = LoadWholeState(ck.load_dir, &from, &notes);
        status[r] = whole.ok() ? (*t)->LoadState(*whole, false) : whole.status();
        if (!status[r].ok()) return;
      } else if (!ck.load_dir.empty()) {
        status[r] = (*t)->LoadShards(ck.load_dir + file);
        if (!status[r].ok()) return;
      }
      for (int s = 0; s < steps; ++s) {
        absl::StatusOr<StepReport> rep = (*t)->Step();
        if (!rep.ok()) {
          status[r] = rep.status();
          return;
        }
        losses[r].push_back(rep->loss);
        norms[r].push_back(rep->grad_norm);
        logits[r].push_back(rep->max_attn_logit);
        health[r].push_back(rep->muon);
        if (r == 0) lr_scales.push_back(rep->lr_scale);
        if (r == 0) result.muon_in_backward.push_back(rep->muon_in_backward);
        for (const auto& [k, v] : rep->bytes_sent) bytes[r][k] += v;
        result.rounds[r] = rep->muon_rounds;
        result.exchange_calls[r] = rep->muon_exchange_calls;
        result.ns_flops[r] = rep->ns_flops;
        result.collective_calls[r] = rep->collective_calls;
      }
      if (!ck.save_dir.empty()) {
        status[r] = ck.reshard ? SaveCheckpoint(**t, ck.save_dir, c.world, r)
                               : (*t)->SaveShards(ck.save_dir + file);
        if (!status[r].ok()) return;
      }
      absl::StatusOr<std::vector<std::vector<float>>> w = (*t)->GatherParameters();
      if (!w.ok()) {
        status[r] = w.status();
        return;
      }
      if (r == 0) weights = *w;
      if (r == c.world - 1) last_weights = *w;
    });
  }
  for (auto& t : threads) t.join();
  for (int32_t r = 0; r < c.world; ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    if (r > 0) {
      EXPECT_EQ(losses[r], losses[0]) << "ranks disagree on the loss";
      EXPECT_EQ(norms[r], norms[0]) << "ranks disagree on the gradient norm";
      EXPECT_EQ(logits[r], logits[0]) << "ranks disagree on the attention logits";
      for (size_t st = 0; st < health[r].size() && st < health[0].size(); ++st) {
        EXPECT_EQ(health[r][st].elements, health[0][st].elements) << "step " << st;
        EXPECT_EQ(health[r][st].update_rms, health[0][st].update_rms) << "step " << st;
        EXPECT_EQ(health[r][st].ortho_error_max, health[0][st].ortho_error_max) << "step " << st;
      }
    }
    for (const auto& [k, v] : bytes[r]) result.bytes[k] += v;
  }
  result.wire = hub->TrafficBytes();
  result.losses = losses[0];
  result.grad_norms = norms[0];
  result.max_attn_logits = logits[0];
  result.health = health[0];
  result.lr_scales = lr_scales;
  result.weights = weights;
  result.last_weights = last_weights;
  return result;
}

class TrainerConfigTest : public ::testing::TestWithParam<Config> {};

TEST_P(TrainerConfigTest, MatchesTheSingleRankRun) {
  const Config single = {"single", 1, "optim_grads_params", 1, "", 1, GetParam().moe};
  const RunResult one = RunJob(single, "lpt");
  const RunResult many = RunJob(GetParam(), "lpt");
  ASSERT_EQ(one.losses.size(), 5u);
  ASSERT_EQ(many.losses.size(), 5u);
  for (size_t s = 0; s < one.losses.size(); ++s) {
    EXPECT_NEAR(many.losses[s], one.losses[s], 1e-5 * std::abs(one.losses[s])) << "step " << s;
  }
  // The loss must actually move: the runs train.
  EXPECT_LT(one.losses.back(), one.losses.front());
  ASSERT_EQ(many.weights.size(), one.weights.size());
  for (size_t p = 0; p < one.weights.size(); ++p) {
    for (size_t i = 0; i < one.weights[p].size(); ++i) {
      EXPECT_NEAR(many.weights[p][i], one.weights[p][i], 1e-5) << "param " << p << " [" << i << "]";
    }
  }
}

// The independent reference (double precision, plain loops) on config c's
// workload from `init`, with the options RunJob gives the trainer and
// `recipe`. `gap`: the expert reference's closest routing decision.
reference::RefTrainResult ReferenceRun(const Config& c, const reference::Tensors& init,
                                       int steps, const reference::RefRecipe& recipe = {},
                                       double* gap = nullptr) {
  reference::RefMuonOptions muon;
  muon.lr = 0.02;
  muon.momentum = 0.95;
  muon.nesterov = true;
  muon.weight_decay = 0.01;
  reference::RefAdamWOptions adamw;
  adamw.lr = 1e-3;
  adamw.eps = 0.05;
  constexpr int64_t kBatch = 24;
  const std::unique_ptr<Workload> model = MakeWorkload(c.moe, c.mlp);
  if (c.moe) {
    const auto* moe = static_cast<const MoeMlp*>(model.get());
    const std::vector<double> x(moe->x().begin(), moe->x().end());
    const std::vector<double> y(moe->y().begin(), moe->y().end());
    double min_gap = 0;
    reference::RefTrainResult r = reference::ReferenceTrainMoe(
        {kMoeDims.d_in, kMoeDims.d_model, kMoeDims.d_expert, kMoeDims.num_experts,
         kMoeDims.d_out},
        init, x, y, kTeacherSamples, steps, kBatch, muon, adamw, &min_gap, recipe);
    if (gap != nullptr) *gap = min_gap;
    return r;
  }
  const auto* mlp = static_cast<const Mlp*>(model.get());
  const std::vector<double> x(mlp->x().begin(), mlp->x().end());
  const std::vector<double> y(mlp->y().begin(), mlp->y().end());
  if (gap != nullptr) *gap = std::numeric_limits<double>::infinity();
  return reference::ReferenceTrain(kMlpDims, init, x, y, kTeacherSamples, steps, kBatch, muon,
                                   adamw, {}, recipe);
}

// The weights a run starts from (gathered after zero steps), as the
// reference takes them.
reference::Tensors InitialWeights(const RunResult& start) {
  reference::Tensors init;
  for (const auto& w : start.weights) init.emplace_back(w.begin(), w.end());
  return init;
}

// The run's losses and final weights against the reference's, within fp32
// rounding of a few steps.
void ExpectMatchesReference(const RunResult& run, const reference::RefTrainResult& ref) {
  ASSERT_EQ(run.losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_NEAR(run.losses[s], ref.losses[s], 1e-5 * std::abs(ref.losses[s])) << "step " << s;
  }
  ASSERT_EQ(run.weights.size(), ref.params.size());
  for (size_t p = 0; p < ref.params.size(); ++p) {
    ASSERT_EQ(run.weights[p].size(), ref.params[p].size()) << "param " << p;
    for (size_t i = 0; i < ref.params[p].size(); ++i) {
      EXPECT_NEAR(run.weights[p][i], ref.params[p][i], 1e-5) << "param " << p << " [" << i << "]";
    }
  }
}

// The largest difference between two runs' final weights.
double MaxApart(const RunResult& a, const RunResult& b) {
  double apart = 0;
  for (size_t p = 0; p < a.weights.size() && p < b.weights.size(); ++p) {
    for (size_t i = 0; i < a.weights[p].size() && i < b.weights[p].size(); ++i) {
      apart = std::max(apart, static_cast<double>(std::abs(a.weights[p][i] - b.weights[p][i])));
    }
  }
  return apart;
}

// The sharded run against the independent reference (double precision,
// plain loops) from the same initial weights (the run's own, gathered after
// zero steps) on the workload's data: losses and final weights within fp32
// rounding of 5 steps. The expert reference reports how close its routing
// came to a tie; a comfortable gap means fp32 routes every sample alike.
TEST_P(TrainerConfigTest, MatchesTheIndependentReference) {
  Config c = GetParam();
  c.mlp = true;
  constexpr int kSteps = 5;
  const RunResult start = RunJob(c, "lpt", /*steps=*/0);
  const RunResult run = RunJob(c, "lpt", kSteps);
  ASSERT_FALSE(start.weights.empty());
  const reference::Tensors init = InitialWeights(start);
  double gap = 0;
  const reference::RefTrainResult ref = ReferenceRun(c, init, kSteps, {}, &gap);
  ASSERT_GT(gap, 1e-4) << "a routing decision this close to a tie may differ in fp32";
  ExpectMatchesReference(run, ref);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  double moved = 0;
  for (size_t p = 0; p < ref.params.size(); ++p) {
    for (size_t i = 0; i < ref.params[p].size(); ++i) {
      moved = std::max(moved, std::abs(ref.params[p][i] - init[p][i]));
    }
  }
  // The tolerance is far below what training moved the weights.
  EXPECT_GT(moved, 1e-2);
}

// The recipe (a warmup then cosine decay, Muon's momentum warmup, clipping
// active on some steps, and per-parameter rates as optimizer.rules give them,
// Muon and AdamW tensors alike) against the independent reference, which
// is handed each step's factors as this test works them out from the
// formulas of docs/architecture.md §5 and computes the gradient norm over the whole
// gradients itself: every layout, dense and expert, agrees with it on the
// losses, the norms (each element counted once) and the final weights.
TEST_P(TrainerConfigTest, TheRecipeMatchesTheIndependentReference) {
  Config c = GetParam();
  c.mlp = true;
  constexpr int kSteps = 6;
  constexpr int kWarmup = 2;
  constexpr double kMinRatio = 0.1;
  reference::RefRecipe ref_recipe;
  for (int s = 0; s < kSteps; ++s) {
    const double q = static_cast<double>(s - kWarmup) / (kSteps - kWarmup);
    ref_recipe.lr_scale.push_back(
        s < kWarmup ? (s + 1.0) / kWarmup
                    : kMinRatio + (1 - kMinRatio) * 0.5 * (1 + std::cos(M_PI * q)));
    ref_recipe.momentum.push_back(0.85 + (0.95 - 0.85) * std::min(1.0, s / 4.0));
  }
  const RunResult start = RunJob(c, "lpt", /*steps=*/0);
  ASSERT_FALSE(start.weights.empty());
  const reference::Tensors init = InitialWeights(start);
  // Rates by flat index: parameter 3 at half the rate; the other odd ones
  // at twice the rate with decay 0.05; parameter 2 at half with decay 0.1.
  std::vector<optim::ParamRates> rates(init.size());
  for (size_t i = 0; i < init.size(); ++i) {
    if (i == 3) {
      rates[i] = {0.5, std::nullopt};
    } else if (i % 2 == 1) {
      rates[i] = {2.0, 0.05};
    } else if (i == 2) {
      rates[i] = {0.5, 0.1};
    }
    ref_recipe.param_lr_scale.push_back(rates[i].lr_scale);
    ref_recipe.param_weight_decay.push_back(rates[i].weight_decay.value_or(std::nan("")));
  }
  const auto reference_run = [&](const reference::RefRecipe& r) {
    double gap = 0;
    reference::RefTrainResult out = ReferenceRun(c, init, kSteps, r, &gap);
    EXPECT_GT(gap, 1e-4) << "a routing decision this close to a tie may differ in fp32";
    return out;
  };
  // Clip at the median unclipped norm of the first steps: some steps are
  // clipped, some are not.
  std::vector<double> unclipped = reference_run(ref_recipe).grad_norms;
  std::sort(unclipped.begin(), unclipped.end());
  ref_recipe.clip_grad_norm = unclipped[unclipped.size() / 2];
  const reference::RefTrainResult ref = reference_run(ref_recipe);
  int clipped = 0;
  for (double n : ref.grad_norms) clipped += n > ref_recipe.clip_grad_norm ? 1 : 0;
  ASSERT_GT(clipped, 0);
  ASSERT_LT(clipped, kSteps);

  RunRecipe recipe;
  recipe.schedule = {.warmup_steps = kWarmup, .decay = optim::LrDecay::kCosine,
                     .min_lr_ratio = kMinRatio};
  recipe.total_steps = kSteps;
  recipe.momentum_warmup = optim::MomentumWarmup{.start = 0.85, .steps = 4};
  recipe.clip_grad_norm = ref_recipe.clip_grad_norm;
  recipe.param_rates = rates;
  const RunResult run = RunJob(c, "lpt", kSteps, {}, 0, true, "", recipe);
  ExpectMatchesReference(run, ref);
  ASSERT_EQ(run.grad_norms.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(run.grad_norms[s], ref.grad_norms[s], 1e-4 * ref.grad_norms[s]) << "step " << s;
    EXPECT_NEAR(run.lr_scales[s], ref_recipe.lr_scale[s], 1e-12) << "step " << s;
  }
  // Without the recipe the weights end elsewhere: the test sees it act.
  EXPECT_GT(MaxApart(RunJob(c, "lpt", kSteps), run), 1e-3);
}

// `steps` steps of `c` with Muon on the recipe's row blocks, against the
// reference doing Muon on the same rows (`ref_recipe`): the plan holds
// `expected_matrices` matrices (dense once, experts once per EP group) and
// the run matches the reference. Returns the run.
RunResult RunBlocksAgainstReference(const Config& c, int steps, const RunRecipe& recipe,
                                    const reference::RefRecipe& ref_recipe,
                                    int64_t expected_matrices) {
  const RunResult start = RunJob(c, "lpt", /*steps=*/0, {}, 0, true, "", recipe);
  EXPECT_FALSE(start.weights.empty());
  if (start.weights.empty()) return start;
  const int64_t planned = static_cast<int64_t>(start.plan.dense.matrices.size()) +
                          static_cast<int64_t>(start.plan.expert.matrices.size()) * c.ep;
  EXPECT_EQ(planned, expected_matrices);
  const RunResult run = RunJob(c, "lpt", steps, {}, 0, true, "", recipe);
  double gap = 0;
  const reference::RefTrainResult ref =
      ReferenceRun(c, InitialWeights(start), steps, ref_recipe, &gap);
  EXPECT_GT(gap, 1e-4);
  ExpectMatchesReference(run, ref);
  return run;
}

// Muon on row blocks (ParamSpec::muon_block_rows: split q/k/v, per head):
// every Muon matrix with an even number of rows orthogonalized as its two
// halves, experts' included. The plan holds one matrix per block, and every
// layout matches the independent reference doing Muon on each half alone.
TEST_P(TrainerConfigTest, MuonBlocksMatchTheIndependentReference) {
  Config c = GetParam();
  c.mlp = true;
  constexpr int kSteps = 4;
  const std::unique_ptr<Workload> model = MakeWorkload(c.moe, c.mlp);
  RunRecipe recipe;
  reference::RefRecipe ref_recipe;
  int64_t expected_matrices = 0;  // over the model: experts x blocks, all EP groups
  for (const plan::UnitSpec& u : model->spec().units) {
    for (const plan::ParamSpec& p : u.params) {
      const int64_t rows = p.shape[p.expert ? 1 : 0];
      const int64_t half = p.optimizer == "muon" && rows % 2 == 0 ? rows / 2 : 0;
      recipe.block_rows.push_back(half);
      ref_recipe.param_block_rows.push_back(half);
      if (p.optimizer == "muon") {
        expected_matrices += (p.expert ? p.shape[0] : 1) * (half > 0 ? 2 : 1);
      }
    }
  }
  const RunResult run =
      RunBlocksAgainstReference(c, kSteps, recipe, ref_recipe, expected_matrices);
  // Whole-matrix Muon ends elsewhere: the blocks are really apart.
  EXPECT_GT(MaxApart(RunJob(c, "lpt", kSteps), run), 1e-3);
}

// Stacked blocks (ParamSpec::muon_stack_blocks: MLA's kv_b_proj under
// split_qkv, every head's k_nope rows one matrix and every head's v rows
// another): each Muon matrix's rows cut in pairs of blocks, two rows then
// one (rows divisible by 3) or one and one (even rows), the blocks of each
// size stacked into one matrix, so every matrix's rows lie in pieces across
// its tensor and its shards. Two matrices per tensor, and every layout
// matches the reference doing Muon on each group of rows alone.
TEST_P(TrainerConfigTest, StackedMuonBlocksMatchTheIndependentReference) {
  Config c = GetParam();
  c.mlp = true;
  constexpr int kSteps = 4;
  const std::unique_ptr<Workload> model = MakeWorkload(c.moe, c.mlp);
  RunRecipe recipe;
  reference::RefRecipe ref_recipe;
  int64_t expected_matrices = 0;  // over the model: experts x 2 (or 1), all EP groups
  for (const plan::UnitSpec& u : model->spec().units) {
    for (const plan::ParamSpec& p : u.params) {
      const int64_t rows = p.shape[p.expert ? 1 : 0];
      const bool muon = p.optimizer == "muon";
      const int64_t first = !muon ? 0 : rows % 3 == 0 ? 2 : rows % 2 == 0 ? 1 : 0;
      const int64_t second = first > 0 ? 1 : 0;
      recipe.block_rows.push_back(first);
      recipe.block_rows_next.push_back(second);
      recipe.stack_blocks.push_back(first > 0);
      ref_recipe.param_block_rows.push_back(first);
      ref_recipe.param_block_rows_next.push_back(second);
      ref_recipe.param_stack_blocks.push_back(first > 0);
      if (muon) expected_matrices += (p.expert ? p.shape[0] : 1) * (first > 0 ? 2 : 1);
    }
  }
  const RunResult run =
      RunBlocksAgainstReference(c, kSteps, recipe, ref_recipe, expected_matrices);
  // Blocks one after another (unstacked) end elsewhere: the stacking acts.
  RunRecipe apart = recipe;
  apart.stack_blocks.clear();
  EXPECT_GT(MaxApart(RunJob(c, "lpt", kSteps, {}, 0, true, "", apart), run), 1e-3);
}

// Gradient accumulation: the local batch one sample at a time (6 micro-
// batches a step at 4 ranks, 24 at 1, 3 at 8) gives the unaccumulated step
// to float rounding, losses and weights.
// data.shuffle draws the same samples for every layout (the order is a
// function of the global index): the layout's run ends where one rank's
// does; and it is another order than the unshuffled one.
// Muon health under every layout: each step counts every Muon matrix and
// element once (against the workload's spec, counted here: an expert stack
// [E, r, c] is E matrices), the update's RMS is what the weights moved by
// (step 0: p0 (1 - lr wd) - p1 over the Muon tensors, lr 0.02, wd 0.01),
// and the orthogonality error comes on the health steps only, at the values
// one rank measures.
TEST_P(TrainerConfigTest, MuonHealthCountsEachMatrixOnceAndMeasuresTheUpdate) {
  const Config c = GetParam();
  const Config single = {"single", 1, "optim_grads_params", 1, "", 1, c.moe};
  RunRecipe recipe;
  recipe.health_every = 2;
  const RunResult start = RunJob(c, "lpt", /*steps=*/0);
  const RunResult first = RunJob(c, "lpt", 1, {}, 0, true, "", recipe);
  const RunResult run = RunJob(c, "lpt", 3, {}, 0, true, "", recipe);
  const RunResult one = RunJob(single, "lpt", 3, {}, 0, true, "", recipe);
  int64_t matrices = 0, elements = 0;
  std::vector<bool> muon;
  const std::unique_ptr<Workload> model = MakeWorkload(c.moe);
  for (const plan::UnitSpec& unit : model->spec().units) {
    for (const plan::ParamSpec& p : unit.params) {
      muon.push_back(p.optimizer == "muon");
      if (!muon.back()) continue;
      matrices += p.expert ? p.shape[0] : 1;
      int64_t size = 1;
      for (int64_t d : p.shape) size *= d;
      elements += size;
    }
  }
  ASSERT_EQ(run.health.size(), 3u);
  // The orthogonality errors ride in the step records' one all-gather: the
  // last step, a health step, makes no more collective calls than the same
  // step of a run that never measures them.
  const RunResult quiet = RunJob(c, "lpt", 3);
  EXPECT_EQ(run.collective_calls, quiet.collective_calls);
  for (size_t st = 0; st < 3; ++st) {
    const MuonHealth& h = run.health[st];
    EXPECT_EQ(h.matrices, matrices) << "step " << st;
    EXPECT_EQ(h.planned_matrices, matrices) << "step " << st;
    EXPECT_EQ(h.elements, elements) << "step " << st;
    EXPECT_EQ(h.planned_elements, elements) << "step " << st;
    EXPECT_NEAR(h.update_rms, one.health[st].update_rms, 1e-4 * one.health[st].update_rms);
    EXPECT_EQ(h.ortho_error_max.has_value(), st % 2 == 0) << "step " << st;
    EXPECT_EQ(h.ortho_error_median.has_value(), st % 2 == 0) << "step " << st;
    if (st % 2 != 0) continue;
    EXPECT_NEAR(*h.ortho_error_max, *one.health[st].ortho_error_max, 1e-4);
    EXPECT_NEAR(*h.ortho_error_median, *one.health[st].ortho_error_median, 1e-4);
    EXPECT_LE(*h.ortho_error_median, *h.ortho_error_max);
    EXPECT_GT(*h.ortho_error_median, 0.0);
    // Singular values in [0, sqrt 2] keep each term (s^2 - 1)^2 <= 1.
    EXPECT_LE(*h.ortho_error_max, 1.0);
  }
  double sum_sq = 0;
  int64_t n = 0;
  for (size_t p = 0; p < muon.size(); ++p) {
    if (!muon[p]) continue;
    for (size_t i = 0; i < start.weights[p].size(); ++i) {
      const double moved = start.weights[p][i] * (1.0 - 0.02 * 0.01) - first.weights[p][i];
      sum_sq += moved * moved;
      ++n;
    }
  }
  ASSERT_EQ(first.health.size(), 1u);
  const double want = std::sqrt(sum_sq / static_cast<double>(n));
  EXPECT_NEAR(first.health[0].update_rms, want, 1e-3 * want);
}

TEST_P(TrainerConfigTest, ShuffledSamplesAreTheSameUnderEveryLayout) {
  RunRecipe shuffled;
  shuffled.shuffle_seed = 17;
  const Config single = {"single", 1, "optim_grads_params", 1, "", 1, GetParam().moe};
  const RunResult one = RunJob(single, "lpt", 5, {}, 0, true, "", shuffled);
  const RunResult many = RunJob(GetParam(), "lpt", 5, {}, 0, true, "", shuffled);
  const RunResult in_order = RunJob(single, "lpt");
  ASSERT_EQ(many.losses.size(), one.losses.size());
  bool differs = false;
  for (size_t s = 0; s < one.losses.size(); ++s) {
    EXPECT_NEAR(many.losses[s], one.losses[s], 1e-5 * std::abs(one.losses[s])) << "step " << s;
    differs = differs || std::abs(one.losses[s] - in_order.losses[s]) > 1e-4 * in_order.losses[s];
  }
  EXPECT_TRUE(differs) << "the shuffled run read the samples in order";
  ASSERT_EQ(many.weights.size(), one.weights.size());
  for (size_t p = 0; p < one.weights.size(); ++p) {
    for (size_t i = 0; i < one.weights[p].size(); ++i) {
      EXPECT_NEAR(many.weights[p][i], one.weights[p][i], 1e-5) << "param " << p << " [" << i << "]";
    }
  }
}

TEST_P(TrainerConfigTest, MicroBatchesGiveTheUnaccumulatedStep) {
  Config c = GetParam();
  c.mlp = true;
  RunRecipe accumulate;
  accumulate.micro_batch_size = 1;
  const RunResult whole = RunJob(c, "lpt");
  const RunResult micro = RunJob(c, "lpt", 5, {}, 0, true, "", accumulate);
  ASSERT_EQ(micro.losses.size(), whole.losses.size());
  for (size_t s = 0; s < whole.losses.size(); ++s) {
    EXPECT_NEAR(micro.losses[s], whole.losses[s], 1e-5 * std::abs(whole.losses[s])) << "step " << s;
    EXPECT_NEAR(micro.grad_norms[s], whole.grad_norms[s], 1e-5 * whole.grad_norms[s]);
  }
  ASSERT_EQ(micro.weights.size(), whole.weights.size());
  for (size_t p = 0; p < whole.weights.size(); ++p) {
    for (size_t i = 0; i < whole.weights[p].size(); ++i) {
      EXPECT_NEAR(micro.weights[p][i], whole.weights[p][i], 1e-5) << "param " << p << " [" << i << "]";
    }
  }
  EXPECT_LT(whole.losses.back(), whole.losses.front());
}

// Every weight of `got` the same bits as `want`'s (`what` names the run).
void ExpectSameWeights(const RunResult& got, const RunResult& want, const std::string& what) {
  ASSERT_EQ(got.weights.size(), want.weights.size()) << what;
  for (size_t p = 0; p < want.weights.size(); ++p) {
    ASSERT_EQ(got.weights[p].size(), want.weights[p].size()) << what << ", param " << p;
    EXPECT_EQ(std::memcmp(got.weights[p].data(), want.weights[p].data(),
                          sizeof(float) * want.weights[p].size()),
              0)
        << what << ", param " << p;
  }
}

// The same weights bit for bit, and the same losses and gradient norms.
void ExpectSameRun(const RunResult& got, const RunResult& want, const std::string& what) {
  ExpectSameWeights(got, want, what);
  EXPECT_EQ(got.losses, want.losses) << what;
  EXPECT_EQ(got.grad_norms, want.grad_norms) << what;
}

TEST_P(TrainerConfigTest, OwnerBasedAndAllgatherEndBitIdentical) {
  const RunResult owners = RunJob(GetParam(), "lpt");
  const RunResult everyone = RunJob(GetParam(), "allgather");
  ExpectSameWeights(everyone, owners, "allgather");
}

// Communication buckets (core/plan/buckets.h): one unit a collective, about
// half the model a bucket, and the default (the whole of these small models
// in one) end with the same weights bit for bit and send the same bytes;
// each unit merged into a bucket saves, per step, one call per reduce
// level, per all-reduced axis and, where parameters are replicated over
// optimizer shards, its after-step gather (counted from the mesh geometry);
// where parameters are sharded, the forward pass's gathers are shared too:
// for a workload that acquires its units once, in order (Workload's
// default pass, TwoLayerLinear), one more call saved per merged unit; for
// the others at least the reduction's and the after-step's. The buckets
// reduced on the step's own thread instead of beside the backward pass, and
// the parameters gathered when acquired instead of one gather ahead, end
// the same, bit for bit, with the same calls.
TEST_P(TrainerConfigTest, BucketsOfAnySizeEndBitIdenticalWithFewerCalls) {
  const Config& c = GetParam();
  RunRecipe one_each;
  one_each.bucket_bytes = 0;
  const RunResult per_unit = RunJob(c, "lpt", 3, {}, 0, true, "", one_each);
  int64_t padded = 0;
  for (const plan::Bucket& b : plan::PlanBuckets(per_unit.plan, 0)) padded += b.elements;
  RunRecipe halves;
  halves.bucket_bytes = 4 * padded / 2;
  const RunResult half = RunJob(c, "lpt", 3, {}, 0, true, "", halves);
  const RunResult whole = RunJob(c, "lpt", 3);
  RunRecipe on_the_step;
  on_the_step.overlap_reduce = false;
  on_the_step.prefetch_gathers = false;
  const RunResult serial = RunJob(c, "lpt", 3, {}, 0, true, "", on_the_step);
  for (const auto& [other, what] :
       {std::pair{&half, "half the model a bucket"}, std::pair{&whole, "one bucket"},
        std::pair{&serial, "reduced and gathered on the step's thread"}}) {
    ExpectSameWeights(*other, per_unit, what);
    EXPECT_EQ(other->bytes, per_unit.bytes) << what;
  }
  EXPECT_EQ(serial.collective_calls, whole.collective_calls);
  RunRecipe one_each_serial = one_each;
  one_each_serial.prefetch_gathers = false;
  EXPECT_EQ(RunJob(c, "lpt", 3, {}, 0, true, "", one_each_serial).collective_calls,
            per_unit.collective_calls);
  // Calls saved: per mesh, (units - buckets) times the calls one unit's
  // reduction and after-step gather make.
  auto saved = [&](int64_t bucket_bytes, bool with_gathers) {
    int64_t calls = 0;
    for (const plan::Bucket& b : plan::PlanBuckets(per_unit.plan, bucket_bytes)) {
      const plan::MeshGeometry g = b.mesh == plan::MeshKind::kDense
                                       ? plan::MeshGeometry::Dense(per_unit.plan.config)
                                       : plan::MeshGeometry::Expert(per_unit.plan.config);
      int64_t per_unit_calls = static_cast<int64_t>(g.shard_order().size());
      for (const plan::MeshAxis& a : g.axes()) {
        per_unit_calls += a.size > 1 && a.placements.optimizer != plan::Placement::kShard;
      }
      per_unit_calls += g.domain_size() / g.param_shards() > 1;
      if (with_gathers) per_unit_calls += g.param_shards() > 1;
      calls += (static_cast<int64_t>(b.units.size()) - 1) * per_unit_calls;
    }
    return calls;
  };
  const bool in_order = !c.moe && !c.mlp && !c.gpt;
  for (int32_t r = 0; r < c.world; ++r) {
    for (const auto& [run, bytes] : {std::pair{&half, halves.bucket_bytes},
                                     std::pair{&whole, plan::kDefaultBucketBytes}}) {
      const int64_t fewer = per_unit.collective_calls[r] - run->collective_calls[r];
      if (in_order) {
        EXPECT_EQ(fewer, saved(bytes, true)) << "rank " << r << ", buckets of " << bytes;
      } else {
        EXPECT_GE(fewer, saved(bytes, false)) << "rank " << r << ", buckets of " << bytes;
      }
    }
  }
  EXPECT_GT(saved(plan::kDefaultBucketBytes, false), 0);
}

// The Muon phase in waves: one wave for the whole model, one per unit
// (a budget of one byte), or the default budget, with or without the next
// wave's gather overlapping this one's Newton-Schulz, end with the same
// weights bit for bit; a wave makes one round with one gather and one scatter
// exchange per mesh; the rounds hold all the Newton-Schulz work, each matrix
// orthogonalized once per copy of the optimizer state, and the busiest
// rank's work in one wave is the plan's busiest rank.
TEST_P(TrainerConfigTest, MuonWavesOfAnyBudgetEndBitIdentical) {
  const Config& c = GetParam();
  const RunResult one = RunJob(c, "lpt", 3);
  const RunResult per_unit = RunJob(c, "lpt", 3, {}, /*muon_buffer_bytes=*/1);
  const RunResult by_default =
      RunJob(c, "lpt", 3, {}, BackwardPeakMuonBufferBytes(one.plan));
  // One unit per wave, each wave's gather beside the previous one's
  // Newton-Schulz, against the same waves run one after the other.
  const RunResult serial = RunJob(c, "lpt", 3, {}, /*muon_buffer_bytes=*/1, /*muon_overlap=*/false);
  for (const auto& [other, what] : {std::pair{&per_unit, "a wave per unit"},
                                     std::pair{&by_default, "the backward peak's budget"},
                                     std::pair{&serial, "waves one after the other"}}) {
    ExpectSameWeights(*other, one, what);
  }
  // From the model spec: units with Muon matrices, the meshes they are on,
  // and the Newton-Schulz work of one copy of every matrix.
  const std::unique_ptr<Workload> model = MakeWorkload(c.moe, c.mlp);
  const plan::ModelSpec& spec = model->spec();
  int muon_units = 0;
  bool dense_muon = false, expert_muon = false;
  double dense_flops = 0, expert_flops = 0;
  for (const plan::UnitSpec& u : spec.units) {
    bool any = false;
    for (const plan::ParamSpec& p : u.params) {
      if (p.optimizer != "muon") continue;
      any = true;
      if (p.expert) {
        expert_muon = true;
        expert_flops +=
            static_cast<double>(p.shape[0]) * plan::NsFlops(plan::NsAlgorithm::kAuto, p.shape[1],
                                                            p.shape[2], 5, plan::NsTable::kQuintic);
      } else {
        dense_muon = true;
        int64_t cols = 1;
        for (size_t d = 1; d < p.shape.size(); ++d) cols *= p.shape[d];
        dense_flops +=
            plan::NsFlops(plan::NsAlgorithm::kAuto, p.shape[0], cols, 5, plan::NsTable::kQuintic);
      }
    }
    muon_units += any ? 1 : 0;
  }
  // Copies of the optimizer state (docs/architecture.md §3): a sharded inner strategy
  // splits one copy over the W/I ranks of an instance, and over all W when
  // the outer strategy shards too; no_shard keeps one per rank. Experts
  // follow the inner strategy over their W/EP expert-data-parallel ranks.
  const bool sharded = std::string(c.inner) != "no_shard";
  const int64_t dense_domain =
      sharded ? c.world / c.instances * (std::string(c.outer) == "optim" ? c.instances : 1) : 1;
  const int64_t expert_domain = sharded ? c.world / c.ep : 1;
  const double total = static_cast<double>(c.world / dense_domain) * dense_flops +
                       static_cast<double>(c.world / c.ep / expert_domain) * expert_flops;
  const int meshes = (dense_muon ? 1 : 0) + (expert_muon ? 1 : 0);
  double busiest = 0, sum = 0, planned_busiest = 0;
  for (int32_t r = 0; r < c.world; ++r) {
    ASSERT_EQ(one.rounds[r].size(), 1u) << "rank " << r;
    EXPECT_EQ(one.exchange_calls[r], 2 * meshes) << "rank " << r;
    EXPECT_EQ(per_unit.rounds[r].size(), static_cast<size_t>(muon_units)) << "rank " << r;
    EXPECT_EQ(per_unit.exchange_calls[r], 2 * muon_units) << "rank " << r;
    EXPECT_EQ(serial.exchange_calls[r], 2 * muon_units) << "rank " << r;
    double in_rounds = 0;
    for (const MuonRound& round : per_unit.rounds[r]) {
      in_rounds += round.ns_flops;
      // The executed work of each round is what the plan gave this rank.
      EXPECT_DOUBLE_EQ(round.ns_flops, round.planned_ns_flops) << "rank " << r;
    }
    EXPECT_DOUBLE_EQ(in_rounds, per_unit.ns_flops[r]);
    EXPECT_DOUBLE_EQ(one.rounds[r][0].ns_flops, one.ns_flops[r]);
    busiest = std::max(busiest, one.rounds[r][0].ns_flops);
    sum += one.ns_flops[r];
    planned_busiest = std::max(planned_busiest, one.plan.ranks[r].ns_flops);
  }
  EXPECT_NEAR(sum, total, 1e-9 * total);
  EXPECT_NEAR(busiest, planned_busiest, 1e-9 * planned_busiest);
  // Per round, the busiest rank's executed work is the planned critical
  // path's share of that round.
  for (size_t k = 0; k < per_unit.rounds[0].size(); ++k) {
    double executed = 0;
    for (int32_t r = 0; r < c.world; ++r) {
      executed = std::max(executed, per_unit.rounds[r][k].ns_flops);
    }
    EXPECT_DOUBLE_EQ(executed, per_unit.rounds[0][k].planned_critical_ns_flops) << "round " << k;
  }
}

// Muon inside the backward pass (TrainerOptions::muon_in_backward): with a
// wave per unit, the last wave's gather runs beside the rest of the
// backward pass, queued behind its units' reductions (one bucket a unit, or
// the default buckets, where a bucket holds units of several waves; or in
// the last micro-batch's pass). Under
// a clip that binds on some steps and not on others (a clipped step
// gathers again after the pass), the losses, norms and weights end bit for
// bit as with it off; the steps that began the Muon phase inside the
// backward pass are exactly those that did not clip and followed a step
// that did not.
TEST_P(TrainerConfigTest, MuonInsideTheBackwardEndsBitIdentical) {
  const Config& c = GetParam();
  constexpr int kSteps = 5;
  // (bucket_bytes, micro_batch_size): a bucket a unit, the default buckets,
  // and micro-batches of one sample (the gather starts in the last one's
  // backward pass, and turns the wave's sums into their mean first).
  for (const auto& [bucket_bytes, micro] :
       {std::pair{int64_t{0}, int64_t{0}}, std::pair{plan::kDefaultBucketBytes, int64_t{0}},
        std::pair{int64_t{0}, int64_t{1}}}) {
    SCOPED_TRACE(absl::StrCat("bucket_bytes ", bucket_bytes, ", micro_batch_size ", micro));
    RunRecipe off;
    off.muon_in_backward = false;
    off.bucket_bytes = bucket_bytes;
    off.micro_batch_size = micro;
    const RunResult unclipped = RunJob(c, "lpt", kSteps, {}, /*muon_buffer_bytes=*/1, true, "", off);
    ASSERT_EQ(unclipped.grad_norms.size(), static_cast<size_t>(kSteps));
    const auto [lo, hi] =
        std::minmax_element(unclipped.grad_norms.begin(), unclipped.grad_norms.end());
    off.clip_grad_norm = 0.5 * (*lo + *hi);
    RunRecipe on = off;
    on.muon_in_backward = true;
    const RunResult after = RunJob(c, "lpt", kSteps, {}, 1, true, "", off);
    const RunResult inside = RunJob(c, "lpt", kSteps, {}, 1, true, "", on);
    ExpectSameRun(inside, after, "Muon inside the backward pass");
    ASSERT_EQ(inside.muon_in_backward.size(), static_cast<size_t>(kSteps));
    // A step after a clipped one does not start early (it would likely be
    // redone); the others do, and keep it unless they clip.
    int early = 0, redone = 0;
    for (int s = 0; s < kSteps; ++s) {
      const auto clipped = [&](int t) {
        return t >= 0 && off.clip_grad_norm / (inside.grad_norms[t] + 1e-6) < 1.0;
      };
      const bool started = !clipped(s - 1);
      EXPECT_EQ(inside.muon_in_backward[s], started && !clipped(s)) << "step " << s;
      EXPECT_FALSE(after.muon_in_backward[s]) << "step " << s;
      early += started && !clipped(s) ? 1 : 0;
      redone += started && clipped(s) ? 1 : 0;
    }
    EXPECT_GT(early, 0) << "no step began the Muon phase inside the backward pass";
    EXPECT_GT(redone, 0) << "no step clipped: the redo went untested";
  }
}

TEST_P(TrainerConfigTest, MuonTrafficIsWhatThePlanSays) {
  const int steps = 2;
  RunResult r = RunJob(GetParam(), "lpt", steps);
  for (plan::MeshKind mesh : {plan::MeshKind::kDense, plan::MeshKind::kExpert}) {
    const std::string prefix = mesh == plan::MeshKind::kExpert ? "expert/" : "";
    int64_t planned = 0;
    for (const plan::CollectiveBytes& c : r.plan.collectives) {
      if (c.name == "muon_gather" && c.mesh == mesh) planned += c.bytes_per_step;
    }
    EXPECT_EQ(r.bytes[prefix + "muon_gather"], planned * steps) << prefix;
    EXPECT_EQ(r.bytes[prefix + "muon_scatter"], planned * steps) << prefix;
  }
  if (GetParam().moe) {
    // The expert mesh moves bytes exactly when experts have data-parallel
    // replicas (world / EP > 1); tokens move exactly when EP > 1.
    int64_t expert_mesh = 0;
    for (const auto& [name, b] : r.bytes) {
      if (name.rfind("expert/", 0) == 0) expert_mesh += b;
    }
    EXPECT_EQ(expert_mesh > 0, GetParam().world / GetParam().ep > 1);
    EXPECT_EQ(r.bytes["expert_dispatch"] > 0, GetParam().ep > 1);
  }
}

// The plan's bytes per collective over `steps` steps, by the names the
// communicators count them under.
std::map<std::string, int64_t> PlannedBytes(const plan::Plan& plan, int steps) {
  std::map<std::string, int64_t> planned;
  for (const plan::CollectiveBytes& c : plan.collectives) {
    planned[(c.mesh == plan::MeshKind::kExpert ? "expert/" : "") + c.name] +=
        c.bytes_per_step * steps;
  }
  return planned;
}

// A run's counted bytes per collective, less token dispatch (not planned)
// and the collectives that moved nothing.
std::map<std::string, int64_t> PlannedKindsOfBytes(std::map<std::string, int64_t> bytes) {
  bytes.erase("expert_dispatch");
  for (auto it = bytes.begin(); it != bytes.end();) {
    it = it->second == 0 ? bytes.erase(it) : std::next(it);
  }
  return bytes;
}

// Every collective moves what the plan says it moves, counted by the
// communicators, including the backward re-gathers of the units the
// workload gathers twice (the moe unit); token dispatch is not planned.
TEST_P(TrainerConfigTest, EveryCollectiveMovesThePlannedBytes) {
  const int steps = 2;
  RunResult r = RunJob(GetParam(), "lpt", steps);
  const std::map<std::string, int64_t> planned = PlannedBytes(r.plan, steps);
  EXPECT_EQ(PlannedKindsOfBytes(r.bytes), planned);
  if (GetParam().moe && GetParam().inner == std::string("optim_grads_params") &&
      GetParam().world / GetParam().ep > 1) {
    const auto regathers = planned.find("expert/param_allgather_backward");
    EXPECT_TRUE(regathers != planned.end() && regathers->second > 0);
  }
}

// The step records' all-gather beside the after-step gather
// (TrainerOptions::overlap_records) against after it: the same losses,
// norms and weights bit for bit, the same attention logits (gpt) and Muon
// health (a health step every step: orthogonality errors too), the same
// bytes and calls. Dense configs also run gpt.
TEST_P(TrainerConfigTest, RecordsBesideTheAfterStepGatherEndTheSame) {
  std::vector<Config> workloads = {GetParam()};
  if (!GetParam().moe) {
    workloads.push_back(GetParam());
    workloads.back().gpt = true;
  }
  for (const Config& c : workloads) {
    SCOPED_TRACE(c.gpt ? "gpt" : "default workload");
    RunRecipe serial;
    serial.health_every = 1;
    serial.overlap_records = false;
    RunRecipe beside = serial;
    beside.overlap_records = true;
    const RunResult after = RunJob(c, "lpt", 3, {}, 0, true, "", serial);
    const RunResult overlapped = RunJob(c, "lpt", 3, {}, 0, true, "", beside);
    ExpectSameRun(overlapped, after, "records beside the after-step gather");
    EXPECT_EQ(overlapped.max_attn_logits, after.max_attn_logits);
    EXPECT_EQ(c.gpt, !after.max_attn_logits.empty() && !after.max_attn_logits[0].empty());
    ASSERT_EQ(overlapped.health.size(), after.health.size());
    for (size_t st = 0; st < after.health.size(); ++st) {
      EXPECT_GT(after.health[st].matrices, 0) << "step " << st;
      EXPECT_EQ(overlapped.health[st].matrices, after.health[st].matrices) << "step " << st;
      EXPECT_EQ(overlapped.health[st].elements, after.health[st].elements) << "step " << st;
      EXPECT_EQ(overlapped.health[st].update_rms, after.health[st].update_rms) << "step " << st;
      EXPECT_TRUE(after.health[st].ortho_error_max.has_value()) << "step " << st;
      EXPECT_EQ(overlapped.health[st].ortho_error_max, after.health[st].ortho_error_max)
          << "step " << st;
    }
    EXPECT_EQ(overlapped.bytes, after.bytes);
    EXPECT_EQ(overlapped.collective_calls, after.collective_calls);
  }
}

// The after-step gathers beside the next step
// (TrainerOptions::overlap_param_gather; the next forward pass waits for
// each unit's bucket, the checkpoint and the final gather for all) against
// the step waiting for them, one unit a bucket and the default buckets: the
// same losses, norms and weights bit for bit, the same bytes (each step
// counts its own gathers: summed over the steps, a gather counted a step
// late would leave the last one out) and calls a step, the same shard
// files. Dense configs also run gpt.
TEST_P(TrainerConfigTest, AfterStepGatherBesideTheNextStepEndsTheSame) {
  std::vector<Config> workloads = {GetParam()};
  if (!GetParam().moe) {
    workloads.push_back(GetParam());
    workloads.back().gpt = true;
  }
  for (const Config& c : workloads) {
    for (const int64_t bucket_bytes : {int64_t{0}, plan::kDefaultBucketBytes}) {
      SCOPED_TRACE(absl::StrCat(c.gpt ? "gpt" : "default workload", ", bucket_bytes ",
                                bucket_bytes));
      RunRecipe waited;
      waited.bucket_bytes = bucket_bytes;
      waited.overlap_param_gather = false;
      RunRecipe beside = waited;
      beside.overlap_param_gather = true;
      const std::string dir = ::testing::TempDir() + "/after_step_" + c.name;
      Checkpoints waited_ck, beside_ck;
      waited_ck.save_dir = dir + "_waited";
      beside_ck.save_dir = dir + "_beside";
      for (const std::string& d : {waited_ck.save_dir, beside_ck.save_dir}) {
        std::filesystem::remove_all(d);
        std::filesystem::create_directories(d);
      }
      const RunResult after = RunJob(c, "lpt", 3, waited_ck, 0, true, "", waited);
      const RunResult overlapped = RunJob(c, "lpt", 3, beside_ck, 0, true, "", beside);
      ExpectSameRun(overlapped, after, "after-step gather beside the next step");
      EXPECT_EQ(overlapped.bytes, after.bytes);
      EXPECT_EQ(overlapped.collective_calls, after.collective_calls);
      EXPECT_EQ(PlannedKindsOfBytes(overlapped.bytes), PlannedBytes(overlapped.plan, 3));
      for (int32_t r = 0; r < c.world; ++r) {
        const std::string file = "/rank-" + std::to_string(r) + ".safetensors";
        const std::string saved = ReadFileBytes(beside_ck.save_dir + file);
        EXPECT_FALSE(saved.empty()) << "rank " << r;
        EXPECT_EQ(saved, ReadFileBytes(waited_ck.save_dir + file)) << "rank " << r;
      }
      for (const std::string& d : {waited_ck.save_dir, beside_ck.save_dir}) {
        std::filesystem::remove_all(d);
      }
    }
  }
}

// Units held gathered from their first use in a pass to their last
// (PlanOptions::reshard_after_forward false), one unit a collective or the
// default buckets: the losses, norms and weights end bit for bit as when
// every use gathers again; every collective moves what the held plan says,
// which has no backward re-gathers and otherwise the bytes of the plan
// that re-gathers; and where that plan re-gathers (workloads that acquire a
// unit twice, on meshes that shard parameters: moe_mlp's expert unit, every
// mlp layer but the last, every gpt unit but the head), every rank makes
// fewer calls a step. Dense configs run TwoLayerLinear, mlp and gpt.
TEST_P(TrainerConfigTest, UnitsHeldForTheBackwardEndBitIdenticalWithoutRegathers) {
  std::vector<Config> workloads = {GetParam()};
  if (!GetParam().moe) {
    workloads.push_back(GetParam());
    workloads.back().mlp = true;
    workloads.push_back(GetParam());
    workloads.back().gpt = true;
  }
  constexpr int kSteps = 3;
  std::vector<std::pair<Config, int64_t>> cases;
  for (const Config& c : workloads) {
    for (const int64_t bucket_bytes : {int64_t{0}, plan::kDefaultBucketBytes}) {
      cases.emplace_back(c, bucket_bytes);
    }
  }
  for (const auto& [c, bucket_bytes] : cases) {
    SCOPED_TRACE(absl::StrCat(c.mlp ? "mlp" : (c.gpt ? "gpt" : "default workload"),
                              ", bucket_bytes ", bucket_bytes));
    RunRecipe again;
    again.bucket_bytes = bucket_bytes;
    RunRecipe held = again;
    held.reshard_after_forward = false;
    const RunResult regathered = RunJob(c, "lpt", kSteps, {}, 0, true, "", again);
    const RunResult kept = RunJob(c, "lpt", kSteps, {}, 0, true, "", held);
    ExpectSameRun(kept, regathered, "units held for the backward pass");
    const std::map<std::string, int64_t> planned = PlannedBytes(kept.plan, kSteps);
    EXPECT_EQ(PlannedKindsOfBytes(kept.bytes), planned);
    std::map<std::string, int64_t> spared = PlannedBytes(regathered.plan, kSteps);
    int64_t regathers = 0;
    for (const char* name : {"param_allgather_backward", "expert/param_allgather_backward"}) {
      EXPECT_EQ(planned.count(name), 0u) << name;
      regathers += spared.count(name) > 0 ? spared[name] : 0;
      spared.erase(name);
    }
    EXPECT_EQ(planned, spared);
    for (int32_t r = 0; r < c.world; ++r) {
      if (regathers > 0) {
        EXPECT_LT(kept.collective_calls[r], regathered.collective_calls[r]) << "rank " << r;
      } else {
        EXPECT_EQ(kept.collective_calls[r], regathered.collective_calls[r]) << "rank " << r;
      }
    }
  }
}

// The same against real traffic: the bytes the transport copied from rank to
// rank (counted where it copies, not by the communicators' byte model). The
// Muon exchanges (all-to-alls outside the token-dispatch group) carry
// exactly the plan's gather and scatter bytes; gradient reduce-scatters
// exactly the plan's (nothing else reduce-scatters; the final
// GatherParameters and the loss all-reduce are not planned, so all-gathers
// and all-reduces are not compared).
TEST_P(TrainerConfigTest, TheWireCarriesThePlannedMuonAndReduceScatterBytes) {
  const int steps = 2;
  const RunResult r = RunJob(GetParam(), "lpt", steps);
  int64_t planned_muon = 0, planned_reduce_scatter = 0;
  for (const plan::CollectiveBytes& c : r.plan.collectives) {
    if (c.name == "muon_gather" || c.name == "muon_scatter" || c.name == "muon_replica_exchange") {
      planned_muon += c.bytes_per_step * steps;
    }
    if (c.name == "grad_reduce_scatter") planned_reduce_scatter += c.bytes_per_step * steps;
  }
  int64_t wire_muon = 0, wire_reduce_scatter = 0;
  for (const auto& [group, bytes] : r.wire) {
    if (group.find("/dispatch/") == std::string::npos) {
      wire_muon += bytes[static_cast<int>(comm::Collective::kAllToAllV)];
    }
    wire_reduce_scatter += bytes[static_cast<int>(comm::Collective::kReduceScatter)];
  }
  // Sharded optimizer state means owners, and owners mean exchanges.
  if (std::string(GetParam().inner) != "no_shard") {
    EXPECT_GT(wire_muon, 0);
  }
  EXPECT_EQ(wire_muon, planned_muon);
  EXPECT_EQ(wire_reduce_scatter, planned_reduce_scatter);
}

TEST_P(TrainerConfigTest, ResumingFromSavedShardsContinuesBitForBit) {
  const std::string dir = ::testing::TempDir() + "/trainer_ckpt_" + GetParam().name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const RunResult straight = RunJob(GetParam(), "lpt", 5);
  const RunResult first = RunJob(GetParam(), "lpt", 3, {"", dir});
  const RunResult rest = RunJob(GetParam(), "lpt", 2, {dir, ""});
  ASSERT_EQ(rest.losses.size(), 2u);
  ASSERT_EQ(straight.losses.size(), 5u);
  // Bit for bit: the batch, the AdamW bias correction and the synthetic
  // data follow the restored step count.
  EXPECT_EQ(rest.losses[0], straight.losses[3]);
  EXPECT_EQ(rest.losses[1], straight.losses[4]);
  ExpectSameWeights(rest, straight, "resumed");
}

// Resharding: 10 steps under one layout and a checkpoint, then 10 more
// under another from the checkpoint put back together, against 20 steps
// under the first layout undisturbed. The batch, the data and the math are
// the same; only the reduction order differs between layouts (the same
// layout, or only other owners: bit-identical).
struct ReshardCase {
  const char* name;
  Config from;
  Config to;
  const char* from_rule = "lpt";
  const char* to_rule = "lpt";
  bool bit_identical = false;
};
void PrintTo(const ReshardCase& c, std::ostream* os) { *os << c.name; }

class ReshardTest : public ::testing::TestWithParam<ReshardCase> {};

// Relative differences of a model's tensors, worst over tensors: the
// largest |a - b| over the largest |b|, and ||a - b|| over ||b||.
struct Relative {
  double largest = 0;
  double norm = 0;
};
Relative Compare(const std::vector<std::vector<float>>& a,
                 const std::vector<std::vector<float>>& b) {
  Relative worst;
  for (size_t p = 0; p < b.size(); ++p) {
    double diff = 0, scale = 0, diff2 = 0, scale2 = 0;
    for (size_t i = 0; i < b[p].size(); ++i) {
      const double d = static_cast<double>(a[p][i]) - b[p][i];
      diff = std::max(diff, std::abs(d));
      scale = std::max(scale, std::abs(static_cast<double>(b[p][i])));
      diff2 += d * d;
      scale2 += static_cast<double>(b[p][i]) * b[p][i];
    }
    worst.largest = std::max(worst.largest, scale > 0 ? diff / scale : diff);
    worst.norm = std::max(worst.norm, scale2 > 0 ? std::sqrt(diff2 / scale2) : std::sqrt(diff2));
  }
  return worst;
}

TEST_P(ReshardTest, TenStepsThenTenUnderAnotherLayoutEndWhereTwentyDo) {
  const ReshardCase& c = GetParam();
  const std::string dir = ::testing::TempDir() + "/reshard_" + c.name;
  std::filesystem::remove_all(dir);
  const RunResult straight = RunJob(c.from, c.from_rule, 20);
  const RunResult first = RunJob(c.from, c.from_rule, 10, {"", dir, true});
  ASSERT_EQ(first.losses.size(), 10u);
  const RunResult rest = RunJob(c.to, c.to_rule, 10, {dir + "/checkpoints", "", true});
  ASSERT_EQ(rest.losses.size(), 10u);
  ASSERT_EQ(straight.weights.size(), rest.weights.size());
  // The restored step count picks the same batches: the first loss after
  // the load is step 10's.
  EXPECT_NEAR(rest.losses[0], straight.losses[10], 1e-5 * std::abs(straight.losses[10]));
  // What the change of layout alone costs: 20 steps under each differ by
  // their reduction order. A resharding must add nothing to it (a wrong
  // run, a lost optimizer state or step count shows as 1e-3 and more).
  const RunResult other = RunJob(c.to, c.to_rule, 20);
  const Relative resharded = Compare(rest.weights, straight.weights);
  const Relative layouts = Compare(other.weights, straight.weights);
  std::cout << c.name << ": final weights within " << resharded.largest << " (largest element) and "
            << resharded.norm << " (norm) relative of 20 steps; 20 steps under each layout differ "
            << "by " << layouts.largest << " and " << layouts.norm << "\n";
  EXPECT_LE(resharded.norm, 1e-5);
  EXPECT_LE(resharded.largest, std::max(1e-5, layouts.largest));
  if (c.bit_identical) {
    EXPECT_EQ(rest.losses[9], straight.losses[19]);
    for (size_t p = 0; p < straight.weights.size(); ++p) {
      EXPECT_EQ(rest.weights[p], straight.weights[p]) << "param " << p;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ReshardTest,
    ::testing::Values(ReshardCase{"same_zero3_w4",
                                  {"zero3", 4, "optim_grads_params", 1, ""},
                                  {"zero3", 4, "optim_grads_params", 1, ""},
                                  "lpt",
                                  "lpt",
                                  true},
                      ReshardCase{"other_owners_zero3_w4",
                                  {"zero3", 4, "optim_grads_params", 1, ""},
                                  {"zero3", 4, "optim_grads_params", 1, ""},
                                  "lpt",
                                  "round_robin",
                                  true},
                      ReshardCase{"zero3_w4_to_hfsdp_w2",
                                  {"zero3", 4, "optim_grads_params", 1, ""},
                                  {"hfsdp_w2", 2, "optim_grads_params", 2, "optim"}},
                      ReshardCase{"zero3_w4_to_ddp_w3",
                                  {"zero3", 4, "optim_grads_params", 1, ""},
                                  {"ddp_w3", 3, "no_shard", 1, ""}},
                      ReshardCase{"zero3_w4_to_zero1_w8",
                                  {"zero3", 4, "optim_grads_params", 1, ""},
                                  {"zero1_w8", 8, "optim", 1, ""}},
                      ReshardCase{"ddp_w3_to_hsdp_w4",
                                  {"ddp_w3", 3, "no_shard", 1, ""},
                                  {"hsdp", 4, "optim_grads_params", 2, "no_shard"}},
                      ReshardCase{"hfsdp_w4_to_zero3_w3",
                                  {"hfsdp", 4, "optim_grads_params", 2, "optim"},
                                  {"zero3_w3", 3, "optim_grads_params", 1, ""}},
                      ReshardCase{"zero2_w4_to_zero3_w1",
                                  {"zero2", 4, "optim_grads", 1, ""},
                                  {"zero3_w1", 1, "optim_grads_params", 1, ""}},
                      ReshardCase{"moe_ep2_to_ep1",
                                  {"moe_ep2_zero3", 4, "optim_grads_params", 1, "", 2, true},
                                  {"moe_ep1_zero3", 4, "optim_grads_params", 1, "", 1, true}},
                      ReshardCase{"moe_ep2_w4_to_ep1_w2",
                                  {"moe_ep2_zero3", 4, "optim_grads_params", 1, "", 2, true},
                                  {"moe_ep1_w2", 2, "optim_grads_params", 1, "", 1, true}},
                      ReshardCase{
                          "moe_ep1_to_ep4_hsdp",
                          {"moe_ep1_ddp", 4, "no_shard", 1, "", 1, true},
                          {"moe_ep2_hsdp", 4, "optim_grads_params", 2, "no_shard", 2, true}}),
    [](const auto& info) { return std::string(info.param.name); });

// One rank on its own: a Trainer for `strategy` with a fresh store.
std::unique_ptr<Trainer> SoloTrainer(TwoLayerLinear* model, const char* strategy,
                                     const std::string& dir) {
  plan::PlanInput in;
  in.model = model->spec();
  in.world_size = 1;
  in.parallelism.data_parallel_sharding_strategy = strategy;
  in.options.device = "cpu";
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(in);
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::filesystem::remove_all(dir);
  absl::StatusOr<std::unique_ptr<comm::FileStore>> store = comm::FileStore::Open(dir);
  EXPECT_TRUE(store.ok());
  // One CPU device for these single-threaded tests; it outlives the trainers.
  static const std::unique_ptr<Device> cpu = MakeCpuDevice();
  TrainerOptions o;
  o.device = cpu.get();
  o.backend = comm::Backend::kInProcess;
  o.store = store->get();  // needed by Create only
  o.group_options.hub = std::make_shared<comm::InProcessHub>();
  o.global_batch_size = 4;
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(*plan, model, 0, o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

TEST(TrainerCheckpointTest, RefusesShardsOfAnotherLayoutOrFormatAndChangesNothing) {
  const std::string dir = ::testing::TempDir() + "/trainer_ckpt_refuse";
  std::filesystem::create_directories(dir);
  TwoLayerLinear model;
  std::unique_ptr<Trainer> zero3 = SoloTrainer(&model, "optim_grads_params", dir + "/s1");
  std::unique_ptr<Trainer> ddp = SoloTrainer(&model, "no_shard", dir + "/s2");
  ASSERT_TRUE(zero3 && ddp);
  ASSERT_TRUE(zero3->Step().ok());
  const std::string file = dir + "/zero3.safetensors";
  ASSERT_TRUE(zero3->SaveShards(file).ok());
  EXPECT_NE(zero3->LayoutFingerprint(), ddp->LayoutFingerprint());

  absl::Status st = ddp->LoadShards(file);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("layout"), std::string::npos) << st;
  EXPECT_EQ(ddp->steps_done(), 0);

  const std::vector<float> x = {1, 2};
  ASSERT_TRUE(io::WriteSafetensors(dir + "/plain.safetensors", {{"x", {2}, x.data()}}).ok());
  st = zero3->LoadShards(dir + "/plain.safetensors");
  EXPECT_NE(st.message().find("not a muonmesh shard file"), std::string::npos) << st;
  EXPECT_EQ(zero3->LoadShards(dir + "/missing.safetensors").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(zero3->steps_done(), 1);

  // Its own file loads, and puts the step count back.
  ASSERT_TRUE(zero3->Step().ok());
  ASSERT_TRUE(zero3->LoadShards(file).ok());
  EXPECT_EQ(zero3->steps_done(), 1);
}

// A one-rank job's checkpoint of `model` after one step, as SaveCheckpoint
// writes it under `dir`; returns its step folder.
std::string OneStepCheckpoint(Trainer& t, const std::string& dir) {
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(t.Step().ok());
  EXPECT_TRUE(SaveCheckpoint(t, dir, 1, 0).ok());
  return CheckpointDir(dir, 1);
}

TEST(ReshardInputTest, ConsolidatedFilesRoundTripAndLoadBitForBit) {
  const std::string dir = ::testing::TempDir() + "/reshard_file";
  TwoLayerLinear model;
  std::unique_ptr<Trainer> zero3 = SoloTrainer(&model, "optim_grads_params", dir + "/s1");
  ASSERT_TRUE(zero3);
  const std::string step_dir = OneStepCheckpoint(*zero3, dir + "/out");
  absl::StatusOr<WholeState> whole = ConsolidateCheckpoint(step_dir);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->step, 1);
  ASSERT_TRUE(WriteConsolidated(*whole, dir + "/state.safetensors").ok());
  absl::StatusOr<WholeState> back = ReadConsolidated(dir + "/state.safetensors");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->tensors.size(), whole->tensors.size());
  for (size_t i = 0; i < whole->tensors.size(); ++i) {
    const WholeTensor& a = whole->tensors[i];
    const WholeTensor& b = back->tensors[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.optimizer, b.optimizer);
    EXPECT_EQ(a.param, b.param);
    EXPECT_EQ(a.state1, b.state1);
    EXPECT_EQ(a.state2, b.state2);
    // Muon's one buffer, AdamW's two: state that a step made non-zero.
    EXPECT_NE(a.optimizer, TensorOptimizer::kNone) << a.name;
    EXPECT_EQ(a.state2.empty(), a.optimizer == TensorOptimizer::kMuon) << a.name;
  }
  // A DDP trainer from the file steps as the ZeRO-3 one does (one rank: the
  // same reductions).
  std::unique_ptr<Trainer> ddp = SoloTrainer(&model, "no_shard", dir + "/s2");
  ASSERT_TRUE(ddp->LoadState(*back, false).ok());
  EXPECT_EQ(ddp->steps_done(), 1);
  absl::StatusOr<StepReport> a = zero3->Step();
  absl::StatusOr<StepReport> b = ddp->Step();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->loss, b->loss);
  EXPECT_EQ(*zero3->GatherParameters(), *ddp->GatherParameters());
}

TEST(ReshardInputTest, RefusesAnotherModelOrMissingStateAndChangesNothing) {
  const std::string dir = ::testing::TempDir() + "/reshard_refuse";
  TwoLayerLinear model;
  std::unique_ptr<Trainer> t = SoloTrainer(&model, "optim_grads_params", dir + "/s1");
  ASSERT_TRUE(t);
  const std::string step_dir = OneStepCheckpoint(*t, dir + "/out");
  absl::StatusOr<WholeState> whole = ConsolidateCheckpoint(step_dir);
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::unique_ptr<Trainer> fresh = SoloTrainer(&model, "no_shard", dir + "/s2");
  const std::vector<std::vector<float>> before = *fresh->GatherParameters();

  WholeState other = *whole;
  other.tensors[1].name = "decoder.w";
  absl::Status st = fresh->LoadState(other, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("another model"), std::string::npos) << st;
  other = *whole;
  other.tensors.pop_back();
  EXPECT_EQ(fresh->LoadState(other, false).code(), absl::StatusCode::kInvalidArgument);

  // Weights without optimizer state (an export): refused unless the job
  // asks for fresh state, and then loaded with zero state.
  const std::vector<float>& w0 = whole->tensors[0].param;
  std::vector<io::TensorView> views;
  for (const WholeTensor& x : whole->tensors) views.push_back({x.name, x.shape, x.param.data()});
  ASSERT_TRUE(io::WriteSafetensors(dir + "/weights.safetensors", views).ok());
  absl::StatusOr<WholeState> weights = ReadConsolidated(dir + "/weights.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  st = fresh->LoadState(*weights, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("no optimizer state"), std::string::npos) << st;
  EXPECT_NE(st.message().find("fresh_optimizer_state"), std::string::npos) << st;
  EXPECT_EQ(*fresh->GatherParameters(), before);
  EXPECT_EQ(fresh->steps_done(), 0);
  ASSERT_TRUE(fresh->LoadState(*weights, true).ok());
  EXPECT_EQ((*fresh->GatherParameters())[0], w0);

  // Fresh state at step 1: AdamW's bias correction counts from there, and
  // the shards say so (a resume keeps counting from it).
  ASSERT_TRUE(fresh->LoadState(*whole, true).ok());
  ASSERT_TRUE(fresh->SaveShards(dir + "/fresh.safetensors").ok());
  std::map<std::string, std::string> meta;
  ASSERT_TRUE(io::ReadSafetensors(dir + "/fresh.safetensors", &meta).ok());
  EXPECT_EQ(meta["adamw_origin"], "1");
  EXPECT_EQ(meta["step"], "1");

  // A damaged rank file: named, and the checkpoint left as it was.
  const std::string rank_file = step_dir + "/" + RankFile(0);
  const uintmax_t size = std::filesystem::file_size(rank_file);
  std::filesystem::resize_file(rank_file, size - 1);
  absl::StatusOr<WholeState> damaged = ConsolidateCheckpoint(step_dir);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(damaged.status().message().find(RankFile(0)), std::string::npos) << damaged.status();
  EXPECT_EQ(std::filesystem::file_size(rank_file), size - 1);
  EXPECT_TRUE(std::filesystem::exists(step_dir + "/COMPLETE"));
  // A folder with no checkpoint, and nothing at all.
  std::string from;
  std::vector<std::string> notes;
  EXPECT_EQ(LoadWholeState(dir + "/s2", &from, &notes).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadWholeState(dir + "/none", &from, &notes).status().code(),
            absl::StatusCode::kNotFound);
}

// A checkpoint whose shard metadata lies (runs out of range, a model
// larger than its files, a missing optimizer buffer), re-signed in its
// manifest so that only the metadata is wrong: an error naming the file,
// never a crash or a write out of bounds.
TEST(ReshardInputTest, LyingShardMetadataIsAnErrorNamingTheFile) {
  const std::string dir = ::testing::TempDir() + "/reshard_lies";
  TwoLayerLinear model;
  std::unique_ptr<Trainer> t = SoloTrainer(&model, "optim_grads_params", dir + "/s1");
  ASSERT_TRUE(t);
  const std::string step_dir = OneStepCheckpoint(*t, dir + "/out");
  const std::string file = step_dir + "/" + RankFile(0);
  std::map<std::string, std::string> meta;
  absl::StatusOr<std::vector<io::Tensor>> tensors = io::ReadSafetensors(file, &meta);
  ASSERT_TRUE(tensors.ok());
  const std::string manifest = [&] {
    std::ifstream in(step_dir + "/COMPLETE");
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }();
  // Writes the file with `edit` applied and its manifest line re-signed.
  auto rewrite = [&](const std::function<void(std::map<std::string, std::string>&,
                                              std::vector<io::Tensor>&)>& edit) {
    std::map<std::string, std::string> m = meta;
    std::vector<io::Tensor> ts = *tensors;
    edit(m, ts);
    std::vector<io::TensorView> views;
    for (const io::Tensor& x : ts) views.push_back({x.name, x.shape, x.data.data()});
    ASSERT_TRUE(io::WriteSafetensors(file, views, m).ok());
    absl::StatusOr<Digest> d = DigestOf(file);
    ASSERT_TRUE(d.ok());
    std::string text = manifest.substr(0, manifest.find("file "));
    absl::StrAppendFormat(&text, "file %s %d %08x\n", RankFile(0), d->size, d->crc32);
    std::ofstream(step_dir + "/COMPLETE") << text;
  };
  const std::string runs_key = "runs.units.0.dense.param";
  ASSERT_TRUE(meta.count(runs_key)) << "the first unit's runs";
  for (const std::string& runs :
       {std::string("0:9223372036854775800:0:10"), std::string("0:0:9223372036854775800:10"),
        std::string("7:0:0:1"), std::string("0:0:0:-1")}) {
    rewrite([&](auto& m, auto&) { m[runs_key] = runs; });
    absl::StatusOr<WholeState> w = ConsolidateCheckpoint(step_dir);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << runs;
    EXPECT_NE(w.status().message().find(RankFile(0)), std::string::npos) << w.status();
    EXPECT_NE(w.status().message().find("a bad run"), std::string::npos) << w.status();
  }
  rewrite([&](auto& m, auto&) {
    m["tensors"] = absl::StrCat("huge\t1000000000000\tmuon\n", meta["tensors"]);
  });
  absl::StatusOr<WholeState> w = ConsolidateCheckpoint(step_dir);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("more elements than the checkpoint's files hold"),
            std::string::npos)
      << w.status();
  // Without the AdamW second moments: their elements are in no file.
  rewrite([&](auto&, auto& ts) {
    ts.erase(std::remove_if(ts.begin(), ts.end(),
                            [](const io::Tensor& x) { return x.name.ends_with(".state2"); }),
             ts.end());
  });
  w = ConsolidateCheckpoint(step_dir);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(w.status().message().find("exp_avg_sq element"), std::string::npos) << w.status();
}

// A Device that says it holds GPU memory (and is the CPU underneath).
class PretendGpu final : public Device {
 public:
  comm::MemorySpace memory_space() const override { return comm::MemorySpace::kCudaDevice; }
  std::string name() const override { return "pretend-gpu"; }
  absl::StatusOr<DeviceBuffer> Allocate(int64_t n) override { return cpu_->Allocate(n); }
  absl::Status Copy(float* d, const float* s, int64_t n) override { return cpu_->Copy(d, s, n); }
  absl::Status Fill(float* d, int64_t n, float v) override { return cpu_->Fill(d, n, v); }
  absl::Status CopyFromHost(float* d, const float* s, int64_t n) override {
    return cpu_->CopyFromHost(d, s, n);
  }
  absl::Status CopyToHost(float* d, const float* s, int64_t n) override {
    return cpu_->CopyToHost(d, s, n);
  }
  absl::Status AdamWStep(const optim::AdamWOptions& o, int64_t t, const float* g, float* m,
                         float* v, float* p, int64_t n) override {
    return cpu_->AdamWStep(o, t, g, m, v, p, n);
  }
  absl::Status MuonPrepare(const optim::MuonOptions& o, const float* g, const float* m, float* u,
                           int64_t n) override {
    return cpu_->MuonPrepare(o, g, m, u, n);
  }
  absl::Status MuonApply(const optim::MuonOptions& o, int64_t r, int64_t c, const float* g,
                         const float* x, float* m, float* p, int64_t n) override {
    return cpu_->MuonApply(o, r, c, g, x, m, p, n);
  }
  absl::StatusOr<bool> AllFinite(const float* x, int64_t n) override {
    return cpu_->AllFinite(x, n);
  }
  absl::Status NewtonSchulz(float* x, int64_t r, int64_t c, const optim::NsOptions& o) override {
    return cpu_->NewtonSchulz(x, r, c, o);
  }

 private:
  std::unique_ptr<Device> cpu_ = MakeCpuDevice();
};

TEST(TrainerDeviceTest, WorkloadBackendAndDeviceMustShareTheirMemory) {
  TwoLayerLinear model;  // host memory
  plan::PlanInput in;
  in.model = model.spec();
  in.world_size = 1;
  in.options.device = "cpu";
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(in);
  ASSERT_TRUE(plan.ok());
  const std::string dir = ::testing::TempDir() + "/trainer_device";
  std::filesystem::remove_all(dir);
  absl::StatusOr<std::unique_ptr<comm::FileStore>> store = comm::FileStore::Open(dir);
  ASSERT_TRUE(store.ok());
  PretendGpu gpu;
  TrainerOptions o;
  o.backend = comm::Backend::kInProcess;
  o.store = store->get();
  o.group_options.hub = std::make_shared<comm::InProcessHub>();
  o.global_batch_size = 4;
  o.device = &gpu;
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(*plan, &model, 0, o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("computes in host memory, the device pretend-gpu holds "
                                      "cuda device memory"),
            std::string::npos)
      << t.status();
}

// TwoLayerLinear whose gradients turn NaN at one step (on the rank that
// builds it so).
class NanAtStep final : public Workload {
 public:
  explicit NanAtStep(int64_t bad_step) : bad_step_(bad_step) {}
  const plan::ModelSpec& spec() const override { return base_.spec(); }
  int64_t num_samples() const override { return base_.num_samples(); }
  absl::Status Initialize(uint64_t seed, absl::Span<float* const> p) const override {
    return base_.Initialize(seed, p);
  }
  absl::StatusOr<double> ForwardBackward(int64_t step, absl::Span<const float* const> p,
                                         absl::Span<const int64_t> samples,
                                         absl::Span<float* const> g) override {
    absl::StatusOr<double> loss = base_.ForwardBackward(step, p, samples, g);
    // Once: a retried step is clean.
    if (loss.ok() && step == bad_step_ && !fired_) {
      g[1][0] = std::nanf("");
      fired_ = true;
    }
    return loss;
  }

 private:
  TwoLayerLinear base_;
  int64_t bad_step_;
  bool fired_ = false;
};

// Two ranks, rank 1's gradient NaN at step 1: the step is refused on both
// ranks at once, and their weights and optimizer state (the saved shards,
// byte for byte) are what the step before left. `muon_buffer_bytes` 1 cuts
// a wave per layer, so that the last layer's Muon gather starts inside the
// backward pass (and is then dropped). Then the step is taken again, clean;
// the weights after it, as rank 0 gathers them.
std::vector<std::vector<float>> ExpectNonFiniteStepRefused(int64_t muon_buffer_bytes) {
  plan::PlanInput in;
  in.model = TwoLayerLinear().spec();
  in.world_size = 2;
  in.options.device = "cpu";
  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(in);
  EXPECT_TRUE(plan.ok());
  if (!plan.ok()) return {};
  const std::string dir =
      ::testing::TempDir() + "/trainer_nan_" + std::to_string(muon_buffer_bytes);
  std::filesystem::remove_all(dir);
  absl::StatusOr<std::unique_ptr<comm::FileStore>> store = comm::FileStore::Open(dir);
  EXPECT_TRUE(store.ok());
  if (!store.ok()) return {};
  std::vector<std::vector<float>> retried;
  auto hub = std::make_shared<comm::InProcessHub>();
  std::vector<absl::Status> refused(2);
  std::vector<bool> began_inside(2);
  std::vector<std::vector<std::vector<float>>> before(2), after(2);
  std::vector<std::string> shards_before(2), shards_after(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      NanAtStep model(r == 1 ? 1 : -1);  // only rank 1 sees the NaN
      const std::unique_ptr<Device> cpu = MakeCpuDevice();
      TrainerOptions o;
      o.device = cpu.get();
      o.backend = comm::Backend::kInProcess;
      o.store = store->get();
      o.group_options.hub = hub;
      o.collective.timeout = absl::Seconds(30);
      o.global_batch_size = 8;
      o.muon_buffer_bytes = muon_buffer_bytes;
      absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(*plan, &model, r, o);
      ASSERT_TRUE(t.ok()) << t.status();
      absl::StatusOr<StepReport> first = (*t)->Step();
      ASSERT_TRUE(first.ok()) << first.status();
      began_inside[r] = first->muon_in_backward;
      const std::string file = dir + "/rank-" + std::to_string(r);
      before[r] = *(*t)->GatherParameters();
      ASSERT_TRUE((*t)->SaveShards(file + "-before.safetensors").ok());
      refused[r] = (*t)->Step().status();
      after[r] = *(*t)->GatherParameters();
      ASSERT_TRUE((*t)->SaveShards(file + "-after.safetensors").ok());
      shards_before[r] = ReadFileBytes(file + "-before.safetensors");
      shards_after[r] = ReadFileBytes(file + "-after.safetensors");
      EXPECT_EQ((*t)->steps_done(), 1);
      absl::StatusOr<StepReport> again = (*t)->Step();
      ASSERT_TRUE(again.ok()) << again.status();
      absl::StatusOr<std::vector<std::vector<float>>> w = (*t)->GatherParameters();  // every rank
      ASSERT_TRUE(w.ok()) << w.status();
      if (r == 0) retried = *std::move(w);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    // At once and on both ranks, not after the collective timeout.
    EXPECT_EQ(refused[r].code(), absl::StatusCode::kFailedPrecondition) << "rank " << r;
    EXPECT_NE(refused[r].message().find("NaN or infinite (on 1 of 2 ranks)"), std::string::npos)
        << refused[r];
    // Marked, so that the daemon reports a refused step, not any failure.
    EXPECT_TRUE(refused[r].GetPayload(kRefusedStepPayload).has_value()) << "rank " << r;
    EXPECT_EQ(after[r], before[r]) << "rank " << r << " changed its weights";
    EXPECT_FALSE(shards_before[r].empty());
    EXPECT_TRUE(shards_after[r] == shards_before[r])
        << "rank " << r << " changed its shards (weights or optimizer state)";
    EXPECT_EQ(began_inside[r], muon_buffer_bytes > 0) << "rank " << r;
  }
  return retried;
}

TEST(TrainerTest, ANonFiniteGradientOnOneRankRefusesTheStepOnEveryRank) {
  EXPECT_FALSE(ExpectNonFiniteStepRefused(/*muon_buffer_bytes=*/0).empty());
}

// With the last layer's Muon gather started inside the refused step's
// backward pass: nothing of it stays (the shards), and the retried step ends
// where it does without waves, bit for bit.
TEST(TrainerTest, ARefusedStepDropsTheMuonGatherStartedInItsBackward) {
  const std::vector<std::vector<float>> one_wave = ExpectNonFiniteStepRefused(0);
  const std::vector<std::vector<float>> early = ExpectNonFiniteStepRefused(1);
  ASSERT_EQ(early.size(), one_wave.size());
  for (size_t p = 0; p < early.size(); ++p) {
    ASSERT_EQ(early[p].size(), one_wave[p].size());
    EXPECT_EQ(std::memcmp(early[p].data(), one_wave[p].data(), sizeof(float) * early[p].size()), 0)
        << "param " << p;
  }
}

// The HSDP replica split (optimizer.muon_replica_split, core/plan/types.h
// ReplicaSplit): the dp_outer replicas share the dense Newton-Schulz work
// and exchange the results. Forced on, in one wave or one wave per unit, the
// weights end bit for bit as with it off; it runs exactly where the
// optimizer state is replicated on dp_outer (HSDP), and there each dense
// matrix is orthogonalized once per set of I replica domains instead of
// once per domain, and each wave with dense matrices adds one exchange
// round on "dp_outer" (after its gather and scatter), which moves what the
// plan says and, independently, I - 1 copies of every dense Muon matrix per
// set of replicas.
class ReplicaSplitTest : public ::testing::TestWithParam<Config> {};

TEST_P(ReplicaSplitTest, SplitAndUnsplitEndBitIdentical) {
  const Config& c = GetParam();
  const int steps = 3;
  const RunResult off = RunJob(c, "lpt", steps, {}, 0, true, "off");
  const RunResult on = RunJob(c, "lpt", steps, {}, 0, true, "on");
  const RunResult on_per_unit = RunJob(c, "lpt", steps, {}, /*muon_buffer_bytes=*/1, true, "on");
  // As the first and the last rank see them (replicas 0 and I - 1).
  for (const RunResult* other : {&on, &on_per_unit}) {
    for (const auto& [mine, theirs] : {std::pair{&other->weights, &off.weights},
                                       std::pair{&other->last_weights, &off.weights}}) {
      ASSERT_EQ(mine->size(), theirs->size());
      for (size_t p = 0; p < theirs->size(); ++p) {
        ASSERT_EQ((*mine)[p].size(), (*theirs)[p].size());
        EXPECT_EQ(std::memcmp((*mine)[p].data(), (*theirs)[p].data(),
                              sizeof(float) * (*theirs)[p].size()),
                  0)
            << "param " << p;
      }
    }
  }
  const bool splits = c.instances > 1 && std::string(c.outer) == "no_shard";
  ASSERT_EQ(on.plan.dense.replicas, splits ? c.instances : 1);
  EXPECT_EQ(off.plan.dense.replicas, 1);

  // From the model spec: one copy of every dense and expert matrix's
  // Newton-Schulz work, the dense matrices' elements, and the units with
  // dense Muon matrices.
  const std::unique_ptr<Workload> model = MakeWorkload(c.moe, c.mlp);
  double dense_flops = 0, expert_flops = 0;
  int64_t dense_elements = 0;
  int dense_units = 0, muon_units = 0;
  for (const plan::UnitSpec& u : model->spec().units) {
    bool dense = false, any = false;
    for (const plan::ParamSpec& p : u.params) {
      if (p.optimizer != "muon") continue;
      any = true;
      if (p.expert) {
        expert_flops +=
            static_cast<double>(p.shape[0]) * plan::NsFlops(plan::NsAlgorithm::kAuto, p.shape[1],
                                                            p.shape[2], 5, plan::NsTable::kQuintic);
        continue;
      }
      dense = true;
      int64_t cols = 1;
      for (size_t d = 1; d < p.shape.size(); ++d) cols *= p.shape[d];
      dense_flops +=
          plan::NsFlops(plan::NsAlgorithm::kAuto, p.shape[0], cols, 5, plan::NsTable::kQuintic);
      dense_elements += p.shape[0] * cols;
    }
    dense_units += dense ? 1 : 0;
    muon_units += any ? 1 : 0;
  }
  // Dense domains (docs/architecture.md §3): an instance's W/I ranks when the inner
  // strategy shards, all W when the outer shards too, one rank under
  // no_shard. Experts: W/EP expert-data-parallel ranks, or one.
  const bool sharded = std::string(c.inner) != "no_shard";
  const int64_t dense_domain =
      sharded ? c.world / c.instances * (std::string(c.outer) == "optim" ? c.instances : 1) : 1;
  const int64_t dense_domains = c.world / dense_domain;
  const int64_t expert_domain = sharded ? c.world / c.ep : 1;
  const double experts = static_cast<double>(c.world / c.ep / expert_domain) * expert_flops;
  const int64_t sets = splits ? dense_domains / c.instances : dense_domains;
  double off_total = 0, on_total = 0;
  for (int32_t r = 0; r < c.world; ++r) {
    off_total += off.ns_flops[r];
    on_total += on.ns_flops[r];
  }
  const double want_off = static_cast<double>(dense_domains) * dense_flops + experts;
  const double want_on = static_cast<double>(sets) * dense_flops + experts;
  EXPECT_NEAR(off_total, want_off, 1e-9 * want_off);
  EXPECT_NEAR(on_total, want_on, 1e-9 * want_on);

  // The rounds: one per wave, and under the split one more on dp_outer for
  // each wave with dense matrices, right after it.
  const int meshes = (dense_flops > 0 ? 1 : 0) + (expert_flops > 0 ? 1 : 0);
  for (int32_t r = 0; r < c.world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_EQ(on.rounds[r].size(), splits ? 2u : 1u);
    EXPECT_EQ(on.exchange_calls[r], 2 * meshes + (splits ? 1 : 0));
    EXPECT_NE(on.rounds[r][0].domain, "dp_outer");
    EXPECT_DOUBLE_EQ(on.rounds[r][0].ns_flops, on.plan.ranks[r].ns_flops);
    if (splits) {
      const MuonRound& x = on.rounds[r][1];
      EXPECT_EQ(x.domain, "dp_outer");
      EXPECT_EQ(x.wave, 0);
      EXPECT_EQ(x.ns_flops, 0.0);
      EXPECT_EQ(x.sent_bytes + x.recv_bytes, on.plan.ranks[r].replica_exchange_bytes);
    }
    int replica_rounds = 0;
    for (const MuonRound& x : on_per_unit.rounds[r]) replica_rounds += x.domain == "dp_outer";
    EXPECT_EQ(replica_rounds, splits ? dense_units : 0);
    EXPECT_EQ(on_per_unit.rounds[r].size(), static_cast<size_t>(muon_units + replica_rounds));
  }
  int64_t planned = 0;
  for (const plan::CollectiveBytes& x : on.plan.collectives) {
    if (x.name == "muon_replica_exchange") planned += x.bytes_per_step;
  }
  const int64_t by_formula =
      splits ? (c.instances - 1) * sets * dense_elements * static_cast<int64_t>(sizeof(float)) : 0;
  EXPECT_EQ(planned, by_formula);
  auto sent = [](const RunResult& run) {
    auto it = run.bytes.find("muon_replica_exchange");
    return it == run.bytes.end() ? int64_t{0} : it->second;
  };
  EXPECT_EQ(sent(on), by_formula * steps);
  EXPECT_EQ(sent(on_per_unit), by_formula * steps);
  EXPECT_EQ(sent(off), 0);
  // And every collective of the split run, the owners' exchanges included,
  // moves what the plan says.
  const std::map<std::string, int64_t> all_planned = PlannedBytes(on.plan, steps);
  const std::map<std::string, int64_t> counted = PlannedKindsOfBytes(on.bytes);
  EXPECT_EQ(counted, all_planned);
}

INSTANTIATE_TEST_SUITE_P(
    Hsdp, ReplicaSplitTest,
    ::testing::Values(Config{"hsdp", 4, "optim_grads_params", 2, "no_shard"},
                      Config{"hsdp_w8_i4", 8, "optim_grads_params", 4, "no_shard"},
                      Config{"hsdp_over_ddp", 4, "no_shard", 2, "no_shard"},
                      Config{"hfsdp", 4, "optim_grads_params", 2, "optim"},
                      Config{"moe_ep1_hsdp", 4, "optim_grads_params", 2, "no_shard", 1, true},
                      Config{"moe_ep2_hsdp", 4, "optim_grads_params", 2, "no_shard", 2, true},
                      Config{"moe_ep2_hfsdp", 4, "optim_grads_params", 2, "optim", 2, true}),
    [](const auto& info) { return std::string(info.param.name); });

INSTANTIATE_TEST_SUITE_P(
    Configs, TrainerConfigTest,
    ::testing::Values(Config{"ddp", 4, "no_shard", 1, ""}, Config{"zero1", 4, "optim", 1, ""},
                      Config{"zero2", 4, "optim_grads", 1, ""},
                      Config{"zero3", 4, "optim_grads_params", 1, ""},
                      Config{"zero3_w3", 3, "optim_grads_params", 1, ""},
                      Config{"zero3_w8", 8, "optim_grads_params", 1, ""},
                      Config{"hsdp", 4, "optim_grads_params", 2, "no_shard"},
                      Config{"hfsdp", 4, "optim_grads_params", 2, "optim"}),
    [](const auto& info) { return std::string(info.param.name); });

// moe_mlp with its experts on the expert mesh: EP 1, 2 and 4 at world size
// 4 under every inner strategy, and with an outer axis (experts never get
// one: they follow the inner strategy over expert_dp).
INSTANTIATE_TEST_SUITE_P(
    Experts, TrainerConfigTest,
    ::testing::Values(Config{"moe_ep1_zero3", 4, "optim_grads_params", 1, "", 1, true},
                      Config{"moe_ep2_ddp", 4, "no_shard", 1, "", 2, true},
                      Config{"moe_ep2_zero1", 4, "optim", 1, "", 2, true},
                      Config{"moe_ep2_zero2", 4, "optim_grads", 1, "", 2, true},
                      Config{"moe_ep2_zero3", 4, "optim_grads_params", 1, "", 2, true},
                      Config{"moe_ep4_zero3", 4, "optim_grads_params", 1, "", 4, true},
                      Config{"moe_ep2_hsdp", 4, "optim_grads_params", 2, "no_shard", 2, true},
                      Config{"moe_ep2_hfsdp", 4, "optim_grads_params", 2, "optim", 2, true},
                      Config{"moe_ep2_zero3_w8", 8, "optim_grads_params", 1, "", 2, true}),
    [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------- QK-clip

// One rank, one step from the initial weights: each head's largest logit
// comes from the independent reference (double precision, its own q.k /
// sqrt(D)); the step's record holds each layer's largest; with tau between
// the heads', the clipped run equals the unclipped one except the clipped
// heads' query and key rows of c_attn.weight, scaled by sqrt(tau / S_h)
// (docs/architecture.md, "QK-clip"), the bias and every other tensor
// untouched.
TEST(QkClipTest, RescalesTheClippedHeadsQueryAndKeyRowsAfterTheStep) {
  Config one = {"gpt_single", 1, "optim_grads_params", 1, ""};
  one.gpt = true;
  const RunResult start = RunJob(one, "lpt", /*steps=*/0);
  const RunResult plain = RunJob(one, "lpt", /*steps=*/1);
  ASSERT_FALSE(start.weights.empty());
  std::vector<int64_t> samples;  // step 0's batch of 24: samples k mod 18
  for (int64_t k = 0; k < 24; ++k) samples.push_back(k % 18);
  std::vector<double> s;
  reference::GptRefLossAndGrad({11, 8, 2, 2, 8, 5}, InitialWeights(start), GptTokens(), samples,
                               nullptr, &s);
  ASSERT_EQ(s.size(), 4u);
  ASSERT_EQ(plain.max_attn_logits.size(), 1u);
  ASSERT_EQ(plain.max_attn_logits[0].size(), 2u);
  for (int l = 0; l < 2; ++l) {
    const double want = std::max(s[2 * l], s[2 * l + 1]);
    EXPECT_NEAR(plain.max_attn_logits[0][l], want, 1e-5 * std::abs(want)) << "layer " << l;
  }
  std::vector<double> sorted = s;
  std::sort(sorted.begin(), sorted.end());
  const double tau = 0.5 * (sorted[1] + sorted[2]);
  ASSERT_GT(tau, 0);
  ASSERT_LT(tau / sorted[3], 0.98) << "the heads' logits are too close for this test";

  RunRecipe recipe;
  recipe.qk_clip = tau;
  const RunResult clipped = RunJob(one, "lpt", 1, {}, 0, true, "", recipe);
  ASSERT_EQ(clipped.weights.size(), plain.weights.size());
  EXPECT_EQ(clipped.max_attn_logits, plain.max_attn_logits);  // recorded before the rescaling
  constexpr int64_t kC = 8, kD = 4;
  int scaled = 0;
  for (size_t p = 0; p < plain.weights.size(); ++p) {
    const bool c_attn = p == 4 || p == 16;  // 2 + 12 l + 2
    const int l = p == 16 ? 1 : 0;
    for (size_t i = 0; i < plain.weights[p].size(); ++i) {
      const int64_t row = static_cast<int64_t>(i) / kC;
      const int64_t h = (row % kC) / kD;  // q rows [0, C), k rows [C, 2C)
      const double head_s = s[2 * l + h];
      if (!c_attn || row >= 2 * kC || head_s <= tau) {
        EXPECT_EQ(clipped.weights[p][i], plain.weights[p][i]) << "param " << p << " [" << i << "]";
        continue;
      }
      const double want = plain.weights[p][i] * std::sqrt(tau / head_s);
      EXPECT_NEAR(clipped.weights[p][i], want, 1e-5 * std::abs(want) + 1e-9)
          << "param " << p << " [" << i << "]";
      ++scaled;
    }
  }
  EXPECT_EQ(scaled, 2 * 2 * kD * kC);  // two heads, q and k rows
}

// Every layout clips as one rank does: the same logits in every step's
// record, losses and final weights within fp32 rounding, after steps where
// QK-clip rescaled heads (it changes the outcome against an unclipped run).
class QkClipLayoutTest : public ::testing::TestWithParam<Config> {};

TEST_P(QkClipLayoutTest, EveryLayoutClipsAsOneRankDoes) {
  constexpr int kSteps = 4;
  Config one = {"gpt_single", 1, "optim_grads_params", 1, ""};
  one.gpt = true;
  Config many = GetParam();
  many.gpt = true;
  const RunResult plain = RunJob(one, "lpt", kSteps);
  ASSERT_EQ(plain.max_attn_logits.size(), static_cast<size_t>(kSteps));
  RunRecipe recipe;
  recipe.qk_clip = 0.7 * std::min(plain.max_attn_logits[0][0], plain.max_attn_logits[0][1]);
  const RunResult a = RunJob(one, "lpt", kSteps, {}, 0, true, "", recipe);
  const RunResult b = RunJob(many, "lpt", kSteps, {}, 0, true, "", recipe);
  EXPECT_GT(MaxApart(a, plain), 1e-4) << "QK-clip changed nothing";
  ASSERT_EQ(b.losses.size(), a.losses.size());
  for (size_t st = 0; st < a.losses.size(); ++st) {
    EXPECT_NEAR(b.losses[st], a.losses[st], 1e-5 * std::abs(a.losses[st])) << "step " << st;
    ASSERT_EQ(b.max_attn_logits[st].size(), 2u);
    for (int l = 0; l < 2; ++l) {
      EXPECT_NEAR(b.max_attn_logits[st][l], a.max_attn_logits[st][l],
                  1e-5 * std::abs(a.max_attn_logits[st][l]))
          << "step " << st << " layer " << l;
    }
  }
  EXPECT_LE(MaxApart(a, b), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, QkClipLayoutTest,
    ::testing::Values(Config{"ddp", 2, "no_shard", 1, ""}, Config{"zero1", 4, "optim", 1, ""},
                      Config{"zero2", 4, "optim_grads", 1, ""},
                      Config{"zero3_w3", 3, "optim_grads_params", 1, ""},
                      Config{"hsdp", 4, "optim_grads_params", 2, "no_shard"},
                      Config{"hfsdp", 4, "optim_grads_params", 2, "optim"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace muonmesh::worker
