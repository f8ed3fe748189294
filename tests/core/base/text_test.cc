// UTF-8 and JSON string helpers against the encodings RFC 3629 and RFC 8259
// spell out (byte values typed in from the RFCs' tables, not computed).

#include "core/base/text.h"

#include <string>

#include "gtest/gtest.h"

namespace muonmesh::text {
namespace {

TEST(Utf8Test, EncodesEachLength) {
  const struct {
    uint32_t cp;
    std::string bytes;
  } cases[] = {
      {0x24, "\x24"},
      {0xE9, "\xC3\xA9"},
      {0x20AC, "\xE2\x82\xAC"},
      {0x1F600, "\xF0\x9F\x98\x80"},
      {0x10FFFF, "\xF4\x8F\xBF\xBF"},
  };
  for (const auto& c : cases) {
    std::string out;
    AppendUtf8(c.cp, &out);
    EXPECT_EQ(out, c.bytes) << std::hex << c.cp;
    EXPECT_TRUE(IsValidUtf8(out));
    EXPECT_EQ(Utf8SequenceLength(out, 0), c.bytes.size());
  }
}

TEST(Utf8Test, RefusesWhatRfc3629Forbids) {
  for (const std::string& bad : {
           std::string("\xC0\x80"),          // overlong NUL
           std::string("\xE0\x80\xAF"),      // overlong '/'
           std::string("\xED\xA0\x80"),      // surrogate U+D800
           std::string("\xF4\x90\x80\x80"),  // past U+10FFFF
           std::string("\x80"),              // a lone continuation byte
           std::string("\xE2\x82"),          // cut short
           std::string("a\xFF"),             // never a UTF-8 byte
       }) {
    EXPECT_FALSE(IsValidUtf8(bad)) << testing::PrintToString(bad);
  }
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ASCII"));
}

TEST(JsonStringTest, EscapesWhatJsonRequires) {
  EXPECT_EQ(JsonString("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(JsonString("\b\f\n\r\t"), "\"\\b\\f\\n\\r\\t\"");
  EXPECT_EQ(JsonString(std::string("\x01\x1f", 2)), "\"\\u0001\\u001f\"");
  EXPECT_EQ(JsonString("caf\xC3\xA9 /"), "\"caf\xC3\xA9 /\"");  // UTF-8 and '/' as they are
  std::string out = "x=";
  AppendJsonString("", &out);
  EXPECT_EQ(out, "x=\"\"");
}

}  // namespace
}  // namespace muonmesh::text
