#!/usr/bin/env bash
# Every GPU check of mori in one device call (4x H200), sized to fit one lease:
#   phase 1, in parallel: mori-core VMM check + mori-shmem GPU tests (GPUs 0-3) and mori-io GPU
#            tests (GPUs 2-3): correctness only, so sharing GPUs costs time, not validity;
#   phase 2, one at a time so timings are clean: all-reduce benchmark + mori-triton GPU tests
#            (4 GPUs), mori.ops tests and bench_ep.py (4 PEs), the shmem put/latency benchmark (2 GPUs), then the NVLink transfer
#            benchmark (2 GPUs).
# Run from the repository root with .devkit carried: `bash ci/device/all.sh`; logs go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
# Sub-scripts write many files; $OUT brings back at most 8, so they go to a work folder that is
# packed into $OUT/logs.tgz at the end.
OUT_FINAL=${OUT:-/tmp/mori-out}
OUT=/tmp/mori-work
mkdir -p "$OUT" "$OUT_FINAL"
t0=$(date +%s)
python3 -m pip install -q --no-index --find-links .devkit/wheels \
  ./packages/mori-core ./packages/mori-shmem ./packages/mori-io ./packages/mori-triton 2>&1 | tail -5 || exit 1
export MORI_SKIP_INSTALL=1
echo "== installed mori in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

mkdir -p "$OUT/shmem" "$OUT/io" "$OUT/triton"
OUT="$OUT/shmem" bash ci/device/shmem.sh --no-bench > "$OUT/shmem.log" 2>&1 & shmem_pid=$!
OUT="$OUT/io" CUDA_VISIBLE_DEVICES=2,3 bash ci/device/io.sh --tests-only > "$OUT/io_tests.log" 2>&1 & io_pid=$!
wait $shmem_pid; shmem_rc=$?
wait $io_pid; io_tests_rc=$?
echo "== phase 1 done at $(( $(date +%s) - t0 ))s"
echo "##### mori-core + mori-shmem (rc=$shmem_rc)"; tail -n 45 "$OUT/shmem.log"
echo "##### mori-io GPU tests (rc=$io_tests_rc)"; tail -n 30 "$OUT/io_tests.log"
tar czf "$OUT_FINAL/logs.tgz" -C /tmp mori-work  # again at the end; this one survives a kill

OUT="$OUT/triton" bash ci/device/triton.sh --pes 4 --modes static > "$OUT/triton.log" 2>&1; triton_rc=$?
mkdir -p "$OUT/ops"
OUT="$OUT/ops" bash ci/device/ep.sh --pes 4 > "$OUT/ops.log" 2>&1; ops_rc=$?
OUT="$OUT/shmem" MORI_SKIP_CORE=1 bash ci/device/shmem.sh --no-tests > "$OUT/shmem_bench.log" 2>&1; shmem_bench_rc=$?
OUT="$OUT/io" bash ci/device/io.sh --no-tests > "$OUT/io_bench.log" 2>&1; io_bench_rc=$?
# Benchmarks last: the caller sees the end of the output first.
echo "##### mori-triton (rc=$triton_rc)"; tail -n 90 "$OUT/triton.log"
echo "##### mori.ops tests and benchmark (rc=$ops_rc)"; grep -E "^ok  all|^== |rc=|FAILED" "$OUT/ops.log"
sed -n '/mori.ops dispatch\/combine/,$p' "$OUT/ops.log"
echo "##### mori-shmem benchmark (rc=$shmem_bench_rc)"; sed -n '/mori.shmem put bandwidth/,$p' "$OUT/shmem_bench.log"
echo "##### mori-io NVLink benchmark (rc=$io_bench_rc)"; tail -n 45 "$OUT/io_bench.log"
echo "== all done in $(( $(date +%s) - t0 ))s: shmem=$shmem_rc io_tests=$io_tests_rc triton=$triton_rc" \
  "ops=$ops_rc shmem_bench=$shmem_bench_rc io_bench=$io_bench_rc"
tar czf "$OUT_FINAL/logs.tgz" -C /tmp mori-work
[ $shmem_rc = 0 ] && [ $io_tests_rc = 0 ] && [ $triton_rc = 0 ] && [ $ops_rc = 0 ] && [ $shmem_bench_rc = 0 ] && [ $io_bench_rc = 0 ]
