#!/usr/bin/env bash
# The main job: installs dependencies, builds, then runs the service on this
# machine and trains a job through it:
#  1. starts muonmesh-coordinator on a free loopback port (state in a
#     temporary folder) and 4 muonmesh-worker daemons that register with it;
#  2. prints, through muonmeshctl, the plan of the job (by default a
#     byte-level GPT-2 on 4 ranks with ZeRO-3, deploy/local/examples/gpt-text.yaml);
#  3. submits it, watches it to the end (every step's loss and time, the
#     validation loss every 50 steps), prints its step records and a
#     summary, and the fleet;
#  4. for a language model (gpt, transformer), prints text the trained
#     model writes (muonmesh-worker
#     --sample);
#  5. stops everything it started. The final weights are in
#     deploy/local/examples/runs/<job name>/final.safetensors.
#
#   deploy/local/run-example.sh [JOB.yaml]
#
# MUONMESH_BUILD_DIR overrides the build folder (default build/).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
job=${1:-deploy/local/examples/gpt-text.yaml}

build_dir=${MUONMESH_BUILD_DIR:-build}
deploy/local/build.sh --target muonmesh-coordinator muonmeshctl muonmesh-worker >/dev/null

coordinator="$build_dir/server/muonmesh-coordinator"
worker="$build_dir/worker/muonmesh-worker"
ctl="$build_dir/client/muonmeshctl"
work=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-example.XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

"$coordinator" --listen 127.0.0.1:0 --data-dir "$work/state" >"$work/coordinator.log" 2>&1 &
pids+=($!)
# Wait (bounded) for "muonmesh-coordinator listening on HOST:PORT".
address=""
for _ in $(seq 100); do
  address=$(sed -n 's/^muonmesh-coordinator listening on //p' "$work/coordinator.log" | head -n 1)
  [[ -n "$address" ]] && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$work/coordinator.log" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$address" ]] || { echo "coordinator did not start within 10 s" >&2; exit 1; }
echo "coordinator at $address"

# Four CPU workers on this machine, each with a quarter of the default budget.
budget=$(awk '/MemTotal/ {printf "%dKiB", $2 * 0.8 / 4}' /proc/meminfo)
for i in 0 1 2 3; do
  "$worker" --coordinator "$address" --worker-id "local-$i" --memory-budget "$budget" \
    >"$work/worker-$i.log" 2>&1 &
  pids+=($!)
done

export MUONMESH_COORDINATOR=$address
# A job never starts over an earlier run's outputs (it would overwrite
# them); the example is meant to run again, so it moves them aside first.
output_dir=$("$worker" --describe --job "$job" | sed -n 's/^output_dir=//p')
if [[ -n "$output_dir" && -d "$output_dir" && -n "$(ls -A "$output_dir")" ]]; then
  aside="$output_dir.earlier-$(date -u +%Y%m%dT%H%M%SZ)"
  mv "$output_dir" "$aside"
  echo "the earlier run's outputs are now in $aside"
fi
echo
"$ctl" plan --job "$job"
echo
id=$("$ctl" submit "$job" | tail -n 1)
echo "submitted $job as $id"
"$ctl" watch "$id"
echo
"$ctl" metrics "$id" --summary
echo
"$ctl" workers
"$ctl" status "$id" | grep -q SUCCEEDED || { echo "the job did not succeed" >&2; exit 1; }
# Language models (gpt, transformer) exported in muonmesh's own format.
if grep -qE '^[[:space:]]*(gpt|transformer):' "$job" && ! grep -qE 'export_format:[[:space:]]*hf' "$job"; then
  weights=$("$worker" --describe --job "$job" | sed -n 's/^export=//p')
  echo
  echo "A sample from the trained model (muonmesh-worker --sample, temperature 0.8, top-k 40):"
  echo
  "$worker" --sample --job "$job" --weights "$weights" --prompt "The " --tokens 300 \
    --temperature 0.8 --top-k 40 --seed 1
fi
