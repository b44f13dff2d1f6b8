"""The benchmark's "hosts": network namespaces of this machine, each with one address, joined by a
bridge in a namespace of its own (the host's own network is not touched). Traffic between them
crosses the kernel's TCP stack as between hosts, with CUBIC as on real ones
(mori.core.testing's choice and reasons). Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mori.core.testing import host_congestion_control


@dataclass(frozen=True)
class Host:
    """A namespace: its name and its address."""

    netns: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


@contextlib.contextmanager
def hosts(count: int, subnet: str = "10.233.41") -> Iterator[list[Host]]:
    """``count`` namespaces at ``subnet``.1, .2, ...; removed on exit."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError("the benchmark's hosts are network namespaces: it needs root and iproute2")
    congestion = host_congestion_control()
    tag = f"{os.getpid() % 100000}x{time.monotonic_ns() % 1000}"
    bridge = f"ubench_b{tag}"
    made = [bridge]
    try:
        _ip("netns", "add", bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        spaces = []
        for i in range(count):
            host = Host(f"ubench_h{tag}n{i}", f"{subnet}.{i + 1}")
            inner, outer = f"ui{tag}n{i}", f"uo{tag}n{i}"
            _ip("netns", "add", host.netns)
            made.append(host.netns)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", host.netns)
            _ip("link", "set", outer, "netns", bridge)
            _ip("-n", bridge, "link", "set", outer, "master", "br0")
            _ip("-n", bridge, "link", "set", outer, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", inner)
            _ip("-n", host.netns, "link", "set", inner, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            if congestion:
                _ip("-n", host.netns, "route", "replace", f"{subnet}.0/24", "dev", inner, "congctl", congestion)
            spaces.append(host)
        yield spaces
    finally:
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
