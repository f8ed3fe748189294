#include "proto/io/document.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace muonmesh::protoio::internal {

static_assert(sizeof(Node) <= 20, "kMaxNodes and the memory bound assume 20-byte nodes");

std::size_t Document::MemoryBytes() const {
  return nodes_.size() * sizeof(Node) + arena_.capacity();
}

namespace {

std::size_t BytesPerNode(TreeBuilder::Format format) {
  return format == TreeBuilder::kJson ? kJsonBytesPerNode : kYamlBytesPerNode;
}

}  // namespace

TreeBuilder::TreeBuilder(Document* doc, std::size_t text_bytes, Format format,
                         const ReadLimits& limits)
    : doc_(*doc),
      limits_(limits),
      text_bytes_(text_bytes),
      format_(format),
      max_nodes_(std::min(limits.max_nodes, text_bytes / BytesPerNode(format) + kNodeAllowance)) {}

Node* TreeBuilder::Add(Location where, Node::Kind kind) {
  if (doc_.nodes_.size() >= max_nodes_) {
    error_ = absl::StrCat("more than ", max_nodes_, " nodes");
    if (max_nodes_ < limits_.max_nodes) {
      absl::StrAppend(&error_, ", the most ", text_bytes_, " bytes of ",
                      format_ == kJson ? "JSON" : "YAML", " may hold (one per ",
                      BytesPerNode(format_), " bytes, plus ", kNodeAllowance, ")");
    }
    return nullptr;
  }
  Node& node = doc_.nodes_.emplace_back();
  node.where = where;
  node.kind = kind;
  return &node;
}

bool TreeBuilder::SourceScalar(Location where, std::size_t offset, std::size_t size, bool plain) {
  Node* node = Add(where, Node::kScalar);
  if (node == nullptr) return false;
  // Both fit: the source is at most kMaxFileBytes.
  node->offset = static_cast<std::uint32_t>(offset);
  node->size = static_cast<std::uint32_t>(size);
  node->plain = plain;
  return true;
}

bool TreeBuilder::CopiedScalar(Location where, absl::string_view value, bool plain) {
  BeginArenaScalar().append(value.data(), value.size());
  return EndArenaScalar(where, plain);
}

std::string& TreeBuilder::BeginArenaScalar() {
  arena_start_ = doc_.arena_.size();
  return doc_.arena_;
}

bool TreeBuilder::EndArenaScalar(Location where, bool plain) {
  Node* node = Add(where, Node::kScalar);
  if (node == nullptr) return false;
  node->offset = static_cast<std::uint32_t>(arena_start_);
  node->size = static_cast<std::uint32_t>(doc_.arena_.size() - arena_start_);
  node->plain = plain;
  node->in_arena = true;
  return true;
}

bool TreeBuilder::Null(Location where) { return Add(where, Node::kNull) != nullptr; }

bool TreeBuilder::Alias(Location where, std::uint32_t target) {
  Node* node = Add(where, Node::kAlias);
  if (node == nullptr) return false;
  node->offset = target;
  return true;
}

bool TreeBuilder::Open(Location where, Node::Kind kind) {
  if (depth() >= limits_.max_depth) {
    error_ = absl::StrCat("nesting deeper than ", limits_.max_depth - 1, " levels");
    return false;
  }
  const std::uint32_t index = next_index();
  if (Add(where, kind) == nullptr) return false;
  open_.push_back(index);
  return true;
}

void TreeBuilder::Close() {
  // Readers close only what they opened; an extra Close is a reader bug,
  // and ignoring it keeps the tree well formed.
  if (open_.empty()) return;
  doc_.nodes_[open_.back()].size = next_index();
  open_.pop_back();
}

absl::Status LocatedError(absl::string_view source, const Location* where,
                          absl::string_view path, absl::string_view reason) {
  std::string text(source);
  if (where != nullptr) absl::StrAppend(&text, ":", where->line + 1, ":", where->column + 1);
  text += ": ";
  if (!path.empty()) absl::StrAppend(&text, path, ": ");
  text.append(reason.data(), reason.size());
  return absl::InvalidArgumentError(text);
}

}  // namespace muonmesh::protoio::internal
