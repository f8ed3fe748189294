#!/usr/bin/env bash
# The suite's short form of the network fault bench (faults.sh): a worker
# running a rank is cut from the other workers but not from the coordinator
# (a real partition between network namespaces, which loopback cannot make).
# The attempt must fail by the stall checks (the ranks that stall find the
# worker unreachable and say so in their heartbeats), well before the
# collective timeout (the default minute), the cut-off worker, and only it,
# be blamed, and the job finish on the spare with the weights of the run
# without the fault, byte for byte. Exits 77 (skipped) where namespaces
# cannot be made.
#
#   tests/deploy/net/net_faults_test.sh BUILD_DIR
set -euo pipefail
STEPS=40 FAULT_STEP=28 CHECK=1 COORDINATOR_FLAGS="--lease-ttl 2s" \
  exec "$(dirname "${BASH_SOURCE[0]}")/faults.sh" "${1:?usage: $0 BUILD_DIR}" peer-partition
