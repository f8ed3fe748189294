#!/usr/bin/python3
"""The gpt's training step against PyTorch's CPU build on the same model, data and threads.

Runs, in one invocation so that both see the same machine load:
  1. muonmesh-worker --standalone, one rank, the job below (Muon on the four matrices of each
     block, AdamW on the rest), and takes the median of its step records' step_seconds;
  2. the same GPT-2 in PyTorch eager mode (Debian's python3-torch), the same shapes, windows
     of the same text, the same optimizer split (torch.optim.AdamW, and Muon written out as
     torch.optim.Muon defines it: momentum, Nesterov, 5 quintic Newton-Schulz steps, the
     shape scale), timing forward, backward and both optimizers per step.
Both on THREADS threads (OpenBLAS's and torch's). Prints the two medians and their ratio.

  tests/worker/model/gpt_vs_torch.py [--worker build/worker/muonmesh-worker] [--threads 1]
      [--steps 30] [--layers 4] [--embd 128] [--seq 128] [--batch 8]
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


def muonmesh_step(args, out):
    job = os.path.join(out, "job.yaml")
    with open(job, "w") as f:
        f.write(f"""name: vs-torch
world_size: 1
model:
  gpt: {{vocab_size: 256, block_size: {args.seq}, n_layer: {args.layers}, n_head: 4,
         n_embd: {args.embd}, seq_len: {args.seq}}}
data: {{text: {{train: "{CORPUS}", val_fraction: 0}}}}
optimizer:
  muon: {{lr: 0.02, momentum: 0.95, nesterov: true, ns_steps: 5}}
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


def torch_step(args):
    import glob
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    text = b"".join(open(p, "rb").read() for p in sorted(glob.glob(CORPUS)))
    data = torch.tensor(list(text[:200000]), dtype=torch.long)
    c, t, v, h = args.embd, args.seq, 256, 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
            self.c_attn, self.c_proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
            self.c_fc, self.mlp_proj = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

        def forward(self, x):
            b = x.shape[0]
            q, k, vv = self.c_attn(self.ln_1(x)).split(c, dim=2)
            q, k, vv = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, vv))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // h)
            att = att.masked_fill(torch.ones(t, t).tril() == 0, float("-inf")).softmax(-1)
            y = (att @ vv).transpose(1, 2).reshape(b, t, c)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Gpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(v, c), torch.nn.Embedding(t, c)
            self.h = torch.nn.ModuleList(Block() for _ in range(args.layers))
            self.ln_f = torch.nn.LayerNorm(c)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(t))
            for block in self.h:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.T

    model = Gpt()
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("h.")]
    others = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n.startswith("h."))]
    adamw = torch.optim.AdamW(others, lr=0.003, betas=(0.9, 0.95), weight_decay=0)
    momenta = [torch.zeros_like(p) for p in matrices]

    def muon():
        with torch.no_grad():
            for p, m in zip(matrices, momenta):
                m.lerp_(p.grad, 0.05)
                u = p.grad.lerp(m, 0.95)
                x = u.T if u.shape[0] > u.shape[1] else u
                x = x / max(x.norm(), 1e-7)
                for _ in range(5):
                    a = x @ x.T
                    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
                x = x.T if u.shape[0] > u.shape[1] else x
                p.add_(x, alpha=-0.02 * max(1, p.shape[0] / p.shape[1]) ** 0.5)

    seconds = []
    for s in range(args.steps):
        starts = [((s * args.batch + i) * t) % (len(data) - t) for i in range(args.batch)]
        x = torch.stack([data[p:p + t] for p in starts])
        y = torch.stack([data[p + 1:p + t + 1] for p in starts])
        begin = time.perf_counter()
        loss = F.cross_entropy(model(x).view(-1, v), y.view(-1))
        model.zero_grad(set_to_none=True)
        loss.backward()
        adamw.step()
        muon()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds[2:]), torch.__version__


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="build/worker/muonmesh-worker")
    for flag, default in (("threads", 1), ("steps", 30), ("layers", 4), ("embd", 128),
                          ("seq", 128), ("batch", 8)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args()
    args.worker = os.path.abspath(args.worker)
    with tempfile.TemporaryDirectory() as out:
        ours = muonmesh_step(args, out)
    theirs, version = torch_step(args)
    print(f"gpt L={args.layers} C={args.embd} T={args.seq} V=256 batch {args.batch}, "
          f"{args.threads} thread(s): muonmesh {1e3 * ours:.1f} ms a step, "
          f"PyTorch {version} eager {1e3 * theirs:.1f} ms: muonmesh/PyTorch time {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
