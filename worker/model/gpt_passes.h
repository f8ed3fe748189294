#pragma once

// The gpt workload's passes (worker/model/gpt.h documents the model) split
// from the one driver that streams the units through them: the host form
// (Gpt, OpenBLAS) and the GPU form (CudaGpt, cuBLAS and kernels) implement
// GptPasses, and RunGptPasses makes the same calls to the runtime's
// UnitAccess, in the same order, for both. docs/architecture.md, "Adding a
// model kind".

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model/gpt_spec.h"
#include "worker/model/token_windows.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

// One device's arithmetic for one call on n windows. Pointers are in the
// device's memory (the workload's memory_space()); each method reads the
// activations the ones before it left, in RunGptPasses's order.
class GptPasses {
 public:
  virtual ~GptPasses() = default;

  // Readies the scratch for n windows: `windows` holds them, [n, T + 1]
  // token ids in [0, V) (inputs tok[0, T), targets tok[1, T]), on the host.
  virtual absl::Status Prepare(absl::Span<const int32_t> windows, int64_t n) = 0;
  // x = wte[tok] + wpe[t]: block 0's input.
  virtual absl::Status EmbedForward(int64_t n, const float* wte, const float* wpe) = 0;
  // Block `layer` (its 12 parameters in `p`, gpt_spec.h's order), keeping
  // what its backward pass needs.
  virtual absl::Status BlockForward(int64_t layer, int64_t n, absl::Span<const float* const> p) = 0;
  // ln_f over the last block's output.
  virtual absl::Status FinalNorm(int64_t n, const float* w, const float* b) = 0;
  // The logits ln_f(x) wte^T and the cross-entropy summed (not averaged)
  // over the n T positions; with `gradients`, dL/dlogits for the mean loss
  // kept for HeadBackward.
  virtual absl::StatusOr<double> LogitsAndLoss(int64_t n, const float* wte, bool gradients) = 0;
  // dwte = the tied head's gradient (overwritten), dlnf_w, dlnf_b, and
  // dL/dx of the last block's output.
  virtual absl::Status HeadBackward(int64_t n, const float* wte, const float* lnf_w, float* dwte,
                                    float* dlnf_w, float* dlnf_b) = 0;
  // Block `layer`'s gradients into `g` (overwritten); dL/dx moves to the
  // block's input.
  virtual absl::Status BlockBackward(int64_t layer, int64_t n, absl::Span<const float* const> p,
                                     absl::Span<float* const> g) = 0;
  // dwte += the lookup's rows (dwte holds the head's part); dwpe
  // overwritten, 0 at positions >= T.
  virtual absl::Status EmbedBackward(int64_t n, float* dwte, float* dwpe) = 0;
};

// ReadGptWindows for any language model: `model` names it in errors
// ("transformer"), tokens must be below `vocab_size`.
absl::Status ReadWindows(const char* model, int64_t vocab_size, int64_t t_len,
                         const TokenStream& tokens, absl::Span<const int64_t> samples,
                         std::vector<int32_t>& windows);

// Reads the windows of `samples` from `tokens` into `windows` ([n, T + 1],
// grown as needed). InvalidArgument for a stream of N <= T tokens, empty
// samples, a sample outside [0, WindowPeriod(N, T)), more than
// INT32_MAX / T samples, or a token outside [0, V) (naming its position in
// the stream, where that is, and its value); a read error as is.
absl::Status ReadGptWindows(const model::GptDims& dims, const TokenStream& tokens,
                            absl::Span<const int64_t> samples, std::vector<int32_t>& windows);

// The mean loss over `samples` of `tokens`, and with `gradients` every
// unit's gradients committed, through `passes`: the calls to `units` that
// Gpt::ForwardBackwardByUnit (with gradients) and Gpt::LossByUnit
// (without) document. `windows` is the caller's scratch for the windows
// read. Errors: ReadGptWindows's (before any call to `units`), the units'
// (wrong tensor counts named by unit), and the passes' own; on an error
// what is held is released.
absl::StatusOr<double> RunGptPasses(const model::GptDims& dims, GptPasses& passes,
                                    UnitAccess& units, const TokenStream& tokens,
                                    absl::Span<const int64_t> samples, bool gradients,
                                    std::vector<int32_t>& windows);

}  // namespace muonmesh::worker
