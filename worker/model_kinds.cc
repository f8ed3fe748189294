#include "worker/model_kinds.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "proto/convert/plan_convert.h"
#include "proto/job/corpus.h"
#include "worker/io/safetensors.h"
#include "worker/io/token_files.h"
#include "worker/model/gpt.h"
#include "worker/model/mlp.h"
#include "worker/model/moe_mlp.h"
#include "worker/model/synthetic.h"
#include "worker/model/token_windows.h"
#include "worker/model/transformer.h"

namespace muonmesh::worker {
namespace {

constexpr double kFloat = 4;  // bytes of an fp32 element
constexpr double kIndex = 8;  // bytes of a sample index

double Sum(const std::vector<int64_t>& v) {
  double s = 0;
  for (int64_t x : v) s += static_cast<double>(x);
  return s;
}

// ------------------------------------------------------- examples (mlp, moe_mlp)

struct Dataset {
  std::vector<float> x;
  std::vector<float> y;
};

// A dataset from a safetensors file with x [N, d_in] and y [N, d_out];
// `model` names the job field the sizes come from.
absl::StatusOr<Dataset> ReadDataset(const std::string& path, int64_t d_in, int64_t d_out,
                                    const char* model) {
  MUONMESH_ASSIGN_OR_RETURN(std::vector<io::Tensor> tensors, io::ReadSafetensors(path));
  std::map<std::string, io::Tensor*> by_name;
  for (io::Tensor& t : tensors) by_name[t.name] = &t;
  for (const char* name : {"x", "y"}) {
    if (by_name.count(name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": no tensor '", name, "' (data files hold x [N, d_in] and y [N, d_out])"));
    }
  }
  io::Tensor& x = *by_name["x"];
  io::Tensor& y = *by_name["y"];
  if (x.shape.size() != 2 || x.shape[1] != d_in) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor 'x' has shape [", absl::StrJoin(x.shape, ", "), "], expected [N, ", d_in,
        "] for ", model));
  }
  if (y.shape.size() != 2 || y.shape[1] != d_out || y.shape[0] != x.shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor 'y' has shape [", absl::StrJoin(y.shape, ", "), "], expected [", x.shape[0],
        ", ", d_out, "]"));
  }
  return Dataset{std::move(x.data), std::move(y.data)};
}

absl::StatusOr<std::unique_ptr<Workload>> MlpFromFile(const std::vector<int64_t>& dims,
                                                      const std::string& path) {
  MUONMESH_ASSIGN_OR_RETURN(Dataset data,
                            ReadDataset(path, dims.front(), dims.back(), "model.mlp.dims"));
  MUONMESH_ASSIGN_OR_RETURN(Mlp mlp, Mlp::Create(dims, std::move(data.x), std::move(data.y)), path);
  return std::unique_ptr<Workload>(new Mlp(std::move(mlp)));
}

absl::StatusOr<std::unique_ptr<Workload>> MakeMoeMlp(const job::ResolvedJob& job) {
  const MoeMlpDims& dims = std::get<job::MoeMlpModel>(job.model_form).dims;
  if (job.data_safetensors.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(
        MoeMlp moe, MoeMlp::FromTeacher(dims, job.teacher_seed.value_or(0), job.teacher_samples));
    return std::unique_ptr<Workload>(new MoeMlp(std::move(moe)));
  }
  MUONMESH_ASSIGN_OR_RETURN(
      Dataset data, ReadDataset(job.data_safetensors, dims.d_in, dims.d_out, "model.moe_mlp"));
  MUONMESH_ASSIGN_OR_RETURN(MoeMlp moe, MoeMlp::Create(dims, std::move(data.x), std::move(data.y)),
                            job.data_safetensors);
  return std::unique_ptr<Workload>(new MoeMlp(std::move(moe)));
}


// The dataset: from data.safetensors (read, then kept), or the teacher's
// x [N, d_in] and y [N, d_out].
void AddDataset(const job::ResolvedJob& job, const InputFileBytes& files, double d_in, double d_out,
                WorkloadMemory& w) {
  if (!job.data_safetensors.empty()) {
    // Up to twice the file: 16-bit tensors are widened to fp32.
    w.resident.push_back(
        {"data.safetensors", "dataset x, y", 2 * static_cast<double>(files.data)});
    w.setup = w.resident;
    return;
  }
  const double n = static_cast<double>(job.teacher_samples);
  w.resident.push_back({"data.teacher.samples", "dataset x, y", kFloat * n * (d_in + d_out)});
  w.setup = w.resident;
}

WorkloadMemory MlpMemory(const job::ResolvedJob& job, double local_batch,
                         const InputFileBytes& files) {
  const std::vector<int64_t>& d = std::get<job::MlpModel>(job.model_form).dims;
  double weights = 0;
  for (size_t i = 0; i + 1 < d.size(); ++i) {
    weights += static_cast<double>(d[i] + 1) * static_cast<double>(d[i + 1]);
  }
  const double max_d = static_cast<double>(*std::max_element(d.begin(), d.end()));
  WorkloadMemory w;
  AddDataset(job, files, static_cast<double>(d.front()), static_cast<double>(d.back()), w);
  if (job.data_safetensors.empty()) {
    const double n = static_cast<double>(job.teacher_samples);
    w.setup.push_back({"model.mlp.dims", "teacher weights", kFloat * weights});
    w.setup.push_back(
        {"data.teacher.samples", "teacher forward pass over every sample", kFloat * n * Sum(d)});
  }
  // Activations of every layer, and two back-propagated deltas.
  w.step.push_back({"training.global_batch_size", "activations of the local batch",
                    kFloat * local_batch * (Sum(d) + 2 * max_d)});
  return w;
}

WorkloadMemory MoeMemory(const job::ResolvedJob& job, double local_batch,
                         const InputFileBytes& files) {
  const model::MoeMlpDims& m = std::get<job::MoeMlpModel>(job.model_form).dims;
  const double d_in = static_cast<double>(m.d_in);
  const double d = static_cast<double>(m.d_model);
  const double de = static_cast<double>(m.d_expert);
  const double e = static_cast<double>(m.num_experts);
  const double d_out = static_cast<double>(m.d_out);
  const double weights = (d_in + 1) * d + d * e + 2 * e * de * d + (d + 1) * d_out;
  // Per sample: input, hidden, gates, expert input/output/activation, the
  // mixed output and the prediction, plus routing indices.
  const double per_sample = kFloat * (d_in + 6 * d + 2 * de + e + 2 * d_out) + 4 * kIndex;
  WorkloadMemory w;
  AddDataset(job, files, d_in, d_out, w);
  if (job.data_safetensors.empty()) {
    const double n = static_cast<double>(job.teacher_samples);
    w.setup.push_back({"model.moe_mlp", "teacher weights", kFloat * weights});
    w.setup.push_back({"data.teacher.samples", "teacher forward pass over every sample",
                       kFloat * n * (d_in + d_out) + n * per_sample});
  }
  w.step.push_back({"training.global_batch_size", "activations of the local batch (x2 with "
                                                  "the backward pass)",
                    2 * local_batch * per_sample});
  return w;
}


// ----------------------------------------------------------------------- mlp

absl::StatusOr<std::unique_ptr<Workload>> MakeMlp(const job::ResolvedJob& job) {
  const std::vector<int64_t>& dims = std::get<job::MlpModel>(job.model_form).dims;
  if (!job.data_safetensors.empty()) return MlpFromFile(dims, job.data_safetensors);
  MUONMESH_ASSIGN_OR_RETURN(
      Mlp mlp, Mlp::FromTeacher(dims, job.teacher_seed.value_or(0), job.teacher_samples));
  return std::unique_ptr<Workload>(new Mlp(std::move(mlp)));
}

// ----------------------------------------------------------------- synthetic

absl::StatusOr<std::unique_ptr<Workload>> MakeSynthetic(const job::ResolvedJob& job) {
  const job::SyntheticModel& m = std::get<job::SyntheticModel>(job.model_form);
  const int64_t ep = std::max<int64_t>(1, job.parallelism.expert_model_parallel_size);
  MUONMESH_ASSIGN_OR_RETURN(
      Synthetic s, m.inline_spec.has_value()
                       ? Synthetic::Create(convert::ModelFromProto(*m.inline_spec), m.scale, ep,
                                           job.init_seed.value_or(0))
                       : Synthetic::FromSpecFile(m.spec_path, m.scale, ep,
                                                 job.init_seed.value_or(0)));
  return std::unique_ptr<Workload>(new Synthetic(std::move(s)));
}

// The synthetic workload holds only its parameters' shards (the runtime's):
// its gradients are generated a unit at a time.
WorkloadMemory SyntheticMemory(const job::ResolvedJob& /*job*/, double /*local_batch*/,
                               const InputFileBytes& /*files*/) {
  return {};
}

// ----------------------------------------------------------------------- gpt

// The corpus's training and validation streams: `val` when given, else the
// last floor(M * val_fraction) of the M training tokens (none when that is
// 0). The files are memory-mapped, never read whole.
struct Corpus {
  std::shared_ptr<const TokenStream> train, val;
};

absl::StatusOr<std::shared_ptr<const TokenStream>> OpenCorpusPart(const job::Corpus& corpus,
                                                                  const std::string& field,
                                                                  const std::string& pattern) {
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::string> files, job::ExpandCorpus(field, pattern));
  return io::OpenTokenFiles(files, corpus.tokens ? io::TokenFormat::kShards : io::TokenFormat::kText);
}

// Every token is checked against the vocabulary first (job::CheckCorpus,
// one read of the files), so bad data fails before step 0, naming the file
// and the token, not at the step that first reads it.
absl::StatusOr<Corpus> OpenCorpus(const job::Corpus& corpus, int64_t vocab_size) {
  MUONMESH_RETURN_IF_ERROR(job::CheckCorpus(corpus, vocab_size, /*scan=*/true).status());
  const std::string field = corpus.tokens ? "data.tokens" : "data.text";
  Corpus out;
  MUONMESH_ASSIGN_OR_RETURN(out.train, OpenCorpusPart(corpus, field + ".train", corpus.train));
  if (!corpus.val.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(out.val, OpenCorpusPart(corpus, field + ".val", corpus.val));
    return out;
  }
  const int64_t total = out.train->num_tokens();
  const auto held = static_cast<int64_t>(std::floor(static_cast<double>(total) *
                                                    corpus.val_fraction));
  if (held <= 0) return out;
  if (held >= total) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".val_fraction: holds out all ",
                                                   total, " tokens"));
  }
  MUONMESH_ASSIGN_OR_RETURN(out.val, io::SliceTokens(out.train, total - held, total));
  MUONMESH_ASSIGN_OR_RETURN(out.train, io::SliceTokens(out.train, 0, total - held));
  return out;
}

absl::StatusOr<std::unique_ptr<Workload>> MakeGpt(const job::ResolvedJob& job) {
  MUONMESH_ASSIGN_OR_RETURN(Corpus corpus,
                            OpenCorpus(job.corpus, job.kind->vocab_size(job.model_form)));
  MUONMESH_ASSIGN_OR_RETURN(
      Gpt gpt, Gpt::Create(std::get<job::GptModel>(job.model_form).dims, corpus.train));
  MUONMESH_RETURN_IF_ERROR(gpt.SetValidation(corpus.val));
  return std::unique_ptr<Workload>(new Gpt(std::move(gpt)));
}


// The gpt keeps every block's activations for the backward pass
// (worker/model/gpt.h): L T (16 C + H T) floats a sample, plus the logits
// and their gradient (2 T V) and the head's and the backward pass's own
// rows (12 T C: the final LayerNorm, the residual gradient, the attention
// and MLP gradients). Validation runs a local batch at a time, so it needs
// no more. The corpus is memory-mapped: the page cache holds it, not the
// rank.
WorkloadMemory GptMemory(const job::ResolvedJob& job, double local_batch,
                         const InputFileBytes& /*files*/) {
  const model::GptDims& d = std::get<job::GptModel>(job.model_form).dims;
  const double t = static_cast<double>(d.seq_len);
  const double c = static_cast<double>(d.n_embd);
  const double per_sample =
      static_cast<double>(d.n_layer) * t * (16.0 * c + static_cast<double>(d.n_head) * t) +
      2.0 * t * static_cast<double>(d.vocab_size) + 12.0 * t * c;
  WorkloadMemory w;
  if (job.device == "cuda") {
    // The activations live on the GPU (worker/model/gpt_cuda.h); the host
    // keeps the windows read and the per-position losses copied back.
    w.step.push_back({"training.global_batch_size",
                      "the local batch's token windows and per-position losses",
                      local_batch * (4.0 * (t + 1.0) + 8.0 * t)});
    return w;
  }
  w.step.push_back({"training.global_batch_size",
                    "activations of the local batch kept for the backward pass",
                    kFloat * local_batch * per_sample});
  return w;
}


// Sampling from a gpt: a Gpt whose seq_len is the context's length, made
// again only when that length changes (it stays at block_size once the
// context fills it).
class GptNextToken final : public NextTokenModel {
 public:
  explicit GptNextToken(const model::GptDims& dims) : dims_(dims) {}

  int64_t vocab_size() const override { return dims_.vocab_size; }
  int64_t context_limit() const override { return dims_.block_size; }

  absl::StatusOr<std::vector<float>> NextTokenLogits(absl::Span<const float* const> params,
                                                     absl::Span<const int32_t> context) override {
    const auto seen = static_cast<int64_t>(context.size());
    if (seen < 1 || seen > dims_.block_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a context of ", seen, " tokens; the model sees 1 to ", dims_.block_size));
    }
    if (!gpt_.has_value() || gpt_->dims().seq_len != seen) {
      model::GptDims dims = dims_;
      dims.seq_len = seen;
      // The stream only satisfies Create (N > T); the context goes in below.
      auto unused = std::make_shared<const InMemoryTokens>(std::vector<int32_t>(seen + 1, 0));
      MUONMESH_ASSIGN_OR_RETURN(gpt_, Gpt::Create(dims, unused));
    }
    return gpt_->NextTokenLogits(params, context);
  }

 private:
  model::GptDims dims_;
  std::optional<Gpt> gpt_;
};

absl::StatusOr<std::unique_ptr<NextTokenModel>> MakeGptNextToken(const job::ModelForm& form) {
  const model::GptDims& dims = std::get<job::GptModel>(form).dims;
  MUONMESH_RETURN_IF_ERROR(model::ValidateGptDims(dims), "model.gpt");
  return std::unique_ptr<NextTokenModel>(new GptNextToken(dims));
}

// ---------------------------------------------------------------- transformer

absl::StatusOr<std::unique_ptr<Workload>> MakeTransformer(const job::ResolvedJob& job) {
  MUONMESH_ASSIGN_OR_RETURN(Corpus corpus,
                            OpenCorpus(job.corpus, job.kind->vocab_size(job.model_form)));
  MUONMESH_ASSIGN_OR_RETURN(
      Transformer t,
      Transformer::Create(std::get<job::TransformerModel>(job.model_form).dims, corpus.train),
      "model.transformer");
  MUONMESH_RETURN_IF_ERROR(t.SetValidation(corpus.val));
  return std::unique_ptr<Workload>(new Transformer(std::move(t)));
}

// The transformer's next token: a Transformer for the context's length
// (RoPE's positions 0..len-1, as the training windows have them), up to
// seq_len, carrying the loaded buffers.
class TransformerNextToken final : public NextTokenModel {
 public:
  explicit TransformerNextToken(const model::TransformerDims& dims) : dims_(dims) {}

  int64_t vocab_size() const override { return dims_.vocab_size; }
  int64_t context_limit() const override { return dims_.seq_len; }
  std::vector<BufferSpec> buffers() const override {
    absl::StatusOr<Transformer> probe = Model(1);
    return probe.ok() ? probe->buffers() : std::vector<BufferSpec>{};
  }
  // Checked against a model of this form, kept for each context length's.
  absl::Status SetBuffers(absl::Span<const std::vector<float>> values) override {
    MUONMESH_ASSIGN_OR_RETURN(Transformer probe, Model(1));
    MUONMESH_RETURN_IF_ERROR(probe.SetBuffers(values));
    buffers_.assign(values.begin(), values.end());
    model_.reset();
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<float>> NextTokenLogits(absl::Span<const float* const> params,
                                                     absl::Span<const int32_t> context) override {
    const auto seen = static_cast<int64_t>(context.size());
    if (seen < 1 || seen > dims_.seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("a context of ", seen, " tokens; the model sees 1 to ", dims_.seq_len));
    }
    if (!model_.has_value() || model_->dims().seq_len != seen) {
      MUONMESH_ASSIGN_OR_RETURN(Transformer t, Model(seen));
      model_.emplace(std::move(t));
      if (!buffers_.empty()) MUONMESH_RETURN_IF_ERROR(model_->SetBuffers(buffers_));
    }
    return model_->NextTokenLogits(params, context);
  }

 private:
  // A model for contexts of `seen` tokens (the stream only satisfies
  // Create: N > T; the context goes in through NextTokenLogits).
  absl::StatusOr<Transformer> Model(int64_t seen) const {
    model::TransformerDims dims = dims_;
    dims.seq_len = seen;
    auto unused = std::make_shared<const InMemoryTokens>(std::vector<int32_t>(seen + 1, 0));
    return Transformer::Create(dims, unused);
  }

  model::TransformerDims dims_;
  std::vector<std::vector<float>> buffers_;
  std::optional<Transformer> model_;
};

absl::StatusOr<std::unique_ptr<NextTokenModel>> MakeTransformerNextToken(
    const job::ModelForm& form) {
  const model::TransformerDims& dims = std::get<job::TransformerModel>(form).dims;
  if (std::optional<FieldViolation> v = model::TransformerDimsViolation(dims)) {
    return absl::InvalidArgumentError(absl::StrCat("model.transformer.", v->field, ": ",
                                                   v->description));
  }
  return std::unique_ptr<NextTokenModel>(new TransformerNextToken(dims));
}

// The transformer keeps every layer's activations for the backward pass
// (worker/model/transformer.h), per position: 4 C (the layer's input, both
// norms' outputs, the residual after attention) + 2 (the inverse roots);
// the attention's q, k, v and output (mha: 2 H D + 2 Hkv D; mla: 2 H (dn +
// dr) + 2 H dv, and the latents and q_lora's 2 rkv + 2 rq + 2) and H T
// probabilities; a dense MLP's 3 F; an MoE layer's scores E, choices and
// gates 2 K, 2 for the chosen sum, the K expert outputs K C, the shared
// block's 3 S Fe, and the expert side of the tokens it receives, K (C +
// 3 Fe) a position when routing spreads them evenly (a skewed step can
// send an EP group up to EP times that). Then the head's logits (T V) and
// the backward pass's rows, and the token exchanges' buffers and scratch
// (once for every MoE layer).
double TransformerFloatsPerSample(const model::TransformerDims& d) {
  const double t = static_cast<double>(d.seq_len);
  const double c = static_cast<double>(d.d_model);
  const double h = static_cast<double>(d.n_head);
  double attn = 2 * h * static_cast<double>(d.head_dim) +
                2 * static_cast<double>(d.n_kv_head * d.head_dim);
  if (d.attention == model::Attention::kMla) {
    const model::MlaDims& m = d.mla;
    attn = 2 * h * static_cast<double>(m.qk_nope_head_dim + m.qk_rope_head_dim) +
           2 * h * static_cast<double>(m.v_head_dim) +
           2 * static_cast<double>(m.kv_lora_rank + m.q_lora_rank) + 2;
  }
  const double dense = 3 * static_cast<double>(d.ffn_hidden);
  double moe = 0;
  double exchange = 0;
  if (d.moe.has_value()) {
    const model::MoeDims& m = *d.moe;
    const double k = static_cast<double>(m.top_k);
    const double fe = static_cast<double>(m.moe_ffn_hidden);
    moe = static_cast<double>(m.n_routed_experts) + 2 * k + 2 + k * c +
          3 * static_cast<double>(m.n_shared_experts) * fe + k * (c + 3 * fe);
    // The exchanges and the layers' shared scratch: tokens out and in,
    // outputs and gradients of the received tokens, the shared block's.
    exchange = t * (2 * k * (c + 1) + 2 * k * c + 2 * k * fe + 2 * k +
                    static_cast<double>(m.n_shared_experts) * fe);
  }
  double layers = 0;
  for (int64_t l = 0; l < d.n_layer; ++l) {
    layers += t * (4 * c + 2 + attn + (model::IsMoeLayer(d, l) ? moe : dense)) + h * t * t;
  }
  // MLA's scratch: kv_a_proj's and kv_b_proj's outputs and k_pe.
  const double mla_scratch =
      d.attention == model::Attention::kMla
          ? static_cast<double>(d.mla.kv_lora_rank + 2 * d.mla.qk_rope_head_dim) +
                h * static_cast<double>(d.mla.qk_nope_head_dim + d.mla.v_head_dim)
          : 0.0;
  return layers + exchange +
         t * (static_cast<double>(d.vocab_size) + 4 * c + attn + mla_scratch + 2 * dense / 3 + 1);
}

WorkloadMemory TransformerMemory(const job::ResolvedJob& job, double local_batch,
                                 const InputFileBytes& /*files*/) {
  const model::TransformerDims& d = std::get<job::TransformerModel>(job.model_form).dims;
  WorkloadMemory w;
  w.step.push_back({"training.global_batch_size",
                    "activations of the local batch kept for the backward pass (the routed "
                    "tokens' and the token exchanges' included)",
                    kFloat * local_batch * TransformerFloatsPerSample(d)});
  return w;
}

// The registrations, one per kind of proto/job/model_kind.h.
constexpr WorkerModelKind kKinds[] = {
    {v1::ModelConfig::kMlp, &MakeMlp, &MlpMemory, nullptr},
    {v1::ModelConfig::kMoeMlp, &MakeMoeMlp, &MoeMemory, nullptr},
    {v1::ModelConfig::kSynthetic, &MakeSynthetic, &SyntheticMemory, nullptr},
    {v1::ModelConfig::kGpt, &MakeGpt, &GptMemory, &MakeGptNextToken},
    {v1::ModelConfig::kTransformer, &MakeTransformer, &TransformerMemory,
     &MakeTransformerNextToken},
};

}  // namespace

absl::Span<const WorkerModelKind> WorkerModelKinds() { return kKinds; }

const WorkerModelKind* FindWorkerModelKind(v1::ModelConfig::KindCase proto_case) {
  for (const WorkerModelKind& kind : kKinds) {
    if (kind.proto_case == proto_case) return &kind;
  }
  return nullptr;
}

}  // namespace muonmesh::worker
