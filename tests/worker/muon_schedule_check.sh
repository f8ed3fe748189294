#!/usr/bin/env bash
# The Muon schedule on real processes (issue 10): `synthetic` Llama-3-8B and
# DeepSeek-V3 shapes scaled down, world size 8 on loopback (Gloo), ZeRO-3
# and HFSDP, EP 2 for DeepSeek-V3, each with one wave for the whole model
# (the default) and with optimizer.muon_buffer_bytes set to the largest
# unit's whole gradients (waves that keep the Muon phase within the backward
# pass's memory peak; the script prints the figure it used). From every
# rank's <output.dir>/metrics/rank-<R>.jsonl it checks and prints, per run:
#   - the executed critical path, the sum over rounds of the busiest rank's
#     Newton-Schulz FLOPs, against the plan's (each round's
#     planned_critical_ns_flops): they must be equal;
#   - every rank's work in every round against the plan's share for it;
#   - rounds and exchange calls per step beside the model's unit count;
#   - the plan's joint critical path over its joint lower bound (rank 0's
#     "plan:" line, in flop-equivalents: Newton-Schulz plus owner traffic).
#
#   tests/worker/muon_schedule_check.sh [SCALE=0.03125] [STEPS=2] [THREADS_PER_RANK=1]
#
# THREADS_PER_RANK sets the jobs' training.threads_per_rank, which the plan
# prices the Newton-Schulz forms for (the Gram iteration instead of the
# spectral form on wide matrices at 2): executed must still equal planned.
#
# Needs the build and python3. Not part of the test suite (minutes on 2
# cores); its figures go to BENCHMARKS.md. Exits 1 when a check fails.
set -euo pipefail

scale=${1:-0.03125}
steps=${2:-2}
threads=${3:-1}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
specs="$root/specs"
specs=$(cd "$specs" && pwd)
command -v python3 >/dev/null || { echo "muon_schedule_check.sh: needs python3" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-schedule.XXXXXX")
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$work"' EXIT

status=0
run() {  # NAME SPEC PARALLELISM BUFFER
  local name=$1 spec=$2 parallelism=$3 buffer=$4
  local dir="$work/$name"
  mkdir -p "$dir"
  cat >"$dir/job.yaml" <<JOB
name: $name
world_size: 8
device: cpu
parallelism: $parallelism
model: {synthetic: {spec: $specs/$spec, scale: $scale}}
optimizer: {muon_buffer_bytes: $buffer}
training: {steps: $steps, global_batch_size: 8, threads_per_rank: $threads}
output: {dir: $dir/out, export: ""}
JOB
  if ! OPENBLAS_NUM_THREADS=1 "$root/deploy/local/run-job.sh" "$dir/job.yaml" \
      --timeout-seconds 600 >"$dir/rank0.out" 2>&1; then
    echo "FAIL: $name did not run:" >&2
    tail -n 20 "$dir/rank0.out" >&2
    status=1
    return
  fi
  local plan_line
  plan_line=$(grep -m 1 'Muon critical path' "$dir/rank0.out" || true)
  python3 - "$name" "$dir/out/metrics" "$plan_line" <<'PY' || status=1
import json, os, re, sys
name, metrics, plan_line = sys.argv[1], sys.argv[2], sys.argv[3]
ranks = {}
for f in sorted(os.listdir(metrics)):
    m = re.match(r"rank-(\d+)\.jsonl$", f)
    if m:
        with open(os.path.join(metrics, f)) as fh:
            ranks[int(m.group(1))] = [json.loads(line) for line in fh if line.strip()]
ok = True
last = {r: lines[-1] for r, lines in ranks.items()}
rounds = [l["muon_rounds"] for l in last.values()]
n = len(rounds[0])
if any(len(r) != n for r in rounds):
    print(f"FAIL {name}: ranks ran different numbers of rounds"); sys.exit(1)
executed = planned = 0.0
for k in range(n):
    busiest = max(r[k]["ns_flops"] for r in rounds)
    executed += busiest
    planned += rounds[0][k]["planned_critical_ns_flops"]
    for r in rounds:
        if r[k]["ns_flops"] != r[k]["planned_ns_flops"]:
            ok = False
            print(f"FAIL {name}: round {k}: a rank ran {r[k]['ns_flops']:.6g} FLOPs, "
                  f"the plan gave it {r[k]['planned_ns_flops']:.6g}")
if abs(executed - planned) > 1e-9 * planned:
    ok = False
    print(f"FAIL {name}: executed critical path {executed:.6g} != planned {planned:.6g}")
calls = max(l["muon_exchange_calls"] for l in last.values())
waits = [sum(x["wait_ms"] for x in r) for r in rounds]
m = re.search(r"critical path ([0-9.e+]+) .*joint lower bound ([0-9.e+]+) \(([0-9.]+)x\)"
              r"(?:, certified bound ([0-9.e+]+) \(([0-9.]+)x\))?", plan_line)
joint = f"plan joint {m.group(3)}x" if m else "plan joint ?"
if m and m.group(5):
    joint += f" (certified bound: {m.group(5)}x)"
units = max(x["units"][1] for x in rounds[0]) if n else 0
print(f"{name}: rounds {n}, exchange calls {calls} (spec units with Muon <= {units}), "
      f"critical path executed {executed:.4g} = planned {planned:.4g} NS FLOPs, "
      f"{joint}, exchange wait per rank {min(waits):.0f}-{max(waits):.0f} ms"
      + ("" if ok else "  <- FAILED"))
sys.exit(0 if ok else 1)
PY
}

echo "muon schedule check: scale $scale, $steps steps, world size 8, $(date -u +%FT%TZ)"
cases=(
  "llama3-zero3 llama3-8b.json {data_parallel_sharding_strategy: optim_grads_params}"
  "llama3-hfsdp llama3-8b.json {data_parallel_sharding_strategy: optim_grads_params, num_distributed_optimizer_instances: 2, outer_dp_sharding_strategy: optim}"
  "deepseek-ep2-zero3 deepseek-v3.json {data_parallel_sharding_strategy: optim_grads_params, expert_model_parallel_size: 2}"
  "deepseek-ep2-hfsdp deepseek-v3.json {data_parallel_sharding_strategy: optim_grads_params, num_distributed_optimizer_instances: 2, outer_dp_sharding_strategy: optim, expert_model_parallel_size: 2}"
)
for c in "${cases[@]}"; do
  read -r name spec parallelism <<<"$c"
  run "$name-one-wave" "$spec" "$parallelism" 0
  # The budget that keeps the Muon phase within the backward pass's peak,
  # as rank 0 printed it.
  budget=$(sed -n 's/.*(optimizer.muon_buffer_bytes 0; \([0-9]*\) keeps.*/\1/p' \
           "$work/$name-one-wave/rank0.out" | head -n 1)
  [[ -n $budget ]] || { echo "FAIL: $name: no wave budget printed" >&2; status=1; continue; }
  echo "  ($name: waves within the backward peak: optimizer.muon_buffer_bytes $budget)"
  run "$name-waves" "$spec" "$parallelism" "$budget"
done
exit "$status"
