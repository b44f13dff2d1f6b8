"""UcxPeer.submit: a transfer from a mori.core.batch.Batch (rows: local address, remote
offset, bytes), two engines in this process over UCX's tcp transport; bytes checked, and rows
outside the local registration refused in the call with nothing moved."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from mori.core import ucx
from mori.core.batch import Batch
from mori.core.codes import TransferCode

SIZE = 1 << 20


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[ucx.UcxPeer, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    local, remote = rng.integers(0, 256, SIZE, dtype=np.uint8), rng.integers(0, 256, SIZE, dtype=np.uint8)
    init = ucx.make_engine("init", {"TLS": "tcp"}, timeout=10.0)
    target = ucx.make_engine("target", {"TLS": "tcp"}, timeout=10.0)
    try:
        init.register_memory(1, int(local.ctypes.data), SIZE)
        target.register_memory(7, int(remote.ctypes.data), SIZE)
        peer = init.connect("target", target.addresses, target.admit("init"))
        yield peer, local, remote
        peer.close()
    finally:
        init.close()
        target.close()


def test_rows_move_byte_for_byte(engines: tuple[ucx.UcxPeer, np.ndarray, np.ndarray]) -> None:
    peer, local, remote = engines
    base = int(local.ctypes.data)
    l_offs, r_offs = [0, 8192, 40000], [4096, 100, 70000]
    sizes = [4096, 3000, 65536]
    t = peer.submit(ucx.WRITE, 1, Batch(l_offs, r_offs, sizes, src_base=base), 7, uid=1)
    assert t.wait(10.0) and t.code() == TransferCode.SUCCESS, t.message()
    for lo, ro, n in zip(l_offs, r_offs, sizes):
        assert np.array_equal(remote[ro : ro + n], local[lo : lo + n])
    remote[200000 : 200000 + 5000] = 9
    t = peer.submit(ucx.READ, 1, Batch.one(base + 300000, 200000, 5000), 7, uid=2)
    assert t.wait(10.0) and t.code() == TransferCode.SUCCESS, t.message()
    assert (local[300000:305000] == 9).all()


@pytest.mark.parametrize("row", [(-1, 0, 16), (SIZE - 8, 0, 16), (SIZE, 0, 1), (2 * SIZE, 0, 4096)])
def test_rows_outside_the_local_region_are_refused(
    engines: tuple[ucx.UcxPeer, np.ndarray, np.ndarray], row: tuple[int, int, int]
) -> None:
    peer, local, remote = engines
    before = remote.copy()
    src = int(local.ctypes.data) + row[0]
    with pytest.raises(ValueError, match="outside local memory id 1"):
        peer.submit(ucx.WRITE, 1, Batch.one(src, row[1], row[2]), 7)
    with pytest.raises(ValueError, match="not registered"):
        peer.submit(ucx.WRITE, 2, Batch.one(int(local.ctypes.data), 0, 16), 7)
    assert np.array_equal(remote, before)
