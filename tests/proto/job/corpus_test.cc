// The corpus pre-flight (proto/job/corpus.h): files written here by hand,
// every defect reported with the field, the file and (for a token outside
// the vocabulary) its index in the file and its value.

#include "proto/job/corpus.h"

#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/token_shard.h"

namespace muonmesh::job {
namespace {

using ::muonmesh::testing::Shard;
using ::muonmesh::testing::WriteFile;
using ::testing::HasSubstr;

std::string TempDir() {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "corpus_test" /
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(CorpusCheckTest, CountsShardsAndTextAcrossAGlob) {
  const std::string dir = TempDir();
  WriteFile(dir, "a.bin", Shard({1, 2, 3}));
  WriteFile(dir, "b.bin", Shard({4, 5}));
  absl::StatusOr<CorpusSummary> s =
      CheckCorpusFiles("data.tokens.train", dir + "/*.bin", /*tokens=*/true, 6, /*scan=*/true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->files, 2);
  EXPECT_EQ(s->tokens, 5);
  EXPECT_EQ(s->bytes, 10);  // two bytes a token, every one read

  WriteFile(dir, "t.txt", "hello");
  s = CheckCorpusFiles("data.text.train", dir + "/t.txt", /*tokens=*/false, 256, /*scan=*/true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tokens, 5);
  EXPECT_EQ(s->bytes, 0);  // bytes are below 256: nothing to scan
}

TEST(CorpusCheckTest, NamesTheFirstTokenOutsideTheVocabulary) {
  const std::string dir = TempDir();
  WriteFile(dir, "a.bin", Shard({1, 2, 3}));
  // Token 1 of b.bin is 50257: GPT-2's vocabulary is [0, 50257).
  const std::string b = WriteFile(dir, "b.bin", Shard({50256, 50257, 7}));
  absl::StatusOr<CorpusSummary> s =
      CheckCorpusFiles("data.tokens.train", dir + "/*.bin", true, 50257, true);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "data.tokens.train: " + b +
                                      ": token 1 is 50257, outside the model's vocabulary "
                                      "[0, 50257)");
  // Without the scan the headers alone pass.
  EXPECT_TRUE(CheckCorpusFiles("data.tokens.train", dir + "/*.bin", true, 50257, false).ok());

  // A text corpus with a vocabulary below 256 is scanned byte by byte.
  const std::string t = WriteFile(dir, "t.txt", std::string("ab\x80", 3));
  s = CheckCorpusFiles("data.text.train", t, false, 128, true);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr(t + ": token 2 is 128, outside"));
}

TEST(CorpusCheckTest, RefusesBrokenFilesNamingFieldAndFile) {
  const std::string dir = TempDir();
  struct Case {
    std::string bytes;
    std::string says;
  };
  const std::vector<Case> cases = {
      {Shard({1, 2}, /*magic=*/7), "magic 7"},
      {Shard({1, 2}, 20240520, /*version=*/2), "version 2"},
      {Shard({1, 2}, 20240520, 1, /*count=*/3), "the header counts 3 tokens"},
      {std::string(100, '\0'), "100 bytes, shorter than a token shard's 1024-byte header"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteFile(dir, "x.bin", c.bytes);
    absl::StatusOr<CorpusSummary> s = CheckCorpusFiles("data.tokens.val", path, true, 10, true);
    ASSERT_FALSE(s.ok()) << c.says;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("data.tokens.val: " + path + ": " + c.says));
  }
  const std::string empty = WriteFile(dir, "e.txt", "");
  EXPECT_THAT(CheckCorpusFiles("data.text.train", empty, false, 256, true).status().message(),
              HasSubstr("data.text.train: " + empty + ": empty text file"));
  EXPECT_THAT(
      CheckCorpusFiles("data.text.train", dir + "/none-*.txt", false, 256, true).status().message(),
      HasSubstr("data.text.train: no file matches"));
}

}  // namespace
}  // namespace muonmesh::job
