#pragma once

// A training workload as the worker runtime sees it: a model spec (units of
// parameters, which the planner lays out) and a function from full parameter
// tensors and a set of sample indices to a loss and full gradients.
//
// The runtime calls ForwardBackwardByUnit on this rank's slice of the
// global batch: it gathers a unit's parameters into whole tensors when the
// workload acquires the unit, and reduces a unit's gradients over the
// data-parallel ranks with an average when the workload commits them. So that the math
// does not depend on the layout, the loss is the mean over this call's
// samples (every data-parallel rank gets an equal slice; the average of the
// slice means is the global mean).
//
// Parameters are addressed by their flat index: units in order, parameters
// in order within each unit (the order of spec()). Tensors are row-major
// fp32, in host memory unless memory_space() says the workload computes on a
// GPU (then ForwardBackwardByUnit's tensors, and ExchangeTokens' buffers,
// are device memory).
//
// Thread-compatible: one instance per rank; ForwardBackward may keep scratch
// buffers between calls.
//
// Streaming (FSDP style): ForwardBackwardByUnit computes the same loss and
// gradients but asks for one unit's whole parameters at a time and hands
// back each unit's gradients as soon as they are final, so that the runtime
// never holds the whole model. The default implementation acquires every
// unit and calls ForwardBackward (correct, not memory-saving); workloads
// override it to stream.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/plan/types.h"
#include "worker/comm/types.h"

namespace muonmesh::worker {

// The runtime's side of ForwardBackwardByUnit. Units are indexed as in
// spec().units; a unit's tensors are its parameters in spec order.
class UnitAccess {
 public:
  virtual ~UnitAccess() = default;
  // Whole tensors of unit `unit`, valid until Release(unit). A unit may be
  // acquired again after its release (the runtime gathers it again).
  virtual absl::StatusOr<absl::Span<const float* const>> Acquire(int unit) = 0;
  virtual void Release(int unit) = 0;
  // Buffers for unit `unit`'s gradients (one per parameter, overwritten by
  // the workload); Commit(unit) hands them back: the runtime reduces them
  // right away and may reuse the memory. Each unit is committed exactly once
  // per call.
  virtual absl::StatusOr<absl::Span<float* const>> GradientBuffers(int unit) = 0;
  virtual absl::Status Commit(int unit) = 0;

  // Expert parallelism (docs/architecture.md §3). Expert stacks [E, ...] are split over
  // EP = expert_parallel_size() groups: this rank holds experts
  // [i * E/EP, (i + 1) * E/EP) for i = expert_parallel_index(), and Acquire
  // and GradientBuffers hand out only those (a stack's tensor holds E/EP
  // experts). Tokens reach the rank holding their expert through
  // ExchangeTokens, over the EP ranks that share this rank's slice of the
  // batch position (one per group, in group order).
  //
  // The gradient of an expert stack is taken with respect to the mean of the
  // losses of those EP ranks (each rank's loss is the mean over its own
  // samples): with every rank's slice the same size, the runtime's average
  // over the expert data-parallel ranks then gives the global-batch mean, as
  // for dense parameters.
  virtual int expert_parallel_size() const { return 1; }
  virtual int expert_parallel_index() const { return 0; }

  // A variable-size exchange over the EP ranks (Communicator::AllToAllV
  // semantics, by group index): send_counts[q] floats to group q, in order;
  // recv_counts[q] floats from it. Every EP rank must call it the same number
  // of times. The default (EP = 1) copies send to recv.
  virtual absl::Status ExchangeTokens(const float* send, absl::Span<const int64_t> send_counts,
                                      float* recv, absl::Span<const int64_t> recv_counts);
};

// Releases an acquired unit on scope exit (an error path), unless
// Release() or Keep() ran first.
class HeldUnit {
 public:
  HeldUnit(UnitAccess& units, int unit) : units_(units), unit_(unit) {}
  ~HeldUnit() { Release(); }
  void Release() {
    if (unit_ >= 0) units_.Release(unit_);
    unit_ = -1;
  }
  // Hands the unit on, still acquired: the destructor no longer releases it.
  void Keep() { unit_ = -1; }
  HeldUnit(const HeldUnit&) = delete;
  HeldUnit& operator=(const HeldUnit&) = delete;

 private:
  UnitAccess& units_;
  int unit_;
};

// Whole tensors (every parameter of `spec`, flat order) as a UnitAccess
// with one expert-parallel group: what a workload's ForwardBackward runs its
// by-unit code on, so that the two compute alike. Acquire hands out slices
// of `params`, GradientBuffers of `grads` (Internal when none were given:
// a loss-only pass); Release and Commit do nothing. It keeps views: the
// spans must outlive it.
class WholeModelAccess final : public UnitAccess {
 public:
  WholeModelAccess(const plan::ModelSpec& spec, absl::Span<const float* const> params,
                   absl::Span<float* const> grads);
  absl::StatusOr<absl::Span<const float* const>> Acquire(int unit) override;
  void Release(int) override {}
  absl::StatusOr<absl::Span<float* const>> GradientBuffers(int unit) override;
  absl::Status Commit(int) override { return absl::OkStatus(); }

 private:
  std::string model_;
  absl::Span<const float* const> params_;
  absl::Span<float* const> grads_;
  std::vector<size_t> first_;  // per unit: its first parameter's flat index
  std::vector<size_t> count_;  // per unit: its number of parameters
};

// QK-clip (docs/architecture.md, "QK-clip"): rows of one parameter the
// runtime multiplies by `factor` after a step: rows [row_start, row_start +
// rows) of flat parameter `flat` (a row: the parameter's elements divided by
// its first dimension).
struct RowScale {
  int32_t flat = 0;
  int64_t row_start = 0;
  int64_t rows = 0;
  float factor = 1.0f;
};

// A buffer: a replicated tensor a workload keeps beside its parameters,
// not trained by gradients and the same on every rank, saved in checkpoints
// and exports under its name (a transformer's balancing bias,
// layers.N.mlp.router.bias [E]).
struct BufferSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// A mixture-of-experts layer's load in one step: the model's layer, the
// tokens of the global batch routed to its least and most loaded expert
// over the mean per expert (1 and 1: perfectly balanced), and the tokens
// dropped (none: no capacity limit).
struct ExpertLoad {
  int64_t layer = 0;
  double min_over_mean = 0;
  double max_over_mean = 0;
  int64_t dropped = 0;
};

class Workload {
 public:
  virtual ~Workload() = default;

  // The parameters, as units; stable for the workload's lifetime.
  virtual const plan::ModelSpec& spec() const = 0;

  // Where the tensors of ForwardBackwardByUnit live (the runtime's device
  // must match): host memory unless a workload computes on a GPU.
  // Initialize and InitializeUnit always write host memory.
  virtual comm::MemorySpace memory_space() const { return comm::MemorySpace::kHost; }

  // Number of samples in the dataset (N); the batch of step s is samples
  // (s * B + j) mod N for j < B.
  virtual int64_t num_samples() const = 0;

  // Writes the deterministic initial value of every parameter (params[i]
  // has the size of parameter i). Same seed, same values, on every rank.
  virtual absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const = 0;

  // Loss (mean over `samples`) and its gradient with respect to every
  // parameter, written to grads[i] (overwritten, not accumulated). `step`
  // is the 0-based step (synthetic workloads derive gradients from it).
  // InvalidArgument for an empty or out-of-range sample list.
  virtual absl::StatusOr<double> ForwardBackward(int64_t step,
                                                 absl::Span<const float* const> params,
                                                 absl::Span<const int64_t> samples,
                                                 absl::Span<float* const> grads) = 0;

  // The same loss and gradients as ForwardBackward (bit for bit), with the
  // parameters and gradients exchanged unit by unit through `units`. Every
  // unit is committed exactly once on success; an error from `units` is
  // returned as is. The default acquires every unit, runs ForwardBackward,
  // commits every unit and releases every unit; with EP > 1 and expert
  // parameters it returns Unimplemented (it needs whole expert stacks).
  virtual absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                                       absl::Span<const int64_t> samples);

  // Writes the initial value of unit `unit`'s parameters (params[j] has the
  // size of the unit's parameter j): the same values as Initialize. The
  // default runs Initialize on the whole model and copies the unit out
  // (correct, model-sized scratch); workloads override it to avoid that.
  virtual absl::Status InitializeUnit(uint64_t seed, int unit,
                                      absl::Span<float* const> params) const;

  // Validation (language models): the number of distinct validation
  // samples (0: the workload has no validation data, the default), and the
  // mean loss over `samples` of them, each in [0, num_validation_samples()),
  // with the parameters acquired unit by unit through `units` and nothing
  // committed. The default is Unimplemented.
  virtual int64_t num_validation_samples() const { return 0; }
  virtual absl::StatusOr<double> ValidationLossByUnit(UnitAccess& units,
                                                      absl::Span<const int64_t> samples);

  // Attention (models with heads; the defaults: none). Every training pass
  // (ForwardBackward, ForwardBackwardByUnit; not validation or loss-only
  // passes) raises attention_logits()[l * heads + h] to the largest
  // pre-softmax logit q.k / sqrt(D) of head h of layer l over the causal
  // positions of its samples; ResetAttentionLogits() sets them to -infinity.
  // A workload whose device does not record them returns 0 layers.
  virtual int64_t attention_layers() const { return 0; }
  virtual int64_t attention_heads() const { return 0; }
  virtual void ResetAttentionLogits() {}
  virtual absl::Span<const float> attention_logits() const { return {}; }
  // MuonClip: given every head's largest logit over the global batch
  // (`logits`, as attention_logits() lays them out) and tau > 0, the rows to
  // rescale so that each head with a logit above tau is brought to tau
  // (docs/architecture.md, "QK-clip"). Heads at or below tau: no rows.
  virtual std::vector<RowScale> QkClipRows(absl::Span<const float> /*logits*/,
                                           double /*tau*/) const {
    return {};
  }

  // Buffers (the default: none): names and shapes, their values (one
  // vector each, in buffers() order), and SetBuffers (InvalidArgument
  // naming the buffer for a wrong count or size; nothing changed then).
  virtual std::vector<BufferSpec> buffers() const { return {}; }
  virtual std::vector<std::vector<float>> BufferValues() const { return {}; }
  virtual absl::Status SetBuffers(absl::Span<const std::vector<float>> values);
  // What training passes gather for the buffers' update (a transformer:
  // the tokens routed to each expert of each MoE layer, as floats). The
  // runtime resets them before a step, sums them over every rank after it
  // (each rank's own samples: every token counted once) and hands the sums
  // to UpdateBuffers on every rank, so that every rank updates alike.
  // Validation passes gather nothing.
  virtual void ResetBufferStats() {}
  virtual absl::Span<const float> buffer_stats() const { return {}; }
  virtual absl::Status UpdateBuffers(absl::Span<const float> /*global*/) {
    return absl::OkStatus();
  }
  // Per MoE layer, the load the last UpdateBuffers saw (empty: no experts).
  virtual std::vector<ExpertLoad> expert_load() const { return {}; }
  // A loss term beside the data's (a transformer's balance loss): its mean
  // over the training passes since ResetBufferStats, each pass's the mean
  // over its samples; nothing for a model without one. The runtime averages
  // it over the ranks (StepReport::aux_loss).
  virtual std::optional<double> aux_loss() const { return std::nullopt; }
};

}  // namespace muonmesh::worker
