// The `gpt` workload (worker/model/gpt.h): its double-precision reference
// (gpt_reference.h) against central differences, the fp32 workload against
// the reference, streaming against ForwardBackward bit for bit and in the
// documented call order, the documented initialisation, the loss-only
// paths, errors, and the spec at GPT-2 124M size against the shared spec
// file.

#include "worker/model/gpt.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <numbers>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/model/gpt_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/model/central_difference.h"
#include "tests/worker/model/gpt_reference.h"
#include "worker/model/rng.h"
#include "worker/model/token_windows.h"

namespace muonmesh::worker {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using Floats = std::vector<std::vector<float>>;

// ---------------------------------------------------------------- helpers

int64_t Elements(const plan::ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

Floats ZerosLike(const plan::ModelSpec& spec) {
  Floats out;
  for (const auto& unit : spec.units) {
    for (const auto& p : unit.params) out.emplace_back(static_cast<size_t>(Elements(p)), 0.0f);
  }
  return out;
}

std::vector<const float*> ConstPtrs(const Floats& t) {
  std::vector<const float*> p;
  for (const auto& v : t) p.push_back(v.data());
  return p;
}

std::vector<float*> Ptrs(Floats& t) {
  std::vector<float*> p;
  for (auto& v : t) p.push_back(v.data());
  return p;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

reference::GptTensors ToDouble(const Floats& t) {
  reference::GptTensors out;
  for (const auto& v : t) out.emplace_back(v.begin(), v.end());
  return out;
}

// The tiny model of most tests: V=11, block=8, L=2, H=2, C=8, T=5.
model::GptDims Tiny(int64_t layers = 2) { return {11, 8, layers, 2, 8, 5}; }

reference::RefGptDims RefDims(const model::GptDims& d) {
  return {d.vocab_size, d.block_size, d.n_layer, d.n_head, d.n_embd, d.seq_len};
}

std::vector<int32_t> TinyTokens(int64_t count, int32_t vocab, int32_t salt = 0) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < count; ++i)
    t.push_back(static_cast<int32_t>((7 * i * i + 3 * i + salt) % vocab));
  return t;
}

Gpt MakeGpt(const model::GptDims& dims, std::vector<int32_t> tokens) {
  absl::StatusOr<Gpt> gpt = Gpt::Create(dims, std::make_shared<InMemoryTokens>(std::move(tokens)));
  EXPECT_TRUE(gpt.ok()) << gpt.status();
  return *std::move(gpt);
}

// Parameters far from the initialisation (so that attention is not
// uniform and every path carries gradient): LayerNorm weights 1 + U(-0.2,
// 0.2), biases U(-0.1, 0.1), everything else U(-0.5, 0.5). The uniforms are
// 24-bit grid values from mt19937_64 (exact in float and double).
Floats TestParams(const plan::ModelSpec& spec, uint64_t seed) {
  std::mt19937_64 gen(seed);
  auto uniform = [&gen] {
    return static_cast<double>(gen() >> 40) * 0x1p-24 * 2.0 - 1.0;  // [-1, 1)
  };
  Floats out;
  for (const auto& unit : spec.units) {
    for (const auto& p : unit.params) {
      const bool norm = p.name.find("ln_") != std::string::npos;
      const bool bias = p.name.ends_with(".bias");
      std::vector<float> v(static_cast<size_t>(Elements(p)));
      for (float& x : v) {
        const double u = uniform();
        x = static_cast<float>(bias ? 0.1 * u : norm ? 1.0 + 0.2 * u : 0.5 * u);
      }
      out.push_back(std::move(v));
    }
  }
  return out;
}

struct Result {
  double loss = 0;
  Floats grads;
};

Result Whole(Gpt& gpt, const Floats& params, const std::vector<int64_t>& samples) {
  Result r;
  r.grads = ZerosLike(gpt.spec());
  for (auto& g : r.grads) std::fill(g.begin(), g.end(), std::nanf(""));  // overwritten
  std::vector<const float*> p = ConstPtrs(params);
  std::vector<float*> g = Ptrs(r.grads);
  absl::StatusOr<double> loss = gpt.ForwardBackward(0, p, samples, absl::MakeSpan(g));
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.value_or(-1);
  return r;
}

// A UnitAccess over whole-model vectors that hands each unit out in fresh
// buffers (poisoned with NaN after release, and gradient buffers poisoned
// before use, so a stale read shows), copies committed gradients back and
// records every call ("A3" = Acquire(3), R, G, C likewise). It can fail one
// Acquire or GradientBuffers call (by its position among the calls).
class RecordingAccess final : public UnitAccess {
 public:
  RecordingAccess(const plan::ModelSpec& spec, const Floats& params)
      : params_(params), grads_(ZerosLike(spec)) {
    for (const auto& unit : spec.units) {
      first_.push_back(count_);
      count_ += unit.params.size();
      sizes_.push_back(unit.params.size());
    }
    held_.resize(sizes_.size());
    held_ptrs_.resize(sizes_.size());
    gbufs_.resize(sizes_.size());
    gptrs_.resize(sizes_.size());
    committed_.assign(sizes_.size(), 0);
  }

  void FailCall(size_t index) { fail_at_ = index; }

  absl::StatusOr<absl::Span<const float* const>> Acquire(int u) override {
    calls_.push_back(absl::StrCat("A", u));
    if (calls_.size() == fail_at_ + 1) return absl::UnavailableError("injected");
    if (!held_[u].empty()) return absl::FailedPreconditionError("acquired twice");
    for (size_t j = 0; j < sizes_[u]; ++j) held_[u].push_back(params_[first_[u] + j]);
    for (auto& t : held_[u]) held_ptrs_[u].push_back(t.data());
    max_acquired_ = std::max(max_acquired_, ++acquired_now_);
    return absl::MakeConstSpan(held_ptrs_[u]);
  }
  void Release(int u) override {
    calls_.push_back(absl::StrCat("R", u));
    if (held_[u].empty()) return;
    for (auto& t : held_[u]) std::fill(t.begin(), t.end(), std::nanf(""));
    held_[u].clear();
    held_ptrs_[u].clear();
    --acquired_now_;
  }
  absl::StatusOr<absl::Span<float* const>> GradientBuffers(int u) override {
    calls_.push_back(absl::StrCat("G", u));
    if (calls_.size() == fail_at_ + 1) return absl::UnavailableError("injected");
    for (size_t j = 0; j < sizes_[u]; ++j) {
      gbufs_[u].emplace_back(params_[first_[u] + j].size(), std::nanf(""));
    }
    for (auto& t : gbufs_[u]) gptrs_[u].push_back(t.data());
    max_grads_ = std::max(max_grads_, ++grads_now_);
    return absl::MakeConstSpan(gptrs_[u]);
  }
  absl::Status Commit(int u) override {
    calls_.push_back(absl::StrCat("C", u));
    ++committed_[u];
    for (size_t j = 0; j < gbufs_[u].size(); ++j) grads_[first_[u] + j] = gbufs_[u][j];
    gbufs_[u].clear();
    gptrs_[u].clear();
    --grads_now_;
    return absl::OkStatus();
  }

  const std::vector<std::string>& calls() const { return calls_; }
  const Floats& grads() const { return grads_; }
  const std::vector<int>& committed() const { return committed_; }
  int max_acquired() const { return max_acquired_; }
  int max_grads() const { return max_grads_; }
  int acquired_now() const { return acquired_now_; }

 private:
  const Floats& params_;
  Floats grads_;
  std::vector<size_t> first_;
  std::vector<size_t> sizes_;
  size_t count_ = 0;
  std::vector<Floats> held_;
  std::vector<std::vector<const float*>> held_ptrs_;
  std::vector<Floats> gbufs_;
  std::vector<std::vector<float*>> gptrs_;
  std::vector<int> committed_;
  std::vector<std::string> calls_;
  size_t fail_at_ = SIZE_MAX;
  int acquired_now_ = 0;
  int max_acquired_ = 0;
  int grads_now_ = 0;
  int max_grads_ = 0;
};

// ---------------------------------------------------------------- reference

TEST(GptReferenceTest, GradientsMatchCentralDifferences) {
  const model::GptDims dims = Tiny();
  absl::StatusOr<plan::ModelSpec> spec = model::GptSpec(dims);
  ASSERT_TRUE(spec.ok());
  reference::GptTensors params = ToDouble(TestParams(*spec, 5));
  const std::vector<int32_t> tokens = TinyTokens(23, 11);
  const std::vector<int64_t> samples = {0, 7, 7};  // a repeat: gradients add up
  reference::GptTensors grads;
  const reference::RefGptDims d = RefDims(dims);
  reference::GptRefLossAndGrad(d, params, tokens, samples, &grads);
  auto loss = [&](const reference::GptTensors& p) {
    return reference::GptRefLossAndGrad(d, p, tokens, samples, nullptr);
  };
  const std::vector<double> largest =
      reference::ExpectGradientsMatchCentralDifferences(loss, params, grads);
  // Every tensor carries gradient (wpe rows >= T do not, the rest do).
  for (size_t i = 0; i < largest.size(); ++i) EXPECT_GT(largest[i], 1e-4) << "param " << i;
}

// ---------------------------------------------------------------- fp32 vs
// reference

// fp32 against the double reference: |got - want| <= 1e-5 + 1e-4 |want|
// per gradient entry, 1e-6 relative for the loss. Why: the fp32 pass has
// unit roundoff 6e-8 and its sums here have at most 4C = 32 terms of O(1)
// activations, so entries (up to ~0.5 here) should be off by ~1e-7
// absolute; small entries that come out of cancellation are off by more
// relative to themselves, hence the relative part. Measured when written:
// largest absolute error 3.8e-7, largest relative error 4.2e-5 on
// entries above 1e-3, loss 7e-9 relative, i.e. 1/55 of the tolerance at
// worst, while a wrong or missing term moves entries by >= 1e-3.
TEST(GptTest, ForwardBackwardMatchesTheReference) {
  const model::GptDims dims = Tiny();
  const std::vector<int32_t> tokens = TinyTokens(23, 11);
  Gpt gpt = MakeGpt(dims, tokens);
  EXPECT_EQ(gpt.num_samples(), 18);  // (23 - 5) / gcd(5, 18)
  const Floats params = TestParams(gpt.spec(), 5);
  const std::vector<int64_t> samples = {0, 7, 7, 17};
  const Result got = Whole(gpt, params, samples);
  reference::GptTensors want;
  const double want_loss =
      reference::GptRefLossAndGrad(RefDims(dims), ToDouble(params), tokens, samples, &want);
  EXPECT_NEAR(got.loss, want_loss, 1e-6 * want_loss);
  ASSERT_EQ(got.grads.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got.grads[i].size(), want[i].size());
    for (size_t k = 0; k < want[i].size(); ++k) {
      const double err = std::abs(got.grads[i][k] - want[i][k]);
      EXPECT_LE(err, 1e-5 + 1e-4 * std::abs(want[i][k])) << "param " << i << " [" << k << "]";
    }
  }

  // A second call with fewer samples reuses the scratch.
  const Result again = Whole(gpt, params, {3});
  const double want_again =
      reference::GptRefLossAndGrad(RefDims(dims), ToDouble(params), tokens, {3}, nullptr);
  EXPECT_NEAR(again.loss, want_again, 1e-6 * want_again);
}

// ---------------------------------------------------------------- streaming

void ExpectSame(const Result& want, double loss, const RecordingAccess& access) {
  EXPECT_EQ(std::memcmp(&want.loss, &loss, sizeof loss), 0) << want.loss << " vs " << loss;
  ASSERT_EQ(want.grads.size(), access.grads().size());
  for (size_t i = 0; i < want.grads.size(); ++i) {
    EXPECT_TRUE(BitEqual(want.grads[i], access.grads()[i])) << "gradient " << i;
  }
  for (int c : access.committed()) EXPECT_EQ(c, 1);
  EXPECT_EQ(access.acquired_now(), 0);
}

TEST(GptTest, ByUnitIsBitIdenticalInTheDocumentedOrder) {
  Gpt gpt = MakeGpt(Tiny(), TinyTokens(23, 11));
  const Floats params = TestParams(gpt.spec(), 8);
  const std::vector<int64_t> samples = {2, 9, 9, 0, 16};
  const Result want = Whole(gpt, params, samples);
  for (int call = 0; call < 2; ++call) {  // the second reuses the scratch
    RecordingAccess access(gpt.spec(), params);
    absl::StatusOr<double> loss = gpt.ForwardBackwardByUnit(call, access, samples);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ExpectSame(want, *loss, access);
    // embed = 0, h.0 = 1, h.1 = 2, head = 3.
    EXPECT_THAT(access.calls(),
                ElementsAreArray({"A0", "R0", "A1", "R1", "A2", "R2",              // forward
                                  "A3", "A0", "G3", "G0", "C3", "R3", "R0",        // head
                                  "A2", "G2", "C2", "R2", "A1", "G1", "C1", "R1",  // blocks
                                  "C0"}));
    EXPECT_EQ(access.max_acquired(), 2);
    EXPECT_EQ(access.max_grads(), 2);
  }
}

TEST(GptTest, ByUnitOneLayer) {
  Gpt gpt = MakeGpt(Tiny(1), TinyTokens(19, 11, 4));
  const Floats params = TestParams(gpt.spec(), 2);
  const Result want = Whole(gpt, params, {1, 3});
  RecordingAccess access(gpt.spec(), params);
  absl::StatusOr<double> loss = gpt.ForwardBackwardByUnit(0, access, {1, 3});
  ASSERT_TRUE(loss.ok()) << loss.status();
  ExpectSame(want, *loss, access);
  EXPECT_THAT(access.calls(), ElementsAreArray({"A0", "R0", "A1", "R1", "A2", "A0", "G2", "G0",
                                                "C2", "R2", "R0", "A1", "G1", "C1", "R1", "C0"}));
}

TEST(GptTest, ByUnitReleasesWhatItHoldsOnAnAccessError) {
  Gpt gpt = MakeGpt(Tiny(), TinyTokens(23, 11));
  const Floats params = TestParams(gpt.spec(), 8);
  // Fail each Acquire / GradientBuffers call of the documented sequence.
  // {call, units held when it fails}: after the failure, only their releases.
  const std::vector<std::pair<size_t, size_t>> cases = {{0, 0}, {2, 0},  {6, 0},  {7, 1},  {8, 2},
                                                        {9, 2}, {13, 0}, {14, 1}, {17, 0}, {18, 1}};
  for (const auto& [at, held] : cases) {
    RecordingAccess access(gpt.spec(), params);
    access.FailCall(at);
    absl::StatusOr<double> loss = gpt.ForwardBackwardByUnit(0, access, {1, 2});
    EXPECT_EQ(loss.status().code(), absl::StatusCode::kUnavailable) << "call " << at;
    EXPECT_EQ(access.acquired_now(), 0) << "call " << at;
    EXPECT_EQ(access.calls().size(), at + 1 + held) << "call " << at;
  }
}

// ----------------------------------------------------------------
// initialisation

Floats Initial(const Gpt& gpt, uint64_t seed) {
  Floats params = ZerosLike(gpt.spec());
  std::vector<float*> p = Ptrs(params);
  EXPECT_TRUE(gpt.Initialize(seed, absl::MakeSpan(p)).ok());
  return params;
}

TEST(GptTest, InitializeUnitMatchesInitialize) {
  Gpt gpt = MakeGpt(Tiny(3), TinyTokens(23, 11));
  const Floats want = Initial(gpt, 42);
  size_t flat = 0;
  for (size_t u = 0; u < gpt.spec().units.size(); ++u) {
    Floats got;
    for (size_t j = 0; j < gpt.spec().units[u].params.size(); ++j) {
      got.emplace_back(want[flat + j].size(), -7.0f);
    }
    std::vector<float*> p = Ptrs(got);
    ASSERT_TRUE(gpt.InitializeUnit(42, static_cast<int>(u), absl::MakeSpan(p)).ok());
    for (size_t j = 0; j < got.size(); ++j) {
      EXPECT_TRUE(BitEqual(got[j], want[flat + j])) << "unit " << u << " tensor " << j;
    }
    flat += got.size();
  }
  std::vector<float*> none;
  EXPECT_EQ(gpt.InitializeUnit(42, 5, absl::MakeSpan(none)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpt.InitializeUnit(42, 0, absl::MakeSpan(none)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(BitEqual(Initial(gpt, 43)[0], want[0]));
}

// The formula of gpt.h, written out again from rng.h's UniformAt.
float DocumentedNormal(uint64_t seed, uint64_t param, uint64_t e, double sigma) {
  const double u1 = (static_cast<double>(UniformAt(seed, param, 2 * e)) + 1.0) / 2.0 + 0x1p-24;
  const double u2 = (static_cast<double>(UniformAt(seed, param, 2 * e + 1)) + 1.0) / 2.0;
  const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  return static_cast<float>(sigma * z);
}

TEST(GptTest, InitializationFollowsTheDocumentedFormula) {
  const model::GptDims dims = Tiny(3);
  Gpt gpt = MakeGpt(dims, TinyTokens(23, 11));
  const Floats init = Initial(gpt, 1234);
  const double scaled = 0.02 / std::sqrt(6.0);
  // flat index -> sigma, for block 1 (base 14) and the embedding.
  const std::vector<std::pair<int, double>> normals = {{0, 0.02},    {1, 0.02},  {16, 0.02},
                                                       {18, scaled}, {22, 0.02}, {24, scaled}};
  for (const auto& [i, sigma] : normals) {
    for (uint64_t e : {uint64_t{0}, uint64_t{1}, uint64_t{37}, init[i].size() - 1}) {
      EXPECT_EQ(init[i][e], DocumentedNormal(1234, i, e, sigma))
          << "param " << i << " [" << e << "]";
    }
  }
  const double u1 = (UniformAt(1234, 16, 10) + 1.0) / 2.0 + 0x1p-24;
  const double u2 = (UniformAt(1234, 16, 11) + 1.0) / 2.0;
  EXPECT_EQ(GptStandardNormal(1234, 16, 5),
            std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
}

// Mean and standard deviation of every matrix within 5 standard errors:
// se(mean) = sigma / sqrt(n), se(std) ~ sigma / sqrt(2 n) for a normal.
TEST(GptTest, InitializationStatistics) {
  const model::GptDims dims = {512, 64, 3, 4, 64, 16};
  Gpt gpt = MakeGpt(dims, TinyTokens(40, 512));
  const Floats init = Initial(gpt, 7);
  const double scaled = 0.02 / std::sqrt(6.0);
  size_t flat = 0;
  for (const plan::UnitSpec& unit : gpt.spec().units) {
    for (const plan::ParamSpec& p : unit.params) {
      const std::vector<float>& v = init[flat++];
      if (p.shape.size() == 1) {  // biases 0, LayerNorm weights 1, exactly
        const float want = p.name.ends_with(".weight") ? 1.0f : 0.0f;
        EXPECT_TRUE(std::all_of(v.begin(), v.end(), [&](float x) { return x == want; })) << p.name;
        continue;
      }
      const double sigma = p.name.ends_with("c_proj.weight") ? scaled : 0.02;
      double sum = 0, sq = 0;
      for (float x : v) sum += x;
      const double n = static_cast<double>(v.size());
      const double mean = sum / n;
      for (float x : v) sq += (x - mean) * (x - mean);
      const double sd = std::sqrt(sq / n);
      EXPECT_NEAR(mean, 0.0, 5 * sigma / std::sqrt(n)) << p.name;
      EXPECT_NEAR(sd, sigma, 5 * sigma / std::sqrt(2 * n)) << p.name;
    }
  }
}

// ---------------------------------------------------------------- loss only

TEST(GptTest, LossAndLossByUnitEqualForwardBackwardsLoss) {
  const std::vector<int32_t> tokens = TinyTokens(23, 11);
  Gpt gpt = MakeGpt(Tiny(), tokens);
  const Floats params = TestParams(gpt.spec(), 3);
  const std::vector<int64_t> samples = {4, 4, 11, 0, 5, 6};
  const Result want = Whole(gpt, params, samples);
  std::vector<const float*> p = ConstPtrs(params);
  absl::StatusOr<double> loss = gpt.Loss(p, gpt.train(), samples);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(*loss, want.loss);
  RecordingAccess access(gpt.spec(), params);
  loss = gpt.LossByUnit(access, gpt.train(), samples);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(*loss, want.loss);
  EXPECT_THAT(access.calls(),
              ElementsAreArray({"A0", "R0", "A1", "R1", "A2", "R2", "A3", "R3", "A0", "R0"}));
  EXPECT_EQ(access.max_acquired(), 1);

  // Another stream (validation data, its own window period): the reference.
  const std::vector<int32_t> val = TinyTokens(13, 11, 5);
  InMemoryTokens val_stream(val);
  loss = gpt.Loss(p, val_stream, {0, 7});
  ASSERT_TRUE(loss.ok()) << loss.status();
  const double ref =
      reference::GptRefLossAndGrad(RefDims(Tiny()), ToDouble(params), val, {0, 7}, nullptr);
  EXPECT_NEAR(*loss, ref, 1e-6 * ref);
  EXPECT_THAT(gpt.Loss(p, val_stream, {8}).status().message(), HasSubstr("outside [0, 8)"));
  InMemoryTokens short_stream({1, 2, 3, 4, 5});
  EXPECT_THAT(gpt.Loss(p, short_stream, {0}).status().message(), HasSubstr("5 tokens"));
}

// ---------------------------------------------------------------- QK-clip

// Each head's largest logit, against the reference's (its own q.k / sqrt(D)
// in double over causal positions): raised by training passes only, across
// calls until reset, the same whole and by unit.
TEST(GptTest, AttentionLogitsAreEachHeadsLargestCausalLogit) {
  const model::GptDims dims = Tiny();
  const std::vector<int32_t> tokens = TinyTokens(23, 11);
  Gpt gpt = MakeGpt(dims, tokens);
  ASSERT_EQ(gpt.attention_layers(), 2);
  ASSERT_EQ(gpt.attention_heads(), 2);
  for (float v : gpt.attention_logits()) EXPECT_EQ(v, -std::numeric_limits<float>::infinity());
  const Floats params = TestParams(gpt.spec(), 5);
  std::vector<double> want;
  reference::GptRefLossAndGrad(RefDims(dims), ToDouble(params), tokens, {0, 7, 7, 17}, nullptr,
                               &want);
  ASSERT_EQ(want.size(), 4u);
  // Two calls (a step's micro-batches) without a reset: the max of both.
  Whole(gpt, params, {0, 7});
  Whole(gpt, params, {7, 17});
  std::vector<float> got(gpt.attention_logits().begin(), gpt.attention_logits().end());
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-5 + 1e-5 * std::abs(want[i])) << "layer " << i / 2 << " head "
                                                                   << i % 2;
  }
  EXPECT_NE(want[0], want[1]);  // heads differ, so a mixed-up index shows

  // Loss-only passes (validation) leave them alone.
  gpt.ResetAttentionLogits();
  std::vector<const float*> p = ConstPtrs(params);
  ASSERT_TRUE(gpt.Loss(p, gpt.train(), {0, 7}).ok());
  for (float v : gpt.attention_logits()) EXPECT_EQ(v, -std::numeric_limits<float>::infinity());

  // By unit: the same values as the whole pass on the same samples.
  Whole(gpt, params, {0, 7, 7, 17});
  got.assign(gpt.attention_logits().begin(), gpt.attention_logits().end());
  gpt.ResetAttentionLogits();
  RecordingAccess access(gpt.spec(), params);
  ASSERT_TRUE(gpt.ForwardBackwardByUnit(0, access, {0, 7, 7, 17}).ok());
  EXPECT_THAT(gpt.attention_logits(), ElementsAreArray(got));
}

// The rows MuonClip scales: head h's query rows [h D, (h+1) D) and key rows
// C + [h D, (h+1) D) of its layer's c_attn.weight (flat 2 + 12 l + 2), by
// sqrt(tau / S); nothing for heads at or below tau.
TEST(GptTest, QkClipRowsAreTheClippedHeadsQueryAndKeyRows) {
  Gpt gpt = MakeGpt(Tiny(), TinyTokens(23, 11));
  const std::vector<float> logits = {3.0f, 9.0f, 4.0f, 16.0f};  // [layer][head]
  const std::vector<RowScale> rows = gpt.QkClipRows(logits, 4.0);
  ASSERT_EQ(rows.size(), 4u);  // heads (0, 1) and (1, 1); (1, 0) sits at tau
  const int64_t d = 8 / 2;
  struct Want {
    int32_t flat;
    int64_t row_start;
    double factor;
  };
  const Want want[] = {{4, d, std::sqrt(4.0 / 9.0)}, {4, 8 + d, std::sqrt(4.0 / 9.0)},
                       {16, d, 0.5}, {16, 8 + d, 0.5}};
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].flat, want[i].flat) << i;
    EXPECT_EQ(rows[i].row_start, want[i].row_start) << i;
    EXPECT_EQ(rows[i].rows, d) << i;
    EXPECT_FLOAT_EQ(rows[i].factor, static_cast<float>(want[i].factor)) << i;
    EXPECT_EQ(gpt.spec().units[1 + (rows[i].flat - 4) / 12].params[2].name,
              absl::StrCat("h.", (rows[i].flat - 4) / 12, ".attn.c_attn.weight"));
  }
  EXPECT_TRUE(gpt.QkClipRows(logits, 20.0).empty());
}

// ---------------------------------------------------------------- errors

TEST(GptTest, RejectsBadTokensSamplesAndPointers) {
  std::vector<int32_t> tokens = TinyTokens(23, 11);
  tokens[12] = 11;  // in the windows of samples 2 (starts at 10) and 6 (at 12)
  tokens[20] = -3;  // in sample 3's (at 15)
  Gpt gpt = MakeGpt(Tiny(), tokens);
  const Floats params = TestParams(gpt.spec(), 1);
  Floats grads = ZerosLike(gpt.spec());
  std::vector<const float*> p = ConstPtrs(params);
  std::vector<float*> g = Ptrs(grads);
  auto run = [&](std::vector<int64_t> samples) {
    return gpt.ForwardBackward(0, p, samples, absl::MakeSpan(g)).status();
  };
  EXPECT_TRUE(run({0, 1}).ok());  // [0, 6) and [5, 11)
  for (auto& t : grads) std::fill(t.begin(), t.end(), 0.0f);
  absl::Status st = run({0, 2});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("token 12"));
  EXPECT_THAT(st.message(), HasSubstr("is 11"));
  // In memory, the stream names the position (a file names its byte offset:
  // token_files_test).
  EXPECT_THAT(run({3}).message(),
              HasSubstr("token 20 (in sample 3; token 20 of the stream) is -3"));
  for (const auto& t : grads) {  // untouched on error
    EXPECT_TRUE(std::all_of(t.begin(), t.end(), [](float x) { return x == 0.0f; }));
  }
  st = run({18});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("samples[0] = 18 is outside [0, 18)"));
  EXPECT_THAT(run({-1}).message(), HasSubstr("outside"));
  st = run({});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("empty"));

  RecordingAccess access(gpt.spec(), params);  // checked before any call
  EXPECT_EQ(gpt.ForwardBackwardByUnit(0, access, {2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpt.LossByUnit(access, gpt.train(), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(access.calls().empty());

  std::vector<const float*> short_p(p.begin(), p.end() - 1);
  EXPECT_THAT(gpt.ForwardBackward(0, short_p, {0}, absl::MakeSpan(g)).status().message(),
              HasSubstr("got 27 tensors"));
  g[3] = nullptr;
  EXPECT_THAT(gpt.ForwardBackward(0, p, {0}, absl::MakeSpan(g)).status().message(),
              HasSubstr("null"));
  p[5] = nullptr;
  EXPECT_EQ(gpt.Loss(p, gpt.train(), {0}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GptTest, CreateRejectsBadDimsAndData) {
  auto stream = std::make_shared<InMemoryTokens>(TinyTokens(23, 11));
  model::GptDims dims = Tiny();
  dims.n_embd = 9;
  absl::StatusOr<Gpt> gpt = Gpt::Create(dims, stream);
  EXPECT_EQ(gpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gpt.status().message(), HasSubstr("n_embd"));
  dims = Tiny();
  dims.seq_len = 9;
  EXPECT_THAT(Gpt::Create(dims, stream).status().message(), HasSubstr("seq_len"));
  gpt = Gpt::Create(Tiny(), std::make_shared<InMemoryTokens>(TinyTokens(5, 11)));
  EXPECT_EQ(gpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gpt.status().message(), HasSubstr("data"));
  EXPECT_THAT(Gpt::Create(Tiny(), nullptr).status().message(), HasSubstr("data"));
  EXPECT_TRUE(Gpt::Create(Tiny(), std::make_shared<InMemoryTokens>(TinyTokens(6, 11))).ok());
}

// ---------------------------------------------------------------- spec file

// Just enough JSON for the spec file: objects, arrays, strings without
// escapes, numbers.
struct Json {
  std::string str;  // a string, or a number's text
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;

  const Json& operator[](const std::string& key) const {
    for (const auto& [k, v] : fields) {
      if (k == key) return v;
    }
    ADD_FAILURE() << "no field " << key;
    static const Json kNone;
    return kNone;
  }
};

class JsonReader {
 public:
  explicit JsonReader(std::string text) : s_(std::move(text)) {}
  Json Value() {
    Json j;
    Skip();
    if (pos_ >= s_.size()) return j;
    const char ch = s_[pos_];
    if (ch == '{' || ch == '[') {
      ++pos_;
      for (Skip(); pos_ < s_.size() && s_[pos_] != (ch == '{' ? '}' : ']'); Skip()) {
        if (s_[pos_] == ',') ++pos_;
        if (ch == '[') {
          j.items.push_back(Value());
          continue;
        }
        std::string key = Value().str;
        Skip();
        ++pos_;  // ':'
        j.fields.emplace_back(std::move(key), Value());
      }
      ++pos_;
    } else if (ch == '"') {
      const size_t end = s_.find('"', pos_ + 1);
      j.str = s_.substr(pos_ + 1, end - pos_ - 1);
      pos_ = end + 1;
    } else {
      const size_t start = pos_;
      while (pos_ < s_.size() && (std::isalnum(s_[pos_]) || s_[pos_] == '-' || s_[pos_] == '.')) {
        ++pos_;
      }
      j.str = s_.substr(start, pos_ - start);
    }
    return j;
  }

 private:
  void Skip() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  std::string s_;
  size_t pos_ = 0;
};

TEST(GptSpecFileTest, Gpt2SizeMatchesTheSharedSpecFile) {
  const std::string path = MUONMESH_SPECS_DIR "/gpt2-124m.json";
  std::ifstream in(path);
  if (!in) GTEST_SKIP() << path << " is missing";
  std::stringstream text;
  text << in.rdbuf();
  const Json file = JsonReader(text.str()).Value();
  absl::StatusOr<plan::ModelSpec> spec = model::GptSpec({50257, 1024, 12, 12, 768, 1024});
  ASSERT_TRUE(spec.ok()) << spec.status();
  const std::vector<Json>& units = file["units"].items;
  ASSERT_EQ(units.size(), spec->units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    const plan::UnitSpec& want = spec->units[u];
    EXPECT_EQ(units[u]["name"].str, want.name);
    const std::vector<Json>& params = units[u]["params"].items;
    ASSERT_EQ(params.size(), want.params.size()) << want.name;
    for (size_t j = 0; j < params.size(); ++j) {
      EXPECT_EQ(params[j]["name"].str, want.params[j].name);
      EXPECT_EQ(params[j]["optimizer"].str, want.params[j].optimizer) << want.params[j].name;
      std::vector<int64_t> shape;
      for (const Json& d : params[j]["shape"].items) shape.push_back(std::stoll(d.str));
      EXPECT_EQ(shape, want.params[j].shape) << want.params[j].name;
    }
  }
}

}  // namespace
}  // namespace muonmesh::worker
