#!/usr/bin/env bash
# Optimizer-step benchmark of the worker runtime (issue 4): the synthetic
# workload at GPT-2-124M shapes, ZeRO-3 on 4 local ranks (real processes,
# Gloo on loopback), owner-based Muon (lpt) against the allgather baseline,
# both in this one run. Prints:
#   - the optimizer step time (AdamW + every Muon phase + after-step gather,
#     median over the steps after the first, slowest rank) of each rule and their ratio;
#   - bytes moved per step (all ranks, every collective, as the communicators
#     count them) against the plan's lower bound (its ring collectives plus
#     the Muon exchange with every owner at its best holder);
#   - peak RSS per rank against the bytes of its parameter, gradient and
#     optimizer shards, and against the worker's own memory estimate (the
#     budget its memory check holds a job to: worker/job/memory_estimate.h).
#
#   tests/worker/optimizer_step_benchmark.sh [STEPS=3] [SCALE=1.0] [WORLD=4]
#
# RULES (default "lpt allgather") picks the owner rules to run; STRATEGY
# (default optim_grads_params, ZeRO-3) the data-parallel sharding strategy,
# or PARALLELISM the whole parallelism section (a YAML flow mapping);
# KEEP=1 keeps the work folder (each rank's output). The step waits for its
# after-step gather (communication.overlap_param_gather false): the optimizer
# step's whole time, as a peer's step that gathers its updates counts it;
# OVERLAP_PARAM_GATHER=true leaves it to run beside the next step.
#
# Not part of the test suite (minutes on 2 cores). Each rank runs OpenBLAS on
# one thread so that 4 ranks share the cores evenly.
set -euo pipefail

steps=${1:-3}
scale=${2:-1.0}
world=${3:-4}
read -r -a rules <<<"${RULES:-lpt allgather}"
strategy=${STRATEGY:-optim_grads_params}
parallelism=${PARALLELISM:-"{data_parallel_sharding_strategy: $strategy}"}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
worker="${MUONMESH_BUILD_DIR:-$root/build}/worker/muonmesh-worker"
spec="$root/specs/gpt2-124m.json"
[[ -x "$worker" ]] || { echo "no $worker: build first" >&2; exit 2; }
[[ -f "$spec" ]] || { echo "no $spec" >&2; exit 2; }
spec=$(cd "$(dirname "$spec")" && pwd)/$(basename "$spec")
work=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-bench.XXXXXX")
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1

run() {  # rule -> writes $work/$rule.rank*.out
  local rule=$1
  cat >"$work/$rule.yaml" <<JOB
name: bench-$rule
world_size: $world
device: cpu
parallelism: $parallelism
model: {synthetic: {spec: $spec, scale: $scale}}
init: {seed: 1}
optimizer:
  muon: {lr: 0.02, momentum: 0.95}
  owner_assignment: $rule
training: {steps: $steps, global_batch_size: $world}
communication: {overlap_param_gather: ${OVERLAP_PARAM_GATHER:-false}}
output: {dir: $work/out-$rule, export: ""}
JOB
  local pids=()
  mkdir -p "$work/store-$rule"
  for ((r = 0; r < world; ++r)); do
    "$worker" --standalone --job "$work/$rule.yaml" --rank "$r" --world-size "$world" \
      --store "$work/store-$rule" --timeout-seconds 600 >"$work/$rule.rank$r.out" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || { cat "$work/$rule".rank*.out >&2; exit 1; }; done
}

field() {  # file key -> value from the summary line
  sed -n "s/.*summary.* $2=\([0-9.]*\).*/\1/p" "$1"
}

echo "synthetic gpt2-124m x$scale, parallelism $parallelism, $world ranks, $steps steps, $(date -u +%FT%TZ)"
for rule in "${rules[@]}"; do
  start=$(date +%s)
  run "$rule"
  echo "  $rule: done in $(( $(date +%s) - start )) s"
done

slowest() {  # rule -> max over ranks of the median optimizer step
  for f in "$work/$1".rank*.out; do field "$f" optimizer_ms_median; done | sort -g | tail -n 1
}
sum_field() {
  for f in "$work/$1".rank*.out; do field "$f" "$2"; done | awk '{s += $1} END {printf "%.0f", s}'
}
for rule in "${rules[@]}"; do
  echo "optimizer step (slowest rank, median), $rule: $(slowest "$rule") ms"
done
if [[ " ${rules[*]} " == *" lpt "* && " ${rules[*]} " == *" allgather "* ]]; then
  awk -v a="$(slowest allgather)" -v l="$(slowest lpt)" 'BEGIN {
    printf "owner-based %.1f ms, allgather %.1f ms: %.2fx faster\n", l, a, a / l }'
fi
[[ " ${rules[*]} " == *" lpt "* ]] || exit 0

plan_line=$(grep -h '^plan:' "$work/lpt.rank0.out")
planned=$(sed -n 's/^plan: \([0-9]*\) bytes per step.*/\1/p' <<<"$plan_line")
exchange=$(sed -n 's/.*Muon exchange \([0-9]*\) bytes.*/\1/p' <<<"$plan_line")
exchange_lb=$(sed -n 's/.*(lower bound \([0-9]*\)).*/\1/p' <<<"$plan_line")
measured=$(sum_field lpt bytes_per_step)
awk -v m="$measured" -v p="$planned" -v e="$exchange" -v lb="$exchange_lb" 'BEGIN {
  bound = p - e + lb
  printf "bytes per step (all ranks): measured %.0f, plan %.0f, lower bound %.0f: %.3fx the lower bound\n", m, p, bound, m / bound }'

for f in "$work"/lpt.rank*.out; do
  rss=$(field "$f" peak_rss_bytes)
  shards=$(field "$f" shard_bytes)
  estimate=$(field "$f" estimated_peak_bytes)
  awk -v r="$rss" -v s="$shards" -v e="$estimate" -v f="$(basename "$f" .out)" 'BEGIN {
    printf "  %s: peak RSS %.1f MiB, shards %.1f MiB (%.2fx), RSS - 1.5 x shards = %.1f MiB, the worker'"'"'s estimate %.1f MiB (peak %.2fx it)\n",
      f, r / 1048576, s / 1048576, r / s, (r - 1.5 * s) / 1048576, e / 1048576, r / e }'
done
