// The Gloo communicator's algorithms by size (worker/comm/gloo_communicator.cc;
// docs/architecture.md §5, "Collective algorithms"): the direct all-gather
// and the ring, the one-round all-reduce and the reduce-scatter then
// all-gather, each on both sides of its threshold, give the bits of the
// sequential rank-order sum (or the concatenation) computed here with
// plain loops, at 2-4 ranks on loopback; and so do the same exchanges sent
// in chunks through a window (GroupOptions::gloo_window_bytes), with parts
// of many chunks, of a part of one, and empty.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/test_util.h"
#include "worker/comm/communicator.h"
#include "worker/comm/file_store.h"

namespace muonmesh::comm {
namespace {

using testing::RunOnThreads;
using testing::ScopedTempDir;

const CollectiveOptions kOpts{absl::Seconds(20)};

// Floats whose sums round (mixed exponents and signs), from (rank, i).
float Messy(int rank, int64_t i) {
  uint32_t x = static_cast<uint32_t>(rank * 7919 + i * 104729 + 17);
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return std::ldexp(static_cast<float>(x % 100000) / 100000.0f - 0.5f,
                    static_cast<int>((x >> 20) % 12) - 6);
}

struct Case {
  int ranks;
  int direct_max_ranks;      // GroupOptions::gloo_direct_max_ranks
  int64_t window_bytes = 0;  // GroupOptions::gloo_window_bytes
};

class GlooAlgorithmsTest : public ::testing::TestWithParam<Case> {
 protected:
  // Runs fn(rank, communicator) on one thread per rank of a fresh group.
  void RunGroup(const std::function<void(int, Communicator&)>& fn) {
    ScopedTempDir dir;
    absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Open(dir.path());
    ASSERT_TRUE(store.ok()) << store.status();
    const Case c = GetParam();
    RunOnThreads(c.ranks, [&](int r) {
      GroupOptions o;
      o.connect_timeout = absl::Seconds(30);
      o.gloo_direct_max_ranks = c.direct_max_ranks;
      o.gloo_window_bytes = c.window_bytes;
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          CreateGroup(Backend::kGloo, **store, "algorithms", r, c.ranks, o);
      ASSERT_TRUE(comm.ok()) << comm.status();
      fn(r, **comm);
    });
  }
};

// Below and above 64 KiB (16384 floats): one round, then reduce-scatter and
// all-gather; the large all-gather crosses 1 MiB, where a group past
// gloo_direct_max_ranks takes the ring.
TEST_P(GlooAlgorithmsTest, AllReduceIsTheRankOrderSumAtEverySize) {
  const int n = GetParam().ranks;
  RunGroup([&](int r, Communicator& comm) {
    for (int64_t count : {int64_t{5}, int64_t{16384}, int64_t{16385}, int64_t{300007}}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        std::vector<float> buf(count);
        for (int64_t i = 0; i < count; ++i) buf[i] = Messy(r, i);
        ASSERT_TRUE(comm.AllReduce(buf.data(), count, op, kOpts).ok());
        for (int64_t i = 0; i < count; ++i) {
          float want = Messy(0, i);
          for (int q = 1; q < n; ++q) {
            want = op == ReduceOp::kMax ? std::max(want, Messy(q, i)) : want + Messy(q, i);
          }
          if (op == ReduceOp::kAvg) want /= static_cast<float>(n);
          ASSERT_EQ(std::memcmp(&buf[i], &want, sizeof(float)), 0)
              << "count " << count << " op " << static_cast<int>(op) << " i " << i << ": "
              << buf[i] << " != " << want;
        }
      }
    }
  });
}

TEST_P(GlooAlgorithmsTest, AllGatherConcatenatesAtEverySize) {
  const int n = GetParam().ranks;
  RunGroup([&](int r, Communicator& comm) {
    // 4 n count bytes gathered: below 1 MiB, then above.
    for (int64_t count : {int64_t{3}, int64_t{100003}}) {
      std::vector<float> in(count), out(n * count, -1.0f);
      for (int64_t i = 0; i < count; ++i) in[i] = Messy(r, i);
      ASSERT_TRUE(comm.AllGather(in.data(), count, out.data(), kOpts).ok());
      for (int q = 0; q < n; ++q) {
        for (int64_t i = 0; i < count; ++i) {
          const float want = Messy(q, i);
          ASSERT_EQ(std::memcmp(&out[q * count + i], &want, sizeof(float)), 0)
              << "count " << count << " from rank " << q << " i " << i;
        }
      }
      // In place: my part already where it belongs.
      std::vector<float> inplace(n * count, -1.0f);
      std::copy(in.begin(), in.end(), inplace.begin() + r * count);
      ASSERT_TRUE(comm.AllGather(inplace.data() + r * count, count, inplace.data(), kOpts).ok());
      ASSERT_EQ(inplace, out) << "count " << count;
    }
  });
}

// Floats rank `from` sends rank `to` in the all-to-all below: none, or
// parts of one to several 64 KiB chunks that end mid-chunk.
int64_t PairCount(int from, int to) { return ((from * 3 + to * 5 + 1) % 4) * 30011; }

TEST_P(GlooAlgorithmsTest, ReduceScatterAndAllToAllVMoveEveryByte) {
  const int n = GetParam().ranks;
  RunGroup([&](int r, Communicator& comm) {
    const int64_t count = 100003;  // 400 KB a part
    std::vector<float> in(n * count), out(count, -1.0f);
    for (int64_t i = 0; i < n * count; ++i) in[i] = Messy(r, i);
    ASSERT_TRUE(comm.ReduceScatter(in.data(), out.data(), count, ReduceOp::kSum, kOpts).ok());
    for (int64_t i = 0; i < count; ++i) {
      float want = Messy(0, r * count + i);
      for (int q = 1; q < n; ++q) want += Messy(q, r * count + i);
      ASSERT_EQ(std::memcmp(&out[i], &want, sizeof(float)), 0) << "reduce-scatter i " << i;
    }

    std::vector<int64_t> send_counts(n), recv_counts(n);
    std::vector<float> send;
    for (int q = 0; q < n; ++q) {
      send_counts[q] = PairCount(r, q);
      recv_counts[q] = PairCount(q, r);
      for (int64_t k = 0; k < send_counts[q]; ++k) send.push_back(Messy(r * 16 + q, k));
    }
    int64_t total = 0;
    for (int64_t c : recv_counts) total += c;
    std::vector<float> recv(total, -1.0f);
    ASSERT_TRUE(comm.AllToAllV(send.data(), send_counts, recv.data(), recv_counts, kOpts).ok());
    int64_t at = 0;
    for (int q = 0; q < n; ++q) {
      for (int64_t k = 0; k < recv_counts[q]; ++k, ++at) {
        const float want = Messy(q * 16 + r, k);
        ASSERT_EQ(std::memcmp(&recv[at], &want, sizeof(float)), 0)
            << "all-to-all from rank " << q << " k " << k;
      }
    }
  });
}

// Windows: 128 KiB over 2 peers and 200 KiB over 3 are 64 KiB chunks (the
// least), 1 MiB over 3 peers 174762 bytes.
INSTANTIATE_TEST_SUITE_P(
    Sizes, GlooAlgorithmsTest,
    ::testing::Values(Case{2, 8}, Case{3, 8}, Case{4, 8}, Case{3, 0}, Case{4, 0},
                      Case{2, 8, 128 << 10}, Case{3, 8, 128 << 10}, Case{4, 8, 200 << 10},
                      Case{4, 0, 1 << 20}),
    [](const auto& info) {
      return absl::StrCat(
          info.param.ranks, "_ranks_",
          info.param.direct_max_ranks == 0 ? "ring_above_1MiB" : "direct",
          info.param.window_bytes > 0 ? absl::StrCat("_window_", info.param.window_bytes) : "");
    });

}  // namespace
}  // namespace muonmesh::comm
