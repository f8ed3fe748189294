#!/usr/bin/python3
"""The transformer's training step against PyTorch's CPU build on the same model, data and threads.

Runs, in one invocation so that both see the same machine load:
  1. muonmesh-worker --standalone, one rank, a transformer job (--model dense: the Llama-style
     model of deploy/local/examples/transformer-text.yaml; --model moe: the DeepSeek-style one of
     deepseek-proxy.yaml, MLA and 8 routed experts with a shared one), and takes the median of
     its step records' step_seconds;
  2. the same model in PyTorch eager mode (Debian's python3-torch), written here from the
     definition in docs/architecture.md §6 (RMSNorm, rotate-half RoPE, GQA or MLA, SwiGLU, top-2
     sigmoid routing with the balancing bias and its update, a shared expert), the same shapes,
     windows of the same text and the same optimizer split (torch.optim.AdamW on embed, head,
     norms and routers; Muon written out as torch.optim.Muon defines it on every other matrix,
     each expert's alone), timing forward, backward and both optimizers per step.
Both on THREADS threads (OpenBLAS's and torch's). Prints each round and the median ratio.

  tests/worker/model/transformer_vs_torch.py [--model dense|moe] [--threads 1] [--steps 30]
      [--worker build/worker/muonmesh-worker] [--batch 8] [--rounds 5]

The two run in turn, --rounds times, each round one muonmesh run and one PyTorch run; the
figure is the median of the rounds' ratios (the machine is shared, and alternating lets both
sides sample the same load).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

CORPUS = "/usr/share/games/fortunes/*.u8"
T, V, C, L, H = 128, 256, 128, 4, 4
DENSE = {"n_kv_head": 2, "ffn_hidden": 344}
MLA = {"q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
       "v_head_dim": 32}
MOE = {"n_routed_experts": 8, "top_k": 2, "moe_ffn_hidden": 96, "n_shared_experts": 1,
       "first_k_dense": 1, "route_scale": 2.5, "bias_update_rate": 0.01}


def model_yaml(kind):
    if kind == "dense":
        return (f"{{vocab_size: {V}, seq_len: {T}, n_layer: {L}, d_model: {C}, n_head: {H}, "
                f"n_kv_head: 2, ffn_hidden: 344}}")
    mla = ", ".join(f"{k}: {v}" for k, v in MLA.items())
    moe = ", ".join(f"{k}: {v}" for k, v in MOE.items())
    return (f"{{vocab_size: {V}, seq_len: {T}, n_layer: {L}, d_model: {C}, n_head: {H}, "
            f"ffn_hidden: 344, attention: mla, mla: {{{mla}}}, "
            f"moe: {{{moe}, score: sigmoid}}}}")


def muonmesh_step(args, out):
    job = os.path.join(out, "job.yaml")
    with open(job, "w") as f:
        f.write(f"""name: vs-torch
world_size: 1
model:
  transformer: {model_yaml(args.model)}
data: {{text: {{train: "{CORPUS}", val_fraction: 0}}}}
optimizer:
  muon: {{lr: 0.02, momentum: 0.95, nesterov: true, ns_steps: 5, health_every: 0}}
  adamw: {{lr: 0.003, beta1: 0.9, beta2: 0.95}}
training: {{steps: {args.steps}, global_batch_size: {args.batch}, threads_per_rank: {args.threads}}}
output: {{dir: {out}/run}}
""")
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads))
    done = subprocess.run([args.worker, "--standalone", "--job", job, "--rank", "0",
                           "--world-size", "1", "--store", os.path.join(out, "store"),
                           "--create-store"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"muonmesh-worker failed:\n{done.stderr}")
    with open(os.path.join(out, "run", "metrics", "rank-0.jsonl")) as f:
        seconds = [json.loads(line)["step_seconds"] for line in f]
    return statistics.median(seconds[2:])  # the first steps allocate


def torch_model(kind):
    import torch
    import torch.nn.functional as F
    nn = torch.nn

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def rope(x, r):  # rotate-half over the last r dims' positions, x [b, heads, t, r]
        i = torch.arange(r // 2, dtype=torch.float64)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * i / r)
        cos, sin = ang.cos().float(), ang.sin().float()
        a, b = x[..., :r // 2], x[..., r // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def lin(i, o):
        return nn.Linear(i, o, bias=False)

    class SwiGlu(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = lin(C, f), lin(C, f), lin(f, C)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            e, fe = MOE["n_routed_experts"], MOE["moe_ffn_hidden"]
            self.router = lin(C, e)
            self.gate = nn.Parameter(torch.randn(e, fe, C) * 0.02)
            self.up = nn.Parameter(torch.randn(e, fe, C) * 0.02)
            self.down = nn.Parameter(torch.randn(e, C, fe) * 0.02)
            self.shared = SwiGlu(MOE["n_shared_experts"] * fe)
            self.register_buffer("bias", torch.zeros(e))
            self.counts = torch.zeros(e)

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, C)
            p = torch.sigmoid(self.router(x))
            chosen = torch.topk(p + self.bias, MOE["top_k"], dim=-1).indices
            g = p.gather(1, chosen)
            g = MOE["route_scale"] * g / g.sum(-1, keepdim=True)
            out = self.shared(x)
            self.counts = torch.bincount(chosen.flatten(), minlength=self.bias.numel()).float()
            for e in range(self.bias.numel()):
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                h = x[rows]
                y = (F.silu(h @ self.gate[e].T) * (h @ self.up[e].T)) @ self.down[e].T
                out = out.index_add(0, rows, y * g[rows, slot, None])
            return out.reshape(shape)

        def update_bias(self):
            with torch.no_grad():
                self.bias += MOE["bias_update_rate"] * torch.sign(self.counts.mean() - self.counts)

    class Gqa(nn.Module):
        def __init__(self):
            super().__init__()
            d = C // H
            self.q_proj, self.k_proj = lin(C, H * d), lin(C, DENSE["n_kv_head"] * d)
            self.v_proj, self.o_proj = lin(C, DENSE["n_kv_head"] * d), lin(H * d, C)

        def forward(self, x):
            b, d, kv = x.shape[0], C // H, DENSE["n_kv_head"]
            q = rope(self.q_proj(x).view(b, T, H, d).transpose(1, 2), d)
            k = rope(self.k_proj(x).view(b, T, kv, d).transpose(1, 2), d)
            v = self.v_proj(x).view(b, T, kv, d).transpose(1, 2)
            k, v = (z.repeat_interleave(H // kv, dim=1) for z in (k, v))
            return self.o_proj(attend(q, k, v, d).transpose(1, 2).reshape(b, T, H * d))

    class Mla(nn.Module):
        def __init__(self):
            super().__init__()
            rq, rkv = MLA["q_lora_rank"], MLA["kv_lora_rank"]
            dn, dr, dv = MLA["qk_nope_head_dim"], MLA["qk_rope_head_dim"], MLA["v_head_dim"]
            self.q_a_proj, self.q_b_proj = lin(C, rq), lin(rq, H * (dn + dr))
            self.q_a_norm, self.kv_a_norm = nn.Parameter(torch.ones(rq)), nn.Parameter(torch.ones(rkv))
            self.kv_a_proj, self.kv_b_proj = lin(C, rkv + dr), lin(rkv, H * (dn + dv))
            self.o_proj = lin(H * dv, C)

        def forward(self, x):
            b = x.shape[0]
            rkv = MLA["kv_lora_rank"]
            dn, dr, dv = MLA["qk_nope_head_dim"], MLA["qk_rope_head_dim"], MLA["v_head_dim"]
            q = self.q_b_proj(rms(self.q_a_proj(x), self.q_a_norm)).view(b, T, H, dn + dr)
            q = q.transpose(1, 2)
            q = torch.cat([q[..., :dn], rope(q[..., dn:], dr)], -1)
            kva = self.kv_a_proj(x)
            pe = rope(kva[..., rkv:].unsqueeze(1), dr).expand(b, H, T, dr)
            kvb = self.kv_b_proj(rms(kva[..., :rkv], self.kv_a_norm)).view(b, T, H, dn + dv)
            kvb = kvb.transpose(1, 2)
            k = torch.cat([kvb[..., :dn], pe], -1)
            y = attend(q, k, kvb[..., dn:], dn + dr)
            return self.o_proj(y.transpose(1, 2).reshape(b, T, H * dv))

    def attend(q, k, v, d):
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        att = att.masked_fill(torch.ones(T, T).tril() == 0, float("-inf")).softmax(-1)
        return att @ v

    class Layer(nn.Module):
        def __init__(self, l):
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(C))
            self.attn = Gqa() if kind == "dense" else Mla()
            moe = kind == "moe" and l >= MOE["first_k_dense"]
            self.mlp = Moe() if moe else SwiGlu(DENSE["ffn_hidden"])

        def forward(self, x):
            x = x + self.attn(rms(x, self.attn_norm))
            return x + self.mlp(rms(x, self.mlp_norm))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, C)
            self.layers = nn.ModuleList(Layer(l) for l in range(L))
            self.final_norm, self.lm_head = nn.Parameter(torch.ones(C)), lin(C, V)

        def forward(self, idx):
            x = self.embed(idx)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(rms(x, self.final_norm))

    return Transformer()


def torch_step(args):
    import glob
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    text = b"".join(open(p, "rb").read() for p in sorted(glob.glob(CORPUS)))
    data = torch.tensor(list(text[:200000]), dtype=torch.long)
    model = torch_model(args.model)
    named = list(model.named_parameters())
    is_muon = [n.startswith("layers.") and p.dim() >= 2 and "router" not in n for n, p in named]
    matrices = [p for (n, p), m in zip(named, is_muon) if m]
    others = [p for (n, p), m in zip(named, is_muon) if not m]
    adamw = torch.optim.AdamW(others, lr=0.003, betas=(0.9, 0.95), weight_decay=0)
    momenta = [torch.zeros_like(p) for p in matrices]
    moes = [m for m in model.modules() if hasattr(m, "update_bias")]

    def orthogonalize(u):
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / max(x.norm(), 1e-7)
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        return (x.T if u.shape[0] > u.shape[1] else x) * max(1, u.shape[0] / u.shape[1]) ** 0.5

    def muon():
        with torch.no_grad():
            for p, m in zip(matrices, momenta):
                m.lerp_(p.grad, 0.05)
                u = p.grad.lerp(m, 0.95)
                for w, g in (zip(p, u) if p.dim() == 3 else [(p, u)]):  # each expert alone
                    w.add_(orthogonalize(g), alpha=-0.02)

    seconds = []
    for s in range(args.steps):
        starts = [((s * args.batch + i) * T) % (len(data) - T) for i in range(args.batch)]
        x = torch.stack([data[p:p + T] for p in starts])
        y = torch.stack([data[p + 1:p + T + 1] for p in starts])
        begin = time.perf_counter()
        loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
        model.zero_grad(set_to_none=True)
        loss.backward()
        adamw.step()
        muon()
        for m in moes:
            m.update_bias()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds[2:]), torch.__version__


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="build/worker/muonmesh-worker")
    parser.add_argument("--model", choices=("dense", "moe"), default="dense")
    for flag, default in (("threads", 1), ("steps", 30), ("batch", 8), ("rounds", 5)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args()
    args.worker = os.path.abspath(args.worker)
    ratios, ours_all, theirs_all = [], [], []
    for r in range(args.rounds):  # alternating, so both sides sample the same load
        with tempfile.TemporaryDirectory() as out:
            ours = muonmesh_step(args, out)
        theirs, version = torch_step(args)
        ratios.append(ours / theirs)
        ours_all.append(ours)
        theirs_all.append(theirs)
        print(f"round {r}: muonmesh {1e3 * ours:.1f} ms, PyTorch {1e3 * theirs:.1f} ms, "
              f"ratio {ours / theirs:.2f}", flush=True)
    print(f"transformer ({args.model}) L={L} C={C} T={T} V={V} batch {args.batch}, "
          f"{args.threads} thread(s), {args.rounds} rounds: muonmesh "
          f"{1e3 * statistics.median(ours_all):.1f} ms a step, PyTorch {version} eager "
          f"{1e3 * statistics.median(theirs_all):.1f} ms (medians): muonmesh/PyTorch time, "
          f"median of the rounds' ratios {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
