#!/usr/bin/env bash
# mori-shmem on the GPU machine, any number of GPUs: install; the memory engineer's VMM check
# (core.sh) when present; the put/latency benchmark (2 PEs, one GPU each: skipped on fewer GPUs);
# then the GPU tests (device API kernels, host API on the GPU heap, static and vmm heaps, the
# guide's Quick Reference) under torchrun with each PE count of --pes (default "2 4"). PEs beyond
# the GPU count share GPUs (PE i on GPU i % count, under MPS when it starts: multi_pe.sh).
# Run from the repository root with .devkit carried (its UCX wheel too: ci/device/ucx_kit.sh);
# logs and JSON go to $OUT.
# Usage: bash ci/device/shmem.sh [--no-bench] [--no-tests] [--pes "2 4"] [--no-mps]
#        (MORI_SKIP_CORE=1: no core.sh)
set -uo pipefail
. "$(dirname "$0")/multi_pe.sh"
pes_script_start "$@" || exit 2
run_bench=1; run_tests=1
for a in "${PES_REST[@]}"; do
  case $a in --no-bench) run_bench=0 ;; --no-tests) run_tests=0 ;; esac
done
status=0
t0=$(date +%s)
[ -n "${MORI_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem 2>&1 | tail -5 || exit 1
# The proxy tests of test_gpu.py need a UCX with CUDA support (the system's has none): the wheel's.
. "$(dirname "$0")/ucx_wheel.sh"
use_ucx_wheel
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
repo=$PWD
if [ -f ci/device/core.sh ] && [ -z "${MORI_SKIP_CORE:-}" ]; then
  echo "== ci/device/core.sh"
  timeout 40 bash ci/device/core.sh > "$OUT/core.log" 2>&1
  rc=$?; echo "rc=$rc"; tail -25 "$OUT/core.log"
  [ $rc = 0 ] || status=1
fi
cd /tmp  # import mori from site-packages, not the source tree
if [ $run_bench = 1 ] && [ "$GPU_COUNT" -lt 2 ]; then
  echo "== benchmark skipped: it times 2 PEs on a GPU each, this machine has $GPU_COUNT GPU"
elif [ $run_bench = 1 ]; then
  echo "== benchmark, 2 GPUs"
  timeout 60 torchrun --standalone --nproc_per_node=2 "$repo/ci/device/bench_shmem.py" --out "$OUT/bench_shmem.json" \
    > "$OUT/bench.log" 2>&1
  rc=$?; echo "rc=$rc"
  sed -n '/mori.shmem put bandwidth/,$p' "$OUT/bench.log"
  [ $rc = 0 ] || { status=1; grep -v "^\s*$" "$OUT/bench.log" | tail -30; }
fi
if [ $run_tests = 1 ]; then
  max_pes=$(echo $PES | tr ' ' '\n' | sort -n | tail -1)
  pes_share_gpus "$max_pes"
  echo "== GPU tests ($PES PEs on $GPU_COUNT GPUs, static and vmm, quick reference)"
  # The proxy tests need a UCX with CUDA transports: shmem_proxy.sh runs them with the libucx wheel.
  MORI_TEST_PES="$PES" timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -s -k "not proxy" \
    "$repo/packages/mori-shmem/tests/test_gpu.py" \
    > "$OUT/tests.log" 2>&1
  rc=$?; echo "rc=$rc"
  grep -E "^ok |quick reference ok|passed|failed|Error|error" "$OUT/tests.log" | sort | uniq -c | sort -rn | head -60
  [ $rc = 0 ] || { status=1; tail -60 "$OUT/tests.log"; }
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
