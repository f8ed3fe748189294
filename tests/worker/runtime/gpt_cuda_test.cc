// The gpt workload on a CUDA GPU (worker/model/gpt_cuda.h) against the host
// Gpt (worker/model/gpt.h) on the same parameters and windows: the loss,
// every gradient, the validation loss and the calls to the runtime. Skipped
// without a GPU; runs in every build on the CPU stand-in for CUDA
// (tests/worker/cuda_cpu/README.md), where it checks the host logic: each
// cuBLAS call's shapes and leading dimensions (a head read with the wrong
// row stride, or a transposed operand, moves the gradients by O(1)), the
// kernels' buffers and indices, and the scratch sizes.
//
// Tolerances: cuBLAS (or the stand-in's column-major loops) and the
// kernels' block reductions sum in other orders than OpenBLAS and the
// CPU's loops, so values agree to fp32 rounding through a few layers:
// losses to 1e-6 relative, each gradient tensor to 1e-4 of its largest
// element (the stand-in measures 1.1e-6 of it; a head read through the wrong
// column block misses by more than 1e-1).

#include "worker/model/gpt_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/plan/validate.h"
#include "gtest/gtest.h"
#include "worker/model/gpt.h"
#include "worker/model/token_windows.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {
namespace {

using Floats = std::vector<std::vector<float>>;

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  if (!ok) cudaGetLastError();
  return ok;
}

// V = 40, block 12, 2 layers, 2 heads, C = 16, T = 8.
model::GptDims Dims() { return {40, 12, 2, 2, 16, 8}; }

// Tokens from a fixed linear congruential sequence: every id of [0, 40)
// appears, with repeats inside a window (so the embedding gradient adds
// rows more than once).
std::shared_ptr<const TokenStream> Tokens(int64_t count, uint32_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(count));
  uint32_t x = seed;
  for (int32_t& v : t) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<int32_t>((x >> 16) % 40);
  }
  return std::make_shared<InMemoryTokens>(std::move(t));
}

Gpt MakeGpt() {
  absl::StatusOr<Gpt> g = Gpt::Create(Dims(), Tokens(400, 7));
  EXPECT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->SetValidation(Tokens(120, 11)).ok());
  return *std::move(g);
}

// The documented initialisation, then every element moved by a small
// deterministic amount so that LayerNorm weights and biases are not 1 and 0
// (their gradients would hide a swapped operand otherwise).
Floats Params(const Gpt& gpt) {
  Floats p;
  std::vector<float*> ptrs;
  for (const plan::UnitSpec& u : gpt.spec().units) {
    for (const plan::ParamSpec& s : u.params) p.emplace_back(plan::NumElements(s));
  }
  for (auto& t : p) ptrs.push_back(t.data());
  EXPECT_TRUE(gpt.Initialize(3, absl::MakeSpan(ptrs)).ok());
  for (size_t i = 0; i < p.size(); ++i) {
    for (size_t e = 0; e < p[i].size(); ++e) {
      p[i][e] += 0.05f * static_cast<float>(std::sin(0.7 * static_cast<double>(e + 13 * i)));
    }
  }
  return p;
}

// Device copies of host tensors, freed at scope exit.
class DeviceTensors {
 public:
  explicit DeviceTensors(const Floats& host) {
    for (const auto& t : host) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, sizeof(float) * t.size()), cudaSuccess);
      // NaN bits: what the workload does not overwrite shows.
      EXPECT_EQ(cudaMemset(p, 0xff, sizeof(float) * t.size()), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p, t.data(), sizeof(float) * t.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
      ptrs_.push_back(static_cast<float*>(p));
      sizes_.push_back(t.size());
    }
  }
  // Buffers shaped like `like`, all NaN.
  static DeviceTensors Poisoned(const Floats& like) {
    Floats nan;
    for (const auto& t : like) nan.emplace_back(t.size(), std::nanf(""));
    return DeviceTensors(nan);
  }
  ~DeviceTensors() {
    for (float* p : ptrs_) cudaFree(p);
  }
  DeviceTensors(DeviceTensors&& o) noexcept
      : ptrs_(std::move(o.ptrs_)), sizes_(std::move(o.sizes_)) {
    o.ptrs_.clear();
  }

  std::vector<float*>& ptrs() { return ptrs_; }
  std::vector<const float*> const_ptrs() const { return {ptrs_.begin(), ptrs_.end()}; }
  Floats ToHost() const {
    Floats out;
    for (size_t i = 0; i < ptrs_.size(); ++i) {
      out.emplace_back(sizes_[i]);
      EXPECT_EQ(cudaMemcpy(out.back().data(), ptrs_[i], sizeof(float) * sizes_[i],
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }

 private:
  std::vector<float*> ptrs_;
  std::vector<size_t> sizes_;
};

// WholeModelAccess that records its calls ("A3" = Acquire(3), R, G, C).
class Recording final : public UnitAccess {
 public:
  Recording(const plan::ModelSpec& spec, absl::Span<const float* const> params,
            absl::Span<float* const> grads)
      : whole_(spec, params, grads) {}
  absl::StatusOr<absl::Span<const float* const>> Acquire(int u) override {
    calls_.push_back(absl::StrCat("A", u));
    return whole_.Acquire(u);
  }
  void Release(int u) override { calls_.push_back(absl::StrCat("R", u)); }
  absl::StatusOr<absl::Span<float* const>> GradientBuffers(int u) override {
    calls_.push_back(absl::StrCat("G", u));
    return whole_.GradientBuffers(u);
  }
  absl::Status Commit(int u) override {
    calls_.push_back(absl::StrCat("C", u));
    return absl::OkStatus();
  }
  const std::vector<std::string>& calls() const { return calls_; }

 private:
  WholeModelAccess whole_;
  std::vector<std::string> calls_;
};

void ExpectGradientsNear(const Floats& gpu, const Floats& host, const plan::ModelSpec& spec) {
  std::vector<std::string> names;
  for (const plan::UnitSpec& u : spec.units) {
    for (const plan::ParamSpec& p : u.params) names.push_back(p.name);
  }
  ASSERT_EQ(gpu.size(), host.size());
  double worst_ratio = 0.0;
  for (size_t i = 0; i < host.size(); ++i) {
    double top = 0.0;
    for (float v : host[i]) top = std::max(top, std::abs(static_cast<double>(v)));
    double worst = 0.0;
    for (size_t e = 0; e < host[i].size(); ++e) {
      const double d = std::abs(static_cast<double>(gpu[i][e]) - host[i][e]);
      worst = std::isnan(d) ? INFINITY : std::max(worst, d);
    }
    worst_ratio = std::max(worst_ratio, worst / top);
    EXPECT_GT(top, 0.0) << names[i];
    EXPECT_LE(worst, 1e-4 * top) << names[i] << ": largest |gradient| " << top;
  }
  std::printf("gradients: worst |GPU - host| / largest |host| over the tensors %.2e\n",
              worst_ratio);
}

TEST(CudaGptTest, LossAndGradientsMatchTheHost) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Gpt host = MakeGpt();
  const Floats params = Params(host);
  // Samples in any order, one repeated.
  const std::vector<int64_t> samples = {5, 0, 17, 5, 30};

  Floats want;
  for (const auto& t : params) want.emplace_back(t.size(), std::nanf(""));
  std::vector<const float*> hp;
  for (const auto& t : params) hp.push_back(t.data());
  std::vector<float*> hg;
  for (auto& t : want) hg.push_back(t.data());
  Recording host_calls(host.spec(), hp, absl::MakeSpan(hg));
  absl::StatusOr<double> want_loss = host.ForwardBackwardByUnit(0, host_calls, samples);
  ASSERT_TRUE(want_loss.ok()) << want_loss.status();

  absl::StatusOr<std::unique_ptr<CudaGpt>> gpu = CudaGpt::Create(MakeGpt());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  DeviceTensors dp(params);
  DeviceTensors dg = DeviceTensors::Poisoned(params);
  const std::vector<const float*> dpc = dp.const_ptrs();
  Recording gpu_calls((*gpu)->spec(), dpc, absl::MakeSpan(dg.ptrs()));
  absl::StatusOr<double> loss = (*gpu)->ForwardBackwardByUnit(0, gpu_calls, samples);
  ASSERT_TRUE(loss.ok()) << loss.status();

  std::printf("loss: GPU %.9g host %.9g\n", *loss, *want_loss);
  EXPECT_NEAR(*loss, *want_loss, 1e-6 * *want_loss);
  EXPECT_EQ(gpu_calls.calls(), host_calls.calls());
  ExpectGradientsNear(dg.ToHost(), want, host.spec());

  // A second, smaller call reuses the scratch (and must not read the first
  // call's windows).
  const std::vector<int64_t> two = {1, 2};
  Recording again((*gpu)->spec(), dpc, absl::MakeSpan(dg.ptrs()));
  absl::StatusOr<double> loss2 = (*gpu)->ForwardBackwardByUnit(1, again, two);
  ASSERT_TRUE(loss2.ok()) << loss2.status();
  Recording host_again(host.spec(), hp, absl::MakeSpan(hg));
  absl::StatusOr<double> want2 = host.ForwardBackwardByUnit(1, host_again, two);
  ASSERT_TRUE(want2.ok());
  EXPECT_NEAR(*loss2, *want2, 1e-6 * *want2);
  ExpectGradientsNear(dg.ToHost(), want, host.spec());
}

TEST(CudaGptTest, ValidationLossMatchesTheHost) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Gpt host = MakeGpt();
  const Floats params = Params(host);
  std::vector<const float*> hp;
  for (const auto& t : params) hp.push_back(t.data());
  const std::vector<int64_t> samples = {0, 3, 9};
  ASSERT_GT(host.num_validation_samples(), 9);
  absl::StatusOr<double> want = host.Loss(hp, *host.validation(), samples);
  ASSERT_TRUE(want.ok()) << want.status();

  absl::StatusOr<std::unique_ptr<CudaGpt>> gpu = CudaGpt::Create(MakeGpt());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->num_validation_samples(), host.num_validation_samples());
  DeviceTensors dp(params);
  const std::vector<const float*> dpc = dp.const_ptrs();
  Recording calls((*gpu)->spec(), dpc, {});
  absl::StatusOr<double> got = (*gpu)->ValidationLossByUnit(calls, samples);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(*got, *want, 1e-6 * *want);
  // A loss pass commits nothing: embed, the blocks, head, embed again.
  EXPECT_EQ(calls.calls(),
            (std::vector<std::string>{"A0", "R0", "A1", "R1", "A2", "R2", "A3", "R3", "A0", "R0"}));
}

// Bad samples are refused before any call to the runtime, as on the host.
TEST(CudaGptTest, BadSamplesAreRefusedBeforeAnyCall) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<CudaGpt>> gpu = CudaGpt::Create(MakeGpt());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const Floats params = Params(MakeGpt());
  DeviceTensors dp(params);
  const std::vector<const float*> dpc = dp.const_ptrs();
  for (const std::vector<int64_t>& bad :
       {std::vector<int64_t>{}, std::vector<int64_t>{-1}, std::vector<int64_t>{0, 9999}}) {
    Recording calls((*gpu)->spec(), dpc, {});
    absl::StatusOr<double> r = (*gpu)->ForwardBackwardByUnit(0, calls, bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(calls.calls().empty());
  }
}

}  // namespace
}  // namespace muonmesh::worker
