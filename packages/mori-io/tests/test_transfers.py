"""Read/write/batch/session x sizes x batch sizes between two processes, checked byte for byte.

Blocks land at shuffled, unaligned remote offsets; the whole region is compared so a byte written
outside the blocks fails too. Combinations moving more than 64 MiB in one batch (1 MiB x 4096,
64 MiB x 64 and x 4096) are left out: they would need gigabytes of memory per side.
"""

from __future__ import annotations

import numpy as np
import pytest
from _peer import PeerProcess, SharedBuffer

from mori.io import IOEngine, MemoryDesc, MemoryLocationType, StatusCode

SIZES = [1, 8, 4096, 1 << 20, 64 << 20]
BATCHES = [1, 64, 4096]
CASES = [(s, b) for s in SIZES for b in BATCHES if s * b <= 64 << 20]
SKEW = 3  # unaligned offsets


def _layout(rng: np.random.Generator, size: int, batch: int) -> tuple[list[int], list[int]]:
    slots = rng.permutation(batch)
    local = [SKEW + i * size for i in range(batch)]
    remote = [SKEW + int(j) * size for j in slots]
    return local, remote


def _run(
    initiator: IOEngine,
    target: PeerProcess,
    remote_region: tuple[SharedBuffer, MemoryDesc],
    op: str,
    api: str,
    size: int,
    batch: int,
) -> None:
    rng = np.random.default_rng(size * 7919 + batch)
    buf, rdesc = remote_region
    local = np.empty(buf.size, dtype=np.uint8)
    local[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    ldesc = initiator.register_memory(int(local.ctypes.data), local.size, -1, MemoryLocationType.CPU)
    try:
        buf.array[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
        l_offs, r_offs = _layout(rng, size, batch)
        sizes = [size] * batch
        expect_remote, expect_local = buf.array.copy(), local.copy()
        for lo, ro in zip(l_offs, r_offs):
            if op == "write":
                expect_remote[ro : ro + size] = local[lo : lo + size]
            else:
                expect_local[lo : lo + size] = buf.array[ro : ro + size]
        if api == "session":
            sess = initiator.create_session(ldesc, rdesc)
            assert sess is not None and sess.alive()
            uid = sess.allocate_transfer_uid()
            if batch == 1:
                st = getattr(sess, op)(l_offs[0], r_offs[0], size, uid)
            else:
                st = getattr(sess, f"batch_{op}")(l_offs, r_offs, sizes, uid)
        else:
            uid = initiator.allocate_transfer_uid()
            if batch == 1:
                st = getattr(initiator, op)(ldesc, l_offs[0], rdesc, r_offs[0], size, uid)
            else:
                st = getattr(initiator, f"batch_{op}")(ldesc, l_offs, rdesc, r_offs, sizes, uid)
        assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS, "transfer did not finish in 60 s"
        assert st.Succeeded(), st.Message()
        assert st.Code() == StatusCode.SUCCESS and not st.Failed() and not st.InProgress()
        assert np.array_equal(buf.array, expect_remote)
        assert np.array_equal(local, expect_local)
        assert target.call("pop_inbound", "initiator", uid, 10.0) == StatusCode.SUCCESS
        assert target.call("pop_inbound", "initiator", uid, 0.0) is None  # popped once
    finally:
        initiator.deregister_memory(ldesc)


@pytest.mark.parametrize("size,batch", CASES, ids=[f"{s}Bx{b}" for s, b in CASES])
@pytest.mark.parametrize("api", ["engine", "session"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_transfer_matrix(initiator, target, remote_region, op, api, size, batch):
    _run(initiator, target, remote_region, op, api, size, batch)


def test_zero_length_and_empty_batch(initiator, target, remote_region):
    buf, rdesc = remote_region
    local = np.zeros(64, dtype=np.uint8)
    ldesc = initiator.register_memory(int(local.ctypes.data), local.size, -1, MemoryLocationType.CPU)
    before = buf.array.copy()
    for sizes in ([0], []):
        uid = initiator.allocate_transfer_uid()
        st = initiator.batch_write(ldesc, [0] * len(sizes), rdesc, [0] * len(sizes), sizes, uid)
        assert st.WaitFor(10_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st.Message()
        assert target.call("pop_inbound", "initiator", uid, 10.0) == StatusCode.SUCCESS
    assert np.array_equal(buf.array, before)
    initiator.deregister_memory(ldesc)


def test_many_concurrent_transfers(initiator, target, remote_region):
    """Hundreds of transfers in flight at once over the striped connections all land."""
    buf, rdesc = remote_region
    rng = np.random.default_rng(5)
    local = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    ldesc = initiator.register_memory(int(local.ctypes.data), local.size, -1, MemoryLocationType.CPU)
    statuses = []
    for i in range(256):
        uid = initiator.allocate_transfer_uid()
        statuses.append((uid, initiator.write(ldesc, i * 4096, rdesc, i * 4096, 4096, uid)))
    for _, st in statuses:
        assert st.WaitFor(30_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st.Message()
    assert np.array_equal(buf.array[: 1 << 20], local)
    for uid, _ in statuses:
        assert target.call("pop_inbound", "initiator", uid, 10.0) == StatusCode.SUCCESS
    initiator.deregister_memory(ldesc)


@pytest.mark.parametrize("op", ["write", "read"])
def test_numpy_offset_arrays(initiator, target, remote_region, op):
    """Offsets and sizes given as numpy arrays (any int dtype) move the same bytes as lists."""
    buf, rdesc = remote_region
    rng = np.random.default_rng(17)
    local = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    ldesc = initiator.register_memory(int(local.ctypes.data), local.size, -1, MemoryLocationType.CPU)
    buf.array[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    l_offs = np.arange(1024, dtype=np.int32) * 4096
    r_offs = (rng.permutation(1024) * 4096 + 1).astype(np.uint64)
    sizes = rng.integers(1, 4096, 1024).astype(np.int64)
    expect_remote, expect_local = buf.array.copy(), local.copy()
    for lo, ro, n in zip(l_offs.tolist(), r_offs.tolist(), sizes.tolist()):
        if op == "write":
            expect_remote[ro : ro + n] = local[lo : lo + n]
        else:
            expect_local[lo : lo + n] = buf.array[ro : ro + n]
    uid = initiator.allocate_transfer_uid()
    st = getattr(initiator, f"batch_{op}")(ldesc, l_offs, rdesc, r_offs, sizes, uid)
    assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st.Message()
    assert np.array_equal(buf.array, expect_remote) and np.array_equal(local, expect_local)
    assert target.call("pop_inbound", "initiator", uid, 10.0) == StatusCode.SUCCESS
    initiator.deregister_memory(ldesc)


def test_a_later_transfer_reports_finished_only_after_earlier_ones(initiator, target, remote_region):
    """A large write striped over every connection, then a small one: when the small one reports
    SUCCESS, the large one has finished too (and its bytes are there), whichever ended first on
    the wire. This is what lets vLLM poll only the last status of a request."""
    buf, rdesc = remote_region
    src = np.random.default_rng(11).integers(0, 256, 32 << 20, dtype=np.uint8)
    ldesc = initiator.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
    try:
        for _ in range(5):
            buf.array[:] = 0
            big = initiator.write(ldesc, 0, rdesc, 0, 32 << 20, initiator.allocate_transfer_uid())
            small = initiator.write(ldesc, 0, rdesc, 40 << 20, 64, initiator.allocate_transfer_uid())
            assert small.WaitFor(60_000) == StatusCode.SUCCESS, small
            assert big.Code() == StatusCode.SUCCESS, big
            assert np.array_equal(buf.array[: 32 << 20], src) and np.array_equal(
                buf.array[40 << 20 : (40 << 20) + 64], src[:64]
            )
    finally:
        initiator.deregister_memory(ldesc)


class _Running:
    """A status stand-in that counts how often the in-flight table asks whether it still runs."""

    asked = 0

    def __init__(self, running: bool) -> None:
        self.running = running

    def _running(self) -> bool:
        _Running.asked += 1
        return self.running


def test_in_flight_table_prunes_in_amortized_constant_work_with_many_running() -> None:
    """20,000 transfers running at once on one region: the table looks at each entry a bounded
    number of times in all (pruning every 64 transfers had scanned them all each time: about
    3 million looks here), keeps every running one and drops the finished ones."""
    from mori.io._registry import InFlight

    table = InFlight()
    _Running.asked = 0
    running = [_Running(True) for _ in range(20000)]
    for s in running:
        table.add(1, s, None, "peer")  # type: ignore[arg-type]
    assert _Running.asked <= 4 * len(running), _Running.asked
    for s in running[::2]:
        s.running = False
    for _ in range(40000):
        table.add(1, _Running(False), None, "peer")  # type: ignore[arg-type]
    kept = [e[0] for e in table._by_mem[1]]
    assert set(map(id, running[1::2])) <= set(map(id, kept))  # every running one is kept
    assert len(kept) <= 2 * 10000  # finished ones are dropped: the table stays within twice what runs
