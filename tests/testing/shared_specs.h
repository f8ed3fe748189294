#pragma once

// The real model specs the tests read: MUONMESH_SHARED_DIR/specs/<name>.json
// (MUONMESH_SHARED_DIR is ../shared beside the checkout, in developers' trees
// and CI's clones alike; see CMakeLists.txt). A missing spec is a failure
// that names the folder, never a skip: a test that skips when its input is
// absent passes without checking anything.
//
//   const std::string path = muonmesh::testing::SharedSpecPath("gpt2-124m");
//   ASSERT_TRUE(muonmesh::testing::SharedSpecExists(path));

#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace muonmesh::testing {

inline std::string SharedSpecsDir() { return std::string(MUONMESH_SHARED_DIR) + "/specs"; }

inline std::string SharedSpecPath(const std::string& name) {
  return SharedSpecsDir() + "/" + name + ".json";
}

// Success when `path` is a file; otherwise a failure message naming the
// specs folder, whether it exists at all, and how to point the build at it.
inline ::testing::AssertionResult SharedSpecExists(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) return ::testing::AssertionSuccess();
  const bool folder = std::filesystem::is_directory(SharedSpecsDir(), error);
  return ::testing::AssertionFailure()
         << path << " is missing; the specs folder " << SharedSpecsDir()
         << (folder ? " exists but lacks it" : " does not exist")
         << " (check out ../shared beside the repository or configure with "
            "-DMUONMESH_SHARED_DIR=<folder holding specs/>)";
}

}  // namespace muonmesh::testing
