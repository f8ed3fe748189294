#include "client/json_writer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/descriptor.h"
#include "core/base/text.h"

namespace muonmesh::client {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string FormatDouble(double v) {
  if (std::isnan(v)) return "\"NaN\"";
  if (std::isinf(v)) return v > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  // Counts and byte totals stored as doubles read best without ".0" or an
  // exponent; below 1e15 every integer prints exactly this way.
  if (v == std::trunc(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  // Shortest of %.15g..%.17g that round-trips; %.17g always does.
  for (int precision = 15; precision < 17; ++precision) {
    std::string text = absl::StrFormat("%.*g", precision, v);
    double back = 0;
    if (absl::SimpleAtod(text, &back) && back == v) return text;
  }
  return absl::StrFormat("%.17g", v);
}

std::string FormatFloat(float v) {
  if (std::isnan(v) || std::isinf(v)) return FormatDouble(v);
  if (v == std::trunc(v) && std::fabs(v) < 1e7f) return absl::StrFormat("%.0f", v);
  for (int precision = 6; precision < 9; ++precision) {
    std::string text = absl::StrFormat("%.*g", precision, v);
    float back = 0;
    if (absl::SimpleAtof(text, &back) && back == v) return text;
  }
  return absl::StrFormat("%.9g", v);
}

std::string Quote(const std::string& text) { return ::muonmesh::text::JsonString(text); }

// Appends to one string; `depth` is the nesting depth of the value being
// written (its closing bracket's indentation, in steps of 2 spaces).
class Writer {
 public:
  explicit Writer(const JsonOptions& options)
      : omit_(options.omit_fields.begin(), options.omit_fields.end()),
        short_enums_(options.short_enum_names) {}

  std::string Take() { return std::move(out_); }

  void WriteMessage(const Message& message, int depth) {
    const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
    const Reflection* reflection = message.GetReflection();
    std::vector<const FieldDescriptor*> fields;
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const FieldDescriptor* field = descriptor->field(i);
      if (!omit_.empty() && omit_.contains(field->full_name())) continue;
      // Presence, not value, decides: zero scalars are written, unset
      // messages and unset optional/oneof fields are not.
      if (!field->is_repeated() && field->has_presence() && !reflection->HasField(message, field)) {
        continue;
      }
      fields.push_back(field);
    }
    // Declaration order is an accident of the .proto file; numbers are the
    // stable identity of a field.
    std::sort(fields.begin(), fields.end(), [](const FieldDescriptor* a, const FieldDescriptor* b) {
      return a->number() < b->number();
    });
    if (fields.empty()) {
      out_ += "{}";
      return;
    }
    out_ += "{\n";
    for (size_t i = 0; i < fields.size(); ++i) {
      Indent(depth + 1);
      absl::StrAppend(&out_, Quote(fields[i]->name()), ": ");
      WriteField(message, fields[i], depth + 1);
      out_ += i + 1 < fields.size() ? ",\n" : "\n";
    }
    Indent(depth);
    out_ += "}";
  }

 private:
  void Indent(int depth) { out_.append(2 * static_cast<size_t>(depth), ' '); }

  void WriteField(const Message& message, const FieldDescriptor* field, int depth) {
    const Reflection* reflection = message.GetReflection();
    if (field->is_map()) {
      WriteMap(message, field, depth);
    } else if (field->is_repeated()) {
      const int size = reflection->FieldSize(message, field);
      if (size == 0) {
        out_ += "[]";
      } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        out_ += "[\n";
        for (int i = 0; i < size; ++i) {
          Indent(depth + 1);
          WriteMessage(reflection->GetRepeatedMessage(message, field, i), depth + 1);
          out_ += i + 1 < size ? ",\n" : "\n";
        }
        Indent(depth);
        out_ += "]";
      } else {
        out_ += "[";
        for (int i = 0; i < size; ++i) {
          if (i > 0) out_ += ", ";
          out_ += Scalar(message, field, i);
        }
        out_ += "]";
      }
    } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      WriteMessage(reflection->GetMessage(message, field), depth);
    } else {
      out_ += Scalar(message, field, -1);
    }
  }

  // Map entries in key order: the wire and reflection order of a map is
  // unspecified, and the output must not depend on it.
  void WriteMap(const Message& message, const FieldDescriptor* field, int depth) {
    const Reflection* reflection = message.GetReflection();
    const int size = reflection->FieldSize(message, field);
    if (size == 0) {
      out_ += "{}";
      return;
    }
    struct Entry {
      const Message* message = nullptr;
      int64_t signed_key = 0;
      uint64_t unsigned_key = 0;
      std::string text_key;
    };
    const FieldDescriptor* key_field = field->message_type()->map_key();
    const FieldDescriptor* value_field = field->message_type()->map_value();
    std::vector<Entry> entries;
    entries.reserve(size);
    for (int i = 0; i < size; ++i) {
      const Message& entry = reflection->GetRepeatedMessage(message, field, i);
      const Reflection* er = entry.GetReflection();
      Entry e;
      e.message = &entry;
      switch (key_field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
          e.signed_key = er->GetInt32(entry, key_field);
          break;
        case FieldDescriptor::CPPTYPE_INT64:
          e.signed_key = er->GetInt64(entry, key_field);
          break;
        case FieldDescriptor::CPPTYPE_UINT32:
          e.unsigned_key = er->GetUInt32(entry, key_field);
          break;
        case FieldDescriptor::CPPTYPE_UINT64:
          e.unsigned_key = er->GetUInt64(entry, key_field);
          break;
        case FieldDescriptor::CPPTYPE_BOOL:
          e.unsigned_key = er->GetBool(entry, key_field);
          break;
        default:
          e.text_key = er->GetString(entry, key_field);
          break;
      }
      entries.push_back(std::move(e));
    }
    std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      if (a.signed_key != b.signed_key) return a.signed_key < b.signed_key;
      if (a.unsigned_key != b.unsigned_key) return a.unsigned_key < b.unsigned_key;
      return a.text_key < b.text_key;
    });
    out_ += "{\n";
    for (size_t i = 0; i < entries.size(); ++i) {
      Indent(depth + 1);
      // JSON keys are strings; integer keys are written in decimal.
      std::string key = Scalar(*entries[i].message, key_field, -1);
      if (key.empty() || key[0] != '"') key = Quote(key);
      absl::StrAppend(&out_, key, ": ");
      WriteField(*entries[i].message, value_field, depth + 1);
      out_ += i + 1 < entries.size() ? ",\n" : "\n";
    }
    Indent(depth);
    out_ += "}";
  }

  // One scalar: element `index` of a repeated field, or the singular field
  // when index < 0.
  std::string Scalar(const Message& message, const FieldDescriptor* field, int index) const {
    const Reflection* r = message.GetReflection();
    const bool rep = index >= 0;
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        return absl::StrCat(rep ? r->GetRepeatedInt32(message, field, index)
                                : r->GetInt32(message, field));
      case FieldDescriptor::CPPTYPE_INT64:
        return absl::StrCat(rep ? r->GetRepeatedInt64(message, field, index)
                                : r->GetInt64(message, field));
      case FieldDescriptor::CPPTYPE_UINT32:
        return absl::StrCat(rep ? r->GetRepeatedUInt32(message, field, index)
                                : r->GetUInt32(message, field));
      case FieldDescriptor::CPPTYPE_UINT64:
        return absl::StrCat(rep ? r->GetRepeatedUInt64(message, field, index)
                                : r->GetUInt64(message, field));
      case FieldDescriptor::CPPTYPE_DOUBLE:
        return FormatDouble(rep ? r->GetRepeatedDouble(message, field, index)
                                : r->GetDouble(message, field));
      case FieldDescriptor::CPPTYPE_FLOAT:
        return FormatFloat(rep ? r->GetRepeatedFloat(message, field, index)
                               : r->GetFloat(message, field));
      case FieldDescriptor::CPPTYPE_BOOL:
        return (rep ? r->GetRepeatedBool(message, field, index) : r->GetBool(message, field))
                   ? "true"
                   : "false";
      case FieldDescriptor::CPPTYPE_ENUM: {
        const int number =
            rep ? r->GetRepeatedEnumValue(message, field, index) : r->GetEnumValue(message, field);
        const google::protobuf::EnumValueDescriptor* value =
            field->enum_type()->FindValueByNumber(number);
        if (value == nullptr) return absl::StrCat(number);
        return Quote(short_enums_ ? value->name().substr(SharedPrefix(*field->enum_type()))
                                  : value->name());
      }
      case FieldDescriptor::CPPTYPE_STRING: {
        const std::string text =
            rep ? r->GetRepeatedString(message, field, index) : r->GetString(message, field);
        return field->type() == FieldDescriptor::TYPE_BYTES ? Quote(absl::Base64Escape(text))
                                                            : Quote(text);
      }
      case FieldDescriptor::CPPTYPE_MESSAGE:
        break;  // Not a scalar; callers never ask.
    }
    return "null";
  }

  // The length of the prefix every value name of `type` shares, cut after
  // its last '_' ("JOB_STATE_" of JOB_STATE_PENDING, JOB_STATE_RUNNING, ...);
  // 0 when that would leave a name empty.
  static size_t SharedPrefix(const google::protobuf::EnumDescriptor& type) {
    std::string prefix = type.value(0)->name();
    for (int i = 1; i < type.value_count(); ++i) {
      const std::string& name = type.value(i)->name();
      size_t n = 0;
      while (n < prefix.size() && n < name.size() && prefix[n] == name[n]) ++n;
      prefix.resize(n);
    }
    const size_t cut = prefix.rfind('_');
    if (cut == std::string::npos) return 0;
    for (int i = 0; i < type.value_count(); ++i) {
      if (type.value(i)->name().size() <= cut + 1) return 0;
    }
    return cut + 1;
  }

  absl::flat_hash_set<std::string> omit_;
  bool short_enums_ = false;
  std::string out_;
};

}  // namespace

std::string ToJson(const google::protobuf::Message& message, const JsonOptions& options) {
  Writer writer(options);
  writer.WriteMessage(message, 0);
  return writer.Take();
}

}  // namespace muonmesh::client
