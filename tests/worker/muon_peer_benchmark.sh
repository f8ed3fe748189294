#!/usr/bin/env bash
# muonmesh's optimizer step against a modded-nanogpt-style peer (issue 44),
# in one run: GPT-2 124M's shapes (specs/gpt2-124m.json) on WORLD ranks of
# this machine, each on one thread, over Gloo on loopback.
#   - muonmesh: tests/worker/optimizer_step_benchmark.sh with the owner
#     rule lpt, twice: with the whole model on every rank, as the peer holds
#     it (HSDP of WORLD optimizer instances of one rank each, whose replica
#     split deals the Muon matrices out over the ranks as the peer does),
#     then ZeRO-1 (the whole model on every rank, its optimizer state
#     sharded as the peer's Muon state is, the updated parameters gathered
#     within the step: like for like with the peer), then ZeRO-3 (the
#     updated shards left for the next forward pass to gather);
#   - the peer: tests/worker/muon_peer.py (PyTorch; the Muon matrices dealt
#     out round-robin in groups of WORLD, each group all-gathered after its
#     update; AdamW on every rank for the rest).
# Prints the slowest-rank medians of the steps after the first on both
# sides (the first touches the state's pages) and the ratios (peer /
# muonmesh).
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

ours() {  # PARALLELISM -> the slowest rank's median optimizer step, ms
  local out
  out=$(RULES=lpt PARALLELISM=$1 "$root/tests/worker/optimizer_step_benchmark.sh" "$steps" 1.0 "$world")
  echo "$out" >&2
  sed -n 's/^optimizer step (slowest rank, median), lpt: \([0-9.]*\) ms$/\1/p' <<<"$out"
}
replicated=$(ours "{data_parallel_sharding_strategy: optim_grads_params, num_distributed_optimizer_instances: $world, outer_dp_sharding_strategy: no_shard}")
zero1=$(ours "{data_parallel_sharding_strategy: optim}")
sharded=$(ours "{data_parallel_sharding_strategy: optim_grads_params}")
peer_out=$("$python" "$root/tests/worker/muon_peer.py" --world "$world" --steps "$steps" \
  --spec "$root/specs/gpt2-124m.json")
echo "$peer_out"
peer=$(sed -n 's/^peer_optimizer_ms=//p' <<<"$peer_out")
[[ -n $replicated && -n $zero1 && -n $sharded && -n $peer ]] ||
  { echo "a run printed no step time" >&2; exit 1; }
awk -v r="$replicated" -v z="$zero1" -v s="$sharded" -v p="$peer" 'BEGIN {
  printf "modded-nanogpt-style peer: %.1f ms a step\n", p
  printf "muonmesh, the whole model on every rank: %.1f ms (%.2fx faster than the peer)\n", r, p / r
  printf "muonmesh, ZeRO-1: %.1f ms (%.2fx faster than the peer)\n", z, p / z
  printf "muonmesh, ZeRO-3: %.1f ms (%.2fx faster than the peer)\n", s, p / s }'
