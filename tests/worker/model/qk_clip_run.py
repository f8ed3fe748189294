#!/usr/bin/env python3
"""QK-clip changing a run's outcome (BENCHMARKS.md, "QK-clip").

Trains the character-level GPT of muon_vs_adamw.py (2 layers, 64 wide, 4 heads) with Muon at
a learning rate high enough that attention logits run away, twice from the same
initialisation on the same windows: without QK-clip and with optimizer.muon.qk_clip TAU.
Each run is one muonmesh-worker --standalone rank; the script reads every step's record
(<output>/metrics/rank-0.jsonl: loss, val_loss on evaluated steps, max_attn_logit per layer)
and prints, every EVAL steps, both runs' validation loss and largest logit, then draws the
losses and the logits into one PNG.

  tests/worker/model/qk_clip_run.py [--worker build/worker/muonmesh-worker]
      [--corpus '/usr/share/games/fortunes/*.u8'] [--steps 400] [--muon-lr 0.1]
      [--tau 50] [--out DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

EVAL = 25

JOB = """name: {name}
world_size: 1
device: cpu
model:
  gpt: {{vocab_size: 256, block_size: 64, n_layer: 2, n_head: 4, n_embd: 64, seq_len: 64}}
init: {{seed: 1}}
data:
  text: {{train: "{corpus}", val_fraction: 0.1}}
optimizer:
  muon: {{lr: {muon_lr}, momentum: 0.95, nesterov: true, ns_steps: 5{clip}}}
  adamw: {{lr: 0.01, beta1: 0.9, beta2: 0.95, weight_decay: 0.0}}
training: {{steps: {steps}, global_batch_size: 16, eval_every: {eval}, eval_batches: 8}}
output: {{dir: {out}}}
"""


def train(args, name, tau):
    """Runs one job; returns its step records (dicts), in step order."""
    folder = os.path.join(args.out, name)
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "out")
    job = JOB.format(name=name, corpus=args.corpus, muon_lr=args.muon_lr,
                     clip=f", qk_clip: {tau}" if tau else "", steps=args.steps, eval=EVAL,
                     out=out)
    path = os.path.join(folder, "job.yaml")
    with open(path, "w") as f:
        f.write(job)
    start = time.time()
    done = subprocess.run([args.worker, "--standalone", "--job", path, "--rank", "0",
                           "--world-size", "1", "--store", os.path.join(folder, "store"),
                           "--create-store"], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: muonmesh-worker failed:\n{done.stderr}")
    with open(os.path.join(out, "metrics", "rank-0.jsonl")) as f:
        records = [json.loads(line) for line in f]
    print(f"{name}: {len(records)} steps in {time.time() - start:.1f} s", flush=True)
    return records


def plot(args, plain, clipped):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no PNG (apt-get install python3-matplotlib)")
        return
    fig, (loss_ax, logit_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for records, label, style in ((plain, "without QK-clip", "-"),
                                  (clipped, f"qk_clip {args.tau}", "-")):
        val = [(r["step"] + 1, r["val_loss"]) for r in records if "val_loss" in r]
        line, = loss_ax.plot(*zip(*val), style, marker="o", label=f"{label}: validation")
        loss_ax.plot([r["step"] + 1 for r in records], [r["loss"] for r in records],
                     color=line.get_color(), alpha=0.25, linewidth=0.8)
        logit_ax.plot([r["step"] + 1 for r in records],
                      [max(r["max_attn_logit"]) for r in records], color=line.get_color(),
                      label=label)
    logit_ax.axhline(args.tau, color="gray", linestyle="--", linewidth=0.8, label="tau")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (nats per byte; faint: training)")
    loss_ax.set_ylim(2.3, 3.6)
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend()
    logit_ax.set_yscale("log")
    logit_ax.set_xlabel("step")
    logit_ax.set_ylabel("largest pre-softmax logit (any layer)")
    logit_ax.grid(True, alpha=0.3)
    logit_ax.legend()
    fig.suptitle(f"Character-level GPT-2, Muon lr {args.muon_lr}: QK-clip at {args.tau}")
    fig.tight_layout()
    png = os.path.join(args.out, "qk_clip.png")
    fig.savefig(png, dpi=100)
    print(f"curves: {png}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="build/worker/muonmesh-worker")
    parser.add_argument("--corpus", default="/usr/share/games/fortunes/*.u8")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--muon-lr", type=float, default=0.1)
    parser.add_argument("--tau", type=float, default=50)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.tau <= 0:
        parser.error("--tau must be > 0")
    args.out = args.out or tempfile.mkdtemp(prefix="qk_clip.")
    args.worker = os.path.abspath(args.worker)
    plain = train(args, "plain", 0)
    clipped = train(args, "clipped", args.tau)
    print(f"{'step':>5} {'val (plain)':>12} {'val (clip)':>11} {'logit (plain)':>14} "
          f"{'logit (clip)':>13}")
    for a, b in zip(plain, clipped):
        if "val_loss" in a:
            print(f"{a['step'] + 1:5d} {a['val_loss']:12.4f} {b['val_loss']:11.4f} "
                  f"{max(a['max_attn_logit']):14.1f} {max(b['max_attn_logit']):13.1f}")
    over = sum(1 for r in clipped if max(r["max_attn_logit"]) > args.tau)
    print(f"with QK-clip, {over} of {len(clipped)} steps began above tau (one step's growth "
          f"before the rescaling); largest logit {max(max(r['max_attn_logit']) for r in clipped):.1f} "
          f"against {max(max(r['max_attn_logit']) for r in plain):.1f} without")
    plot(args, plain, clipped)


if __name__ == "__main__":
    main()
