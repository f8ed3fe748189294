#!/usr/bin/env bash
# The hostile-client load run (bounded, loopback only; issue 32): a
# coordinator and 2 worker daemons training a real job, its pace measured
# alone, then SECONDS of hostile peers (floods of submits with fresh request
# ids, watches opened and abandoned, fake workers registering and vanishing,
# Store writes into scopes that are not running) while it trains on. Prints
# the coordinator's memory and the job's pace every 10 s, then the pace
# under load against the quiet one, the memory after the warm-up (the first
# minute) against the end, and whether every acknowledged submit is still
# there (exit 1 if one is missing or the job stopped).
#
#   tests/server/control/hostile_load.sh [--seconds 180] [--quiet 30] [--forget-lost-after 30s]
#       [--peers submit,watch,fake,store] [--pin]
#
# --pin puts the 2 workers on the last core and the coordinator and the
# hostile peers on the others (taskset), as a deployment puts the
# coordinator on its own machine; without it all share this machine's cores.
# MUONMESH_BUILD_DIR overrides the build folder (default build/). The run's
# logs stay in ${TMPDIR:-/tmp}/muonmesh-hostile.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$root"
build_dir=${MUONMESH_BUILD_DIR:-build}
args=()
prefix=()
while (($#)); do
  case $1 in
    --pin)
      last=$(($(nproc) - 1))
      ((last >= 1)) || { echo "hostile_load.sh: --pin needs 2 cores or more" >&2; exit 2; }
      prefix=(taskset -c "0-$((last - 1))")
      args+=(--pin 1)
      shift ;;
    *) args+=("$1"); shift ;;
  esac
done
deploy/local/build.sh --target hostile muonmesh-coordinator muonmesh-worker >/dev/null
exec "${prefix[@]}" "$build_dir/tests/server/control/hostile" \
  "$build_dir/server/muonmesh-coordinator" "$build_dir/worker/muonmesh-worker" \
  "${TMPDIR:-/tmp}/muonmesh-hostile" "${args[@]}"
