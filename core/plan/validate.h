#pragma once

// Validation of planner input. Every violation is reported at once, each
// with the path of the offending field, so a user fixes a config in one go.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/plan/types.h"

namespace muonmesh::plan {

// Documented limits ("absurd sizes" are rejected, not attempted).
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 20;          // 1,048,576 ranks
inline constexpr int64_t kMaxUnits = 100'000;
// Most parameter gathers per unit and step (UnitSpec::gathers_per_step).
inline constexpr int32_t kMaxGathersPerStep = 8;
inline constexpr int64_t kMaxTensors = 1'000'000;                   // whole model
inline constexpr int64_t kMaxDims = 8;
inline constexpr int64_t kMaxModelElements = int64_t{1} << 50;      // ~1.1e15 parameters
// Model, unit and parameter names, in bytes. Messages quote at most
// kMaxQuotedBytes of a name, so that a huge name is never echoed back.
inline constexpr int64_t kMaxNameLength = 1024;
inline constexpr int64_t kMaxQuotedBytes = 64;
// kMaxNsSteps: plan/ns_cost.h.
// Matrices times domains in one plan (DDP on a huge world repeats every
// matrix in every rank's own domain).
inline constexpr int64_t kMaxPlanMatrixEntries = 20'000'000;
// Shards laid out in all (units times their domain sizes): layouts are kept
// per unit, so this bounds the planner's memory (DeepSeek-V3 fits up to about
// 270k ranks).
inline constexpr int64_t kMaxLayoutShards = int64_t{1} << 24;
// `text` quoted for a message: as is when short, else its first
// kMaxQuotedBytes bytes (cut on a UTF-8 boundary) and its length.
std::string Quote(absl::string_view text);

// All violations of the input; empty when it can be planned.
std::vector<FieldViolation> Validate(const PlanInput& input);

// The config with defaults resolved, or InvalidArgument listing every
// violation ("field: description; field: description").
absl::StatusOr<ResolvedConfig> Resolve(const PlanInput& input);

namespace internal {
// Resolve without validating, for input that Validate has passed.
ResolvedConfig ResolveUnchecked(const PlanInput& input);
}  // namespace internal

// The shape of a parameter as a matrix (rows, cols): (shape[0], rest) for a
// dense tensor, (shape[1], rest) per expert for an expert stack. Assumes a
// validated spec.
struct MatrixView {
  int64_t rows;
  int64_t cols;
};
MatrixView AsMatrix(const ParamSpec& p);
// The matrix Muon orthogonalizes (a block of AsMatrix's rows with
// muon_block_rows; the first with blocks of two sizes), and how many of them
// one expert's (or a dense) tensor holds.
MatrixView MuonMatrixOf(const ParamSpec& p);
int64_t MuonBlocksOf(const ParamSpec& p);
// Blocks of two sizes (muon_block_rows_next): the rows of one pair, block
// b's rows within its expert's (or the dense) matrix, and the block a row
// of that matrix falls in. Uniform blocks, whole matrices and stacked
// blocks (muon_stack_blocks: block 0 every pair's first block, block 1
// every pair's second, each in pieces) alike.
int64_t MuonBlockPeriod(const ParamSpec& p);
bool MuonStacksBlocks(const ParamSpec& p);
MatrixRows MuonBlockRows(const ParamSpec& p, int64_t block);
int64_t MuonBlockOfRow(const ParamSpec& p, int64_t row);
int64_t NumElements(const ParamSpec& p);

}  // namespace muonmesh::plan
