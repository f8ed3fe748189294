// Loads protobuf messages from YAML or JSON text: job files and model specs
// are written by hand, so every error names the file, line, column and field.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace muonmesh::protoio {

// Largest input accepted, in bytes. Model specs run to ~130 KiB; this leaves
// room for generated specs of much larger models.
inline constexpr std::size_t kMaxFileBytes = std::size_t{64} << 20;

// Most YAML nodes (mappings, sequences, scalars, nulls, aliases) one input
// may hold; the largest model spec has ~9,300. Bounds memory (~100 bytes a
// node) and time (yaml-cpp parses ~1 M nodes/s) where kMaxFileBytes alone
// would not: 64 MiB of "1," is 32 M nodes.
inline constexpr std::size_t kMaxNodes = std::size_t{1} << 22;

// Deepest nesting of mappings and sequences accepted (the root mapping is
// depth 1). Bounds recursion on recursive message types and on YAML alias
// cycles.
inline constexpr int kMaxNestingDepth = 64;

// Parses `text`, a YAML document (JSON is YAML, so it takes the same path),
// into `*msg`, which is cleared first. `source_name` prefixes every error.
//
// Mapping keys are proto field names (snake_case, as in the .proto); unknown
// keys are errors. Scalars map onto fields strictly: integers must be
// integers in range (decimal, optionally quoted as proto3 JSON writes
// int64), doubles must be finite, bools are `true`/`false`, enums are value
// names or numbers, bytes are base64, strings must be UTF-8. `~`/`null`/an
// empty value means "not set". Setting two members of one oneof, duplicate
// keys, nulls inside lists, more than one YAML document, more than kMaxNodes
// nodes and YAML aliases that expand the walk beyond twice the document's own
// node count are errors. An empty document yields an empty message.
//
// Returns OK, or InvalidArgument with the message
// "SOURCE:LINE:COL: FIELD.PATH: reason" (1-based; FIELD.PATH such as
// `units[3].params[2].shape[1]`, omitted with its colon for syntax errors
// and errors about the whole document); ResourceExhausted if memory runs
// out. On error `*msg` is left cleared. Never throws. Keeps no state, so any
// thread may call it.
absl::Status ParseMessageText(std::string_view text,
                              std::string_view source_name,
                              google::protobuf::Message* msg);

// Reads the file at `path` and parses it as ParseMessageText does, with the
// path as source name. Returns NotFound if the file does not exist,
// InvalidArgument if it cannot be read, is not a regular file, is larger than
// kMaxFileBytes, or does not parse. Never throws.
absl::Status LoadMessageFile(const std::string& path,
                             google::protobuf::Message* msg);

}  // namespace muonmesh::protoio
