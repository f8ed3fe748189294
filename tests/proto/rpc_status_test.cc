#include "proto/rpc/rpc_status.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"

namespace muonmesh::rpc {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(RpcStatusTest, OkStaysOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus(), {{"f", "d"}}).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(RpcStatusTest, CodesAndMessagesCarryOver) {
  const grpc::Status status = ToGrpcStatus(absl::UnavailableError("peer lost"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(), "peer lost");
  EXPECT_TRUE(status.error_details().empty());
  EXPECT_EQ(FromGrpcStatus(status), absl::UnavailableError("peer lost"));
}

TEST(RpcStatusTest, InvalidArgumentCarriesBadRequest) {
  const std::vector<FieldViolation> violations = {
      {"world_size", "must be >= 1, got 0"},
      {"model.units[3].params[2].shape[1]", "dimension must be positive, got -1"}};
  const grpc::Status status = ToGrpcStatus(absl::InvalidArgumentError("bad config"), violations);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "bad config");

  // Decoded by hand: google.rpc.Status{code 3, message, [Any(BadRequest)]}.
  google::rpc::Status details;
  ASSERT_TRUE(details.ParseFromString(status.error_details()));
  EXPECT_EQ(details.code(), 3);
  EXPECT_EQ(details.message(), "bad config");
  ASSERT_EQ(details.details_size(), 1);
  EXPECT_EQ(details.details(0).type_url(), "type.googleapis.com/google.rpc.BadRequest");
  google::rpc::BadRequest bad_request;
  ASSERT_TRUE(details.details(0).UnpackTo(&bad_request));
  ASSERT_EQ(bad_request.field_violations_size(), 2);
  EXPECT_EQ(bad_request.field_violations(1).field(), "model.units[3].params[2].shape[1]");

  EXPECT_EQ(ViolationsFromGrpcStatus(status), violations);
  const absl::Status back = FromGrpcStatus(status);
  EXPECT_EQ(back.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(back.message(),
            "world_size: must be >= 1, got 0\n"
            "model.units[3].params[2].shape[1]: dimension must be positive, got -1");
}

TEST(RpcStatusTest, OtherCodesIgnoreViolations) {
  const grpc::Status status = ToGrpcStatus(absl::FailedPreconditionError("not yet"), {{"f", "d"}});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(status.error_details().empty());
}

TEST(RpcStatusTest, MalformedDetailsAreIgnored) {
  const grpc::Status status(grpc::StatusCode::INVALID_ARGUMENT, "msg", "\xff\xff not a proto");
  EXPECT_THAT(ViolationsFromGrpcStatus(status), IsEmpty());
  EXPECT_EQ(FromGrpcStatus(status), absl::InvalidArgumentError("msg"));
}

TEST(RpcStatusTest, LongListsAreCutToFitWithANote) {
  std::vector<FieldViolation> violations;
  for (int i = 0; i < 1000; ++i) {
    violations.push_back({absl::StrCat("model.units[", i, "].name"), "empty unit name"});
  }
  const grpc::Status status =
      ToGrpcStatus(absl::InvalidArgumentError(std::string(5000, 'm')), violations);
  EXPECT_LE(status.error_message().size(), kMaxStatusMessageBytes);
  EXPECT_THAT(status.error_message(), ::testing::EndsWith("..."));
  EXPECT_LE(status.error_details().size(), kMaxErrorDetailsBytes);
  const std::vector<FieldViolation> got = ViolationsFromGrpcStatus(status);
  ASSERT_GE(got.size(), 10u);
  ASSERT_LT(got.size(), violations.size());
  // A prefix, in order, then the note.
  for (size_t i = 0; i + 1 < got.size(); ++i) EXPECT_EQ(got[i], violations[i]);
  EXPECT_EQ(got.back().field, "");
  EXPECT_THAT(got.back().description,
              HasSubstr(absl::StrCat(violations.size() - (got.size() - 1), " more violation")));
}

TEST(RpcStatusTest, CutsMessagesOnCharacterBoundaries) {
  std::string euros;
  for (int i = 0; i < 1000; ++i) euros += "\xE2\x82\xAC";
  const grpc::Status status = ToGrpcStatus(absl::InvalidArgumentError(euros), {{"f", "d"}});
  // Whole characters, then "...": the details (proto3 strings) still parse.
  const std::string& message = status.error_message();
  ASSERT_TRUE(message.size() > 3);
  EXPECT_EQ((message.size() - 3) % 3, 0u);
  EXPECT_THAT(ViolationsFromGrpcStatus(status), ElementsAre(FieldViolation{"f", "d"}));
}

// The client edge's form with a context keeps what the server sent: the
// code, and every field violation on its own line after `what`.
TEST(RpcStatusTest, AConversionWithContextKeepsTheViolations) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK, "registering").ok());
  const std::vector<FieldViolation> violations = {{"world_size", "must be >= 1"},
                                                  {"model", "required"}};
  const grpc::Status status =
      ToGrpcStatus(absl::InvalidArgumentError("invalid job"), violations);
  const absl::Status converted = FromGrpcStatus(status, "submit");
  EXPECT_EQ(converted.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(converted.message(), "submit: world_size: must be >= 1\nmodel: required");
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "peer lost"), "store"),
            absl::UnavailableError("store: peer lost"));
}

// Every call ends: a deadline in the past is now, one beyond a year is a year.
TEST(RpcStatusTest, DeadlinesAreBoundedBothWays) {
  const auto now = std::chrono::system_clock::now();
  grpc::ClientContext past;
  SetDeadline(past, absl::Seconds(-5));
  EXPECT_LE(past.deadline(), std::chrono::system_clock::now());
  EXPECT_GE(past.deadline(), now - std::chrono::seconds(1));
  grpc::ClientContext forever;
  SetDeadline(forever, absl::InfiniteDuration());
  EXPECT_LE(forever.deadline(), std::chrono::system_clock::now() + std::chrono::hours(24 * 366));
  EXPECT_GE(forever.deadline(), now + std::chrono::hours(24 * 364));
  grpc::ClientContext second;
  const auto before = std::chrono::system_clock::now();
  SetDeadline(second, absl::Seconds(1));
  const auto after = std::chrono::system_clock::now();
  EXPECT_GE(second.deadline(), before + std::chrono::seconds(1));
  EXPECT_LE(second.deadline(), after + std::chrono::seconds(1));
}

}  // namespace
}  // namespace muonmesh::rpc
