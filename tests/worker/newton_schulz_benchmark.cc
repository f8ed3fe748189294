// Newton-Schulz (worker/math/newton_schulz.h) against plain OpenBLAS sgemm,
// in one process so the ratio of their FLOP/s is meaningful.
//
//   BM_NewtonSchulz/<rows>/<cols>: 5 quintic iterations in the standard
//       form, FLOPS counted as T (4 m^2 n + 2 m^3), m = min(rows, cols): what
//       the iteration costs as dense products (symmetry makes the real work
//       smaller; that is the point of counting it this way).
//   BM_NewtonSchulzGram/<rows>/<cols>: the same orthogonalisation in the
//       Gram form (plan/ns_cost.h), FLOPS counted the same standard way, so
//       its figure is the effective rate a user sees.
//   BM_NewtonSchulzSpectral/<rows>/<cols>: the Gram form evaluated on the
//       eigenvalues of X X^T (plan/ns_cost.h), counted the same way.
//   BM_NewtonSchulzAuto/<rows>/<cols>: the form auto picks, priced for the
//       OpenBLAS threads this process runs (optim::NsOptions::threads): on a good
//       cost model its figure is the best of the three above.
//   BM_Sgemm/<m>/<n>/<k>: C = A B, FLOPS = 2 m n k. For an m x n
//       Newton-Schulz the comparison is m/m/n, the shape of X X^T.
//   BM_SpectralPhases/<rows>/<cols>: the spectral form's phases timed one by
//       one (milliseconds a call in counters): G in fp64 (dsyrk over blocks
//       of 512 converted columns, as the form does), the three parts of
//       dsyevd (dsytrd: reduction to tridiagonal; dstedc: its eigenvectors;
//       dormtr: back to G's basis) and the two sgemm (Q, then Q X_0). Shows
//       which phases a second OpenBLAS thread speeds up.
//
// OpenBLAS runs its own threads, so FLOPS is per wall-clock second, timed here
// around the call: Google Benchmark's kIsRate divides by the main thread's CPU
// time unless UseRealTime() is set, and that would rename every benchmark
// "<name>/real_time". (The Time column is wall-clock time either way.) At the
// end a table gives NS FLOP/s / sgemm FLOP/s per shape. Typical run:
//   newton_schulz_benchmark --benchmark_min_time=0.2 --benchmark_repetitions=3
//       --benchmark_enable_random_interleaving=true

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "worker/math/newton_schulz.h"
#include "core/optim/ns_coefficients.h"

// LAPACK (OpenBLAS carries it), column-major, for BM_SpectralPhases.
extern "C" {
void dsytrd_(const char* uplo, const int* n, double* a, const int* lda, double* d, double* e,
             double* tau, double* work, const int* lwork, int* info);
void dstedc_(const char* compz, const int* n, double* d, double* e, double* z, const int* ldz,
             double* work, const int* lwork, int* iwork, const int* liwork, int* info);
void dormtr_(const char* side, const char* uplo, const char* trans, const int* m, const int* n,
             const double* a, const int* lda, const double* tau, double* c, const int* ldc,
             double* work, const int* lwork, int* info);
}

namespace muonmesh::math {
namespace {

constexpr int kSteps = 5;

std::vector<float> Filled(size_t count, uint32_t seed) {
  // A cheap deterministic fill in [-1, 1); the values do not change the cost.
  std::vector<float> v(count);
  uint32_t s = seed * 2654435761u + 1;
  for (float& e : v) {
    s = s * 1664525u + 1013904223u;
    e = static_cast<float>(s >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return v;
}

// Accumulated wall-clock time of the timed calls.
class WallClock {
 public:
  void Start() { start_ = std::chrono::steady_clock::now(); }
  void Stop() {
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  double seconds() const { return seconds_; }
  // A plain counter value (not kIsRate: see the file comment).
  benchmark::Counter Rate(double flops) const {
    return benchmark::Counter(seconds_ > 0.0 ? flops / seconds_ : 0.0);
  }

 private:
  std::chrono::steady_clock::time_point start_;
  double seconds_ = 0.0;
};

void RunNewtonSchulz(benchmark::State& state, plan::NsAlgorithm algorithm) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const std::vector<float> input = Filled(static_cast<size_t>(rows * cols), 1);
  std::vector<float> x = input;
  NewtonSchulz ns;
  optim::NsOptions options;
  options.steps = kSteps;
  options.algorithm = algorithm;
  options.threads = openblas_get_num_threads();
  // Warm-up, untimed: the first call touches the freshly allocated workspace
  // (page faults) and OpenBLAS's buffers. The runtime keeps one NewtonSchulz
  // across steps, so the steady state is what counts.
  if (const absl::Status s = ns.Run(x.data(), rows, cols, options); !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }
  WallClock wall;
  for (auto _ : state) {
    state.PauseTiming();
    x = input;  // same input every time (the copy is not timed)
    state.ResumeTiming();
    wall.Start();
    const absl::Status status = ns.Run(x.data(), rows, cols, options);
    wall.Stop();
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] =
      wall.Rate(optim::NewtonSchulzFlops(rows, cols, kSteps) * static_cast<double>(state.iterations()));
  state.SetLabel(plan::NsAlgorithmName(optim::NsFormFor(options, rows, cols)));  // the form that ran
}

void BM_NewtonSchulz(benchmark::State& state) {
  RunNewtonSchulz(state, plan::NsAlgorithm::kStandard);
}
void BM_NewtonSchulzGram(benchmark::State& state) {
  RunNewtonSchulz(state, plan::NsAlgorithm::kGram);
}
void BM_NewtonSchulzSpectral(benchmark::State& state) {
  RunNewtonSchulz(state, plan::NsAlgorithm::kSpectral);
}
void BM_NewtonSchulzAuto(benchmark::State& state) {
  RunNewtonSchulz(state, plan::NsAlgorithm::kAuto);
}

void BM_Sgemm(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0));
  const int n = static_cast<int>(state.range(1));
  const int k = static_cast<int>(state.range(2));
  const std::vector<float> a = Filled(static_cast<size_t>(m) * k, 2);
  const std::vector<float> b = Filled(static_cast<size_t>(k) * n, 3);
  std::vector<float> c(static_cast<size_t>(m) * n);
  auto gemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a.data(), k, b.data(),
                n, 0.0f, c.data(), n);
  };
  gemm();  // warm-up, untimed, as for Newton-Schulz
  WallClock wall;
  for (auto _ : state) {
    wall.Start();
    gemm();
    wall.Stop();
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = wall.Rate(2.0 * m * n * k * static_cast<double>(state.iterations()));
}

// The fp64 buffers of one spectral evaluation of an m x n X (m <= n).
struct SpectralBuffers {
  SpectralBuffers(int m, int n)
      : block(static_cast<size_t>(m) * 512), g(static_cast<size_t>(m) * m), z(g.size()),
        d(m), e(m), tau(m), work(1 + 6 * static_cast<size_t>(m) + 2 * g.size()),
        iwork(3 + 5 * static_cast<size_t>(m)), vt(g.size()), scaled(g.size()), q(g.size()),
        out(static_cast<size_t>(m) * n) {}
  std::vector<double> block, g, z, d, e, tau, work;
  std::vector<int> iwork;
  std::vector<float> vt, scaled, q, out;
};

// G = X X^T in fp64 (upper triangle, row-major), as the spectral form forms it.
void SpectralGram(const std::vector<float>& x, int m, int n, SpectralBuffers& b) {
  for (int j0 = 0; j0 < n; j0 += 512) {
    const int width = std::min(512, n - j0);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < width; ++j) {
        b.block[static_cast<size_t>(i) * width + j] = x[static_cast<size_t>(i) * n + j0 + j];
      }
    }
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m, width, 1.0, b.block.data(), width,
                j0 == 0 ? 0.0 : 1.0, b.g.data(), m);
  }
}

void BM_SpectralPhases(benchmark::State& state) {
  const int rows = static_cast<int>(state.range(0)), cols = static_cast<int>(state.range(1));
  const int m = std::min(rows, cols), n = std::max(rows, cols);
  std::vector<float> x = Filled(static_cast<size_t>(m) * n, 1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(m) * n / 3.0f);  // about unit norm
  for (float& v : x) v *= scale;
  SpectralBuffers b(m, n);
  const int lwork = static_cast<int>(b.work.size()), liwork = static_cast<int>(b.iwork.size());
  WallClock phase[6];
  int info = 0;
  for (auto _ : state) {
    phase[0].Start();
    SpectralGram(x, m, n, b);
    phase[0].Stop();
    phase[1].Start();  // the row-major upper triangle is the column-major lower one
    dsytrd_("L", &m, b.g.data(), &m, b.d.data(), b.e.data(), b.tau.data(), b.work.data(), &lwork,
            &info);
    phase[1].Stop();
    phase[2].Start();
    dstedc_("I", &m, b.d.data(), b.e.data(), b.z.data(), &m, b.work.data(), &lwork,
            b.iwork.data(), &liwork, &info);
    phase[2].Stop();
    phase[3].Start();
    dormtr_("L", "L", "N", &m, &m, b.g.data(), &m, b.tau.data(), b.z.data(), &m, b.work.data(),
            &lwork, &info);
    phase[3].Stop();
    for (size_t i = 0; i < b.z.size(); ++i) {  // V^T and diag(q) V^T, q = 1 (not timed)
      b.vt[i] = static_cast<float>(b.z[i]);
      b.scaled[i] = b.vt[i];
    }
    phase[4].Start();
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, m, m, 1.0f, b.vt.data(), m,
                b.scaled.data(), m, 0.0f, b.q.data(), m);
    phase[4].Stop();
    phase[5].Start();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0f, b.q.data(), m, x.data(),
                n, 0.0f, b.out.data(), n);
    phase[5].Stop();
    if (info != 0) state.SkipWithError("a LAPACK phase failed");
    benchmark::DoNotOptimize(b.out.data());
  }
  const char* names[6] = {"gram_dsyrk_ms", "dsytrd_ms", "dstedc_ms", "dormtr_ms", "q_sgemm_ms",
                          "qx_sgemm_ms"};
  const double calls = static_cast<double>(state.iterations());
  for (int p = 0; p < 6; ++p) state.counters[names[p]] = 1e3 * phase[p].seconds() / calls;
}

// {rows, cols} of each Newton-Schulz shape; its GEMM is m/m/n.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {128, 128}, {128, 344}, {128, 1152}, {128, 2048}, {256, 256}, {256, 688}, {256, 1536},
    {512, 1376},
    {768, 2304}, {768, 3072}, {1024, 1024}, {1024, 4096}, {1024, 8192}, {4096, 4096}};

void RegisterAll() {
  const std::pair<const char*, void (*)(benchmark::State&)> forms[] = {
      {"BM_NewtonSchulz", BM_NewtonSchulz},
      {"BM_NewtonSchulzGram", BM_NewtonSchulzGram},
      {"BM_NewtonSchulzSpectral", BM_NewtonSchulzSpectral},
      {"BM_NewtonSchulzAuto", BM_NewtonSchulzAuto}};
  for (const auto& [rows, cols] : kShapes) {
    for (const auto& [name, run] : forms) {
      benchmark::RegisterBenchmark(name, run)->Args({rows, cols})->Unit(benchmark::kMillisecond);
    }
    const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
    benchmark::RegisterBenchmark("BM_Sgemm", BM_Sgemm)
        ->Args({m, m, n})
        ->Unit(benchmark::kMillisecond);
    if (n >= 4 * m) {
      benchmark::RegisterBenchmark("BM_SpectralPhases", BM_SpectralPhases)
          ->Args({rows, cols})
          ->Unit(benchmark::kMillisecond);
    }
  }
}

// Console output as usual, plus the FLOP/s ratio per shape at the end, from
// the best and from the median of the repetitions of each benchmark. On a
// shared machine other load only ever slows a run down, so the best run is
// the better estimate of what the code does; run with
// --benchmark_repetitions=N --benchmark_enable_random_interleaving=true so
// that both sides of a ratio sample the same periods. With repetitions the
// console shows only the aggregates (what --benchmark_display_aggregates_only
// would show; that flag also hides the repetitions from this reporter, so the
// table needs it off).
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    std::vector<Run> shown;
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Aggregate || run.repetitions <= 1) shown.push_back(run);
      auto it = run.counters.find("FLOPS");
      if (it != run.counters.end() && run.run_type == Run::RT_Iteration && !run.error_occurred) {
        flops_[run.run_name.str()].push_back(it->second.value);
      }
    }
    if (!shown.empty()) ConsoleReporter::ReportRuns(shown);
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    if (flops_.empty()) {
      std::printf("\nNo repetitions reached the ratio table: run without "
                  "--benchmark_display_aggregates_only.\n");
      return;
    }
    std::printf("\n%-32s %-26s %22s %22s %15s\n", "Newton-Schulz", "sgemm (X X^T shape)",
                "NS GFLOP/s best/med", "sgemm GFLOP/s best/med", "ratio best/med");
    for (const auto& [form, rows, cols] : Rows()) {
      const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
      const std::string ns = form + std::to_string(rows) + "/" + std::to_string(cols);
      const std::string gemm = "BM_Sgemm/" + std::to_string(m) + "/" + std::to_string(m) + "/" +
                               std::to_string(n);
      if (!flops_.count(ns) || !flops_.count(gemm)) continue;
      const std::vector<double>& a = flops_[ns];
      const std::vector<double>& b = flops_[gemm];
      const double ns_best = *std::max_element(a.begin(), a.end());
      const double gemm_best = *std::max_element(b.begin(), b.end());
      std::printf("%-32s %-26s %10.1f / %-9.1f %10.1f / %-9.1f %6.3f / %-6.3f\n", ns.c_str(),
                  gemm.c_str(), ns_best / 1e9, Median(a) / 1e9, gemm_best / 1e9, Median(b) / 1e9,
                  ns_best / gemm_best, Median(a) / Median(b));
    }
  }

 private:
  // Each form on each shape, the standard form first.
  static std::vector<std::tuple<std::string, int64_t, int64_t>> Rows() {
    std::vector<std::tuple<std::string, int64_t, int64_t>> rows;
    for (const char* form :
         {"BM_NewtonSchulz/", "BM_NewtonSchulzGram/", "BM_NewtonSchulzSpectral/",
          "BM_NewtonSchulzAuto/"}) {
      for (const auto& [r, c] : kShapes) rows.emplace_back(form, r, c);
    }
    return rows;
  }

  static double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t h = v.size() / 2;
    return v.size() % 2 == 1 ? v[h] : 0.5 * (v[h - 1] + v[h]);
  }

  std::map<std::string, std::vector<double>> flops_;
};

}  // namespace
}  // namespace muonmesh::math

int main(int argc, char** argv) {
  std::printf("OpenBLAS core: %s, threads: %d, config: %s\n", openblas_get_corename(),
              openblas_get_num_threads(), openblas_get_config());
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  benchmark::AddCustomContext("openblas_threads", std::to_string(openblas_get_num_threads()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  muonmesh::math::RegisterAll();
  muonmesh::math::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
