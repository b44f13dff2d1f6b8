"""Shared by every benchmark runner (mori's and the peers'): the sweep points and the statistics.

Kept free of mori imports so a peer runner can run under another interpreter (a venv where the
peer library is installed) and still report the same numbers the same way.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

__all__ = ["summarize", "block_layout", "pin_target"]


def pin_target() -> None:
    """In a target process: pins it (and the threads it starts from now on) to the CPUs listed in
    ``MORI_BENCH_TARGET_CPUS`` (e.g. ``1``), when set. A caller that pins the initiator
    (``taskset -c 0 ...``) then keeps the two sides on their own CPUs, as on two hosts, for
    mori's targets and the peers' alike."""
    cpus = os.environ.get("MORI_BENCH_TARGET_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def block_layout(size: int, batch: int) -> tuple[list[int], list[int]]:
    """Local and remote offsets of ``batch`` blocks of ``size`` bytes (remote order reversed so
    that blocks really scatter)."""
    local = [i * size for i in range(batch)]
    return local, local[::-1]


def summarize(size: int, batch: int, times: list[float], cpu: float | None = None) -> dict[str, Any]:
    """MORI's benchmark columns from per-iteration seconds: MaxBW/AvgBW (GB/s, 1e9 bytes), MinLat/AvgLat (us),
    and the median's; ``cpu`` (the initiator process's CPU seconds over the timed iterations, every
    thread) gives ``cpu_s_per_gb``."""
    total = size * batch
    best, mean, median = min(times), statistics.fmean(times), statistics.median(times)
    row = {
        "size": size,
        "batch": batch,
        "bytes": total,
        "iters": len(times),
        "max_bw_gbs": total / best / 1e9,
        "avg_bw_gbs": total / mean / 1e9,
        "median_bw_gbs": total / median / 1e9,
        "min_lat_us": best * 1e6,
        "avg_lat_us": mean * 1e6,
        "median_lat_us": median * 1e6,
    }
    if cpu is not None:
        row["cpu_s_per_gb"] = cpu / (total * len(times) / 1e9)
    return row
