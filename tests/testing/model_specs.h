#pragma once

// The real model specs the tests read: MUONMESH_SPECS_DIR/<name>.json
// (MUONMESH_SPECS_DIR is the repository's own specs/ folder; see
// CMakeLists.txt). A missing spec is a failure
// that names the folder, never a skip: a test that skips when its input is
// absent passes without checking anything.
//
//   const std::string path = muonmesh::testing::ModelSpecPath("gpt2-124m");
//   ASSERT_TRUE(muonmesh::testing::ModelSpecExists(path));

#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace muonmesh::testing {

inline std::string ModelSpecsDir() { return MUONMESH_SPECS_DIR; }

inline std::string ModelSpecPath(const std::string& name) {
  return ModelSpecsDir() + "/" + name + ".json";
}

// Success when `path` is a file; otherwise a failure message naming the
// specs folder and whether it exists at all.
inline ::testing::AssertionResult ModelSpecExists(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) return ::testing::AssertionSuccess();
  const bool folder = std::filesystem::is_directory(ModelSpecsDir(), error);
  return ::testing::AssertionFailure()
         << path << " is missing; the specs folder " << ModelSpecsDir()
         << (folder ? " exists but lacks it" : " does not exist")
         << " (the specs belong to the repository: restore specs/ from git)";
}

}  // namespace muonmesh::testing
