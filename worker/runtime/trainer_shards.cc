// A rank's checkpoint shards: what it holds that a later step needs
// (parameters, optimizer state, step count), as one safetensors file.
#include "absl/strings/str_join.h"
#include "worker/runtime/trainer_impl.h"

namespace muonmesh::worker {
namespace {

std::string ShardTensorName(const UnitState& u, const char* what) {
  return absl::StrCat("units.", u.unit, ".",
                      u.mesh->kind == plan::MeshKind::kExpert ? "expert" : "dense", ".", what);
}

// "flat:whole_start:offset:count;..." (ParseShardRuns in worker/reshard.cc
// reads it back).
std::string RunsText(const std::vector<ShardRun>& runs) {
  std::string text;
  for (const ShardRun& r : runs) {
    absl::StrAppend(&text, text.empty() ? "" : ";", r.flat, ":", r.whole_start, ":", r.offset, ":",
                    r.count);
  }
  return text;
}
}  // namespace

std::vector<TensorOptimizer> Trainer::Impl::Optimizers() const {
  std::vector<TensorOptimizer> of(param_sizes.size(), TensorOptimizer::kNone);
  for (const UnitState& u : units) {
    for (size_t t = 0; t < u.flat.size(); ++t) {
      of[u.flat[t]] = u.muon[t] ? TensorOptimizer::kMuon : TensorOptimizer::kAdamW;
    }
  }
  return of;
}

std::string Trainer::Impl::TensorsText() const {
  const std::vector<TensorOptimizer> of = Optimizers();
  std::string text;
  size_t flat = 0;
  for (const plan::UnitSpec& u : workload->spec().units) {
    for (const plan::ParamSpec& p : u.params) {
      absl::StrAppend(&text, p.name, "\t", absl::StrJoin(p.shape, ","), "\t",
                      TensorOptimizerName(of[flat++]), "\n");
    }
  }
  return text;
}

absl::Status Trainer::SaveShards(const std::string& path) const {
  // The last step's after-step gathers write the shards saved here.
  StepReport drained;
  MUONMESH_RETURN_IF_ERROR(impl_->DrainGatherAfterStep(&drained));
  std::vector<io::TensorView> views;
  // Host copies of device shards (host shards are written as they are).
  std::vector<std::vector<float>> host;
  const bool on_host = impl_->dev->memory_space() == comm::MemorySpace::kHost;
  for (const UnitState& u : impl_->units) {
    for (const auto& [what, v] : {std::pair{"param", &u.param}, std::pair{"state1", &u.state1},
                                  std::pair{"state2", &u.state2}}) {
      const float* data = v->data();
      if (!on_host) {
        host.emplace_back(static_cast<size_t>(v->size()));
        absl::Status st = impl_->dev->CopyToHost(host.back().data(), v->data(), v->size());
        MUONMESH_RETURN_IF_ERROR(st);
        data = host.back().data();
      }
      views.push_back({ShardTensorName(u, what), {v->size()}, data});
    }
  }
  // The workload's buffers, the same on every rank: each rank keeps a copy.
  const std::vector<BufferSpec> buffer_specs = impl_->workload->buffers();
  const std::vector<std::vector<float>> buffer_values = impl_->workload->BufferValues();
  std::string buffer_names;
  for (size_t b = 0; b < buffer_specs.size() && b < buffer_values.size(); ++b) {
    views.push_back({kBufferTensorPrefix + buffer_specs[b].name, buffer_specs[b].shape,
                     buffer_values[b].data()});
    absl::StrAppend(&buffer_names, buffer_specs[b].name, "\n");
  }
  // What a resharding needs to put these shards back together without the
  // plan that laid them out: the model's tensors and each buffer's runs.
  std::map<std::string, std::string> metadata = {{"format", kShardsFormat},
                                                 {"rank", absl::StrCat(impl_->rank)},
                                                 {"world_size", absl::StrCat(impl_->world)},
                                                 {"step", absl::StrCat(step_)},
                                                 {"adamw_origin", absl::StrCat(adamw_origin_)},
                                                 {"layout", LayoutFingerprint()},
                                                 {"tensors", impl_->TensorsText()},
                                                 {"buffers", buffer_names}};
  for (const UnitState& u : impl_->units) {
    metadata[absl::StrCat("runs.", ShardTensorName(u, "param"))] = RunsText(ParamRuns(u));
    metadata[absl::StrCat("runs.", ShardTensorName(u, "state"))] = RunsText(StateRuns(u));
  }
  return io::WriteSafetensors(path, views, metadata);
}

absl::Status Trainer::LoadShards(const std::string& path) {
  // Nothing may still write the shards being replaced.
  StepReport drained;
  MUONMESH_RETURN_IF_ERROR(impl_->DrainGatherAfterStep(&drained));
  std::map<std::string, std::string> metadata;
  MUONMESH_ASSIGN_OR_RETURN(std::vector<io::Tensor> tensors, io::ReadSafetensors(path, &metadata));
  auto expect = [&](const std::string& key, const std::string& want) -> absl::Status {
    auto it = metadata.find(key);
    if (it == metadata.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not a muonmesh shard file (no metadata '", key, "')"));
    }
    if (it->second != want) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " is '", it->second,
                                                     "', this run needs '", want, "'"));
    }
    return absl::OkStatus();
  };
  for (const auto& [key, want] :
       {std::pair<std::string, std::string>{"format", kShardsFormat},
        {"world_size", absl::StrCat(impl_->world)},
        {"rank", absl::StrCat(impl_->rank)},
        {"layout", LayoutFingerprint()}}) {
    MUONMESH_RETURN_IF_ERROR(expect(key, want));
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(metadata["step"], &step) || step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata step '", metadata["step"], "' is not a step count"));
  }
  int64_t origin = 0;  // absent from files written before it was kept
  if (!metadata["adamw_origin"].empty() &&
      (!absl::SimpleAtoi(metadata["adamw_origin"], &origin) || origin < 0 || origin > step)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": metadata adamw_origin '", metadata["adamw_origin"], "' is not a step count"));
  }
  std::map<std::string, io::Tensor*> by_name;
  for (io::Tensor& t : tensors) by_name[t.name] = &t;
  // Check everything before changing anything.
  std::vector<std::pair<io::Tensor*, DeviceBuffer*>> copies;
  for (UnitState& u : impl_->units) {
    for (const auto& [what, v] : {std::pair{"param", &u.param}, std::pair{"state1", &u.state1},
                                  std::pair{"state2", &u.state2}}) {
      const std::string name = ShardTensorName(u, what);
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": no tensor '", name, "'"));
      }
      if (static_cast<int64_t>(it->second->data.size()) != v->size()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "' has ",
                                                       it->second->data.size(),
                                                       " elements, the shard has ", v->size()));
      }
      copies.push_back({it->second, v});
    }
  }
  std::vector<std::vector<float>> buffers;
  for (const BufferSpec& b : impl_->workload->buffers()) {
    auto it = by_name.find(kBufferTensorPrefix + b.name);
    if (it == by_name.end() || it->second->shape != b.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": no tensor '", kBufferTensorPrefix, b.name, "' of shape [",
          absl::StrJoin(b.shape, ","), "] (the model's buffer ", b.name, ")"));
    }
    buffers.push_back(it->second->data);
  }
  if (copies.size() + buffers.size() != tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", tensors.size(),
                                                   " tensors, this rank holds ",
                                                   copies.size() + buffers.size()));
  }
  MUONMESH_RETURN_IF_ERROR(impl_->workload->SetBuffers(buffers), path);
  for (auto& [from, to] : copies) {
    absl::Status st = impl_->dev->CopyFromHost(to->data(), from->data.data(), to->size());
    MUONMESH_RETURN_IF_ERROR(st);
  }
  step_ = step;
  adamw_origin_ = origin;
  return absl::OkStatus();
}

absl::Status Trainer::Impl::CheckWholeState(const WholeState& state, bool fresh_state) const {
  if (state.step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", state.step));
  if (state.adamw_origin < 0 || state.adamw_origin > state.step) {
    return absl::InvalidArgumentError(
        absl::StrCat("adamw_origin ", state.adamw_origin, " is not in [0, step ", state.step, "]"));
  }
  if (state.tensors.size() != param_sizes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("it has ", state.tensors.size(),
                                                   " tensors, the model ", workload->spec().name,
                                                   " has ", param_sizes.size()));
  }
  const std::vector<TensorOptimizer> mine = Optimizers();
  size_t flat = 0;
  for (const plan::UnitSpec& u : workload->spec().units) {
    for (const plan::ParamSpec& p : u.params) {
      const WholeTensor& t = state.tensors[flat];
      if (t.name != p.name || t.shape != p.shape) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "tensor %d is %s [%s], the model %s has %s [%s] (a checkpoint of another model?)", flat,
            t.name, absl::StrJoin(t.shape, ","), workload->spec().name, p.name,
            absl::StrJoin(p.shape, ",")));
      }
      const size_t n = static_cast<size_t>(param_sizes[flat]);
      if (t.param.size() != n) {
        return absl::InvalidArgumentError(
            absl::StrCat(t.name, ": ", t.param.size(), " parameter values, expected ", n));
      }
      const TensorOptimizer want = mine[flat++];
      if (want == TensorOptimizer::kNone || fresh_state) continue;
      const bool adamw = want == TensorOptimizer::kAdamW;
      if (t.optimizer != want || t.state1.size() != n || (adamw && t.state2.size() != n)) {
        return absl::InvalidArgumentError(absl::StrCat(
            t.name, ": this job steps it with ", TensorOptimizerName(want), " but ",
            t.optimizer == TensorOptimizer::kNone
                ? "no optimizer state was recorded for it"
                : absl::StrCat("the state is ", TensorOptimizerName(t.optimizer), "'s"),
            t.optimizer == want ? " (incomplete)" : "",
            "; init.fresh_optimizer_state: true starts every tensor's state afresh"));
      }
    }
  }
  return CheckBuffers(state).status();
}

absl::StatusOr<std::vector<std::vector<float>>> Trainer::Impl::CheckBuffers(
    const WholeState& state) const {
  const std::vector<BufferSpec> specs = workload->buffers();
  std::vector<std::vector<float>> values;
  for (const BufferSpec& b : specs) {
    int64_t n = 1;
    for (int64_t d : b.shape) n *= d;
    values.emplace_back(static_cast<size_t>(n), 0.0f);
  }
  for (const WholeBuffer& given : state.buffers) {
    size_t i = 0;
    while (i < specs.size() && specs[i].name != given.name) ++i;
    if (i == specs.size() || specs[i].shape != given.shape ||
        given.values.size() != values[i].size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer ", given.name, " [", absl::StrJoin(given.shape, ","), "] is not one of the model ",
          workload->spec().name, "'s (a checkpoint of another model?)"));
    }
    values[i] = given.values;
  }
  return values;
}

absl::Status Trainer::LoadState(const WholeState& state, bool fresh_optimizer_state) {
  Impl& m = *impl_;
  StepReport drained;  // nothing may still write the shards (LoadShards)
  MUONMESH_RETURN_IF_ERROR(m.DrainGatherAfterStep(&drained));
  MUONMESH_RETURN_IF_ERROR(m.CheckWholeState(state, fresh_optimizer_state));
  // Whole buffers built on the host (padding zero), then copied: a unit's
  // shard at a time.
  for (UnitState& u : m.units) {
    std::vector<float> param(static_cast<size_t>(u.param.size()), 0.0f);
    for (const ShardRun& r : ParamRuns(u)) {
      std::copy_n(state.tensors[r.flat].param.begin() + r.whole_start, r.count,
                  param.begin() + r.offset);
    }
    std::vector<float> s1(static_cast<size_t>(u.state1.size()), 0.0f);
    std::vector<float> s2(static_cast<size_t>(u.state2.size()), 0.0f);
    for (const ShardRun& r : fresh_optimizer_state ? std::vector<ShardRun>{} : StateRuns(u)) {
      const WholeTensor& t = state.tensors[r.flat];
      std::copy_n(t.state1.begin() + r.whole_start, r.count, s1.begin() + r.offset);
      if (!t.state2.empty()) {
        std::copy_n(t.state2.begin() + r.whole_start, r.count, s2.begin() + r.offset);
      }
    }
    for (auto [to, from] :
         {std::pair{&u.param, &param}, std::pair{&u.state1, &s1}, std::pair{&u.state2, &s2}}) {
      MUONMESH_RETURN_IF_ERROR(m.dev->CopyFromHost(to->data(), from->data(), to->size()));
    }
  }
  for (size_t u = 0; u < m.states_of.size(); ++u) {
    if (!m.states_of[u].empty()) continue;
    for (int32_t j = 0; j < m.unit_count[u]; ++j) {
      m.frozen[u][j] = state.tensors[m.unit_base[u] + j].param;
    }
  }
  MUONMESH_ASSIGN_OR_RETURN(std::vector<std::vector<float>> buffers, m.CheckBuffers(state));
  MUONMESH_RETURN_IF_ERROR(m.workload->SetBuffers(buffers));
  step_ = state.step;
  adamw_origin_ = fresh_optimizer_state ? state.step : state.adamw_origin;
  return absl::OkStatus();
}

int64_t Trainer::shard_bytes() const {
  int64_t floats = 0;
  for (const UnitState& u : impl_->units) {
    floats += static_cast<int64_t>(u.param.size() + u.grad.size() + u.state1.size() +
                                   u.state2.size());
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace muonmesh::worker
