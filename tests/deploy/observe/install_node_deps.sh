#!/usr/bin/env bash
# Installs the npm packages of package.json (pinned by package-lock.json)
# into DIR/node_modules with `npm ci`: the Kubernetes and prometheus-operator
# schema validators and the PromQL grammar that the deploy/observe checks
# use. Idempotent: nothing is fetched when DIR already holds this lockfile's
# install. Needs node and npm (Debian: nodejs npm) and the npm registry.
#
#   tests/deploy/observe/install_node_deps.sh DIR
# Exits 77 (ctest's skip) when node or npm is missing, or 1 under CI (CI
# set), where the checks must run.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${1:?usage: $0 DIR}

for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    if [[ -n "${CI:-}" ]]; then
      echo "FAIL: $tool is not installed (Debian: apt-get install nodejs npm); CI must run these checks" >&2
      exit 1
    fi
    echo "SKIP: $tool is not installed (Debian: apt-get install nodejs npm)" >&2
    exit 77
  fi
done

mkdir -p "$dir"
stamp="$dir/node_modules/.muonmesh-lock"
if [[ -f "$stamp" ]] && cmp -s "$stamp" "$here/package-lock.json"; then
  echo "install_node_deps: $dir/node_modules is up to date"
  exit 0
fi

cp "$here/package.json" "$here/package-lock.json" "$dir/"
# Bounded: a registry that does not answer fails the test instead of hanging it.
(cd "$dir" && timeout 240 npm ci --no-audit --no-fund --loglevel=error)
cp "$here/package-lock.json" "$stamp"
echo "install_node_deps: installed into $dir/node_modules"
