// The parsed form of one YAML or JSON document, shared by the two readers
// (json_reader.h, yaml_reader.h) and the message filler (message_file.cc).
// Internal to proto/io: callers use message_file.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/io/message_file.h"

namespace muonmesh::protoio::internal {

// Where a node starts: 0-based line and byte column, as yaml-cpp counts them
// (lines end at '\n'; a '\r' before it is the line's last column).
struct Location {
  std::uint32_t line = 0;
  std::uint32_t column = 0;
};

// Limits a reader enforces while it reads, so that no input makes it build
// more than they allow. Tests shrink them.
struct ReadLimits {
  // Most nodes in one document; TreeBuilder also allows at most one per
  // `bytes_per_node` bytes of input (plus kNodeAllowance).
  std::size_t max_nodes = kMaxNodes;
  // Deepest container accepted while reading (the root is depth 1). One
  // more than the filler accepts, so that a document just one level too
  // deep is reported by the filler, which knows the field path.
  int max_depth = kMaxNestingDepth + 1;
  // YAML only: the most non-blank bytes yaml-cpp may read ahead of the last
  // node it handed over (see yaml_reader.h); 4096 at least.
  std::size_t max_yaml_lookahead = kMaxYamlLookahead;
  // JSON only: strict RFC 8259 (no comments, every string valid UTF-8), as
  // json_document.h's formats want, or YAML comments read as blanks and
  // string bytes left to the filler, as job files and specs are read.
  bool strict_json = false;
};

inline constexpr std::size_t kNodeAllowance = 1024;

// JSON never needs more than one node per two bytes: a scalar takes a byte
// and, but for the last in its container, a ','; a container takes two
// brackets; a key, two quotes and a ':'. So this only restates kMaxNodes
// for smaller inputs.
inline constexpr std::size_t kJsonBytesPerNode = 2;
// YAML through yaml-cpp costs more per node: besides our 20 bytes, its
// scanner keeps every indentation marker it ever made until the document
// ends (~48 bytes each, one per block collection or potential key at a
// deeper column, so about one per node). Honest YAML takes 7 bytes a node
// or more (a spec line "- {name: w, shape: [4, 4], optimizer: muon}" 5);
// only YAML's empty entries ("{,,,}" makes two nulls per byte, "-\n" one
// per two) and contrived lists get near one per four.
inline constexpr std::size_t kYamlBytesPerNode = 4;

// One node, 20 bytes. Nodes are stored in document order (pre-order), so a
// container's children are the nodes after it up to `end`, and a document
// needs no per-node child lists.
struct Node {
  enum Kind : std::uint8_t { kNull, kScalar, kSequence, kMap, kAlias };

  bool is_null() const { return kind == kNull; }
  bool is_scalar() const { return kind == kScalar; }
  bool is_sequence() const { return kind == kSequence; }
  bool is_map() const { return kind == kMap; }
  bool is_container() const { return kind == kSequence || kind == kMap; }

  Location where;
  // kScalar: the value is bytes [offset, offset + size) of the source text,
  //   or of the document's arena if `in_arena` (escaped or folded values).
  // kSequence, kMap: `size` is the index one past the container's last
  //   descendant. Mapping children alternate key, value.
  // kAlias: `offset` is the index of the anchored node (which may be an
  //   ancestor: YAML lets an alias sit inside its own anchor).
  std::uint32_t offset = 0;
  std::uint32_t size = 0;
  Kind kind = kNull;
  // A scalar written without quotes or tag: only these may be numbers,
  // booleans or null.
  bool plain = false;
  bool in_arena = false;
};

// A parsed document: its nodes, and the text their scalars point into.
// Filled by one reader through TreeBuilder, then only read. Not thread-safe
// while being filled; the source text must outlive it.
class Document {
 public:
  explicit Document(absl::string_view source) : source_(source) {}
  Document(const Document&) = delete;
  Document& operator=(const Document&) = delete;

  // The root node's index, when size() > 0.
  static constexpr std::uint32_t kRoot = 0;

  std::uint32_t size() const { return static_cast<std::uint32_t>(nodes_.size()); }
  const Node& operator[](std::uint32_t index) const { return nodes_[index]; }

  // The index of the node an alias names; other nodes name themselves.
  std::uint32_t Resolve(std::uint32_t index) const {
    const Node& node = nodes_[index];
    return node.kind == Node::kAlias ? node.offset : index;
  }
  // The index just past `index` and its descendants: its next sibling.
  std::uint32_t Next(std::uint32_t index) const {
    const Node& node = nodes_[index];
    return node.is_container() ? node.size : index + 1;
  }
  absl::string_view Scalar(const Node& node) const {
    const absl::string_view text = node.in_arena ? absl::string_view(arena_) : source_;
    return text.substr(node.offset, node.size);
  }
  absl::string_view source() const { return source_; }

  // Bytes this document holds beyond the source text.
  std::size_t MemoryBytes() const;

 private:
  friend class TreeBuilder;

  absl::string_view source_;
  // A deque, not a vector: growing never copies the nodes (a vector's
  // doubling would briefly hold 3x their size) and indices stay valid.
  std::deque<Node> nodes_;
  std::string arena_;  // scalar values that differ from their source text
};

// Appends nodes to a Document in document order and enforces ReadLimits as
// it goes: each call that would exceed a limit returns false and leaves the
// reason in error(), and the reader stops there. Single-threaded.
class TreeBuilder {
 public:
  enum Format { kJson, kYaml };

  // Allows limits.max_nodes nodes, and at most one per kJsonBytesPerNode or
  // kYamlBytesPerNode of the `text_bytes` of input (plus kNodeAllowance).
  TreeBuilder(Document* doc, std::size_t text_bytes, Format format, const ReadLimits& limits);

  // A scalar whose value is source text [offset, offset + size).
  bool SourceScalar(Location where, std::size_t offset, std::size_t size, bool plain);
  // A scalar whose value differs from its source text; copied.
  bool CopiedScalar(Location where, absl::string_view value, bool plain);
  // A scalar written into the arena in pieces: BeginArenaScalar, then
  // arena() appends, then EndArenaScalar. Saves a copy for escaped strings.
  std::string& BeginArenaScalar();
  bool EndArenaScalar(Location where, bool plain);
  bool Null(Location where);
  bool Alias(Location where, std::uint32_t target);
  bool Open(Location where, Node::Kind kind);  // kSequence or kMap
  void Close();

  // The index the next node will get.
  std::uint32_t next_index() const { return doc_.size(); }
  int depth() const { return static_cast<int>(open_.size()); }
  const std::string& error() const { return error_; }

 private:
  Node* Add(Location where, Node::Kind kind);

  Document& doc_;
  const ReadLimits limits_;
  const std::size_t text_bytes_;
  const Format format_;
  const std::size_t max_nodes_;
  std::vector<std::uint32_t> open_;  // containers not yet closed
  std::size_t arena_start_ = 0;      // of the scalar being written
  std::string error_;
};

// "SOURCE:LINE:COL: PATH: reason" (1-based), without ": PATH" when `path` is
// empty and without ":LINE:COL" when `where` is null.
absl::Status LocatedError(absl::string_view source, const Location* where,
                          absl::string_view path, absl::string_view reason);

}  // namespace muonmesh::protoio::internal
