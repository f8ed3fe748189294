#!/usr/bin/env python3
"""The optimizer step of a modded-nanogpt-style distributed Muon, in PyTorch.

The peer that issue 44 holds muonmesh's optimizer step against: every rank
keeps the whole model (data parallel, gradients already all-reduced, as DDP
leaves them); the Muon matrices, largest first, are dealt out in groups of
`world` — rank r orthogonalizes the r-th of each group (momentum, Nesterov,
the quintic Newton-Schulz iteration on the normalized update, 5 steps, the
coefficients 3.4445, -4.7750, 2.0315), applies it, then all-gathers the
group's updated matrices; every rank runs AdamW on the rest (embeddings,
biases, norms). Shapes come from a planner spec (specs/gpt2-124m.json).

    tests/worker/muon_peer.py [--spec S] [--world 4] [--steps 4] [--dtype float32]

Prints the median step time of each rank after the first step and the
slowest rank's median (`peer_optimizer_ms=`). Each rank runs torch on one
thread (as the muonmesh benchmark runs OpenBLAS), over Gloo on loopback.
Written from the algorithm's description; nothing here is modded-nanogpt's
code. tests/worker/muon_peer_benchmark.sh runs it beside muonmesh.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g, steps, dtype):
    """The quintic Newton-Schulz iteration on g / |g|_F, on the wide side."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * (s @ s)) @ x
    if tall:
        x = x.T
    return x.to(g.dtype)


def shapes_of(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    muon, adamw = [], []
    for unit in spec["units"]:
        for p in unit["params"]:
            (muon if p["optimizer"] == "muon" else adamw).append(tuple(p["shape"]))
    return muon, adamw


def rank_main(rank, args, store_path, out):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world)
    gen = torch.Generator().manual_seed(1)  # every rank the same model
    muon_shapes, adamw_shapes = shapes_of(args.spec)

    def param(shape):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        return p

    # One class per element count, largest first; within a class, groups of
    # `world` matrices (equal counts, so their flat views gather together).
    classes = {}
    for s in muon_shapes:
        classes.setdefault(s[0] * s[1], []).append(s)
    muon_params = [param(s) for numel in sorted(classes, reverse=True) for s in classes[numel]]
    groups, at = [], 0
    for numel in sorted(classes, reverse=True):
        n = len(classes[numel])
        groups += [list(range(at + b, at + min(b + args.world, n)))
                   for b in range(0, n, args.world)]
        at += n
    adamw_params = [param(s) for s in adamw_shapes]
    momentum = [torch.zeros_like(p) for p in muon_params]
    adamw = torch.optim.AdamW(adamw_params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    dtype = getattr(torch, args.dtype)
    beta, lr = 0.95, 0.02

    def muon_step():
        for group in groups:
            if rank < len(group):
                i = group[rank]
                p, buf = muon_params[i], momentum[i]
                buf.lerp_(p.grad, 1 - beta)
                u = p.grad.lerp(buf, beta)
                o = orthogonalize(u, 5, dtype)
                p.data.add_(o, alpha=-lr * max(1.0, p.size(0) / p.size(1)) ** 0.5)
            # The group's updated matrices from their ranks, flat; a short
            # group pads with scratch.
            flat = [muon_params[i].data.view(-1) for i in group]
            flat += [torch.empty_like(flat[0]) for _ in range(args.world - len(group))]
            dist.all_gather(flat, flat[rank])

    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        adamw.step()
        muon_step()
        times.append((time.perf_counter() - t0) * 1e3)
    out[rank] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    dist.destroy_process_group()


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=os.path.join(here, "..", "..", "specs", "gpt2-124m.json"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="Newton-Schulz's precision (modded-nanogpt runs bfloat16 on GPUs)")
    args = ap.parse_args()
    if args.world < 1 or args.steps < 1:
        sys.exit("--world and --steps must be at least 1")
    if not os.path.exists(args.spec):
        sys.exit(f"no spec at {args.spec}")
    with tempfile.TemporaryDirectory() as tmp:
        out = mp.Manager().dict()
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "store"), out), nprocs=args.world)
        per_rank = [out[r] for r in range(args.world)]
    for r, ms in enumerate(per_rank):
        print(f"rank {r}: optimizer step median {ms:.1f} ms")
    print(f"peer_optimizer_ms={max(per_rank):.1f}")


if __name__ == "__main__":
    main()
