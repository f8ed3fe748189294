#!/usr/bin/env bash
# Installs, in an image's runtime stage, the packages listed one per line in
# FILE (what docker/runtime-packages.sh printed in the build stage) that the
# base image does not already have, without recommended packages, then
# empties apt's caches so the layer holds only the libraries.
# In the CUDA images the runtime base already carries CUDA, cuBLAS and NCCL,
# so only the Debian-side libraries are installed here.
#
#   docker/install-runtime-packages.sh FILE
set -euo pipefail

list=${1:?usage: $0 FILE}
missing=()
while read -r package; do
  [[ -n "$package" ]] || continue
  status=$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null || true)
  [[ "$status" == installed ]] || missing+=("$package")
done <"$list"

if ((${#missing[@]} == 0)); then
  echo "install-runtime-packages: the base image has every package"
  exit 0
fi
echo "install-runtime-packages: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
apt-get clean
rm -rf /var/lib/apt/lists/*
