#!/usr/bin/env bash
# Runs e2e_observe.mjs (see its header); skips (77) without node. The report
# lands in --out DIR/report.png.
exec "$(dirname "${BASH_SOURCE[0]}")/node_or_skip.sh" e2e_observe.mjs "$@"
