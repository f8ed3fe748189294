#include "proto/job/allowed_dirs.h"

#include <deque>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/job/corpus.h"

namespace muonmesh::job {
namespace {

namespace fs = std::filesystem;

// As Linux's MAXSYMLINKS.
constexpr int kMaxLinks = 40;

}  // namespace

absl::StatusOr<std::string> ResolvePath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("an empty path");
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot make it absolute: ",
                                                   ec.message()));
  }
  // The components still to walk; a link's target is pushed in front.
  const fs::path relative = absolute.relative_path();
  std::deque<fs::path> rest(relative.begin(), relative.end());
  fs::path resolved = "/";
  int links = 0;
  while (!rest.empty()) {
    const fs::path part = std::move(rest.front());
    rest.pop_front();
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      resolved = resolved.parent_path();
      continue;
    }
    fs::path next = resolved / part;
    const fs::file_status status = fs::symlink_status(next, ec);
    if (!fs::is_symlink(status)) {
      resolved = std::move(next);
      continue;
    }
    if (++links > kMaxLinks) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": more than ", kMaxLinks, " symbolic links (a loop?)"));
    }
    const fs::path target = fs::read_symlink(next, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": cannot read the symbolic link ", next.string(), ": ",
                       ec.message()));
    }
    if (target.is_absolute()) resolved = "/";
    const fs::path target_parts = target.relative_path();
    rest.insert(rest.begin(), target_parts.begin(), target_parts.end());
  }
  return resolved.string();
}

absl::StatusOr<std::vector<std::string>> ResolveAllowedDirs(const std::vector<std::string>& dirs) {
  std::vector<std::string> out;
  for (const std::string& dir : dirs) {
    absl::StatusOr<std::string> resolved = ResolvePath(dir);
    if (!resolved.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--allowed-dirs: ", resolved.status().message()));
    }
    std::error_code ec;
    if (!fs::is_directory(*resolved, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--allowed-dirs: ", dir, " is not an existing folder",
          *resolved != dir ? absl::StrCat(" (it leads to ", *resolved, ")") : std::string()));
    }
    out.push_back(*std::move(resolved));
  }
  return out;
}

bool IsInside(const std::string& path, const std::vector<std::string>& allowed) {
  for (const std::string& dir : allowed) {
    if (path == dir) return true;
    if (dir == "/") return true;
    if (path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
        path[dir.size()] == '/') {
      return true;
    }
  }
  return false;
}

namespace {

using FieldPaths = std::vector<std::pair<std::string, std::string>>;  // (field, path)

absl::Status CheckPaths(const FieldPaths& paths, const std::vector<std::string>& allowed) {
  std::vector<std::string> violations;
  for (const auto& [field, path] : paths) {
    absl::StatusOr<std::string> resolved = ResolvePath(path);
    if (!resolved.ok()) {
      violations.push_back(absl::StrCat(field, ": ", resolved.status().message()));
      continue;
    }
    if (IsInside(*resolved, allowed)) continue;
    std::error_code ec;
    const std::string plain = fs::absolute(path, ec).lexically_normal().string();
    violations.push_back(absl::StrCat(
        field, ": ", path,
        *resolved != plain ? absl::StrCat(" (which leads to ", *resolved, ")") : std::string(),
        " is outside the allowed folders"));
  }
  if (violations.empty()) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(absl::StrJoin(violations, "; "),
                                                  " (--allowed-dirs ",
                                                  absl::StrJoin(allowed, ","), ")"));
}

void AddOutputDir(const std::string& dir, FieldPaths* paths) {
  paths->emplace_back("output.dir", dir);
  paths->emplace_back("output.dir (its checkpoints/ folder)",
                      (fs::path(dir) / "checkpoints").string());
  paths->emplace_back("output.dir (its metrics/ folder)", (fs::path(dir) / "metrics").string());
}

}  // namespace

absl::Status CheckJobPathsAllowed(const ResolvedJob& job, const std::vector<std::string>& allowed) {
  if (allowed.empty()) return absl::OkStatus();
  FieldPaths paths;
  if (!job.init_safetensors.empty()) paths.emplace_back("init.safetensors", job.init_safetensors);
  if (!job.init_checkpoint.empty()) paths.emplace_back("init.checkpoint", job.init_checkpoint);
  if (!job.data_safetensors.empty()) paths.emplace_back("data.safetensors", job.data_safetensors);
  if (job.model_file.has_value() && !job.model_file->given_inline) {
    paths.emplace_back(job.model_file->field, job.model_file->path);
  }
  if (!job.corpus.train.empty()) {
    // Every file a pattern matches, as the worker will open it (a match may
    // be a link out of the allowed folders).
    const std::string field = job.corpus.tokens ? "data.tokens" : "data.text";
    for (const auto& [suffix, pattern] :
         {std::pair{".train", job.corpus.train}, std::pair{".val", job.corpus.val}}) {
      if (pattern.empty()) continue;
      absl::StatusOr<std::vector<std::string>> files = ExpandCorpus(field + suffix, pattern);
      if (!files.ok()) return files.status();
      for (const std::string& f : *files) paths.emplace_back(field + suffix, f);
    }
  }
  if (!job.output_dir.empty()) AddOutputDir(job.output_dir, &paths);
  if (!job.export_path.empty()) paths.emplace_back("output.export", job.export_path);
  return CheckPaths(paths, allowed);
}

absl::Status CheckJobPathsAllowed(const v1::JobSpec& spec, const std::vector<std::string>& allowed) {
  if (allowed.empty()) return absl::OkStatus();
  FieldPaths paths;
  if (spec.init().source_case() == v1::InitConfig::kSafetensors &&
      !spec.init().safetensors().empty()) {
    paths.emplace_back("init.safetensors", spec.init().safetensors());
  }
  if (spec.init().source_case() == v1::InitConfig::kCheckpoint &&
      !spec.init().checkpoint().empty()) {
    paths.emplace_back("init.checkpoint", spec.init().checkpoint());
  }
  if (spec.data().source_case() == v1::DataConfig::kSafetensors &&
      !spec.data().safetensors().empty()) {
    paths.emplace_back("data.safetensors", spec.data().safetensors());
  }
  if (const std::optional<ModelFile> file = ModelFileOf(spec.model());
      file.has_value() && !file->given_inline && !file->path.empty()) {
    paths.emplace_back(file->field, file->path);
  }
  // A corpus pattern (the coordinator cannot expand it): its folder.
  const auto add_corpus = [&](const std::string& field, const std::string& path) {
    if (path.empty()) return;
    paths.emplace_back(field, IsPattern(path)
                                  ? std::filesystem::path(path).parent_path().string()
                                  : path);
  };
  if (spec.data().source_case() == v1::DataConfig::kText) {
    add_corpus("data.text.train", spec.data().text().train());
    add_corpus("data.text.val", spec.data().text().val());
  } else if (spec.data().source_case() == v1::DataConfig::kTokens) {
    add_corpus("data.tokens.train", spec.data().tokens().train());
    add_corpus("data.tokens.val", spec.data().tokens().val());
  }
  if (!spec.output().dir().empty()) AddOutputDir(spec.output().dir(), &paths);
  if (!spec.output().export_().empty()) paths.emplace_back("output.export", spec.output().export_());
  return CheckPaths(paths, allowed);
}

}  // namespace muonmesh::job
