#include "worker/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string_view>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "core/base/text.h"
#include "proto/io/json_document.h"

namespace muonmesh::io {
namespace {

constexpr uint64_t kBytesPerElement = sizeof(float);
constexpr std::string_view kMetadataKey = "__metadata__";
// Longest name quoted in an error message: a hostile file's 50 MiB name
// should not become a 50 MiB message.
constexpr size_t kMaxQuotedName = 120;

static_assert(sizeof(float) == 4 && std::numeric_limits<float>::is_iec559,
              "safetensors F32 is IEEE-754 binary32");
static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
              "mixed-endian hosts are not supported");

// A name as error messages show it: C-escaped, in double quotes, shortened.
std::string QuoteName(std::string_view name) {
  std::string shown(name.substr(0, kMaxQuotedName));
  std::string out = absl::StrCat("\"", absl::CEscape(shown), "\"");
  if (name.size() > kMaxQuotedName) absl::StrAppend(&out, "...");
  return out;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}


// a * b for a, b >= 0, or nullopt when it exceeds `limit`.
std::optional<uint64_t> MulCapped(uint64_t a, uint64_t b, uint64_t limit) {
  if (a == 0 || b == 0) return 0;
  if (a > limit / b) return std::nullopt;
  return a * b;
}

// Elements of `shape` (all dims >= 0), or nullopt when more than `limit`.
std::optional<uint64_t> NumElements(const std::vector<int64_t>& shape, uint64_t limit) {
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  uint64_t n = 1;
  for (int64_t d : shape) {
    std::optional<uint64_t> next = MulCapped(n, static_cast<uint64_t>(d), limit);
    if (!next) return std::nullopt;
    n = *next;
  }
  return n;
}

void ByteSwapFloats(float* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &data[i], sizeof(bits));
    bits = ((bits & 0x000000FFu) << 24) | ((bits & 0x0000FF00u) << 8) |
           ((bits & 0x00FF0000u) >> 8) | ((bits & 0xFF000000u) >> 24);
    std::memcpy(&data[i], &bits, sizeof(bits));
  }
}

// ---------------------------------------------------------------- reading

// One tensor entry of the header.
// The element types a file may hold; F16 and BF16 are widened to fp32 on
// load, exactly (every binary16 and bfloat16 value is a binary32 value).
enum class Dtype { kF32, kF16, kBF16 };

uint64_t BytesPerElement(Dtype d) { return d == Dtype::kF32 ? 4 : 2; }

const char* DtypeName(Dtype d) {
  switch (d) {
    case Dtype::kF32:
      return "F32";
    case Dtype::kF16:
      return "F16";
    case Dtype::kBF16:
      return "BF16";
  }
  return "?";
}

// IEEE-754 binary16 to binary32, exactly: normals re-biased, subnormals
// normalised, infinities and NaNs (payload kept) carried over.
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    // Subnormal: value = mantissa * 2^-24; shift until the implicit bit.
    exponent = 127 - 15 + 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(bits);
}

float BFloat16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

struct Entry {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t elements = 0;
  size_t order = 0;  // position in the header
};

std::string_view Std(absl::string_view v) { return {v.data(), v.size()}; }

// Reads the header's entries from its JSON tree (proto/io/json_document.h:
// the project's one JSON reader, strict, bounded in nodes and depth), by
// the format's schema. Errors name the file, the tensor and the place.
class HeaderReader {
 public:
  HeaderReader(const protoio::JsonDocument& doc, const std::string& path)
      : doc_(doc), path_(path) {}

  // Where the "__metadata__" entries go (may be null: checked and dropped).
  void set_metadata(std::map<std::string, std::string>* metadata) { metadata_ = metadata; }

  absl::Status Read(std::vector<Entry>* entries) {
    const protoio::JsonNode& root = doc_[protoio::JsonDocument::kRoot];
    if (!root.is_map()) return ErrorAt(root, "the header must be a JSON object");
    std::unordered_set<std::string_view> names;
    bool have_metadata = false;
    for (uint32_t k = 1; k < root.size; k = doc_.Next(k + 1)) {
      const protoio::JsonNode& key_node = doc_[k];
      const std::string_view key = Std(doc_.Scalar(key_node));
      if (key == kMetadataKey) {
        if (have_metadata) return ErrorAt(key_node, "duplicate \"__metadata__\"");
        have_metadata = true;
        MUONMESH_RETURN_IF_ERROR(ReadMetadata(k + 1));
        continue;
      }
      if (key.empty()) return ErrorAt(key_node, "empty tensor name");
      if (!names.insert(key).second) {
        return ErrorAt(key_node, absl::StrCat("duplicate tensor name ", QuoteName(key)));
      }
      Entry entry;
      entry.name = std::string(key);
      entry.order = entries->size();
      tensor_ = &entry.name;
      absl::Status s = ReadTensor(k + 1, &entry);
      tensor_ = nullptr;
      MUONMESH_RETURN_IF_ERROR(s);
      entries->push_back(std::move(entry));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status ErrorAt(const protoio::JsonNode& node, std::string_view reason) const {
    std::string where = absl::StrCat(path_, ": ");
    if (tensor_ != nullptr) absl::StrAppend(&where, "tensor ", QuoteName(*tensor_), ": ");
    return absl::InvalidArgumentError(absl::StrCat(where, "safetensors header:",
                                                   node.where.line + 1, ":",
                                                   node.where.column + 1, ": ", std::string(reason)));
  }
  absl::Status Expected(const protoio::JsonNode& node, std::string_view what) const {
    return ErrorAt(node, absl::StrCat("expected ", std::string(what), ", got ",
                                      protoio::JsonKindName(doc_, node)));
  }

  // A JSON integer in [0, INT64_MAX]; `what` names it in errors.
  absl::StatusOr<int64_t> NonNegative(uint32_t index, std::string_view what) const {
    const protoio::JsonNode& node = doc_[index];
    const std::string_view text = node.is_scalar() ? Std(doc_.Scalar(node)) : std::string_view();
    if (!node.is_scalar() || node.plain == false || text == "true" || text == "false") {
      return Expected(node, absl::StrCat(std::string(what), " (an integer)"));
    }
    if (text.find_first_of(".eE") != std::string_view::npos) {
      return ErrorAt(node, absl::StrCat(std::string(what), " must be an integer"));
    }
    if (text.front() == '-') return ErrorAt(node, absl::StrCat(std::string(what), " must be >= 0"));
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    int64_t v = 0;
    for (const char c : text) {  // the reader checked: digits, no leading zero
      const int digit = c - '0';
      if (v > (kMax - digit) / 10) return ErrorAt(node, absl::StrCat(std::string(what), " exceeds ", kMax));
      v = v * 10 + digit;
    }
    return v;
  }

  absl::Status ReadMetadata(uint32_t index) {
    const protoio::JsonNode& map = doc_[index];
    if (!map.is_map()) return Expected(map, "an object");
    std::unordered_set<std::string_view> keys;
    for (uint32_t k = index + 1; k < map.size; k = doc_.Next(k + 1)) {
      const std::string_view key = Std(doc_.Scalar(doc_[k]));
      if (!keys.insert(key).second) {
        return ErrorAt(doc_[k], absl::StrCat("duplicate __metadata__ key ", QuoteName(key)));
      }
      const protoio::JsonNode& value = doc_[k + 1];
      if (!protoio::IsJsonString(value)) {
        return ErrorAt(value, absl::StrCat("__metadata__ values must be strings, got ",
                                           protoio::JsonKindName(doc_, value)));
      }
      if (metadata_ != nullptr) (*metadata_)[std::string(key)] = std::string(doc_.Scalar(value));
    }
    return absl::OkStatus();
  }

  absl::Status ReadDtype(const protoio::JsonNode& node, Entry* entry) const {
    if (!protoio::IsJsonString(node)) return Expected(node, "a string");
    const std::string_view dtype = Std(doc_.Scalar(node));
    if (dtype == "F32") {
      entry->dtype = Dtype::kF32;
    } else if (dtype == "F16") {
      entry->dtype = Dtype::kF16;
    } else if (dtype == "BF16") {
      entry->dtype = Dtype::kBF16;
    } else {
      return ErrorAt(node, absl::StrCat("dtype ", QuoteName(dtype),
                                        " is not supported: F32, F16 and BF16 are (read as fp32)"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadShape(uint32_t index, Entry* entry) const {
    const protoio::JsonNode& node = doc_[index];
    if (!node.is_sequence()) return Expected(node, "the shape (an array)");
    if (node.size - index - 1 > static_cast<uint32_t>(kMaxSafetensorsDims)) {
      return ErrorAt(node, absl::StrCat("more than ", kMaxSafetensorsDims, " dimensions"));
    }
    for (uint32_t d = index + 1; d < node.size; d = doc_.Next(d)) {
      MUONMESH_ASSIGN_OR_RETURN(int64_t dim, NonNegative(d, "a dimension"));
      entry->shape.push_back(dim);
    }
    return absl::OkStatus();
  }

  absl::Status ReadOffsets(uint32_t index, Entry* entry) const {
    const protoio::JsonNode& node = doc_[index];
    if (!node.is_sequence()) return Expected(node, "data_offsets (an array)");
    int64_t offsets[2] = {0, 0};
    size_t count = 0;
    for (uint32_t d = index + 1; d < node.size; d = doc_.Next(d), ++count) {
      if (count >= 2) return ErrorAt(node, "data_offsets must be [begin, end]: too many values");
      MUONMESH_ASSIGN_OR_RETURN(offsets[count], NonNegative(d, "a data offset"));
    }
    if (count != 2) return ErrorAt(node, "data_offsets must be [begin, end]");
    if (offsets[0] > offsets[1]) {
      return ErrorAt(node, absl::StrCat("data_offsets [", offsets[0], ", ", offsets[1],
                                        "]: begin is after end"));
    }
    entry->begin = static_cast<uint64_t>(offsets[0]);
    entry->end = static_cast<uint64_t>(offsets[1]);
    return absl::OkStatus();
  }

  absl::Status ReadTensor(uint32_t index, Entry* entry) const {
    const protoio::JsonNode& map = doc_[index];
    if (!map.is_map()) return Expected(map, "an object");
    bool have[3] = {false, false, false};
    static constexpr std::string_view kKeys[3] = {"dtype", "shape", "data_offsets"};
    for (uint32_t k = index + 1; k < map.size; k = doc_.Next(k + 1)) {
      const std::string_view key = Std(doc_.Scalar(doc_[k]));
      const auto* known = std::find(std::begin(kKeys), std::end(kKeys), key);
      if (known == std::end(kKeys)) {
        return ErrorAt(doc_[k], absl::StrCat("unknown key ", QuoteName(key),
                                             " (expected dtype, shape, data_offsets)"));
      }
      const size_t which = static_cast<size_t>(known - std::begin(kKeys));
      if (have[which]) return ErrorAt(doc_[k], absl::StrCat("duplicate key ", QuoteName(key)));
      have[which] = true;
      if (which == 0) MUONMESH_RETURN_IF_ERROR(ReadDtype(doc_[k + 1], entry));
      if (which == 1) MUONMESH_RETURN_IF_ERROR(ReadShape(k + 1, entry));
      if (which == 2) MUONMESH_RETURN_IF_ERROR(ReadOffsets(k + 1, entry));
    }
    for (size_t i = 0; i < 3; ++i) {
      if (!have[i]) return ErrorAt(map, absl::StrCat("missing key \"", std::string(kKeys[i]), "\""));
    }
    return absl::OkStatus();
  }

  const protoio::JsonDocument& doc_;
  const std::string& path_;
  std::map<std::string, std::string>* metadata_ = nullptr;
  const std::string* tensor_ = nullptr;  // the tensor being read, for errors
};

// The header's JSON tree. A real header takes ~12 nodes a tensor in 60 bytes
// or more, so one node per 4 bytes leaves room and bounds a hostile header's
// tree at ~5 times its size; the format nests 3 deep.
absl::StatusOr<std::unique_ptr<protoio::JsonDocument>> ReadHeaderJson(const std::string& header,
                                                                      const std::string& path) {
  if (header.empty() || header[0] != '{') {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": safetensors header: the header must be a JSON object starting with '{'"));
  }
  protoio::JsonOptions options;
  options.max_nodes = header.size() / 4 + 1024;
  options.max_depth = 3;
  return protoio::ReadJsonDocument(header, absl::StrCat(path, ": safetensors header"), options);
}

// Checks every entry's byte range against its shape and the buffer, and that
// the ranges tile [0, buffer_bytes). Sorts `entries` into file order.
absl::Status CheckRanges(const std::string& path, uint64_t buffer_bytes,
                         std::vector<Entry>* entries) {
  constexpr uint64_t kMaxElements =
      static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / kBytesPerElement;
  const auto tensor_error = [&](const Entry& e, std::string_view reason) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor ", QuoteName(e.name), ": ", std::string(reason)));
  };
  for (Entry& e : *entries) {
    const std::string range = absl::StrCat("data_offsets [", e.begin, ", ", e.end, "]");
    if (e.end > buffer_bytes) {
      return tensor_error(
          e, absl::StrCat(range, " run past the end of the ", buffer_bytes, "-byte data buffer"));
    }
    std::optional<uint64_t> elements = NumElements(e.shape, kMaxElements);
    if (!elements) {
      return tensor_error(e, absl::StrCat("shape ", ShapeString(e.shape),
                                          " is too large (over 2^63 bytes of fp32)"));
    }
    e.elements = *elements;
    const uint64_t want = *elements * BytesPerElement(e.dtype);
    if (e.end - e.begin != want) {
      return tensor_error(e, absl::StrCat(range, " span ", e.end - e.begin, " bytes but ",
                                          DtypeName(e.dtype), " shape ", ShapeString(e.shape),
                                          " needs ", want));
    }
  }
  // Empty tensors sort before a non-empty one at the same offset; ties keep
  // header order.
  std::sort(entries->begin(), entries->end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.order) < std::tie(b.begin, b.end, b.order);
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& e : *entries) {
    if (e.begin < covered) {
      return tensor_error(e, absl::StrCat("data_offsets [", e.begin, ", ", e.end,
                                          "] overlap those of tensor ", QuoteName(previous->name)));
    }
    if (e.begin > covered) {
      return tensor_error(
          e, absl::StrCat("data_offsets [", e.begin, ", ", e.end, "] leave ", e.begin - covered,
                          " unused bytes before them at offset ", covered));
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != buffer_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", buffer_bytes - covered,
                                                   " trailing bytes after the last tensor's "
                                                   "data (the data buffer is ",
                                                   buffer_bytes, " bytes, the tensors cover ",
                                                   covered, ")"));
  }
  return absl::OkStatus();
}

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, reporting the error close() gives (a delayed write error).
  int Close() {
    const int r = ::close(fd_);
    fd_ = -1;
    return r;
  }

 private:
  int fd_;
};

// Reads exactly n bytes at `offset`.
absl::Status ReadExactly(int fd, uint64_t offset, char* dst, uint64_t n, const std::string& path) {
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    const ssize_t r = ::pread(fd, dst, chunk, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat(path, ": read failed at byte ", offset));
    }
    if (r == 0) {
      return absl::DataLossError(
          absl::StrCat(path, ": file ended at byte ", offset, " while reading (did it change?)"));
    }
    dst += r;
    offset += static_cast<uint64_t>(r);
    n -= static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- writing

absl::Status WriteAll(int fd, const char* src, uint64_t n, const std::string& path) {
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    const ssize_t r = ::write(fd, src, chunk);
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat(path, ": write failed"));
    }
    src += r;
    n -= static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

// The header JSON for `tensors`, padded with spaces to a multiple of 8 bytes,
// or InvalidArgument for a tensor that cannot be written.
absl::StatusOr<std::string> BuildHeader(const std::string& path,
                                        absl::Span<const TensorView> tensors,
                                        const std::map<std::string, std::string>& metadata,
                                        std::vector<uint64_t>* bytes, bool require_data = true) {
  constexpr uint64_t kMaxBytes = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  std::unordered_set<std::string_view> names;
  std::string header = "{";
  if (!metadata.empty()) {
    ::muonmesh::text::AppendJsonString(kMetadataKey, &header);
    header += ":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!::muonmesh::text::IsValidUtf8(key) || !::muonmesh::text::IsValidUtf8(value)) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": metadata ", QuoteName(key), ": keys and values must be valid UTF-8"));
      }
      if (!first) header.push_back(',');
      first = false;
      ::muonmesh::text::AppendJsonString(key, &header);
      header.push_back(':');
      ::muonmesh::text::AppendJsonString(value, &header);
    }
    header += "}";
    if (!tensors.empty()) header.push_back(',');
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    const auto error = [&](std::string_view reason) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", i, " (", QuoteName(t.name), "): ", std::string(reason)));
    };
    if (t.name.empty()) return error("empty name");
    if (t.name == kMetadataKey) return error("\"__metadata__\" is reserved");
    if (!::muonmesh::text::IsValidUtf8(t.name)) return error("the name is not valid UTF-8");
    if (!names.insert(t.name).second) return error("duplicate name");
    if (t.shape.size() > static_cast<size_t>(kMaxSafetensorsDims)) {
      return error(
          absl::StrCat(t.shape.size(), " dimensions exceed the limit of ", kMaxSafetensorsDims));
    }
    for (int64_t d : t.shape) {
      if (d < 0) return error(absl::StrCat("negative dimension in shape ", ShapeString(t.shape)));
    }
    std::optional<uint64_t> elements =
        NumElements(t.shape, (kMaxBytes - offset) / kBytesPerElement);
    if (!elements) return error(absl::StrCat("shape ", ShapeString(t.shape), " is too large"));
    if (require_data && *elements > 0 && t.data == nullptr) {
      return error("null data for a non-empty tensor");
    }
    const uint64_t size = *elements * kBytesPerElement;
    bytes->push_back(size);
    if (i > 0) header.push_back(',');
    ::muonmesh::text::AppendJsonString(t.name, &header);
    absl::StrAppend(&header, ":{\"dtype\":\"F32\",\"shape\":[", absl::StrJoin(t.shape, ","),
                    "],\"data_offsets\":[", offset, ",", offset + size, "]}");
    offset += size;
  }
  header.push_back('}');
  while (header.size() % 8 != 0) header.push_back(' ');
  return header;
}

// The writer renames its temporary file over `path`, which replaces what is
// there: only a regular file (or nothing) may be. A device such as /dev/full,
// a FIFO, a folder or a symbolic link is refused, never replaced.
absl::Status CheckReplaceable(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot stat"));
  }
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      path, S_ISLNK(st.st_mode) ? ": is a symbolic link" : ": exists and is not a regular file",
      "; refusing to replace it"));
}

std::string TempPathFor(const std::string& path, uint64_t attempt) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1), ".", attempt);
}

// Reads entry `e`'s elements into `out` as fp32: F32 directly, F16 and BF16
// through a bounded staging buffer, so a 16-bit tensor costs its fp32 size
// and no more.
absl::Status ReadElements(int fd, uint64_t data_start, const Entry& e, float* out,
                          const std::string& path) {
  if (e.dtype == Dtype::kF32) {
    MUONMESH_RETURN_IF_ERROR(
        ReadExactly(fd, data_start + e.begin, reinterpret_cast<char*>(out), e.end - e.begin, path));
    if constexpr (std::endian::native == std::endian::big) ByteSwapFloats(out, e.elements);
    return absl::OkStatus();
  }
  constexpr uint64_t kChunk = uint64_t{1} << 18;  // elements per read
  std::vector<unsigned char> staging(static_cast<size_t>(std::min(e.elements, kChunk) * 2));
  for (uint64_t done = 0; done < e.elements;) {
    const uint64_t n = std::min(kChunk, e.elements - done);
    MUONMESH_RETURN_IF_ERROR(ReadExactly(fd, data_start + e.begin + 2 * done,
                                         reinterpret_cast<char*>(staging.data()), 2 * n, path));
    for (uint64_t i = 0; i < n; ++i) {
      // Little-endian in the file, whatever the host.
      const auto v = static_cast<uint16_t>(staging[2 * i] | (staging[2 * i + 1] << 8));
      out[done + i] = e.dtype == Dtype::kF16 ? HalfToFloat(v) : BFloat16ToFloat(v);
    }
    done += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<Tensor>> ReadSafetensors(const std::string& path,
                                                    std::map<std::string, std::string>* metadata) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it has no effect
  // on the regular files that pass the check below.
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", file_bytes,
                     " bytes is too short for a safetensors file (8-byte header length)"));
  }
  unsigned char length_bytes[8];
  MUONMESH_RETURN_IF_ERROR(
      ReadExactly(fd.get(), 0, reinterpret_cast<char*>(length_bytes), 8, path));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_bytes,
                                                   " exceeds the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_bytes > file_bytes - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_bytes,
                                                   " runs past the end of the ", file_bytes,
                                                   "-byte file"));
  }
  const uint64_t buffer_bytes = file_bytes - 8 - header_bytes;

  try {
    std::string header(static_cast<size_t>(header_bytes), '\0');
    MUONMESH_RETURN_IF_ERROR(ReadExactly(fd.get(), 8, header.data(), header_bytes, path));
    std::vector<Entry> entries;
    std::map<std::string, std::string> parsed_metadata;
    {
      MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<protoio::JsonDocument> doc,
                                ReadHeaderJson(header, path));
      HeaderReader reader(*doc, path);
      reader.set_metadata(&parsed_metadata);
      MUONMESH_RETURN_IF_ERROR(reader.Read(&entries));
    }
    header = std::string();
    MUONMESH_RETURN_IF_ERROR(CheckRanges(path, buffer_bytes, &entries));

    std::vector<Tensor> tensors;
    tensors.reserve(entries.size());
    const uint64_t data_start = 8 + header_bytes;
    for (Entry& e : entries) {
      Tensor t;
      t.name = std::move(e.name);
      t.shape = std::move(e.shape);
      t.data.resize(static_cast<size_t>(e.elements));
      MUONMESH_RETURN_IF_ERROR(ReadElements(fd.get(), data_start, e, t.data.data(), path));
      tensors.push_back(std::move(t));
    }
    if (metadata != nullptr) *metadata = std::move(parsed_metadata);
    return tensors;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": out of memory reading ", file_bytes, " bytes"));
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": out of memory reading ", file_bytes, " bytes"));
  }
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const TensorView& t : tensors) entries.push_back({t.name, t.shape});
  // The data checks first, so that a bad list writes nothing at all.
  std::vector<uint64_t> bytes;
  MUONMESH_ASSIGN_OR_RETURN(std::string header, BuildHeader(path, tensors, metadata, &bytes));
  MUONMESH_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                            SafetensorsWriter::Create(path, std::move(entries), metadata));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t count = static_cast<size_t>(bytes[i] / kBytesPerElement);
    absl::Status st = writer->Append(absl::MakeConstSpan(tensors[i].data, count));
    MUONMESH_RETURN_IF_ERROR(st);
  }
  return writer->Finish();
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<Entry> tensors,
    const std::map<std::string, std::string>& metadata) {
  std::vector<TensorView> views;
  for (const Entry& e : tensors) views.push_back({e.name, e.shape, nullptr});
  std::vector<uint64_t> bytes;
  MUONMESH_ASSIGN_OR_RETURN(std::string header,
                            BuildHeader(path, views, metadata, &bytes, /*require_data=*/false));
  MUONMESH_RETURN_IF_ERROR(CheckReplaceable(path));

  std::string temp;
  int raw_fd = -1;
  for (uint64_t attempt = 0; attempt < 100 && raw_fd < 0; ++attempt) {
    temp = TempPathFor(path, attempt);
    raw_fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (raw_fd < 0 && errno != EEXIST) break;
  }
  if (raw_fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot create temporary file ", temp));
  }
  std::unique_ptr<SafetensorsWriter> w(
      new SafetensorsWriter(path, temp, raw_fd, std::move(tensors), std::move(bytes)));
  unsigned char length_bytes[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i, n >>= 8) length_bytes[i] = static_cast<unsigned char>(n & 0xFF);
  if (absl::Status s = WriteAll(w->fd_, reinterpret_cast<const char*>(length_bytes), 8, temp);
      !s.ok()) {
    return s;  // the destructor removes the temporary file
  }
  MUONMESH_RETURN_IF_ERROR(WriteAll(w->fd_, header.data(), header.size(), temp));
  return w;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::string temp, int fd,
                                     std::vector<Entry> tensors, std::vector<uint64_t> bytes)
    : path_(std::move(path)),
      temp_(std::move(temp)),
      fd_(fd),
      tensors_(std::move(tensors)),
      bytes_(std::move(bytes)) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_.c_str());
  }
}

absl::Status SafetensorsWriter::Append(absl::Span<const float> data) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  if (next_ >= tensors_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": every declared tensor was already written"));
  }
  const uint64_t want = bytes_[next_] / kBytesPerElement;
  if (data.size() != want) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": tensor ",
                                                      QuoteName(tensors_[next_].name), " needs ",
                                                      want, " values, got ", data.size()));
  }
  const char* src = reinterpret_cast<const char*>(data.data());
  if constexpr (std::endian::native == std::endian::little) {
    MUONMESH_RETURN_IF_ERROR(WriteAll(fd_, src, bytes_[next_], temp_));
  } else {
    std::vector<float> chunk;
    for (size_t at = 0; at < data.size(); at += size_t{1} << 16) {
      const size_t count = std::min(data.size() - at, size_t{1} << 16);
      chunk.assign(data.data() + at, data.data() + at + count);
      ByteSwapFloats(chunk.data(), count);
      MUONMESH_RETURN_IF_ERROR(WriteAll(fd_, reinterpret_cast<const char*>(chunk.data()),
                                        count * kBytesPerElement, temp_));
    }
  }
  ++next_;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  if (next_ != tensors_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": ", next_, " of ",
                                                      tensors_.size(), " tensors written"));
  }
  const int fd = std::exchange(fd_, -1);
  const auto fail = [&](absl::Status s) {
    ::unlink(temp_.c_str());
    return s;
  };
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    return fail(absl::ErrnoToStatus(e, absl::StrCat(temp_, ": fsync failed")));
  }
  if (::close(fd) != 0) {
    return fail(absl::ErrnoToStatus(errno, absl::StrCat(temp_, ": close failed")));
  }
  // Again: the path may have changed while the tensors were written.
  if (absl::Status s = CheckReplaceable(path_); !s.ok()) return fail(s);
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    return fail(
        absl::ErrnoToStatus(errno, absl::StrCat(path_, ": cannot rename ", temp_, " to it")));
  }
  // Make the rename itself durable. Best effort: some file systems refuse
  // fsync on a directory, and the data is already in place.
  std::filesystem::path dir = std::filesystem::path(path_).parent_path();
  if (dir.empty()) dir = std::filesystem::path(".");
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::io
