#include "worker/comm/file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"

namespace muonmesh::comm {
namespace {

constexpr size_t kMaxKeyBytes = 200;
constexpr absl::Duration kFirstPoll = absl::Milliseconds(1);
constexpr absl::Duration kMaxPoll = absl::Milliseconds(25);

std::string ErrnoText(int error) { return std::string(std::strerror(error)); }

// Sleeps for the current backoff (never past the deadline) and doubles it.
void Backoff(absl::Duration& delay, absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return;
  absl::SleepFor(std::min(delay, left));
  delay = std::min(delay * 2, kMaxPoll);
}

absl::Status WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("write: ", ErrnoText(errno)));
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Open(std::string dir) {
  if (dir.empty()) return absl::InvalidArgumentError("FileStore: empty folder path");
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("FileStore: cannot create folder ", dir, ": ", error.message()));
  }
  if (!std::filesystem::is_directory(dir, error) || ::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::UnavailableError(
        absl::StrCat("FileStore: ", dir, " is not a writable folder"));
  }
  return std::unique_ptr<FileStore>(new FileStore(std::move(dir)));
}

absl::StatusOr<std::string> FileStore::PathFor(absl::string_view key) const {
  if (key.empty()) return absl::InvalidArgumentError("FileStore: empty key");
  if (key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("FileStore: key of ", key.size(), " bytes (limit ", kMaxKeyBytes, ")"));
  }
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string name = "k_";  // never "." or "..", never a temporary's ".tmp-" prefix
  for (const char ch : key) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == 0) return absl::InvalidArgumentError("FileStore: key contains a NUL byte");
    if (std::isalnum(c) || c == '_' || c == '-' || c == '.') {
      name.push_back(ch);
    } else {
      name.push_back('%');
      name.push_back(kHex[c >> 4]);
      name.push_back(kHex[c & 15]);
    }
  }
  return absl::StrCat(dir_, "/", name);
}

absl::StatusOr<std::optional<std::string>> FileStore::TryRead(const std::string& path) const {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<std::string>();
    return absl::UnavailableError(absl::StrCat("FileStore: open ", path, ": ", ErrnoText(errno)));
  }
  std::string value;
  char buffer[4096];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("FileStore: read ", path, ": ", ErrnoText(error)));
    }
    if (n == 0) break;
    value.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return std::optional<std::string>(std::move(value));
}

absl::Status FileStore::Set(absl::string_view key, absl::string_view value) {
  MUONMESH_ASSIGN_OR_RETURN(std::string path, PathFor(key));

  // A name no other writer (thread or process) can pick.
  static std::atomic<uint64_t> counter{0};
  const std::string temp =
      absl::StrCat(dir_, "/.tmp-", ::getpid(), "-",
                   std::hash<std::thread::id>()(std::this_thread::get_id()), "-",
                   counter.fetch_add(1, std::memory_order_relaxed));
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("FileStore: create ", temp, ": ", ErrnoText(errno)));
  }
  absl::Status written = WriteAll(fd, value);
  if (::close(fd) != 0 && written.ok()) {
    written = absl::UnavailableError(absl::StrCat("close: ", ErrnoText(errno)));
  }
  if (!written.ok()) {
    ::unlink(temp.c_str());
    return absl::UnavailableError(
        absl::StrCat("FileStore: writing key '", key, "': ", written.message()));
  }
  // link(2) publishes the complete file atomically and refuses to replace an
  // existing one: the write-once rule, across processes.
  const int linked = ::link(temp.c_str(), path.c_str());
  const int link_error = errno;
  ::unlink(temp.c_str());
  if (linked == 0) return absl::OkStatus();
  if (link_error != EEXIST) {
    return absl::UnavailableError(
        absl::StrCat("FileStore: publishing key '", key, "': ", ErrnoText(link_error)));
  }
  MUONMESH_ASSIGN_OR_RETURN(std::optional<std::string> existing, TryRead(path));
  if (existing.has_value() && *existing == value) return absl::OkStatus();
  return absl::AlreadyExistsError(
      absl::StrCat("FileStore: key '", key, "' is already set to a different value (keys are "
                   "write-once; use a fresh prefix per job attempt)"));
}

absl::StatusOr<std::string> FileStore::Get(absl::string_view key, absl::Duration timeout) {
  MUONMESH_ASSIGN_OR_RETURN(std::string path, PathFor(key));
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration delay = kFirstPoll;
  while (true) {
    MUONMESH_ASSIGN_OR_RETURN(std::optional<std::string> value, TryRead(path));
    if (value.has_value()) return std::move(*value);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("FileStore: key '", key, "' not set after ",
                       absl::FormatDuration(timeout), " (in ", dir_, ")"));
    }
    Backoff(delay, deadline);
  }
}

absl::Status FileStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  std::vector<std::string> paths;
  paths.reserve(keys.size());
  for (const std::string& key : keys) {
    MUONMESH_ASSIGN_OR_RETURN(std::string path, PathFor(key));
    paths.push_back(std::move(path));
  }
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration delay = kFirstPoll;
  std::vector<bool> present(keys.size(), false);
  while (true) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (present[i]) continue;
      struct stat info;
      if (::stat(paths[i].c_str(), &info) == 0) {
        present[i] = true;
      } else if (errno == ENOENT) {
        missing.push_back(keys[i]);
      } else {
        return absl::UnavailableError(
            absl::StrCat("FileStore: stat ", paths[i], ": ", ErrnoText(errno)));
      }
    }
    if (missing.empty()) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("FileStore: keys not set after ", absl::FormatDuration(timeout), ": '",
                       absl::StrJoin(missing, "', '"), "' (in ", dir_, ")"));
    }
    Backoff(delay, deadline);
  }
}

}  // namespace muonmesh::comm
