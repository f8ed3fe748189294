#include "worker/model/gpt_passes.h"

#include <climits>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/model/checks.h"

namespace muonmesh::worker {
namespace {

constexpr int kEmbedUnit = 0;

template <typename T>
absl::Status CheckTensors(absl::Span<T* const> tensors, size_t want, const char* what, int unit) {
  return internal::CheckUnitTensors("gpt", tensors, want, what, unit);
}

// One call's walk over the units (gpt.h, Gpt::ForwardBackwardByUnit).
class Driver {
 public:
  Driver(const model::GptDims& dims, GptPasses& passes, UnitAccess& units)
      : dims_(dims), passes_(passes), units_(units) {}

  absl::Status ForwardBlocks(int64_t n);
  absl::StatusOr<double> LossTail(int64_t n);
  // ln_f, the logits and the loss, then the head's backward pass: commits
  // head, leaves embed's gradient buffers (wte holding the head's part) in
  // `embed_grads`, uncommitted.
  absl::StatusOr<double> HeadStep(int64_t n, absl::Span<float* const>& embed_grads);
  absl::Status BlockBackwardStep(int64_t layer, int64_t n);

 private:
  int head_unit() const { return static_cast<int>(dims_.n_layer) + 1; }

  const model::GptDims& dims_;
  GptPasses& passes_;
  UnitAccess& units_;
};

absl::Status Driver::ForwardBlocks(int64_t n) {
  {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> embed, units_.Acquire(kEmbedUnit));
    HeldUnit held(units_, kEmbedUnit);
    MUONMESH_RETURN_IF_ERROR(CheckTensors(embed, 2, "parameters", kEmbedUnit));
    MUONMESH_RETURN_IF_ERROR(passes_.EmbedForward(n, embed[0], embed[1]));
  }
  for (int64_t l = 0; l < dims_.n_layer; ++l) {
    const int unit = static_cast<int>(l) + 1;
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, units_.Acquire(unit));
    HeldUnit held(units_, unit);
    MUONMESH_RETURN_IF_ERROR(CheckTensors(p, model::kGptParamsPerBlock, "parameters", unit));
    MUONMESH_RETURN_IF_ERROR(passes_.BlockForward(l, n, p));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Driver::LossTail(int64_t n) {
  {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> head, units_.Acquire(head_unit()));
    HeldUnit held(units_, head_unit());
    MUONMESH_RETURN_IF_ERROR(CheckTensors(head, 2, "parameters", head_unit()));
    MUONMESH_RETURN_IF_ERROR(passes_.FinalNorm(n, head[0], head[1]));
  }
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> embed, units_.Acquire(kEmbedUnit));
  HeldUnit held(units_, kEmbedUnit);
  MUONMESH_RETURN_IF_ERROR(CheckTensors(embed, 2, "parameters", kEmbedUnit));
  return passes_.LogitsAndLoss(n, embed[0], /*gradients=*/false);
}

absl::StatusOr<double> Driver::HeadStep(int64_t n, absl::Span<float* const>& embed_grads) {
  const int hu = head_unit();
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> head, units_.Acquire(hu));
  HeldUnit head_held(units_, hu);
  MUONMESH_RETURN_IF_ERROR(CheckTensors(head, 2, "parameters", hu));
  MUONMESH_RETURN_IF_ERROR(passes_.FinalNorm(n, head[0], head[1]));
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> embed, units_.Acquire(kEmbedUnit));
  HeldUnit embed_held(units_, kEmbedUnit);
  MUONMESH_RETURN_IF_ERROR(CheckTensors(embed, 2, "parameters", kEmbedUnit));
  MUONMESH_ASSIGN_OR_RETURN(const double loss,
                            passes_.LogitsAndLoss(n, embed[0], /*gradients=*/true));

  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> head_grads, units_.GradientBuffers(hu));
  MUONMESH_RETURN_IF_ERROR(CheckTensors(head_grads, 2, "gradient buffers", hu));
  MUONMESH_ASSIGN_OR_RETURN(embed_grads, units_.GradientBuffers(kEmbedUnit));
  MUONMESH_RETURN_IF_ERROR(CheckTensors(embed_grads, 2, "gradient buffers", kEmbedUnit));
  MUONMESH_RETURN_IF_ERROR(
      passes_.HeadBackward(n, embed[0], head[0], embed_grads[0], head_grads[0], head_grads[1]));
  MUONMESH_RETURN_IF_ERROR(units_.Commit(hu));
  head_held.Release();
  embed_held.Release();
  return loss;
}

absl::Status Driver::BlockBackwardStep(int64_t layer, int64_t n) {
  const int unit = static_cast<int>(layer) + 1;
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, units_.Acquire(unit));
  HeldUnit held(units_, unit);
  MUONMESH_RETURN_IF_ERROR(CheckTensors(p, model::kGptParamsPerBlock, "parameters", unit));
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g, units_.GradientBuffers(unit));
  MUONMESH_RETURN_IF_ERROR(CheckTensors(g, model::kGptParamsPerBlock, "gradient buffers", unit));
  MUONMESH_RETURN_IF_ERROR(passes_.BlockBackward(layer, n, p, g));
  return units_.Commit(unit);
}

}  // namespace

absl::Status ReadWindows(const char* model, int64_t vocab_size, int64_t t_len,
                         const TokenStream& tokens, absl::Span<const int64_t> samples,
                         std::vector<int32_t>& windows) {
  const int64_t num_tokens = tokens.num_tokens();
  if (num_tokens <= t_len) {
    return absl::InvalidArgumentError(absl::StrCat(model, ": the token stream has ", num_tokens,
                                                   " tokens, need more than seq_len = ", t_len));
  }
  MUONMESH_RETURN_IF_ERROR(
      internal::CheckSampleList(model, samples, WindowPeriod(num_tokens, t_len), INT_MAX / t_len));
  const size_t need = samples.size() * static_cast<size_t>(t_len + 1);
  if (windows.size() < need) windows.resize(need);
  for (size_t k = 0; k < samples.size(); ++k) {
    const int64_t p = WindowStart(samples[k], num_tokens, t_len);
    int32_t* window = windows.data() + k * static_cast<size_t>(t_len + 1);
    MUONMESH_RETURN_IF_ERROR(tokens.Read(p, t_len + 1, window), model, ": sample ", samples[k]);
    for (int64_t j = 0; j <= t_len; ++j) {
      if (window[j] < 0 || window[j] >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            model, ": token ", p + j, " (in sample ", samples[k], "; ", tokens.Where(p + j),
            ") is ", window[j], ", outside the vocabulary [0, ", vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ReadGptWindows(const model::GptDims& dims, const TokenStream& tokens,
                            absl::Span<const int64_t> samples, std::vector<int32_t>& windows) {
  return ReadWindows("gpt", dims.vocab_size, dims.seq_len, tokens, samples, windows);
}

absl::StatusOr<double> RunGptPasses(const model::GptDims& dims, GptPasses& passes,
                                    UnitAccess& units, const TokenStream& tokens,
                                    absl::Span<const int64_t> samples, bool gradients,
                                    std::vector<int32_t>& windows) {
  MUONMESH_RETURN_IF_ERROR(ReadGptWindows(dims, tokens, samples, windows));
  const int64_t n = static_cast<int64_t>(samples.size());
  MUONMESH_RETURN_IF_ERROR(
      passes.Prepare(absl::MakeConstSpan(windows).subspan(0, n * (dims.seq_len + 1)), n));
  const double denom = static_cast<double>(n) * static_cast<double>(dims.seq_len);
  Driver driver(dims, passes, units);
  MUONMESH_RETURN_IF_ERROR(driver.ForwardBlocks(n));
  if (!gradients) {
    MUONMESH_ASSIGN_OR_RETURN(const double sum, driver.LossTail(n));
    return sum / denom;
  }
  absl::Span<float* const> embed_grads;
  MUONMESH_ASSIGN_OR_RETURN(const double sum, driver.HeadStep(n, embed_grads));
  for (int64_t l = dims.n_layer - 1; l >= 0; --l) {
    MUONMESH_RETURN_IF_ERROR(driver.BlockBackwardStep(l, n));
  }
  MUONMESH_RETURN_IF_ERROR(passes.EmbedBackward(n, embed_grads[0], embed_grads[1]));
  MUONMESH_RETURN_IF_ERROR(units.Commit(kEmbedUnit));
  return sum / denom;
}

}  // namespace muonmesh::worker
