// Planner benchmark: plan quality on the real specs (padding against
// Megatron's LCM rule, makespan against the lower bound for our owner rule
// beside #6425's in-order greedy and round-robin, and the joint makespan of
// the runtime's one Muon schedule against the joint lower bound), the joint
// ratio over generated model shapes (tests/core/plan/shape_generator.h) at 8, 64
// and 512 ranks with their plan times, then plan time and memory.
//
//   build/tests/core/plan/planner_benchmark [--shapes=N] [--list_shapes] [--shapes_only]
//                                      [--worlds=8,64,512]
//                                      [--benchmark_filter=...]
//   build/tests/core/plan/planner_benchmark --replica_split_only   (the HSDP split table alone)
//   build/tests/core/plan/planner_benchmark --explain=SEED,WORLD   (one generated plan in detail)
//   build/tests/core/plan/planner_benchmark --waves_only   (owners balanced per wave, public specs)
//
// The quality tables are exact (no timing); the shape sweep times each plan
// once; the benchmarks time ComputePlan.

#include <sys/resource.h>

#include <cmath>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "benchmark/benchmark.h"
#include "core/plan/planner.h"
#include "core/plan/waves.h"
#include "tests/core/plan/shape_generator.h"
#include "tests/core/plan/spec_loader.h"

namespace muonmesh {
namespace {

const plan::ModelSpec& Spec(const std::string& name) {
  static auto* cache = new std::map<std::string, plan::ModelSpec>();
  auto it = cache->find(name);
  if (it == cache->end()) {
    absl::StatusOr<plan::ModelSpec> spec = testing::LoadSpec(name);
    if (!spec.ok()) {
      std::fprintf(stderr, "cannot load %s: %s\n", name.c_str(),
                   std::string(spec.status().message()).c_str());
      std::exit(2);
    }
    it = cache->emplace(name, *std::move(spec)).first;
  }
  return it->second;
}

plan::PlanInput Input(const std::string& model, int64_t world, int64_t ep, int64_t instances,
                      const std::string& rule, const std::string& device = "cuda") {
  plan::PlanInput in;
  in.options.device = device;
  in.model = Spec(model);
  in.world_size = world;
  in.parallelism.expert_model_parallel_size = ep;
  in.parallelism.num_distributed_optimizer_instances = instances;
  in.options.owner_assignment = rule;
  return in;
}

double WorstRatio(const plan::Plan& p) {
  double r = 1;
  for (const plan::DomainPlan* d : {&p.dense, &p.expert}) {
    if (d->lower_bound > 0) r = std::max(r, d->makespan / d->lower_bound);
  }
  return r;
}

double JointRatio(const plan::Plan& p) {
  return p.joint_lower_bound > 0 ? p.joint_makespan / p.joint_lower_bound : 1.0;
}
double StrongRatio(const plan::Plan& p) {
  return p.joint_strong_lower_bound > 0 ? p.joint_makespan / p.joint_strong_lower_bound : 1.0;
}

// The q-quantile of `v` (nearest rank: the smallest value with at least
// q of the values at or below it).
double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::min(v.size(), std::max<size_t>(k, 1)) - 1];
}

// The joint ratio of lpt plans over `shapes` generated shapes (seeds 0..N-1)
// at 8, 64 and 512 ranks, each plan timed once.
void PrintGeneratedShapes(int shapes, bool list, const std::vector<int64_t>& worlds) {
  std::printf("Generated shapes: %d seeds (tests/core/plan/shape_generator.h), lpt, cuda cost model\n",
              shapes);
  std::printf("%6s | %6s %8s %8s %8s %6s %6s | %8s %8s %6s %6s | %9s %9s\n", "ranks", "plans",
              "worst", "p95", "median", ">1.05", ">1.10", "p95 s.", "worst s.", ">1.05s", ">1.10s",
              "plan p50", "plan max");
  for (const int64_t world : worlds) {
    std::vector<double> ratios;
    std::vector<double> strong;
    std::vector<double> seconds;
    std::string worst_shape;
    double worst = 0;
    int over5 = 0, over10 = 0, strong_over5 = 0, strong_over10 = 0, failed = 0;
    for (int seed = 0; seed < shapes; ++seed) {
      const testing::GeneratedShape shape = testing::GenerateShape(seed);
      const plan::PlanInput in = testing::InputFor(shape, world);
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<plan::Plan> p = plan::ComputePlan(in);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (!p.ok()) {
        ++failed;
        std::printf("  %s at %lld: %s\n", shape.description.c_str(),
                    static_cast<long long>(world), std::string(p.status().message()).c_str());
        continue;
      }
      const double r = JointRatio(*p);
      const double s = StrongRatio(*p);
      ratios.push_back(r);
      strong.push_back(s);
      seconds.push_back(took.count());
      over5 += r > 1.05;
      over10 += r > 1.10;
      strong_over5 += s > 1.05;
      strong_over10 += s > 1.10;
      if (r > worst) {
        worst = r;
        worst_shape = shape.description;
      }
      if (list) {
        std::printf("  %4lld ep%-3lld %.4f %.4f (domains %.4f) %7.1f ms  %s\n",
                    static_cast<long long>(world),
                    static_cast<long long>(in.parallelism.expert_model_parallel_size), r, s,
                    WorstRatio(*p), 1e3 * took.count(), shape.description.c_str());
      }
    }
    std::printf("%6lld | %6zu %8.4f %8.4f %8.4f %6d %6d | %8.4f %8.4f %6d %6d | %7.1fms %7.1fms\n",
                static_cast<long long>(world), ratios.size(), worst, Quantile(ratios, 0.95),
                Quantile(ratios, 0.5), over5, over10, Quantile(strong, 0.95),
                strong.empty() ? 0.0 : *std::max_element(strong.begin(), strong.end()),
                strong_over5, strong_over10,
                1e3 * Quantile(seconds, 0.5),
                seconds.empty() ? 0.0 : 1e3 * *std::max_element(seconds.begin(), seconds.end()));
    std::printf("         worst: %s%s\n", worst_shape.c_str(),
                failed > 0 ? " (some plans failed, above)" : "");
  }
  std::printf(
      "(joint makespan / joint lower bound; s.: joint makespan / the stronger certified\n"
      " bound, computed where the ratio exceeds 1.05: its p95, worst, and shapes above 1.05\n"
      " and 1.10, where no certificate shows that the plan is within that of the optimum)\n\n");
}

// One generated plan in detail: per position of each domain, its load over
// the domain's lower bound and what it owns (matrix shape, owner cost over
// its best-holder cost), to see where a plan loses against its bound.
void Explain(int seed, int64_t world) {
  const testing::GeneratedShape shape = testing::GenerateShape(seed);
  const plan::PlanInput in = testing::InputFor(shape, world);
  absl::StatusOr<plan::Plan> p = plan::ComputePlan(in);
  if (!p.ok()) {
    std::printf("%s\n", std::string(p.status().message()).c_str());
    return;
  }
  std::printf("%s at %lld ranks, EP %lld: joint %.4f strong %.4f (bound %.4g)\n",
              shape.description.c_str(), static_cast<long long>(world),
              static_cast<long long>(in.parallelism.expert_model_parallel_size), JointRatio(*p),
              StrongRatio(*p), p->joint_lower_bound);
  // Each expert position's group: its expert load, and the largest and
  // mean dense load of its ranks (the joint load of the group is the sum of
  // the first two).
  if (!p->expert.matrices.empty() && p->dense.replicas == 1) {
    std::vector<double> dense_of(static_cast<size_t>(world), 0.0);
    std::vector<std::vector<int32_t>> group(p->expert.load.size());
    for (const plan::Domain& dom : p->domains) {
      for (size_t q = 0; q < dom.ranks.size(); ++q) {
        if (dom.mesh == plan::MeshKind::kDense) {
          dense_of[static_cast<size_t>(dom.ranks[q])] = p->dense.load[q];
        } else {
          group[q].push_back(dom.ranks[q]);
        }
      }
    }
    std::printf("groups (expert position: expert load, max / mean dense of its ranks, ranks):\n");
    for (size_t q = 0; q < group.size(); ++q) {
      double top = 0, mean = 0;
      for (int32_t r : group[q]) {
        top = std::max(top, dense_of[static_cast<size_t>(r)]);
        mean += dense_of[static_cast<size_t>(r)] / static_cast<double>(group[q].size());
      }
      const double b = p->joint_lower_bound;
      std::printf("  %4zu %.4f + %.4f = %.4f (mean %.4f):", q, p->expert.load[q] / b, top / b,
                  (p->expert.load[q] + top) / b, mean / b);
      for (int32_t r : group[q]) std::printf(" %d", r);
      std::printf("\n");
    }
  }
  for (const plan::DomainPlan* d : {&p->dense, &p->expert}) {
    if (d->matrices.empty()) continue;
    std::printf("%s domain: %zu matrices, %lld positions, makespan / joint bound %.4f\n",
                d->mesh == plan::MeshKind::kDense ? "dense" : "expert", d->matrices.size(),
                static_cast<long long>(d->load.size()), d->makespan / p->joint_lower_bound);
    std::vector<std::vector<int32_t>> owned(d->load.size());
    for (size_t j = 0; j < d->matrices.size(); ++j) {
      const plan::MatrixPlan& m = d->matrices[j];
      if (m.owner >= 0) owned[static_cast<size_t>(m.owner)].push_back(static_cast<int32_t>(j));
    }
    for (size_t q = 0; q < d->load.size(); ++q) {
      std::printf("  %4zu %.4f:", q, d->load[q] / p->joint_lower_bound);
      for (int32_t j : owned[q]) {
        const plan::MatrixPlan& m = d->matrices[static_cast<size_t>(j)];
        std::printf(" %lldx%lld %.3f/%.2f", static_cast<long long>(m.rows),
                    static_cast<long long>(m.cols), m.owner_cost / p->joint_lower_bound,
                    m.owner_cost / m.min_cost);
      }
      std::printf("\n");
    }
  }
}

struct Case {
  std::string model;
  int64_t world;
  int64_t ep;
};

const std::vector<Case>& Cases() {
  static const auto* cases = new std::vector<Case>{
      {"gpt2-124m", 8, 1},   {"gpt2-124m", 64, 1},   {"gpt2-124m", 512, 1},
      {"llama3-8b", 8, 1},   {"llama3-8b", 64, 1},   {"llama3-8b", 512, 1},
      {"deepseek-v3", 8, 8}, {"deepseek-v3", 64, 64}, {"deepseek-v3", 512, 64},
  };
  return *cases;
}

void PrintQualityTable(int64_t instances, const std::string& device) {
  std::printf("Plan quality: inner optim_grads_params, I=%lld%s, %s cost model, T=5\n",
              static_cast<long long>(instances), instances > 1 ? " (HFSDP)" : " (ZeRO-3)",
              device.c_str());
  std::printf("%-12s %6s %4s | %9s %9s %7s | %8s %8s %8s | %8s %8s\n", "model", "ranks", "ep",
              "pad ours%", "pad lcm%", "ours/lcm", "lpt", "greedy", "rrobin", "joint",
              "strong");
  for (const Case& c : Cases()) {
    std::map<std::string, double> ratio;
    plan::Plan lpt;
    for (const std::string rule : {"lpt", "greedy_in_order", "round_robin"}) {
      absl::StatusOr<plan::Plan> p =
          plan::ComputePlan(Input(c.model, c.world, c.ep, instances, rule, device));
      if (!p.ok()) {
        std::printf("%s at %lld: %s\n", c.model.c_str(), static_cast<long long>(c.world),
                    std::string(p.status().message()).c_str());
        return;
      }
      ratio[rule] = WorstRatio(*p);
      if (rule == "lpt") lpt = *std::move(p);
    }
    absl::StatusOr<int64_t> lcm_or =
        plan::MegatronPaddingElements(Input(c.model, c.world, c.ep, instances, "lpt", device));
    if (!lcm_or.ok()) {
      std::printf("%-12s %6lld: LCM padding: %s\n", c.model.c_str(), static_cast<long long>(c.world),
                  std::string(lcm_or.status().message()).c_str());
      return;
    }
    const int64_t lcm = *lcm_or;
    const double params = static_cast<double>(lpt.parameters);
    std::printf("%-12s %6lld %4lld | %9.4f %9.4f %7.3f | %8.4f %8.4f %8.4f | %8.4f %8.4f\n",
                c.model.c_str(), static_cast<long long>(c.world), static_cast<long long>(c.ep),
                100.0 * lpt.padding_elements / params, 100.0 * lcm / params,
                lcm > 0 ? static_cast<double>(lpt.padding_elements) / lcm : 0.0, ratio["lpt"],
                ratio["greedy_in_order"], ratio["round_robin"], JointRatio(lpt),
                StrongRatio(lpt));
  }
  std::printf(
      "(lpt/greedy/rrobin: makespan / lower bound of the worst domain; joint: lpt's joint\n"
      " makespan, max over ranks of the load summed over its domains, / the joint lower bound;\n"
      " strong: the same over the stronger certified bound; pad = padding / parameters)\n\n");
}

// Every power of two from 8 to 4096 ranks (ZeRO-3, lpt): where the targets
// hold and where they do not.
void PrintSweep(const std::string& device) {
  std::printf("Sweep: makespan / lower bound (dense, expert) and pad%%, lpt, %s cost model\n",
              device.c_str());
  for (const std::string model : {"gpt2-124m", "llama3-8b", "deepseek-v3"}) {
    std::printf("%-12s", model.c_str());
    for (int64_t w = 8; w <= 4096; w *= 2) {
      const int64_t ep = model == "deepseek-v3" ? std::min<int64_t>(w, 64) : 1;
      absl::StatusOr<plan::Plan> p = plan::ComputePlan(Input(model, w, ep, 1, "lpt", device));
      if (!p.ok()) continue;
      const double expert = p->expert.lower_bound > 0 ? p->expert.makespan / p->expert.lower_bound : 0;
      std::printf(" %lld:%.3f", static_cast<long long>(w), p->dense.makespan / p->dense.lower_bound);
      if (expert > 0) std::printf("/%.3f", expert);
      std::printf("/%.2f%%", 100.0 * p->padding_elements / p->parameters);
    }
    std::printf("\n");
  }
  std::printf("\n");
}

// The HSDP replica split (outer no_shard, I replicas of ZeRO-3 domains):
// the joint makespan planned without and with it, what auto picks, the
// split plan's busiest rank's exchange over dp_outer and the joint ratio of
// the plan that runs.
void PrintReplicaSplitTable(const std::string& device) {
  std::printf("HSDP replica split: inner optim_grads_params, outer no_shard, lpt, %s cost model\n",
              device.c_str());
  std::printf("%-12s %6s %4s %3s | %12s %12s %7s | %5s | %9s | %8s %8s\n", "model", "ranks", "ep",
              "I", "unsplit", "split", "ratio", "auto", "xchg MiB", "joint", "time s");
  const struct {
    const char* model;
    int64_t world, ep, instances;
  } cases[] = {{"gpt2-124m", 64, 1, 2},    {"gpt2-124m", 64, 1, 8},  {"llama3-8b", 64, 1, 2},
               {"llama3-8b", 64, 1, 8},    {"llama3-8b", 512, 1, 8}, {"deepseek-v3", 64, 8, 2},
               {"deepseek-v3", 512, 64, 8}};
  for (const auto& c : cases) {
    plan::PlanInput in = Input(c.model, c.world, c.ep, c.instances, "lpt", device);
    in.parallelism.outer_dp_sharding_strategy = "no_shard";
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<plan::Plan> p = plan::ComputePlan(in);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!p.ok()) {
      std::printf("%s at %lld: %s\n", c.model, static_cast<long long>(c.world),
                  std::string(p.status().message()).c_str());
      continue;
    }
    int64_t exchange = 0;
    for (const plan::RankSummary& r : p->ranks) {
      exchange = std::max(exchange, r.replica_exchange_bytes);
    }
    std::printf("%-12s %6lld %4lld %3lld | %12.4g %12.4g %7.3f | %5s | %9.1f | %8.4f %8.2f\n",
                c.model, static_cast<long long>(c.world), static_cast<long long>(c.ep),
                static_cast<long long>(c.instances), p->joint_makespan_unsplit,
                p->joint_makespan_split, p->joint_makespan_split / p->joint_makespan_unsplit,
                p->dense.replicas > 1 ? "split" : "off", static_cast<double>(exchange) / (1 << 20),
                JointRatio(*p), seconds);
  }
  std::printf(
      "(unsplit / split: joint makespan, the busiest rank's Newton-Schulz FLOPs plus\n"
      " comm_flops_per_byte x its bytes, each plan made; ratio: split / unsplit; auto: what\n"
      " muon_replica_split auto runs; xchg: the split plan's busiest rank's dp_outer bytes,\n"
      " sent + received, per step; joint: makespan / joint lower bound of the plan that runs;\n"
      " time: both plans)\n\n");
}

// Owners balanced wave by wave (PlanOptions::muon_wave_budget_bytes): on the
// public specs with the budget that keeps the Muon phase within the backward
// pass's peak (BackwardPeakMuonBufferBytes, as the workers suggest it), the
// executed critical path (the sum over waves of the busiest rank's
// Newton-Schulz FLOPs) of the whole model's owners cut into those waves and
// of the owners balanced per wave, the one-wave path, and both plan times.
// With `instances` > 1: HSDP (outer no_shard) with the replica split on,
// each wave's dense matrices split between the replicas anew.
void PrintWaveTable(int64_t instances) {
  std::printf("Waves at the backward-peak budget: lpt, cuda cost model, %s\n",
              instances > 1 ? "HSDP I = 2 (outer no_shard), replica split on" : "ZeRO-3");
  std::printf("%-12s %6s %4s | %6s | %12s %12s %7s | %12s | %8s %8s\n", "model", "ranks", "ep",
              "waves", "whole", "per wave", "ratio", "one wave", "t whole", "t waves");
  for (const Case& c : Cases()) {
    if (c.world % (2 * instances) != 0) continue;
    plan::PlanInput in = Input(c.model, c.world, c.ep, instances, "lpt");
    if (instances > 1) {
      in.parallelism.outer_dp_sharding_strategy = "no_shard";
      in.options.muon_replica_split = "on";
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<plan::Plan> whole = plan::ComputePlan(in);
    const auto t1 = std::chrono::steady_clock::now();
    if (!whole.ok()) continue;
    in.options.muon_wave_budget_bytes = plan::BackwardPeakMuonBufferBytes(*whole);
    absl::StatusOr<plan::Plan> waved = plan::ComputePlan(in);
    const auto t2 = std::chrono::steady_clock::now();
    if (!waved.ok()) continue;
    const auto critical = plan::WaveCriticalPathNsFlops;
    const int64_t budget = in.options.muon_wave_budget_bytes;
    const std::vector<plan::MuonWave> cut = plan::PlanMuonWaves(*waved, budget);
    const double before = critical(*whole, plan::PlanMuonWaves(*whole, budget));
    const double after = critical(*waved, cut);
    const double one = critical(*whole, plan::PlanMuonWaves(*whole, 0));
    std::printf("%-12s %6lld %4lld | %6zu | %12.4g %12.4g %7.3f | %12.4g | %6.0fms %6.0fms\n",
                c.model.c_str(), static_cast<long long>(c.world), static_cast<long long>(c.ep),
                cut.size(), before, after, after / before, one,
                std::chrono::duration<double, std::milli>(t1 - t0).count(),
                std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  std::printf(
      "(whole / per wave: the executed critical path in Newton-Schulz FLOPs, the sum over waves\n"
      " of the busiest rank, with the whole model's owners and with owners balanced per wave;\n"
      " one wave: the same with no budget; t: plan time without and with the budget)\n\n");
}

long MaxRssMiB() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

void BM_Plan(benchmark::State& state, std::string model, int64_t world, int64_t ep,
             int64_t instances) {
  const plan::PlanInput in = Input(model, world, ep, instances, "lpt");
  for (auto _ : state) {
    absl::StatusOr<plan::Plan> p = plan::ComputePlan(in);
    if (!p.ok()) {
      state.SkipWithError(std::string(p.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(p->dense.makespan);
  }
  state.counters["max_rss_MiB"] = static_cast<double>(MaxRssMiB());
}

void Register() {
  for (const Case& c : Cases()) {
    benchmark::RegisterBenchmark(
        absl::StrFormat("BM_Plan/%s/%d", c.model, c.world).c_str(),
        [c](benchmark::State& s) { BM_Plan(s, c.model, c.world, c.ep, 1); })
        ->Unit(benchmark::kMillisecond);
  }
  // The scale target: DeepSeek-V3 on 16384 ranks, HFSDP with I = 2, EP = 64.
  benchmark::RegisterBenchmark("BM_Plan/deepseek-v3/16384/I2/EP64",
                               [](benchmark::State& s) { BM_Plan(s, "deepseek-v3", 16384, 64, 2); })
      ->Unit(benchmark::kMillisecond);
}

}  // namespace
}  // namespace muonmesh

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  int shapes = 60;
  bool list = false;
  bool shapes_only = false;
  std::vector<int64_t> worlds = {8, 64, 512};
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--shapes=", 9) == 0) shapes = std::atoi(argv[i] + 9);
    if (std::strcmp(argv[i], "--list_shapes") == 0) list = true;
    if (std::strcmp(argv[i], "--shapes_only") == 0) shapes_only = true;
    if (std::strncmp(argv[i], "--worlds=", 9) == 0) {
      worlds.clear();
      for (const char* c = argv[i] + 9; *c != '\0';) {
        char* end = nullptr;
        const long long v = std::strtoll(c, &end, 10);
        if (end == c || v < 1) {
          std::fprintf(stderr, "--worlds=N[,N...] (e.g. --worlds=64,512)\n");
          return 2;
        }
        worlds.push_back(v);
        c = *end == ',' ? end + 1 : end;
      }
    }
    if (std::strncmp(argv[i], "--explain=", 10) == 0) {
      int seed = 0;
      long long world = 0;
      if (std::sscanf(argv[i] + 10, "%d,%lld", &seed, &world) != 2 || world < 1) {
        std::fprintf(stderr, "--explain=SEED,WORLD (e.g. --explain=17,64)\n");
        return 2;
      }
      muonmesh::Explain(seed, world);
      return 0;
    }
    if (std::strcmp(argv[i], "--waves_only") == 0) {
      muonmesh::PrintWaveTable(1);
      muonmesh::PrintWaveTable(2);
      return 0;
    }
    if (std::strcmp(argv[i], "--replica_split_only") == 0) {
      muonmesh::PrintReplicaSplitTable("cuda");
      muonmesh::PrintReplicaSplitTable("cpu");
      return 0;
    }
  }
  muonmesh::PrintGeneratedShapes(shapes, list, worlds);
  if (shapes_only) return 0;
  muonmesh::PrintQualityTable(1, "cuda");
  muonmesh::PrintQualityTable(2, "cuda");
  muonmesh::PrintQualityTable(1, "cpu");
  muonmesh::PrintReplicaSplitTable("cuda");
  muonmesh::PrintSweep("cuda");
  muonmesh::Register();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
