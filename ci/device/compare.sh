#!/usr/bin/env bash
# Before/after on one GPU machine, in one lease: this tree ("mine") against another version's tree
# ("base", e.g. `git archive OLD | tar -x -C .wt/base`, carried), each installed whole (its own
# native module) — base into a folder of its own put first on PYTHONPATH (its mori.core, mori.io
# and mori.shmem then shadow this tree's; the other requirements are the system's). Runs the TCP
# backend with GPU memory (ci/device/io_tcp_gpu_bench.py, this tree's script for both) and the
# shmem put/latency benchmark (each tree's own bench_shmem.py, 2 PEs under MPS) and the NVLink
# backend's (this tree's ci/device/io_bench.py; one GPU: same-GPU copies, not NVLink), alternating
# mine/base ROUNDS times so that neither always runs first. Logs and JSON go to $OUT.
# Usage (repository root, .devkit carried): bash ci/device/compare.sh BASE_DIR [ROUNDS] [ITERS]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
repo=$PWD
base=$(cd "$1" && pwd)
rounds=${2:-2}
iters=${3:-100}
kit=$repo/${MORI_DEVKIT:-.devkit}
t0=$(date +%s)
pkgs() { echo "$1/packages/mori-core" "$1/packages/mori-shmem" "$1/packages/mori-io"; }
# shellcheck disable=SC2046
python3 -m pip install -q --no-index --find-links "$kit/wheels" $(pkgs "$repo") 2>&1 | tail -3
# shellcheck disable=SC2046
rm -rf /tmp/mori-base
python3 -m pip install -q --no-deps --target /tmp/mori-base --no-index --find-links "$kit/wheels" $(pkgs "$base") \
  2>&1 | tail -3
echo "== installed mine and base in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
. "$repo/ci/device/multi_pe.sh"
trap pes_stop_mps EXIT
cd /tmp  # import mori from site-packages, not a source tree
status=0
run() {  # run VERSION ROUND: both benchmarks with VERSION's install
  local v=$1 r=$2 path= bench=$repo/ci/device/bench_shmem.py
  if [ "$v" = base ]; then path=/tmp/mori-base; bench=$base/ci/device/bench_shmem.py; fi
  PYTHONPATH=$path python3 -c "import mori.core, mori.io, mori.shmem as s; print('$v:', mori.core.__file__, mori.io.__file__, s.__file__)"
  PYTHONPATH=$path timeout 240 python3 "$repo/ci/device/io_tcp_gpu_bench.py" --iters "$iters" --out "$OUT/tcp_gpu_${v}_$r.json" \
    > "$OUT/tcp_gpu_${v}_$r.log" 2>&1 || { echo "tcp_gpu $v $r failed"; status=1; }
  echo "== TCP with GPU memory, $v, round $r"
  tail -n 30 "$OUT/tcp_gpu_${v}_$r.log"
  PYTHONPATH=$path timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 "$bench" --no-nvshmem \
    --out "$OUT/shmem_${v}_$r.json" > "$OUT/shmem_${v}_$r.log" 2>&1 || { echo "shmem $v $r failed"; status=1; }
  echo "== shmem bench, $v, round $r"
  sed -n '/mori.shmem put bandwidth/,$p' "$OUT/shmem_${v}_$r.log"
  PYTHONPATH=$path timeout 180 python3 "$repo/ci/device/io_bench.py" --iters 20 --out "$OUT/nvlink_${v}_$r.json" \
    > "$OUT/nvlink_${v}_$r.log" 2>&1 || { echo "nvlink $v $r failed"; status=1; }
  echo "== NVLink backend (io_bench.py), $v, round $r"
  grep -vE "^\s*$" "$OUT/nvlink_${v}_$r.log" | tail -n 75
}
pes_share_gpus 2  # the shmem bench's 2 PEs share the GPU under MPS; both versions run under it
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then run mine "$r"; run base "$r"; else run base "$r"; run mine "$r"; fi
done
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
