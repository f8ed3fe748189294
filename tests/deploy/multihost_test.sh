#!/usr/bin/env bash
# The service across hosts. A coordinator and four workers, each in a network
# namespace of its own (its own address on one bridge: five "hosts"), run a
# 4-rank HFSDP mlp job twice, over plaintext and over mutual TLS with role
# tokens;
# each run's exported weights must equal, byte for byte, the same job run on
# loopback by deploy/local/run-job.sh. The workers get no --address: each
# must advertise its own namespace's address (checked in `workers --json`),
# and ranks follow their --locality labels (two racks).
# Needs root and iproute2's `ip netns`; exits 77 (ctest: skipped) where
# namespaces cannot be made. Removes every namespace, link and file it makes.
#
#   tests/deploy/multihost_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
ctl="$build/client/muonmeshctl"

skip() { echo "SKIPPED: $*"; exit 77; }
[[ $(id -u) == 0 ]] || skip "making network namespaces needs root"
command -v ip >/dev/null || skip "no ip command (iproute2)"
tag="mm$$"  # interface names stay under 16 characters
ip netns add "${tag}c" 2>/dev/null || skip "cannot make a network namespace here"

work=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-multihost.XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in c 0 1 2 3; do ip netns del "${tag}$n" 2>/dev/null || true; done
  ip link del "${tag}br" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -20 "$f"; done; exit 1; }

# One bridge in this namespace; a veth from it into each host's namespace.
net="10.$((RANDOM % 200 + 20)).$((RANDOM % 250))"
ip link add "${tag}br" type bridge
ip addr add "$net.1/24" dev "${tag}br"
ip link set "${tag}br" up
host() {  # NAME LAST_OCTET
  local ns="${tag}$1"
  ip netns add "$ns" 2>/dev/null || true
  ip link add "${tag}v$1" type veth peer name "${tag}p$1"
  ip link set "${tag}p$1" netns "$ns"
  ip link set "${tag}v$1" master "${tag}br"
  ip link set "${tag}v$1" up
  ip -n "$ns" addr add "$net.$2/24" dev "${tag}p$1"
  ip -n "$ns" link set "${tag}p$1" up
  ip -n "$ns" link set lo up
}
host c 10
for i in 0 1 2 3; do host "$i" $((11 + i)); done
coordinator="$net.10:50051"

# Waits up to 30 s for PATTERN in FILE.
wait_for() {
  for _ in $(seq 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  fail "no '$2' in $1"
}

# The job, once per run, its outputs in DIR.
job() {  # NAME DIR
  sed -e "s/^name: .*/name: $1/" \
      -e "s#^output: .*#output: {dir: $2, export: $2/final.safetensors}#" \
      "$root/deploy/local/examples/mlp-hfsdp.yaml" > "$work/$1.yaml"
  echo "$work/$1.yaml"
}

# The reference: the same job on loopback, one process per rank.
MUONMESH_BUILD_DIR="$build" "$root/deploy/local/run-job.sh" "$(job loopback "$work/loopback")" \
  > "$work/loopback.log" 2>&1 || fail "the loopback run failed"

# MODE: plain or tls. Starts the coordinator and the workers in their
# namespaces, submits the job from this one, waits for it, compares.
run() {
  local mode=$1 state="$work/state-$1" coordinator_flags=() worker_flags=()
  pids=()
  if [[ $mode == tls ]]; then
    bash "$root/tests/server/auth/make_test_certs.sh" "$work/certs" >/dev/null
    printf 'worker worker-token-3c9a5e7b21\nsubmitter submitter-token-8d2f6a1c44\n' \
      > "$work/certs/tokens"
    echo worker-token-3c9a5e7b21 > "$work/certs/worker.token"
    echo submitter-token-8d2f6a1c44 > "$work/certs/submitter.token"
    chmod 600 "$work/certs/tokens" "$work/certs"/*.token
    coordinator_flags=(--tls-cert "$work/certs/server.pem" --tls-key "$work/certs/server.key"
                       --tokens-file "$work/certs/tokens")
    # Mutual TLS (the coordinator reads the CA from MUONMESH_TLS_CA below):
    # the workers present their client certificate.
    worker_flags=(--tls-ca "$work/certs/ca.pem" --tls-cert "$work/certs/worker.pem"
                  --tls-key "$work/certs/worker.key" --token-file "$work/certs/worker.token")
    # The test certificate names localhost; the coordinator is reached by address.
    export MUONMESH_TLS_SERVER_NAME=localhost MUONMESH_TLS_CA="$work/certs/ca.pem"
    export MUONMESH_TOKEN_FILE="$work/certs/submitter.token"
  else
    coordinator_flags=(--insecure)
  fi
  ip netns exec "${tag}c" "$build/server/muonmesh-coordinator" --listen "$coordinator" \
    --data-dir "$state" "${coordinator_flags[@]}" > "$work/$mode-coordinator.log" 2>&1 &
  pids+=($!)
  wait_for "$work/$mode-coordinator.log" "listening on"
  # Two "racks", alternating: ranks 0 and 1 must go to rack a's workers
  # (w1, w3), whatever order the four register in.
  for i in 0 1 2 3; do
    ip netns exec "${tag}$i" "$build/worker/muonmesh-worker" --coordinator "$coordinator" \
      --worker-id "w$i" --locality "rack-$( ((i % 2)) && echo a || echo b)/host-$i" \
      --memory-budget 2GiB "${worker_flags[@]}" \
      > "$work/$mode-w$i.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2 3; do wait_for "$work/$mode-w$i.log" "registered as"; done

  local workers
  workers=$("$ctl" workers --json --coordinator "$coordinator")
  for i in 0 1 2 3; do
    grep -q "\"$net.$((11 + i))" <<<"$workers" ||
      fail "w$i does not advertise its own address $net.$((11 + i)): $workers"
  done
  "$ctl" workers --coordinator "$coordinator" | grep -q "  in rack-a/host-1" ||
    fail "$mode: \`workers\` does not show w1's locality"
  local id
  id=$("$ctl" submit "$(job "$mode" "$work/$mode")" --coordinator "$coordinator" | tail -1)
  for _ in $(seq 600); do
    state_now=$("$ctl" status "$id" --json --coordinator "$coordinator")
    grep -q '"state": "SUCCEEDED"' <<<"$state_now" && break
    grep -qE '"state": "(FAILED|CANCELLED)"' <<<"$state_now" && fail "$mode: $state_now"
    sleep 0.5
  done
  grep -q '"state": "SUCCEEDED"' <<<"$state_now" || fail "$mode: not done after 300 s"
  cmp "$work/loopback/final.safetensors" "$work/$mode/final.safetensors" ||
    fail "$mode: the weights differ from loopback's"
  for i in 0 1 2 3; do
    local want='[01]'
    ((i % 2)) || want='[23]'
    grep -qE "rank $want\] " "$work/$mode-w$i.log" ||
      fail "$mode: w$i (rack-$( ((i % 2)) && echo a || echo b)) did not run rank $want by locality"
  done
  echo "multihost $mode: 4 ranks on 4 hosts, weights byte-identical to loopback, ranks by locality"
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  unset MUONMESH_TLS_SERVER_NAME MUONMESH_TLS_CA MUONMESH_TOKEN_FILE
}

run plain
run tls
