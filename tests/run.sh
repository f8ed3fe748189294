#!/usr/bin/env bash
# Installs dependencies, builds everything (Release, Ninja) in build/ and runs
# every test. What CI runs; works incrementally in a developer's tree too.
# MUONMESH_BUILD_DIR overrides the build folder.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

deploy/local/install-deps.sh

build_dir=${MUONMESH_BUILD_DIR:-build}
configure=(cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release)
# The generator can only be chosen when the folder is first configured.
[[ -f "$build_dir/CMakeCache.txt" ]] || configure+=(-G Ninja)
"${configure[@]}"
cmake --build "$build_dir" -j"$(nproc)"

# Per-test timeout: a hung test fails alone instead of eating CI's budget.
ctest --test-dir "$build_dir" --output-on-failure -j2 --timeout 300
