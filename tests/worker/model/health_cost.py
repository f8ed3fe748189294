#!/usr/bin/env python3
"""What Muon's health metrics cost a step (BENCHMARKS.md, "Muon health: its cost").

Runs the quickstart's job (deploy/local/examples/gpt-text.yaml: the character-level GPT,
4 layers, 128 wide, 4 CPU ranks as HFSDP) as --standalone ranks on this host, with
optimizer.muon.health_every 2, so that health steps (orthogonality error measured) and
plain steps (counts and update RMS only) alternate within one run under the same load.
Reads rank 0's step records and prints the median step time of each kind, the extra time of
a health step, and what that extra costs per step at the default interval (100) and at
--every. The per-step part (counting the applied rows and the update's sum of squares, one
all-gather of eight floats) runs on every step of both kinds; its cost is bounded by the
muon_apply phase it rides in, printed too.

  tests/worker/model/health_cost.py [--worker build/worker/muonmesh-worker]
      [--steps 100] [--ranks 4] [--out DIR]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile


def job_text(args, out):
    with open(args.job) as f:
        text = f.read()
    text = re.sub(r"world_size: \d+", f"world_size: {args.ranks}", text)
    text = re.sub(r"steps: 250", f"steps: {args.steps}", text)
    text = text.replace("eval_every: 50", f"eval_every: {args.steps}")
    text = text.replace("ns_steps: 5,", "ns_steps: 5, health_every: 2,")
    text = re.sub(r"output: \{dir: [^}]*\}", f"output: {{dir: {out}}}", text)
    if "health_every: 2" not in text:
        sys.exit(f"{args.job}: could not set health_every (its muon line changed?)")
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="build/worker/muonmesh-worker")
    parser.add_argument("--job", default="deploy/local/examples/gpt-text.yaml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="health_cost.")
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "out")
    path = os.path.join(args.out, "job.yaml")
    with open(path, "w") as f:
        f.write(job_text(args, out))
    store = os.path.join(args.out, "store")
    os.makedirs(store, exist_ok=True)
    ranks = [subprocess.Popen([os.path.abspath(args.worker), "--standalone", "--job", path,
                               "--rank", str(r), "--world-size", str(args.ranks), "--store",
                               store], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for r in range(args.ranks)]
    for r, p in enumerate(ranks):
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"rank {r} failed:\n{err}")
    with open(os.path.join(out, "metrics", "rank-0.jsonl")) as f:
        records = [json.loads(line) for line in f][4:]  # past the first steps' warm-up
    health = [r for r in records if "ortho_error_max" in r["muon"]]
    plain = [r for r in records if "ortho_error_max" not in r["muon"]]
    step_h = statistics.median(r["step_seconds"] for r in health)
    step_p = statistics.median(r["step_seconds"] for r in plain)
    ns_h = statistics.median(r["phases"]["newton_schulz"] for r in health)
    ns_p = statistics.median(r["phases"]["newton_schulz"] for r in plain)
    apply_p = statistics.median(r["phases"]["muon_apply"] for r in plain)
    after = "param_allgather_after_step"  # also times the logit and health reductions
    after_h = statistics.median(r["phases"][after] for r in health)
    after_p = statistics.median(r["phases"][after] for r in plain)
    extra = ns_h - ns_p
    print(f"{len(health)} health steps, {len(plain)} plain steps (rank 0, {args.ranks} ranks)")
    print(f"median step: health {1e3 * step_h:.1f} ms, plain {1e3 * step_p:.1f} ms")
    print(f"median newton_schulz phase (where the error is measured): health "
          f"{1e3 * ns_h:.2f} ms, plain {1e3 * ns_p:.2f} ms: +{1e3 * extra:.2f} ms a health step")
    print(f"median {after} phase (the health all-gather every step, the errors' max-reduce "
          f"on health steps): health {1e3 * after_h:.2f} ms, plain {1e3 * after_p:.2f} ms")
    extra += max(0.0, after_h - after_p)
    print(f"health step over a plain one: {extra / step_p:.2%} (both phases), "
          f"{(step_h - step_p) / step_p:+.2%} (whole step, noisier)")
    print(f"at health_every 100: {extra / 100 / step_p:.4%} a step; the per-step tally rides "
          f"in muon_apply, {1e3 * apply_p:.2f} ms = {apply_p / step_p:.2%} of a step in all")
    errors = [r["muon"]["ortho_error_max"] for r in health]
    print(f"orthogonality error (largest): {min(errors):.3f} to {max(errors):.3f}; "
          f"Muon elements {records[-1]['muon']['elements']} of "
          f"{records[-1]['muon']['planned_elements']} planned")


if __name__ == "__main__":
    main()
