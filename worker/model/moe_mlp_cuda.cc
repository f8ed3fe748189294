#include "worker/model/moe_mlp_cuda.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/cuda/cuda_checks.h"
#include "worker/cuda/mlp_kernels.h"
#include "worker/cuda/row_major_gemm.h"
#include "worker/model/checks.h"
#include "worker/model/expert_groups.h"

namespace muonmesh::worker {
namespace {

namespace k = cuda::internal;

// cudaMalloc'd elements that only grow (contents are not kept on growth).
template <typename T>
class DevArray {
 public:
  DevArray() = default;
  DevArray(const DevArray&) = delete;
  DevArray& operator=(const DevArray&) = delete;
  ~DevArray() { cudaFree(data_); }
  absl::Status Reserve(int64_t count) {
    if (count <= capacity_) return absl::OkStatus();
    cudaFree(data_);
    data_ = nullptr;
    capacity_ = 0;
    MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), sizeof(T) * count));
    capacity_ = count;
    return absl::OkStatus();
  }
  T* get() const { return data_; }

 private:
  T* data_ = nullptr;
  int64_t capacity_ = 0;
};

using Held = HeldUnit;

// A launch error with the call site's file:line.
#define MUONMESH_LAUNCH(expr) MUONMESH_CUDA_CHECK(expr)

// Waits for the stream on scope exit, so that an early return never leaves
// queued work reading a unit the runtime is about to release (declare it
// after the unit's Held: it is destroyed first).
class SyncOnExit {
 public:
  explicit SyncOnExit(cudaStream_t stream) : stream_(stream) {}
  ~SyncOnExit() { cudaStreamSynchronize(stream_); }
  SyncOnExit(const SyncOnExit&) = delete;
  SyncOnExit& operator=(const SyncOnExit&) = delete;

 private:
  cudaStream_t stream_;
};

template <typename Span>
absl::Status Expect(const Span& tensors, size_t count, int unit, const char* what) {
  bool null = false;
  for (const auto* t : tensors) null = null || t == nullptr;
  if (tensors.size() != count || null) {
    return absl::InternalError(absl::StrCat("moe_mlp: unit ", unit, " ", what, ": got ",
                                            tensors.size(), " tensors, expected ", count,
                                            " non-null"));
  }
  return absl::OkStatus();
}

}  // namespace

class CudaMoeMlp::Scratch {
 public:
  DevArray<float> xs, h, logits, o, z, yout, dy, dz, dh, send, recv, ex_h, ex_a, ex_o, ex_do,
      ex_da, dlogits, gate, ids, counts_send, counts_recv;
  DevArray<int64_t> samples, order, ex_order;
  DevArray<double> partial, dots;
};

absl::StatusOr<std::unique_ptr<CudaMoeMlp>> CudaMoeMlp::Create(MoeMlp moe) {
  MUONMESH_RETURN_IF_ERROR(cuda::CudaDeviceCount("moe_mlp on cuda").status());
  std::unique_ptr<CudaMoeMlp> w(new CudaMoeMlp(std::move(moe)));
  MUONMESH_RETURN_IF_ERROR(w->Init());
  return w;
}

CudaMoeMlp::CudaMoeMlp(MoeMlp cpu)
    : CudaWorkload(std::move(cpu)), scratch_(std::make_unique<Scratch>()) {}

absl::Status CudaMoeMlp::Init() {
  MUONMESH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MUONMESH_CUBLAS_CHECK(cublasCreate(&blas_));
  MUONMESH_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  MUONMESH_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_PEDANTIC_MATH));
  MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&x_), sizeof(float) * cpu_.x().size()));
  MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&y_), sizeof(float) * cpu_.y().size()));
  MUONMESH_CUDA_CHECK(cudaMemcpy(x_, cpu_.x().data(), sizeof(float) * cpu_.x().size(),
                                 cudaMemcpyHostToDevice));
  MUONMESH_CUDA_CHECK(cudaMemcpy(y_, cpu_.y().data(), sizeof(float) * cpu_.y().size(),
                                 cudaMemcpyHostToDevice));
  return scratch_->partial.Reserve(k::kLossBlocks);
}

CudaMoeMlp::~CudaMoeMlp() {
  scratch_.reset();
  cudaFree(x_);
  cudaFree(y_);
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaMoeMlp::Sync() {
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaMoeMlp::Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t kk,
                              float alpha, const float* a, const float* b, float beta, float* c) {
  return cuda::RowMajorSgemm(blas_, trans_a, trans_b, m, n, kk, alpha, a, b, beta, c);
}

absl::StatusOr<double> CudaMoeMlp::ForwardBackwardByUnit(int64_t /*step*/, UnitAccess& units,
                                                         absl::Span<const int64_t> samples) {
  MUONMESH_RETURN_IF_ERROR(
      internal::CheckSampleList("moe_mlp", samples, cpu_.num_samples(), kMoeMaxSamplesPerCall));
  return Run(units, samples);
}

// One call's routing and token counts, from the forward pass to the
// backward one.
struct CudaMoeMlp::Pass {
  int64_t n = 0;      // tokens of this rank
  int ep = 1;         // expert-parallel ranks
  int64_t local = 0;  // experts on this rank
  std::vector<float> g;  // router probabilities [n, experts] (host)
  MoeRouting routing;
  std::vector<int64_t> send_tokens, recv_tokens;  // per expert-parallel rank
  int64_t received = 0;                           // tokens this rank's experts take
  std::vector<int64_t> ex_begin;  // received tokens of local expert l: [ex_begin[l], [l + 1])
  std::vector<int64_t> send_counts, recv_counts;  // of the exchange in flight, in floats

  // The exchange counts for tokens of `width` floats each.
  void SetCounts(int64_t width) {
    for (int q = 0; q < ep; ++q) {
      send_counts[q] = send_tokens[q] * width;
      recv_counts[q] = recv_tokens[q] * width;
    }
  }
};

absl::Status CudaMoeMlp::ReserveFor(int64_t n, int ep) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d_in = dm.d_in, d = dm.d_model, e_total = dm.num_experts, d_out = dm.d_out;
  Scratch& s = *scratch_;
  for (DevArray<float>* b : {&s.xs}) MUONMESH_RETURN_IF_ERROR(b->Reserve(n * d_in));
  for (DevArray<float>* b : {&s.h, &s.o, &s.z, &s.dz, &s.dh}) {
    MUONMESH_RETURN_IF_ERROR(b->Reserve(n * d));
  }
  MUONMESH_RETURN_IF_ERROR(s.logits.Reserve(n * e_total));
  MUONMESH_RETURN_IF_ERROR(s.dlogits.Reserve(n * e_total));
  MUONMESH_RETURN_IF_ERROR(s.yout.Reserve(n * d_out));
  MUONMESH_RETURN_IF_ERROR(s.dy.Reserve(n * d_out));
  MUONMESH_RETURN_IF_ERROR(s.send.Reserve(n * (d + 1)));
  MUONMESH_RETURN_IF_ERROR(s.gate.Reserve(n));
  MUONMESH_RETURN_IF_ERROR(s.ids.Reserve(n));
  MUONMESH_RETURN_IF_ERROR(s.samples.Reserve(n));
  MUONMESH_RETURN_IF_ERROR(s.order.Reserve(n));
  MUONMESH_RETURN_IF_ERROR(s.dots.Reserve(n));
  MUONMESH_RETURN_IF_ERROR(s.counts_send.Reserve(ep));
  MUONMESH_RETURN_IF_ERROR(s.counts_recv.Reserve(ep));
  return absl::OkStatus();
}

absl::Status CudaMoeMlp::InputForward(UnitAccess& units, int64_t n) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d_in = dm.d_in, d = dm.d_model;
  Scratch& s = *scratch_;
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p, units.Acquire(0));
  Held held(units, 0);
  SyncOnExit synced(stream_);
  MUONMESH_RETURN_IF_ERROR(Expect(p, 2, 0, "parameters"));
  MUONMESH_RETURN_IF_ERROR(Gemm(false, true, n, d, d_in, 1.0f, s.xs.get(), p[0], 0.0f, s.h.get()));
  MUONMESH_LAUNCH(k::LaunchBiasActivate(s.h.get(), p[1], n, d, true, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  return absl::OkStatus();
}

// The router (on the host, in double, as the CPU), then the tokens sent to
// the ranks holding their experts.
absl::Status CudaMoeMlp::Dispatch(UnitAccess& units, const float* w_router, Pass& pass) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t n = pass.n, d = dm.d_model, de = dm.d_expert, e_total = dm.num_experts,
                local = pass.local;
  const int ep = pass.ep;
  Scratch& s = *scratch_;
  MUONMESH_RETURN_IF_ERROR(Gemm(false, true, n, e_total, d, 1.0f, s.h.get(), w_router, 0.0f,
                                s.logits.get()));
  pass.g.resize(static_cast<size_t>(n * e_total));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(pass.g.data(), s.logits.get(), sizeof(float) * pass.g.size(),
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  RouteTokens(pass.g.data(), n, e_total, &pass.routing);
  const std::vector<int32_t>& expert = pass.routing.expert;
  const std::vector<float>& gate = pass.routing.gate;
  const std::vector<int64_t>& order = pass.routing.order;
  const std::vector<int64_t>& per_expert = pass.routing.per_expert;
  pass.send_tokens.assign(ep, 0);
  pass.recv_tokens.assign(ep, 0);
  std::vector<float> count_send(ep), count_recv(ep), ids(n);
  for (int q = 0; q < ep; ++q) {
    pass.send_tokens[q] = per_expert[(q + 1) * local] - per_expert[q * local];
    count_send[q] = static_cast<float>(pass.send_tokens[q]);
  }
  for (int64_t j = 0; j < n; ++j) ids[j] = static_cast<float>(expert[order[j]] % local);
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.gate.get(), gate.data(), sizeof(float) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.order.get(), order.data(), sizeof(int64_t) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.ids.get(), ids.data(), sizeof(float) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.counts_send.get(), count_send.data(), sizeof(float) * ep,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  const std::vector<int64_t> ones(ep, 1);
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(s.counts_send.get(), ones, s.counts_recv.get(), ones));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(count_recv.data(), s.counts_recv.get(), sizeof(float) * ep,
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  for (int q = 0; q < ep; ++q) {
    const float c = count_recv[q];
    if (!(c >= 0.0f && c <= static_cast<float>(kMoeMaxSamplesPerCall)) || c != std::floor(c)) {
      return absl::InternalError(
          absl::StrCat("moe_mlp: expert-parallel group ", q, " announced ", c, " tokens"));
    }
    pass.recv_tokens[q] = static_cast<int64_t>(c);
    pass.received += pass.recv_tokens[q];
  }
  const int64_t received = pass.received;
  for (DevArray<float>* b : {&s.ex_h, &s.ex_o, &s.ex_do}) {
    MUONMESH_RETURN_IF_ERROR(b->Reserve(std::max<int64_t>(received * d, 1)));
  }
  for (DevArray<float>* b : {&s.ex_a, &s.ex_da}) {
    MUONMESH_RETURN_IF_ERROR(b->Reserve(std::max<int64_t>(received * de, 1)));
  }
  MUONMESH_RETURN_IF_ERROR(s.recv.Reserve(std::max<int64_t>(received * (d + 1), 1)));
  MUONMESH_RETURN_IF_ERROR(s.ex_order.Reserve(std::max<int64_t>(received, 1)));
  pass.send_counts.assign(ep, 0);
  pass.recv_counts.assign(ep, 0);
  pass.SetCounts(d + 1);
  MUONMESH_LAUNCH(
      k::LaunchPackTokens(s.h.get(), s.order.get(), s.ids.get(), n, d, s.send.get(), stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(s.send.get(), pass.send_counts, s.recv.get(), pass.recv_counts));
  return absl::OkStatus();
}

// The received tokens through their local experts, grouped by expert, and
// the results sent back.
absl::Status CudaMoeMlp::ExpertsForward(UnitAccess& units, const float* w1, const float* w2,
                                        Pass& pass) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model, de = dm.d_expert, local = pass.local, received = pass.received;
  Scratch& s = *scratch_;
  std::vector<float> recv_ids(static_cast<size_t>(received));
  if (received > 0) {
    MUONMESH_CUDA_CHECK(cudaMemcpy2DAsync(recv_ids.data(), sizeof(float), s.recv.get(),
                                          sizeof(float) * (d + 1), sizeof(float), received,
                                          cudaMemcpyDeviceToHost, stream_));
    MUONMESH_RETURN_IF_ERROR(Sync());
  }
  std::vector<int64_t> ex_order;
  std::vector<int32_t> ex_local;
  MUONMESH_RETURN_IF_ERROR(internal::GroupByLocalExpert(recv_ids.data(), 1, received, local,
                                                        &ex_local, &pass.ex_begin, &ex_order));
  const std::vector<int64_t>& ex_begin = pass.ex_begin;
  if (received > 0) {
    MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.ex_order.get(), ex_order.data(),
                                        sizeof(int64_t) * received, cudaMemcpyHostToDevice,
                                        stream_));
  }
  MUONMESH_LAUNCH(k::LaunchGatherRowsStrided(s.recv.get(), d + 1, 1, s.ex_order.get(), received,
                                             d, s.ex_h.get(), stream_));
  for (int64_t l = 0; l < local; ++l) {
    const int64_t b = ex_begin[l];
    const int64_t c = ex_begin[l + 1] - b;
    if (c == 0) continue;
    float* a = s.ex_a.get() + b * de;
    MUONMESH_RETURN_IF_ERROR(
        Gemm(false, true, c, de, d, 1.0f, s.ex_h.get() + b * d, w1 + l * de * d, 0.0f, a));
    MUONMESH_LAUNCH(k::LaunchTanh(a, c * de, stream_));
    MUONMESH_RETURN_IF_ERROR(
        Gemm(false, true, c, d, de, 1.0f, a, w2 + l * d * de, 0.0f, s.ex_o.get() + b * d));
  }
  // Back in the order received (recv is free: the inputs were copied out).
  MUONMESH_LAUNCH(
      k::LaunchScatterRows(s.ex_o.get(), s.ex_order.get(), received, d, s.recv.get(), stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  pass.SetCounts(d);
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(s.recv.get(), pass.recv_counts, s.send.get(), pass.send_counts));
  return absl::OkStatus();
}

// The output layer, the loss and dL/dy, its gradients and dL/dz; returns the
// sum of squared errors.
absl::StatusOr<double> CudaMoeMlp::OutputLayer(UnitAccess& units, int64_t n) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model, d_out = dm.d_out;
  Scratch& s = *scratch_;
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p2, units.Acquire(2));
  Held held2(units, 2);
  SyncOnExit synced2(stream_);
  MUONMESH_RETURN_IF_ERROR(Expect(p2, 2, 2, "parameters"));
  MUONMESH_RETURN_IF_ERROR(
      Gemm(false, true, n, d_out, d, 1.0f, s.z.get(), p2[0], 0.0f, s.yout.get()));
  MUONMESH_LAUNCH(k::LaunchBiasActivate(s.yout.get(), p2[1], n, d_out, false, stream_));
  const double denom = static_cast<double>(n) * static_cast<double>(d_out);
  MUONMESH_LAUNCH(k::LaunchOutputDelta(s.yout.get(), y_, s.samples.get(), n, d_out, denom,
                                       s.dy.get(), s.partial.get(), stream_));
  std::vector<double> partial(k::kLossBlocks);
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(partial.data(), s.partial.get(),
                                      sizeof(double) * partial.size(), cudaMemcpyDeviceToHost,
                                      stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  double loss_sum = 0.0;
  for (double v : partial) loss_sum += v;
  {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g2, units.GradientBuffers(2));
    MUONMESH_RETURN_IF_ERROR(Expect(g2, 2, 2, "gradients"));
    MUONMESH_RETURN_IF_ERROR(
        Gemm(true, false, d_out, d, n, 1.0f, s.dy.get(), s.z.get(), 0.0f, g2[0]));
    MUONMESH_LAUNCH(k::LaunchColumnSums(s.dy.get(), n, d_out, g2[1], stream_));
    MUONMESH_RETURN_IF_ERROR(
        Gemm(false, false, n, d, d_out, 1.0f, s.dy.get(), p2[0], 0.0f, s.dz.get()));
    MUONMESH_RETURN_IF_ERROR(Sync());
    MUONMESH_RETURN_IF_ERROR(units.Commit(2));
  }
  return loss_sum;
}

// dL/dz through the combine, back to the experts' ranks, through the
// experts, and home again into dL/dh; the router's gradients.
absl::Status CudaMoeMlp::ExpertsBackward(UnitAccess& units, const Pass& pass) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t n = pass.n, d = dm.d_model, de = dm.d_expert, e_total = dm.num_experts,
                local = pass.local, received = pass.received;
  const int ep = pass.ep;
  const std::vector<int64_t>& ex_begin = pass.ex_begin;
  Scratch& s = *scratch_;
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p1, units.Acquire(1));
  Held again(units, 1);
  SyncOnExit synced_again(stream_);
  MUONMESH_RETURN_IF_ERROR(Expect(p1, 3, 1, "parameters"));
  const float* w_router = p1[0];
  const float* w1 = p1[1];
  const float* w2 = p1[2];
  std::vector<double> dgate(n);
  MUONMESH_LAUNCH(k::LaunchRowDots(s.dz.get(), s.o.get(), n, d, s.dots.get(), stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(dgate.data(), s.dots.get(), sizeof(double) * n,
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_LAUNCH(k::LaunchGatherScaledRows(s.dz.get(), s.gate.get(), s.order.get(), n, d,
                                            s.send.get(), stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(s.send.get(), pass.send_counts, s.recv.get(), pass.recv_counts));
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g1, units.GradientBuffers(1));
  MUONMESH_RETURN_IF_ERROR(Expect(g1, 3, 1, "gradients"));
  float* gw_router = g1[0];
  float* gw1 = g1[1];
  float* gw2 = g1[2];
  const float alpha = 1.0f / static_cast<float>(ep);  // the mean loss of the EP ranks
  MUONMESH_LAUNCH(
      k::LaunchGatherRows(s.recv.get(), s.ex_order.get(), received, d, s.ex_do.get(), stream_));
  for (int64_t l = 0; l < local; ++l) {
    const int64_t b = ex_begin[l];
    const int64_t c = ex_begin[l + 1] - b;
    float* g1l = gw1 + l * de * d;
    float* g2l = gw2 + l * d * de;
    if (c == 0) {
      MUONMESH_CUDA_CHECK(cudaMemsetAsync(g1l, 0, sizeof(float) * de * d, stream_));
      MUONMESH_CUDA_CHECK(cudaMemsetAsync(g2l, 0, sizeof(float) * d * de, stream_));
      continue;
    }
    const float* a = s.ex_a.get() + b * de;
    float* dob = s.ex_do.get() + b * d;
    float* da = s.ex_da.get() + b * de;
    MUONMESH_RETURN_IF_ERROR(Gemm(true, false, d, de, c, alpha, dob, a, 0.0f, g2l));
    MUONMESH_RETURN_IF_ERROR(Gemm(false, false, c, de, d, 1.0f, dob, w2 + l * d * de, 0.0f, da));
    MUONMESH_LAUNCH(k::LaunchTanhBackward(da, a, c * de, stream_));
    MUONMESH_RETURN_IF_ERROR(
        Gemm(true, false, de, d, c, alpha, da, s.ex_h.get() + b * d, 0.0f, g1l));
    // dL/dh of these tokens, over their dL/do rows (no longer needed).
    MUONMESH_RETURN_IF_ERROR(Gemm(false, false, c, d, de, 1.0f, da, w1 + l * de * d, 0.0f, dob));
  }
  MUONMESH_LAUNCH(
      k::LaunchScatterRows(s.ex_do.get(), s.ex_order.get(), received, d, s.recv.get(), stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  MUONMESH_RETURN_IF_ERROR(
      units.ExchangeTokens(s.recv.get(), pass.recv_counts, s.send.get(), pass.send_counts));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.dh.get(), s.dz.get(), sizeof(float) * n * d,
                                      cudaMemcpyDeviceToDevice, stream_));
  MUONMESH_LAUNCH(
      k::LaunchScatterAddRows(s.send.get(), s.order.get(), n, d, s.dh.get(), stream_));
  // Router: dL/dlogit_j = g_e (delta_je - g_j) dL/dg_e, on the host.
  std::vector<float> dlogits(static_cast<size_t>(n * e_total));
  RouterLogitGradient(pass.g.data(), pass.routing, dgate.data(), n, e_total, dlogits.data());
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.dlogits.get(), dlogits.data(),
                                      sizeof(float) * dlogits.size(), cudaMemcpyHostToDevice,
                                      stream_));
  MUONMESH_RETURN_IF_ERROR(Gemm(true, false, e_total, d, n, 1.0f, s.dlogits.get(), s.h.get(),
                                0.0f, gw_router));
  MUONMESH_RETURN_IF_ERROR(Gemm(false, false, n, d, e_total, 1.0f, s.dlogits.get(), w_router,
                                1.0f, s.dh.get()));
  MUONMESH_RETURN_IF_ERROR(Sync());
  MUONMESH_RETURN_IF_ERROR(units.Commit(1));
  return absl::OkStatus();
}

// dL/dh through tanh, then the input layer's gradients.
absl::Status CudaMoeMlp::InputBackward(UnitAccess& units, int64_t n) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d_in = dm.d_in, d = dm.d_model;
  Scratch& s = *scratch_;
  MUONMESH_LAUNCH(k::LaunchTanhBackward(s.dh.get(), s.h.get(), n * d, stream_));
  MUONMESH_ASSIGN_OR_RETURN(absl::Span<float* const> g0, units.GradientBuffers(0));
  MUONMESH_RETURN_IF_ERROR(Expect(g0, 2, 0, "gradients"));
  MUONMESH_RETURN_IF_ERROR(
      Gemm(true, false, d, d_in, n, 1.0f, s.dh.get(), s.xs.get(), 0.0f, g0[0]));
  MUONMESH_LAUNCH(k::LaunchColumnSums(s.dh.get(), n, d, g0[1], stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  MUONMESH_RETURN_IF_ERROR(units.Commit(0));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaMoeMlp::Run(UnitAccess& units, absl::Span<const int64_t> samples) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t e_total = dm.num_experts, d = dm.d_model;
  Pass pass;
  pass.n = static_cast<int64_t>(samples.size());
  pass.ep = units.expert_parallel_size();
  const int64_t n = pass.n;
  const int ep = pass.ep;
  if (ep < 1 || e_total % ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moe_mlp: num_experts ", e_total, " does not split over ", ep, " expert-parallel groups"));
  }
  pass.local = e_total / ep;
  MUONMESH_RETURN_IF_ERROR(ReserveFor(n, ep));
  Scratch& s = *scratch_;
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.samples.get(), samples.data(), sizeof(int64_t) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_LAUNCH(k::LaunchGatherRows(x_, s.samples.get(), n, dm.d_in, s.xs.get(), stream_));
  MUONMESH_RETURN_IF_ERROR(InputForward(units, n));

  // Router, dispatch, experts, combine.
  {
    MUONMESH_ASSIGN_OR_RETURN(absl::Span<const float* const> p1, units.Acquire(1));
    Held held1(units, 1);
    SyncOnExit synced1(stream_);
    MUONMESH_RETURN_IF_ERROR(Expect(p1, 3, 1, "parameters"));
    MUONMESH_RETURN_IF_ERROR(Dispatch(units, p1[0], pass));
    MUONMESH_RETURN_IF_ERROR(ExpertsForward(units, p1[1], p1[2], pass));
  }
  MUONMESH_LAUNCH(k::LaunchScatterRows(s.send.get(), s.order.get(), n, d, s.o.get(), stream_));
  MUONMESH_LAUNCH(
      k::LaunchGatedResidual(s.h.get(), s.gate.get(), s.o.get(), n, d, s.z.get(), stream_));

  MUONMESH_ASSIGN_OR_RETURN(double loss_sum, OutputLayer(units, n));
  MUONMESH_RETURN_IF_ERROR(ExpertsBackward(units, pass));
  MUONMESH_RETURN_IF_ERROR(InputBackward(units, n));
  return loss_sum / (static_cast<double>(n) * static_cast<double>(dm.d_out));
}

}  // namespace muonmesh::worker
