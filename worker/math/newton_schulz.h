#pragma once

// Newton-Schulz orthogonalisation on the CPU: fp32 through OpenBLAS.
//
// NewtonSchulz holds the workspace of the iteration (two m x n buffers and
// four m x m buffers for m = min(rows, cols), n = max(rows, cols); the
// spectral form adds fp64 ones: WorkspaceBytes). It grows to the
// largest shape it has seen (or was told with Reserve) and is then reused, so a
// call on a shape that fits does no heap allocation. One instance per thread:
// Run is not safe to call concurrently on one object. OpenBLAS threads inside
// each call.
//
// The iteration (docs/architecture.md §5): X = x, transposed when rows > cols;
// X <- X / max(||X||_F, eps) with the norm accumulated in double; then T times
//     A = X X^T;   B = b A + c A A;   X = a X + B X.
// A and A A are symmetric, so both are rank-k updates (ssyrk, one triangle)
// and B X is a symmetric-times-general product (ssymm); a X is folded into
// the product as (B + a I) X. The result is a deterministic function of the
// input (for a fixed OpenBLAS build and thread count), and NS(x^T) is exactly
// NS(x)^T because the transposed input is laid out identically before any
// arithmetic.
//
// optim::NsOptions::algorithm picks the Gram form instead (plan/ns_cost.h: the
// iteration on the m x m matrices X X^T and Q with X_k = Q X_0, restarted
// from a fresh X X^T as plan::GramStartsAt says), or its spectral
// evaluation (the same X_T = q_T(X_0 X_0^T) X_0 through the eigenvalues of
// X_0 X_0^T in fp64: LAPACK's dsyevd, which OpenBLAS carries); kAuto takes
// the form with the fewest FLOPs for optim::NsOptions::threads (optim::NsFormFor: at 5
// quintic iterations on one thread, matrices beyond 1:1.5 go to the Gram
// iteration and beyond 1:(1 + 1500 / m) to the spectral form; on two, the
// Gram iteration keeps them up to about 1:13.6 at m = 1024), which is what the planner charges the owner. Same properties:
// deterministic, exact under transposition, batched equal to per-matrix.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/plan/ns_cost.h"
#include "core/optim/types.h"

namespace muonmesh::math {

namespace internal {

// A 64-byte aligned array of T (float, double or int) that only grows.
template <class T>
class AlignedArray {
 public:
  // False when the allocation failed. Growing frees the old array first
  // (its contents are scratch), so that growth never holds both at once.
  bool Reserve(size_t count);
  T* data() { return data_.get(); }
  size_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(T* p) const;
  };
  std::unique_ptr<T[], Free> data_;
  size_t capacity_ = 0;
};

using AlignedFloats = AlignedArray<float>;

}  // namespace internal

// The workspace one NewtonSchulz holds after running every shape added:
// each of its buffers grows to the largest size any of them needed, so a
// wide matrix and a square one together hold more than either alone.
class NsWorkspaceBound {
 public:
  void Add(int64_t rows, int64_t cols, plan::NsAlgorithm form);
  size_t bytes() const;

 private:
  size_t mn_ = 0;          // floats of each m x n buffer
  size_t mm_ = 0;          // floats of each m x m buffer
  int64_t spectral_m_ = 0;  // the largest short side run in the spectral form
};

class NewtonSchulz {
 public:
  NewtonSchulz() = default;
  NewtonSchulz(const NewtonSchulz&) = delete;
  NewtonSchulz& operator=(const NewtonSchulz&) = delete;
  NewtonSchulz(NewtonSchulz&&) = default;
  NewtonSchulz& operator=(NewtonSchulz&&) = default;

  // Allocates the workspace for rows x cols (either orientation) in `form`
  // (kSpectral adds its fp64 buffers; the others share theirs) now, so the
  // first Run on that shape allocates nothing. ResourceExhausted when the
  // allocation fails, InvalidArgument for negative or oversized dimensions.
  absl::Status Reserve(int64_t rows, int64_t cols,
                       plan::NsAlgorithm form = plan::NsAlgorithm::kStandard);

  // The workspace Reserve(rows, cols, form) holds on a fresh object (for
  // several shapes: NsWorkspaceBound).
  static size_t WorkspaceBytes(int64_t rows, int64_t cols, plan::NsAlgorithm form);

  // Orthogonalises the row-major rows x cols matrix x in place.
  //  - rows == 0 or cols == 0: nothing to do, OK.
  //  - a zero matrix stays zero (X / eps = 0).
  //  - InvalidArgument if options are invalid or x holds a NaN or infinity;
  //    x is then untouched.
  //  - InvalidArgument if the iteration produced a non-finite value (only a
  //    diverging user table can); x is then untouched.
  //  - ResourceExhausted if the workspace could not grow; x untouched.
  absl::Status Run(float* x, int64_t rows, int64_t cols, const optim::NsOptions& options);

  // Orthogonalises `count` row-major rows x cols matrices stored one after
  // another (an expert stack [count, rows, cols]); each result equals Run on
  // that matrix bit for bit. Every input is checked before any is written, so
  // bad options or a non-finite input leave all of x untouched. A non-finite
  // result (diverging user table) stops at that matrix: the earlier ones hold
  // their results, that one and the later ones are untouched.
  absl::Status RunBatched(float* x, int64_t count, int64_t rows, int64_t cols,
                          const optim::NsOptions& options);

  // Bytes of workspace currently held.
  size_t workspace_bytes() const;

 private:
  absl::Status RunValidated(float* x, int64_t rows, int64_t cols, const optim::NsOptions& options);
  // The iterations on the normalised m x n matrix in x0_; return where the
  // result is (x0_ or x1_).
  const float* IterateStandard(int64_t m, int64_t n, const optim::NsOptions& options);
  const float* IterateGram(int64_t m, int64_t n, const optim::NsOptions& options);
  absl::StatusOr<const float*> EvaluateSpectral(int64_t m, int64_t n, const optim::NsOptions& options);

  internal::AlignedFloats x0_;  // m x n, ping
  internal::AlignedFloats x1_;  // m x n, pong
  internal::AlignedFloats a_;   // m x m, X X^T (made full before A A)
  internal::AlignedFloats b_;   // m x m, upper triangle of b A + c A A + a I
  internal::AlignedFloats q_;   // m x m, Gram form: Q
  internal::AlignedFloats c_;   // m x m, Gram form: scratch
  // Spectral form: G = X X^T, then its eigenvectors (m x m); its eigenvalues,
  // a block of X in double and LAPACK's work; LAPACK's integer work.
  internal::AlignedArray<double> g_;
  internal::AlignedArray<double> dwork_;
  internal::AlignedArray<int> iwork_;
};

}  // namespace muonmesh::math
