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
    : CudaWorkload(std::move(cpu)),
      scratch_(std::make_unique<Scratch>()),
      pass_(std::make_unique<Pass>()) {}

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
  pass_.reset();
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
  return RunMoeMlpPasses(cpu_.dims(), cpu_.num_samples(), *this, units, samples,
                         /*gradients=*/true);
}

// One call's routing, from the forward pass to the backward one.
struct CudaMoeMlp::Pass {
  int64_t local = 0;              // experts on this rank
  std::vector<float> g;           // router probabilities [n, experts] (host)
  MoeRouting routing;
  std::vector<int64_t> ex_begin;  // received tokens of local expert l: [ex_begin[l], [l + 1])
  std::vector<double> dgate;      // dL/dgate per token (host)
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

absl::Status CudaMoeMlp::Gather(absl::Span<const int64_t> samples, int ep) {
  const int64_t n = static_cast<int64_t>(samples.size());
  MUONMESH_RETURN_IF_ERROR(ReserveFor(n, ep));
  Scratch& s = *scratch_;
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.samples.get(), samples.data(), sizeof(int64_t) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_LAUNCH(
      k::LaunchGatherRows(x_, s.samples.get(), n, cpu_.dims().d_in, s.xs.get(), stream_));
  return Sync();
}

absl::Status CudaMoeMlp::InputForward(int64_t n, const float* weight, const float* bias) {
  const MoeMlpDims& dm = cpu_.dims();
  Scratch& s = *scratch_;
  SyncOnExit synced(stream_);
  MUONMESH_RETURN_IF_ERROR(
      Gemm(false, true, n, dm.d_model, dm.d_in, 1.0f, s.xs.get(), weight, 0.0f, s.h.get()));
  MUONMESH_LAUNCH(k::LaunchBiasActivate(s.h.get(), bias, n, dm.d_model, true, stream_));
  return Sync();
}

// The router's probabilities, on the host in double as the CPU's.
absl::StatusOr<std::vector<int64_t>> CudaMoeMlp::Route(int64_t n, int ep, const float* w_router) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t e_total = dm.num_experts, local = e_total / ep;
  Scratch& s = *scratch_;
  Pass& pass = *pass_;
  SyncOnExit synced(stream_);
  pass.local = local;
  MUONMESH_RETURN_IF_ERROR(Gemm(false, true, n, e_total, dm.d_model, 1.0f, s.h.get(), w_router,
                                0.0f, s.logits.get()));
  pass.g.resize(static_cast<size_t>(n * e_total));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(pass.g.data(), s.logits.get(), sizeof(float) * pass.g.size(),
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  RouteTokens(pass.g.data(), n, e_total, &pass.routing);
  const MoeRouting& r = pass.routing;
  std::vector<int64_t> send_tokens(ep);
  std::vector<float> count_send(ep), ids(n);
  for (int q = 0; q < ep; ++q) {
    send_tokens[q] = r.per_expert[(q + 1) * local] - r.per_expert[q * local];
    count_send[q] = static_cast<float>(send_tokens[q]);
  }
  for (int64_t j = 0; j < n; ++j) ids[j] = static_cast<float>(r.expert[r.order[j]] % local);
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.gate.get(), r.gate.data(), sizeof(float) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.order.get(), r.order.data(), sizeof(int64_t) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.ids.get(), ids.data(), sizeof(float) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.counts_send.get(), count_send.data(), sizeof(float) * ep,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  return send_tokens;
}

absl::StatusOr<std::vector<float>> CudaMoeMlp::ReceivedCounts(int ep) {
  std::vector<float> counts(ep);
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(counts.data(), scratch_->counts_recv.get(),
                                      sizeof(float) * ep, cudaMemcpyDeviceToHost, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  return counts;
}

absl::Status CudaMoeMlp::PackTokens(int64_t n, int64_t received) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model, de = dm.d_expert;
  Scratch& s = *scratch_;
  for (DevArray<float>* b : {&s.ex_h, &s.ex_o, &s.ex_do}) {
    MUONMESH_RETURN_IF_ERROR(b->Reserve(std::max<int64_t>(received * d, 1)));
  }
  for (DevArray<float>* b : {&s.ex_a, &s.ex_da}) {
    MUONMESH_RETURN_IF_ERROR(b->Reserve(std::max<int64_t>(received * de, 1)));
  }
  MUONMESH_RETURN_IF_ERROR(s.recv.Reserve(std::max<int64_t>(received * (d + 1), 1)));
  MUONMESH_RETURN_IF_ERROR(s.ex_order.Reserve(std::max<int64_t>(received, 1)));
  MUONMESH_LAUNCH(
      k::LaunchPackTokens(s.h.get(), s.order.get(), s.ids.get(), n, d, s.send.get(), stream_));
  return Sync();
}

// The received tokens through their local experts, grouped by expert.
absl::Status CudaMoeMlp::ExpertsForward(int64_t received, int64_t local, const float* w1,
                                        const float* w2) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model, de = dm.d_expert;
  Scratch& s = *scratch_;
  SyncOnExit synced(stream_);
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
                                                        &ex_local, &pass_->ex_begin, &ex_order));
  const std::vector<int64_t>& ex_begin = pass_->ex_begin;
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
  return Sync();
}

absl::Status CudaMoeMlp::Combine(int64_t n) {
  const int64_t d = cpu_.dims().d_model;
  Scratch& s = *scratch_;
  MUONMESH_LAUNCH(k::LaunchScatterRows(s.send.get(), s.order.get(), n, d, s.o.get(), stream_));
  MUONMESH_LAUNCH(
      k::LaunchGatedResidual(s.h.get(), s.gate.get(), s.o.get(), n, d, s.z.get(), stream_));
  return Sync();
}

absl::Status CudaMoeMlp::OutputLayer(int64_t n, const float* weight, const float* bias) {
  const MoeMlpDims& dm = cpu_.dims();
  Scratch& s = *scratch_;
  SyncOnExit synced(stream_);
  MUONMESH_RETURN_IF_ERROR(
      Gemm(false, true, n, dm.d_out, dm.d_model, 1.0f, s.z.get(), weight, 0.0f, s.yout.get()));
  MUONMESH_LAUNCH(k::LaunchBiasActivate(s.yout.get(), bias, n, dm.d_out, false, stream_));
  return Sync();
}

absl::StatusOr<double> CudaMoeMlp::OutputLoss(absl::Span<const int64_t> samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t d_out = cpu_.dims().d_out;
  Scratch& s = *scratch_;
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
  return loss_sum;
}

absl::Status CudaMoeMlp::OutputBackward(int64_t n, const float* weight, float* dw, float* db) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model, d_out = dm.d_out;
  Scratch& s = *scratch_;
  SyncOnExit synced(stream_);
  MUONMESH_RETURN_IF_ERROR(Gemm(true, false, d_out, d, n, 1.0f, s.dy.get(), s.z.get(), 0.0f, dw));
  MUONMESH_LAUNCH(k::LaunchColumnSums(s.dy.get(), n, d_out, db, stream_));
  MUONMESH_RETURN_IF_ERROR(
      Gemm(false, false, n, d, d_out, 1.0f, s.dy.get(), weight, 0.0f, s.dz.get()));
  return Sync();
}

absl::Status CudaMoeMlp::PackGateGradients(int64_t n) {
  const int64_t d = cpu_.dims().d_model;
  Scratch& s = *scratch_;
  pass_->dgate.resize(static_cast<size_t>(n));
  MUONMESH_LAUNCH(k::LaunchRowDots(s.dz.get(), s.o.get(), n, d, s.dots.get(), stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(pass_->dgate.data(), s.dots.get(), sizeof(double) * n,
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_LAUNCH(k::LaunchGatherScaledRows(s.dz.get(), s.gate.get(), s.order.get(), n, d,
                                            s.send.get(), stream_));
  return Sync();
}

absl::Status CudaMoeMlp::ExpertsBackward(int64_t received, int64_t local, int ep,
                                         const float* w1, const float* w2, float* gw1,
                                         float* gw2) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model, de = dm.d_expert;
  const std::vector<int64_t>& ex_begin = pass_->ex_begin;
  Scratch& s = *scratch_;
  SyncOnExit synced(stream_);
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
  return Sync();
}

// dL/dh = dL/dz + the experts' part + the router's (dL/dlogit_j =
// g_e (delta_je - g_j) dL/dg_e, on the host).
absl::Status CudaMoeMlp::RouterBackward(int64_t n, const float* w_router, float* gw_router) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model, e_total = dm.num_experts;
  Scratch& s = *scratch_;
  SyncOnExit synced(stream_);
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.dh.get(), s.dz.get(), sizeof(float) * n * d,
                                      cudaMemcpyDeviceToDevice, stream_));
  MUONMESH_LAUNCH(
      k::LaunchScatterAddRows(s.send.get(), s.order.get(), n, d, s.dh.get(), stream_));
  std::vector<float> dlogits(static_cast<size_t>(n * e_total));
  RouterLogitGradient(pass_->g.data(), pass_->routing, pass_->dgate.data(), n, e_total,
                      dlogits.data());
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(s.dlogits.get(), dlogits.data(),
                                      sizeof(float) * dlogits.size(), cudaMemcpyHostToDevice,
                                      stream_));
  MUONMESH_RETURN_IF_ERROR(Gemm(true, false, e_total, d, n, 1.0f, s.dlogits.get(), s.h.get(),
                                0.0f, gw_router));
  MUONMESH_RETURN_IF_ERROR(Gemm(false, false, n, d, e_total, 1.0f, s.dlogits.get(), w_router,
                                1.0f, s.dh.get()));
  return Sync();
}

absl::Status CudaMoeMlp::InputBackward(int64_t n, float* dw, float* db) {
  const MoeMlpDims& dm = cpu_.dims();
  const int64_t d = dm.d_model;
  Scratch& s = *scratch_;
  SyncOnExit synced(stream_);
  MUONMESH_LAUNCH(k::LaunchTanhBackward(s.dh.get(), s.h.get(), n * d, stream_));
  MUONMESH_RETURN_IF_ERROR(Gemm(true, false, d, dm.d_in, n, 1.0f, s.dh.get(), s.xs.get(), 0.0f, dw));
  MUONMESH_LAUNCH(k::LaunchColumnSums(s.dh.get(), n, d, db, stream_));
  return Sync();
}

float* CudaMoeMlp::counts_send() { return scratch_->counts_send.get(); }
float* CudaMoeMlp::counts_recv() { return scratch_->counts_recv.get(); }
float* CudaMoeMlp::send() { return scratch_->send.get(); }
float* CudaMoeMlp::recv() { return scratch_->recv.get(); }

}  // namespace muonmesh::worker
