// Text and llm.c token shards as one stream: the bytes written here by hand
// (header fields little-endian, as llm.c's write_datafile lays them out) read
// back token for token, across file boundaries and through slices; broken
// shards refused naming the file.

#include "worker/io/token_files.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/token_shard.h"

namespace muonmesh::io {
namespace {

using ::testing::HasSubstr;

std::string TempDir() {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::create_directories(dir);
  return dir.string();
}

using ::muonmesh::testing::Shard;

std::string Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  return ::muonmesh::testing::WriteFile(dir, name, bytes);
}

std::vector<int32_t> ReadAll(const worker::TokenStream& s) {
  std::vector<int32_t> out(static_cast<size_t>(s.num_tokens()));
  EXPECT_TRUE(s.Read(0, s.num_tokens(), out.data()).ok());
  return out;
}

TEST(TokenFilesTest, TextIsOneTokenPerByteAcrossFiles) {
  const std::string dir = TempDir();
  const std::string a = Write(dir, "a.txt", "Hi\n");
  const std::string b = Write(dir, "b.txt", std::string("\xff\x00z", 3));
  absl::StatusOr<std::shared_ptr<const worker::TokenStream>> s =
      OpenTokenFiles({a, b}, TokenFormat::kText);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(ReadAll(**s), (std::vector<int32_t>{'H', 'i', '\n', 255, 0, 'z'}));
  int32_t two[2];
  ASSERT_TRUE((*s)->Read(2, 2, two).ok());  // straddles the two files
  EXPECT_EQ(two[0], '\n');
  EXPECT_EQ(two[1], 255);
  EXPECT_EQ((*s)->Read(5, 2, two).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*s)->Read(-1, 1, two).code(), absl::StatusCode::kOutOfRange);
}

TEST(TokenFilesTest, ShardsReadLittleEndianUint16) {
  const std::string dir = TempDir();
  const std::string a = Write(dir, "a.bin", Shard({50256, 1, 0x1234}));
  const std::string b = Write(dir, "b.bin", Shard({65535}));
  absl::StatusOr<std::shared_ptr<const worker::TokenStream>> s =
      OpenTokenFiles({a, b}, TokenFormat::kShards);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(ReadAll(**s), (std::vector<int32_t>{50256, 1, 0x1234, 65535}));
  // Token 3 is b.bin's first: right after its 1024-byte header.
  EXPECT_EQ((*s)->Where(3), b + " at byte 1024");
  EXPECT_EQ((*s)->Where(2), a + " at byte 1028");
  absl::StatusOr<std::shared_ptr<const worker::TokenStream>> tail = SliceTokens(*s, 2, 4);
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ((*tail)->Where(1), b + " at byte 1024");
}

TEST(TokenFilesTest, BrokenShardsNameTheFile) {
  const std::string dir = TempDir();
  const struct {
    std::string bytes;
    std::string why;
  } cases[] = {
      {Shard({1, 2}, /*magic=*/20240801), "magic 20240801"},
      {Shard({1, 2}, 20240520, /*version=*/2), "version 2"},
      {Shard({1, 2}, 20240520, 1, /*count=*/3), "counts 3 tokens"},
      {std::string(100, '\0'), "shorter than a token shard's 1024-byte header"},
  };
  for (const auto& c : cases) {
    const std::string path = Write(dir, "bad.bin", c.bytes);
    absl::StatusOr<std::shared_ptr<const worker::TokenStream>> s =
        OpenTokenFiles({path}, TokenFormat::kShards);
    ASSERT_FALSE(s.ok()) << c.why;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr(path));
    EXPECT_THAT(s.status().message(), HasSubstr(c.why));
  }
  EXPECT_EQ(OpenTokenFiles({dir + "/missing.txt"}, TokenFormat::kText).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(OpenTokenFiles({Write(dir, "empty.txt", "")}, TokenFormat::kText).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenFilesTest, SlicesAreViewsOfTheirRange) {
  auto base = std::make_shared<const worker::InMemoryTokens>(std::vector<int32_t>{0, 1, 2, 3, 4, 5});
  absl::StatusOr<std::shared_ptr<const worker::TokenStream>> tail = SliceTokens(base, 4, 6);
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_EQ(ReadAll(**tail), (std::vector<int32_t>{4, 5}));
  int32_t one;
  EXPECT_EQ((*tail)->Read(2, 1, &one).code(), absl::StatusCode::kOutOfRange);
  EXPECT_FALSE(SliceTokens(base, 3, 3).ok());
  EXPECT_FALSE(SliceTokens(base, 0, 7).ok());
}

TEST(TokenWindowsTest, PeriodAndStartsFollowTheFormula) {
  // N = 10, T = 4: p(k) = 4k mod 6 = 0, 4, 2, 0, ...: period 3 = 6 / gcd(4, 6).
  EXPECT_EQ(worker::WindowPeriod(10, 4), 3);
  EXPECT_EQ(worker::WindowStart(0, 10, 4), 0);
  EXPECT_EQ(worker::WindowStart(1, 10, 4), 4);
  EXPECT_EQ(worker::WindowStart(2, 10, 4), 2);
  // No overflow where k T passes 2^63: (2^40 * 2^24) mod (2^40 + 7 - 2^24),
  // worked out with Python's integers.
  const int64_t n = (int64_t{1} << 40) + 7;
  EXPECT_EQ(worker::WindowStart(int64_t{1} << 40, n, 1 << 24), int64_t{4177524992});
}

}  // namespace
}  // namespace muonmesh::io
