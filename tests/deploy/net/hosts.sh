# Hosts on one machine, for the network benches and tests (sourced, bash):
# each host is a network namespace with its own address, joined to the others
# by linkem (linkem.cc), a user-space switch that can delay, rate-limit, lose
# and cut frames. Needs root, iproute2 and /dev/net/tun.
#
#   source tests/deploy/net/hosts.sh
#   net_start BUILD_DIR HOST...   the hosts (names of one to three characters)
#   net_addr HOST                 its address
#   net_in HOST CMD...            runs CMD in HOST's namespace
#   net_ns HOST                   the namespace's name: `ip netns exec "$(net_ns H)" CMD &`
#                                 leaves CMD's own pid in $! (net_in's is a subshell's)
#   net_do LINE                   a linkem command (delay 2, cut 1 2, ...), applied
#                                 before it returns; fails on linkem's error
#   net_stats                     every host's frame counts, a line each
#   net_stop                      removes all of it (call it from the EXIT trap)
#
# net_start returns 77 (ctest's skip) where namespaces cannot be made.

net_tag=""
net_dir=""
net_linkem_pid=""
net_hosts=()
declare -A net_addrs=()

net_start() {
  local build=$1 i=0 host
  shift
  [[ $(id -u) == 0 ]] || { echo "SKIPPED: network namespaces need root"; return 77; }
  command -v ip >/dev/null || { echo "SKIPPED: no ip command (iproute2)"; return 77; }
  [[ -c /dev/net/tun ]] || { echo "SKIPPED: no /dev/net/tun"; return 77; }
  net_tag="ml$$"  # interface names stay under 16 characters
  net_hosts=("$@")
  ip netns add "${net_tag}${1}" 2>/dev/null || {
    echo "SKIPPED: cannot make a network namespace here"
    return 77
  }
  net_dir=$(mktemp -d "${TMPDIR:-/tmp}/muonmesh-net.XXXXXX")
  mkfifo "$net_dir/control"
  "$build/tests/deploy/net/linkem" --prefix "${net_tag}t" --hosts "$(IFS=,; echo "$*")" \
    --control "$net_dir/control" > "$net_dir/linkem.log" 2>&1 &
  net_linkem_pid=$!
  for _ in $(seq 100); do
    grep -q '^ready' "$net_dir/linkem.log" && break
    kill -0 "$net_linkem_pid" 2>/dev/null || { cat "$net_dir/linkem.log"; return 1; }
    sleep 0.05
  done
  local prefix="10.$((RANDOM % 200 + 20)).$((RANDOM % 250))"
  for host in "$@"; do
    local ns="${net_tag}${host}" dev="${net_tag}t${host}"
    ip netns add "$ns" 2>/dev/null || true
    ip link set "$dev" netns "$ns"
    # 9000-byte frames: a sixth of the frames linkem forwards at 1500.
    ip -n "$ns" link set "$dev" mtu 9000 up
    ip -n "$ns" addr add "$prefix.$((10 + i))/24" dev "$dev"
    ip -n "$ns" link set lo up
    net_addrs[$host]="$prefix.$((10 + i))"
    i=$((i + 1))
  done
}

net_addr() { echo "${net_addrs[$1]}"; }

net_ns() { echo "${net_tag}$1"; }

net_in() {
  local host=$1
  shift
  ip netns exec "${net_tag}${host}" "$@"
}

net_do() {
  local before
  before=$(grep -c '^\(ok\|error\): ' "$net_dir/linkem.log" || true)
  echo "$*" > "$net_dir/control"
  for _ in $(seq 200); do
    local answers
    answers=$(grep '^\(ok\|error\): ' "$net_dir/linkem.log" || true)
    if (( $(wc -l <<<"$answers") > before )) && [[ -n $answers ]]; then
      local last
      last=$(tail -1 <<<"$answers")
      [[ $last == ok:* ]] && return 0
      echo "linkem: $last" >&2
      return 1
    fi
    sleep 0.01
  done
  echo "linkem did not answer '$*'" >&2
  return 1
}

# Every host's frame counts now (linkem prints them before its "ok: stats").
net_stats() {
  net_do stats
  grep '^host ' "$net_dir/linkem.log" | tail -"${#net_hosts[@]}"
}

net_stop() {
  if [[ -n $net_linkem_pid ]]; then
    kill "$net_linkem_pid" 2>/dev/null
    wait "$net_linkem_pid" 2>/dev/null
  fi
  local host
  for host in "${net_hosts[@]}"; do ip netns del "${net_tag}${host}" 2>/dev/null || true; done
  [[ -n $net_dir ]] && rm -rf "$net_dir"
  net_linkem_pid="" net_dir="" net_hosts=() net_addrs=()
  return 0
}
