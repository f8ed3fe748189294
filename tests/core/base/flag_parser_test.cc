// core/base/flag_parser.h on its own: every kind of flag, both
// spellings of a name, and errors that name the flag (with dashes).

#include "core/base/flag_parser.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace muonmesh {
namespace {

struct Values {
  std::string name;
  int64_t count = 3;
  absl::Duration ttl = absl::Seconds(10);
  bool fast = false;
};

absl::Status Parse(const std::vector<std::string>& args, Values* v, bool* help) {
  FlagParser parser("prog");
  parser.String("--data-dir", "DIR", "a folder", &v->name);
  parser.Int("--count", "N", "a count", &v->count);
  parser.Duration("--lease-ttl", "D", "a duration", &v->ttl);
  parser.Bool("--fast", "go fast", &v->fast);
  return parser.Parse(args, help);
}

TEST(FlagParserTest, EveryKindAndBothSpellings) {
  Values v;
  bool help = true;
  ASSERT_TRUE(Parse({"--data_dir", "/x", "--count=7", "--lease_ttl=1h30m", "--fast"}, &v, &help)
                  .ok());
  EXPECT_FALSE(help);
  EXPECT_EQ(v.name, "/x");
  EXPECT_EQ(v.count, 7);
  EXPECT_EQ(v.ttl, absl::Minutes(90));
  EXPECT_TRUE(v.fast);
  Values defaults;
  ASSERT_TRUE(Parse({"--lease-ttl", "500ms"}, &defaults, &help).ok());
  EXPECT_EQ(defaults.ttl, absl::Milliseconds(500));
  EXPECT_EQ(defaults.count, 3);
}

TEST(FlagParserTest, ErrorsNameTheFlagWithDashes) {
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"--lease_ttl=ten"}, "--lease-ttl: 'ten' is not a duration"},
      {{"--lease-ttl", "10"}, "--lease-ttl: '10' is not a duration"},
      {{"--count=x"}, "--count: 'x' is not an integer"},
      {{"--fast=true"}, "--fast takes no value"},
      {{"--data_dri", "/x"}, "unknown flag --data-dri"},
      {{"--data-dir", "--fast"}, "--data-dir needs a value"},
      {{"stray"}, "unexpected argument 'stray'"},
  };
  for (const auto& c : cases) {
    Values v;
    bool help = false;
    const absl::Status st = Parse(c.args, &v, &help);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.args[0];
    EXPECT_NE(st.message().find(c.message), std::string::npos) << st.message();
  }
}

TEST(FlagParserTest, HelpWinsAndListsEveryFlag) {
  Values v;
  bool help = false;
  ASSERT_TRUE(Parse({"--count=x", "-h"}, &v, &help).ok());
  EXPECT_TRUE(help);
  FlagParser parser("prog");
  parser.Duration("--lease-ttl", "D", "how long", &v.ttl);
  const std::string usage = parser.Usage("[flags]");
  EXPECT_NE(usage.find("--lease-ttl D"), std::string::npos) << usage;
  EXPECT_NE(usage.find("how long"), std::string::npos) << usage;
}

}  // namespace
}  // namespace muonmesh
