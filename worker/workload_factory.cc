#include "worker/workload_factory.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/convert/plan_convert.h"
#include "core/base/status_macros.h"
#include "proto/job/corpus.h"
#include "worker/io/safetensors.h"
#include "worker/io/token_files.h"
#include "worker/model/gpt.h"
#include "worker/model/mlp.h"
#include "worker/model/moe_mlp.h"
#include "worker/model/synthetic.h"
#ifndef MUONMESH_WORKER_WITH_CUDA
#define MUONMESH_WORKER_WITH_CUDA 0
#endif
#if MUONMESH_WORKER_WITH_CUDA
#include <cuda_runtime_api.h>

#include "worker/cuda/cuda_error.h"
#include "worker/model/gpt_cuda.h"
#include "worker/model/mlp_cuda.h"
#include "worker/model/moe_mlp_cuda.h"
#include "worker/model/synthetic_cuda.h"
#include "worker/runtime/cuda_device.h"
#endif

namespace muonmesh::worker {
namespace {

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
  const MoeMlpDims dims{job.moe.d_in(), job.moe.d_model(), job.moe.d_expert(),
                        job.moe.num_experts(), job.moe.d_out()};
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
  return OpenTokenFiles(files, corpus.tokens ? TokenFormat::kShards : TokenFormat::kText);
}

absl::StatusOr<Corpus> OpenCorpus(const job::Corpus& corpus) {
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
  MUONMESH_ASSIGN_OR_RETURN(out.val, SliceTokens(out.train, total - held, total));
  MUONMESH_ASSIGN_OR_RETURN(out.train, SliceTokens(out.train, 0, total - held));
  return out;
}

absl::StatusOr<std::unique_ptr<Workload>> MakeGpt(const job::ResolvedJob& job) {
  MUONMESH_ASSIGN_OR_RETURN(Corpus corpus, OpenCorpus(job.corpus));
  MUONMESH_ASSIGN_OR_RETURN(Gpt gpt, Gpt::Create(job.gpt, corpus.train));
  MUONMESH_RETURN_IF_ERROR(gpt.SetValidation(corpus.val));
  return std::unique_ptr<Workload>(new Gpt(std::move(gpt)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const job::ResolvedJob& job) {
  switch (job.model_kind) {
    case job::ResolvedJob::ModelKind::kMlp: {
      if (!job.data_safetensors.empty()) return MlpFromFile(job.mlp_dims, job.data_safetensors);
      MUONMESH_ASSIGN_OR_RETURN(
          Mlp mlp,
          Mlp::FromTeacher(job.mlp_dims, job.teacher_seed.value_or(0), job.teacher_samples));
      return std::unique_ptr<Workload>(new Mlp(std::move(mlp)));
    }
    case job::ResolvedJob::ModelKind::kSynthetic: {
      const int64_t ep = std::max<int64_t>(1, job.parallelism.expert_model_parallel_size);
      MUONMESH_ASSIGN_OR_RETURN(
          Synthetic s, job.synthetic_model.has_value()
                           ? Synthetic::Create(ModelFromProto(*job.synthetic_model),
                                               job.synthetic_scale, ep, job.init_seed.value_or(0))
                           : Synthetic::FromSpecFile(job.synthetic_spec_path, job.synthetic_scale,
                                                     ep, job.init_seed.value_or(0)));
      return std::unique_ptr<Workload>(new Synthetic(std::move(s)));
    }
    case job::ResolvedJob::ModelKind::kMoeMlp:
      return MakeMoeMlp(job);
    case job::ResolvedJob::ModelKind::kGpt:
      return MakeGpt(job);
  }
  return absl::InternalError("unknown model kind");
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
  if (job.model_kind == job::ResolvedJob::ModelKind::kGpt) {
    auto* g = static_cast<Gpt*>(workload.get());
    MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<CudaGpt> gpu, CudaGpt::Create(std::move(*g)));
    return std::unique_ptr<Workload>(std::move(gpu));
  }
  if (job.model_kind == job::ResolvedJob::ModelKind::kSynthetic) {
    auto* s = static_cast<Synthetic*>(workload.get());
    MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<CudaSynthetic> gpu,
                              CudaSynthetic::Create(std::move(*s)));
    return std::unique_ptr<Workload>(std::move(gpu));
  }
  if (job.model_kind == job::ResolvedJob::ModelKind::kMlp) {
    auto* m = static_cast<Mlp*>(workload.get());
    MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<CudaMlp> gpu, CudaMlp::Create(std::move(*m)));
    return std::unique_ptr<Workload>(std::move(gpu));
  }
  auto* moe = static_cast<MoeMlp*>(workload.get());
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<CudaMoeMlp> gpu, CudaMoeMlp::Create(std::move(*moe)));
  return std::unique_ptr<Workload>(std::move(gpu));
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

}  // namespace muonmesh::worker
