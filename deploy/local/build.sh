#!/usr/bin/env bash
# Installs missing packages, configures (Release, Ninja on first configure)
# and builds into ${MUONMESH_BUILD_DIR:-build}. Extra arguments go to
# `cmake --build` (for example `--target muonmesh-worker`).
# Shared by tests/run.sh and deploy/local/run-example.sh.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

deploy/local/install-deps.sh
build_dir=${MUONMESH_BUILD_DIR:-build}
configure=(cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release)
# The generator can only be chosen when the folder is first configured.
[[ -f "$build_dir/CMakeCache.txt" ]] || configure+=(-G Ninja)
"${configure[@]}"
cmake --build "$build_dir" -j"$(nproc)" "$@"
