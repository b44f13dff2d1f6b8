"""Launcher for CPU (or GPU) PEs on one host: ``python -m mori.shmem.run -n N script.py [args...]``.

Makes a unique id, starts N copies of the script with ``MORI_SHMEM_RANK``, ``MORI_SHMEM_WORLD``
and ``MORI_SHMEM_UNIQUE_ID`` (plus ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) set, so the script calls
``mori.shmem.shmem_init_from_env()``. Exits with the first non-zero exit status; if one PE fails
the others are stopped rather than left waiting in a collective.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from mori.core.bootstrap import UniqueId, get_unique_id, take_listener

from .api import ENV_RANK, ENV_UID, ENV_WORLD

__all__ = ["launch", "main"]


def launch(nprocs: int, argv: list[str], timeout: float | None = None, env: dict[str, str] | None = None) -> int:
    """Runs ``argv`` (a Python script and its arguments) as ``nprocs`` PEs; returns the exit status.

    ``timeout``: seconds before every PE still running is killed (status 124).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"-n must be a positive number of PEs, got {nprocs!r}")
    if not argv:
        raise ValueError("no script given: python -m mori.shmem.run -n N script.py [args...]")
    uid = _uid_for_child_rank0()
    procs = []
    base_env = dict(os.environ if env is None else env)
    try:
        for rank in range(nprocs):
            child = dict(base_env)
            child.update({ENV_RANK: str(rank), ENV_WORLD: str(nprocs), ENV_UID: uid, "RANK": str(rank),
                          "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nprocs)})
            procs.append(subprocess.Popen([sys.executable, *argv], env=child))
        return _wait_all(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _uid_for_child_rank0() -> str:
    """A unique id whose rank 0 is a child: the listener get_unique_id opened here is closed again,
    and the child that is rank 0 binds the same port (take_listener's documented fallback)."""
    uid = get_unique_id()
    take_listener(UniqueId.from_bytes(uid)).close()
    return bytes(uid).hex()


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float | None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed:
            status = failed[0]
            break
        if deadline is not None and time.monotonic() > deadline:
            print(f"mori.shmem.run: PEs still running after {timeout} s; stopping them", file=sys.stderr)
            return 124
        time.sleep(0.05)
    return status or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m mori.shmem.run", description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of PEs to start")
    parser.add_argument("--timeout", type=float, default=None, help="kill every PE after this many seconds")
    parser.add_argument("script", help="the Python script each PE runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    return launch(ns.nprocs, [ns.script, *ns.args], ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
