#include "worker/checkpoints.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace muonmesh::worker {
namespace {

absl::Status Annotate(const absl::Status& st, const std::string& where) {
  return absl::Status(st.code(), absl::StrCat(where, ": ", st.message()));
}

// fsync of a file or folder; best effort for folders some file systems
// refuse to sync.
absl::Status Sync(const std::string& path, bool folder) {
  const int fd = ::open(path.c_str(), (folder ? O_RDONLY | O_DIRECTORY : O_WRONLY) | O_CLOEXEC);
  if (fd < 0) {
    if (folder) return absl::OkStatus();
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open to sync"));
  }
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  if (rc != 0 && !folder) return absl::ErrnoToStatus(saved, absl::StrCat(path, ": fsync failed"));
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  // The rename would replace whatever is at `path`: only ever a file.
  std::error_code ec;
  const std::filesystem::file_type type = std::filesystem::symlink_status(path, ec).type();
  if (type != std::filesystem::file_type::not_found &&
      type != std::filesystem::file_type::regular) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": exists and is not a regular file; refusing to replace it"));
  }
  const std::string temp = absl::StrCat(path, ".tmp");
  {
    std::ofstream f(temp, std::ios::trunc);
    f << text;
    f.flush();
    if (!f) return absl::InternalError(absl::StrCat(temp, ": cannot write"));
  }
  if (absl::Status st = Sync(temp, /*folder=*/false); !st.ok()) return st;
  std::filesystem::rename(temp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": cannot rename into place: ", ec.message()));
  return Sync(std::filesystem::path(path).parent_path().string(), /*folder=*/true);
}

absl::Status SaveCheckpoint(Trainer& trainer, const std::string& output_dir, int64_t world_size,
                            int32_t rank) {
  const int64_t step = trainer.steps_done();
  const std::string dir = CheckpointDir(output_dir, step);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  absl::Status st =
      trainer.SaveShards(absl::StrFormat("%s/rank-%05d.safetensors", dir, rank));
  if (!st.ok()) return Annotate(st, "saving a checkpoint");
  st = trainer.Barrier();
  if (!st.ok()) return Annotate(st, "waiting for every rank's checkpoint");
  if (rank != 0) return absl::OkStatus();
  st = WriteFileAtomically(dir + "/COMPLETE",
                           absl::StrCat("step ", step, "\nworld_size ", world_size,
                                        "\nlayout ", trainer.LayoutFingerprint(), "\n"));
  if (!st.ok()) return st;
  // Keep the two newest complete checkpoints; drop everything older.
  std::vector<int64_t> complete;
  std::vector<std::pair<int64_t, std::filesystem::path>> all;
  for (const auto& entry :
       std::filesystem::directory_iterator(output_dir + "/checkpoints", ec)) {
    int64_t s = 0;
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &s)) continue;
    all.push_back({s, entry.path()});
    if (std::filesystem::exists(entry.path() / "COMPLETE")) complete.push_back(s);
  }
  std::sort(complete.rbegin(), complete.rend());
  if (complete.size() > 2) {
    for (const auto& [s, path] : all) {
      if (s < complete[1]) std::filesystem::remove_all(path, ec);
    }
  }
  return absl::OkStatus();
}

std::string CheckpointDir(const std::string& output_dir, int64_t step) {
  return absl::StrFormat("%s/checkpoints/step-%08d", output_dir, step);
}

std::optional<int64_t> NewestCheckpoint(const std::string& output_dir) {
  std::optional<int64_t> newest;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator(output_dir + "/checkpoints", ec)) {
    int64_t s = 0;
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &s)) continue;
    if (std::filesystem::exists(entry.path() / "COMPLETE", ec)) newest = std::max(newest.value_or(s), s);
  }
  return newest;
}

}  // namespace muonmesh::worker
