#!/usr/bin/env bash
# The direction of dependencies, checked on the tree and on the built planner:
#  1. nothing in worker/ or client/ includes the coordinator's code
#     ("server/..."); they share the planner as "plan/..." and the API
#     conversions under proto/;
#  2. the planner (server/plan/) includes only itself, Abseil, the standard
#     library and the header-only error macro (proto/support/status_macros.h):
#     no protobuf, no gRPC, no other part of the project;
#  3. its built library needs no protobuf or gRPC symbol.
#
#   tests/layering_test.sh ROOT [LIBMUONMESH_PLAN.a]
set -euo pipefail
root=${1:?usage: $0 ROOT [LIBMUONMESH_PLAN.a]}
lib=${2:-}
status=0

if hits=$(cd "$root" && git grep -n '#include "server/' -- worker client 2>/dev/null ||
          grep -rn '#include "server/' worker client); then
  if [[ -n $hits ]]; then
    echo "FAIL: worker/ or client/ include the coordinator's code:" >&2
    echo "$hits" >&2
    status=1
  fi
fi

bad=$(grep -n '#include "' "$root"/server/plan/*.h "$root"/server/plan/*.cc |
      grep -v '#include "plan/' | grep -v '#include "absl/' |
      grep -v '#include "proto/support/status_macros.h"' || true)
if [[ -n $bad ]]; then
  echo "FAIL: the planner includes more than itself and Abseil:" >&2
  echo "$bad" >&2
  status=1
fi

if [[ -n $lib ]]; then
  if ! command -v nm >/dev/null; then
    echo "FAIL: nm is missing (binutils)" >&2
    exit 1
  fi
  needs=$(nm -C --undefined-only "$lib" | grep -E 'google::protobuf|grpc' || true)
  if [[ -n $needs ]]; then
    echo "FAIL: $lib needs protobuf or gRPC symbols:" >&2
    echo "$needs" | head -20 >&2
    status=1
  fi
fi
((status == 0)) && echo "layering: worker/ and client/ include no server/ code; the planner is a leaf"
exit "$status"
