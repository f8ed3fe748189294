#include "worker/model/gpt_cuda.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/cuda/cuda_checks.h"
#include "worker/cuda/gpt_kernels.h"
#include "worker/cuda/mlp_kernels.h"
#include "worker/cuda/row_major_gemm.h"

namespace muonmesh::worker {

namespace kernels = cuda::internal;

absl::StatusOr<std::unique_ptr<CudaGpt>> CudaGpt::Create(Gpt gpt) {
  MUONMESH_RETURN_IF_ERROR(cuda::CudaDeviceCount("gpt on cuda").status());
  std::unique_ptr<CudaGpt> w(new CudaGpt(std::move(gpt)));
  MUONMESH_RETURN_IF_ERROR(w->Init());
  return w;
}

CudaGpt::CudaGpt(Gpt cpu)
    : CudaWorkload(std::move(cpu)), blocks_(static_cast<size_t>(cpu_.dims().n_layer)) {}

absl::Status CudaGpt::Init() {
  MUONMESH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MUONMESH_CUBLAS_CHECK(cublasCreate(&blas_));
  MUONMESH_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  // Plain fp32 products (no TF32), like the CPU workload.
  MUONMESH_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_PEDANTIC_MATH));
  return absl::OkStatus();
}

CudaGpt::~CudaGpt() {
  FreeScratch();
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CudaGpt::FreeScratch() {
  for (void* p : allocations_) cudaFree(p);
  allocations_.clear();
  capacity_ = 0;
}

absl::Status CudaGpt::Reserve(int64_t n) {
  if (n <= capacity_) return absl::OkStatus();
  FreeScratch();
  const model::GptDims& d = cpu_.dims();
  const size_t rows = static_cast<size_t>(n * d.seq_len);
  const size_t c = static_cast<size_t>(d.n_embd);
  const size_t att = static_cast<size_t>(n * d.n_head * d.seq_len * d.seq_len);
  // Every buffer, as (where its pointer goes, 4-byte words): the int32
  // windows and double losses too (cudaMalloc aligns each to 256 bytes).
  std::vector<std::pair<void**, size_t>> wanted = {
      {reinterpret_cast<void**>(&windows_d_), static_cast<size_t>(n * (d.seq_len + 1))},
      {reinterpret_cast<void**>(&row_loss_d_), 2 * rows}};
  auto add = [&wanted](float*& p, size_t words) {
    wanted.emplace_back(reinterpret_cast<void**>(&p), words);
  };
  for (BlockActs& a : blocks_) {
    for (float** p : {&a.resid_in, &a.ln1, &a.atty, &a.resid_mid, &a.ln2}) add(*p, rows * c);
    for (float** p : {&a.ln1_mean, &a.ln1_rstd, &a.ln2_mean, &a.ln2_rstd}) add(*p, rows);
    add(a.qkv, rows * 3 * c);
    add(a.att, att);
    add(a.fch, rows * 4 * c);
    add(a.fch_gelu, rows * 4 * c);
  }
  for (float** p : {&resid_out_, &lnf_, &dresid_, &dc_}) add(*p, rows * c);
  add(lnf_mean_, rows);
  add(lnf_rstd_, rows);
  add(logits_, rows * static_cast<size_t>(d.vocab_size));
  add(dqkv_, rows * 3 * c);
  add(dfch_, rows * 4 * c);
  add(datt_, att);
  size_t words = 0;
  for (const auto& w : wanted) words += w.second;
  for (const auto& [where, count] : wanted) {
    const cudaError_t e = cudaMalloc(where, 4 * count);
    if (e != cudaSuccess) {
      FreeScratch();
      return cuda::CudaErrorToStatus(
          e,
          absl::StrCat("gpt on cuda: the activations of ", n, " windows (",
                       absl::SixDigits(4.0 * static_cast<double>(words) / (1 << 30)),
                       " GiB) do not fit the GPU; lower training.global_batch_size (per rank) "
                       "or model.gpt.seq_len")
              .c_str(),
          __FILE__, __LINE__);
    }
    allocations_.push_back(*where);
  }
  row_loss_.resize(rows);
  capacity_ = n;
  return absl::OkStatus();
}

absl::Status CudaGpt::Sync() {
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

float* CudaGpt::BlockOutput(int64_t layer) const {
  return layer + 1 < cpu_.dims().n_layer ? blocks_[layer + 1].resid_in : resid_out_;
}

absl::Status CudaGpt::Linear(int64_t rows, int64_t in, int64_t out, const float* x, const float* w,
                             const float* b, float* y) {
  MUONMESH_RETURN_IF_ERROR(
      cuda::RowMajorSgemm(blas_, false, true, rows, out, in, 1.0f, x, w, 0.0f, y));
  MUONMESH_CUDA_CHECK(kernels::LaunchBiasActivate(y, b, rows, out, /*activate=*/false, stream_));
  return absl::OkStatus();
}

absl::Status CudaGpt::LinearBackward(int64_t rows, int64_t in, int64_t out, const float* dy,
                                     const float* x, const float* w, float* dw, float* db,
                                     float* dx) {
  MUONMESH_RETURN_IF_ERROR(
      cuda::RowMajorSgemm(blas_, true, false, out, in, rows, 1.0f, dy, x, 0.0f, dw));
  MUONMESH_CUDA_CHECK(kernels::LaunchColumnSums(dy, rows, out, db, stream_));
  return cuda::RowMajorSgemm(blas_, false, false, rows, in, out, 1.0f, dy, w, 0.0f, dx);
}

// ---------------------------------------------------------------- passes

absl::Status CudaGpt::Prepare(absl::Span<const int32_t> windows, int64_t n) {
  MUONMESH_RETURN_IF_ERROR(Reserve(n));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(windows_d_, windows.data(), sizeof(int32_t) * windows.size(),
                                      cudaMemcpyHostToDevice, stream_));
  return Sync();
}

absl::Status CudaGpt::EmbedForward(int64_t n, const float* wte, const float* wpe) {
  const model::GptDims& d = cpu_.dims();
  MUONMESH_CUDA_CHECK(kernels::LaunchGptEmbed(windows_d_, n, d.seq_len, d.n_embd, wte, wpe,
                                              blocks_.front().resid_in, stream_));
  return Sync();
}

absl::Status CudaGpt::AttentionForward(const BlockActs& a, int64_t n) {
  const model::GptDims& d = cpu_.dims();
  const int64_t t_len = d.seq_len;
  const int64_t c = d.n_embd;
  const int64_t hs = c / d.n_head;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  const int64_t tt = t_len * t_len;
  // Per sample, every head at once: head h is the column block h hs of q,
  // k and v (row stride 3C), its scores the [T, T] block h of att.
  for (int64_t b = 0; b < n; ++b) {
    const float* qkv = a.qkv + b * t_len * 3 * c;
    MUONMESH_RETURN_IF_ERROR(cuda::RowMajorSgemmStridedBatched(
        blas_, false, true, t_len, t_len, hs, scale, qkv, 3 * c, hs, qkv + c, 3 * c, hs, 0.0f,
        a.att + b * d.n_head * tt, t_len, tt, d.n_head));
  }
  MUONMESH_CUDA_CHECK(kernels::LaunchCausalSoftmax(a.att, n * d.n_head * t_len, t_len, stream_));
  for (int64_t b = 0; b < n; ++b) {
    const float* qkv = a.qkv + b * t_len * 3 * c;
    MUONMESH_RETURN_IF_ERROR(cuda::RowMajorSgemmStridedBatched(
        blas_, false, false, t_len, hs, t_len, 1.0f, a.att + b * d.n_head * tt, t_len, tt,
        qkv + 2 * c, 3 * c, hs, 0.0f, a.atty + b * t_len * c, c, hs, d.n_head));
  }
  return absl::OkStatus();
}

absl::Status CudaGpt::BlockForward(int64_t layer, int64_t n, absl::Span<const float* const> p) {
  const model::GptDims& d = cpu_.dims();
  const int64_t rows = n * d.seq_len;
  const int64_t c = d.n_embd;
  const BlockActs& a = blocks_[layer];
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNorm(a.resid_in, p[0], p[1], rows, c, a.ln1, a.ln1_mean,
                                               a.ln1_rstd, stream_));
  MUONMESH_RETURN_IF_ERROR(Linear(rows, c, 3 * c, a.ln1, p[2], p[3], a.qkv));
  MUONMESH_RETURN_IF_ERROR(AttentionForward(a, n));
  MUONMESH_RETURN_IF_ERROR(Linear(rows, c, c, a.atty, p[4], p[5], a.resid_mid));
  MUONMESH_CUDA_CHECK(kernels::LaunchAddInPlace(a.resid_mid, a.resid_in, rows * c, stream_));
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNorm(a.resid_mid, p[6], p[7], rows, c, a.ln2, a.ln2_mean,
                                               a.ln2_rstd, stream_));
  MUONMESH_RETURN_IF_ERROR(Linear(rows, c, 4 * c, a.ln2, p[8], p[9], a.fch));
  MUONMESH_CUDA_CHECK(kernels::LaunchGelu(a.fch, a.fch_gelu, rows * 4 * c, stream_));
  float* out = BlockOutput(layer);
  MUONMESH_RETURN_IF_ERROR(Linear(rows, 4 * c, c, a.fch_gelu, p[10], p[11], out));
  MUONMESH_CUDA_CHECK(kernels::LaunchAddInPlace(out, a.resid_mid, rows * c, stream_));
  return Sync();
}

absl::Status CudaGpt::FinalNorm(int64_t n, const float* w, const float* b) {
  const model::GptDims& d = cpu_.dims();
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNorm(resid_out_, w, b, n * d.seq_len, d.n_embd, lnf_,
                                               lnf_mean_, lnf_rstd_, stream_));
  return Sync();
}

absl::StatusOr<double> CudaGpt::LogitsAndLoss(int64_t n, const float* wte, bool gradients) {
  const model::GptDims& d = cpu_.dims();
  const int64_t rows = n * d.seq_len;
  MUONMESH_RETURN_IF_ERROR(cuda::RowMajorSgemm(blas_, false, true, rows, d.vocab_size, d.n_embd,
                                               1.0f, lnf_, wte, 0.0f, logits_));
  MUONMESH_CUDA_CHECK(kernels::LaunchCrossEntropy(logits_, windows_d_, n, d.seq_len, d.vocab_size,
                                                  static_cast<double>(rows), gradients, row_loss_d_,
                                                  stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(row_loss_.data(), row_loss_d_, sizeof(double) * rows,
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_RETURN_IF_ERROR(Sync());
  double loss = 0.0;
  for (int64_t r = 0; r < rows; ++r) loss += row_loss_[r];
  return loss;
}

// ---------------------------------------------------------------- backward

absl::Status CudaGpt::HeadBackward(int64_t n, const float* wte, const float* lnf_w, float* dwte,
                                   float* dlnf_w, float* dlnf_b) {
  const model::GptDims& d = cpu_.dims();
  const int64_t rows = n * d.seq_len;
  const int64_t c = d.n_embd;
  const int64_t v = d.vocab_size;
  MUONMESH_RETURN_IF_ERROR(
      cuda::RowMajorSgemm(blas_, true, false, v, c, rows, 1.0f, logits_, lnf_, 0.0f, dwte));
  MUONMESH_RETURN_IF_ERROR(
      cuda::RowMajorSgemm(blas_, false, false, rows, c, v, 1.0f, logits_, wte, 0.0f, dc_));
  MUONMESH_CUDA_CHECK(cudaMemsetAsync(dresid_, 0, sizeof(float) * rows * c, stream_));
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNormBackward(resid_out_, lnf_mean_, lnf_rstd_, lnf_w, dc_,
                                                       rows, c, dresid_, stream_));
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNormParamGrads(resid_out_, lnf_mean_, lnf_rstd_, dc_,
                                                         rows, c, dlnf_w, dlnf_b, stream_));
  return Sync();
}

absl::Status CudaGpt::AttentionBackward(const BlockActs& a, int64_t n, const float* datty,
                                        float* dqkv) {
  const model::GptDims& d = cpu_.dims();
  const int64_t t_len = d.seq_len;
  const int64_t c = d.n_embd;
  const int64_t hs = c / d.n_head;
  const int64_t h = d.n_head;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  const int64_t tt = t_len * t_len;
  // dP = dY V^T; dV = P^T dY; dS = softmax'(dP); dQ = s dS K; dK = s dS^T Q.
  for (int64_t b = 0; b < n; ++b) {
    const float* qkv = a.qkv + b * t_len * 3 * c;
    const float* dy = datty + b * t_len * c;
    float* dq = dqkv + b * t_len * 3 * c;
    MUONMESH_RETURN_IF_ERROR(cuda::RowMajorSgemmStridedBatched(
        blas_, false, true, t_len, t_len, hs, 1.0f, dy, c, hs, qkv + 2 * c, 3 * c, hs, 0.0f,
        datt_ + b * h * tt, t_len, tt, h));
    MUONMESH_RETURN_IF_ERROR(cuda::RowMajorSgemmStridedBatched(
        blas_, true, false, t_len, hs, t_len, 1.0f, a.att + b * h * tt, t_len, tt, dy, c, hs, 0.0f,
        dq + 2 * c, 3 * c, hs, h));
  }
  MUONMESH_CUDA_CHECK(
      kernels::LaunchCausalSoftmaxBackward(a.att, datt_, n * h * t_len, t_len, stream_));
  for (int64_t b = 0; b < n; ++b) {
    const float* qkv = a.qkv + b * t_len * 3 * c;
    float* dq = dqkv + b * t_len * 3 * c;
    const float* ds = datt_ + b * h * tt;
    MUONMESH_RETURN_IF_ERROR(cuda::RowMajorSgemmStridedBatched(blas_, false, false, t_len, hs,
                                                               t_len, scale, ds, t_len, tt, qkv + c,
                                                               3 * c, hs, 0.0f, dq, 3 * c, hs, h));
    MUONMESH_RETURN_IF_ERROR(cuda::RowMajorSgemmStridedBatched(blas_, true, false, t_len, hs, t_len,
                                                               scale, ds, t_len, tt, qkv, 3 * c, hs,
                                                               0.0f, dq + c, 3 * c, hs, h));
  }
  return absl::OkStatus();
}

absl::Status CudaGpt::BlockBackward(int64_t layer, int64_t n, absl::Span<const float* const> p,
                                    absl::Span<float* const> g) {
  const model::GptDims& d = cpu_.dims();
  const int64_t rows = n * d.seq_len;
  const int64_t c = d.n_embd;
  const BlockActs& a = blocks_[layer];
  MUONMESH_RETURN_IF_ERROR(
      LinearBackward(rows, 4 * c, c, dresid_, a.fch_gelu, p[10], g[10], g[11], dfch_));
  MUONMESH_CUDA_CHECK(kernels::LaunchGeluBackward(a.fch, dfch_, rows * 4 * c, stream_));
  MUONMESH_RETURN_IF_ERROR(LinearBackward(rows, c, 4 * c, dfch_, a.ln2, p[8], g[8], g[9], dc_));
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNormBackward(a.resid_mid, a.ln2_mean, a.ln2_rstd, p[6],
                                                       dc_, rows, c, dresid_, stream_));
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNormParamGrads(a.resid_mid, a.ln2_mean, a.ln2_rstd, dc_,
                                                         rows, c, g[6], g[7], stream_));
  MUONMESH_RETURN_IF_ERROR(LinearBackward(rows, c, c, dresid_, a.atty, p[4], g[4], g[5], dc_));
  MUONMESH_RETURN_IF_ERROR(AttentionBackward(a, n, dc_, dqkv_));
  MUONMESH_RETURN_IF_ERROR(LinearBackward(rows, c, 3 * c, dqkv_, a.ln1, p[2], g[2], g[3], dc_));
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNormBackward(a.resid_in, a.ln1_mean, a.ln1_rstd, p[0],
                                                       dc_, rows, c, dresid_, stream_));
  MUONMESH_CUDA_CHECK(kernels::LaunchLayerNormParamGrads(a.resid_in, a.ln1_mean, a.ln1_rstd, dc_,
                                                         rows, c, g[0], g[1], stream_));
  return Sync();
}

absl::Status CudaGpt::EmbedBackward(int64_t n, float* dwte, float* dwpe) {
  const model::GptDims& d = cpu_.dims();
  MUONMESH_CUDA_CHECK(
      kernels::LaunchGptEmbedBackward(windows_d_, n, d.seq_len, d.n_embd, dresid_, dwte, stream_));
  MUONMESH_CUDA_CHECK(
      kernels::LaunchPositionGrads(dresid_, n, d.seq_len, d.n_embd, d.block_size, dwpe, stream_));
  return Sync();
}

// ---------------------------------------------------------------- entry points

absl::StatusOr<double> CudaGpt::ForwardBackwardByUnit(int64_t /*step*/, UnitAccess& units,
                                                      absl::Span<const int64_t> samples) {
  return RunGptPasses(cpu_.dims(), *this, units, cpu_.train(), samples, /*gradients=*/true,
                      windows_);
}

absl::StatusOr<double> CudaGpt::ValidationLossByUnit(UnitAccess& units,
                                                     absl::Span<const int64_t> samples) {
  if (cpu_.validation() == nullptr) return absl::FailedPreconditionError("gpt: no validation data");
  return RunGptPasses(cpu_.dims(), *this, units, *cpu_.validation(), samples,
                      /*gradients=*/false, windows_);
}

}  // namespace muonmesh::worker
