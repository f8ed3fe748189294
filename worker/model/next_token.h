#pragma once

// A language model as sampling sees it (worker/sample.h): the logits of the
// token that follows a context. A model kind that is a language model
// registers a maker of one (worker/model_kinds.h, make_next_token).
//
// Not thread-safe: a model may keep scratch between calls.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

class NextTokenModel {
 public:
  virtual ~NextTokenModel() = default;

  virtual int64_t vocab_size() const = 0;
  // The most tokens of context the model sees; sampling drops older ones.
  virtual int64_t context_limit() const = 0;
  // The logits [vocab_size] after `context` (1 to context_limit tokens,
  // each in [0, vocab_size)) with the parameters `params` (flat order of
  // the model's spec). InvalidArgument for a wrong length or token.
  virtual absl::StatusOr<std::vector<float>> NextTokenLogits(
      absl::Span<const float* const> params, absl::Span<const int32_t> context) = 0;
  // The model's buffers (workload.h; a transformer's balancing bias, which
  // routing reads), loaded with the weights; none by default.
  virtual std::vector<BufferSpec> buffers() const { return {}; }
  virtual absl::Status SetBuffers(absl::Span<const std::vector<float>> /*values*/) {
    return absl::OkStatus();
  }
};

}  // namespace muonmesh::worker
