"""Rejected requests change nothing; dead and hung peers fail transfers in bounded time;
tokens are enforced; backends fail over."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from _peer import PeerProcess, SharedBuffer

from mori.core import tcp as _tcp
from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TransferStatus,
)
from mori.io import backends as io_backends
from mori.io.backends import Backend, Outcome


@pytest.fixture()
def local(initiator):
    arr = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    desc = initiator.register_memory(int(arr.ctypes.data), arr.size, -1, MemoryLocationType.CPU)
    yield arr, desc
    initiator.deregister_memory(desc)


def _wait(st: TransferStatus) -> TransferStatus:
    assert st.WaitFor(30_000) != StatusCode.IN_PROGRESS, "transfer did not finish"
    return st


def _unchanged(buf: SharedBuffer, fn) -> None:
    buf.array[:] = np.random.default_rng(2).integers(0, 256, buf.size, dtype=np.uint8)
    before = buf.array.copy()
    fn()
    assert np.array_equal(buf.array, before), "the target region was modified"


def test_out_of_range_rejected_locally_and_by_target(initiator, target, remote_region, local):
    buf, rdesc = remote_region
    arr, ldesc = local

    def attempt():
        st = _wait(initiator.write(ldesc, 0, rdesc, rdesc.size - 10, 11, initiator.allocate_transfer_uid()))
        assert st.Failed() and st.Code() == StatusCode.ERR_INVALID_ARGS, st
        st = _wait(initiator.write(ldesc, arr.size - 1, rdesc, 0, 2, initiator.allocate_transfer_uid()))
        assert st.Code() == StatusCode.ERR_INVALID_ARGS and "local memory" in st.Message()
        # A forged descriptor claiming a bigger region: only the target can catch it.
        forged = dataclasses.replace(rdesc, size=rdesc.size * 2)
        st = _wait(
            initiator.batch_write(
                ldesc, [0, 0], forged, [rdesc.size - 8, rdesc.size], [16, 16], initiator.allocate_transfer_uid()
            )
        )
        assert st.Code() == StatusCode.ERR_INVALID_ARGS and "out of range" in st.Message(), st
        st = _wait(initiator.read(ldesc, 0, forged, rdesc.size + 8, 8, initiator.allocate_transfer_uid()))
        assert st.Code() == StatusCode.ERR_INVALID_ARGS, st

    _unchanged(buf, attempt)
    with pytest.raises(ValueError, match="batch lengths differ"):
        initiator.batch_write(ldesc, [0], rdesc, [0, 1], [1], 1)
    with pytest.raises(TypeError):
        initiator.write("not a desc", 0, rdesc, 0, 1, 1)


def test_unknown_and_deregistered_memory(initiator, target, remote_region, local):
    buf, rdesc = remote_region
    _, ldesc = local
    extra = SharedBuffer(1 << 16)
    try:
        edesc = MemoryDesc.unpack(target.call("register_shm", extra.path, extra.size))
        target.call("deregister", edesc.id)

        def attempt():
            for bad in (edesc, dataclasses.replace(rdesc, id=987654)):
                st = _wait(initiator.write(ldesc, 0, bad, 0, 1024, initiator.allocate_transfer_uid()))
                assert st.Code() == StatusCode.ERR_NOT_FOUND and "not registered" in st.Message(), st

        extra.array[:] = 7
        _unchanged(buf, attempt)
        assert (extra.array == 7).all()
    finally:
        extra.unlink()


def test_target_serves_unregistered_initiators(initiator, target, remote_region, local):
    """As in MORI, registration is the initiator's step: a target serves an engine it never
    registered (or deregistered), checks its requests against its memory as for any engine, and
    keeps inbound records for it."""
    buf, rdesc = remote_region
    arr, ldesc = local
    assert _wait(initiator.write(ldesc, 0, rdesc, 0, 8, initiator.allocate_transfer_uid())).Succeeded()
    target.call("deregister_engine", initiator.get_engine_desc().pack())
    try:
        uid = initiator.allocate_transfer_uid()
        assert _wait(initiator.batch_write(ldesc, [0, 64], rdesc, [128, 192], [64, 64], uid)).Succeeded()
        assert (buf.array[128:256] == arr[:128]).all()
        assert target.call("pop_inbound", initiator.key, uid, 10) == StatusCode.SUCCESS
    finally:
        target.call("register_engine", initiator.get_engine_desc().pack())
    with IOEngine("stranger", IOEngineConfig()) as stranger:
        stranger.create_backend(BackendType.TCP)
        stranger.register_remote_engine(target.desc)
        src = np.arange(256, dtype=np.uint8)
        sd = stranger.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        assert stranger.lookup_remote_memory(target.desc.key, rdesc.id) == rdesc
        assert _wait(stranger.write(sd, 0, rdesc, 4096, 256, 7)).Succeeded()
        assert (buf.array[4096:4352] == src).all()
        assert target.call("pop_inbound", "stranger", 7, 10) == StatusCode.SUCCESS
        src[:] = 0
        assert _wait(stranger.read(sd, 0, rdesc, 4096, 256, 8)).Succeeded()
        assert (src == np.arange(256, dtype=np.uint8)).all()
        assert target.call("pop_inbound", "stranger", 8, 10) == StatusCode.SUCCESS
        # Its requests are checked against the target's memory like anyone's (a forged size
        # passes the initiator's own check and is refused by the target).
        forged = dataclasses.replace(rdesc, size=rdesc.size * 2)
        _unchanged(
            buf, lambda: _check_code(stranger.write(sd, 0, forged, rdesc.size - 8, 16, 9), StatusCode.ERR_INVALID_ARGS)
        )
        _unchanged(
            buf,
            lambda: _check_code(
                stranger.write(sd, 0, dataclasses.replace(rdesc, id=987654), 0, 16, 10), StatusCode.ERR_NOT_FOUND
            ),
        )
        assert target.call("pop_inbound", "stranger", 9, 10) == StatusCode.ERR_INVALID_ARGS
    # Locally unregistered remote engine: refused before any I/O.
    st = initiator.write(ldesc, 0, dataclasses.replace(rdesc, engine_key="nobody"), 0, 1, 1)
    assert st.Code() == StatusCode.ERR_NOT_FOUND


def _check_code(st: TransferStatus, code: StatusCode) -> None:
    assert _wait(st).Code() == code, st


def test_wrong_token_rejected(monkeypatch):
    buf = SharedBuffer(1 << 16)
    peer = PeerProcess("guarded", token="s3cret")
    try:
        rdesc = MemoryDesc.unpack(peer.call("register_shm", buf.path, buf.size))
        for token, ok in (("wrong", False), ("", False), ("s3cret", True)):
            # The target never registers these engines: the token alone decides.
            with IOEngine(f"client-{token or 'none'}", IOEngineConfig(auth_token=token)) as eng:
                eng.create_backend(BackendType.TCP)
                eng.register_remote_engine(peer.desc)
                arr = np.full(256, 9, dtype=np.uint8)
                ld = eng.register_memory(int(arr.ctypes.data), arr.size, -1, MemoryLocationType.CPU)
                buf.array[:] = 0
                st = _wait(eng.write(ld, 0, rdesc, 0, 256, 1))
                assert st.Succeeded() == ok, st
                if not ok:
                    assert "rejected" in st.Message() and not buf.array.any()
                else:
                    assert (buf.array[:256] == 9).all()
        # The data plane enforces the token on its own too, and the ticket its control plane
        # issued to the key the connection claims.
        port = _tcp.Target("127.0.0.1", 0, "s3cret", 5.0)
        port.issue_ticket("x", "ticket-x")
        for key, token in (("x", "nope"), ("y", "s3cret")):
            with pytest.raises(RuntimeError, match="rejected: auth token or data-plane ticket"):
                _tcp.Peer("t", "127.0.0.1", port.port, 1, key, token, "ticket-x", 5.0)
        _tcp.Peer("t", "127.0.0.1", port.port, 1, "x", "s3cret", "ticket-x", 5.0).close()
        port.close()
    finally:
        peer.close()
        buf.unlink()


def test_peer_killed_mid_batch_fails_in_time(initiator):
    peer = PeerProcess("doomed")
    buf = SharedBuffer(64 << 20)
    try:
        peer.call("register_engine", initiator.get_engine_desc().pack())
        initiator.register_remote_engine(peer.desc)
        rdesc = MemoryDesc.unpack(peer.call("register_shm", buf.path, buf.size))
        src = np.random.default_rng(3).integers(0, 256, 64 << 20, dtype=np.uint8)
        ld = initiator.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        assert _wait(initiator.write(ld, 0, rdesc, 0, 4096, initiator.allocate_transfer_uid())).Succeeded()
        peer.stop()  # the batch below cannot finish before the kill
        offs = [i * 16384 for i in range(4096)]
        st = initiator.batch_write(ld, offs, rdesc, offs, [16384] * 4096, initiator.allocate_transfer_uid())
        time.sleep(0.3)
        assert st.InProgress()
        t0 = time.monotonic()
        peer.kill()
        assert st.WaitFor(35_000) != StatusCode.IN_PROGRESS, "no failure within MORI_IO_TIMEOUT after the peer died"
        assert st.Failed() and st.Code() == StatusCode.ERR_BAD_STATE, st
        assert time.monotonic() - t0 < 30
        # The next transfer to the dead engine fails too (reconnect refused), without hanging.
        st2 = _wait(initiator.write(ld, 0, rdesc, 0, 8, initiator.allocate_transfer_uid()))
        assert st2.Failed()
        initiator.deregister_memory(ld)
    finally:
        peer.kill()
        buf.unlink()
        initiator.deregister_remote_engine(peer.desc)


def test_hung_peer_times_out(monkeypatch):
    monkeypatch.setenv("MORI_IO_TIMEOUT", "2")
    peer = PeerProcess("frozen")
    buf = SharedBuffer(1 << 20)
    try:
        with IOEngine("impatient", IOEngineConfig()) as eng:
            eng.create_backend(BackendType.TCP)
            peer.call("register_engine", eng.get_engine_desc().pack())
            eng.register_remote_engine(peer.desc)
            rdesc = MemoryDesc.unpack(peer.call("register_shm", buf.path, buf.size))
            arr = np.ones(1 << 20, dtype=np.uint8)
            ld = eng.register_memory(int(arr.ctypes.data), arr.size, -1, MemoryLocationType.CPU)
            assert _wait(eng.read(ld, 0, rdesc, 0, 1024, 1)).Succeeded()
            peer.stop()
            t0 = time.monotonic()
            st = eng.read(ld, 0, rdesc, 0, 1024, 2)
            assert st.WaitFor(10_000) != StatusCode.IN_PROGRESS
            elapsed = time.monotonic() - t0
            assert st.Failed() and "MORI_IO_TIMEOUT" in st.Message(), st
            assert 1.5 < elapsed < 8, elapsed
    finally:
        peer.kill()
        buf.unlink()


def test_rdma_backend_refused_clearly():
    with IOEngine("nordma", IOEngineConfig()) as eng, pytest.raises(RuntimeError, match="RDMA"):
        eng.create_backend(BackendType.RDMA)


class _Flaky(Backend):
    """A backend that can serve CPU memory, outranks TCP, and breaks on its first transfer."""

    kind = BackendType.RDMA
    priority = 100

    def __init__(self, ctx, config):
        super().__init__(ctx, config)
        self.broken = False
        self.used = 0

    def can_serve(self, local, remote):
        return True

    def healthy(self, remote_key):
        return not self.broken

    def register_memory(self, desc):
        return desc

    def deregister_memory(self, desc):
        pass

    def register_remote_engine(self, desc):
        pass

    def deregister_remote_engine(self, desc):
        pass

    def submit(self, request):
        self.used += 1
        self.broken = True
        return Outcome(StatusCode.ERR_BAD_STATE, "flaky link went down")

    def close(self):
        pass


def test_failover_to_another_backend(initiator, target, remote_region, local, monkeypatch):
    buf, rdesc = remote_region
    arr, ldesc = local
    monkeypatch.setitem(io_backends._FACTORIES, BackendType.RDMA, lambda: _Flaky)
    initiator.create_backend(BackendType.RDMA)
    try:
        flaky = initiator._backends[BackendType.RDMA]
        st = _wait(initiator.write(ldesc, 0, rdesc, 0, 512, initiator.allocate_transfer_uid()))
        assert st.Failed() and "flaky" in st.Message()
        st = _wait(initiator.write(ldesc, 0, rdesc, 0, 512, initiator.allocate_transfer_uid()))
        assert st.Succeeded(), st
        assert flaky.used == 1 and np.array_equal(buf.array[:512], arr[:512])
    finally:
        initiator.remove_backend(BackendType.RDMA)
