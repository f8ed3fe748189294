#!/usr/bin/env bash
# The main job, for now: installs dependencies, builds, starts a local
# coordinator on a free loopback port and asks it, through muonmeshctl, to
# plan an example model on 16 ranks as HFSDP (2 optimizer instances) with
# 4-way expert parallelism. Later issues make this job train.
#
#   deploy/local/run-example.sh [extra muonmeshctl plan flags...]
#
# MUONMESH_BUILD_DIR overrides the build folder (default build/).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

deploy/local/install-deps.sh
build_dir=${MUONMESH_BUILD_DIR:-build}
configure=(cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release)
[[ -f "$build_dir/CMakeCache.txt" ]] || configure+=(-G Ninja)
"${configure[@]}" >/dev/null
cmake --build "$build_dir" -j"$(nproc)" --target muonmesh-coordinator muonmeshctl

coordinator="$build_dir/server/muonmesh-coordinator"
ctl="$build_dir/client/muonmeshctl"
log=$(mktemp)
"$coordinator" --listen 127.0.0.1:0 >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -f "$log"' EXIT

# Wait (bounded) for "muonmesh-coordinator listening on HOST:PORT".
address=""
for _ in $(seq 100); do
  address=$(sed -n 's/^muonmesh-coordinator listening on //p' "$log" | head -n 1)
  [[ -n "$address" ]] && break
  kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$address" ]] || { echo "coordinator did not start within 10 s" >&2; cat "$log" >&2; exit 1; }
echo "coordinator at $address"

"$ctl" plan --coordinator "$address" --spec deploy/local/examples/moe-6l.yaml \
  --world-size 16 --instances 2 --ep 4 "$@"
