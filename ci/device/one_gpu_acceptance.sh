#!/usr/bin/env bash
# The GPU acceptance that a one-GPU machine can give, in one lease (~9 minutes), most important
# first, each step bounded so that a slow one cannot eat the rest:
#   io_tests      mori-io's GPU tests between two namespaces (io_gpu_netns.sh --no-bench: the
#                 device Stager, the TCP and RDMA backends with GPU memory: every byte, forged
#                 offsets, a killed peer);
#   shmem_netns   mori.shmem's GPU tests through the proxy, PEs in two namespaces (netns_gpu.sh
#                 --only shmem, 2 PEs);
#   ops_tests     mori.ops GPU tests other than the proxy ones, those of $MORI_OPS_K (default: the
#                 EP surface and the inter-node kernels against IntraNode: routing handles, replay
#                 dispatch, quantized combine, standard-MoE layout, AsyncLL ...) with 2, 4 and 8 PEs
#                 (ep.sh --no-bench -k);
#   ops_netns     mori.ops InterNodeV1/V1LL/AsyncLL and the EP surface through the device proxy,
#                 PEs in two network namespaces (netns_gpu.sh --only ops), 2 PEs;
#   no_cuda_ucx   a GPU heap with MORI_DISABLE_P2P on the machine's system UCX (no CUDA): refused
#                 at init (test_gpu.py);
#   proxy_bench   mori.shmem between two namespaces, GPU heaps (netns_bench.sh: host- and
#                 device-initiated puts, put+signal), with this tree's code, and, when
#                 MORI_BASELINE names a tree, with the baseline's too (its mori-core, mori-shmem
#                 and mori-io installed apart and run by its own scripts): before and after,
#                 MORI_PROXY_PAIRS times (default 1) in turns (ABBA...), so that the machine's
#                 drift falls on both alike; then the median of each tree's runs, per point
#                 (MORI_PROXY_ROUNDS rounds of each point a run, default 1; MORI_PROXY_SIZES;
#                 MORI_PROXY_IO=0 leaves mori-io-bench out of the runs; MORI_PROXY_CPU_HEAP=1 runs
#                 each on CPU heaps first, for the GPU heaps' put+signal against theirs);
#   io_bench      mori-io-bench between two namespaces, GPU memory (MORI_IO_MEMS=gpu,cpu: host
#                 memory too), TCP and RDMA beside NIXL (single 4 and 64 KiB blocks again with 100
#                 transfers each: io_gpu_netns.sh --lat-iters), under
#                 MPS (io_gpu_netns.sh --mps), with MORI_STAGING_PROFILE: every process's staging
#                 statistics (copies, bytes, copy and wait times) in $OUT/staging_profile.jsonl;
#   ep_bench      bench_ep.py with 2 PEs (every quantized combine), then with 1 PE (NCCL and
#                 PyTorch symmetric memory's all_to_all_vdev against itself).
# Run from the repository root with .devkit carried (and MORI_BASELINE's folder, e.g. a
# `git archive` of the baseline commit's packages/ and ci/ under .baseline).
# MORI_STEPS="ops_tests io_bench ...": only these steps. Logs go to $OUT (packed into logs.tgz).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
OUT_FINAL=${OUT:-/tmp/mori-out}
OUT=/tmp/mori-acceptance  # many logs: packed into $OUT_FINAL/logs.tgz, which brings back 8 files at most
mkdir -p "$OUT" "$OUT/io_tests" "$OUT/shmem_netns" "$OUT_FINAL"
repo=$PWD
t0=$(date +%s)
status=0
# Logs packed after every step (steps.sh calls step_done): a lease cut short brings back what ran.
step_done() { tar czf "$OUT_FINAL/logs.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
. "$repo/ci/device/steps.sh"
install_tree() {  # install_tree DIR [pip args]: its mori-core, mori-shmem and mori-io
  local dir=$1; shift
  timeout 90 python3 -m pip install -q --no-index --find-links "$repo/.devkit/wheels" --force-reinstall --no-deps "$@" \
    "$dir/packages/mori-core" "$dir/packages/mori-shmem" "$dir/packages/mori-io" 2>&1 | tail -3
}
python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem \
  ./packages/mori-io ./packages/mori-triton pyroute2 2>&1 | tail -3
python3 -m pip install -q --no-deps --no-index .devkit/ucx/*.whl .devkit/nixl/*.whl 2>&1 | tail -3
export MORI_SKIP_INSTALL=1
echo "== installed in $(( $(date +%s) - t0 ))s"

step io_tests 150 env OUT="$OUT/io_tests" bash ci/device/io_gpu_netns.sh --no-bench
grep -hE "^== |passed|failed|rc=" "$OUT/io_tests.log" | tail -10
step shmem_netns 150 env OUT="$OUT/shmem_netns" bash ci/device/netns_gpu.sh --only shmem --pes 2
grep -hE "^rc=|passed|failed" "$OUT/shmem_netns.log"
step ops_tests 230 env OUT="$OUT" bash ci/device/ep.sh --pes "2 4 8" --no-bench -k "${MORI_OPS_K:-(surface or internode) and not through_the_proxy}"
grep -hE "^rc=|passed|failed" "$OUT/ops_tests.log"
step ops_netns 110 env OUT="$OUT" bash ci/device/netns_gpu.sh --only ops --ops-pes 2
grep -hE "^rc=|passed|failed" "$OUT/ops_netns.log"
step no_cuda_ucx 45 env -C /tmp python3 -m pytest -q -m gpu -p no:cacheprovider -s -k ucx_without_cuda \
  "$repo/packages/mori-shmem/tests/test_gpu.py"
grep -hE "ok  init refused|passed|failed|skipped" "$OUT/no_cuda_ucx.log" | cut -c1-300

rounds=${MORI_PROXY_ROUNDS:-1}  # rounds of each proxy_bench point (medians over them)
nb_args=(--rounds "$rounds" --iters 10 --sizes "${MORI_PROXY_SIZES:-4K,64K,1M,16M}")
[ "${MORI_PROXY_IO:-1}" = 1 ] && nb_args+=(--io)
[ "${MORI_PROXY_CPU_HEAP:-0}" = 1 ] && nb_args+=(--cpu-heap)  # CPU heaps first, in the same run
nb_limit=$(( (45 + 30 * rounds) * (1 + ${MORI_PROXY_CPU_HEAP:-0}) ))
trees=(now)
if [ -n "${MORI_BASELINE:-}" ]; then
  base=$repo/$MORI_BASELINE
  ln -sfn "$repo/.devkit" "$base/.devkit"
  install_tree "$base" --target /tmp/mori-baseline
  trees=(baseline now)
fi
proxy_run() {  # proxy_run TREE PAIR: one netns_bench.sh run of that tree's code
  local tree=$1 pair=$2 dir=$repo path=""
  [ "$tree" = baseline ] && { dir=$base; path=/tmp/mori-baseline; }
  mkdir -p "$OUT/$tree/$pair"
  step "proxy_${tree}_$pair" "$nb_limit" env -C "$dir" PYTHONPATH=$path OUT="$OUT/$tree/$pair" \
    bash ci/device/netns_bench.sh "${nb_args[@]}"
  grep -v "^\[" "$OUT/$tree/$pair/shmem_remote_device.log" | tail -7
}
for pair in $(seq 1 "${MORI_PROXY_PAIRS:-1}"); do
  order=("${trees[@]}")
  [ $(( pair % 2 )) = 0 ] && order=($(printf '%s\n' "${trees[@]}" | tac))
  for tree in "${order[@]}"; do proxy_run "$tree" "$pair"; done
done
python3 - "$OUT" "${trees[@]}" <<'EOF'
import glob, json, statistics, sys
out, trees = sys.argv[1], sys.argv[2:]
runs = {t: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{t}/*/shmem_remote_device.json"))] for t in trees}
print("proxy_bench, median of each tree's runs (" + ", ".join(f"{t}: {len(r)}" for t, r in runs.items()) + ")")
print(f"{'size':>10} " + " ".join(f"{t + ' ' + k:>26}" for k in ("shmem put", "device put", "engine") for t in trees))
for i, row in enumerate(runs[trees[0]][0]["put"] if runs[trees[0]] else []):
    cells = []
    for key in ("put_gbps", "device_put_gbps", "engine_gbps"):
        for t in trees:
            vals = [r["put"][i][key] for r in runs[t]]
            cells.append(f"{statistics.median(vals):8.3f} ({min(vals):.3f}-{max(vals):.3f})")
    print(f"{row['size']:>10} " + " ".join(f"{c:>26}" for c in cells))
for k in ("signal", "device_signal"):
    print(f"put+signal one way, {k}: " + ", ".join(
        f"{t} {statistics.median(r['signal_one_way_us'][k] for r in runs[t]):.1f} us" for t in trees if runs[t]))
cpu = {t: [json.load(open(f))["signal_one_way_us"]["signal"]
           for f in sorted(glob.glob(f"{out}/{t}/*/shmem_remote_cpu.json"))] for t in trees}
for t, v in cpu.items():
    if v:
        print(f"put+signal one way on CPU heaps, {t}: {statistics.median(v):.1f} us ({len(v)} runs)")
EOF

export MORI_STAGING_PROFILE=$OUT/staging_profile.jsonl
io_mems=${MORI_IO_MEMS:-gpu}  # gpu,cpu: host memory in the same lease too, for GPU/host ratios
step io_bench $(( 160 * $(echo "$io_mems" | tr ',' '\n' | wc -l) )) env OUT="$OUT" bash ci/device/io_gpu_netns.sh \
  --no-tests --mem "$io_mems" --mps --iters 10
grep -E "^(mori|mori-rdma|nixl) |^== mori-io-bench" "$OUT/io_bench.log"
python3 - "$MORI_STAGING_PROFILE" <<'EOF'
import json, sys
try:
    lines = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    lines = []
print(f"staging profile: {len(lines)} stagers")
for p in lines:
    copies = p["to_host"] + p["to_device"]
    moved = p["to_host_bytes"] + p["to_device_bytes"]
    if copies:
        print(f"  pid {p['pid']} {' '.join(p['argv'][1:4])[:60]}: {p['to_host']} out / {p['to_device']} in, "
              f"{moved / 2**20:.0f} MiB, copy {p['copy_ns'] / copies / 1e3:.1f} us each (queued to seen ended), "
              f"waited {p['wait_ns'] / 1e6:.1f} ms, unpinned {p['unpinned']}, pinned {p['pinned']}")
EOF
unset MORI_STAGING_PROFILE

step ep_bench 70 env OUT="$OUT" bash ci/device/ep.sh --pes 2 --no-tests -- --iters 10
sed -n '/mori.ops dispatch\/combine/,$p' "$OUT/ep_bench.log" | grep -v "^\s*$"
step ep_bench_1pe 50 env OUT="$OUT/one" MORI_BENCH_PES=1 bash ci/device/ep.sh --pes 1 --no-tests -- --shapes decode \
  --quants none --iters 10
grep -E "nccl|symm_mem|rc=" "$OUT/ep_bench_1pe.log"
step_done
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
