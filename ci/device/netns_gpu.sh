#!/usr/bin/env bash
# mori.shmem's and mori.ops' GPU tests of the remote transport with their PEs on two "hosts": two
# network namespaces joined by a veth pair on the GPU machine (MORI_TEST_NETNS=1: the tests start
# half of their PEs in each namespace, ci/device/netns_torchrun.py), any number of GPUs (PEs share
# them under MPS, multi_pe.sh). UCX on tcp + cuda_copy between the namespaces (no RDMA NIC here):
#   1. the shmem GPU tests through the proxy (test_gpu.py -k proxy: device-API kernels and host
#      API on the GPU heap, static and vmm heaps, a PE dying), each PE count of --pes;
#   2. mori.ops InterNodeV1, InterNodeV1LL and AsyncLL byte for byte against IntraNode, and the EP
#      surface checks (test_ops_gpu.py -k through_the_proxy): with MORI_DISABLE_P2P (every peer
#      through the proxy), then with P2P
#      inside each namespace and the remote transport across, each PE count of --ops-pes;
#   3. the Triton puts/gets and the seed's kernel B, 2 PEs (one per namespace: shmem_ptr_p2p is 0
#      for the other, so kernel B takes its IBGDA mode).
# Needs root and `ip` (iproute2, else ci/device/netns_ip.py: ip_shim.sh), .devkit/ucx (ucx_kit.sh).
# Usage: bash ci/device/netns_gpu.sh [--pes "2 4"] [--ops-pes "2 4 8"] [--only shmem|ops|triton] [--no-mps]
set -uo pipefail
. "$(dirname "$0")/multi_pe.sh"
ops_pes="2 4 8"
only=""
args=()
while [ $# -gt 0 ]; do
  case $1 in --ops-pes) ops_pes=$2; shift 2 ;; --only) only=$2; shift 2 ;; *) args+=("$1"); shift ;; esac
done
pes_script_start "${args[@]}" || exit 2
[ ${#PES_REST[@]} = 0 ] || { echo "unknown argument: ${PES_REST[*]}" >&2; exit 2; }
status=0
t0=$(date +%s)
repo=$PWD
. "$(dirname "$0")/ucx_wheel.sh"
. "$(dirname "$0")/ip_shim.sh"
if [ -z "${MORI_SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem \
    ./packages/mori-triton 2>&1 | tail -5 || exit 1
fi
use_ucx_wheel
use_ip_shim || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
cd /tmp  # import mori from site-packages, not the source tree
export MORI_TEST_NETNS=1 UCX_TLS=${UCX_TLS:-tcp,cuda_copy,self} MORI_SHMEM_TIMEOUT=${MORI_SHMEM_TIMEOUT:-30}
max_pes=$(echo $PES $ops_pes | tr ' ' '\n' | sort -n | tail -1)
pes_share_gpus "$max_pes"
if [ -z "$only" ] || [ "$only" = shmem ]; then
echo "== mori.shmem GPU tests through the proxy, PEs on two hosts ($PES PEs on $GPU_COUNT GPUs)"
MORI_TEST_PES="$PES" timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -s -k proxy \
  "$repo/packages/mori-shmem/tests/test_gpu.py" > "$OUT/netns_shmem.log" 2>&1
rc=$?; echo "rc=$rc"
grep -E "^ok |passed|failed|Error|error" "$OUT/netns_shmem.log" | sort | uniq -c | sort -rn | head -40
[ $rc = 0 ] || { status=1; tail -60 "$OUT/netns_shmem.log"; }
grep "^node " "$OUT/netns_shmem.log" | sort | uniq -c
fi
if [ -z "$only" ] || [ "$only" = ops ]; then
echo "== mori.ops InterNodeV1/V1LL/AsyncLL and the EP surface, PEs on two hosts ($ops_pes PEs)"
MORI_TEST_PES="$ops_pes" timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -s -k through_the_proxy \
  "$repo/packages/mori-shmem/tests/test_ops_gpu.py" > "$OUT/netns_ops.log" 2>&1
rc=$?; echo "rc=$rc"
grep -E "byte for byte|^ok |passed|failed|Error" "$OUT/netns_ops.log" | sed 's/seed [0-9]*//' | sort | uniq -c | sort -rn | head -30
[ $rc = 0 ] || { status=1; tail -60 "$OUT/netns_ops.log"; }
grep "^node " "$OUT/netns_ops.log" | sort | uniq -c
fi
if [ -z "$only" ] || [ "$only" = triton ]; then
echo "== Triton puts/gets and kernel B (IBGDA mode), 2 PEs on two hosts"
timeout 300 python3 "$repo/ci/device/netns_torchrun.py" 2 -m pytest -q -m gpu -p no:cacheprovider -s \
  -k "kernel_b or put_get_ring" "$repo/packages/mori-triton/tests/test_gpu.py" > "$OUT/netns_triton.log" 2>&1
rc=$?; echo "rc=$rc"
grep -E "^node |passed|failed|Error" "$OUT/netns_triton.log" | sort | uniq -c | head -20
[ $rc = 0 ] || { status=1; tail -60 "$OUT/netns_triton.log"; }
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
