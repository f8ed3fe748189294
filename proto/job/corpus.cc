#include "proto/job/corpus.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace muonmesh::job {
namespace {

namespace fs = std::filesystem;

absl::Status CheckRegular(const std::string& field, const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": no such file"));
  }
  if (ec) return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": ", ec.message()));
  if (st.type() != fs::file_type::regular) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": not a regular file"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsPattern(const std::string& pattern) {
  const std::string name = fs::path(pattern).filename().string();
  return name.find_first_of("*?[") != std::string::npos;
}

absl::StatusOr<std::vector<std::string>> ExpandCorpus(const std::string& field,
                                                      const std::string& pattern) {
  if (pattern.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty path"));
  std::vector<std::string> files;
  if (!IsPattern(pattern)) {
    if (absl::Status s = CheckRegular(field, pattern); !s.ok()) return s;
    files.push_back(pattern);
    return files;
  }
  glob_t g{};
  const int rc = glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc && files.size() <= kMaxCorpusFiles; ++i) {
      files.emplace_back(g.gl_pathv[i]);
    }
  }
  globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && files.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no file matches ", pattern));
  }
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read the folder of ", pattern));
  }
  if (files.size() > kMaxCorpusFiles) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", pattern, " matches more than ",
                                                   kMaxCorpusFiles, " files"));
  }
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    if (absl::Status s = CheckRegular(field, f); !s.ok()) return s;
  }
  return files;
}

}  // namespace muonmesh::job
