#!/usr/bin/env bash
# Installs the Debian packages muonmesh builds and tests with (the list in
# BUILD_NOTES.md, plus libabsl-dev). Idempotent: apt is only touched when a
# package is missing, so CI and repeated runs cost nothing once set up.
# CUDA 13 and NCCL are not Debian packages; the build turns CUDA off without
# them.
set -euo pipefail

packages=(
  g++ cmake ninja-build pkgconf curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  prometheus-cpp-dev libgloo-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libsqlite3-dev libyaml-cpp-dev libabsl-dev libre2-dev
  libssl-dev  # SHA-256 of tokens, certificate checks (gRPC links it too)
  openssl  # the security tests make their certificates with it
  iproute2  # the multi-host test's network namespaces (tests/deploy/multihost_test.sh)
  prometheus  # promtool and a real Prometheus server for tests
  python3-matplotlib  # the observe e2e test's PNG report (tests/deploy/observe/report_png.py)
  python3-grpcio python3-protobuf python3-yaml  # the Python client (client/python)
  fortunes  # English text the quickstart's GPT trains on (/usr/share/games/fortunes)
  clang  # the fuzz targets and the thread-safety analysis (tests/thread_safety_check.py)
)

missing=()
for package in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null || true)
  [[ "$status" == installed ]] || missing+=("$package")
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages are installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
as_root=()
if [[ $(id -u) -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-deps: run as root (or install sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
  as_root=(sudo)
fi
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends "${missing[@]}"
