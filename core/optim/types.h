#pragma once

// Option structs of the optimizer numerics (worker/math/ on CPU and
// worker/cuda/ on GPU). Plain values: copy them freely. The defaults are
// torch.optim's (Muon: torch.optim.Muon, AdamW: torch.optim.AdamW).

#include <cstdint>
#include <optional>
#include <vector>

#include "core/plan/ns_cost.h"

namespace muonmesh::optim {

// One Newton-Schulz iteration X <- a X + (b A + c A^2) X with A = X X^T.
using NsCoefficientSet = plan::NsCoefficientSet;

enum class NsCoefficients {
  // (3.4445, -4.7750, 2.0315) on every iteration (Keller Jordan's quintic,
  // torch.optim.Muon's default).
  kQuintic,
  // Polar Express (arXiv 2505.16932) as NVIDIA Emerging-Optimizers tabulates
  // it: eight rows, the last repeating past eight iterations.
  kPolarExpress,
  // NsOptions::table, the last row repeating past its end.
  kTable,
};

// The named tables (plan::NsTable, what a job file names) and back; a
// custom table (kTable) has no name and maps to nullopt.
inline NsCoefficients NsCoefficientsOf(plan::NsTable table) {
  return table == plan::NsTable::kPolarExpress ? NsCoefficients::kPolarExpress
                                               : NsCoefficients::kQuintic;
}
inline std::optional<plan::NsTable> NsTableOf(NsCoefficients coefficients) {
  switch (coefficients) {
    case NsCoefficients::kQuintic:
      return plan::NsTable::kQuintic;
    case NsCoefficients::kPolarExpress:
      return plan::NsTable::kPolarExpress;
    case NsCoefficients::kTable:
      break;
  }
  return std::nullopt;
}

struct NsOptions {
  // Iterations T; ValidateNsOptions accepts [1, 100].
  int steps = static_cast<int>(plan::kDefaultNsSteps);
  NsCoefficients coefficients = NsCoefficients::kQuintic;
  // Used only with NsCoefficients::kTable: row t for iteration t.
  std::vector<NsCoefficientSet> table;
  // X is divided by max(||X||_F, eps) before the first iteration.
  double eps = 1e-7;
  // Standard or Gram form (plan/ns_cost.h); auto: per matrix, the one with
  // fewer FLOPs.
  plan::NsAlgorithm algorithm = plan::NsAlgorithm::kAuto;
  // The OpenBLAS threads the caller runs (the job's threads_per_rank): auto
  // prices the spectral form's eigensolver for it (plan/ns_cost.h). It
  // chooses; it does not set OpenBLAS's thread count.
  int64_t threads = 1;
};

// How Muon scales the orthogonalised update of a rows x cols matrix
// (torch.optim.Muon's adjust_lr_fn).
enum class MuonScale {
  // sqrt(max(1, rows / cols)).
  kOriginal,
  // 0.2 * sqrt(max(rows, cols)): update RMS comparable to AdamW's.
  kMatchRmsAdamW,
};

struct MuonOptions {
  double lr = 1e-3;
  double momentum = 0.95;  // beta, in [0, 1)
  bool nesterov = true;
  double weight_decay = 0.1;  // decoupled, multiplied by the unadjusted lr
  MuonScale scale = MuonScale::kOriginal;
  NsOptions ns;
};

// What an optimizer.rules entry changes for the tensors it matches (a torch
// param group): the learning rate times lr_scale, and weight_decay instead
// of the optimizer's when set.
struct ParamRates {
  double lr_scale = 1.0;
  std::optional<double> weight_decay;
  bool operator==(const ParamRates&) const = default;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled: p <- p (1 - lr wd) first
};

}  // namespace muonmesh::optim
