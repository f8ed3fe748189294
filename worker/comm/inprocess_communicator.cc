#include "worker/comm/inprocess_communicator.h"

#include <cstring>
#include <functional>
#include <iterator>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "worker/comm/reduce.h"

namespace muonmesh::comm {
namespace internal {

// What one rank posts for one call: the arguments every rank must agree on,
// and where its buffers are.
struct InProcessPost {
  int64_t sequence = -1;  // this rank's call index in the group
  Collective collective = Collective::kBarrier;
  int64_t count = 0;
  int root = 0;
  ReduceOp op = ReduceOp::kSum;
  const float* in = nullptr;
  absl::Span<const int64_t> send_counts = {};
  absl::Span<const int64_t> recv_counts = {};
};

// The shared state of one group, owned jointly by its members.
struct InProcessGroup {
  explicit InProcessGroup(int size) : size(size), joined(size, false), posts(size) {}

  const int size;
  absl::Mutex mu;
  std::vector<bool> joined ABSL_GUARDED_BY(mu);
  int joined_count ABSL_GUARDED_BY(mu) = 0;
  // Phase 1: posts, and a generation bumped when the last rank arrives.
  std::vector<InProcessPost> posts ABSL_GUARDED_BY(mu);
  int arrived ABSL_GUARDED_BY(mu) = 0;
  uint64_t arrive_generation ABSL_GUARDED_BY(mu) = 0;
  // Phase 2: everyone done reading the others' buffers.
  int finished ABSL_GUARDED_BY(mu) = 0;
  uint64_t finish_generation ABSL_GUARDED_BY(mu) = 0;
  // Set once, by the first rank that gives up; never cleared.
  bool aborted ABSL_GUARDED_BY(mu) = false;
  std::string abort_reason ABSL_GUARDED_BY(mu);
};

}  // namespace internal

absl::StatusOr<std::shared_ptr<internal::InProcessGroup>> JoinInProcessGroup(
    InProcessHub& hub, const std::string& name, int rank, int size) {
  absl::MutexLock hub_lock(&hub.mu_);
  // Forget groups whose members are all gone, so names can be reused and
  // the map does not grow with every test.
  for (auto it = hub.groups_.begin(); it != hub.groups_.end();) {
    it = it->second.expired() ? hub.groups_.erase(it) : std::next(it);
  }
  std::shared_ptr<internal::InProcessGroup> group = hub.groups_[name].lock();
  if (group == nullptr) {
    group = std::make_shared<internal::InProcessGroup>(size);
    hub.groups_[name] = group;
  }
  if (group->size != size) {
    return absl::InvalidArgumentError(absl::StrCat("group '", name, "' exists with size ",
                                                   group->size, ", not ", size));
  }
  absl::MutexLock lock(&group->mu);
  if (group->joined[rank]) {
    return absl::AlreadyExistsError(
        absl::StrCat("rank ", rank, " of group '", name, "' has already joined"));
  }
  group->joined[rank] = true;
  ++group->joined_count;
  return group;
}

std::map<std::string, std::array<int64_t, kNumCollectives>> InProcessHub::TrafficBytes() const {
  absl::MutexLock lock(&traffic_mu_);
  return traffic_;
}

void InProcessHub::AddTraffic(const std::string& group, Collective collective, int64_t bytes) {
  absl::MutexLock lock(&traffic_mu_);
  auto [it, fresh] = traffic_.try_emplace(group);
  if (fresh) it->second.fill(0);
  it->second[static_cast<int>(collective)] += bytes;
}

namespace {

using internal::InProcessGroup;
using internal::InProcessPost;

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::string name, int rank, int size,
                        std::shared_ptr<InProcessGroup> group, std::shared_ptr<InProcessHub> hub)
      : Communicator(std::move(name), rank, size),
        group_(std::move(group)),
        hub_(std::move(hub)) {}

  ~InProcessCommunicator() override { LeaveAbortSignal(); }

  Backend backend() const override { return Backend::kInProcess; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }

 private:
  // Aborts the whole group, as a closed connection does over a network: a
  // rank waiting in it wakes now (its peers in the group see Unavailable).
  void DoAbort(const std::string& reason) override {
    absl::MutexLock lock(&group_->mu);
    if (group_->aborted) return;
    group_->aborted = true;
    group_->abort_reason = absl::StrCat("group aborted: rank ", rank(), ": ", reason);
  }

  // Compute reads the posts (all ranks' buffers are valid and unchanged while
  // it runs) and fills scratch_; Commit writes this rank's outputs, after
  // every rank has finished computing.
  using Compute = std::function<absl::Status(const std::vector<InProcessPost>&)>;
  using Commit = std::function<void()>;

  absl::Status Rendezvous(InProcessPost mine, absl::Time deadline, const Compute& compute,
                          const Commit& commit);
  // InvalidArgument if the posts of one round disagree.
  absl::Status CheckConsistent(const std::vector<InProcessPost>& posts) const;

  absl::Status DoAllGather(const float* in, int64_t count, float* out,
                           absl::Time deadline) override;
  absl::Status DoReduceScatter(const float* in, float* out, int64_t count, ReduceOp op,
                               absl::Time deadline) override;
  absl::Status DoAllReduce(float* inout, int64_t count, ReduceOp op,
                           absl::Time deadline) override;
  absl::Status DoBroadcast(float* inout, int64_t count, int root, absl::Time deadline) override;
  absl::Status DoAllToAllV(const float* send, absl::Span<const int64_t> send_counts, float* recv,
                           absl::Span<const int64_t> recv_counts, absl::Time deadline) override;
  absl::Status DoBarrier(absl::Time deadline) override;

  // Counts `floats` read from other ranks' buffers (InProcessHub::TrafficBytes).
  void Read(Collective collective, int64_t floats) {
    if (floats > 0) hub_->AddTraffic(group_name(), collective, floats * int64_t{sizeof(float)});
  }

  const std::shared_ptr<InProcessGroup> group_;
  const std::shared_ptr<InProcessHub> hub_;
  int64_t sequence_ = 0;
  std::vector<float> scratch_;
};

absl::Status InProcessCommunicator::CheckConsistent(
    const std::vector<InProcessPost>& posts) const {
  const InProcessPost& first = posts[0];
  for (int q = 1; q < size(); ++q) {
    const InProcessPost& p = posts[q];
    if (p.collective != first.collective) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mismatched collectives: rank 0 called ", CollectiveName(first.collective), ", rank ",
          q, " called ", CollectiveName(p.collective)));
    }
    if (p.count != first.count || p.root != first.root || p.op != first.op) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mismatched arguments: rank 0 (count ", first.count, ", root ", first.root,
          "), rank ", q, " (count ", p.count, ", root ", p.root, ") or different reduce ops"));
    }
  }
  if (first.collective == Collective::kAllToAllV) {
    for (int from = 0; from < size(); ++from) {
      for (int to = 0; to < size(); ++to) {
        if (posts[from].send_counts[to] != posts[to].recv_counts[from]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "inconsistent counts: rank ", from, " sends ", posts[from].send_counts[to],
              " floats to rank ", to, ", which expects ", posts[to].recv_counts[from]));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status InProcessCommunicator::Rendezvous(InProcessPost mine, absl::Time deadline,
                                               const Compute& compute, const Commit& commit) {
  InProcessGroup& g = *group_;
  mine.sequence = sequence_++;
  const std::vector<InProcessPost>* posts = nullptr;
  {
    absl::MutexLock lock(&g.mu);
    if (g.aborted) return absl::UnavailableError(g.abort_reason);
    g.posts[rank()] = mine;
    if (++g.arrived == g.size) {
      g.arrived = 0;
      ++g.arrive_generation;
    } else {
      const uint64_t generation = g.arrive_generation;
      const auto released = [&g, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
        return g.arrive_generation != generation || g.aborted;
      };
      const bool woke = g.mu.AwaitWithDeadline(absl::Condition(&released), deadline);
      if (g.arrive_generation == generation) {  // not released: aborted or timed out
        if (woke) return absl::UnavailableError(g.abort_reason);
        std::vector<int> missing;
        for (int q = 0; q < g.size; ++q) {
          if (g.posts[q].sequence != mine.sequence) missing.push_back(q);
        }
        g.aborted = true;
        g.abort_reason = absl::StrCat("group aborted: rank ", rank(), " timed out waiting for ",
                                      "rank(s) ", absl::StrJoin(missing, ", "), " in call #",
                                      mine.sequence);
        return absl::DeadlineExceededError(absl::StrCat(
            "rank(s) ", absl::StrJoin(missing, ", "), " did not enter call #", mine.sequence,
            " before the deadline"));
      }
    }
    posts = &g.posts;  // stable until every rank passes phase 2
  }

  // Phase 1 is complete: every post of this round is in place and stays so
  // until phase 2 completes. Reading them without the lock is safe: no rank
  // writes its post again before then.
  absl::Status status = CheckConsistent(*posts);
  if (status.ok()) status = compute(*posts);

  {
    absl::MutexLock lock(&g.mu);
    if (++g.finished == g.size) {
      g.finished = 0;
      ++g.finish_generation;
    } else {
      const uint64_t generation = g.finish_generation;
      const auto done = [&g, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
        return g.finish_generation != generation;
      };
      // No deadline: the peers we wait for are past phase 1, doing local
      // copies and sums only, and cannot block.
      g.mu.Await(absl::Condition(&done));
    }
  }
  if (status.ok()) commit();
  return status;
}

absl::Status InProcessCommunicator::DoAllGather(const float* in, int64_t count, float* out,
                                                absl::Time deadline) {
  InProcessPost post{.collective = Collective::kAllGather, .count = count, .in = in};
  return Rendezvous(
      post, deadline,
      [&](const std::vector<InProcessPost>& posts) {
        scratch_.resize(static_cast<size_t>(size() * count));
        for (int q = 0; q < size(); ++q) {
          std::memcpy(scratch_.data() + q * count, posts[q].in, count * sizeof(float));
        }
        Read(Collective::kAllGather, (size() - 1) * count);
        return absl::OkStatus();
      },
      [&] { std::memcpy(out, scratch_.data(), scratch_.size() * sizeof(float)); });
}

absl::Status InProcessCommunicator::DoReduceScatter(const float* in, float* out, int64_t count,
                                                    ReduceOp op, absl::Time deadline) {
  InProcessPost post{
      .collective = Collective::kReduceScatter, .count = count, .op = op, .in = in};
  return Rendezvous(
      post, deadline,
      [&](const std::vector<InProcessPost>& posts) {
        std::vector<const float*> parts(size());
        for (int q = 0; q < size(); ++q) parts[q] = posts[q].in + rank() * count;
        scratch_.resize(static_cast<size_t>(count));
        internal::ReduceInRankOrder(parts, count, op, scratch_.data());
        Read(Collective::kReduceScatter, (size() - 1) * count);
        return absl::OkStatus();
      },
      [&] { std::memcpy(out, scratch_.data(), count * sizeof(float)); });
}

absl::Status InProcessCommunicator::DoAllReduce(float* inout, int64_t count, ReduceOp op,
                                                absl::Time deadline) {
  InProcessPost post{
      .collective = Collective::kAllReduce, .count = count, .op = op, .in = inout};
  return Rendezvous(
      post, deadline,
      [&](const std::vector<InProcessPost>& posts) {
        std::vector<const float*> parts(size());
        for (int q = 0; q < size(); ++q) parts[q] = posts[q].in;
        scratch_.resize(static_cast<size_t>(count));
        internal::ReduceInRankOrder(parts, count, op, scratch_.data());
        Read(Collective::kAllReduce, (size() - 1) * count);
        return absl::OkStatus();
      },
      [&] { std::memcpy(inout, scratch_.data(), count * sizeof(float)); });
}

absl::Status InProcessCommunicator::DoBroadcast(float* inout, int64_t count, int root,
                                                absl::Time deadline) {
  InProcessPost post{
      .collective = Collective::kBroadcast, .count = count, .root = root, .in = inout};
  const bool receiver = rank() != root;
  return Rendezvous(
      post, deadline,
      [&](const std::vector<InProcessPost>& posts) {
        if (receiver) {
          scratch_.assign(posts[root].in, posts[root].in + count);
          Read(Collective::kBroadcast, count);
        }
        return absl::OkStatus();
      },
      [&] {
        if (receiver) std::memcpy(inout, scratch_.data(), count * sizeof(float));
      });
}

absl::Status InProcessCommunicator::DoAllToAllV(const float* send,
                                                absl::Span<const int64_t> send_counts,
                                                float* recv,
                                                absl::Span<const int64_t> recv_counts,
                                                absl::Time deadline) {
  InProcessPost post{.collective = Collective::kAllToAllV,
                     .in = send,
                     .send_counts = send_counts,
                     .recv_counts = recv_counts};
  int64_t recv_total = 0;
  for (int64_t c : recv_counts) recv_total += c;
  return Rendezvous(
      post, deadline,
      [&](const std::vector<InProcessPost>& posts) {
        scratch_.resize(static_cast<size_t>(recv_total));
        int64_t at = 0;
        for (int q = 0; q < size(); ++q) {
          // Where rank q's part for this rank starts in q's send buffer.
          int64_t offset = 0;
          for (int p = 0; p < rank(); ++p) offset += posts[q].send_counts[p];
          if (recv_counts[q] > 0) {
            std::memcpy(scratch_.data() + at, posts[q].in + offset,
                        recv_counts[q] * sizeof(float));
          }
          if (q != rank()) Read(Collective::kAllToAllV, recv_counts[q]);
          at += recv_counts[q];
        }
        return absl::OkStatus();
      },
      [&] {
        if (recv_total > 0) std::memcpy(recv, scratch_.data(), recv_total * sizeof(float));
      });
}

absl::Status InProcessCommunicator::DoBarrier(absl::Time deadline) {
  InProcessPost post{.collective = Collective::kBarrier};
  return Rendezvous(
      post, deadline, [](const std::vector<InProcessPost>&) { return absl::OkStatus(); },
      [] {});
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateInProcessCommunicator(
    std::string group_name, int rank, int size, const GroupOptions& options) {
  if (options.hub == nullptr) {
    return absl::InvalidArgumentError("the in-process backend needs GroupOptions::hub");
  }
  MUONMESH_ASSIGN_OR_RETURN(std::shared_ptr<InProcessGroup> joined,
                            JoinInProcessGroup(*options.hub, group_name, rank, size));
  std::shared_ptr<InProcessGroup> group = std::move(joined);
  {
    InProcessGroup& g = *group;
    absl::MutexLock lock(&g.mu);
    const auto all_joined = [&g]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
      return g.joined_count == g.size || g.aborted;
    };
    const bool woke =
        g.mu.AwaitWithDeadline(absl::Condition(&all_joined), absl::Now() + options.connect_timeout);
    if (g.aborted) return absl::UnavailableError(g.abort_reason);
    if (!woke) {
      std::vector<int> missing;
      for (int q = 0; q < g.size; ++q) {
        if (!g.joined[q]) missing.push_back(q);
      }
      g.aborted = true;
      g.abort_reason = absl::StrCat("group '", group_name, "' aborted: rank ", rank,
                                    " gave up waiting for rank(s) ", absl::StrJoin(missing, ", "));
      return absl::DeadlineExceededError(absl::StrCat(
          "group '", group_name, "': rank(s) ", absl::StrJoin(missing, ", "),
          " did not join within ", absl::FormatDuration(options.connect_timeout)));
    }
  }
  return std::unique_ptr<Communicator>(
      new InProcessCommunicator(std::move(group_name), rank, size, std::move(group), options.hub));
}

}  // namespace muonmesh::comm
