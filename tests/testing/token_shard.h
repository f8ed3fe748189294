#pragma once

// llm.c token shards written byte by byte for tests (header fields
// little-endian, as llm.c's write_datafile lays them out), independently of
// the readers under test.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace muonmesh::testing {

inline void PutInt32(std::string& out, int32_t v) {
  for (int k = 0; k < 4; ++k) {
    out.push_back(static_cast<char>((static_cast<uint32_t>(v) >> (8 * k)) & 0xFF));
  }
}

// A shard: magic, version, count (the number of tokens unless given), 253
// zero ints, then uint16 tokens.
inline std::string Shard(const std::vector<uint16_t>& tokens, int32_t magic = 20240520,
                         int32_t version = 1, int64_t count = -1) {
  std::string out;
  PutInt32(out, magic);
  PutInt32(out, version);
  PutInt32(out, static_cast<int32_t>(count < 0 ? static_cast<int64_t>(tokens.size()) : count));
  for (int i = 3; i < 256; ++i) PutInt32(out, 0);
  for (uint16_t t : tokens) {
    out.push_back(static_cast<char>(t & 0xFF));
    out.push_back(static_cast<char>(t >> 8));
  }
  return out;
}

// Writes `bytes` to dir/name; returns the path.
inline std::string WriteFile(const std::string& dir, const std::string& name,
                             const std::string& bytes) {
  const std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

}  // namespace muonmesh::testing
