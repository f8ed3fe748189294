// The plan a coordinator sends to workers survives the trip through
// v1::ExecutionPlan field by field, for real models under several configs,
// and a damaged message is refused naming the field.

#include "proto/convert/exec_plan_convert.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/plan/planner.h"
#include "tests/core/plan/spec_loader.h"

namespace muonmesh {
namespace {

using ::testing::HasSubstr;

// Field-by-field equality of two plans, written out here (the plan types
// have no operator==) so that a field the conversion drops is caught.
void ExpectSameLayout(const plan::UnitLayout& a, const plan::UnitLayout& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].param, b.tensors[i].param);
    EXPECT_EQ(a.tensors[i].rows, b.tensors[i].rows);
    EXPECT_EQ(a.tensors[i].row_len, b.tensors[i].row_len);
  }
  EXPECT_EQ(a.num_shards, b.num_shards);
  EXPECT_EQ(a.shard_elements, b.shard_elements);
  EXPECT_EQ(a.padding_elements, b.padding_elements);
  ASSERT_EQ(a.segments.size(), b.segments.size());
  for (size_t i = 0; i < a.segments.size(); ++i) {
    EXPECT_EQ(a.segments[i].tensor, b.segments[i].tensor);
    EXPECT_EQ(a.segments[i].row_start, b.segments[i].row_start);
    EXPECT_EQ(a.segments[i].row_count, b.segments[i].row_count);
    EXPECT_EQ(a.segments[i].offset, b.segments[i].offset);
  }
  EXPECT_EQ(a.shard_begin, b.shard_begin);
  EXPECT_EQ(a.method, b.method);
  EXPECT_EQ(a.rotation, b.rotation);
}

void ExpectSameDomainPlan(const plan::DomainPlan& a, const plan::DomainPlan& b) {
  EXPECT_EQ(a.mesh, b.mesh);
  EXPECT_EQ(a.size, b.size);
  EXPECT_EQ(a.replicas, b.replicas);
  ASSERT_EQ(a.matrices.size(), b.matrices.size());
  for (size_t i = 0; i < a.matrices.size(); ++i) {
    const plan::MatrixPlan& x = a.matrices[i];
    const plan::MatrixPlan& y = b.matrices[i];
    EXPECT_EQ(x.unit, y.unit);
    EXPECT_EQ(x.param, y.param);
    EXPECT_EQ(x.expert, y.expert);
    EXPECT_EQ(x.rows, y.rows);
    EXPECT_EQ(x.cols, y.cols);
    EXPECT_EQ(x.ns_form, y.ns_form);
    EXPECT_EQ(x.cost_flops, y.cost_flops);
    EXPECT_EQ(x.min_cost, y.min_cost);
    ASSERT_EQ(x.holders.size(), y.holders.size());
    for (size_t k = 0; k < x.holders.size(); ++k) {
      EXPECT_EQ(x.holders[k].position, y.holders[k].position);
      EXPECT_EQ(x.holders[k].row_start, y.holders[k].row_start);
      EXPECT_EQ(x.holders[k].row_count, y.holders[k].row_count);
    }
    EXPECT_EQ(x.owner, y.owner);
    EXPECT_EQ(x.owner_cost, y.owner_cost);
    EXPECT_EQ(x.gather_bytes, y.gather_bytes);
    EXPECT_EQ(x.replica, y.replica);
  }
  EXPECT_EQ(a.load, b.load);
  EXPECT_EQ(a.ns_flops, b.ns_flops);
  EXPECT_EQ(a.gather_bytes, b.gather_bytes);
  EXPECT_EQ(a.owned, b.owned);
  EXPECT_EQ(a.makespan, b.makespan);
  EXPECT_EQ(a.lower_bound, b.lower_bound);
  EXPECT_EQ(a.exchange_bytes, b.exchange_bytes);
  EXPECT_EQ(a.exchange_lower_bound_bytes, b.exchange_lower_bound_bytes);
}

void ExpectSameAxes(const std::vector<plan::MeshAxis>& a, const std::vector<plan::MeshAxis>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].size, b[i].size);
    EXPECT_EQ(a[i].strategy, b[i].strategy);
    EXPECT_EQ(a[i].placements.param, b[i].placements.param);
    EXPECT_EQ(a[i].placements.grad, b[i].placements.grad);
    EXPECT_EQ(a[i].placements.optimizer, b[i].placements.optimizer);
  }
}

void ExpectSamePlan(const plan::Plan& a, const plan::Plan& b) {
  EXPECT_EQ(a.config.world_size, b.config.world_size);
  EXPECT_EQ(a.config.instances, b.config.instances);
  EXPECT_EQ(a.config.ep, b.config.ep);
  EXPECT_EQ(a.config.inner, b.config.inner);
  EXPECT_EQ(a.config.outer, b.config.outer);
  EXPECT_EQ(a.config.owner_rule, b.config.owner_rule);
  EXPECT_EQ(a.config.replica_split, b.config.replica_split);
  EXPECT_EQ(a.config.ns_steps, b.config.ns_steps);
  EXPECT_EQ(a.config.ns_algorithm, b.config.ns_algorithm);
  EXPECT_EQ(a.config.ns_table, b.config.ns_table);
  EXPECT_EQ(a.config.threads_per_rank, b.config.threads_per_rank);
  EXPECT_EQ(a.config.reshard_after_forward, b.config.reshard_after_forward);
  EXPECT_EQ(a.config.comm_flops_per_byte, b.config.comm_flops_per_byte);
  EXPECT_EQ(a.config.bytes_per_element, b.config.bytes_per_element);
  ExpectSameAxes(a.dense_axes, b.dense_axes);
  ExpectSameAxes(a.expert_axes, b.expert_axes);
  EXPECT_EQ(a.has_experts, b.has_experts);
  ASSERT_EQ(a.units.size(), b.units.size());
  for (size_t u = 0; u < a.units.size(); ++u) {
    EXPECT_EQ(a.units[u].name, b.units[u].name);
    EXPECT_EQ(a.units[u].has_dense, b.units[u].has_dense);
    EXPECT_EQ(a.units[u].has_expert, b.units[u].has_expert);
    if (a.units[u].has_dense) ExpectSameLayout(a.units[u].dense, b.units[u].dense);
    if (a.units[u].has_expert) ExpectSameLayout(a.units[u].expert, b.units[u].expert);
  }
  ExpectSameDomainPlan(a.dense, b.dense);
  ExpectSameDomainPlan(a.expert, b.expert);
  ASSERT_EQ(a.domains.size(), b.domains.size());
  for (size_t i = 0; i < a.domains.size(); ++i) {
    EXPECT_EQ(a.domains[i].id, b.domains[i].id);
    EXPECT_EQ(a.domains[i].mesh, b.domains[i].mesh);
    EXPECT_EQ(a.domains[i].name, b.domains[i].name);
    EXPECT_EQ(a.domains[i].ranks, b.domains[i].ranks);
  }
  ASSERT_EQ(a.ranks.size(), b.ranks.size());
  for (size_t i = 0; i < a.ranks.size(); ++i) {
    EXPECT_EQ(a.ranks[i].rank, b.ranks[i].rank);
    EXPECT_EQ(a.ranks[i].load_flops, b.ranks[i].load_flops);
    EXPECT_EQ(a.ranks[i].ns_flops, b.ranks[i].ns_flops);
    EXPECT_EQ(a.ranks[i].shard_elements, b.ranks[i].shard_elements);
    EXPECT_EQ(a.ranks[i].param_shard_elements, b.ranks[i].param_shard_elements);
    EXPECT_EQ(a.ranks[i].grad_shard_elements, b.ranks[i].grad_shard_elements);
    EXPECT_EQ(a.ranks[i].gather_bytes, b.ranks[i].gather_bytes);
    EXPECT_EQ(a.ranks[i].owned_matrices, b.ranks[i].owned_matrices);
    EXPECT_EQ(a.ranks[i].replica_exchange_bytes, b.ranks[i].replica_exchange_bytes);
  }
  ASSERT_EQ(a.collectives.size(), b.collectives.size());
  for (size_t i = 0; i < a.collectives.size(); ++i) {
    EXPECT_EQ(a.collectives[i].name, b.collectives[i].name);
    EXPECT_EQ(a.collectives[i].mesh, b.collectives[i].mesh);
    EXPECT_EQ(a.collectives[i].axis, b.collectives[i].axis);
    EXPECT_EQ(a.collectives[i].bytes_per_step, b.collectives[i].bytes_per_step);
    EXPECT_EQ(a.collectives[i].max_rank_bytes, b.collectives[i].max_rank_bytes);
  }
  EXPECT_EQ(a.parameters, b.parameters);
  EXPECT_EQ(a.padding_elements, b.padding_elements);
}

struct Case {
  const char* spec;
  int64_t world;
  const char* strategy;
  int64_t instances;
  int64_t ep;
  const char* rule;
  const char* outer = "";
  const char* replica_split = "";
  int64_t threads_per_rank = 0;
  bool reshard_after_forward = true;
};

TEST(ExecPlanConvertTest, PlansOfRealModelsRoundTripFieldByField) {
  for (const Case& c :
       std::vector<Case>{{"gpt2-124m", 8, "optim_grads_params", 2, 1, "lpt"},
                         {"gpt2-124m", 4, "no_shard", 1, 1, "allgather"},
                         {"llama3-8b", 16, "optim", 1, 1, "round_robin"},
                         {"deepseek-v3", 8, "optim_grads_params", 1, 8, "lpt"},
                         // HSDP with the replica split.
                         {"gpt2-124m", 8, "optim_grads_params", 2, 1, "lpt", "no_shard", "on"},
                         // Priced for ranks of 3 OpenBLAS threads.
                         {"llama3-8b", 8, "optim_grads_params", 1, 1, "lpt", "", "", 3},
                         // Units held gathered for the backward pass.
                         {"gpt2-124m", 4, "optim_grads_params", 1, 1, "lpt", "", "", 0, false}}) {
    SCOPED_TRACE(::testing::Message() << c.spec << " W=" << c.world << " " << c.strategy);
    absl::StatusOr<plan::ModelSpec> spec = testing::LoadSpec(c.spec);
    ASSERT_TRUE(spec.ok()) << spec.status();
    plan::PlanInput input;
    input.model = *spec;
    input.world_size = c.world;
    input.parallelism.data_parallel_sharding_strategy = c.strategy;
    input.parallelism.num_distributed_optimizer_instances = c.instances;
    input.parallelism.expert_model_parallel_size = c.ep;
    input.parallelism.outer_dp_sharding_strategy = c.outer;
    input.options.owner_assignment = c.rule;
    input.options.muon_replica_split = c.replica_split;
    input.options.threads_per_rank = c.threads_per_rank;
    input.options.reshard_after_forward = c.reshard_after_forward;
    input.options.device = "cpu";  // where the forms, and so the threads, matter
    absl::StatusOr<plan::Plan> original = plan::ComputePlan(input);
    ASSERT_TRUE(original.ok()) << original.status();
    EXPECT_EQ(original->config.threads_per_rank, std::max<int64_t>(1, c.threads_per_rank));
    EXPECT_EQ(original->config.reshard_after_forward, c.reshard_after_forward);
    // Every case has wide matrices, which auto does not leave to the
    // standard form on the CPU: the forms are not all the default.
    int64_t other_forms = 0;
    for (const plan::MatrixPlan& m : original->dense.matrices) {
      other_forms += m.ns_form != plan::NsAlgorithm::kStandard;
    }
    EXPECT_GT(other_forms, 0);
    const v1::ExecutionPlan exec = convert::PlanToExec(*original);
    absl::StatusOr<plan::Plan> back = convert::PlanFromExec(exec);
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSamePlan(*original, *back);
    // The fingerprint is a function of the plan: the same for the same plan,
    // different once anything changes.
    EXPECT_EQ(convert::PlanFingerprint(exec), convert::PlanFingerprint(convert::PlanToExec(*back)));
    v1::ExecutionPlan changed = exec;
    changed.mutable_dense()->mutable_matrices(0)->set_owner(
        (changed.dense().matrices(0).owner() + 1) % static_cast<int>(changed.dense().size()));
    EXPECT_NE(convert::PlanFingerprint(exec), convert::PlanFingerprint(changed));
  }
}

TEST(ExecPlanConvertTest, DamagedPlansAreRefusedNamingTheField) {
  absl::StatusOr<plan::ModelSpec> spec = testing::LoadSpec("gpt2-124m");
  ASSERT_TRUE(spec.ok());
  plan::PlanInput input;
  input.model = *spec;
  input.world_size = 4;
  absl::StatusOr<plan::Plan> p = plan::ComputePlan(input);
  ASSERT_TRUE(p.ok());
  const v1::ExecutionPlan good = convert::PlanToExec(*p);

  v1::ExecutionPlan bad = good;
  bad.mutable_units(1)->mutable_dense()->add_segment_offset(7);
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()),
              HasSubstr("units[1].dense: segment arrays differ"));
  bad = good;
  bad.mutable_units(0)->mutable_dense()->set_segment_tensor(0, 99);
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()),
              HasSubstr("units[0].dense.segment_tensor[0]"));
  bad = good;
  bad.mutable_units(0)->mutable_dense()->set_num_shards(1000);
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()), HasSubstr("shard_begin"));
  bad = good;
  bad.mutable_config()->set_owner_rule(static_cast<v1::ExecOwnerRule>(9));
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()), HasSubstr("config.owner_rule"));
  bad = good;
  bad.mutable_dense()->mutable_matrices(0)->set_replica(0);  // no split: -1 only
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()),
              HasSubstr("dense.matrices[0].replica"));
  bad = good;
  bad.mutable_config()->set_replica_split(7);
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()), HasSubstr("config.replica_split"));
  bad = good;
  bad.mutable_config()->set_threads_per_rank(-2);
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()),
              HasSubstr("config.threads_per_rank: must be in [0, 256], got -2"));
  bad = good;
  bad.mutable_config()->set_threads_per_rank(0);  // a plan from before the field: one thread
  ASSERT_TRUE(convert::PlanFromExec(bad).ok());
  EXPECT_EQ(convert::PlanFromExec(bad)->config.threads_per_rank, 1);
  bad = good;
  bad.mutable_config()->set_ns_steps(1 << 30);  // refused before the forms loop over them
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()),
              HasSubstr("config.ns_steps: must be in [1, 100], got 1073741824"));
  bad = good;
  bad.mutable_dense()->mutable_matrices(0)->add_holder_row_start(1);
  EXPECT_THAT(std::string(convert::PlanFromExec(bad).status().message()),
              HasSubstr("dense.matrices[0]: holder arrays"));
}

}  // namespace
}  // namespace muonmesh
