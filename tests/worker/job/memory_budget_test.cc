#include "worker/job/memory_budget.h"

#include <sys/resource.h>
#include <unistd.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::worker {
namespace {

TEST(MemoryBudgetTest, SizesParseWithBinaryUnits) {
  EXPECT_EQ(*ParseByteSize("100000"), 100000);
  EXPECT_EQ(*ParseByteSize("8GiB"), int64_t{8} << 30);
  EXPECT_EQ(*ParseByteSize("8G"), int64_t{8} << 30);
  EXPECT_EQ(*ParseByteSize("512M"), int64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize("1.5gib"), int64_t{3} << 29);
  EXPECT_EQ(*ParseByteSize(" 64KiB "), 65536);
  EXPECT_EQ(*ParseByteSize("auto"), 0);
  for (const char* bad : {"", "lots", "-1G", "0", "1e30", "G", "12X", "nan"}) {
    EXPECT_EQ(ParseByteSize(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(MemoryBudgetTest, FormatsForPeople) {
  EXPECT_EQ(FormatBytes(812), "812 B");
  EXPECT_EQ(FormatBytes(512.0 * 1048576), "512.0 MiB");
  EXPECT_EQ(FormatBytes(1.5 * 1073741824), "1.50 GiB");
}

// The machine's memory is at most its physical memory, and an address
// space limit lowers it (the limit the probes ran under).
TEST(MemoryBudgetTest, DefaultFollowsTheMachineAndItsLimits) {
  const int64_t physical = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) *
                           static_cast<int64_t>(::sysconf(_SC_PAGE_SIZE));
  EXPECT_LE(MachineMemoryBytes(), physical);
  EXPECT_GT(MachineMemoryBytes(), 0);
  const int64_t one = DefaultMemoryBudgetBytes(1);
  EXPECT_NEAR(static_cast<double>(DefaultMemoryBudgetBytes(4)), one / 4.0, 1.0);
  EXPECT_NEAR(static_cast<double>(one), 0.8 * static_cast<double>(MachineMemoryBytes()), 1.0);

  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &saved), 0);
  rlimit capped = saved;
  capped.rlim_cur = rlim_t{4} << 30;
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < capped.rlim_cur) {
    GTEST_SKIP() << "hard RLIMIT_AS below 4 GiB";
  }
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &capped), 0);
  const int64_t limited = MachineMemoryBytes();
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &saved), 0);
  EXPECT_LE(limited, int64_t{4} << 30);
}

}  // namespace
}  // namespace muonmesh::worker
