#!/usr/bin/env bash
# The docs' GPU examples on the GPU machine: every code block tagged `gpu` in docs/*.md and the
# READMEs (ci/doc_examples.py has the rules; the CPU ones run in ci/test.sh). The examples start
# 2 PEs; on one GPU they share it, under MPS when it starts (multi_pe.sh; MORI_MPS=0: without),
# since some of them wait in a kernel for the other PE.
# Run from the repository root with .devkit carried: `bash ci/device/doc_examples.sh`; the log
# goes to $OUT/doc_examples.log.
set -uo pipefail
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
[ -n "${MORI_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --find-links .devkit/wheels \
  ./packages/mori-core ./packages/mori-shmem ./packages/mori-io ./packages/mori-triton 2>&1 | tail -5 || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
. "$(dirname "$0")/multi_pe.sh"
trap pes_stop_mps EXIT
pes_share_gpus 2 || exit 1
python3 ci/doc_examples.py --gpu 2>&1 | tee "$OUT/doc_examples.log"
rc=${PIPESTATUS[0]}
echo "== done in $(( $(date +%s) - t0 ))s, rc=$rc"
exit $rc
