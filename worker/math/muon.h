#pragma once

// Muon (torch.optim.Muon semantics) split the way the sharded runtime runs it:
//
//   1. MuonPrepare, on each rank's row shard: m' = m + (1 - beta)(g - m),
//      u = nesterov ? g + beta (m' - g) : m'. Writes only u.
//   2. Gather u's row shards to the matrix's owner; NewtonSchulz::Run on the
//      whole matrix gives O (never on a row shard: that is a different map).
//   3. Scatter O's rows back; MuonApply, on each row shard, commits
//      m <- m' and p <- p (1 - lr wd) - lr scale O.
//
// Nothing is committed before step 3, so a refused step (an error from any
// phase) leaves weights and momentum as they were; MuonApply recomputes m'
// from (g, m) with the same code as MuonPrepare, so the two agree bit for bit.
// The momentum buffer starts at zero, as in torch.
//
// Elementwise operations round in torch's order: lerp as torch's lerp
// (w < 0.5 ? s + w (e - s) : e - (e - s)(1 - w)), then p * (1 - lr wd) and
// + (-lr scale) * O. Scalars are computed in double and rounded to float
// once, as torch does with Python scalars.
//
// The free functions are stateless and thread-safe; Muon (the full-matrix
// convenience step) owns a NewtonSchulz and a scratch buffer: one per thread.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "worker/math/newton_schulz.h"
#include "core/optim/optimizer_options.h"
#include "core/optim/types.h"

namespace muonmesh::math {

// Phase 1 on a shard of any number of whole rows: writes u (same size as
// grad and momentum). InvalidArgument, with u untouched, for invalid options,
// mismatched sizes or a NaN/infinity in grad or momentum.
absl::Status MuonPrepare(const optim::MuonOptions& options, absl::Span<const float> grad,
                         absl::Span<const float> momentum, absl::Span<float> update);

// Phase 3 on the same shard: `orthogonalized` holds this shard's rows of O,
// and rows x cols is the shape of the whole matrix (it sets the scale).
// Commits momentum and param. InvalidArgument, with nothing written, for
// invalid options or shape, mismatched sizes, a NaN/infinity in O, or an
// update that would make a weight or momentum value non-finite.
absl::Status MuonApply(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                       absl::Span<const float> grad, absl::Span<const float> orthogonalized,
                       absl::Span<float> momentum, absl::Span<float> param);

// One Muon step on whole matrices held by one rank (no sharding): the three
// phases back to back. Holds the Newton-Schulz workspace and the u buffer, so
// after the first step on the largest shape it allocates nothing.
class Muon {
 public:
  // One step on a row-major rows x cols matrix. On any error, param and
  // momentum are untouched; the errors are those of the phases.
  absl::Status Step(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                    absl::Span<const float> grad, absl::Span<float> momentum,
                    absl::Span<float> param);

  // One step on `count` equal-shape matrices stored back to back (an expert
  // stack [count, rows, cols]); each matrix is orthogonalised on its own and
  // the result equals `count` calls of Step bit for bit. All or nothing: on
  // any error no matrix is updated.
  absl::Status StepBatched(const optim::MuonOptions& options, int64_t count, int64_t rows, int64_t cols,
                           absl::Span<const float> grad, absl::Span<float> momentum,
                           absl::Span<float> param);

 private:
  NewtonSchulz ns_;
  internal::AlignedFloats update_;
};

}  // namespace muonmesh::math
