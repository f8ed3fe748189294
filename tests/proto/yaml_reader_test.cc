#include "proto/io/yaml_reader.h"

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/io/document.h"

namespace muonmesh::protoio::internal {
namespace {

using ::testing::HasSubstr;

std::string Repeat(absl::string_view unit, std::size_t times) {
  std::string text;
  for (std::size_t i = 0; i < times; ++i) text.append(unit.data(), unit.size());
  return text;
}

struct Read {
  absl::Status status;
  bool lookahead_exceeded = false;
};

Read ReadInto(const std::string& text, Document* doc, const ReadLimits& limits = ReadLimits()) {
  Read read;
  read.status = ReadYaml(text, "y", limits, doc, &read.lookahead_exceeded);
  return read;
}

// The read-ahead bound trips where yaml-cpp would have to buffer: a flow
// collection that could be a key (at the document's start, after "- ",
// inside a flow sequence), or tokens after a key on one line.
TEST(YamlReaderTest, ReadAheadIsBounded) {
  ReadLimits limits;
  limits.max_yaml_lookahead = 8192;
  for (const std::string& text :
       {Repeat("[", 20000), absl::StrCat("- ", Repeat("{a: 1, ", 5000)),
        absl::StrCat("a: [", Repeat("[1, ", 5000)), absl::StrCat("\"x\"", Repeat(",", 20000)),
        absl::StrCat("name: \"", Repeat("x", 20000), "\"")}) {
    Document doc(text);
    const Read read = ReadInto(text, &doc, limits);
    EXPECT_TRUE(read.lookahead_exceeded) << read.status << "\n" << text.substr(0, 40);
    EXPECT_THAT(std::string(read.status.message()),
                HasSubstr("more than 8192 non-blank bytes of YAML after this point"));
  }
}

// Where yaml-cpp hands nodes over as it goes, the bound never trips, however
// large the document: block style, and flow collections after "key: ".
TEST(YamlReaderTest, StreamingDocumentsAreNotBounded) {
  ReadLimits limits;
  limits.max_yaml_lookahead = 8192;
  for (const std::string& text :
       {absl::StrCat("a:\n", Repeat("- {name: x, shape: [4, 4]}\n", 3000)),
        absl::StrCat("a: [", Repeat("{name: layer, shape: [4096, 4096]}, ", 3000), "]\n"),
        // Full-line comments cost nothing, even inside a flow collection
        // that yaml-cpp reads whole.
        absl::StrCat("[1,\n", Repeat("  # a comment with [[[{{{ in it\n", 3000), "2]\n")}) {
    Document doc(text);
    const Read read = ReadInto(text, &doc, limits);
    EXPECT_TRUE(read.status.ok()) << read.status << "\n" << text.substr(0, 40);
  }
}

TEST(YamlReaderTest, LimitsRefuseWhileReading) {
  ReadLimits limits;
  limits.max_nodes = 4;
  {
    const std::string text = "a: 1\nb: 2\nc: 3\n";  // the map and 4 scalars
    Document doc(text);
    const Read read = ReadInto(text, &doc, limits);
    EXPECT_EQ(read.status.message(), "y:2:4: more than 4 nodes");
    EXPECT_FALSE(read.lookahead_exceeded);
  }
  {
    // Empty entries: two nulls for each ','.
    const std::string text = absl::StrCat("- {", Repeat(",", 3000), "}\n");
    Document doc(text);
    EXPECT_THAT(std::string(ReadInto(text, &doc).status.message()),
                HasSubstr("more than 1775 nodes, the most 3005 bytes of YAML may hold (one per 4 "
                          "bytes, plus 1024)"));
  }
  {
    const std::string text = "a:\n  b:\n    c:\n      d: 1\n";
    Document doc(text);
    EXPECT_EQ(ReadInto(text, &doc, ReadLimits{.max_depth = 3}).status.message(),
              "y:4:7: nesting deeper than 2 levels");
  }
}

// Scalars that are their source text are not copied; the rest are, and
// mean what yaml-cpp says they mean.
TEST(YamlReaderTest, ScalarsPointIntoTheSourceUnlessRewritten) {
  const std::string text =
      "plain: hello world\n"
      "quoted: 'it''s'\n"
      "escaped: \"a\\tb\"\n"
      "folded: two\n  lines\n"
      "literal: |\n  kept\n";
  Document doc(text);
  ASSERT_TRUE(ReadInto(text, &doc).status.ok());
  ASSERT_EQ(doc.size(), 11u);
  const auto value = [&](std::uint32_t i) { return std::string(doc.Scalar(doc[i])); };
  EXPECT_EQ(value(2), "hello world");
  EXPECT_FALSE(doc[2].in_arena);
  EXPECT_TRUE(doc[2].plain);
  EXPECT_EQ(value(4), "it's");
  EXPECT_TRUE(doc[4].in_arena);
  EXPECT_FALSE(doc[4].plain);
  EXPECT_EQ(value(6), "a\tb");
  EXPECT_TRUE(doc[6].in_arena);
  EXPECT_EQ(value(8), "two lines");
  EXPECT_TRUE(doc[8].in_arena);
  EXPECT_EQ(value(10), "kept\n");
  EXPECT_TRUE(doc[10].in_arena);
  EXPECT_EQ(doc[10].where.line, 5u);  // the '|'
  EXPECT_EQ(doc[10].where.column, 9u);
}

TEST(YamlReaderTest, AliasesNameTheirAnchors) {
  const std::string text = "a: &x [1, 2]\nb: *x\n";
  Document doc(text);
  ASSERT_TRUE(ReadInto(text, &doc).status.ok());
  ASSERT_EQ(doc.size(), 7u);  // map, a, [, 1, 2, b, *x
  EXPECT_EQ(doc[6].kind, Node::kAlias);
  EXPECT_EQ(doc.Resolve(6), 2u);
  EXPECT_EQ(doc.Next(2), 5u);  // past the sequence
}

TEST(YamlReaderTest, SecondDocumentIsAnError) {
  const std::string text = "a: 1\n--- [1, 2\n";  // not even read: it is not closed
  Document doc(text);
  EXPECT_EQ(ReadInto(text, &doc).status.message(),
            "y:2:1: content after the end of the document (one YAML document per file)");
}

TEST(YamlReaderTest, NoDocumentLeavesItEmpty) {
  for (const std::string text : {"", "# only\n# comments\n", "\n\n"}) {
    Document doc(text);
    EXPECT_TRUE(ReadInto(text, &doc).status.ok());
    EXPECT_EQ(doc.size(), 0u);
  }
}

}  // namespace
}  // namespace muonmesh::protoio::internal
