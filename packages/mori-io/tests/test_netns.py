"""TCP between two network namespaces joined by a veth pair (a real network path, not loopback)."""

from __future__ import annotations

import subprocess

import numpy as np
from _netns import HOST_A, HOST_B, ask, quit_peer, start_peer, stop_peer, two_namespaces
from _peer import SharedBuffer

SIZE = 8 << 20


def test_tcp_between_network_namespaces():
    procs: list[subprocess.Popen[str]] = []
    bufs = [SharedBuffer(SIZE), SharedBuffer(SIZE)]
    try:
        with two_namespaces() as (ns_a, ns_b):
            rng = np.random.default_rng(11)
            for b in bufs:
                b.array[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
            target_buf, init_buf = bufs
            expect_target, expect_init = target_buf.array.copy(), init_buf.array.copy()
            target = start_peer(ns_a, "target", HOST_A, target_buf.path, SIZE)
            procs.append(target)
            initiator = start_peer(ns_b, "initiator", HOST_B, init_buf.path, SIZE)
            procs.append(initiator)
            t_engine, t_mem = ask(target)
            i_engine, _ = ask(initiator)
            assert ask(target, f"register {i_engine}") == ["ok"]
            assert ask(initiator, f"register {t_engine}") == ["ok"]
            half = SIZE // 2
            # write: initiator[0:half] -> target[0:half]; read: target[0:half] -> initiator[half:]
            assert ask(initiator, f"write {t_mem}")[0] == "SUCCESS"
            expect_target[:half] = expect_init[:half]
            assert ask(initiator, f"read {t_mem}")[0] == "SUCCESS"
            expect_init[half:] = expect_target[:half]
            assert np.array_equal(target_buf.array, expect_target)
            assert np.array_equal(init_buf.array, expect_init)
            for p in procs:
                quit_peer(p)
    finally:
        for p in procs:
            stop_peer(p)
        for b in bufs:
            b.unlink()
