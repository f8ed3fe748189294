#pragma once

// A deterministic protobuf -> JSON writer for machine-read output
// (`muonmeshctl plan --json`). Not protobuf's MessageToJsonString: that one
// writes int64 as strings, drops zero-valued fields and does not promise a
// byte-stable format, while scripts here read numbers as numbers, expect
// every field (`"owner": 0`), and diff outputs byte for byte.
//
// The format, which is a contract:
// - an object per message, fields in field-number order, keyed by their
//   proto field names; 2-space indentation, one field per line;
// - every singular scalar is written, zero or not; fields with explicit
//   presence (sub-messages, proto3 `optional`, oneof members) only when set;
// - integers (int64 too) as JSON numbers; doubles and floats with the fewest
//   significant digits that read back to the same value (%.17g at most;
//   integral values below 1e15 without a decimal point); NaN and infinities
//   as the strings "NaN", "Infinity", "-Infinity";
// - enums by value name (the number when unknown; JsonOptions can drop the
//   prefix their type's values share), bytes as base64;
// - repeated scalars as one-line arrays ([1, 2]), repeated messages as
//   arrays of objects one per line, maps as objects sorted by key.
// Well-known types (Any, Timestamp, ...) are written as ordinary messages.
//
// Pure function; safe from any thread.

#include <string>
#include <vector>

#include "google/protobuf/message.h"

namespace muonmesh::client {

struct JsonOptions {
  // Fields to leave out, by full name ("muonmesh.v1.PlanSummary.plan_seconds"):
  // values that differ between runs on the same input, such as timings,
  // would break byte-identical output.
  std::vector<std::string> omit_fields;
  // Enum values without the prefix every value of their type shares
  // ("RUNNING" for JOB_STATE_RUNNING), as muonmeshctl's tables print them.
  bool short_enum_names = false;
};

// `message` as JSON, without a trailing newline.
std::string ToJson(const google::protobuf::Message& message, const JsonOptions& options = {});

}  // namespace muonmesh::client
