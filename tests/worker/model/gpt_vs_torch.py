#!/usr/bin/python3
"""The gpt's training step against PyTorch on the same model, data and device.

Runs, in one invocation so that both see the same machine load:
  1. muonmesh-worker --standalone, one rank, the job below (Muon on the four matrices of each
     block, AdamW on the rest), and takes the median of its step records' step_seconds;
  2. the same GPT-2 in PyTorch eager mode (and, with --compile, under torch.compile), the
     same shapes, windows of the same text, the same optimizer split (torch.optim.AdamW, and
     torch.optim.Muon where this PyTorch has it, else Muon written out as it defines it:
     momentum, Nesterov, 5 quintic Newton-Schulz steps, in bf16 on a GPU, the shape scale),
     timing forward, backward and both optimizers per step.
On the CPU both use THREADS threads (OpenBLAS's and torch's); with --device cuda the job runs
on GPU 0 through muonmesh-worker-cuda (pass it as --worker) and PyTorch on the same GPU.
Prints the medians, tokens/s and the time ratios.

  tests/worker/model/gpt_vs_torch.py [--worker build/worker/muonmesh-worker] [--threads 1]
      [--steps 30] [--layers 4] [--embd 128] [--heads 4] [--seq 128] [--vocab 256]
      [--batch 8] [--device cpu|cuda] [--compile] [--corpus GLOB]

GPT-2 124M on a GPU (worker/cuda/run_gpu_checks.sh runs this):
  gpt_vs_torch.py --device cuda --compile --worker DIR/muonmesh-worker-cuda --layers 12
      --embd 768 --heads 12 --seq 1024 --vocab 50257 --batch 8 --steps 12 --corpus README.md
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

CORPUS = "/usr/share/games/fortunes/*.u8"  # the default --corpus (Debian's fortunes-min)


def muonmesh_step(args, out):
    job = os.path.join(out, "job.yaml")
    with open(job, "w") as f:
        f.write(f"""name: vs-torch
world_size: 1
device: {args.device}
model:
  gpt: {{vocab_size: {args.vocab}, block_size: {args.seq}, n_layer: {args.layers},
         n_head: {args.heads}, n_embd: {args.embd}, seq_len: {args.seq}}}
data: {{text: {{train: "{args.corpus}", val_fraction: 0}}}}
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


def torch_step(args, compiled=False):
    import glob
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    text = b"".join(open(p, "rb").read() for p in sorted(glob.glob(args.corpus)))
    data = torch.tensor(list(text[:200000]), dtype=torch.long, device=dev)
    c, t, v, h = args.embd, args.seq, args.vocab, args.heads
    causal = torch.ones(t, t, device=dev).tril() == 0

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
            att = att.masked_fill(causal, float("-inf")).softmax(-1)
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
            x = self.wte(idx) + self.wpe(torch.arange(t, device=dev))
            for block in self.h:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.T

    model = Gpt().to(dev)
    forward = torch.compile(model) if compiled else model
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("h.")]
    others = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n.startswith("h."))]
    adamw = torch.optim.AdamW(others, lr=0.003, betas=(0.9, 0.95), weight_decay=0)
    momenta = [torch.zeros_like(p) for p in matrices]
    ns_type = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def written_out_muon():
        with torch.no_grad():
            for p, m in zip(matrices, momenta):
                m.lerp_(p.grad, 0.05)
                u = p.grad.lerp(m, 0.95)
                x = (u.T if u.shape[0] > u.shape[1] else u).to(ns_type)
                x = x / max(x.norm(), 1e-7)
                for _ in range(5):
                    a = x @ x.T
                    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
                x = (x.T if u.shape[0] > u.shape[1] else x).to(p.dtype)
                p.add_(x, alpha=-0.02 * max(1, p.shape[0] / p.shape[1]) ** 0.5)

    muon, name = written_out_muon, "Muon written out"
    try:  # PyTorch's own where it has one (2.9 and later)
        muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0, momentum=0.95, nesterov=True,
                                ns_steps=5, adjust_lr_fn="original").step
        name = "torch.optim.Muon"
    except (AttributeError, TypeError):
        pass

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    seconds = []
    for s in range(args.steps):
        starts = [((s * args.batch + i) * t) % (len(data) - t) for i in range(args.batch)]
        x = torch.stack([data[p:p + t] for p in starts])
        y = torch.stack([data[p + 1:p + t + 1] for p in starts])
        sync()
        begin = time.perf_counter()
        loss = F.cross_entropy(forward(x).view(-1, v), y.view(-1))
        model.zero_grad(set_to_none=True)
        loss.backward()
        adamw.step()
        muon()
        sync()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds[2:]), f"{torch.__version__} ({name})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="build/worker/muonmesh-worker")
    for flag, default in (("threads", 1), ("steps", 30), ("layers", 4), ("embd", 128),
                          ("heads", 4), ("seq", 128), ("vocab", 256), ("batch", 8)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--corpus", default=CORPUS, help="text file(s), a glob")
    args = parser.parse_args()
    args.worker = os.path.abspath(args.worker)
    args.corpus = os.path.abspath(args.corpus) if "*" not in args.corpus else args.corpus
    tokens = args.batch * args.seq
    with tempfile.TemporaryDirectory() as out:
        ours = muonmesh_step(args, out)
    where = "GPU" if args.device == "cuda" else f"{args.threads} thread(s)"
    print(f"gpt L={args.layers} C={args.embd} H={args.heads} T={args.seq} V={args.vocab} "
          f"batch {args.batch}, {where}: muonmesh {1e3 * ours:.1f} ms a step, "
          f"{tokens / ours:.0f} tokens/s", flush=True)
    modes = [("eager", False)] + ([("torch.compile", True)] if args.compile else [])
    for mode, compiled in modes:
        try:
            theirs, version = torch_step(args, compiled)
        except Exception as e:  # torch.compile may be missing or fail on this machine
            print(f"PyTorch {mode}: did not run: {type(e).__name__}: {e}".splitlines()[0])
            continue
        print(f"PyTorch {version} {mode} {1e3 * theirs:.1f} ms, {tokens / theirs:.0f} tokens/s: "
              f"muonmesh/PyTorch time {ours / theirs:.2f}", flush=True)


if __name__ == "__main__":
    main()
