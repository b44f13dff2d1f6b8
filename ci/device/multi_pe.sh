# Sourced by the ci/device scripts that start several PEs (shmem.sh, triton.sh, ops): how many PEs,
# and how PEs that outnumber the GPUs share them. Not run on its own.
#
#   pes_parse_args "$@"   takes  --pes "2 4"  (PE counts to run each multi-PE test with; default
#                         "2 4", or $MORI_PES) and  --no-mps ; leaves the other arguments in
#                         PES_REST. Sets PES (the counts) and GPU_COUNT (visible GPUs).
#   pes_share_gpus N      when N PEs outnumber the GPUs: starts an MPS control daemon (unless
#                         --no-mps or MORI_MPS=0) so that the PEs' kernels run side by side, checks
#                         that a CUDA client can start under it, and else falls back to the driver's
#                         time-slicing. Prints which. A daemon already answering on the pipe
#                         directory (started by an outer script) is reused and left running.
#   pes_stop_mps          stops the daemon this script started (the scripts trap EXIT with it).
#   pes_script_start "$@" the opening of a multi-PE script (shmem.sh, shmem_proxy.sh): pes_parse_args,
#                         pes_stop_mps trapped on EXIT, NVLink multicast off, unbuffered Python,
#                         $OUT (default /tmp/mori-out) made, MORI_CACHE_DIR defaulted.
#
# PE i uses GPU i % GPU_COUNT (ci/device/gpu_world.py) and PEs that share a GPU talk through a gloo
# process group. Why MPS: docs/shmem.md, "Several PEs on one GPU".

PES=${MORI_PES:-"2 4"}
PES_REST=()
PES_MPS_STARTED=0
GPU_COUNT=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mori-mps/pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mori-mps/log}

pes_parse_args() {
  PES_REST=()
  while [ $# -gt 0 ]; do
    case $1 in
      --pes) PES=$2; shift ;;
      --pes=*) PES=${1#--pes=} ;;
      --no-mps) export MORI_MPS=0 ;;
      *) PES_REST+=("$1") ;;
    esac
    shift
  done
  for n in $PES; do
    case $n in ''|*[!0-9]*|0) echo "--pes: '$PES' is not a list of positive PE counts" >&2; return 2 ;; esac
  done
}

_pes_mps_answers() {
  echo get_server_list | timeout 10 nvidia-cuda-mps-control > /dev/null 2>&1
}

pes_share_gpus() {
  local n=$1
  if [ "$GPU_COUNT" = 0 ]; then
    echo "== no GPU visible (nvidia-smi lists none)"
    return 1
  fi
  if [ "$n" -le "$GPU_COUNT" ]; then
    echo "== $n PEs on $GPU_COUNT GPUs: one GPU per PE"
    return 0
  fi
  local per=$(( (n + GPU_COUNT - 1) / GPU_COUNT ))
  if [ "${MORI_MPS:-1}" = 0 ] || ! command -v nvidia-cuda-mps-control > /dev/null; then
    echo "== $n PEs on $GPU_COUNT GPUs (up to $per per GPU): driver time-slicing (no MPS)"
    return 0
  fi
  if ! _pes_mps_answers; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d && _pes_mps_answers; then
      PES_MPS_STARTED=1
    fi
  fi
  # A client must start under the daemon, or every PE would fail at its first CUDA call. One retry:
  # on the H100, a probe started beside another script's first client failed once.
  local probe="import torch; torch.ones(1, device='cuda').sum().item()"
  if _pes_mps_answers && { timeout 60 python3 -c "$probe" > /dev/null 2>&1 \
      || { sleep 2; timeout 60 python3 -c "$probe" > /dev/null 2>&1; }; }; then
    echo "== $n PEs on $GPU_COUNT GPUs (up to $per per GPU): MPS ($CUDA_MPS_PIPE_DIRECTORY)"
  else
    echo "== $n PEs on $GPU_COUNT GPUs (up to $per per GPU): MPS unusable here, driver time-slicing"
    pes_stop_mps
    export MORI_MPS=0
  fi
}

pes_stop_mps() {
  if [ "$PES_MPS_STARTED" = 1 ]; then
    echo quit | timeout 30 nvidia-cuda-mps-control > /dev/null 2>&1
    PES_MPS_STARTED=0
  fi
}

pes_script_start() {
  pes_parse_args "$@" || return 2
  trap pes_stop_mps EXIT
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  OUT=${OUT:-/tmp/mori-out}
  mkdir -p "$OUT"
  export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
}
