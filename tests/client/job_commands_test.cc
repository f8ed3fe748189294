// What `muonmeshctl watch` says about a step's Muon health
// (client/job_commands.h, HealthWarning).

#include "client/job_commands.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::client {
namespace {

using ::testing::HasSubstr;

v1::StepRecord Step(int64_t elements, int64_t planned) {
  v1::StepRecord r;
  r.set_step(41);
  r.mutable_muon()->set_elements(elements);
  r.mutable_muon()->set_planned_elements(planned);
  return r;
}

TEST(HealthWarningTest, NamesTheMissingElementsAndTheBrokenOrthogonalization) {
  EXPECT_EQ(HealthWarning(Step(4096, 4096)), "");
  EXPECT_EQ(HealthWarning(Step(0, 0)), "");  // no Muon in the job
  EXPECT_EQ(HealthWarning(Step(0, 4096)),
            "step 41  warning: Muon updated 0 of the 4096 elements planned");
  v1::StepRecord r = Step(4096, 4096);
  r.mutable_muon()->set_ortho_error_max(0.89);
  EXPECT_EQ(HealthWarning(r), "");
  r.mutable_muon()->set_ortho_error_max(1.25);
  EXPECT_THAT(HealthWarning(r), HasSubstr("orthogonality error 1.250 (above 1)"));
}

}  // namespace
}  // namespace muonmesh::client
