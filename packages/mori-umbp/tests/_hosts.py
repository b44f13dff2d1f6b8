"""Several "hosts" on this machine: network namespaces, each with one address, joined by a bridge
that lives in a namespace of its own (so the host's own network and firewall are not touched).
Traffic between them crosses the kernel's network stack as between real hosts.

Needs root and iproute2 (CI has both); without them the tests fail rather than skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

from mori.core.testing import Namespace


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


@contextlib.contextmanager
def hosts(count: int, subnet: str = "10.232.41") -> Iterator[list[Namespace]]:
    """``count`` namespaces at ``subnet``.1, .2, ...; removed on exit."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError("network namespaces need root and iproute2 (ci/setup.sh installs iproute2; CI runs as root)")
    tag = f"{os.getpid() % 100000}x{time.monotonic_ns() % 1000}"
    bridge_ns = f"umbp_b{tag}"
    made = [bridge_ns]
    spaces = [Namespace(f"umbp_h{tag}n{i}", f"uh{tag}n{i}", f"{subnet}.{i + 1}") for i in range(count)]
    try:
        _ip("netns", "add", bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(spaces):
            _ip("netns", "add", ns.name)
            made.append(ns.name)
            outer = f"ub{tag}n{i}"
            _ip("link", "add", ns.device, "type", "veth", "peer", "name", outer)
            _ip("link", "set", ns.device, "netns", ns.name)
            _ip("link", "set", outer, "netns", bridge_ns)
            _ip("-n", bridge_ns, "link", "set", outer, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", outer, "up")
            _ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.device)
            _ip("-n", ns.name, "link", "set", ns.device, "up")
            _ip("-n", ns.name, "link", "set", "lo", "up")
        yield spaces
    finally:
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
