#include "worker/runtime/whole_state.h"

namespace muonmesh::worker {

const char* TensorOptimizerName(TensorOptimizer o) {
  switch (o) {
    case TensorOptimizer::kMuon:
      return "muon";
    case TensorOptimizer::kAdamW:
      return "adamw";
    case TensorOptimizer::kNone:
      break;
  }
  return "none";
}

bool ParseTensorOptimizer(const std::string& name, TensorOptimizer* out) {
  for (TensorOptimizer o :
       {TensorOptimizer::kNone, TensorOptimizer::kMuon, TensorOptimizer::kAdamW}) {
    if (name == TensorOptimizerName(o)) {
      *out = o;
      return true;
    }
  }
  return false;
}

}  // namespace muonmesh::worker
