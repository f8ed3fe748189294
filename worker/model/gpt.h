#pragma once

// The built-in `gpt` workload: the GPT-2 decoder (nanoGPT's model.py,
// llm.c's train_gpt2.c) trained as a next-token language model on CPU, with
// the forward and backward passes written out in fp32. Exact definition, so
// that anyone can reproduce it:
//
// Shape and parameters: core/model/gpt_spec.h (units `embed`, `h.{l}`,
// `head`; weights [out, in], a linear layer computes x W^T + b). Below
// V = vocab_size, L = n_layer, H = n_head, C = n_embd, hs = C / H,
// T = seq_len.
//
// Samples (worker/model/token_windows.h): sample k of a token stream of N
// tokens is the window at p = WindowStart(k, N, T): inputs tok[p, p + T),
// targets tok[p + 1, p + T + 1). num_samples() = WindowPeriod(N, T). Every
// token id of a window must be in [0, V).
//
// Model, per sample (rows t < T):
//   x_t    = wte[tok_t] + wpe[t]
//   block l: x = x + c_proj(attn(ln_1(x))); x = x + mlp(ln_2(x))
//   logits = ln_f(x) wte^T                          (the head is tied to wte)
// LayerNorm(x) = (x - mean) / sqrt(var + 1e-5) * w + b, var the biased
// variance (mean of squared deviations). attn: qkv = a c_attn^T + b; q, k, v
// are its three C-column blocks in that order; head h takes columns
// [h hs, (h + 1) hs) of each; row t of head h is softmax_{j <= t}(q_t . k_j
// / sqrt(hs)) weighting v_j (causal); head h's output fills columns
// [h hs, (h + 1) hs) of the attention output, which goes through c_proj.
// mlp(a) = c_proj(gelu(c_fc(a))), gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi)
// (x + 0.044715 x^3))). No dropout.
//
// Loss of a call on samples S (|S| = n, repeats allowed): the mean
// cross-entropy over every position of every sample,
//   loss = 1/(n T) sum_{s in S} sum_t (logsumexp(logits_{s,t}) -
//   logits_{s,t}[target_{s,t}]),
// so that the average of equal-size slices' losses (and gradients) is the
// whole batch's.
//
// Initialisation from seed `seed`. Parameter i (flat index, gpt_spec.h),
// element e (row-major): a standard normal
//   u1 = (UniformAt(seed, i, 2e)     + 1) / 2 + 2^-24     in (0, 1]
//   u2 = (UniformAt(seed, i, 2e + 1) + 1) / 2             in [0, 1)
//   z  = sqrt(-2 ln u1) cos(2 pi u2)                      (Box-Muller, cosine
//   branch)
// (worker/model/rng.h for UniformAt; u1 and u2 are exact in double, z is
// computed in double with the C library's log, sqrt and cos), scaled and
// rounded once: value = float(sigma z) with sigma (in double)
//   0.02              wte, wpe, attn.c_attn.weight, mlp.c_fc.weight
//   0.02 / sqrt(2 L)  attn.c_proj.weight, mlp.c_proj.weight
// Every bias and ln_f / ln_1 / ln_2 bias is 0; every LayerNorm weight is 1.
// (A libm whose log or cos differs from glibc's may change a value's last
// bit, rarely; GptStandardNormal is the one implementation here.)
//
// Arithmetic. Row-major fp32 activations; every matrix product (the linear
// layers, q k^T and the attention-weighted sum of v per sample and head,
// the tied head, and their backward products) through cblas_sgemm with
// beta = 0, the attention scale 1/sqrt(hs) (rounded to float) as sgemm's
// alpha. Elementwise operations are fp32 with one rounding each
// (-ffp-contract=off). GELU and its derivative are math::Gelu and
// math::GeluSlope (worker/math/elementwise.h: fp32, tanh z as 1 - 2 / (1 +
// e^{2z}) with math::ExpF). Softmax and cross-entropy take e_j =
// ExpF(l_j - max) in fp32 and sum them in double (four interleaved partial
// sums, gpt.cc's SumInDouble); probabilities e_j / sum, the loss max +
// log(sum) - l_target and its gradient are computed in double and rounded
// once. LayerNorm means and variances and the softmax and LayerNorm
// backward row reductions are computed in double and rounded once; bias,
// LayerNorm-parameter and wpe gradients are column sums over rows
// accumulated in double and rounded once. The loss is summed in double.
// wte's gradient is the tied head's (sgemm) plus the embedding rows added
// in fp32 in sample then position order.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model/gpt_spec.h"
#include "core/plan/types.h"
#include "worker/model/gpt_passes.h"
#include "worker/model/token_windows.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

// z of the documented initialisation for parameter `param` (flat index),
// element `element`: the standard normal before scaling.
double GptStandardNormal(uint64_t seed, uint64_t param, uint64_t element);

// The gpt workload over a token stream (the training data).
//
// One instance per rank, owned by the rank's runtime; it shares the token
// stream (immutable, thread-safe) with whoever else reads it.
// Thread-compatible: ForwardBackward*, Loss* reuse scratch buffers that
// hold every block's activations for the largest call seen (grown, never
// shrunk): O(L n T (16 C + H T) + n T V) floats for n samples. const methods
// may be called concurrently.
class Gpt final : public Workload, private GptPasses {
 public:
  // InvalidArgument for dims that model::ValidateGptDims rejects, or (field
  // `data`) a null stream or one of N <= T tokens.
  static absl::StatusOr<Gpt> Create(model::GptDims dims, std::shared_ptr<const TokenStream> train);

  const plan::ModelSpec& spec() const override { return spec_; }
  int64_t num_samples() const override { return num_samples_; }

  // The documented initialisation. InvalidArgument unless params holds one
  // non-null pointer per parameter (each holding the parameter's size).
  absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const override;
  // Unit `unit`'s part of it, bit for bit the same values.
  absl::Status InitializeUnit(uint64_t seed, int unit,
                              absl::Span<float* const> params) const override;

  // Loss and gradients on `samples` of the training stream (any order,
  // repeats allowed; `step` is ignored). InvalidArgument, with grads
  // untouched, for empty samples, a sample outside [0, num_samples()), more
  // than INT32_MAX / T samples, a token id outside [0, V) (naming its
  // position in the stream and its value), or params / grads that do not
  // hold one non-null pointer per parameter. An error reading the stream
  // is returned as is.
  absl::StatusOr<double> ForwardBackward(int64_t step, absl::Span<const float* const> params,
                                         absl::Span<const int64_t> samples,
                                         absl::Span<float* const> grads) override;

  // The same loss and gradients as ForwardBackward, bit for bit (the same
  // code: ForwardBackward runs this over its whole tensors), streamed unit
  // by unit. With embed = unit 0, h.l = unit 1 + l, head = unit L + 1, the
  // calls are, in order,
  //   forward:  Acquire(embed), Release(embed)          (the lookup)
  //             Acquire(h.l), Release(h.l)              for l = 0 .. L-1
  //             Acquire(head), Acquire(embed)           (ln_f, the logits)
  //   head:     GradientBuffers(head), GradientBuffers(embed),
  //             Commit(head), Release(head), Release(embed)
  //   blocks:   Acquire(h.l), GradientBuffers(h.l), Commit(h.l),
  //             Release(h.l)                            for l = L-1 .. 0
  //   embed:    Commit(embed)
  // so at most two units are held at once (head and embed) and at most two
  // units' gradient buffers are outstanding (embed's, from the head's wte
  // gradient to the end, plus one other). On an error (its own, checked
  // before any call to `units` where it can be, or one from `units`) it
  // releases what it holds and returns; units already committed stay so.
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

  // The loss alone (no gradients; the same forward code, so the same value
  // ForwardBackward returns on the training stream) on the windows
  // `samples` of any stream `tokens` (validation), samples in
  // [0, WindowPeriod(N, T)). Errors as ForwardBackward's, and
  // InvalidArgument for a stream of N <= T tokens.
  absl::StatusOr<double> Loss(absl::Span<const float* const> params, const TokenStream& tokens,
                              absl::Span<const int64_t> samples);
  // Streamed: Acquire(u), Release(u) for u = embed, h.0 .. h.{L-1}, head,
  // embed (again, for the logits); commits nothing.
  absl::StatusOr<double> LossByUnit(UnitAccess& units, const TokenStream& tokens,
                                    absl::Span<const int64_t> samples);

  // The logits [V] that follow `context` (exactly seq_len tokens, each in
  // [0, V)): Loss's forward pass on that one window, its last position's
  // row. For sampling (worker/sample.h), which makes a Gpt whose seq_len
  // is the context's length. InvalidArgument for a wrong length or token.
  absl::StatusOr<std::vector<float>> NextTokenLogits(absl::Span<const float* const> params,
                                                     absl::Span<const int32_t> context);

  // Validation: `val`'s windows (none when null, the default). Fails, naming
  // `data`, for a stream of N <= T tokens.
  absl::Status SetValidation(std::shared_ptr<const TokenStream> val);
  int64_t num_validation_samples() const override { return num_val_samples_; }
  // LossByUnit on the validation stream.
  absl::StatusOr<double> ValidationLossByUnit(UnitAccess& units,
                                              absl::Span<const int64_t> samples) override;

  // QK-clip (workload.h): H logits per layer; a head's rows are its query
  // rows [h D, (h + 1) D) and key rows C + [h D, (h + 1) D) of c_attn.weight,
  // each scaled by sqrt(tau / S_h) (MHA); c_attn.bias is left alone.
  int64_t attention_layers() const override { return dims_.n_layer; }
  int64_t attention_heads() const override { return dims_.n_head; }
  void ResetAttentionLogits() override;
  absl::Span<const float> attention_logits() const override { return logit_max_; }
  std::vector<RowScale> QkClipRows(absl::Span<const float> logits, double tau) const override;

  const model::GptDims& dims() const { return dims_; }
  const TokenStream& train() const { return *train_; }
  // The validation stream, or null.
  const TokenStream* validation() const { return val_.get(); }

 private:
  // What the backward pass needs from block l's forward pass, rows = n T.
  struct BlockActs {
    std::vector<float> resid_in;   // [rows, C] the block's input x
    std::vector<float> ln1;        // [rows, C] ln_1(x)
    std::vector<float> ln1_mean;   // [rows]
    std::vector<float> ln1_rstd;   // [rows] 1 / sqrt(var + eps)
    std::vector<float> qkv;        // [rows, 3C]
    std::vector<float> att;        // [n, H, T, T] softmax probabilities, 0 above the diagonal
    std::vector<float> atty;       // [rows, C] attention output before c_proj
    std::vector<float> resid_mid;  // [rows, C] x after the attention residual
    std::vector<float> ln2;        // [rows, C]
    std::vector<float> ln2_mean;   // [rows]
    std::vector<float> ln2_rstd;   // [rows]
    std::vector<float> fch;        // [rows, 4C] c_fc output (before gelu)
    std::vector<float> fch_gelu;   // [rows, 4C]
  };

  Gpt(model::GptDims dims, std::shared_ptr<const TokenStream> train, plan::ModelSpec spec);

  int head_unit() const { return static_cast<int>(dims_.n_layer) + 1; }

  // The host's passes (gpt_passes.h), which RunGptPasses drives; they
  // return OkStatus always.
  absl::Status Prepare(absl::Span<const int32_t> windows, int64_t n) override;
  absl::Status EmbedForward(int64_t n, const float* wte, const float* wpe) override;
  absl::Status BlockForward(int64_t layer, int64_t n, absl::Span<const float* const> p) override;
  absl::Status FinalNorm(int64_t n, const float* w, const float* b) override;
  absl::StatusOr<double> LogitsAndLoss(int64_t n, const float* wte, bool gradients) override;
  absl::Status HeadBackward(int64_t n, const float* wte, const float* lnf_w, float* dwte,
                            float* dlnf_w, float* dlnf_b) override;
  absl::Status BlockBackward(int64_t layer, int64_t n, absl::Span<const float* const> p,
                             absl::Span<float* const> g) override;
  absl::Status EmbedBackward(int64_t n, float* dwte, float* dwpe) override;

  // Grows the activation scratch to hold n samples.
  void Reserve(int64_t n);
  // `head_max`, when not null: raised to each head's largest logit (H).
  void AttentionForward(BlockActs& a, int64_t n, float* head_max);
  void AttentionBackward(const BlockActs& a, int64_t n, const float* datty, float* dqkv);

  // x at block l's output: block l + 1's input, or resid_out_ after the last.
  float* BlockOutput(int64_t layer);

  model::GptDims dims_;
  std::shared_ptr<const TokenStream> train_;
  plan::ModelSpec spec_;
  int64_t num_samples_ = 0;
  std::shared_ptr<const TokenStream> val_;  // null: no validation
  // [L H] the largest logits since ResetAttentionLogits; raised only while
  // record_logits_ (a training pass) is set.
  std::vector<float> logit_max_;
  bool record_logits_ = false;
  int64_t num_val_samples_ = 0;

  // Scratch (rows = n T for the call's n samples).
  int64_t capacity_ = 0;           // samples the buffers below hold
  std::vector<int32_t> tokens_;    // [n, T + 1] the windows (RunGptPasses reads them here)
  std::vector<BlockActs> blocks_;  // [L]
  std::vector<float> resid_out_;   // [rows, C] the last block's output
  std::vector<float> lnf_;         // [rows, C]
  std::vector<float> lnf_mean_;    // [rows]
  std::vector<float> lnf_rstd_;    // [rows]
  std::vector<float> logits_;      // [rows, V]; dL/dlogits after the loss
  std::vector<float> dresid_;      // [rows, C] dL/dx of the residual stream
  std::vector<float> dc_;          // [rows, C] dL/d(a LayerNorm output or the attention output)
  std::vector<float> dqkv_;        // [rows, 3C]
  std::vector<float> dfch_;        // [rows, 4C]
  std::vector<float> exp_;         // [max(V, T)] one row's exps (softmax, cross-entropy)
  std::vector<float> datt_;        // [T, T] one sample and head's dL/d(probabilities)
  std::vector<double> col_sums_;   // [8C] column sums of gradients
};

}  // namespace muonmesh::worker
