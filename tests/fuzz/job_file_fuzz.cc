// Job files as untrusted text: YAML or JSON into the JobSpec message
// (proto/io/message_file.h). Any input must end in OK or a located error,
// within the parser's documented limits; ASan and libFuzzer catch the rest.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "muonmesh/v1/config.pb.h"
#include "proto/io/message_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  muonmesh::v1::JobSpec job;
  (void)muonmesh::protoio::ParseMessageText(text, "fuzz.yaml", &job);
  return 0;
}
