// The CUDA elementwise optimizer steps (worker/cuda/optimizer_cuda.h) against
// torch's formulas written out here in fp32, one rounding per operation:
// results must agree bit for bit, refusals must leave every buffer as it was.
// Linked into the newton_schulz_cuda_test binary (its main skips without a
// GPU); each test also skips itself.

#include "worker/cuda/optimizer_cuda.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace muonmesh::cuda {
namespace {

bool Gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

class Buffer {
 public:
  explicit Buffer(const std::vector<float>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&data_, sizeof(float) * std::max<size_t>(n_, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host.data(), sizeof(float) * n_, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~Buffer() { cudaFree(data_); }
  float* get() { return data_; }
  std::vector<float> Host() const {
    std::vector<float> out(n_);
    EXPECT_EQ(cudaMemcpy(out.data(), data_, sizeof(float) * n_, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  size_t n_;
  float* data_ = nullptr;
};

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// torch.lerp in fp32.
float Lerp(float s, float e, float w) {
  volatile float d = e - s;
  if (std::fabs(w) < 0.5f) {
    volatile float t = w * d;
    return s + t;
  }
  volatile float u = 1.0f - w;
  volatile float t = d * u;
  return e - t;
}

class CudaOptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Gpu()) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<CudaOptimizer>> o = CudaOptimizer::Create();
    ASSERT_TRUE(o.ok()) << o.status();
    opt_ = *std::move(o);
  }
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(opt_->stream()), cudaSuccess); }
  std::unique_ptr<CudaOptimizer> opt_;
};

TEST_F(CudaOptimizerTest, AdamWMatchesTorchsFormulaBitForBit) {
  const size_t n = 100'003;  // not a multiple of the block size
  optim::AdamWOptions o;
  o.lr = 3e-3;
  o.beta1 = 0.9;
  o.beta2 = 0.995;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  std::vector<float> p = Random(n, 1, 1.0f), m(n, 0.0f), v(n, 0.0f);
  Buffer dp(p), dm(m), dv(v);
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = Random(n, 10 + step, 0.1f);
    Buffer dg(g);
    ASSERT_TRUE(opt_->AdamWStep(o, step, dg.get(), dm.get(), dv.get(), dp.get(), n).ok());
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
    const float decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
    const float w1 = static_cast<float>(1.0 - o.beta1);
    const float b2 = static_cast<float>(o.beta2);
    const float w2 = static_cast<float>(1.0 - o.beta2);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float eps = static_cast<float>(o.eps);
    const float neg_step = static_cast<float>(-(o.lr / bc1));
    for (size_t i = 0; i < n; ++i) {
      volatile float pd = p[i] * decay;
      m[i] = Lerp(m[i], g[i], w1);
      volatile float a = v[i] * b2;
      volatile float b = w2 * g[i];
      volatile float c = b * g[i];
      v[i] = a + c;
      volatile float r = std::sqrt(v[i]);
      volatile float q = r / bc2_sqrt;
      volatile float den = q + eps;
      volatile float num = neg_step * m[i];
      volatile float upd = num / den;
      p[i] = pd + upd;
    }
    Sync();
    ASSERT_TRUE(BitEqual(dp.Host(), p)) << "param, step " << step;
    ASSERT_TRUE(BitEqual(dm.Host(), m)) << "exp_avg, step " << step;
    ASSERT_TRUE(BitEqual(dv.Host(), v)) << "exp_avg_sq, step " << step;
  }
}

TEST_F(CudaOptimizerTest, MuonPhasesMatchTorchsFormulaBitForBit) {
  const int64_t rows = 300, cols = 257;
  const size_t n = rows * cols;
  for (bool nesterov : {true, false}) {
    optim::MuonOptions o;
    o.lr = 0.02;
    o.momentum = 0.95;
    o.nesterov = nesterov;
    o.weight_decay = 0.01;
    const std::vector<float> g = Random(n, 3, 0.1f), orth = Random(n, 4, 0.05f);
    std::vector<float> m = Random(n, 5, 0.1f), p = Random(n, 6, 1.0f);
    Buffer dg(g), dorth(orth), dm(m), dp(p), du(std::vector<float>(n, 0.0f));
    ASSERT_TRUE(opt_->MuonPrepare(o, dg.get(), dm.get(), du.get(), n).ok());
    ASSERT_TRUE(opt_->MuonApply(o, rows, cols, dg.get(), dorth.get(), dm.get(), dp.get(), n).ok());
    const float w = static_cast<float>(1.0 - o.momentum);
    const float beta = static_cast<float>(o.momentum);
    const float decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
    const float step = static_cast<float>(-(o.lr * std::sqrt(std::max(1.0, 300.0 / 257.0))));
    std::vector<float> u(n);
    for (size_t i = 0; i < n; ++i) {
      const float m_new = Lerp(m[i], g[i], w);
      u[i] = nesterov ? Lerp(g[i], m_new, beta) : m_new;
      volatile float a = p[i] * decay;
      volatile float b = step * orth[i];
      p[i] = a + b;
      m[i] = m_new;
    }
    Sync();
    EXPECT_TRUE(BitEqual(du.Host(), u)) << "update input, nesterov " << nesterov;
    EXPECT_TRUE(BitEqual(dp.Host(), p)) << "param, nesterov " << nesterov;
    EXPECT_TRUE(BitEqual(dm.Host(), m)) << "momentum, nesterov " << nesterov;
  }
}

TEST_F(CudaOptimizerTest, RefusedStepsChangeNothing) {
  const size_t n = 5000;
  std::vector<float> g = Random(n, 7, 0.1f);
  g[4321] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> m = Random(n, 8, 0.1f), v(n, 0.5f), p = Random(n, 9, 1.0f);
  Buffer dg(g), dm(m), dv(v), dp(p), du(std::vector<float>(n, 7.0f));
  optim::AdamWOptions a;
  a.lr = 1e-3;
  a.beta1 = 0.9;
  a.beta2 = 0.999;
  absl::Status st = opt_->AdamWStep(a, 1, dg.get(), dm.get(), dv.get(), dp.get(), n);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("element 4321"), std::string::npos) << st;
  optim::MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.95;
  EXPECT_EQ(opt_->MuonPrepare(o, dg.get(), dm.get(), du.get(), n).code(),
            absl::StatusCode::kInvalidArgument);
  // A NaN in the orthogonalised update refuses the apply phase.
  EXPECT_EQ(opt_->MuonApply(o, 50, 100, dm.get(), dg.get(), dv.get(), dp.get(), n).code(),
            absl::StatusCode::kInvalidArgument);
  // Bad options and shapes are refused before any launch.
  a.beta1 = 1.5;
  EXPECT_EQ(opt_->AdamWStep(a, 1, dm.get(), dm.get(), dv.get(), dp.get(), n).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(opt_->MuonApply(o, 50, 99, dm.get(), dm.get(), dv.get(), dp.get(), n).code(),
            absl::StatusCode::kInvalidArgument);
  Sync();
  EXPECT_TRUE(BitEqual(dm.Host(), m));
  EXPECT_TRUE(BitEqual(dv.Host(), v));
  EXPECT_TRUE(BitEqual(dp.Host(), p));
  EXPECT_TRUE(BitEqual(du.Host(), std::vector<float>(n, 7.0f)));
}

TEST_F(CudaOptimizerTest, FiniteExtremesThatOverflowAreRefusedAsOnTheCpu) {
  // lerp(m, g, 1 - beta) computes g - m = 6e38, which overflows float.
  const std::vector<float> g = {3e38f, 1.0f}, m = {-3e38f, 0.5f};
  Buffer dg(g), dm(m), du(std::vector<float>(2, 7.0f));
  optim::MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.95;
  EXPECT_EQ(opt_->MuonPrepare(o, dg.get(), dm.get(), du.get(), 2).code(),
            absl::StatusCode::kInvalidArgument);
  Sync();
  EXPECT_TRUE(BitEqual(du.Host(), std::vector<float>(2, 7.0f)));
}

TEST_F(CudaOptimizerTest, FirstNonFiniteFindsTheFirstBadElement) {
  std::vector<float> x(70'000, 1.0f);
  Buffer clean(x);
  absl::StatusOr<int64_t> first = opt_->FirstNonFinite(clean.get(), x.size());
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 70'000);
  x[65'537] = std::numeric_limits<float>::infinity();
  x[66'000] = std::numeric_limits<float>::quiet_NaN();
  Buffer dirty(x);
  first = opt_->FirstNonFinite(dirty.get(), x.size());
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 65'537);
}

}  // namespace
}  // namespace muonmesh::cuda
