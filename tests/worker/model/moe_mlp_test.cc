// The moe_mlp workload against the definition written out here: a plain-loop
// double forward pass (the loss, and central differences for the gradients),
// the documented initialisation element by element, and expert parallelism
// (ranks as threads exchanging tokens over the in-process communicator)
// against the whole batch on one rank.

#include "worker/model/moe_mlp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator.h"
#include "worker/comm/inprocess_communicator.h"
#include "worker/model/rng.h"

namespace muonmesh::worker {
namespace {

using ::testing::HasSubstr;

std::vector<std::vector<float>> ZerosLike(const plan::ModelSpec& spec) {
  std::vector<std::vector<float>> out;
  for (const auto& unit : spec.units) {
    for (const auto& p : unit.params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      out.emplace_back(static_cast<size_t>(n), 0.0f);
    }
  }
  return out;
}

template <typename T>
std::vector<T*> Ptrs(std::vector<std::vector<float>>& t) {
  std::vector<T*> p;
  for (auto& v : t) p.push_back(v.data());
  return p;
}

// The definition, in double. Returns the expert each sample takes in
// `experts` when given.
double DoubleLoss(const MoeMlpDims& dm, const std::vector<std::vector<double>>& p,
                  const std::vector<float>& x, const std::vector<float>& y,
                  const std::vector<int64_t>& samples, std::vector<int>* experts = nullptr) {
  const int64_t d = dm.d_model, de = dm.d_expert, ne = dm.num_experts;
  double total = 0;
  for (int64_t s : samples) {
    std::vector<double> h(d), logits(ne), a(de), z(d);
    for (int64_t j = 0; j < d; ++j) {
      double acc = p[1][j];
      for (int64_t c = 0; c < dm.d_in; ++c) acc += p[0][j * dm.d_in + c] * x[s * dm.d_in + c];
      h[j] = std::tanh(acc);
    }
    double m = -1e300;
    for (int64_t e = 0; e < ne; ++e) {
      logits[e] = 0;
      for (int64_t j = 0; j < d; ++j) logits[e] += p[2][e * d + j] * h[j];
      m = std::max(m, logits[e]);
    }
    double sum = 0;
    for (int64_t e = 0; e < ne; ++e) sum += std::exp(logits[e] - m);
    int best = 0;
    for (int64_t e = 1; e < ne; ++e) {
      if (logits[e] > logits[best]) best = static_cast<int>(e);
    }
    if (experts != nullptr) experts->push_back(best);
    const double gate = std::exp(logits[best] - m) / sum;
    for (int64_t k = 0; k < de; ++k) {
      double acc = 0;
      for (int64_t j = 0; j < d; ++j) acc += p[3][(best * de + k) * d + j] * h[j];
      a[k] = std::tanh(acc);
    }
    for (int64_t j = 0; j < d; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < de; ++k) acc += p[4][(best * d + j) * de + k] * a[k];
      z[j] = h[j] + gate * acc;
    }
    for (int64_t o = 0; o < dm.d_out; ++o) {
      double acc = p[6][o];
      for (int64_t j = 0; j < d; ++j) acc += p[5][o * d + j] * z[j];
      const double diff = acc - y[s * dm.d_out + o];
      total += diff * diff;
    }
  }
  return total / static_cast<double>(samples.size() * dm.d_out);
}

const MoeMlpDims kDims{3, 5, 4, 4, 2};

std::vector<std::vector<float>> Init(const MoeMlp& moe, uint64_t seed) {
  std::vector<std::vector<float>> params = ZerosLike(moe.spec());
  std::vector<float*> p = Ptrs<float>(params);
  EXPECT_TRUE(moe.Initialize(seed, absl::MakeSpan(p)).ok());
  return params;
}

TEST(MoeMlpTest, SpecNamesShapesOptimizersAndExperts) {
  absl::StatusOr<plan::ModelSpec> spec = MoeMlpSpec(kDims);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->units.size(), 3u);
  EXPECT_EQ(spec->units[0].name, "input");
  EXPECT_EQ(spec->units[1].name, "moe");
  EXPECT_EQ(spec->units[2].name, "output");
  std::vector<std::string> names, optimizers;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<bool> expert;
  for (const auto& u : spec->units) {
    for (const auto& p : u.params) {
      names.push_back(p.name);
      optimizers.push_back(p.optimizer);
      shapes.push_back(p.shape);
      expert.push_back(p.expert);
    }
  }
  EXPECT_THAT(names, ::testing::ElementsAre("input.weight", "input.bias", "router.weight",
                                            "experts.w1", "experts.w2", "output.weight",
                                            "output.bias"));
  EXPECT_THAT(optimizers, ::testing::ElementsAre("muon", "adamw", "adamw", "muon", "muon",
                                                 "muon", "adamw"));
  const std::vector<std::vector<int64_t>> want = {{5, 3}, {5}, {4, 5}, {4, 4, 5},
                                                  {4, 5, 4}, {2, 5}, {2}};
  EXPECT_EQ(shapes, want);
  EXPECT_THAT(expert, ::testing::ElementsAre(false, false, false, true, true, false, false));
}

TEST(MoeMlpTest, InitialisationFollowsTheDocumentedFormula) {
  absl::StatusOr<MoeMlp> moe = MoeMlp::FromTeacher(kDims, 1, 4);
  ASSERT_TRUE(moe.ok());
  const std::vector<std::vector<float>> params = Init(*moe, 77);
  const double fan_in[7] = {3, 3, 5, 5, 4, 5, 5};
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t k = 0; k < params[p].size(); ++k) {
      const float want = static_cast<float>(static_cast<double>(UniformAt(77, p, k)) /
                                            std::sqrt(fan_in[p]));
      ASSERT_EQ(params[p][k], want) << "param " << p << " element " << k;
    }
  }
}

TEST(MoeMlpTest, TeacherDataFollowsTheDefinitionAndTheTeacherHasZeroLoss) {
  const int64_t n = 16;
  absl::StatusOr<MoeMlp> moe = MoeMlp::FromTeacher(kDims, 5, n);
  ASSERT_TRUE(moe.ok()) << moe.status();
  for (int64_t k = 0; k < n * kDims.d_in; ++k) {
    ASSERT_EQ(moe->x()[k], UniformAt(5, 1'000'000, k));
  }
  // y is the teacher (seed 6) on x: the double definition agrees to fp32.
  std::vector<std::vector<float>> teacher = Init(*moe, 6);
  std::vector<std::vector<double>> p;
  for (const auto& t : teacher) p.emplace_back(t.begin(), t.end());
  std::vector<int64_t> all(n);
  for (int64_t s = 0; s < n; ++s) all[s] = s;
  std::vector<float> zeros(moe->y().size(), 0.0f);
  const double mean_square = DoubleLoss(kDims, p, moe->x(), zeros, all);
  EXPECT_GT(mean_square, 1e-3);
  EXPECT_LT(DoubleLoss(kDims, p, moe->x(), moe->y(), all), 1e-10 * mean_square);

  // The student holding the teacher's weights: loss and gradients exactly 0.
  std::vector<std::vector<float>> grads = ZerosLike(moe->spec());
  absl::StatusOr<double> loss =
      moe->ForwardBackward(0, Ptrs<const float>(teacher), all, Ptrs<float>(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(*loss, 0.0);
  for (const auto& g : grads) {
    for (float v : g) ASSERT_EQ(v, 0.0f);
  }
}

TEST(MoeMlpTest, GradientsMatchCentralDifferencesInDouble) {
  absl::StatusOr<MoeMlp> moe = MoeMlp::FromTeacher(kDims, 3, 24);
  ASSERT_TRUE(moe.ok()) << moe.status();
  const std::vector<int64_t> samples = {0, 3, 5, 6, 1, 9, 12, 15, 18, 21, 23, 7};
  // The first initialisation whose routing spreads the samples over at
  // least three experts (a larger router makes that likely).
  std::vector<std::vector<float>> params;
  std::vector<std::vector<double>> p;
  std::vector<int> experts;
  for (uint64_t seed = 1; seed < 100; ++seed) {
    params = Init(*moe, seed);
    for (float& v : params[2]) v *= 8;
    p.clear();
    for (const auto& t : params) p.emplace_back(t.begin(), t.end());
    experts.clear();
    DoubleLoss(kDims, p, moe->x(), moe->y(), samples, &experts);
    if (std::set<int>(experts.begin(), experts.end()).size() >= 3) break;
  }
  ASSERT_GE(std::set<int>(experts.begin(), experts.end()).size(), 3u);

  std::vector<std::vector<float>> grads = ZerosLike(moe->spec());
  absl::StatusOr<double> loss =
      moe->ForwardBackward(0, Ptrs<const float>(params), samples, Ptrs<float>(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();
  const double reference = DoubleLoss(kDims, p, moe->x(), moe->y(), samples);
  EXPECT_GT(reference, 1e-3);
  EXPECT_NEAR(*loss, reference, 1e-6 * reference);

  constexpr double kH = 1e-6;
  double max_grad = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    double max_param_grad = 0;
    for (size_t k = 0; k < p[i].size(); ++k) {
      const double saved = p[i][k];
      p[i][k] = saved + kH;
      const double plus = DoubleLoss(kDims, p, moe->x(), moe->y(), samples);
      p[i][k] = saved - kH;
      const double minus = DoubleLoss(kDims, p, moe->x(), moe->y(), samples);
      p[i][k] = saved;
      const double fd = (plus - minus) / (2 * kH);
      max_param_grad = std::max(max_param_grad, std::abs(fd));
      EXPECT_NEAR(grads[i][k], fd, 2e-6 + 5e-5 * std::abs(fd))
          << "param " << i << " element " << k;
    }
    EXPECT_GT(max_param_grad, 1e-4) << "param " << i << " has no gradient to check";
    max_grad = std::max(max_grad, max_param_grad);
  }
  EXPECT_GT(max_grad, 1e-2);
}

// One expert-parallel rank: whole dense tensors, its E/EP experts, tokens
// over an in-process group.
class ExpertRank final : public UnitAccess {
 public:
  ExpertRank(const std::vector<std::vector<float>>& whole, int ep, int index,
             comm::Communicator* group)
      : ep_(ep), index_(index), group_(group) {
    for (size_t p = 0; p < whole.size(); ++p) {
      if (p == 3 || p == 4) {  // expert stacks: my block
        const size_t local = whole[p].size() / ep;
        params_.emplace_back(whole[p].begin() + index * local,
                             whole[p].begin() + (index + 1) * local);
      } else {
        params_.push_back(whole[p]);
      }
      grads_.emplace_back(params_.back().size(), std::nanf(""));
    }
    for (auto& t : params_) pp_.push_back(t.data());
    for (auto& t : grads_) gp_.push_back(t.data());
  }
  absl::StatusOr<absl::Span<const float* const>> Acquire(int u) override {
    return absl::MakeConstSpan(pp_).subspan(kFirst[u], kCount[u]);
  }
  void Release(int) override {}
  absl::StatusOr<absl::Span<float* const>> GradientBuffers(int u) override {
    return absl::MakeConstSpan(gp_).subspan(kFirst[u], kCount[u]);
  }
  absl::Status Commit(int) override { return absl::OkStatus(); }
  int expert_parallel_size() const override { return ep_; }
  int expert_parallel_index() const override { return index_; }
  absl::Status ExchangeTokens(const float* send, absl::Span<const int64_t> send_counts,
                              float* recv, absl::Span<const int64_t> recv_counts) override {
    ++exchanges_;
    return group_->AllToAllV(send, send_counts, recv, recv_counts);
  }
  const std::vector<std::vector<float>>& grads() const { return grads_; }
  int exchanges() const { return exchanges_; }

 private:
  static constexpr size_t kFirst[3] = {0, 2, 5};
  static constexpr size_t kCount[3] = {2, 3, 2};
  int ep_, index_;
  comm::Communicator* group_;
  std::vector<std::vector<float>> params_, grads_;
  std::vector<const float*> pp_;
  std::vector<float*> gp_;
  int exchanges_ = 0;
};

class MoeMlpExpertParallelTest : public ::testing::TestWithParam<int> {};

TEST_P(MoeMlpExpertParallelTest, RanksTogetherMatchTheWholeBatch) {
  const int ep = GetParam();
  const MoeMlpDims dims{3, 6, 4, 4, 2};
  absl::StatusOr<MoeMlp> whole = MoeMlp::FromTeacher(dims, 8, 40);
  ASSERT_TRUE(whole.ok());
  std::vector<std::vector<float>> params = Init(*whole, 2);
  for (float& v : params[2]) v *= 8;
  const int64_t per_rank = 6;
  std::vector<int64_t> batch;
  for (int64_t j = 0; j < per_rank * ep; ++j) batch.push_back((7 * j + 3) % 40);
  std::vector<std::vector<float>> want = ZerosLike(whole->spec());
  absl::StatusOr<double> want_loss = whole->ForwardBackward(0, Ptrs<const float>(params), batch,
                                                            Ptrs<float>(want));
  ASSERT_TRUE(want_loss.ok());

  comm::GroupOptions options;
  options.hub = std::make_shared<comm::InProcessHub>();
  options.connect_timeout = absl::Seconds(20);
  std::vector<double> losses(ep);
  std::vector<std::unique_ptr<ExpertRank>> ranks(ep);
  std::vector<absl::Status> errors(ep);
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<comm::Communicator>> c =
          comm::CreateInProcessCommunicator("ep", r, ep, options);
      if (!c.ok()) {
        errors[r] = c.status();
        return;
      }
      absl::StatusOr<MoeMlp> moe = MoeMlp::Create(dims, whole->x(), whole->y());
      if (!moe.ok()) {
        errors[r] = moe.status();
        return;
      }
      ranks[r] = std::make_unique<ExpertRank>(params, ep, r, c->get());
      std::vector<int64_t> mine(batch.begin() + r * per_rank,
                                batch.begin() + (r + 1) * per_rank);
      absl::StatusOr<double> loss = moe->ForwardBackwardByUnit(0, *ranks[r], mine);
      errors[r] = loss.status();
      losses[r] = loss.value_or(0);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ep; ++r) ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r];

  double mean = 0;
  for (double l : losses) mean += l / ep;
  EXPECT_NEAR(mean, *want_loss, 1e-6 * *want_loss);
  EXPECT_EQ(ranks[0]->exchanges(), 5);  // counts, tokens, outputs; dL/do, dL/dh
  for (size_t p = 0; p < want.size(); ++p) {
    const bool stack = p == 3 || p == 4;
    const size_t local = want[p].size() / (stack ? ep : 1);
    double max_abs = 0;
    for (size_t k = 0; k < want[p].size(); ++k) {
      max_abs = std::max(max_abs, std::abs(static_cast<double>(want[p][k])));
      double got = 0;
      if (stack) {
        // The expert's rank holds its gradient (the mean over EP ranks).
        got = ranks[k / local]->grads()[p][k % local];
      } else {
        // Dense gradients: the runtime averages them over the ranks.
        for (int r = 0; r < ep; ++r) got += ranks[r]->grads()[p][k] / ep;
      }
      ASSERT_NEAR(got, want[p][k], 1e-6 + 1e-4 * std::abs(want[p][k]))
          << "param " << p << " element " << k;
    }
    EXPECT_GT(max_abs, 1e-5) << "param " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Ep, MoeMlpExpertParallelTest, ::testing::Values(1, 2, 4));

TEST(MoeMlpTest, RejectsBadDimsAndData) {
  EXPECT_THAT(std::string(MoeMlpSpec({0, 4, 4, 2, 1}).status().message()), HasSubstr("d_in"));
  EXPECT_THAT(std::string(MoeMlpSpec({2, 4, 4, 0, 1}).status().message()),
              HasSubstr("num_experts"));
  EXPECT_THAT(std::string(MoeMlpSpec({2, kMoeMaxDim + 1, 4, 2, 1}).status().message()),
              HasSubstr("d_model"));
  EXPECT_THAT(std::string(MoeMlp::Create(kDims, {1, 2}, {1}).status().message()),
              HasSubstr("x has 2 elements"));
  EXPECT_THAT(std::string(MoeMlp::Create(kDims, {1, 2, 3}, {1}).status().message()),
              HasSubstr("y has 1 elements"));
  EXPECT_THAT(std::string(MoeMlp::Create(kDims, {1, NAN, 3}, {1, 2}).status().message()),
              HasSubstr("x[1] is not finite"));
  EXPECT_FALSE(MoeMlp::FromTeacher(kDims, 1, 0).ok());
}

TEST(MoeMlpTest, ForwardBackwardRejectsBadInputAndWritesNothing) {
  absl::StatusOr<MoeMlp> moe = MoeMlp::FromTeacher(kDims, 3, 5);
  ASSERT_TRUE(moe.ok());
  std::vector<std::vector<float>> params = Init(*moe, 1);
  std::vector<std::vector<float>> grads = ZerosLike(moe->spec());
  for (auto& g : grads) std::fill(g.begin(), g.end(), 7.0f);
  auto run = [&](std::vector<int64_t> samples) {
    return moe->ForwardBackward(0, Ptrs<const float>(params), samples,
                                Ptrs<float>(grads))
        .status();
  };
  EXPECT_THAT(std::string(run({}).message()), HasSubstr("empty"));
  EXPECT_THAT(std::string(run({0, 5}).message()), HasSubstr("samples[1] = 5"));
  EXPECT_THAT(std::string(run({-1}).message()), HasSubstr("samples[0] = -1"));
  std::vector<const float*> six = Ptrs<const float>(params);
  six.pop_back();
  EXPECT_EQ(moe->ForwardBackward(0, six, {0}, Ptrs<float>(grads)).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const auto& g : grads) {
    for (float v : g) ASSERT_EQ(v, 7.0f);
  }
}

}  // namespace
}  // namespace muonmesh::worker
