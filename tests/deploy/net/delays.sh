#!/usr/bin/env bash
# The network delay bench (issue 44): the quickstart's 4-rank GPT (HFSDP),
# each rank on a host of its own (network namespaces on linkem, hosts.sh),
# run once per one-way delay between hosts, printing the median step time
# and the median time of each communication phase against the run without a
# delay, the share of the step spent waiting in collectives (exposed
# communication), the collective calls a rank makes per step (each a few round trips
# one after another: what a delay multiplies), the frames linkem forwarded
# per step (every host's, both ways) and those a full link queue dropped;
# on a rate-limited link, issue 44's allowance (twice the no-delay step plus
# the time the busiest rank's bytes of a step need at the rate) and whether
# the step is within it.
#
#   tests/deploy/net/delays.sh BUILD_DIR [DELAY_MS[@RATE_MBIT]...]
#
# Default delays: 0 0.5 2 20@100 (20 ms with a 100 Mbit/s rate on every host
# link). STEPS (default 40) sets the job's steps; the first 5 (warm-up) are
# left out of the medians; BUCKET_BYTES sets the job's
# communication.bucket_bytes (default: the job's default); PREFETCH=false
# turns communication.prefetch off; WINDOW sets communication.window_bytes
# (each exchange's bytes in flight to a rank); MUON_BUFFER_BYTES sets
# optimizer.muon_buffer_bytes (the Muon phase in waves) and
# MUON_IN_BACKWARD=false turns communication.muon_in_backward off;
# OVERLAP_PARAM_GATHER=false turns communication.overlap_param_gather off
# (the step waits for its after-step gathers);
# RESHARD_AFTER_FORWARD sets communication.reshard_after_forward (false:
# the units held gathered from the forward pass to the backward one; true:
# gathered again; unset, the job's default: held when the model fits one
# bucket, as the quickstart's does); CLIP sets
# training.clip_grad_norm (none: no clipping); KEEP_CWND=1 sets
# net.ipv4.tcp_slow_start_after_idle=0 on the worker hosts (TCP keeps its
# congestion window across the idle time between a step's bursts); WORLD
# (default 4) runs that many worker hosts and ranks, and MODEL replaces the
# job's model section (a YAML flow mapping, e.g. "{gpt: {vocab_size: 256,
# block_size: 128, n_layer: 8, n_head: 8, n_embd: 256, seq_len: 128}}"). Needs root; exits 77 where namespaces cannot be
# made; removes every namespace and file it makes.
set -euo pipefail
build=$(cd "${1:?usage: $0 BUILD_DIR [DELAY_MS[@RATE_MBIT]...]}" && pwd)
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
delays=("$@")
((${#delays[@]})) || delays=(0 0.5 2 20@100)
steps=${STEPS:-40}
source "$root/tests/deploy/net/hosts.sh"

work=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-delays.XXXXXX")
pids=()
cleanup() {
  set +e
  local pid
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  ((${#pids[@]} == 0)) || wait "${pids[@]}" 2>/dev/null
  net_stop
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' TERM INT
world=${WORLD:-4}
workers=()
for ((i = 0; i < world; i++)); do workers+=("w$i"); done
net_start "$build" x c "${workers[@]}" || exit $?
coordinator="$(net_addr c):50051"
ctl() { net_in x "$build/client/muonmeshctl" --coordinator "$coordinator" "$@"; }

if [[ ${KEEP_CWND:-0} == 1 ]]; then
  for ((i = 0; i < world; i++)); do
    ip netns exec "$(net_ns "w$i")" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0
  done
fi
ip netns exec "$(net_ns c)" "$build/server/muonmesh-coordinator" --listen "$coordinator" \
  --insecure --data-dir "$work/state" > "$work/coordinator.log" 2>&1 &
pids+=($!)
for ((i = 0; i < world; i++)); do
  ip netns exec "$(net_ns "w$i")" "$build/worker/muonmesh-worker" --coordinator "$coordinator" \
    --worker-id "w$i" --memory-budget 2GiB > "$work/w$i.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 300); do
  [[ $(ctl workers --json 2>/dev/null | grep -c '"IDLE"') == "$world" ]] && break
  sleep 0.1
done

# Runs the job once at DELAY[@RATE]; prints its row.
run() {
  local delay=${1%@*} rate=0 name="d${1//[@.]/_}"
  [[ $1 == *@* ]] && rate=${1#*@}
  net_do delay "$delay"
  net_do rate "$rate"
  sed -e "s/^name: .*/name: $name/" -e "s/^  steps: .*/  steps: $steps/" \
      -e "/^  eval_every: /d" -e "/^  eval_batches: /d" \
      -e "s/decay_steps: 75/decay_steps: $((steps / 4))/" \
      -e "s/warmup_steps: 10/warmup_steps: $((steps < 40 ? steps / 4 : 10))/" \
      -e "s#^output: .*#output: {dir: $work/$name}#" \
      -e "s/^world_size: .*/world_size: $world/" \
      "$root/deploy/local/examples/gpt-text.yaml" > "$work/$name.yaml"
  [[ -z ${MODEL:-} ]] || sed -i "/^  gpt: /d; s/^model:.*/model: $MODEL/" "$work/$name.yaml"
  case ${CLIP:-} in
    '') ;;
    none) sed -i "/^  clip_grad_norm: /d" "$work/$name.yaml" ;;
    *) sed -i "s/^  clip_grad_norm: .*/  clip_grad_norm: $CLIP/" "$work/$name.yaml" ;;
  esac
  local comm=()
  [[ -z ${BUCKET_BYTES:-} ]] || comm+=("bucket_bytes: $BUCKET_BYTES")
  [[ -z ${PREFETCH:-} ]] || comm+=("prefetch: $PREFETCH")
  [[ -z ${WINDOW:-} ]] || comm+=("window_bytes: $WINDOW")
  [[ -z ${MUON_IN_BACKWARD:-} ]] || comm+=("muon_in_backward: $MUON_IN_BACKWARD")
  [[ -z ${OVERLAP_PARAM_GATHER:-} ]] || comm+=("overlap_param_gather: $OVERLAP_PARAM_GATHER")
  [[ -z ${RESHARD_AFTER_FORWARD:-} ]] || comm+=("reshard_after_forward: $RESHARD_AFTER_FORWARD")
  [[ -z ${MUON_BUFFER_BYTES:-} ]] ||
    sed -i "s/^optimizer:\$/optimizer:\n  muon_buffer_bytes: $MUON_BUFFER_BYTES/" "$work/$name.yaml"
  ((${#comm[@]} == 0)) || (IFS=,; echo "communication: {${comm[*]}}") >> "$work/$name.yaml"
  local id frames_before frames_after drops_before drops_after
  id=$(ctl submit "$work/$name.yaml" 2> "$work/$name.submit.err" | tail -1)
  [[ -n $id ]] || { cat "$work/$name.submit.err"; exit 1; }
  frames_before=$(net_stats | awk '{s += $4} END {print s}')
  drops_before=$(net_stats | awk '{s += $12} END {print s}')
  ctl watch "$id" --timeout 3600 > "$work/$name.watch" 2>&1 || {
    echo "job at $1 failed:"
    tail -5 "$work/$name.watch"
    exit 1
  }
  frames_after=$(net_stats | awk '{s += $4} END {print s}')
  drops_after=$(net_stats | awk '{s += $12} END {print s}')
  ctl metrics "$id" --json > "$work/$name.json"
  python3 - "$1" "$work/$name.json" "$work/base.txt" "$(( (frames_after - frames_before) / steps ))" \
    "$(( (drops_after - drops_before) / steps ))" <<'EOF'
import json, os, statistics, sys
label, records_file, base_file, frames, drops = sys.argv[1:6]
records = [r for r in json.load(open(records_file))["records"] if r["step"] >= 5]
phases = ["param_gather", "grad_reduce", "muon_gather", "muon_scatter",
          "param_allgather_after_step"]
med = {"step": statistics.median(r["step_seconds"] for r in records)}
for p in phases:
    med[p] = statistics.median(r["phases"].get(p, 0.0) for r in records)
if not os.path.exists(base_file):
    json.dump(med, open(base_file, "w"))
base = json.load(open(base_file))
cells = ["%.3f s (%.2fx)" % (med[k], med[k] / base[k] if base[k] else 0) for k in ["step"] + phases]
calls = statistics.median(r.get("collective_calls", 0) for r in records)
hidden = statistics.median(r["phases"].get("grad_reduce_hidden", 0.0) for r in records)
ahead = statistics.median(r["phases"].get("param_gather_hidden", 0.0) for r in records)
early = statistics.median(r["phases"].get("muon_gather_hidden", 0.0) for r in records)
# Exposed communication: the step's time waiting in collectives (every
# communication phase, the token exchanges included), as a share of it.
waited = phases + ["expert_dispatch"]
exposed = statistics.median(sum(r["phases"].get(p, 0.0) for p in waited) / r["step_seconds"]
                            for r in records if r["step_seconds"] > 0)
# Issue 44's allowance on a rate-limited link: twice the no-delay step plus
# the time the busiest rank's bytes of a step need at the link's rate.
target = "-"
if "@" in label:
    rate = float(label.split("@")[1]) * 1e6 / 8
    sent = max(sum(r.get("bytes_sent", {}).values()) for r in records)
    allow = 2 * base["step"] + sent / rate
    over = med["step"] / allow - 1
    target = "%.3f s: %s" % (allow, "met" if over <= 0 else "%.1f %% over" % (100 * over))
print("| %s | %s | %.3f s | %.3f s | %.3f s | %.1f %% | %g | %s | %s | %s |" % (
    label, " | ".join(cells), hidden, ahead, early, 100 * exposed, calls, frames, drops, target))
EOF
}

echo "delays: ${delays[*]} ms one way; $world ranks; model ${MODEL:-of the quickstart};" \
  "$steps steps a run, medians of steps 5 on;" \
  "communication.bucket_bytes ${BUCKET_BYTES:-default}, prefetch ${PREFETCH:-default}, window_bytes ${WINDOW:-default}," \
  "muon_in_backward ${MUON_IN_BACKWARD:-default}, reshard_after_forward ${RESHARD_AFTER_FORWARD:-default}," \
  "overlap_param_gather ${OVERLAP_PARAM_GATHER:-default};" \
  "optimizer.muon_buffer_bytes ${MUON_BUFFER_BYTES:-default};" \
  "training.clip_grad_norm ${CLIP:-of the quickstart};" \
  "tcp_slow_start_after_idle" \
  "$( ((${KEEP_CWND:-0})) && echo 0 || echo 1)"
# The socket limits Gloo's connections live with (it sets no buffer sizes of
# its own; new namespaces start from these): the largest receive and send
# buffers TCP's autotuning grows to, against a link's bandwidth-delay product.
echo "tcp: congestion control $(cat /proc/sys/net/ipv4/tcp_congestion_control)," \
  "autotuned buffers up to $(awk '{print $3}' /proc/sys/net/ipv4/tcp_rmem) bytes receiving," \
  "$(awk '{print $3}' /proc/sys/net/ipv4/tcp_wmem) sending"
echo "| one-way delay ms[@Mbit/s] | step | param_gather | grad_reduce | muon_gather | muon_scatter | param_allgather_after_step | grad_reduce_hidden | param_gather_hidden | muon_gather_hidden | exposed communication | calls a step | frames a step | queue drops a step | target (2 x no-delay + bytes at the rate) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for d in "${delays[@]}"; do run "$d"; done
