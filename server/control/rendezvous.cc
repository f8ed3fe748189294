#include "server/control/rendezvous.h"

#include <chrono>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"

namespace muonmesh::coordinator {
namespace {

// How often a waiter looks at its cancel callback.
constexpr auto kPollInterval = std::chrono::milliseconds(50);

std::string Short(const std::string& key) { return key.size() <= 80 ? key : key.substr(0, 80) + "..."; }

}  // namespace

absl::Status Rendezvous::CheckKey(const std::string& key) const {
  if (key.empty()) return absl::InvalidArgumentError("store: empty key");
  if (key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: key of ", key.size(),
                                                   " bytes exceeds the limit of ", kMaxKeyBytes));
  }
  if (key.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("store: key holds a NUL byte");
  }
  return absl::OkStatus();
}

std::string* Rendezvous::FindLocked(const RendezvousScope& scope, const std::string& key) {
  auto space = keys_.find(scope);
  if (space == keys_.end()) return nullptr;
  auto it = space->second.find(key);
  return it == space->second.end() ? nullptr : &it->second;
}

absl::Status Rendezvous::InsertLocked(const RendezvousScope& scope, const std::string& key,
                                      std::string value) {
  const bool new_scope = keys_.find(scope) == keys_.end();
  const size_t bytes = key.size() + value.size() + kEntryOverheadBytes +
                       (new_scope ? kScopeOverheadBytes : 0);
  if (total_bytes_ + bytes > kMaxTotalBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store: the coordinator holds ", total_bytes_, " bytes of keys, its limit is ",
        kMaxTotalBytes));
  }
  total_bytes_ += bytes;
  keys_[scope].emplace(key, std::move(value));
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::Status Rendezvous::Set(const RendezvousScope& scope, const std::string& key,
                             std::string value) {
  MUONMESH_RETURN_IF_ERROR(CheckKey(key));
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: value of ", value.size(),
                                                   " bytes exceeds the limit of ",
                                                   kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  if (const std::string* old = FindLocked(scope, key); old != nullptr) {
    if (*old == value) return absl::OkStatus();
    return absl::AlreadyExistsError(
        absl::StrCat("store: key '", Short(key), "' is already set to another value"));
  }
  return InsertLocked(scope, key, std::move(value));
}

absl::Status Rendezvous::WaitUntil(const std::function<bool()>& ready, absl::Duration timeout,
                                   const Cancelled& cancelled, const std::string& what) {
  const auto deadline =
      std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(std::max(timeout, absl::ZeroDuration()));
  while (!ready()) {
    if (shutdown_) return absl::CancelledError("store: the coordinator is shutting down");
    if (cancelled && cancelled()) return absl::CancelledError("store: the call was cancelled");
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("store: ", what, " still missing after ", absl::FormatDuration(timeout)));
    }
    changed_.WaitWithTimeout(
        &mu_, absl::FromChrono(std::min<std::chrono::steady_clock::duration>(deadline - now,
                                                                             kPollInterval)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Rendezvous::Get(const RendezvousScope& scope, const std::string& key,
                                            absl::Duration timeout, const Cancelled& cancelled) {
  MUONMESH_RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  const std::string* found = nullptr;
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (found = FindLocked(scope, key)) != nullptr;
  };
  MUONMESH_RETURN_IF_ERROR(
      WaitUntil(ready, timeout, cancelled, absl::StrCat("key '", Short(key), "'")));
  return *found;
}

absl::Status Rendezvous::Wait(const RendezvousScope& scope, const std::vector<std::string>& keys,
                              absl::Duration timeout, const Cancelled& cancelled) {
  for (const std::string& key : keys) {
    MUONMESH_RETURN_IF_ERROR(CheckKey(key));
  }
  absl::MutexLock lock(&mu_);
  std::vector<std::string> missing;
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    missing.clear();
    auto space = keys_.find(scope);
    for (const std::string& key : keys) {
      if (space == keys_.end() || space->second.count(key) == 0) missing.push_back(Short(key));
    }
    return missing.empty();
  };
  return WaitUntil(ready, timeout, cancelled,
                   absl::StrCat("keys ", absl::StrJoin(missing.begin(),
                                                       missing.begin() + std::min<size_t>(missing.size(), 8),
                                                       ", ")));
}

absl::StatusOr<int64_t> Rendezvous::Add(const RendezvousScope& scope, const std::string& key,
                                        int64_t delta) {
  MUONMESH_RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  std::string* old = FindLocked(scope, key);
  int64_t value = 0;
  if (old != nullptr && !absl::SimpleAtoi(*old, &value)) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: key '", Short(key), "' does not hold a counter"));
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    return absl::OutOfRangeError(
        absl::StrCat("store: adding ", delta, " to counter '", Short(key), "' overflows"));
  }
  std::string text = absl::StrCat(value);
  if (old == nullptr) {
    MUONMESH_RETURN_IF_ERROR(InsertLocked(scope, key, std::move(text)));
  } else {
    total_bytes_ = total_bytes_ - old->size() + text.size();
    *old = std::move(text);
    changed_.SignalAll();
  }
  return value;
}

void Rendezvous::DropJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (auto it = keys_.lower_bound({job_id, INT32_MIN}); it != keys_.end() && it->first.job_id == job_id;) {
    for (const auto& [k, v] : it->second) {
      total_bytes_ -= k.size() + v.size() + kEntryOverheadBytes;
    }
    total_bytes_ -= kScopeOverheadBytes;
    it = keys_.erase(it);
  }
  changed_.SignalAll();
}

void Rendezvous::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  changed_.SignalAll();
}

size_t Rendezvous::total_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

}  // namespace muonmesh::coordinator
