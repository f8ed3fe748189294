#!/usr/bin/env bash
# A negative test: runs COMMAND, which must fail (exit status neither 0 nor
# 77) with output matching the extended regular expression PATTERN, the name
# of the bad input. Passes COMMAND's skip (77) on.
#
#   tests/deploy/observe/expect_fail.sh PATTERN COMMAND [ARG...]
set -uo pipefail

pattern=${1:?usage: $0 PATTERN COMMAND [ARG...]}
shift
output=$("$@" 2>&1)
status=$?
echo "$output"
if ((status == 77)); then
  exit 77
fi
if ((status == 0)); then
  echo "FAIL: '$*' passed; it must reject its bad input" >&2
  exit 1
fi
if ! grep -Eq -- "$pattern" <<<"$output"; then
  echo "FAIL: '$*' failed (status $status) without naming /$pattern/" >&2
  exit 1
fi
echo "OK: rejected as expected (status $status), naming /$pattern/"
