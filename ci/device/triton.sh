#!/usr/bin/env bash
# mori-triton on the GPU machine, any number of GPUs: install, then the GPU tests under torchrun
# with each PE count of --pes (default "2 4") on static and vmm heaps, then the all-reduce
# benchmark (4 PEs, one GPU each: skipped on fewer GPUs; it checks every variant it times).
# PEs beyond the GPU count share GPUs (PE i on GPU i % count, under MPS when it starts:
# multi_pe.sh); the tests check results only, so sharing costs time, not validity.
# Run from the repository root with .devkit carried; results (logs, JSON) go to $OUT.
# Usage: bash ci/device/triton.sh [--no-tests] [--no-bench] [--pes "2 4"] [--modes "static vmm"]
#                                 [--no-mps] [--no-tune]
set -uo pipefail
. "$(dirname "$0")/multi_pe.sh"
pes_parse_args "$@" || exit 2
trap pes_stop_mps EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# A peer that never signals fails a kernel after 10 s instead of holding the GPUs (30 s when PEs
# share a GPU: a PE still compiling a kernel its peers already run makes them wait that long).
user_wait=${MORI_SHMEM_TIMEOUT:-}
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
run_tests=1; run_bench=1; modes="static vmm"; bench_args=()
set -- "${PES_REST[@]}"
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) run_tests=0 ;; --no-bench) run_bench=0 ;; --no-tune) bench_args+=(--no-tune) ;;
    --modes) modes=$2; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
status=0
t0=$(date +%s)
[ -n "${MORI_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --find-links .devkit/wheels \
  ./packages/mori-core ./packages/mori-shmem ./packages/mori-triton 2>&1 | tail -5 || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
cd /tmp  # import mori from site-packages, not the source tree
repo=$OLDPWD
if [ $run_bench = 1 ] && [ "$GPU_COUNT" -lt 4 ]; then
  echo "== benchmark skipped: it times 4 PEs on a GPU each, this machine has $GPU_COUNT"
elif [ $run_bench = 1 ]; then
  echo "== benchmark, 4 GPUs"
  timeout 160 torchrun --nproc_per_node=4 "$repo/ci/device/bench_allreduce.py" --out "$OUT/bench_allreduce.json" \
    "${bench_args[@]}" > "$OUT/bench.log" 2>&1
  rc=$?; echo "rc=$rc"
  sed -n '/all-reduce bf16 sum/,$p' "$OUT/bench.log"
  [ $rc = 0 ] || { status=1; grep -v "^\s*$" "$OUT/bench.log" | tail -30; }
fi
if [ $run_tests = 1 ]; then
  for n in $PES; do
    pes_share_gpus "$n"
    wait_s=${user_wait:-$(( n > GPU_COUNT ? 30 : 10 ))}
    for mode in $modes; do
      echo "== GPU tests, $n PEs, $mode heap"
      t1=$(date +%s)
      # 110 s covered 4 PEs on 4 GPUs; PEs sharing a GPU take longer, so the limit grows with them.
      MORI_SHMEM_MODE=$mode MORI_SHMEM_TIMEOUT=$wait_s timeout $(( 60 + 25 * n * (n > GPU_COUNT ? 2 : 1) )) \
        torchrun --standalone --nproc_per_node=$n -m pytest -q -m gpu -p no:cacheprovider \
        "$repo/packages/mori-triton/tests/test_gpu.py" > "$OUT/tests_${n}_$mode.log" 2>&1
      rc=$?; echo "rc=$rc in $(( $(date +%s) - t1 ))s"
      # every rank prints pytest's summary: count the identical lines
      grep -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR) |^E   " "$OUT/tests_${n}_$mode.log" | cut -c1-220 \
        | sort | uniq -c | sort -rn | head -15
      [ $rc = 0 ] || status=1
    done
  done
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
