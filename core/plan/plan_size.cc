#include "core/plan/plan_size.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/plan/layout.h"
#include "core/plan/mesh.h"
#include "core/plan/validate.h"

namespace muonmesh::plan {
namespace {

// Bytes of the planner's state per counted item, measured on generated and
// real specs and rounded up: a Segment (32) in each unit's layout copy and
// in the layout cache; an offset (8) per shard, likewise; a Holder (24) in
// up to three lists of matrices, with vector growth; a MatrixPlan (~100) in
// three lists, with the input's ParamSpec, the assignment's indexes and the
// proto-free copies of names; a rank's summary and domain entries.
constexpr double kBytesPerSegment = 48;
constexpr double kBytesPerShard = 16;
constexpr double kBytesPerHolder = 80;
constexpr double kBytesPerMatrix = 1024;
constexpr double kBytesPerRank = 256;
constexpr double kBytesPerTensor = 256;

// Row runs and holder entries of one unit's layout on one mesh.
struct LayoutCounts {
  double segments = 0;
  double holders = 0;
};

// The Muon matrices (blocks of every expert) that rows [start, start +
// count) of a tensor meet.
int64_t MatricesCrossed(const ParamSpec& p, int64_t start, int64_t count) {
  const int64_t rows = AsMatrix(p).rows;  // of one expert
  const int64_t blocks = MuonBlocksOf(p);
  const int64_t last = start + count - 1;
  if (!MuonStacksBlocks(p)) {
    // Blocks follow each other: the run meets every block between its ends.
    auto block_of = [&](int64_t row) {
      return (row / rows) * blocks + MuonBlockOfRow(p, row % rows);
    };
    return block_of(last) - block_of(start) + 1;
  }
  // Stacked blocks interleave: both of every expert the run passes whole,
  // those it meets of the experts at its ends.
  auto met = [&](int64_t expert) {
    const int64_t lo = std::max(start - expert * rows, int64_t{0});
    const int64_t hi = std::min(start + count - expert * rows, rows);
    int64_t n = 0;
    for (int64_t b = 0; b < blocks; ++b) n += MuonBlockRows(p, b).Among(lo, hi).count > 0;
    return n;
  };
  const int64_t first_expert = start / rows;
  const int64_t last_expert = last / rows;
  if (first_expert == last_expert) return met(first_expert);
  return met(first_expert) + met(last_expert) + (last_expert - first_expert - 1) * blocks;
}

// One holder entry per row run of a Muon tensor and expert it crosses: the
// planner (UnitMatrices) splits a run that spans experts of a stack.
LayoutCounts Count(const UnitSpec& unit, const UnitLayout& layout) {
  LayoutCounts c;
  c.segments = static_cast<double>(layout.segments.size());
  for (const Segment& s : layout.segments) {
    const ParamSpec& p = unit.params[layout.tensors[s.tensor].param];
    if (p.optimizer != "muon") continue;
    c.holders += static_cast<double>(MatricesCrossed(p, s.row_start, s.row_count));
  }
  return c;
}

// Counts of each distinct unit layout, computed once: a model repeats its
// layers, and their layouts are the costly part of sizing.
class CountCache {
 public:
  // Counts of `tensors` (of `unit`) cut into `num_shards` shards.
  LayoutCounts Get(const UnitSpec& unit, const std::vector<LayoutTensor>& tensors,
                   int64_t num_shards) {
    std::vector<int64_t> key = {num_shards};
    for (const LayoutTensor& t : tensors) {
      const ParamSpec& p = unit.params[t.param];
      // Muon rows per expert decide how runs split into holder entries.
      const int64_t muon_rows = p.optimizer == "muon" ? MuonMatrixOf(p).rows : 0;
      key.insert(key.end(), {t.param, t.rows, t.row_len, muon_rows, p.muon_block_rows_next,
                              p.muon_stack_blocks ? 1 : 0});
    }
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      // Validated input: LayoutUnit cannot fail here.
      it = cache_.emplace(std::move(key), Count(unit, *LayoutUnit(tensors, num_shards))).first;
    }
    return it->second;
  }

 private:
  std::map<std::vector<int64_t>, LayoutCounts> cache_;
};

// Matrices of one unit on one mesh (`expert`: its expert stacks, each E/EP
// local experts) and the bytes of their names as the answer lists them.
std::pair<double, double> UnitMatrices(const UnitSpec& unit, bool expert, int64_t ep) {
  double matrices = 0;
  double name_bytes = 0;
  for (const ParamSpec& p : unit.params) {
    if (p.expert != expert || p.optimizer != "muon") continue;
    const double copies = (p.expert ? static_cast<double>(p.shape[0] / ep) : 1.0) *
                          static_cast<double>(MuonBlocksOf(p));
    matrices += copies;
    // "name[e]": two brackets and at most 18 digits; "[r0:r1]" per block,
    // "[r0:r1 every s]" per stacked one.
    const size_t block_bytes = MuonStacksBlocks(p) ? 64 : p.muon_block_rows > 0 ? 40 : 0;
    name_bytes += copies * static_cast<double>(p.name.size() + (p.expert ? 20 : 0) + block_bytes);
  }
  return {matrices, name_bytes};
}

}  // namespace

absl::StatusOr<PlanSize> EstimatePlanSize(const PlanInput& input, CancelToken* cancel) {
  const ResolvedConfig cfg = internal::ResolveUnchecked(input);
  const MeshGeometry meshes[2] = {MeshGeometry::Dense(cfg), MeshGeometry::Expert(cfg)};
  PlanSize size;
  bool has_experts = false;
  double tensors = 0;
  CountCache cache;
  for (const UnitSpec& unit : input.model.units) {
    const UnitTensors split = SplitUnit(unit, cfg.ep);
    tensors += static_cast<double>(unit.params.size());
    for (int mesh = 0; mesh < 2; ++mesh) {
      const std::vector<LayoutTensor>& list = mesh == 0 ? split.dense : split.expert;
      if (list.empty()) continue;
      has_experts = has_experts || mesh == 1;
      const MeshGeometry& g = meshes[mesh];
      const LayoutCounts c = cache.Get(unit, list, g.domain_size());
      const auto [matrices, name_bytes] = UnitMatrices(unit, mesh == 1, cfg.ep);
      const double domains = static_cast<double>(g.num_domains());
      size.layout_shards += static_cast<double>(g.domain_size());
      size.segments += c.segments;
      size.matrices += matrices;
      size.holders += c.holders;
      size.listed_matrices += matrices * domains;
      size.listed_holders += c.holders * domains;
      size.listed_name_bytes += name_bytes * domains;
    }
    if (cancel != nullptr && cancel->Tick(static_cast<int64_t>(unit.params.size()))) {
      return CancelToken::Status();
    }
  }
  size.domains = static_cast<double>(meshes[0].num_domains()) +
                 (has_experts ? static_cast<double>(meshes[1].num_domains()) : 0.0);
  size.planner_bytes = kBytesPerSegment * size.segments + kBytesPerShard * size.layout_shards +
                       kBytesPerHolder * size.holders + kBytesPerMatrix * size.matrices +
                       kBytesPerRank * static_cast<double>(cfg.world_size) +
                       kBytesPerTensor * tensors;
  return size;
}

std::vector<FieldViolation> PlanSizeViolations(const PlanSize& size) {
  if (size.planner_bytes <= static_cast<double>(kMaxPlannerBytes)) return {};
  return {{"world_size",
           absl::StrFormat("planning would take about %.0f MiB (limit %d MiB): %.0f matrices "
                           "with %.0f holder entries, and %.0f row runs in the units' layouts; "
                           "use fewer ranks per optimizer domain, or fewer or larger units",
                           size.planner_bytes / (1 << 20), kMaxPlannerBytes >> 20, size.matrices,
                           size.holders, size.segments)}};
}

}  // namespace muonmesh::plan
