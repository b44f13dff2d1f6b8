"""Launcher for CPU (or GPU) PEs on one host: ``python -m mori.shmem.run -n N script.py [args...]``.

Makes a unique id (the launcher is no PE: it only reserves rank 0's port), starts N copies of the
script with ``MORI_SHMEM_RANK``, ``MORI_SHMEM_WORLD`` and ``MORI_SHMEM_UNIQUE_ID`` (plus
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) set, so the script calls
``mori.shmem.shmem_init_from_env()``. Every line a PE writes comes out whole, prefixed with
``[PE r]``, on the launcher's stdout or stderr as the PE wrote it. Exits with the first non-zero
exit status and says which PE failed; the others are then stopped rather than left waiting in
a collective.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import IO

from mori.core.bootstrap import get_unique_id

from .api import ENV_RANK, ENV_UID, ENV_WORLD

__all__ = ["launch", "main"]

_write_lock = threading.Lock()


def launch(nprocs: int, argv: list[str], timeout: float | None = None, env: dict[str, str] | None = None) -> int:
    """Runs ``argv`` (a Python script and its arguments) as ``nprocs`` PEs; returns the exit status.

    ``timeout``: seconds before every PE still running is killed (status 124).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"-n must be a positive number of PEs, got {nprocs!r}")
    if not argv:
        raise ValueError("no script given: python -m mori.shmem.run -n N script.py [args...]")
    uid = bytes(get_unique_id()).hex()  # reserved here until rank 0 listens on it
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    base_env = dict(os.environ if env is None else env)
    try:
        for rank in range(nprocs):
            child = dict(base_env)
            child.update(
                {
                    ENV_RANK: str(rank),
                    ENV_WORLD: str(nprocs),
                    ENV_UID: uid,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(nprocs),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(nprocs),
                }
            )
            proc = subprocess.Popen([sys.executable, *argv], env=child, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                pump = threading.Thread(target=_pump, args=(pipe, sink, f"[PE {rank}] ".encode()), daemon=True)
                pump.start()
                pumps.append(pump)
        return _wait_all(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for pump in pumps:
            pump.join(timeout=5)


def _pump(pipe: IO[bytes] | None, sink: IO[str], prefix: bytes) -> None:
    """Copies a PE's output to ``sink`` line by line, each line whole and prefixed."""
    assert pipe is not None
    out = getattr(sink, "buffer", None)
    with pipe:
        for line in iter(pipe.readline, b""):
            data = prefix + (line if line.endswith(b"\n") else line + b"\n")
            with _write_lock:
                if out is not None:
                    out.write(data)
                else:
                    sink.write(data.decode(errors="replace"))
                sink.flush()


def _say(message: str) -> None:
    with _write_lock:
        print(f"mori.shmem.run: {message}", file=sys.stderr, flush=True)


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float | None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    # Every PE is polled on every round (a list, not any(), which would stop at the first PE
    # still running and leave a later PE's exit unseen until the earlier ones end).
    while None in (codes := [p.poll() for p in procs]):
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, p = failed[0], procs[failed[0]]
            running = [r for r, code in enumerate(codes) if code is None]
            _say(f"PE {rank} (pid {p.pid}) exited with status {p.returncode}; stopping PEs {running}")
            return int(p.returncode)
        if deadline is not None and time.monotonic() > deadline:
            running = [r for r, code in enumerate(codes) if code is None]
            _say(f"PEs {running} still running after {timeout} s; stopping them")
            return 124
        time.sleep(0.05)
    for rank, p in enumerate(procs):
        if p.returncode:
            _say(f"PE {rank} (pid {p.pid}) exited with status {p.returncode}")
            return int(p.returncode)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m mori.shmem.run", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of PEs to start")
    parser.add_argument("--timeout", type=float, default=None, help="kill every PE after this many seconds")
    parser.add_argument("script", help="the Python script each PE runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    return launch(ns.nprocs, [ns.script, *ns.args], ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
