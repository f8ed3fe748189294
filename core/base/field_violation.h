#pragma once

// One problem with an input, named by the path of the offending field
// ("parallelism.num_distributed_optimizer_instances",
// "model.units[3].params[0].shape[1]"), and a collector that lets every
// check add what it finds so that the caller reports them all at once. The
// planner, the job file's checks and the RPC edge (google.rpc.BadRequest)
// share it.

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace muonmesh {

struct FieldViolation {
  std::string field;
  std::string description;

  bool operator==(const FieldViolation&) const = default;
};

class Violations {
 public:
  void Add(std::string field, std::string description) {
    list_.push_back({std::move(field), std::move(description)});
  }
  bool empty() const { return list_.empty(); }
  size_t size() const { return list_.size(); }
  std::vector<FieldViolation> Take() { return std::move(list_); }

 private:
  std::vector<FieldViolation> list_;
};

}  // namespace muonmesh
