#!/usr/bin/env bash
# Runs the CUDA Newton-Schulz checks on a machine with an NVIDIA GPU, as one
# prepared step that takes well under 5 minutes: the GPU test binary, then
# the CUDA benchmark (NS effective FLOP/s, standard and Gram forms, against
# cuBLAS bf16 GEMM FLOP/s).
#
#   worker/cuda/run_gpu_checks.sh [BIN_DIR]
#
# A GPU machine has CUDA 13 (driver, libcudart, libcublas) and a compiler,
# but not this project's build dependencies (Abseil headers, GoogleTest, the
# rest of the Debian package list), and may have no network: it cannot build
# these binaries. Build them where the project builds and carry them over;
# they link GoogleTest and Abseil statically (worker/cuda/CMakeLists.txt):
#
#   cmake -S . -B build -G Ninja
#   cmake --build build --target newton_schulz_cuda_test newton_schulz_cuda_benchmark
#   # then copy build/tests/worker/newton_schulz_cuda_{test,benchmark}
#
# BIN_DIR (else $MUONMESH_GPU_BIN_DIR) names the folder holding both
# binaries; without either, the first of build-math/tests/worker,
# build/tests/worker, build-*/tests/worker (under the checkout) that holds
# them. With MUONMESH_GPU_LOG_DIR set, each step's output is also written
# there. Everything the script prints (device, test results, losses, step
# times, tokens/s) also goes to one results file, $MUONMESH_GPU_RESULTS
# (default ./gpu-results.txt). Every step runs under its own time limit.
#
# Also runs worker_runtime_cuda_test and comm_nccl_gpu_test when they are in
# the same folder (copy them there from build/tests/worker/{runtime,comm}),
# and, when muonmesh-worker-cuda is there too (from build/worker; the shared
# libraries it needs beyond CUDA's may sit in BIN_DIR/lib), one-rank jobs
# through it: an mlp, a moe_mlp and a small gpt (on this checkout's README as
# bytes) on device cuda against the same jobs on device cpu (every step's loss
# within 1e-2 relative: bf16 Newton-Schulz against the CPU's fp32), and the
# step times of a larger mlp and of the gpt at GPT-2 124M's size on the GPU;
# then ranks that share the GPU (communication.backend gloo: Gloo on host
# copies): the small gpt on 2 ranks (ZeRO-3) and 4 ranks (HFSDP) against the
# same jobs on the CPU; and, where python3 has PyTorch with CUDA, the gpt at
# GPT-2 124M's size against PyTorch on the same GPU, eager and torch.compile
# (tests/worker/model/gpt_vs_torch.py, tokens/s side by side).
#
# Exit status: 0 tests passed (benchmark ran); 1 a test or the benchmark
# failed; 2 binaries missing or not runnable here; 77 no usable GPU.

set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
test_name=newton_schulz_cuda_test
bench_name=newton_schulz_cuda_benchmark

find_bin_dir() {
  local candidates=()
  if [[ -n ${1:-} ]]; then  # an explicit folder is the only one looked at
    candidates=("$1")
  elif [[ -n ${MUONMESH_GPU_BIN_DIR:-} ]]; then
    candidates=("$MUONMESH_GPU_BIN_DIR")
  else
    candidates=("$root/build-math/tests/worker" "$root/build/tests/worker")
    for d in "$root"/build-*/tests/worker; do candidates+=("$d"); done
  fi
  local d
  for d in "${candidates[@]}"; do
    if [[ -x $d/$test_name && -x $d/$bench_name ]]; then
      echo "$d"
      return 0
    fi
  done
  return 1
}

if ! bin_dir=$(find_bin_dir "${1:-}"); then
  cat >&2 <<EOF
run_gpu_checks: no prebuilt $test_name and $bench_name found
(looked in: ${1:-${MUONMESH_GPU_BIN_DIR:-$root/build-math/tests/worker, $root/build/tests/worker, $root/build-*/tests/worker}}).
This machine cannot build them (no Abseil/GoogleTest packages, no network).
Build them on a machine with the project's dependencies and nvcc:
  cmake -S . -B build -G Ninja
  cmake --build build --target $test_name $bench_name
then copy build/tests/worker/{$test_name,$bench_name} here and pass their folder.
EOF
  exit 2
fi

results=${MUONMESH_GPU_RESULTS:-$PWD/gpu-results.txt}
mkdir -p "$(dirname "$results")"
exec > >(tee "$results") 2>&1
echo "== run_gpu_checks $(date -u +%Y-%m-%dT%H:%M:%SZ), results in $results"
log_dir=${MUONMESH_GPU_LOG_DIR:-}
[[ -n $log_dir ]] && mkdir -p "$log_dir"
run_logged() {  # run_logged NAME LIMIT_SECONDS CMD...
  local name=$1 limit=$2
  shift 2
  if [[ -n $log_dir ]]; then
    timeout "$limit" "$@" 2>&1 | tee "$log_dir/$name.log"
  else
    timeout "$limit" "$@" 2>&1
  fi
}

# The CUDA libraries: the binaries carry an rpath to the build machine's
# /usr/local/cuda/lib; add the usual places in case this machine differs.
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d $d ]] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

echo "== run_gpu_checks: binaries from $bin_dir"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
# CUDA libraries the system lacks may come with Python wheels (PyTorch's
# nvidia-* packages: nvidia/cu13/lib for cuBLAS and the runtime,
# nvidia/nccl/lib): their folders go last on the search path.
wheel_lib_dirs() {
  python3 - 2>/dev/null <<'PY'
import glob, os
try:
    import nvidia
    for root in nvidia.__path__:
        for lib in sorted(glob.glob(os.path.join(root, "*", "lib"))):
            if glob.glob(os.path.join(lib, "lib*.so*")):
                print(lib)
except Exception:
    pass
PY
}
if ldd "$bin_dir/$test_name" | grep -q "not found" ||
  ! ldconfig -p 2>/dev/null | grep -q "libnccl.so.2"; then
  while read -r d; do LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"; done \
    < <(wheel_lib_dirs)
  export LD_LIBRARY_PATH
fi
if ldd "$bin_dir/$test_name" | grep -q "not found"; then
  echo "run_gpu_checks: $test_name cannot load its libraries here:" >&2
  ldd "$bin_dir/$test_name" | grep "not found" >&2
  exit 2
fi

start=$(date +%s)
echo "== $test_name"
run_logged "$test_name" 180 "$bin_dir/$test_name"
test_rc=$?
case $test_rc in
  0) echo "== $test_name: passed" ;;
  77)
    echo "== $test_name: skipped, no usable GPU"
    exit 77
    ;;
  124) echo "== $test_name: timed out after 180 s" ;;
  *) echo "== $test_name: FAILED (exit $test_rc)" ;;
esac

echo "== $bench_name"
run_logged "$bench_name" 100 "$bin_dir/$bench_name"
bench_rc=$?
[[ $bench_rc -eq 0 ]] || echo "== $bench_name: FAILED (exit $bench_rc)"

# Optional, when their binaries are in the same folder: the training engine
# on the GPU against the host (worker_runtime_cuda_test, from
# build/tests/worker/runtime) and the NCCL communicator conformance suite
# (comm_nccl_gpu_test, from build/tests/worker/comm; its multi-rank cases need
# one GPU per rank). Both need libnccl.so.2 (the system's, or a wheel's: see
# above).
extra_rc=0
for extra in worker_runtime_cuda_test comm_nccl_gpu_test; do
  [[ -x $bin_dir/$extra ]] || continue
  echo "== $extra"
  run_logged "$extra" 120 "$bin_dir/$extra"
  rc=$?
  case $rc in
    0) echo "== $extra: passed" ;;
    *)
      echo "== $extra: FAILED (exit $rc)"
      extra_rc=1
      ;;
  esac
done

# One-rank jobs through the CUDA worker against the CPU (see the top).
worker=$bin_dir/muonmesh-worker-cuda
job_rc=0
if [[ -x $worker ]]; then
  [[ -d $bin_dir/lib ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$bin_dir/lib"
  jobs_dir=$(mktemp -d)
  write_job() {  # write_job NAME DEVICE MODEL DATA TRAINING
    cat >"$jobs_dir/$1-$2.yaml" <<JOB
name: $1
world_size: 1
device: $2
model: $3
init: {seed: 7}
data: $4
optimizer:
  muon: {lr: 0.02, momentum: 0.95, nesterov: true, ns_steps: 5, weight_decay: 0.1}
  adamw: {lr: 0.001, weight_decay: 0.01}
training: $5
output: {dir: $jobs_dir/out-$1-$2}
JOB
  }
  run_job() {  # run_job NAME DEVICE: the worker's output in $jobs_dir/NAME-DEVICE.log
    mkdir -p "$jobs_dir/store-$1-$2"
    # (OpenBLAS runs the job's training.threads_per_rank threads: 1 here.)
    timeout 120 "$worker" --standalone \
      --job "$jobs_dir/$1-$2.yaml" --rank 0 --world-size 1 --store "$jobs_dir/store-$1-$2" \
      >"$jobs_dir/$1-$2.log" 2>&1
  }
  losses() { awk '$1 == "step" && $3 == "loss" { print $2, $4 }' "$1"; }
  # Every one of 20 steps' losses on cuda within 1e-2 relative of the CPU's.
  same_losses() {  # same_losses CUDA_LOG CPU_LOG
    paste <(losses "$1") <(losses "$2") | awk '
      $1 != $3 { exit 1 }
      { d = ($2 - $4) / $4; if (d < 0) d = -d; if (d > worst) worst = d; n++ }
      END { printf "%d steps, largest relative loss difference %.2e\n", n, worst;
            exit !(n == 20 && worst <= 1e-2) }'
  }
  for device in cuda cpu; do
    write_job mlp $device "{mlp: {dims: [64, 256, 256, 16]}}" \
      "{teacher: {seed: 11, samples: 4096}}" "{steps: 20, global_batch_size: 64}"
    write_job moe $device "{moe_mlp: {d_in: 32, d_model: 64, d_expert: 48, num_experts: 8, d_out: 8}}" \
      "{teacher: {seed: 11, samples: 4096}}" "{steps: 20, global_batch_size: 64}"
    write_job gpt $device \
      "{gpt: {vocab_size: 256, block_size: 64, n_layer: 2, n_head: 4, n_embd: 64, seq_len: 64}}" \
      "{text: {train: \"$root/README.md\", val_fraction: 0.1}}" \
      "{steps: 20, global_batch_size: 16, eval_every: 10}"
  done
  write_job big cuda "{mlp: {dims: [1024, 4096, 4096, 1024]}}" \
    "{teacher: {seed: 11, samples: 4096}}" "{steps: 20, global_batch_size: 1024}"
  write_job gpt124m cuda "{gpt: {vocab_size: 50257, block_size: 1024, n_layer: 12, n_head: 12, \
n_embd: 768, seq_len: 1024}}" "{text: {train: \"$root/README.md\", val_fraction: 0.1}}" \
    "{steps: 10, global_batch_size: 8}"
  for name in mlp moe gpt; do
    echo "== job $name: device cuda against device cpu"
    if ! run_job $name cuda || ! run_job $name cpu; then
      echo "== job $name: FAILED"
      tail -n 5 "$jobs_dir/$name-cuda.log" "$jobs_dir/$name-cpu.log"
      job_rc=1
      continue
    fi
    if ! same_losses "$jobs_dir/$name-cuda.log" "$jobs_dir/$name-cpu.log"; then
      echo "== job $name: FAILED (losses differ)"
      job_rc=1
    fi
  done
  # A step's time: the sum of its phases (the ms: fields); the median over
  # steps 1.. (step 0 includes cuBLAS's warm-up).
  median_step() {  # median_step LOG LABEL
    awk '$1 == "step" && $2 > 0 { t = 0; for (i = 1; i <= NF; ++i) if ($i == "ms:") on = 1;
           else if ($i == "|") on = 0; else if (on) { n = split($i, p, "/");
             for (k = 1; k <= n; ++k) if (p[k] ~ /^[0-9.]+$/) t += p[k] } print t }' "$1" |
      sort -g | awk -v label="$2" '{ v[NR] = $1 } END {
        printf "%s: median step %.2f ms over %d steps\n", label, v[int((NR + 1) / 2)], NR }'
    grep '^summary' "$1"
  }
  for name in big gpt124m; do
    echo "== job $name (cuda): step time"
    if run_job $name cuda; then
      case $name in
        big) median_step "$jobs_dir/big-cuda.log" "mlp [1024, 4096, 4096, 1024], batch 1024" ;;
        *) median_step "$jobs_dir/$name-cuda.log" "gpt at GPT-2 124M size, 8 x 1024 tokens" ;;
      esac
    else
      echo "== job $name: FAILED"
      tail -n 5 "$jobs_dir/$name-cuda.log"
      job_rc=1
    fi
  done
  # Ranks sharing the GPU (Gloo on host copies) against the same ranks on
  # the CPU: every step's loss within 1e-2 relative.
  run_ranks() {  # run_ranks NAME DEVICE WORLD: all ranks at once, each its own process
    local name=$1 device=$2 world=$3 r pids=() rc=0
    mkdir -p "$jobs_dir/store-$name-$device"
    for ((r = 0; r < world; ++r)); do
      timeout 180 "$worker" --standalone --job "$jobs_dir/$name-$device.yaml" --rank $r \
        --world-size "$world" --store "$jobs_dir/store-$name-$device" \
        >"$jobs_dir/$name-$device-$r.log" 2>&1 &
      pids+=($!)
    done
    for r in "${pids[@]}"; do wait "$r" || rc=1; done
    return $rc
  }
  for layout in "zero3 2 {data_parallel_sharding_strategy: optim_grads_params}" \
    "hfsdp 4 {data_parallel_sharding_strategy: optim_grads_params, \
num_distributed_optimizer_instances: 2, outer_dp_sharding_strategy: optim}"; do
    read -r lname world parallelism <<<"$layout"
    name=shared-$lname
    for device in cuda cpu; do
      write_job "$name" $device \
        "{gpt: {vocab_size: 256, block_size: 64, n_layer: 2, n_head: 4, n_embd: 64, seq_len: 64}}" \
        "{text: {train: \"$root/README.md\", val_fraction: 0.1}}" \
        "{steps: 20, global_batch_size: 16}"
      sed -i "s/^world_size: 1$/world_size: $world/" "$jobs_dir/$name-$device.yaml"
      printf 'parallelism: %s\ncommunication: {backend: gloo}\n' "$parallelism" \
        >>"$jobs_dir/$name-$device.yaml"
    done
    echo "== job $name: $world ranks sharing the GPU (gloo via host copies) against the CPU"
    if ! run_ranks "$name" cuda "$world" || ! run_ranks "$name" cpu "$world"; then
      echo "== job $name: FAILED"
      tail -n 5 "$jobs_dir/$name"-*.log
      job_rc=1
      continue
    fi
    grep -h "^collectives:" "$jobs_dir/$name-cuda-0.log"
    if ! same_losses "$jobs_dir/$name-cuda-0.log" "$jobs_dir/$name-cpu-0.log"; then
      echo "== job $name: FAILED (losses differ)"
      job_rc=1
    fi
    median_step "$jobs_dir/$name-cuda-0.log" "gpt on $world ranks sharing the GPU"
  done
  rm -rf "$jobs_dir"

  # GPT-2 124M against PyTorch on this GPU (eager, then torch.compile).
  if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "== gpt at GPT-2 124M size against PyTorch on the same GPU"
    run_logged gpt_vs_torch 300 python3 "$root/tests/worker/model/gpt_vs_torch.py" \
      --device cuda --compile --worker "$worker" --layers 12 --embd 768 --heads 12 --seq 1024 \
      --vocab 50257 --batch "${MUONMESH_GPU_TORCH_BATCH:-8}" --steps 12 --corpus "$root/README.md" ||
      { echo "== gpt_vs_torch: FAILED"; job_rc=1; }
  else
    echo "== gpt against PyTorch: skipped (python3 has no PyTorch with CUDA here)"
  fi
fi

echo "== run_gpu_checks: done in $(($(date +%s) - start)) s"
[[ $test_rc -eq 0 && $bench_rc -eq 0 && $extra_rc -eq 0 && $job_rc -eq 0 ]] || exit 1
exit 0
