// Whether the coordinator takes a job (server/control/job_admission.h), on
// its own: each rule of a job run by workers elsewhere, the planner's checks
// and size limits, and the allowed folders, each named by the field it
// concerns.

#include "server/control/job_admission.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/io/message_file.h"

namespace muonmesh::coordinator {
namespace {

using ::testing::Contains;
using ::testing::Field;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

v1::JobSpec Spec(const std::string& text) {
  v1::JobSpec spec;
  const absl::Status s = protoio::ParseMessageText(text, "job", &spec);
  EXPECT_TRUE(s.ok()) << s;
  return spec;
}

std::vector<std::string> Fields(const std::vector<plan::FieldViolation>& v) {
  std::vector<std::string> out;
  for (const plan::FieldViolation& f : v) out.push_back(f.field);
  return out;
}

constexpr char kMlp[] =
    "name: a\nworld_size: 2\nmodel: {mlp: {dims: [6, 16, 3]}}\n"
    "training: {steps: 4, global_batch_size: 8}\n";

TEST(JobAdmissionTest, AJobWithAbsolutePathsIsTaken) {
  std::vector<plan::FieldViolation> v;
  const absl::Status s = AdmitJob(Spec(absl::StrCat(kMlp, "output: {dir: /runs/a}\n")), {}, &v);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_THAT(v, IsEmpty());
}

TEST(JobAdmissionTest, RelativePathsAndAMissingOutputFolderAreNamed) {
  std::vector<plan::FieldViolation> v;
  const absl::Status s = AdmitJob(
      Spec("name: g\nworld_size: 1\nmodel: {gpt: {n_layer: 1, n_head: 2, n_embd: 8, "
           "vocab_size: 256, block_size: 8}}\n"
           "data: {text: {train: data/train.txt, val: /abs/val.txt}}\n"
           "training: {steps: 4, global_batch_size: 2}\noutput: {export: out/w.safetensors}\n"),
      {}, &v);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Fields(v), Contains("data.text.train"));
  EXPECT_THAT(Fields(v), Contains("output.dir"));
  EXPECT_THAT(Fields(v), Contains("output.export"));
  EXPECT_THAT(Fields(v), ::testing::Not(Contains("data.text.val")));
  EXPECT_THAT(v, Contains(Field(&plan::FieldViolation::description, HasSubstr("is relative"))));
}

TEST(JobAdmissionTest, AModelFileMustTravelInline) {
  std::vector<plan::FieldViolation> v;
  const absl::Status s =
      AdmitJob(Spec("name: s\nworld_size: 1\nmodel: {synthetic: {spec: /specs/gpt2.json}}\n"
                    "training: {steps: 1, global_batch_size: 1}\noutput: {dir: /runs/s}\n"),
               {}, &v);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Fields(v), Contains("model.synthetic.spec"));
}

TEST(JobAdmissionTest, ThePlannersChecksComeOnceTheJobFilesPass) {
  // Expert parallelism 2 does not divide 3 ranks.
  std::vector<plan::FieldViolation> v;
  const absl::Status s = AdmitJob(
      Spec("name: m\nworld_size: 3\nparallelism: {expert_model_parallel_size: 2}\n"
           "model: {moe_mlp: {d_in: 5, d_model: 8, d_expert: 6, num_experts: 4, d_out: 3}}\n"
           "training: {steps: 2, global_batch_size: 6}\noutput: {dir: /runs/m}\n"),
      {}, &v);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Fields(v), Contains(HasSubstr("expert_model_parallel_size")));
}

TEST(JobAdmissionTest, AJobTooLargeToPlanIsRefusedOnItsWorldSize) {
  std::string units;
  for (int u = 0; u < 1000; ++u) {
    absl::StrAppend(&units, u == 0 ? "" : ", ", "{name: u", u, ", params: [{name: u", u,
                    ".w, shape: [1048576, 1048576], optimizer: muon}]}");
  }
  std::vector<plan::FieldViolation> v;
  const absl::Status s = AdmitJob(
      Spec(absl::StrCat("name: huge\nworld_size: 16384\nmodel: {synthetic: {model: {name: huge, "
                        "units: [",
                        units,
                        "]}}}\ntraining: {steps: 1, global_batch_size: 16384}\n"
                        "output: {dir: /runs/huge}\n")),
      {}, &v);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Fields(v), Contains("world_size"));
}

TEST(JobAdmissionTest, APathOutsideTheAllowedFoldersIsRefusedNamingItsField) {
  std::vector<plan::FieldViolation> v;
  const absl::Status s =
      AdmitJob(Spec(absl::StrCat(kMlp, "output: {dir: /elsewhere/a}\n")), {"/runs"}, &v);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output.dir"));
  EXPECT_TRUE(AdmitJob(Spec(absl::StrCat(kMlp, "output: {dir: /runs/a}\n")), {"/runs"}, &v).ok());
}

}  // namespace
}  // namespace muonmesh::coordinator
