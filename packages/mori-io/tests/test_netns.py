"""TCP between two network namespaces joined by a veth pair (a real network path, not loopback).

Needs root and iproute2, which CI has (ci/setup.sh installs iproute2; CI runs as root). Without
them the test fails loudly rather than skipping, so a CI change that loses them is noticed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from _peer import SharedBuffer

HERE = Path(__file__).resolve().parent
SIZE = 8 << 20


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _start(ns: str, role: str, host: str, shm: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HERE / "_netns_peer.py"), role, host, shm,
                             str(SIZE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)


def _ask(proc: subprocess.Popen[str], line: str | None = None) -> list[str]:
    assert proc.stdin is not None and proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    out = proc.stdout.readline().split()
    assert out, f"peer {proc.args} exited (rc={proc.poll()})"
    return out


def test_tcp_between_network_namespaces():
    assert os.geteuid() == 0 and shutil.which("ip"), \
        "this test needs root and iproute2 (ci/setup.sh installs iproute2; CI runs as root)"
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b, veth_a, veth_b = f"mori_a{tag}", f"mori_b{tag}", f"mva{tag}", f"mvb{tag}"
    procs: list[subprocess.Popen[str]] = []
    bufs = [SharedBuffer(SIZE), SharedBuffer(SIZE)]
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, "10.231.7.1/24"), (ns_b, veth_b, "10.231.7.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        rng = np.random.default_rng(11)
        for b in bufs:
            b.array[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
        target_buf, init_buf = bufs
        expect_target, expect_init = target_buf.array.copy(), init_buf.array.copy()
        target = _start(ns_a, "target", "10.231.7.1", target_buf.path)
        procs.append(target)
        initiator = _start(ns_b, "initiator", "10.231.7.2", init_buf.path)
        procs.append(initiator)
        t_engine, t_mem = _ask(target)
        i_engine, _ = _ask(initiator)
        assert _ask(target, f"register {i_engine}") == ["ok"]
        assert _ask(initiator, f"register {t_engine}") == ["ok"]
        half = SIZE // 2
        # write: initiator[0:half] -> target[0:half]; read: target[0:half] -> initiator[half:]
        assert _ask(initiator, f"write {t_mem}")[0] == "SUCCESS"
        expect_target[:half] = expect_init[:half]
        assert _ask(initiator, f"read {t_mem}")[0] == "SUCCESS"
        expect_init[half:] = expect_target[:half]
        assert np.array_equal(target_buf.array, expect_target)
        assert np.array_equal(init_buf.array, expect_init)
        for p in procs:
            _ask_quit(p)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()
        for b in bufs:
            b.unlink()
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _ask_quit(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("quit\n")
    proc.stdin.flush()
    proc.wait(timeout=30)
