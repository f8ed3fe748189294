#include "tests/core/plan/shape_generator.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muonmesh::testing {
namespace {

using plan::ParamSpec;
using plan::UnitSpec;

// Uniform-ish draws by modulo: reproducible everywhere (the standard fixes
// mt19937_64's output, not its distributions').
class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(rng_() % static_cast<uint64_t>(hi - lo + 1));
  }
  template <typename T>
  T Pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(Int(0, static_cast<int64_t>(v.size()) - 1))];
  }
  bool Chance(int percent) { return Int(0, 99) < percent; }

 private:
  std::mt19937_64 rng_;
};

int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

ParamSpec Muon(const std::string& name, std::vector<int64_t> shape) {
  return {name, std::move(shape), "muon", false};
}
ParamSpec Adam(const std::string& name, std::vector<int64_t> shape) {
  return {name, std::move(shape), "adamw", false};
}
ParamSpec Experts(const std::string& name, std::vector<int64_t> shape) {
  return {name, std::move(shape), "muon", true};
}

struct Arch {
  int64_t hidden = 0;
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  bool fused_qkv = false;
  bool mla = false;
  int64_t q_lora = 0;
  int64_t kv_lora = 0;
  bool gated = true;
  int64_t ffn = 0;  // dense MLP
  int64_t experts = 0;
  int64_t expert_ffn = 0;
  int64_t shared = 0;
  int64_t leading_dense = 0;
  int64_t vocab = 0;
  bool biases = false;
};

void AddAttention(const Arch& a, const std::string& p, std::vector<ParamSpec>* out) {
  const int64_t h = a.hidden;
  out->push_back(Adam(p + ".attn_norm.weight", {h}));
  if (a.mla) {
    const int64_t rope = 64;
    out->push_back(Muon(p + ".attn.q_a_proj.weight", {a.q_lora, h}));
    out->push_back(Adam(p + ".attn.q_a_norm.weight", {a.q_lora}));
    out->push_back(Muon(p + ".attn.q_b_proj.weight", {a.heads * (a.head_dim + rope), a.q_lora}));
    out->push_back(Muon(p + ".attn.kv_a_proj.weight", {a.kv_lora + rope, h}));
    out->push_back(Adam(p + ".attn.kv_a_norm.weight", {a.kv_lora}));
    out->push_back(Muon(p + ".attn.kv_b_proj.weight", {a.heads * 2 * a.head_dim, a.kv_lora}));
  } else if (a.fused_qkv) {
    const int64_t rows = (a.heads + 2 * a.kv_heads) * a.head_dim;
    out->push_back(Muon(p + ".attn.qkv_proj.weight", {rows, h}));
    if (a.biases) out->push_back(Adam(p + ".attn.qkv_proj.bias", {rows}));
  } else {
    out->push_back(Muon(p + ".attn.q_proj.weight", {a.heads * a.head_dim, h}));
    out->push_back(Muon(p + ".attn.k_proj.weight", {a.kv_heads * a.head_dim, h}));
    out->push_back(Muon(p + ".attn.v_proj.weight", {a.kv_heads * a.head_dim, h}));
    if (a.biases) {
      out->push_back(Adam(p + ".attn.q_proj.bias", {a.heads * a.head_dim}));
      out->push_back(Adam(p + ".attn.k_proj.bias", {a.kv_heads * a.head_dim}));
      out->push_back(Adam(p + ".attn.v_proj.bias", {a.kv_heads * a.head_dim}));
    }
  }
  out->push_back(Muon(p + ".attn.o_proj.weight", {h, a.heads * a.head_dim}));
}

void AddMlp(const Arch& a, const std::string& p, int64_t ffn, std::vector<ParamSpec>* out) {
  const int64_t h = a.hidden;
  if (a.gated) {
    out->push_back(Muon(p + ".gate_proj.weight", {ffn, h}));
    out->push_back(Muon(p + ".up_proj.weight", {ffn, h}));
    out->push_back(Muon(p + ".down_proj.weight", {h, ffn}));
  } else {
    out->push_back(Muon(p + ".fc.weight", {ffn, h}));
    if (a.biases) out->push_back(Adam(p + ".fc.bias", {ffn}));
    out->push_back(Muon(p + ".proj.weight", {h, ffn}));
    if (a.biases) out->push_back(Adam(p + ".proj.bias", {h}));
  }
}

void AddMoe(const Arch& a, const std::string& p, std::vector<ParamSpec>* out) {
  const int64_t h = a.hidden;
  const int64_t e = a.experts;
  const int64_t f = a.expert_ffn;
  out->push_back(Adam(p + ".mlp.router.weight", {e, h}));
  if (a.gated) {
    out->push_back(Experts(p + ".mlp.experts.gate_proj", {e, f, h}));
    out->push_back(Experts(p + ".mlp.experts.up_proj", {e, f, h}));
    out->push_back(Experts(p + ".mlp.experts.down_proj", {e, h, f}));
  } else {
    out->push_back(Experts(p + ".mlp.experts.fc", {e, f, h}));
    out->push_back(Experts(p + ".mlp.experts.proj", {e, h, f}));
  }
  if (a.shared > 0) AddMlp(a, p + ".mlp.shared_experts", a.shared * f, out);
}

Arch DrawArch(Draw& d) {
  Arch a;
  // One shape in eight is wider or odder than the common ranges.
  const bool odd = d.Chance(12);
  a.hidden = odd ? d.Pick<int64_t>({2304, 3584, 5376, 12288, 1280, 6656})
                 : d.Pick<int64_t>({1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192});
  a.head_dim = odd ? d.Pick<int64_t>({64, 80, 96, 128}) : d.Pick<int64_t>({64, 128, 128});
  if (a.hidden % a.head_dim != 0) a.head_dim = 64;
  a.heads = a.hidden / a.head_dim;
  std::vector<int64_t> kv;
  for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}, int64_t{16}, a.heads}) {
    if (k <= a.heads && a.heads % k == 0) kv.push_back(k);
  }
  a.kv_heads = d.Pick(kv);
  a.layers = odd ? d.Int(4, 96) : d.Int(12, 80);
  a.fused_qkv = d.Chance(20);
  a.gated = d.Chance(85);
  a.biases = !a.gated && d.Chance(70);
  a.vocab = d.Pick<int64_t>({32000, 32768, 50257, 65536, 100352, 128256, 151936, 152064});
  a.ffn = a.gated ? RoundUp(a.hidden * 8 / 3 * d.Int(9, 14) / 10, 256) : 4 * a.hidden;
  if (d.Chance(45)) {
    a.experts = odd ? d.Pick<int64_t>({6, 12, 40, 96, 384})
                    : d.Pick<int64_t>({8, 16, 32, 60, 64, 128, 160, 256});
    a.expert_ffn = RoundUp(a.hidden * d.Int(1, 8) / 8, 64);
    a.shared = d.Int(0, 2);
    a.leading_dense = d.Pick<int64_t>({0, 0, 1, 3});
    a.leading_dense = std::min(a.leading_dense, a.layers - 1);
    a.mla = a.hidden >= 2048 && d.Chance(30);
    if (a.mla) {
      a.q_lora = d.Pick<int64_t>({768, 1024, 1536});
      a.kv_lora = 512;
    }
  }
  return a;
}

}  // namespace

GeneratedShape GenerateShape(uint64_t seed) {
  Draw d(seed * 0x9E3779B97F4A7C15ull + 12345);
  const Arch a = DrawArch(d);
  GeneratedShape out;
  out.experts = a.experts;
  out.preferred_ep = a.experts > 0 ? d.Pick<int64_t>({1, 2, 4, 8, 8, 16, 32, 64}) : 1;
  // Few experts a rank: keep the planner's input (matrices per domain) to a
  // plausible size, as EP does in practice for many experts.
  if (a.experts >= 128) out.preferred_ep = std::max<int64_t>(out.preferred_ep, 8);
  const int64_t mode = d.Int(0, 9);
  if (mode >= 7) {
    out.instances = 2;
    out.outer = mode == 9 ? "no_shard" : "optim";
  }
  plan::ModelSpec& m = out.model;
  m.name = absl::StrCat("gen-", seed);
  m.units.push_back({"embed", {Adam("embed.weight", {a.vocab, a.hidden})}, 0});
  for (int64_t l = 0; l < a.layers; ++l) {
    const std::string p = absl::StrCat("layers.", l);
    UnitSpec u{p, {}, 0};
    AddAttention(a, p, &u.params);
    u.params.push_back(Adam(p + ".mlp_norm.weight", {a.hidden}));
    if (a.experts > 0 && l >= a.leading_dense) {
      AddMoe(a, p, &u.params);
    } else {
      AddMlp(a, p + ".mlp", a.ffn, &u.params);
    }
    m.units.push_back(std::move(u));
  }
  m.units.push_back({"head",
                     {Adam("final_norm.weight", {a.hidden}),
                      Adam("lm_head.weight", {a.vocab, a.hidden})},
                     0});
  out.description = absl::StrCat(
      m.name, ": h", a.hidden, " L", a.layers, " heads ", a.heads, "/", a.kv_heads, "x",
      a.head_dim, a.mla ? " mla" : (a.fused_qkv ? " qkv" : ""), a.gated ? " gated" : " gelu",
      " ffn ", a.ffn);
  if (a.experts > 0) {
    absl::StrAppend(&out.description, " E", a.experts, "x", a.expert_ffn, " shared ", a.shared,
                    " lead ", a.leading_dense, " ep<=", out.preferred_ep);
  }
  if (out.instances > 1) absl::StrAppend(&out.description, " I2 outer ", out.outer);
  return out;
}

int64_t EpFor(const GeneratedShape& shape, int64_t world) {
  if (shape.experts == 0) return 1;
  int64_t ep = 1;
  while (ep * 2 <= shape.preferred_ep && shape.experts % (ep * 2) == 0 && world % (ep * 2) == 0) {
    ep *= 2;
  }
  return ep;
}

plan::PlanInput InputFor(const GeneratedShape& shape, int64_t world) {
  plan::PlanInput in;
  in.model = shape.model;
  in.world_size = world;
  in.parallelism.expert_model_parallel_size = EpFor(shape, world);
  in.parallelism.num_distributed_optimizer_instances = shape.instances;
  in.parallelism.outer_dp_sharding_strategy = shape.outer;
  in.options.owner_assignment = "lpt";
  in.options.device = "cuda";
  return in;
}

}  // namespace muonmesh::testing
