#include "worker/math/blas_threads.h"

#include <cblas.h>

#include <algorithm>

namespace muonmesh::math {

int SetBlasThreads(int threads) {
  const int before = openblas_get_num_threads();
  openblas_set_num_threads(std::max(1, threads));
  return before;
}

int BlasThreads() { return openblas_get_num_threads(); }

}  // namespace muonmesh::math
