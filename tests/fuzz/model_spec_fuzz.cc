// Model specs as untrusted text, then the config validator behind them: the
// spec parsed into ModelSpec, converted to the planner's input, and checked
// with plan::Validate and plan::Resolve at a world size and parallelism the
// input's first bytes choose. No planning: the validator must refuse what
// the planner could not take, cheaply.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "muonmesh/v1/config.pb.h"
#include "core/plan/validate.h"
#include "proto/convert/plan_convert.h"
#include "proto/io/message_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint8_t world = data[0];
  const uint8_t ep = data[1];
  const uint8_t strategy = data[2];
  const std::string_view text(reinterpret_cast<const char*>(data) + 3, size - 3);
  muonmesh::v1::ModelSpec spec;
  if (!muonmesh::protoio::ParseMessageText(text, "fuzz.yaml", &spec).ok()) return 0;
  muonmesh::plan::PlanInput in;
  in.model = muonmesh::convert::ModelFromProto(spec);
  in.world_size = world;
  in.parallelism.expert_model_parallel_size = ep % 9;
  static const char* kStrategies[] = {"no_shard", "optim", "optim_grads", "optim_grads_params",
                                      "bogus"};
  in.parallelism.data_parallel_sharding_strategy = kStrategies[strategy % 5];
  in.parallelism.num_distributed_optimizer_instances = (strategy / 5) % 4;
  if (muonmesh::plan::Validate(in).empty()) (void)muonmesh::plan::Resolve(in);
  return 0;
}
