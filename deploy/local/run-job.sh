#!/usr/bin/env bash
# Runs a job file on a local CPU cluster: one muonmesh-worker --standalone
# process per rank on loopback, meeting through a fresh store folder. Rank 0's
# output (per-step loss) goes to stdout; every rank's log is kept under a
# temporary folder while the job runs.
#
# If a rank fails, the others are stopped and, while the job's
# training.max_restarts allows, every rank is started again as a new attempt
# with --resume: the job continues from its newest complete checkpoint
# (training.checkpoint_every; from step 0 when there is none). The script
# exits non-zero once the attempts are used up.
#
#   deploy/local/run-job.sh JOB.yaml [WORKER FLAGS...]   e.g. --timeout-seconds 30
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

# The job's device, world size and restart budget, as the worker reads the file.
describe=$("$worker" --describe --job "$job") || exit 1
world=$(sed -n 's/^world_size=//p' <<<"$describe")
max_restarts=$(sed -n 's/^max_restarts=//p' <<<"$describe")
if [[ $(sed -n 's/^device=//p' <<<"$describe") == cuda ]]; then
  # GPU jobs need the CUDA build of the worker (the CPU one does not load cuBLAS).
  worker="${worker}-cuda"
  [[ -x "$worker" ]] || { echo "no $worker: device: cuda jobs need a build with CUDA" >&2; exit 2; }
fi

logs=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-job.XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

for ((attempt = 0; attempt <= max_restarts; ++attempt)); do
  dir="$logs/attempt-$attempt"
  mkdir -p "$dir/store"
  flags=(--attempt "$attempt" --store "$dir/store")
  ((attempt == 0)) || flags+=(--resume)
  pids=()
  for ((r = 1; r < world; ++r)); do
    "$worker" --standalone --job "$job" --rank "$r" --world-size "$world" "${flags[@]}" "$@" \
      >"$dir/rank$r.log" 2>&1 &
    pids+=($!)
  done
  "$worker" --standalone --job "$job" --rank 0 --world-size "$world" "${flags[@]}" "$@" \
    2> >(tee "$dir/rank0.err" >&2) &
  pids+=($!)

  status=0
  job_error=0
  for pid in "${pids[@]}"; do
    rc=0
    wait "$pid" || rc=$?
    ((rc == 0)) || status=1
    # 3: the job's own error (a restart cannot change it, or would resume an
    # earlier run's checkpoints): no restart.
    ((rc != 3)) || job_error=1
  done
  pids=()
  if ((status == 0)); then
    rm -rf "$logs"
    exit 0
  fi
  echo "run-job: attempt $attempt failed; logs in $dir" >&2
  for f in "$dir"/rank*.log; do
    [[ -s "$f" ]] && { echo "--- $f" >&2; tail -n 3 "$f" >&2; }
  done
  if ((job_error)); then
    echo "run-job: the job itself is at fault (see above); not restarting" >&2
    exit 1
  fi
  if ((attempt < max_restarts)); then
    echo "run-job: restarting (attempt $((attempt + 1)) of at most $max_restarts restarts)" \
      "from the newest complete checkpoint" >&2
  fi
done
exit 1
