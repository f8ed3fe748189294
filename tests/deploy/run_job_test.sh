#!/usr/bin/env bash
# deploy/local/run-job.sh end to end, with real worker processes: a job whose
# ranks all fail in their first attempt (--fail-at-step) is restarted from
# its newest complete checkpoint and finishes with the weights of a run that
# never failed (byte-identical export); without a restart budget the script
# gives up with a non-zero exit.
#
#   tests/deploy/run_job_test.sh BUILD_DIR
set -euo pipefail

build=$(cd "$1" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/run_job_test.XXXXXX")
trap 'rm -rf "$work"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

write_job() {  # name max_restarts
  cat >"$work/$1.yaml" <<YAML
name: $1
world_size: 2
device: cpu
parallelism: {data_parallel_sharding_strategy: optim_grads_params}
model: {mlp: {dims: [4, 8, 3]}}
init: {seed: 3}
data: {teacher: {seed: 9, samples: 64}}
optimizer:
  muon: {lr: 0.02, momentum: 0.95}
  adamw: {lr: 0.001, eps: 0.05}
training: {steps: 6, global_batch_size: 8, checkpoint_every: 2, max_restarts: $2}
output: {dir: out-$1}
YAML
}

run() {  # job [flags...] -> stdout in $work/<job>.out, stderr in $work/<job>.err
  local job=$1
  shift
  MUONMESH_BUILD_DIR="$build" "$root/deploy/local/run-job.sh" "$work/$job.yaml" \
    --timeout-seconds 20 "$@" >"$work/$job.out" 2>"$work/$job.err"
}

write_job straight 0
run straight || fail "the job without faults failed: $(cat "$work/straight.err")"

write_job restarted 1
run restarted --fail-at-step 3 || fail "the restarted job failed: $(cat "$work/restarted.err")"
grep -q "attempt 0 failed" "$work/restarted.err" || fail "no failed first attempt reported"
grep -q "restarting" "$work/restarted.err" || fail "no restart reported"
grep -q "resume: from the checkpoint at step 2" "$work/restarted.out" ||
  fail "did not resume from step 2: $(cat "$work/restarted.out")"
cmp "$work/out-straight/final.safetensors" "$work/out-restarted/final.safetensors" ||
  fail "the restarted run's weights differ from the straight run's"

write_job no_budget 0
if run no_budget --fail-at-step 3; then fail "a job out of restarts exited 0"; fi
grep -q "attempt 0 failed" "$work/no_budget.err" || fail "no failure reported"
if grep -q "restarting" "$work/no_budget.err"; then fail "restarted without a budget"; fi
[[ ! -e "$work/out-no_budget/final.safetensors" ]] || fail "a failed job exported weights"

echo "run_job_test: OK"
