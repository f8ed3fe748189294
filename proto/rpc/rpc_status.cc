#include "proto/rpc/rpc_status.h"

#include <algorithm>
#include <chrono>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace muonmesh::rpc {
namespace {

// Bytes of the google.rpc.Status envelope besides the message and the
// violations' text: the code, the Any's type URL
// ("type.googleapis.com/google.rpc.BadRequest", 41 bytes) and tags/lengths.
constexpr std::size_t kEnvelopeBytes = 96;
// Tags and length prefixes of one FieldViolation inside the BadRequest.
constexpr std::size_t kPerViolationBytes = 16;
// Room kept for the "N more violations" note.
constexpr std::size_t kNoteBytes = 128;

// `text` cut to at most `max` bytes, marked with "..." when cut. Cuts on a
// UTF-8 character boundary: proto3 strings must be valid UTF-8, and a peer
// fails to parse details that are not.
std::string Truncate(std::string text, std::size_t max) {
  if (text.size() <= max) return text;
  std::size_t end = max > 3 ? max - 3 : 0;
  // Back up over continuation bytes (10xxxxxx) to a character start.
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  text.resize(end);
  text += "...";
  return text;
}

grpc::StatusCode ToGrpcCode(absl::StatusCode code) {
  const int value = static_cast<int>(code);
  // absl and gRPC share the canonical code numbering (0 OK .. 16
  // UNAUTHENTICATED); anything else is not a code a peer would understand.
  if (value < 0 || value > 16) return grpc::StatusCode::UNKNOWN;
  return static_cast<grpc::StatusCode>(value);
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status, absl::Span<const FieldViolation> violations) {
  if (status.ok()) return grpc::Status::OK;
  const grpc::StatusCode code = ToGrpcCode(status.code());
  std::string message = Truncate(std::string(status.message()), kMaxStatusMessageBytes);
  if (status.code() != absl::StatusCode::kInvalidArgument || violations.empty()) {
    return grpc::Status(code, message);
  }

  google::rpc::BadRequest bad_request;
  std::size_t used = kEnvelopeBytes + message.size();
  std::size_t kept = 0;
  // Keep a prefix (not a best-fit subset): the planner reports violations in
  // field order, and the first ones are what a user fixes first.
  for (const FieldViolation& v : violations) {
    const std::size_t size = v.field.size() + v.description.size() + kPerViolationBytes;
    if (used + size + kNoteBytes > kMaxErrorDetailsBytes) break;
    google::rpc::BadRequest::FieldViolation* out = bad_request.add_field_violations();
    out->set_field(v.field);
    out->set_description(v.description);
    used += size;
    ++kept;
  }
  if (kept < violations.size()) {
    google::rpc::BadRequest::FieldViolation* note = bad_request.add_field_violations();
    note->set_description(absl::StrCat(violations.size() - kept,
                                       " more violation(s) not shown; ValidateConfig "
                                       "returns all of them"));
  }

  google::rpc::Status details;
  details.set_code(static_cast<int>(code));
  details.set_message(message);
  details.add_details()->PackFrom(bad_request);
  return grpc::Status(code, std::move(message), details.SerializeAsString());
}

std::vector<FieldViolation> ViolationsFromGrpcStatus(const grpc::Status& status) {
  std::vector<FieldViolation> out;
  if (status.error_details().empty()) return out;
  google::rpc::Status details;
  if (!details.ParseFromString(status.error_details())) return out;
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::BadRequest bad_request;
    if (!any.Is<google::rpc::BadRequest>() || !any.UnpackTo(&bad_request)) continue;
    for (const google::rpc::BadRequest::FieldViolation& v : bad_request.field_violations()) {
      out.push_back({v.field(), v.description()});
    }
  }
  return out;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  const std::vector<FieldViolation> violations = ViolationsFromGrpcStatus(status);
  if (violations.empty()) return absl::Status(code, status.error_message());
  std::vector<std::string> lines;
  lines.reserve(violations.size());
  for (const FieldViolation& v : violations) {
    lines.push_back(v.field.empty() ? v.description : absl::StrCat(v.field, ": ", v.description));
  }
  return absl::Status(code, absl::StrJoin(lines, "\n"));
}

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view what) {
  const absl::Status converted = FromGrpcStatus(status);
  if (converted.ok()) return converted;
  return absl::Status(converted.code(), absl::StrCat(what, ": ", converted.message()));
}

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  const absl::Duration bounded =
      std::clamp(timeout, absl::ZeroDuration(), absl::Hours(24 * 365));
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(bounded));
}

}  // namespace muonmesh::rpc
