#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/*_fuzz.cc) with clang and
# AddressSanitizer in their own tree, then runs each for SECONDS from its
# seed corpus (tests/fuzz/corpus/<target>/, with the hostile inputs of the
# hardening issue; safetensors seeds are generated here). Prints each
# target's executions and whether it crashed; exits 1 on any crash (the
# reproducer is kept under BUILD_DIR/findings/), 77 when clang or libFuzzer
# is missing.
#
#   tests/fuzz/run_fuzz.sh [SECONDS=60] [BUILD_DIR=build/fuzz] [TARGET...]
#   tests/fuzz/run_fuzz.sh 600        # the long run: 10 minutes a target
#
# The test command's fuzz_short uses build/fuzz too: do not run both at once
# on one tree (give the long run its own BUILD_DIR).
set -euo pipefail

seconds=${1:-60}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${2:-$root/build/fuzz}
targets=(job_file_fuzz model_spec_fuzz safetensors_fuzz)
if (($# > 2)); then targets=("${@:3}"); fi

if ! command -v clang++ >/dev/null 2>&1; then
  echo "SKIP: clang++ is not installed (Debian: apt-get install clang)" >&2
  exit 77
fi
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  echo "SKIP: clang++ cannot link libFuzzer (-fsanitize=fuzzer)" >&2
  exit 77
fi

if [[ ! -f $build/CMakeCache.txt ]]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DMUONMESH_FUZZ=ON -DMUONMESH_WERROR=OFF -DMUONMESH_ENABLE_CUDA=OFF \
    -DCMAKE_CXX_FLAGS="-fsanitize=address,fuzzer-no-link" >"$build.configure.log" 2>&1 ||
    { cat "$build.configure.log" >&2; exit 1; }
fi
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >"$build.build.log" 2>&1 ||
  { tail -n 40 "$build.build.log" >&2; exit 1; }

# Seeds: the checked-in corpora, the example jobs and specs, and generated
# safetensors files (valid ones of each dtype, and broken ones).
work=$build/run
rm -rf "$work"
mkdir -p "$work"
for t in job_file_fuzz model_spec_fuzz safetensors_fuzz; do mkdir -p "$work/$t"; done
cp "$root"/tests/fuzz/corpus/job_file/* "$work/job_file_fuzz/"
cp "$root"/deploy/local/examples/*.yaml "$work/job_file_fuzz/"
for f in "$root"/tests/fuzz/corpus/model_spec/* "$root"/deploy/local/examples/mlp-32-64-64-8.yaml \
         "$root"/deploy/local/examples/moe-6l.yaml; do
  # The model-spec target reads three bytes (world size, EP, strategy) first.
  { printf '\x08\x02\x03'; cat "$f"; } >"$work/model_spec_fuzz/$(basename "$f")"
done
st() {  # NAME HEADER DATA_BYTES
  local header=$2
  local n=${#header}
  { printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x\\x00\\x00\\x00\\x00' \
      $((n & 255)) $(((n >> 8) & 255)) $(((n >> 16) & 255)) $(((n >> 24) & 255)))"
    printf '%s' "$header"; head -c "$3" /dev/zero; } >"$work/safetensors_fuzz/$1"
}
st f32 '{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}' 24
st bf16 '{"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}' 8
st f16 '{"b":{"dtype":"F16","shape":[1,2],"data_offsets":[0,4]}}' 4
st overlap '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' 12
st huge '{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}' 8
st short '{"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}' 4

mkdir -p "$build/findings"
status=0
echo "fuzz: ${seconds} s a target, $(date -u +%FT%TZ)"
for t in "${targets[@]}"; do
  log=$work/$t.log
  set +e
  (cd "$build/findings" && TMPDIR=$work "$build/tests/fuzz/$t" "$work/$t" \
      -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
      -print_final_stats=1 >"$log" 2>&1)
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  corpus=$(ls "$work/$t" | wc -l)
  if ((rc == 0)); then
    echo "$t: ${execs:-?} executions, corpus $corpus inputs, no crash"
  else
    echo "$t: CRASH after ${execs:-?} executions (exit $rc); reproducer in $build/findings:" >&2
    grep -E "ERROR|SUMMARY|Test unit written" "$log" | head -n 10 >&2
    status=1
  fi
done
exit "$status"
