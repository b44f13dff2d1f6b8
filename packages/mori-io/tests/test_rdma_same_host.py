"""The RDMA backend between two engines of one host (both in this process): host memory takes the
UCX engine's same-host path; the initiator copies small transfers itself where the transports
allow UCX's own copies between processes (cma), and the backend's description says which."""

from __future__ import annotations

import numpy as np
import pytest

from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType, StatusCode

SIZE = 1 << 20


def _write_and_describe(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, str]:
    """A 4 KiB and a 1 MiB write from "init" to "targ" under env, every byte and the target's
    record checked as soon as each reports success; the initiator's same-host description."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    a, b = IOEngine("init", IOEngineConfig()), IOEngine("targ", IOEngineConfig())
    try:
        for e in (a, b):
            e.create_backend(BackendType.RDMA)
        a.register_remote_engine(b.get_engine_desc())
        b.register_remote_engine(a.get_engine_desc())
        rng = np.random.default_rng(7)
        src, dst = rng.integers(0, 256, SIZE, dtype=np.uint8), np.zeros(SIZE, np.uint8)
        ma = a.register_memory(int(src.ctypes.data), SIZE, -1, MemoryLocationType.CPU)
        mb = MemoryDesc.unpack(b.register_memory(int(dst.ctypes.data), SIZE, -1, MemoryLocationType.CPU).pack())
        for size in (4096, SIZE):
            uid = a.allocate_transfer_uid()
            st = a.batch_write(ma, [0], mb, [0], [size], uid)
            assert st.WaitFor(30_000) == StatusCode.SUCCESS, st.Message()
            assert np.array_equal(dst[:size], src[:size])
            record = b.pop_inbound_transfer_status("init", uid)
            assert record is not None and record.Succeeded()  # recorded before the initiator saw success
        return dict(a.describe()["backends"]["RDMA"]["same_host"])
    finally:
        a.close()
        b.close()


def test_the_initiator_copies_where_the_transports_allow_cma(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _write_and_describe(monkeypatch, {"MORI_IO_RDMA_TRANSPORTS": "all"}) == {"targ": "direct"}


def test_a_transport_list_without_cma_leaves_every_copy_to_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    described = _write_and_describe(monkeypatch, {"MORI_IO_RDMA_TRANSPORTS": "tcp"})
    assert described == {"targ": "served: off in this engine (same_host_direct=False)"}


def test_same_host_path_off_keeps_host_memory_on_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"MORI_IO_RDMA_TRANSPORTS": "tcp", "MORI_IO_RDMA_SAME_HOST": "0"}
    assert _write_and_describe(monkeypatch, env) == {}
