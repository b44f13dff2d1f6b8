"""Where a machine's CPU time goes while a command runs: the machine's busy share (from
/proc/stat) and the threads that used the most CPU (from /proc/*/task/*/stat), over the
command's whole run, measured from its start to its end.

For the staged TCP plane's question: do a process's connection threads spin on cores that the
kernel's TCP work (softirq, the receiving side's copies) then lacks?

Usage: python ci/device/cpu_sampler.py [--top 25] -- COMMAND...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _machine() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _threads() -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (name, utime + stime in jiffies) of every thread alive now."""
    out: dict[tuple[int, int], tuple[str, int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            name = raw[raw.index("(") + 1 : raw.rindex(")")]
            rest = raw[raw.rindex(")") + 2 :].split()
            out[(int(pid), int(tid))] = (name, int(rest[11]) + int(rest[12]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("a command to run")
    busy0, total0 = _machine()
    first = {key: jiffies for key, (_, jiffies) in _threads().items()}  # threads alive before
    last: dict[tuple[int, int], tuple[str, int]] = {}  # each thread's latest sample
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        last.update(_threads())
        time.sleep(0.2)
    wall = time.monotonic() - start
    busy1, total1 = _machine()
    rows = sorted(((jiffies - first.get(key, 0), name, key) for key, (name, jiffies) in last.items()), reverse=True)
    print(
        f"== {wall:.1f} s, machine busy {100 * (busy1 - busy0) / max(1, total1 - total0):.0f} % of "
        f"{os.cpu_count()} CPUs; threads by CPU (% of one CPU over the run):"
    )
    for used, name, (pid, tid) in rows[: args.top]:
        print(f"  {100 * used / TICK / wall:6.1f} %  {name:<16} pid {pid} tid {tid}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
