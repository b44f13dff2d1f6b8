#!/usr/bin/env bash
# mori-triton on the GPU machine (4x H200): install, GPU tests on 2 and 4 GPUs under torchrun,
# then the all-reduce benchmark on 4 GPUs (it checks every variant it times).
# Time limits (bench 160 s, tests 110 + 80 s) keep the whole run under about 6 minutes.
# Run from the repository root with .devkit carried; results (logs, JSON) go to $OUT.
# On a 2-GPU machine: --no-bench --no-4gpu (the benchmark needs 4 GPUs).
# Usage: bash ci/device/triton.sh [--no-tests] [--no-bench] [--no-2gpu | --no-4gpu] [--no-tune]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# A peer that never signals fails a kernel after 10 s instead of holding the GPUs.
export MORI_SHMEM_TIMEOUT=${MORI_SHMEM_TIMEOUT:-10}
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
run_tests=1; run_bench=1; gpu_counts="4 2"; bench_args=()
for a in "$@"; do
  case $a in
    --no-tests) run_tests=0 ;; --no-bench) run_bench=0 ;; --no-2gpu) gpu_counts="4" ;; --no-4gpu) gpu_counts="2" ;;
    --no-tune) bench_args+=(--no-tune) ;;
  esac
done
status=0
t0=$(date +%s)
[ -n "${MORI_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --find-links .devkit/wheels \
  ./packages/mori-core ./packages/mori-shmem ./packages/mori-triton 2>&1 | tail -5 || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
cd /tmp  # import mori from site-packages, not the source tree
repo=$OLDPWD
if [ $run_bench = 1 ]; then
  echo "== benchmark, 4 GPUs"
  timeout 160 torchrun --nproc_per_node=4 "$repo/ci/device/bench_allreduce.py" --out "$OUT/bench_allreduce.json" \
    "${bench_args[@]}" > "$OUT/bench.log" 2>&1
  rc=$?; echo "rc=$rc"
  sed -n '/all-reduce bf16 sum/,$p' "$OUT/bench.log"
  [ $rc = 0 ] || { status=1; grep -v "^\s*$" "$OUT/bench.log" | tail -30; }
fi
if [ $run_tests = 1 ]; then
  for n in $gpu_counts; do
    echo "== GPU tests, $n GPUs"
    timeout $(( n == 4 ? 110 : 80 )) torchrun --nproc_per_node=$n -m pytest -q -m gpu -p no:cacheprovider \
      "$repo/packages/mori-triton/tests/test_gpu.py" > "$OUT/tests_$n.log" 2>&1
    rc=$?; echo "rc=$rc"; grep -E "passed|failed|error|Error" "$OUT/tests_$n.log" | tail -15
    [ $rc = 0 ] || status=1
  done
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
