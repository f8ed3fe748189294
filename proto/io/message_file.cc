#include "proto/io/message_file.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/charconv.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "proto/io/document.h"
#include "proto/io/json_reader.h"
#include "proto/io/yaml_reader.h"
#include "core/base/status_macros.h"
#include "core/base/text.h"

namespace muonmesh::protoio {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumValueDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::OneofDescriptor;
using google::protobuf::Reflection;
using internal::Document;
using internal::Location;
using internal::Node;

// Scalar values longer than this are cut in error messages, so one bad
// 10 MB string does not produce a 10 MB error.
constexpr std::size_t kMaxQuotedBytes = 48;

std::string Quote(absl::string_view s) {
  if (s.size() <= kMaxQuotedBytes) return absl::StrCat("\"", absl::CHexEscape(s), "\"");
  return absl::StrCat("\"", absl::CHexEscape(s.substr(0, kMaxQuotedBytes)), "...\"");
}

std::string TypeName(const FieldDescriptor& field) {
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return std::string(field.message_type()->full_name());
    case FieldDescriptor::CPPTYPE_ENUM:
      return absl::StrCat("enum ", field.enum_type()->full_name());
    default:
      return field.type_name();
  }
}

std::size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1,
                         diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The closest of `candidates` to `name` within edit distance 2, or "".
// Ties go to the earliest candidate (declaration order), which keeps error
// messages stable.
template <typename Names>
std::string ClosestName(absl::string_view name, const Names& candidates) {
  std::string best;
  std::size_t best_distance = 3;
  // Bounding by length first keeps this linear for long garbage keys.
  for (const std::string& candidate : candidates) {
    const std::size_t length_gap = candidate.size() > name.size()
                                       ? candidate.size() - name.size()
                                       : name.size() - candidate.size();
    if (length_gap >= best_distance) continue;
    const std::size_t d = EditDistance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  return best;
}

std::string UnknownFieldReason(const Descriptor& type, absl::string_view key) {
  std::string reason =
      absl::StrCat("unknown field ", Quote(key), " in ", type.full_name());
  std::vector<std::string> names;
  names.reserve(type.field_count());
  for (int i = 0; i < type.field_count(); ++i) {
    const FieldDescriptor* field = type.field(i);
    // camelCase (proto3 JSON) is not accepted, to keep one spelling per
    // field in job files; point the writer at the real name instead.
    if (field->json_name() == key) {
      return absl::StrCat(reason, "; did you mean \"", field->name(), "\"?");
    }
    names.push_back(field->name());
  }
  const std::string suggestion = ClosestName(key, names);
  if (!suggestion.empty()) absl::StrAppend(&reason, "; did you mean \"", suggestion, "\"?");
  return reason;
}


// A quoted scalar in a numeric field is a type error, as in a typed
// language: "4" is a string. (proto3 JSON quotes int64s, but job files and
// specs are written by hand, where quotes are a mistake worth naming.)
std::string QuotedNumberReason(absl::string_view what, absl::string_view type_name,
                               absl::string_view text) {
  return absl::StrCat("expected ", what, " (", type_name, "), got the string ", Quote(text),
                      "; write numbers without quotes");
}

// Parses a decimal integer `[-+]?[0-9]+` in [-max_negative, max_positive]
// into its two's complement bits. Working on the magnitude in uint64 keeps
// every int32/int64/uint32/uint64 bound representable.
// Returns "" on success, else the reason.
std::string ParseInteger(absl::string_view text, absl::string_view type_name,
                         std::uint64_t max_positive, std::uint64_t max_negative,
                         std::uint64_t* bits) {
  absl::string_view digits = text;
  bool negative = false;
  if (!digits.empty() && (digits.front() == '-' || digits.front() == '+')) {
    negative = digits.front() == '-';
    digits.remove_prefix(1);
  }
  const bool all_digits =
      !digits.empty() && std::all_of(digits.begin(), digits.end(), [](char c) {
        return c >= '0' && c <= '9';
      });
  if (!all_digits) {
    return absl::StrCat("expected an integer (", type_name, "), got ", Quote(text));
  }
  std::uint64_t magnitude = 0;
  for (const char c : digits) {
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (magnitude > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) {
      return absl::StrCat(Quote(text), " is out of range for ", type_name);
    }
    magnitude = magnitude * 10 + digit;
  }
  if (magnitude > (negative ? max_negative : max_positive)) {
    return absl::StrCat(Quote(text), " is out of range for ", type_name);
  }
  *bits = negative ? ~magnitude + 1 : magnitude;
  return "";
}

// Parses a finite double. Accepts what JSON and YAML 1.2 write for finite
// numbers (plus a leading '+'); rejects .inf/.nan, hex and overflow.
std::string ParseDouble(absl::string_view text, absl::string_view type_name,
                        double max_abs, double* out) {
  absl::string_view body = text;
  if (!body.empty() && body.front() == '+') body.remove_prefix(1);
  // absl::from_chars would also take "inf"/"nan"; require a digit up front
  // (after an optional sign and '.') so those never parse.
  const std::size_t first = (!body.empty() && body.front() == '-') ? 1 : 0;
  const std::size_t digit_at = (body.size() > first && body[first] == '.') ? first + 1 : first;
  if (body.size() <= digit_at || body[digit_at] < '0' || body[digit_at] > '9') {
    return absl::StrCat("expected a finite number (", type_name, "), got ", Quote(text));
  }
  double value = 0;
  const absl::from_chars_result result =
      absl::from_chars(body.data(), body.data() + body.size(), value);
  if (result.ptr != body.data() + body.size() ||
      (result.ec != std::errc() && result.ec != std::errc::result_out_of_range)) {
    return absl::StrCat("expected a finite number (", type_name, "), got ", Quote(text));
  }
  // A range error is either underflow, where absl gives +-0 (the right
  // reading of "1e-400"), or overflow, where it gives +-DBL_MAX; the tests
  // pin both behaviours.
  const bool overflow = result.ec == std::errc::result_out_of_range && value != 0;
  if (overflow || !std::isfinite(value) || std::fabs(value) > max_abs) {
    return absl::StrCat(Quote(text), " is out of range for ", type_name);
  }
  *out = value;
  return "";
}

// Appends one step to a field path for as long as it is alive: a field name
// (after a '.'), an index "[3]" or a map key "[\"k\"]".
// Each of these sets a singular scalar field from `text`, or appends it to
// a repeated one, and returns "" or why `text` is no value of the field.
std::string SetInteger(absl::string_view text, const FieldDescriptor& field, Message* msg) {
  const Reflection& r = *msg->GetReflection();
  const bool repeated = field.is_repeated();
  std::uint64_t bits = 0;
  std::string why;
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      why = ParseInteger(text, "int32", INT32_MAX, std::uint64_t{INT32_MAX} + 1, &bits);
      if (!why.empty()) break;
      repeated ? r.AddInt32(msg, &field, static_cast<std::int32_t>(bits))
               : r.SetInt32(msg, &field, static_cast<std::int32_t>(bits));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      why = ParseInteger(text, "int64", INT64_MAX, std::uint64_t{INT64_MAX} + 1, &bits);
      if (!why.empty()) break;
      repeated ? r.AddInt64(msg, &field, static_cast<std::int64_t>(bits))
               : r.SetInt64(msg, &field, static_cast<std::int64_t>(bits));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      why = ParseInteger(text, "uint32", UINT32_MAX, 0, &bits);
      if (!why.empty()) break;
      repeated ? r.AddUInt32(msg, &field, static_cast<std::uint32_t>(bits))
               : r.SetUInt32(msg, &field, static_cast<std::uint32_t>(bits));
      break;
    default:
      why = ParseInteger(text, "uint64", UINT64_MAX, 0, &bits);
      if (!why.empty()) break;
      repeated ? r.AddUInt64(msg, &field, bits) : r.SetUInt64(msg, &field, bits);
      break;
  }
  return why;
}

std::string SetFloating(absl::string_view text, const FieldDescriptor& field, Message* msg) {
  const Reflection& r = *msg->GetReflection();
  const bool repeated = field.is_repeated();
  const bool is_float = field.cpp_type() == FieldDescriptor::CPPTYPE_FLOAT;
  double v = 0;
  std::string why = ParseDouble(text, field.type_name(),
                                is_float ? std::numeric_limits<float>::max()
                                         : std::numeric_limits<double>::max(),
                                &v);
  if (!why.empty()) return why;
  if (is_float) {
    const auto f = static_cast<float>(v);
    repeated ? r.AddFloat(msg, &field, f) : r.SetFloat(msg, &field, f);
  } else {
    repeated ? r.AddDouble(msg, &field, v) : r.SetDouble(msg, &field, v);
  }
  return "";
}

// An enum by name or, as proto3 JSON allows, by number.
std::string SetEnum(absl::string_view text, const FieldDescriptor& field, Message* msg) {
  const EnumValueDescriptor* v = field.enum_type()->FindValueByName(std::string(text));
  if (std::uint64_t bits = 0;
      v == nullptr &&
      ParseInteger(text, "int32", INT32_MAX, std::uint64_t{INT32_MAX} + 1, &bits).empty()) {
    v = field.enum_type()->FindValueByNumber(static_cast<std::int32_t>(bits));
  }
  if (v == nullptr) {
    std::vector<std::string> names;
    for (int i = 0; i < field.enum_type()->value_count(); ++i) {
      names.push_back(field.enum_type()->value(i)->name());
    }
    std::string why = absl::StrCat("unknown value ", Quote(text), " for ", TypeName(field));
    if (const std::string s = ClosestName(text, names); !s.empty()) {
      absl::StrAppend(&why, "; did you mean \"", s, "\"?");
    }
    return why;
  }
  const Reflection& r = *msg->GetReflection();
  field.is_repeated() ? r.AddEnum(msg, &field, v) : r.SetEnum(msg, &field, v);
  return "";
}

// A string (valid UTF-8) or bytes (base64, as proto3 JSON writes them,
// either alphabet).
std::string SetString(absl::string_view text, const FieldDescriptor& field, Message* msg) {
  std::string value;
  if (field.type() == FieldDescriptor::TYPE_BYTES) {
    if (!absl::Base64Unescape(text, &value) && !absl::WebSafeBase64Unescape(text, &value)) {
      return absl::StrCat("expected base64 (bytes), got ", Quote(text));
    }
  } else if (!::muonmesh::text::IsValidUtf8(std::string_view(text.data(), text.size()))) {
    return "string is not valid UTF-8";
  } else {
    value = std::string(text);
  }
  const Reflection& r = *msg->GetReflection();
  field.is_repeated() ? r.AddString(msg, &field, std::move(value))
                      : r.SetString(msg, &field, std::move(value));
  return "";
}

class PathScope {
 public:
  enum Kind { kField, kIndex };
  PathScope(std::string& path, Kind kind, absl::string_view step)
      : path_(path), size_(path.size()) {
    if (kind == kField && !path_.empty()) path_.push_back('.');
    path_.append(step.data(), step.size());
  }
  PathScope(const PathScope&) = delete;
  PathScope& operator=(const PathScope&) = delete;
  ~PathScope() { path_.resize(size_); }

 private:
  std::string& path_;
  std::size_t size_;
};

// Walks one parsed document and fills a message through reflection. Tracks
// the field path for errors, the nesting depth, and a node budget: YAML
// aliases let a small document name the same subtree many times (or
// itself), and the walk must stay linear in the input size. Nodes are
// passed by index, resolved (aliases replaced by what they name).
class MessageFiller {
 public:
  MessageFiller(const Document& doc, absl::string_view source, std::size_t node_budget)
      : doc_(doc), source_(source), nodes_left_(node_budget) {}

  absl::Status FillMessage(std::uint32_t index, int depth, Message* msg) {
    const Node& node = doc_[index];
    const Descriptor& type = *msg->GetDescriptor();
    if (!node.is_map()) {
      return Error(node, absl::StrCat("expected a mapping (", type.full_name(), "), got ",
                                      Describe(node)));
    }
    MUONMESH_RETURN_IF_ERROR(Enter(node, depth));

    absl::flat_hash_map<int, Location> seen;  // field number -> key location
    absl::flat_hash_map<const OneofDescriptor*, const FieldDescriptor*> oneof_set;
    for (std::uint32_t k = index + 1; k < node.size;) {
      const std::uint32_t v = doc_.Next(k);
      if (v >= node.size) break;  // readers always pair keys with values
      const Node& key = doc_[doc_.Resolve(k)];
      const std::uint32_t value_index = doc_.Resolve(v);
      const Node& value = doc_[value_index];
      k = doc_.Next(v);
      if (!key.is_scalar()) {
        return Error(key, absl::StrCat("expected a field name, got ", Describe(key)));
      }
      const absl::string_view name = doc_.Scalar(key);
      PathScope scope(path_, PathScope::kField, absl::CHexEscape(name.substr(0, kMaxQuotedBytes)));
      const FieldDescriptor* field = type.FindFieldByName(std::string(name));
      if (field == nullptr) return Error(key, UnknownFieldReason(type, name));
      if (auto [first, inserted] = seen.try_emplace(field->number(), key.where); !inserted) {
        return Error(key, absl::StrCat("duplicate key ", Quote(name), " (first at ",
                                       first->second.line + 1, ":", first->second.column + 1,
                                       ")"));
      }
      if (value.is_null()) continue;  // "not set"
      if (const OneofDescriptor* oneof = field->real_containing_oneof(); oneof != nullptr) {
        auto [other, inserted] = oneof_set.try_emplace(oneof, field);
        if (!inserted) {
          return Error(key,
                       absl::StrCat("fields \"", other->second->name(), "\" and \"",
                                    field->name(), "\" are both set, but they belong to oneof \"",
                                    oneof->name(), "\"; set only one"));
        }
      }
      MUONMESH_RETURN_IF_ERROR(FillField(value_index, *field, depth, msg));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Error(const Node& node, absl::string_view reason) const {
    return internal::LocatedError(source_, &node.where, path_, reason);
  }

  std::string Describe(const Node& node) const {
    switch (node.kind) {
      case Node::kMap:
        return "a mapping";
      case Node::kSequence:
        return "a sequence";
      case Node::kScalar:
        return absl::StrCat("the scalar ", Quote(doc_.Scalar(node)));
      case Node::kNull:
      case Node::kAlias:  // never: nodes come here resolved
        break;
    }
    return "null";
  }

  // Charges one node to the budget and checks the depth of a container.
  absl::Status Enter(const Node& node, int depth) {
    if (depth > kMaxNestingDepth) {
      return Error(node, absl::StrCat("nesting deeper than ", kMaxNestingDepth, " levels"));
    }
    return Charge(node);
  }

  absl::Status Charge(const Node& node) {
    if (nodes_left_ == 0) {
      return Error(node, "document expands to too many nodes (YAML aliases?)");
    }
    --nodes_left_;
    return absl::OkStatus();
  }

  // `index` is not null. `depth` is the depth of the mapping holding it.
  absl::Status FillField(std::uint32_t index, const FieldDescriptor& field, int depth,
                         Message* msg) {
    if (field.is_map()) return FillMap(index, field, depth + 1, msg);
    if (field.is_repeated()) return FillRepeated(index, field, depth + 1, msg);
    if (field.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      return FillSubmessage(index, field, depth + 1, msg);
    }
    return FillScalar(doc_[index], field, /*is_map_key=*/false, msg);
  }

  // Fills the message `field` of `msg` from node `index` (singular, or a new
  // element of a repeated field). Checks the kind before creating anything,
  // so the error names the field's type.
  absl::Status FillSubmessage(std::uint32_t index, const FieldDescriptor& field, int depth,
                              Message* msg) {
    const Node& value = doc_[index];
    if (!value.is_map()) {
      return Error(value,
                   absl::StrCat("expected a mapping (", TypeName(field), "), got ", Describe(value)));
    }
    const Reflection& r = *msg->GetReflection();
    return FillMessage(index, depth,
                       field.is_repeated() ? r.AddMessage(msg, &field) : r.MutableMessage(msg, &field));
  }

  absl::Status FillRepeated(std::uint32_t index, const FieldDescriptor& field, int depth,
                            Message* msg) {
    const Node& value = doc_[index];
    if (!value.is_sequence()) {
      return Error(value, absl::StrCat("expected a sequence (repeated ", TypeName(field),
                                       "), got ", Describe(value)));
    }
    MUONMESH_RETURN_IF_ERROR(Enter(value, depth));
    std::size_t position = 0;
    for (std::uint32_t i = index + 1; i < value.size; i = doc_.Next(i)) {
      const std::uint32_t element_index = doc_.Resolve(i);
      const Node& element = doc_[element_index];
      PathScope scope(path_, PathScope::kIndex, absl::StrCat("[", position++, "]"));
      if (element.is_null()) {
        return Error(element, "null is not allowed in a repeated field");
      }
      absl::Status s = field.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE
                           ? FillSubmessage(element_index, field, depth + 1, msg)
                           : FillScalar(element, field, /*is_map_key=*/false, msg);
      MUONMESH_RETURN_IF_ERROR(s);
    }
    return absl::OkStatus();
  }

  absl::Status FillMap(std::uint32_t index, const FieldDescriptor& field, int depth,
                       Message* msg) {
    const Node& value = doc_[index];
    if (!value.is_map()) {
      return Error(value, absl::StrCat("expected a mapping (map field), got ", Describe(value)));
    }
    MUONMESH_RETURN_IF_ERROR(Enter(value, depth));
    const Reflection& reflection = *msg->GetReflection();
    const FieldDescriptor& key_field = *field.message_type()->map_key();
    const FieldDescriptor& value_field = *field.message_type()->map_value();
    absl::flat_hash_map<std::string, Location> seen;  // canonical key -> location
    for (std::uint32_t k = index + 1; k < value.size;) {
      const std::uint32_t v = doc_.Next(k);
      if (v >= value.size) break;
      const Node& key = doc_[doc_.Resolve(k)];
      const std::uint32_t item_index = doc_.Resolve(v);
      const Node& item = doc_[item_index];
      k = doc_.Next(v);
      if (!key.is_scalar()) {
        return Error(key, absl::StrCat("expected a scalar map key, got ", Describe(key)));
      }
      PathScope scope(path_, PathScope::kIndex, absl::StrCat("[", Quote(doc_.Scalar(key)), "]"));
      Message* entry = reflection.AddMessage(msg, &field);
      MUONMESH_RETURN_IF_ERROR(FillScalar(key, key_field, /*is_map_key=*/true, entry));
      if (auto [first, inserted] = seen.try_emplace(CanonicalKey(*entry, key_field), key.where);
          !inserted) {
        return Error(key, absl::StrCat("duplicate key ", Quote(doc_.Scalar(key)), " (first at ",
                                       first->second.line + 1, ":", first->second.column + 1,
                                       ")"));
      }
      if (item.is_null()) return Error(item, "null is not allowed as a map value");
      MUONMESH_RETURN_IF_ERROR(FillField(item_index, value_field, depth, entry));
    }
    return absl::OkStatus();
  }

  // So that "7" and "07" count as one key of a map<int64, _>.
  static std::string CanonicalKey(const Message& entry, const FieldDescriptor& key_field) {
    const Reflection& r = *entry.GetReflection();
    switch (key_field.cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        return absl::StrCat(r.GetInt32(entry, &key_field));
      case FieldDescriptor::CPPTYPE_INT64:
        return absl::StrCat(r.GetInt64(entry, &key_field));
      case FieldDescriptor::CPPTYPE_UINT32:
        return absl::StrCat(r.GetUInt32(entry, &key_field));
      case FieldDescriptor::CPPTYPE_UINT64:
        return absl::StrCat(r.GetUInt64(entry, &key_field));
      case FieldDescriptor::CPPTYPE_BOOL:
        return r.GetBool(entry, &key_field) ? "true" : "false";
      default:
        return r.GetString(entry, &key_field);
    }
  }

  // Sets a singular scalar field, or appends to a repeated one. Map keys
  // may be quoted whatever their type: JSON quotes every key, and proto3
  // JSON writes map<int64, V> keys as "7".
  absl::Status FillScalar(const Node& node, const FieldDescriptor& field, bool is_map_key,
                          Message* msg) {
    if (!node.is_scalar()) {
      return Error(node,
                   absl::StrCat("expected a scalar (", TypeName(field), "), got ", Describe(node)));
    }
    MUONMESH_RETURN_IF_ERROR(Charge(node));
    const absl::string_view text = doc_.Scalar(node);
    const bool number_quoted = !node.plain && !is_map_key;
    std::string why;
    switch (field.cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
      case FieldDescriptor::CPPTYPE_INT64:
      case FieldDescriptor::CPPTYPE_UINT32:
      case FieldDescriptor::CPPTYPE_UINT64:
        why = number_quoted ? QuotedNumberReason("an integer", field.type_name(), text)
                            : SetInteger(text, field, msg);
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
      case FieldDescriptor::CPPTYPE_FLOAT:
        why = number_quoted ? QuotedNumberReason("a finite number", field.type_name(), text)
                            : SetFloating(text, field, msg);
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        // Only JSON's spellings: YAML 1.1's yes/no/on/off are a known trap.
        if (number_quoted || (text != "true" && text != "false")) {
          why = absl::StrCat("expected true or false, got ",
                             node.plain ? "" : "the quoted string ", Quote(text));
        } else if (field.is_repeated()) {
          msg->GetReflection()->AddBool(msg, &field, text == "true");
        } else {
          msg->GetReflection()->SetBool(msg, &field, text == "true");
        }
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        why = SetEnum(text, field, msg);
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        why = SetString(text, field, msg);
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        why = absl::StrCat("expected a mapping (", TypeName(field), ")");  // unreachable
        break;
    }
    if (!why.empty()) return Error(node, why);
    return absl::OkStatus();
  }

  const Document& doc_;
  absl::string_view source_;
  std::string path_;  // of the node being filled, e.g. "units[3].params"
  std::size_t nodes_left_;
};

// Where the text ends, for errors about a document with nothing in it.
Location EndOf(absl::string_view text) {
  Location end;
  const std::size_t last_break = text.rfind('\n');
  end.line = static_cast<std::uint32_t>(std::count(text.begin(), text.end(), '\n'));
  end.column = static_cast<std::uint32_t>(
      last_break == absl::string_view::npos ? text.size() : text.size() - last_break - 1);
  return end;
}

// Reads `text` into `*doc` (JSON through our reader, the rest and what is
// not JSON after all through yaml-cpp). Returns InvalidArgument, located,
// for syntax errors and limits, and for a document with nothing in it.
absl::Status ReadDocument(absl::string_view text, absl::string_view source,
                          std::optional<Document>* doc) {
  const internal::ReadLimits limits;
  absl::Status json_error;
  if (internal::LooksLikeJson(text)) {
    switch (internal::ReadJson(text, source, limits, &doc->emplace(text), &json_error)) {
      case internal::JsonVerdict::kRead:
        return absl::OkStatus();
      case internal::JsonVerdict::kRefused:
        return json_error;
      case internal::JsonVerdict::kNotJson:
        break;  // YAML flow style, as in "{name: x}", or a mistake
    }
  }
  bool lookahead_exceeded = false;
  absl::Status status =
      internal::ReadYaml(text, source, limits, &doc->emplace(text), &lookahead_exceeded);
  if (!status.ok()) {
    // yaml-cpp names mistakes as before, except where the document is too
    // large for it: then the JSON mistake says more.
    if (lookahead_exceeded && !json_error.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          json_error.message(), " (and it is too large to read as YAML: ", status.message(), ")"));
    }
    return status;
  }
  const Document& read = **doc;
  if (read.size() == 0 || read[Document::kRoot].is_null()) {
    const Location where = read.size() == 0 ? EndOf(text) : read[Document::kRoot].where;
    return internal::LocatedError(source, &where, "",
                                  "empty document (nothing but comments, null or ---)");
  }
  return absl::OkStatus();
}

absl::Status ParseDocument(absl::string_view text, absl::string_view source, Message* msg) {
  std::optional<Document> doc;
  MUONMESH_RETURN_IF_ERROR(ReadDocument(text, source, &doc));
  // Aliases may repeat subtrees; let them at most double the work.
  MessageFiller filler(*doc, source, 2 * std::size_t{doc->size()} + 1024);
  return filler.FillMessage(Document::kRoot, 1, msg);
}

}  // namespace

absl::Status ParseMessageText(std::string_view text_in, std::string_view source_name_in,
                              google::protobuf::Message* msg) {
  // Debian's Abseil is built with its own absl::string_view (not an alias of
  // std::string_view), so convert once here.
  const absl::string_view text(text_in.data(), text_in.size());
  const absl::string_view source_name(source_name_in.data(), source_name_in.size());
  msg->Clear();
  if (text.size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": input is ", text.size(),
                                                   " bytes, more than the limit of ",
                                                   kMaxFileBytes));
  }
  absl::Status status;
  // The readers report yaml-cpp's errors as statuses; nothing may escape to
  // callers, which are RPC handlers and CLIs.
  try {
    status = ParseDocument(text, source_name, msg);
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(
        absl::StrCat(source_name, ": out of memory while parsing"));
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat(source_name, ": unexpected error: ", e.what()));
  } catch (...) {
    status = absl::InternalError(absl::StrCat(source_name, ": unexpected error"));
  }
  if (!status.ok()) msg->Clear();
  return status;
}

absl::Status LoadMessageFile(const std::string& path, google::protobuf::Message* msg) {
  msg->Clear();
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) {
    if (!ec || ec == std::errc::no_such_file_or_directory) {
      return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    }
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot stat: ", ec.message()));
  }
  if (!std::filesystem::is_regular_file(st)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": file is ", size,
                                                   " bytes, larger than the limit of ",
                                                   kMaxFileBytes));
  }

  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  // Read up to one byte past the limit, rather than trusting the size from
  // stat, so a file that grows meanwhile is still caught. Reserving the
  // size stat gave keeps the text at one copy (growth by doubling would
  // briefly hold three).
  std::string text;
  absl::Status status;
  try {
    if (!ec) text.reserve(static_cast<std::size_t>(size) + 1);
    char chunk[1 << 16];
    while (text.size() <= kMaxFileBytes) {
      const std::size_t n = std::fread(chunk, 1, sizeof(chunk), file);
      text.append(chunk, n);
      if (n < sizeof(chunk)) break;
    }
    if (std::ferror(file)) {
      status = absl::InvalidArgumentError(
          absl::StrCat(path, ": cannot read: ", std::strerror(errno)));
    }
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(absl::StrCat(path, ": out of memory while reading"));
  }
  std::fclose(file);
  MUONMESH_RETURN_IF_ERROR(status);
  if (text.size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is larger than the limit of ", kMaxFileBytes));
  }
  return ParseMessageText(text, path, msg);
}

}  // namespace muonmesh::protoio
