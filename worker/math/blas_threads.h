#pragma once

// The OpenBLAS threads this process's math runs on. OpenBLAS keeps one count
// for the whole process; a rank sets it to its job's threads_per_rank before
// it builds anything (worker/rank_runner.cc), so the forms auto picks
// (plan/ns_cost.h, priced for that count) are the ones that run fastest.

namespace muonmesh::math {

// Sets the count (clamped to >= 1) and returns the one before.
int SetBlasThreads(int threads);

int BlasThreads();

}  // namespace muonmesh::math
