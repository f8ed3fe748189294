#include "proto/job/corpus.h"

#include <fcntl.h>
#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace muonmesh::job {
namespace {

namespace fs = std::filesystem;

absl::Status CheckRegular(const std::string& field, const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": no such file"));
  }
  if (ec) return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": ", ec.message()));
  if (st.type() != fs::file_type::regular) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": not a regular file"));
  }
  return absl::OkStatus();
}

int32_t LittleEndianInt32(const unsigned char* p) {
  return static_cast<int32_t>(static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                              static_cast<uint32_t>(p[2]) << 16 |
                              static_cast<uint32_t>(p[3]) << 24);
}

// A file read from front to back in blocks; closed on destruction.
class Reader {
 public:
  static absl::StatusOr<std::unique_ptr<Reader>> Open(const std::string& field,
                                                      const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Error(field, path, "cannot open");
    const off_t size = ::lseek(fd, 0, SEEK_END);
    if (size < 0 || ::lseek(fd, 0, SEEK_SET) != 0) {
      absl::Status s = Error(field, path, "cannot seek");
      ::close(fd);
      return s;
    }
    return std::unique_ptr<Reader>(new Reader(field, path, fd, static_cast<int64_t>(size)));
  }
  ~Reader() { ::close(fd_); }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  int64_t size() const { return size_; }
  // Up to `n` bytes into `out` (fewer only at the end of the file).
  absl::StatusOr<size_t> Read(char* out, size_t n) {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::read(fd_, out + got, n - got);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return Error(field_, path_, "cannot read");
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    return got;
  }

 private:
  Reader(std::string field, std::string path, int fd, int64_t size)
      : field_(std::move(field)), path_(std::move(path)), fd_(fd), size_(size) {}
  static absl::Status Error(const std::string& field, const std::string& path, const char* what) {
    const int e = errno;
    return absl::ErrnoToStatus(e, absl::StrCat(field, ": ", path, ": ", what, ": ",
                                               std::strerror(e)));
  }

  std::string field_, path_;
  int fd_;
  int64_t size_;
};

// Reads `tokens` tokens of `width` bytes (1: text, 2: uint16 shards) from
// `reader` and checks each is below `vocab_size`.
absl::Status ScanTokens(const std::string& field, const std::string& path, Reader& reader,
                        int64_t tokens, int width, int64_t vocab_size) {
  constexpr size_t kBlock = size_t{1} << 20;
  std::string block(kBlock, '\0');
  int64_t index = 0;
  while (index < tokens) {
    const size_t want = static_cast<size_t>(
        std::min<int64_t>(static_cast<int64_t>(kBlock / width), tokens - index) * width);
    absl::StatusOr<size_t> got = reader.Read(block.data(), want);
    if (!got.ok()) return got.status();
    if (*got != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", path, ": the file ended at token ", index + *got / width));
    }
    const auto* bytes = reinterpret_cast<const unsigned char*>(block.data());
    for (size_t k = 0; k < want / width; ++k) {
      const int64_t token = width == 1 ? bytes[k] : (bytes[2 * k] | bytes[2 * k + 1] << 8);
      if (token >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": ", path, ": token ", index + static_cast<int64_t>(k), " is ", token,
            ", outside the model's vocabulary [0, ", vocab_size, ")"));
      }
    }
    index += static_cast<int64_t>(want / width);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ShardTokenCount(const std::string& path, absl::string_view head,
                                        int64_t file_bytes) {
  if (file_bytes < kTokenShardHeaderBytes || head.size() < 12) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", file_bytes, " bytes, shorter than a token shard's ", kTokenShardHeaderBytes,
        "-byte header"));
  }
  const auto* p = reinterpret_cast<const unsigned char*>(head.data());
  const int32_t magic = LittleEndianInt32(p);
  const int32_t version = LittleEndianInt32(p + 4);
  const int64_t count = LittleEndianInt32(p + 8);
  if (magic != kTokenShardMagic) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": magic ", magic, ", a token shard has ",
                                                   kTokenShardMagic, " (llm.c .bin format)"));
  }
  if (version != kTokenShardVersion) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": version ", version, ", only version ",
                                                   kTokenShardVersion, " (uint16 tokens) is read"));
  }
  const int64_t want = kTokenShardHeaderBytes + 2 * count;
  if (count < 0 || file_bytes != want) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": the header counts ", count,
                                                   " tokens (", want, " bytes) but the file has ",
                                                   file_bytes, " bytes"));
  }
  return count;
}

absl::StatusOr<CorpusSummary> CheckCorpusFiles(const std::string& field,
                                               const std::string& pattern, bool tokens,
                                               int64_t vocab_size, bool scan) {
  absl::StatusOr<std::vector<std::string>> files = ExpandCorpus(field, pattern);
  if (!files.ok()) return files.status();
  CorpusSummary summary;
  for (const std::string& path : *files) {
    absl::StatusOr<std::unique_ptr<Reader>> reader = Reader::Open(field, path);
    if (!reader.ok()) return reader.status();
    int64_t count = (*reader)->size();
    if (tokens) {
      std::string head(kTokenShardHeaderBytes, '\0');
      absl::StatusOr<size_t> got = (*reader)->Read(head.data(), head.size());
      if (!got.ok()) return got.status();
      head.resize(*got);
      absl::StatusOr<int64_t> n = ShardTokenCount(path, head, (*reader)->size());
      if (!n.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", n.status().message()));
      count = *n;
    } else if (count == 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": empty text file"));
    }
    // A text file's bytes are all below 256: only a smaller vocabulary needs a scan.
    if (scan && (tokens || vocab_size < 256)) {
      const int width = tokens ? 2 : 1;
      if (absl::Status s = ScanTokens(field, path, **reader, count, width, vocab_size); !s.ok()) {
        return s;
      }
      summary.bytes += count * width;
    }
    ++summary.files;
    summary.tokens += count;
  }
  return summary;
}

bool IsPattern(const std::string& pattern) {
  const std::string name = fs::path(pattern).filename().string();
  return name.find_first_of("*?[") != std::string::npos;
}

absl::StatusOr<std::vector<std::string>> ExpandCorpus(const std::string& field,
                                                      const std::string& pattern) {
  if (pattern.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty path"));
  std::vector<std::string> files;
  if (!IsPattern(pattern)) {
    if (absl::Status s = CheckRegular(field, pattern); !s.ok()) return s;
    files.push_back(pattern);
    return files;
  }
  glob_t g{};
  const int rc = glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc && files.size() <= kMaxCorpusFiles; ++i) {
      files.emplace_back(g.gl_pathv[i]);
    }
  }
  globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && files.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no file matches ", pattern));
  }
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read the folder of ", pattern));
  }
  if (files.size() > kMaxCorpusFiles) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", pattern, " matches more than ",
                                                   kMaxCorpusFiles, " files"));
  }
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    if (absl::Status s = CheckRegular(field, f); !s.ok()) return s;
  }
  return files;
}

absl::StatusOr<CorpusReport> CheckCorpus(const Corpus& corpus, int64_t vocab_size, bool scan) {
  const std::string field = corpus.tokens ? "data.tokens" : "data.text";
  CorpusReport report;
  absl::StatusOr<CorpusSummary> train =
      CheckCorpusFiles(field + ".train", corpus.train, corpus.tokens, vocab_size, scan);
  if (!train.ok()) return train.status();
  report.train = *train;
  if (!corpus.val.empty()) {
    absl::StatusOr<CorpusSummary> val =
        CheckCorpusFiles(field + ".val", corpus.val, corpus.tokens, vocab_size, scan);
    if (!val.ok()) return val.status();
    report.val = *val;
  }
  return report;
}

}  // namespace muonmesh::job
