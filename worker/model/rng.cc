#include "worker/model/rng.h"

namespace muonmesh::worker {

void UniformStream::Fill(uint64_t first, int64_t count, double factor, float* out) const {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = static_cast<float>(static_cast<double>(At(first + static_cast<uint64_t>(i))) * factor);
  }
}

}  // namespace muonmesh::worker
