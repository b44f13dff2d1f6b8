"""Two network namespaces joined by a veth pair: two "hosts" with their own addresses on this
machine (a real network path through the kernel, not loopback), and engine processes in them.

Needs root and iproute2, which CI has (ci/setup.sh installs iproute2; CI runs as root). Without
them the tests fail loudly rather than skipping, so a CI change that loses them is noticed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["HOST_A", "HOST_B", "two_namespaces", "start_peer", "ask", "quit_peer", "stop_peer"]

HERE = Path(__file__).resolve().parent
HOST_A, HOST_B = "10.231.7.1", "10.231.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[str, str]]:
    """Creates namespaces A (``HOST_A``) and B (``HOST_B``) joined by a veth pair; removes them after."""
    assert os.geteuid() == 0 and shutil.which("ip"), \
        "these tests need root and iproute2 (ci/setup.sh installs iproute2; CI runs as root)"
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b, veth_a, veth_b = f"mori_a{tag}", f"mori_b{tag}", f"mva{tag}", f"mvb{tag}"
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, HOST_A), (ns_b, veth_b, HOST_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def start_peer(ns: str, role: str, host: str, shm: str, size: int,
               env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``_netns_peer.py`` in namespace ``ns``; ``env`` is added to this process's environment."""
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HERE / "_netns_peer.py"), role, host,
                             shm, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE,
                            env={**os.environ, **(env or {})})


def ask(proc: subprocess.Popen[str], line: str | None = None) -> list[str]:
    """Sends a command line (if any) and returns the peer's answer split into words."""
    assert proc.stdin is not None and proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    out = proc.stdout.readline().split()
    assert out, f"peer {proc.args} exited (rc={proc.poll()})"
    return out


def quit_peer(proc: subprocess.Popen[str]) -> None:
    """Asks the peer to close its engine and exit; it must within 30 s."""
    assert proc.stdin is not None
    proc.stdin.write("quit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 0


def stop_peer(proc: subprocess.Popen[str]) -> None:
    """Kills the peer if it still runs and closes its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
