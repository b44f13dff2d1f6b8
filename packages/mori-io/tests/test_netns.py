"""TCP between two network namespaces joined by a veth pair (a real network path, not loopback)."""

from __future__ import annotations

import numpy as np
from _netns import HOST_A, HOST_B, NetnsPeer, two_namespaces
from _peer import SharedBuffer

SIZE = 8 << 20


def test_tcp_between_network_namespaces():
    peers: list[NetnsPeer] = []
    bufs = [SharedBuffer(SIZE), SharedBuffer(SIZE)]
    try:
        with two_namespaces() as (ns_a, ns_b):
            rng = np.random.default_rng(11)
            for b in bufs:
                b.array[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
            target_buf, init_buf = bufs
            expect_target, expect_init = target_buf.array.copy(), init_buf.array.copy()
            target = NetnsPeer(ns_a, "target", HOST_A, target_buf)
            peers.append(target)
            initiator = NetnsPeer(ns_b, "initiator", HOST_B, init_buf)
            peers.append(initiator)
            target.connect(initiator)
            half = SIZE // 2
            # write: initiator[0:half] -> target[0:half]; read: target[0:half] -> initiator[half:]
            assert initiator.call("transfer", "write", target.mem)[0] == "SUCCESS"
            expect_target[:half] = expect_init[:half]
            assert initiator.call("transfer", "read", target.mem)[0] == "SUCCESS"
            expect_init[half:] = expect_target[:half]
            assert np.array_equal(target_buf.array, expect_target)
            assert np.array_equal(init_buf.array, expect_init)
            for p in peers:
                p.call("close")
    finally:
        for p in peers:
            p.close()
        for b in bufs:
            b.unlink()
