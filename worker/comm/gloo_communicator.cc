#include "worker/comm/gloo_communicator.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/pair.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"
#include "core/base/status_macros.h"
#include "worker/comm/peer_probe.h"
#include "worker/comm/reduce.h"

namespace muonmesh::comm {
namespace {

// Gloo's view of our Store: keys prefixed with the group, every wait bounded
// by the connect timeout. Gloo expects exceptions on failure; the first
// error is kept so the caller can return it as a Status, with its code.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(comm::Store& store, std::string prefix, absl::Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_.Set(prefix_ + key, absl::string_view(data.data(), data.size())));
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_.Get(prefix_ + key, timeout_);
    Check(value.status());
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override { Wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    // Gloo passes its context timeout (ours) or 0 for "none": never unbounded.
    const absl::Duration bound = absl::FromChrono(timeout);
    Wait(keys, bound > absl::ZeroDuration() ? std::min(bound, timeout_) : timeout_);
  }

  absl::Status first_error() const {
    absl::MutexLock lock(&mu_);
    return first_error_;
  }

 private:
  void Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const std::string& key : keys) prefixed.push_back(prefix_ + key);
    Check(store_.Wait(prefixed, timeout));
  }

  void Check(const absl::Status& status) {
    if (status.ok()) return;
    {
      absl::MutexLock lock(&mu_);
      if (first_error_.ok()) first_error_ = status;
    }
    throw gloo::IoException(std::string(status.message()));
  }

  comm::Store& store_;
  const std::string prefix_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

// Gloo's exceptions as Status. Gloo signals its own timeouts with an
// IoException whose message starts "Timed out"; the other IoExceptions are
// connection failures.
absl::Status FromGlooException(const std::exception& e) {
  const std::string what = e.what();
  if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) {
    if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timed out")) {
      return absl::DeadlineExceededError(absl::StrCat("gloo: ", what));
    }
    return absl::UnavailableError(absl::StrCat("gloo: peer connection lost: ", what));
  }
  if (dynamic_cast<const gloo::EnforceNotMet*>(&e) != nullptr) {
    return absl::InternalError(absl::StrCat("gloo assertion: ", what));
  }
  return absl::InternalError(absl::StrCat("gloo: ", what));
}

// Runs a Gloo call; no exception escapes.
template <typename Fn>
absl::Status GuardGloo(Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return FromGlooException(e);
  } catch (...) {
    return absl::InternalError("gloo: unknown exception");
  }
}

// The time left before `deadline` as Gloo wants it (whole milliseconds,
// rounded up, at least 1); DeadlineExceeded if none is left.
absl::StatusOr<std::chrono::milliseconds> Remaining(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError("timeout expired before the next step");
  }
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(
                                                            absl::Ceil(left, absl::Milliseconds(1)))));
}

// Gloo writes with writev(2), which raises SIGPIPE when the peer's socket is
// gone; the default action would kill this process instead of letting the
// collective fail with Unavailable. Ignore it, once, unless the program has
// installed a handler of its own.
void IgnoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) &&
        current.sa_handler == SIG_DFL) {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      ::sigaction(SIGPIPE, &ignore, nullptr);
    }
  });
}

// How long an abort keeps waking the call in progress (it ends within
// milliseconds: its next step on a closed connection throws).
constexpr absl::Duration kAbortWakeFor = absl::Seconds(2);

// Collective algorithms by size (docs/architecture.md §5, "Collective
// algorithms"). On TCP each of Gloo's point-to-point messages waits for the
// peer's "ready to receive" notice, so every dependent step of an algorithm
// costs a round trip. Gloo's all-gather is a ring, n - 1 steps one after
// another; a direct exchange (each rank sends its part to every peer at
// once) is one step and sends the same bytes per rank, so it is used up to
// GroupOptions::gloo_direct_max_ranks ranks (8), or for any group while the
// gathered buffer is at most kDirectMaxBytes (a large group's ring spreads a large buffer's
// traffic over time instead of every peer sending to each rank at once).
// An all-reduce of at most kOneRoundAllReduceBytes goes in one step: every
// rank sends its whole buffer to every peer and reduces all of them in rank
// order, (n - 1) count floats a rank instead of the model's 2 (n - 1) / n
// count, in one round trip instead of two; larger ones reduce-scatter
// directly, then all-gather their chunks as above. Every rule keeps the
// rank-order sum, so results are the same bits whichever runs. The direct
// exchanges (all-gathers, reduce-scatters, all-to-alls) are one routine,
// DirectExchange, which with GroupOptions::gloo_window_bytes sends each
// peer's part in chunks, kChunksAhead (n - 1) of them asked for at once
// over all peers.
constexpr int64_t kDirectMaxBytes = int64_t{1} << 20;
constexpr int64_t kOneRoundAllReduceBytes = int64_t{64} << 10;
constexpr size_t kChunksAhead = 2;
constexpr size_t kMinChunkBytes = size_t{64} << 10;

// One peer's part of an exchange buffer, in bytes.
struct Part {
  size_t offset = 0;
  size_t bytes = 0;
};

// Parts of counts[q] floats each, laid end to end from offset 0.
std::vector<Part> PartsEndToEnd(absl::Span<const int64_t> counts) {
  std::vector<Part> parts(counts.size());
  size_t at = 0;
  for (size_t q = 0; q < counts.size(); ++q) {
    parts[q] = {at, static_cast<size_t>(counts[q]) * sizeof(float)};
    at += parts[q].bytes;
  }
  return parts;
}

// Gloo's slot prefixes end at 0x08 (gloo/types.h): the direct exchange's.
constexpr uint8_t kDirectSlotPrefix = 0x40;

// Gloo's options for one call, with the unbound buffers they hold in reach
// (they are protected members of each options class).
template <typename Options>
class Watched : public Options {
 public:
  using Options::Options;
  std::vector<gloo::transport::UnboundBuffer*> Buffers() {
    std::vector<gloo::transport::UnboundBuffer*> out;
    if constexpr (std::is_same_v<Options, gloo::BarrierOptions>) {
      out.push_back(this->buffer.get());
    } else {
      out.push_back(this->in.get());
      out.push_back(this->out.get());
    }
    out.erase(std::remove(out.begin(), out.end(), nullptr), out.end());
    return out;
  }
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::string name, int rank, int size,
                   std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::rendezvous::Context> context, int direct_max_ranks,
                   int64_t window_bytes)
      : Communicator(std::move(name), rank, size),
        direct_max_ranks_(direct_max_ranks),
        chunk_bytes_(ChunkBytes(window_bytes, size)),
        device_(std::move(device)),
        context_(std::move(context)) {}
  ~GlooCommunicator() override { LeaveAbortSignal(); }

  Backend backend() const override { return Backend::kGloo; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }

  // Part of creation: proves every peer is connected.
  absl::Status ConnectBarrier(absl::Time deadline) { return DoBarrier(deadline); }

 private:
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
  void DoAbort(const std::string& reason) override;

  // out[off_q .. off_q + counts[q]) = rank q's part, for every q: mine is
  // already in place and goes to every peer at once (one step).
  absl::Status DirectAllGatherV(float* out, absl::Span<const int64_t> counts, absl::Time deadline);
  // Every peer q at once: sends[q] of `from` to q, and what q sends into
  // recvs[q] of `into` (my own parts are the caller's). A peer's part goes
  // in chunks of chunk_bytes_, kChunksAhead (n - 1) of all peers' asked for
  // at once: each arrival asks for the next. The parts of one peer must
  // match on both sides.
  absl::Status DirectExchange(const void* from, absl::Span<const Part> sends, void* into,
                              absl::Span<const Part> recvs, absl::Time deadline);
  // The chunk for a window of `window_bytes` over `size` ranks' peers; no
  // window: one chunk a part.
  static size_t ChunkBytes(int64_t window_bytes, int size) {
    if (window_bytes <= 0 || size < 2) return std::numeric_limits<size_t>::max();
    const size_t per_peer = static_cast<size_t>(window_bytes) / (kChunksAhead * (size - 1));
    return std::max(kMinChunkBytes, per_peer);
  }
  size_t Chunks(size_t bytes) const { return bytes == 0 ? 0 : 1 + (bytes - 1) / chunk_bytes_; }
  bool Direct(int64_t gathered_floats) const {
    return size() <= direct_max_ranks_ || gathered_floats * 4 <= kDirectMaxBytes;
  }

  // Runs `collective` (a Gloo call on `opts`) with opts' buffers where
  // DoAbort can wake them.
  template <typename Options, typename Fn>
  absl::Status Watching(Watched<Options>& opts, Fn&& collective) {
    return WatchingBuffers(opts.Buffers(), std::forward<Fn>(collective));
  }
  template <typename Fn>
  absl::Status WatchingBuffers(std::vector<gloo::transport::UnboundBuffer*> buffers,
                               Fn&& collective) {
    {
      absl::MutexLock lock(&watch_mu_);
      watched_ = std::move(buffers);
      in_call_ = true;
    }
    absl::Status status = GuardGloo(collective);
    absl::MutexLock lock(&watch_mu_);
    watched_.clear();
    in_call_ = false;
    return status;
  }

  const int direct_max_ranks_;
  const size_t chunk_bytes_;
  // The device (and its event-loop thread) outlives the context using it.
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::vector<float> scratch_;
  float dummy_ = 0.0f;
  // The call in progress and its buffers (Watching), for DoAbort.
  absl::Mutex watch_mu_;
  bool in_call_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::vector<gloo::transport::UnboundBuffer*> watched_ ABSL_GUARDED_BY(watch_mu_);
};

absl::Status GlooCommunicator::DoAllGather(const float* in, int64_t count, float* out,
                                           absl::Time deadline) {
  float* own = out + rank() * count;
  if (size() == 1) {
    if (in != own) std::memcpy(own, in, count * sizeof(float));
    return absl::OkStatus();
  }
  if (Direct(size() * count)) {
    if (in != own) std::memcpy(own, in, count * sizeof(float));
    return DirectAllGatherV(out, std::vector<int64_t>(size(), count), deadline);
  }
  MUONMESH_ASSIGN_OR_RETURN(std::chrono::milliseconds timeout, Remaining(deadline));
  Watched<gloo::AllgatherOptions> opts(context_);
  // Without an input Gloo works in place: `out` already holds our part.
  if (in != own) opts.setInput(const_cast<float*>(in), count);
  opts.setOutput(out, size() * count);
  opts.setTimeout(timeout);
  return Watching(opts, [&] { gloo::allgather(opts); });
}

absl::Status GlooCommunicator::DoReduceScatter(const float* in, float* out, int64_t count,
                                               ReduceOp op, absl::Time deadline) {
  std::vector<const float*> parts(size());
  if (size() == 1) {
    parts[0] = in;
  } else {
    // Chunk q of every rank's input lands at scratch_[q * count]: what a
    // ring reduce-scatter sends, (n-1) * count floats per rank.
    scratch_.resize(static_cast<size_t>(size() * count));
    std::memcpy(scratch_.data() + rank() * count, in + rank() * count, count * sizeof(float));
    const std::vector<Part> chunks = PartsEndToEnd(std::vector<int64_t>(size(), count));
    MUONMESH_RETURN_IF_ERROR(DirectExchange(in, chunks, scratch_.data(), chunks, deadline));
    for (int q = 0; q < size(); ++q) parts[q] = scratch_.data() + q * count;
  }
  // Reads only scratch_ (or, alone, `in`), so `out` may alias `in`.
  internal::ReduceInRankOrder(parts, count, op, out);
  return absl::OkStatus();
}

absl::Status GlooCommunicator::DoAllReduce(float* inout, int64_t count, ReduceOp op,
                                           absl::Time deadline) {
  if (size() == 1) {
    const float* parts[1] = {inout};
    internal::ReduceInRankOrder(parts, count, op, inout);
    return absl::OkStatus();
  }
  std::vector<const float*> parts(size());
  if (count * 4 <= kOneRoundAllReduceBytes) {
    // Everyone's whole buffer, side by side, then the rank-order sum.
    scratch_.resize(static_cast<size_t>(size() * count));
    std::memcpy(scratch_.data() + rank() * count, inout, count * sizeof(float));
    MUONMESH_RETURN_IF_ERROR(
        DirectAllGatherV(scratch_.data(), std::vector<int64_t>(size(), count), deadline));
    for (int q = 0; q < size(); ++q) parts[q] = scratch_.data() + q * count;
    internal::ReduceInRankOrder(parts, count, op, inout);
    return absl::OkStatus();
  }
  std::vector<int64_t> chunk(size());
  for (int q = 0; q < size(); ++q) chunk[q] = internal::ChunkLength(count, size(), q);
  const int64_t mine = chunk[rank()];

  // Reduce-scatter of the chunks: chunk q of inout goes to rank q; we get
  // our chunk from everyone, in rank order.
  scratch_.resize(static_cast<size_t>(std::max<int64_t>(1, size() * mine)));
  const std::vector<Part> sends = PartsEndToEnd(chunk);
  const std::vector<Part> recvs = PartsEndToEnd(std::vector<int64_t>(size(), mine));
  std::memcpy(scratch_.data() + rank() * mine, inout + sends[rank()].offset / sizeof(float),
              mine * sizeof(float));
  MUONMESH_RETURN_IF_ERROR(DirectExchange(inout, sends, scratch_.data(), recvs, deadline));
  for (int q = 0; q < size(); ++q) parts[q] = scratch_.data() + q * mine;
  internal::ReduceInRankOrder(parts, mine, op,
                              inout + internal::ChunkOffset(count, size(), rank()));

  // All-gather of the reduced chunks, in place.
  if (Direct(count)) return DirectAllGatherV(inout, chunk, deadline);
  MUONMESH_ASSIGN_OR_RETURN(std::chrono::milliseconds timeout, Remaining(deadline));
  Watched<gloo::AllgathervOptions> gather(context_);
  gather.setOutput(inout, std::vector<size_t>(chunk.begin(), chunk.end()));
  gather.setTimeout(timeout);
  return Watching(gather, [&] { gloo::allgatherv(gather); });
}

absl::Status GlooCommunicator::DirectAllGatherV(float* out, absl::Span<const int64_t> counts,
                                                absl::Time deadline) {
  const std::vector<Part> parts = PartsEndToEnd(counts);
  const std::vector<Part> mine(size(), parts[rank()]);
  return DirectExchange(out, mine, out, parts, deadline);
}

absl::Status GlooCommunicator::DirectExchange(const void* from, absl::Span<const Part> sends,
                                              void* into, absl::Span<const Part> recvs,
                                              absl::Time deadline) {
  MUONMESH_RETURN_IF_ERROR(Remaining(deadline).status());
  // One buffer for what I send and one for all I receive: a connection's
  // failure wakes the waits of every buffer with an operation on it, so
  // one receive buffer hears of any peer's death at once.
  size_t send_end = 0, recv_end = 0;
  for (int q = 0; q < size(); ++q) {
    if (q == rank()) continue;
    send_end = std::max(send_end, sends[q].offset + sends[q].bytes);
    recv_end = std::max(recv_end, recvs[q].offset + recvs[q].bytes);
  }
  std::unique_ptr<gloo::transport::UnboundBuffer> out =
      context_->createUnboundBuffer(send_end > 0 ? const_cast<void*>(from) : &dummy_, send_end);
  std::unique_ptr<gloo::transport::UnboundBuffer> in =
      context_->createUnboundBuffer(recv_end > 0 ? into : &dummy_, recv_end);
  // What I ask for, in order: every peer's first chunk, then every peer's
  // second, ... The window is kChunksAhead chunks a peer, counted over all
  // peers together: each arrival, from whichever peer, asks for the next.
  std::vector<std::pair<int, size_t>> asks;  // (peer, byte offset in its part)
  for (size_t c = 0, more = 1; more; ++c) {
    more = 0;
    for (int i = 1; i < size(); ++i) {
      const int q = (rank() + size() - i) % size();
      if (c >= Chunks(recvs[q].bytes)) continue;
      asks.emplace_back(q, c * chunk_bytes_);
      more = 1;
    }
  }
  const size_t ahead = std::min(asks.size(), kChunksAhead * static_cast<size_t>(size() - 1));
  const uint64_t slot = gloo::Slot::build(kDirectSlotPrefix, 0);
  return WatchingBuffers({out.get(), in.get()}, [&] {
    auto ask = [&](size_t k) {
      const auto [q, at] = asks[k];
      in->recv(q, slot, recvs[q].offset + at, std::min(chunk_bytes_, recvs[q].bytes - at));
    };
    for (size_t k = 0; k < ahead; ++k) ask(k);
    // Gloo holds each send until the peer asks for it, in order.
    size_t sent = 0;
    for (int i = 1; i < size(); ++i) {
      const int q = (rank() + i) % size();
      for (size_t c = 0; c < Chunks(sends[q].bytes); ++c, ++sent) {
        const size_t at = c * chunk_bytes_;
        out->send(q, slot, sends[q].offset + at, std::min(chunk_bytes_, sends[q].bytes - at));
      }
    }
    // Each wait gets what is left of the call's time; one returns false
    // when DoAbort woke it.
    auto left = [&] {
      absl::StatusOr<std::chrono::milliseconds> t = Remaining(deadline);
      if (!t.ok()) throw gloo::IoException("Timed out in a direct exchange");
      return *t;
    };
    for (size_t k = 0; k < asks.size(); ++k) {
      if (!in->waitRecv(left())) throw gloo::IoException("direct exchange aborted");
      if (k + ahead < asks.size()) ask(k + ahead);
    }
    for (size_t k = 0; k < sent; ++k) {
      if (!out->waitSend(left())) throw gloo::IoException("direct exchange aborted");
    }
  });
}

absl::Status GlooCommunicator::DoBroadcast(float* inout, int64_t count, int root,
                                           absl::Time deadline) {
  if (size() == 1) return absl::OkStatus();
  MUONMESH_ASSIGN_OR_RETURN(std::chrono::milliseconds timeout, Remaining(deadline));
  Watched<gloo::BroadcastOptions> opts(context_);
  opts.setOutput(inout, count);  // the root sends from it in place
  opts.setRoot(root);
  opts.setTimeout(timeout);
  return Watching(opts, [&] { gloo::broadcast(opts); });
}

absl::Status GlooCommunicator::DoAllToAllV(const float* send,
                                           absl::Span<const int64_t> send_counts, float* recv,
                                           absl::Span<const int64_t> recv_counts,
                                           absl::Time deadline) {
  if (size() == 1) {
    if (send_counts[0] > 0) std::memcpy(recv, send, send_counts[0] * sizeof(float));
    return absl::OkStatus();
  }
  const std::vector<Part> sends = PartsEndToEnd(send_counts);
  const std::vector<Part> recvs = PartsEndToEnd(recv_counts);
  const size_t own = std::min(sends[rank()].bytes, recvs[rank()].bytes);
  if (own > 0) {
    std::memcpy(reinterpret_cast<char*>(recv) + recvs[rank()].offset,
                reinterpret_cast<const char*>(send) + sends[rank()].offset, own);
  }
  return DirectExchange(send, sends, recv, recvs, deadline);
}

absl::Status GlooCommunicator::DoBarrier(absl::Time deadline) {
  if (size() == 1) return absl::OkStatus();
  MUONMESH_ASSIGN_OR_RETURN(std::chrono::milliseconds timeout, Remaining(deadline));
  Watched<gloo::BarrierOptions> opts(context_);
  opts.setTimeout(timeout);
  return Watching(opts, [&] { gloo::barrier(opts); });
}

// Ending a call in progress. This Gloo has no abort of its own, and its TCP
// pair's error path is not public: close every connection (the peers
// waiting on this rank fail at once: their sockets are reset), then wake
// the call's own waits (abortWaitRecv/Send on its buffers) until it
// returns; each wake ends one wait, and the next send or receive on a
// closed pair throws.
void GlooCommunicator::DoAbort(const std::string& /*reason*/) {
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank()) continue;
    if (std::unique_ptr<gloo::transport::Pair>& pair = context_->getPair(peer); pair) {
      pair->close();
    }
  }
  const absl::Time until = absl::Now() + kAbortWakeFor;
  while (absl::Now() < until) {
    {
      absl::MutexLock lock(&watch_mu_);
      if (!in_call_) return;
      for (gloo::transport::UnboundBuffer* b : watched_) {
        b->abortWaitRecv();
        b->abortWaitSend();
      }
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// How long a rank tries to open a connection to a peer before the group
// fails naming the two (a healthy network answers in milliseconds).
constexpr absl::Duration kProbeConnectTimeout = absl::Seconds(5);

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    Store& store, std::string group_name, int rank, int size, const GroupOptions& options) {
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  const auto where = [&] {
    return absl::StrCat("gloo group '", group_name, "' (rank ", rank, " of ", size, ")");
  };

  IgnoreSigpipeOnce();
  gloo::transport::tcp::attr attr;
  if (!options.gloo_interface.empty()) {
    attr.iface = options.gloo_interface;
  } else {
    attr.hostname = options.gloo_hostname;
  }
  std::shared_ptr<gloo::transport::Device> device;
  absl::Status status = GuardGloo([&] { device = gloo::transport::tcp::CreateDevice(attr); });
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat(
        where(), ": cannot open a TCP device on ",
        options.gloo_interface.empty() ? "host " + options.gloo_hostname
                                       : "interface " + options.gloo_interface,
        ": ", status.message()));
  }

  // Every peer reachable first, within seconds (peer_probe.h), rather than
  // Gloo's connect waiting out the whole timeout for one that is not.
  if (options.gloo_interface.empty()) {
    MUONMESH_RETURN_IF_ERROR(ProbePeers(store, absl::StrCat(group_name, "/"), rank, size,
                                        options.gloo_hostname,
                                        std::min(options.connect_timeout, kProbeConnectTimeout),
                                        options.connect_timeout),
                             where(), ": rendezvous failed");
  }
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  const auto connect_ms = std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(options.connect_timeout)));
  context->setTimeout(connect_ms);
  GlooStoreAdapter adapter(store, absl::StrCat(group_name, "/gloo/"), options.connect_timeout);
  status = GuardGloo([&] { context->connectFullMesh(adapter, device); });
  if (!status.ok()) {
    // The store's own error (missing peer key, a name used twice) says more
    // than the exception Gloo rethrew for it.
    const absl::Status store_error = adapter.first_error();
    const absl::Status& cause = store_error.ok() ? status : store_error;
    return AnnotateStatus(cause, absl::StrCat(where(), ": rendezvous failed"));
  }

  auto communicator =
      std::make_unique<GlooCommunicator>(group_name, rank, size, std::move(device),
                                         std::move(context), options.gloo_direct_max_ranks,
                                         options.gloo_window_bytes);
  MUONMESH_RETURN_IF_ERROR(communicator->ConnectBarrier(deadline), where(),
                           ": connect barrier failed");
  return std::unique_ptr<Communicator>(std::move(communicator));
}

}  // namespace muonmesh::comm
