#pragma once

// The one place where absl::Status meets grpc::Status, and the client edge
// of every call (deadlines). Handlers work in absl::Status and convert at
// the RPC edge; clients (muonmeshctl's library, the worker daemon, the
// rendezvous store) convert back with FromGrpcStatus and bound each call
// with SetDeadline. Bad input
// travels as google.rpc.BadRequest field violations in the binary error
// details (the grpc-status-details-bin trailer), the convention every gRPC
// ecosystem reads, so a user sees every problem with a request at once.
//
// Stateless free functions; safe to call from any thread.

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"
#include "core/base/field_violation.h"

namespace muonmesh::rpc {

// One invalid field of a request: its path ("world_size",
// "model.units[3].params[2].shape[1]") and what is wrong with it. An empty
// field means the request as a whole. The planner's type: what the
// validators find goes into an error as it is.
using FieldViolation = ::muonmesh::FieldViolation;

// gRPC carries the status message and the error details in HTTP/2 trailers,
// and a peer drops a call whose trailers exceed its metadata limit (8 KiB by
// default), so the error must stay well under it however many violations
// the input has. The full list is always available from ValidateConfig,
// which returns it in the response body.
inline constexpr std::size_t kMaxStatusMessageBytes = 1024;
inline constexpr std::size_t kMaxErrorDetailsBytes = 4096;

// Converts `status` into a grpc::Status with the same code and message.
//
// For INVALID_ARGUMENT with a non-empty `violations`, the result also
// carries a serialized google.rpc.Status{code, message,
// details=[Any(google.rpc.BadRequest)]}. Violations that do not fit in
// kMaxErrorDetailsBytes are dropped and replaced by one final violation with
// an empty field saying how many were left out. Other codes ignore
// `violations`: BadRequest describes bad input only. Messages longer than
// kMaxStatusMessageBytes are cut (marked with "...").
grpc::Status ToGrpcStatus(const absl::Status& status,
                          absl::Span<const FieldViolation> violations = {});

// The BadRequest field violations carried in `status`'s error details, in
// the order the server sent them. Empty when there are none or when the
// details are not a google.rpc.Status (a peer's malformed details are
// ignored rather than trusted).
std::vector<FieldViolation> ViolationsFromGrpcStatus(const grpc::Status& status);

// The inverse of ToGrpcStatus for clients: same code; the message is the
// field violations, one per line as "field: description" (a violation with
// an empty field is its description alone), or the status message when
// there are none.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The same with `what` in front ("what: message"; the violations follow on
// their lines). OK stays OK.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view what);

// Ends the call of `context` `timeout` from now. Every call has an end
// (STYLE.md: every wait is bounded): a negative timeout is now, and one
// beyond a year is a year (the clock would overflow).
void SetDeadline(grpc::ClientContext& context, absl::Duration timeout);

}  // namespace muonmesh::rpc
