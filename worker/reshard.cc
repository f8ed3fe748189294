#include "worker/reshard.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/base/status_macros.h"
#include "worker/checkpoints.h"
#include "worker/io/safetensors.h"
#include "worker/runtime/trainer.h"

namespace muonmesh::worker {
namespace {

constexpr char kStateFormat[] = "muonmesh.state.v1";

// "name\tshape\toptimizer" lines (Trainer::SaveShards' "tensors"), as
// tensors without data.
absl::StatusOr<std::vector<WholeTensor>> ParseTensors(const std::string& text) {
  std::vector<WholeTensor> tensors;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, '\t');
    WholeTensor t;
    bool ok = f.size() == 3 && !f[0].empty() && ParseTensorOptimizer(f[2], &t.optimizer);
    for (absl::string_view d : absl::StrSplit(ok ? f[1] : "", ',', absl::SkipEmpty())) {
      int64_t dim = 0;
      ok = ok && absl::SimpleAtoi(d, &dim) && dim >= 0;
      t.shape.push_back(dim);
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata 'tensors': a bad line '", line.substr(0, 80), "'"));
    }
    t.name = f[0];
    tensors.push_back(std::move(t));
  }
  return tensors;
}

// A shape's element count, or -1 past kMaxElements (shapes come from files).
constexpr int64_t kMaxElements = int64_t{1} << 40;
int64_t ElementsOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > kMaxElements / d)) return -1;
    n *= d;
  }
  return n;
}

struct Run {
  int64_t flat, whole_start, offset, count;
};

// "flat:whole_start:offset:count;..." against the tensors and the buffer of
// `buffer_size` elements it describes.
absl::StatusOr<std::vector<Run>> ParseRuns(const std::string& text,
                                           const std::vector<WholeTensor>& tensors,
                                           int64_t buffer_size) {
  std::vector<Run> runs;
  for (absl::string_view item : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(item, ':');
    Run r{};
    const bool parsed = f.size() == 4 && absl::SimpleAtoi(f[0], &r.flat) &&
                        absl::SimpleAtoi(f[1], &r.whole_start) &&
                        absl::SimpleAtoi(f[2], &r.offset) && absl::SimpleAtoi(f[3], &r.count);
    // (Written without sums that could overflow: the numbers come from a file.)
    const bool fits = parsed && r.flat >= 0 && r.flat < static_cast<int64_t>(tensors.size()) &&
                      r.whole_start >= 0 && r.offset >= 0 && r.count >= 0 &&
                      r.whole_start <= ElementsOf(tensors[r.flat].shape) &&
                      r.count <= ElementsOf(tensors[r.flat].shape) - r.whole_start &&
                      r.offset <= buffer_size && r.count <= buffer_size - r.offset;
    if (!fits) return absl::InvalidArgumentError(absl::StrCat("a bad run '", item, "'"));
    runs.push_back(r);
  }
  return runs;
}

// The whole state being put together, which elements of each buffer have
// been seen, and the most elements the checkpoint's files can hold.
struct Assembly {
  WholeState state;
  std::vector<std::vector<bool>> seen_param, seen_state1, seen_state2;
  int64_t max_elements = 0;
};

absl::Status Place(const std::vector<Run>& runs, const io::Tensor& from, bool param, int state_slot,
                   Assembly& a) {
  for (const Run& r : runs) {
    WholeTensor& t = a.state.tensors[r.flat];
    std::vector<float>& to = param ? t.param : (state_slot == 1 ? t.state1 : t.state2);
    if (to.empty()) to.assign(static_cast<size_t>(ElementsOf(t.shape)), 0.0f);
    std::copy_n(from.data.begin() + r.offset, r.count, to.begin() + r.whole_start);
    std::vector<bool>& seen = param             ? a.seen_param[r.flat]
                              : state_slot == 1 ? a.seen_state1[r.flat]
                                                : a.seen_state2[r.flat];
    std::fill_n(seen.begin() + r.whole_start, r.count, true);
  }
  return absl::OkStatus();
}

// A buffer's copy ("buffer/NAME"): rank 0's is kept, the others must equal
// it (every rank holds the same values).
absl::Status AddBuffer(const io::Tensor& t, int64_t rank, Assembly& a) {
  const std::string name = t.name.substr(std::string(kBufferTensorPrefix).size());
  auto it = std::find_if(a.state.buffers.begin(), a.state.buffers.end(),
                         [&](const WholeBuffer& b) { return b.name == name; });
  if (rank == 0 && it == a.state.buffers.end()) {
    a.state.buffers.push_back({name, t.shape, t.data});
    return absl::OkStatus();
  }
  if (it == a.state.buffers.end() || it->shape != t.shape || it->values != t.data) {
    return absl::DataLossError(
        absl::StrCat("buffer ", name, " differs from rank 0's copy (or rank 0 has none)"));
  }
  return absl::OkStatus();
}

// One rank's file into the assembly (its tensors list must be the one
// already there; `rank` and `step` what the manifest says).
absl::Status AddRankFile(const std::string& path, int64_t rank, const CheckpointManifest& m,
                         Assembly& a) {
  std::map<std::string, std::string> meta;
  MUONMESH_ASSIGN_OR_RETURN(std::vector<io::Tensor> tensors, io::ReadSafetensors(path, &meta));
  if (meta["format"] != kShardsFormat) {
    return absl::InvalidArgumentError("not a muonmesh shard file");
  }
  if (meta.find("tensors") == meta.end()) {
    return absl::FailedPreconditionError(
        "written before shard files recorded their runs: it resumes only under the layout that "
        "wrote it");
  }
  for (const auto& [key, want] : {std::pair<std::string, int64_t>{"rank", rank},
                                  {"world_size", m.world_size},
                                  {"step", m.step}}) {
    if (meta[key] != absl::StrCat(want)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata ", key, " is '", meta[key], "', the manifest says ", want));
    }
  }
  MUONMESH_ASSIGN_OR_RETURN(std::vector<WholeTensor> listed, ParseTensors(meta["tensors"]));
  if (a.state.tensors.empty()) {
    // Every element is in some rank's file: a model larger than the files
    // is a damaged list, refused before anything is allocated for it.
    int64_t total = 0;
    for (const WholeTensor& t : listed) {
      const int64_t n = ElementsOf(t.shape);
      if (n < 0 || n > a.max_elements - total) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata 'tensors': more elements than the checkpoint's files hold (at ",
                         t.name, ")"));
      }
      total += n;
    }
    a.state.tensors = std::move(listed);
    a.state.step = m.step;
    int64_t origin = 0;
    if (!meta["adamw_origin"].empty() && !absl::SimpleAtoi(meta["adamw_origin"], &origin)) {
      return absl::InvalidArgumentError("metadata adamw_origin is not a step count");
    }
    a.state.adamw_origin = origin;
    for (const WholeTensor& t : a.state.tensors) {
      for (auto* seen : {&a.seen_param, &a.seen_state1, &a.seen_state2}) {
        seen->emplace_back(static_cast<size_t>(ElementsOf(t.shape)), false);
      }
    }
  } else {
    bool same = listed.size() == a.state.tensors.size();
    for (size_t i = 0; same && i < listed.size(); ++i) {
      same = listed[i].name == a.state.tensors[i].name &&
             listed[i].shape == a.state.tensors[i].shape &&
             listed[i].optimizer == a.state.tensors[i].optimizer;
    }
    if (!same) return absl::InvalidArgumentError("its tensors differ from rank 0's");
  }
  for (const io::Tensor& t : tensors) {
    if (absl::StartsWith(t.name, kBufferTensorPrefix)) {
      MUONMESH_RETURN_IF_ERROR(AddBuffer(t, rank, a));
      continue;
    }
    // "units.{u}.{dense|expert}.{param|state1|state2}"
    const size_t dot = t.name.rfind('.');
    const std::string what = dot == std::string::npos ? "" : t.name.substr(dot + 1);
    const bool param = what == "param";
    const int slot = what == "state1" ? 1 : what == "state2" ? 2 : 0;
    if (!param && slot == 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected tensor '", t.name, "'"));
    }
    const std::string key =
        absl::StrCat("runs.", t.name.substr(0, dot), param ? ".param" : ".state");
    auto it = meta.find(key);
    if (it == meta.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no metadata '", key, "'"));
    }
    absl::StatusOr<std::vector<Run>> runs =
        ParseRuns(it->second, a.state.tensors, static_cast<int64_t>(t.data.size()));
    MUONMESH_RETURN_IF_ERROR(runs.status(), "metadata '", key, "'");
    MUONMESH_RETURN_IF_ERROR(Place(*runs, t, param, slot, a));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<WholeState> ConsolidateCheckpoint(const std::string& step_dir) {
  absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(step_dir);
  MUONMESH_RETURN_IF_ERROR(m.status(), step_dir);
  Assembly a;
  for (const std::string& file : m->files) {
    std::error_code ec;
    const uintmax_t bytes = std::filesystem::file_size(absl::StrCat(step_dir, "/", file), ec);
    if (!ec) a.max_elements += static_cast<int64_t>(bytes / sizeof(float));
  }
  for (int64_t r = 0; r < m->world_size; ++r) {
    const std::string path = absl::StrCat(step_dir, "/", m->files[r]);
    MUONMESH_RETURN_IF_ERROR(AddRankFile(path, r, *m, a), path);
  }
  // Every element of every parameter, and of every stepped tensor's state.
  for (size_t i = 0; i < a.state.tensors.size(); ++i) {
    WholeTensor& t = a.state.tensors[i];
    const bool stepped = t.optimizer != TensorOptimizer::kNone;
    const bool adamw = t.optimizer == TensorOptimizer::kAdamW;
    for (const auto& [seen, what, needed] :
         {std::tuple{&a.seen_param[i], "parameter", true},
          std::tuple{&a.seen_state1[i], adamw ? "exp_avg" : "momentum", stepped},
          std::tuple{&a.seen_state2[i], "exp_avg_sq", adamw}}) {
      if (!needed) continue;
      const auto missing = std::find(seen->begin(), seen->end(), false);
      if (missing != seen->end()) {
        return absl::DataLossError(absl::StrCat(step_dir, ": ", t.name, ": ", what, " element ",
                                                missing - seen->begin(), " is in no rank's file"));
      }
    }
    // Muon keeps one buffer; what its state2 shards held is not state.
    if (t.optimizer != TensorOptimizer::kAdamW) t.state2.clear();
    if (!stepped) t.state1.clear();
    if (t.param.empty()) t.param.assign(static_cast<size_t>(ElementsOf(t.shape)), 0.0f);
  }
  return std::move(a.state);
}

absl::Status WriteConsolidated(const WholeState& state, const std::string& path) {
  std::vector<io::TensorView> views;
  std::string listed;
  for (const WholeTensor& t : state.tensors) {
    views.push_back({t.name, t.shape, t.param.data()});
    absl::StrAppend(&listed, t.name, "\t", absl::StrJoin(t.shape, ","), "\t",
                    TensorOptimizerName(t.optimizer), "\n");
  }
  for (const WholeTensor& t : state.tensors) {
    const bool muon = t.optimizer == TensorOptimizer::kMuon;
    if (!t.state1.empty()) {
      views.push_back({absl::StrCat("optimizer/", t.name, muon ? "/momentum" : "/exp_avg"), t.shape,
                       t.state1.data()});
    }
    if (!t.state2.empty()) {
      views.push_back(
          {absl::StrCat("optimizer/", t.name, "/exp_avg_sq"), t.shape, t.state2.data()});
    }
  }
  std::string buffers;
  for (const WholeBuffer& b : state.buffers) {
    views.push_back({b.name, b.shape, b.values.data()});
    absl::StrAppend(&buffers, b.name, "\n");
  }
  return io::WriteSafetensors(path, views,
                              {{"format", kStateFormat},
                               {"step", absl::StrCat(state.step)},
                               {"adamw_origin", absl::StrCat(state.adamw_origin)},
                               {"tensors", listed},
                               {"buffers", buffers}});
}

absl::StatusOr<WholeState> ReadConsolidated(const std::string& path) {
  std::map<std::string, std::string> meta;
  MUONMESH_ASSIGN_OR_RETURN(std::vector<io::Tensor> tensors, io::ReadSafetensors(path, &meta));
  WholeState state;
  // The tensors metadata "buffers" names are the model's buffers.
  std::set<std::string> buffer_names;
  for (absl::string_view name : absl::StrSplit(meta["buffers"], '\n', absl::SkipEmpty())) {
    buffer_names.insert(std::string(name));
  }
  for (io::Tensor& t : tensors) {
    if (buffer_names.count(t.name) > 0) state.buffers.push_back({t.name, t.shape, t.data});
  }
  if (meta["format"] != kStateFormat) {
    // Parameters (and buffers) only: an export or an init.safetensors file.
    for (io::Tensor& t : tensors) {
      if (buffer_names.count(t.name) > 0) continue;
      state.tensors.push_back({t.name, t.shape, TensorOptimizer::kNone, std::move(t.data), {}, {}});
    }
    return state;
  }
  absl::StatusOr<std::vector<WholeTensor>> listed = ParseTensors(meta["tensors"]);
  MUONMESH_RETURN_IF_ERROR(listed.status(), path);
  if (!absl::SimpleAtoi(meta["step"], &state.step) || state.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata step '", meta["step"], "' is not a step count"));
  }
  if (!meta["adamw_origin"].empty() &&
      (!absl::SimpleAtoi(meta["adamw_origin"], &state.adamw_origin) || state.adamw_origin < 0 ||
       state.adamw_origin > state.step)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": metadata adamw_origin '",
                                                   meta["adamw_origin"], "' is not a step count"));
  }
  std::map<std::string, io::Tensor*> by_name;
  for (io::Tensor& t : tensors) by_name[t.name] = &t;
  auto take = [&](const std::string& name, const WholeTensor& t, bool required,
                  std::vector<float>& to) -> absl::Status {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      if (!required) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(path, ": no tensor '", name, "'"));
    }
    if (it->second->shape != t.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", name, "' has shape [", absl::StrJoin(it->second->shape, ","),
          "], the list says [", absl::StrJoin(t.shape, ","), "]"));
    }
    to = std::move(it->second->data);
    return absl::OkStatus();
  };
  // Optimizer state that is missing leaves the tensor's buffers empty:
  // Trainer::LoadState refuses it unless the job asks for fresh state.
  for (WholeTensor& t : *listed) {
    const std::string base = absl::StrCat("optimizer/", t.name, "/");
    const bool muon = t.optimizer == TensorOptimizer::kMuon;
    MUONMESH_RETURN_IF_ERROR(take(t.name, t, true, t.param));
    if (t.optimizer == TensorOptimizer::kNone) continue;
    MUONMESH_RETURN_IF_ERROR(take(base + (muon ? "momentum" : "exp_avg"), t, false, t.state1));
    if (!muon) MUONMESH_RETURN_IF_ERROR(take(base + "exp_avg_sq", t, false, t.state2));
  }
  state.tensors = *std::move(listed);
  return state;
}

absl::StatusOr<WholeState> LoadWholeState(const std::string& source, std::string* from,
                                          std::vector<std::string>* notes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(source, ec)) {
    *from = source;
    return ReadConsolidated(source);
  }
  if (!fs::is_directory(source, ec)) {
    return absl::NotFoundError(absl::StrCat(source, ": no such file or folder"));
  }
  if (fs::exists(fs::path(source) / "COMPLETE", ec)) {
    *from = source;
    return ConsolidateCheckpoint(source);
  }
  const std::string folder =
      fs::is_directory(fs::path(source) / "checkpoints", ec) ? source + "/checkpoints" : source;
  const CheckpointChoice choice = NewestValidCheckpointIn(folder, kAnyWorldSize);
  for (const std::string& why : choice.skipped) notes->push_back(absl::StrCat("skipping ", why));
  if (!choice.step.has_value()) {
    return absl::NotFoundError(
        absl::StrCat(folder,
                     ": no complete checkpoint (a step-N folder with its COMPLETE "
                     "manifest)"));
  }
  *from = choice.dir;
  return ConsolidateCheckpoint(choice.dir);
}

}  // namespace muonmesh::worker
