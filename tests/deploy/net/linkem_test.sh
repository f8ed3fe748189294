#!/usr/bin/env bash
# linkem against what it promises, between two hosts (namespaces): a TCP
# echo's round trip is at least twice the one-way delay set (and below it
# without one); a cut pair cannot connect, and after `join` it can; a rate
# limit bounds the bytes a second that get through; a refused command is
# answered with an error naming it. Exits 77 (skipped) where namespaces
# cannot be made.
#
#   tests/deploy/net/linkem_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
source "$root/tests/deploy/net/hosts.sh"
server=""
cleanup() {
  set +e
  [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  net_stop
}
trap cleanup EXIT
net_start "$build" a b || exit $?
fail() { echo "FAIL: $*"; exit 1; }

# An echo server on b: every connection gets its bytes back.
ip netns exec "$(net_ns b)" python3 -c "
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('$(net_addr b)', 7000)); s.listen(64)
def serve(c):
    while True:
        d = c.recv(1 << 20)
        if not d: break
        c.sendall(d)
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
" &
server=$!

# Prints "RTT_MS MBIT_PER_S" for one connection from a (20 one-byte round
# trips, then 4 MiB echoed), or "unreachable" when it cannot connect in 3 s.
probe() {
  net_in a python3 -c "
import socket, threading, time
try:
    s = socket.create_connection(('$(net_addr b)', 7000), timeout=3)
except OSError:
    print('unreachable'); raise SystemExit
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.settimeout(30)
rtts = []
for _ in range(20):
    t = time.perf_counter(); s.sendall(b'x'); s.recv(1); rtts.append(time.perf_counter() - t)
payload = b'y' * (4 << 20); got = 0
# Sent from a thread while this one reads the echo: a sender that read only
# afterwards would stall once both sockets' buffers are full.
t = time.perf_counter()
sender = threading.Thread(target=s.sendall, args=(payload,)); sender.start()
while got < len(payload): got += len(s.recv(1 << 20))
sender.join()
print('%.3f %.1f' % (min(rtts) * 1e3, 2 * len(payload) * 8 / (time.perf_counter() - t) / 1e6))
"
}
for _ in $(seq 50); do [[ $(probe) != unreachable ]] && break; sleep 0.1; done

# RTT_MS MBIT_PER_S of one probe, or the test fails naming what it printed.
measure() {
  local out
  out=$(probe 2>&1) || true
  [[ $out =~ ^[0-9.]+\ [0-9.]+$ ]] || { echo "FAIL: the probe failed: $out" >&2; exit 1; }
  echo "$out"
}
# Fails with MESSAGE unless the Python expression EXPR holds.
holds() { python3 -c "import sys; sys.exit(0 if $1 else 1)" || fail "$2"; }
m=$(measure)
read -r rtt _ <<<"$m"
holds "$rtt < 5" "round trip $rtt ms with no delay"
net_do delay 10
m=$(measure)
read -r rtt _ <<<"$m"
holds "$rtt >= 20" "round trip $rtt ms with a 10 ms one-way delay (at least 20)"
echo "delay: round trip $rtt ms at 10 ms one way"
net_do reset
net_do rate 20
m=$(measure)
read -r _ mbit <<<"$m"
# Each host link carries 20 Mbit/s each way: the echo's bytes, out and back,
# cannot pass faster than 2 x 20 (5 % for the clock).
holds "$mbit <= 2 * 20 * 1.05" "$mbit Mbit/s through a 20 Mbit/s link"
echo "rate: $mbit Mbit/s echoed through 20 Mbit/s links (<= 40)"
net_do reset
net_do cut a b
[[ $(probe) == unreachable ]] || fail "a cut pair connected"
net_do join a b
[[ $(probe) != unreachable ]] || fail "a joined pair could not connect"
echo "cut: no connection; joined: connects"
if net_do cut a nosuchhost 2>/dev/null; then fail "a cut of an unknown host was accepted"; fi
echo "linkem: all checks passed"
