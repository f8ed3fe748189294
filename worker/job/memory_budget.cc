#include "worker/job/memory_budget.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace muonmesh::worker {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMaxBytes = int64_t{1} << 62;

// The first line of a file as a number of bytes; 0 when absent, "max" or
// not a number (cgroup files write "max" for no limit).
int64_t ReadLimitFile(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return 0;
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value <= 0) return 0;
  return value;
}

int64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<int64_t>(pages) * page_size;
}

int64_t RlimitBytes(int resource) {
  struct rlimit limit;
  if (::getrlimit(resource, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 0;
  return static_cast<int64_t>(std::min<rlim_t>(limit.rlim_cur, kMaxBytes));
}

}  // namespace

int64_t MachineMemoryBytes() {
  int64_t smallest = PhysicalMemoryBytes();
  // cgroup v1 writes a huge number (about 2^63) for "no limit".
  for (int64_t limit : {ReadLimitFile("/sys/fs/cgroup/memory.max"),
                        ReadLimitFile("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                        RlimitBytes(RLIMIT_AS), RlimitBytes(RLIMIT_DATA)}) {
    if (limit > 0 && limit < kMaxBytes && (smallest == 0 || limit < smallest)) smallest = limit;
  }
  return smallest > 0 ? smallest : kGiB;
}

int64_t DefaultMemoryBudgetBytes(int64_t processes_per_host) {
  const double share = kDefaultBudgetFraction * static_cast<double>(MachineMemoryBytes()) /
                       static_cast<double>(std::max<int64_t>(1, processes_per_host));
  return std::max<int64_t>(1, static_cast<int64_t>(share));
}

absl::StatusOr<int64_t> ParseByteSize(const std::string& text) {
  std::string s = absl::AsciiStrToLower(std::string(absl::StripAsciiWhitespace(text)));
  if (s == "auto") return 0;
  const auto invalid = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("not a size: '", text, "' (write bytes, or a number with K, M, G or T, "
                     "e.g. 8GiB or 512M)"));
  };
  double unit = 1;
  for (const auto& [suffix, factor] :
       {std::pair{"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0},
        {"tib", 1099511627776.0}, {"k", 1024.0}, {"m", 1048576.0}, {"g", 1073741824.0},
        {"t", 1099511627776.0}, {"b", 1.0}}) {
    const std::string tail(suffix);
    if (s.size() > tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0) {
      s.resize(s.size() - tail.size());
      unit = factor;
      break;
    }
  }
  double number = 0;
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0])) ||
      !absl::SimpleAtod(s, &number) || !std::isfinite(number)) {
    return invalid();
  }
  const double bytes = number * unit;
  if (bytes < 1 || bytes > static_cast<double>(kMaxBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size '", text, "' is not between 1 byte and 2^62 bytes"));
  }
  return static_cast<int64_t>(bytes);
}

std::string FormatBytes(double bytes) {
  if (bytes >= static_cast<double>(kGiB)) return absl::StrFormat("%.2f GiB", bytes / kGiB);
  if (bytes >= 1048576.0) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  if (bytes >= 1024.0) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrFormat("%.0f B", bytes);
}

}  // namespace muonmesh::worker
