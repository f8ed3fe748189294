#!/usr/bin/env bash
# Runs one of this folder's Node.js checks: node_or_skip.sh SCRIPT.mjs ARGS...
# (see the script's header); exits 77 (ctest's skip) when node is missing.
set -euo pipefail
if ! command -v node >/dev/null 2>&1; then
  if [[ -n "${CI:-}" ]]; then  # CI must run the checks, not skip them
    echo "FAIL: node is not installed (Debian: apt-get install nodejs npm)" >&2
    exit 1
  fi
  echo "SKIP: node is not installed (Debian: apt-get install nodejs npm)" >&2
  exit 77
fi
script=${1:?usage: $0 SCRIPT.mjs ARGS...}
shift
exec node "$(dirname "${BASH_SOURCE[0]}")/$script" "$@"
