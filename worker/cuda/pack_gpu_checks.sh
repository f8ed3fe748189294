#!/usr/bin/env bash
# Packs what worker/cuda/run_gpu_checks.sh needs on a GPU machine that has
# CUDA, NCCL and PyTorch but none of this project's packages: the five
# prebuilt binaries in one folder, and the shared libraries the CUDA worker
# loads besides the system's C/C++ runtime and CUDA's own, in its lib/.
#
#   worker/cuda/pack_gpu_checks.sh [BUILD_DIR] [OUT_DIR]
#
# BUILD_DIR (default build) must have been configured with CUDA (nvcc found);
# the targets are built first. OUT_DIR (default gpu-bin, ignored by git) is
# made afresh, its files stripped of symbols, and packed as OUT_DIR.tar.xz
# (about 15 MB; the folder is about 95 MB, mostly OpenBLAS). Then, on the GPU
# machine, from a checkout of the same commit:
#
#   tar -xJf gpu-bin.tar.xz
#   MUONMESH_GPU_RESULTS=results.txt worker/cuda/run_gpu_checks.sh gpu-bin
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build}
out=${2:-$root/gpu-bin}
targets=(newton_schulz_cuda_test newton_schulz_cuda_benchmark worker_runtime_cuda_test
  comm_nccl_gpu_test muonmesh-worker-cuda)

if ! grep -q '^MUONMESH_ENABLE_CUDA:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "pack_gpu_checks: $build is not a CUDA build (configure where nvcc is found)" >&2
  exit 2
fi
cmake --build "$build" --target "${targets[@]}"
rm -rf "$out"
mkdir -p "$out/lib"
for t in "${targets[@]}"; do
  path=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
  [[ -n $path ]] || { echo "pack_gpu_checks: $t was not built" >&2; exit 1; }
  cp "$path" "$out/"
done
# The worker's own libraries (gRPC, protobuf, Abseil, OpenBLAS, Gloo, ...):
# everything ldd resolves except the C/C++ runtime, which every machine has,
# and CUDA's, which the GPU machine brings (its driver, or PyTorch's wheels).
ldd "$out/muonmesh-worker-cuda" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' |
  while read -r name path; do
    case $name in
      linux-vdso* | ld-linux* | libc.so* | libm.so* | libpthread* | libdl.so* | librt.so* | \
        libstdc++* | libgcc_s* | libcuda.so* | libcudart* | libcublas* | libnccl*) continue ;;
    esac
    cp -L "$path" "$out/lib/$name"
  done
strip --strip-unneeded "$out"/* "$out"/lib/* 2>/dev/null || true
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"
du -sh "$out" "$out.tar.xz" | awk '{ print "pack_gpu_checks: " $2 ": " $1 }'
