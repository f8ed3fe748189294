#pragma once

// The expert side of a mixture-of-experts exchange: the tokens a rank
// received, each tagged with the local expert it goes to (a float id, the
// first value of its row, as the exchange carries it), grouped by that
// expert with a stable counting sort. The CPU and CUDA moe_mlp share it so
// both group, and so sum, in one order. Header-only; any thread.

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muonmesh::worker::internal {

// ids[r * stride] is the local expert of received token r (r < received),
// checked to be a whole number in [0, local) (InternalError otherwise: a
// peer sent what no rank should). On return (*expert)[r] is that expert,
// (*begin)[l] .. (*begin)[l + 1] the positions in *order of expert l's
// tokens (begin has local + 1 entries), and *order lists the received
// tokens expert by expert, in arrival order within an expert.
template <typename Index>
absl::Status GroupByLocalExpert(const float* ids, int64_t stride, int64_t received,
                                int64_t local, std::vector<int32_t>* expert,
                                std::vector<int64_t>* begin, std::vector<Index>* order) {
  expert->resize(static_cast<size_t>(received));
  begin->assign(static_cast<size_t>(local + 1), 0);
  for (int64_t r = 0; r < received; ++r) {
    const float id = ids[r * stride];
    if (!(id >= 0.0f && id < static_cast<float>(local)) || id != std::floor(id)) {
      return absl::InternalError(absl::StrCat("moe_mlp: received a token for local expert ", id,
                                              " of ", local));
    }
    (*expert)[r] = static_cast<int32_t>(id);
    ++(*begin)[(*expert)[r] + 1];
  }
  for (int64_t l = 0; l < local; ++l) (*begin)[l + 1] += (*begin)[l];
  order->resize(static_cast<size_t>(received));
  std::vector<int64_t> next(begin->begin(), begin->end() - 1);
  for (int64_t r = 0; r < received; ++r) {
    (*order)[next[(*expert)[r]]++] = static_cast<Index>(r);
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker::internal
