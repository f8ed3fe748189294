#include "proto/io/json_reader.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/io/document.h"
#include "proto/io/json_document.h"
#include "proto/io/yaml_reader.h"
#include "tests/testing/model_specs.h"

namespace muonmesh::protoio::internal {
namespace {

using ::testing::HasSubstr;

// Node by node: same kind, place, quoting, value and extent.
void ExpectSameDocument(const Document& got, const Document& want, absl::string_view text) {
  ASSERT_EQ(got.size(), want.size()) << text;
  for (std::uint32_t i = 0; i < got.size(); ++i) {
    const Node& a = got[i];
    const Node& b = want[i];
    ASSERT_EQ(a.kind, b.kind) << "node " << i << " of\n" << text;
    EXPECT_EQ(a.where.line, b.where.line) << "node " << i << " of\n" << text;
    EXPECT_EQ(a.where.column, b.where.column) << "node " << i << " of\n" << text;
    if (a.is_scalar()) {
      EXPECT_EQ(a.plain, b.plain) << "node " << i << " of\n" << text;
      EXPECT_EQ(got.Scalar(a), want.Scalar(b)) << "node " << i << " of\n" << text;
    }
    if (a.is_container()) {
      EXPECT_EQ(a.size, b.size) << "node " << i << " of\n" << text;
    }
  }
}

// Reads `text` with both readers (yaml-cpp being the reference, allowed to
// read ahead as far as it likes) and expects the same document from each.
void ExpectReadersAgree(const std::string& text) {
  Document json(text);
  absl::Status error;
  ASSERT_EQ(ReadJson(text, "t", ReadLimits(), &json, &error), JsonVerdict::kRead)
      << error << "\n" << text;
  Document yaml(text);
  bool lookahead_exceeded = false;
  const absl::Status status =
      ReadYaml(text, "t", ReadLimits{.max_yaml_lookahead = kMaxFileBytes}, &yaml, &lookahead_exceeded);
  ASSERT_TRUE(status.ok()) << status << "\n" << text;
  ExpectSameDocument(json, yaml, text);
}

// Random JSON that yaml-cpp reads as JSON means it: every construct of the
// grammar, blanks, CRLF and comments between tokens; no surrogate escapes
// (yaml-cpp refuses them) and no key longer than 1024 bytes or apart from
// its ':' by a line break (yaml-cpp requires simple keys to be short and on
// one line).
class RandomJson {
 public:
  explicit RandomJson(std::uint64_t seed) : state_(seed) {}

  std::string Document() {
    std::string out;
    Space(&out);
    Container(0, &out);
    Space(&out);
    return out;
  }

 private:
  std::uint64_t Next() {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return state_;
  }
  std::size_t Below(std::size_t n) { return static_cast<std::size_t>(Next() % n); }

  void Space(std::string* out) {
    static constexpr std::string_view kSpaces[] = {"", "", "", " ", "  ", "\t", "\n", "\r\n",
                                                    "\n  ", " # a comment, ] } [\n "};
    out->append(kSpaces[Below(std::size(kSpaces))]);
  }
  // Blanks only: between a key and its ':'.
  void Blank(std::string* out) { out->append(Below(4) == 0 ? " " : ""); }

  void Value(int depth, std::string* out) {
    switch (Below(depth < 4 ? 7 : 5)) {
      case 0:
        String(out);
        break;
      case 1:
        Number(out);
        break;
      case 2: {
        static constexpr std::string_view kLiterals[] = {"true", "false", "null"};
        out->append(kLiterals[Below(3)]);
        break;
      }
      case 3:
      case 4:
        String(out);
        break;
      default:
        Container(depth + 1, out);
        break;
    }
  }

  void Container(int depth, std::string* out) {
    const bool object = Below(2) == 0;
    out->push_back(object ? '{' : '[');
    const std::size_t n = Below(5);
    for (std::size_t i = 0; i < n; ++i) {
      Space(out);
      if (object) {
        String(out);
        Blank(out);
        out->push_back(':');
        Space(out);
      }
      Value(depth, out);
      Space(out);
      if (i + 1 < n) out->push_back(',');
    }
    Space(out);
    out->push_back(object ? '}' : ']');
  }

  void String(std::string* out) {
    static constexpr std::string_view kPieces[] = {
        "a",      "name",   " ",      "caf\xC3\xA9", "- x",    ": y",    "# z",    "[1]",
        "{a: b}", "&x *y",  "'",      "\\\"",        "\\\\",   "\\/",    "\\b",    "\\f",
        "\\n",    "\\r",    "\\t",    "\\u0041",     "\\u00e9", "\\u20AC", "\\u0000", "!tag"};
    out->push_back('"');
    const std::size_t n = Below(4);
    for (std::size_t i = 0; i < n; ++i) out->append(kPieces[Below(std::size(kPieces))]);
    out->push_back('"');
  }

  void Number(std::string* out) {
    static constexpr std::string_view kNumbers[] = {
        "0", "-0", "7", "-12", "4096", "0.5", "-3.25", "1e5", "1E+5", "2.5e-3", "-0.0E0",
        "18446744073709551616"};
    out->append(kNumbers[Below(std::size(kNumbers))]);
  }

  std::uint64_t state_;
};

TEST(JsonReaderTest, AgreesWithYamlCppOnRandomJson) {
  RandomJson random(0x5DEECE66Du);  // fixed seed: failures reproduce
  for (int i = 0; i < 3000; ++i) ExpectReadersAgree(random.Document());
}

TEST(JsonReaderTest, AgreesWithYamlCppOnRealSpecs) {
  int read = 0;
  for (const char* name : {"gpt2-124m", "llama3-8b", "deepseek-v3"}) {
    const std::string path = absl::StrCat(MUONMESH_SPECS_DIR, "/", name, ".json");
    ASSERT_TRUE(muonmesh::testing::ModelSpecExists(path));
    std::ifstream file(path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    ExpectReadersAgree(text);
    ++read;
  }
  EXPECT_EQ(read, 3);
}

TEST(JsonReaderTest, LooksLikeJson) {
  for (const char* text : {"{}", "[1]", "  \n\t{", "# c\n{", "\r\n[", "#\n  # c\n  ["}) {
    EXPECT_TRUE(LooksLikeJson(text)) << text;
  }
  for (const char* text : {"", "a: {}", "--- {}", "# {", "\xEF\xBB\xBF{}", "\"a\"", "- [1]"}) {
    EXPECT_FALSE(LooksLikeJson(text)) << text;
  }
}

// Strings without escapes stay in the source; escaped ones are decoded,
// surrogate pairs included (which yaml-cpp would refuse).
TEST(JsonReaderTest, StringsPointIntoTheSourceUnlessEscaped) {
  const std::string text = R"(["plain", "caf\u00e9\ud83d\ude00\n"])";
  Document doc(text);
  absl::Status error;
  ASSERT_EQ(ReadJson(text, "t", ReadLimits(), &doc, &error), JsonVerdict::kRead) << error;
  ASSERT_EQ(doc.size(), 3u);
  EXPECT_FALSE(doc[1].in_arena);
  EXPECT_EQ(doc.Scalar(doc[1]), "plain");
  EXPECT_TRUE(doc[2].in_arena);
  EXPECT_EQ(doc.Scalar(doc[2]), "caf\xC3\xA9\xF0\x9F\x98\x80\n");
}

struct NotJsonCase {
  std::string text;
  std::string want;  // "t:LINE:COL: syntax error: ..." prefix
};

TEST(JsonReaderTest, SyntaxErrorsAreLocated) {
  for (const NotJsonCase& c : {
           NotJsonCase{"{name: x}", "t:1:2: syntax error: expected a string in double quotes"},
           NotJsonCase{"[1, 2,]", "t:1:7: syntax error: expected a value, got ']'"},
           NotJsonCase{"[01]", "t:1:3: syntax error: a number with a leading zero"},
           NotJsonCase{"[1]\n[2]", "t:2:1: syntax error: content after the JSON value"},
           NotJsonCase{"[\"a\tb\"]", "t:1:4: syntax error: control character in a string"},
           NotJsonCase{"[\"\\ud800\"]", "t:1:3: syntax error: unpaired surrogate"},
           NotJsonCase{"[\"\\x41\"]", "t:1:3: syntax error: unknown escape"},
           NotJsonCase{"[1,\r2]", "t:1:4: syntax error: carriage return without a line feed"},
           NotJsonCase{"[1,#c\n2]", "t:1:4: syntax error: expected a value, got '#'"},
           NotJsonCase{"{\"a\": tru}", "t:1:7: syntax error: expected true"},
           NotJsonCase{"[\"abc", "t:1:6: syntax error: the input ends inside a string"},
           NotJsonCase{"[1,\n 2", "t:2:3: syntax error: the input ends inside an array"},
       }) {
    Document doc(c.text);
    absl::Status error;
    EXPECT_EQ(ReadJson(c.text, "t", ReadLimits(), &doc, &error), JsonVerdict::kNotJson) << c.text;
    EXPECT_TRUE(absl::StartsWith(error.message(), c.want))
        << c.text << "\ngot:  " << error.message() << "\nwant: " << c.want;
  }
}

TEST(JsonReaderTest, LimitsRefuseWhileReading) {
  ReadLimits limits;
  limits.max_nodes = 5;
  limits.max_depth = 3;
  absl::Status error;
  {
    const std::string text = "[1, 2, 3, 4, 5]";  // the sixth node is the 5
    Document doc(text);
    EXPECT_EQ(ReadJson(text, "t", limits, &doc, &error), JsonVerdict::kRefused);
    EXPECT_EQ(error.message(),
              "t:1:14: more than 5 nodes");
    EXPECT_EQ(doc.size(), 5u);  // stopped there
  }
  {
    const std::string text = "[[[[1]]]]";  // the fourth level is refused
    Document doc(text);
    EXPECT_EQ(ReadJson(text, "t", limits, &doc, &error), JsonVerdict::kRefused);
    EXPECT_EQ(error.message(), "t:1:4: nesting deeper than 2 levels");
    EXPECT_EQ(doc.size(), 3u);
  }
  {
    // A refusal before the syntax error that follows it.
    const std::string text = std::string(100, '[') + "x";
    Document doc(text);
    EXPECT_EQ(ReadJson(text, "t", ReadLimits(), &doc, &error), JsonVerdict::kRefused);
    EXPECT_THAT(std::string(error.message()), HasSubstr("t:1:66: nesting deeper than 64 levels"));
  }
}


// Strict JSON (json_document.h) refuses what job files may hold beyond RFC
// 8259 (comments) and strings that are not UTF-8, which the job-file mode
// leaves to the filler; what both accept reads the same.
TEST(JsonReaderTest, StrictModeRefusesCommentsAndInvalidUtf8) {
  const std::string with_comment = "{\"a\": 1} # note";
  const std::string bad_utf8 = "[\"\xc0\xaf\"]";
  const std::string escaped_bad_utf8 = "[\"\\n\xff\"]";
  for (const std::string& text : {with_comment, bad_utf8, escaped_bad_utf8}) {
    Document lenient(text);
    absl::Status error;
    EXPECT_EQ(ReadJson(text, "t", ReadLimits(), &lenient, &error), JsonVerdict::kRead) << text;
    EXPECT_FALSE(ReadJsonDocument(text, "t").ok()) << text;
  }
  EXPECT_THAT(std::string(ReadJsonDocument(with_comment, "t").status().message()),
              HasSubstr("t:1:10: syntax error: content after the JSON value"));
  EXPECT_THAT(std::string(ReadJsonDocument(bad_utf8, "t").status().message()),
              HasSubstr("t:1:3: syntax error: invalid UTF-8 in a string"));
  EXPECT_THAT(std::string(ReadJsonDocument(escaped_bad_utf8, "t").status().message()),
              HasSubstr("t:1:5: syntax error: invalid UTF-8 in a string"));

  const std::string text = "{\"na\\u00efve \xc3\xa9\": [1, true, null, \"s\", {}]}";
  auto doc = ReadJsonDocument(text, "t");
  ASSERT_TRUE(doc.ok()) << doc.status();
  const JsonDocument& d = **doc;
  ASSERT_EQ(d.size(), 8u);  // map, key, sequence, 1, true, null, "s", {}
  EXPECT_EQ(d.Scalar(d[1]), "na\u00efve \xc3\xa9");
  const char* kinds[] = {"an object", "a string", "an array", "a number",
                         "a boolean", "null",     "a string", "an object"};
  for (std::uint32_t i = 0; i < d.size(); ++i) EXPECT_EQ(JsonKindName(d, d[i]), std::string(kinds[i]));
  EXPECT_TRUE(IsJsonString(d[6]));
  EXPECT_FALSE(IsJsonString(d[3]));

  JsonOptions options;
  options.max_nodes = 3;
  EXPECT_THAT(std::string(ReadJsonDocument("[1, 2, 3]", "t", options).status().message()),
              HasSubstr("more than 3 nodes"));
}

}  // namespace
}  // namespace muonmesh::protoio::internal
