#!/usr/bin/env bash
# The soak run (bounded, loopback only): a coordinator and 6 worker daemons,
# 20 jobs submitted, a busy worker killed every 1-3 s, 20 times (it comes back a
# second later) and the coordinator killed three times (it comes back 2 s later
# on the same address and data folder). Prints the jobs by final state, the
# reasons of those that did not succeed, the faults, and the time from each
# fault to the affected job's first step after it (median, worst; worker and
# coordinator kills apart); exits 1 if an acknowledged job is lost or does
# not succeed within the limit, or an attempt running at a coordinator kill
# was restarted for it.
#
#   tests/server/control/soak.sh [--jobs J] [--workers W] [--seconds LIMIT] [--seed S]
#
# MUONMESH_BUILD_DIR overrides the build folder (default build/). The run's
# logs stay in ${TMPDIR:-/tmp}/muonmesh-soak.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$root"
build_dir=${MUONMESH_BUILD_DIR:-build}
deploy/local/build.sh --target soak muonmesh-coordinator muonmesh-worker >/dev/null
exec "$build_dir/tests/server/control/soak" "$build_dir/server/muonmesh-coordinator" \
  "$build_dir/worker/muonmesh-worker" "${TMPDIR:-/tmp}/muonmesh-soak" "$@"
