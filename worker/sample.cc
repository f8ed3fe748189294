#include "worker/sample.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "proto/job/job.h"
#include "proto/job/model_specs.h"
#include "proto/job/model_kind.h"
#include "worker/model/next_token.h"
#include "worker/model/rng.h"
#include "worker/model_kinds.h"
#include "worker/workload_factory.h"

namespace muonmesh::worker {
namespace {

constexpr uint32_t kTokenizerMagic = 20240328;

struct Model {
  std::unique_ptr<NextTokenModel> next;
  bool bytes = false;  // trained on data.text: token j is byte j
  std::vector<std::vector<float>> params;
};

// The job's model as its kind samples it (a language model's registration,
// worker/model_kinds.h), with the weights of `weights_path`.
absl::StatusOr<Model> LoadModel(const SampleOptions& o) {
  MUONMESH_ASSIGN_OR_RETURN(v1::JobSpec job, job::LoadJobFile(o.job_path));
  const job::ModelKind* kind = job::FindModelKind(job.model().kind_case());
  const WorkerModelKind* worker = FindWorkerModelKind(job.model().kind_case());
  if (kind == nullptr || worker == nullptr || worker->make_next_token == nullptr) {
    std::vector<std::string> samplers;  // the kinds with a next-token form
    for (const job::ModelKind* k : job::ModelKinds()) {
      const WorkerModelKind* w = FindWorkerModelKind(k->proto_case);
      if (w != nullptr && w->make_next_token != nullptr) samplers.push_back(k->name);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        o.job_path, ": --sample needs a job whose model can be sampled (",
        absl::StrJoin(samplers, ", "), "); this one trains ",
        kind == nullptr ? "no model" : kind->name));
  }
  Model m;
  MUONMESH_ASSIGN_OR_RETURN(m.next, worker->make_next_token(kind->resolve(job.model(), "")),
                            o.job_path);
  m.bytes = job.data().has_text();
  MUONMESH_ASSIGN_OR_RETURN(plan::ModelSpec spec, job::ModelSpecOf(job.model(), 1, ""));
  MUONMESH_ASSIGN_OR_RETURN(m.params, InitialFromFile(spec, o.weights_path));
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::vector<float>> buffers,
                            BuffersFromFile(m.next->buffers(), o.weights_path));
  if (!buffers.empty()) MUONMESH_RETURN_IF_ERROR(m.next->SetBuffers(buffers), o.weights_path);
  return m;
}

absl::StatusOr<std::vector<int32_t>> Prompt(const SampleOptions& o, const Model& m) {
  std::vector<int32_t> out;
  if (!o.prompt.empty()) {
    if (!m.bytes) {
      return absl::InvalidArgumentError(
          "--prompt: the model's tokens are not bytes (it trained on data.tokens); give token "
          "ids with --prompt-ids");
    }
    for (unsigned char c : o.prompt) out.push_back(c);
  }
  for (int32_t id : o.prompt_ids) {
    if (id < 0 || id >= m.next->vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("--prompt-ids: ", id, " is outside [0, ",
                                                     m.next->vocab_size(), ")"));
    }
    out.push_back(id);
  }
  if (out.empty()) return absl::InvalidArgumentError("--prompt or --prompt-ids: required");
  return out;
}

absl::Status CheckOptions(const SampleOptions& o) {
  if (o.tokens < 1 || o.tokens > 1'000'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens: must be in [1, 1000000], got ", o.tokens));
  }
  if (!std::isfinite(o.temperature) || o.temperature < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--temperature: must be >= 0 (0: greedy), got ", o.temperature));
  }
  if (o.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--top-k: must be >= 0, got ", o.top_k));
  }
  return absl::OkStatus();
}

// The documented draw from `logits` for the `index`-th new token.
int32_t Draw(const std::vector<float>& logits, const SampleOptions& o, uint64_t index) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  if (o.temperature == 0) return order[0];
  const size_t k = o.top_k == 0 ? order.size()
                                : std::min(order.size(), static_cast<size_t>(o.top_k));
  const double top = logits[order[0]];
  std::vector<double> weight(k);
  double total = 0;
  for (size_t i = 0; i < k; ++i) {
    weight[i] = std::exp((static_cast<double>(logits[order[i]]) - top) / o.temperature);
    total += weight[i];
  }
  const double u = (static_cast<double>(UniformAt(o.seed, 0, index)) + 1.0) / 2.0;
  double cumulative = 0;
  for (size_t i = 0; i < k; ++i) {
    cumulative += weight[i] / total;
    if (cumulative > u) return order[i];
  }
  return order[k - 1];  // u within rounding of 1
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> SampleTokens(const SampleOptions& o, bool* bytes) {
  MUONMESH_RETURN_IF_ERROR(CheckOptions(o));
  MUONMESH_ASSIGN_OR_RETURN(Model m, LoadModel(o));
  if (bytes != nullptr) *bytes = m.bytes;
  MUONMESH_ASSIGN_OR_RETURN(std::vector<int32_t> context, Prompt(o, m));
  std::vector<const float*> params;
  for (const std::vector<float>& p : m.params) params.push_back(p.data());
  std::vector<int32_t> out;
  for (int64_t i = 0; i < o.tokens; ++i) {
    // Only the last context_limit tokens are seen.
    const size_t seen = std::min(context.size(), static_cast<size_t>(m.next->context_limit()));
    MUONMESH_ASSIGN_OR_RETURN(
        std::vector<float> logits,
        m.next->NextTokenLogits(params, absl::MakeConstSpan(context).subspan(context.size() - seen)));
    const int32_t next = Draw(logits, o, static_cast<uint64_t>(i));
    out.push_back(next);
    context.push_back(next);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> ReadTokenizer(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto u32 = [&](size_t at) {
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + at);
    return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
           static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
  };
  if (bytes.size() < 1024 || u32(0) != kTokenizerMagic || (u32(4) != 1 && u32(4) != 2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not an llm.c tokenizer file (a 1024-byte header with magic ", kTokenizerMagic,
        ", version 1 or 2)"));
  }
  const uint32_t count = u32(8);
  std::vector<std::string> vocab;
  size_t at = 1024;
  for (uint32_t i = 0; i < count; ++i) {
    if (at >= bytes.size() || at + 1 + static_cast<unsigned char>(bytes[at]) > bytes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ends inside token ", i, " of the ", count, " its header counts"));
    }
    const size_t len = static_cast<unsigned char>(bytes[at]);
    vocab.push_back(bytes.substr(at + 1, len));
    at += 1 + len;
  }
  return vocab;
}

absl::StatusOr<std::string> RenderTokens(const SampleOptions& o, const std::vector<int32_t>& tokens,
                                         bool bytes) {
  if (!o.tokenizer_path.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(std::vector<std::string> vocab, ReadTokenizer(o.tokenizer_path));
    std::string text;
    for (int32_t t : tokens) {
      if (t < 0 || static_cast<size_t>(t) >= vocab.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            o.tokenizer_path, ": has ", vocab.size(), " tokens; the model drew ", t));
      }
      text += vocab[t];
    }
    return text;
  }
  if (bytes) {
    std::string text;
    for (int32_t t : tokens) text.push_back(static_cast<char>(t));
    return text;
  }
  return absl::StrJoin(tokens, " ");
}

}  // namespace muonmesh::worker
