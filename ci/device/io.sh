#!/usr/bin/env bash
# mori-io's NVLink backend on the GPU machine (2 of the 4 H200s): install, GPU tests (two
# processes), then the NVLink benchmark against the copy-engine peer copy. Run from the
# repository root with .devkit carried; logs and JSON go to $OUT.
# With .devkit/peers (ci/device/peer_kit.sh) the benchmark also measures NIXL and Mooncake; with
# .devkit/ucx (ci/device/ucx_kit.sh) the RDMA backend moves GPU memory through UCX (rdma_gpu.py).
# Usage: bash ci/device/io.sh [--no-tests | --tests-only] [--quick]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
run_tests=1; run_bench=1; bench_args=()
for a in "$@"; do
  case $a in --no-tests) run_tests=0 ;; --tests-only) run_bench=0 ;; --quick) bench_args+=(--quick) ;; esac
done
status=0
t0=$(date +%s)
[ -n "${MORI_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-io 2>&1 | tail -5
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
repo=$PWD
cd /tmp  # import mori from site-packages, not the source tree
export MORI_CACHE_DIR=/tmp/mori-cache
echo "== GPU ordinals: torch uuid / driver uuid / driver ordinal of a cuda:i pointer"
python3 - <<'PY' 2>&1 | tail -6
import torch
from cuda.bindings import driver as d
d.cuInit(0)
for i in range(torch.cuda.device_count()):
    t = torch.empty(16, device=f"cuda:{i}")
    _, dev = d.cuDeviceGet(i)
    _, uuid = d.cuDeviceGetUuid(dev)
    attr = d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    print(i, str(torch.cuda.get_device_properties(i).uuid)[:13], bytes(uuid.bytes).hex()[:12],
          d.cuPointerGetAttribute(attr, t.data_ptr()))
PY
if [ $run_tests = 1 ]; then
  echo "== NVLink tests (GPU 0 target process, GPU 1 initiator)"
  timeout 150 python3 -m pytest --maxfail=4 -q -p no:cacheprovider --rootdir "$repo" \
    "$repo/packages/mori-io/tests/test_nvlink_gpu.py" "$repo/packages/mori-io/tests/test_nvlink_plan.py" \
    > "$OUT/io_tests.log" 2>&1
  rc=$?; echo "rc=$rc (after $(( $(date +%s) - t0 ))s)"
  grep -E "passed|failed|Error|error|assert" "$OUT/io_tests.log" | tail -25
  [ $rc = 0 ] || status=1
fi
if [ $run_tests = 1 ]; then
  echo "== TCP backend with GPU memory (pinned staging; TCP-only engines, GPU 0 target process, GPU 1 initiator)"
  timeout 90 python3 -m pytest --maxfail=4 -q -p no:cacheprovider --rootdir "$repo" \
    "$repo/packages/mori-io/tests/test_tcp_gpu.py" > "$OUT/io_tcp_gpu_tests.log" 2>&1
  rc=$?; echo "rc=$rc (after $(( $(date +%s) - t0 ))s)"
  grep -E "passed|failed|Error|error|assert" "$OUT/io_tcp_gpu_tests.log" | tail -25
  [ $rc = 0 ] || status=1
fi
if [ $run_tests = 1 ] && ls "$repo"/.devkit/ucx/*.whl >/dev/null 2>&1; then
  # UCX for the RDMA backend (ci/device/ucx_kit.sh); no RDMA NIC here: tcp + cuda_copy transports.
  echo "== RDMA backend with GPU memory (UCX tcp,cuda_copy; two processes on the last GPU)"
  python3 -m pip install -q --no-deps --no-index "$repo"/.devkit/ucx/*.whl 2>&1 | tail -3
  timeout 120 python3 "$repo/ci/device/rdma_gpu.py" > "$OUT/io_rdma_gpu.log" 2>&1
  rc=$?; echo "rc=$rc"
  grep -v "^\[" "$OUT/io_rdma_gpu.log" | tail -16
  [ $rc = 0 ] || status=1
fi
if [ $run_bench = 1 ] && ls "$repo"/.devkit/peers/*.whl >/dev/null 2>&1; then
  # NVLink peers (ci/device/peer_kit.sh): NIXL and Mooncake, measured in the same run.
  python3 -m pip install -q --no-deps --no-index "$repo"/.devkit/peers/*.whl 2>&1 | tail -3
  for l in libibverbs.so.1 libmlx5.so.1 libnuma.so.1; do
    ldconfig -p | grep -q "$l" || export MORI_PEER_LIBDIR="$repo/.devkit/peers/lib"
  done
  bench_args+=(--peers nixl,mooncake)
fi
if [ $run_bench = 1 ]; then
  echo "== NVLink benchmark"
  timeout 240 python3 "$repo/ci/device/io_bench.py" --out "$OUT/io_bench.json" "${bench_args[@]}" \
    > "$OUT/io_bench.log" 2>&1
  rc=$?; echo "rc=$rc"
  cat "$OUT/io_bench.log" | tail -110
  [ $rc = 0 ] || status=1
  echo "== gather kernel alone (piece sweep, copy engines beside it)"
  timeout 120 python3 "$repo/packages/mori-io/tests/gpu_kernel_sweep.py" > "$OUT/io_kernel_sweep.log" 2>&1
  rc=$?; echo "rc=$rc"
  cat "$OUT/io_kernel_sweep.log" | tail -70
  [ $rc = 0 ] || status=1
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
