#include "worker/io/safetensors.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::io {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ =
        fs::path(::testing::TempDir()) / absl::StrCat("safetensors_test_", ::getpid(), "_",
                                                      info->test_suite_name(), "_", info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The 8-byte little-endian length, written out by hand.
std::string LengthPrefix(uint64_t n) {
  std::string out;
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>(n & 0xFF));
    n >>= 8;
  }
  return out;
}

// A file: length prefix, header as given, then `buffer`.
std::string FileBytes(const std::string& header, const std::string& buffer) {
  return LengthPrefix(header.size()) + header + buffer;
}

// The little-endian bytes of a float's IEEE-754 bit pattern, given as an
// integer so that the expected bytes do not come from the code under test.
std::string F32Bytes(uint32_t bits) {
  std::string out;
  for (int i = 0; i < 4; ++i) {
    out.push_back(static_cast<char>(bits & 0xFF));
    bits >>= 8;
  }
  return out;
}

uint32_t BitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// ---------------------------------------------------------------- round trip

TEST(SafetensorsTest, RoundTripKeepsNamesShapesOrderAndBits) {
  TempDir dir;
  const std::vector<float> w = {
      1.0f, -2.5f, 0.0f, -0.0f, 3.25e-40f /* subnormal */, std::numeric_limits<float>::infinity()};
  const std::vector<float> b = {std::numeric_limits<float>::quiet_NaN(), 7.0f, 1e30f};
  const float scalar = 42.0f;
  const std::vector<TensorView> views = {
      {"zeta.weight", {2, 3}, w.data()},
      {"alpha.bias", {3}, b.data()},
      {"empty", {0, 5}, nullptr},
      {"scalar", {}, &scalar},
      {"unicode \xc3\xa9 \"quoted\" \\ tab\t", {1, 1, 1}, &scalar},
  };
  const std::string path = dir.File("model.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, views).ok());

  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const Tensor& t = (*read)[i];
    EXPECT_EQ(t.name, views[i].name);
    EXPECT_EQ(t.shape, views[i].shape);
    size_t n = 1;
    for (int64_t d : views[i].shape) n *= static_cast<size_t>(d);
    ASSERT_EQ(t.data.size(), n) << t.name;
    for (size_t k = 0; k < n; ++k) {
      EXPECT_EQ(BitsOf(t.data[k]), BitsOf(views[i].data[k])) << t.name << "[" << k << "]";
    }
  }
  // No temporary file is left next to the output.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(SafetensorsTest, WriterProducesTheExactReferenceLayout) {
  TempDir dir;
  const std::vector<float> a = {1.0f, -2.5f};
  const std::string path = dir.File("a.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, std::vector<TensorView>{{"a", {2}, a.data()}}).ok());
  // 54 bytes of JSON, padded with two spaces to 56 so the data is 8-aligned.
  const std::string header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}  ";
  ASSERT_EQ(header.size() % 8, 0u);
  EXPECT_EQ(ReadBytes(path), FileBytes(header, F32Bytes(0x3F800000) + F32Bytes(0xC0200000)));
}

TEST(SafetensorsTest, EmptyListRoundTrips) {
  TempDir dir;
  const std::string path = dir.File("none.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {}).ok());
  EXPECT_EQ(ReadBytes(path), FileBytes("{}      ", ""));
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->empty());
}

TEST(SafetensorsTest, OverwritesAtomically) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  const std::vector<float> one = {1.0f};
  const std::vector<float> two = {2.0f, 3.0f};
  ASSERT_TRUE(WriteSafetensors(path, std::vector<TensorView>{{"x", {1}, one.data()}}).ok());
  ASSERT_TRUE(WriteSafetensors(path, std::vector<TensorView>{{"y", {2}, two.data()}}).ok());
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ((*read)[0].name, "y");
  EXPECT_EQ((*read)[0].data, two);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(SafetensorsTest, LargeTensorRoundTrips) {
  TempDir dir;
  std::vector<float> big(1 << 20);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (float& x : big) x = normal(rng);
  const std::string path = dir.File("big.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, std::vector<TensorView>{{"big", {1024, 1024}, big.data()}}).ok());
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ((*read)[0].data, big);
}

// ---------------------------------------------------------------- hand-made file

TEST(SafetensorsTest, ReadsAFileWrittenByHand) {
  TempDir dir;
  // Header order differs from data order; metadata in the middle; JSON
  // whitespace, an escaped name and space padding, as other writers produce.
  const std::string header =
      "{ \"b\" : {\"dtype\":\"F32\", \"shape\":[2], \"data_offsets\":[8,16]},\n"
      "  \"__metadata__\": {\"format\": \"pt\", \"note\": \"\\u00e9\\ud83d\\ude00\"},\n"
      "  \"w\\u00e9\\\"x\": {\"data_offsets\": [0, 8], \"shape\": [1, 2], \"dtype\": \"F32\"},\n"
      "  \"none\": {\"dtype\":\"F32\",\"shape\":[3,0],\"data_offsets\":[16,16]} }    ";
  const std::string buffer = F32Bytes(0x3F800000) /* 1.0 */ + F32Bytes(0xC0200000) /* -2.5 */ +
                             F32Bytes(0x3F000000) /* 0.5 */ + F32Bytes(0x40400000) /* 3.0 */;
  const std::string path = dir.File("hand.safetensors");
  WriteBytes(path, FileBytes(header, buffer));

  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path, &metadata);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{
                          {"format", "pt"}, {"note", "\xc3\xa9\xf0\x9f\x98\x80"}}));
  ASSERT_EQ(read->size(), 3u);
  EXPECT_EQ((*read)[0].name, "w\xc3\xa9\"x");
  EXPECT_EQ((*read)[0].shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ((*read)[0].data, (std::vector<float>{1.0f, -2.5f}));
  EXPECT_EQ((*read)[1].name, "b");
  EXPECT_EQ((*read)[1].shape, (std::vector<int64_t>{2}));
  EXPECT_EQ((*read)[1].data, (std::vector<float>{0.5f, 3.0f}));
  EXPECT_EQ((*read)[2].name, "none");
  EXPECT_EQ((*read)[2].shape, (std::vector<int64_t>{3, 0}));
  EXPECT_TRUE((*read)[2].data.empty());
}

TEST(SafetensorsTest, MetadataRoundTripsAndIsOptional) {
  TempDir dir;
  const std::string path = dir.File("meta.safetensors");
  const std::vector<float> a = {1, 2, 3};
  const std::map<std::string, std::string> written = {
      {"step", "12"}, {"quote\"and\\slash", "line\nbreak \xc3\xa9"}, {"empty", ""}};
  ASSERT_TRUE(WriteSafetensors(path, {{"a", {3}, a.data()}}, written).ok());
  std::map<std::string, std::string> read_back = {{"stale", "x"}};
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path, &read_back);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read_back, written);
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ((*read)[0].data, a);

  // Metadata alone, and a file without any: an empty map.
  ASSERT_TRUE(WriteSafetensors(path, {}, {{"k", "v"}}).ok());
  ASSERT_TRUE(ReadSafetensors(path, &read_back).ok());
  EXPECT_EQ(read_back, (std::map<std::string, std::string>{{"k", "v"}}));
  ASSERT_TRUE(WriteSafetensors(path, {{"a", {3}, a.data()}}).ok());
  ASSERT_TRUE(ReadSafetensors(path, &read_back).ok());
  EXPECT_TRUE(read_back.empty());

  EXPECT_EQ(WriteSafetensors(path, {}, {{"bad\xff", "v"}}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsWriterTest, StreamedFileEqualsTheOneShotFile) {
  TempDir dir;
  const std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {-1.5f}, none;
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  ASSERT_TRUE(WriteSafetensors(dir.File("one.safetensors"),
                               {{"a", {2, 3}, a.data()}, {"b", {1}, b.data()}, {"z", {0}, nullptr}},
                               meta)
                  .ok());
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(
      dir.File("streamed.safetensors"), {{"a", {2, 3}}, {"b", {1}}, {"z", {0}}}, meta);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append(a).ok());
  EXPECT_FALSE(fs::exists(dir.File("streamed.safetensors")));  // not before Finish
  ASSERT_TRUE((*w)->Append(b).ok());
  ASSERT_TRUE((*w)->Append(none).ok());
  EXPECT_EQ((*w)->Append(b).code(), absl::StatusCode::kFailedPrecondition);  // one too many
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_EQ(ReadBytes(dir.File("streamed.safetensors")), ReadBytes(dir.File("one.safetensors")));
}

TEST(SafetensorsWriterTest, WrongSizesAndUnfinishedWritersLeaveNothingBehind) {
  TempDir dir;
  const std::string path = dir.File("out.safetensors");
  const std::vector<float> old = {9};
  ASSERT_TRUE(WriteSafetensors(path, {{"old", {1}, old.data()}}).ok());
  const std::string before = ReadBytes(path);
  {
    absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
        SafetensorsWriter::Create(path, {{"a", {2}}, {"b", {2}}});
    ASSERT_TRUE(w.ok());
    const std::vector<float> three = {1, 2, 3}, two = {1, 2};
    absl::Status st = (*w)->Append(three);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(st.message()), HasSubstr("needs 2 values, got 3"));
    ASSERT_TRUE((*w)->Append(two).ok());
    EXPECT_EQ((*w)->Finish().code(), absl::StatusCode::kFailedPrecondition);  // b missing
  }  // dropped unfinished
  EXPECT_EQ(ReadBytes(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  // Bad declarations are refused before any file is created.
  EXPECT_EQ(SafetensorsWriter::Create(dir.File("bad.safetensors"), {{"", {1}}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir.File("bad.safetensors")));
}

// ---------------------------------------------------------------- malformed input

struct BadFile {
  std::string name;
  std::string bytes;
  std::vector<std::string> reasons;  // fragments the message must contain
};

void PrintTo(const BadFile& c, std::ostream* os) { *os << c.name; }

std::string Entry(const std::string& name, const std::string& shape, uint64_t begin, uint64_t end,
                  const std::string& dtype = "F32") {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype, "\",\"shape\":", shape,
                      ",\"data_offsets\":[", begin, ",", end, "]}");
}

// "{body}" (absl::StrCat: GCC 12 warns falsely on `"{" + std::string`).
std::string Obj(const std::string& body) { return absl::StrCat("{", body, "}"); }

std::string Zeros(size_t n) { return std::string(n, '\0'); }

// 16-bit tensors widen to fp32 exactly. Expected values from the formats'
// definitions (sign, exponent, mantissa), not from the code under test.
TEST(SafetensorsTest, F16AndBF16AreReadAsExactFp32) {
  TempDir dir;
  auto u16 = [](std::initializer_list<uint16_t> values) {
    std::string out;
    for (uint16_t v : values) {
      out.push_back(static_cast<char>(v & 0xFF));
      out.push_back(static_cast<char>(v >> 8));
    }
    return out;
  };
  // binary16: 1.0, -2.0, the largest normal, the smallest subnormal 2^-24,
  // the largest subnormal, 1/3 rounded to binary16, -0, +inf, -inf, NaN.
  const std::string half = u16({0x3C00, 0xC000, 0x7BFF, 0x0001, 0x03FF, 0x3555, 0x8000,
                                0x7C00, 0xFC00, 0x7E00});
  // bfloat16: 1.0, -123.5, the smallest subnormal 2^-133, 3.140625, +inf.
  const std::string brain = u16({0x3F80, 0xC2F7, 0x0001, 0x4049, 0x7F80});
  const std::string header =
      Obj(Entry("h", "[2, 5]", 0, 20, "F16") + "," + Entry("b", "[5]", 20, 30, "BF16"));
  const std::string path = dir.File("half.safetensors");
  WriteBytes(path, FileBytes(header, half + brain));
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 2u);
  const std::vector<float>& h = (*read)[0].data;
  ASSERT_EQ(h.size(), 10u);
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.0f);
  EXPECT_EQ(h[2], 65504.0f);
  EXPECT_EQ(h[3], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[4], std::ldexp(1023.0f, -24));
  EXPECT_EQ(h[5], std::ldexp(1024.0f + 0x155, -12));  // (1 + 341/1024) / 4
  EXPECT_EQ(BitsOf(h[6]), 0x80000000u);
  EXPECT_EQ(h[7], std::numeric_limits<float>::infinity());
  EXPECT_EQ(h[8], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(h[9]));
  const std::vector<float>& b = (*read)[1].data;
  ASSERT_EQ(b.size(), 5u);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -123.5f);
  EXPECT_EQ(b[2], std::ldexp(1.0f, -133));
  EXPECT_EQ(b[3], 3.140625f);
  EXPECT_EQ(b[4], std::numeric_limits<float>::infinity());
}


std::vector<BadFile> BadFiles() {
  const std::string ok_a = Entry("a", "[2]", 0, 8);
  std::string dims65 = "[1";  // kMaxSafetensorsDims + 1 dimensions of 1
  for (int i = 1; i <= kMaxSafetensorsDims; ++i) dims65 += ",1";
  dims65 += "]";
  return {
      {"TooShort", std::string("\x05\x00\x00", 3), {"too short"}},
      {"EmptyFile", "", {"too short"}},
      {"HeaderOverLimit", LengthPrefix(uint64_t{200} << 20) + "{}", {"exceeds the limit"}},
      {"HeaderHuge", LengthPrefix(~uint64_t{0}) + "{}", {"exceeds the limit"}},
      {"HeaderPastEnd", LengthPrefix(100) + "{}", {"runs past the end"}},
      {"EmptyHeader", FileBytes("", ""), {"must be a JSON object"}},
      {"NotAnObject", FileBytes("[]", ""), {"must be a JSON object"}},
      {"LeadingSpace", FileBytes(" {}", ""), {"must be a JSON object"}},
      {"Truncated", FileBytes("{\"a\":", ""), {"safetensors header:1:6:", "the input ends where a value should be"}},
      {"MissingColon", FileBytes("{\"a\" {}}", ""), {"expected ':'"}},
      {"TrailingComma", FileBytes(Obj(ok_a + ","), Zeros(8)), {"expected a string in double quotes as the key"}},
      {"UnquotedKey", FileBytes("{a:1}", ""), {"expected a string in double quotes as the key"}},
      {"TextAfterObject", FileBytes("{} x", ""), {"content after the JSON value"}},
      {"TwoObjects", FileBytes("{}{}", ""), {"content after the JSON value"}},
      {"UnterminatedString", FileBytes("{\"abc", ""), {"the input ends inside a string"}},
      {"ControlCharInString", FileBytes("{\"a\nb\":{}}", ""), {"control character"}},
      {"InvalidUtf8", FileBytes("{\"\xff\":{}}", ""), {"invalid UTF-8"}},
      {"OverlongUtf8", FileBytes("{\"\xc0\xaf\":{}}", ""), {"invalid UTF-8"}},
      {"BadEscape", FileBytes("{\"\\x\":{}}", ""), {"unknown escape"}},
      {"LoneSurrogate", FileBytes("{\"\\udc00\":{}}", ""), {"unpaired surrogate"}},
      {"ShortUnicodeEscape", FileBytes("{\"\\u12\":{}}", ""), {"bad \\u escape"}},
      {"MissingDtype",
       FileBytes("{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", Zeros(8)),
       {"tensor \"a\"", "missing key \"dtype\""}},
      {"MissingShape",
       FileBytes("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", Zeros(8)),
       {"tensor \"a\"", "missing key \"shape\""}},
      {"MissingOffsets",
       FileBytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", Zeros(8)),
       {"tensor \"a\"", "missing key \"data_offsets\""}},
      {"UnknownKey",
       FileBytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}",
                 Zeros(8)),
       {"tensor \"a\"", "unknown key \"x\""}},
      {"DuplicateKey",
       FileBytes(
           "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
           Zeros(8)),
       {"duplicate key \"dtype\""}},
      {"TensorNotObject", FileBytes("{\"a\":[1]}", ""), {"expected an object, got an array"}},
      {"DtypeF64",
       FileBytes(Obj(Entry("w", "[2]", 0, 16, "F64")), Zeros(16)),
       {"tensor \"w\"", "\"F64\"", "F32, F16 and BF16 are"}},
      {"DtypeI32",
       FileBytes(Obj(Entry("w", "[2]", 0, 8, "I32")), Zeros(8)),
       {"tensor \"w\"", "\"I32\"", "not supported"}},
      {"F16WithF32Sizes",
       FileBytes(Obj(Entry("w", "[2]", 0, 8, "F16")), Zeros(8)),
       {"tensor \"w\"", "F16 shape [2] needs 4"}},
      {"DtypeNotString",
       FileBytes("{\"a\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", Zeros(8)),
       {"expected a string, got a number"}},
      {"NegativeDim",
       FileBytes(Obj(Entry("a", "[-2]", 0, 8)), Zeros(8)),
       {"tensor \"a\"", "a dimension must be >= 0"}},
      {"FractionalDim",
       FileBytes(Obj(Entry("a", "[2.0]", 0, 8)), Zeros(8)),
       {"must be an integer"}},
      {"ExponentDim", FileBytes(Obj(Entry("a", "[2e0]", 0, 8)), Zeros(8)), {"must be an integer"}},
      {"LeadingZeroDim", FileBytes(Obj(Entry("a", "[02]", 0, 8)), Zeros(8)), {"leading zero"}},
      {"DimOverflowsInt64",
       FileBytes(Obj(Entry("a", "[99999999999999999999]", 0, 8)), Zeros(8)),
       {"a dimension exceeds"}},
      {"ShapeProductOverflows",
       FileBytes(Obj(Entry("a", "[4294967296,4294967296,4294967296]", 0, 8)), Zeros(8)),
       {"tensor \"a\"", "is too large"}},
      {"DimNotNumber",
       FileBytes(Obj(Entry("a", "[\"2\"]", 0, 8)), Zeros(8)),
       {"expected a dimension (an integer), got a string"}},
      {"ShapeNotArray",
       FileBytes(Obj(Entry("a", "2", 0, 8)), Zeros(8)),
       {"expected the shape (an array), got a number"}},
      {"TooManyDims",
       FileBytes(Obj(Entry("a", dims65, 0, 4)), Zeros(4)),
       {"tensor \"a\"", "more than 64 dimensions"}},
      {"OffsetsBeginAfterEnd",
       FileBytes(Obj(Entry("a", "[0]", 8, 0)), Zeros(8)),
       {"tensor \"a\"", "begin is after end"}},
      {"OffsetsThreeValues",
       FileBytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,8]}}", Zeros(8)),
       {"too many values"}},
      {"OffsetsOneValue",
       FileBytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", Zeros(8)),
       {"data_offsets must be [begin, end]"}},
      {"OffsetsNegative",
       FileBytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-1,8]}}", Zeros(8)),
       {"a data offset must be >= 0"}},
      {"OffsetsOutOfRange",
       FileBytes(Obj(Entry("a", "[2]", 8, 16)), Zeros(8)),
       {"tensor \"a\"", "run past the end of the 8-byte data buffer"}},
      {"OffsetsHuge",
       FileBytes(Obj(Entry("a", "[2]", 0, uint64_t{1} << 62)), Zeros(8)),
       {"tensor \"a\"", "run past the end"}},
      {"SizeDoesNotMatchShape",
       FileBytes(Obj(Entry("a", "[3]", 0, 8)), Zeros(8)),
       {"tensor \"a\"", "span 8 bytes but F32 shape [3] needs 12"}},
      {"Overlap",
       FileBytes(Obj(Entry("a", "[2]", 0, 8) + "," + Entry("b", "[2]", 4, 12)), Zeros(12)),
       {"tensor \"b\"", "overlap those of tensor \"a\""}},
      {"SameRangeTwice",
       FileBytes(Obj(Entry("a", "[2]", 0, 8) + "," + Entry("b", "[2]", 0, 8)), Zeros(8)),
       {"tensor \"b\"", "overlap"}},
      {"Gap",
       FileBytes(Obj(Entry("a", "[2]", 0, 8) + "," + Entry("b", "[1]", 12, 16)), Zeros(16)),
       {"tensor \"b\"", "leave 4 unused bytes"}},
      {"GapAtStart",
       FileBytes(Obj(Entry("a", "[1]", 4, 8)), Zeros(8)),
       {"tensor \"a\"", "leave 4 unused bytes before them at offset 0"}},
      {"TrailingBytes", FileBytes(Obj(ok_a), Zeros(9)), {"1 trailing bytes"}},
      {"TrailingBytesNoTensors", FileBytes("{}", Zeros(4)), {"4 trailing bytes"}},
      {"DuplicateName",
       FileBytes(Obj(ok_a + "," + ok_a), Zeros(8)),
       {"duplicate tensor name \"a\""}},
      {"EmptyName", FileBytes(Obj(Entry("", "[2]", 0, 8)), Zeros(8)), {"empty tensor name"}},
      {"MetadataNotObject", FileBytes("{\"__metadata__\":\"x\"}", ""), {"expected an object"}},
      {"MetadataNonString",
       FileBytes("{\"__metadata__\":{\"k\":1}}", ""),
       {"__metadata__ values must be strings"}},
      {"MetadataDuplicateKey",
       FileBytes("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", ""),
       {"duplicate __metadata__ key"}},
      {"MetadataTwice",
       FileBytes("{\"__metadata__\":{},\"__metadata__\":{}}", ""),
       {"duplicate \"__metadata__\""}},
      {"TensorIsNull", FileBytes("{\"a\":null}", ""), {"expected an object, got null"}},
  };
}

class MalformedFileTest : public ::testing::TestWithParam<BadFile> {};

TEST_P(MalformedFileTest, GivesAClearErrorNamingTheFile) {
  const BadFile& c = GetParam();
  TempDir dir;
  const std::string path = dir.File("bad.safetensors");
  WriteBytes(path, c.bytes);
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << read.status();
  const std::string message(read.status().message());
  EXPECT_THAT(message, StartsWith(path + ": "));
  ASSERT_FALSE(c.reasons.empty());
  for (const std::string& reason : c.reasons) EXPECT_THAT(message, HasSubstr(reason));
}

INSTANTIATE_TEST_SUITE_P(Cases, MalformedFileTest, ::testing::ValuesIn(BadFiles()),
                         [](const auto& info) { return info.param.name; });

TEST(SafetensorsTest, MissingFileIsNotFound) {
  TempDir dir;
  const std::string path = dir.File("missing.safetensors");
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(path));
}

TEST(SafetensorsTest, DirectoryIsNotARegularFile) {
  TempDir dir;
  absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(dir.path().string());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("not a regular file"));
}

// ---------------------------------------------------------------- writer errors

TEST(SafetensorsTest, WriterRejectsBadTensorsAndWritesNothing) {
  TempDir dir;
  const float x[2] = {1.0f, 2.0f};
  struct Case {
    std::string name;
    std::vector<TensorView> views;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"empty name", {{"", {1}, x}}, "empty name"},
      {"reserved", {{"__metadata__", {1}, x}}, "reserved"},
      {"bad utf8", {{"a\xff", {1}, x}}, "not valid UTF-8"},
      {"duplicate", {{"a", {1}, x}, {"a", {1}, x}}, "duplicate name"},
      {"negative", {{"a", {-1}, x}}, "negative dimension"},
      {"null data", {{"a", {2}, nullptr}}, "null data"},
      {"overflow", {{"a", {int64_t{1} << 40, int64_t{1} << 40}, x}}, "too large"},
      {"too many dims", {{"a", std::vector<int64_t>(65, 1), x}}, "dimensions exceed"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.File("out.safetensors");
    absl::Status s = WriteSafetensors(path, c.views);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.reason)) << c.name;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path)) << c.name;
    EXPECT_FALSE(fs::exists(path)) << c.name;
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 0);
}

TEST(SafetensorsTest, WriterReportsAnUnwritableDirectory) {
  TempDir dir;
  const float x = 1.0f;
  const std::string path = dir.File("no/such/dir/out.safetensors");
  absl::Status s = WriteSafetensors(path, std::vector<TensorView>{{"a", {1}, &x}});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(path));
}

// ---------------------------------------------------------------- robustness

// Every truncation and many random mutations of a valid file read back as
// either an error or tensors whose sizes agree with their shapes: never a
// crash, a hang or a huge allocation.
TEST(SafetensorsTest, TruncationsAndMutationsNeverCrash) {
  TempDir dir;
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {7, 8};
  const std::string good_path = dir.File("good.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(good_path, std::vector<TensorView>{{"layers.0.weight", {2, 3}, w.data()},
                                                          {"layers.0.bias", {2}, b.data()},
                                                          {"e", {0}, nullptr}})
          .ok());
  const std::string good = ReadBytes(good_path);
  const std::string path = dir.File("fuzz.safetensors");

  int ok = 0;
  int failed = 0;
  const auto check = [&](const std::string& bytes) {
    WriteBytes(path, bytes);
    absl::StatusOr<std::vector<Tensor>> read = ReadSafetensors(path);
    if (!read.ok()) {
      ++failed;
      EXPECT_THAT(std::string(read.status().message()), StartsWith(path));
      return;
    }
    ++ok;
    size_t total = 0;
    for (const Tensor& t : *read) {
      size_t n = 1;
      for (int64_t d : t.shape) n *= static_cast<size_t>(d);
      EXPECT_EQ(t.data.size(), n);
      total += n * 4;
    }
    EXPECT_LE(total, bytes.size());
  };

  for (size_t len = 0; len < good.size(); ++len) check(good.substr(0, len));
  EXPECT_EQ(ok, 0) << "a truncated file read back";

  const auto start = std::chrono::steady_clock::now();
  std::mt19937 rng(12345);
  std::uniform_int_distribution<size_t> pos(0, good.size() - 1);
  std::uniform_int_distribution<int> byte(0, 255);
  const char interesting[] = {'0', '9', '-', '"', '{',  '}', '[',
                              ']', ',', ':', ' ', '\\', 'e', '.'};
  std::uniform_int_distribution<size_t> pick(0, sizeof(interesting) - 1);
  for (int iter = 0; iter < 3000; ++iter) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(3)) break;
    std::string bytes = good;
    const int edits = 1 + iter % 4;
    for (int e = 0; e < edits; ++e) {
      const size_t p = pos(rng);
      switch ((iter + e) % 4) {
        case 0:
          bytes[p] = static_cast<char>(byte(rng));
          break;
        case 1:
          bytes[p] = interesting[pick(rng)];
          break;
        case 2:
          bytes.erase(std::min(p, bytes.size() - 1), 1);
          break;
        default:
          bytes.insert(std::min(p, bytes.size()), 1, interesting[pick(rng)]);
      }
    }
    check(bytes);
  }
  // The mutations reach past the first checks: some files still parse (a
  // changed float, a space in the padding) and many do not.
  EXPECT_GT(ok, 0);
  EXPECT_GT(failed, 100);
}

}  // namespace
}  // namespace muonmesh::io
