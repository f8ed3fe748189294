#!/usr/bin/env bash
# muonmesh's optimizer step against a modded-nanogpt-style peer (issue 44),
# in one run: GPT-2 124M's shapes (specs/gpt2-124m.json) on WORLD ranks of
# this machine, each on one thread, over Gloo on loopback.
#   - muonmesh: tests/worker/optimizer_step_benchmark.sh with the owner
#     rule lpt under STRATEGY (default no_shard: every rank holds the whole
#     model, as the peer does; optim_grads_params is ZeRO-3);
#   - the peer: tests/worker/muon_peer.py (PyTorch; the Muon matrices dealt
#     out round-robin in groups of WORLD, each group all-gathered after its
#     update; AdamW on every rank for the rest).
# Prints both slowest-rank medians and their ratio (peer / muonmesh).
#
#   tests/worker/muon_peer_benchmark.sh [STEPS=4] [WORLD=4]
#
# Needs python3 with torch (PYTHON names another; Debian: apt-get install
# python3-torch, then PYTHON=/usr/bin/python3 where python3 is not Debian's) and a
# build (MUONMESH_BUILD_DIR, default build/). Minutes on 2 cores; not part
# of the test suite.
set -euo pipefail
steps=${1:-4}
world=${2:-4}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
"$python" -c 'import torch.distributed' 2>/dev/null ||
  { echo "python3 has no torch.distributed: apt-get install python3-torch" >&2; exit 2; }

ours_out=$(RULES=lpt STRATEGY=${STRATEGY:-no_shard} \
  "$root/tests/worker/optimizer_step_benchmark.sh" "$steps" 1.0 "$world")
echo "$ours_out"
ours=$(sed -n 's/^optimizer step (slowest rank, median), lpt: \([0-9.]*\) ms$/\1/p' <<<"$ours_out")
peer_out=$("$python" "$root/tests/worker/muon_peer.py" --world "$world" --steps "$steps" \
  --spec "$root/specs/gpt2-124m.json")
echo "$peer_out"
peer=$(sed -n 's/^peer_optimizer_ms=//p' <<<"$peer_out")
[[ -n $ours && -n $peer ]] || { echo "a run printed no step time" >&2; exit 1; }
awk -v o="$ours" -v p="$peer" 'BEGIN {
  printf "optimizer step: muonmesh %.1f ms, modded-nanogpt-style peer %.1f ms: %.2fx faster\n", o, p, p / o }'
