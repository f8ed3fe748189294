#!/usr/bin/env bash
# The overlays' example jobs are jobs the worker accepts (muonmesh-worker
# --describe loads and validates a job file), with their outputs under the
# workers' shared volume.
#
#   tests/deploy/observe/example_jobs_test.sh MUONMESH_WORKER JOB.yaml...
set -euo pipefail

worker=${1:?usage: $0 MUONMESH_WORKER JOB.yaml...}
shift
for job in "$@"; do
  facts=$("$worker" --describe --job "$job") || { echo "FAIL: $job: the worker rejects it" >&2; exit 1; }
  echo "$job:"
  sed 's/^/  /' <<<"$facts"
  grep -q '^output_dir=/var/lib/muonmesh/runs/' <<<"$facts" ||
    { echo "FAIL: $job: output.dir is not under /var/lib/muonmesh/runs (the shared volume)" >&2; exit 1; }
done
