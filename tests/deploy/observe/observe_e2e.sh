#!/usr/bin/env bash
# Runs e2e_observe.mjs with Node.js (see its header); exits 77 (ctest's skip)
# when node is missing. The report lands in --out DIR/report.png.
set -euo pipefail
if ! command -v node >/dev/null 2>&1; then
  echo "SKIP: node is not installed (Debian: apt-get install nodejs npm)" >&2
  exit 77
fi
exec node "$(dirname "${BASH_SOURCE[0]}")/e2e_observe.mjs" "$@"
