#!/usr/bin/env bash
# Where a socket's receiving thread spends its time, by the kind of buffer it receives into:
# pinned_socket_probe.py (one thread, loopback) under `perf record -a` once per receiving kind,
# then the busiest processes' top leaf functions (of the threads mostly copying to or from a socket) from `perf script`.
# Usage: bash ci/device/socket_perf.sh [KINDS (default pageable,pageable-cuda)] [TOTAL (default 4G)]
set -uo pipefail
repo=$PWD
mkdir -p /tmp/perf && tar xJf "$repo/.devkit/perf.tar.xz" -C /tmp/perf || exit 1
perf=(env LD_LIBRARY_PATH=/tmp/perf/lib /tmp/perf/perf)
for kind in $(echo "${1:-pageable,pageable-cuda}" | tr , ' '); do
  echo "== receiving into $kind"
  "${perf[@]}" record -q -a -F 999 -o "/tmp/perf/$kind.data" -- env -u LD_LIBRARY_PATH \
    python3 ci/device/pinned_socket_probe.py --send pageable --receive "$kind" --total "${2:-4G}"
  "${perf[@]}" script -i "/tmp/perf/$kind.data" -F comm,pid,tid,ip,sym,dso 2>/dev/null | python3 -c '
import collections, re, sys
line_re = re.compile(r"^\s*(.+?)\s+(\d+)/(\d+)\s+[0-9a-f]+\s+(.*)$")
by = collections.defaultdict(collections.Counter)
for line in sys.stdin:
    m = line_re.match(line)
    if m and m.group(1) != "swapper":
        by[(m.group(1), m.group(3))][m.group(4)] += 1
# The socket threads: those whose samples are mostly the kernel copying to or from a socket.
def copying(funcs):
    return sum(n for f, n in funcs.items() if "_copy_to_iter" in f or "_copy_from_iter" in f)
socket_threads = [kv for kv in by.items() if copying(kv[1]) > 0.2 * sum(kv[1].values())]
for (comm, tid), funcs in sorted(socket_threads, key=lambda kv: -sum(kv[1].values()))[:4]:
    total = sum(funcs.values())
    print(f"-- {comm}/{tid}: {total} samples")
    for func, n in funcs.most_common(12):
        print(f"  {n:7d} {100 * n / total:5.1f}%  {func[:110]}")
'
done
