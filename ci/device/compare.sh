#!/usr/bin/env bash
# Before/after on one GPU machine, in one lease: this tree ("mine") against another version's tree
# ("base", e.g. `git archive OLD | tar -x -C .wt/base`, carried), each installed whole (its own
# native module) — base into a folder of its own put first on PYTHONPATH (its mori.core, mori.io
# and mori.shmem then shadow this tree's; the other requirements are the system's). Runs the TCP
# backend with GPU memory (ci/device/io_tcp_gpu_bench.py) and the
# shmem put/latency benchmark (each tree's own bench_shmem.py, 2 PEs under MPS) and the NVLink
# backend's (ci/device/io_bench.py; one GPU: same-GPU copies, not NVLink), each version with its own
# scripts (a script the base tree lacks is reported and skipped), in alternating order
# ROUNDS times so that no version always runs first. Logs and JSON go to $OUT.
# Usage (repository root, .devkit carried): bash ci/device/compare.sh BASE_DIR[,BASE_DIR...] [ROUNDS] [ITERS]
# Several bases (comma-separated) are each named by their folder's name and installed side by
# side (in parallel); one base is named "base". Each round runs mine and the bases, in reverse
# order every other round.
# MORI_BENCHES="tcp_gpu shmem nvlink": run only the named benchmarks (default: these three); "ep"
# adds mori.ops' bench_ep.py, one PE per GPU (MORI_EP_ARGS: its arguments).
# MORI_COMPARE_DEADLINE_S: start no benchmark once this many seconds have passed (say so), so that
# a short device lease still brings back what ran. The device tool brings back only a few files:
# give compare.sh an OUT of its own and tar it into the tool's $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
repo=$PWD
declare -A tree=([mine]=$repo) site=([mine]=)
versions=(mine)
IFS=, read -r -a base_dirs <<< "$1"
for dir in "${base_dirs[@]}"; do
  name=base
  [ "${#base_dirs[@]}" -gt 1 ] && name=$(basename "$dir")
  tree[$name]=$(cd "$dir" && pwd) site[$name]=/tmp/mori-$name
  versions+=("$name")
done
rounds=${2:-2}
iters=${3:-100}
kit=$repo/${MORI_DEVKIT:-.devkit}
t0=$(date +%s)
pkgs() { echo "$1/packages/mori-core" "$1/packages/mori-shmem" "$1/packages/mori-io"; }
# shellcheck disable=SC2046
python3 -m pip install -q --no-index --find-links "$kit/wheels" $(pkgs "$repo") > "$OUT/install_mine.log" 2>&1 &
for v in "${versions[@]:1}"; do
  rm -rf "${site[$v]}"
  # shellcheck disable=SC2046
  python3 -m pip install -q --no-deps --target "${site[$v]}" --no-index --find-links "$kit/wheels" \
    $(pkgs "${tree[$v]}") > "$OUT/install_$v.log" 2>&1 &
done
wait
for v in "${versions[@]}"; do tail -3 "$OUT/install_$v.log"; done
echo "== installed ${versions[*]} in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
. "$repo/ci/device/multi_pe.sh"
trap pes_stop_mps EXIT
cd /tmp  # import mori from site-packages, not a source tree
status=0
run() {  # run VERSION ROUND: the benchmarks with VERSION's install and VERSION's own scripts
  local v=$1 r=$2 path=${site[$1]} tree=${tree[$1]}
  PYTHONPATH=$path python3 -c "import mori.core, mori.io, mori.shmem as s; print('$v:', mori.core.__file__, mori.io.__file__, s.__file__)"
  want tcp_gpu && bench "$v" "$r" tcp_gpu "TCP with GPU memory" 240 "$tree/ci/device/io_tcp_gpu_bench.py" --iters "$iters" \
    && tail -n 30 "$OUT/tcp_gpu_${v}_$r.log"
  want shmem && launch="-m torch.distributed.run --standalone --nproc_per_node=2" \
    bench "$v" "$r" shmem "shmem bench" 120 "$tree/ci/device/bench_shmem.py" --no-nvshmem \
    && sed -n '/mori.shmem put bandwidth/,$p' "$OUT/shmem_${v}_$r.log"
  want nvlink && bench "$v" "$r" nvlink "NVLink backend (io_bench.py)" 180 "$tree/ci/device/io_bench.py" --iters 20 \
    && grep -vE "^\s*$" "$OUT/nvlink_${v}_$r.log" | tail -n 75
  # shellcheck disable=SC2086  # MORI_EP_ARGS is words
  want ep && launch="-m torch.distributed.run --standalone --nproc_per_node=$GPU_COUNT" MORI_SHMEM_HEAP_SIZE=16G \
    bench "$v" "$r" ep "EP dispatch/combine (bench_ep.py)" 300 "$tree/ci/device/bench_ep.py" ${MORI_EP_ARGS:-} \
    && sed -n '/mori.ops dispatch\/combine/,$p' "$OUT/ep_${v}_$r.log"
}
want() { [[ " ${MORI_BENCHES:-tcp_gpu shmem nvlink} " == *" $1 "* ]]; }
bench() {  # bench VERSION ROUND NAME TITLE LIMIT SCRIPT ARGS...: python3 [$launch] SCRIPT ARGS, log in $OUT
  local v=$1 r=$2 name=$3 title=$4 limit=$5 script=$6 path=${site[$1]}
  shift 6
  if [ -n "${MORI_COMPARE_DEADLINE_S:-}" ] && [ $(( $(date +%s) - t0 )) -ge "$MORI_COMPARE_DEADLINE_S" ]; then
    echo "== $title, $v, round $r: not started (MORI_COMPARE_DEADLINE_S=$MORI_COMPARE_DEADLINE_S passed)"
    return 1
  fi
  echo "== $title, $v, round $r"
  if [ ! -f "$script" ]; then echo "(not in $v's tree: $script)"; return 1; fi
  # shellcheck disable=SC2086  # $launch is words
  PYTHONPATH=$path timeout "$limit" python3 ${launch:-} "$script" "$@" --out "$OUT/${name}_${v}_$r.json" \
    > "$OUT/${name}_${v}_$r.log" 2>&1 || { echo "$name $v $r failed"; status=1; return 1; }
}
pes_share_gpus 2  # the shmem bench's 2 PEs share the GPU under MPS; both versions run under it
for r in $(seq 1 "$rounds"); do
  order=("${versions[@]}")
  if [ $((r % 2)) = 0 ]; then
    order=()
    for ((i = ${#versions[@]} - 1; i >= 0; i--)); do order+=("${versions[i]}"); done
  fi
  for v in "${order[@]}"; do run "$v" "$r"; done
done
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
