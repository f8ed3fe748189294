#pragma once

// The worker side of each model kind (docs/architecture.md, "Adding a model
// kind"): its host workload, made from the resolved job with its data, and
// the host memory that workload holds, which the rank's estimate
// (worker/job/memory_estimate.h) counts before anything is allocated, and,
// for a language model, what sampling draws from. Found
// by the proto case of the job's model section, as the job-file side
// (proto/job/model_kind.h) is. The GPU forms are registered beside the CUDA
// workloads (worker/model/gpu_forms.h), in the build that has them.
//
// A test fails when a kind of the job file has no registration here
// (tests/worker/model_kinds_test.cc).
//
// Immutable tables: any thread may read them.

#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/job/job.h"
#include "worker/job/workload_memory.h"
#include "worker/model/next_token.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

struct WorkerModelKind {
  v1::ModelConfig::KindCase proto_case;
  // The job's workload on the host, with its data (InvalidArgument naming
  // the file and tensor or field for data it cannot use).
  absl::StatusOr<std::unique_ptr<Workload>> (*make_workload)(const job::ResolvedJob& job);
  // What that workload holds for a local batch of `local_batch` samples
  // (errs high: every buffer at its largest).
  WorkloadMemory (*memory)(const job::ResolvedJob& job, double local_batch,
                           const InputFileBytes& files);
  // Language models only (nullptr otherwise): the model that `muonmesh-worker
  // --sample` draws from, made from the section's resolved form alone (no
  // data). InvalidArgument naming the field for dimensions it cannot use.
  absl::StatusOr<std::unique_ptr<NextTokenModel>> (*make_next_token)(const job::ModelForm& form);
};

absl::Span<const WorkerModelKind> WorkerModelKinds();

// nullptr when the kind has no worker registration.
const WorkerModelKind* FindWorkerModelKind(v1::ModelConfig::KindCase proto_case);

}  // namespace muonmesh::worker
