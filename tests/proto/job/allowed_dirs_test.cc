#include "proto/job/allowed_dirs.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::worker {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

// A fresh tree per test:
//   root/allowed/               the only allowed folder
//   root/allowed/in/            an ordinary folder inside it
//   root/allowed/escape ->      root/outside (a link out)
//   root/allowed/dangling ->    root/outside/new.safetensors (missing target)
//   root/allowed/loop ->        root/allowed/loop
//   root/outside/
//   root/allowed-not/           shares a prefix with allowed/ but is not in it
//   root/link-to-allowed ->     root/allowed
class AllowedDirsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            absl::StrCat("allowed_dirs_", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                         "_", ::getpid());
    fs::remove_all(root_);
    fs::create_directories(root_ / "allowed" / "in");
    fs::create_directories(root_ / "outside");
    fs::create_directories(root_ / "allowed-not");
    fs::create_directory_symlink(root_ / "outside", root_ / "allowed" / "escape");
    fs::create_symlink(root_ / "outside" / "new.safetensors", root_ / "allowed" / "dangling");
    fs::create_symlink(root_ / "allowed" / "loop", root_ / "allowed" / "loop");
    fs::create_directory_symlink(root_ / "allowed", root_ / "link-to-allowed");
    absl::StatusOr<std::vector<std::string>> allowed = job::ResolveAllowedDirs({P("allowed")});
    ASSERT_TRUE(allowed.ok()) << allowed.status();
    allowed_ = *allowed;
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string P(const std::string& relative) const { return (root_ / relative).string(); }

  // A job whose every path is inside allowed/in.
  job::ResolvedJob InsideJob() const {
    job::ResolvedJob job;
    job.init_safetensors = P("allowed/in/init.safetensors");
    job.data_safetensors = P("allowed/in/data.safetensors");
    job.output_dir = P("allowed/in/run");
    job.export_path = P("allowed/in/run/final.safetensors");
    return job;
  }

  fs::path root_;
  std::vector<std::string> allowed_;
};

TEST_F(AllowedDirsTest, PathsInsideAreAllowedExistingOrNot) {
  EXPECT_TRUE(job::CheckJobPathsAllowed(InsideJob(), allowed_).ok());
  // The allowed folder itself, and a path through a link that leads into it.
  job::ResolvedJob job = InsideJob();
  job.output_dir = P("allowed");
  job.export_path = P("link-to-allowed/in/x/../final.safetensors");
  EXPECT_TRUE(job::CheckJobPathsAllowed(job, allowed_).ok()) << job::CheckJobPathsAllowed(job, allowed_);
}

TEST_F(AllowedDirsTest, NoAllowedFoldersMeansNoRestriction) {
  job::ResolvedJob job = InsideJob();
  job.output_dir = "/etc";
  EXPECT_TRUE(job::CheckJobPathsAllowed(job, {}).ok());
}

// Each way out, one field at a time: the error is PermissionDenied and
// names the field and the path as written.
TEST_F(AllowedDirsTest, EveryWayOutIsRefusedNamingTheFieldAndPath) {
  struct Case {
    std::string field;
    std::string path;
  };
  const std::vector<Case> cases = {
      {"init.safetensors", "/etc/passwd"},
      {"data.safetensors", P("allowed/in/../../outside/data.safetensors")},
      {"output.dir", P("allowed/escape/run")},
      {"output.export", P("allowed/dangling")},
      {"output.export", P("allowed-not/final.safetensors")},
      {"output.dir", P("allowed/in/run/../../../outside")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field + " " + c.path);
    job::ResolvedJob job = InsideJob();
    if (c.field == "init.safetensors") job.init_safetensors = c.path;
    if (c.field == "data.safetensors") job.data_safetensors = c.path;
    if (c.field == "output.dir") {
      job.output_dir = c.path;
      job.export_path = P("allowed/in/final.safetensors");
    }
    if (c.field == "output.export") job.export_path = c.path;
    const absl::Status s = job::CheckJobPathsAllowed(job, allowed_);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(c.field, ": ", c.path)));
    EXPECT_THAT(s.message(), HasSubstr("outside the allowed folders"));
    EXPECT_THAT(s.message(), HasSubstr(allowed_[0]));
  }
}

TEST_F(AllowedDirsTest, LinksAreFollowedToWhereTheyLead) {
  absl::StatusOr<std::string> r = job::ResolvePath(P("allowed/escape/run"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (fs::canonical(root_ / "outside") / "run").string());
  r = job::ResolvePath(P("allowed/dangling"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (fs::canonical(root_ / "outside") / "new.safetensors").string());
  // ".." after a link applies to where the link leads, not to the link.
  r = job::ResolvePath(P("link-to-allowed/../outside"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, fs::canonical(root_ / "outside").string());
  r = job::ResolvePath(P("allowed/escape/.."));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, fs::canonical(root_).string());
  // A loop is an error, not a hang.
  r = job::ResolvePath(P("allowed/loop/x"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  // The error says where the link leads.
  job::ResolvedJob job = InsideJob();
  job.output_dir = P("allowed/escape/run");
  EXPECT_THAT(job::CheckJobPathsAllowed(job, allowed_).message(),
              HasSubstr(absl::StrCat("which leads to ", fs::canonical(root_ / "outside").string())));
}

TEST_F(AllowedDirsTest, ACheckpointsFolderLinkedOutsideIsRefused) {
  fs::create_directories(root_ / "allowed" / "in" / "run");
  fs::create_directory_symlink(root_ / "outside", root_ / "allowed" / "in" / "run" / "checkpoints");
  const absl::Status s = job::CheckJobPathsAllowed(InsideJob(), allowed_);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("output.dir (its checkpoints/ folder)"));
  EXPECT_THAT(s.message(), Not(HasSubstr("output.export")));
}

TEST_F(AllowedDirsTest, AnInlineSyntheticSpecIsNotAPath) {
  job::ResolvedJob job = InsideJob();
  job.model_file = job::ModelFile{"model.synthetic.spec", "/etc/spec.yaml", false};
  EXPECT_EQ(job::CheckJobPathsAllowed(job, allowed_).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(job::CheckJobPathsAllowed(job, allowed_).message(), HasSubstr("model.synthetic.spec"));
  job.model_file->given_inline = true;
  EXPECT_TRUE(job::CheckJobPathsAllowed(job, allowed_).ok());
}

// The explicit paths of a job file, checked before job::ResolveJob stats them.
TEST_F(AllowedDirsTest, AJobSpecsExplicitPathsAreCheckedToo) {
  v1::JobSpec spec;
  spec.mutable_output()->set_dir(P("allowed/in/run"));
  EXPECT_TRUE(job::CheckJobPathsAllowed(spec, allowed_).ok());
  spec.mutable_init()->set_safetensors("/etc/shadow");
  spec.mutable_data()->set_safetensors(P("allowed/escape/data.safetensors"));
  spec.mutable_output()->set_export_(P("outside/final.safetensors"));
  const absl::Status s = job::CheckJobPathsAllowed(spec, allowed_);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("init.safetensors: /etc/shadow is outside"));
  EXPECT_THAT(s.message(), HasSubstr("data.safetensors: "));
  EXPECT_THAT(s.message(), HasSubstr("output.export: "));
  EXPECT_THAT(s.message(), Not(HasSubstr("output.dir")));
  // An inline synthetic spec is not read, whatever its path says.
  v1::JobSpec synthetic;
  synthetic.mutable_model()->mutable_synthetic()->set_spec("/etc/spec.yaml");
  EXPECT_EQ(job::CheckJobPathsAllowed(synthetic, allowed_).code(), absl::StatusCode::kPermissionDenied);
  synthetic.mutable_model()->mutable_synthetic()->mutable_model();
  EXPECT_TRUE(job::CheckJobPathsAllowed(synthetic, allowed_).ok());
  EXPECT_TRUE(job::CheckJobPathsAllowed(spec, {}).ok());
}

TEST_F(AllowedDirsTest, AllowedFoldersMustExist) {
  absl::StatusOr<std::vector<std::string>> r = job::ResolveAllowedDirs({P("missing")});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("--allowed-dirs"));
  EXPECT_THAT(r.status().message(), HasSubstr(P("missing")));
  // A link to a folder is its target.
  r = job::ResolveAllowedDirs({P("link-to-allowed")});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, std::vector<std::string>{fs::canonical(root_ / "allowed").string()});
}

TEST(IsInsideTest, ComparesWholeComponents) {
  EXPECT_TRUE(job::IsInside("/a/b", {"/a/b"}));
  EXPECT_TRUE(job::IsInside("/a/b/c", {"/a/b"}));
  EXPECT_FALSE(job::IsInside("/a/bc", {"/a/b"}));
  EXPECT_FALSE(job::IsInside("/a", {"/a/b"}));
  EXPECT_TRUE(job::IsInside("/anything", {"/"}));
  EXPECT_TRUE(job::IsInside("/x/y", {"/a", "/x"}));
}

}  // namespace
}  // namespace muonmesh::worker
