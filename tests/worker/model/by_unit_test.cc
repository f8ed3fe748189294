// Workload::ForwardBackwardByUnit (the unit-by-unit streaming the runtime
// uses) against ForwardBackward: the same loss and gradients bit for bit,
// and the documented order of Acquire / Release / GradientBuffers / Commit
// calls. Also InitializeUnit against Initialize, and the default (non-
// streaming) implementation through a wrapper that does not override it.

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/model/mlp.h"
#include "worker/model/moe_mlp.h"
#include "worker/model/synthetic.h"
#include "worker/model/token_windows.h"
#include "worker/model/transformer.h"
#include "worker/model/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::worker {
namespace {

using ::testing::ElementsAreArray;

std::vector<std::vector<float>> ZerosLike(const plan::ModelSpec &spec) {
  std::vector<std::vector<float>> out;
  for (const auto &unit : spec.units) {
    for (const auto &p : unit.params) {
      int64_t n = 1;
      for (int64_t d : p.shape)
        n *= d;
      out.emplace_back(static_cast<size_t>(n), 0.0f);
    }
  }
  return out;
}

bool BitEqual(const std::vector<float> &a, const std::vector<float> &b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// A UnitAccess over whole-model vectors that hands each unit out in fresh
// buffers (poisoned with NaN, so a read of anything not handed out shows),
// copies committed gradients back, and records every call.
class RecordingAccess final : public UnitAccess {
public:
  RecordingAccess(const plan::ModelSpec &spec,
                  const std::vector<std::vector<float>> &params)
      : params_(params), grads_(ZerosLike(spec)) {
    for (const auto &unit : spec.units) {
      base_.push_back(count_);
      sizes_.emplace_back();
      for (const auto &p : unit.params) {
        int64_t n = 1;
        for (int64_t d : p.shape)
          n *= d;
        sizes_.back().push_back(n);
        ++count_;
      }
    }
    held_.resize(spec.units.size());
    held_ptrs_.resize(spec.units.size());
    gbufs_.resize(spec.units.size());
    gptrs_.resize(spec.units.size());
    committed_.assign(spec.units.size(), 0);
  }

  absl::StatusOr<absl::Span<const float *const>> Acquire(int u) override {
    calls_.push_back(absl::StrCat("A", u));
    if (!held_[u].empty())
      return absl::FailedPreconditionError("acquired twice");
    for (size_t j = 0; j < sizes_[u].size(); ++j) {
      held_[u].push_back(params_[base_[u] + j]);
      held_ptrs_[u].push_back(held_[u].back().data());
    }
    ++acquired_now_;
    max_acquired_ = std::max(max_acquired_, acquired_now_);
    return absl::MakeConstSpan(held_ptrs_[u]);
  }
  void Release(int u) override {
    calls_.push_back(absl::StrCat("R", u));
    if (held_[u].empty())
      return;
    // Poison what the workload was handed: a use after release shows.
    for (auto &t : held_[u])
      std::fill(t.begin(), t.end(), std::nanf(""));
    held_[u].clear();
    held_ptrs_[u].clear();
    --acquired_now_;
  }
  absl::StatusOr<absl::Span<float *const>> GradientBuffers(int u) override {
    calls_.push_back(absl::StrCat("G", u));
    for (size_t j = 0; j < sizes_[u].size(); ++j) {
      gbufs_[u].emplace_back(static_cast<size_t>(sizes_[u][j]), std::nanf(""));
      gptrs_[u].push_back(gbufs_[u].back().data());
    }
    ++grads_now_;
    max_grads_ = std::max(max_grads_, grads_now_);
    return absl::MakeConstSpan(gptrs_[u]);
  }
  absl::Status Commit(int u) override {
    calls_.push_back(absl::StrCat("C", u));
    ++committed_[u];
    for (size_t j = 0; j < gbufs_[u].size(); ++j)
      grads_[base_[u] + j] = gbufs_[u][j];
    gbufs_[u].clear();
    gptrs_[u].clear();
    --grads_now_;
    return absl::OkStatus();
  }

  const std::vector<std::string> &calls() const { return calls_; }
  const std::vector<std::vector<float>> &grads() const { return grads_; }
  const std::vector<int> &committed() const { return committed_; }
  int max_acquired() const { return max_acquired_; }
  int max_grads() const { return max_grads_; }
  int acquired_now() const { return acquired_now_; }

private:
  const std::vector<std::vector<float>> &params_;
  std::vector<std::vector<float>> grads_;
  std::vector<size_t> base_;
  size_t count_ = 0;
  std::vector<std::vector<int64_t>> sizes_;
  std::vector<std::vector<std::vector<float>>> held_;
  std::vector<std::vector<const float *>> held_ptrs_;
  std::vector<std::vector<std::vector<float>>> gbufs_;
  std::vector<std::vector<float *>> gptrs_;
  std::vector<int> committed_;
  std::vector<std::string> calls_;
  int acquired_now_ = 0;
  int max_acquired_ = 0;
  int grads_now_ = 0;
  int max_grads_ = 0;
};

// Forwards everything but ForwardBackwardByUnit / InitializeUnit: exercises
// the Workload defaults.
class Plain final : public Workload {
public:
  explicit Plain(Workload &w) : w_(w) {}
  const plan::ModelSpec &spec() const override { return w_.spec(); }
  int64_t num_samples() const override { return w_.num_samples(); }
  absl::Status Initialize(uint64_t seed,
                          absl::Span<float *const> params) const override {
    return w_.Initialize(seed, params);
  }
  absl::StatusOr<double>
  ForwardBackward(int64_t step, absl::Span<const float *const> params,
                  absl::Span<const int64_t> samples,
                  absl::Span<float *const> grads) override {
    return w_.ForwardBackward(step, params, samples, grads);
  }

private:
  Workload &w_;
};

struct Reference {
  double loss = 0;
  std::vector<std::vector<float>> grads;
};

Reference Whole(Workload &w, int64_t step,
                const std::vector<std::vector<float>> &params,
                const std::vector<int64_t> &samples) {
  Reference r;
  r.grads = ZerosLike(w.spec());
  std::vector<const float *> p;
  for (const auto &t : params)
    p.push_back(t.data());
  std::vector<float *> g;
  for (auto &t : r.grads)
    g.push_back(t.data());
  absl::StatusOr<double> loss =
      w.ForwardBackward(step, p, samples, absl::MakeSpan(g));
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.value_or(-1);
  return r;
}

void ExpectSame(const Reference &want, double loss,
                const RecordingAccess &access) {
  EXPECT_EQ(std::memcmp(&want.loss, &loss, sizeof loss), 0)
      << want.loss << " vs " << loss;
  ASSERT_EQ(want.grads.size(), access.grads().size());
  for (size_t i = 0; i < want.grads.size(); ++i) {
    EXPECT_TRUE(BitEqual(want.grads[i], access.grads()[i])) << "gradient " << i;
  }
  for (int c : access.committed())
    EXPECT_EQ(c, 1);
  EXPECT_EQ(access.acquired_now(), 0);
}

std::vector<std::vector<float>> InitialValues(const Workload &w,
                                              uint64_t seed) {
  std::vector<std::vector<float>> params = ZerosLike(w.spec());
  std::vector<float *> p;
  for (auto &t : params)
    p.push_back(t.data());
  EXPECT_TRUE(w.Initialize(seed, absl::MakeSpan(p)).ok());
  return params;
}

TEST(MlpByUnitTest, BitIdenticalToForwardBackwardInTheDocumentedOrder) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher({5, 7, 6, 3}, 11, 17);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  const std::vector<std::vector<float>> params = InitialValues(*mlp, 3);
  const std::vector<int64_t> samples = {4, 0, 16, 4, 9, 2};
  const Reference want = Whole(*mlp, 0, params, samples);

  RecordingAccess access(mlp->spec(), params);
  absl::StatusOr<double> loss = mlp->ForwardBackwardByUnit(0, access, samples);
  ASSERT_TRUE(loss.ok()) << loss.status();
  ExpectSame(want, *loss, access);
  EXPECT_THAT(access.calls(),
              ElementsAreArray({"A0", "R0", "A1", "R1", "A2", // forward
                                "G2", "C2", "R2",             // last layer
                                "A1", "G1", "C1", "R1",       // re-gathered
                                "A0", "G0", "C0", "R0"}));
  EXPECT_EQ(access.max_acquired(), 1);
  EXPECT_EQ(access.max_grads(), 1);

  // A second call (scratch reused) and a one-layer mlp.
  RecordingAccess again(mlp->spec(), params);
  loss = mlp->ForwardBackwardByUnit(5, again, samples);
  ASSERT_TRUE(loss.ok());
  ExpectSame(want, *loss, again);

  absl::StatusOr<Mlp> one = Mlp::FromTeacher({4, 2}, 5, 8);
  ASSERT_TRUE(one.ok());
  const std::vector<std::vector<float>> p1 = InitialValues(*one, 9);
  const Reference w1 = Whole(*one, 0, p1, {1, 7, 3});
  RecordingAccess a1(one->spec(), p1);
  loss = one->ForwardBackwardByUnit(0, a1, {1, 7, 3});
  ASSERT_TRUE(loss.ok());
  ExpectSame(w1, *loss, a1);
  EXPECT_THAT(a1.calls(), ElementsAreArray({"A0", "G0", "C0", "R0"}));
}

TEST(MlpByUnitTest, RejectsBadSamplesBeforeAcquiring) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher({3, 4, 2}, 1, 5);
  ASSERT_TRUE(mlp.ok());
  const std::vector<std::vector<float>> params = InitialValues(*mlp, 2);
  RecordingAccess access(mlp->spec(), params);
  EXPECT_EQ(mlp->ForwardBackwardByUnit(0, access, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mlp->ForwardBackwardByUnit(0, access, {5}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(access.calls().empty());
}

TEST(MlpByUnitTest, DefaultImplementationMatchesToo) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher({5, 7, 3}, 11, 9);
  ASSERT_TRUE(mlp.ok());
  const std::vector<std::vector<float>> params = InitialValues(*mlp, 4);
  const std::vector<int64_t> samples = {8, 1, 1};
  const Reference want = Whole(*mlp, 0, params, samples);
  Plain plain(*mlp);
  RecordingAccess access(mlp->spec(), params);
  absl::StatusOr<double> loss = plain.ForwardBackwardByUnit(0, access, samples);
  ASSERT_TRUE(loss.ok()) << loss.status();
  ExpectSame(want, *loss, access);
  EXPECT_THAT(access.calls(), ElementsAreArray({"A0", "G0", "A1", "G1", "C0",
                                                "C1", "R0", "R1"}));
}

TEST(MlpByUnitTest, InitializeUnitMatchesInitialize) {
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher({5, 7, 3}, 11, 9);
  ASSERT_TRUE(mlp.ok());
  const std::vector<std::vector<float>> want = InitialValues(*mlp, 42);
  Plain plain(*mlp);
  for (const Workload *w : {static_cast<const Workload *>(&*mlp),
                            static_cast<const Workload *>(&plain)}) {
    for (int u = 0; u < 2; ++u) {
      std::vector<float> wt(want[2 * u].size()), b(want[2 * u + 1].size());
      std::vector<float *> p = {wt.data(), b.data()};
      ASSERT_TRUE(w->InitializeUnit(42, u, absl::MakeSpan(p)).ok());
      EXPECT_TRUE(BitEqual(wt, want[2 * u]));
      EXPECT_TRUE(BitEqual(b, want[2 * u + 1]));
    }
  }
  std::vector<float *> none;
  EXPECT_EQ(mlp->InitializeUnit(42, 2, absl::MakeSpan(none)).code(),
            absl::StatusCode::kInvalidArgument);
}

plan::ModelSpec SmallSpec() {
  plan::ModelSpec spec;
  spec.name = "small";
  spec.units.push_back({"embed", {{"wte", {10, 4}, "adamw", false}}});
  spec.units.push_back({"block",
                        {{"w", {4, 6}, "muon", false},
                         {"b", {6}, "adamw", false},
                         {"v", {3, 3}, "muon", false}}});
  spec.units.push_back({"head", {{"out", {5, 2}, "muon", false}}});
  return spec;
}

// The transformer streams as transformer.h documents: embed for the lookup,
// each layer, the head (with embed again when tied), each layer again in
// reverse, embed's gradient last; bit for bit ForwardBackward's. Untied,
// tied, and DeepSeek-style (MLA, experts in layer 1: the same order, the
// token exchanges inside the layer).
TEST(TransformerByUnitTest, BitIdenticalInTheDocumentedOrder) {
  for (int variant : {0, 1, 2}) {
    const bool tied = variant == 1;
    model::TransformerDims d;
    d.vocab_size = 11;
    d.seq_len = 5;
    d.n_layer = 2;
    d.d_model = 8;
    d.n_head = 4;
    d.n_kv_head = 2;
    d.head_dim = 4;
    d.ffn_hidden = 6;
    d.tie_embeddings = tied;
    if (variant == 2) {
      d.attention = model::Attention::kMla;
      d.mla = {3, 5, 2, 2, 3};
      d.moe = model::MoeDims{4, 2, 3, 1, 1};
    }
    std::vector<int32_t> tokens;
    for (int32_t i = 0; i < 23; ++i) tokens.push_back((5 * i + 3) % 11);
    absl::StatusOr<Transformer> model =
        Transformer::Create(d, std::make_shared<InMemoryTokens>(tokens));
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<std::vector<float>> params = ZerosLike(model->spec());
    std::vector<float *> init;
    for (auto &v : params) init.push_back(v.data());
    ASSERT_TRUE(model->Initialize(4, init).ok());
    std::vector<std::vector<float>> grads = ZerosLike(model->spec());
    std::vector<const float *> p;
    std::vector<float *> g;
    for (size_t i = 0; i < params.size(); ++i) {
      p.push_back(params[i].data());
      g.push_back(grads[i].data());
    }
    const std::vector<int64_t> samples = {1, 4, 4};
    absl::StatusOr<double> whole = model->ForwardBackward(0, p, samples, absl::MakeSpan(g));
    ASSERT_TRUE(whole.ok()) << whole.status();
    RecordingAccess access(model->spec(), params);
    absl::StatusOr<double> by_unit = model->ForwardBackwardByUnit(0, access, samples);
    ASSERT_TRUE(by_unit.ok()) << by_unit.status();
    EXPECT_EQ(*whole, *by_unit);
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_TRUE(BitEqual(grads[i], access.grads()[i])) << "variant " << variant << " gradient " << i;
    }
    const std::vector<std::string> untied_order = {
        "A0", "R0", "A1", "R1", "A2", "R2", "A3", "G3", "C3", "R3",
        "A2", "G2", "C2", "R2", "A1", "G1", "C1", "R1", "G0", "C0"};
    const std::vector<std::string> tied_order = {
        "A0", "R0", "A1", "R1", "A2", "R2", "A3", "A0", "G3", "G0", "C3", "R3",
        "R0", "A2", "G2", "C2", "R2", "A1", "G1", "C1", "R1", "C0"};
    EXPECT_THAT(access.calls(), ElementsAreArray(tied ? tied_order : untied_order));
    EXPECT_EQ(access.acquired_now(), 0);
    for (int c : access.committed()) EXPECT_EQ(c, 1);
  }
}

TEST(SyntheticByUnitTest, BitIdenticalToForwardBackwardUnitByUnit) {
  absl::StatusOr<Synthetic> w = Synthetic::Create(SmallSpec(), 1.0, 1, 1234);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<std::vector<float>> params = InitialValues(*w, 7);
  for (int64_t step : {0, 1, 9}) {
    const Reference want = Whole(*w, step, params, {0, 0});
    RecordingAccess access(w->spec(), params);
    absl::StatusOr<double> loss =
        w->ForwardBackwardByUnit(step, access, {0, 0});
    ASSERT_TRUE(loss.ok()) << loss.status();
    ExpectSame(want, *loss, access);
    EXPECT_THAT(access.calls(),
                ElementsAreArray({"A0", "R0", "G0", "C0", "A1", "R1", "G1",
                                  "C1", "A2", "R2", "G2", "C2"}));
    EXPECT_EQ(access.max_acquired(), 1);
    EXPECT_EQ(access.max_grads(), 1);
  }
  RecordingAccess bad(w->spec(), params);
  EXPECT_EQ(w->ForwardBackwardByUnit(-1, bad, {0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w->ForwardBackwardByUnit(0, bad, {1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(bad.calls().empty());
}

// One EP rank's view for a workload that does not read its parameters:
// expert stacks are handed out as this group's slice.
class SlicedAccess final : public UnitAccess {
public:
  SlicedAccess(const plan::ModelSpec &spec, int ep, int index)
      : ep_(ep), index_(index) {
    for (const auto &unit : spec.units) {
      sizes_.emplace_back();
      for (const auto &p : unit.params) {
        int64_t n = 1;
        for (int64_t d : p.shape)
          n *= d;
        sizes_.back().push_back(p.expert ? n / ep : n);
      }
    }
    bufs_.resize(sizes_.size());
    ptrs_.resize(sizes_.size());
  }
  absl::StatusOr<absl::Span<const float *const>> Acquire(int) override {
    return absl::Span<const float *const>();
  }
  void Release(int) override {}
  absl::StatusOr<absl::Span<float *const>> GradientBuffers(int u) override {
    for (int64_t n : sizes_[u]) {
      bufs_[u].emplace_back(static_cast<size_t>(n), std::nanf(""));
      ptrs_[u].push_back(bufs_[u].back().data());
    }
    return absl::MakeConstSpan(ptrs_[u]);
  }
  absl::Status Commit(int) override { return absl::OkStatus(); }
  int expert_parallel_size() const override { return ep_; }
  int expert_parallel_index() const override { return index_; }
  const std::vector<float> &grad(int u, int j) const { return bufs_[u][j]; }

private:
  int ep_, index_;
  std::vector<std::vector<int64_t>> sizes_;
  std::vector<std::vector<std::vector<float>>> bufs_;
  std::vector<std::vector<float *>> ptrs_;
};

TEST(SyntheticByUnitTest, ExpertStacksGetTheirGroupsSliceAndTheWholeLoss) {
  plan::ModelSpec spec = SmallSpec();
  spec.units[1].params.push_back({"experts", {4, 3, 5}, "muon", true});
  absl::StatusOr<Synthetic> w = Synthetic::Create(spec, 1.0, 2, 99);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<std::vector<float>> params = InitialValues(*w, 7);
  const Reference want = Whole(*w, 3, params, {0});
  for (int index = 0; index < 2; ++index) {
    SlicedAccess access(w->spec(), 2, index);
    absl::StatusOr<double> loss = w->ForwardBackwardByUnit(3, access, {0});
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_EQ(*loss, want.loss);
    const std::vector<float> &mine = access.grad(1, 3);
    ASSERT_EQ(mine.size(), 30u);
    const std::vector<float> &whole = want.grads[4];  // flat index of "experts"
    EXPECT_TRUE(BitEqual(mine, std::vector<float>(whole.begin() + 30 * index,
                                                  whole.begin() + 30 * (index + 1))));
    EXPECT_TRUE(BitEqual(access.grad(1, 0), want.grads[1]));  // dense: whole
  }
  SlicedAccess three(w->spec(), 3, 0);
  EXPECT_EQ(w->ForwardBackwardByUnit(0, three, {0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SyntheticByUnitTest, InitializeUnitMatchesInitialize) {
  absl::StatusOr<Synthetic> w = Synthetic::Create(SmallSpec(), 1.0, 1, 0);
  ASSERT_TRUE(w.ok());
  const std::vector<std::vector<float>> want = InitialValues(*w, 77);
  Plain plain(*w);
  size_t flat = 0;
  for (int u = 0; u < 3; ++u) {
    const size_t count = w->spec().units[u].params.size();
    for (const Workload *x : {static_cast<const Workload *>(&*w),
                              static_cast<const Workload *>(&plain)}) {
      std::vector<std::vector<float>> got;
      std::vector<float *> p;
      for (size_t j = 0; j < count; ++j)
        got.emplace_back(want[flat + j].size(), 0.0f);
      for (auto &t : got)
        p.push_back(t.data());
      ASSERT_TRUE(x->InitializeUnit(77, u, absl::MakeSpan(p)).ok());
      for (size_t j = 0; j < count; ++j)
        EXPECT_TRUE(BitEqual(got[j], want[flat + j]));
    }
    flat += count;
  }
}

// ---------------------------------------------------------------- moe_mlp

MoeMlpDims SmallMoe() { return {4, 6, 5, 4, 3}; }

TEST(MoeMlpByUnitTest, BitIdenticalToForwardBackwardInTheDocumentedOrder) {
  absl::StatusOr<MoeMlp> moe = MoeMlp::FromTeacher(SmallMoe(), 11, 23);
  ASSERT_TRUE(moe.ok()) << moe.status();
  const std::vector<std::vector<float>> params = InitialValues(*moe, 3);
  const std::vector<int64_t> samples = {4, 0, 16, 4, 9, 2, 22, 13};
  const Reference want = Whole(*moe, 0, params, samples);

  RecordingAccess access(moe->spec(), params);
  absl::StatusOr<double> loss = moe->ForwardBackwardByUnit(0, access, samples);
  ASSERT_TRUE(loss.ok()) << loss.status() << absl::StrJoin(access.calls(), ",");
  ExpectSame(want, *loss, access);
  EXPECT_THAT(access.calls(),
              ElementsAreArray({"A0", "R0", "A1", "R1", "A2", // forward
                                "G2", "C2", "R2",             // output layer
                                "A1", "G1", "C1", "R1",       // re-gathered
                                "G0", "C0"}));                // no parameters needed
  EXPECT_EQ(access.max_acquired(), 1);
  EXPECT_EQ(access.max_grads(), 1);

  RecordingAccess again(moe->spec(), params);
  loss = moe->ForwardBackwardByUnit(1, again, samples);
  ASSERT_TRUE(loss.ok());
  ExpectSame(want, *loss, again);
}

TEST(MoeMlpByUnitTest, InitializeUnitMatchesInitialize) {
  absl::StatusOr<MoeMlp> moe = MoeMlp::FromTeacher(SmallMoe(), 11, 9);
  ASSERT_TRUE(moe.ok());
  const std::vector<std::vector<float>> want = InitialValues(*moe, 42);
  size_t flat = 0;
  for (int u = 0; u < 3; ++u) {
    std::vector<std::vector<float>> got;
    std::vector<float *> p;
    for (size_t j = 0; j < moe->spec().units[u].params.size(); ++j) {
      got.emplace_back(want[flat + j].size());
    }
    for (auto &t : got) p.push_back(t.data());
    ASSERT_TRUE(moe->InitializeUnit(42, u, absl::MakeSpan(p)).ok());
    for (size_t j = 0; j < got.size(); ++j) {
      EXPECT_TRUE(BitEqual(got[j], want[flat + j])) << "unit " << u << " tensor " << j;
    }
    flat += got.size();
  }
  std::vector<float *> none;
  EXPECT_EQ(moe->InitializeUnit(42, 3, absl::MakeSpan(none)).code(),
            absl::StatusCode::kInvalidArgument);
}

// An access that claims two expert-parallel groups.
class TwoGroups final : public UnitAccess {
public:
  absl::StatusOr<absl::Span<const float *const>> Acquire(int) override {
    return absl::InternalError("not reached");
  }
  void Release(int) override {}
  absl::StatusOr<absl::Span<float *const>> GradientBuffers(int) override {
    return absl::InternalError("not reached");
  }
  absl::Status Commit(int) override { return absl::OkStatus(); }
  int expert_parallel_size() const override { return 2; }
};

TEST(MoeMlpByUnitTest, DefaultImplementationRefusesToSplitExperts) {
  absl::StatusOr<MoeMlp> moe = MoeMlp::FromTeacher(SmallMoe(), 11, 9);
  ASSERT_TRUE(moe.ok());
  Plain plain(*moe);
  TwoGroups access;
  absl::StatusOr<double> loss = plain.ForwardBackwardByUnit(0, access, {1});
  EXPECT_EQ(loss.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(loss.status().message()),
              ::testing::HasSubstr("experts.w1"));
}

TEST(MoeMlpByUnitTest, DefaultExchangeIsACopyAndChecksCounts) {
  const std::vector<std::vector<float>> none;
  RecordingAccess access(plan::ModelSpec{}, none);
  const float send[3] = {1, 2, 3};
  float recv[3] = {0, 0, 0};
  const int64_t three[1] = {3};
  ASSERT_TRUE(access.ExchangeTokens(send, three, recv, three).ok());
  EXPECT_EQ(recv[2], 3.0f);
  const int64_t two[1] = {2};
  EXPECT_EQ(access.ExchangeTokens(send, three, recv, two).code(),
            absl::StatusCode::kInvalidArgument);
}

} // namespace
} // namespace muonmesh::worker
