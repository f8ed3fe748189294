// worker/checkpoints.h on folders made by hand: which checkpoint a resume
// takes (manifests whose sizes and CRC-32s are written here from the bytes,
// by zlib's published check value), why it skips the others, and which
// folders pruning keeps.
#include "worker/checkpoints.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>
#include <zlib.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

class CheckpointsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    out_ = (fs::temp_directory_path() /
            absl::StrCat("checkpoints_test_", ::testing::UnitTest::GetInstance()
                                                   ->current_test_info()
                                                   ->name(),
                         "_", getpid()))
               .string();
    fs::remove_all(out_);
    fs::create_directories(out_ + "/checkpoints");
  }
  void TearDown() override { fs::remove_all(out_); }

  static void Write(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
  }

  // A checkpoint of `world` rank files, each holding "rank R of step S";
  // with `complete`, a manifest listing every file's size and CRC-32.
  void Make(int64_t step, int64_t world, bool complete) {
    const std::string dir = CheckpointDir(out_, step);
    fs::create_directories(dir);
    std::string manifest = absl::StrCat("step ", step, "\nworld_size ", world, "\nlayout x\n");
    for (int64_t r = 0; r < world; ++r) {
      const std::string bytes = absl::StrCat("rank ", r, " of step ", step);
      Write(absl::StrCat(dir, "/", RankFile(r)), bytes);
      const uint32_t crc = static_cast<uint32_t>(
          crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
      absl::StrAppendFormat(&manifest, "file %s %d %08x\n", RankFile(r), bytes.size(), crc);
    }
    if (complete) Write(dir + "/COMPLETE", manifest);
  }

  std::vector<int64_t> Folders() const {
    std::vector<int64_t> steps;
    for (const auto& e : fs::directory_iterator(out_ + "/checkpoints")) {
      steps.push_back(std::stoll(e.path().filename().string().substr(5)));
    }
    std::sort(steps.begin(), steps.end());
    return steps;
  }

  std::string out_;
};

TEST(DigestTest, MatchesZlibsCheckValue) {
  // The CRC-32 check value of "123456789" is 0xCBF43926 (the standard's).
  const std::string path = (fs::temp_directory_path() / "checkpoints_test_digest").string();
  {
    std::ofstream f(path, std::ios::binary);
    f << "123456789";
  }
  absl::StatusOr<Digest> d = DigestOf(path);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->size, 9);
  EXPECT_EQ(d->crc32, 0xCBF43926u);
  fs::remove(path);
  EXPECT_FALSE(DigestOf(path).ok());
}

TEST_F(CheckpointsTest, ResumeTakesTheNewestIntactCheckpointAndSaysWhyItSkipsOthers) {
  Make(2, 3, true);
  Make(4, 3, true);
  Make(6, 3, true);
  Make(8, 3, false);  // a rank died before rank 0 wrote the manifest
  // Step 6's rank 1 damaged after the manifest: same size, other bytes.
  Write(CheckpointDir(out_, 6) + "/" + RankFile(1), "RANK 1 OF STEP 6");

  EXPECT_EQ(NewestCheckpoint(out_), 6);  // the marker alone: 8 has none, 6 looks complete
  CheckpointChoice c = NewestValidCheckpoint(out_, 3);
  EXPECT_EQ(c.step, 4);
  ASSERT_EQ(c.skipped.size(), 2u);
  EXPECT_THAT(c.skipped[0], HasSubstr("step 8: no COMPLETE marker"));
  EXPECT_THAT(c.skipped[1], HasSubstr("step 6: rank-00001.safetensors: CRC-32"));
  EXPECT_THAT(c.skipped[1], HasSubstr("(damaged)"));

  // Another world size cannot resume from any of them.
  CheckpointChoice other = NewestValidCheckpoint(out_, 4);
  EXPECT_FALSE(other.step.has_value());
  EXPECT_THAT(other.skipped.back(), HasSubstr("written by a job of 3 ranks, this one has 4"));

  // A truncated file is caught by its size.
  Write(CheckpointDir(out_, 4) + "/" + RankFile(2), "short");
  c = NewestValidCheckpoint(out_, 3);
  EXPECT_EQ(c.step, 2);
  EXPECT_THAT(c.skipped.back(), HasSubstr("rank-00002.safetensors: 5 bytes, the manifest says"));
}

TEST_F(CheckpointsTest, NothingToResumeFromAnEmptyOrMissingFolder) {
  EXPECT_FALSE(NewestCheckpoint(out_).has_value());
  EXPECT_FALSE(NewestValidCheckpoint(out_, 2).step.has_value());
  EXPECT_FALSE(NewestCheckpoint(out_ + "/nowhere").has_value());
  EXPECT_TRUE(PruneCheckpoints(out_ + "/nowhere").ok());
}

TEST_F(CheckpointsTest, PruningKeepsTheTwoNewestCompleteAndAnythingNewer) {
  for (int64_t s : {1, 2, 3, 4}) Make(s, 2, true);
  Make(5, 2, false);  // being written: newer than every complete one
  ASSERT_TRUE(PruneCheckpoints(out_).ok());
  EXPECT_THAT(Folders(), ElementsAre(3, 4, 5));
  // Idempotent; and with two complete checkpoints there is nothing to drop.
  ASSERT_TRUE(PruneCheckpoints(out_).ok());
  EXPECT_THAT(Folders(), ElementsAre(3, 4, 5));
  EXPECT_EQ(NewestValidCheckpoint(out_, 2).step, 4);
}

// training.keep_checkpoints: the `keep` newest complete ones stay, whatever
// is partial among them.
TEST_F(CheckpointsTest, PruningKeepsAsManyAsTheJobSays) {
  for (int64_t s : {1, 2, 3, 4, 5, 6}) Make(s, 2, s != 5);
  ASSERT_TRUE(PruneCheckpoints(out_, 3).ok());
  EXPECT_THAT(Folders(), ElementsAre(3, 4, 5, 6));  // 3, 4, 6 complete; 5 partial
  ASSERT_TRUE(PruneCheckpoints(out_, 1).ok());
  EXPECT_THAT(Folders(), ElementsAre(6));
  ASSERT_TRUE(PruneCheckpoints(out_, 1000).ok());
  EXPECT_THAT(Folders(), ElementsAre(6));
}

TEST_F(CheckpointsTest, PruningNeverDropsTheOnlyCompleteCheckpoints) {
  Make(1, 2, false);
  Make(2, 2, true);
  Make(3, 2, false);
  ASSERT_TRUE(PruneCheckpoints(out_).ok());
  EXPECT_THAT(Folders(), ElementsAre(1, 2, 3));
}

}  // namespace
}  // namespace muonmesh::worker
