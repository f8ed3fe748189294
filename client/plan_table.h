#pragma once

// The human view of a plan (`muonmeshctl plan` without --json): what the
// mesh looks like, what the layout costs (padding, Newton-Schulz makespan,
// bytes per step) and which ranks carry the most. Machine readers use the
// JSON view; this text is not a stable format.
//
// Pure functions; safe from any thread.

#include <cstdint>
#include <string>

#include "muonmesh/v1/planner.pb.h"

namespace muonmesh::client {

// World sizes above this show only the most and least loaded ranks.
inline constexpr int kPlanTableAllRanksUpTo = 16;
inline constexpr int kPlanTableTopRanks = 8;
inline constexpr int kPlanTableBottomRanks = 4;

// The plan of `model_name` as aligned text tables, ending with a newline.
std::string FormatPlanTable(const std::string& model_name, const v1::Plan& plan);

// Human-readable units, for the table and for messages: "512 B", "1.5 KiB",
// "59.3 MiB", "1.2 GiB"; "850 FLOP", "1.23 GFLOP", "4.56 TFLOP";
// "124,439,808".
std::string FormatBytes(double bytes);
std::string FormatFlops(double flops);
std::string FormatCount(int64_t n);

}  // namespace muonmesh::client
