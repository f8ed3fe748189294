#pragma once

// The folders a worker lets job files read from and write to (the worker's
// --allowed-dirs): a job reaches a worker from whoever may submit, and its
// paths must not make the worker read or overwrite files the operator did
// not offer (README "Security").
//
// Paths are compared after resolving them as the file system would: made
// absolute against the working folder, every symbolic link followed (a
// dangling one too, to where a write would land) and every ".." applied to
// the folder it follows. Parts that do not exist yet are taken as written.
// A symbolic link created inside an allowed folder after the check is not
// seen: the check guards against job files, not against users who can
// already write there.
//
// Free functions with no shared state: any thread may call them.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muonmesh/v1/config.pb.h"
#include "proto/job/job.h"

namespace muonmesh::job {

// `path` resolved as described above. InvalidArgument when it cannot be
// (a loop of symbolic links, an unreadable link).
absl::StatusOr<std::string> ResolvePath(const std::string& path);

// The resolved forms of `dirs`, each an existing folder. InvalidArgument
// naming --allowed-dirs and the folder for one that does not exist or is
// not a folder.
absl::StatusOr<std::vector<std::string>> ResolveAllowedDirs(const std::vector<std::string>& dirs);

// Whether resolved `path` is one of the resolved `allowed` folders or lies
// inside one.
bool IsInside(const std::string& path, const std::vector<std::string>& allowed);

// OK when every path `job` reads or writes lies inside one of `allowed`
// (from ResolveAllowedDirs), or when `allowed` is empty (no restriction):
// init.safetensors, data.safetensors, model.synthetic.spec (unless the spec
// is inline), output.dir with its checkpoints/ and metrics/ folders, and
// output.export. PermissionDenied otherwise, naming every offending field
// with its path (and where it leads, when a link or ".." moved it) and the
// allowed folders.
absl::Status CheckJobPathsAllowed(const ResolvedJob& job, const std::vector<std::string>& allowed);

// The same for the paths a job file names explicitly, before ResolveJob
// looks at them (it checks that input files exist, which would tell a
// submitter whether a file outside the allowed folders exists). Defaults
// (output.dir runs/<name>, ...) are only known after ResolveJob: check the
// ResolvedJob too.
absl::Status CheckJobPathsAllowed(const v1::JobSpec& spec, const std::vector<std::string>& allowed);

}  // namespace muonmesh::job
