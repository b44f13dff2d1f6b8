#!/usr/bin/env bash
# mori.shmem's remote transport on the GPU machine, any number of GPUs, with MORI_DISABLE_P2P=ON
# (every peer reached as if on another host: host calls through the UCX engine, kernels through
# the device proxy; UCX on tcp + cuda_copy, there is no RDMA NIC here): install (with the
# libucx-cu13 wheel of .devkit/ucx), then
#   1. the mori.shmem GPU tests through the proxy (test_gpu.py -k proxy: device API kernels, host
#      API on the GPU heap, static and vmm heaps) with each PE count of --pes (default "2 4");
#   2. the Triton tests of puts/gets and the seed's kernel B, which picks its IBGDA mode
#      (CHUNKS_PER_PE=1, one block per PE) when shmem_ptr_p2p is 0, with 2 PEs;
#   3. the benchmark (2 PEs): host- against device-initiated put bandwidth and put+signal latency,
#      and mori-io's RDMA backend moving GPU memory on the same UCX transports (rdma_gpu.py);
#   4. whether PEs can run in two network namespaces here.
# PEs beyond the GPU count share GPUs (under MPS when it starts: multi_pe.sh). Logs go to $OUT.
# Usage: bash ci/device/shmem_proxy.sh [--pes "2 4"] [--no-mps] [--no-tests] [--no-bench] [--no-triton]
#        (MORI_PROXY_MODES=static: the static heap only)
set -uo pipefail
. "$(dirname "$0")/multi_pe.sh"
pes_script_start "$@" || exit 2
run_bench=1; run_triton=1; run_tests=1
for a in "${PES_REST[@]}"; do
  case $a in
    --no-bench) run_bench=0 ;; --no-triton) run_triton=0 ;; --no-tests) run_tests=0 ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done
status=0
t0=$(date +%s)
repo=$PWD
. "$(dirname "$0")/ucx_wheel.sh"
if [ -z "${MORI_SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem \
    ./packages/mori-triton 2>&1 | tail -5 || exit 1
  python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-io 2>&1 | tail -3
fi
use_ucx_wheel
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
cd /tmp  # import mori from site-packages, not the source tree
python3 -c "from mori.core import ucx; i = ucx.load(); print('UCX', i['version'], i['source'], i['transports'])"
export MORI_DISABLE_P2P=ON UCX_TLS=${UCX_TLS:-tcp,cuda_copy,self} MORI_SHMEM_TIMEOUT=${MORI_SHMEM_TIMEOUT:-30}
max_pes=$(echo $PES | tr ' ' '\n' | sort -n | tail -1)
pes_share_gpus "$max_pes"
if [ $run_tests = 1 ]; then
  echo "== mori.shmem GPU tests through the proxy ($PES PEs on $GPU_COUNT GPUs, static and vmm)"
  MORI_TEST_PES="$PES" timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -s -k "proxy${MORI_PROXY_MODES:+ and $MORI_PROXY_MODES}" \
    "$repo/packages/mori-shmem/tests/test_gpu.py" > "$OUT/proxy_tests.log" 2>&1
  rc=$?; echo "rc=$rc"
  grep -E "^ok |passed|failed|Error|error" "$OUT/proxy_tests.log" | sort | uniq -c | sort -rn | head -60
  [ $rc = 0 ] || { status=1; tail -80 "$OUT/proxy_tests.log"; }
fi
if [ $run_triton = 1 ]; then
  echo "== Triton puts/gets and kernel B (IBGDA mode) through the proxy, 2 PEs"
  timeout 200 torchrun --standalone --nproc_per_node=2 -m pytest -q -m gpu -p no:cacheprovider -s \
    -k "kernel_b or put_get_ring" "$repo/packages/mori-triton/tests/test_gpu.py" > "$OUT/proxy_triton.log" 2>&1
  rc=$?; echo "rc=$rc"
  grep -E "passed|failed|Error" "$OUT/proxy_triton.log" | sort | uniq -c | head -20
  [ $rc = 0 ] || { status=1; tail -60 "$OUT/proxy_triton.log"; }
fi
if [ $run_bench = 1 ]; then
  echo "== benchmark, 2 PEs (host- and device-initiated, through the remote transport)"
  timeout 200 torchrun --standalone --nproc_per_node=2 "$repo/ci/device/bench_shmem_proxy.py" \
    --out "$OUT/bench_shmem_proxy.json" > "$OUT/bench_proxy.log" 2>&1
  rc=$?; echo "rc=$rc"
  sed -n '/remote put bandwidth/,$p' "$OUT/bench_proxy.log"
  [ $rc = 0 ] || { status=1; grep -v "^\s*$" "$OUT/bench_proxy.log" | tail -40; }
  echo "== mori-io's RDMA backend, GPU memory, same UCX transports"
  MORI_IO_RDMA_TRANSPORTS=${UCX_TLS%,self} timeout 120 python3 "$repo/ci/device/rdma_gpu.py" > "$OUT/io_rdma_gpu.log" 2>&1
  rc=$?; echo "rc=$rc"; grep -v "^\[" "$OUT/io_rdma_gpu.log" | tail -14
fi
echo "== network namespaces on this machine?"
echo "ip (iproute2, for veth pairs): $(command -v ip || echo missing)"
unshare --net python3 -c "import torch; print('CUDA in a new network namespace:', torch.cuda.is_available(), torch.cuda.device_count())" 2>&1 | tail -2
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
