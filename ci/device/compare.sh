#!/usr/bin/env bash
# Before/after on one GPU machine, in one lease: this tree ("mine") against another version's tree
# ("base", e.g. `git archive OLD | tar -x -C .wt/base`, carried), each installed whole (its own
# native module) — base into a folder of its own put first on PYTHONPATH (its mori.core, mori.io
# and mori.shmem then shadow this tree's; the other requirements are the system's). Runs the TCP
# backend with GPU memory (ci/device/io_tcp_gpu_bench.py) and the
# shmem put/latency benchmark (each tree's own bench_shmem.py, 2 PEs under MPS) and the NVLink
# backend's (ci/device/io_bench.py; one GPU: same-GPU copies, not NVLink), each version with its own
# scripts (a script the base tree lacks is reported and skipped), alternating
# mine/base ROUNDS times so that neither always runs first. Logs and JSON go to $OUT.
# Usage (repository root, .devkit carried): bash ci/device/compare.sh BASE_DIR [ROUNDS] [ITERS]
# MORI_BENCHES="tcp_gpu shmem nvlink": run only the named benchmarks (default: all three).
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
run() {  # run VERSION ROUND: the benchmarks with VERSION's install and VERSION's own scripts
  local v=$1 r=$2 path= tree=$repo
  if [ "$v" = base ]; then path=/tmp/mori-base; tree=$base; fi
  PYTHONPATH=$path python3 -c "import mori.core, mori.io, mori.shmem as s; print('$v:', mori.core.__file__, mori.io.__file__, s.__file__)"
  want tcp_gpu && bench "$v" "$r" tcp_gpu "TCP with GPU memory" 240 "$tree/ci/device/io_tcp_gpu_bench.py" --iters "$iters" \
    && tail -n 30 "$OUT/tcp_gpu_${v}_$r.log"
  want shmem && launch="-m torch.distributed.run --standalone --nproc_per_node=2" \
    bench "$v" "$r" shmem "shmem bench" 120 "$tree/ci/device/bench_shmem.py" --no-nvshmem \
    && sed -n '/mori.shmem put bandwidth/,$p' "$OUT/shmem_${v}_$r.log"
  want nvlink && bench "$v" "$r" nvlink "NVLink backend (io_bench.py)" 180 "$tree/ci/device/io_bench.py" --iters 20 \
    && grep -vE "^\s*$" "$OUT/nvlink_${v}_$r.log" | tail -n 75
}
want() { [ -z "${MORI_BENCHES:-}" ] || [[ " $MORI_BENCHES " == *" $1 "* ]]; }
bench() {  # bench VERSION ROUND NAME TITLE LIMIT SCRIPT ARGS...: python3 [$launch] SCRIPT ARGS, log in $OUT
  local v=$1 r=$2 name=$3 title=$4 limit=$5 script=$6 path=
  shift 6
  [ "$v" = base ] && path=/tmp/mori-base
  echo "== $title, $v, round $r"
  if [ ! -f "$script" ]; then echo "(not in $v's tree: $script)"; return 1; fi
  # shellcheck disable=SC2086  # $launch is words
  PYTHONPATH=$path timeout "$limit" python3 ${launch:-} "$script" "$@" --out "$OUT/${name}_${v}_$r.json" \
    > "$OUT/${name}_${v}_$r.log" 2>&1 || { echo "$name $v $r failed"; status=1; return 1; }
}
pes_share_gpus 2  # the shmem bench's 2 PEs share the GPU under MPS; both versions run under it
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then run mine "$r"; run base "$r"; else run base "$r"; run mine "$r"; fi
done
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
