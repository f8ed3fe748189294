#pragma once

// Reading and writing the safetensors format (https://github.com/huggingface/safetensors),
// the format of initial weights, training data and exported weights (docs/architecture.md §6).
//
// Layout of a file:
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian;
//   bytes [8, 8 + N)    the header, a UTF-8 JSON object:
//                         {"NAME": {"dtype": "F32", "shape": [d0, d1, ...],
//                                   "data_offsets": [BEGIN, END]}, ...,
//                          "__metadata__": {"KEY": "VALUE", ...}}   (optional)
//                       possibly followed by spaces (writers pad to 8-byte alignment);
//   bytes [8 + N, EOF)  the data buffer; each tensor's bytes are [BEGIN, END) relative to its
//                       start, row-major, little-endian.
//
// muonmesh keeps parameters, gradients and data in fp32. The reader takes F32, F16 and BF16
// tensors (most published checkpoints are BF16) and widens 16-bit ones to fp32 exactly: every
// binary16 and bfloat16 value, subnormals, infinities and NaNs included, is a binary32 value,
// so no rounding happens. Any other dtype is refused, naming the tensor. The writer writes F32.
//
// The reader is strict, because these files come from outside: the header must be well-formed
// JSON with exactly the keys above; every tensor's byte range must be shape x 4 bytes; the
// ranges must tile the buffer exactly (in the order of their offsets, no gaps, no overlaps, no
// trailing bytes), as the reference implementation requires. A malformed file is an error
// naming the file (and the tensor, where there is one), never a crash, and the reader never
// allocates more than the file's own size justifies.
//
// Free functions with no shared state: any thread may call them.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace muonmesh::io {

// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;
// Most dimensions one tensor may have.
inline constexpr int kMaxSafetensorsDims = 64;

// A tensor read from a file: it owns its data (row-major, product of `shape` elements).
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// A tensor to write: `data` points at product-of-`shape` floats owned by the caller (may be
// null when that product is 0).
struct TensorView {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// Reads every tensor of the file at `path`, in file order (ascending data offset; tensors of
// zero bytes at the same offset keep their header order). The "__metadata__" entry is checked
// and, when `metadata` is not null, returned there (string keys to string values).
//
// Returns NotFound if the file does not exist; InvalidArgument, with a message starting with
// `path`, if it is not a regular file or is malformed in any way: shorter than 8 bytes, a header
// length over kMaxSafetensorsHeaderBytes or beyond the end of the file, a header that is not
// strict JSON of the shape above (unknown or missing keys, duplicate names, an empty name,
// negative or non-integer numbers, more than kMaxSafetensorsDims dimensions), a dtype other than
// F32, F16 or BF16, byte ranges that do not match their shape or do not tile the data buffer; an error with
// errno's code if reading fails; ResourceExhausted if memory runs out.
absl::StatusOr<std::vector<Tensor>> ReadSafetensors(
    const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

// Writes `tensors`, in the given order (data offsets ascending in that order), as F32 to `path`,
// atomically: the bytes go to a temporary file in the same directory, which is flushed to disk
// and then renamed over `path`, so a reader sees the old file or the new one, never a part. The
// header is padded with spaces so that the data buffer starts at a multiple of 8 bytes.
// A non-empty `metadata` is written as the "__metadata__" entry (keys and values must be valid
// UTF-8).
//
// Returns InvalidArgument, writing nothing, if a name is empty, is "__metadata__", is not valid
// UTF-8 or appears twice, a dimension is negative, a shape has more than kMaxSafetensorsDims
// dimensions or its size overflows, or `data` is null for a non-empty tensor; an error with
// errno's code (naming the path) if the file cannot be written, in which case `path` is left as
// it was and no temporary file remains; FailedPrecondition, writing nothing, if `path` exists and
// is not a regular file (a device, FIFO, socket, folder or symbolic link is never replaced).
absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata = {});

// WriteSafetensors a tensor at a time, for files larger than what one wants
// in memory at once: Create declares every tensor (names, shapes, metadata;
// the checks of WriteSafetensors) and writes the header to a temporary file;
// Append writes the next tensor's data, in declaration order; Finish syncs
// the file and renames it over `path`. Dropping the writer before Finish
// (or any error) removes the temporary file and leaves `path` as it was.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
  };
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<Entry> tensors,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next tensor's data: exactly its shape's element count.
  // FailedPrecondition after the last tensor or with the wrong count.
  absl::Status Append(absl::Span<const float> data);
  // FailedPrecondition unless every tensor was appended.
  absl::Status Finish();

 private:
  SafetensorsWriter(std::string path, std::string temp, int fd, std::vector<Entry> tensors,
                    std::vector<uint64_t> bytes);
  std::string path_;
  std::string temp_;
  int fd_;
  std::vector<Entry> tensors_;
  std::vector<uint64_t> bytes_;
  size_t next_ = 0;
};

}  // namespace muonmesh::io
