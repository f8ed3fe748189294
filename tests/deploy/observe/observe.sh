#!/usr/bin/env bash
# Runs observe.mjs (see its header for the checks); skips (77) without node.
exec "$(dirname "${BASH_SOURCE[0]}")/node_or_skip.sh" observe.mjs "$@"
