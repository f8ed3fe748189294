#include "server/state/data_dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace muonmesh::coordinator {

absl::StatusOr<std::unique_ptr<DataDirLock>> DataDirLock::Acquire(const std::string& data_dir) {
  const std::string path = (std::filesystem::path(data_dir) / "LOCK").string();
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-dir ", data_dir, ": cannot open ", path, ": ", std::strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder(32, '\0');
    const ssize_t n = pread(fd, holder.data(), holder.size(), 0);
    holder.resize(n > 0 ? static_cast<size_t>(n) : 0);
    close(fd);
    if (err == EWOULDBLOCK) {
      const std::string pid(absl::StripAsciiWhitespace(holder));
      return absl::FailedPreconditionError(absl::StrCat(
          "--data-dir ", data_dir, ": in use by another coordinator",
          pid.empty() ? "" : absl::StrCat(" (pid ", pid, ")"),
          "; one data folder serves one coordinator"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("--data-dir ", data_dir, ": cannot lock ", path, ": ", std::strerror(err)));
  }
  // Who holds it, for the message above; best effort.
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) == 0) (void)!pwrite(fd, pid.data(), pid.size(), 0);
  return std::unique_ptr<DataDirLock>(new DataDirLock(fd));
}

DataDirLock::~DataDirLock() { close(fd_); }

}  // namespace muonmesh::coordinator
