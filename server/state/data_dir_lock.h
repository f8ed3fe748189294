#pragma once

// One coordinator per data folder: an exclusive lock on DATA_DIR/LOCK, held
// for the life of this object. A second coordinator pointed at the same
// folder (two would schedule the same jobs twice) is refused, naming the
// holder's pid. The lock is flock(2): the kernel drops it when the holder
// exits, even by SIGKILL, so a crash leaves nothing to clean up.

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace muonmesh::coordinator {

class DataDirLock {
 public:
  // FailedPrecondition naming the folder and the holder's pid when another
  // process holds it; InvalidArgument when LOCK cannot be opened.
  static absl::StatusOr<std::unique_ptr<DataDirLock>> Acquire(const std::string& data_dir);
  ~DataDirLock();
  DataDirLock(const DataDirLock&) = delete;
  DataDirLock& operator=(const DataDirLock&) = delete;

 private:
  explicit DataDirLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace muonmesh::coordinator
