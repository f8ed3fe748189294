// FileStore (worker/comm/file_store.h): write-once Set, blocking Get and
// Wait with timeouts, odd keys, and many concurrent writers.

#include "worker/comm/file_store.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/test_util.h"

namespace muonmesh::comm {
namespace {

using testing::RunOnThreads;
using testing::ScopedTempDir;

std::unique_ptr<FileStore> OpenStore(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Open(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

TEST(FileStoreTest, SetThenGetReturnsTheBytes) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  const std::string value("a\0b\xff", 4);  // binary, with a NUL
  ASSERT_TRUE(store->Set("job/attempt-0/group/0", value).ok());
  absl::StatusOr<std::string> got = store->Get("job/attempt-0/group/0", absl::Seconds(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, value);
  // An empty value is a value.
  ASSERT_TRUE(store->Set("empty", "").ok());
  got = store->Get("empty", absl::Seconds(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "");
}

TEST(FileStoreTest, KeysAreWriteOnce) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Set("k", "first").ok());
  EXPECT_TRUE(store->Set("k", "first").ok()) << "same value again is an idempotent retry";
  const absl::Status rewrite = store->Set("k", "second");
  EXPECT_EQ(rewrite.code(), absl::StatusCode::kAlreadyExists) << rewrite;
  absl::StatusOr<std::string> got = store->Get("k", absl::Seconds(1));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, "first");
}

TEST(FileStoreTest, KeysThatLookAlikeStayDistinct) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  const std::vector<std::string> keys = {"a/b", "a%2Fb", "a_b", "..", ".tmp-1", "a b", "A/B"};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(store->Set(keys[i], absl::StrCat("v", i)).ok()) << keys[i];
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<std::string> got = store->Get(keys[i], absl::Seconds(1));
    ASSERT_TRUE(got.ok()) << keys[i];
    EXPECT_EQ(*got, absl::StrCat("v", i)) << keys[i];
  }
}

TEST(FileStoreTest, BadKeysAreInvalidArguments) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Set(std::string(201, 'k'), "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Set(std::string("a\0b", 3), "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Get("", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FileStoreTest, OpenFailsOnAFile) {
  ScopedTempDir dir;
  const std::string file = dir.path() + "/plain-file";
  ASSERT_TRUE(OpenStore(dir.path())->Set("x", "y").ok());
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  EXPECT_FALSE(FileStore::Open(file).ok());
  EXPECT_EQ(FileStore::Open("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FileStoreTest, GetTimesOutOnAMissingKey) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> got = store->Get("never", absl::Milliseconds(200));
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_NE(std::string(got.status().message()).find("never"), std::string::npos);
  EXPECT_GE(elapsed, absl::Milliseconds(190));
  EXPECT_LT(elapsed, absl::Seconds(2));
}

TEST(FileStoreTest, GetBlocksUntilAnotherStoreSetsTheKey) {
  ScopedTempDir dir;
  auto reader = OpenStore(dir.path());
  auto writer = OpenStore(dir.path());  // a second handle on the folder, like another process
  ASSERT_NE(reader, nullptr);
  ASSERT_NE(writer, nullptr);
  const absl::Time start = absl::Now();
  std::thread late_writer([&] {
    absl::SleepFor(absl::Milliseconds(150));
    ASSERT_TRUE(writer->Set("late", "value").ok());
  });
  absl::StatusOr<std::string> got = reader->Get("late", absl::Seconds(5));
  const absl::Duration elapsed = absl::Now() - start;
  late_writer.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "value");
  EXPECT_GE(elapsed, absl::Milliseconds(140));
  EXPECT_LT(elapsed, absl::Seconds(2)) << "polling backoff is capped at 25 ms";
}

TEST(FileStoreTest, WaitNamesTheMissingKeys) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Set("present", "1").ok());
  const std::vector<std::string> keys = {"present", "absent"};
  const absl::Status status = store->Wait(keys, absl::Milliseconds(100));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(std::string(status.message()).find("'absent'"), std::string::npos) << status;
  EXPECT_EQ(std::string(status.message()).find("'present'"), std::string::npos) << status;
  ASSERT_TRUE(store->Set("absent", "2").ok());
  EXPECT_TRUE(store->Wait(keys, absl::Milliseconds(100)).ok());
  EXPECT_TRUE(store->Wait({}, absl::Milliseconds(1)).ok());
}

TEST(FileStoreTest, ConcurrentWritersOfOneKeyHaveExactlyOneWinner) {
  ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  constexpr int kWriters = 8;
  constexpr int kKeys = 20;
  std::atomic<int> wins[kKeys] = {};
  std::atomic<int> other_errors{0};
  RunOnThreads(kWriters, [&](int writer) {
    for (int k = 0; k < kKeys; ++k) {
      const absl::Status s = store->Set(absl::StrCat("race/", k), absl::StrCat("writer-", writer));
      if (s.ok()) {
        ++wins[k];
      } else if (s.code() != absl::StatusCode::kAlreadyExists) {
        ++other_errors;
      }
    }
  });
  EXPECT_EQ(other_errors.load(), 0);
  for (int k = 0; k < kKeys; ++k) {
    EXPECT_EQ(wins[k].load(), 1) << "key " << k;
    absl::StatusOr<std::string> got = store->Get(absl::StrCat("race/", k), absl::Seconds(1));
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->rfind("writer-", 0), 0u) << *got << " is a whole value, never partial";
  }
  // No temporaries are left behind.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_NE(entry.path().filename().string().rfind(".tmp-", 0), 0u) << entry.path();
    ++files;
  }
  EXPECT_EQ(files, kKeys);
}

}  // namespace
}  // namespace muonmesh::comm
