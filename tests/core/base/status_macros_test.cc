// MUONMESH_RETURN_IF_ERROR, MUONMESH_ASSIGN_OR_RETURN and AnnotateStatus:
// what comes back, with and without context, and that the expression runs
// once; and the tests' ASSERT_OK_AND_ASSIGN.
#include "core/base/status_macros.h"

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

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

absl::StatusOr<std::string> Named(bool ok, int* calls) {
  ++*calls;
  if (!ok) {
    absl::Status s = absl::NotFoundError("no such file");
    s.SetPayload(kDetail, absl::Cord("where"));
    return s;
  }
  return std::string("rank-0.jsonl");
}

// Declares a new variable; the context goes in front of an error.
absl::StatusOr<size_t> Length(bool ok, int* calls, bool* reached_end) {
  MUONMESH_ASSIGN_OR_RETURN(std::string name, Named(ok, calls), "metrics ", 0);
  *reached_end = true;
  return name.size();
}

// Assigns to an existing variable, twice in one function.
absl::Status Both(bool first_ok, bool second_ok, int* calls, std::string* out) {
  std::string a;
  MUONMESH_ASSIGN_OR_RETURN(a, Named(first_ok, calls));
  MUONMESH_ASSIGN_OR_RETURN(*out, Named(second_ok, calls));
  *out = a + "+" + *out;
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnMovesTheValue) {
  int calls = 0;
  bool end = false;
  absl::StatusOr<size_t> n = Length(true, &calls, &end);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, std::string("rank-0.jsonl").size());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(end);
  std::string out;
  EXPECT_TRUE(Both(true, true, &calls, &out).ok());
  EXPECT_EQ(out, "rank-0.jsonl+rank-0.jsonl");
  EXPECT_EQ(calls, 3);
}

TEST(StatusMacrosTest, AssignOrReturnReturnsTheErrorWithContext) {
  int calls = 0;
  bool end = false;
  absl::StatusOr<size_t> n = Length(false, &calls, &end);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(end);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(n.status().message(), "metrics 0: no such file");
  EXPECT_EQ(n.status().GetPayload(kDetail), absl::Cord("where"));
  std::string out = "untouched";
  EXPECT_EQ(Both(true, false, &calls, &out).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(out, "untouched");  // the failed assignment leaves its target alone
  EXPECT_EQ(calls, 3);
}

TEST(StatusMacrosTest, AssertOkAndAssignTakesTheValue) {
  int calls = 0;
  ASSERT_OK_AND_ASSIGN(std::string name, Named(true, &calls));
  EXPECT_EQ(name, "rank-0.jsonl");
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace muonmesh
