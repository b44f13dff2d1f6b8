#!/usr/bin/env bash
# mori.shmem between two network namespaces joined by a veth pair on the GPU machine, which has
# no iproute2: ci/shmem_remote_bench.py --device (GPU heaps; host- and device-initiated puts and
# put+signal ping-pongs, the device's through the proxy, beside mori-core's UCX engine moving
# GPU memory, all over UCX tcp + cuda_copy between the namespaces). Both PEs share GPU 0 under
# MPS on a one-GPU machine (multi_pe.sh). Needs root and `unshare` (util-linux).
#
# Without `ip` on the machine, ci/device/netns_ip.py (pyroute2) stands in for it (ip_shim.sh says
# how to fetch its wheel into .devkit/wheels), and .devkit/ucx (the libucx-cu13 wheel,
# ci/device/ucx_kit.sh) for UCX with CUDA support.
#
# Steps: install mori-core, mori-shmem, mori-io (--io runs mori-io-bench) (and pyroute2 when `ip` is missing); check that two
# namespaces can be made and reach each other (a TCP connection from one to the other, and /sys
# showing each one's devices); then the benchmark. Logs and JSON go to $OUT.
# With NIXL in the run (--io --peer-python python3): install it on the device first from
# .devkit/nixl (ci/device/nixl_kit.py): python3 -m pip install --no-deps --no-index .devkit/nixl/*.whl
# --cpu-heap first runs the same benchmark on CPU heaps (host memory against mori-io-bench's host
# memory: the like-for-like comparison the 2-core CI VM also makes), then the GPU heaps' run.
# Usage: bash ci/device/netns_bench.sh [--check-only] [--cpu-heap] [shmem_remote_bench.py args, e.g. --rounds 3 --iters 20]
set -uo pipefail
. "$(dirname "$0")/multi_pe.sh"
pes_script_start --pes 2 "$@" || exit 2
check_only=0
cpu_heap=0
bench_args=()
for a in "${PES_REST[@]}"; do
  case $a in --check-only) check_only=1 ;; --cpu-heap) cpu_heap=1 ;; *) bench_args+=("$a") ;; esac
done
repo=$PWD
t0=$(date +%s)
if [ -z "${MORI_SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core ./packages/mori-shmem ./packages/mori-io \
    2>&1 | tail -5 || exit 1
fi
. "$(dirname "$0")/ucx_wheel.sh"
. "$(dirname "$0")/ip_shim.sh"
use_ucx_wheel
use_ip_shim || exit 1
echo "== installed in $(( $(date +%s) - t0 ))s"
cd /tmp  # import mori from site-packages, not the source tree
echo "== two network namespaces joined by a veth pair"
python3 - <<'EOF' 2>&1 | tee "$OUT/netns_check.log"
import subprocess, sys
from mori.core import testing

with testing.network_namespaces() as (a, b):
    server = ("import socket; s = socket.socket(); s.bind((%r, 5599)); s.listen(); c, _ = s.accept(); "
              "c.sendall(open('/sys/class/net/%s/address', 'rb').read()); c.close()" % (a.address, a.device))
    srv = subprocess.Popen(["ip", "netns", "exec", a.name, sys.executable, "-c", server])
    client = ("import os, socket, time\nfor _ in range(100):\n    try:\n        s = socket.create_connection((%r, 5599), 2)\n"
              "        break\n    except OSError:\n        time.sleep(0.05)\nprint(s.recv(64).decode().strip(), sorted(os.listdir('/sys/class/net')))"
              % a.address)
    out = subprocess.run(["ip", "netns", "exec", b.name, sys.executable, "-c", client], capture_output=True, text=True,
                         timeout=60)
    srv.wait(10)
    print(f"namespaces {a.name} ({a.address}) and {b.name} ({b.address}): B read A's MAC over TCP: {out.stdout.strip()}",
          out.stderr.strip())
    assert out.returncode == 0 and srv.returncode == 0, "the namespaces do not reach each other"
EOF
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { echo "== namespace check failed (rc=$rc)"; exit 1; }
[ $check_only = 1 ] && { echo "== done (check only)"; exit 0; }
if [ $cpu_heap = 1 ]; then
  echo "== shmem_remote_bench.py (CPU heaps) ${bench_args[*]}"
  timeout 240 python3 "$repo/ci/shmem_remote_bench.py" --json "$OUT/shmem_remote_cpu.json" "${bench_args[@]}" --io-mem cpu \
    > "$OUT/shmem_remote_cpu.log" 2>&1
  echo "rc=$?"
  grep -v "^\[" "$OUT/shmem_remote_cpu.log" | tail -9
fi
pes_share_gpus 2
echo "== shmem_remote_bench.py --device ${bench_args[*]}"
timeout $(( cpu_heap ? 330 : 540 )) python3 "$repo/ci/shmem_remote_bench.py" --device --json "$OUT/shmem_remote_device.json" "${bench_args[@]}" \
  > "$OUT/shmem_remote_device.log" 2>&1
rc=$?
echo "rc=$rc"
grep -v "^\[" "$OUT/shmem_remote_device.log" | tail -12
echo "== done in $(( $(date +%s) - t0 ))s"
exit $rc
