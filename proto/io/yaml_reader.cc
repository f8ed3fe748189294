#include "proto/io/yaml_reader.h"

// Only yaml-cpp's event parser: its Node API costs ~350 bytes per node and
// its LoadAll loops forever on input such as "{a: 1}, b" (yaml-cpp 0.7).
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/exceptions.h>
#include <yaml-cpp/mark.h>
#include <yaml-cpp/parser.h>

#include <algorithm>
#include <cstdint>
#include <istream>
#include <streambuf>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muonmesh::protoio::internal {
namespace {

// Thrown through yaml-cpp (which is exception safe: it reports its own
// errors by throwing) to stop reading.
struct Stop {
  YAML::Mark mark;
  std::string reason;
  bool lookahead = false;
};

// How yaml-cpp's positions (Mark::pos, counted in the UTF-8 it decodes to)
// map to byte offsets in the text.
class Positions {
 public:
  explicit Positions(absl::string_view text) {
    // yaml-cpp's encoding detection (src/stream.cpp) picks UTF-8 and keeps
    // every byte unless the text starts with 00, FE, FF or a byte and 00
    // (UTF-16/32), or with the UTF-8 byte order mark, which it skips.
    const auto byte = [&](std::size_t i) {
      return i < text.size() ? static_cast<unsigned char>(text[i]) : 0x100;
    };
    exact_ = byte(0) != 0x00 && byte(0) != 0xFE && byte(0) != 0xFF && byte(1) != 0x00;
    if (byte(0) == 0xEF && byte(1) == 0xBB && byte(2) == 0xBF) skipped_ = 3;
  }

  // True if positions are byte offsets (less the byte order mark).
  bool exact() const { return exact_; }

  // The offset of `pos`, or, for UTF-16 and UTF-32 (where one to four
  // UTF-8 bytes stand for two or four bytes of text), a lower bound.
  std::size_t Offset(int pos) const {
    const auto p = static_cast<std::size_t>(std::max(pos, 0));
    return exact_ ? p + skipped_ : p * 2 / 3;
  }

 private:
  bool exact_ = true;
  std::size_t skipped_ = 0;
};

// Hands `text` to yaml-cpp in chunks, in place, and counts the non-blank
// bytes it reads ahead of the last node handed over (see yaml_reader.h).
// Throws Stop from underflow() once they exceed the limit: yaml-cpp reads
// through sgetn() on this buffer directly, so the exception reaches ReadYaml.
class LookaheadGuard : public std::streambuf {
 public:
  // The limit is at least one chunk: the first is read through
  // istream::get, which would swallow the exception.
  LookaheadGuard(absl::string_view text, const Positions& positions, std::size_t max_nonblank)
      : text_(text), positions_(positions), max_nonblank_(std::max(max_nonblank, kChunk)) {
    counted_.push_back(0);
  }

  // yaml-cpp handed over a node that starts at `mark`.
  void NodeAt(const YAML::Mark& mark) {
    last_node_ = mark;
    last_offset_ = positions_.Offset(mark.pos);
  }

 protected:
  int_type underflow() override {
    if (gptr() < egptr()) return traits_type::to_int_type(*gptr());
    if (served_ == text_.size()) return traits_type::eof();
    const std::size_t begin = served_;
    served_ = std::min(begin + kChunk, text_.size());
    Count(text_.substr(begin, served_ - begin));
    counted_.push_back(nonblank_);
    // Non-blank bytes from the start of the chunk holding the last node
    // (so up to kChunk more than from the node itself) to the end of what
    // yaml-cpp now has.
    const std::size_t first_chunk = std::min(last_offset_ / kChunk, counted_.size() - 1);
    if (nonblank_ - counted_[first_chunk] > max_nonblank_) {
      throw Stop{last_node_,
                 absl::StrCat("more than ", max_nonblank_,
                              " non-blank bytes of YAML after this point in one flow collection "
                              "([...] or {...}) or line, which yaml-cpp reads whole before "
                              "parsing; write it in block style, or the whole file as JSON"),
                 /*lookahead=*/true};
    }
    char* data = const_cast<char*>(text_.data());  // never written: a get area
    setg(data + begin, data + begin, data + served_);
    return traits_type::to_int_type(*gptr());
  }

 private:
  static constexpr std::size_t kChunk = 4096;

  // Counts bytes that may start a token: not blanks, not line breaks, not
  // on lines whose first non-blank byte is '#'.
  void Count(absl::string_view chunk) {
    for (const char c : chunk) {
      if (c == '\n') {
        line_blank_ = true;
        in_comment_line_ = false;
      } else if (in_comment_line_ || c == ' ' || c == '\t') {
        continue;
      } else if (line_blank_ && c == '#') {
        in_comment_line_ = true;
      } else {
        line_blank_ = false;
        ++nonblank_;
      }
    }
  }

  absl::string_view text_;
  const Positions& positions_;
  const std::size_t max_nonblank_;
  std::size_t served_ = 0;                 // bytes handed to yaml-cpp
  std::size_t nonblank_ = 0;               // counted in them
  std::vector<std::size_t> counted_;       // nonblank_ before chunk k
  bool line_blank_ = true;                 // only blanks so far on this line
  bool in_comment_line_ = false;
  YAML::Mark last_node_;                   // initially 1:1
  std::size_t last_offset_ = 0;
};

Location LocationOf(const YAML::Mark& mark) {
  return {static_cast<std::uint32_t>(std::max(mark.line, 0)),
          static_cast<std::uint32_t>(std::max(mark.column, 0))};
}

// Builds the Document from yaml-cpp's parse events; throws Stop when a limit
// refuses a node.
class DocumentBuilder : public YAML::EventHandler {
 public:
  DocumentBuilder(absl::string_view text, const Positions& positions, const ReadLimits& limits,
                  LookaheadGuard* guard, Document* doc)
      : text_(text), positions_(positions), guard_(*guard), tree_(doc, text.size(), TreeBuilder::kYaml, limits) {}

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    Anchor(anchor, tree_.next_index());
    Check(tree_.Null(At(mark)), mark);
  }
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    // yaml-cpp numbers anchors 1, 2, ... in order of definition and rejects
    // undefined aliases itself; check anyway rather than trust.
    if (anchor == 0 || anchor > anchors_.size()) {
      throw YAML::ParserException(mark, "alias to an undefined anchor");
    }
    Check(tree_.Alias(At(mark), anchors_[anchor - 1]), mark);
  }
  void OnScalar(const YAML::Mark& mark, const std::string& tag, YAML::anchor_t anchor,
                const std::string& value) override {
    Anchor(anchor, tree_.next_index());
    const bool plain = tag == "?";  // yaml-cpp's tag for plain scalars; "!" if quoted
    // Most scalars are their source text (plain, or quoted without escapes
    // or line folding): point at it rather than copy.
    if (positions_.exact()) {
      std::size_t offset = positions_.Offset(mark.pos);
      if (!plain && offset < text_.size() && (text_[offset] == '"' || text_[offset] == '\'')) {
        ++offset;
      }
      if (text_.substr(std::min(offset, text_.size()), value.size()) == value) {
        Check(tree_.SourceScalar(At(mark), offset, value.size(), plain), mark);
        return;
      }
    }
    Check(tree_.CopiedScalar(At(mark), value, plain), mark);
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    Anchor(anchor, tree_.next_index());
    Check(tree_.Open(At(mark), Node::kSequence), mark);
  }
  void OnSequenceEnd() override { tree_.Close(); }
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    Anchor(anchor, tree_.next_index());
    Check(tree_.Open(At(mark), Node::kMap), mark);
  }
  void OnMapEnd() override { tree_.Close(); }

 private:
  // Every node event passes here first: it moves the read-ahead window.
  Location At(const YAML::Mark& mark) {
    guard_.NodeAt(mark);
    return LocationOf(mark);
  }

  void Check(bool ok, const YAML::Mark& mark) {
    if (!ok) throw Stop{mark, tree_.error()};
  }

  void Anchor(YAML::anchor_t anchor, std::uint32_t index) {
    if (anchor == YAML::NullAnchor) return;
    if (anchors_.size() < anchor) anchors_.resize(anchor, 0);
    anchors_[anchor - 1] = index;
  }

  absl::string_view text_;
  const Positions& positions_;
  LookaheadGuard& guard_;
  TreeBuilder tree_;
  std::vector<std::uint32_t> anchors_;  // anchor id - 1 -> node index
};

// Stops at the start of a second document, whose mark it reports; reading
// that document would only cost time.
class SecondDocumentProbe : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override {
    throw Stop{mark, "content after the end of the document (one YAML document per file)"};
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

absl::Status ErrorAt(absl::string_view source, const YAML::Mark& mark, absl::string_view reason) {
  const Location where = LocationOf(mark);
  return LocatedError(source, mark.is_null() ? nullptr : &where, "", reason);
}

}  // namespace

absl::Status ReadYaml(absl::string_view text, absl::string_view source, const ReadLimits& limits,
                      Document* doc, bool* lookahead_exceeded) {
  *lookahead_exceeded = false;
  const Positions positions(text);
  LookaheadGuard guard(text, positions, limits.max_yaml_lookahead);
  std::istream stream(&guard);
  try {
    YAML::Parser parser(stream);
    DocumentBuilder builder(text, positions, limits, &guard, doc);
    if (!parser.HandleNextDocument(builder)) return absl::OkStatus();  // no document
    // One more document at most: yaml-cpp 0.7 can report "documents" forever
    // after a stray token, as in "{a: 1}, b".
    SecondDocumentProbe probe;
    parser.HandleNextDocument(probe);
  } catch (const Stop& stop) {
    *lookahead_exceeded = stop.lookahead;
    return ErrorAt(source, stop.mark, stop.reason);
  } catch (const YAML::DeepRecursion& e) {
    return ErrorAt(source, e.mark,
                   absl::StrCat("nesting deeper than ", limits.max_depth - 1, " levels"));
  } catch (const YAML::Exception& e) {
    return ErrorAt(source, e.mark, absl::StrCat("syntax error: ", e.msg));
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::protoio::internal
