// The list of model kinds: the one line a new kind adds here.

#include "proto/job/kinds/kinds.h"

#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/job/job.h"

namespace muonmesh::job {
namespace {

constexpr const ModelKind* kRegistered[] = {&kinds::kMlp, &kinds::kMoeMlp, &kinds::kSynthetic,
                                            &kinds::kGpt, &kinds::kTransformer};

// "a", "a or b", "a, b or c" (with `last` as the final joint).
std::string Sentence(const std::vector<const char*>& names, const char* last) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, i + 1 == names.size() ? last : ", ");
    absl::StrAppend(&out, names[i]);
  }
  return out;
}

}  // namespace

absl::Span<const ModelKind* const> ModelKinds() { return kRegistered; }

const ModelKind* FindModelKind(v1::ModelConfig::KindCase proto_case) {
  for (const ModelKind* kind : kRegistered) {
    if (kind->proto_case == proto_case) return kind;
  }
  return nullptr;
}

std::optional<ModelFile> ModelFileOf(const v1::ModelConfig& model) {
  const ModelKind* kind = FindModelKind(model.kind_case());
  if (kind == nullptr || kind->model_file == nullptr) return std::nullopt;
  return kind->model_file(model);
}

std::string KindNamesUsing(DataUse data) {
  std::vector<const char*> names;
  for (const ModelKind* kind : kRegistered) {
    if (kind->data == data) names.push_back(kind->name);
  }
  return Sentence(names, " and ");
}

std::string AllKindNames() {
  std::vector<const char*> names;
  for (const ModelKind* kind : kRegistered) names.push_back(kind->name);
  return Sentence(names, " or ");
}

std::string ResolveJobPath(const std::string& job_dir, const std::string& path) {
  if (job_dir.empty() || path.empty()) return path;
  const std::filesystem::path p(path);
  if (p.is_absolute()) return path;
  return (std::filesystem::path(job_dir) / p).lexically_normal().string();
}

namespace kinds {

void CheckDim(const std::string& field, int64_t value, bool list_entry, plan::Violations& v) {
  if (value < 1) {
    v.Add(field, value == 0 && !list_entry ? std::string("required: must be >= 1")
                                           : absl::StrCat("must be >= 1, got ", value));
  } else if (value > kMaxModelDim) {
    v.Add(field, absl::StrCat(value, " exceeds the limit of ", kMaxModelDim));
  }
}

int64_t ExpertParallelSize(const v1::JobSpec& job) {
  const int64_t ep = job.parallelism().expert_model_parallel_size();
  return ep == 0 ? 1 : ep;
}

}  // namespace kinds
}  // namespace muonmesh::job
