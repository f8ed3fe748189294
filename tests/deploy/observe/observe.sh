#!/usr/bin/env bash
# Runs observe.mjs with Node.js (see its header for the checks); exits 77
# (ctest's skip) when node is missing.
set -euo pipefail
if ! command -v node >/dev/null 2>&1; then
  echo "SKIP: node is not installed (Debian: apt-get install nodejs npm)" >&2
  exit 77
fi
exec node "$(dirname "${BASH_SOURCE[0]}")/observe.mjs" "$@"
