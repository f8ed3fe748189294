#pragma once

// The built-in model kinds' registrations (proto/job/model_kind.h), one file
// each in this folder, and the checks their sections share. Internal to
// proto/job: everything else finds a kind through FindModelKind.

#include <cstdint>
#include <string>

#include "core/plan/types.h"
#include "proto/job/model_kind.h"

namespace muonmesh::job::kinds {

extern const ModelKind kMlp;
extern const ModelKind kMoeMlp;
extern const ModelKind kSynthetic;
extern const ModelKind kGpt;
extern const ModelKind kTransformer;

// A model width in [1, kMaxModelDim] (job.h). For a scalar field 0 means
// "not given"; a list entry of 0 is just out of range.
void CheckDim(const std::string& field, int64_t value, bool list_entry, plan::Violations& v);

// The job's expert parallel size (unset: 1).
int64_t ExpertParallelSize(const v1::JobSpec& job);

}  // namespace muonmesh::job::kinds
