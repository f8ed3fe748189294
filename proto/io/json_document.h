// The project's one JSON reader, for callers outside proto/io: the same
// bounded reader that loads job files and model specs (json_reader.h),
// returning its tree (document.h) instead of filling a protobuf message.
// The safetensors header (worker/io/safetensors.cc) is read through it.
// Plain C++ and Abseil: no protobuf, no yaml-cpp.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/io/document.h"

namespace muonmesh::protoio {

using JsonDocument = internal::Document;
using JsonNode = internal::Node;
using JsonLocation = internal::Location;

struct JsonOptions {
  // Most nodes the document may hold; the reader also allows at most one
  // per 2 bytes of text (plus 1024), as for job files.
  std::size_t max_nodes = kMaxNodes;
  // Deepest container accepted (the root is depth 1).
  int max_depth = kMaxNestingDepth;
};

// Reads `text`, which must outlive the result, as one strict JSON document
// (RFC 8259: no comments, strings valid UTF-8).
// InvalidArgument "SOURCE:LINE:COL: reason" (1-based) for a syntax error or
// a limit of `options` exceeded; ResourceExhausted if memory runs out.
absl::StatusOr<std::unique_ptr<JsonDocument>> ReadJsonDocument(absl::string_view text,
                                                               absl::string_view source,
                                                               const JsonOptions& options = {});

// What the node is, for "expected X, got Y": "an object", "an array",
// "a string", "a number", "a boolean" or "null".
const char* JsonKindName(const JsonDocument& doc, const JsonNode& node);

// True for a JSON string (a quoted scalar; doc.Scalar(node) is its decoded
// value), false for numbers, booleans, null and containers.
bool IsJsonString(const JsonNode& node);

}  // namespace muonmesh::protoio
