#include "worker/checkpoints.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/base/status_macros.h"

#include <zlib.h>

namespace muonmesh::worker {
namespace {

// A `step-NNNNNNNN` folder under `<output.dir>/checkpoints` and whether its
// COMPLETE marker is there (an unreadable folder lists as nothing).
struct StepFolder {
  int64_t step = 0;
  std::filesystem::path path;
  bool complete = false;
};
std::vector<StepFolder> StepFolders(const std::string& checkpoints_dir) {
  std::vector<StepFolder> folders;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(checkpoints_dir, ec)) {
    int64_t s = 0;
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &s)) continue;
    std::error_code exists_ec;
    folders.push_back(
        {s, entry.path(), std::filesystem::exists(entry.path() / "COMPLETE", exists_ec)});
  }
  return folders;
}

}  // namespace

namespace {

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
  MUONMESH_RETURN_IF_ERROR(Sync(temp, /*folder=*/false));
  std::filesystem::rename(temp, path, ec);
  if (ec) return absl::ErrnoToStatus(ec.value(), absl::StrCat(path, ": cannot rename into place"));
  return Sync(std::filesystem::path(path).parent_path().string(), /*folder=*/true);
}

std::string RankFile(int64_t rank) { return absl::StrFormat("rank-%05d.safetensors", rank); }

absl::StatusOr<Digest> DigestOf(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  Digest d;
  uLong crc = crc32(0L, Z_NULL, 0);
  std::vector<unsigned char> buf(size_t{1} << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
    crc = crc32(crc, buf.data(), static_cast<uInt>(n));
    d.size += static_cast<int64_t>(n);
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  d.crc32 = static_cast<uint32_t>(crc);
  return d;
}

absl::Status SaveCheckpoint(Trainer& trainer, const std::string& output_dir, int64_t world_size,
                            int32_t rank) {
  const int64_t step = trainer.steps_done();
  const std::string dir = CheckpointDir(output_dir, step);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  // The errno's code: a read-only folder is PERMISSION_DENIED, a full disk
  // RESOURCE_EXHAUSTED, a read-only file system FAILED_PRECONDITION.
  if (ec) return absl::ErrnoToStatus(ec.value(), absl::StrCat(dir, ": cannot create"));
  absl::Status st = trainer.SaveShards(absl::StrCat(dir, "/", RankFile(rank)));
  MUONMESH_RETURN_IF_ERROR(st, "saving a checkpoint");
  st = trainer.Barrier();
  MUONMESH_RETURN_IF_ERROR(st, "waiting for every rank's checkpoint");
  if (rank != 0) return absl::OkStatus();
  // The manifest: every rank's file with its size and CRC-32, so that a
  // resume can tell a damaged checkpoint from a good one.
  std::string manifest = absl::StrCat("step ", step, "\nworld_size ", world_size, "\nlayout ",
                                      trainer.LayoutFingerprint(), "\n");
  for (int64_t r = 0; r < world_size; ++r) {
    const std::string file = RankFile(r);
    MUONMESH_ASSIGN_OR_RETURN(Digest d, DigestOf(absl::StrCat(dir, "/", file)),
                              "checking the checkpoint's files");
    absl::StrAppendFormat(&manifest, "file %s %d %08x\n", file, d.size, d.crc32);
  }
  MUONMESH_RETURN_IF_ERROR(WriteFileAtomically(dir + "/COMPLETE", manifest));
  return absl::OkStatus();
}

absl::Status PruneCheckpoints(const std::string& output_dir, int64_t keep) {
  // Keep the `keep` newest complete checkpoints; drop everything older.
  keep = std::max<int64_t>(1, keep);
  const std::vector<StepFolder> all = StepFolders(output_dir + "/checkpoints");
  std::vector<int64_t> complete;
  for (const StepFolder& f : all) {
    if (f.complete) complete.push_back(f.step);
  }
  std::sort(complete.rbegin(), complete.rend());
  if (complete.size() <= static_cast<size_t>(keep)) return absl::OkStatus();
  std::string failed;
  for (const StepFolder& f : all) {
    if (f.step >= complete[static_cast<size_t>(keep) - 1]) continue;
    std::error_code ec;
    std::filesystem::remove_all(f.path, ec);
    if (ec) absl::StrAppend(&failed, failed.empty() ? "" : "; ", f.path.string(), ": ", ec.message());
  }
  if (!failed.empty()) return absl::InternalError(absl::StrCat("cannot remove ", failed));
  return absl::OkStatus();
}

std::string CheckpointDir(const std::string& output_dir, int64_t step) {
  return absl::StrFormat("%s/checkpoints/step-%08d", output_dir, step);
}

absl::StatusOr<CheckpointManifest> ReadCheckpointManifest(const std::string& dir) {
  std::ifstream in(dir + "/COMPLETE");
  if (!in) return absl::NotFoundError("no COMPLETE marker (a partial checkpoint)");
  auto bad = [](std::string why) { return absl::DataLossError(std::move(why)); };
  CheckpointManifest m;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() == 2 && f[0] == "world_size" && !absl::SimpleAtoi(f[1], &m.world_size)) {
      return bad("COMPLETE: a bad world_size line");
    }
    if (f.size() == 2 && f[0] == "step" && !absl::SimpleAtoi(f[1], &m.step)) {
      return bad("COMPLETE: a bad step line");
    }
    if (f.size() == 2 && f[0] == "layout") m.layout = f[1];
    if (f.empty() || f[0] != "file") continue;
    int64_t size = 0;
    uint32_t crc = 0;
    if (f.size() != 4 || !absl::SimpleAtoi(f[2], &size) || !absl::SimpleHexAtoi(f[3], &crc)) {
      return bad(absl::StrCat("COMPLETE: a bad line '", line.substr(0, 80), "'"));
    }
    absl::StatusOr<Digest> d = DigestOf(absl::StrCat(dir, "/", f[1]));
    if (!d.ok()) return d.status();
    if (d->size != size) {
      return bad(absl::StrCat(f[1], ": ", d->size, " bytes, the manifest says ", size));
    }
    if (d->crc32 != crc) {
      return bad(absl::StrFormat("%s: CRC-32 %08x, the manifest says %08x (damaged)", f[1],
                                 d->crc32, crc));
    }
    m.files.push_back(f[1]);
  }
  if (m.world_size < 1) return bad("COMPLETE: no world_size line");
  if (static_cast<int64_t>(m.files.size()) != m.world_size) {
    return bad(absl::StrCat("COMPLETE lists ", m.files.size(), " files with checksums, expected ",
                            m.world_size, " (written by an older muonmesh?)"));
  }
  for (int64_t r = 0; r < m.world_size; ++r) {
    if (m.files[r] != RankFile(r)) {
      return bad(
          absl::StrCat("COMPLETE: file ", r, " is ", m.files[r], ", expected ", RankFile(r)));
    }
  }
  return m;
}

CheckpointChoice NewestValidCheckpointIn(const std::string& checkpoints_dir, int64_t world_size) {
  std::vector<StepFolder> folders = StepFolders(checkpoints_dir);
  std::sort(folders.begin(), folders.end(),
            [](const StepFolder& a, const StepFolder& b) { return a.step > b.step; });
  CheckpointChoice choice;
  for (const StepFolder& f : folders) {
    absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(f.path.string());
    std::string problem(m.status().message());
    if (m.ok() && world_size != kAnyWorldSize && m->world_size != world_size) {
      problem =
          absl::StrCat("written by a job of ", m->world_size, " ranks, this one has ", world_size);
    }
    if (problem.empty()) {
      choice.step = f.step;
      choice.dir = f.path.string();
      choice.manifest = *std::move(m);
      return choice;
    }
    choice.skipped.push_back(absl::StrCat("step ", f.step, ": ", problem));
  }
  return choice;
}

CheckpointChoice NewestValidCheckpoint(const std::string& output_dir, int64_t world_size) {
  return NewestValidCheckpointIn(output_dir + "/checkpoints", world_size);
}

std::optional<int64_t> NewestCheckpoint(const std::string& output_dir) {
  std::optional<int64_t> newest;
  for (const StepFolder& f : StepFolders(output_dir + "/checkpoints")) {
    if (f.complete) newest = std::max(newest.value_or(f.step), f.step);
  }
  return newest;
}

}  // namespace muonmesh::worker
