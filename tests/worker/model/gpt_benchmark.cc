// The gpt and transformer workloads' forward and backward passes at
// GPT-2-small widths against plain OpenBLAS sgemm, in one process so that the
// ratio of their FLOP/s means something on a shared machine.
//
//   BM_GptForwardBackward/<n_layer>/<seq_len>/<vocab>: one ForwardBackward on
//       one sample, C = 768, 12 heads. FLOPS counts the matrix products the
//       model defines, as dense products: forward 2 n T (12 L C^2 + C V) for
//       the linear layers and the tied head, plus 4 T^2 C L per sample for
//       q k^T and the attention-weighted sum of v (the whole T x T square:
//       the code computes it, then masks); the backward pass is twice the
//       forward's. Elementwise work (LayerNorm, GELU, softmax) is not
//       counted, so the figure is the rate a user sees on the products.
//       Steady state: an untimed first call allocates the activations.
//   BM_TransformerForwardBackward/<n_layer>/<seq_len>/<moe>: the same for the
//       transformer (worker/model/transformer.h) at C = 768, 12 heads of 64
//       over 4 kv heads, SwiGLU 2048, V = 256, untied: forward 2 n T (C (2 C
//       + 2 Hkv D) + 3 C F + C V) per layer's products and the head's, plus
//       4 T^2 C L for attention; with <moe> 1 every layer is 8 experts of
//       width 512, top 2, and a shared one (3 (K + S) C Fe + C E instead of
//       3 C F); backward twice the forward.
//   BM_Sgemm/<m>/<n>/<k>: C = A B, FLOPS = 2 m n k, on the shapes the model's
//       largest products have (T rows by 3072 by 768; T by V by 768).
//
// OpenBLAS threads are the process's (OPENBLAS_NUM_THREADS; 1 for the
// figures in BENCHMARKS.md). FLOPS is per wall-clock second. At the end a
// line gives the forward+backward rate over the best sgemm rate.
//   gpt_benchmark --benchmark_min_time=1 --benchmark_repetitions=3

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/plan/validate.h"
#include "worker/model/gpt.h"
#include "worker/model/transformer.h"
#include "worker/model/token_windows.h"

namespace muonmesh::worker {
namespace {

constexpr int64_t kEmbd = 768;
constexpr int64_t kHeads = 12;

std::map<std::string, double>& Rates() {
  static auto* rates = new std::map<std::string, double>;
  return *rates;
}

double GptFlops(int64_t layers, int64_t t, int64_t vocab) {
  const double c = static_cast<double>(kEmbd);
  const double rows = static_cast<double>(t);
  const double forward = 2 * rows * (12 * static_cast<double>(layers) * c * c +
                                     c * static_cast<double>(vocab)) +
                         4 * rows * rows * c * static_cast<double>(layers);
  return 3 * forward;
}

// Times `w`'s ForwardBackward on one sample, after one untimed call that
// allocates the activations (and pays their first-touch page faults, which a
// training step does once per run); `flops` per call give the FLOPS counter
// and the best rate under `key`.
void TimeForwardBackward(benchmark::State& state, Workload& w, double flops,
                         const std::string& key) {
  std::vector<std::vector<float>> params, grads;
  std::vector<float*> p, g;
  for (const plan::UnitSpec& u : w.spec().units) {
    for (const plan::ParamSpec& ps : u.params) {
      params.emplace_back(static_cast<size_t>(plan::NumElements(ps)));
      grads.emplace_back(params.back().size());
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    p.push_back(params[i].data());
    g.push_back(grads[i].data());
  }
  if (!w.Initialize(1, p).ok()) return state.SkipWithError("Initialize failed");
  const std::vector<const float*> cp(p.begin(), p.end());
  const std::vector<int64_t> samples = {0};
  if (!w.ForwardBackward(0, cp, samples, g).ok()) return state.SkipWithError("warm-up failed");
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<double> loss = w.ForwardBackward(0, cp, samples, g);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!loss.ok()) return state.SkipWithError(std::string(loss.status().message()).c_str());
    benchmark::DoNotOptimize(*loss);
  }
  const double rate = flops * static_cast<double>(state.iterations()) / seconds;
  state.counters["FLOPS"] = rate;
  Rates()[key] = std::max(Rates()[key], rate);
}

void BM_GptForwardBackward(benchmark::State& state) {
  const int64_t layers = state.range(0), t = state.range(1), vocab = state.range(2);
  const model::GptDims dims{vocab, t, layers, kHeads, kEmbd, t};
  std::vector<int32_t> tokens(static_cast<size_t>(4 * t));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % vocab);
  absl::StatusOr<Gpt> gpt = Gpt::Create(dims, std::make_shared<InMemoryTokens>(tokens));
  if (!gpt.ok()) {
    state.SkipWithError(std::string(gpt.status().message()).c_str());
    return;
  }
  TimeForwardBackward(state, *gpt, GptFlops(layers, t, vocab), "gpt");
}

double TransformerFlops(const model::TransformerDims& d) {
  const double c = static_cast<double>(d.d_model);
  const double t = static_cast<double>(d.seq_len);
  const double kd = static_cast<double>(d.n_kv_head * d.head_dim);
  double mlp = 3 * c * static_cast<double>(d.ffn_hidden);
  if (d.moe.has_value()) {
    const model::MoeDims& m = *d.moe;
    mlp = 3 * static_cast<double>(m.top_k + m.n_shared_experts) * c *
              static_cast<double>(m.moe_ffn_hidden) +
          c * static_cast<double>(m.n_routed_experts);
  }
  const double per_layer = 2 * t * (c * (2 * c + 2 * kd) + mlp) + 4 * t * t * c;
  const double forward = static_cast<double>(d.n_layer) * per_layer +
                         2 * t * c * static_cast<double>(d.vocab_size);
  return 3 * forward;
}

void BM_TransformerForwardBackward(benchmark::State& state) {
  model::TransformerDims d;
  d.vocab_size = 256;
  d.seq_len = state.range(1);
  d.n_layer = state.range(0);
  d.d_model = kEmbd;
  d.n_head = kHeads;
  d.n_kv_head = 4;
  d.head_dim = kEmbd / kHeads;
  d.ffn_hidden = 2048;
  if (state.range(2) != 0) d.moe = model::MoeDims{8, 2, 512, 1, 0};
  std::vector<int32_t> tokens(static_cast<size_t>(4 * d.seq_len));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % 256);
  absl::StatusOr<Transformer> model =
      Transformer::Create(d, std::make_shared<InMemoryTokens>(tokens));
  if (!model.ok()) return state.SkipWithError(std::string(model.status().message()).c_str());
  TimeForwardBackward(state, *model, TransformerFlops(d),
                      state.range(2) != 0 ? "transformer moe" : "transformer");
}

void BM_Sgemm(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1)),
            k = static_cast<int>(state.range(2));
  std::vector<float> a(static_cast<size_t>(m) * k, 0.5f), b(static_cast<size_t>(k) * n, 0.25f),
      c(static_cast<size_t>(m) * n);
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a.data(), k, b.data(),
                n, 0.0f, c.data(), n);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    benchmark::DoNotOptimize(c.data());
  }
  const double rate = 2.0 * m * n * k * static_cast<double>(state.iterations()) / seconds;
  state.counters["FLOPS"] = rate;
  Rates()["sgemm"] = std::max(Rates()["sgemm"], rate);
}

BENCHMARK(BM_GptForwardBackward)
    ->Args({2, 256, 50257})
    ->Args({2, 256, 256})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TransformerForwardBackward)
    ->Args({2, 256, 0})
    ->Args({2, 256, 1})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Sgemm)->Args({256, 3072, 768})->Args({256, 50257, 768})->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace muonmesh::worker

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("OpenBLAS core %s, %d threads\n", openblas_get_corename(),
              openblas_get_num_threads());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  auto& r = muonmesh::worker::Rates();
  if (r["sgemm"] > 0) {
    for (const char* model : {"gpt", "transformer", "transformer moe"}) {
      std::printf("%s forward+backward %.1f GFLOP/s, best sgemm %.1f GFLOP/s: ratio %.2f\n",
                  model, r[model] / 1e9, r["sgemm"] / 1e9, r[model] / r["sgemm"]);
    }
  }
  return 0;
}
