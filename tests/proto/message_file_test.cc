#include "proto/io/message_file.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/message_differencer.h"
#include "google/protobuf/wrappers.pb.h"
#include "gtest/gtest.h"
#include "muonmesh/v1/config.pb.h"
#include "tests/testing/model_specs.h"

namespace muonmesh::protoio {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Abseil here is Debian's build, whose absl::string_view is its own type
// (not std::string_view): helpers that feed absl take absl::string_view.

// True if `message` starts with "SOURCE:LINE:COL: " (both numbers >= 1).
bool HasLocation(absl::string_view message, absl::string_view source) {
  if (!absl::ConsumePrefix(&message, source) || !absl::ConsumePrefix(&message, ":")) return false;
  for (int part = 0; part < 2; ++part) {
    std::size_t digits = 0;
    while (digits < message.size() && absl::ascii_isdigit(message[digits])) ++digits;
    if (digits == 0 || message[0] == '0') return false;
    message.remove_prefix(digits);
    if (!absl::ConsumePrefix(&message, part == 0 ? ":" : ": ")) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------
// Malformed inputs. `want` is the exact "SOURCE:LINE:COL: PATH: " prefix,
// worked out by hand from `text` (lines and columns count from 1; the mark
// is the first character of the offending key or value, or the opening
// quote/bracket); `reason` is a fragment of what follows.

struct BadCase {
  std::string name;
  std::string text;
  std::string want;
  std::string reason;
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class JobSpecErrorTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(JobSpecErrorTest, ReportsLocationPathAndReason) {
  const BadCase& c = GetParam();
  muonmesh::v1::JobSpec job;
  const absl::Status status = ParseMessageText(c.text, "job.yaml", &job);
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StartsWith(status.message(), c.want))
      << "got:  " << status.message() << "\nwant: " << c.want << "...";
  EXPECT_THAT(std::string(status.message()), HasSubstr(c.reason));
  // A failed parse leaves nothing half-filled behind.
  EXPECT_EQ(job.ByteSizeLong(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, JobSpecErrorTest,
    ::testing::Values(
        // Syntax errors, at the place yaml-cpp detects them.
        BadCase{"UnterminatedString", "name: \"abc", "job.yaml:1:11: ",  // at EOF
                "syntax error"},
        BadCase{"BadIndentation", "name: x\n  world_size: 4\n", "job.yaml:2:13: ",  // the ':'
                "syntax error: illegal map value"},
        BadCase{"RootIsSequence", "- 1\n- 2\n", "job.yaml:1:1: ",
                "expected a mapping (muonmesh.v1.JobSpec), got a sequence"},
        BadCase{"RootIsScalar", "\n  hello\n", "job.yaml:2:3: ", "got the scalar \"hello\""},
        BadCase{"TwoDocuments", "name: a\n---\nname: b\n", "job.yaml:2:1: ",  // the "---"
                "content after the end of the document"},
        // yaml-cpp's LoadAll loops forever on this; we stop at the ','.
        BadCase{"StrayTokenAfterFlowMap", "{name: a}, b", "job.yaml:1:10: ",
                "content after the end of the document"},
        // Unknown fields, with and without a suggestion.
        BadCase{"UnknownTopLevel", "name: x\nworld_sise: 4\n", "job.yaml:2:1: world_sise: ",
                "unknown field \"world_sise\" in muonmesh.v1.JobSpec; did you mean "
                "\"world_size\"?"},
        BadCase{"CamelCaseSuggestsSnakeCase", "worldSize: 4\n", "job.yaml:1:1: worldSize: ",
                "did you mean \"world_size\"?"},
        BadCase{"UnknownNested",
                "optimizer:\n  muon:\n    lr: 0.02\n    momentom: 0.9\n",
                "job.yaml:4:5: optimizer.muon.momentom: ", "did you mean \"momentum\"?"},
        BadCase{"NonScalarKey", "{[1]: 2}", "job.yaml:1:2: ", "expected a field name"},
        // Wrong node kinds.
        BadCase{"MessageGivenSequence", "parallelism: [1]\n", "job.yaml:1:14: parallelism: ",
                "expected a mapping (muonmesh.v1.ParallelismConfig), got a sequence"},
        BadCase{"ScalarGivenMapping", "world_size: {a: 1}\n", "job.yaml:1:13: world_size: ",
                "expected a scalar (int64), got a mapping"},
        BadCase{"RepeatedGivenScalar", "model:\n  mlp:\n    dims: 5\n",
                "job.yaml:3:11: model.mlp.dims: ", "expected a sequence (repeated int64)"},
        BadCase{"RepeatedMessageGivenScalarElement", "optimizer: {rules: [x]}",
                "job.yaml:1:21: optimizer.rules[0]: ",
                "expected a mapping (muonmesh.v1.OptimizerRule), got the scalar \"x\""},
        // Integers: strict syntax, exact ranges.
        BadCase{"IntegerWithFraction", "world_size: 7.5\n", "job.yaml:1:13: world_size: ",
                "expected an integer (int64), got \"7.5\""},
        BadCase{"IntegerInExponentForm", "world_size: 1e30\n", "job.yaml:1:13: world_size: ",
                "expected an integer (int64), got \"1e30\""},
        BadCase{"IntegerHex", "world_size: 0x10\n", "job.yaml:1:13: world_size: ",
                "expected an integer"},
        BadCase{"Int64Overflow", "world_size: 9223372036854775808\n",
                "job.yaml:1:13: world_size: ", "is out of range for int64"},
        BadCase{"Int64Underflow", "world_size: -9223372036854775809\n",
                "job.yaml:1:13: world_size: ", "is out of range for int64"},
        BadCase{"Int32Overflow", "optimizer: {muon: {ns_steps: 2147483648}}",
                "job.yaml:1:30: optimizer.muon.ns_steps: ", "is out of range for int32"},
        BadCase{"Uint64Negative", "init: {seed: -1}", "job.yaml:1:14: init.seed: ",
                "\"-1\" is out of range for uint64"},
        BadCase{"Uint64Overflow", "init: {seed: 18446744073709551616}",
                "job.yaml:1:14: init.seed: ", "is out of range for uint64"},
        BadCase{"IntegerInList", "model: {mlp: {dims: [32, 64, x]}}",
                "job.yaml:1:30: model.mlp.dims[2]: ", "expected an integer (int64), got \"x\""},
        // Numbers in quotes are strings: a type error, whatever they spell.
        BadCase{"QuotedInteger", "world_size: \"8\"\n", "job.yaml:1:13: world_size: ",
                "expected an integer (int64), got the string \"8\"; write numbers without quotes"},
        BadCase{"SingleQuotedInteger", "world_size: '8'\n", "job.yaml:1:13: world_size: ",
                "expected an integer (int64), got the string \"8\"; write numbers without quotes"},
        BadCase{"QuotedIntegerInList", "model: {mlp: {dims: [32, \"64\"]}}",
                "job.yaml:1:26: model.mlp.dims[1]: ",
                "expected an integer (int64), got the string \"64\""},
        BadCase{"QuotedDouble", "optimizer: {muon: {weight_decay: \"2.5\"}}",
                "job.yaml:1:34: optimizer.muon.weight_decay: ",
                "expected a finite number (double), got the string \"2.5\"; write numbers without "
                "quotes"},
        BadCase{"QuotedUint64", "init: {seed: \"7\"}", "job.yaml:1:14: init.seed: ",
                "expected an integer (uint64), got the string \"7\""},
        // Booleans: JSON spellings only.
        BadCase{"BoolYes", "optimizer:\n  muon:\n    nesterov: yes\n",
                "job.yaml:3:15: optimizer.muon.nesterov: ", "expected true or false, got \"yes\""},
        BadCase{"BoolCapitalised", "optimizer: {muon: {nesterov: True}}",
                "job.yaml:1:30: optimizer.muon.nesterov: ", "expected true or false"},
        BadCase{"BoolQuoted", "optimizer: {muon: {nesterov: \"true\"}}",
                "job.yaml:1:30: optimizer.muon.nesterov: ", "the quoted string \"true\""},
        // Doubles: finite only.
        BadCase{"DoubleInf", "optimizer: {muon: {lr: .inf}}", "job.yaml:1:24: optimizer.muon.lr: ",
                "expected a finite number (double), got \".inf\""},
        BadCase{"DoubleNan", "optimizer: {muon: {lr: .nan}}", "job.yaml:1:24: optimizer.muon.lr: ",
                "expected a finite number"},
        BadCase{"DoubleSpelledInf", "optimizer: {adamw: {eps: -inf}}",
                "job.yaml:1:26: optimizer.adamw.eps: ", "expected a finite number"},
        BadCase{"DoubleOverflow", "optimizer: {muon: {lr: 1e400}}",
                "job.yaml:1:24: optimizer.muon.lr: ", "\"1e400\" is out of range for double"},
        BadCase{"DoubleNegativeOverflow", "optimizer: {adamw: {eps: -1e400}}",
                "job.yaml:1:26: optimizer.adamw.eps: ", "\"-1e400\" is out of range for double"},
        BadCase{"DoubleWord", "optimizer: {muon: {lr: fast}}", "job.yaml:1:24: optimizer.muon.lr: ",
                "expected a finite number (double), got \"fast\""},
        // Strings.
        BadCase{"StringGivenSequence", "name: [a, b]", "job.yaml:1:7: name: ",
                "expected a scalar (string), got a sequence"},
        BadCase{"StringNotUtf8", "device: \"cp\xC3\x28\"", "job.yaml:1:9: device: ",
                "not valid UTF-8"},
        // Repeated fields: no nulls inside.
        BadCase{"NullInList", "model:\n  mlp:\n    dims:\n      - 1\n      - ~\n",
                "job.yaml:5:9: model.mlp.dims[1]: ", "null is not allowed in a repeated field"},
        // Oneofs: one member at most; a null member does not count.
        BadCase{"TwoOneofMembers", "model:\n  mlp: {dims: [1]}\n  moe_mlp: {d_in: 2}\n",
                "job.yaml:3:3: model.moe_mlp: ",
                "fields \"mlp\" and \"moe_mlp\" are both set, but they belong to oneof \"kind\""},
        BadCase{"TwoOneofScalars", "init: {safetensors: w.st, seed: 7}", "job.yaml:1:27: init.seed: ",
                "fields \"safetensors\" and \"seed\""},
        // Duplicate keys, including one whose first value was null.
        BadCase{"DuplicateKey", "name: a\nworld_size: 2\nname: b\n", "job.yaml:3:1: name: ",
                "duplicate key \"name\" (first at 1:1)"},
        BadCase{"DuplicateAfterNull", "training:\n  steps: ~\n  steps: 3\n",
                "job.yaml:3:3: training.steps: ", "duplicate key \"steps\" (first at 2:3)"},
        // The same mistakes in JSON.
        BadCase{"JsonUnknownNested",
                "{\n  \"name\": \"j\",\n  \"training\": {\"steps\": 1, \"stpes\": 2}\n}\n",
                "job.yaml:3:28: training.stpes: ", "did you mean \"steps\"?"},
        BadCase{"JsonDuplicateKey", "{\"world_size\": 1,\n \"world_size\": 2}",
                "job.yaml:2:2: world_size: ", "duplicate key \"world_size\" (first at 1:2)"},
        BadCase{"JsonStringForInt", "{\"world_size\": \"four\"}", "job.yaml:1:16: world_size: ",
                "expected an integer (int64), got the string \"four\"; write numbers without quotes"},
        BadCase{"JsonQuotedInt", "{\"world_size\": \"4\"}", "job.yaml:1:16: world_size: ",
                "expected an integer (int64), got the string \"4\"; write numbers without quotes"},
        BadCase{"JsonUnterminatedString", "{\"name\": \"abc}", "job.yaml:1:15: ",
                "syntax error"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

// The deepest field path: units[i].params[j].shape[k] in a JSON model spec.
TEST(ModelSpecErrorTest, DeepPathInJson) {
  const std::string text = R"({
 "name": "m",
 "units": [
  {"name": "a", "params": [{"name": "a.w", "shape": [4, 4]}]},
  {"name": "b", "params": [
    {"name": "b.w", "shape": [4, 4]},
    {"name": "b.v", "shape": [8, 7.5]}
  ]}
 ]
})";
  muonmesh::v1::ModelSpec spec;
  const absl::Status status = ParseMessageText(text, "spec.json", &spec);
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  // Line 7: `    {"name": "b.v", "shape": [8, 7.5]}`; "7.5" starts at column 34.
  EXPECT_EQ(std::string(status.message()),
            "spec.json:7:34: units[1].params[1].shape[1]: expected an integer (int64), got \"7.5\"");
}

TEST(ModelSpecErrorTest, ShapeWrittenAsStringIsATypeError) {
  muonmesh::v1::ModelSpec spec;
  const absl::Status status = ParseMessageText(
      R"({"units": [{"name": "u", "params": [{"name": "w", "shape": [4, "4"]}]}]})", "spec.json",
      &spec);
  EXPECT_EQ(std::string(status.message()),
            "spec.json:1:64: units[0].params[0].shape[1]: expected an integer (int64), got the "
            "string \"4\"; write numbers without quotes");
}

TEST(ModelSpecErrorTest, UnknownParamFieldNamesClosestField) {
  const std::string text = "units:\n- name: u\n  params:\n  - {name: w, shap: [1, 2]}\n";
  muonmesh::v1::ModelSpec spec;
  const absl::Status status = ParseMessageText(text, "spec.yaml", &spec);
  EXPECT_EQ(std::string(status.message()),
            "spec.yaml:4:15: units[0].params[0].shap: unknown field \"shap\" in "
            "muonmesh.v1.ParamSpec; did you mean \"shape\"?");
}

TEST(ModelSpecErrorTest, NoSuggestionWhenNothingIsClose) {
  muonmesh::v1::ModelSpec spec;
  const absl::Status status = ParseMessageText("layers: []\n", "spec.yaml", &spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("unknown field \"layers\""));
  EXPECT_THAT(std::string(status.message()), Not(HasSubstr("did you mean")));
}

// ---------------------------------------------------------------------------
// Values that must be accepted, and what they become.

// A file with nothing in it is a mistake (a wrong path, a truncated write),
// not a request for all defaults; "{}" asks for those.
TEST(ParseMessageTextTest, EmptyDocumentsAreErrors) {
  struct Case {
    const char* text;
    const char* where;  // the null root, or the end of the text
  };
  for (const Case& c : {Case{"", "e.yaml:1:1: "}, Case{"\n", "e.yaml:2:1: "},
                        Case{"# just a comment\n", "e.yaml:2:1: "}, Case{"  # indented", "e.yaml:1:13: "},
                        Case{"---\n", "e.yaml:2:1: "}, Case{"~\n", "e.yaml:1:1: "},
                        Case{"\n  null  # nothing\n", "e.yaml:2:3: "}}) {
    muonmesh::v1::JobSpec job;
    job.set_name("stale");
    const absl::Status status = ParseMessageText(c.text, "e.yaml", &job);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << "text: " << c.text;
    EXPECT_EQ(std::string(status.message()),
              absl::StrCat(c.where, "empty document (nothing but comments, null or ---)"))
        << "text: " << c.text;
    EXPECT_EQ(job.ByteSizeLong(), 0u) << "text: " << c.text;
  }
}

TEST(ParseMessageTextTest, EmptyMappingGivesEmptyMessage) {
  for (const char* text : {"{}", "{}\n# comment\n", "--- {}\n", " # comment\n{ }"}) {
    muonmesh::v1::JobSpec job;
    job.set_name("stale");
    EXPECT_TRUE(ParseMessageText(text, "e.yaml", &job).ok()) << "text: " << text;
    EXPECT_EQ(job.ByteSizeLong(), 0u) << "text: " << text;
  }
}


// yaml-cpp skips a UTF-8 byte order mark and counts columns after it; it
// reads UTF-16 and UTF-32 too. Both readers agree.
TEST(ParseMessageTextTest, ByteOrderMarkAndUtf16) {
  muonmesh::v1::JobSpec job;
  ASSERT_TRUE(ParseMessageText("\xEF\xBB\xBFname: caf\xC3\xA9\nworld_size: 2\n", "bom.yaml", &job).ok());
  EXPECT_EQ(job.name(), "caf\xC3\xA9");
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(std::string(ParseMessageText("\xEF\xBB\xBFworld_size: x\n", "bom.yaml", &job).message()),
            "bom.yaml:1:13: world_size: expected an integer (int64), got \"x\"");

  std::string utf16 = "\xFF\xFE";  // little-endian, with its mark
  for (const char c : std::string_view("name: j\nworld_size: 3\n")) {
    utf16 += c;
    utf16 += '\0';
  }
  ASSERT_TRUE(ParseMessageText(utf16, "le.yaml", &job).ok());
  EXPECT_EQ(job.name(), "j");
  EXPECT_EQ(job.world_size(), 3);
}

// JSON is read by its own reader: strict RFC 8259, plus YAML's comments.
TEST(ParseMessageTextTest, JsonWithCommentsAndEscapes) {
  muonmesh::v1::JobSpec job;
  const absl::Status status = ParseMessageText(
      "# a job\n{\"name\": \"caf\\u00e9 \\ud83d\\ude00 \\\"q\\\" \\/\",  # its name\n"
      " \"world_size\": 2}\n# end\n",
      "j.json", &job);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(job.name(), "caf\xC3\xA9 \xF0\x9F\x98\x80 \"q\" /");
  EXPECT_EQ(job.world_size(), 2);
}

TEST(ParseMessageTextTest, NullMeansNotSet) {
  muonmesh::v1::JobSpec job;
  ASSERT_TRUE(ParseMessageText("name: ~\nworld_size: null\nparallelism:\n"
                               "model: {mlp: ~, moe_mlp: {d_in: 3}}\ninit: {seed: Null}\n",
                               "n.yaml", &job)
                  .ok());
  EXPECT_EQ(job.name(), "");
  EXPECT_EQ(job.world_size(), 0);
  EXPECT_FALSE(job.has_parallelism());
  EXPECT_EQ(job.model().kind_case(), muonmesh::v1::ModelConfig::kMoeMlp);
  EXPECT_EQ(job.model().moe_mlp().d_in(), 3);
  EXPECT_TRUE(job.has_init());
  EXPECT_EQ(job.init().source_case(), muonmesh::v1::InitConfig::SOURCE_NOT_SET);
}

TEST(ParseMessageTextTest, ScalarEdgeCases) {
  muonmesh::v1::JobSpec job;
  const absl::Status status = ParseMessageText(
      "name: 123\n"                          // a plain number is a fine string
      "device: \"null\"\n"                   // a quoted null is a string
      "world_size: 8\n"
      "init: {seed: 18446744073709551615}\n"  // uint64 max
      "parallelism: {expert_model_parallel_size: -9223372036854775808}\n"  // int64 min
      "training: {steps: +007}\n"
      "optimizer:\n"
      "  muon: {lr: 1e-400, momentum: -.5, weight_decay: 2.5, ns_steps: -2147483648,\n"
      "         nesterov: false}\n"
      "  adamw: {eps: 1.0e-8, lr: 3}\n",
      "s.yaml", &job);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(job.name(), "123");
  EXPECT_EQ(job.device(), "null");
  EXPECT_EQ(job.world_size(), 8);
  EXPECT_EQ(job.init().seed(), UINT64_MAX);
  EXPECT_EQ(job.parallelism().expert_model_parallel_size(), INT64_MIN);
  EXPECT_EQ(job.training().steps(), 7);
  EXPECT_EQ(job.optimizer().muon().lr(), 0.0);
  EXPECT_EQ(job.optimizer().muon().momentum(), -0.5);
  EXPECT_EQ(job.optimizer().muon().weight_decay(), 2.5);
  EXPECT_EQ(job.optimizer().muon().ns_steps(), INT32_MIN);
  EXPECT_TRUE(job.optimizer().muon().has_nesterov());  // proto3 optional: presence kept
  EXPECT_FALSE(job.optimizer().muon().nesterov());
  EXPECT_EQ(job.optimizer().adamw().eps(), 1.0e-8);
  EXPECT_EQ(job.optimizer().adamw().lr(), 3.0);
}

TEST(ParseMessageTextTest, EmptyMappingCreatesSubmessage) {
  muonmesh::v1::JobSpec job;
  ASSERT_TRUE(ParseMessageText("{\"init\": {}}", "j.json", &job).ok());
  EXPECT_TRUE(job.has_init());
  EXPECT_FALSE(job.has_data());
}

// ---------------------------------------------------------------------------
// Map fields, enums and bytes, which the muonmesh protos do not use yet, on
// protobuf's own well-known types.

TEST(WellKnownTypesTest, MapEnumAndNestedPaths) {
  google::protobuf::Struct value;
  ASSERT_TRUE(ParseMessageText("fields:\n"
                               "  a: {number_value: 1.5}\n"
                               "  b: {null_value: NULL_VALUE}\n"
                               "  c: {struct_value: {fields: {d: {string_value: x}}}}\n",
                               "s.yaml", &value)
                  .ok());
  ASSERT_EQ(value.fields().size(), 3u);
  EXPECT_EQ(value.fields().at("a").number_value(), 1.5);
  EXPECT_EQ(value.fields().at("b").kind_case(), google::protobuf::Value::kNullValue);
  EXPECT_EQ(value.fields().at("c").struct_value().fields().at("d").string_value(), "x");

  absl::Status status = ParseMessageText("fields:\n  a: {null_value: NULL_VALU}\n", "s.yaml", &value);
  EXPECT_EQ(std::string(status.message()),
            "s.yaml:2:19: fields[\"a\"].null_value: unknown value \"NULL_VALU\" for enum "
            "google.protobuf.NullValue; did you mean \"NULL_VALUE\"?");
  status = ParseMessageText("fields: {a: {}, b: {}, a: {}}", "s.yaml", &value);
  EXPECT_EQ(std::string(status.message()),
            "s.yaml:1:24: fields[\"a\"]: duplicate key \"a\" (first at 1:10)");
  status = ParseMessageText("fields: {a: ~}", "s.yaml", &value);
  EXPECT_EQ(std::string(status.message()), "s.yaml:1:13: fields[\"a\"]: null is not allowed as a map value");
}

TEST(WellKnownTypesTest, BytesAreBase64) {
  google::protobuf::BytesValue bytes;
  ASSERT_TRUE(ParseMessageText("value: aGVsbG8=", "b.yaml", &bytes).ok());
  EXPECT_EQ(bytes.value(), "hello");
  EXPECT_EQ(std::string(ParseMessageText("value: \"*not base64*\"", "b.yaml", &bytes).message()),
            "b.yaml:1:8: value: expected base64 (bytes), got \"*not base64*\"");
}

TEST(WellKnownTypesTest, FloatRange) {
  google::protobuf::FloatValue f;
  ASSERT_TRUE(ParseMessageText("value: 3.4e38", "f.yaml", &f).ok());
  EXPECT_EQ(std::string(ParseMessageText("value: 3.5e38", "f.yaml", &f).message()),
            "f.yaml:1:8: value: \"3.5e38\" is out of range for float");
  EXPECT_EQ(std::string(ParseMessageText("value: \"1.5\"", "f.yaml", &f).message()),
            "f.yaml:1:8: value: expected a finite number (float), got the string \"1.5\"; write "
            "numbers without quotes");
}

// Enums and strings may be quoted; only numbers may not.
TEST(WellKnownTypesTest, QuotedEnumAndStringValuesAreFine) {
  google::protobuf::Value value;
  ASSERT_TRUE(ParseMessageText("{\"null_value\": \"NULL_VALUE\"}", "v.json", &value).ok());
  EXPECT_EQ(value.kind_case(), google::protobuf::Value::kNullValue);
  ASSERT_TRUE(ParseMessageText("{\"string_value\": \"4\"}", "v.json", &value).ok());
  EXPECT_EQ(value.string_value(), "4");
}

// ---------------------------------------------------------------------------
// Depth and size limits.

// `head`, then `unit` as often as fits in `bytes` with `tail`, then `tail`.
std::string Repeat(absl::string_view head, absl::string_view unit, absl::string_view tail,
                   std::size_t bytes) {
  std::string text(head);
  while (text.size() + unit.size() + tail.size() <= bytes) text.append(unit.data(), unit.size());
  text.append(tail.data(), tail.size());
  return text;
}

// google.protobuf.DescriptorProto nests through `nested_type`, so it can
// reach any depth. `levels` times "{nested_type: [" puts the innermost
// mapping at depth 2 * levels + 1; `innermost` goes there.
std::string NestedDescriptor(int levels, absl::string_view innermost) {
  std::string text(innermost);
  for (int i = 0; i < levels; ++i) text = absl::StrCat("{nested_type: [", text, "]}");
  return text;
}

TEST(LimitsTest, NestingDepthBoundary) {
  google::protobuf::DescriptorProto descriptor;
  // Innermost mapping at depth 63, its reserved_name sequence at 64: fine.
  ASSERT_TRUE(
      ParseMessageText(NestedDescriptor(31, "{reserved_name: [x]}"), "d.yaml", &descriptor).ok());
  // Innermost mapping at depth 65: one too many. It opens at column
  // 1 + 32 * len("{nested_type: [") = 481.
  const absl::Status status = ParseMessageText(NestedDescriptor(32, "{}"), "d.yaml", &descriptor);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("d.yaml:1:481: nested_type[0]"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("nesting deeper than 64 levels"));
}

// Stopped while reading, at the first bracket too deep (the readers allow
// one level more than the filler, which reports that level with its path).
TEST(LimitsTest, ParserDepthLimitIsAnErrorNotACrash) {
  muonmesh::v1::JobSpec job;
  for (const std::string& text : {std::string(100000, '['), absl::StrCat("a: ", std::string(100, '[')),
                                   Repeat("", "- ", "", 1000)}) {
    const absl::Status status = ParseMessageText(text, "deep.yaml", &job);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasLocation(status.message(), "deep.yaml")) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("nesting deeper than 64 levels"));
  }
  EXPECT_EQ(std::string(ParseMessageText(std::string(100000, '['), "deep.json", &job).message()),
            "deep.json:1:66: nesting deeper than 64 levels");
}

TEST(LimitsTest, SelfReferencingAliasStops) {
  google::protobuf::DescriptorProto descriptor;
  const absl::Status status =
      ParseMessageText("&a {name: x, nested_type: [*a]}", "cycle.yaml", &descriptor);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("nesting deeper than 64 levels"));
}

TEST(LimitsTest, AliasBombIsRejected) {
  // message_type is a repeated DescriptorProto. Level k names level k-1 ten
  // times, so the last one expands to a million descriptors from ~400 bytes.
  std::string text = "message_type:\n- &l0 {name: x}\n";
  for (int level = 1; level <= 6; ++level) {
    absl::StrAppend(&text, "- &l", level, " {nested_type: [");
    for (int i = 0; i < 10; ++i) absl::StrAppend(&text, i ? ", " : "", "*l", level - 1);
    text += "]}\n";
  }
  google::protobuf::FileDescriptorProto file;
  const absl::Status status = ParseMessageText(text, "bomb.yaml", &file);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("too many nodes"));
}

TEST(LimitsTest, NodeCountLimitPerByteOfYaml) {
  // In a flow mapping every ',' adds a null key and a null value: the
  // densest way to spend nodes, here about two a byte. YAML may spend one
  // per 4 bytes (plus 1024). (kMaxNodes itself takes 32 MiB of JSON to
  // reach: parse_memory_test's stress tests reach it.)
  const std::string text = Repeat("", "- {,,,,,,,,,,}\n", "", 40000);
  muonmesh::v1::JobSpec job;
  const absl::Status status = ParseMessageText(text, "dense.yaml", &job);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasLocation(status.message(), "dense.yaml")) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("more than ", text.size() / 4 + 1024, " nodes, the most ",
                                     text.size(), " bytes of YAML may hold (one per 4 bytes, "
                                     "plus 1024)")));
}

// yaml-cpp reads a flow collection that could be a mapping key (here: the
// whole document) before it parses any of it; past kMaxYamlLookahead
// non-blank bytes the reader stops it, and says what to do.
TEST(LimitsTest, LargeYamlFlowCollectionIsRefusedWithAdvice) {
  const std::string text = Repeat("{name: x, model: {mlp: {dims: [", "1, ", "1]}}}\n", 300000);
  muonmesh::v1::JobSpec job;
  const absl::Status status = ParseMessageText(text, "flow.yaml", &job);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("more than ", kMaxYamlLookahead, " non-blank bytes of YAML")));
  EXPECT_THAT(std::string(status.message()), HasSubstr("or the whole file as JSON"));
  // The same list in block style, or in JSON, is fine.
  const std::string block = Repeat("name: x\nmodel:\n  mlp:\n    dims:\n", "    - 1\n", "", 300000);
  ASSERT_TRUE(ParseMessageText(block, "block.yaml", &job).ok());
  EXPECT_GT(job.model().mlp().dims_size(), 30000);
  const std::string json = Repeat("{\"name\": \"x\", \"model\": {\"mlp\": {\"dims\": [", "1, ",
                                  "1]}}}", 300000);
  ASSERT_TRUE(ParseMessageText(json, "flow.json", &job).ok());
  EXPECT_GT(job.model().mlp().dims_size(), 90000);
}

// A JSON file with a mistake goes to yaml-cpp (it may be YAML's flow style,
// as "{name: x}" is); a large one is too large for it, and the JSON
// reader's error stands.
TEST(LimitsTest, LargeJsonWithAMistakeReportsTheJsonError) {
  std::string text = Repeat("{\"name\": \"x\", \"model\": {\"mlp\": {\"dims\": [", "1, ", "1,]}}}",
                            300000);
  muonmesh::v1::JobSpec job;
  absl::Status status = ParseMessageText(text, "bad.json", &job);
  EXPECT_TRUE(absl::StartsWith(status.message(),
                               absl::StrCat("bad.json:1:", text.size() - 3,
                                            ": syntax error: expected a value, got ']' (JSON) "
                                            "(and it is too large to read as YAML")))
      << status;
  // Small, the same mistake is fine YAML.
  text = "{\"name\": \"x\", \"model\": {\"mlp\": {\"dims\": [1, 2,]}}}";
  ASSERT_TRUE(ParseMessageText(text, "small.json", &job).ok());
  EXPECT_THAT(job.model().mlp().dims(), ::testing::ElementsAre(1, 2));
}

TEST(LimitsTest, TextOverLimitIsRejectedBeforeParsing) {
  const std::string text(kMaxFileBytes + 1, ' ');
  muonmesh::v1::JobSpec job;
  const absl::Status status = ParseMessageText(text, "big.yaml", &job);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("big.yaml: input is 67108865 bytes"));
}

// ---------------------------------------------------------------------------
// Files.

class LoadMessageFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           absl::StrCat("message_file_test_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(std::string_view name, std::string_view text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  std::filesystem::path dir_;
};

TEST_F(LoadMessageFileTest, LoadsAndNamesThePathInErrors) {
  muonmesh::v1::JobSpec job;
  ASSERT_TRUE(LoadMessageFile(Write("ok.yaml", "name: j\nworld_size: 2\n"), &job).ok());
  EXPECT_EQ(job.world_size(), 2);

  const std::string bad = Write("bad.yaml", "name: j\nworld_size: two\n");
  EXPECT_EQ(std::string(LoadMessageFile(bad, &job).message()),
            absl::StrCat(bad, ":2:13: world_size: expected an integer (int64), got \"two\""));
  EXPECT_EQ(job.ByteSizeLong(), 0u);
}

TEST_F(LoadMessageFileTest, MissingFileIsNotFound) {
  muonmesh::v1::JobSpec job;
  const std::string path = (dir_ / "absent.yaml").string();
  const absl::Status status = LoadMessageFile(path, &job);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()), HasSubstr(path));
}

TEST_F(LoadMessageFileTest, DirectoryIsInvalid) {
  muonmesh::v1::JobSpec job;
  const absl::Status status = LoadMessageFile(dir_.string(), &job);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("not a regular file"));
}

TEST_F(LoadMessageFileTest, FileOverLimitIsInvalid) {
  const std::string path = Write("big.yaml", "");
  std::filesystem::resize_file(path, kMaxFileBytes + 1);  // sparse: costs no disk
  muonmesh::v1::JobSpec job;
  const absl::Status status = LoadMessageFile(path, &job);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr(path));
  EXPECT_THAT(std::string(status.message()), HasSubstr("larger than the limit"));
}

// ---------------------------------------------------------------------------
// Real inputs.

std::string SpecPath(absl::string_view name) {
  return absl::StrCat(MUONMESH_SPECS_DIR, "/", name, ".json");
}

// The counts of specs/README.md's table.
struct SpecCase {
  const char* name;
  int units;
  int tensors;
  int64_t parameters;
};

class RealSpecTest : public ::testing::TestWithParam<SpecCase> {};

TEST_P(RealSpecTest, LoadsWithExpectedTensorCount) {
  const std::string path = SpecPath(GetParam().name);
  ASSERT_TRUE(muonmesh::testing::ModelSpecExists(path));
  muonmesh::v1::ModelSpec spec;
  const absl::Status status = LoadMessageFile(path, &spec);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(spec.name(), GetParam().name);
  int tensors = 0;
  int64_t parameters = 0;
  for (const muonmesh::v1::UnitSpec& unit : spec.units()) {
    EXPECT_FALSE(unit.name().empty());
    tensors += unit.params_size();
    for (const muonmesh::v1::ParamSpec& param : unit.params()) {
      EXPECT_FALSE(param.shape().empty()) << param.name();
      EXPECT_TRUE(param.optimizer() == "muon" || param.optimizer() == "adamw") << param.name();
      int64_t elements = 1;
      for (const int64_t dim : param.shape()) elements *= dim;
      parameters += elements;
    }
  }
  EXPECT_EQ(spec.units_size(), GetParam().units);
  EXPECT_EQ(tensors, GetParam().tensors);
  EXPECT_EQ(parameters, GetParam().parameters);
}

INSTANTIATE_TEST_SUITE_P(Specs, RealSpecTest,
                         ::testing::Values(SpecCase{"gpt2-124m", 14, 148, 124'439'808},
                                           SpecCase{"llama3-8b", 34, 291, 8'030'261'248},
                                           SpecCase{"deepseek-v3", 63, 967, 671'026'404'352}),
                         [](const ::testing::TestParamInfo<SpecCase>& info) {
                           std::string name = info.param.name;
                           for (char& c : name) {
                             if (!absl::ascii_isalnum(c)) c = '_';
                           }
                           return name;
                         });

TEST(RealSpecTest, Gpt2FirstTensorShape) {
  const std::string path = SpecPath("gpt2-124m");
  ASSERT_TRUE(muonmesh::testing::ModelSpecExists(path));
  muonmesh::v1::ModelSpec spec;
  ASSERT_TRUE(LoadMessageFile(path, &spec).ok());
  const muonmesh::v1::ParamSpec& wte = spec.units(0).params(0);
  EXPECT_EQ(wte.name(), "wte.weight");
  EXPECT_THAT(wte.shape(), ::testing::ElementsAre(50257, 768));
  EXPECT_EQ(wte.optimizer(), "adamw");
}

// The job file of docs/architecture.md §2, verbatim, and the same job in JSON.
constexpr std::string_view kJobYaml = R"(name: mlp-hfsdp
world_size: 4
device: cpu                      # or cuda
parallelism:
  data_parallel_sharding_strategy: optim_grads_params
  num_distributed_optimizer_instances: 2
  outer_dp_sharding_strategy: optim
  expert_model_parallel_size: 1
model:
  mlp: {dims: [32, 64, 64, 8]}   # or moe_mlp: {...}, or synthetic: {spec: FILE, scale: 0.125}
init: {seed: 7}                  # or {safetensors: FILE}
data: {teacher: {seed: 11, samples: 4096}}   # or {safetensors: FILE} with tensors x, y
optimizer:
  muon: {lr: 0.02, momentum: 0.95, nesterov: true, ns_steps: 5, weight_decay: 0.0, scale: original}
  adamw: {lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1.0e-8, weight_decay: 0.0}
  owner_assignment: lpt          # or round_robin, allgather
training: {steps: 20, global_batch_size: 64, checkpoint_every: 5, max_restarts: 1}
output: {dir: runs/mlp-hfsdp, export: runs/mlp-hfsdp/final.safetensors}
)";

constexpr std::string_view kJobJson = R"({
  "name": "mlp-hfsdp",
  "world_size": 4,
  "device": "cpu",
  "parallelism": {
    "data_parallel_sharding_strategy": "optim_grads_params",
    "num_distributed_optimizer_instances": 2,
    "outer_dp_sharding_strategy": "optim",
    "expert_model_parallel_size": 1
  },
  "model": {"mlp": {"dims": [32, 64, 64, 8]}},
  "init": {"seed": 7},
  "data": {"teacher": {"seed": 11, "samples": 4096}},
  "optimizer": {
    "muon": {"lr": 0.02, "momentum": 0.95, "nesterov": true, "ns_steps": 5,
             "weight_decay": 0.0, "scale": "original"},
    "adamw": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1.0e-8, "weight_decay": 0.0},
    "owner_assignment": "lpt"
  },
  "training": {"steps": 20, "global_batch_size": 64, "checkpoint_every": 5, "max_restarts": 1},
  "output": {"dir": "runs/mlp-hfsdp", "export": "runs/mlp-hfsdp/final.safetensors"}
})";

TEST(JobSpecTest, YamlAndJsonAgree) {
  muonmesh::v1::JobSpec from_yaml;
  muonmesh::v1::JobSpec from_json;
  ASSERT_TRUE(ParseMessageText(kJobYaml, "job.yaml", &from_yaml).ok());
  ASSERT_TRUE(ParseMessageText(kJobJson, "job.json", &from_json).ok());
  std::string diff;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(from_yaml, from_json)) << diff;

  // And both mean what the file says (guards against two equal mistakes).
  EXPECT_EQ(from_yaml.world_size(), 4);
  EXPECT_EQ(from_yaml.parallelism().num_distributed_optimizer_instances(), 2);
  EXPECT_THAT(from_yaml.model().mlp().dims(), ::testing::ElementsAre(32, 64, 64, 8));
  EXPECT_EQ(from_yaml.init().seed(), 7u);
  EXPECT_EQ(from_yaml.data().teacher().samples(), 4096);
  EXPECT_TRUE(from_yaml.optimizer().muon().nesterov());
  EXPECT_EQ(from_yaml.optimizer().adamw().eps(), 1.0e-8);
  EXPECT_EQ(from_yaml.optimizer().owner_assignment(), "lpt");
  EXPECT_EQ(from_yaml.output().export_(), "runs/mlp-hfsdp/final.safetensors");
}

// ---------------------------------------------------------------------------
// Property: any prefix of a valid document either parses or fails with
// InvalidArgument at a location; nothing crashes or throws.

void ExpectEveryPrefixBehaves(std::string_view text, std::size_t samples,
                              google::protobuf::Message* msg) {
  int parsed = 0;
  int failed = 0;
  for (std::size_t i = 0; i <= samples; ++i) {
    const std::size_t cut = text.size() * i / samples;
    const absl::Status status = ParseMessageText(text.substr(0, cut), "cut", msg);
    if (status.ok()) {
      ++parsed;
      continue;
    }
    ++failed;
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << "cut at " << cut;
    EXPECT_TRUE(HasLocation(status.message(), "cut")) << "cut at " << cut << ": " << status;
  }
  // Sanity: the whole text parses; the empty prefix does not.
  EXPECT_GE(parsed, 1);
  EXPECT_GE(failed, 1);
}

TEST(TruncationTest, JsonSpecPrefixes) {
  const std::string path = SpecPath("gpt2-124m");
  ASSERT_TRUE(muonmesh::testing::ModelSpecExists(path));
  std::ifstream file(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  ASSERT_GT(text.size(), 1000u);
  muonmesh::v1::ModelSpec spec;
  ExpectEveryPrefixBehaves(text, 200, &spec);
}

TEST(TruncationTest, JobPrefixesAtEveryByte) {
  muonmesh::v1::JobSpec job;
  ExpectEveryPrefixBehaves(kJobJson, kJobJson.size(), &job);
  ExpectEveryPrefixBehaves(kJobYaml, kJobYaml.size(), &job);
}

// Property: flipping single bytes of a valid job to characters that matter
// to YAML/JSON (and to a few that should never appear) never crashes, and a
// failure is always InvalidArgument at a location.
TEST(MutationTest, SingleByteMutationsBehave) {
  // An array, not a literal's strlen: the alphabet holds a NUL.
  static constexpr char kChars[] = "{}[],:\"'&*!|>-?#%@`~\t\n\\\0\xff\xc3 0a.e";
  constexpr std::string_view kAlphabet(kChars, sizeof(kChars) - 1);
  std::uint64_t state = 0x9E3779B97F4A7C15u;  // fixed seed: failures reproduce
  const auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  muonmesh::v1::JobSpec job;
  int failed = 0;
  for (const std::string_view original : {kJobYaml, kJobJson}) {
    for (int trial = 0; trial < 400; ++trial) {
      std::string text(original);
      text[next() % text.size()] = kAlphabet[next() % kAlphabet.size()];
      const absl::Status status = ParseMessageText(text, "mut", &job);
      if (status.ok()) continue;
      ++failed;
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status << "\n" << text;
      EXPECT_TRUE(HasLocation(status.message(), "mut")) << status << "\n" << text;
    }
  }
  EXPECT_GT(failed, 100);  // the mutations do reach the error paths
}

}  // namespace
}  // namespace muonmesh::protoio
