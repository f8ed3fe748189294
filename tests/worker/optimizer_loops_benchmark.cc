// The optimizer's elementwise loops (worker/math: AdamWStep, MuonPrepare,
// MuonApply) against the plain loop a single-process trainer runs for AdamW
// (llm.c's train_gpt2.c update: one pass, no checks; its formula written out
// here), per element on one thread, in one run so that the ratio sees one
// machine load. AdamWStep checks every result before it writes any (a
// refused step leaves the weights as they were), so it makes two passes; the
// question is what that costs against the one unchecked pass.
//
//   build/tests/worker/optimizer_loops_benchmark --benchmark_repetitions=5
//       --benchmark_enable_random_interleaving=true   (one command line)
//
// Items are elements; the reported rate is elements a second.

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/optim/types.h"
#include "worker/math/adamw.h"
#include "worker/math/muon.h"

namespace muonmesh::math {
namespace {

constexpr int64_t kCols = 1024;

struct Buffers {
  explicit Buffers(int64_t n) : grad(n), a(n), b(n), param(n) {
    for (int64_t i = 0; i < n; ++i) {
      grad[i] = 0.001f * static_cast<float>((i * 7919) % 2001 - 1000);
      param[i] = 0.0005f * static_cast<float>((i * 104729) % 2001 - 1000);
      a[i] = 0.1f * grad[i];
      b[i] = 0.01f * grad[i] * grad[i];
    }
  }
  std::vector<float> grad, a, b, param;
};

optim::AdamWOptions Adam() {
  optim::AdamWOptions o;
  o.lr = 3e-4;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  return o;
}

void BM_AdamWStep(benchmark::State& state) {
  Buffers x(state.range(0));
  const optim::AdamWOptions o = Adam();
  int64_t step = 1;
  for (auto _ : state) {
    const absl::Status s = AdamWStep(o, step++, x.grad, absl::MakeSpan(x.a), absl::MakeSpan(x.b),
                                     absl::MakeSpan(x.param));
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// llm.c's AdamW update, one pass: m, v, bias-corrected m̂ and v̂, decoupled
// decay, no checks.
void BM_PlainAdamW(benchmark::State& state) {
  Buffers x(state.range(0));
  const optim::AdamWOptions o = Adam();
  const float lr = static_cast<float>(o.lr), b1 = static_cast<float>(o.beta1);
  const float b2 = static_cast<float>(o.beta2), eps = static_cast<float>(o.eps);
  const float wd = static_cast<float>(o.weight_decay);
  int t = 1;
  for (auto _ : state) {
    const float c1 = 1.0f - std::pow(b1, static_cast<float>(t));
    const float c2 = 1.0f - std::pow(b2, static_cast<float>(t));
    ++t;
    float* m = x.a.data();
    float* v = x.b.data();
    float* p = x.param.data();
    const float* g = x.grad.data();
    for (int64_t i = 0; i < state.range(0); ++i) {
      m[i] = b1 * m[i] + (1.0f - b1) * g[i];
      v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
      p[i] -= lr * ((m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + wd * p[i]);
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

optim::MuonOptions Muon() {
  optim::MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.95;
  o.nesterov = true;
  o.weight_decay = 0.01;
  return o;
}

void BM_MuonPrepare(benchmark::State& state) {
  Buffers x(state.range(0));
  for (auto _ : state) {
    const absl::Status s = MuonPrepare(Muon(), x.grad, x.a, absl::MakeSpan(x.b));
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_MuonApply(benchmark::State& state) {
  Buffers x(state.range(0));
  const int64_t rows = state.range(0) / kCols;
  for (auto _ : state) {
    const absl::Status s = MuonApply(Muon(), rows, kCols, x.grad, x.b, absl::MakeSpan(x.a),
                                     absl::MakeSpan(x.param));
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// 4M elements (four buffers of 16 MiB: past the caches, as a model's are).
BENCHMARK(BM_AdamWStep)->Arg(int64_t{1} << 22)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlainAdamW)->Arg(int64_t{1} << 22)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MuonPrepare)->Arg(int64_t{1} << 22)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MuonApply)->Arg(int64_t{1} << 22)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace muonmesh::math

BENCHMARK_MAIN();
