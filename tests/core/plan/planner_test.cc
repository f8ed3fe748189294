#include "core/plan/planner.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/plan/buckets.h"
#include "core/plan/mesh.h"
#include "proto/convert/plan_convert.h"
#include "tests/core/plan/spec_loader.h"

namespace muonmesh::plan {
namespace {

// A small model with everything: matrices of several row lengths, vectors,
// a 4-D tensor viewed as a matrix, and an expert stack.
ModelSpec SmallMoe() {
  ModelSpec m;
  m.name = "small-moe";
  m.units.push_back({"embed", {{"embed.weight", {50, 12}, "adamw", false}}});
  for (int i = 0; i < 3; ++i) {
    const std::string p = "layers." + std::to_string(i);
    m.units.push_back({p,
                       {{p + ".q", {12, 12}, "muon", false},
                        {p + ".up", {40, 12}, "muon", false},
                        {p + ".down", {12, 40}, "muon", false},
                        {p + ".conv", {6, 2, 3, 3}, "muon", false},
                        {p + ".norm", {12}, "adamw", false},
                        {p + ".experts.w1", {8, 10, 12}, "muon", true},
                        {p + ".experts.w2", {8, 12, 10}, "muon", true},
                        {p + ".experts.bias", {8, 10}, "adamw", true}}});
  }
  return m;
}

struct Config {
  const char* name;
  int64_t world;
  const char* inner;
  int64_t instances;
  const char* outer;
  int64_t ep;
  const char* replica_split = "";  // optimizer.muon_replica_split
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

const Config kConfigs[] = {
    {"single", 1, "optim_grads_params", 1, "", 1},
    {"ddp", 4, "no_shard", 1, "", 1},
    {"zero1", 4, "optim", 1, "", 2},
    {"zero2", 4, "optim_grads", 1, "", 4},
    {"zero3", 4, "optim_grads_params", 1, "", 2},
    {"zero3_w3", 3, "optim_grads_params", 1, "", 1},
    {"hsdp", 8, "optim_grads_params", 2, "no_shard", 2},
    {"hfsdp", 8, "optim_grads_params", 2, "optim", 4},
    {"outer_zero3", 8, "optim", 2, "optim_grads_params", 8},
    {"many_ranks", 64, "optim_grads_params", 1, "", 8},
    {"hsdp_split", 8, "optim_grads_params", 2, "no_shard", 2, "on"},
    {"hsdp_split_i4_ep1", 16, "optim_grads_params", 4, "no_shard", 1, "on"},
    {"hsdp_over_ddp_split", 8, "no_shard", 2, "no_shard", 4, "on"},
};

PlanInput Input(const ModelSpec& model, const Config& c, const char* rule = "lpt") {
  PlanInput in;
  in.model = model;
  in.world_size = c.world;
  in.parallelism.data_parallel_sharding_strategy = c.inner;
  in.parallelism.num_distributed_optimizer_instances = c.instances;
  in.parallelism.outer_dp_sharding_strategy = c.outer;
  in.parallelism.expert_model_parallel_size = c.ep;
  in.options.owner_assignment = rule;
  in.options.muon_replica_split = c.replica_split;
  return in;
}

// Rows [0, rows) are tiled exactly once by the ranges.
void ExpectTiles(std::vector<std::pair<int64_t, int64_t>> ranges, int64_t rows,
                 const std::string& what) {
  std::sort(ranges.begin(), ranges.end());
  int64_t at = 0;
  for (const auto& [start, count] : ranges) {
    ASSERT_EQ(start, at) << what << ": gap or overlap at row " << at;
    ASSERT_GT(count, 0) << what;
    at += count;
  }
  EXPECT_EQ(at, rows) << what;
}

void CheckInvariants(const PlanInput& in, const Plan& p) {
  const ResolvedConfig& cfg = p.config;
  // Parameter count, independently.
  int64_t params = 0;
  for (const UnitSpec& u : in.model.units) {
    for (const ParamSpec& s : u.params) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      params += n;
    }
  }
  EXPECT_EQ(p.parameters, params);
  absl::StatusOr<int64_t> lcm_padding = MegatronPaddingElements(in);
  ASSERT_TRUE(lcm_padding.ok()) << lcm_padding.status();
  EXPECT_LE(p.padding_elements, *lcm_padding);

  // Every element of every tensor in exactly one shard of each domain: each
  // unit layout (shared by the domains of its mesh) tiles every tensor's rows.
  for (const UnitPlan& u : p.units) {
    for (const UnitLayout* l : {&u.dense, &u.expert}) {
      if (l->tensors.empty()) continue;
      std::vector<std::vector<std::pair<int64_t, int64_t>>> per(l->tensors.size());
      for (const Segment& s : l->segments) per[s.tensor].push_back({s.row_start, s.row_count});
      for (size_t t = 0; t < l->tensors.size(); ++t) {
        ExpectTiles(per[t], l->tensors[t].rows, u.name + " tensor " + std::to_string(t));
      }
    }
  }

  // Domains partition the ranks, per mesh, each with D distinct ranks.
  for (MeshKind mesh : {MeshKind::kDense, MeshKind::kExpert}) {
    if (mesh == MeshKind::kExpert && !p.has_experts) continue;
    std::multiset<int32_t> seen;
    for (const Domain& d : p.domains) {
      if (d.mesh != mesh) continue;
      EXPECT_EQ(static_cast<int64_t>(d.ranks.size()),
                mesh == MeshKind::kDense ? p.dense.size : p.expert.size);
      seen.insert(d.ranks.begin(), d.ranks.end());
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), cfg.world_size);
    for (int32_t r = 0; r < cfg.world_size; ++r) EXPECT_EQ(seen.count(r), 1u) << r;
  }

  // Matrices: holders tile each matrix's rows, owners hold rows or pay.
  const v1::Plan proto = [&] {
    v1::Plan out;
    convert::PlanToProto(in, p, false, &out);
    return out;
  }();
  std::map<std::string, int> copies;  // matrix name -> domains listing it
  // Under the replica split a matrix's owner may sit in another replica: it
  // holds the rows of the holder with its dp_shard coordinate (r mod W/I).
  const int64_t inner = cfg.world_size / cfg.instances;
  for (const v1::Matrix& m : proto.matrices()) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    bool owner_holds = false;
    for (const v1::Holder& h : m.holders()) {
      ranges.push_back({h.row_start(), h.row_count()});
      owner_holds = owner_holds || h.rank() == m.owner() ||
                    (m.has_replica() && h.rank() % inner == m.owner() % inner);
    }
    if (m.has_replica()) {
      EXPECT_EQ(m.owner() / inner, m.replica()) << m.name();
    }
    ExpectTiles(ranges, m.rows(), m.name());
    ASSERT_GE(m.owner(), 0) << m.name();
    EXPECT_EQ(m.owner_is_holder(), owner_holds);
    if (!owner_holds) {
      // A moved owner receives and returns every row.
      EXPECT_EQ(m.gather_bytes(), 2 * m.rows() * m.cols() * cfg.bytes_per_element) << m.name();
    }
    ++copies[m.name()];
  }
  // Each dense Muon matrix once per dense domain; each expert's matrix once
  // per domain of its own EP group.
  const int64_t dense_domains = MeshGeometry::Dense(cfg).num_domains();
  const int64_t expert_domains = MeshGeometry::Expert(cfg).num_domains() / cfg.ep;
  int expected_names = 0;
  for (const UnitSpec& u : in.model.units) {
    for (const ParamSpec& s : u.params) {
      if (s.optimizer != "muon") continue;
      if (!s.expert) {
        ++expected_names;
        EXPECT_EQ(copies[s.name], dense_domains) << s.name;
      } else {
        for (int64_t e = 0; e < s.shape[0]; ++e) {
          ++expected_names;
          const std::string name = s.name + "[" + std::to_string(e) + "]";
          EXPECT_EQ(copies[name], expert_domains) << name;
        }
      }
    }
  }
  EXPECT_EQ(static_cast<int>(copies.size()), expected_names);
  // Rank loads add up to the domain loads (under the replica split, the
  // dense loads are those of a set of I replica domains).
  const bool can_split = cfg.instances > 1 && cfg.outer == Strategy::kNoShard &&
                         cfg.owner_rule != OwnerRule::kAllGather;
  if (!can_split || in.options.muon_replica_split == "off") {
    EXPECT_EQ(p.dense.replicas, 1);
  }
  if (can_split && in.options.muon_replica_split == "on") {
    EXPECT_EQ(p.dense.replicas, cfg.instances);
  }
  double dense_total = 0;
  for (double l : p.dense.load) dense_total += l;
  double expert_total = 0;
  for (double l : p.expert.load) expert_total += l;
  double rank_total = 0;
  for (const RankSummary& r : p.ranks) rank_total += r.load_flops;
  EXPECT_NEAR(rank_total,
              dense_total * static_cast<double>(dense_domains / p.dense.replicas) +
                  expert_total * (p.has_experts ? cfg.ep * expert_domains : 0),
              1e-6 * std::max(1.0, rank_total));
  // Newton-Schulz work: each dense matrix once per domain, or once per set
  // of replica domains under the split.
  double dense_ns = 0;
  for (const MatrixPlan& m : p.dense.matrices) dense_ns += m.cost_flops;
  double expert_ns = 0;
  for (const MatrixPlan& m : p.expert.matrices) expert_ns += m.cost_flops;
  double rank_ns = 0;
  for (const RankSummary& r : p.ranks) rank_ns += r.ns_flops;
  if (cfg.owner_rule != OwnerRule::kAllGather) {
    EXPECT_NEAR(rank_ns,
                dense_ns * static_cast<double>(dense_domains / p.dense.replicas) +
                    expert_ns * (p.has_experts ? cfg.ep * expert_domains : 0),
                1e-6 * std::max(1.0, rank_ns));
  }
  // The joint makespan is the busiest rank's load, and never below its bound.
  double busiest = 0;
  for (const RankSummary& r : p.ranks) busiest = std::max(busiest, r.load_flops);
  EXPECT_DOUBLE_EQ(p.joint_makespan, busiest);
  EXPECT_GE(p.joint_makespan, p.joint_lower_bound * (1 - 1e-12));
}

class PlannerConfigTest : public ::testing::TestWithParam<Config> {};

TEST_P(PlannerConfigTest, SmallMoeHoldsInvariantsUnderEveryRule) {
  for (const char* rule : {"lpt", "round_robin", "greedy_in_order"}) {
    SCOPED_TRACE(rule);
    const PlanInput in = Input(SmallMoe(), GetParam(), rule);
    absl::StatusOr<Plan> p = ComputePlan(in);
    ASSERT_TRUE(p.ok()) << p.status();
    CheckInvariants(in, *p);
  }
}

TEST_P(PlannerConfigTest, SameInputGivesByteIdenticalPlans) {
  const PlanInput in = Input(SmallMoe(), GetParam());
  absl::StatusOr<Plan> a = ComputePlan(in);
  absl::StatusOr<Plan> b = ComputePlan(in);
  ASSERT_TRUE(a.ok() && b.ok());
  v1::Plan pa, pb;
  convert::PlanToProto(in, *a, true, &pa);
  convert::PlanToProto(in, *b, true, &pb);
  std::string sa, sb;
  ASSERT_TRUE(pa.SerializeToString(&sa));
  ASSERT_TRUE(pb.SerializeToString(&sb));
  EXPECT_EQ(sa, sb);
}

INSTANTIATE_TEST_SUITE_P(Configs, PlannerConfigTest, ::testing::ValuesIn(kConfigs),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(PlannerTest, HsdpAndHfsdpOptimizerPlacements) {
  const Config hsdp = {"hsdp", 8, "optim_grads_params", 2, "no_shard", 1};
  absl::StatusOr<Plan> p = ComputePlan(Input(SmallMoe(), hsdp));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->dense_axes.size(), 2u);
  EXPECT_EQ(p->dense_axes[0].name, "dp_outer");
  EXPECT_EQ(p->dense_axes[0].placements.optimizer, Placement::kReplicate);
  EXPECT_EQ(p->dense_axes[1].placements.optimizer, Placement::kShard);
  // Two dense domains, the rows of the (2, 4) mesh.
  std::vector<std::vector<int32_t>> rows;
  for (const Domain& d : p->domains) {
    if (d.mesh == MeshKind::kDense) rows.push_back(d.ranks);
  }
  EXPECT_THAT(rows, ::testing::ElementsAre(::testing::ElementsAre(0, 1, 2, 3),
                                           ::testing::ElementsAre(4, 5, 6, 7)));

  const Config hfsdp = {"hfsdp", 8, "optim_grads_params", 2, "optim", 1};
  p = ComputePlan(Input(SmallMoe(), hfsdp));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->dense_axes[0].placements.optimizer, Placement::kShard);
  EXPECT_EQ(p->dense_axes[1].placements.optimizer, Placement::kShard);
  ASSERT_EQ(p->expert_axes.size(), 1u);
  EXPECT_EQ(p->expert_axes[0].name, "expert_dp");
}

TEST(PlannerTest, CollectiveBytesByFormula) {
  // One 8x4 matrix (32 floats) on 4 ranks.
  ModelSpec m;
  m.units.push_back({"u", {{"w", {8, 4}, "muon", false}}});
  std::map<std::string, int64_t> bytes;
  bool reshard_after_forward = true;
  auto run = [&](const char* strategy) {
    bytes.clear();
    PlanInput in = Input(m, {"x", 4, strategy, 1, "", 1});
    in.options.reshard_after_forward = reshard_after_forward;
    absl::StatusOr<Plan> p = ComputePlan(in);
    ASSERT_TRUE(p.ok()) << p.status();
    for (const CollectiveBytes& c : p->collectives) bytes[c.name] += c.bytes_per_step;
  };
  // ZeRO-3: shards of 2 rows (8 floats); ring all-gather and reduce-scatter
  // each send 3 shards per rank: 4 ranks * 3 * 8 floats * 4 bytes.
  run("optim_grads_params");
  EXPECT_EQ(bytes["param_allgather"], 4 * 3 * 8 * 4);
  EXPECT_EQ(bytes["grad_reduce_scatter"], 4 * 3 * 8 * 4);
  EXPECT_EQ(bytes.count("param_allgather_after_step"), 0u);
  // The owner holds 2 of 8 rows: 6 rows of 4 floats in and out.
  EXPECT_EQ(bytes["muon_gather"], 6 * 4 * 4);
  EXPECT_EQ(bytes["muon_scatter"], 6 * 4 * 4);
  // DDP: ring all-reduce sends 2 (n-1)/n of the buffer per rank; no Muon traffic.
  run("no_shard");
  EXPECT_EQ(bytes["grad_allreduce"], 4 * 2 * 3 * 32 / 4 * 4);
  EXPECT_EQ(bytes.count("muon_gather"), 0u);
  EXPECT_EQ(bytes.count("param_allgather"), 0u);
  // ZeRO-1: reduce-scatter gradients, all-gather updated parameters.
  run("optim");
  EXPECT_EQ(bytes["grad_reduce_scatter"], 4 * 3 * 8 * 4);
  EXPECT_EQ(bytes["param_allgather_after_step"], 4 * 3 * 8 * 4);
  EXPECT_EQ(bytes.count("param_allgather_backward"), 0u);

  // A unit gathered twice per step (again for the backward pass): the
  // second gather is counted apart, the same bytes again; none where the
  // parameters are replicated.
  m.units[0].gathers_per_step = 2;
  run("optim_grads_params");
  EXPECT_EQ(bytes["param_allgather"], 4 * 3 * 8 * 4);
  EXPECT_EQ(bytes["param_allgather_backward"], 4 * 3 * 8 * 4);
  run("no_shard");
  EXPECT_EQ(bytes.count("param_allgather_backward"), 0u);
  // Held gathered from the forward pass to the backward one
  // (reshard_after_forward false): gathered once, the rest unchanged.
  reshard_after_forward = false;
  run("optim_grads_params");
  EXPECT_EQ(bytes["param_allgather"], 4 * 3 * 8 * 4);
  EXPECT_EQ(bytes.count("param_allgather_backward"), 0u);
  EXPECT_EQ(bytes["grad_reduce_scatter"], 4 * 3 * 8 * 4);
  reshard_after_forward = true;

  // An all-reduce of a count 4 ranks do not divide (3 x 3 = 9 floats):
  // 2 (n-1) count per group, exactly.
  ModelSpec odd;
  odd.units.push_back({"u", {{"w", {3, 3}, "muon", false}}});
  absl::StatusOr<Plan> p = ComputePlan(Input(odd, {"x", 4, "no_shard", 1, "", 1}));
  ASSERT_TRUE(p.ok()) << p.status();
  int found = 0;
  for (const CollectiveBytes& c : p->collectives) {
    if (c.name == "grad_allreduce") {
      EXPECT_EQ(c.bytes_per_step, 2 * 3 * 9 * 4);
      ++found;
    }
  }
  EXPECT_EQ(found, 1) << "no grad_allreduce entry in the plan";
}

// A token that never stops gives the same plan; one that stops gives
// Cancelled, wherever in the planner it is when it stops.
TEST(PlannerTest, CancelTokenStopsThePlan) {
  const PlanInput in = Input(SmallMoe(), kConfigs[9]);
  absl::StatusOr<Plan> plain = ComputePlan(in);
  ASSERT_TRUE(plain.ok()) << plain.status();
  CancelToken never([] { return false; }, 1);
  absl::StatusOr<Plan> ticked = ComputePlan(in, &never);
  ASSERT_TRUE(ticked.ok()) << ticked.status();
  v1::Plan a, b;
  convert::PlanToProto(in, *plain, true, &a);
  convert::PlanToProto(in, *ticked, true, &b);
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());

  // Polled once per tick: stopping at the k-th poll stops in every phase.
  int polls_in_full_plan = 0;
  CancelToken count([&] { return ++polls_in_full_plan < 0; }, 1);
  ASSERT_TRUE(ComputePlan(in, &count).ok());
  ASSERT_GT(polls_in_full_plan, 10);
  for (int stop_at : {1, polls_in_full_plan / 3, polls_in_full_plan - 1}) {
    SCOPED_TRACE(stop_at);
    int polls = 0;
    CancelToken token([&] { return ++polls >= stop_at; }, 1);
    EXPECT_EQ(ComputePlan(in, &token).status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(polls, stop_at);
  }
}

// ModelFitsOneBucket: every parameter at 4 bytes against the bucket, by
// the specs' sizes summed here; an empty tensor counts nothing, sizes past
// int64 do not wrap round to fit, and a bucket of 0 holds nothing.
TEST(PlannerTest, ModelFitsOneBucketCountsEveryParameter) {
  ModelSpec tiny;
  tiny.units.push_back({"a", {{"w", {3, 5}, "muon"}, {"b", {5}, "adamw"}, {"e", {0, 7}, "adamw"}}});
  tiny.units.push_back({"b", {{"w", {2, 5}, "muon"}}});
  const int64_t bytes = 4 * (3 * 5 + 5 + 2 * 5);
  EXPECT_TRUE(ModelFitsOneBucket(tiny, bytes));
  EXPECT_FALSE(ModelFitsOneBucket(tiny, bytes - 1));
  EXPECT_FALSE(ModelFitsOneBucket(tiny, 0));
  ModelSpec huge;
  huge.units.push_back({"h", {{"w", {int64_t{1} << 40, int64_t{1} << 40}, "muon"}}});
  EXPECT_FALSE(ModelFitsOneBucket(huge, std::numeric_limits<int64_t>::max()));
  // GPT-2 124M (about 497 MB) against the default 25 MiB and a 1 GiB bucket.
  absl::StatusOr<ModelSpec> gpt2 = testing::LoadSpec("gpt2-124m");
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  int64_t elements = 0;
  for (const UnitSpec& u : gpt2->units) {
    for (const ParamSpec& p : u.params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      elements += n;
    }
  }
  EXPECT_GT(elements, 120'000'000);
  EXPECT_FALSE(ModelFitsOneBucket(*gpt2, kDefaultBucketBytes));
  EXPECT_TRUE(ModelFitsOneBucket(*gpt2, 4 * elements));
  EXPECT_FALSE(ModelFitsOneBucket(*gpt2, 4 * elements - 1));
}

// The real specs: invariants, and no more padding than Megatron's rule.
TEST(PlannerTest, RealSpecsHoldInvariants) {
  const struct {
    const char* spec;
    int64_t world;
    int64_t instances;
    int64_t ep;
  } cases[] = {{"gpt2-124m", 8, 1, 1},    {"gpt2-124m", 96, 2, 1}, {"llama3-8b", 24, 1, 1},
               {"llama3-8b", 64, 2, 1},   {"deepseek-v3", 64, 1, 64}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.spec) + " at " + std::to_string(c.world));
    absl::StatusOr<ModelSpec> spec = testing::LoadSpec(c.spec);
    ASSERT_TRUE(spec.ok()) << "spec not found: " << spec.status();
    PlanInput in;
    in.model = *spec;
    in.world_size = c.world;
    in.parallelism.num_distributed_optimizer_instances = c.instances;
    in.parallelism.expert_model_parallel_size = c.ep;
    absl::StatusOr<Plan> p = ComputePlan(in);
    ASSERT_TRUE(p.ok()) << p.status();
    CheckInvariants(in, *p);
    EXPECT_GE(p->dense.makespan, p->dense.lower_bound * (1 - 1e-12));
  }
}

}  // namespace
}  // namespace muonmesh::plan
