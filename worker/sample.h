#pragma once

// Text from a trained language model (muonmesh-worker --sample; a kind that
// registers make_next_token in worker/model_kinds.h, such as gpt): the job
// file gives the model's shape, a safetensors file its weights (the job's
// export), and tokens are drawn one at a time from the model's next-token
// distribution.
//
// Sampling, exactly: with context c (the prompt, then what was drawn; only
// its last context_limit tokens are seen: a gpt's block_size), the logits z
// of the next token (NextTokenModel::NextTokenLogits) become, at temperature
// tau > 0, the distribution p_j proportional to exp((z_j - max z) / tau) over the top_k largest z
// (all when top_k is 0; ties broken by the lower id), computed in double.
// The draw takes u_i = (UniformAt(seed, 0, i) + 1) / 2 in [0, 1)
// (worker/model/rng.h) for the i-th new token and picks the first j, in
// that top-k order, whose cumulative probability exceeds u_i. Temperature
// 0 picks the largest logit (greedy). Same inputs, same text.
//
// Tokens are printed as text for a byte vocabulary (a model trained on
// data.text: every token a byte, written as is), else decoded through an
// llm.c tokenizer file (gpt2_tokenizer.bin) when one is given, else as
// token ids separated by spaces.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muonmesh::worker {

struct SampleOptions {
  std::string job_path;      // the job the weights were trained by
  std::string weights_path;  // a safetensors file with every parameter
  std::string prompt;        // text (bytes) for a byte vocabulary
  std::vector<int32_t> prompt_ids;  // token ids otherwise (or as well: appended)
  std::string tokenizer_path;       // llm.c tokenizer file: decodes ids to text
  int64_t tokens = 200;             // how many to draw
  double temperature = 1.0;         // >= 0; 0 is greedy
  int64_t top_k = 0;                // 0: every token
  uint64_t seed = 0;
};

// The generated tokens (the prompt not included). InvalidArgument naming
// the flag or file for a job that is not a gpt, weights of the wrong
// shapes, an empty prompt, a token outside the vocabulary, or options out
// of range. `*bytes`, when given, tells whether the model's tokens are
// bytes (it trained on data.text).
absl::StatusOr<std::vector<int32_t>> SampleTokens(const SampleOptions& options,
                                                  bool* bytes = nullptr);

// `tokens` as the options say to print them (see above); `bytes` as
// SampleTokens reports it.
absl::StatusOr<std::string> RenderTokens(const SampleOptions& options,
                                         const std::vector<int32_t>& tokens, bool bytes);

// An llm.c tokenizer file: a header of 256 little-endian uint32 (magic
// 20240328, version 1 or 2, vocabulary size; version 2 adds the end-of-text
// id), then per token one length byte and that many bytes. Token i's bytes
// at [i]. InvalidArgument naming the file when it is not one.
absl::StatusOr<std::vector<std::string>> ReadTokenizer(const std::string& path);

}  // namespace muonmesh::worker
