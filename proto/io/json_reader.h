// Reads JSON documents into a Document without yaml-cpp. Internal to
// proto/io: callers use message_file.h.
//
// Why a reader of our own: yaml-cpp reads every token of a flow collection
// ([...] or {...}) before it hands over the first one (a flow collection may
// be a mapping key, "[a, b]: c", so the key it might be stays unverified
// until the collection closes), and a JSON document is one flow collection:
// a 57 MB spec cost 2.3 GB before any limit could look at it. This reader
// builds the tree as it reads, at 20 bytes a node and every limit checked
// per node.
//
// It reads strict JSON (RFC 8259) plus YAML comments ('#' at the start of a
// line or after a blank, to the end of the line), and nothing else. Every
// document it accepts is also YAML and yields the same tree as yaml-cpp
// would (tests/proto/json_reader_test.cc checks this), so whether a
// document took this path never shows in the result; anything else it
// leaves to the YAML reader.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/io/document.h"

namespace muonmesh::protoio::internal {

// True if the first byte of `text` that is not blank, a line break or in a
// comment is '{' or '['.
bool LooksLikeJson(absl::string_view text);

enum class JsonVerdict {
  kRead,     // `*doc` holds the document
  kNotJson,  // a syntax error: `*error` says where; try YAML
  kRefused,  // a limit of `limits` refused it: `*error` says where and why
};

// Reads `text` as one JSON document into `*doc` (which must be empty and
// built over `text`). On kNotJson and kRefused, `*error` is InvalidArgument
// "SOURCE:LINE:COL: reason" and `*doc` holds a partial tree to discard.
// Never throws but std::bad_alloc.
JsonVerdict ReadJson(absl::string_view text, absl::string_view source, const ReadLimits& limits,
                     Document* doc, absl::Status* error);

}  // namespace muonmesh::protoio::internal
