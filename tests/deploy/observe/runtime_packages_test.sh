#!/usr/bin/env bash
# docker/runtime-packages.sh on the binaries this build made, outside any
# image: what the images' runtime stages would install must be installed
# packages here, runtime libraries only (no -dev package, no compiler), and
# include the C library; a library that no package owns must make it fail,
# naming that library.
#
#   tests/deploy/observe/runtime_packages_test.sh BINARY...
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
script="$root/docker/runtime-packages.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/runtime_packages_test.XXXXXX")
trap 'rm -rf "$work"' EXIT

# This machine's CUDA toolkit lives in /usr/local/cuda outside dpkg; the CUDA
# images get it from NVIDIA's packages, so they need no such exception.
"$script" --allow-unowned /usr/local/cuda "$@" >"$work/packages" 2>"$work/err" ||
  fail "runtime-packages.sh failed on $*: $(cat "$work/err")"
echo "runtime packages of $*:"
sed 's/^/  /' "$work/packages"
[[ -s "$work/packages" ]] || fail "no packages listed"
grep -qx libc6 "$work/packages" || fail "libc6 is not listed"
while read -r package; do
  [[ "$package" != *-dev ]] || fail "$package is a development package"
  [[ "$package" != g++* && "$package" != gcc* && "$package" != cpp* ]] || fail "$package is a compiler"
  status=$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null || true)
  [[ "$status" == installed ]] || fail "$package is not an installed package"
done <"$work/packages"

# A copy of one of the binary's libraries, outside any package, found first.
# (awk reads to the end: exiting early would fail ldd with SIGPIPE under pipefail)
lib=$(ldd "$1" | awk '/=> \// && $1 ~ /^libz\.so/ && !found {print $3; found = 1}')
if [[ -z "$lib" ]]; then
  lib=$(ldd "$1" | awk '/=> \// && $1 !~ /^lib(c|m|gcc_s|stdc\+\+)\.so/ && !found {print $3; found = 1}')
fi
mkdir "$work/lib"
cp "$lib" "$work/lib/"
if LD_LIBRARY_PATH="$work/lib" "$script" "$1" >/dev/null 2>"$work/err"; then
  fail "runtime-packages.sh accepted $(basename "$lib") from $work/lib, which no package owns"
fi
grep -q "$work/lib/$(basename "$lib")" "$work/err" ||
  fail "runtime-packages.sh did not name the unowned library: $(cat "$work/err")"
echo "OK: an unowned $(basename "$lib") is refused by name"

# Allowed by a symlink to its directory while ldd prints the resolved path
# (CI's /usr/local/cuda -> /usr/local/cuda-13.0): still allowed.
ln -s "$work/lib" "$work/link"
LD_LIBRARY_PATH="$work/lib" "$script" --allow-unowned /usr/local/cuda --allow-unowned "$work/link" "$1" >/dev/null 2>"$work/err" ||
  fail "runtime-packages.sh refused $(basename "$lib") under an allowed directory reached by a symlink: $(cat "$work/err")"
grep -q "is owned by no package (allowed)" "$work/err" ||
  fail "runtime-packages.sh did not say it allowed $(basename "$lib"): $(cat "$work/err")"
echo "OK: an unowned library under an allowed directory's target is allowed"
