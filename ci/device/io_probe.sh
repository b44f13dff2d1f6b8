#!/usr/bin/env bash
# Where a staged GPU transfer's time goes, in one lease (~6 minutes), each step bounded:
#   gpu_tests   the GPU tests of the staging (io_gpu_netns.sh --no-bench: mori-core's device
#               Stager, mori-io's TCP and RDMA backends with GPU memory);
#   stager      ci/device/staging_probe.py: one piece's copy latency, queueing cost and pipelined
#               GB/s through mori-core's device Stager, beside PyTorch's copies (the ceiling);
#               then the same in two processes at once under MPS (as initiator and target share
#               GPU 0 in the benchmarks);
#   tcp_loop    ci/device/io_tcp_gpu_bench.py: the TCP backend on loopback, GPU<->GPU, GPU<->CPU
#               and CPU<->GPU, read and write (which end's staging costs what);
#   tcp_baseline  with MORI_BASELINE naming a tree of another version (e.g. a `git archive` under
#               .baseline, carried): its mori-io-bench, TCP only, GPU memory (MORI_PROBE_BASELINE_MEMS=gpu,cpu:
#               host memory too), at tcp_conns' points
#               (this step and tcp_conns: MORI_PROBE_BACKEND=rdma benchmarks the RDMA backend on
#               UCX tcp,cuda_copy instead; MORI_PROBE_ITERS timed transfers per point, default 10);
#   tcp_conns   this tree's: TCP only, GPU and host memory, with 1 and 4 data connections
#               (MORI_PROBE_CONNS, MORI_PROBE_SIZES, MORI_PROBE_BATCHES: other lists)
#               (MORI_STAGING_PROFILE on: every process's copies and waits);
#   tcp_pairs   two initiator processes at once against one with two connections;
#   tcp_cpu     where the CPUs' time goes (ci/device/cpu_sampler.py: the machine's busy share, the
#               busiest threads) during GPU and host-memory writes of 64 x 1 MiB, 4 connections
#               (and GPU with 1);
#   tcp_perf    where mori's TCP threads spend it, kernel included: perf (.devkit/perf.tar.xz from
#               ci/device/perf_kit.sh) samples every CPU with call graphs during GPU and then
#               host-memory writes of 64 x 1 MiB over 1 and 4 connections (MORI_PROBE_PERF_CONNS,
#               MORI_PROBE_PERF_MEMS); the report gives each thread's samples, then the top
#               functions of the TCP threads (mori-tcp-send, mori-tcp-recv, mori-tcp-serve) and
#               of the bench's own (python3), with their counts and shares.
# Run from the repository root with .devkit carried. MORI_STEPS="stager ..." runs only those.
# Logs go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
repo=$PWD
t0=$(date +%s)
status=0
. "$repo/ci/device/steps.sh"
python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem \
  ./packages/mori-io pyroute2 2>&1 | tail -3
python3 -m pip install -q --no-deps --no-index .devkit/ucx/*.whl .devkit/nixl/*.whl 2>&1 | tail -3
export MORI_SKIP_INSTALL=1
. "$repo/ci/device/ip_shim.sh"
use_ip_shim || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
cd /tmp  # import mori from site-packages, not the source tree

step gpu_tests 300 env -C "$repo" OUT="$OUT/gpu_tests" bash ci/device/io_gpu_netns.sh --no-bench
grep -E "^== |passed|failed|rc=" "$OUT/gpu_tests.log" | tail -12
step stager 90 python3 "$repo/ci/device/staging_probe.py" --iters 100
cat "$OUT/stager.log"
two_stagers() {
  . "$repo/ci/device/multi_pe.sh"
  trap pes_stop_mps EXIT
  GPU_COUNT=1 pes_share_gpus 2
  python3 "$repo/ci/device/staging_probe.py" --iters 100 --sizes 256K,1M > "$OUT/stager_b.log" 2>&1 &
  python3 "$repo/ci/device/staging_probe.py" --iters 100 --sizes 256K,1M
  wait
  echo "-- the other process:"; cat "$OUT/stager_b.log"
}
step stager_mps 120 bash -c "$(declare -f two_stagers); repo=$repo OUT=$OUT two_stagers"
cat "$OUT/stager_mps.log"

step tcp_loop 150 python3 "$repo/ci/device/io_tcp_gpu_bench.py" --iters 10 --out "$OUT/tcp_loop.json"
tail -30 "$OUT/tcp_loop.log"

# tcp_bench MEMS CONNS [SIZES BATCHES]: mori-io-bench between two namespaces, TCP only, each memory
# type, op and connection count.
tcp_bench() {
  python3 - "$@" <<'EOF'
import os, subprocess, sys
from mori.core import testing

backend, iters = os.environ.get("MORI_PROBE_BACKEND", "tcp"), os.environ.get("MORI_PROBE_ITERS", "10")
mems, conns = sys.argv[1].split(","), sys.argv[2].split(",")
sizes = sys.argv[3] if len(sys.argv) > 3 else "4K,64K,1M,4M"
batches = sys.argv[4] if len(sys.argv) > 4 else "1,64"
with testing.network_namespaces() as (a, b):
    for n in conns:
        for mem in mems:
            for op in ("write", "read"):
                print(f"\n== --mem-type {mem} --op {op} --num-connections {n}", flush=True)
                cmd = ["ip", "netns", "exec", a.name, sys.executable, "-m", "mori.io.bench", "--backend", backend,
                       "--mem-type", mem, "--op", op, "--num-connections", n, "--sizes", sizes,
                       "--batch-sizes", batches, "--iters", iters, "--warmup", "3", "--host", a.address,
                       "--target-host", b.address, "--target-netns", b.name, "--no-progress"]
                subprocess.run(cmd, timeout=120)
EOF
}
# tcp_pairs: GPU writes of 64 x 1 MiB by two initiator processes at once (a connection each,
# their own target processes), against one initiator with two connections: whether a process's
# connections slow each other down (the driver's locks) or the GPU's copies are the limit.
tcp_pairs() {
  python3 - <<'EOF'
import subprocess, sys
from mori.core import testing

with testing.network_namespaces() as (a, b):
    def cmd(conns):
        return ["ip", "netns", "exec", a.name, sys.executable, "-m", "mori.io.bench", "--backend", "tcp",
                "--mem-type", "gpu", "--op", "write", "--num-connections", conns, "--sizes", "1M",
                "--batch-sizes", "64", "--iters", "30", "--warmup", "3", "--host", a.address,
                "--target-host", b.address, "--target-netns", b.name, "--no-progress"]
    print("== one initiator, 2 connections", flush=True)
    subprocess.run(cmd("2"), timeout=120)
    print("== two initiators at once, 1 connection each", flush=True)
    ps = [subprocess.Popen(cmd("1")) for _ in range(2)]
    for p in ps:
        p.wait(timeout=120)
EOF
}
# tcp_cpu: cpu_sampler.py around each write run (GPU and host memory, 4 connections; GPU, 1).
tcp_cpu() {
  python3 - "$repo/ci/device/cpu_sampler.py" <<'EOF'
import subprocess, sys
from mori.core import testing

with testing.network_namespaces() as (a, b):
    for mem, conns in (("gpu", "4"), ("cpu", "4"), ("gpu", "1")):
        print(f"== --mem-type {mem} --num-connections {conns}: 64 x 1 MiB writes", flush=True)
        bench = ["ip", "netns", "exec", a.name, sys.executable, "-m", "mori.io.bench", "--backend", "tcp",
                 "--mem-type", mem, "--op", "write", "--num-connections", conns, "--sizes", "1M",
                 "--batch-sizes", "64", "--iters", "150", "--warmup", "5", "--host", a.address,
                 "--target-host", b.address, "--target-netns", b.name, "--no-progress"]
        subprocess.run([sys.executable, sys.argv[1], "--top", "30", "--", *bench], timeout=150)
EOF
}
# tcp_perf: perf record around each write run (GPU, then host memory; MORI_PROBE_PERF_CONNS
# connections, default 1,4), then each thread's samples and the top functions of the TCP threads
# and of the bench's own (python3), counted from `perf script`, one line per sample: `perf report`
# filtered by thread put some of the serving threads' samples under the process's name. Counts
# compare across runs (they move the same bytes); shares are of the threads' own samples.
tcp_perf() {
  mkdir -p /tmp/perf && tar xJf "$repo/.devkit/perf.tar.xz" -C /tmp/perf || return 1
  python3 - "${MORI_PROBE_PERF_CONNS:-1,4}" "${MORI_PROBE_PERF_MEMS:-gpu,cpu}" <<'EOF'
import collections, re, subprocess, sys
from mori.core import testing

perf = ["env", "LD_LIBRARY_PATH=/tmp/perf/lib", "/tmp/perf/perf"]
SAMPLE = re.compile(r"^\s*(.+?)\s+(\d+)\s+[0-9a-f]+\s+(.*)$")

def samples(data):
    """(comm, tid) -> Counter of the functions each sample was in (its leaf frame, with its DSO)."""
    out = subprocess.run([*perf, "script", "-i", data, "-F", "comm,tid,ip,sym,dso", "--hide-call-graph"],
                         capture_output=True, text=True, timeout=240).stdout
    threads = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        m = SAMPLE.match(line)
        if m:
            threads[(m.group(1), int(m.group(2)))][m.group(3)] += 1
    return threads

with testing.network_namespaces() as (a, b):
    for conns in sys.argv[1].split(","):
        for mem in sys.argv[2].split(","):
            print(f"\n== --mem-type {mem} --num-connections {conns}: 64 x 1 MiB writes under perf record", flush=True)
            bench = ["ip", "netns", "exec", a.name, sys.executable, "-m", "mori.io.bench", "--backend", "tcp",
                     "--mem-type", mem, "--op", "write", "--num-connections", conns, "--sizes", "1M",
                     "--batch-sizes", "64", "--iters", "100", "--warmup", "5", "--host", a.address,
                     "--target-host", b.address, "--target-netns", b.name, "--no-progress"]
            data = f"/tmp/perf/{mem}{conns}.data"
            # The bench runs without the bundle's libraries (LD_LIBRARY_PATH is for perf alone).
            subprocess.run([*perf, "record", "-q", "-a", "-g", "-F", "999", "-o", data, "--", "env", "-u",
                            "LD_LIBRARY_PATH", *bench], timeout=150)
            threads = samples(data)
            busiest = sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))
            print("-- threads:", "; ".join(f"{c}/{t} {sum(n.values())}" for (c, t), n in busiest[:14] if c != "swapper"))
            for comm in ("mori-tcp-send", "mori-tcp-recv", "mori-tcp-serve", "python3"):
                funcs = collections.Counter()
                for (c, _), n in threads.items():
                    if c == comm:
                        funcs.update(n)
                total = sum(funcs.values())
                print(f"-- {comm}: {total} samples" + ("" if total else " (none)"))
                for func, n in funcs.most_common(10):
                    print(f"  {n:7d} {100 * n / total:5.1f}%  {func[:110]}")
            sys.stdout.flush()
EOF
}
export MORI_STAGING_PROFILE=$OUT/staging_profile.jsonl
# The RDMA backend over the transports the device machine has (as io_gpu_netns.sh runs it).
export MORI_IO_RDMA_TRANSPORTS=tcp,cuda_copy UCX_TLS=tcp,cuda_copy
if [ -n "${MORI_BASELINE:-}" ]; then
  timeout 90 python3 -m pip install -q --no-index --find-links "$repo/.devkit/wheels" --force-reinstall --no-deps \
    --target /tmp/mori-baseline "$repo/$MORI_BASELINE/packages/mori-core" "$repo/$MORI_BASELINE/packages/mori-io" \
    2>&1 | tail -3
  step tcp_baseline 150 env PYTHONPATH=/tmp/mori-baseline bash -c "$(declare -f tcp_bench); tcp_bench ${MORI_PROBE_BASELINE_MEMS:-gpu} ${MORI_PROBE_CONNS:-1,4} ${MORI_PROBE_SIZES:-64K,1M,4M} ${MORI_PROBE_BATCHES:-1,64}"
  grep -E "^==|^mori " "$OUT/tcp_baseline.log"
fi
step tcp_conns 240 bash -c "$(declare -f tcp_bench); tcp_bench gpu,cpu ${MORI_PROBE_CONNS:-1,4} ${MORI_PROBE_SIZES:-64K,1M,4M} ${MORI_PROBE_BATCHES:-1,64}"
grep -E "^==|^mori " "$OUT/tcp_conns.log"
step tcp_pairs 90 bash -c "$(declare -f tcp_pairs); tcp_pairs"
grep -E "^==|^mori " "$OUT/tcp_pairs.log"
step tcp_cpu 200 bash -c "$(declare -f tcp_cpu); repo=$repo tcp_cpu"
cat "$OUT/tcp_cpu.log"
step tcp_perf 330 bash -c "$(declare -f tcp_perf); repo=$repo tcp_perf"
head -c 11000 "$OUT/tcp_perf.log"
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
