"""The RDMA backend between two engines of one host (both in this process): host memory takes the
UCX engine's same-host path; the initiator copies small transfers itself where the transports
allow UCX's own copies between processes (cma), and the backend's description says which."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TransferStatus,
)

SIZE = 1 << 20


@contextlib.contextmanager
def _engines(seed: int) -> Iterator[tuple[IOEngine, IOEngine, np.ndarray, np.ndarray, MemoryDesc, MemoryDesc]]:
    """Engines "init" and "targ" with RDMA backends, each knowing the other; a region of SIZE
    random bytes at "init" and one of SIZE zeros at "targ", registered (the target's as the
    initiator receives it); all closed on exit."""
    a, b = IOEngine("init", IOEngineConfig()), IOEngine("targ", IOEngineConfig())
    try:
        for e in (a, b):
            e.create_backend(BackendType.RDMA)
        a.register_remote_engine(b.get_engine_desc())
        b.register_remote_engine(a.get_engine_desc())
        src, dst = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8), np.zeros(SIZE, np.uint8)
        ma = a.register_memory(int(src.ctypes.data), SIZE, -1, MemoryLocationType.CPU)
        mb = MemoryDesc.unpack(b.register_memory(int(dst.ctypes.data), SIZE, -1, MemoryLocationType.CPU).pack())
        yield a, b, src, dst, ma, mb
    finally:
        a.close()
        b.close()


def _write_and_describe(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, str]:
    """A 4 KiB and a 1 MiB write from "init" to "targ" under env, every byte and the target's
    record checked as soon as each reports success; the initiator's same-host description."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with _engines(7) as (a, b, src, dst, ma, mb):
        for size in (4096, SIZE):
            uid = a.allocate_transfer_uid()
            st = a.batch_write(ma, [0], mb, [0], [size], uid)
            assert st.WaitFor(30_000) == StatusCode.SUCCESS, st.Message()
            assert np.array_equal(dst[:size], src[:size])
            record = b.pop_inbound_transfer_status("init", uid)
            assert record is not None and record.Succeeded()  # recorded before the initiator saw success
        return dict(a.describe()["backends"]["RDMA"]["same_host"])


def test_the_initiator_copies_where_the_transports_allow_cma(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _write_and_describe(monkeypatch, {"MORI_IO_RDMA_TRANSPORTS": "all"}) == {"targ": "direct"}


def test_a_transport_list_without_cma_leaves_every_copy_to_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    described = _write_and_describe(monkeypatch, {"MORI_IO_RDMA_TRANSPORTS": "tcp"})
    assert described == {"targ": "served: off in this engine (same_host_direct=False)"}


def test_same_host_path_off_keeps_host_memory_on_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"MORI_IO_RDMA_TRANSPORTS": "tcp", "MORI_IO_RDMA_SAME_HOST": "0"}
    assert _write_and_describe(monkeypatch, env) == {}


def test_a_copy_finished_as_it_started_still_reports_after_earlier_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Single blocks the initiator copied itself finish as they start (their status keeps its code
    with no completion), yet one reports finished only once an earlier transfer to the same
    engine has: here a status held IN_PROGRESS in the engine's order stands for one."""
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "all")
    with _engines(3) as (a, _, src, dst, ma, mb):
        for i in range(4):  # the first connects, the next makes the pair's lane, the others start through it
            st = a.write(ma, 4096 * i, mb, 8192 * i, 4096, a.allocate_transfer_uid())
            assert st.WaitFor(10_000 if i == 0 else 0) == StatusCode.SUCCESS, st.Message()
            assert np.array_equal(dst[8192 * i : 8192 * i + 4096], src[4096 * i : 4096 * (i + 1)])
        held = TransferStatus(StatusCode.IN_PROGRESS)
        a._transfers._order.join("targ", held)  # an earlier transfer to "targ", still running
        uid = a.allocate_transfer_uid()
        st = a.read(ma, 0, mb, 8192, 4096, uid)
        assert np.array_equal(src[:4096], dst[8192 : 8192 + 4096])  # its bytes moved as it started
        assert st.WaitFor(20) == StatusCode.IN_PROGRESS and st.InProgress()
        held._set(StatusCode.SUCCESS)
        assert st.WaitFor(10_000) == StatusCode.SUCCESS and st.Message() == ""
        assert a.write(ma, 0, mb, 0, 4096, a.allocate_transfer_uid()).WaitFor(0) == StatusCode.SUCCESS
        assert a._transfers._order.last("targ") is None  # the finished one was dropped: none to ask
