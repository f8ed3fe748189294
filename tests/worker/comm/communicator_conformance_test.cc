// One conformance suite for every Communicator backend (worker/comm/):
// value-parameterised by backend and world size, each rank on its own thread
// with its own communicator, results checked against closed forms (rank r
// contributes r * 1000 + i) or against a sequential rank-order sum computed
// here with plain loops. NCCL cases are registered when the build has CUDA
// and skip themselves without one GPU per rank; so are the host backends on
// CUDA device buffers (staging_communicator.h), every rank on GPU 0.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <latch>
#include <limits>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "muonmesh/config.h"
#include "tests/worker/comm/test_util.h"
#include "worker/comm/communicator.h"
#include "worker/comm/file_store.h"
#include "worker/comm/inprocess_communicator.h"

#if MUONMESH_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

// 0 in the self-contained GPU binary (comm_nccl_gpu_test), which is built
// without Gloo so it runs on a machine that has only CUDA and NCCL.
#ifndef MUONMESH_COMM_WITH_GLOO
#define MUONMESH_COMM_WITH_GLOO 1
#endif

namespace muonmesh::comm {
namespace {

using testing::RunOnThreads;
using testing::ScopedTempDir;

// Every collective in these tests gets this timeout: a bug shows up as a
// failure within seconds, never as a hung test.
const CollectiveOptions kOpts{absl::Seconds(10)};

constexpr float kUnset = -12345.0f;

float V(int rank, int64_t i) { return static_cast<float>(rank * 1000 + i); }

// Floats that do not add exactly: different exponents and signs, a pure
// function of (rank, i).
float Messy(int rank, int64_t i) {
  uint32_t x = static_cast<uint32_t>(rank * 7919 + i * 104729 + 17);
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  const float mantissa = static_cast<float>(x % 100000) / 100000.0f - 0.5f;
  const int exponent = static_cast<int>((x >> 20) % 12) - 6;
  return std::ldexp(mantissa, exponent);
}

// Floats sent by `from` to `to` in the AllToAllV tests, and how many.
int64_t Count(int from, int to) { return (from * 3 + to * 5 + 1) % 4; }
float W(int from, int to, int64_t k) { return static_cast<float>(from * 1000 + to * 100 + k); }

std::vector<int64_t> SendCounts(int rank, int n) {
  std::vector<int64_t> c(n);
  for (int q = 0; q < n; ++q) c[q] = Count(rank, q);
  return c;
}
std::vector<int64_t> RecvCounts(int rank, int n) {
  std::vector<int64_t> c(n);
  for (int q = 0; q < n; ++q) c[q] = Count(q, rank);
  return c;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How many GPUs this process sees (0 without CUDA).
int GpuCount() {
#if MUONMESH_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

// fp32 values in a backend's memory space: a host vector, or device memory
// of the calling thread's current GPU.
class Buffer {
 public:
  Buffer(MemorySpace space, std::vector<float> values) : space_(space), host_(std::move(values)) {
#if MUONMESH_HAVE_CUDA
    if (space_ == MemorySpace::kCudaDevice && !host_.empty()) {
      EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&device_), host_.size() * sizeof(float)),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpy(device_, host_.data(), host_.size() * sizeof(float),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
#endif
  }
  Buffer(MemorySpace space, size_t n) : Buffer(space, std::vector<float>(n, kUnset)) {}
  ~Buffer() {
#if MUONMESH_HAVE_CUDA
    if (device_ != nullptr) cudaFree(device_);
#endif
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  float* data() { return space_ == MemorySpace::kHost ? host_.data() : device_; }

  std::vector<float> Host() {
#if MUONMESH_HAVE_CUDA
    if (space_ == MemorySpace::kCudaDevice && !host_.empty()) {
      EXPECT_EQ(cudaMemcpy(host_.data(), device_, host_.size() * sizeof(float),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
#endif
    return host_;
  }

 private:
  MemorySpace space_;
  std::vector<float> host_;
  float* device_ = nullptr;
};

struct Case {
  Backend backend;
  int world;
  // Where the ranks' buffers live: kCudaDevice with a host backend stages
  // every call through host copies, all ranks sharing GPU 0.
  MemorySpace buffers = MemorySpace::kHost;
};

bool Staged(const Case& c) {
  return c.backend != Backend::kNccl && c.buffers == MemorySpace::kCudaDevice;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << BackendName(c.backend) << (Staged(c) ? " on cuda" : "") << " x " << c.world;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(std::string(BackendName(info.param.backend)),
                      Staged(info.param) ? "_on_cuda" : "", "_", info.param.world);
}

class ConformanceTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    backend_ = GetParam().backend;
    n_ = GetParam().world;
    staged_ = Staged(GetParam());
    if (backend_ == Backend::kNccl && GpuCount() < n_) {
      GTEST_SKIP() << "NCCL needs one GPU per rank: " << n_ << " ranks, " << GpuCount()
                   << " GPU(s) visible";
    }
    if (staged_ && GpuCount() < 1) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Open(dir_.path());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    options_.hub = std::make_shared<InProcessHub>();
    options_.connect_timeout = absl::Seconds(20);
  }

  // Creates a new group of n_ ranks, each on its own thread, and runs
  // body(rank, communicator) there.
  void RunGroup(const std::function<void(int, Communicator&)>& body) {
    const std::string name = absl::StrCat("test/", next_group_++);
    RunOnThreads(n_, [&](int rank) {
      GroupOptions options = options_;
      ASSERT_NO_FATAL_FAILURE(PlaceRank(rank, options));
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          CreateGroup(backend_, *store_, name, rank, n_, options);
      ASSERT_TRUE(comm.ok()) << comm.status();
      ASSERT_EQ((*comm)->rank(), rank);
      ASSERT_EQ((*comm)->size(), n_);
      ASSERT_EQ((*comm)->backend(), backend_);
      ASSERT_EQ((*comm)->memory_space(), space());
      body(rank, **comm);
    });
  }

  // The device of `rank` (its own GPU with NCCL, GPU 0 for every staged
  // rank), current on the calling thread, in `options`.
  void PlaceRank(int rank, GroupOptions& options) const {
    if (backend_ != Backend::kNccl && !staged_) return;
    options.cuda_device = staged_ ? 0 : rank;
    options.buffers = MemorySpace::kCudaDevice;
#if MUONMESH_HAVE_CUDA
    ASSERT_EQ(cudaSetDevice(options.cuda_device), cudaSuccess);
#endif
  }

  MemorySpace space() const {
    return backend_ == Backend::kNccl || staged_ ? MemorySpace::kCudaDevice : MemorySpace::kHost;
  }
  // Sums in rank order (the host backends, staged or not).
  bool cpu_backend() const { return backend_ != Backend::kNccl; }

  Backend backend_ = Backend::kInProcess;
  bool staged_ = false;
  int n_ = 1;
  ScopedTempDir dir_;
  std::unique_ptr<FileStore> store_;
  GroupOptions options_;
  int next_group_ = 0;
};

TEST_P(ConformanceTest, AllGatherConcatenatesInRankOrder) {
  RunGroup([&](int r, Communicator& comm) {
    for (int64_t count : {1, 3, 64}) {
      std::vector<float> in(count);
      for (int64_t i = 0; i < count; ++i) in[i] = V(r, i);
      Buffer in_buf(space(), in);
      Buffer out(space(), n_ * count);
      ASSERT_TRUE(comm.AllGather(in_buf.data(), count, out.data(), kOpts).ok());
      const std::vector<float> got = out.Host();
      for (int q = 0; q < n_; ++q) {
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(got[q * count + i], V(q, i)) << "count " << count << " from rank " << q;
        }
      }
    }
  });
}

TEST_P(ConformanceTest, AllGatherInPlace) {
  RunGroup([&](int r, Communicator& comm) {
    const int64_t count = 5;
    std::vector<float> values(n_ * count, kUnset);
    for (int64_t i = 0; i < count; ++i) values[r * count + i] = V(r, i);
    Buffer buf(space(), values);
    ASSERT_TRUE(comm.AllGather(buf.data() + r * count, count, buf.data(), kOpts).ok());
    const std::vector<float> got = buf.Host();
    for (int q = 0; q < n_; ++q) {
      for (int64_t i = 0; i < count; ++i) ASSERT_EQ(got[q * count + i], V(q, i));
    }
  });
}

TEST_P(ConformanceTest, ReduceScatterSumAndAverage) {
  RunGroup([&](int r, Communicator& comm) {
    for (int64_t count : {1, 5, 300}) {
      std::vector<float> in(n_ * count);
      for (int64_t j = 0; j < n_ * count; ++j) in[j] = V(r, j);
      Buffer in_buf(space(), in);
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        Buffer out(space(), count);
        ASSERT_TRUE(comm.ReduceScatter(in_buf.data(), out.data(), count, op, kOpts).ok());
        const std::vector<float> got = out.Host();
        for (int64_t i = 0; i < count; ++i) {
          // sum over q of q * 1000 + (r * count + i)
          const double sum = 1000.0 * n_ * (n_ - 1) / 2 + static_cast<double>(n_) * (r * count + i);
          if (op == ReduceOp::kSum) {
            ASSERT_EQ(got[i], static_cast<float>(sum)) << "count " << count << " i " << i;
          } else {
            ASSERT_FLOAT_EQ(got[i], static_cast<float>(sum / n_)) << "count " << count;
          }
        }
      }
    }
  });
}

// kMax: every element's largest value comes from a different rank (and is
// negative on some), so a sum, a first-rank or a last-rank answer all fail.
TEST_P(ConformanceTest, AllReduceAndReduceScatterMax) {
  auto value = [&](int r, int64_t i) {
    return static_cast<float>(((r + i) % n_) * 10 - 25) + 0.5f * static_cast<float>(i);
  };
  auto largest = [&](int64_t i) {
    float m = value(0, i);
    for (int q = 1; q < n_; ++q) m = m > value(q, i) ? m : value(q, i);
    return m;
  };
  RunGroup([&](int r, Communicator& comm) {
    for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{300}}) {
      std::vector<float> values(count);
      for (int64_t i = 0; i < count; ++i) values[i] = value(r, i);
      Buffer buf(space(), values);
      ASSERT_TRUE(comm.AllReduce(buf.data(), count, ReduceOp::kMax, kOpts).ok());
      const std::vector<float> got = buf.Host();
      for (int64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], largest(i)) << "i " << i;

      std::vector<float> in(n_ * count);
      for (int64_t j = 0; j < n_ * count; ++j) in[j] = value(r, j);
      Buffer in_buf(space(), in);
      Buffer out(space(), count);
      ASSERT_TRUE(comm.ReduceScatter(in_buf.data(), out.data(), count, ReduceOp::kMax, kOpts).ok());
      const std::vector<float> mine = out.Host();
      for (int64_t i = 0; i < count; ++i) ASSERT_EQ(mine[i], largest(r * count + i)) << "i " << i;
    }
  });
}

TEST_P(ConformanceTest, ReduceScatterInPlace) {
  RunGroup([&](int r, Communicator& comm) {
    const int64_t count = 7;
    std::vector<float> in(n_ * count);
    for (int64_t j = 0; j < n_ * count; ++j) in[j] = V(r, j);
    Buffer buf(space(), in);
    float* out = buf.data() + r * count;
    ASSERT_TRUE(comm.ReduceScatter(buf.data(), out, count, ReduceOp::kSum, kOpts).ok());
    const std::vector<float> got = buf.Host();
    for (int64_t i = 0; i < count; ++i) {
      const double sum = 1000.0 * n_ * (n_ - 1) / 2 + static_cast<double>(n_) * (r * count + i);
      ASSERT_EQ(got[r * count + i], static_cast<float>(sum));
    }
  });
}

TEST_P(ConformanceTest, AllReduceSumAndAverageForAnyCount) {
  RunGroup([&](int r, Communicator& comm) {
    // Fewer floats than ranks (empty chunks), uneven and even splits.
    for (int64_t count : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{12}, int64_t{1001}}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        std::vector<float> values(count);
        for (int64_t i = 0; i < count; ++i) values[i] = V(r, i);
        Buffer buf(space(), values);
        ASSERT_TRUE(comm.AllReduce(buf.data(), count, op, kOpts).ok());
        const std::vector<float> got = buf.Host();
        for (int64_t i = 0; i < count; ++i) {
          const double sum = 1000.0 * n_ * (n_ - 1) / 2 + static_cast<double>(n_) * i;
          if (op == ReduceOp::kSum) {
            ASSERT_EQ(got[i], static_cast<float>(sum)) << "count " << count << " i " << i;
          } else {
            ASSERT_FLOAT_EQ(got[i], static_cast<float>(sum / n_)) << "count " << count;
          }
        }
      }
    }
  });
}

TEST_P(ConformanceTest, BroadcastFromEveryRoot) {
  RunGroup([&](int r, Communicator& comm) {
    const int64_t count = 10;
    // The last rank first: a non-zero root.
    for (int root = n_ - 1; root >= 0; --root) {
      std::vector<float> values(count);
      for (int64_t i = 0; i < count; ++i) values[i] = V(r, i);
      Buffer buf(space(), values);
      ASSERT_TRUE(comm.Broadcast(buf.data(), count, root, kOpts).ok());
      const std::vector<float> got = buf.Host();
      for (int64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], V(root, i)) << "root " << root;
    }
  });
}

TEST_P(ConformanceTest, AllToAllVWithUnevenAndZeroCounts) {
  RunGroup([&](int r, Communicator& comm) {
    const std::vector<int64_t> send_counts = SendCounts(r, n_);
    const std::vector<int64_t> recv_counts = RecvCounts(r, n_);
    std::vector<float> send;
    for (int q = 0; q < n_; ++q) {
      for (int64_t k = 0; k < send_counts[q]; ++k) send.push_back(W(r, q, k));
    }
    int64_t recv_total = 0;
    for (int64_t c : recv_counts) recv_total += c;
    Buffer send_buf(space(), send);
    Buffer recv_buf(space(), recv_total);
    ASSERT_TRUE(comm.AllToAllV(send_buf.data(), send_counts, recv_buf.data(), recv_counts, kOpts)
                    .ok());
    const std::vector<float> got = recv_buf.Host();
    int64_t at = 0;
    for (int q = 0; q < n_; ++q) {
      for (int64_t k = 0; k < recv_counts[q]; ++k, ++at) {
        ASSERT_EQ(got[at], W(q, r, k)) << "from rank " << q << " item " << k;
      }
    }
  });
}

TEST_P(ConformanceTest, AllToAllVWithNothingToSend) {
  RunGroup([&](int r, Communicator& comm) {
    const std::vector<int64_t> zeros(n_, 0);
    // Null buffers are fine when nothing moves.
    ASSERT_TRUE(comm.AllToAllV(nullptr, zeros, nullptr, zeros, kOpts).ok());
    // Only the part a rank keeps for itself.
    std::vector<int64_t> self(n_, 0);
    self[r] = 3;
    Buffer send(space(), std::vector<float>{V(r, 0), V(r, 1), V(r, 2)});
    Buffer recv(space(), 3);
    ASSERT_TRUE(comm.AllToAllV(send.data(), self, recv.data(), self, kOpts).ok());
    EXPECT_EQ(recv.Host(), (std::vector<float>{V(r, 0), V(r, 1), V(r, 2)}));
    // One rank gathers from everyone (the Muon owner pattern): rank 0
    // receives 2 floats from each rank, sends nothing.
    std::vector<int64_t> to_owner(n_, 0);
    to_owner[0] = 2;
    std::vector<int64_t> at_owner(n_, r == 0 ? 2 : 0);
    Buffer mine(space(), std::vector<float>{V(r, 0), V(r, 1)});
    Buffer gathered(space(), r == 0 ? 2 * n_ : 0);
    ASSERT_TRUE(comm.AllToAllV(mine.data(), to_owner, gathered.data(), at_owner, kOpts).ok());
    if (r == 0) {
      const std::vector<float> got = gathered.Host();
      for (int q = 0; q < n_; ++q) {
        EXPECT_EQ(got[2 * q], V(q, 0));
        EXPECT_EQ(got[2 * q + 1], V(q, 1));
      }
    }
  });
}

TEST_P(ConformanceTest, ZeroCountsAreNoOps) {
  RunGroup([&](int, Communicator& comm) {
    EXPECT_TRUE(comm.AllGather(nullptr, 0, nullptr, kOpts).ok());
    EXPECT_TRUE(comm.ReduceScatter(nullptr, nullptr, 0, ReduceOp::kSum, kOpts).ok());
    EXPECT_TRUE(comm.AllReduce(nullptr, 0, ReduceOp::kAvg, kOpts).ok());
    EXPECT_TRUE(comm.Broadcast(nullptr, 0, n_ - 1, kOpts).ok());
    // Still in step afterwards.
    Buffer buf(space(), std::vector<float>{1.0f});
    ASSERT_TRUE(comm.AllReduce(buf.data(), 1, ReduceOp::kSum, kOpts).ok());
    EXPECT_EQ(buf.Host()[0], static_cast<float>(n_));
    // Only that last call moved bytes: one float, cut into n chunks of which
    // rank 0 holds the only non-empty one, so rank 0 sends its reduced float
    // to n-1 peers and every other rank sends rank 0 its float.
    const int64_t expected = n_ == 1 ? 0 : (comm.rank() == 0 ? 4 * (n_ - 1) : 4);
    EXPECT_EQ(comm.stats().total_bytes_sent(), expected);
  });
}

TEST_P(ConformanceTest, BarrierWaitsForTheLastRank) {
  using Clock = std::chrono::steady_clock;
  constexpr int kRounds = 3;
  // [round][rank], each written by its rank's thread only, read after join.
  std::vector<std::vector<Clock::time_point>> entered(kRounds, std::vector<Clock::time_point>(n_));
  std::vector<std::vector<Clock::time_point>> left = entered;
  RunGroup([&](int r, Communicator& comm) {
    for (int round = 0; round < kRounds; ++round) {
      // Ranks arrive staggered, the last one 20 * (n - 1) ms late.
      std::this_thread::sleep_for(std::chrono::milliseconds(20 * ((r + round) % n_)));
      entered[round][r] = Clock::now();
      ASSERT_TRUE(comm.Barrier(kOpts).ok());
      left[round][r] = Clock::now();
    }
  });
  for (int round = 0; round < kRounds; ++round) {
    const Clock::time_point last_in =
        *std::max_element(entered[round].begin(), entered[round].end());
    for (int r = 0; r < n_; ++r) {
      EXPECT_GE(left[round][r], last_in)
          << "round " << round << ": rank " << r << " left before every rank entered";
    }
  }
}

TEST_P(ConformanceTest, ByteCountersFollowTheModel) {
  constexpr int64_t kGather = 10, kScatter = 6, kReduce = 12, kBroadcast = 5;
  std::vector<CommStats> stats(n_);
  RunGroup([&](int r, Communicator& comm) {
    Buffer gather_in(space(), kGather), gather_out(space(), n_ * kGather);
    Buffer scatter_in(space(), n_ * kScatter), scatter_out(space(), kScatter);
    Buffer reduce(space(), kReduce), broadcast(space(), kBroadcast);
    ASSERT_TRUE(comm.AllGather(gather_in.data(), kGather, gather_out.data(), kOpts).ok());
    ASSERT_TRUE(comm.ReduceScatter(scatter_in.data(), scatter_out.data(), kScatter,
                                   ReduceOp::kSum, kOpts)
                    .ok());
    ASSERT_TRUE(comm.AllReduce(reduce.data(), kReduce, ReduceOp::kAvg, kOpts).ok());
    ASSERT_TRUE(comm.Broadcast(broadcast.data(), kBroadcast, n_ - 1, kOpts).ok());
    const std::vector<int64_t> send_counts = SendCounts(r, n_);
    const std::vector<int64_t> recv_counts = RecvCounts(r, n_);
    int64_t send_total = 0, recv_total = 0;
    for (int q = 0; q < n_; ++q) {
      send_total += send_counts[q];
      recv_total += recv_counts[q];
    }
    Buffer send(space(), send_total), recv(space(), recv_total);
    ASSERT_TRUE(comm.AllToAllV(send.data(), send_counts, recv.data(), recv_counts, kOpts).ok());
    ASSERT_TRUE(comm.Barrier(kOpts).ok());
    stats[r] = comm.stats();
  });
  const int64_t f = sizeof(float);
  int64_t reduce_total = 0, broadcast_total = 0;
  for (int r = 0; r < n_; ++r) {
    const CommStats& s = stats[r];
    for (int c = 0; c < kNumCollectives; ++c) {
      EXPECT_EQ(s.by_collective[c].calls, 1) << CollectiveName(static_cast<Collective>(c));
      EXPECT_EQ(s.by_collective[c].failures, 0);
    }
    EXPECT_EQ(s[Collective::kAllGather].bytes_sent, (n_ - 1) * kGather * f);
    EXPECT_EQ(s[Collective::kReduceScatter].bytes_sent, (n_ - 1) * kScatter * f);
    int64_t a2a = 0;
    for (int q = 0; q < n_; ++q) {
      if (q != r) a2a += Count(r, q) * f;
    }
    EXPECT_EQ(s[Collective::kAllToAllV].bytes_sent, a2a);
    EXPECT_EQ(s[Collective::kBarrier].bytes_sent, 0);
    reduce_total += s[Collective::kAllReduce].bytes_sent;
    broadcast_total += s[Collective::kBroadcast].bytes_sent;
    EXPECT_EQ(s.total_bytes_sent(),
              s[Collective::kAllGather].bytes_sent + s[Collective::kReduceScatter].bytes_sent +
                  s[Collective::kAllReduce].bytes_sent + s[Collective::kBroadcast].bytes_sent +
                  a2a);
  }
  // 12 floats split evenly for every n <= 4: a ring all-reduce moves
  // 2 (n-1)/n of the buffer per rank; a broadcast (n-1) copies in all.
  EXPECT_EQ(reduce_total, 2 * (n_ - 1) * kReduce * f);
  for (int r = 0; r < n_; ++r) {
    EXPECT_EQ(stats[r][Collective::kAllReduce].bytes_sent, 2 * (n_ - 1) * kReduce * f / n_);
  }
  EXPECT_EQ(broadcast_total, (n_ - 1) * kBroadcast * f);
}

TEST_P(ConformanceTest, ReductionsAreBitIdenticalAcrossRanks) {
  constexpr int64_t kChunk = 257;
  const int64_t count = n_ * kChunk;
  // The rank-order sum, computed here independently.
  std::vector<float> sum(count), avg(count);
  for (int64_t i = 0; i < count; ++i) {
    float acc = Messy(0, i);
    for (int q = 1; q < n_; ++q) acc += Messy(q, i);
    sum[i] = acc;
    avg[i] = n_ > 1 ? acc / static_cast<float>(n_) : acc;
  }
  std::vector<std::vector<float>> reduced(n_), averaged(n_), scattered(n_);
  RunGroup([&](int r, Communicator& comm) {
    std::vector<float> mine(count);
    for (int64_t i = 0; i < count; ++i) mine[i] = Messy(r, i);
    Buffer a(space(), mine), b(space(), mine), in(space(), mine), out(space(), kChunk);
    ASSERT_TRUE(comm.AllReduce(a.data(), count, ReduceOp::kSum, kOpts).ok());
    ASSERT_TRUE(comm.AllReduce(b.data(), count, ReduceOp::kAvg, kOpts).ok());
    ASSERT_TRUE(comm.ReduceScatter(in.data(), out.data(), kChunk, ReduceOp::kSum, kOpts).ok());
    reduced[r] = a.Host();
    averaged[r] = b.Host();
    scattered[r] = out.Host();
  });
  for (int r = 1; r < n_; ++r) {
    EXPECT_TRUE(SameBits(reduced[r], reduced[0])) << "all_reduce sum differs on rank " << r;
    EXPECT_TRUE(SameBits(averaged[r], averaged[0])) << "all_reduce avg differs on rank " << r;
  }
  for (int r = 0; r < n_; ++r) {
    const std::vector<float> slice(sum.begin() + r * kChunk, sum.begin() + (r + 1) * kChunk);
    if (cpu_backend()) {
      EXPECT_TRUE(SameBits(scattered[r], slice)) << "reduce_scatter on rank " << r;
    } else {
      for (int64_t i = 0; i < kChunk; ++i) {
        ASSERT_NEAR(scattered[r][i], slice[i], 1e-5f * (1.0f + std::fabs(slice[i])));
      }
    }
  }
  if (cpu_backend()) {
    EXPECT_TRUE(SameBits(reduced[0], sum)) << "not the rank-order sum";
    EXPECT_TRUE(SameBits(averaged[0], avg)) << "not the rank-order sum divided by n";
  } else {
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_NEAR(reduced[0][i], sum[i], 1e-5f * (1.0f + std::fabs(sum[i])));
      ASSERT_NEAR(averaged[0][i], avg[i], 1e-5f * (1.0f + std::fabs(avg[i])));
    }
  }
}

TEST_P(ConformanceTest, MissingRankTimesOutAndBreaksTheGroup) {
  if (n_ == 1) GTEST_SKIP() << "needs a peer that does not show up";
  const absl::Duration timeout = absl::Milliseconds(400);
  std::latch others_done(n_ - 1);
  std::vector<absl::Status> status(n_);
  std::vector<absl::Duration> elapsed(n_);
  std::vector<absl::Status> after(n_);
  RunGroup([&](int r, Communicator& comm) {
    if (r == 0) {
      // Never calls, but stays alive (connections open) until the others
      // have given up: they must time out, not see a closed connection.
      others_done.wait();
      return;
    }
    Buffer buf(space(), 16);
    const absl::Time start = absl::Now();
    status[r] = comm.AllReduce(buf.data(), 16, ReduceOp::kSum, CollectiveOptions{timeout});
    elapsed[r] = absl::Now() - start;
    after[r] = comm.Barrier(kOpts);
    EXPECT_FALSE(comm.health().ok());
    EXPECT_EQ(comm.stats()[Collective::kAllReduce].failures, 1);
    others_done.count_down();
  });
  int deadline_exceeded = 0;
  for (int r = 1; r < n_; ++r) {
    // The first rank to time out may close its connections (Gloo) or abort
    // the group (in-process), so the others may see the loss instead.
    EXPECT_TRUE(absl::IsDeadlineExceeded(status[r]) || absl::IsUnavailable(status[r]))
        << "rank " << r << ": " << status[r];
    deadline_exceeded += absl::IsDeadlineExceeded(status[r]);
    EXPECT_GE(elapsed[r], timeout - absl::Milliseconds(50)) << "rank " << r;
    EXPECT_LT(elapsed[r], timeout + absl::Seconds(3)) << "rank " << r;
    const std::string message(status[r].message());
    EXPECT_NE(message.find("all_reduce"), std::string::npos) << message;
    EXPECT_NE(message.find("test/"), std::string::npos) << "names the group: " << message;
    if (staged_) {
      EXPECT_NE(message.find("via host copies"), std::string::npos) << message;
    }
    EXPECT_TRUE(absl::IsFailedPrecondition(after[r])) << after[r];
  }
  EXPECT_GE(deadline_exceeded, 1);
}

// A rank told to stop (Communicator::Abort, what a rank's AbortSignal
// calls) while its collective waits for a peer that never calls: the call
// ends long before its timeout, Cancelled with the abort's reason (or
// Unavailable, woken by another rank's abort of the group), and the group
// refuses later calls.
TEST_P(ConformanceTest, AnAbortEndsACallWaitingOnAMissingRank) {
  if (n_ == 1) GTEST_SKIP() << "needs a peer that does not show up";
  const absl::Duration timeout = absl::Seconds(60);
  std::latch others_done(n_ - 1);
  std::vector<absl::Status> status(n_), after(n_);
  std::vector<absl::Duration> elapsed(n_);
  RunGroup([&](int r, Communicator& comm) {
    if (r == 0) {
      others_done.wait();  // never calls, stays alive
      return;
    }
    std::thread stopper([&comm, r] {
      absl::SleepFor(absl::Milliseconds(200));
      comm.Abort(absl::StrCat("test stop of rank ", r));
    });
    Buffer buf(space(), 16);
    const absl::Time start = absl::Now();
    status[r] = comm.AllReduce(buf.data(), 16, ReduceOp::kSum, CollectiveOptions{timeout});
    elapsed[r] = absl::Now() - start;
    stopper.join();
    after[r] = comm.Barrier(kOpts);
    others_done.count_down();
  });
  int cancelled = 0;
  for (int r = 1; r < n_; ++r) {
    EXPECT_TRUE(absl::IsCancelled(status[r]) || absl::IsUnavailable(status[r]))
        << "rank " << r << ": " << status[r];
    if (absl::IsCancelled(status[r])) {
      ++cancelled;
      EXPECT_NE(std::string(status[r].message()).find("test stop of rank"), std::string::npos)
          << status[r];
    }
    EXPECT_LT(elapsed[r], timeout / 2) << "rank " << r << " waited out its timeout";
    EXPECT_TRUE(absl::IsCancelled(after[r])) << "rank " << r << ": " << after[r];
  }
  EXPECT_GE(cancelled, 1);
}

TEST_P(ConformanceTest, InvalidArgumentsFailLocallyAndKeepTheGroupUsable) {
  RunGroup([&](int, Communicator& comm) {
    Buffer buf(space(), 4 * n_);
    const std::vector<int64_t> short_counts(n_ + 1, 0);
    const std::vector<int64_t> negative(n_, -1);
    EXPECT_TRUE(absl::IsInvalidArgument(comm.AllGather(buf.data(), -1, buf.data(), kOpts)));
    EXPECT_TRUE(absl::IsInvalidArgument(comm.AllReduce(nullptr, 3, ReduceOp::kSum, kOpts)));
    EXPECT_TRUE(absl::IsInvalidArgument(comm.Broadcast(buf.data(), 1, n_, kOpts)));
    EXPECT_TRUE(absl::IsInvalidArgument(comm.Broadcast(buf.data(), 1, -1, kOpts)));
    EXPECT_TRUE(absl::IsInvalidArgument(
        comm.AllToAllV(buf.data(), short_counts, buf.data(), short_counts, kOpts)));
    EXPECT_TRUE(
        absl::IsInvalidArgument(comm.AllToAllV(buf.data(), negative, buf.data(), negative, kOpts)));
    EXPECT_TRUE(absl::IsInvalidArgument(comm.Barrier(CollectiveOptions{absl::ZeroDuration()})));
    EXPECT_TRUE(
        absl::IsInvalidArgument(comm.Barrier(CollectiveOptions{absl::InfiniteDuration()})));
    EXPECT_TRUE(comm.health().ok());
    EXPECT_TRUE(comm.Barrier(kOpts).ok());
  });
}

TEST_P(ConformanceTest, GroupsPerMeshAxisWorkSideBySide) {
  // A (I, n/I) mesh: rows are the inner groups, columns the outer ones.
  const int outer = n_ % 2 == 0 ? 2 : 1;
  const int inner = n_ / outer;
  const std::string prefix = absl::StrCat("mesh/", next_group_++);
  RunOnThreads(n_, [&](int rank) {
    GroupOptions options = options_;
    ASSERT_NO_FATAL_FAILURE(PlaceRank(rank, options));
    const int row = rank / inner, col = rank % inner;
    auto row_group = CreateGroup(backend_, *store_, absl::StrCat(prefix, "/dp_shard/", row), col,
                                 inner, options);
    ASSERT_TRUE(row_group.ok()) << row_group.status();
    auto col_group = CreateGroup(backend_, *store_, absl::StrCat(prefix, "/dp_outer/", col), row,
                                 outer, options);
    ASSERT_TRUE(col_group.ok()) << col_group.status();
    // Sum of global ranks over my row, then over my column.
    Buffer a(space(), std::vector<float>{static_cast<float>(rank)});
    Buffer b(space(), std::vector<float>{static_cast<float>(rank)});
    ASSERT_TRUE((*row_group)->AllReduce(a.data(), 1, ReduceOp::kSum, kOpts).ok());
    ASSERT_TRUE((*col_group)->AllReduce(b.data(), 1, ReduceOp::kSum, kOpts).ok());
    float row_sum = 0, col_sum = 0;
    for (int c = 0; c < inner; ++c) row_sum += static_cast<float>(row * inner + c);
    for (int o = 0; o < outer; ++o) col_sum += static_cast<float>(o * inner + col);
    EXPECT_EQ(a.Host()[0], row_sum);
    EXPECT_EQ(b.Host()[0], col_sum);
  });
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  std::vector<Backend> backends = {Backend::kInProcess};
#if MUONMESH_COMM_WITH_GLOO
  backends.push_back(Backend::kGloo);
#endif
#if MUONMESH_HAVE_CUDA
  backends.push_back(Backend::kNccl);
#endif
  for (Backend b : backends) {
    for (int world : {1, 2, 3, 4}) cases.push_back({b, world});
  }
#if MUONMESH_HAVE_CUDA
  for (Backend b : backends) {
    if (b == Backend::kNccl) continue;
    for (int world : {1, 2, 3, 4}) cases.push_back({b, world, MemorySpace::kCudaDevice});
  }
#endif
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Backends, ConformanceTest, ::testing::ValuesIn(AllCases()), CaseName);

// ---------------------------------------------------------------------------
// Backend-specific behaviour outside the common contract.

TEST(InProcessCommunicatorTest, MismatchedCallsAreReportedOnEveryRank) {
  auto hub = std::make_shared<InProcessHub>();
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  GroupOptions options;
  options.hub = hub;
  std::vector<absl::Status> status(2);
  RunOnThreads(2, [&](int r) {
    auto comm = CreateGroup(Backend::kInProcess, **store, "mismatch", r, 2, options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::vector<float> buf(8, 1.0f);
    status[r] = r == 0 ? (*comm)->AllReduce(buf.data(), 4, ReduceOp::kSum, kOpts)
                       : (*comm)->AllGather(buf.data(), 4, buf.data(), kOpts);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(absl::IsInvalidArgument(status[r])) << status[r];
    EXPECT_NE(std::string(status[r].message()).find("mismatched"), std::string::npos);
  }
}

TEST(InProcessCommunicatorTest, NeedsAHubAndValidRanks) {
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(
      CreateGroup(Backend::kInProcess, **store, "g", 0, 1, GroupOptions{}).status()));
  GroupOptions options;
  options.hub = std::make_shared<InProcessHub>();
  EXPECT_TRUE(absl::IsInvalidArgument(
      CreateGroup(Backend::kInProcess, **store, "g", 2, 2, options).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      CreateGroup(Backend::kInProcess, **store, "g", 0, 0, options).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      CreateGroup(Backend::kInProcess, **store, "", 0, 1, options).status()));
}

TEST(InProcessCommunicatorTest, MissingMemberTimesOutAtCreation) {
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  GroupOptions options;
  options.hub = std::make_shared<InProcessHub>();
  options.connect_timeout = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  auto comm = CreateGroup(Backend::kInProcess, **store, "lonely", 0, 2, options);
  EXPECT_TRUE(absl::IsDeadlineExceeded(comm.status())) << comm.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

#if MUONMESH_COMM_WITH_GLOO
TEST(GlooCommunicatorTest, MissingPeerTimesOutAtCreation) {
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  GroupOptions options;
  options.connect_timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  auto comm = CreateGroup(Backend::kGloo, **store, "lonely", 0, 2, options);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_TRUE(absl::IsDeadlineExceeded(comm.status())) << comm.status();
  EXPECT_NE(std::string(comm.status().message()).find("lonely"), std::string::npos);
  EXPECT_LT(elapsed, absl::Seconds(3));
}

TEST(GlooCommunicatorTest, ReusingAGroupNameInOneStoreIsAnError) {
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  GroupOptions options;
  options.connect_timeout = absl::Seconds(5);
  RunOnThreads(2, [&](int r) {
    auto comm = CreateGroup(Backend::kGloo, **store, "once", r, 2, options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_TRUE((*comm)->Barrier(kOpts).ok());
  });
  std::vector<absl::Status> again(2);
  const absl::Time start = absl::Now();
  RunOnThreads(2, [&](int r) {
    again[r] = CreateGroup(Backend::kGloo, **store, "once", r, 2, options).status();
  });
  // Each rank's address key already holds the first group's address.
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(absl::IsAlreadyExists(again[r])) << again[r];
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

#endif  // MUONMESH_COMM_WITH_GLOO

TEST(NcclCommunicatorTest, WithoutAGpuCreationFailsCleanly) {
#if MUONMESH_HAVE_CUDA
  if (GpuCount() > 0) GTEST_SKIP() << "a GPU is present; the conformance cases cover NCCL";
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  auto comm = CreateGroup(Backend::kNccl, **store, "nccl", 0, 1, GroupOptions{});
  EXPECT_TRUE(absl::IsFailedPrecondition(comm.status())) << comm.status();
#else
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  auto comm = CreateGroup(Backend::kNccl, **store, "nccl", 0, 1, GroupOptions{});
  EXPECT_TRUE(absl::IsUnimplemented(comm.status())) << comm.status();
#endif
}

// Device buffers with a host backend need CUDA and a device; without them
// creation fails on its own, before meeting any peer (a group of two whose
// second rank never comes).
TEST(StagedGroupTest, DeviceBuffersWithoutCudaFailCleanly) {
#if MUONMESH_HAVE_CUDA
  if (GpuCount() > 0) GTEST_SKIP() << "a GPU is present; the *_on_cuda cases cover staging";
#endif
  ScopedTempDir dir;
  auto store = FileStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  GroupOptions options;
  options.hub = std::make_shared<InProcessHub>();
  options.buffers = MemorySpace::kCudaDevice;
  options.connect_timeout = absl::Seconds(30);
  const absl::Time start = absl::Now();
  auto comm = CreateGroup(Backend::kInProcess, **store, "staged", 0, 2, options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "waited for the missing peer";
#if MUONMESH_HAVE_CUDA
  EXPECT_TRUE(absl::IsFailedPrecondition(comm.status())) << comm.status();
#else
  EXPECT_TRUE(absl::IsUnimplemented(comm.status())) << comm.status();
  EXPECT_NE(std::string(comm.status().message()).find("MUONMESH_ENABLE_CUDA"), std::string::npos)
      << comm.status();
#endif
}

TEST(BackendNamesTest, RoundTrip) {
  for (Backend b : {Backend::kInProcess, Backend::kGloo, Backend::kNccl}) {
    absl::StatusOr<Backend> parsed = ParseBackend(BackendName(b));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, b);
  }
  EXPECT_TRUE(absl::IsInvalidArgument(ParseBackend("mpi").status()));
  EXPECT_EQ(CollectiveName(Collective::kAllToAllV), "all_to_all_v");
}

}  // namespace
}  // namespace muonmesh::comm
