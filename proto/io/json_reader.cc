#include "proto/io/json_reader.h"

#include <memory>
#include <new>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/base/text.h"
#include "proto/io/json_document.h"

namespace muonmesh::protoio::internal {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}


// A recursive-descent reader. Recursion is bounded by ReadLimits::max_depth,
// which TreeBuilder::Open enforces before each level is entered.
class JsonReader {
 public:
  JsonReader(absl::string_view text, absl::string_view source, const ReadLimits& limits,
             Document* doc)
      : text_(text),
        source_(source),
        strict_(limits.strict_json),
        tree_(doc, text.size(), TreeBuilder::kJson, limits) {}

  JsonVerdict Read(absl::Status* error) {
    if (!SkipSpace() || !Value() || !SkipSpace()) {
      *error = error_;
      return verdict_;
    }
    if (pos_ < text_.size()) {
      Syntax("content after the JSON value");
      *error = error_;
      return verdict_;
    }
    return JsonVerdict::kRead;
  }

 private:
  Location Here() const {
    return {line_, static_cast<std::uint32_t>(pos_ - line_start_)};
  }

  // Each of these returns false after recording why.
  bool Syntax(absl::string_view reason) {
    const Location here = Here();
    verdict_ = JsonVerdict::kNotJson;
    error_ = LocatedError(source_, &here, "", absl::StrCat("syntax error: ", reason, " (JSON)"));
    return false;
  }
  bool Refused(Location where) {
    verdict_ = JsonVerdict::kRefused;
    error_ = LocatedError(source_, &where, "", tree_.error());
    return false;
  }

  // Skips blanks, line breaks and comments. A '\r' must begin a "\r\n":
  // yaml-cpp does not take a lone one for a line break, so neither do we.
  bool SkipSpace() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == ' ' || c == '\t') {
        ++pos_;
      } else if (c == '\n') {
        ++pos_;
        ++line_;
        line_start_ = pos_;
      } else if (c == '\r') {
        if (pos_ + 1 >= text_.size() || text_[pos_ + 1] != '\n') {
          return Syntax("carriage return without a line feed");
        }
        ++pos_;
      } else if (c == '#' && !strict_ && (pos_ == 0 || text_[pos_ - 1] == ' ' || text_[pos_ - 1] == '\t' ||
                              text_[pos_ - 1] == '\n')) {
        const std::size_t eol = text_.find('\n', pos_);
        pos_ = eol == absl::string_view::npos ? text_.size() : eol;
      } else {
        break;
      }
    }
    return true;
  }

  bool Value() {
    if (pos_ >= text_.size()) return Syntax("the input ends where a value should be");
    switch (text_[pos_]) {
      case '{':
        return Container(Node::kMap);
      case '[':
        return Container(Node::kSequence);
      case '"':
        return String();
      case 't':
        return Literal("true");
      case 'f':
        return Literal("false");
      case 'n':
        return Literal("null");
      default:
        if (text_[pos_] == '-' || IsDigit(text_[pos_])) return Number();
        return Syntax(absl::StrCat("expected a value, got '", absl::string_view(&text_[pos_], 1),
                                   "'"));
    }
  }

  // An object or an array: '{' or '[' at pos_.
  bool Container(Node::Kind kind) {
    const bool is_map = kind == Node::kMap;
    const char close = is_map ? '}' : ']';
    const Location where = Here();
    if (!tree_.Open(where, kind)) return Refused(where);
    ++pos_;
    if (!SkipSpace()) return false;
    if (pos_ < text_.size() && text_[pos_] == close) {
      ++pos_;
      tree_.Close();
      return true;
    }
    while (true) {
      if (is_map) {
        if (pos_ >= text_.size() || text_[pos_] != '"') {
          return Syntax("expected a string in double quotes as the key");
        }
        if (!String() || !SkipSpace()) return false;
        if (pos_ >= text_.size() || text_[pos_] != ':') return Syntax("expected ':' after the key");
        ++pos_;
        if (!SkipSpace()) return false;
      }
      if (!Value() || !SkipSpace()) return false;
      if (pos_ >= text_.size()) {
        return Syntax(absl::StrCat("the input ends inside ", is_map ? "an object" : "an array"));
      }
      if (text_[pos_] == close) {
        ++pos_;
        tree_.Close();
        return true;
      }
      if (text_[pos_] != ',') {
        return Syntax(absl::StrCat("expected ',' or '", absl::string_view(&close, 1), "'"));
      }
      ++pos_;
      if (!SkipSpace()) return false;
    }
  }

  // A string: '"' at pos_. Values without escapes stay in the source text;
  // the others are decoded into the arena.
  bool String() {
    const Location where = Here();
    const std::size_t begin = ++pos_;
    while (pos_ < text_.size()) {
      const auto c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        if (!tree_.SourceScalar(where, begin, pos_ - 1 - begin, /*plain=*/false)) {
          return Refused(where);
        }
        return true;
      }
      if (c == '\\') return EscapedString(where, begin);
      if (c < 0x20) return Syntax("control character in a string");
      if (!Utf8()) return false;
    }
    return Syntax("the input ends inside a string");
  }

  // Steps over one character of a string: a byte, or in strict mode a
  // whole UTF-8 sequence, refusing an invalid one.
  bool Utf8() {
    if (!strict_ || static_cast<unsigned char>(text_[pos_]) < 0x80) {
      ++pos_;
      return true;
    }
    const std::size_t n = ::muonmesh::text::Utf8SequenceLength(std::string_view(text_.data(), text_.size()), pos_);
    if (n == 0) return Syntax("invalid UTF-8 in a string");
    pos_ += n;
    return true;
  }

  bool EscapedString(Location where, std::size_t begin) {
    std::string& out = tree_.BeginArenaScalar();
    out.append(text_.data() + begin, pos_ - begin);
    while (pos_ < text_.size()) {
      const auto c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        if (!tree_.EndArenaScalar(where, /*plain=*/false)) return Refused(where);
        return true;
      }
      if (c < 0x20) return Syntax("control character in a string");
      if (c != '\\') {
        const std::size_t from = pos_;
        if (!Utf8()) return false;
        out.append(text_.data() + from, pos_ - from);
        continue;
      }
      if (pos_ + 1 >= text_.size()) break;
      const char escape = text_[pos_ + 1];
      pos_ += 2;
      switch (escape) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          pos_ -= 2;
          std::uint32_t code_point = 0;
          if (!UnicodeEscape(&code_point)) return false;
          ::muonmesh::text::AppendUtf8(code_point, &out);
          break;
        }
        default:
          pos_ -= 2;
          return Syntax("unknown escape in a string");
      }
    }
    return Syntax("the input ends inside a string");
  }

  // "\uXXXX" at pos_, or a surrogate pair "\uD8XX\uDCXX". Errors point at
  // the escape.
  bool UnicodeEscape(std::uint32_t* code_point) {
    const std::size_t start = pos_;
    std::uint32_t high = 0;
    if (!Hex4(&high)) return false;
    if (high < 0xD800 || high > 0xDFFF) {
      *code_point = high;
      return true;
    }
    std::uint32_t low = 0;
    if (high > 0xDBFF || pos_ + 1 >= text_.size() || text_[pos_] != '\\' ||
        text_[pos_ + 1] != 'u' || !Hex4(&low) || low < 0xDC00 || low > 0xDFFF) {
      pos_ = start;
      return Syntax("unpaired surrogate in a \\u escape");
    }
    *code_point = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
    return true;
  }

  // "\uXXXX" at pos_.
  bool Hex4(std::uint32_t* value) {
    if (text_.size() - pos_ < 6) return Syntax("truncated \\u escape");
    *value = 0;
    for (std::size_t i = pos_ + 2; i < pos_ + 6; ++i) {
      const int digit = HexValue(text_[i]);
      if (digit < 0) return Syntax("bad \\u escape");
      *value = *value * 16 + static_cast<std::uint32_t>(digit);
    }
    pos_ += 6;
    return true;
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, kept as written: the
  // filler parses it for the field's type, as it does YAML's plain scalars.
  bool Number() {
    const Location where = Here();
    const std::size_t begin = pos_;
    if (text_[pos_] == '-') ++pos_;
    if (pos_ < text_.size() && text_[pos_] == '0') {
      ++pos_;
      if (pos_ < text_.size() && IsDigit(text_[pos_])) {
        return Syntax("a number with a leading zero");
      }
    } else if (!Digits()) {
      return Syntax("bad number");
    }
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      if (!Digits()) return Syntax("bad number");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (!Digits()) return Syntax("bad number");
    }
    if (!tree_.SourceScalar(where, begin, pos_ - begin, /*plain=*/true)) return Refused(where);
    return true;
  }

  // One or more digits at pos_.
  bool Digits() {
    const std::size_t begin = pos_;
    while (pos_ < text_.size() && IsDigit(text_[pos_])) ++pos_;
    return pos_ > begin;
  }

  bool Literal(absl::string_view word) {
    const Location where = Here();
    if (text_.substr(pos_, word.size()) != word) {
      return Syntax(absl::StrCat("expected ", word));
    }
    const bool ok = word == "null" ? tree_.Null(where)
                                   : tree_.SourceScalar(where, pos_, word.size(), /*plain=*/true);
    if (!ok) return Refused(where);
    pos_ += word.size();
    return true;
  }

  absl::string_view text_;
  absl::string_view source_;
  bool strict_;
  TreeBuilder tree_;
  std::size_t pos_ = 0;
  std::uint32_t line_ = 0;
  std::size_t line_start_ = 0;
  JsonVerdict verdict_ = JsonVerdict::kNotJson;
  absl::Status error_;
};

}  // namespace

bool LooksLikeJson(absl::string_view text) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    const char c = text[pos];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++pos;
    } else if (c == '#') {
      pos = text.find('\n', pos);
      if (pos == absl::string_view::npos) return false;
    } else {
      return c == '{' || c == '[';
    }
  }
  return false;
}

JsonVerdict ReadJson(absl::string_view text, absl::string_view source, const ReadLimits& limits,
                     Document* doc, absl::Status* error) {
  return JsonReader(text, source, limits, doc).Read(error);
}

}  // namespace muonmesh::protoio::internal

namespace muonmesh::protoio {

absl::StatusOr<std::unique_ptr<JsonDocument>> ReadJsonDocument(absl::string_view text,
                                                               absl::string_view source,
                                                               const JsonOptions& options) {
  internal::ReadLimits limits;
  limits.max_nodes = options.max_nodes;
  limits.max_depth = options.max_depth;
  limits.strict_json = true;
  try {
    auto doc = std::make_unique<JsonDocument>(text);
    absl::Status error;
    if (internal::ReadJson(text, source, limits, doc.get(), &error) != internal::JsonVerdict::kRead) {
      return error;
    }
    return doc;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(source, ": out of memory reading ", text.size(), " bytes of JSON"));
  }
}

bool IsJsonString(const JsonNode& node) { return node.is_scalar() && !node.plain; }

const char* JsonKindName(const JsonDocument& doc, const JsonNode& node) {
  if (node.is_map()) return "an object";
  if (node.is_sequence()) return "an array";
  if (node.is_null()) return "null";
  if (IsJsonString(node)) return "a string";
  const absl::string_view value = doc.Scalar(node);
  return value == "true" || value == "false" ? "a boolean" : "a number";
}

}  // namespace muonmesh::protoio
