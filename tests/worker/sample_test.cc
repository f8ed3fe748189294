// muonmesh-worker --sample's engine: the greedy choice against the
// independent double-precision reference (the next token is the one whose
// window has the smallest summed loss, since only the last position's term
// depends on it), reproducibility per seed, top-k 1 as greedy, rendering,
// llm.c tokenizer files, and errors that name the flag or file.

#include "worker/sample.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/model/gpt_reference.h"
#include "tests/worker/model/transformer_reference.h"
#include "worker/io/safetensors.h"
#include "worker/model/gpt.h"
#include "worker/model/token_windows.h"
#include "worker/model/transformer.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;

struct Fixture {
  std::string dir, job, weights;
  model::GptDims dims{256, 6, 2, 2, 8, 6};
  std::vector<std::vector<float>> params;
};

// A byte-level gpt job and safetensors weights from its initialisation
// (seed 3), in a fresh folder.
Fixture MakeFixture(const std::string& name, const std::string& data = "{text: {train: t.txt}}") {
  Fixture f;
  f.dir = ::testing::TempDir() + "/sample_" + name;
  std::filesystem::remove_all(f.dir);
  std::filesystem::create_directories(f.dir);
  f.job = f.dir + "/job.yaml";
  std::ofstream(f.job) << "name: s\nworld_size: 1\nmodel: {gpt: {vocab_size: 256, block_size: 6, "
                          "n_layer: 2, n_head: 2, n_embd: 8, seq_len: 6}}\ndata: "
                       << data << "\ntraining: {steps: 1, global_batch_size: 1}\n";
  auto stream = std::make_shared<const InMemoryTokens>(std::vector<int32_t>(8, 1));
  absl::StatusOr<Gpt> gpt = Gpt::Create(f.dims, stream);
  EXPECT_TRUE(gpt.ok()) << gpt.status();
  std::vector<io::TensorView> views;
  std::vector<float*> ptrs;
  for (const plan::UnitSpec& u : gpt->spec().units) {
    for (const plan::ParamSpec& p : u.params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      f.params.emplace_back(static_cast<size_t>(n));
    }
  }
  for (std::vector<float>& p : f.params) ptrs.push_back(p.data());
  EXPECT_TRUE(gpt->Initialize(3, ptrs).ok());
  size_t i = 0;
  for (const plan::UnitSpec& u : gpt->spec().units) {
    for (const plan::ParamSpec& p : u.params) views.push_back({p.name, p.shape, ptrs[i++]});
  }
  f.weights = f.dir + "/w.safetensors";
  EXPECT_TRUE(io::WriteSafetensors(f.weights, views).ok());
  return f;
}

// The reference's greedy next token after `context` (length seq_len).
int32_t ReferenceGreedy(const Fixture& f, const std::vector<int32_t>& context) {
  const reference::RefGptDims d{f.dims.vocab_size, f.dims.block_size, f.dims.n_layer,
                                f.dims.n_head,     f.dims.n_embd,     f.dims.seq_len};
  reference::GptTensors params;
  for (const std::vector<float>& p : f.params) params.emplace_back(p.begin(), p.end());
  int32_t best = -1;
  double best_loss = 0;
  for (int32_t j = 0; j < f.dims.vocab_size; ++j) {
    std::vector<int32_t> window = context;
    window.push_back(j);
    const double loss = reference::GptRefLossAndGrad(d, params, window, {0}, nullptr);
    if (best < 0 || loss < best_loss) {
      best = j;
      best_loss = loss;
    }
  }
  return best;
}

TEST(SampleTest, GreedyMatchesTheReference) {
  const Fixture f = MakeFixture("greedy");
  SampleOptions o;
  o.job_path = f.job;
  o.weights_path = f.weights;
  o.prompt = "Muon r";  // six bytes: the first draw sees exactly seq_len tokens
  o.tokens = 1;
  o.temperature = 0;
  absl::StatusOr<std::vector<int32_t>> out = SampleTokens(o);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<int32_t> context(o.prompt.begin(), o.prompt.end());
  ASSERT_EQ(out->size(), 1u);
  EXPECT_EQ((*out)[0], ReferenceGreedy(f, context));
}

// A DeepSeek-style transformer (MLA, experts in layer 1 with a balancing
// bias that changes choices, read from the weights file like the
// parameters): each greedy token is the reference's, whose window with that
// token last has the smallest loss; from a context shorter than seq_len the
// model sees positions 0.. as a window does.
TEST(SampleTest, TransformerGreedyMatchesTheReference) {
  const std::string dir = ::testing::TempDir() + "/sample_transformer";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string job = dir + "/job.yaml";
  std::ofstream(job) << "name: s\nworld_size: 1\nmodel: {transformer: {vocab_size: 256, "
                        "seq_len: 5, n_layer: 2, d_model: 8, n_head: 2, ffn_hidden: 12, "
                        "attention: mla, mla: {q_lora_rank: 6, kv_lora_rank: 4, "
                        "qk_nope_head_dim: 2, qk_rope_head_dim: 2, v_head_dim: 3}, "
                        "moe: {n_routed_experts: 4, top_k: 2, moe_ffn_hidden: 3, "
                        "n_shared_experts: 1, first_k_dense: 1}}}\n"
                        "data: {text: {train: t.txt}}\ntraining: {steps: 1, global_batch_size: 1}\n";
  model::TransformerDims d;
  d.vocab_size = 256;
  d.seq_len = 5;
  d.n_layer = 2;
  d.d_model = 8;
  d.n_head = 2;
  d.n_kv_head = 2;
  d.head_dim = 4;
  d.ffn_hidden = 12;
  d.attention = model::Attention::kMla;
  d.mla = {6, 4, 2, 2, 3};
  d.moe = model::MoeDims{4, 2, 3, 1, 1};
  absl::StatusOr<Transformer> t = Transformer::Create(
      d, std::make_shared<const InMemoryTokens>(std::vector<int32_t>(8, 1)));
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<std::vector<float>> params;
  std::vector<float*> ptrs;
  std::vector<io::TensorView> views;
  for (const plan::UnitSpec& u : t->spec().units) {
    for (const plan::ParamSpec& p : u.params) {
      int64_t n = 1;
      for (int64_t dim : p.shape) n *= dim;
      params.emplace_back(static_cast<size_t>(n));
    }
  }
  for (std::vector<float>& p : params) ptrs.push_back(p.data());
  // Weights larger than the initialisation's, so the choices are clear.
  ASSERT_TRUE(t->Initialize(3, ptrs).ok());
  for (std::vector<float>& p : params) {
    for (float& x : p) x = x == 1.0f ? 1.0f : 25.0f * x;
  }
  size_t i = 0;
  for (const plan::UnitSpec& u : t->spec().units) {
    for (const plan::ParamSpec& p : u.params) views.push_back({p.name, p.shape, ptrs[i++]});
  }
  std::vector<float> bias = {-1.0f, 0.75f, 1.0f, -0.5f};
  views.push_back({"layers.1.mlp.router.bias", {4}, bias.data()});
  const std::string weights = dir + "/w.safetensors";
  ASSERT_TRUE(io::WriteSafetensors(weights, views).ok());

  SampleOptions o;
  o.job_path = job;
  o.weights_path = weights;
  o.prompt = "Muo";  // three bytes: the first draws see fewer than seq_len tokens
  o.tokens = 4;
  o.temperature = 0;
  absl::StatusOr<std::vector<int32_t>> out = SampleTokens(o);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 4u);
  reference::RefTransformerDims r;
  r.vocab = 256;
  r.layers = 2;
  r.embd = 8;
  r.heads = 2;
  r.ffn = 12;
  r.mla = true;
  r.q_rank = 6;
  r.kv_rank = 4;
  r.dn = 2;
  r.dr = 2;
  r.dv = 3;
  r.experts = 4;
  r.top_k = 2;
  r.expert_ffn = 3;
  r.shared = 1;
  r.first_dense = 1;
  reference::TransformerTensors ref;
  for (const std::vector<float>& p : params) ref.emplace_back(p.begin(), p.end());
  std::vector<int32_t> context(o.prompt.begin(), o.prompt.end());
  for (int32_t got : *out) {
    r.seq = static_cast<int64_t>(context.size());
    int32_t best = -1;
    double best_loss = 0;
    for (int32_t j = 0; j < 256; ++j) {
      std::vector<int32_t> window = context;
      window.push_back(j);
      reference::MoeState state;
      state.bias = {{}, {bias.begin(), bias.end()}};
      const double loss =
          reference::TransformerRefLossAndGrad(r, ref, window, {0}, nullptr, nullptr, &state);
      if (best < 0 || loss < best_loss) {
        best = j;
        best_loss = loss;
      }
    }
    EXPECT_EQ(got, best) << "after " << context.size() << " tokens";
    context.push_back(got);
    if (static_cast<int64_t>(context.size()) > 5) context.erase(context.begin());
  }
}

TEST(SampleTest, SeededDrawsRepeatAndTopOneIsGreedy) {
  const Fixture f = MakeFixture("seeded");
  SampleOptions o;
  o.job_path = f.job;
  o.weights_path = f.weights;
  o.prompt = "ab";
  o.tokens = 12;  // past block_size: the context is cut to its last 6 tokens
  o.seed = 7;
  bool bytes = false;
  absl::StatusOr<std::vector<int32_t>> a = SampleTokens(o, &bytes);
  EXPECT_TRUE(bytes);  // trained on data.text
  absl::StatusOr<std::vector<int32_t>> b = SampleTokens(o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);
  o.top_k = 1;
  absl::StatusOr<std::vector<int32_t>> top1 = SampleTokens(o);
  o.top_k = 0;
  o.temperature = 0;
  absl::StatusOr<std::vector<int32_t>> greedy = SampleTokens(o);
  ASSERT_TRUE(top1.ok() && greedy.ok());
  EXPECT_EQ(*top1, *greedy);
  // At init the distribution is nearly uniform over 256 bytes: twelve
  // draws that all repeat the greedy ones would be a broken draw.
  EXPECT_NE(*a, *greedy);
  absl::StatusOr<std::string> text =
      RenderTokens(o, std::vector<int32_t>{'h', 'i', 0xC3}, /*bytes=*/true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "hi\xC3");
}

TEST(SampleTest, TokenModelsPrintIdsOrTokenizerText) {
  const Fixture f = MakeFixture("ids", "{tokens: {train: shards.bin}}");
  SampleOptions o;
  o.job_path = f.job;
  o.weights_path = f.weights;
  o.prompt = "text";
  EXPECT_THAT(std::string(SampleTokens(o).status().message()), HasSubstr("--prompt-ids"));
  o.prompt.clear();
  o.prompt_ids = {5};
  o.tokens = 2;
  bool byte_tokens = true;
  ASSERT_TRUE(SampleTokens(o, &byte_tokens).ok());
  EXPECT_FALSE(byte_tokens);  // trained on data.tokens: ids, not bytes
  o.prompt_ids = {5, 300};
  EXPECT_THAT(std::string(SampleTokens(o).status().message()),
              HasSubstr("--prompt-ids: 300 is outside [0, 256)"));
  absl::StatusOr<std::string> ids = RenderTokens(o, {5, 17}, /*bytes=*/false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, "5 17");
  // A tokenizer file: header (magic 20240328, version 1, 3 tokens), then
  // length-prefixed bytes.
  std::string bytes(1024, '\0');
  const uint32_t header[3] = {20240328, 1, 3};
  for (int k = 0; k < 3; ++k) {
    for (int b = 0; b < 4; ++b) bytes[4 * k + b] = static_cast<char>((header[k] >> (8 * b)) & 0xFF);
  }
  for (const std::string token : {"He", "llo", " world"}) {
    bytes.push_back(static_cast<char>(token.size()));
    bytes += token;
  }
  o.tokenizer_path = f.dir + "/tok.bin";
  std::ofstream(o.tokenizer_path, std::ios::binary) << bytes;
  absl::StatusOr<std::string> text = RenderTokens(o, {0, 1, 2}, /*bytes=*/false);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "Hello world");
  EXPECT_THAT(std::string(RenderTokens(o, {3}, /*bytes=*/false).status().message()),
              HasSubstr("has 3 tokens"));
  std::ofstream(o.tokenizer_path, std::ios::binary) << "not a tokenizer";
  EXPECT_THAT(std::string(ReadTokenizer(o.tokenizer_path).status().message()),
              HasSubstr("not an llm.c tokenizer file"));
}

TEST(SampleTest, BadInputNamesTheFlagOrFile) {
  const Fixture f = MakeFixture("bad");
  SampleOptions o;
  o.job_path = f.job;
  o.weights_path = f.weights;
  o.prompt = "x";
  o.temperature = -1;
  EXPECT_THAT(std::string(SampleTokens(o).status().message()), HasSubstr("--temperature"));
  o.temperature = 1;
  o.tokens = 0;
  EXPECT_THAT(std::string(SampleTokens(o).status().message()), HasSubstr("--tokens"));
  o.tokens = 1;
  o.prompt.clear();
  EXPECT_THAT(std::string(SampleTokens(o).status().message()), HasSubstr("required"));
  o.prompt = "x";
  o.weights_path = f.dir + "/missing.safetensors";
  EXPECT_THAT(std::string(SampleTokens(o).status().message()), HasSubstr("missing.safetensors"));
  const std::string mlp = f.dir + "/mlp.yaml";
  std::ofstream(mlp) << "name: m\nworld_size: 1\nmodel: {mlp: {dims: [2, 2]}}\n"
                        "training: {steps: 1, global_batch_size: 1}\n";
  o.job_path = mlp;
  o.weights_path = f.weights;
  EXPECT_THAT(std::string(SampleTokens(o).status().message()),
              HasSubstr("needs a job whose model can be sampled (gpt, transformer); this one "
                        "trains mlp"));
}

}  // namespace
}  // namespace muonmesh::worker
