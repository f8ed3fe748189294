#!/usr/bin/env bash
# Prints the Debian/Ubuntu packages that a runtime image must install to run
# the given binaries: the owners (dpkg -S) of every shared library that ldd
# resolves for them, one per line, sorted, without architecture suffixes.
# The images' build stages run it on what they built, so the runtime stage
# installs exactly what the binaries load and no -dev package or compiler.
#
#   docker/runtime-packages.sh [--allow-unowned DIR]... BINARY...
#
# Fails, naming the library, when ldd cannot resolve one ("not found") or no
# package owns it (a library copied by hand would be missing at run time),
# unless it lies under an --allow-unowned DIR (a toolkit installed outside
# the package manager, such as this build machine's /usr/local/cuda; the CUDA
# images install CUDA and NCCL as packages, so they need no exception).
set -euo pipefail

allowed=()
while (($# > 0)) && [[ "$1" == --allow-unowned ]]; do
  (($# >= 2)) || { echo "usage: $0 [--allow-unowned DIR]... BINARY..." >&2; exit 2; }
  # The directory as given and as resolved: ldd may print either
  # /usr/local/cuda/lib/... or /usr/local/cuda-13.0/lib/... for one library.
  allowed+=("${2%/}/")
  resolved=$(readlink -f "$2" 2>/dev/null || true)
  [[ -n "$resolved" && "$resolved/" != "${2%/}/" ]] && allowed+=("$resolved/")
  shift 2
done
if (($# == 0)); then
  echo "usage: $0 [--allow-unowned DIR]... BINARY..." >&2
  exit 2
fi

# Every shared library the binaries load, as ldd resolves it.
declare -A libraries=()
status=0
for binary in "$@"; do
  if [[ ! -x "$binary" ]]; then
    echo "runtime-packages: $binary: not an executable file" >&2
    exit 1
  fi
  while read -r line; do
    case "$line" in
      *"=> not found"*)
        echo "runtime-packages: $binary needs ${line%% *}, which ldd cannot find" >&2
        status=1 ;;
      *"=> /"*) path=${line#*=> }; libraries[${path%% (*}]=$binary ;;
      /*) libraries[${line%% (*}]=$binary ;;  # the dynamic loader itself
      *) ;;                                    # linux-vdso lives in the kernel
    esac
  done < <(ldd "$binary")
done

# Each library under the names dpkg may know it by: the path ldd printed, its
# usr-merged twin and its resolved target (alternatives such as
# libopenblas.so.0 are symlinks whose final file is the one dpkg owns).
candidates() {
  local path=$1
  printf '%s\n' "$path" "/usr$path" "${path#/usr}" "$(readlink -f "$path")"
}
declare -A owner=()
mapfile -t queries < <(for path in "${!libraries[@]}"; do candidates "$path"; done | sort -u)
# One dpkg -S for all of them (it reads its whole database per call); lines
# are "libfoo1:amd64: /usr/lib/..."; paths no package owns only warn.
while IFS= read -r line; do
  [[ "$line" == "diversion by"* ]] && continue
  package=${line%%: /*}
  owner[${line#*: }]=${package%%:*}
done < <(dpkg -S "${queries[@]}" 2>/dev/null || true)

under_allowed() {
  local dir
  for dir in "${allowed[@]}"; do
    [[ "$1" == "$dir"* || "$(readlink -f "$1")" == "$dir"* ]] && return 0
  done
  return 1
}

declare -A packages=()
for path in "${!libraries[@]}"; do
  found=""
  while read -r candidate; do
    [[ -n "${owner[$candidate]:-}" ]] && { found=${owner[$candidate]}; break; }
  done < <(candidates "$path")
  if [[ -n "$found" ]]; then
    packages[$found]=1
  elif under_allowed "$path"; then
    echo "runtime-packages: $path is owned by no package (allowed)" >&2
  else
    echo "runtime-packages: ${libraries[$path]} loads $path, which no installed package owns" >&2
    status=1
  fi
done
((status == 0)) || exit "$status"
printf '%s\n' "${!packages[@]}" | sort
