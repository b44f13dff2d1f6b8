#!/usr/bin/env bash
# mori-io moving GPU memory between two "hosts" on the GPU machine: two network namespaces joined
# by a veth pair, both processes on GPU 0 (any GPU count >= 1), UCX from the libucx-cu13 wheel.
#
# Steps, in one lease: install mori-core, mori-shmem, mori-io, the UCX wheel and NIXL
# (.devkit/ucx, .devkit/nixl: ci/device/ucx_kit.sh, ci/device/nixl_kit.py; pyroute2 for the
# `ip` shim where the machine has no iproute2: ci/device/ip_shim.sh); the GPU tests of the
# staging (mori-core's device Stager, mori-io's TCP backend with GPU memory: every byte,
# GPU<->GPU/host, forged offsets, a killed target; the RDMA backend with GPU memory:
# ci/device/rdma_gpu.py); then mori-io-bench between the namespaces, --mem-type gpu and cpu,
# write and read, mori's TCP and RDMA backends beside NIXL on the same UCX transports
# (tcp,cuda_copy). Logs and JSON go to $OUT (at most 8 files).
# Usage (repository root, .devkit carried): bash ci/device/io_gpu_netns.sh [--no-tests] [--no-bench]
#   [--iters N] [--sizes 4K,64K,1M,4M] [--batch-sizes 1,64] [--mem gpu,cpu] [--mps] [--lat-iters N]
#   [--backend tcp,rdma] [--peers nixl] [--bench-args "ARGS"]
#   --backend / --peers: mori's backends and the peers beside them (--peers none: no peer), for
#          a run of one backend alone (its timestamps then hold only its transfers).
#   --bench-args "ARGS": more mori-io-bench arguments (--num-worker-threads 1, say).
#   --lat-iters N: after each run, single 4 KiB and 64 KiB blocks again with N timed transfers
#          (default 100; 0: none), so that their min latency is not the best of a handful (single
#          latencies of 10-20 transfers moved 5-10 us between runs on the H200 machine).
#   MORI_TRACE_DIR=DIR: each run's timestamps (csrc/base/trace.hpp) in DIR/<mem>_<op>[_lat], for
#          ci/trace_report.py --ladder T.
#   --mps: initiator and targets share GPU 0 under MPS (multi_pe.sh) instead of the driver's
#          time-slicing between their two contexts, which also takes turns for copy-engine work;
#          on two real hosts each process has its GPU to itself. JSON names then end in _mps.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
run_tests=1; run_bench=1; iters=20; sizes=4K,64K,1M,4M; batches=1,64; mems=gpu,cpu; mps=0; lat_iters=100
backends=tcp,rdma; peers=nixl; bench_args=""
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) run_tests=0 ;;
    --no-bench) run_bench=0 ;;
    --iters) iters=$2; shift ;;
    --sizes) sizes=$2; shift ;;
    --batch-sizes) batches=$2; shift ;;
    --mem) mems=$2; shift ;;
    --mps) mps=1 ;;
    --lat-iters) lat_iters=$2; shift ;;
    --backend) backends=$2; shift ;;
    --peers) peers=$2; shift ;;
    --bench-args) bench_args=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
status=0
t0=$(date +%s)
if [ -z "${MORI_SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem \
    ./packages/mori-io 2>&1 | tail -5
  python3 -m pip install -q --no-deps --no-index .devkit/nixl/*.whl 2>&1 | tail -3
fi
. "$(dirname "$0")/ucx_wheel.sh"
. "$(dirname "$0")/ip_shim.sh"
use_ucx_wheel
use_ip_shim || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
repo=$PWD
suffix=""
if [ $mps = 1 ]; then
  . "$(dirname "$0")/multi_pe.sh"
  trap pes_stop_mps EXIT
  GPU_COUNT=1 pes_share_gpus 2
  [ "${MORI_MPS:-1}" = 0 ] || suffix=_mps
fi
cd /tmp  # import mori from site-packages, not the source tree
# UCX over tcp between the namespaces, with cuda_copy so that NIXL's UCX takes GPU memory (mori's
# RDMA backend finds no transport with GPUDirect there and stages GPU memory itself).
export MORI_IO_RDMA_TRANSPORTS=tcp,cuda_copy UCX_TLS=tcp,cuda_copy

if [ $run_tests = 1 ]; then
  s=$(date +%s)
  {
    echo "== mori-core: the device Stager"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -k stager "$repo/packages/mori-core/tests/test_gpu_device.py"
    echo "rc=$?"
    echo "== mori-io: TCP backend with GPU memory"
    timeout 240 python3 -m pytest -q -p no:cacheprovider --durations=5 --rootdir "$repo" \
      "$repo/packages/mori-io/tests/test_tcp_gpu.py"
    echo "rc=$?"
    echo "== mori-io: RDMA backend with GPU memory (ci/device/rdma_gpu.py)"
    timeout 180 python3 "$repo/ci/device/rdma_gpu.py"
    echo "rc=$?"
  } > "$OUT/gpu_tests.log" 2>&1
  grep -E "^== |passed|failed|Error|rc=|^ok|FAIL" "$OUT/gpu_tests.log" | tail -40
  grep -q "rc=[^0]" "$OUT/gpu_tests.log" && status=1
  echo "== tests in $(( $(date +%s) - s ))s"
fi

if [ $run_bench = 1 ]; then
  python3 - "$OUT" "$iters" "$sizes" "$batches" "$mems" "$suffix" "$lat_iters" "$backends" "$peers" "$bench_args" <<'EOF' 2>&1 | tee -a "$OUT/bench.log"
import os, subprocess, sys, time
from mori.core import testing

out, iters, sizes, batches, mems, suffix, lat_iters, backends, peers, bench_args = sys.argv[1:]
trace_dir = os.environ.get("MORI_TRACE_DIR", "")
with testing.network_namespaces() as (a, b):
    print(f"initiator in {a.name} ({a.address}), targets in {b.name} ({b.address}), both on GPU 0", flush=True)
    for mem in mems.split(","):
        for op in ("write", "read"):
            # The points, then (lat_iters) single small blocks again with more transfers.
            runs = [(sizes, batches, iters, f"io_{mem}_{op}{suffix}.json", "")]
            if int(lat_iters) > 0:
                runs.append(("4K,64K", "1", lat_iters, "", f", single blocks, {lat_iters} transfers"))
            for run_sizes, run_batches, run_iters, json_name, what in runs:
                started = time.monotonic()
                cmd = ["ip", "netns", "exec", a.name, sys.executable, "-m", "mori.io.bench", "--backend", backends,
                       *(["--peers", peers, "--peer-python", sys.executable] if peers != "none" else []),
                       "--mem-type", mem, "--op", op,
                       "--sizes", run_sizes, "--batch-sizes", run_batches, "--iters", run_iters, "--warmup", "3",
                       "--host", a.address, "--target-host", b.address, "--target-netns", b.name, "--no-progress",
                       *bench_args.split()]
                if json_name:
                    cmd += ["--json", os.path.join(out, json_name)]
                print(f"\n== mori-io-bench --mem-type {mem} --op {op}{' (MPS)' if suffix else ''}{what}", flush=True)
                env = dict(os.environ)
                if trace_dir:  # each run's timestamps apart (ci/trace_report.py --ladder T reads one)
                    env["MORI_TRACE_DIR"] = os.path.join(trace_dir, f"{mem}_{op}{'_lat' if what else ''}")
                    os.makedirs(env["MORI_TRACE_DIR"], exist_ok=True)
                rc = subprocess.run(cmd, timeout=420, env=env).returncode
                print(f"rc={rc} in {time.monotonic() - started:.0f}s", flush=True)
EOF
  grep -q "^rc=[^0]" "$OUT/bench.log" && status=1
fi
echo "== done in $(( $(date +%s) - t0 ))s"
exit $status
