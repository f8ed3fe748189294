#!/usr/bin/env bash
# Installs dependencies, builds everything (Release, Ninja) in build/ and runs
# every test. What CI runs; works incrementally in a developer's tree too.
# MUONMESH_BUILD_DIR overrides the build folder.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

build_dir=${MUONMESH_BUILD_DIR:-build}
deploy/local/build.sh

# Per-test timeout: a hung test fails alone instead of eating CI's budget.
ctest --test-dir "$build_dir" --output-on-failure -j2 --timeout 300
