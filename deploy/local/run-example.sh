#!/usr/bin/env bash
# The main job: installs dependencies, builds, then
#  1. starts a local coordinator on a free loopback port and asks it, through
#     muonmeshctl, for the plan of the training job below (the MLP of
#     DESIGN.md §2 on 4 ranks as HFSDP);
#  2. trains that job on a local CPU cluster: 4 muonmesh-worker processes on
#     loopback (Gloo), printing the loss of every step and exporting the
#     final weights to runs/mlp-hfsdp/final.safetensors.
#
#   deploy/local/run-example.sh [extra muonmeshctl plan flags...]
#
# MUONMESH_BUILD_DIR overrides the build folder (default build/).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

build_dir=${MUONMESH_BUILD_DIR:-build}
deploy/local/build.sh --target muonmesh-coordinator muonmeshctl muonmesh-worker >/dev/null

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

# The plan of the example job's model (its spec file, as muonmesh-worker
# builds it from model.mlp.dims).
"$ctl" plan --coordinator "$address" --spec deploy/local/examples/mlp-32-64-64-8.yaml \
  --world-size 4 --instances 2 --device cpu "$@"

echo
echo "training deploy/local/examples/mlp-hfsdp.yaml on 4 local CPU ranks"
MUONMESH_BUILD_DIR="$build_dir" deploy/local/run-job.sh deploy/local/examples/mlp-hfsdp.yaml
