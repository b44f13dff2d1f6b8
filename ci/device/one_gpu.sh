#!/usr/bin/env bash
# The GPU checks that fit a one-GPU machine, in one lease: install mori-core, mori-shmem and
# mori-io; mori-core's VMM tests and its streams/events/pinned-pool tests; the shmem GPU tests with 2 PEs sharing the GPU (static and vmm heaps, the guide's Quick
# Reference); mori-io's TCP backend with GPU memory (target and initiator processes on the GPU: tests and a benchmark);
# mori-io's NVLink backend tests and benchmark with target and initiator processes both on the GPU (IPC/VMM
# import across processes, but same-GPU copies, not NVLink); the shmem put/latency benchmark with 2 PEs on the GPU (a PE's "peer" heap is then on the same
# device, so the numbers are same-GPU copies, not NVLink). Logs and JSON go to $OUT.
# Usage (repository root, .devkit carried): bash ci/device/one_gpu.sh
# MORI_STEPS="core_gpu_tests io_nvlink_tests ...": run only the named steps (default: all).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
kit=${MORI_DEVKIT:-.devkit}
status=0
t0=$(date +%s)
python3 -m pip install -q --no-index --find-links "$kit/wheels" ./packages/mori-core ./packages/mori-shmem \
  ./packages/mori-io 2>&1 | tail -5
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
repo=$PWD
# Two PEs on one GPU wait on each other inside kernels (the ping-pong): multi_pe.sh runs them under
# MPS so that their kernels run side by side instead of time-slicing.
. "$repo/ci/device/multi_pe.sh"
trap pes_stop_mps EXIT
pes_share_gpus 2
cd /tmp  # import mori from site-packages, not the source tree
. "$repo/ci/device/steps.sh"
step core_vmm_tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not second_gpu" \
  "$repo/packages/mori-core/tests/test_memory_vmm.py"  # the second-GPU test needs 2 GPUs
grep -E "passed|failed|Error" "$OUT/core_vmm_tests.log" | tail -5
step core_gpu_tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider "$repo/packages/mori-core/tests/test_gpu_device.py"
grep -E "passed|failed|Error" "$OUT/core_gpu_tests.log" | tail -5
step shmem_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not 4" -s \
  "$repo/packages/mori-shmem/tests/test_gpu.py"
grep -E "^ok |quick reference ok|passed|failed|Error" "$OUT/shmem_tests.log" | sort | uniq -c | sort -rn | head -30
step io_tcp_gpu_tests 90 python3 -m pytest -q -p no:cacheprovider --durations=5 --rootdir "$repo" \
  "$repo/packages/mori-io/tests/test_tcp_gpu.py"
grep -E "passed|failed|Error|s call" "$OUT/io_tcp_gpu_tests.log" | tail -12
step io_tcp_gpu_bench 120 python3 "$repo/ci/device/io_tcp_gpu_bench.py" --out "$OUT/io_tcp_gpu_bench.json"
tail -n 40 "$OUT/io_tcp_gpu_bench.log"
step io_nvlink_tests 240 python3 -m pytest -q -p no:cacheprovider --durations=5 --rootdir "$repo" \
  "$repo/packages/mori-io/tests/test_nvlink_gpu.py" "$repo/packages/mori-io/tests/test_gpu_wait.py"
grep -E "passed|failed|Error|s call" "$OUT/io_nvlink_tests.log" | tail -12
step io_nvlink_bench 120 python3 "$repo/ci/device/io_bench.py" --iters 20 --out "$OUT/io_bench.json"
grep -vE "^\s*$" "$OUT/io_nvlink_bench.log" | tail -70
# MORI_BASELINE=DIR: another version's Python sources (DIR/mori/{core,shmem}, the device headers
# in DIR/mori/core/include, its DIR/bench_shmem.py), benchmarked first in the same lease (the
# "before" of a change). Its native module is this build's: valid while csrc/ is unchanged.
if [ -n "${MORI_BASELINE:-}" ]; then
  base=$(cd "$repo/$MORI_BASELINE" && pwd)
  cp "$(python3 -c 'import mori.core._native as n; print(n.__file__)')" "$base/mori/core/"
  PYTHONPATH=$base step shmem_bench_baseline 60 torchrun --standalone --nproc_per_node=2 \
    "$base/bench_shmem.py" --no-nvshmem --out "$OUT/bench_shmem_baseline.json"
  sed -n '/mori.shmem put bandwidth/,$p' "$OUT/shmem_bench_baseline.log"
fi
step shmem_bench 60 torchrun --standalone --nproc_per_node=2 "$repo/ci/device/bench_shmem.py" --no-nvshmem \
  --out "$OUT/bench_shmem.json"
sed -n '/mori.shmem put bandwidth/,$p' "$OUT/shmem_bench.log"
[ $status = 0 ] || for f in "$OUT"/*.log; do echo "-- $f"; tail -n 30 "$f"; done
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
