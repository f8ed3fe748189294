// Safetensors files as untrusted bytes: each input is written to a file of
// this process and read back with ReadSafetensors, which must end in OK or
// a clear error without reading past the file or allocating without bound.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "worker/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/safetensors_fuzz." +
           std::to_string(getpid()) + ".safetensors";
  }();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  const size_t written = std::fwrite(data, 1, size, f);
  std::fclose(f);
  if (written != size) return 0;
  std::map<std::string, std::string> metadata;
  (void)muonmesh::io::ReadSafetensors(path, &metadata);
  return 0;
}
