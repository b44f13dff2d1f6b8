"""Where a put+signal ping-pong's one-way time goes, from mori-core's timestamps (MORI_TRACE_DIR:
csrc/base/trace.hpp, docs/core-ucx.md "Timestamps"): every process's records merged on the host's
clock, then each leg of the ping-pong cut into its steps, medians over the legs (the first
quarter of them, a warm-up, left out).

A leg starts where one side posts a signal put (the device proxy picking up a kernel's command,
``P``, or a host call, ``H``) and ends where the other side posts its answer:

- ``send``: the proxy's command executed (``P`` to ``S``: the message handed to UCX);
- ``wire``: to the target's handler (``S``, or ``H``, to ``R``);
- ``queue``: the handler's checks and the GPU copy and store queued (``R`` to ``W``);
- ``gpu``: until the worker saw them end (``W`` to ``D``), then its answer sent (``D`` to ``A``);
- ``turn``: from the store queued to the other side's next post (``W`` to its ``P``/``H``: the GPU
  running it, the kernel or the host seeing the signal, and posting its answer);
- ``leg``: the whole one way.

With ``--ladder STEP`` it reads one transfer after another instead (a latency run of
mori-io-bench, say: ``T`` a UCX transfer posted): each episode runs from a ``STEP`` to the next,
and every step's first record in it is timed from its start, medians over the episodes, the
starting process's steps as ``i:`` (initiator) and the others' as ``t:`` (target).

With ``--episode`` as well, it prints every record of one episode in order (the episode of median
length, past the warm-up): a transfer in pieces shows each piece's steps, which the ladder's
first records hide.

Usage: python ci/trace_report.py DIR [--ladder STEP [--episode]]   (DIR: the MORI_TRACE_DIR of a run;
ci/device/netns_bench.sh passes MORI_TRACE_DIR through to its PEs)
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
from collections import Counter
from pathlib import Path

RECORD = struct.Struct("<QQQ")


def load(folder: Path) -> list[tuple[int, int, str, int]]:
    """Every record of every process: (ns, process index, step, argument), in time order."""
    records = []
    for index, path in enumerate(sorted(folder.glob("mori-trace-*.bin"))):
        data = path.read_bytes()
        for offset in range(0, len(data), RECORD.size):
            ns, step, arg = RECORD.unpack_from(data, offset)
            if ns == 0:
                break
            records.append((ns, index, chr(step), arg))
    records.sort()
    return records


def legs(records: list[tuple[int, int, str, int]], start: str) -> dict[str, list[float]]:
    """The steps (µs) of every leg that starts with ``start`` (P or H) on one process and whose
    target handled it on another."""
    out: dict[str, list[float]] = {k: [] for k in ("send", "wire", "queue", "gpu", "answer", "turn", "leg")}
    for i, (t0, me, step, _) in enumerate(records):
        if step != start:
            continue
        sent, at = None, {}
        j = i + 1
        while j < len(records) and len(at) < 4:
            ns, who, s, _ = records[j]
            if who == me and s == "S" and sent is None:
                sent = ns
            elif who != me and s in "RWDA" and s not in at and (s == "R" or "R" in at):
                at[s] = ns
            j += 1
        if len(at) < 4:
            continue
        answer = next((r[0] for r in records[i + 1 :] if r[1] != me and r[2] == start and r[0] > at["W"]), None)
        if answer is None or answer - t0 > 10_000_000:
            continue
        if sent is not None:
            out["send"].append(sent - t0)
        out["wire"].append(at["R"] - (sent if sent is not None else t0))
        out["queue"].append(at["W"] - at["R"])
        out["gpu"].append(at["D"] - at["W"])
        out["answer"].append(at["A"] - at["D"])
        out["turn"].append(answer - at["W"])
        out["leg"].append(answer - t0)
    return {k: [x / 1e3 for x in v[len(v) // 4 :]] for k, v in out.items()}


def episodes(records: list[tuple[int, int, str, int]], start: str) -> list[list[tuple[float, str, int]]]:
    """Each episode (from a ``start`` record to the next on any process) as its records: (µs from
    its start, step keyed ``i:X`` on the starting process and ``t:X`` on others, argument)."""
    starts = [i for i, r in enumerate(records) if r[2] == start]
    out = []
    for k, i in enumerate(starts):
        t0, me = records[i][0], records[i][1]
        end = starts[k + 1] if k + 1 < len(starts) else len(records)
        out.append(
            [((ns - t0) / 1e3, ("i:" if who == me else "t:") + step, arg) for ns, who, step, arg in records[i:end]]
        )
    return out


def ladder(records: list[tuple[int, int, str, int]], start: str) -> dict[str, list[float]]:
    """Each episode (from a ``start`` record to the next on any process) as the time (µs) from its
    start to every step's first record in it, keyed ``i:X`` on the starting process and ``t:X``
    on others; the first quarter of the episodes (a warm-up) left out."""
    firsts: list[dict[str, float]] = []
    for episode in episodes(records, start):
        seen: dict[str, float] = {}
        for us, key, _ in episode[1:]:
            seen.setdefault(key, us)
        firsts.append(seen)
    out: dict[str, list[float]] = {}
    for seen in firsts[len(firsts) // 4 :]:
        for key, us in seen.items():
            out.setdefault(key, []).append(us)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--ladder", metavar="STEP", help="episodes from each STEP record to the next")
    parser.add_argument("--episode", action="store_true", help="with --ladder: one episode's every record")
    args = parser.parse_args()
    records = load(args.dir)
    if not records:
        print(f"no records in {args.dir} (was MORI_TRACE_DIR set for the run?)", file=sys.stderr)
        return 1
    counts = Counter((who, step) for _, who, step, _ in records)
    print(f"{len(records)} records from {len({who for _, who, _, _ in records})} processes: "
          + ", ".join(f"{who}:{step} {n}" for (who, step), n in sorted(counts.items())))  # fmt: skip
    if args.ladder and args.episode:
        every = episodes(records, args.ladder)
        runs = every[len(every) // 4 :]
        if not runs:
            print(f"no episodes from {args.ladder}", file=sys.stderr)
            return 1
        median = sorted(runs, key=lambda e: e[-1][0])[len(runs) // 2]
        print(f"the episode of median length of {len(runs)} from {args.ladder}: every record, us from its start")
        for us, key, arg in median:
            print(f"  {us:10.1f}  {key}  {arg}")
        return 0
    if args.ladder:
        steps = ladder(records, args.ladder)
        count = max((len(v) for v in steps.values()), default=0)
        print(f"episodes from {args.ladder}: {count}; each step's first record, us from the start")
        for key, values in sorted(steps.items(), key=lambda kv: statistics.median(kv[1])):
            ordered = sorted(values)
            print(
                f"  {key}  median {statistics.median(values):8.1f}   p10 {ordered[len(ordered) // 10]:8.1f}   "
                f"p90 {ordered[9 * len(ordered) // 10]:8.1f}   in {len(values)}"
            )
        return 0
    for start, what in (("P", "from a kernel (the proxy's pick-up)"), ("H", "from the host")):
        steps = legs(records, start)
        if not steps["leg"]:
            continue
        print(f"legs {what}: {len(steps['leg'])}")
        for name, values in steps.items():
            if values:
                ordered = sorted(values)
                print(
                    f"  {name:7s} median {statistics.median(values):7.1f} us   "
                    f"p10 {ordered[len(ordered) // 10]:7.1f}   p90 {ordered[9 * len(ordered) // 10]:7.1f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
