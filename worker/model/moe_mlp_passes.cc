#include "worker/model/moe_mlp_passes.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/model/checks.h"

namespace muonmesh::worker {
namespace {

constexpr size_t kUnitParams[3] = {2, 3, 2};  // input, moe, output

// One call's walk (moe_mlp.h, MoeMlp::ForwardBackwardByUnit).
class Walk {
 public:
  Walk(const model::MoeMlpDims& dims, MoeMlpPasses& passes, UnitAccess& units, int64_t n)
      : dims_(dims),
        passes_(passes),
        units_(units),
        n_(n),
        ep_(units.expert_parallel_size()),
        local_(dims.num_experts / ep_) {}

  absl::Status Input();
  absl::Status Mixture();
  absl::Status Output(bool gradients, absl::Span<const int64_t> samples, double* sum);
  absl::Status MixtureBackward();
  absl::Status InputBackward();

 private:
  absl::StatusOr<absl::Span<const float* const>> Acquire(int unit) {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, units_.Acquire(unit));
    HeldUnit held(units_, unit);
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("moe_mlp", p, kUnitParams[unit], "parameters", unit));
    held.Keep();
    return p;
  }
  absl::StatusOr<absl::Span<float* const>> Gradients(int unit) {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, units_.GradientBuffers(unit));
    MUONMESH_RETURN_IF_ERROR(
        internal::CheckUnitTensors("moe_mlp", g, kUnitParams[unit], "gradient buffers", unit));
    return g;
  }
  // Sends send() to the groups and takes recv() from them (`forward`), or
  // the other way round, `width` floats a token.
  absl::Status Exchange(bool forward, int64_t width) {
    std::vector<int64_t> out(ep_), in(ep_);
    for (int q = 0; q < ep_; ++q) {
      out[q] = send_tokens_[q] * width;
      in[q] = recv_tokens_[q] * width;
    }
    if (forward) return units_.ExchangeTokens(passes_.send(), out, passes_.recv(), in);
    return units_.ExchangeTokens(passes_.recv(), in, passes_.send(), out);
  }
  absl::Status ExchangeCounts();

  const model::MoeMlpDims& dims_;
  MoeMlpPasses& passes_;
  UnitAccess& units_;
  const int64_t n_;
  const int ep_;
  const int64_t local_;
  std::vector<int64_t> send_tokens_, recv_tokens_;  // per EP group
  int64_t received_ = 0;
};

absl::Status Walk::Input() {
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, Acquire(0));
  HeldUnit held(units_, 0);
  return passes_.InputForward(n_, p[0], p[1]);
}

// Token counts first (as floats: exact below 2^24), then the tokens.
absl::Status Walk::ExchangeCounts() {
  const std::vector<int64_t> ones(ep_, 1);
  MUONMESH_RETURN_IF_ERROR(
      units_.ExchangeTokens(passes_.counts_send(), ones, passes_.counts_recv(), ones));
  MUONMESH_ASSIGN_OR_RETURN(const std::vector<float> counts, passes_.ReceivedCounts(ep_));
  recv_tokens_.assign(ep_, 0);
  received_ = 0;
  for (int q = 0; q < ep_; ++q) {
    const float c = counts[q];
    if (!(c >= 0.0f && c <= static_cast<float>(model::kMoeMaxSamplesPerCall)) ||
        c != std::floor(c)) {
      return absl::InternalError(
          absl::StrCat("moe_mlp: expert-parallel group ", q, " announced ", c, " tokens"));
    }
    recv_tokens_[q] = static_cast<int64_t>(c);
    received_ += recv_tokens_[q];
  }
  return absl::OkStatus();
}

absl::Status Walk::Mixture() {
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, Acquire(1));
  HeldUnit held(units_, 1);
  MUONMESH_ASSIGN_OR_RETURN(send_tokens_, passes_.Route(n_, ep_, p[0]));
  MUONMESH_RETURN_IF_ERROR(ExchangeCounts());
  MUONMESH_RETURN_IF_ERROR(passes_.PackTokens(n_, received_));
  MUONMESH_RETURN_IF_ERROR(Exchange(/*forward=*/true, dims_.d_model + 1));
  MUONMESH_RETURN_IF_ERROR(passes_.ExpertsForward(received_, local_, p[1], p[2]));
  MUONMESH_RETURN_IF_ERROR(Exchange(/*forward=*/false, dims_.d_model));
  held.Release();
  return passes_.Combine(n_);
}

absl::Status Walk::Output(bool gradients, absl::Span<const int64_t> samples, double* sum) {
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, Acquire(2));
  HeldUnit held(units_, 2);
  MUONMESH_RETURN_IF_ERROR(passes_.OutputLayer(n_, p[0], p[1]));
  if (!gradients) return absl::OkStatus();
  MUONMESH_ASSIGN_OR_RETURN(*sum, passes_.OutputLoss(samples));
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, Gradients(2));
  MUONMESH_RETURN_IF_ERROR(passes_.OutputBackward(n_, p[0], g[0], g[1]));
  return units_.Commit(2);
}

absl::Status Walk::MixtureBackward() {
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, Acquire(1));
  HeldUnit held(units_, 1);
  MUONMESH_RETURN_IF_ERROR(passes_.PackGateGradients(n_));
  MUONMESH_RETURN_IF_ERROR(Exchange(/*forward=*/true, dims_.d_model));
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, Gradients(1));
  MUONMESH_RETURN_IF_ERROR(passes_.ExpertsBackward(received_, local_, ep_, p[1], p[2], g[1], g[2]));
  MUONMESH_RETURN_IF_ERROR(Exchange(/*forward=*/false, dims_.d_model));
  MUONMESH_RETURN_IF_ERROR(passes_.RouterBackward(n_, p[0], g[0]));
  return units_.Commit(1);
}

// The input layer's gradients do not need its parameters.
absl::Status Walk::InputBackward() {
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, Gradients(0));
  MUONMESH_RETURN_IF_ERROR(passes_.InputBackward(n_, g[0], g[1]));
  return units_.Commit(0);
}

}  // namespace

absl::StatusOr<double> RunMoeMlpPasses(const model::MoeMlpDims& dims, int64_t num_samples,
                                       MoeMlpPasses& passes, UnitAccess& units,
                                       absl::Span<const int64_t> samples, bool gradients) {
  MUONMESH_RETURN_IF_ERROR(internal::CheckSampleList("moe_mlp", samples, num_samples,
                                                     model::kMoeMaxSamplesPerCall));
  const int ep = units.expert_parallel_size();
  if (ep < 1 || dims.num_experts % ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat("moe_mlp: num_experts ", dims.num_experts,
                                                   " does not split over ", ep,
                                                   " expert-parallel groups"));
  }
  const int64_t n = static_cast<int64_t>(samples.size());
  MUONMESH_RETURN_IF_ERROR(passes.Gather(samples, ep));
  Walk walk(dims, passes, units, n);
  MUONMESH_RETURN_IF_ERROR(walk.Input());
  MUONMESH_RETURN_IF_ERROR(walk.Mixture());
  double sum = 0.0;
  MUONMESH_RETURN_IF_ERROR(walk.Output(gradients, samples, &sum));
  if (!gradients) return 0.0;
  MUONMESH_RETURN_IF_ERROR(walk.MixtureBackward());
  MUONMESH_RETURN_IF_ERROR(walk.InputBackward());
  return sum / (static_cast<double>(n) * static_cast<double>(dims.d_out));
}

}  // namespace muonmesh::worker
