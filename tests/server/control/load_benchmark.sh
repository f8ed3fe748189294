#!/usr/bin/env bash
# Load benchmark of the coordinator's read path, on loopback, bounded in time:
# a coordinator and 4 CPU workers train an MLP job while 64 clients (each on
# its own connection) call GetJob, ListJobs and GetJobMetrics as fast as they
# can, or at a set rate (tests/server/control/jobs_load.cc). Prints the RPC
# rate and p50/p99 latency per method, and the job's median step time in
# windows of equal length that alternate quiet and loaded; each loaded
# window's slowdown is its median over the mean of the quiet ones either
# side, and the figure is the median over the rounds, all from one run.
#
#   tests/server/control/load_benchmark.sh [--clients 64] [--seconds 10]
#       [--rate 0] [--rounds 3] [--dims 64,512,512,64] [--pin]
#
# --rate: calls per second of each client on a fixed schedule (0, the
# default: each as fast as it can, which measures saturation). --pin puts
# the workers on the last core and the coordinator and the clients on the
# others (taskset), as a deployment puts them on different machines: what is
# left is the interference through the kernel, loopback and memory.
#
# Needs the build (deploy/local/build.sh) in ${MUONMESH_BUILD_DIR:-build}.
# Not part of the test suite: its figures go to BENCHMARKS.md.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
build=${MUONMESH_BUILD_DIR:-$root/build}
clients=64
seconds=10
dims=64,512,512,64
rate=0
rounds=3
pin=0
while (($#)); do
  case $1 in
    --clients) clients=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --dims) dims=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --pin) pin=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "load_benchmark.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

coordinator=$build/server/muonmesh-coordinator
worker=$build/worker/muonmesh-worker
ctl=$build/client/muonmeshctl
load=$build/tests/server/control/jobs_load
for bin in "$coordinator" "$worker" "$ctl" "$load"; do
  [[ -x $bin ]] || { echo "load_benchmark.sh: $bin is missing: build first" >&2; exit 2; }
done

serve=()
train=()
if ((pin)); then
  last=$(($(nproc) - 1))
  ((last >= 1)) || { echo "load_benchmark.sh: --pin needs 2 cores or more" >&2; exit 2; }
  serve=(taskset -c "0-$((last - 1))")
  train=(taskset -c "$last")
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-load.XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

"${serve[@]}" "$coordinator" --listen 127.0.0.1:0 --data-dir "$work/state" >"$work/coordinator.log" 2>&1 &
pids+=($!)
address=""
for _ in $(seq 100); do
  address=$(sed -n 's/^muonmesh-coordinator listening on //p' "$work/coordinator.log" | head -n 1)
  [[ -n $address ]] && break
  sleep 0.1
done
[[ -n $address ]] || { cat "$work/coordinator.log" >&2; exit 1; }
export MUONMESH_COORDINATOR=$address
for i in 0 1 2 3; do
  "${train[@]}" "$worker" --coordinator "$address" --worker-id "load-$i" --memory-budget 1GiB \
    >"$work/worker-$i.log" 2>&1 &
  pids+=($!)
done

cat >"$work/job.yaml" <<EOF
name: load-benchmark
world_size: 4
device: cpu
parallelism: {data_parallel_sharding_strategy: optim_grads_params}
model: {mlp: {dims: [$dims]}}
init: {seed: 1}
data: {teacher: {seed: 2, samples: 4096}}
training: {steps: 1000000, global_batch_size: 64}
output: {dir: $work/out}
EOF
job=$("$ctl" submit "$work/job.yaml" 2>/dev/null | tail -n 1)

steps_done() {
  "$ctl" status "$job" --json | sed -n 's/.*"steps_done":"\{0,1\}\([0-9]*\).*/\1/p'
}
# Median step time (ms) of steps [FROM, TO) from the job's records (rank 0's
# step time is the slowest rank's wall time of the step).
median_ms() {
  "$ctl" metrics "$job" --format csv | awk -F, -v a="$1" -v b="$2" \
    'NR > 1 && $1 >= a && $1 < b { print $5 * 1000 }' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print v[int((NR + 1) / 2)] }'
}

# Warm up: 20 steps.
for _ in $(seq 600); do
  [[ $(steps_done) -ge 20 ]] 2>/dev/null && break
  sleep 0.1
done

# Windows of equal length: quiet, loaded, quiet, ..., quiet (--rounds loaded
# ones); each loaded window is compared with the quiet ones either side.
marks=("$(steps_done)")
for ((r = 0; r < rounds; ++r)); do
  sleep "$seconds"
  marks+=("$(steps_done)")
  "${serve[@]}" "$load" --coordinator "$address" --job "$job" --clients "$clients" --seconds "$seconds" \
    --rate "$rate" >"$work/load-$r.txt"
  marks+=("$(steps_done)")
done
sleep "$seconds"
marks+=("$(steps_done)")
"$ctl" cancel "$job" >/dev/null

echo "load benchmark: $clients clients (rate ${rate}/s each, 0: unpaced) x ${seconds} s," \
  "$rounds rounds, on $(nproc) cores$( ((pin)) && echo " (workers pinned to core $last, the rest to 0-$((last - 1)))"); 4 CPU workers, mlp [$dims]"
for ((r = 0; r < rounds; ++r)); do
  sed "s/^/round=$r /" "$work/load-$r.txt"
done
ratios=()
for ((r = 0; r < rounds; ++r)); do
  i=$((2 * r))
  before=$(median_ms "${marks[i]}" "${marks[i + 1]}")
  loaded=$(median_ms "${marks[i + 1]}" "${marks[i + 2]}")
  after=$(median_ms "${marks[i + 2]}" "${marks[i + 3]}")
  ratio=$(awk -v b="$before" -v l="$loaded" -v a="$after" 'BEGIN { printf "%.3f", l / ((b + a) / 2) }')
  ratios+=("$ratio")
  echo "round=$r step_ms quiet_before=$before loaded=$loaded quiet_after=$after ratio=$ratio" \
    "(steps $((marks[i + 1] - marks[i])), $((marks[i + 2] - marks[i + 1])), $((marks[i + 3] - marks[i + 2])))"
done
printf '%s\n' "${ratios[@]}" | sort -g |
  awk '{ v[NR] = $1 } END { printf "step_time_ratio loaded/quiet median of %d rounds=%s\n", NR, v[int((NR + 1) / 2)] }'
