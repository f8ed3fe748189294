#!/usr/bin/env bash
# Runs one promtool check on each FILE and fails naming every file it
# rejects:
#   rules   promtool check rules  (rule files parse, PromQL included)
#   config  promtool check config (a Prometheus configuration and its rule files)
#   test    promtool test rules   (rule unit tests with synthetic series)
#
#   tests/deploy/observe/promtool_check.sh rules|config|test FILE...
# Exits 77 (ctest's skip) when promtool (Debian: prometheus) is missing.
set -euo pipefail

what=${1:?usage: $0 rules|config|test FILE...}
shift
case "$what" in
  rules) check=(check rules) ;;
  config) check=(check config) ;;
  test) check=(test rules) ;;
  *) echo "usage: $0 rules|config|test FILE..." >&2; exit 2 ;;
esac
if ! command -v promtool >/dev/null 2>&1; then
  if [[ -n "${CI:-}" ]]; then  # CI must run the checks, not skip them
    echo "FAIL: promtool is not installed (Debian package prometheus)" >&2
    exit 1
  fi
  echo "SKIP: promtool is not installed (Debian package prometheus)" >&2
  exit 77
fi
status=0
for file in "$@"; do
  if output=$(promtool "${check[@]}" "$file" 2>&1); then
    echo "$output"
  else
    echo "$output" >&2
    echo "FAIL: $file: promtool ${check[*]} rejects it" >&2
    status=1
  fi
done
exit "$status"
