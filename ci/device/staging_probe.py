"""What one staged piece costs on this GPU: mori-core's device Stager against the copy engine's
ceiling, so that a staged transfer's time can be split into copy, queueing and wire.

For each piece size it prints, medians of ``--iters``:
- ``lat``: one copy queued and waited for (``to_host``/``to_device`` with ``wait=True``), µs;
- ``queue``: the CPU time of queueing one copy with ``wait=False`` (pool loan, lane lock, driver
  call, event record), µs;
- ``pipe``: GB/s of ``--window`` copies kept in flight on one thread, polled as the TCP plane does;
- ``threads``: GB/s of ``--threads`` threads doing the same at once (each its own lane);
- ``torch``: GB/s of PyTorch copying the same pieces between the GPU and pinned memory on one
  stream, synchronized once at the end (the copy engine's ceiling for this piece size).

Usage: python ci/device/staging_probe.py [--sizes 64K,256K,1M] [--iters 200] [--window 4] [--threads 4]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from mori.core.staging import device_stager


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _latency(stager, dev: int, n: int, iters: int) -> tuple[float, float, float]:
    """Medians (µs) of a waited copy out, a waited copy in, and queueing one copy out."""
    out, into, queue = [], [], []
    for _ in range(iters):
        t = time.perf_counter_ns()
        s = stager.to_host(dev, n, True)
        out.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        stager.to_device(dev, s, True)
        into.append(time.perf_counter_ns() - t)
        s.release()
        t = time.perf_counter_ns()
        s = stager.to_host(dev, n, False)
        queue.append(time.perf_counter_ns() - t)
        s.wait()
        s.release()
    return tuple(statistics.median(x) / 1e3 for x in (out, into, queue))  # type: ignore[return-value]


def _pipelined(stager, dev: int, n: int, pieces: int, window: int) -> float:
    """Seconds for `pieces` copies out, `window` in flight, each waited for in order."""
    ahead = []
    t = time.perf_counter()
    for i in range(pieces):
        if len(ahead) >= window:
            ahead.pop(0).wait()
        ahead.append(stager.to_host(dev + (i % 16) * n, n, False))
    for s in ahead:
        s.wait()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,256K,1M")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    torch.cuda.set_device(0)
    sizes = [_size(s) for s in a.sizes.split(",")]
    buf = torch.randint(0, 255, (16 * max(sizes) * a.threads,), dtype=torch.uint8, device="cuda")
    stager = device_stager(0)
    print(
        f"{'piece':>6} {'lat out':>8} {'lat in':>8} {'queue':>7} {'pipe GB/s':>10} {'threads GB/s':>13} "
        f"{'torch GB/s':>11}"
    )
    for n in sizes:
        dev = buf.data_ptr()
        _latency(stager, dev, n, 20)  # warm the pool and the driver
        lat_out, lat_in, queue = _latency(stager, dev, n, a.iters)
        pieces = max(64, (256 << 20) // n)
        pipe = pieces * n / _pipelined(stager, dev, n, pieces, a.window) / 1e9

        took = [0.0] * a.threads

        def worker(k: int, n: int = n, pieces: int = pieces, took: list[float] = took) -> None:
            took[k] = _pipelined(stager, buf.data_ptr() + k * 16 * n, n, pieces, a.window)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(a.threads)]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        threads = a.threads * pieces * n / (time.perf_counter() - t) / 1e9

        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(pieces):
            host.copy_(buf[(i % 16) * n : (i % 16 + 1) * n], non_blocking=True)
        torch.cuda.synchronize()
        ceiling = pieces * n / (time.perf_counter() - t) / 1e9
        print(
            f"{n >> 10:>5}K {lat_out:>8.1f} {lat_in:>8.1f} {queue:>7.1f} {pipe:>10.1f} {threads:>13.1f} "
            f"{ceiling:>11.1f}",
            flush=True,
        )
    print("stats:", stager.stats())


if __name__ == "__main__":
    main()
