// A rank's checkpoint shards: what it holds that a later step needs
// (parameters, optimizer state, step count), as one safetensors file.
#include "worker/runtime/trainer_impl.h"

namespace muonmesh::worker {
namespace {
constexpr char kShardsFormat[] = "muonmesh.shards.v1";

std::string ShardTensorName(const UnitState& u, const char* what) {
  return absl::StrCat("units.", u.unit, ".",
                      u.mesh->kind == plan::MeshKind::kExpert ? "expert" : "dense", ".", what);
}
}  // namespace

absl::Status Trainer::SaveShards(const std::string& path) const {
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
  const std::map<std::string, std::string> metadata = {
      {"format", kShardsFormat},
      {"rank", absl::StrCat(impl_->rank)},
      {"world_size", absl::StrCat(impl_->world)},
      {"step", absl::StrCat(step_)},
      {"layout", LayoutFingerprint()}};
  return io::WriteSafetensors(path, views, metadata);
}

absl::Status Trainer::LoadShards(const std::string& path) {
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
  if (copies.size() != tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", tensors.size(), " tensors, this rank holds ", copies.size()));
  }
  for (auto& [from, to] : copies) {
    absl::Status st = impl_->dev->CopyFromHost(to->data(), from->data.data(), to->size());
    MUONMESH_RETURN_IF_ERROR(st);
  }
  step_ = step;
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
