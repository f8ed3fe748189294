#pragma once

// A model's training state as whole tensors, whatever layout wrote it: what
// a checkpoint consolidates to (worker/reshard.h) and what a Trainer of any
// layout loads (Trainer::LoadState). See docs/architecture.md §7
// ("Resharding").

#include <cstdint>
#include <string>
#include <vector>

namespace muonmesh::worker {

// Which optimizer a tensor's state belongs to. kNone: a tensor no optimizer
// steps (a frozen unit), or state that was not recorded (a plain weights
// file).
enum class TensorOptimizer { kNone, kMuon, kAdamW };

const char* TensorOptimizerName(TensorOptimizer o);
// "muon", "adamw", "none"; false for anything else.
bool ParseTensorOptimizer(const std::string& name, TensorOptimizer* out);

struct WholeTensor {
  std::string name;
  std::vector<int64_t> shape;
  TensorOptimizer optimizer = TensorOptimizer::kNone;
  std::vector<float> param;
  // Muon: the momentum buffer. AdamW: exp_avg. Empty: no state recorded.
  std::vector<float> state1;
  // AdamW: exp_avg_sq. Empty for Muon, and when no state was recorded.
  std::vector<float> state2;
};

// A model buffer (Workload::buffers: replicated, not trained) with its
// values. Shard files keep buffer NAME as tensor "buffer/NAME"
// (kBufferTensorPrefix, on every rank); consolidated files and exports
// keep it as NAME, listed in metadata "buffers" (one NAME a line), so it is
// not taken for a parameter.
struct WholeBuffer {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};
inline constexpr char kBufferTensorPrefix[] = "buffer/";

struct WholeState {
  int64_t step = 0;                  // steps done
  // Steps done before the optimizer state began (a start with fresh state):
  // AdamW's bias correction counts from it.
  int64_t adamw_origin = 0;
  std::vector<WholeTensor> tensors;  // flat spec order
  std::vector<WholeBuffer> buffers;  // by name; a model buffer absent here loads as 0
};

}  // namespace muonmesh::worker
