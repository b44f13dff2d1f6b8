#!/usr/bin/env bash
# mori.triton.mlir on the GPU machine, any number of GPUs: the seed's two MLIR kernels run with each
# PE count of --pes (default "2 4"; PEs beyond the GPU count share GPUs, under MPS when it starts:
# multi_pe.sh) and every PE checks its results (ci/device/triton_mlir.py).
# The GPU machine has no MLIR bindings: build the cubins first on a CPU machine with the [mlir]
# extra and carry the folder:
#   python -m mori.triton.mlir --arch sm_90 --out mlir-kernels --cubin
# Usage (repository root, .devkit carried):
#   bash ci/device/triton_mlir.sh [--pes "2 4"] [--no-mps] [KERNEL_DIR]   (default mlir-kernels)
set -uo pipefail
. "$(dirname "$0")/multi_pe.sh"
pes_parse_args "$@" || exit 2
trap pes_stop_mps EXIT
set -- "${PES_REST[@]}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# A stuck kernel fails after 30 s instead of holding the GPU (PEs sharing a GPU run slower).
export MORI_SHMEM_TIMEOUT=${MORI_SHMEM_TIMEOUT:-30}
kernels=$(cd "${1:-mlir-kernels}" 2>/dev/null && pwd) || {
  echo "no kernel folder ${1:-mlir-kernels}: python -m mori.triton.mlir --arch sm_90 --out mlir-kernels --cubin"; exit 1; }
t0=$(date +%s)
[ -n "${MORI_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --find-links .devkit/wheels \
  ./packages/mori-core ./packages/mori-shmem ./packages/mori-triton 2>&1 | tail -5 || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
repo=$PWD
cd /tmp  # import mori from site-packages, not the source tree
status=0
for n in $PES; do
  pes_share_gpus "$n"
  timeout 120 torchrun --standalone --nproc_per_node=$n "$repo/ci/device/triton_mlir.py" --kernels "$kernels" 2>&1 \
    | grep -v -E "^(W|I)[0-9]{4} |^\*+$|OMP_NUM_THREADS|Setting OMP"
  rc=${PIPESTATUS[0]}; echo "rc=$rc"; [ "$rc" = 0 ] || status=1
done
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
