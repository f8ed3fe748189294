#include "worker/workload_factory.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "worker/io/safetensors.h"
#include "worker/model_kinds.h"
#ifndef MUONMESH_WORKER_WITH_CUDA
#define MUONMESH_WORKER_WITH_CUDA 0
#endif
#if MUONMESH_WORKER_WITH_CUDA
#include <cuda_runtime_api.h>

#include "worker/cuda/cuda_error.h"
#include "worker/model/gpu_forms.h"
#include "worker/runtime/cuda_device.h"
#endif

namespace muonmesh::worker {
absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const job::ResolvedJob& job) {
  const WorkerModelKind* kind = FindWorkerModelKind(job.model.kind_case());
  if (kind == nullptr) {
    return absl::InternalError(absl::StrCat("model.", job.kind == nullptr ? "?" : job.kind->name,
                                            ": no workload registered (worker/model_kinds.cc)"));
  }
  return kind->make_workload(job);
}

// The job's device: the CPU, or the GPU --cuda-device (else rank modulo the
// GPUs of this machine).
absl::StatusOr<std::unique_ptr<Device>> MakeDevice(const job::ResolvedJob& job, int32_t rank,
                                                   int cuda_device) {
  if (job.device == "cpu") return MakeCpuDevice();
#if MUONMESH_WORKER_WITH_CUDA
  int ordinal = cuda_device;
  if (ordinal < 0) {
    MUONMESH_ASSIGN_OR_RETURN(
        const int count, cuda::CudaDeviceCount(absl::StrCat("device 'cuda': rank ", rank)));
    // NCCL needs a GPU of its own for every rank of a group.
    if (job.world_size > count) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device 'cuda': the job has ", job.world_size, " ranks but this machine has ", count,
          " GPUs, and NCCL needs one GPU per rank; when the ranks run on several machines, "
          "give each its GPU with --cuda-device (or CUDA_VISIBLE_DEVICES)"));
    }
    ordinal = rank % count;
  }
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<Device> d, MakeCudaDevice(ordinal), "device 'cuda'");
  return d;
#else
  (void)rank;
  (void)cuda_device;
  return absl::UnimplementedError(
      "device 'cuda': this muonmesh-worker runs cpu jobs only; run cuda jobs with "
      "muonmesh-worker-cuda (built next to it when CUDA is found)");
#endif
}

// The workload's GPU form.
absl::StatusOr<std::unique_ptr<Workload>> OnGpu(const job::ResolvedJob& job,
                                                std::unique_ptr<Workload> workload) {
#if MUONMESH_WORKER_WITH_CUDA
  const GpuForm* form = job.kind == nullptr ? nullptr : FindGpuForm(job.kind->name);
  if (form == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "device 'cuda': model.", job.kind == nullptr ? "?" : job.kind->name,
        " has no GPU form (worker/model/gpu_forms.cc)"));
  }
  return form->to_gpu(std::move(workload));
#else
  (void)job;
  (void)workload;
  return absl::UnimplementedError("device 'cuda': this muonmesh-worker runs cpu jobs only");
#endif
}

absl::StatusOr<std::vector<std::vector<float>>> InitialFromFile(const plan::ModelSpec& spec,
                                                                const std::string& path) {
  MUONMESH_ASSIGN_OR_RETURN(std::vector<io::Tensor> tensors, io::ReadSafetensors(path));
  std::map<std::string, io::Tensor*> by_name;
  for (io::Tensor& t : tensors) by_name[t.name] = &t;
  std::vector<std::vector<float>> out;
  for (const plan::UnitSpec& u : spec.units) {
    for (const plan::ParamSpec& p : u.params) {
      auto it = by_name.find(p.name);
      if (it == by_name.end()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": no tensor '", p.name, "'"));
      }
      if (it->second->shape != p.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": tensor '", p.name, "' has shape [", absl::StrJoin(it->second->shape, ", "),
            "], the model needs [", absl::StrJoin(p.shape, ", "), "]"));
      }
      out.push_back(std::move(it->second->data));
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<float>>> BuffersFromFile(
    const std::vector<BufferSpec>& buffers, const std::string& path) {
  std::vector<std::vector<float>> out;
  if (buffers.empty()) return out;
  MUONMESH_ASSIGN_OR_RETURN(std::vector<io::Tensor> tensors, io::ReadSafetensors(path));
  for (const BufferSpec& b : buffers) {
    int64_t n = 1;
    for (int64_t d : b.shape) n *= d;
    out.emplace_back(static_cast<size_t>(n), 0.0f);
    for (io::Tensor& t : tensors) {
      if (t.name != b.name) continue;
      if (t.shape != b.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": buffer '", b.name, "' has shape [", absl::StrJoin(t.shape, ", "),
            "], the model needs [", absl::StrJoin(b.shape, ", "), "]"));
      }
      out.back() = std::move(t.data);
    }
  }
  return out;
}

}  // namespace muonmesh::worker
