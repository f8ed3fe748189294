#!/usr/bin/env python3
"""Muon against AdamW on a character-level language model (BENCHMARKS.md, "Muon against AdamW").

Trains the same model on the same text from the same initialisation twice over a small
learning-rate sweep: once as the product runs it (Muon on the four matrices of each block,
AdamW on embeddings, biases and LayerNorms) and once with AdamW on everything (an
optimizer rule `.*` -> adamw). Each run is one muonmesh-worker --standalone rank (the
arithmetic is the same under every layout, and one rank leaves the other core free). Prints,
per run, the validation loss every EVAL steps; then each optimizer at its best learning rate
(lowest final validation loss), the step at which each first reaches AdamW's best validation
loss, and their ratio; and draws both curves into a PNG.

--model picks the model (the same width, depth and data): gpt (GPT-2's block, the default),
transformer (the Llama-style one: RMSNorm, RoPE, grouped-query attention, SwiGLU) or moe (the
DeepSeek-style one: MLA, a dense first layer, then 8 routed experts, top 2, and a shared one,
the balancing bias at 0.01). Muon takes every matrix inside the layers (each expert's alone)
but the routers.

With --schedule both optimizers run the recipe real runs use: a linear warmup over the
first 5 % of the steps, then a cosine decay to 10 % of the peak, and the global gradient
norm clipped at 1 (training.lr_schedule, training.clip_grad_norm); the sweep is the same.

  tests/worker/model/muon_vs_adamw.py [--worker build/worker/muonmesh-worker]
      [--corpus '/usr/share/games/fortunes/*.u8'] [--steps 400] [--schedule]
      [--model gpt|transformer|moe] [--out DIR]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

MUON_LRS = [0.01, 0.02, 0.04]
# The transformers' best Muon rate sits at the gpt sweep's low end: their sweep goes a step lower.
MUON_LRS_TRANSFORMER = [0.005, 0.01, 0.02, 0.04]
ADAMW_LRS = [0.0003, 0.001, 0.003, 0.01]
ADAMW_LR_BESIDE_MUON = 0.003  # embeddings, biases and LayerNorms in the Muon runs
EVAL = 25
MODELS = {
    "gpt": "gpt: {vocab_size: 256, block_size: 64, n_layer: 2, n_head: 4, n_embd: 64, seq_len: 64}",
    "transformer": "transformer: {vocab_size: 256, seq_len: 64, n_layer: 2, d_model: 64, "
                   "n_head: 4, n_kv_head: 2, ffn_hidden: 172}",
    "moe": "transformer: {vocab_size: 256, seq_len: 64, n_layer: 2, d_model: 64, n_head: 4, "
           "ffn_hidden: 172, attention: mla, mla: {q_lora_rank: 48, kv_lora_rank: 32, "
           "qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16}, "
           "moe: {n_routed_experts: 8, top_k: 2, moe_ffn_hidden: 48, n_shared_experts: 1, "
           "first_k_dense: 1, score: sigmoid, route_scale: 2.5, bias_update_rate: 0.01}}",
}
TITLES = {
    "gpt": "Character-level GPT-2 (2 layers, 64 wide)",
    "transformer": "Character-level Llama-style transformer (2 layers, 64 wide)",
    "moe": "Character-level DeepSeek-style MoE (2 layers, 64 wide, 8 experts)",
}

JOB = """name: {name}
world_size: 1
device: cpu
model:
  {model}
init: {{seed: 1}}
data:
  text: {{train: "{corpus}", val_fraction: 0.1}}
optimizer:
  muon: {{lr: {muon_lr}, momentum: 0.95, nesterov: true, ns_steps: 5}}
  adamw: {{lr: {adamw_lr}, beta1: 0.9, beta2: 0.95, weight_decay: 0.0}}
{rules}training: {{steps: {steps}, global_batch_size: 16, eval_every: {eval}, eval_batches: 8{recipe}}}
output: {{dir: {out}}}
"""


def recipe(args):
    if not args.schedule:
        return ""
    warmup = max(1, args.steps // 20)
    return (f",\n  lr_schedule: {{warmup_steps: {warmup}, decay: cosine, min_lr_ratio: 0.1}},"
            f"\n  clip_grad_norm: 1.0")


def run(args, name, muon_lr, adamw_lr, all_adamw):
    folder = os.path.join(args.out, name)
    os.makedirs(folder, exist_ok=True)
    rules = "  rules: [{pattern: '.*', optimizer: adamw}]\n" if all_adamw else ""
    job = JOB.format(name=name, model=MODELS[args.model], corpus=args.corpus, muon_lr=muon_lr,
                     adamw_lr=adamw_lr,
                     rules=rules, steps=args.steps, eval=EVAL, out=os.path.join(folder, "out"),
                     recipe=recipe(args))
    path = os.path.join(folder, "job.yaml")
    with open(path, "w") as f:
        f.write(job)
    store = os.path.join(folder, "store")
    start = time.time()
    done = subprocess.run([args.worker, "--standalone", "--job", path, "--rank", "0",
                           "--world-size", "1", "--store", store, "--create-store"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: muonmesh-worker failed:\n{done.stderr}")
    curve = [(int(m.group(1)) + 1, float(m.group(2)))
             for m in re.finditer(r"step\s+(\d+)\s+val_loss ([0-9.eE+-]+)", done.stdout)]
    print(f"{name:22s} {time.time() - start:6.1f} s  final val_loss {curve[-1][1]:.4f}  "
          + " ".join(f"{v:.3f}" for _, v in curve), flush=True)
    return curve


def first_reaching(curve, target):
    for step, value in curve:
        if value <= target:
            return step
    return None


def plot(args, muon, adamw, muon_name, adamw_name):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no PNG (apt-get install python3-matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(*zip(*muon), marker="o", label=f"Muon + AdamW ({muon_name})")
    ax.plot(*zip(*adamw), marker="s", label=f"AdamW only ({adamw_name})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title(TITLES[args.model] + "\non the fortunes texts"
                 + (", warmup + cosine" if args.schedule else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    model = "" if args.model == "gpt" else f"_{args.model}"
    png = os.path.join(args.out, f"muon_vs_adamw{model}"
                       + ("_schedule.png" if args.schedule else ".png"))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"curves: {png}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="build/worker/muonmesh-worker")
    parser.add_argument("--corpus", default="/usr/share/games/fortunes/*.u8")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--schedule", action="store_true",
                        help="warmup + cosine decay and clipping at 1 for both optimizers")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="muon_vs_adamw.")
    args.worker = os.path.abspath(args.worker)
    muon_lrs = MUON_LRS if args.model == "gpt" else MUON_LRS_TRANSFORMER
    muon = {lr: run(args, f"muon-lr{lr}", lr, ADAMW_LR_BESIDE_MUON, False) for lr in muon_lrs}
    adamw = {lr: run(args, f"adamw-lr{lr}", 0.02, lr, True) for lr in ADAMW_LRS}
    best_muon = min(muon, key=lambda lr: muon[lr][-1][1])
    best_adamw = min(adamw, key=lambda lr: adamw[lr][-1][1])
    target = min(v for _, v in adamw[best_adamw])
    muon_steps = first_reaching(muon[best_muon], target)
    adamw_steps = first_reaching(adamw[best_adamw], target)
    print(f"best: Muon lr {best_muon} (final {muon[best_muon][-1][1]:.4f}), "
          f"AdamW lr {best_adamw} (final {adamw[best_adamw][-1][1]:.4f})")
    print(f"AdamW's best validation loss {target:.4f}: AdamW reaches it at step {adamw_steps}, "
          f"Muon at step {muon_steps}"
          + (f" ({muon_steps / adamw_steps:.2f}x AdamW's steps)" if muon_steps else " (never)"))
    plot(args, muon[best_muon], adamw[best_adamw], f"lr {best_muon}", f"lr {best_adamw}")


if __name__ == "__main__":
    main()
