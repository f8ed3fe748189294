#include "worker/io/token_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muonmesh::io {
namespace {

// One read-only mapping, unmapped on destruction.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(path, "cannot open");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      absl::Status s = ErrnoStatus(path, "cannot stat");
      ::close(fd);
      return s;
    }
    const size_t size = static_cast<size_t>(st.st_size);
    void* data = nullptr;
    if (size > 0) {
      data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (data == MAP_FAILED) {
        absl::Status s = ErrnoStatus(path, "cannot map");
        ::close(fd);
        return s;
      }
    }
    ::close(fd);
    return std::unique_ptr<MappedFile>(
        new MappedFile(path, static_cast<const unsigned char*>(data), size));
  }
  ~MappedFile() {
    if (size_ > 0) ::munmap(const_cast<unsigned char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile(std::string path, const unsigned char* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  static absl::Status ErrnoStatus(const std::string& path, const char* what) {
    const int e = errno;
    const std::string message = absl::StrCat(path, ": ", what, ": ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(message) : absl::PermissionDeniedError(message);
  }

  std::string path_;
  const unsigned char* data_;
  size_t size_;
};

// One file's tokens: where they start in the mapping and how many.
struct Piece {
  std::unique_ptr<MappedFile> file;
  const unsigned char* first = nullptr;
  int64_t count = 0;
};

absl::StatusOr<Piece> CheckShard(std::unique_ptr<MappedFile> file) {
  const size_t head = std::min(file->size(), static_cast<size_t>(kTokenShardHeaderBytes));
  absl::StatusOr<int64_t> count = job::ShardTokenCount(
      file->path(), absl::string_view(reinterpret_cast<const char*>(file->data()), head),
      static_cast<int64_t>(file->size()));
  if (!count.ok()) return count.status();
  Piece piece;
  piece.first = file->data() + kTokenShardHeaderBytes;
  piece.count = *count;
  piece.file = std::move(file);
  return piece;
}

class FileTokens final : public worker::TokenStream {
 public:
  FileTokens(std::vector<Piece> pieces, TokenFormat format)
      : pieces_(std::move(pieces)), format_(format) {
    starts_.push_back(0);
    for (const Piece& p : pieces_) starts_.push_back(starts_.back() + p.count);
  }
  int64_t num_tokens() const override { return starts_.back(); }

  absl::Status Read(int64_t begin, int64_t count, int32_t* out) const override {
    if (begin < 0 || count < 0 || begin > num_tokens() - count) {
      return absl::OutOfRangeError(absl::StrCat("tokens [", begin, ", ", begin + count,
                                                ") outside [0, ", num_tokens(), ")"));
    }
    // The piece holding `begin`: the last start <= begin.
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
    while (count > 0) {
      const int64_t offset = begin - starts_[i];
      const int64_t n = std::min(count, pieces_[i].count - offset);
      Copy(pieces_[i], offset, n, out);
      out += n;
      begin += n;
      count -= n;
      ++i;
    }
    return absl::OkStatus();
  }

  std::string Where(int64_t position) const override {
    if (position < 0 || position >= num_tokens()) return worker::TokenStream::Where(position);
    const size_t i =
        std::upper_bound(starts_.begin(), starts_.end(), position) - starts_.begin() - 1;
    const int64_t k = position - starts_[i];
    const int64_t offset = format_ == TokenFormat::kText ? k : kTokenShardHeaderBytes + 2 * k;
    return absl::StrCat(pieces_[i].file->path(), " at byte ", offset);
  }

 private:
  void Copy(const Piece& p, int64_t offset, int64_t n, int32_t* out) const {
    if (format_ == TokenFormat::kText) {
      for (int64_t k = 0; k < n; ++k) out[k] = p.first[offset + k];
      return;
    }
    const unsigned char* b = p.first + 2 * offset;
    for (int64_t k = 0; k < n; ++k) out[k] = b[2 * k] | (b[2 * k + 1] << 8);
  }

  std::vector<Piece> pieces_;
  std::vector<int64_t> starts_;  // pieces_[i] holds tokens [starts_[i], starts_[i + 1])
  TokenFormat format_;
};

class SlicedTokens final : public worker::TokenStream {
 public:
  SlicedTokens(std::shared_ptr<const worker::TokenStream> base, int64_t begin, int64_t end)
      : base_(std::move(base)), begin_(begin), end_(end) {}
  int64_t num_tokens() const override { return end_ - begin_; }
  absl::Status Read(int64_t begin, int64_t count, int32_t* out) const override {
    if (begin < 0 || count < 0 || begin > num_tokens() - count) {
      return absl::OutOfRangeError(absl::StrCat("tokens [", begin, ", ", begin + count,
                                                ") outside [0, ", num_tokens(), ")"));
    }
    return base_->Read(begin_ + begin, count, out);
  }
  std::string Where(int64_t position) const override { return base_->Where(begin_ + position); }

 private:
  std::shared_ptr<const worker::TokenStream> base_;
  int64_t begin_, end_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const worker::TokenStream>> OpenTokenFiles(
    const std::vector<std::string>& files, TokenFormat format) {
  if (files.empty()) return absl::InvalidArgumentError("no token files");
  std::vector<Piece> pieces;
  for (const std::string& path : files) {
    absl::StatusOr<std::unique_ptr<MappedFile>> file = MappedFile::Open(path);
    if (!file.ok()) return file.status();
    if (format == TokenFormat::kShards) {
      absl::StatusOr<Piece> piece = CheckShard(*std::move(file));
      if (!piece.ok()) return piece.status();
      pieces.push_back(*std::move(piece));
      continue;
    }
    if ((*file)->size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": empty text file"));
    }
    Piece piece;
    piece.first = (*file)->data();
    piece.count = static_cast<int64_t>((*file)->size());
    piece.file = *std::move(file);
    pieces.push_back(std::move(piece));
  }
  return std::shared_ptr<const worker::TokenStream>(new FileTokens(std::move(pieces), format));
}

absl::StatusOr<std::shared_ptr<const worker::TokenStream>> SliceTokens(
    std::shared_ptr<const worker::TokenStream> stream, int64_t begin, int64_t end) {
  if (stream == nullptr || begin < 0 || begin >= end || end > stream->num_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens [", begin, ", ", end, ") are not a non-empty part of [0, ",
        stream == nullptr ? 0 : stream->num_tokens(), ")"));
  }
  return std::shared_ptr<const worker::TokenStream>(new SlicedTokens(std::move(stream), begin, end));
}

}  // namespace muonmesh::io
