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

// Most nodes (mappings, sequences, scalars, nulls, aliases) one input may
// hold. An input may also hold at most one node per 2 bytes if JSON (which
// any JSON document meets) and one per 4 bytes if YAML (plus 1024 either
// way): yaml-cpp costs ~70 bytes a node, and only YAML's empty entries
// ("{,,,}", "-\n-\n") and contrived lists ("- 1\n- 2\n" is the edge) come
// that close. A model spec takes 9 nodes a tensor (12 for an expert stack),
// 5 a unit: the README's 1,000,000 tensors fit, and so does their file, in
// JSON or block YAML, at up to ~67 bytes a tensor (measured by
// parse_memory_test's stress test: compact JSON, 67.0 MB, 3.1 s and
// 430 MB; block YAML with one flow mapping a tensor, 66.9 MB, 25 s, 430 MB).
inline constexpr std::size_t kMaxNodes = std::size_t{1} << 24;

// Deepest nesting of mappings and sequences accepted (the root mapping is
// depth 1), checked while reading and again while filling (YAML aliases
// can nest a document deeper than it is written). Bounds recursion on
// recursive message types and on YAML alias cycles.
inline constexpr int kMaxNestingDepth = 64;

// YAML only (JSON has a reader of its own): yaml-cpp reads some stretches
// of a document whole before handing over any node of them, at up to ~250
// bytes of memory a byte: a flow collection ([...] or {...}) that could be
// a mapping key (at the start of the document or of a "- " entry, or inside
// a flow sequence), and whatever follows a would-be key on its line. Such a
// stretch, and any single scalar, may hold at most this many non-blank
// bytes outside comment lines (~15 MB of yaml-cpp's memory). A flow
// collection after "key: " is read as it goes and is not limited; neither is
// block style, nor JSON.
inline constexpr std::size_t kMaxYamlLookahead = std::size_t{1} << 16;

// What parsing costs. ParseMessageText on S bytes allocates at most about
// kParseBytesPerInputByte * S + kParseFixedBytes bytes, the message it fills
// included; LoadMessageFile adds the S bytes of the text. Measured worst
// cases (parse_memory_test, its stress tests up to S = 64 MiB): 22.3 * S
// for a JSON list of int64 (20 bytes a node, then the repeated field's
// doubling), 17.3 * S for YAML's densest block lists (yaml-cpp keeps ~48
// bytes for every block collection and potential key until the document
// ends); real specs 5-6.5 * S; yaml-cpp's read-ahead 15 MB at most; at
// S = 64 MiB kMaxNodes caps JSON at 5.2 * S and YAML at 17.2 * S. Time is
// linear: ~20 MB/s for JSON, ~0.7 M nodes/s for YAML.
inline constexpr std::size_t kParseBytesPerInputByte = 24;
inline constexpr std::size_t kParseFixedBytes = std::size_t{32} << 20;

// Parses `text`, one YAML or JSON document, into `*msg`, which is cleared
// first. `source_name` prefixes every error. A document whose first
// character (past blanks and comments) is '{' or '[' is read as JSON by a
// reader of our own; what is not JSON after all (YAML's flow style, "{a:
// 1}", or a mistake) and every other document goes to yaml-cpp. JSON is
// YAML, and both paths give the same result for it.
//
// Mapping keys are proto field names (snake_case, as in the .proto); unknown
// keys are errors. Scalars map onto fields strictly: integers must be
// integers in range, written without quotes ("4" is a string, an error in a
// numeric field; map keys may be quoted, as JSON quotes every key), doubles
// must be finite and unquoted, bools are `true`/`false`, enums are value
// names or numbers, bytes are base64, strings must be UTF-8.
// `~`/`null`/an empty value means "not set". Setting two members of one
// oneof, duplicate keys, nulls inside lists, more than one YAML document, an
// empty document (nothing but blanks, comments, "---" or a null: "{}" is
// the empty message), exceeding a limit above, and YAML aliases that expand
// the walk beyond twice the document's own node count are errors. Limits
// are enforced while reading, before the input is read in full.
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
