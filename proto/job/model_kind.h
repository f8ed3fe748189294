#pragma once

// Model kinds, registered once (docs/architecture.md, "Adding a model kind").
//
// A job's model section is one of several kinds (model: {gpt: {...}}). Each
// kind is described here once, by a ModelKind: the job-file side of it, which
// the coordinator, the workers and the clients share (its section's checks,
// its typed resolved form, its parameter list, the data it reads, the input
// file its section may name). The worker side (workloads on the CPU and the
// GPU, the memory estimate) is the kind's WorkerModelKind
// (worker/model/model_kinds.h), found by the same proto case.
//
// Adding a kind: its message in config.proto's ModelConfig, its spec builder
// in core/model/, its form in ModelForm below, and a file
// proto/job/kinds/<kind>.cc defining its ModelKind, listed once in
// ModelKinds() (proto/job/kinds/kinds.cc). Tests fail for a kind of the proto
// oneof that is not registered or registered without every part
// (tests/proto/job/model_kind_test.cc).
//
// Everything here is immutable after static initialisation: any thread may
// read it.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model/gpt_spec.h"
#include "core/model/moe_mlp_spec.h"
#include "core/model/transformer_spec.h"
#include "core/plan/types.h"
#include "muonmesh/v1/config.pb.h"

namespace muonmesh::job {

// The data section a kind trains on.
enum class DataUse {
  kExamples,  // (x, y) pairs: data.teacher (the default) or data.safetensors
  kCorpus,    // a token stream: data.text or data.tokens (required), with validation
  kNone,      // nothing: the workload generates its gradients (no data section)
};

// The resolved forms of the kinds' sections: defaults filled in, paths
// joined to the job file's folder.
struct MlpModel {
  std::vector<int64_t> dims;  // [d_in, hidden..., d_out]
};
struct MoeMlpModel {
  model::MoeMlpDims dims;
};
struct SyntheticModel {
  std::string spec_path;                   // the spec file, resolved ("" when inline)
  std::optional<v1::ModelSpec> inline_spec;  // model.synthetic.model: the path is not read
  double scale = 1.0;                      // in (0, 1]
};
struct GptModel {
  model::GptDims dims;
};
struct TransformerModel {
  model::TransformerDims dims;  // every default filled in
};
using ModelForm = std::variant<MlpModel, MoeMlpModel, SyntheticModel, GptModel, TransformerModel>;

// A model as a Hugging Face checkpoint: each spec parameter's name there
// (every parameter has one) and the config.json that goes beside it.
struct HfExport {
  std::map<std::string, std::string> names;  // spec name -> Hugging Face name
  std::string config_json;
};

// An input file a model section names itself (synthetic's spec), beyond
// init.* and data.*.
struct ModelFile {
  std::string field;         // "model.synthetic.spec"
  std::string path;          // as written in the section
  bool given_inline = false;  // the file's content is in the section: nothing is read
};

struct ModelKind {
  const char* name;  // the key under model: ("gpt")
  v1::ModelConfig::KindCase proto_case;
  DataUse data;
  // The job field its sizes come from, named by memory estimates
  // ("model.gpt", "model.mlp.dims").
  const char* size_field;

  // Adds the violations of the kind's own section (model.<name>.*), with the
  // job around it for what they depend on (EP, the data section).
  void (*validate)(const v1::JobSpec& job, plan::Violations& v);
  // The section's resolved form; relative paths joined to `job_dir` (left
  // as they are when it is empty). The job is valid.
  ModelForm (*resolve)(const v1::ModelConfig& model, const std::string& job_dir);
  // The parameter list (before the optimizer rules), expert stacks split
  // `ep` ways (>= 1). InvalidArgument naming the field or file otherwise.
  absl::StatusOr<plan::ModelSpec> (*spec)(const ModelForm& form, int64_t ep);
  // The input file the section names, if any (nullptr, the default: the
  // kind never names one).
  std::optional<ModelFile> (*model_file)(const v1::ModelConfig& model) = nullptr;
  // Reads the section's file (at `path`, absolute) into the section, so a
  // job submitted to a coordinator carries it (nullptr with model_file).
  absl::Status (*embed_model_file)(v1::ModelConfig* model, const std::string& path) = nullptr;
  // Muon's attention options (optimizer.muon.split_qkv, per_head): sets
  // ParamSpec::muon_block_rows on the spec's attention projections, so the
  // planner sees q, k and v (or each head) as the matrices they are
  // (nullptr, the default: the kind has no attention, and a job asking for
  // them is refused).
  void (*attention_blocks)(const ModelForm& form, bool split_qkv, bool per_head,
                           plan::ModelSpec* spec) = nullptr;
  // DataUse::kCorpus kinds: the vocabulary size, every token of the corpus
  // must be below it (the data pre-flight, corpus.h's CheckCorpusFiles).
  int64_t (*vocab_size)(const ModelForm& form) = nullptr;
  // output.export_format: hf: what a Hugging Face model of this form
  // needs, or why it has none (a sentence for the violation); nullptr: the
  // kind has no Hugging Face form.
  absl::StatusOr<HfExport> (*hf_export)(const ModelForm& form) = nullptr;
};

// Every registered kind, in the oneof's order.
absl::Span<const ModelKind* const> ModelKinds();

// The kind of a model section; nullptr when none is set (or unregistered).
const ModelKind* FindModelKind(v1::ModelConfig::KindCase proto_case);

// The input file `model` names through its kind's model_file (the path as
// written); nullopt when the kind names none or this section gives none.
std::optional<ModelFile> ModelFileOf(const v1::ModelConfig& model);

// The names of the kinds that train on `data`, as a sentence part:
// "gpt", "gpt and transformer", "mlp, moe_mlp and synthetic".
std::string KindNamesUsing(DataUse data);

// The names of every kind: "mlp, moe_mlp, synthetic or gpt".
std::string AllKindNames();

// Joins a path of the job file to its folder (relative paths only; `path`
// unchanged when `job_dir` or `path` is empty).
std::string ResolveJobPath(const std::string& job_dir, const std::string& path);

}  // namespace muonmesh::job
