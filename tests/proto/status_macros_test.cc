// MUONMESH_RETURN_IF_ERROR and AnnotateStatus: what comes back, with and
// without context, and that the expression runs once.
#include "proto/support/status_macros.h"

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "gtest/gtest.h"

namespace muonmesh {
namespace {

constexpr char kDetail[] = "type.googleapis.com/google.rpc.BadRequest";

absl::Status Failing(int* calls) {
  ++*calls;
  absl::Status s = absl::InvalidArgumentError("world_size: must be positive");
  s.SetPayload(kDetail, absl::Cord("field violations"));
  return s;
}

absl::Status Passing(int* calls) {
  ++*calls;
  return absl::OkStatus();
}

absl::Status Plain(absl::Status (*f)(int*), int* calls, bool* reached_end) {
  MUONMESH_RETURN_IF_ERROR(f(calls));
  *reached_end = true;
  return absl::OkStatus();
}

absl::StatusOr<int> Annotated(absl::Status (*f)(int*), int* calls, int index) {
  MUONMESH_RETURN_IF_ERROR(f(calls), "job file ", index, " 'a.yaml'");
  return 7;
}

TEST(StatusMacrosTest, ReturnsTheErrorUnchangedWithoutContext) {
  int calls = 0;
  bool end = false;
  absl::Status s = Plain(Failing, &calls, &end);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(end);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "world_size: must be positive");
  EXPECT_EQ(s.GetPayload(kDetail), absl::Cord("field violations"));
}

TEST(StatusMacrosTest, GoesOnWhenOk) {
  int calls = 0;
  bool end = false;
  EXPECT_TRUE(Plain(Passing, &calls, &end).ok());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(end);
  absl::StatusOr<int> v = Annotated(Passing, &calls, 3);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 7);
  EXPECT_EQ(calls, 2);
}

TEST(StatusMacrosTest, ContextGoesInFrontAndKeepsCodeAndPayloads) {
  int calls = 0;
  absl::StatusOr<int> v = Annotated(Failing, &calls, 3);
  EXPECT_EQ(calls, 1);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v.status().message(), "job file 3 'a.yaml': world_size: must be positive");
  EXPECT_EQ(v.status().GetPayload(kDetail), absl::Cord("field violations"));
}

TEST(StatusMacrosTest, AnnotateLeavesOkAndEmptyContextAlone) {
  EXPECT_TRUE(AnnotateStatus(absl::OkStatus(), "context").ok());
  const absl::Status e = absl::UnavailableError("peer 3 lost");
  EXPECT_EQ(AnnotateStatus(e, ""), e);
  EXPECT_EQ(AnnotateStatus(e, "rank 1"), absl::UnavailableError("rank 1: peer 3 lost"));
}

}  // namespace
}  // namespace muonmesh
