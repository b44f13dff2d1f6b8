#!/usr/bin/env bash
# mori.ops (MORI-EP) on the GPU machine: install; the GPU tests (ops_gpu_worker.py: bf16, fp8 with
# per-token and per-128 scales, float32, AsyncLL, zero copy, fp8 direct cast, CUDA-graph replay,
# MORI's EP checker; hot experts and refused second dispatches; InterNodeV1 and InterNodeV1LL with
# the PEs split into nodes, byte for byte against IntraNode; a dispatch graph replayed twice,
# which ends its PEs with a device trap) with each PE count of --pes (default "2 4 8"; PEs beyond
# the GPU count share GPUs, under MPS when it starts: multi_pe.sh, a fresh daemon per count); then
# bench_ep.py on one PE per GPU (MORI_BENCH_PES overrides the count; 16G heaps: ops are never freed,
# and with 8 PEs the prefill shape's ops take about 12 GB, the inter-node rows' staging and return
# blocks included).
# Run from the repository root with .devkit carried; logs and JSON go to $OUT.
# Usage: bash ci/device/ep.sh [--pes "2 4 8"] [--no-mps] [--no-tests] [--no-bench] [--proxy] [-k EXPR]
#                             [-- bench args]
#   -k EXPR: only the GPU tests pytest's -k selects (e.g. "hot or graph").
#   --proxy: InterNodeV1 and InterNodeV1LL through the device proxy (MORI_DISABLE_P2P, UCX on
#            tcp + cuda_copy from the libucx wheel of .devkit: ucx_wheel.sh), byte for byte
#            against IntraNode with P2P (test_internode_through_the_proxy...); no benchmark.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
MORI_PES=${MORI_PES:-"2 4 8"}
. "$(dirname "$0")/multi_pe.sh"
pes_parse_args "$@" || exit 2
trap pes_stop_mps EXIT
run_tests=1; run_bench=1; bench_args=(); select=(); seen_dashes=0; want_k=0; proxy=0
for a in "${PES_REST[@]}"; do
  if [ $seen_dashes = 1 ]; then bench_args+=("$a"); continue; fi
  if [ $want_k = 1 ]; then select=(-k "$a"); want_k=0; continue; fi
  case $a in
    --no-tests) run_tests=0 ;; --no-bench) run_bench=0 ;; --proxy) proxy=1; run_bench=0 ;; -k) want_k=1 ;;
    --) seen_dashes=1 ;;
  esac
done
# The proxy tests need the UCX wheel's CUDA transports (--proxy sets them up): without it, the rest.
if [ ${#select[@]} = 0 ]; then
  if [ $proxy = 1 ]; then select=(-k through_the_proxy); else select=(-k "not through_the_proxy"); fi
fi
status=0
t0=$(date +%s)
[ -n "${MORI_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --find-links .devkit/wheels \
  ./packages/mori-core ./packages/mori-shmem 2>&1 | tail -5 || exit 1
if [ $proxy = 1 ]; then
  . "$(dirname "$0")/ucx_wheel.sh"
  use_ucx_wheel
  export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,self} MORI_SHMEM_TIMEOUT=${MORI_SHMEM_TIMEOUT:-30}
fi
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
repo=$PWD
cd /tmp  # import mori from site-packages, not the source tree
if [ $run_tests = 1 ]; then
  for n in $PES; do
    pes_stop_mps  # the last test of a count ends in device traps: each count starts a fresh daemon
    pes_share_gpus "$n"
    echo "== mori.ops GPU tests, $n PEs"
    t1=$(date +%s)
    MORI_TEST_PES=$n timeout $(( 120 + (60 + 60 * proxy) * n )) python3 -m pytest -q -m gpu -p no:cacheprovider -s \
      "${select[@]}" "$repo/packages/mori-shmem/tests/test_ops_gpu.py" > "$OUT/ops_tests_$n.log" 2>&1
    rc=$?; echo "rc=$rc in $(( $(date +%s) - t1 ))s"
    grep -E "^ok |passed|failed|Error|error" "$OUT/ops_tests_$n.log" | cut -c1-200 | head -80
    # Through the proxy, what the engines and the proxy said (a stalled GPU copy or atomic, a timeout).
    [ $proxy = 1 ] && grep -hoE "mori (proxy|UCX engine)[^\\]*" "$OUT/ops_tests_$n.log" | cut -c1-300 | sort | uniq -c | head -20
    [ $rc = 0 ] || { status=1; tail -40 "$OUT/ops_tests_$n.log"; }
  done
fi
if [ $run_bench = 1 ]; then
  # One PE per GPU; on one GPU two PEs share it (MORI_BENCH_PES=1: a single PE, which exercises
  # the NCCL and symmetric-memory paths against itself).
  n=${MORI_BENCH_PES:-$(( GPU_COUNT >= 2 ? GPU_COUNT : 2 ))}
  pes_stop_mps
  pes_share_gpus "$n"
  echo "== bench_ep.py, $n PEs on $GPU_COUNT GPUs"
  MORI_SHMEM_HEAP_SIZE=${MORI_SHMEM_HEAP_SIZE:-16G} timeout 300 torchrun --standalone --nproc_per_node=$n \
    "$repo/ci/device/bench_ep.py" --out "$OUT/bench_ep.json" "${bench_args[@]}" > "$OUT/bench_ep.log" 2>&1
  rc=$?; echo "rc=$rc"
  sed -n '/mori.ops dispatch\/combine/,$p' "$OUT/bench_ep.log"
  [ $rc = 0 ] || { status=1; grep -v "^\s*$" "$OUT/bench_ep.log" | tail -30; }
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
