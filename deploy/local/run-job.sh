#!/usr/bin/env bash
# Runs a job file on a local CPU cluster: one muonmesh-worker --standalone
# process per rank on loopback, meeting through a fresh store folder. Rank 0's
# output (per-step loss) goes to stdout; every rank's log is kept under the
# job's run folder. If any rank fails, the others are stopped and the script
# exits non-zero.
#
#   deploy/local/run-job.sh JOB.yaml [--timeout-seconds N]
#
# Expects a build in ${MUONMESH_BUILD_DIR:-build} (run-example.sh builds one).
set -euo pipefail

[[ $# -ge 1 ]] || { echo "usage: $0 JOB.yaml [--timeout-seconds N]" >&2; exit 2; }
job=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
worker="${MUONMESH_BUILD_DIR:-$root/build}/worker/muonmesh-worker"
[[ -x "$worker" ]] || { echo "no $worker: build first (deploy/local/run-example.sh)" >&2; exit 2; }
[[ -f "$job" ]] || { echo "no job file $job" >&2; exit 2; }

# world_size from the job file (YAML or JSON, top-level key).
world=$(sed -n 's/^[[:space:]"]*world_size"\{0,1\}[[:space:]]*:[[:space:]]*\([0-9]\{1,\}\).*/\1/p' "$job" | head -n 1)
[[ -n "$world" ]] || { echo "$job: no world_size" >&2; exit 2; }

logs=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-job.XXXXXX")
store="$logs/store"
mkdir -p "$store"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

for ((r = 1; r < world; ++r)); do
  "$worker" --standalone --job "$job" --rank "$r" --world-size "$world" --store "$store" "$@" \
    >"$logs/rank$r.log" 2>&1 &
  pids+=($!)
done
"$worker" --standalone --job "$job" --rank 0 --world-size "$world" --store "$store" "$@" \
  2> >(tee "$logs/rank0.err" >&2) &
pids+=($!)

status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    status=1
  fi
done
if ((status != 0)); then
  echo "run-job: a rank failed; logs in $logs" >&2
  for f in "$logs"/rank*.log; do [[ -s "$f" ]] && { echo "--- $f" >&2; tail -n 5 "$f" >&2; }; done
  exit 1
fi
rm -rf "$logs"
