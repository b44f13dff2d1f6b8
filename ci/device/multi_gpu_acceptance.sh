#!/usr/bin/env bash
# The GPU acceptance of a machine with two or more GPUs, one PE per GPU, in one lease, benchmarks
# first (they are what such a machine is lent for), each step bounded:
#   topo          the GPUs and how they are linked (nvidia-smi topo -m);
#   ep_bench      bench_ep.py, one PE per GPU: eager calls and CUDA-graph replays (+graph), a
#                 per-kernel profile of each mori.ops row (torch.profiler), beside NCCL and PyTorch
#                 symmetric memory's all_to_all_vdev (MORI_EP_SHAPES, default decode,prefill;
#                 MORI_EP_QUANTS, default none,fp8_blockwise; MORI_EP_ARGS: more bench_ep.py
#                 arguments, e.g. "--blocks 132 --host-profile");
#   shmem_bench   bench_shmem.py on 2 GPUs: device put bandwidth beside the copy engine and
#                 NVSHMEM, put+signal one way beside its raw floor;
#   io_bench      io_bench.py: mori-io's NVLink batch reads beside the copy engine;
#   allreduce     bench_allreduce.py (4 GPUs and more: triton.sh --no-tests);
#   core          mori-core's GPU tests (core.sh);
#   shmem_tests   mori.shmem's GPU tests with one PE per GPU (shmem.sh --no-bench);
#   shmem_proxy   mori.shmem's GPU tests through the device proxy, one PE per GPU, on the libucx
#                 wheel's CUDA transports (shmem_proxy.sh --no-bench --no-triton);
#   io_tests      mori-io's GPU tests (io.sh --tests-only);
#   triton_tests  mori-triton's GPU tests with one PE per GPU (triton.sh --no-bench);
#   ops_tests     mori.ops's GPU tests with one PE per GPU (ep.sh --no-bench);
#   ops_proxy     mori.ops's inter-node kernels through the device proxy, one PE per GPU (ep.sh
#                 --proxy: MORI_DISABLE_P2P, the libucx wheel's CUDA transports);
#   no_cuda_ucx   a GPU heap with MORI_DISABLE_P2P on the machine's system UCX (no CUDA): refused
#                 at init (test_gpu.py).
# Run from the repository root with .devkit carried. MORI_STEPS="ep_bench ...": only these steps.
# Logs go to $OUT (packed into logs.tgz after every step, so a lease cut short brings back what ran).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
OUT_FINAL=${OUT:-/tmp/mori-out}
OUT=/tmp/mori-acceptance
mkdir -p "$OUT" "$OUT_FINAL"
repo=$PWD
t0=$(date +%s)
status=0
step_done() { tar czf "$OUT_FINAL/logs.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
. "$repo/ci/device/steps.sh"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
[ "$gpus" -ge 2 ] || { echo "multi_gpu_acceptance.sh needs two or more GPUs, this machine has $gpus"; exit 2; }
python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem \
  ./packages/mori-io ./packages/mori-triton 2>&1 | tail -3
python3 -m pip install -q --no-deps --no-index .devkit/ucx/*.whl 2>&1 | tail -3  # shmem_proxy's CUDA transports
export MORI_SKIP_INSTALL=1
echo "== installed in $(( $(date +%s) - t0 ))s, $gpus GPUs"

step topo 20 nvidia-smi topo -m
cat "$OUT/topo.log"
step ep_bench 240 env OUT="$OUT/ep" bash ci/device/ep.sh --pes "$gpus" --no-tests -- --graph --profile --iters 20 \
  --shapes "${MORI_EP_SHAPES:-decode,prefill}" --quants "${MORI_EP_QUANTS:-none,fp8_blockwise}" ${MORI_EP_ARGS:-}
grep -E "^profile|^  |^host time|^host profile" "$OUT/ep/bench_ep.log" | cut -c1-120 | head -150
sed -n '/mori.ops dispatch\/combine/,$p' "$OUT/ep/bench_ep.log" | grep -v "^\s*$"
step shmem_bench 120 env OUT="$OUT/shmem" MORI_SKIP_CORE=1 bash ci/device/shmem.sh --no-tests
sed -n '/mori.shmem put bandwidth/,$p' "$OUT/shmem/bench.log"
step io_bench 240 env OUT="$OUT/io" bash ci/device/io.sh --no-tests
tail -n 45 "$OUT/io/io_bench.log"
if [ "$gpus" -ge 4 ]; then
  step allreduce 180 env OUT="$OUT/triton" bash ci/device/triton.sh --no-tests --pes "$gpus"
  tail -n 30 "$OUT/allreduce.log"
fi
step core 200 env OUT="$OUT/core" bash ci/device/core.sh
grep -hE "passed|failed|rc=" "$OUT/core.log" | tail -5
step shmem_tests 300 env OUT="$OUT/shmem" MORI_SKIP_CORE=1 bash ci/device/shmem.sh --no-bench --pes "$gpus"
grep -hE "passed|failed|rc=" "$OUT/shmem_tests.log" | tail -8
step shmem_proxy 300 env OUT="$OUT/proxy" bash ci/device/shmem_proxy.sh --no-bench --no-triton --pes "$gpus"
grep -hE "passed|failed|rc=" "$OUT/shmem_proxy.log" | tail -8
step io_tests 200 env OUT="$OUT/io" bash ci/device/io.sh --tests-only
grep -hE "passed|failed|rc=" "$OUT/io_tests.log" | tail -8
step triton_tests 300 env OUT="$OUT/triton" bash ci/device/triton.sh --no-bench --pes "$gpus" --modes static
grep -hE "passed|failed|rc=" "$OUT/triton_tests.log" | tail -8
step ops_tests 400 env OUT="$OUT/ops" bash ci/device/ep.sh --pes "$gpus" --no-bench
grep -hE "^rc=|passed|failed" "$OUT/ops_tests.log"
step ops_proxy 300 env OUT="$OUT/ops" bash ci/device/ep.sh --pes "$gpus" --no-bench --proxy
grep -hE "^rc=|passed|failed" "$OUT/ops_proxy.log"
step no_cuda_ucx 45 env -C /tmp python3 -m pytest -q -m gpu -p no:cacheprovider -s -k ucx_without_cuda \
  "$repo/packages/mori-shmem/tests/test_gpu.py"
grep -hE "ok  init refused|passed|failed|skipped" "$OUT/no_cuda_ucx.log" | cut -c1-300
step_done
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
